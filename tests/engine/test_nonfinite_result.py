"""Note [non-finite result] (infinity/optim/step_txn.py): an Adam update whose
*result* is inf/NaN although its gradients are finite (here: an fp16 model whose
weight the update pushes past 65504, so its fp16 copy would be inf).

- The update held in a transaction with undo copies (NVMe states): rolled back like a
  non-finite gradient -- ``step()`` False, ``nonfinite_steps`` counts it, weights and
  every optimizer state bit-identical to before, and training goes on exactly like a
  run that never saw that batch; ``nonfinite_grads: "raise"`` raises
  ``NonFiniteUpdateError`` (rolled back) instead.
- Host states updated in place (one process, CPU states: Note [finish only]): the
  engine is ``FAILED`` naming the group, and every later call says so.
"""
import pytest
import torch
from torch import nn

import infinity
from infinity.engine.phase import NonFiniteUpdateError, PhaseError


class Net(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.inp = nn.Linear(8, 16, bias=bias)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.inp(x))


def _model():
    torch.manual_seed(0)
    m = Net()
    with torch.no_grad():
        m.inp.weight[0, :] = 65504.0       # the fp16 maximum: one Adam step up overflows it
        m.out.weight[:, 0].abs_()          # d loss / d inp.weight[0] has the sign of the loss
    return m.half()


def _cfg(tmp_path, where, **extra):
    c = {"precision": "fp16", "fp16": {"initial_scale": 1.0},
         "optimizer": {"lr": 1e-3, "weight_decay": 0.0,
                       "param_groups": [{"params": ["inp.weight"], "lr": 2000.0}]},
         "offload": {"params": where, "optimizer": where,
                     "nvme_paths": [str(tmp_path / f"swap-{len(list(tmp_path.iterdir()))}")]}}
    c.update(extra)
    return c


# inputs: "quiet" leaves inp.weight's gradient zero (moments build up elsewhere), "up"
# pushes inp.weight[0] up by ~lr (past the fp16 range), "down" pushes it down
_X = torch.rand(1, 8, generator=torch.Generator().manual_seed(1)) * 1e-4 + 1e-5
BATCHES = {"quiet": (torch.zeros(1, 8), 1.0), "up": (_X, -1.0), "down": (_X, 1.0)}


def _step(e, name):
    x, k = BATCHES[name]
    e.backward(e(x.half()).float().sum() * k)
    return e.step()


def _state(e):
    from infinity.engine.checkpoint_state import EngineCheckpoint
    return {n: t.clone() for n, t in EngineCheckpoint(e).checkpoint_tensors()}


def _same(a, b):
    return [n for n in a if not torch.equal(a[n], b[n])] == []


def test_rolled_back_like_a_nonfinite_gradient(tmp_path):
    with infinity.initialize(_model(), _cfg(tmp_path, "nvme")) as e:
        assert _step(e, "quiet")
        before = _state(e)
        assert _step(e, "up") is False
        st = e.stats()
        assert (st["nonfinite_steps"], st["skipped_steps"], st["step"], st["phase"]) == \
            (1, 1, 1, "idle")
        assert _same(before, _state(e))
        assert _step(e, "down")
        got = _state(e)
    with infinity.initialize(_model(), _cfg(tmp_path, "nvme")) as ref:
        _step(ref, "quiet")
        _step(ref, "down")
        assert _same(got, _state(ref))


def test_raise_mode_rolls_back_then_raises(tmp_path):
    with infinity.initialize(_model(), _cfg(tmp_path, "nvme", nonfinite_grads="raise")) as e:
        _step(e, "quiet")
        before = _state(e)
        with pytest.raises(NonFiniteUpdateError, match="inp") as ei:
            _step(e, "up")
        assert ei.value.rolled_back and ei.value.groups == ("inp",)
        assert _same(before, _state(e)) and e.stats()["phase"] == "idle"
        assert _step(e, "down")


def test_in_place_update_fails_the_engine_naming_the_group(tmp_path):
    e = infinity.initialize(_model(), _cfg(tmp_path, "cpu"))
    try:
        assert _step(e, "quiet")
        with pytest.raises(NonFiniteUpdateError, match=r"group\(s\) inp.*load the last checkpoint") as ei:
            _step(e, "up")
        assert not ei.value.rolled_back
        st = e.stats()
        assert st["phase"] == "failed" and "inp" in st["failure"]
        for call in (lambda: e(BATCHES["down"][0].half()), e.step, lambda: e.backward(torch.ones(()))):
            with pytest.raises(PhaseError, match="NonFiniteUpdateError"):
                call()
    finally:
        e.close()
    assert e.stats()["phase"] == "closed"


def test_overlapped_early_step_rolled_back_before_the_decision(tmp_path):
    """fp32 with the step overlapped with backward (the group is stepped before the norm is
    known): a master pushed past fp32's range is caught before the commit decision and
    rolled back like a non-finite gradient; the run then equals one without that batch."""
    def model():
        torch.manual_seed(0)
        m = Net(bias=False)
        with torch.no_grad():
            m.inp.weight[0, :] = 3.35e38         # one step of ~1.5e37 up leaves fp32's range
            m.out.weight[:, 0] = 1e20            # inp.weight[0]'s gradient ~1e-4, all finite
        return m

    def cfg(**extra):
        c = _cfg(tmp_path, "nvme", **extra)
        c["precision"] = "fp32"
        c["gradient_clipping"] = 0.0               # the early steps stand (nothing to redo)
        c["optimizer"]["param_groups"][0]["lr"] = 2e37
        return c
    x = torch.rand(1, 8, generator=torch.Generator().manual_seed(1)) + 1e-3
    batches = {"quiet": (torch.zeros(1, 8), 1.0), "up": (x * 1e-24, -1.0), "down": (x * 1e-24, 1.0)}

    def step(e, name):
        xb, k = batches[name]
        e.backward(e(xb).sum() * k)
        return e.step()
    with infinity.initialize(model(), cfg()) as e:
        assert e.overlap is not None
        assert step(e, "quiet")
        before = _state(e)
        overlapped = e.stats()["optimizer_groups_overlapped"]
        assert step(e, "up") is False
        assert e.stats()["optimizer_groups_overlapped"] > overlapped     # stepped early
        assert e.stats()["nonfinite_steps"] == 1 and _same(before, _state(e))
        assert step(e, "down")
        got = _state(e)
    with infinity.initialize(model(), cfg()) as ref:
        step(ref, "quiet")
        step(ref, "down")
        assert _same(got, _state(ref))
