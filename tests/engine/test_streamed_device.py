"""Streamed gradients on a separate device tier at world size 1 (Note [Streamed gradients]
in infinity/engine/overlap.py; the simulated device, INFINITY_SIMULATE_DEVICE=1): a
group's gradient is final when its D2H copy landed in the host accumulation
(``GradD2H.landed``), and with the fp32 gradients homed on NVMe (the host cap squeezed)
its final sum is stepped from memory, never written to NVMe nor read back.

Against plain PyTorch AdamW (fp32, < 1e-5) or the same engine stepping at the boundary
(bf16, bit-identical), with and without clipping; per step after the first (no prefetch
trace yet) every group is stepped early and the NVMe bytes are those of the plan
(writes: ``PlacementPlan.links``), a gradient round trip less than the boundary step.
"""
import os
import sys

import pytest
import torch

import infinity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_streamed_step import _cfg, _data, _model, _reference, _rel, _train  # noqa: E402

# the cap: the separate device's H2D / D2H staging, two staging buffers, the optimizer's
# tile ring and the streamed window fit, one fp32 gradient accumulator more does not
CAP_GB = {("nvme", "fp32"): 0.006, ("cpu", "bf16"): 0.0055}


@pytest.fixture(autouse=True)
def _simulated_device(monkeypatch):
    monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")


def _run(swap_dir, params, prec, data, clip=0.0, overlap=True):
    torch.manual_seed(0)
    model = _model()
    with infinity.initialize(model, _cfg(swap_dir, params, clip=clip, prec=prec,
                                         cap=CAP_GB[params, prec])) as eng:
        assert eng.mm.dev.kind == "simulated" and not eng.mm.dev.zero_copy
        eng.overlap_optimizer_step = overlap
        plan = eng.placement
        assert plan.grad_home == "nvme" and not plan.grad_host_gids, \
            "the cap is meant to leave every gradient on NVMe"
        assert plan.stream_window > 0
        losses, per = _train(eng, data)
        sd = {k: v.clone() for k, v in eng.state_dict().items()}
        numel = sum(g.padded_numel for g in eng.opt.groups)
        n = len(eng.opt.groups)
    return dict(losses=losses, per=per, sd=sd, plan=plan, numel=numel, n=n)


@pytest.mark.parametrize("params,prec,clip", [("nvme", "fp32", 0.0), ("cpu", "bf16", 0.0),
                                              ("nvme", "fp32", 1e4)])
def test_streamed_on_a_separate_device(swap_dir, params, prec, clip):
    data = _data(5)
    on = _run(swap_dir, params, prec, data, clip)
    off = _run(swap_dir, params, prec, data, clip, overlap=False)
    if prec == "fp32":
        ref = _model()
        ref_l, _ = _reference(ref, data, clip)
        ref_sd = {k: v.detach() for k, v in ref.named_parameters()}
    else:
        assert on["losses"] == off["losses"]
        ref_l, ref_sd = off["losses"], off["sd"]
    num = sum(float((on["sd"][k].double() - v.double()).norm() ** 2) for k, v in ref_sd.items())
    den = sum(float(v.double().norm() ** 2) for v in ref_sd.values())
    assert _rel(on["losses"], ref_l) < 1e-5 and (num / den) ** 0.5 < 1e-5
    for a, b in zip(on["per"][1:], off["per"][1:]):
        assert a["optimizer_groups_overlapped"] == on["n"], a
        assert b["optimizer_groups_overlapped"] == 0, b
        # a separate device hands no master off (the released buffer is device memory)
        assert a.get("optimizer_master_handoffs", 0) == 0
        assert b["nvme_read_bytes"] - a["nvme_read_bytes"] == 4 * on["numel"]
        # fp32 moments: a clip that does not bind writes nothing for a redo
        assert b["nvme_write_bytes"] - a["nvme_write_bytes"] == 4 * on["numel"]
        # (reads: the plan re-fetches every group in backward, the groups still resident
        # from forward are not read again)
        assert a["nvme_write_bytes"] == on["plan"].links["nvme_write"], (a, on["plan"].links)


def test_streamed_on_a_separate_device_clip_binding(swap_dir):
    """A clip that binds on some steps, speculating in every window: the speculative early
    steps are redone clipped (from the moments), at parity."""
    data = _data(5)
    _, norms = _reference(_model(), data, 0.0)
    clip = sorted(norms)[len(norms) // 2] * 0.99
    torch.manual_seed(0)
    model = _model()
    with infinity.initialize(model, _cfg(swap_dir, "nvme", clip=clip, prec="fp32",
                                         cap=CAP_GB["nvme", "fp32"])) as eng:
        eng.overlap.predict = False        # speculate in every window: redos happen
        losses, per = _train(eng, data)
        sd = {k: v.clone() for k, v in eng.state_dict().items()}
    ref = _model()
    ref_l, _ = _reference(ref, data, clip)
    ref_sd = {k: v.detach() for k, v in ref.named_parameters()}
    num = sum(float((sd[k].double() - v.double()).norm() ** 2) for k, v in ref_sd.items())
    den = sum(float(v.double().norm() ** 2) for v in ref_sd.values())
    assert _rel(losses, ref_l) < 1e-5 and (num / den) ** 0.5 < 1e-5
    assert sum(p["optimizer_groups_overlapped"] for p in per) > 0
    assert sum(p.get("optimizer_clip_redos", 0) for p in per) > 0
