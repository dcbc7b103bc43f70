"""Streamed gradients across ranks (Note [Streamed gradients] in infinity/engine/overlap.py;
infinity/zero/shard_stream.py): with the fp32 gradient shards spilled to NVMe, ZeRO stage 3
steps each group's final averaged shard from memory as its reduce-scatter lands, so the
last micro-step's sums are neither written to NVMe nor read back by the optimizer.

The spill is forced (``spill``: dist_child.make_engine patches the size rule, a tiny model
never exceeds half a workable host cap); the streamed window is what the plan reserves.

* parity: losses and gathered parameters within 1e-5 of single-process torch AdamW,
  stages 2 and 3, with accumulation and clipping (speculative steps redone clipped), on
  the host tier and the simulated separate device (the shard's D2H route);
* bytes: per optimizer step (after the first, which has no prefetch trace), the NVMe
  writes and reads of a streamed run differ from the same run stepping at the boundary
  by exactly what the estimator's ``traffic_per_step`` predicts for streaming, and the
  streamed run's gradient bytes are the prediction's;
* a rank failing in an overlapped step of a streamed window commits nothing anywhere.
"""
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_stages import BATCH, STEPS, base_config, check_run, reference  # noqa: E402
from test_overlap_zero import FAIL_TIMEOUT_S  # noqa: E402
from zero_harness import rank0_prefix, run_ranks, run_ranks_ok  # noqa: E402

SIM = {"INFINITY_SIMULATE_DEVICE": "1"}
NO_SIM = {"INFINITY_SIMULATE_DEVICE": "0"}
LOOSE_CLIP = 1e4      # clipping on (speculative steps) but never binding
TIGHT_CLIP = 0.5      # the stack's gradient norm is above it: speculative steps are redone


def _runs(tmp_path, combos):
    """``(stage, params home, flags)``; flags: clip (binding), loose (clip never binding),
    gas, sim, off (the overlapped step off: the boundary steps every spilled shard)."""
    runs = []
    for stage, home, *flags in combos:
        flags = set(flags)
        name = "-".join([f"s{stage}", home] + sorted(flags))
        extra = {}
        if "clip" in flags:
            extra["gradient_clipping"] = TIGHT_CLIP
        if "loose" in flags:
            extra["gradient_clipping"] = LOOSE_CLIP
        if "gas" in flags:
            extra["gradient_accumulation_steps"] = 2
        if "bf16acc" in flags:     # lossy bf16 partial sums between micro-steps
            extra["gradient_accumulation_dtype"] = "bf16"
        cfg = base_config(stage, home, str(tmp_path / f"swap-{name}"), **extra)
        cfg["offload"]["optimizer"] = "nvme"       # the spill needs the optimizer on NVMe
        run = {"name": name, "model": "stack", "steps": STEPS, "batch": BATCH, "spill": True,
               "config": cfg, "env": SIM if "sim" in flags else NO_SIM}
        if "clip" in flags and stage == 3:
            run["overlap_predict"] = False         # speculate in every window: redos happen
        if "off" in flags:
            run["overlap"] = False
        runs.append(run)
    return runs


def _spawn(tmp_path, combos, world_size):
    runs = _runs(tmp_path, combos)
    res = run_ranks_ok("dist_child.py", {"runs": runs}, tmp_path, world_size=world_size,
                       timeout=900)
    prefix = rank0_prefix(tmp_path)
    for run in runs:
        name = run["name"]
        if "bf16acc" in name:      # lossy: near the reference, not at fp32 parity
            ref_losses, _ = reference(run["config"], kind="stack")
            for r in res:
                got = r.result["runs"][name]["losses"]
                assert max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses)) < 1e-2, name
        else:
            check_run(res, prefix, name, run["config"], kind="stack")
        for r in res:
            st = r.result["runs"][name]
            assert st["spill"], (name, st)
            streamed = run["config"]["zero_stage"] == 3 and run.get("overlap") is not False
            if streamed:
                assert st["stream_window"] > 0, (name, st)
                # every group of the stack is used once: stepped as they land (a binding
                # clip stops speculating once the running norm passes it: some steps only)
                steps = [p["optimizer_groups_overlapped"] > 0 for p in st["per_step"][1:]]
                assert (any if "clip" in name else all)(steps), (name, r.rank, st["per_step"])
            else:
                assert st["optimizer_groups_overlapped"] == 0, (name, r.rank, st)
        if "clip" in name and run["config"]["zero_stage"] == 3:
            assert any(r.result["runs"][name]["optimizer_clip_redos"] > 0 for r in res), name
    return {run["name"]: run for run in runs}, res


