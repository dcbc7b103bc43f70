"""The optimizer step overlapped with backward across ranks (Note [Overlap across ranks] in
infinity/engine/overlap.py): at ZeRO stage 3 a group's shard is stepped as soon as its
reduce-scatter landed, while backward goes on.

* parity: losses and gathered final parameters within 1e-5 (norm-relative) of
  single-process torch AdamW on the global batch (``test_stages.check_run``), with the
  overlap on and really used (``optimizer_groups_overlapped`` > 0 on every rank at stage 3),
  homes cpu / nvme, with clipping (speculative steps redone clipped) and accumulation, also
  on the simulated device tier; stages 1-2 run in the same spawns (nothing is paged there,
  so nothing may be stepped early: the counter must stay 0); fp32 NVMe homes hand this
  rank's slice of the released gathered buffer to its early step as the master.
* failure: a rank whose overlapped group steps raise, or whose backward raises after
  group steps started on every rank, makes every rank raise; no rank's shards move.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_stages import BATCH, STEPS, base_config, run_and_check  # noqa: E402
from zero_harness import run_ranks  # noqa: E402

SIM = {"INFINITY_SIMULATE_DEVICE": "1"}
FAIL_TIMEOUT_S = 8     # the survivor waits this long; shorter is flaky on a loaded machine
CLIP = 3.0    # the awkward model's gradient norm (1-6.6) crosses it during the run


def _runs(tmp_path, combos):
    """``(stage, home, flags)``; flags: clip, gas, sim (simulated device tier)."""
    runs = []
    for stage, home, *flags in combos:
        flags = set(flags)
        name = "-".join([f"s{stage}", home] + sorted(flags))
        extra = {}
        if "clip" in flags:
            extra["gradient_clipping"] = CLIP
        if "gas" in flags:
            extra["gradient_accumulation_steps"] = 2
        cfg = base_config(stage, home, str(tmp_path / f"swap-{name}"), **extra)
        run = {"name": name, "model": "awkward", "steps": STEPS, "batch": BATCH,
               "config": cfg, "env": SIM if "sim" in flags else {"INFINITY_SIMULATE_DEVICE": "0"}}
        if "clip" in flags and stage == 3:
            run["overlap_predict"] = False     # speculate every window: redos happen
        runs.append(run)
    return runs


def home_of(run):
    return run["config"]["offload"]["params"]


def _run(tmp_path, combos, world_size):
    runs = _runs(tmp_path, combos)
    res = run_and_check(tmp_path, runs, world_size=world_size)
    for run in runs:
        name = run["name"]
        for r in res:
            st = r.result["runs"][name]
            if run["config"]["zero_stage"] == 3:
                assert st["optimizer_groups_overlapped"] > 0, (name, r.rank, st)
                if home_of(run) == "nvme" and "sim" not in name:
                    # Note [Master hand-off]: this rank's slice of the gathered buffer
                    assert st["optimizer_master_handoffs"] > 0, (name, r.rank, st)
            else:
                assert st["optimizer_groups_overlapped"] == 0, (name, r.rank, st)
        if "clip" in name and run["config"]["zero_stage"] == 3:
            # the speculative early steps were rolled back and redone clipped at least once
            assert any(r.result["runs"][name]["optimizer_clip_redos"] > 0 for r in res), name
    return res


def test_overlap_parity_2_ranks(tmp_path):
    """Default slice: stage 3 nvme + clipping, stage 3 cpu + accumulation, stage 3 cpu on
    the simulated device with clipping and accumulation; one 2-rank spawn."""
    _run(tmp_path, [(3, "nvme", "clip"), (3, "cpu", "gas"), (3, "cpu", "sim", "clip", "gas")],
         world_size=2)


@pytest.mark.slow   # (the 2-rank variant runs by default)
def test_overlap_parity_4_ranks(tmp_path):
    """Default slice at world size 4: stage 3 on NVMe with clipping and accumulation."""
    _run(tmp_path, [(3, "nvme", "clip", "gas")], world_size=4)


def _matrix():
    out = []
    for stage in (1, 2, 3):
        for home in ("none", "cpu", "nvme"):
            for flags in ((), ("clip",), ("clip", "gas")):
                out.append((stage, home) + flags)
    return out + [(3, "nvme", "sim", "clip", "gas"), (3, "cpu", "sim")]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_overlap_parity_matrix(tmp_path, world_size):
    _run(tmp_path, _matrix(), world_size=world_size)


# ---------------------------------------------------------------------- failures
def _fail(tmp_path, mode, home):
    cfg = {"zero_stage": 3, "dist_timeout_s": FAIL_TIMEOUT_S,
           "offload": {"params": home, "optimizer": home,
                       "nvme_paths": [str(tmp_path / "swap")]}}
    res = run_ranks("overlap_failure_child.py", {"config": cfg, "fail_rank": 1, "mode": mode},
                    tmp_path, timeout=180)
    for r in res:
        assert r.result is not None, r
        assert r.result["overlap_on"], r.result
        assert r.result["raised"], f"rank {r.rank} did not fail: {r}"
        assert r.result["unchanged"] and r.result["global_steps_unchanged"], r.result
    return res


@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_rank_failing_in_an_overlapped_step_fails_every_rank_and_commits_nothing(tmp_path, home):
    res = _fail(tmp_path, "step", home)
    # the failing rank's early steps were submitted (and raised on their worker)
    assert res[1].result["overlapped"] > 0, res[1].result
    assert "injected overlapped step failure" in res[1].result["raised"], res[1].result
    assert "CollectiveError" in res[0].result["raised"] and "rank 1 failed first" in \
        res[0].result["raised"], res[0].result


def test_rank_failing_in_backward_after_early_steps_commits_nothing(tmp_path):
    """Rank 1's backward raises at its first layer, after the later layers' shards were
    reduced; rank 0 had stepped them early: it must roll them back."""
    res = _fail(tmp_path, "backward", "nvme")
    assert res[0].result["overlapped"] > 0, res[0].result
    assert "injected backward failure" in res[1].result["raised"], res[1].result
    assert "CollectiveError" in res[0].result["raised"], res[0].result
