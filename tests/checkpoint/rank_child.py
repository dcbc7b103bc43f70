"""One gloo rank for the multi-rank checkpoint test.

usage: python rank_child.py RANK WORLD INIT_FILE ROOT
Each rank owns a contiguous flat partition of every tensor (ZeRO-3 style) and
saves only that; rank 0 writes the manifest.
"""
import sys

import torch
import torch.distributed as dist

from infinity.checkpoint import Piece, save_checkpoint


def full_tensors():
    g = torch.Generator().manual_seed(42)
    return {"w": torch.randn(10, 7, generator=g), "b": torch.randn(5, generator=g),
            "e": torch.empty(0, 3), "optim.w.exp_avg": torch.randn(10, 7, generator=g)}


def partition(numel, rank, world):
    per = -(-numel // world)
    lo = min(numel, rank * per)
    return lo, min(numel, lo + per)


class RankState:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def checkpoint_tensors(self):
        for name, t in full_tensors().items():
            lo, hi = partition(t.numel(), self.rank, self.world)
            yield name, t.reshape(-1)[lo:hi].clone(), Piece(t.shape, lo)

    def checkpoint_meta(self):
        return {"step": 4, "world_size": self.world}


def main():
    rank, world, init, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        h = save_checkpoint(RankState(rank, world), root, shard_bytes=100)
        dist.barrier()
        print(h.path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
