"""A decided update finished while the next forward runs (Note [Finish in the next forward]
in infinity/optim/deferred_finish.py): params and optimizer states in host memory, one
process, every update clipped (nothing stepped during backward).

Bit-identical to finishing inside step() (``engine.defer_optimizer_finish = False``) on the
host tier and on a separate (simulated) device, fp32 at parity with torch AdamW; the next
forward really starts before the last group is stepped, groups stepped in forward order, a
fetch never reads a home before its step; every other call joins first (state_dict right
after step() reads the new values); a failing group step makes the next forward raise and
the engine FAILED; an interrupt in that forward leaves the update finished and the window
dropped; nothing deferred where NVMe is involved.
"""
import threading
import time

import pytest
import torch

import infinity
from infinity.engine.phase import Phase


def _cfg(swap_dir, params="cpu", optim="cpu", prec="fp32", clip=0.05):
    return {"precision": prec,
            "offload": {"params": params, "optimizer": optim, "nvme_paths": [swap_dir]},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
            "gradient_accumulation_steps": 1, "gradient_clipping": clip}


def _run(harness, swap_dir, *, defer=True, prec="fp32", steps=4, params="cpu", optim="cpu",
         kind="mlp", before=None):
    torch.manual_seed(0)
    ref = harness.MLPStack() if kind == "mlp" else harness.TinyCausalLM()
    model = harness.copy(ref)
    batches = harness.make_batches(kind, steps)
    ref_losses = harness.reference_run(ref, kind, batches, accum=1, clip=0.05)
    with infinity.initialize(model, _cfg(swap_dir, params, optim, prec)) as eng:
        eng.defer_optimizer_finish = defer
        if before is not None:
            before(eng)
        losses = harness.engine_run(eng, kind, batches)
        perr = harness.param_rel_err(ref, eng)
        sd = {k: v.clone() for k, v in eng.state_dict().items()}
        st = eng.stats()
        n = len(eng.opt.groups)
    return dict(losses=losses, lerr=harness.rel_err(losses, ref_losses), perr=perr, sd=sd,
                stats=st, n=n)


def _same(a, b):
    assert a["losses"] == b["losses"]
    for k in a["sd"]:
        assert torch.equal(a["sd"][k], b["sd"][k]), k


@pytest.mark.parametrize("simulated", [False, True], ids=["host", "simulated-device"])
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_bit_identical_to_finishing_in_step(harness, swap_dir, monkeypatch, simulated, prec):
    if simulated:
        monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    on = _run(harness, swap_dir, prec=prec)
    off = _run(harness, swap_dir, prec=prec, defer=False)
    # steps 1-3 finished during the next forward, step 4 joined by the state_dict after it
    assert on["stats"]["optimizer_groups_finished_after_step"] == 4 * on["n"]
    assert off["stats"]["optimizer_groups_finished_after_step"] == 0
    assert on["stats"]["unfinished_update"] is False
    _same(on, off)
    if prec == "fp32":
        assert on["lerr"] < 1e-5 and on["perr"] < 1e-5, (on["lerr"], on["perr"])


def test_tied_weights_and_embeddings(harness, swap_dir):
    on = _run(harness, swap_dir, kind="lm")
    off = _run(harness, swap_dir, kind="lm", defer=False)
    _same(on, off)
    assert on["lerr"] < 1e-5 and on["perr"] < 1e-5
    assert on["stats"]["optimizer_groups_finished_after_step"] > 0


def test_forward_overlaps_the_steps_in_forward_order(harness, swap_dir):
    """Each group step slowed to 20 ms: the next forward fetches its first group before the
    last group is stepped, the groups are stepped in the order that forward fetches them,
    and no group is fetched before its step ended."""
    torch.manual_seed(0)
    model = harness.MLPStack()
    b = harness.make_batches("mlp", 2)
    log = []
    with infinity.initialize(model, _cfg(swap_dir)) as eng:
        eng.defer_optimizer_finish = True            # (on the CPU too)
        key_of = {g.gid: eng.opt.key(g) for g in eng.opt.groups}
        real_step, real_fetch = eng.opt.store.step, eng.mm.fetch_async

        def slow(items, **kw):
            out = real_step(items, **kw)
            if threading.current_thread().name.startswith("infinity-finish"):
                time.sleep(0.02)
                log.append(("stepped", items[0].key, time.perf_counter()))
            return out

        def fetch(g, **kw):
            out = real_fetch(g, **kw)         # (waits for the group's step first)
            if g.gid in key_of:
                log.append(("fetch", key_of[g.gid], time.perf_counter()))
            return out
        eng.opt.store.step, eng.mm.fetch_async = slow, fetch
        for batch in b:
            log.append(("forward", None, time.perf_counter()))
            out = eng(harness.inputs_of("mlp", batch))
            log.append(("forward end", None, time.perf_counter()))
            eng.backward(harness.loss_of("mlp", out, batch))
            eng.step()
        n = len(eng.opt.groups)
        assert eng.stats()["optimizer_groups_finished_after_step"] == n
    start2 = [i for i, e in enumerate(log) if e[0] == "forward"][1]
    end2 = [i for i, e in enumerate(log) if e[0] == "forward end"][1]
    second = log[start2:end2]                      # the second forward (it joins the worker)
    stepped = {k: t for kind, k, t in second if kind == "stepped"}
    fetched = []                                   # the second forward's first fetches
    for kind, k, t in second:
        if kind == "fetch" and k not in dict(fetched):
            fetched.append((k, t))
    assert len(stepped) == n and len(fetched) == n
    order = sorted(stepped, key=stepped.get)
    assert order == [k for k, _ in fetched]        # stepped in the forward's order
    for k, t in fetched:
        assert t >= stepped[k], k                  # never fetched before its step ended
    assert fetched[0][1] < max(stepped.values())   # the forward ran while groups stepped