def _predicted_grad_bytes(shard_numel, ranks, grad_accum, streamed, clip, accum_dtype="fp32"):
    """The estimator's NVMe gradient bytes per optimizer step for one rank (one rank per
    node: the estimator's per-node links are this rank's)."""
    from infinity.estimate.step_time import traffic_per_step
    spec = SimpleNamespace(params=shard_numel * ranks)
    machine = SimpleNamespace(ranks=ranks, ranks_per_node=1, nodes=ranks, cpu_only=True)
    from infinity.estimate.memory_plan import Knobs
    knobs = Knobs(precision="fp32", zero_stage=3, grad_accum=grad_accum, gradient_clipping=clip,
                  state_dtype="fp32", grad_accum_dtype=accum_dtype, reuse_gb=0)
    plan = SimpleNamespace(params_home="cpu", optimizer_home="cpu", master_is_param=True,
                           grads_on_nvme=True, grads_streamed=streamed, grad_host_bytes=0,
                           items=[])
    t = traffic_per_step(spec, machine, knobs, plan)
    out = {}
    for link in ("nvme_read", "nvme_write"):
        out[link] = sum(b for what, b in t["mb"][link] if "grad" in what) * grad_accum + \
            sum(b for what, b in t["opt"][link] if "grad" in what)
    return out


def _check_bytes(runs, res, on, off, world_size, grad_bytes=None):
    """Per optimizer step after the first: streamed minus boundary-stepped NVMe bytes is
    what the estimator predicts streaming saves."""
    cfg = runs[on]["config"]
    A = cfg.get("gradient_accumulation_steps", 1)
    clip = cfg.get("gradient_clipping", 0.0)
    dt = cfg.get("gradient_accumulation_dtype", "fp32")
    for r in res:
        a, b = r.result["runs"][on], r.result["runs"][off]
        shard = a["shard_numel"]
        s = _predicted_grad_bytes(shard, world_size, A, True, clip, dt)
        n = _predicted_grad_bytes(shard, world_size, A, False, clip, dt)
        for pa, pb in zip(a["per_step"][1:], b["per_step"][1:]):
            saved = pa["optimizer_master_read_bytes_saved"]    # (Note [Master hand-off])
            assert pb["nvme_write_bytes"] - pa["nvme_write_bytes"] == \
                n["nvme_write"] - s["nvme_write"], (on, r.rank, pa, pb, s, n)
            assert pb["nvme_read_bytes"] - pa["nvme_read_bytes"] - saved == \
                n["nvme_read"] - s["nvme_read"], (on, r.rank, pa, pb, s, n)
            if grad_bytes is not None:    # the streamed run's gradient bytes themselves
                for link in ("nvme_read", "nvme_write"):
                    assert grad_bytes(pa, link, shard) == s[link], (on, r.rank, link, pa, s)
        # the prediction is not vacuous: streaming saves the final sums' read back and
        # their write (with clipping too: fp32 moments, a redo recovers the shard from them,
        # Note [Redo from moments])
        assert n["nvme_read"] - s["nvme_read"] == 4 * shard
        assert n["nvme_write"] - s["nvme_write"] == 4 * shard


