"""Note [Base by reference]: a LoRA checkpoint over a quantized frozen base read from
pretrained safetensors names the base's files (SHA-256, sizes, keys, quantization settings)
instead of storing it; loading re-quantizes from those files bit-identically, into an
engine whose base started elsewhere; a missing or changed file is refused by name before
anything is loaded; export merges into the same dequantized base as a checkpoint that
stored it."""
import json
import os
import shutil

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from infinity.checkpoint import CheckpointError, CheckpointReader  # noqa: E402
from infinity.checkpoint.export import export_model, load_exported  # noqa: E402
from infinity.memory.frozen_quant import read_payload  # noqa: E402
from infinity.memory.sources import forget_source, source_of  # noqa: E402

VOCAB, SEQ = 64, 12


def _llama(seed):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=False, use_cache=False))


def _lora(base):
    return peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0))


@pytest.fixture
def base_dir(tmp_path):
    d = tmp_path / "base"
    _llama(0).save_pretrained(d, safe_serialization=True)
    return d


def _from_files(d, cfg, how):
    if how == "init":
        from infinity.integrations.transformers import from_pretrained
        return from_pretrained(d, cfg)
    from infinity.finetune.model import load_pretrained
    return load_pretrained(str(d))


def _cfg(tmp_path, home, dtype="nf4", **fw):
    return {"offload": {"params": home, "optimizer": "cpu", "nvme_paths": [str(tmp_path / "sw")],
                        "frozen_weights": {"dtype": dtype, **fw}},
            "optimizer": {"lr": 3e-3}}


def _ids(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(n)]


def _train(eng, batches):
    losses = []
    for ids in batches:
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        losses.append(out.loss.item())
    return losses


def _payloads(eng):
    return {g.name: read_payload(g, eng.swap)[0][:g.quant.nbytes].clone()
            for g in eng.mm.groups if g.quant is not None}


@pytest.mark.parametrize("home,how,fw", [("cpu", "plain", {}),
                                         ("nvme", "init", {"double_quant": True}),
                                         ("nvme", "plain", {"dtype": "int8"}),
                                         # an fp32 file under bf16 training: both sides
                                         # quantize the working-precision values
                                         ("cpu", "plain", {"precision": "bf16"})])
def test_saved_by_reference_and_requantized_bit_identically(tmp_path, base_dir, home, how, fw):
    fw = dict(fw)
    precision = fw.pop("precision", None)
    cfg = _cfg(tmp_path, home, **fw)
    if precision:
        cfg["precision"] = precision
    model = _lora(_from_files(base_dir, cfg, how))
    with infinity.initialize(model, cfg) as eng:
        _train(eng, _ids(2))
        eng.save_checkpoint(str(tmp_path / "ck"))
        want = _payloads(eng)
        after = _train(eng, _ids(2, seed=7))
        sd = {k: v.clone() for k, v in eng.state_dict().items()}
    assert want
    with CheckpointReader(str(tmp_path / "ck")) as r:
        fb = r.meta["frozen_base"]
        stored = set(r._tensors)
    files = sorted(str(p) for p in base_dir.glob("*.safetensors"))
    assert sorted(fb["files"]) == [os.path.realpath(f) for f in files]
    for f, ent in fb["files"].items():
        assert ent["bytes"] == os.path.getsize(f) and len(ent["sha256"]) == 64
    assert fb["quantization"]["dtype"] == fw.get("dtype", "nf4")
    assert fb["quantization"]["double_quant"] == fw.get("double_quant", False)
    # the quantized groups' tensors are named, not stored; adapters and states are stored
    assert "base_model.model.model.layers.0.mlp.down_proj.weight" in fb["tensors"]
    assert not set(fb["tensors"]) & stored
    assert any("lora_A" in n for n in stored)
    # a fresh engine whose base was built elsewhere (other weights): the load re-quantizes
    # the base from its files, byte for byte the first run's payload, and training goes on
    # exactly as in the run that saved
    cfg2 = _cfg(tmp_path / "two", home, **fw)
    if precision:
        cfg2["precision"] = precision
    model2 = _lora(_llama(5))
    with infinity.initialize(model2, cfg2) as eng2:
        first = _payloads(eng2)
        assert any(not torch.equal(first[k], want[k]) for k in want)
        eng2.load_checkpoint(str(tmp_path / "ck"))
        got = _payloads(eng2)
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert _train(eng2, _ids(2, seed=7)) == after
        sd2 = eng2.state_dict()
        for k, v in sd.items():
            assert torch.equal(sd2[k], v), k


