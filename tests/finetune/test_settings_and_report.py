"""Config precedence, bench-io pick-up, JSON-lines output and link byte accounting."""
import io
import json

import pytest

from infinity.finetune.report import LINKS, Reporter, link_bytes
from infinity.finetune.settings import SettingsError, build_config, find_bench_io_result


def test_defaults_home_params_and_optimizer_on_nvme(tmp_path, monkeypatch):
    monkeypatch.delenv("INFINITY_BENCH_IO", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg, notes = build_config()
    assert cfg["offload"]["params"] == "nvme" and cfg["offload"]["optimizer"] == "nvme"
    assert cfg["offload"]["nvme_paths"] == ["./infinity-swap"]
    assert notes == []


def test_precedence_file_then_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("INFINITY_BENCH_IO", raising=False)
    f = tmp_path / "c.yaml"
    f.write_text("offload:\n  params: cpu\n  nvme_paths: [/tmp/a]\noptimizer:\n  lr: 0.01\n"
                 "aio:\n  queue_depth: 8\n")
    cfg, _ = build_config(config_path=str(f))
    assert cfg["offload"]["params"] == "cpu" and cfg["offload"]["optimizer"] == "nvme"
    assert cfg["optimizer"]["lr"] == 0.01 and cfg["offload"]["nvme_paths"] == ["/tmp/a"]
    cfg, _ = build_config(config_path=str(f), nvme_paths=[str(tmp_path / "x"), str(tmp_path / "y")],
                          lr=0.5)
    assert cfg["offload"]["nvme_paths"] == [str(tmp_path / "x"), str(tmp_path / "y")]
    assert cfg["optimizer"]["lr"] == 0.5 and cfg["aio"]["queue_depth"] == 8


def test_state_dtype_flag_overrides_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("INFINITY_BENCH_IO", raising=False)
    cfg, _ = build_config(use_bench_io=False)
    assert "state_dtype" not in cfg["optimizer"]         # the library default (fp32) applies
    f = tmp_path / "c.json"
    f.write_text('{"optimizer": {"state_dtype": "bf16", "lr": 0.01}}')
    cfg, _ = build_config(config_path=str(f), use_bench_io=False)
    assert cfg["optimizer"]["state_dtype"] == "bf16" and cfg["optimizer"]["lr"] == 0.01
    cfg, _ = build_config(config_path=str(f), state_dtype="fp32", use_bench_io=False)
    assert cfg["optimizer"]["state_dtype"] == "fp32" and cfg["optimizer"]["lr"] == 0.01
    from infinity.config import ConfigError
    with pytest.raises(ConfigError, match="optimizer.state_dtype"):
        build_config(state_dtype="fp16", use_bench_io=False)


def test_bad_config_files(tmp_path):
    from infinity.config import ConfigError
    f = tmp_path / "c.json"
    f.write_text("{bad json")
    with pytest.raises(SettingsError, match="not valid JSON"):
        build_config(config_path=str(f))
    f.write_text('{"offload": {"paramz": "nvme"}}')
    with pytest.raises(ConfigError, match="paramz"):
        build_config(config_path=str(f))
    with pytest.raises(SettingsError, match="cannot read"):
        build_config(config_path=str(tmp_path / "missing.json"))


def test_bench_io_result_is_picked_up_and_config_file_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("INFINITY_BENCH_IO", raising=False)
    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / "bench-io.json").write_text(json.dumps(
        {"aio": {"engine": "posix", "block_size": 262144, "queue_depth": 64, "threads": 2},
         "results": []}))
    assert find_bench_io_result([str(swap)])[1]["queue_depth"] == 64
    cfg, notes = build_config(nvme_paths=[str(swap)])
    assert cfg["aio"] == {"engine": "posix", "block_size": 262144, "queue_depth": 64, "threads": 2}
    assert notes and "bench-io.json" in notes[0]
    f = tmp_path / "c.json"
    f.write_text('{"aio": {"queue_depth": 4}}')
    cfg, _ = build_config(config_path=str(f), nvme_paths=[str(swap)])
    assert cfg["aio"]["queue_depth"] == 4 and cfg["aio"]["block_size"] == 262144
    cfg, notes = build_config(nvme_paths=[str(swap)], use_bench_io=False)
    assert "aio" not in cfg and not notes
    other = tmp_path / "elsewhere.json"
    other.write_text(json.dumps({"aio": {"threads": 3}}))
    monkeypatch.setenv("INFINITY_BENCH_IO", str(other))
    assert find_bench_io_result([str(swap)]) == (str(other), {"threads": 3})


def test_link_bytes_shapes():
    assert link_bytes({"links": {"nvme_read": {"bytes": 5, "seconds": 1.0}}})["nvme_read"] == 5
    assert link_bytes({"links": {"h2d": 7}})["h2d"] == 7
    assert link_bytes({"nvme_write_bytes": 9})["nvme_write"] == 9
    assert link_bytes(None) == {k: 0 for k in LINKS}


def _rec(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.5, "tokens": 100,
            "tokens_per_s": 1000.0, "step_time_s": 0.1,
            "bytes": {k: (step * 10 if k == "nvme_read" else 0) for k in LINKS},
            "gbps": {k: 0.0 for k in LINKS}}


def test_json_lines_only_on_stdout():
    out, err = io.StringIO(), io.StringIO()
    r = Reporter(total_steps=3, json_lines=True, stdout=out, stderr=err, progress=False)
    r.info("hello")
    for s in (1, 2, 3):
        r.step(_rec(s, 4.0 - s))
    text = r.summary()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    recs = [json.loads(line) for line in lines]
    assert [x["step"] for x in recs] == [1, 2, 3]
    for x in recs:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
                    "nvme_read_bytes", "nvme_write_bytes", "h2d_bytes", "d2h_bytes"):
            assert key in x
    assert recs[1]["nvme_read_bytes"] == 20
    assert "hello" in err.getvalue() and "summary" in err.getvalue() and text in err.getvalue()
    assert "3.0000 -> 1.0000" in text and "60 B total" in text


def test_disabled_reporter_prints_nothing():
    out, err = io.StringIO(), io.StringIO()
    r = Reporter(total_steps=1, json_lines=True, enabled=False, stdout=out, stderr=err)
    r.step(_rec(1, 1.0))
    r.summary()
    assert out.getvalue() == "" and err.getvalue() == ""
