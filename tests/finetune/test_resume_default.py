"""Resume by default: the same command after a stop continues the run (same losses and
weights as an uninterrupted one), another run with the same --save is refused naming what
differs, --restart moves the old checkpoints into previous-*/ and starts at step 1."""
import io
import json
import shlex
import signal
import subprocess

import pytest

pytest.importorskip("infinity.engine", reason="the offload engine is not in this build yet")

from infinity.finetune.run import FinetuneError, FinetuneOptions, finetune  # noqa: E402


def _run(tmp_path, **kw):
    out, err = io.StringIO(), io.StringIO()
    opts = FinetuneOptions(**dict(dict(nvme_paths=[str(tmp_path / "swap")], batch_tokens=256,
                                       seq_len=64, json_lines=True), **kw))
    res = finetune(opts, reporter_streams={"stdout": out, "stderr": err})
    return [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue(), res


def _stop_after(monkeypatch, n):
    """Simulate Ctrl-C: a graceful stop requested at the boundary after step ``n``."""
    from infinity.finetune import stop as stop_mod

    orig = stop_mod.GracefulStop.should_stop
    calls = []

    def should_stop(self, *a, **kw):
        calls.append(1)
        if len(calls) == n + 1:
            self.request("SIGINT")
        return orig(self, *a, **kw)

    monkeypatch.setattr(stop_mod.GracefulStop, "should_stop", should_stop)


def _tensors(directory):
    from safetensors.torch import load_file
    return load_file(str(directory / "model.safetensors"))


def test_stop_then_same_command_resumes_to_the_uninterrupted_result(tmp_path, tiny_config,
                                                                    monkeypatch):
    model = tiny_config("llama")
    full, _, _ = _run(tmp_path, model=model, steps=5, output=str(tmp_path / "o-full"))
    ck, out = tmp_path / "ck", tmp_path / "o"
    kw = dict(model=model, steps=5, save=str(ck), output=str(out), command="infinity finetune X")
    with monkeypatch.context() as m:
        _stop_after(m, 2)
        first, err, res = _run(tmp_path, **kw)
    assert [r["step"] for r in first] == [1, 2]
    assert "stopped cleanly after step 2" in res["result"].stop_reason
    assert "resume" in err and "infinity finetune X" in err  # the command that continues
    rest, err, res = _run(tmp_path, **kw)  # the same command again
    assert "resuming from step 2" in err
    assert [r["step"] for r in rest] == [3, 4, 5]
    assert [r["loss"] for r in first + rest] == pytest.approx([r["loss"] for r in full], rel=1e-4)
    assert (ck / "latest").read_text().strip() == "step-00000005"
    a, b = _tensors(tmp_path / "o-full"), _tensors(out)  # --output holds the continued model
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].float().sub(a[k].float()).abs().max().item() < 1e-4, k
    # the checkpoints record the run; --steps may grow: a larger value extends the run
    more, err, _ = _run(tmp_path, **dict(kw, steps=6))
    assert [r["step"] for r in more] == [6] and "resuming from step 5" in err
    # without --save a stop says how to make a run resumable
    with monkeypatch.context() as m:
        _stop_after(m, 1)
        _, err, _ = _run(tmp_path, model=model, steps=3)
    assert "not resumable: no --save DIR" in err


def test_another_run_with_the_same_save_is_refused_naming_the_difference(tmp_path, tiny_config):
    model = tiny_config("llama")
    ck = tmp_path / "ck"
    _run(tmp_path, model=model, steps=2, save=str(ck))
    before = sorted(p.name for p in ck.iterdir())
    with pytest.raises(FinetuneError, match=r"different run.*learning rate \(--lr / "
                       r"optimizer\.lr\): 0\.003 in the checkpoints, 0\.01 now.*--restart.*"
                       r"previous-<UTC time>.*another --save"):
        _run(tmp_path, model=model, steps=4, save=str(ck), lr=1e-2)
    data = tmp_path / "data.txt"
    data.write_text("some other text to train on. " * 400)
    with pytest.raises(FinetuneError, match=r"data \(--data\): shipped corpus in the "
                       r"checkpoints, .*data\.txt now"):
        _run(tmp_path, model=model, steps=4, save=str(ck), data=str(data))
    with pytest.raises(FinetuneError, match=r"sequence length \(--seq-len\): 64 in the "
                       r"checkpoints, 32 now"):
        _run(tmp_path, model=model, steps=4, save=str(ck), seq_len=32)
    with pytest.raises(FinetuneError, match="different run"):  # --resume too
        _run(tmp_path, model=model, steps=4, save=str(ck), lr=1e-2, resume=True)
    assert sorted(p.name for p in ck.iterdir()) == before  # nothing moved or written
    # the data file changing under the same path is another run too
    _run(tmp_path, model=model, steps=1, save=str(tmp_path / "ck2"), data=str(data))
    data.write_text("changed text. " * 500)
    with pytest.raises(FinetuneError, match=r"data \(--data\) .*data\.txt changed since the "
                       r"checkpoints were written \(.*size.*\)"):
        _run(tmp_path, model=model, steps=2, save=str(tmp_path / "ck2"), data=str(data))


