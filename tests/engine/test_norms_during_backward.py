"""The gradient norm taken while backward runs (Note [Norms during backward] in
infinity/engine/overlap.py): when no group is stepped early -- the previous update was
clipped, speculation stopped part-way, or commit_shadow_gb is 0 -- each group's squared
norm is computed as soon as its gradient is final, and the boundary step does not read
the buffers again.  The same values as the boundary's own norm: bit-identical parameters
to the engine with the overlap switched off, on one process's host tier and on a separate
(simulated) device where a gradient is final when its D2H copy landed; against plain
PyTorch AdamW with clip_grad_norm_ in fp32.
"""
import pytest
import torch

import infinity


def _cfg(swap_dir, params, optim, prec, clip, shadow=None):
    off = {"params": params, "optimizer": optim, "nvme_paths": [swap_dir]}
    if shadow is not None:
        off["commit_shadow_gb"] = shadow
    return {"precision": prec, "offload": off,
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
            "gradient_accumulation_steps": 2, "gradient_clipping": clip}


def _run(harness, swap_dir, *, kind="mlp", params="cpu", optim="cpu", prec="fp32",
         clip=0.05, overlap=True, steps=4, shadow=None):
    torch.manual_seed(0)
    ref = harness.MLPStack() if kind == "mlp" else harness.TinyCausalLM()
    model = harness.copy(ref)
    batches = harness.make_batches(kind, steps * 2)
    ref_losses = harness.reference_run(ref, kind, batches, accum=2, clip=clip)
    with infinity.initialize(model, _cfg(swap_dir, params, optim, prec, clip, shadow)) as eng:
        eng.overlap_optimizer_step = overlap
        losses = harness.engine_run(eng, kind, batches)
        perr = harness.param_rel_err(ref, eng)
        sd = {k: v.clone() for k, v in eng.state_dict().items()}
        st = eng.stats()
        n = len(eng.opt.groups)
        dev = eng.mm.dev.kind
    return dict(losses=losses, lerr=harness.rel_err(losses, ref_losses), perr=perr, sd=sd,
                stats=st, n=n, dev=dev)


def _same(a, b):
    assert a["losses"] == b["losses"]
    assert a["sd"].keys() == b["sd"].keys()
    for k in a["sd"]:
        assert torch.equal(a["sd"][k], b["sd"][k]), k


@pytest.mark.parametrize("simulated", [False, True], ids=["host", "simulated-device"])
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_norms_during_backward_when_every_update_clips(harness, swap_dir, monkeypatch,
                                                       simulated, prec):
    if simulated:
        monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    on = _run(harness, swap_dir, prec=prec)
    off = _run(harness, swap_dir, prec=prec, overlap=False)
    assert on["dev"] == ("simulated" if simulated else "cpu")
    st = on["stats"]
    # step 1 speculates and stops at the first group that crosses the clip (the rest get
    # their norms during backward); steps 2-4 skip speculation (the last update clipped):
    # every group's norm is taken during backward
    assert st.get("optimizer_speculation_stopped", 0) == 1
    assert st["optimizer_speculation_skipped"] == 3
    assert st["optimizer_norms_during_backward"] >= 3 * on["n"]
    assert off["stats"].get("optimizer_norms_during_backward", 0) == 0
    _same(on, off)
    if prec == "fp32":
        assert on["lerr"] < 1e-5 and on["perr"] < 1e-5, (on["lerr"], on["perr"])


def test_tied_weights_norm_at_the_boundary(harness, swap_dir):
    """The tied embedding / LM head is used twice per forward: its gradient is not final
    when its first use's gradient arrives, so its norm is left to the boundary."""
    on = _run(harness, swap_dir, kind="lm")
    off = _run(harness, swap_dir, kind="lm", overlap=False)
    _same(on, off)
    assert on["lerr"] < 1e-5 and on["perr"] < 1e-5
    # steps 2-4: every group but the tied one
    assert 3 * (on["n"] - 1) <= on["stats"]["optimizer_norms_during_backward"] \
        < 4 * on["n"]


def test_no_speculation_budget_takes_norms_during_backward(harness, swap_dir):
    """offload.commit_shadow_gb 0 (nothing stepped early) with optimizer states on NVMe:
    norms during backward from the first step, the same update."""
    on = _run(harness, swap_dir, params="nvme", optim="nvme", shadow=0)
    off = _run(harness, swap_dir, params="nvme", optim="nvme", shadow=0, overlap=False)
    _same(on, off)
    assert on["stats"].get("optimizer_groups_overlapped", 0) == 0
    assert on["stats"]["optimizer_norms_during_backward"] == 4 * on["n"]
