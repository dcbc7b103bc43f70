"""The GPU check's model and data: a Llama-shaped causal LM and token batches, from seeds.

No infinity imports, so the infinity run and the DeepSpeed run (tools/peers/deepspeed_llama.py)
build bit-identical models and batches in separate processes.

Sizes (``SIZES``): ``3b`` is Llama-3.2-3B's shape (hidden 3072, 28 layers, 24 heads, 8 KV
heads, MLP 8192) with a 32,000-token vocabulary and untied embeddings: 3.02 B parameters.
``dry`` is the same architecture at toy size, for the dry mode on a machine without a GPU.

The data is the shipped corpus (infinity/data/shakespeare.txt.gz) as bytes, cut into
``seq``-token windows in a seeded order: real text, so the loss falls over the first steps
and two runs that disagree show it.
"""
from __future__ import annotations

import gzip
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "infinity", "data", "shakespeare.txt.gz")

SIZES = {
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "dry": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=384),
}


def dims(size: str) -> dict:
    """The shape of ``size``: a name of :data:`SIZES`, or ``NAME@L`` for that shape with
    ``L`` layers (the NVMe run sizes the model to the disk this way)."""
    base, _, layers = size.partition("@")
    if base not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)} (optionally @LAYERS)")
    d = dict(SIZES[base])
    if layers:
        if not layers.isdigit() or int(layers) < 1:
            raise ValueError(f"size {size!r}: the layer count after '@' must be an integer >= 1")
        d["num_hidden_layers"] = int(layers)
    return d


def llama_config(size: str, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(**dims(size), max_position_embeddings=max(seq, 2048),
                       tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0,
                       attention_bias=False, mlp_bias=False)


def count_params(size: str) -> int:
    """Parameters of ``build_model(size)`` without building it."""
    s = dims(size)
    h, f, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return L * per_layer + 2 * V * h + h


def model_flops_per_token(size: str, seq: int) -> float:
    """MFU's model FLOPs per token (../shared/DESIGN.md §3.5): 6 N + 12 * layers * d_model * seq
    (attention, as PaLM counts it); recompute not counted."""
    s = dims(size)
    return 6 * count_params(size) + 12 * s["num_hidden_layers"] * s["hidden_size"] * seq


def build_model(size: str, seq: int, *, device="cpu", dtype=torch.bfloat16, seed=0,
                checkpointing=True):
    """A seeded ``LlamaForCausalLM`` built directly on ``device`` in ``dtype`` (SDPA attention),
    in train mode, with Hugging Face's activation checkpointing when asked."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(size, seq)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.to(dtype)
    if checkpointing:       # (transformers 5 renamed it; the old name warns as deprecated)
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    model.config.use_cache = False
    model.train()
    return model


def corpus_bytes() -> torch.Tensor:
    with gzip.open(CORPUS, "rb") as f:
        data = f.read()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(n_micro: int, micro_batch: int, seq: int, *, seed=1):
    """``n_micro`` micro-batches of ``micro_batch`` x ``seq`` byte tokens: windows of the corpus
    at seeded offsets (the same for every run with the same arguments)."""
    data = corpus_bytes()
    g = torch.Generator().manual_seed(seed)
    span = data.numel() - seq - 1
    if span < 1:
        raise ValueError(f"the corpus ({data.numel()} bytes) is shorter than seq {seq}")
    out = []
    for _ in range(n_micro):
        starts = torch.randint(0, span, (micro_batch,), generator=g)
        out.append(torch.stack([data[s:s + seq] for s in starts.tolist()]))
    return out
