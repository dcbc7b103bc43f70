"""`infinity export` of a LoRA checkpoint (`infinity finetune --lora R --save DIR`): the base
model with the adapters merged, under the base model's own names — what PEFT's
``merge_and_unload()`` gives over the same base and adapters, 16-bit or quantized — or,
with ``--adapters-only``, the adapters as PEFT writes them; an inconsistent checkpoint is
refused, naming what is wrong."""
import copy
import functools
import io
import json
import os
import re

import pytest
import torch

pytest.importorskip("infinity.engine", reason="the offload engine is not in this build yet")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from infinity.checkpoint import CheckpointError, CheckpointReader, save_checkpoint  # noqa: E402
from infinity.checkpoint.export import export_adapters, export_model, load_exported  # noqa: E402
from infinity.cli.main import main as cli_main  # noqa: E402

# PEFT's loading asks the model through transformers' old name (transformers 5 warns)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

IDS = torch.arange(48).remainder(90).view(2, 24) + 32       # printable byte ids


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`infinity finetune --lora 4 --steps 2 --save ck --output out` on the default tiny
    Llama (plain and over an NF4 base) and the tiny GPT-2 (Conv1D: fan_in_fan_out)."""
    from infinity.finetune.run import FinetuneOptions, finetune

    tmp = tmp_path_factory.mktemp("lora-export")
    out = {"tmp": tmp}
    for name, kw in (("plain", {}), ("nf4", {"frozen_dtype": "nf4"}),
                     ("gpt2", {"model": "tiny-gpt2"})):
        opts = FinetuneOptions(**dict(dict(
            nvme_paths=[str(tmp / "swap")], batch_tokens=128, seq_len=32, steps=2, lora=4,
            save=str(tmp / f"{name}-ck"), output=str(tmp / f"{name}-out"), json_lines=True,
            use_bench_io=False), **kw))
        finetune(opts, reporter_streams={"stdout": io.StringIO(), "stderr": io.StringIO()})
        out[name] = (tmp / f"{name}-ck", tmp / f"{name}-out")
    return out


@functools.lru_cache(maxsize=None)
def _reference(adapters_dir):
    """PEFT's own merge of finetune's --output: its base (written beside the adapters, the
    dequantized one for an NF4 run) + adapters, ``merge_and_unload()``; and the unmerged
    PEFT model's logits. Callers do not modify the model."""
    m = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapters_dir)).eval()
    with torch.no_grad():
        unmerged = m(input_ids=IDS).logits
    return m.merge_and_unload().eval(), unmerged


def _load(path):
    m, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), output_loading_info=True, local_files_only=True)
    return m.eval(), info


