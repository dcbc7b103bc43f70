"""Update each group as its gradient arrives when the gradients do not fit the host cap
(Note [Streamed gradients]) and clipping with the overlapped step (Note [Speculative
clipping]), against plain PyTorch ``clip_grad_norm_`` + ``torch.optim.AdamW``.

* streamed: a host cap squeezed so that no fp32 gradient fits (NVMe gradient home); after
  the first step (no prefetch trace yet) every group is stepped during backward from its
  gradient in memory, the NVMe bytes per step are what the plan predicts (no gradient round
  trip), parity < 1e-5 with and without clipping, clip triggering and not;
* speculative clipping with the overlap in host memory: homes cpu / nvme, fp32 at parity,
  bf16 bit-identical to the same engine stepping at the boundary;
* a failure in backward after early (streamed) updates leaves every weight and state as
  after the last completed step, and training goes on at parity.
"""
import math

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import infinity
from injected_failure import boom_function

LR, WD = 1e-3, 0.01


def _data(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 256, generator=g), torch.randn(4, 256, generator=g))
            for _ in range(n)]


class Stack(nn.Module):
    """8 Linear(256, 256): 8 groups of 257 kB fp32 gradients; an optional failure point
    after the first layer (its backward runs after the 7 others')."""

    def __init__(self, boom=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))
        self.boom = boom

    def forward(self, x):
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
            if i == 0 and self.boom is not None:
                x = self.boom.apply(x)
        return x


def _model(boom=None):
    torch.manual_seed(0)
    return Stack(boom)


