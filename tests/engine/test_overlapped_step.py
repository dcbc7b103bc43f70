"""The optimizer step overlapped with backward (infinity.engine.overlap).

fp32 parity against plain PyTorch + torch.optim.AdamW (10 steps, accumulation 2, no
clipping: the case where groups are stepped during backward), bf16 bit-identical to the
same engine with the overlap switched off, tied weights and activation checkpointing
still correct (those groups wait for the boundary), the overlap really happening
(``optimizer_groups_overlapped``), with clipping too (speculatively), a worker error surfacing at
``engine.step()``; the fp32 master hand-off (the parameter buffer backward read is the
master of the group's step) bit-identical to reading the master again, with exactly that
many fewer bytes read from NVMe.
"""
import pytest
import torch

import infinity


def _cfg(swap_dir, params, optim, prec="fp32", clip=0.0):
    return {"precision": prec,
            "offload": {"params": params, "optimizer": optim, "nvme_paths": [swap_dir]},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
            "gradient_accumulation_steps": 2, "gradient_clipping": clip}


def _run(harness, swap_dir, kind, params, optim, prec="fp32", clip=0.0, overlap=True,
         checkpointing=False, steps=10, handoff=True):
    torch.manual_seed(0)
    ref = harness.MLPStack() if kind == "mlp" else \
        harness.TinyCausalLM(checkpointing=checkpointing)
    model = harness.copy(ref)
    batches = harness.make_batches(kind, steps * 2)
    ref_losses = harness.reference_run(ref, kind, batches, accum=2, clip=clip)
    with infinity.initialize(model, _cfg(swap_dir, params, optim, prec, clip)) as eng:
        eng.overlap_optimizer_step = overlap
        if eng.overlap is not None:
            eng.overlap.handoff = eng.overlap.handoff and handoff
        losses = harness.engine_run(eng, kind, batches)
        perr = harness.param_rel_err(ref, eng)
        params_out = {k: v.clone() for k, v in eng.state_dict().items()}
        stats = eng.stats()
        trainable = len(eng.opt.groups)
    return dict(lerr=harness.rel_err(losses, ref_losses), perr=perr, losses=losses,
                params=params_out, stats=stats, trainable=trainable)


