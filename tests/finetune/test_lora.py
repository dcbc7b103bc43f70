"""`infinity finetune --lora R`: PEFT LoRA adapters over a frozen base (kept quantized with
--frozen-dtype), written as PEFT writes them, resumable; refusals name what to change."""
import io
import json
import math
import os
import sys

import pytest
import torch

pytest.importorskip("infinity.engine", reason="the offload engine is not in this build yet")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from infinity.finetune.run import FinetuneError, FinetuneOptions, finetune  # noqa: E402

# PEFT's loading asks the model through transformers' old name (transformers 5 warns)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

IDS = torch.arange(40).remainder(200).view(2, 20) + 32       # printable byte ids
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}
TINY_LLAMA = dict(model_type="llama", vocab_size=264, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=128, tie_word_embeddings=False, use_cache=False)
TINY_GPT2 = dict(model_type="gpt2", vocab_size=264, n_positions=128, n_embd=64, n_layer=2,
                 n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 tie_word_embeddings=True, use_cache=False)
# hidden 128: the per-group 4096-byte padding of a quantized payload stays small
WIDE_LLAMA = dict(hidden_size=128, intermediate_size=256)


def _run(tmp_path, **kw):
    out, err = io.StringIO(), io.StringIO()
    opts = FinetuneOptions(**dict(dict(nvme_paths=[str(tmp_path / "swap")], batch_tokens=128,
                                       seq_len=32, json_lines=True, use_bench_io=False,
                                       lr=1e-2), **kw))
    res = finetune(opts, reporter_streams={"stdout": out, "stderr": err})
    return [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue(), res


def _capturing_logits(mp, into):
    """The engine's own logits on IDS, taken just before --output is written."""
    from infinity.finetune import output

    orig = output.write_output

    def write_output(engine, *a, **kw):
        with torch.no_grad():
            into.append(engine(input_ids=IDS).logits.detach().clone())
        return orig(engine, *a, **kw)

    mp.setattr(output, "write_output", write_output)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _mean(xs):
    return sum(xs) / len(xs)


def _lora_run(tmp_path, config, name, **kw):
    logits = []
    with pytest.MonkeyPatch.context() as mp:
        _capturing_logits(mp, logits)
        recs, err, res = _run(tmp_path, model=config, steps=6, lora=4,
                              output=str(tmp_path / name), **kw)
    return recs, err, res, logits[0]


def _tiny(tmp_path, kind, **over):
    """A tiny model config (tests/finetune/conftest.py's, which tests cannot import)."""
    cfg = dict(TINY_LLAMA if kind == "llama" else TINY_GPT2, **over)
    path = tmp_path / f"tiny-{kind}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    llama = _tiny(tmp, "llama", **WIDE_LLAMA)
    return {"tmp": tmp, "llama": llama,
            "plain": _lora_run(tmp, llama, "out-plain"),
            "nf4": _lora_run(tmp, llama, "out-nf4", frozen_dtype="nf4")}


def _check_adapters(out, kind, engine_logits, recs):
    files = set(os.listdir(out))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= files
    assert "model.safetensors" not in files and "config.json" not in files   # adapters only
    acfg = json.loads((out / "adapter_config.json").read_text())
    assert acfg["r"] == 4 and acfg["lora_alpha"] == 8 and acfg["peft_type"] == "LORA"
    assert sorted(acfg["target_modules"]) == sorted(TARGETS[kind])   # not the LM head
    assert acfg["base_model_name_or_path"] == str(out / "base")
    from safetensors.torch import load_file

    ad = load_file(str(out / "adapter_model.safetensors"))
    assert ad and all(".lora_A." in k or ".lora_B." in k for k in ad)
    assert not any("lm_head" in k or "embed" in k or "wte" in k for k in ad)
    assert recs[0]["trainable_params"] == sum(t.numel() for t in ad.values())
    assert recs[0]["trainable_params"] < recs[0]["total_params"] / 5
    # PEFT loads them onto the base written beside them: the engine's final model
    m = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(out / "base")), str(out)).eval()
    with torch.no_grad():
        got = m(input_ids=IDS).logits
    assert _rel(got, engine_logits) < 1e-5
    # and in one call, with the tokenizer
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert _rel(auto(input_ids=IDS).logits, engine_logits) < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("Hi", add_special_tokens=False)["input_ids"] == [72, 105]


def _losses_fall(recs):
    losses = [r["loss"] for r in recs]
    assert _mean(losses[-2:]) < _mean(losses[:2]) - 0.02, losses


