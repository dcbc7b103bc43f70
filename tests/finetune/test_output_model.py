"""What `infinity finetune` hands back: ``--output DIR`` and ``infinity export`` of its
checkpoints load with ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` as is
(byte-level tokenizer included), give the trained weights, and generate."""
import io
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("infinity.engine", reason="the offload engine is not in this build yet")

from infinity.finetune.run import FinetuneError, FinetuneOptions, finetune  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, **kw):
    out, err = io.StringIO(), io.StringIO()
    opts = FinetuneOptions(**dict(dict(nvme_paths=[str(tmp_path / "swap")], batch_tokens=128,
                                       seq_len=32, json_lines=True, use_bench_io=False), **kw))
    res = finetune(opts, reporter_streams={"stdout": out, "stderr": err})
    return res, err.getvalue()


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "infinity", *args], capture_output=True,
                          text=True, env=env, timeout=240)


def test_byte_tokenizer_files_load_with_autotokenizer_and_match(tmp_path):
    from transformers import AutoTokenizer

    from infinity.data import ByteTokenizer

    bt = ByteTokenizer()
    files = bt.save_pretrained(str(tmp_path))
    assert sorted(os.path.basename(f) for f in files) == ["tokenizer.json", "tokenizer_config.json"]
    assert all(os.path.isfile(f) for f in files)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"     # transformers 4 and 5 load it
    from tokenizers import Tokenizer                                # and without transformers:
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("héllo").ids == \
        bt.encode("héllo")
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(hf) == bt.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (bt.PAD, bt.BOS, bt.EOS)
    for text in ["Hello, world!", "  leading spaces\nand\ttabs", "héllo wörld — ☃ 日本語",
                 "\x00\x01\xff", ""]:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == bt.encode(text), text
        assert hf.decode(ids) == text
    assert hf.decode([bt.BOS, 72, 105, bt.EOS], skip_special_tokens=True) == "Hi"


