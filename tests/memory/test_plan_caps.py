"""A host cap the machine cannot honour is refused at initialize, before anything is allocated."""
import os

import pytest
import torch
from torch import nn

import infinity
from infinity.memory.plan import WorkingSetError, mem_available_bytes


def test_host_cap_larger_than_available_ram_is_refused(tmp_path):
    avail = mem_available_bytes()
    if avail is None:
        pytest.skip("no /proc/meminfo")
    too_big_gb = (avail * 4 + 64e9) / 1e9
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp_path / "swap")],
                       "host_memory_gb": too_big_gb}}
    with pytest.raises(WorkingSetError) as ei:
        infinity.initialize(model, cfg)
    msg = str(ei.value)
    assert "offload.host_memory_gb" in msg and "available" in msg and "lower" in msg
    # nothing lost: the model's weights are untouched, and no swap files remain
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    swap = tmp_path / "swap"
    leftovers = [os.path.join(d, f) for d, _, fs in os.walk(swap) for f in fs] if swap.exists() else []
    assert leftovers == []


def test_host_cap_within_available_ram_is_accepted(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    cfg = {"offload": {"params": "cpu", "optimizer": "cpu", "host_memory_gb": 0.5}}
    with infinity.initialize(model, cfg) as eng:
        loss = eng(torch.randn(3, 16)).sum()
        eng.backward(loss)
        eng.step()
