"""engine.stats() NVMe byte counters against the bytes the SwapSpace actually moved.

Every SwapSpace.write/read issued during training is counted here (the tensor's
byte length, which is what the I/O engine transfers) and compared with the engine's
``nvme_write_bytes``/``nvme_read_bytes`` deltas.  bf16 with NVMe params is the case
where the optimizer writes the updated bf16 params back through ``param_sink``.
"""
import pytest
import torch

import infinity
from infinity.io.swap import SwapSpace


@pytest.fixture
def io_counter(monkeypatch):
    moved = {"write": 0, "read": 0}
    orig_w, orig_r = SwapSpace.write, SwapSpace.read

    def write(self, extent, tensor, offset=0):
        moved["write"] += tensor.numel() * tensor.element_size()
        return orig_w(self, extent, tensor, offset)

    def read(self, extent, tensor, offset=0):
        moved["read"] += tensor.numel() * tensor.element_size()
        return orig_r(self, extent, tensor, offset)

    monkeypatch.setattr(SwapSpace, "write", write)
    monkeypatch.setattr(SwapSpace, "read", read)
    return moved


@pytest.mark.parametrize("precision,optimizer", [("bf16", "nvme"), ("bf16", "cpu"),
                                                 ("fp32", "nvme")])
def test_stats_nvme_bytes_match_bytes_moved(swap_dir, harness, io_counter, precision, optimizer):
    model = harness.MLPStack()
    cfg = {"precision": precision, "gradient_accumulation_steps": 2,
           "offload": {"params": "nvme", "optimizer": optimizer, "nvme_paths": [swap_dir]}}
    g = torch.Generator().manual_seed(0)
    with infinity.initialize(model, cfg) as eng:
        s0 = eng.stats()
        w0, r0 = io_counter["write"], io_counter["read"]
        for _ in range(4):
            out = eng(torch.randn(8, 16, generator=g))
            eng.backward(out.float().pow(2).mean())
            eng.step()
        s1 = eng.stats()
        wrote = io_counter["write"] - w0
        read = io_counter["read"] - r0
    assert wrote > 0 and read > 0
    assert s1["nvme_write_bytes"] - s0["nvme_write_bytes"] == wrote
    assert s1["nvme_read_bytes"] - s0["nvme_read_bytes"] == read


def test_stats_nvme_tier_bytes_are_the_swap_extents(swap_dir, harness):
    """nvme_bytes / nvme_peak_bytes are the extents the SwapSpace allocated: at least the
    params (fp32 here) plus two fp32 optimizer states per element, and 0 again after close."""
    model = harness.MLPStack()
    numel = sum(p.numel() for p in model.parameters())
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir]}}
    eng = infinity.initialize(model, cfg)
    out = eng(torch.randn(8, 16))
    eng.backward(out.float().pow(2).mean())
    eng.step()
    s = eng.stats()
    eng.close()
    assert s["nvme_bytes"] >= numel * 4 * 3, (s["nvme_bytes"], numel)
    assert s["nvme_peak_bytes"] >= s["nvme_bytes"]
    assert eng.acct.current["nvme"] == 0          # every extent freed at close