@pytest.mark.parametrize("params,optim", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu")])
def test_fp32_parity_with_overlap(harness, swap_dir, params, optim):
    r = _run(harness, swap_dir, "mlp", params, optim)
    assert r["lerr"] < 1e-5, f"loss rel err {r['lerr']:.3g}"
    assert r["perr"] < 1e-5, f"param rel err {r['perr']:.3g}"
    assert r["stats"]["step"] == 10
    # every MLP group is used once per forward: all of them are stepped during backward
    assert r["stats"]["optimizer_groups_overlapped"] == 10 * r["trainable"]


def test_bf16_bit_identical_to_boundary_step(harness, swap_dir):
    on = _run(harness, swap_dir, "mlp", "nvme", "nvme", prec="bf16")
    off = _run(harness, swap_dir, "mlp", "nvme", "nvme", prec="bf16", overlap=False)
    assert on["stats"]["optimizer_groups_overlapped"] > 0
    assert off["stats"]["optimizer_groups_overlapped"] == 0
    assert on["losses"] == off["losses"]
    assert on["params"].keys() == off["params"].keys()
    for k in on["params"]:
        assert torch.equal(on["params"][k], off["params"][k]), k


def test_tied_weights_wait_for_the_boundary(harness, swap_dir):
    r = _run(harness, swap_dir, "lm", "nvme", "nvme")
    assert r["lerr"] < 1e-5 and r["perr"] < 1e-5, (r["lerr"], r["perr"])
    n = r["stats"]["optimizer_groups_overlapped"]
    assert 0 < n < 10 * r["trainable"]        # the tied embedding / LM head group waits


def test_activation_checkpointing_still_correct(harness, swap_dir):
    r = _run(harness, swap_dir, "lm", "cpu", "nvme", checkpointing=True)
    plain = _run(harness, swap_dir, "lm", "cpu", "nvme")
    assert r["lerr"] < 1e-5 and r["perr"] < 1e-5, (r["lerr"], r["perr"])
    # recomputed blocks wait: fewer groups overlapped than without checkpointing
    assert r["stats"]["optimizer_groups_overlapped"] < \
        plain["stats"]["optimizer_groups_overlapped"]


def test_clipping_keeps_the_overlap(harness, swap_dir):
    # (speculative: Note [Speculative clipping]; clip triggering or not at parity:
    # tests/engine/test_streamed_step.py)
    r = _run(harness, swap_dir, "mlp", "nvme", "nvme", clip=1.0, steps=2)
    st = r["stats"]
    assert st["optimizer_groups_overlapped"] + st.get("optimizer_speculation_stopped", 0) > 0
    assert r["lerr"] < 1e-5 and r["perr"] < 1e-5


def test_worker_error_surfaces_at_step(harness, swap_dir):
    torch.manual_seed(0)
    model = harness.MLPStack()
    batches = harness.make_batches("mlp", 2)
    with infinity.initialize(model, _cfg(swap_dir, "nvme", "nvme")) as eng:
        real = eng.store.step

        def failing(items, **kw):
            if len(items) == 1:
                raise OSError(28, "simulated ENOSPC in an overlapped group step")
            return real(items, **kw)
        eng.store.step = failing
        b = batches[0]
        eng.backward(harness.loss_of("mlp", eng(b[0]), b))
        assert eng.step() is False                      # first micro-step: no update
        b = batches[1]
        eng.backward(harness.loss_of("mlp", eng(b[0]), b))
        from infinity.engine.checkpoint_state import EngineCheckpoint
        before = {n: t.clone() for n, t in EngineCheckpoint(eng).checkpoint_tensors()}
        with pytest.raises(OSError, match="simulated ENOSPC") as ei:
            eng.step()                                   # the worker's own error, unchanged
        assert any("overlapped with backward failed" in n for n in ei.value.__notes__)
        # the failed window is rolled back: no group moved, its gradients are dropped
        assert eng.global_steps == 0 and eng.micro_steps == 0
        after = {n: t.clone() for n, t in EngineCheckpoint(eng).checkpoint_tensors()}
        diff = [n for n in before if not torch.equal(before[n], after[n])]
        assert not diff, diff
        assert not eng.opt.grads._written
        eng.store.step = real                            # and training goes on
        for b in batches:
            eng.backward(harness.loss_of("mlp", eng(b[0]), b))
            eng.step()
        assert eng.global_steps == 1


def test_master_handoff_bit_identical_and_saves_reads(harness, swap_dir):
    on = _run(harness, swap_dir, "mlp", "nvme", "nvme")
    off = _run(harness, swap_dir, "mlp", "nvme", "nvme", handoff=False)
    s_on, s_off = on["stats"], off["stats"]
    assert s_on["optimizer_groups_overlapped"] == s_off["optimizer_groups_overlapped"] > 0
    assert s_on["optimizer_master_handoffs"] > 0
    assert s_off.get("optimizer_master_handoffs", 0) == 0
    assert on["losses"] == off["losses"]
    for k in on["params"]:
        assert torch.equal(on["params"][k], off["params"][k]), k
    saved = s_on["optimizer_master_read_bytes_saved"]
    assert saved > 0
    assert s_off["nvme_read_bytes"] - s_on["nvme_read_bytes"] == saved
    assert s_on["nvme_write_bytes"] == s_off["nvme_write_bytes"]


def test_master_handoff_bounded_and_returned(harness, swap_dir, monkeypatch):
    import infinity.engine.overlap as eo
    monkeypatch.setattr(eo, "MAX_HANDOFF", 1)
    torch.manual_seed(0)
    model = harness.MLPStack()
    batches = harness.make_batches("mlp", 4)
    with infinity.initialize(model, _cfg(swap_dir, "nvme", "nvme")) as eng:
        ov = eng.overlap
        seen = []
        real = ov.on_release

        def spy(g, buf):
            took = real(g, buf)
            seen.append(len(ov._held) + ov._handed_off())
            return took
        ov.on_release = spy                  # the manager calls its listener's method
        harness.engine_run(eng, "mlp", batches)
        assert max(seen) <= 1
        assert not ov._held and not ov._stepping
        # every handed-off buffer went back to the device pool: only resident groups lease
        from infinity.memory.pool import ALIGN, round_up
        resident = sum(round_up(g.nbytes, ALIGN) for g in eng.mm.groups
                       if g.device_buf is not None and g.home == "nvme")
        assert eng.mm.device_pool.leased == resident
        assert eng.stats()["optimizer_master_handoffs"] > 0
