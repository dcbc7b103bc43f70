"""The `infinity` entry point: --version, and a reader that closes the pipe early
(`infinity estimate --json | head -1`) ends the command quietly, without a traceback."""
import os
import subprocess
import sys

import infinity

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INFINITY = [sys.executable, "-m", "infinity"]
ENV = dict(os.environ, PYTHONPATH=REPO)
EST = ["estimate", "--params", "125M", "--layers", "12", "--hidden", "768", "--gpus", "1",
       "--host-mem", "64", "--nvme-gb", "500"]


def test_version_prints_the_package_version():
    r = subprocess.run(INFINITY + ["--version"], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"infinity {infinity.__version__}"


def _closed_early(args):
    """Run with stdout a pipe whose reader is gone before anything is written."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(INFINITY + args, stdout=w, stderr=subprocess.PIPE, text=True, env=ENV,
                           timeout=300)
    finally:
        os.close(w)
    return p


def test_closed_stdout_ends_without_broken_pipe_traceback():
    for args in (EST + ["--json"], EST, EST + ["--plan"], ["--help"]):
        p = _closed_early(args)
        assert "BrokenPipeError" not in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
        assert p.returncode in (0, 141), (args, p.returncode, p.stderr)


def test_head_one_through_a_shell_pipe():
    cmd = " ".join(INFINITY + EST + ["--explain"]) + " | head -1"
    p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert p.stdout.startswith("machine:") and "Error" not in p.stderr, p.stderr
