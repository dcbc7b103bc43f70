"""An int4 export with layers kept per output channel (their input size is not a multiple of
the group size) loads with transformers without a "Could not match" warning, and every file
of an export's directory (weights, config, tokenizer) has one mode: 0666 under the umask,
as ``save_pretrained`` writes them."""
import logging
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers")

from infinity.checkpoint import save_checkpoint  # noqa: E402
from infinity.checkpoint.compressed import QuantOptions  # noqa: E402
from infinity.checkpoint.export import export_model  # noqa: E402
from infinity.checkpoint.quantized_export import export_quantized  # noqa: E402

# hidden 64, intermediate 96: with group 64 down_proj (input 96) is quantized per channel
TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=False, use_cache=False)


class _Saved:
    def __init__(self, m):
        self.m = m

    def checkpoint_tensors(self):
        for n, p in self.m.named_parameters():
            yield n, p.detach().clone()

    def checkpoint_meta(self):
        from infinity.checkpoint import model_meta
        return {"step": 1, **model_meta(self.m)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("quiet")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    save_checkpoint(_Saved(model), str(d / "ck"))
    return d / "ck"


def _modes(directory):
    return {fn: stat.S_IMODE(os.stat(os.path.join(directory, fn)).st_mode)
            for fn in os.listdir(directory) if os.path.isfile(os.path.join(directory, fn))}


def _umask():
    old = os.umask(0)
    os.umask(old)
    return old


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_channel_layers_load_without_could_not_match(ckpt, tmp_path, caplog, scheme):
    pytest.importorskip("compressed_tensors")
    out = tmp_path / scheme
    export_quantized(str(ckpt), str(out), options=QuantOptions(scheme, 64), verify=False)
    import json
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    channel = [g for g in qcfg["config_groups"].values()
               if g["weights"]["strategy"] == "channel"]
    assert channel and channel[0]["targets"] == [f"model.layers.{i}.mlp.down_proj"
                                                 for i in range(2)]
    caplog.set_level(logging.WARNING)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Could not match" not in text, text
    # the ragged layers really are per-channel (one scale per output row), the others grouped
    down = m.model.layers[0].mlp.down_proj
    up = m.model.layers[0].mlp.up_proj
    assert down.quantization_scheme.weights.strategy == "channel"
    assert up.quantization_scheme.weights.strategy == "group"
    assert tuple(down.weight_scale.shape) == (64, 1)


def test_export_files_share_one_mode(ckpt, tmp_path):
    want = 0o666 & ~_umask()
    out = tmp_path / "full"
    export_model(str(ckpt), str(out), verify=False)
    transformers.PreTrainedTokenizerFast(tokenizer_object=_tok()).save_pretrained(str(out))
    modes = _modes(out)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(modes)
    assert set(modes.values()) == {want}, {k: oct(v) for k, v in modes.items()}
    q = tmp_path / "q"
    export_quantized(str(ckpt), str(q), options=QuantOptions("int4", 32), verify=False)
    modes = _modes(q)
    assert {"model.safetensors", "config.json"} <= set(modes)
    assert set(modes.values()) == {want}, {k: oct(v) for k, v in modes.items()}


def test_modes_follow_the_umask(ckpt, tmp_path):
    old = os.umask(0o027)
    try:
        export_model(str(ckpt), str(tmp_path / "o"), verify=False)
    finally:
        os.umask(old)
    assert set(_modes(tmp_path / "o").values()) == {0o640}


def _tok():
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))


def test_finetune_output_files_share_one_mode(tmp_path):
    """``infinity finetune --output``: weights, config and tokenizer files, one mode."""
    import infinity
    from infinity.data import ByteTokenizer
    from infinity.finetune.output import write_output
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    engine = infinity.initialize(model, {"offload": {"params": "cpu", "optimizer": "cpu"}})
    try:
        out = write_output(engine, tmp_path / "out", ByteTokenizer())
    finally:
        engine.close()
    modes = _modes(out)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~_umask()}, {k: oct(v) for k, v in modes.items()}
