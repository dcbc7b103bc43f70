"""`--model`: shipped configs, config files, and HF directories streamed from safetensors."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from infinity.data import ByteTokenizer
from infinity.finetune.model import (ModelError, check_vocab, load_model_config, load_pretrained,
                                     resolve_model, shipped_model_config)

TINY = {
    "gpt2": dict(model_type="gpt2", vocab_size=264, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                 tie_word_embeddings=True),
    "llama": dict(model_type="llama", vocab_size=264, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False),
}


def _write_config(path, cfg):
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("sharded", [False, True])
def test_pretrained_directory_streams_exact_weights(tmp_path, family, sharded):
    cfgfile = tmp_path / "c.json"
    _write_config(cfgfile, TINY[family])
    torch.manual_seed(1)
    ref, _ = resolve_model(str(cfgfile))
    d = tmp_path / "model"
    ref.save_pretrained(str(d), safe_serialization=True, max_shard_size="20KB" if sharded else "5GB")
    files = os.listdir(d)
    assert ("model.safetensors.index.json" in files) == sharded
    model = load_pretrained(str(d))
    ref_sd, sd = ref.state_dict(), model.state_dict()
    assert ref_sd.keys() == sd.keys()
    for k in ref_sd:
        assert torch.equal(ref_sd[k], sd[k]), k
    assert not [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if family == "gpt2":  # tied embeddings survive the streaming load
        assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, 259, (2, 16))
    model.eval(), ref.eval()  # GPT-2 configs default to dropout 0.1
    torch.testing.assert_close(model(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss)


def test_base_model_checkpoint_without_prefix(tmp_path):
    """GPT-2 checkpoints saved from GPT2Model have no 'transformer.' prefix."""
    cfgfile = tmp_path / "c.json"
    _write_config(cfgfile, TINY["gpt2"])
    ref, _ = resolve_model(str(cfgfile))
    d = tmp_path / "m"
    d.mkdir()
    _write_config(d / "config.json", TINY["gpt2"])
    sd = {k[len("transformer."):]: v.contiguous() for k, v in ref.state_dict().items()
          if k.startswith("transformer.")}
    save_file(sd, str(d / "model.safetensors"))
    model = load_pretrained(str(d))
    assert torch.equal(model.transformer.wte.weight, ref.transformer.wte.weight)
    assert torch.equal(model.lm_head.weight, ref.transformer.wte.weight)


def test_missing_and_mismatched_weights(tmp_path):
    cfgfile = tmp_path / "c.json"
    _write_config(cfgfile, TINY["llama"])
    ref, _ = resolve_model(str(cfgfile))
    d = tmp_path / "m"
    d.mkdir()
    _write_config(d / "config.json", TINY["llama"])
    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if "layers.1." not in k}
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelError, match="lack .* parameter"):
        load_pretrained(str(d))
    sd = dict(ref.state_dict())
    sd["model.norm.weight"] = torch.ones(7)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    with pytest.raises(ModelError, match="shape"):
        load_pretrained(str(d))


def test_directory_errors(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_pretrained(str(d))
    _write_config(d / "config.json", TINY["gpt2"])
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelError, match="never loaded"):
        load_pretrained(str(d))
    with pytest.raises(ModelError, match="downloads are not supported"):
        resolve_model("gpt2-no-such-local-thing")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ModelError, match="model_type"):
        resolve_model(str(bad))


def test_shipped_configs_fit_the_byte_tokenizer():
    tok = ByteTokenizer()
    for name in ("tiny-llama", "tiny-gpt2"):
        cfg = load_model_config(shipped_model_config(name))
        assert cfg.vocab_size >= tok.vocab_size
    small = dict(TINY["gpt2"], vocab_size=100)
    from infinity.finetune.model import build_model
    from transformers import AutoConfig
    m = build_model(AutoConfig.for_model(**small))
    with pytest.raises(ModelError, match="vocabulary"):
        check_vocab(m, tok)


@pytest.mark.parametrize("family, base_only", [("gpt2", False), ("gpt2", True), ("llama", False)])
def test_pretrained_streams_into_init_homes(tmp_path, family, base_only):
    """With params homed on NVMe the model is built under infinity.Init and each checkpoint
    tensor is written to its offloaded home; values read back equal the saved ones.  The
    build skips the modules' own initialisation (every value comes from the checkpoint):
    it draws no random numbers."""
    from infinity.zero.init import is_managed, materialized

    cfgfile = tmp_path / "c.json"
    _write_config(cfgfile, TINY[family])
    torch.manual_seed(2)
    ref, _ = resolve_model(str(cfgfile))
    d = tmp_path / "model"
    if base_only:  # the layout of the original GPT-2 checkpoints: no "transformer." prefix
        d.mkdir()
        _write_config(d / "config.json", TINY[family])
        save_file({k[len("transformer."):]: v.contiguous() for k, v in ref.state_dict().items()
                   if k.startswith("transformer.")}, str(d / "model.safetensors"))
    else:
        ref.save_pretrained(str(d), safe_serialization=True)
    infcfg = {"offload": {"params": "nvme", "optimizer": "nvme",
                          "nvme_paths": [str(tmp_path / "swap")]}}
    rng = torch.get_rng_state()
    model, desc = resolve_model(str(d), init_config=infcfg)
    assert torch.equal(rng, torch.get_rng_state())
    assert "infinity.Init" in desc
    params = dict(model.named_parameters())
    assert params and all(is_managed(p) for p in params.values())
    ref_params = dict(ref.named_parameters())
    with materialized(list(params.values()), write_back=False):
        for name, p in params.items():
            assert torch.equal(p.data, ref_params[name].data), name
    del model, params


def test_init_path_reports_missing_weights(tmp_path):
    _write_config(tmp_path / "c.json", TINY["llama"])
    ref, _ = resolve_model(str(tmp_path / "c.json"))
    d = tmp_path / "m"
    d.mkdir()
    _write_config(d / "config.json", TINY["llama"])
    save_file({k: v.contiguous() for k, v in ref.state_dict().items() if "layers.1." not in k},
              str(d / "model.safetensors"))
    infcfg = {"offload": {"params": "cpu", "optimizer": "cpu"}}
    with pytest.raises(ModelError, match="do not fit"):
        resolve_model(str(d), init_config=infcfg)
