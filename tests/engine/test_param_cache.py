"""The parameter cache: NVMe-homed fp32 groups keep clean host copies in the host cap's
headroom (``MemoryManager.enable_cache``), written through by the optimizer.

Against plain PyTorch + AdamW and bit-identical to the same engine without a cap (no
cache), with and without the overlapped step; NVMe reads drop to the Adam moments when
everything fits; the host tier stays within the cap; a checkpoint load (which rewrites
the NVMe homes) drops the copies and training goes on from the loaded values.
"""
import pytest
import torch

import infinity

STEPS = 6


def _cfg(swap_dir, cap, clip):
    off = {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir]}
    if cap is not None:
        off["host_memory_gb"] = cap
    return {"offload": off, "gradient_accumulation_steps": 2, "gradient_clipping": clip,
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []}}


def _base_host_gb(harness, swap_dir):
    """The host tier the plan needs without a cache (from an engine with a generous cap)."""
    with infinity.initialize(harness.MLPStack(), _cfg(swap_dir, 1.0, 0.0)) as eng:
        h = eng.placement.host
        need = sum(v for k, v in h.items() if not k.startswith("parameter cache"))
        params = sum(g.nbytes for g in eng.mm.groups)
    return need, params


def _train(harness, swap_dir, cap, clip, batches, overlap=True):
    torch.manual_seed(0)
    model = harness.MLPStack()
    with infinity.initialize(model, _cfg(swap_dir, cap, clip)) as eng:
        eng.overlap_optimizer_step = overlap
        losses = harness.engine_run(eng, "mlp", batches[:-2])
        s0 = eng.stats()
        losses += harness.engine_run(eng, "mlp", batches[-2:])   # one more optimizer step
        s1 = eng.stats()
        params = {k: v.clone() for k, v in eng.state_dict().items()}
        moments = sum(2 * eng.store.master_io_bytes(eng.opt.key(g)) for g in eng.opt.groups)
        info = dict(budget=eng.placement.param_cache_budget, used=eng.mm.cache_used,
                    cached=sum(1 for g in eng.mm.groups if eng.mm.cached(g)),
                    groups=len(eng.mm.groups), host_peak=s1["host_peak_bytes"],
                    read_last=s1["nvme_read_bytes"] - s0["nvme_read_bytes"],
                    write_last=s1["nvme_write_bytes"] - s0["nvme_write_bytes"],
                    moments=moments, stats=s1)
    return losses, params, info