def test_streamed_shards_2_ranks(tmp_path):
    """Stage 3 streamed (nvme params, accumulation; cpu params with a never-binding clip)
    against the same runs stepping at the boundary, bytes and parity; stage 2 spilled at
    parity (nothing is paged there: nothing streams)."""
    runs, res = _spawn(tmp_path, [(3, "nvme", "gas"), (3, "nvme", "gas", "off"),
                                  (3, "cpu", "loose"), (3, "cpu", "loose", "off"),
                                  (2, "cpu", "gas")], world_size=2)
    _check_bytes(runs, res, "s3-nvme-gas", "s3-nvme-gas-off", 2)
    _check_bytes(runs, res, "s3-cpu-loose", "s3-cpu-loose-off", 2)


def test_streamed_shards_clipped_and_simulated_device_2_ranks(tmp_path):
    """Speculative steps redone clipped from the moments (fp32; nothing written for them);
    the simulated separate
    device (each shard reaches the host by D2H), bytes against the boundary step."""
    runs, res = _spawn(tmp_path, [(3, "nvme", "clip", "gas"), (3, "cpu", "sim", "gas"),
                                  (3, "cpu", "sim", "gas", "off")], world_size=2)
    _check_bytes(runs, res, "s3-cpu-gas-sim", "s3-cpu-gas-off-sim", 2)


def test_streamed_shards_bf16_partial_sums_2_ranks(tmp_path):
    """gradient_accumulation_dtype bf16 across ranks: the partial sums between micro-steps
    make their round trip in bf16 (half the bytes), the final sum is streamed; the
    gradient bytes are the estimator's (params and optimizer states in host memory: the
    only NVMe traffic is the gradients')."""
    runs, res = _spawn(tmp_path, [(3, "cpu", "gas", "bf16acc"),
                                  (3, "cpu", "gas", "bf16acc", "off")], world_size=2)
    _check_bytes(runs, res, "s3-cpu-bf16acc-gas", "s3-cpu-bf16acc-gas-off", 2,
                 grad_bytes=lambda p, link, shard: p[link + "_bytes"] - 8 * shard)


@pytest.mark.slow   # (the 2-rank variant runs by default)
def test_streamed_shards_4_ranks(tmp_path):
    runs, res = _spawn(tmp_path, [(3, "nvme", "clip", "gas"), (3, "nvme", "gas"),
                                  (3, "nvme", "gas", "off")], world_size=4)
    _check_bytes(runs, res, "s3-nvme-gas", "s3-nvme-gas-off", 4)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_streamed_shards_matrix(tmp_path, world_size):
    combos = []
    for home in ("cpu", "nvme"):
        for flags in ((), ("gas",), ("clip",), ("clip", "gas"), ("loose", "gas"),
                      ("sim", "clip", "gas"), ("sim", "gas")):
            combos.append((3, home) + flags)
    combos += [(2, "cpu", "clip", "gas"), (2, "cpu", "sim", "gas")]
    _spawn(tmp_path, combos, world_size=world_size)


def test_rank_failing_in_a_streamed_step_commits_nothing(tmp_path):
    cfg = {"zero_stage": 3, "dist_timeout_s": FAIL_TIMEOUT_S,
           "offload": {"params": "nvme", "optimizer": "nvme",
                       "nvme_paths": [str(tmp_path / "swap")]}}
    res = run_ranks("overlap_failure_child.py", {"config": cfg, "fail_rank": 1, "mode": "step",
                                                 "spill": True}, tmp_path, timeout=180)
    for r in res:
        assert r.result is not None, r
        assert r.result["raised"], f"rank {r.rank} did not fail: {r}"
        assert r.result["unchanged"] and r.result["global_steps_unchanged"], r.result
    assert res[1].result["kept"] > 0 and res[1].result["overlapped"] > 0, res[1].result
    assert "injected overlapped step failure" in res[1].result["raised"], res[1].result
    assert "CollectiveError" in res[0].result["raised"], res[0].result