def test_state_dict_right_after_step_joins(harness, swap_dir):
    def grab(defer):
        torch.manual_seed(0)
        model = harness.MLPStack()
        (x, y), = harness.make_batches("mlp", 1)
        with infinity.initialize(model, _cfg(swap_dir)) as eng:
            eng.defer_optimizer_finish = defer
            loss = harness.loss_of("mlp", eng(harness.inputs_of("mlp", (x, y))), (x, y))
            eng.backward(loss)
            eng.step()
            running = eng.opt.deferred is not None
            assert eng.stats()["optimizer_step_seconds"] > 0
            sd = {k: v.clone() for k, v in eng.state_dict().items()}
            assert eng.opt.deferred is None and eng.stats()["unfinished_update"] is False
        return running, sd
    running, on = grab(True)
    _, off = grab(False)
    assert running
    for k in on:
        assert torch.equal(on[k], off[k]), k


def test_a_failing_group_step_fails_the_engine(harness, swap_dir):
    torch.manual_seed(0)
    model = harness.MLPStack()
    b = harness.make_batches("mlp", 2)
    with infinity.initialize(model, _cfg(swap_dir)) as eng:
        eng.defer_optimizer_finish = True
        loss = harness.loss_of("mlp", eng(harness.inputs_of("mlp", b[0])), b[0])
        eng.backward(loss)
        real = eng.opt.store.step
        calls = [0]

        def failing(items, **kw):
            if threading.current_thread().name.startswith("infinity-finish"):
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("injected group step failure")
            return real(items, **kw)
        eng.opt.store.step = failing
        eng.step()
        eng.opt.deferred._ended.wait(10)
        # the module called directly (as a Trainer's evaluate does), not through the engine:
        # the fetch of a group the failed worker never stepped raises, no stale values used
        with pytest.raises(RuntimeError, match="could not be finished"):
            eng.module(harness.inputs_of("mlp", b[1]))
        with pytest.raises(RuntimeError, match="injected group step failure") as ei:
            eng(harness.inputs_of("mlp", b[1]))
        assert any("Finish in the next forward" in n for n in ei.value.__notes__)
        assert eng.phase is Phase.FAILED
        assert eng.stats()["failure"] and "reload a checkpoint" in eng.stats()["failure"]
        with pytest.raises(Exception, match="failed"):
            eng(harness.inputs_of("mlp", b[1]))


def test_interrupt_in_the_next_forward(harness, swap_dir):
    """A KeyboardInterrupt raised inside the next forward: the update is finished anyway
    (joined before the window drops), the engine is idle, and feeding the micro-batch again
    gives what an uninterrupted run gives."""
    def run(interrupt):
        torch.manual_seed(0)
        model = harness.MLPStack()
        b = harness.make_batches("mlp", 3)
        losses = []
        with infinity.initialize(model, _cfg(swap_dir)) as eng:
            eng.defer_optimizer_finish = True
            for i, batch in enumerate(b):
                if interrupt and i == 1:
                    mod = list(eng.module.modules())[-1]
                    h = mod.register_forward_pre_hook(
                        lambda m, a: (_ for _ in ()).throw(KeyboardInterrupt()))
                    with pytest.raises(KeyboardInterrupt):
                        eng(harness.inputs_of("mlp", batch))
                    h.remove()
                    assert eng.opt.deferred is None and eng.phase is Phase.IDLE
                    assert eng.stats()["unfinished_update"] is False
                out = eng(harness.inputs_of("mlp", batch))
                loss = harness.loss_of("mlp", out, batch)
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
            sd = {k: v.clone() for k, v in eng.state_dict().items()}
        return losses, sd
    l1, s1 = run(True)
    l0, s0 = run(False)
    assert l1 == l0
    for k in s0:
        assert torch.equal(s1[k], s0[k]), k


@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated-device"])
def test_default_only_on_a_separate_device(harness, swap_dir, monkeypatch, simulated):
    """By default (None) the finish overlaps the next forward only where that forward
    computes elsewhere (a GPU; here the simulated device): on a CPU-only engine both would
    share the same cores."""
    if simulated:
        monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    r = _run(harness, swap_dir, defer=None, steps=2)
    n = r["stats"]["optimizer_groups_finished_after_step"]
    assert (n == 2 * r["n"]) if simulated else (n == 0)
    assert r["lerr"] < 1e-5 and r["perr"] < 1e-5


@pytest.mark.parametrize("params,optim", [("nvme", "cpu"), ("cpu", "nvme")])
def test_not_deferred_with_nvme(harness, swap_dir, params, optim):
    r = _run(harness, swap_dir, params=params, optim=optim, steps=2)
    assert r["stats"]["optimizer_groups_finished_after_step"] == 0
    assert r["lerr"] < 1e-5 and r["perr"] < 1e-5
