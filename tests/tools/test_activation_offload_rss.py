"""The activation-offload target, checked in the same run (slow): a long-sequence causal
LM with activation_offload nvme/all has a steady-state peak RSS lower than without offload
by at least 80 % of the activation bytes offloaded, with the same losses (fp32, 1e-5).
Each run is a child process of tools/bench_activation_offload.py (RSS is per process)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench_activation_offload.py")


def _child(tmp_path, home, scope):
    spec = {"seq": 2048, "hidden": 256, "layers": 16, "vocab": 4096, "batch": 1, "steps": 4,
            "warmup": 2, "threads": 1, "attn": "sdpa", "ckpt": False, "home": home,
            "scope": scope, "swap": str(tmp_path / f"swap-{home}")}
    p = subprocess.run([sys.executable, TOOL, "--child", json.dumps(spec)], capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_nvme_all_lowers_peak_rss_by_80_percent_of_offloaded_bytes(tmp_path):
    ref = _child(tmp_path, "none", "checkpoints")
    off = _child(tmp_path, "nvme", "all")
    assert off["offload_bytes"] > 0 and ref["offload_bytes"] == 0
    saved = ref["peak_above_base"] - off["peak_above_base"]
    assert saved >= 0.8 * off["offload_bytes"], (saved, off["offload_bytes"])
    assert max(abs(a - b) for a, b in zip(ref["losses"], off["losses"])) < 1e-5