def test_llama_lora_trains_and_writes_peft_adapters(runs):
    recs, err, res, logits = runs["plain"]
    _losses_fall(recs)
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert "frozen_dtype" not in recs[0]
    _check_adapters(runs["tmp"] / "out-plain", "llama", logits, recs)
    # the base is the random init of --seed, untouched by training
    from safetensors.torch import load_file

    from infinity.finetune.model import build_model, load_model_config

    torch.manual_seed(0)
    ref = build_model(load_model_config(runs["llama"]))
    have = load_file(str(runs["tmp"] / "out-plain" / "base" / "model.safetensors"))
    assert have.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(have[k], v), k
    assert "params" in err and "trainable" in err and "LoRA rank 4, alpha 8" in err
    assert "frozen base" in err and "the working precision" in err


def test_frozen_nf4_base_reads_fewer_bytes_and_output_is_the_trained_model(runs):
    recs, err, res, logits = runs["nf4"]
    plain_recs, _, plain, _ = runs["plain"]
    _losses_fall(recs)
    assert recs[0]["frozen_dtype"] == "nf4"
    assert recs[0]["trainable_params"] == plain_recs[0]["trainable_params"]
    read = res["stats"]["frozen_nvme_read_bytes"]
    plain_read = plain["stats"]["frozen_nvme_read_bytes"]
    assert 0 < read < 0.4 * plain_read, (read, plain_read)
    assert "frozen base" in err and "nf4 (group size 64)" in err and "at its home instead" in err
    # the base written beside the adapters is the dequantized one the adapters trained over
    _check_adapters(runs["tmp"] / "out-nf4", "llama", logits, recs)
    from safetensors.torch import load_file

    from infinity.finetune.model import build_model, load_model_config
    from infinity.quant import quantize_weight

    torch.manual_seed(0)
    ref = build_model(load_model_config(runs["llama"]))
    w = ref.model.layers[0].self_attn.q_proj.weight.detach()
    deq = quantize_weight(w, "nf4", 64).dequantize()
    base = load_file(str(runs["tmp"] / "out-nf4" / "base" / "model.safetensors"))
    assert torch.equal(base["model.layers.0.self_attn.q_proj.weight"], deq)
    assert not torch.equal(deq, w)


def test_gpt2_conv1d_lora(tmp_path):
    recs, err, res, logits = _lora_run(tmp_path, _tiny(tmp_path, "gpt2"), "out")
    _losses_fall(recs)
    acfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert acfg["fan_in_fan_out"] is True
    _check_adapters(tmp_path / "out", "gpt2", logits, recs)


