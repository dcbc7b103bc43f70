"""Shard arithmetic and local (world size 1) collectives."""
import pytest
import torch

from infinity.zero.comm import Comm
from infinity.zero.partition import Partition, clip_segments, pad_numel


@pytest.mark.parametrize("numel", [1, 7, 4095, 4097])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_pad_and_ranges_cover_everything_once(numel, world):
    padded = pad_numel(numel, world, 1024)
    assert padded >= numel and padded % (world * 1024) == 0
    seen = torch.zeros(padded, dtype=torch.int32)
    for r in range(world):
        lo, hi = Partition(r, world).range(padded)
        assert (hi - lo) % 1024 == 0
        seen[lo:hi] += 1
    assert bool((seen == 1).all())


def test_clip_segments_rebases_and_checks_coverage():
    segs = [(0, 5, 0.1, 0.0), (5, 10, 0.2, 0.01), (15, 17, 0.0, 0.0)]
    assert clip_segments(segs, 8, 16) == [(0, 7, 0.2, 0.01), (7, 1, 0.0, 0.0)]
    assert clip_segments(segs, 0, 4) == [(0, 4, 0.1, 0.0)]
    with pytest.raises(ValueError, match="cover"):
        clip_segments([(0, 5, 0.1, 0.0)], 4, 8)


def test_partition_rejects_bad_input():
    with pytest.raises(ValueError, match="rank 2"):
        Partition(2, 2)
    with pytest.raises(ValueError, match="evenly"):
        Partition(0, 2).shard_numel(7)


def test_comm_needs_a_process_group():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="process group"):
        Comm()



# ------------------------------------------------------------------ the backends facade
def test_backend_map_and_what_to_create():
    from infinity.zero.comm import check_backends
    cpu, c0 = torch.device("cpu"), torch.device("cuda", 0)
    both = {"cpu": "gloo", "cuda": "nccl"}
    check_backends(both, c0, 8)                         # what infinity creates on GPUs
    check_backends({"cpu": "gloo", "cuda": "gloo"}, cpu, 2)
    with pytest.raises(RuntimeError, match=r"no backend for cpu tensors.*"
                                           r"init_process_group\('cpu:gloo,cuda:nccl'\)"):
        check_backends({"cuda": "nccl"}, c0, 8)         # a plain NCCL group: no host side
    with pytest.raises(RuntimeError, match=r"no backend for cpu tensors.*'gloo'"):
        check_backends({"cuda": "nccl"}, cpu, 2)


def test_backend_parsing(monkeypatch):
    import torch.distributed as dist
    from infinity.zero import comm
    for cfg, want in [("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
                      ("nccl", {"cuda": "nccl"}), ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
                      ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"})]:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=cfg: c)
        assert comm.backend_map() == want, cfg


def test_rank_share_of_the_plan_includes_the_commit_shadows():
    """Each rank writes shadows only for the state tensors of its own shard (Note [commit
    point]): the per-rank plan holds 1/W of them, like the optimizer states."""
    import torch
    from torch import nn
    from types import SimpleNamespace
    from infinity.memory.plan import PlacementPlan
    from infinity.memory.record import GroupRecord, ParamSlot
    from infinity.zero.distributed import partition_placement
    groups = []
    for i in range(3):
        p = nn.Parameter(torch.zeros(4096))
        groups.append(GroupRecord(i, f"g{i}", [ParamSlot(f"w{i}", p, 0, 4096, p.shape, True)],
                                  4096, 4096, torch.float32, "nvme"))
    whole = PlacementPlan("fp32", "nvme", "nvme", 2, groups, None, None).compute(1)
    for stage in (1, 2, 3):
        pl = PlacementPlan("fp32", "nvme", "nvme", 2, groups, None, None).compute(1)
        partition_placement(pl, SimpleNamespace(world_size=4, stage=stage, spill=False))
        key = "commit shadows (all-or-nothing updates)"
        assert pl.nvme[key] == -(-whole.nvme[key] // 4)
