"""doctor_checks and the `infinity bench-io` command line."""
import json
import os
import subprocess
import sys

import pytest

from infinity.io import doctor_checks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INFINITY = [sys.executable, "-m", "infinity"]


def test_doctor_checks_shape_and_path(tmp_path):
    checks = doctor_checks(str(tmp_path / "not-yet"))
    names = [c["name"] for c in checks]
    assert names == ["liburing build", "io_uring", "O_DIRECT", "free space", "RLIMIT_MEMLOCK",
                     "transparent huge pages"]
    for c in checks:
        assert set(c) == {"name", "ok", "detail", "fix"} and isinstance(c["ok"], bool)
        if not c["ok"]:
            assert c["fix"]
    odirect = checks[2]
    assert odirect["ok"], odirect  # tmp_path is on ext4 here
    assert "alignment" in odirect["detail"]
    assert os.listdir(tmp_path) == []  # the probe file was anonymous


def test_doctor_reports_unwritable_path(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    odirect = doctor_checks(str(blocker / "swap"))[2]
    assert not odirect["ok"] and odirect["fix"]


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(INFINITY + args, capture_output=True, text=True, env=env, timeout=300, **kw)


def test_bench_io_json_one_line(tmp_path):
    r = _run(["bench-io", "--path", str(tmp_path / "s"), "--size-mb", "8", "--repeats", "2", "--json"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    for k in ("engine", "direct", "read_gbps", "write_gbps", "block_size", "queue_depth", "threads",
              "size_bytes"):
        assert k in d
    assert d["engine"] in ("uring", "posix") and d["direct"] is True
    assert d["size_bytes"] == 8 << 20 and d["block_size"] == 1 << 20 and d["queue_depth"] == 32
    assert d["read_gbps"] > 0 and d["write_gbps"] > 0 and d["verified"] is True
    assert "round" in r.stderr  # progress on stderr
    assert not (tmp_path / "s").exists()  # nothing left behind


def _run_inproc(args, capsys):
    """Runs the bench-io subcommand in this process (saves a torch import per test)."""
    import argparse
    from types import SimpleNamespace

    from infinity.cli import bench_io
    from infinity.cli.main import CLIError
    p = argparse.ArgumentParser()
    bench_io.register(p.add_subparsers())
    ns = p.parse_args(args)
    try:
        rc = ns.func(ns)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        rc = 2
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def test_bench_io_sweep_saves_best(tmp_path, capsys):
    swap = tmp_path / "s"
    r = _run_inproc(["bench-io", "--path", str(swap), "--size-mb", "4", "--repeats", "1", "--sweep",
              "--sweep-block-kb", "256,1024", "--sweep-queue-depths", "4", "--sweep-threads", "1",
              "--engine", "posix", "--save"], capsys)
    assert r.returncode == 0, r.stderr
    saved = json.loads((swap / "bench-io.json").read_text())
    assert len(saved["results"]) == 2
    assert saved["aio"]["engine"] == "posix" and saved["aio"]["queue_depth"] == 4
    assert saved["aio"]["block_size"] in (256 << 10, 1 << 20)
    assert '"aio"' in r.stdout and "[2/2]" in r.stderr
    assert sorted(os.listdir(swap)) == ["bench-io.json"]


def test_bench_io_bad_path(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    r = _run_inproc(["bench-io", "--path", str(tmp_path / "f" / "s"), "--size-mb", "1", "--json"], capsys)
    assert r.returncode == 2 and r.stdout == ""
    assert "not a directory" in r.stderr.lower() or "cannot create" in r.stderr


@pytest.mark.slow
def test_build_without_liburing(tmp_path):
    """A build without liburing compiles the POSIX engine only and says so."""
    env = dict(os.environ, INFINITY_NO_URING="1", INFINITY_BUILD_ONLY="_aio")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "tmp")], cwd=REPO, capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "POSIX I/O engine only" in r.stderr
    code = ("import importlib.util, sys, glob; p = glob.glob(sys.argv[1] + '/infinity/_aio*.so')[0]; "
            "s = importlib.util.spec_from_file_location('infinity._aio', p); m = importlib.util.module_from_spec(s); "
            "s.loader.exec_module(m); print(m.built_with_liburing(), m.uring_probe())")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "lib")], capture_output=True, text=True)
    assert r.stdout.split() == ["False", "38"], r.stderr  # ENOSYS


def test_doctor_transparent_huge_pages_modes(tmp_path):
    from infinity.io.doctor import _thp_check
    f = tmp_path / "enabled"
    for text, ok in [("always [madvise] never", True), ("[always] madvise never", True),
                     ("always madvise [never]", False)]:
        f.write_text(text + "\n")
        c = _thp_check(str(f))
        assert c["ok"] is ok, c
        assert ok or ("echo madvise >" in c["fix"] and "never" in c["detail"])
    c = _thp_check(str(tmp_path / "missing"))
    assert c["ok"] and "cannot read" in c["detail"]


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    return mount_tmpfs("16m")


def _doctor(args, capsys):
    import argparse

    from infinity.cli import doctor
    p = argparse.ArgumentParser()
    doctor.register(p.add_subparsers())
    ns = p.parse_args(["doctor", *args])
    rc = ns.func(ns)
    out = capsys.readouterr().out
    return rc, next(line for line in out.splitlines() if "free space" in line), out


def test_doctor_free_space_against_need_and_readable_sizes(small_tmpfs, capsys):
    """16 MB free: judged against --need (not a fixed 10 GB) and printed as MB, not '0.0 GB'."""
    swap = str(small_tmpfs / "swap")
    rc, line, _ = _doctor(["--nvme-path", swap, "--need", "10MB"], capsys)
    assert line.startswith("[ok  ]"), line
    assert "16.8 MB free" in line and "10.0 MB needed" in line and "0.0 GB" not in line
    rc, line, out = _doctor(["--path", swap, "--need", "20GB"], capsys)   # --path: the alias
    assert rc == 1 and line.startswith("[FAIL]") and "20.0 GB needed" in line
    assert "fix: free 20.0 GB there" in out or "fix: free 19.9 GB there" in out
    assert "own model's need" not in out      # the need was given: no advice to give one


def test_doctor_default_need_is_what_finetune_defaults_need(small_tmpfs, capsys):
    from infinity.cli.doctor import finetune_default_need
    from infinity.io.doctor import format_bytes
    need = finetune_default_need()
    # tiny-llama (5.13 M params) with params + optimizer on NVMe: Init copy 4 B + param home
    # 4 B + Adam m, v 8 B + commit shadows of m, v and the fp32 master 12 B per parameter,
    # page-rounded per parameter/group
    assert 28 * 5_128_000 <= need < 28 * 5_128_000 * 1.02
    rc, line, out = _doctor(["--nvme-path", str(small_tmpfs)], capsys)
    assert rc == 1 and line.startswith("[FAIL]")
    assert f"{format_bytes(need)} needed (by `infinity finetune` with its defaults" in line
    assert "your own model's need with --need SIZE" in out      # the fix says how to give yours


def test_bench_io_takes_nvme_path(tmp_path, capsys):
    r = _run_inproc(["bench-io", "--nvme-path", str(tmp_path / "s"), "--size-mb", "1",
                     "--repeats", "1", "--json"], capsys)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["size_bytes"] == 1 << 20