def _reference(model, data, clip):
    """Per-step losses and global gradient norms of plain PyTorch."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for x, y in data:
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                            clip if clip else math.inf)))
        opt.step()
        opt.zero_grad()
    return losses, norms


# the cap: the optimizer's tile ring, two staging buffers and the streamed window fit, one
# more fp32 gradient accumulator does not (every gradient is homed on NVMe)
CAP_GB = {("cpu", "fp32"): 0.0065, ("nvme", "fp32"): 0.0046, ("cpu", "bf16"): 0.0055}


def _cfg(swap_dir, params="cpu", clip=0.0, prec="fp32", cap=None):
    off = {"params": params, "optimizer": "nvme", "nvme_paths": [swap_dir],
           "host_memory_gb": CAP_GB[params, prec] if cap is None else cap}
    return {"precision": prec, "offload": off, "gradient_clipping": clip,
            "optimizer": {"lr": LR, "weight_decay": WD, "no_decay": []}}


def _train(eng, data, *, stats_per_step=False):
    losses, per_step = [], []
    for x, y in data:
        before = eng.stats()
        loss = F.mse_loss(eng(x), y)
        losses.append(loss.item())
        eng.backward(loss)
        eng.step()
        after = eng.stats()
        per_step.append({k: after.get(k, 0) - before.get(k, 0) for k in after
                         if isinstance(after[k], (int, float))})
    return losses, per_step


def _rel(a, b):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def _streamed(harness, swap_dir, params, prec, data, overlap=True):
    model = harness.copy(_model())
    with infinity.initialize(model, _cfg(swap_dir, params, prec=prec)) as eng:
        eng.overlap_optimizer_step = overlap
        plan = eng.placement
        assert plan.grad_home == "nvme" and not plan.grad_host_gids, \
            "the cap is meant to leave every gradient on NVMe"
        assert plan.stream_grads
        losses, per = _train(eng, data)
        sd = {k: v.clone() for k, v in eng.state_dict().items()}
        n = len(eng.opt.groups)
        numel = sum(g.padded_numel for g in eng.opt.groups)
    return dict(losses=losses, per=per, sd=sd, n=n, plan=plan, numel=numel)


# fp32 with a cpu param home needs host undo copies of the master the squeezed cap cannot
# hold (those groups step at the boundary, Note [commit point]): bf16 there
@pytest.mark.parametrize("params,prec", [("nvme", "fp32"), ("cpu", "bf16")])
def test_streamed_parity_and_no_gradient_round_trip(harness, swap_dir, params, prec):
    data = _data(6)
    r = _streamed(harness, swap_dir, params, prec, data)
    off = _streamed(harness, swap_dir, params, prec, data, overlap=False)
    assert all(p["optimizer_groups_overlapped"] == 0 for p in off["per"])
    if prec == "fp32":
        ref = _model()
        ref_l, _ = _reference(ref, data, 0.0)
        ref_sd = dict(ref.named_parameters())
    else:                # bf16: bit-identical to the same engine stepping at the boundary
        assert r["losses"] == off["losses"]
        for k in r["sd"]:
            assert torch.equal(r["sd"][k], off["sd"][k]), k
        ref_l, ref_sd = off["losses"], off["sd"]
    num = sum(float((r["sd"][k].double() - v.detach().double()).norm() ** 2)
              for k, v in ref_sd.items())
    den = sum(float(v.detach().double().norm() ** 2) for v in ref_sd.values())
    assert _rel(r["losses"], ref_l) < 1e-5 and (num / den) ** 0.5 < 1e-5
    plan = r["plan"]
    for on_step, off_step in zip(r["per"][1:], off["per"][1:]):
        assert on_step["optimizer_groups_overlapped"] == r["n"], on_step
        # no gradient is written or read back: the gradients' round trip less than stepping
        # at the boundary (reads: the fp32 master hand-off saves more, Note [Master hand-off])
        saved = on_step["optimizer_master_read_bytes_saved"]
        assert off_step["nvme_read_bytes"] - on_step["nvme_read_bytes"] - saved == 4 * r["numel"]
        assert off_step["nvme_write_bytes"] - on_step["nvme_write_bytes"] == 4 * r["numel"]
        assert on_step["nvme_write_bytes"] == plan.links["nvme_write"], (on_step, plan.links)


@pytest.mark.parametrize("mode", ["never", "always", "mixed"])
def test_streamed_clip_parity(harness, swap_dir, mode):
    data = _data(8)
    _, norms = _reference(_model(), data, 0.0)
    clip = {"never": 10 * max(norms), "always": 0.5 * min(norms),
            "mixed": sorted(norms)[len(norms) // 2]}[mode]
    ref = _model()
    model = harness.copy(ref)
    ref_l, ref_norms = _reference(ref, data, clip)
    with infinity.initialize(model, _cfg(swap_dir, "nvme", clip=clip)) as eng:
        assert eng.placement.grad_home == "nvme"
        eng.overlap.predict = False          # speculate in every window (redo when clipped)
        losses, per = _train(eng, data)
        perr = harness.param_rel_err(ref, eng)
        st = eng.stats()
    assert _rel(losses, ref_l) < 1e-5 and perr < 1e-5, (_rel(losses, ref_l), perr)
    clipped = sum(1 for nrm in ref_norms[1:] if nrm + 1e-6 > clip)
    if mode == "never":
        assert clipped == 0 and st.get("optimizer_clip_redos", 0) == 0
        assert st["optimizer_groups_overlapped"] >= 7 * len(eng.opt.groups)
    elif mode == "always":
        assert clipped == 7
        # speculation stops once the running norm passes the clip: never every group
        assert st["optimizer_groups_overlapped"] < 7 * len(eng.opt.groups)
        assert st["optimizer_speculation_stopped"] >= 7
    else:
        assert 0 < clipped < 7
        assert st["optimizer_groups_overlapped"] > 0
        # clipped windows: whatever was stepped early is redone (or nothing was stepped)
        assert st.get("optimizer_clip_redos", 0) + st.get("optimizer_speculation_stopped", 0) > 0


def test_clip_predictor_skips_speculation_after_a_clipped_step(harness, swap_dir):
    data = _data(4)
    _, norms = _reference(_model(), data, 0.0)
    clip = 0.5 * min(norms)
    ref = _model()
    model = harness.copy(ref)
    ref_l, _ = _reference(ref, data, clip)
    with infinity.initialize(model, _cfg(swap_dir, "nvme", clip=clip)) as eng:
        losses, per = _train(eng, data)
        perr = harness.param_rel_err(ref, eng)
    assert _rel(losses, ref_l) < 1e-5 and perr < 1e-5
    assert all(p.get("optimizer_speculation_skipped", 0) == 1 for p in per[1:]), per


def _hp_run(harness, swap_dir, params, prec, clip, overlap=True, steps=8, predict=False):
    torch.manual_seed(0)
    ref = harness.MLPStack()
    model = harness.copy(ref)
    batches = harness.make_batches("mlp", steps * 2)
    ref_l = harness.reference_run(ref, "mlp", batches, accum=2, clip=clip)
    cfg = {"precision": prec, "gradient_clipping": clip, "gradient_accumulation_steps": 2,
           "offload": {"params": params, "optimizer": "nvme", "nvme_paths": [swap_dir]},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []}}
    with infinity.initialize(model, cfg) as eng:
        eng.overlap_optimizer_step = overlap
        assert eng.placement.grad_home == "host"
        eng.overlap.predict = predict
        losses = harness.engine_run(eng, "mlp", batches)
        out = dict(lerr=harness.rel_err(losses, ref_l), perr=harness.param_rel_err(ref, eng),
                   losses=losses, stats=eng.stats(),
                   params={k: v.clone() for k, v in eng.state_dict().items()})
    return out


def _mlp_norms(harness, steps=8):
    torch.manual_seed(0)
    ref = harness.MLPStack()
    batches = harness.make_batches("mlp", steps * 2)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for i, b in enumerate(batches):
        (harness.loss_of("mlp", ref(b[0]), b) / 2).backward()
        if i % 2:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf)))
            opt.step()
            opt.zero_grad()
    return norms


@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_overlap_with_clipping_fp32_parity(harness, swap_dir, params):
    norms = _mlp_norms(harness)
    clip = sorted(norms)[len(norms) // 2]       # clips in about half the steps
    r = _hp_run(harness, swap_dir, params, "fp32", clip)
    assert r["lerr"] < 1e-5 and r["perr"] < 1e-5, (r["lerr"], r["perr"])
    st = r["stats"]
    assert st["optimizer_groups_overlapped"] > 0
    assert st.get("optimizer_clip_redos", 0) + st.get("optimizer_speculation_stopped", 0) > 0


@pytest.mark.parametrize("params", [pytest.param("cpu", marks=pytest.mark.slow), "nvme"])
def test_overlap_with_clipping_bf16_matches_boundary_step(harness, swap_dir, params):
    norms = _mlp_norms(harness)
    clip = sorted(norms)[len(norms) // 2]
    on = _hp_run(harness, swap_dir, params, "bf16", clip)
    off = _hp_run(harness, swap_dir, params, "bf16", clip, overlap=False)
    assert on["stats"]["optimizer_groups_overlapped"] > 0
    assert off["stats"]["optimizer_groups_overlapped"] == 0
    assert on["losses"] == off["losses"]
    for k in on["params"]:
        assert torch.equal(on["params"][k], off["params"][k]), k


def test_failure_in_backward_after_streamed_updates_rolls_back(harness, swap_dir):
    Boom = boom_function("injected failure in backward")
    data = _data(5)
    ref = _model()
    model = _model(Boom)
    ref_l, _ = _reference(ref, data[:2] + data[3:], 0.0)
    with infinity.initialize(model, _cfg(swap_dir, "nvme")) as eng:
        assert eng.placement.grad_home == "nvme"
        losses, _ = _train(eng, data[:2])
        from infinity.engine.checkpoint_state import EngineCheckpoint
        before = {n: t.clone() for n, t in EngineCheckpoint(eng).checkpoint_tensors()}
        x, y = data[2]
        loss = F.mse_loss(eng(x), y)
        overlapped = eng.stats()["optimizer_groups_overlapped"]
        Boom.armed = True
        with pytest.raises(RuntimeError, match="injected failure"):
            eng.backward(loss)              # the layers' updates ran before the failure
        Boom.armed = False
        assert eng.stats()["optimizer_groups_overlapped"] > overlapped
        after = {n: t.clone() for n, t in EngineCheckpoint(eng).checkpoint_tensors()}
        diff = [n for n in before if not torch.equal(before[n], after[n])]
        assert not diff, diff
        assert eng.global_steps == 2
        assert not eng.opt.grads.nvme_grads.held and not eng.opt.grads.nvme_grads.staging
        more, _ = _train(eng, data[3:])        # and training goes on, at parity
        perr = harness.param_rel_err(ref, eng)
    assert _rel(losses + more, ref_l) < 1e-5 and perr < 1e-5


def test_estimator_models_the_streamed_window():
    from infinity.estimate import memory_plan
    from infinity.memory import plan
    assert memory_plan.STREAM_GRAD_WINDOW == plan.STREAM_GRAD_WINDOW


def test_clipping_that_does_not_trigger_costs_no_bytes(harness, swap_dir):
    """Note [Redo from moments]: with fp32 moments a speculative step keeps nothing for a
    redo, so clipping that never triggers moves the same NVMe bytes as no clipping (the
    kept gradient sums were written to NVMe before: 4 B/param more per step)."""
    data = _data(5)
    _, norms = _reference(_model(), data, 0.0)
    runs = {}
    for clip in (0.0, 10 * max(norms)):
        model = harness.copy(_model())
        with infinity.initialize(model, _cfg(swap_dir, "nvme", clip=clip)) as eng:
            eng.overlap.predict = False
            assert eng.placement.grad_home == "nvme"
            _, per = _train(eng, data)
            runs[clip] = (per, eng.placement.links["nvme_write"])
    (off, _), (on, plan_write) = runs[0.0], runs[10 * max(norms)]
    for a, b in zip(off[1:], on[1:]):
        assert b["optimizer_groups_overlapped"] == a["optimizer_groups_overlapped"] > 0
        assert b["nvme_write_bytes"] == a["nvme_write_bytes"] == plan_write, (a, b)
        assert b["nvme_read_bytes"] == a["nvme_read_bytes"], (a, b)


# optimizer states on NVMe under a host cap: gradient buffers leased lazily (the parameter
# cache is on), so early-stepped gradients are gone and are recovered from the moments;
# states in host memory without a cap: the gradient buffers stay, the redo uses them
@pytest.mark.parametrize("optim,cap", [("nvme", 0.05), ("cpu", None)])
def test_clipped_redo_at_parity(harness, swap_dir, optim, cap):
    """Every window speculates and the clip triggers in about half of them: the groups
    stepped early are rolled back one by one and redone clipped (Note [Redo from
    moments]); fp32 parity with clip_grad_norm_ + AdamW."""
    data = _data(8)
    _, norms = _reference(_model(), data, 0.0)
    clip = sorted(norms)[len(norms) // 2]
    ref = _model()
    model = harness.copy(ref)
    ref_l, _ = _reference(ref, data, clip)
    cfg = {"precision": "fp32", "gradient_clipping": clip,
           "offload": {"params": "nvme", "optimizer": optim, "nvme_paths": [swap_dir],
                       "host_memory_gb": cap},
           "optimizer": {"lr": LR, "weight_decay": WD, "no_decay": []}}
    with infinity.initialize(model, cfg) as eng:
        eng.overlap.predict = False
        losses, per = _train(eng, data)
        perr = harness.param_rel_err(ref, eng)
        st = eng.stats()
        lazy = eng.opt.grads.lazy_grads
    assert _rel(losses, ref_l) < 1e-5 and perr < 1e-5, (_rel(losses, ref_l), perr)
    assert st.get("optimizer_clip_redos", 0) > 0 and st.get("optimizer_groups_redone", 0) > 0, st
    assert lazy == (cap is not None)
