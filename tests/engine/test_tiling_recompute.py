"""Note [Recompute keeps its tiles] (infinity/runtime/tiling.py): with activation
checkpointing a tiled layer's recompute keeps the tiles it read for the backward that
follows, so a checkpointed tiled layer is read from NVMe twice per micro-batch (forward,
recompute), not three times -- and trains exactly like plain PyTorch."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity


class Ckpt(nn.Module):
    """Two tiled layers (a Linear with bias, a bias-free one) inside one checkpointed
    segment, a small head outside it."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(40, 40)                # (the segment's input needs a gradient)
        self.a = nn.Linear(40, 300)                 # 12 300 floats: tiled under 40 kB
        self.b = nn.Linear(300, 64, bias=False)     # 19 200 floats: tiled
        self.c = nn.Linear(64, 8)

    def seg(self, x):
        return F.gelu(self.b(F.gelu(self.a(x))))

    def forward(self, x):
        return self.c(checkpoint(self.seg, self.pre(x), use_reentrant=False))


def _cfg(swap, keep=True):
    return {"offload": {"params": "nvme", "optimizer": "cpu", "nvme_paths": [swap]},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
            "tiling": {"max_group_gb": 40e3 / 1e9}}


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 40, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def _run(model, swap, budget=None):
    reads, losses = [], []
    with infinity.initialize(model, _cfg(swap)) as e:
        assert e.tiling is not None and len(e.tiling.specs) == 2
        e.tiling.keep_budget = budget
        for x, y in _batches(4):
            r0 = e.stats()["nvme_read_bytes"]
            loss = F.mse_loss(e(x), y)
            losses.append(loss.item())
            e.backward(loss)
            e.step()
            reads.append(e.stats()["nvme_read_bytes"] - r0)
        st = e.stats()
        sd = {k: v.clone() for k, v in e.state_dict().items()}
    return losses, reads, st, sd


def test_the_backward_reads_no_tile_the_recompute_read(tmp_path):
    torch.manual_seed(0)
    m = Ckpt()
    ref = copy.deepcopy(m)
    losses, reads, st, sd = _run(copy.deepcopy(m), str(tmp_path / "keep"))
    losses0, reads0, st0, sd0 = _run(copy.deepcopy(m), str(tmp_path / "none"), budget=0)
    # every tile of both layers kept once per micro-batch and used by the backward
    assert st["tiles_reused_from_recompute"] == st["tiles_kept_for_backward"] > 0
    assert st0.get("tiles_reused_from_recompute", 0) == 0
    # the tiled groups' bytes (fp32) are read once less per micro-batch: what the backward
    # took from the kept copies, up to the 4096-byte alignment of each tile's read
    tiled = (40 * 300 + 300 + 300 * 64) * 4
    assert st["tile_reread_bytes_saved"] == 4 * tiled
    n_tiles = st["tiles_reused_from_recompute"] // 4
    for a, b in zip(reads, reads0):
        assert tiled <= b - a <= tiled + 2 * 4096 * n_tiles, (reads, reads0)
    # the same training as without keeping, and as plain PyTorch + AdamW
    assert losses == losses0
    assert all(torch.equal(sd[k], sd0[k]) for k in sd)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    want = []
    for x, y in _batches(4):
        loss = F.mse_loss(ref(x), y)
        want.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses == pytest.approx(want, rel=1e-5)
    num = sum(float((sd[k].double() - v.double()).pow(2).sum()) for k, v in ref.state_dict().items())
    den = sum(float(v.double().pow(2).sum()) for v in ref.state_dict().values())
    assert (num / den) ** 0.5 < 1e-5         # norm-relative, as the parity tests compare


def test_a_budget_bounds_the_kept_tiles(tmp_path):
    """Under a budget of one tile's bytes only what fits is kept; the rest is read again,
    and training is unchanged."""
    torch.manual_seed(0)
    m = Ckpt()
    losses, reads, st, sd = _run(copy.deepcopy(m), str(tmp_path / "b"), budget=20_000)
    losses0, reads0, _, sd0 = _run(copy.deepcopy(m), str(tmp_path / "n"), budget=0)
    assert 0 < st["tiles_reused_from_recompute"]
    assert losses == losses0 and all(torch.equal(sd[k], sd0[k]) for k in sd)
    assert reads[-1] < reads0[-1]
