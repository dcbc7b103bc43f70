"""`infinity finetune` runs in-process (``infinity.finetune.run.finetune``, what the CLI
calls): pretrained weights, save/resume, profile. Child-process behaviour (stdout,
signals, exit codes) is in test_finetune_cli.py."""
import io
import json

import pytest
import torch

pytest.importorskip("infinity.engine", reason="the offload engine is not in this build yet")

from infinity.finetune.run import FinetuneOptions, finetune  # noqa: E402


def _run(tmp_path, swap, **kw):
    out, err = io.StringIO(), io.StringIO()
    opts = FinetuneOptions(**dict(dict(nvme_paths=[str(tmp_path / swap)], batch_tokens=256,
                                       seq_len=64, json_lines=True), **kw))
    res = finetune(opts, reporter_streams={"stdout": out, "stderr": err})
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["step"] for r in recs] == [r["step"] for r in res["records"]]
    return recs, err.getvalue(), res


def _no_files(path):
    return not any(p.is_file() for p in path.rglob("*")) if path.exists() else True


def test_pretrained_directory_starts_from_its_weights(tmp_path, tiny_config):
    """Step 1's loss equals the saved model's loss on batch 0: the weights were streamed in."""
    from infinity.data import ByteTokenizer, TokenBatcher, load_texts
    from infinity.finetune.model import resolve_model

    torch.manual_seed(123)
    model, _ = resolve_model(tiny_config("gpt2"))
    with torch.no_grad():  # make it clearly not a fresh init
        model.transformer.wte.weight.mul_(3.0)
    d = tmp_path / "pretrained"
    model.save_pretrained(str(d), safe_serialization=True)
    x = TokenBatcher(load_texts(None), ByteTokenizer(), seq_len=64, batch_size=2, seed=0).batch(0)
    with torch.no_grad():
        expected = model(input_ids=x, labels=x).loss.item()
    recs, _, _ = _run(tmp_path, "swap", model=str(d), steps=2, batch_tokens=128)
    assert recs[0]["loss"] == pytest.approx(expected, rel=1e-4)
    assert _no_files(tmp_path / "swap")


def test_save_and_resume_continue_the_loss_curve(tmp_path, tiny_config):
    from infinity.engine import Engine

    if not hasattr(Engine, "save_checkpoint"):
        pytest.skip("engine.save_checkpoint is not in this build yet")
    model = tiny_config("llama")
    full, _, _ = _run(tmp_path, "s1", model=model, steps=6)
    ck = tmp_path / "ck"
    first, _, res = _run(tmp_path, "s2", model=model, steps=3, save=str(ck), save_every=1, keep_last=2)
    assert res["result"].saved == ["step-00000001", "step-00000002", "step-00000003"]
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == \
        ["step-00000002", "step-00000003"]
    assert (ck / "latest").read_text().strip() == "step-00000003"
    resumed, err, _ = _run(tmp_path, "s2", model=model, steps=6, save=str(ck), resume=True)
    ref = [x["loss"] for x in full]
    assert [x["step"] for x in resumed] == [4, 5, 6]
    assert [x["loss"] for x in first] == pytest.approx(ref[:3], rel=1e-5)
    assert [x["loss"] for x in resumed] == pytest.approx(ref[3:], rel=1e-4)
    assert (ck / "latest").read_text().strip() == "step-00000006"
    assert _no_files(tmp_path / "s1") and _no_files(tmp_path / "s2")
    # a damaged checkpoint is a clear error, not a traceback or a silent restart
    from infinity.finetune.run import FinetuneError
    man = ck / "step-00000006" / "manifest.json"
    man.write_text(man.read_text().replace('"world_size"', '"world_size" ', 1).replace("1", "2", 1))
    with pytest.raises(FinetuneError, match="--resume"):
        _run(tmp_path, "s3", model=model, steps=7, save=str(ck), resume=True)
    assert _no_files(tmp_path / "s3")