def test_restart_moves_old_checkpoints_aside_and_starts_at_step_1(tmp_path, tiny_config):
    model = tiny_config("llama")
    ck = tmp_path / "ck"
    _run(tmp_path, model=model, steps=2, save=str(ck), save_every=1)
    with pytest.raises(FinetuneError, match="--restart and --resume"):
        _run(tmp_path, model=model, steps=3, save=str(ck), lr=1e-2, restart=True, resume=True)
    with pytest.raises(FinetuneError, match="--restart needs --save"):
        _run(tmp_path, model=model, steps=3, restart=True)
    recs, err, _ = _run(tmp_path, model=model, steps=3, save=str(ck), lr=1e-2, restart=True)
    assert [r["step"] for r in recs] == [1, 2, 3]
    prev = [p for p in ck.iterdir() if p.name.startswith("previous-")]
    assert len(prev) == 1 and str(prev[0]) in err
    assert sorted(p.name for p in prev[0].iterdir()) == ["latest", "step-00000001",
                                                         "step-00000002"]
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith("previous-")) == \
        ["latest", "step-00000003"]
    # the restarted run is now the one in ck: the same settings resume it
    more, err, _ = _run(tmp_path, model=model, steps=4, save=str(ck), lr=1e-2)
    assert [r["step"] for r in more] == [4]
    # a second --restart keeps the first previous-* folder and adds another
    _run(tmp_path, model=model, steps=1, save=str(ck), restart=True)
    assert len([p for p in ck.iterdir() if p.name.startswith("previous-")]) == 2


def test_cli_ctrl_c_prints_the_command_and_it_resumes(tmp_path, tiny_config, ft):
    """A real SIGINT in a child: the summary's resume command is the command line (minus
    --restart); running it continues at the next step; another --lr exits 2 naming it."""
    import time

    args = ["--model", tiny_config("llama"), "--nvme-path", str(tmp_path / "swap"),
            "--steps", "8", "--batch-tokens", "128", "--seq-len", "64", "--json",
            "--save", str(tmp_path / "ck"), "--restart"]
    proc = subprocess.Popen(ft.cmd(*args), cwd=tmp_path, env=ft.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = json.loads(proc.stdout.readline())
    assert first["step"] == 1
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    steps = [first["step"]] + [json.loads(ln)["step"] for ln in out.splitlines()]
    last = steps[-1]
    if last == 8:
        pytest.skip("the run finished before the signal arrived")
    assert f"stopped cleanly after step {last}" in err
    line = next(ln for ln in err.splitlines() if ln.startswith("resume"))
    cmd = shlex.split(line.split(None, 1)[1])
    assert cmd[-len(args) + 1:] == [a for a in args if a != "--restart"]
    time.sleep(0.1)
    r = subprocess.run(cmd, cwd=tmp_path, env=ft.env(), capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(ln)["step"] for ln in r.stdout.splitlines()] == list(range(last + 1, 9))
    assert f"resuming from step {last}" in r.stderr
    r = ft.run(*cmd[cmd.index("finetune") + 1:], "--lr", "1e-2", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "different run" in r.stderr and "learning rate" in r.stderr and "--restart" in r.stderr


def test_checkpoints_that_do_not_record_their_run_need_resume(tmp_path, tiny_config):
    """Checkpoints written before runs were recorded: refused by default (no guess), --resume
    continues from them as it always did."""
    from infinity.checkpoint import manifest as mf

    model = tiny_config("llama")
    ck = tmp_path / "ck"
    _run(tmp_path, model=model, steps=2, save=str(ck))
    path = ck / "step-00000002" / "manifest.json"
    m = json.loads(path.read_text())
    del m["meta"]["run"]
    path.write_text(mf.seal(m))
    with pytest.raises(FinetuneError, match="do not record which run wrote them.*--resume.*"
                       "--restart"):
        _run(tmp_path, model=model, steps=3, save=str(ck))
    recs, err, _ = _run(tmp_path, model=model, steps=3, save=str(ck), resume=True)
    assert [r["step"] for r in recs] == [3] and "resuming from step 2" in err


def test_restart_failing_on_rank_0_stops_every_rank(tmp_path, tiny_config, ft):
    """Under torchrun, rank 0 moves the old checkpoints aside for --restart; when that fails
    (injected: ``move_aside`` raises on rank 0) every rank stops with an error naming the
    cause -- no rank trains alone into a collective its peer never joins."""
    import os
    import sys
    model = tiny_config("llama")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest").write_text("step-1")
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '0':\n"
        "    import infinity.finetune.checkpoints as ck\n"
        "    def move_aside(root, now=None):\n"
        "        raise PermissionError(13, 'injected: cannot move', root)\n"
        "    ck.move_aside = move_aside\n")
    env = ft.env()
    env["PYTHONPATH"] = str(inject) + os.pathsep + env["PYTHONPATH"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "infinity", "finetune", "--model", model, "--steps", "2", "--seq-len", "64",
           "--batch-tokens", "128", "--save", str(ck), "--restart",
           "--nvme-path", str(tmp_path / "swap")]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "injected: cannot move" in r.stderr, r.stderr[-3000:]
    assert "rank 0 could not move the checkpoints" in r.stderr, r.stderr[-3000:]
    assert "step 1/" not in r.stdout + r.stderr
    assert sorted(os.listdir(ck)) == ["latest"]          # nothing moved, nothing written
