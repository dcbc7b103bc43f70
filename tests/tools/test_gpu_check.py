"""`make gpu-check` (tools/gpu_check.sh) in its dry mode, so the prepared GPU run cannot rot
between the sessions that are lent a GPU: without CUDA it builds the extensions into a
temporary directory, runs every step of ``--part core`` on the simulated device at toy
sizes, says so on its first line, writes the JSON summary and exits 0."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: the real run, not the dry one")
def test_gpu_check_dry_mode_runs_every_core_step(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path),
               INFINITY_DS_PYTHON=sys.executable)
    p = subprocess.run(["bash", SCRIPT, str(out), "--part", "core"], capture_output=True,
                       text=True, timeout=900, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    first = p.stdout.splitlines()[0]
    assert first.startswith("gpu-check: DRY MODE") and "no figure here is a GPU figure" in first
    names = sorted(os.listdir(out))
    assert len(names) <= 8 and {"log.txt", "summary.json", "extra.tar.gz"} <= set(names)
    s = json.loads((out / "summary.json").read_text())
    from importlib import util
    spec = util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tools", "gpu_check.py"))
    gc = util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    assert set(gc.SCHEMA_KEYS) <= set(s) and s["schema"] == gc.SCHEMA
    assert s["mode"] == "dry" and s["part"] == "core" and s["build"]["ok"] is True
    assert list(s["steps"]) == [name for name, _ in gc.PARTS["core"]]
    for name, step in s["steps"].items():
        assert set(gc.STEP_KEYS) <= set(step), name
        assert step["dry"] is True and step["status"] in ("ok", "skipped"), (name, step)
    # the engine's steps ran for real (on the simulated device) and were measured
    for name in ("infinity_small", "infinity_planned"):
        r = s["steps"][name]["result"]
        assert s["steps"][name]["status"] == "ok" and r["tokens_per_s"] > 0
        assert all(x == x for x in r["losses"]) and r["skipped_updates"] == 0
    assert s["steps"]["infinity_small"]["result"]["profile"]["h2d_copies"] > 0
    # DeepSpeed is not part of the project's environment: said, not faked
    ds = s["steps"]["deepspeed_small"]
    assert ds["status"] in ("ok", "skipped")
    if ds["status"] == "skipped":
        assert "deepspeed" in ds["reason"]
    for t in s["targets"].values():
        assert set(t) == {"value", "bound", "met"}
    # nothing left behind: the build and the swap lived in a temporary directory
    assert not [n for n in os.listdir(tmp_path) if n.startswith("infinity-gpu-check")]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: the real run, not the dry one")
def test_gpu_check_dry_mode_runs_the_nvme_part(tmp_path):
    """--part nvme: the model sized to the free disk with NVMe homes, trained, its NVMe bytes
    per parameter and step measured against the disk bound of this run."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path))
    p = subprocess.run(["bash", SCRIPT, str(out), "--part", "nvme"], capture_output=True,
                       text=True, timeout=900, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    r = s["steps"]["infinity_nvme"]["result"]
    assert s["steps"]["infinity_nvme"]["status"] == "ok" and r["homes"] == ["nvme", "nvme"]
    assert r["sizing"]["nvme_bytes_planned"] <= 0.8 * r["sizing"]["free_disk_bytes"]
    assert r["nvme_bytes_per_param_per_step"] > 0 and r["disk_bound_s"] > 0
