"""Smoke test of `infinity bench-adam` (tiny size: checks it runs and reports, not speed)."""
import json

from infinity.cli.main import main


def test_bench_adam_json(capsys):
    rc = main(["bench-adam", "--numel", "40000", "--rounds", "1", "--skip-foreach", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    f = res["fp32"]
    assert set(f["median_s"]) == {"infinity", "fused", "roofline"}
    assert all(t > 0 for t in f["median_s"].values())
    assert f["speedup_vs_fused"] > 0 and f["fraction_of_roofline"] > 0
    assert res["mixed_bf16"]["speedup_vs_torch"] > 0
    assert set(res["targets"]) == {"fp32_vs_fused>=0.95", "fp32_roofline>=0.85", "mixed_vs_torch>=1.5"}


def test_bench_adam_rejects_bad_numel(capsys):
    assert main(["bench-adam", "--numel", "0"]) == 2
    assert "--numel" in capsys.readouterr().err


def test_bench_adam_rejects_zero_threads(capsys):
    # 0 used to fall back silently to the default thread count
    assert main(["bench-adam", "--numel", "1000", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err
