"""Model, data and loop shared by the new-process resume test (and run as its child).

usage (child): python resume_child.py CKPT OFFLOAD SWAP_DIR
Loads CKPT/latest through engine.load_checkpoint, trains 3 steps, saves tag "end"
into CKPT, prints the losses as JSON on stdout.
"""
import json
import sys

import torch
from torch import nn


def model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.LayerNorm(33), nn.Linear(33, 4))


def data(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def config(offload, swap_dir, precision="fp32", state_dtype="fp32"):
    return {"precision": precision,
            "offload": {"params": offload, "optimizer": offload, "nvme_paths": [swap_dir]},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "state_dtype": state_dtype},
            "scheduler": {"type": "cosine", "warmup_steps": 2, "total_steps": 6}}


def train(engine, steps, start):
    losses = []
    for i in range(start, start + steps):
        x, y = data(i)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main():
    import infinity
    ckpt, offload, swap = sys.argv[1], sys.argv[2], sys.argv[3]
    with infinity.initialize(model(777), config(offload, swap)) as e:
        meta = e.load_checkpoint(ckpt)
        losses = train(e, 3, meta["step"])
        e.save_checkpoint(ckpt, tag="end")
    print(json.dumps(losses))


if __name__ == "__main__":
    main()
