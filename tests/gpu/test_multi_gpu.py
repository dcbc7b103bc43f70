"""All the GPUs of the node (``make test-gpu``; skipped with fewer than 2): ZeRO stages 1-3
x parameter homes x fp32/bf16, one rank per GPU as ``torchrun --nproc-per-node <GPUs>``
runs them (the model built on CPU and placed on ``cuda:LOCAL_RANK`` by the engine; the
process group ``"cpu:gloo,cuda:nccl"`` created by ``initialize``): fp32 within 1e-5 of
single-process torch AdamW on the global batch, bf16 within 3e-2 of it; device-tier
traffic, the peak within the budget on every rank."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "zero"))
from test_stages import BATCH, STEPS, base_config, check_run, reference  # noqa: E402
from zero_harness import run_ranks_ok  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason="needs at least 2 CUDA devices")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_every_gpu_of_the_node(tmp_path, stage):
    runs = []
    for home in ("none", "cpu", "nvme"):
        for precision in ("fp32", "bf16"):
            cfg = base_config(stage, home, str(tmp_path / f"swap-{home}-{precision}"),
                              precision=precision)
            runs.append({"name": f"s{stage}-{home}-{precision}", "model": "awkward",
                         "steps": STEPS, "batch": BATCH, "config": cfg, "init": False,
                         "pg_by_initialize": True})
    res = run_ranks_ok("dist_child.py", {"runs": runs, "pg_by_initialize": True}, tmp_path,
                       world_size=torch.cuda.device_count(), timeout=900)
    prefix = str(tmp_path / [d for d in os.listdir(tmp_path) if d.startswith("ranks-")][0] /
                 "rank0.json")
    for run in runs:
        name, cfg = run["name"], run["config"]
        for r in res:
            st = r.result["runs"][name]
            assert st["device_kind"] == "cuda", (name, st)
            assert st["h2d_bytes"] > 0 and st["d2h_bytes"] > 0, (name, st)
            assert st["device_budget_overflows"] == 0, (name, st)
            assert 0 < st["device_peak_bytes"] <= st["device_cap_bytes"], (name, st)
        if cfg["precision"] == "fp32":
            check_run(res, prefix, name, cfg)
        else:
            ref, _ = reference({**cfg, "precision": "fp32"})
            for a, b in zip(res[0].result["runs"][name]["losses"], ref):
                assert abs(a - b) <= 3e-2 * abs(b), (name, a, b)