@pytest.mark.parametrize("clip", [1.0, 0.0])      # 0: the overlapped step (and hand-off) too
def test_cache_parity_and_reads(harness, swap_dir, clip):
    batches = harness.make_batches("mlp", 2 * STEPS)
    torch.manual_seed(0)
    ref = harness.MLPStack()
    ref_losses = harness.reference_run(ref, "mlp", batches, accum=2, clip=clip)
    need, params = _base_host_gb(harness, swap_dir)
    runs = {}
    for name, cap in (("none", None), ("part", (need + params // 2) / 1e9),
                      ("all", (need + 2 * params) / 1e9)):
        runs[name] = _train(harness, swap_dir, cap, clip, batches)
    none, part, full = runs["none"], runs["part"], runs["all"]
    assert harness.rel_err(none[0], ref_losses) < 1e-5
    sd_ref = dict(ref.named_parameters())
    for name in ("part", "all"):
        losses, params_out, info = runs[name]
        redone = info["stats"].get("optimizer_groups_redone", 0)
        if redone:
            # Note [Redo from moments]: with the cache the gradient buffers are leased lazily
            # and go back once stepped, so a clipped redo recovers them from the moments
            # (exact up to fp32 rounding); without it the kept buffers are used
            assert harness.rel_err(losses, none[0]) < 1e-6, name
        else:
            assert losses == none[0], name
        for k in none[1]:
            if redone:
                assert torch.allclose(params_out[k], none[1][k], rtol=1e-5, atol=1e-7), (name, k)
            else:
                assert torch.equal(params_out[k], none[1][k]), (name, k)
            assert torch.allclose(params_out[k], sd_ref[k].detach(), rtol=1e-4, atol=1e-5), k
        assert info["host_peak"] <= info["stats"]["host_cap_bytes"]
        st = info["stats"]
        assert info["cached"] > 0
        assert st["param_cache_admitted"] - st.get("param_cache_evicted", 0) == info["cached"]
    assert none[2]["budget"] == 0 and none[2]["cached"] == 0
    assert 0 < part[2]["cached"] < part[2]["groups"]
    assert full[2]["cached"] == full[2]["groups"]
    # reads per optimizer step: all cached -> only the Adam moments are read
    assert full[2]["read_last"] == full[2]["moments"]
    assert full[2]["read_last"] < part[2]["read_last"] < none[2]["read_last"]
    # write-through: the same bytes are written with or without the cache
    assert full[2]["write_last"] == part[2]["write_last"] == none[2]["write_last"]


def test_checkpoint_load_drops_the_cache(harness, swap_dir, tmp_path):
    batches = harness.make_batches("mlp", 8)
    need, params = _base_host_gb(harness, swap_dir)
    cap = (need + 2 * params) / 1e9
    results = []
    for c in (cap, None):
        torch.manual_seed(0)
        with infinity.initialize(harness.MLPStack(), _cfg(swap_dir, c, 0.0)) as eng:
            harness.engine_run(eng, "mlp", batches[:4])
            eng.save_checkpoint(str(tmp_path / f"ck{c is None}"), tag="t")
            saved = {k: v.clone() for k, v in eng.state_dict().items()}
            harness.engine_run(eng, "mlp", batches[4:6])
            eng.load_checkpoint(str(tmp_path / f"ck{c is None}"), tag="t")
            assert eng.mm.cache_used == 0 or c is None
            loaded = {k: v.clone() for k, v in eng.state_dict().items()}
            for k in saved:
                assert torch.equal(loaded[k], saved[k]), k
            losses = harness.engine_run(eng, "mlp", batches[6:8])
            if c is not None:
                assert eng.mm.cache_used > 0        # re-filled from the loaded values
            results.append((losses, {k: v.clone() for k, v in eng.state_dict().items()}))
    (l1, p1), (l2, p2) = results
    assert l1 == l2
    for k in p1:
        assert torch.equal(p1[k], p2[k]), k


def test_host_tier_returns_to_zero_after_close(harness, swap_dir):
    need, params = _base_host_gb(harness, swap_dir)
    batches = harness.make_batches("mlp", 4)
    eng = infinity.initialize(harness.MLPStack(), _cfg(swap_dir, (need + 2 * params) / 1e9, 0.0))
    harness.engine_run(eng, "mlp", batches)
    assert eng.mm.cache_used > 0
    assert eng.stats()["host_bytes"] >= eng.mm.cache_used
    eng.close()
    assert eng.mm.cache_used == 0


def test_master_handoff_under_clipping_as_the_estimator_assumes(harness, swap_dir):
    """Note [Master hand-off] with clipping: the speculative early steps (Note [Speculative
    clipping]) take the buffer backward read as their master, as without clipping -- what
    the estimator assumes (step_time._param_cache: hand-off whatever the clip)."""
    from types import SimpleNamespace
    from infinity.estimate.step_time import param_cache_reads
    batches = harness.make_batches("mlp", 2 * STEPS)
    got = {}
    for clip in (0.0, 1e4):
        cfg = _cfg(swap_dir, None, clip)
        cfg["gradient_accumulation_steps"] = 1
        torch.manual_seed(0)
        with infinity.initialize(harness.MLPStack(), cfg) as eng:
            harness.engine_run(eng, "mlp", batches[:-1])
            s0 = eng.stats()
            harness.engine_run(eng, "mlp", batches[-1:])
            s1 = eng.stats()
        got[clip] = {k: s1.get(k, 0) - s0.get(k, 0) for k in
                     ("nvme_read_bytes", "optimizer_master_handoffs", "optimizer_groups_overlapped",
                      "optimizer_master_read_bytes_saved")}
    # (how many of the groups find a hand-off slot free, MAX_HANDOFF, depends on the
    # worker's timing, with or without the clip: the bytes a step reads plus those the
    # hand-offs saved do not)
    assert got[1e4]["optimizer_master_handoffs"] > 0, got
    assert got[1e4]["optimizer_groups_overlapped"] == got[0.0]["optimizer_groups_overlapped"]
    for g in got.values():
        assert g["optimizer_master_read_bytes_saved"] > 0, got
    assert got[1e4]["nvme_read_bytes"] + got[1e4]["optimizer_master_read_bytes_saved"] == \
        got[0.0]["nvme_read_bytes"] + got[0.0]["optimizer_master_read_bytes_saved"], got
    machine = SimpleNamespace(cpu_only=True, ranks=1)
    plan = SimpleNamespace(params_home="nvme", master_is_param=True, grads_on_nvme=False)
    for clip in (0.0, 1e4):
        knobs = SimpleNamespace(gradient_clipping=clip, host_cap_gb=None, lora_rank=None)
        assert param_cache_reads(SimpleNamespace(params=1), machine, knobs, plan)[3], clip
