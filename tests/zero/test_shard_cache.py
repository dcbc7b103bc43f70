"""The parameter cache for a rank's own shard at ZeRO stage 3 across ranks (Note [Shard
cache] in infinity/zero/partitioned_memory.py): fp32, NVMe param home, CPU ranks, a host cap
with headroom: released groups keep a clean host copy of this rank's shard, which later
fetches all-gather from and the optimizer updates in place and writes through.

* parity: losses and gathered final parameters within 1e-5 of single-process torch AdamW
  (``test_stages.check_run``) with a cap that holds every shard ("all"), one that leaves
  the cache only what the gradient buffers of backward do not use, so the host pool
  evicts copies for them ("part"), and no cap (the cache off), with gradient
  accumulation, with clipping (speculative early steps redone), and with the Adam
  moments in host memory (their undo copies keep their room: the step still overlaps
  backward), the overlapped step on; the three give bit-identical losses.
* it is really used: ``param_cache_admitted`` > 0, fetches gathered from copies, master
  reads saved, and fewer NVMe read bytes per optimizer step than with the cache off (all
  < part < off on the last step); "part" evicts, "all" never does; the host tier stays
  within the cap.
* a checkpoint load drops the copies (it rewrites the NVMe homes) and training goes on
  bit-identical to the cache off.
* failure: a rank failing mid-window (its overlapped group steps raise, or its backward
  raises after every rank stepped groups early) makes every rank fail, no rank's states
  move, and every cached copy left equals the NVMe home it caches.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_stages import BATCH, STEPS, base_config, run_and_check  # noqa: E402
from zero_harness import run_ranks, run_ranks_ok  # noqa: E402

CLIP = 3.0          # the awkward model's gradient norm crosses it during the run
ALL_GB = 0.25       # holds every shard of the awkward model many times over
FAIL_TIMEOUT_S = 8


def _runs(tmp_path, tags):
    runs = []
    for tag in tags:
        extra = {}
        if "gas" in tag:
            extra["gradient_accumulation_steps"] = 2
        if "clip" in tag:
            extra["gradient_clipping"] = CLIP
        for cache in ("all", "part", "off"):
            name = f"{tag}-{cache}"
            cfg = base_config(3, "nvme", str(tmp_path / f"swap-{name}"), **extra)
            if "cpuopt" in tag:      # Adam moments in host memory: undo copies come first
                cfg["offload"]["optimizer"] = "cpu"
            run = {"name": name, "model": "awkward", "steps": STEPS, "batch": BATCH,
                   "config": cfg, "env": {"INFINITY_SIMULATE_DEVICE": "0"}}
            if cache == "all":
                cfg["offload"]["host_memory_gb"] = ALL_GB
            elif cache == "part":
                run["cap_from"] = {"run": f"{tag}-all", "fraction": 0.0}
            if "clip" in tag:
                run["overlap_predict"] = False      # speculate every window: redos happen
            runs.append(run)
    return runs


def _check(tmp_path, tags, world_size):
    runs = _runs(tmp_path, tags)
    res = run_and_check(tmp_path, runs, world_size=world_size)
    for tag in tags:
        for r in res:
            got = {k: r.result["runs"][f"{tag}-{k}"] for k in ("all", "part", "off")}
            a, p, o = got["all"], got["part"], got["off"]
            where = (tag, r.rank)
            assert a["losses"] == o["losses"] and p["losses"] == o["losses"], where
            for st in got.values():
                assert st["optimizer_groups_overlapped"] > 0, (where, st)
            # off: no cap, no cache; the master is handed off instead
            assert o["param_cache_budget"] == 0 and o["param_cache_admitted"] == 0, (where, o)
            assert o["cached_groups"] == 0 and o["param_cache_gathers"] == 0, (where, o)
            assert o["optimizer_master_handoffs"] > 0, (where, o)
            for st in (a, p):
                assert st["param_cache_budget"] > 0, (where, st)
                assert st["param_cache_admitted"] > 0 and st["param_cache_gathers"] > 0, \
                    (where, st)
                assert st["optimizer_master_read_bytes_saved"] > 0, (where, st)
                assert st["host_peak_bytes"] <= st["host_cap_bytes"], (where, st)
                # every copy admitted is still there or was evicted (close drops the rest
                # uncounted: this is read before)
                assert st["param_cache_admitted"] - st["param_cache_evicted"] == \
                    st["cached_groups"], (where, st)
            if a["optimizer_clip_redos"] == 0:
                # all: every shard fits next to the gradient buffers: admitted once, never
                # evicted, every forward after the first gathers from the copies
                assert a["param_cache_evicted"] == 0, (where, a)
                assert a["cached_groups"] == a["nvme_groups"], (where, a)
                assert a["param_cache_admitted"] == a["nvme_groups"], (where, a)
                # part: the gradient buffers of backward take copies back
                assert p["param_cache_evicted"] > 0, (where, p)
                # NVMe reads on the last optimizer step (steady state)
                ra, rp, ro = (st["per_step"][-1]["nvme_read_bytes"] for st in (a, p, o))
                assert ra < rp < ro, (where, ra, rp, ro)
            else:
                # a clipped redo rolls the window back: the copies its speculative steps
                # updated in place are dropped (counted as evicted), then re-admitted
                assert a["param_cache_evicted"] > 0, (where, a)
                assert a["param_cache_admitted"] > a["nvme_groups"], (where, a)
            # NVMe reads over the run
            ra, rp, ro = (st["nvme_read_bytes"] for st in (a, p, o))
            assert ra < rp < ro, (where, ra, rp, ro)
            # write-through: the same bytes are written with or without the cache
            wa, wp, wo = (st["per_step"][-1]["nvme_write_bytes"] for st in (a, p, o))
            assert wa == wp == wo, (where, wa, wp, wo)
    return res


def test_shard_cache_parity_and_reads_2_ranks(tmp_path):
    _check(tmp_path, ["gas", "clip", "cpuopt"], world_size=2)


@pytest.mark.slow
def test_shard_cache_parity_and_reads_4_ranks(tmp_path):
    _check(tmp_path, ["gas-clip"], world_size=4)


# ---------------------------------------------------------------------- failures
def _fail(tmp_path, mode):
    cfg = {"zero_stage": 3, "dist_timeout_s": FAIL_TIMEOUT_S,
           "offload": {"params": "nvme", "optimizer": "nvme", "host_memory_gb": ALL_GB,
                       "nvme_paths": [str(tmp_path / "swap")]}}
    res = run_ranks("overlap_failure_child.py", {"config": cfg, "fail_rank": 1, "mode": mode,
                                                 "check_cache": True}, tmp_path, timeout=180)
    for r in res:
        assert r.result is not None, r
        assert r.result["overlap_on"], r.result
        assert r.result["raised"], f"rank {r.rank} did not fail: {r}"
        assert r.result["unchanged"] and r.result["global_steps_unchanged"], r.result
        # the cache was really on before the failing window, and what it holds after it
        # equals the NVMe homes (the copies the rolled-back steps updated were dropped)
        assert r.result["cache_admitted"] > 0, r.result
        assert r.result["cache_gathers"] > 0, r.result
        assert r.result["cache_stale"] == [], r.result
    return res


@pytest.mark.parametrize("mode", ["step", "backward"])
def test_rank_failing_mid_window_with_the_cache_commits_nothing(tmp_path, mode):
    res = _fail(tmp_path, mode)
    stepping = res[1] if mode == "step" else res[0]
    assert stepping.result["overlapped"] > 0, stepping.result
    # a copy an early step updated in place on the rank that did not fail was dropped
    assert res[0].result["cache_discarded"] > 0, res[0].result


def test_checkpoint_load_drops_the_shard_cache(tmp_path):
    """The load rewrites the NVMe homes: the copies go first (else the next fetches would
    all-gather the values of the steps after the save); training then goes on exactly as
    without the cache, and the cache fills again."""
    configs = {}
    for name, cap in (("cache", ALL_GB), ("off", None)):
        cfg = base_config(3, "nvme", str(tmp_path / f"swap-{name}"))
        if cap is not None:
            cfg["offload"]["host_memory_gb"] = cap
        configs[name] = cfg
    res = run_ranks_ok("cache_ckpt_child.py", {"configs": configs,
                                               "ckpt": str(tmp_path / "ckpt")},
                       tmp_path, world_size=2, timeout=300)
    for r in res:
        on, off = r.result["runs"]["cache"], r.result["runs"]["off"]
        assert on["loaded_equal_saved"] and off["loaded_equal_saved"], r.result
        assert on["cache_before_load"] > 0 and on["cache_after_load"] == 0, on
        assert on["cache_end"] > 0, on
        assert off["cache_before_load"] == off["cache_end"] == 0, off
        assert on["losses"] == off["losses"], (r.rank, on["losses"], off["losses"])