def test_output_dir_loads_with_from_pretrained_and_generates(tmp_path, tiny_config):
    """The key round trip: finetune --output DIR, then plain transformers loads it and the
    weights are the trained ones (same loss as the engine's last state) and it generates."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    ck = tmp_path / "ck"
    res, _ = _run(tmp_path, model=tiny_config("llama"), steps=3, output=str(out), save=str(ck))
    assert res["result"].last_step == 3
    names = sorted(os.listdir(out))
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"):
        assert f in names, names
    assert not [n for n in os.listdir(tmp_path) if "tmp-infinity" in n or "old-infinity" in n]
    assert not (tmp_path / "swap").exists()     # the swap dir the run created is gone too
    cfg = AutoConfig.from_pretrained(str(out), local_files_only=True)
    assert cfg.model_type == "llama" and cfg.hidden_size == 64 and cfg.num_hidden_layers == 2
    assert cfg.use_cache is True
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) == \
        sum(v.numel() for v in _tensors(out / "model.safetensors").values())
    # the trained weights, not a fresh init: equal to the last checkpoint's
    from infinity.checkpoint import CheckpointReader
    with CheckpointReader(str(ck)) as r:
        w = r.read("model.embed_tokens.weight")
    assert torch.equal(model.model.embed_tokens.weight.detach(), w)
    enc = tok("To be, or not", return_tensors="pt")
    gen = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape == (1, enc["input_ids"].shape[1] + 8)
    assert isinstance(tok.decode(gen[0][enc["input_ids"].shape[1]:]), str)


def test_export_of_a_finetune_checkpoint_writes_config_and_tokenizer(tmp_path, tiny_config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ck = tmp_path / "ck"
    _, err = _run(tmp_path, model=tiny_config("gpt2"), steps=2, save=str(ck))
    assert f"not written: pass --output DIR for a directory from_pretrained loads, or " \
        f"`infinity export {ck} OUT`" in err
    from infinity.checkpoint import CheckpointReader
    with CheckpointReader(str(ck)) as r:
        meta = r.meta
    assert meta["model_config"]["model_type"] == "gpt2" and meta["model_config"]["n_embd"] == 64
    assert meta["tokenizer"] == {"kind": "byte"}
    out = tmp_path / "exported"
    r = _cli("export", str(ck), str(out))
    assert r.returncode == 0, r.stderr
    names = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.config.n_embd == 64 and model.config.n_layer == 2
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok("ab")["input_ids"] == [97, 98]
    with CheckpointReader(str(ck)) as rd:
        assert torch.equal(model.transformer.h[0].mlp.c_fc.weight.detach(),
                           rd.read("transformer.h.0.mlp.c_fc.weight"))
    # --dtype bf16: the weights and config.json agree, and it still loads
    r = _cli("export", str(ck), str(tmp_path / "bf16"), "--dtype", "bf16", "--no-tokenizer")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "bfloat16" in (cfg.get("dtype"), cfg.get("torch_dtype")), cfg
    assert not (tmp_path / "bf16" / "tokenizer.json").exists()
    m16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), local_files_only=True,
                                               dtype="auto")
    assert m16.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16


def test_hf_tokenizer_source_is_recorded_and_exported(tmp_path, tiny_config):
    """A model directory with its own tokenizer: the checkpoint records where it came from,
    --output and export copy its files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infinity.data import ByteTokenizer
    from infinity.finetune.model import resolve_model

    src = tmp_path / "src"
    model, _ = resolve_model(tiny_config("llama"))
    model.save_pretrained(str(src), safe_serialization=True)
    ByteTokenizer().save_pretrained(str(src))       # any HF tokenizer: this one is offline
    ck, out = tmp_path / "ck", tmp_path / "out"
    res, err = _run(tmp_path, model=str(src), steps=1, save=str(ck), output=str(out))
    assert "tokenizer " + str(src) in err
    from infinity.checkpoint import CheckpointReader
    with CheckpointReader(str(ck)) as r:
        assert r.meta["tokenizer"] == {"kind": "hf", "path": str(src)}
    assert AutoTokenizer.from_pretrained(str(out), local_files_only=True)("x")["input_ids"] == [120]
    AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)


def test_output_is_refused_up_front_when_not_a_model_dir(tmp_path, tiny_config):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(FinetuneError, match="non-empty directory"):
        _run(tmp_path, model=tiny_config("llama"), steps=1, output=str(busy))
    assert (busy / "notes.txt").read_text() == "mine"


def test_export_without_recorded_config_says_so(tmp_path):
    """A checkpoint from the Python API without model meta: weights only, and a note."""
    from torch import nn

    import infinity
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8))
    with infinity.initialize(m, {"offload": {"nvme_paths": [str(tmp_path / "s")]}}) as e:
        e.save_checkpoint(str(tmp_path / "ck"), tag="t")
    r = _cli("export", str(tmp_path / "ck"), str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "does not record its model's config" in r.stderr
    assert sorted(os.listdir(tmp_path / "o")) == ["model.safetensors"]


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def test_clean_stop_still_writes_the_output(tmp_path, tiny_config, monkeypatch):
    """A clean Ctrl-C stop (requested at a step boundary) hands back the model trained so far."""
    from transformers import AutoModelForCausalLM

    from infinity.finetune import stop as stop_mod

    orig = stop_mod.GracefulStop.should_stop
    calls = []

    def should_stop(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:          # after steps 1 and 2
            self.request("SIGINT")
        return orig(self, *a, **kw)

    monkeypatch.setattr(stop_mod.GracefulStop, "should_stop", should_stop)
    out = tmp_path / "model"
    res, err = _run(tmp_path, model=tiny_config("llama"), steps=6, output=str(out))
    assert res["result"].last_step == 2 and "stopped cleanly after step 2" in res["result"].stop_reason
    assert str(out) in err
    AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
