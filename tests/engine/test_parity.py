"""Parity of the offload engine against plain PyTorch + torch.optim.AdamW.

10 optimizer steps (20 micro-batches with gradient accumulation 2), clipping at 1.0.
fp32: relative loss error < 1e-5 and norm-relative parameter error < 1e-5.
bf16: compared with the fp32 reference; stated tolerance 3e-2 on both (bf16 has an
8-bit mantissa: ~4e-3 relative rounding per operation, compounded over 10 steps).
"""
import itertools

import pytest
import torch

import infinity

HOMES = ("none", "cpu", "nvme")
FULL = [(k, p, o, prec) for k in ("mlp", "lm") for p, o in itertools.product(HOMES, HOMES)
        for prec in ("fp32", "bf16")]
DEFAULT = [("mlp", "none", "none", "fp32"), ("mlp", "cpu", "cpu", "fp32"),
           ("mlp", "nvme", "nvme", "fp32"), ("lm", "nvme", "cpu", "fp32"),
           ("mlp", "nvme", "nvme", "bf16"),
           ("lm", "nvme", "nvme", "bf16")]
SLOW = [c for c in FULL if c not in DEFAULT]


def _run(harness, swap_dir, kind, params, optim, prec, accum=2, steps=10):
    torch.manual_seed(0)
    ref = harness.MLPStack() if kind == "mlp" else harness.TinyCausalLM()
    model = harness.copy(ref)
    batches = harness.make_batches(kind, steps * accum)
    ref_losses = harness.reference_run(ref, kind, batches, accum=accum, clip=1.0)
    cfg = {"precision": prec,
           "offload": {"params": params, "optimizer": optim, "nvme_paths": [swap_dir]},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
           "gradient_accumulation_steps": accum, "gradient_clipping": 1.0}
    with infinity.initialize(model, cfg) as eng:
        losses = harness.engine_run(eng, kind, batches)
        perr = harness.param_rel_err(ref, eng)
        stats = eng.stats()
    return harness.rel_err(losses, ref_losses), perr, stats


def _check(harness, swap_dir, kind, params, optim, prec):
    lerr, perr, stats = _run(harness, swap_dir, kind, params, optim, prec)
    tol = 1e-5 if prec == "fp32" else 3e-2
    assert lerr < tol, f"loss rel err {lerr:.3g}"
    assert perr < tol, f"param rel err {perr:.3g}"
    assert stats["step"] == 10
    if params == "nvme":
        assert stats["nvme_read_bytes"] > 0


@pytest.mark.parametrize("kind,params,optim,prec", DEFAULT)
def test_parity(harness, swap_dir, kind, params, optim, prec):
    _check(harness, swap_dir, kind, params, optim, prec)


@pytest.mark.slow
@pytest.mark.parametrize("kind,params,optim,prec", SLOW)
def test_parity_full_matrix(harness, swap_dir, kind, params, optim, prec):
    _check(harness, swap_dir, kind, params, optim, prec)


def test_parity_detects_a_wrong_update(harness, swap_dir):
    """The comparison can fail: a different learning rate is caught."""
    torch.manual_seed(0)
    ref = harness.MLPStack()
    model = harness.copy(ref)
    batches = harness.make_batches("mlp", 4)
    harness.reference_run(ref, "mlp", batches, accum=2, clip=1.0)
    cfg = {"optimizer": {"lr": 1.1e-2, "weight_decay": 0.1, "no_decay": []},
           "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    with infinity.initialize(model, cfg) as eng:
        harness.engine_run(eng, "mlp", batches)
        assert harness.param_rel_err(ref, eng) > 1e-4