def test_missing_or_changed_base_refused_by_name(tmp_path, base_dir):
    cfg = _cfg(tmp_path, "cpu")
    model = _lora(_from_files(base_dir, cfg, "plain"))
    with infinity.initialize(model, cfg) as eng:
        _train(eng, _ids(1))
        eng.save_checkpoint(str(tmp_path / "ck"))
    f = next(base_dir.glob("*.safetensors"))
    model2 = _lora(_llama(5))
    with infinity.initialize(model2, _cfg(tmp_path / "two", "cpu")) as eng2:
        before = {k: v.clone() for k, v in eng2.state_dict().items()}
        shutil.move(f, str(f) + ".away")
        with pytest.raises(CheckpointError, match=rf"{os.path.realpath(f)}.*missing"):
            eng2.load_checkpoint(str(tmp_path / "ck"))
        shutil.move(str(f) + ".away", f)
        # the same size, other bytes: one weight changed
        from safetensors.torch import load_file, save_file
        t = load_file(str(f))
        k = next(n for n in t if n.endswith("down_proj.weight"))
        t[k] = t[k] + 1
        save_file(t, str(f), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=rf"{os.path.realpath(f)}.*has changed"):
            eng2.load_checkpoint(str(tmp_path / "ck"))
        # nothing was loaded
        for k, v in eng2.state_dict().items():
            assert torch.equal(v, before[k]), k


def test_export_merges_into_the_same_dequantized_base(tmp_path, base_dir):
    cfg = _cfg(tmp_path, "cpu")
    model = _lora(_from_files(base_dir, cfg, "plain"))
    with infinity.initialize(model, cfg) as eng:
        _train(eng, _ids(2))
        lora = {"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                         "targets": ["q_proj", "v_proj", "up_proj"]}}
        eng.save_checkpoint(str(tmp_path / "ref"), extra_meta=lora)
        # the same state saved storing its base (the path without a source): the reference
        for p in model.parameters():
            if not p.requires_grad:
                assert source_of(p) is not None
                forget_source(p)
        eng.save_checkpoint(str(tmp_path / "stored"), extra_meta=lora)
    with CheckpointReader(str(tmp_path / "stored")) as r:
        assert "frozen_base" not in r.meta
    a = export_model(str(tmp_path / "ref"), str(tmp_path / "out_ref"))
    b = export_model(str(tmp_path / "stored"), str(tmp_path / "out_stored"))
    assert len(a) == len(b)
    ta, tb = load_exported(str(tmp_path / "out_ref")), load_exported(str(tmp_path / "out_stored"))
    assert set(ta) == set(tb) and any("down_proj" in k for k in ta)
    for k in tb:
        assert torch.equal(ta[k], tb[k]), k
    cfg_json = json.loads((tmp_path / "out_ref" / "config.json").read_text())
    assert cfg_json["model_type"] == "llama"


def test_a_base_changed_in_place_is_stored_not_named(tmp_path, base_dir):
    """A frozen weight edited after it was read (here: one value changed in place) no
    longer matches its file: its group is stored in the checkpoint, and a load restores
    the edited values."""
    cfg = _cfg(tmp_path, "cpu")
    model = _lora(_from_files(base_dir, cfg, "plain"))
    w = next(p for n, p in model.named_parameters() if n.endswith("layers.0.mlp.up_proj.base_layer.weight"))
    with torch.no_grad():
        w[0, 0] += 1.0
    assert source_of(w) is None
    with infinity.initialize(model, cfg) as eng:
        _train(eng, _ids(1))
        eng.save_checkpoint(str(tmp_path / "ck"))
        want = _payloads(eng)
    with CheckpointReader(str(tmp_path / "ck")) as r:
        named = r.meta.get("frozen_base", {}).get("tensors", {})
        assert not any("layers.0.mlp.up_proj" in n for n in named)
        assert any("layers.0.mlp.up_proj.base_layer" in n for n in r._tensors)
    with infinity.initialize(_lora(_llama(5)), _cfg(tmp_path / "two", "cpu")) as eng2:
        eng2.load_checkpoint(str(tmp_path / "ck"))
        got = _payloads(eng2)
        for k in want:
            assert torch.equal(got[k], want[k]), k