def test_resume_with_lora_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """Stopped after step 2 and run again: adapters and Adam state come back, the losses
    and the written adapters are those of the uninterrupted run (quantized base too)."""
    from safetensors.torch import load_file

    from infinity.finetune import stop as stop_mod

    model = _tiny(tmp_path, "gpt2")
    kw = dict(model=model, steps=4, lora=4, lora_targets=["c_attn", "c_fc"],
              frozen_dtype="int8")
    full, _, _ = _run(tmp_path, output=str(tmp_path / "o-full"), **kw)
    ck, out = tmp_path / "ck", tmp_path / "o"
    orig, calls = stop_mod.GracefulStop.should_stop, []

    def should_stop(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            self.request("SIGINT")
        return orig(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(stop_mod.GracefulStop, "should_stop", should_stop)
        first, _, res = _run(tmp_path, save=str(ck), output=str(out), **kw)
    assert [r["step"] for r in first] == [1, 2]
    rest, err, _ = _run(tmp_path, save=str(ck), output=str(out), **kw)
    assert "resuming from step 2" in err
    assert [r["step"] for r in rest] == [3, 4]
    assert [r["loss"] for r in first + rest] == pytest.approx([r["loss"] for r in full],
                                                               rel=1e-5)
    a = load_file(str(tmp_path / "o-full" / "adapter_model.safetensors"))
    b = load_file(str(out / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert {k.split(".")[-3] for k in a} == {"c_attn", "c_fc"}        # --lora-targets only
    for k in a:
        assert _rel(b[k], a[k]) < 1e-5, k
    assert float(sum(v.abs().sum() for k, v in a.items() if "lora_B" in k)) > 0
    # other adapters are another run: refused before anything is built, naming the flag
    with pytest.raises(FinetuneError, match=r"different run.*LoRA rank \(--lora\): 4 in the "
                                            r"checkpoints, 8 now"):
        _run(tmp_path, save=str(ck), **dict(kw, lora=8))
    with pytest.raises(FinetuneError, match=r"frozen base format .*int8.* in the checkpoints, "
                                            r"nf4 now"):
        _run(tmp_path, save=str(ck), **dict(kw, frozen_dtype="nf4"))


def test_refusals_name_what_to_change(tmp_path, monkeypatch):
    model = _tiny(tmp_path, "llama")

    def fails(match, **kw):
        with pytest.raises(FinetuneError, match=match):
            _run(tmp_path, **dict(dict(model=model, steps=1), **kw))

    fails(r"--lora must be a LoRA rank >= 1, got 0", lora=0)
    fails(r"--lora must be a LoRA rank >= 1, got -2", lora=-2)
    fails(r"--lora-alpha must be a number > 0", lora=4, lora_alpha=0.0)
    fails(r"--lora-dropout must be in \[0, 1\)", lora=4, lora_dropout=1.0)
    fails(r"--lora-targets nope matches no module of the model; the model's Linear/Conv1D "
          r"layers are named q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
          r"lm_head \(the default targets all of them except the LM head lm_head\)",
          lora=4, lora_targets=["q_proj", "nope"])
    fails(r"--lora-targets input_layernorm matches LlamaRMSNorm module\(s\).*q_proj",
          lora=4, lora_targets=["input_layernorm"])
    fails(r"--frozen-dtype nf4 .*full fine-tuning trains every weight.*add --lora R",
          frozen_dtype="nf4")
    fails(r"--lora-targets/--lora-alpha set\(s\) the LoRA adapters: add --lora R",
          lora_targets=["q_proj"], lora_alpha=8.0)
    fails(r"--frozen-dtype must be one of nf4, int8, int4", lora=4, frozen_dtype="fp8")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(TINY_LLAMA))
    fails(r"--output .* is the --model directory", lora=4, model=str(base), output=str(base))
    cfg = tmp_path / "fw.json"
    cfg.write_text('{"offload": {"frozen_weights": {"dtype": "int4"}}}')
    fails(r"offload.frozen_weights.dtype in --config .*fw.json is 'int4'.*add --lora R",
          config=str(cfg))
    # peft missing: how to install it
    monkeypatch.setitem(sys.modules, "peft", None)
    fails(r"--lora needs the peft package \(peft>=0.15\).*pip install 'peft>=0.15'", lora=4)
    assert not (tmp_path / "swap").exists()


def test_config_frozen_weights_is_kept_and_the_flag_overrides_it(tmp_path):
    """A --config that sets offload.frozen_weights trains a LoRA run over that base (its
    group_size kept); --frozen-dtype replaces its dtype only."""
    cfg = tmp_path / "fw.json"
    cfg.write_text('{"offload": {"frozen_weights": {"dtype": "int8", "group_size": 128}}}')
    model = _tiny(tmp_path, "llama", **WIDE_LLAMA)
    recs, err, _ = _run(tmp_path, model=model, steps=1, lora=2, config=str(cfg))
    assert recs[0]["frozen_dtype"] == "int8" and "int8 (group size 128)" in err
    recs, err, _ = _run(tmp_path, model=model, steps=1, lora=2, config=str(cfg),
                        frozen_dtype="nf4")
    assert recs[0]["frozen_dtype"] == "nf4" and "nf4 (group size 128)" in err


def test_cli_refusal_exit_code(tmp_path, ft):
    r = ft.run("--frozen-dtype", "nf4", "--steps", "1", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "add --lora R" in r.stderr and r.stdout == ""


def test_pretrained_directory_is_the_adapters_base(tmp_path):
    """--model DIR: the adapters name DIR as their base (nothing copied); the loaded model
    is the engine's. The same over an nf4 base (loaded into host memory, then quantized)."""
    from infinity.finetune.model import build_model, load_model_config

    torch.manual_seed(3)
    pre = tmp_path / "pre"
    build_model(load_model_config(_tiny(tmp_path, "llama"))).save_pretrained(str(pre))
    recs, _, _, logits = _lora_run(tmp_path, str(pre), "out", lora_targets=["q_proj", "v_proj"])
    out = tmp_path / "out"
    assert not (out / "base").exists()
    acfg = json.loads((out / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == str(pre)
    assert sorted(acfg["target_modules"]) == ["q_proj", "v_proj"]
    m = peft.AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert _rel(m(input_ids=IDS).logits, logits) < 1e-5
    _losses_fall(recs)
    recs, err, _, _ = _lora_run(tmp_path, str(pre), "out-nf4", frozen_dtype="nf4")
    assert recs[0]["frozen_dtype"] == "nf4"
    assert json.loads((tmp_path / "out-nf4" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(pre)


def test_auto_plans_the_lora_run(tmp_path):
    """``--auto --lora R --frozen-dtype nf4``: the planner sizes the LoRA run (adapters on
    the projections, the base in its stored format) and the run trains with its plan."""
    model = _tiny(tmp_path, "llama")
    lines, err, res = _run(tmp_path, model=model, steps=2, lora=4, frozen_dtype="nf4",
                           auto=True)
    losses = [r["loss"] for r in lines if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert lines[-1].get("frozen_dtype") == "nf4"
