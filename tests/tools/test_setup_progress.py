"""scripts/setup.sh reports progress during its long steps (installing torch is ~2 minutes
on a fresh machine) instead of minutes of silence."""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETUP = os.path.join(REPO, "scripts", "setup.sh")


def _progress(cmd):
    script = f'source "{SETUP}"; progress "installing torch (about 2 minutes)" {cmd}; echo "rc=$?"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, INFINITY_PROGRESS_EVERY="1"))


def test_long_step_prints_progress_and_its_duration():
    r = _progress("sleep 3.5")
    lines = r.stderr.splitlines()
    assert lines[0] == "[setup] installing torch (about 2 minutes) ..."
    still = [line for line in lines if "still installing torch" in line]
    assert len(still) >= 2, r.stderr                 # one line per second of silence
    # (bash's SECONDS counts whole seconds: the first 1 s wait can span two of them)
    assert still[0].endswith(("(1 s)", "(2 s)")) and \
        lines[-1].startswith("[setup]   done: installing torch (")
    assert r.stdout.strip() == "rc=0"


def test_failure_status_is_kept_and_said():
    r = _progress("false")
    assert r.stdout.strip() == "rc=1" and "FAILED: installing torch (exit 1)" in r.stderr


def test_sourcing_runs_nothing():
    r = subprocess.run(["bash", "-c", f'source "{SETUP}"; type progress >/dev/null && echo ok'],
                       capture_output=True, text=True, timeout=30, cwd="/")
    assert r.stdout.strip() == "ok" and r.stderr == ""