def test_profile_dir_gets_a_trace_and_a_plot(tmp_path, tiny_config):
    """--profile writes a trace with the link and compute lanes, a PNG and a summary whose
    GB/s ceilings come from the bench-io result saved in the swap path."""
    prof = tmp_path / "prof" / "run1"
    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / "bench-io.json").write_text(json.dumps(
        {"aio": {"block_size": 1 << 20, "queue_depth": 32},
         "results": [{"read_gbps": 2.5, "write_gbps": 1.5},
                     {"read_gbps": 1.0, "write_gbps": 0.5}]}))
    recs, err, _ = _run(tmp_path, "swap", model=tiny_config("llama"), steps=2, batch_tokens=128,
                        profile=str(prof))
    assert len(recs) == 2
    files = sorted(p.name for p in prof.iterdir())
    traces = [f for f in files if f.endswith(".json")]
    pngs = [f for f in files if f.endswith(".png")]
    assert traces and pngs, files
    docs = {t: json.loads((prof / t).read_text()) for t in traces}
    assert (prof / pngs[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = next(d for t, d in docs.items() if "summary" in t)
    assert summary["ceilings_gbps"] == {"nvme_read": 2.5, "nvme_write": 1.5}, summary
    trace = next(d for t, d in docs.items() if "summary" not in t)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
    lanes |= {e.get("cat") for e in events if e.get("ph") == "X"}
    for lane in ("nvme_read", "nvme_write", "forward", "backward", "optimizer"):
        assert lane in lanes, (lane, sorted(x for x in lanes if x))
    assert [p.name for p in swap.rglob("*") if p.is_file()] == ["bench-io.json"]
    # 2 steps, --profile-skip 1 (the default): only step 2 is in the profile, and it says so
    # (the engine marks the end of each optimizer step; the loop adds no second mark)
    assert [(r["step"], r.get("before_step")) for r in summary["steps"]][:1] == [(None, 2)]
    assert all(r["step"] in (None, 2) for r in summary["steps"])
    assert summary["covers"] == {"first": 2, "last": 2, "count": 1}
    text = next(prof.glob("summary*.txt")).read_text()
    assert "Covers: step 2; step 1 left out as warm-up (--profile-skip 1" in text


def test_profile_skip_leaves_warm_up_steps_out(tmp_path, tiny_config):
    """--profile-skip 0 keeps step 1 (all on-demand fetches: a lower hit rate); the default
    leaves it out, so the hit rate covers steps 2.. and the summary names them."""
    hit = {}
    for skip in (0, 1):
        prof = tmp_path / f"prof{skip}"
        _run(tmp_path, "swap", model=tiny_config("llama"), steps=3, batch_tokens=128,
             profile=str(prof), profile_skip=skip)
        s = json.loads(next(prof.glob("summary*.json")).read_text())
        assert s["covers"]["first"] == 1 + skip and s["covers"]["last"] == 3
        hit[skip] = s["prefetch"]["hit_rate"]
        text = next(prof.glob("summary*.txt")).read_text()
        assert f"over steps {1 + skip}-3" in text
        assert ("left out as warm-up" in text) == (skip == 1)
    assert hit[1] > hit[0], hit


def _save_bpe_tokenizer(directory, texts, vocab_size=300):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(directory)


def test_pretrained_directory_uses_its_own_tokenizer(tmp_path, tiny_config):
    from infinity.data import HFTokenizer, TokenBatcher, load_texts
    from infinity.finetune.model import resolve_model

    texts = load_texts(None)
    d = tmp_path / "pretrained"
    torch.manual_seed(5)
    model, _ = resolve_model(tiny_config("llama", vocab_size=300))
    model.save_pretrained(str(d), safe_serialization=True)
    _save_bpe_tokenizer(str(d), [texts[0][:50000]])
    tok = HFTokenizer(str(d))
    assert tok.decode(tok.encode("To be, or not to be")) == "To be, or not to be"
    x = TokenBatcher(texts, tok, seq_len=64, batch_size=2, seed=0).batch(0)
    assert int(x.max()) >= 259  # merged tokens beyond the byte range: not the byte tokenizer
    with torch.no_grad():
        expected = model(input_ids=x, labels=x).loss.item()
    recs, err, _ = _run(tmp_path, "swap", model=str(d), steps=1, batch_tokens=128)
    assert "tokenizer " + str(d) in err
    assert recs[0]["loss"] == pytest.approx(expected, rel=1e-4)
    # --tokenizer byte overrides the directory's tokenizer
    recs_b, err_b, _ = _run(tmp_path, "swap", model=str(d), steps=1, batch_tokens=128,
                            tokenizer="byte")
    assert "tokenizer byte-level" in err_b and recs_b[0]["loss"] != pytest.approx(expected, rel=1e-4)
