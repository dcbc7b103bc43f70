"""Exceptions leaving a public call (Note [one exit]) and gradients from outside
engine.backward (Note [foreign backward]).

* A signal held inside forward/backward/step and delivered as the engine's gate closes
  leaves the call like any other exception: the window is dropped (micro_step back at the
  window's start), and re-feeding the window as documented gives exactly the weights of
  plain PyTorch AdamW -- swept over every line the gate runs, at accumulation 2 and 3.
* A plain ``loss.backward()`` on the engine's output adds nothing to any update: the next
  engine call raises naming ``engine.backward(loss)``.
"""
import copy
import math
import signal
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.engine import core as engine_core
from infinity.runtime import interrupts

GATE_FILE = interrupts.__file__


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 8))


def _cfg(swap, homes=("nvme", "nvme"), accum=1):
    return {"offload": {"params": homes[0], "optimizer": homes[1], "nvme_paths": [swap]},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
            "gradient_accumulation_steps": accum}


def _windows(n, accum, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g))
             for _ in range(accum)] for _ in range(n)]


def _trajectory(model, windows):
    """Plain torch AdamW over ``windows`` (each window's mean loss): weights after k updates."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    traj = [{n: p.detach().clone() for n, p in ref.named_parameters()}]
    for w in windows:
        for x, y in w:
            (F.mse_loss(ref(x), y) / len(w)).backward()
        opt.step()
        opt.zero_grad()
        traj.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return traj


def _close(e, want):
    sd = e.state_dict()
    num = sum(float((sd[n].double() - want[n].double()).pow(2).sum()) for n in want)
    den = sum(float(want[n].double().pow(2).sum()) for n in want)
    return math.sqrt(num / den) < 1e-5


def _micro(e, x, y):
    e.backward(F.mse_loss(e(x).float(), y))
    e.step()


def test_interrupt_as_forward_returns_drops_the_window(tmp_path):
    """The reliability review's reproduction: a SIGINT just as the model's forward returns
    into engine.forward is held, then delivered as the gate closes; the window must be
    dropped (micro_step 0) so that re-feeding it counts no micro-batch twice."""
    windows = _windows(1, 2)
    (a, b), = windows
    traj = _trajectory(_net(), windows)
    core_file = engine_core.__file__

    def prof(frame, event, arg):
        if event == "return" and frame.f_back is not None \
                and frame.f_back.f_code.co_name == "forward" \
                and frame.f_back.f_code.co_filename == core_file:
            sys.setprofile(None)
            signal.getsignal(signal.SIGINT)(signal.SIGINT, frame.f_back)

    with infinity.initialize(_net(), _cfg(str(tmp_path / "s"), accum=2)) as e:
        _micro(e, *a)
        assert e.stats()["micro_step"] == 1
        sys.setprofile(prof)
        try:
            with pytest.raises(KeyboardInterrupt):
                e(b[0])
        finally:
            sys.setprofile(None)
        assert e.stats()["micro_step"] == 0 and e.global_steps == 0
        _micro(e, *a)            # the window again, from its start, as documented
        _micro(e, *b)
        assert e.global_steps == 1 and _close(e, traj[1])


def _gate_sweep(tmp_path, homes, accum, stride, updates=2):
    """Ctrl-C at the n-th line the gate's own code (infinity/runtime/interrupts.py) runs in
    an attempt (one micro-batch: forward, backward, step), n = 1, 1 + stride, ..., through
    the SIGINT handler in place at that moment (the gate's while a call is open, Python's
    default one when it is not).  After every interrupt the window was dropped (micro_step
    at its start) and the caller re-feeds it from its first micro-batch; the weights always
    equal plain PyTorch AdamW at exactly global_steps updates."""
    windows = _windows(updates, accum)
    traj = _trajectory(_net(), windows)
    count, at = [0], [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != GATE_FILE:
            return None
        if event == "line":
            count[0] += 1
            if count[0] == at[0]:
                signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
        return tracer

    interrupted = 0
    nxt = {}      # (update, position in the window) -> the next line to interrupt; 0: swept
    with infinity.initialize(_net(), _cfg(str(tmp_path / "s"), homes, accum)) as e:
        for _ in range(20000):
            if e.global_steps == updates:
                break
            k = e.stats()["micro_step"] - e.global_steps * accum
            key = (e.global_steps, k)
            x, y = windows[e.global_steps][k]
            count[0], at[0] = 0, nxt.get(key, 1)
            try:
                sys.settrace(tracer)
                try:
                    _micro(e, x, y)
                finally:
                    sys.settrace(None)
                nxt[key] = 0                 # got through: this micro-batch is swept
            except KeyboardInterrupt:
                interrupted += 1
                nxt[key] = at[0] + stride
                assert e.stats()["micro_step"] == e.global_steps * accum, \
                    f"the window was not dropped (line {at[0]} of the gate at {key})"
            at[0] = 0
            assert _close(e, traj[e.global_steps]), \
                f"weights differ from the reference at update {e.global_steps} ({key})"
        assert e.global_steps == updates and _close(e, traj[-1])
    assert interrupted >= 5 * updates * accum


@pytest.mark.parametrize("accum", [2, 3])
@pytest.mark.parametrize("homes", [("cpu", "cpu"), ("nvme", "nvme")])
def test_interrupts_at_the_gate_lines_keep_the_reference(tmp_path, homes, accum):
    _gate_sweep(tmp_path, homes, accum, stride=7)


@pytest.mark.slow
@pytest.mark.parametrize("accum", [2, 3])
def test_interrupts_at_every_gate_line_keep_the_reference(tmp_path, accum):
    _gate_sweep(tmp_path, ("nvme", "nvme"), accum, stride=1)


# ------------------------------------------------------------------ foreign backward
def _engine(tmp_path, name, accum=1):
    return infinity.initialize(_net(), {"offload": {"params": "cpu", "optimizer": "cpu"},
                                        "optimizer": {"lr": 1e-2, "weight_decay": 0.1,
                                                      "no_decay": []},
                                        "gradient_accumulation_steps": accum})


def test_a_plain_backward_is_refused_and_adds_nothing(tmp_path):
    """The reliability review's reproduction: step() after a plain loss.backward() used to
    warn "nothing to do" and keep the gradients for the next update."""
    (a,), (b,) = _windows(2, 1)
    with _engine(tmp_path, "a") as e, _engine(tmp_path, "b") as ref:
        F.mse_loss(e(a[0]).float(), a[1]).backward()       # not engine.backward
        with pytest.raises(RuntimeError, match=r"engine\.backward\(loss\)"):
            e.step()
        assert e.global_steps == 0
        _micro(e, *b)
        _micro(ref, *b)
        assert all(torch.equal(p, q) for p, q in zip(e.state_dict().values(),
                                                     ref.state_dict().values()))
        # the next call after a plain backward raises, whichever it is; then it works
        F.mse_loss(e(a[0]).float(), a[1]).backward()
        with pytest.raises(RuntimeError, match="dropped"):
            e(a[0])
        _micro(e, *a)
        assert e.global_steps == 2