@pytest.mark.parametrize("kind", ["plain", "nf4", "gpt2"])
def test_merged_export_is_peft_merge_and_unload(runs, kind, capsys):
    ck, adapters = runs[kind]
    out = runs["tmp"] / f"{kind}-merged"
    assert cli_main(["export", str(ck), str(out)]) == 0
    err = capsys.readouterr().err
    assert "LoRA rank 4, alpha 8 (scaling 2) merged into" in err, err
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(out))
    names = list(load_exported(out))
    assert not [n for n in names if "lora_" in n or "base_layer" in n or
                n.startswith("base_model.")], names
    model, info = _load(out)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref, unmerged = _reference(adapters)
    want = ref.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
        assert _rel(logits, ref(input_ids=IDS).logits) < 1e-6
    assert _rel(logits, unmerged) < 1e-4      # the merged model computes what training did
    # the adapters were trained (lora_B left zero), so the merge changed the adapted weights
    base = transformers.AutoModelForCausalLM.from_pretrained(str(adapters / "base")).state_dict()
    adapted, kept = (("transformer.h.0.attn.c_attn.weight", "transformer.ln_f.weight")
                     if kind == "gpt2" else
                     ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"))
    assert not torch.equal(got[adapted], base[adapted])
    assert torch.equal(got[kept], base[kept])


def test_merged_export_in_bf16_rounds_the_fp32_merge_once(runs):
    ck, adapters = runs["plain"]
    out = runs["tmp"] / "plain-bf16"
    export_model(str(ck), str(out), dtype=torch.bfloat16, verify=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    got = load_exported(out)
    want = _reference(adapters)[0].state_dict()
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, want[k].to(torch.bfloat16)), k


def test_quantized_export_of_a_lora_checkpoint_loads(runs, capsys):
    pytest.importorskip("compressed_tensors")
    from infinity.quant import quantize

    ck, adapters = runs["plain"]
    merged = runs["tmp"] / "plain-merged-fp32"
    export_model(str(ck), str(merged), verify=False)
    out = runs["tmp"] / "plain-int8"
    assert cli_main(["export", str(ck), str(out), "--quantize", "int8", "--group-size",
                     "64"]) == 0
    assert "merged into 28 layer(s)" in capsys.readouterr().err
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["ignore"] == ["lm_head"]
    qmodel, info = _load(out)
    assert not info["missing_keys"], info
    assert not hasattr(qmodel.model.layers[0].self_attn.q_proj, "weight")   # stored packed
    # what loads is our quantizer's output for the *merged* weights
    ref = _load(merged)[0]
    sub = copy.deepcopy(ref)
    with torch.no_grad():
        for name, mod in sub.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                w = mod.weight.detach()
                g = 64 if w.shape[1] % 64 == 0 else w.shape[1]
                mod.weight.copy_(quantize(w, 8, g, scale_dtype=torch.bfloat16)
                                 .dequantize(torch.bfloat16))
        lq, lsub, lref = (m.to(torch.bfloat16)(input_ids=IDS).logits for m in (qmodel, sub, ref))
    assert _rel(lq, lsub) < 1e-3
    assert 0 < _rel(lq, lref) < 0.02


@pytest.mark.parametrize("kind", ["plain", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_adapters_only_writes_peft_files(runs, kind, capsys):
    from safetensors.torch import load_file

    ck, adapters = runs[kind]
    out = runs["tmp"] / f"{kind}-adapters"
    assert cli_main(["export", str(ck), str(out), "--adapters-only"]) == 0
    err = capsys.readouterr().err
    assert "written from the checkpoint" in err, err
    files = set(os.listdir(out))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "base"} <= files
    assert "model.safetensors" not in files and "config.json" not in files
    # the same tensors, keys and settings as finetune's own --output (PEFT's save_pretrained)
    a, b = load_file(str(out / "adapter_model.safetensors")), \
        load_file(str(adapters / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    mine = json.loads((out / "adapter_config.json").read_text())
    theirs = json.loads((adapters / "adapter_config.json").read_text())
    for key in ("r", "lora_alpha", "lora_dropout", "fan_in_fan_out", "bias", "peft_type",
                "task_type"):
        assert mine[key] == theirs[key], key
    assert sorted(mine["target_modules"]) == sorted(theirs["target_modules"])
    assert mine["base_model_name_or_path"] == str(out / "base")
    m = peft.AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert _rel(m(input_ids=IDS).logits, _reference(adapters)[1]) < 1e-6
    assert transformers.AutoTokenizer.from_pretrained(str(out / "base"))("Hi")["input_ids"]


def _resave(src, dst, *, drop=(), meta=None):
    """A copy of checkpoint ``src`` without the tensors ``drop``, its meta updated."""
    class Copy:
        def __init__(self):
            self.r = CheckpointReader(str(src))
            self.meta = dict(self.r.meta)
            self.meta["model_names"] = [n for n in self.meta["model_names"] if n not in drop]
            self.meta.update(meta or {})
            for k, v in (meta or {}).items():
                if v is None:
                    del self.meta[k]

        def checkpoint_tensors(self):
            for n in self.r.names():
                if n not in drop:
                    yield n, self.r.read(n)

        def checkpoint_meta(self):
            return self.meta

    c = Copy()
    try:
        save_checkpoint(c, str(dst))
    finally:
        c.r.close()
    return dst


def test_adapters_only_names_the_runs_model_directory(runs, tmp_path):
    """A run that loaded its base from --model DIR: the adapters name DIR, nothing copied."""
    ck, adapters = runs["plain"]
    base = str(adapters / "base")           # a Hugging Face directory holding the base
    with CheckpointReader(str(ck)) as r:
        run = json.loads(json.dumps(r.meta["run"]))
    run["model"] = {"path": base}
    moved = _resave(ck, tmp_path / "ck", meta={"run": run})
    rep = {}
    export_adapters(str(moved), str(tmp_path / "out"), verify=False, report=rep)
    assert rep["base"] == base and not rep["base_written"]
    assert not (tmp_path / "out" / "base").exists()
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == base
    m = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert _rel(m(input_ids=IDS).logits, _reference(adapters)[1]) < 1e-6


def test_inconsistent_lora_checkpoints_are_refused(runs, tmp_path, capsys):
    ck, _ = runs["plain"]
    with CheckpointReader(str(ck)) as r:
        names, lora = list(r.meta["model_names"]), dict(r.meta["lora"])
    b = next(n for n in names if ".lora_B." in n)

    def refused(ckpt, match, *extra):
        out = tmp_path / f"out-{len(os.listdir(tmp_path))}"
        assert cli_main(["export", str(ckpt), str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert re.search(match, err), err
        assert not (out / "model.safetensors").exists()
        assert not (out / "adapter_model.safetensors").exists()

    no_b = _resave(ck, tmp_path / "no-b", drop={b})
    refused(no_b, r"inconsistent LoRA checkpoint.*1 tensor\(s\) are missing: "
                  + b.replace(".", r"\."))
    refused(no_b, r"missing", "--adapters-only")
    refused(no_b, r"missing", "--quantize", "int8")
    with pytest.raises(CheckpointError, match="lora_B"):
        export_model(str(no_b), str(tmp_path / "api"), verify=False)
    refused(_resave(ck, tmp_path / "no-meta", meta={"lora": None}),
            r"holds LoRA adapter tensors .* but its meta records no 'lora' entry")
    refused(_resave(ck, tmp_path / "rank", meta={"lora": dict(lora, rank=8)}),
            r"not of rank 8, the rank meta\['lora'\] records")
    refused(_resave(ck, tmp_path / "targets", meta={"lora": dict(lora, targets=["q_proj"])}),
            r"adapters on .*k_proj.*which no target names")
    refused(_resave(ck, tmp_path / "alpha", meta={"lora": dict(lora, alpha=-1)}),
            r"meta\['lora'\]\['alpha'\] must be a finite number > 0")
    adapters = {n for n in names if ".lora_" in n}
    refused(_resave(ck, tmp_path / "none", drop=adapters),
            r"records LoRA adapters \(rank 4\) but the checkpoint holds no lora_A/lora_B")
    # --adapters-only needs adapters, and does not combine with --quantize
    plain = _resave(ck, tmp_path / "full", drop=adapters, meta={"lora": None})
    refused(plain, r"not a LoRA checkpoint", "--adapters-only")
    refused(ck, r"--adapters-only .* --quantize .*choose one", "--adapters-only",
            "--quantize", "int4")
