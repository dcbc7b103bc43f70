"""Writing weights in the compressed-tensors ``pack-quantized`` format.

This is what Hugging Face ``transformers`` (with the ``compressed-tensors`` package) and
vLLM load as a weight-only INT8/INT4 model: every quantized ``nn.Linear`` ``M`` has

- ``M.weight_packed``: int32 ``(out, ceil(in * bits / 32))``, the integers packed densely
  along the input dimension (:func:`infinity.quant.pack_bits`),
- ``M.weight_scale``: ``(out, ceil(in / group_size))`` in the model's 16-bit dtype,
- ``M.weight_shape``: int64 ``[out, in]``,

and ``config.json`` carries ``quantization_config`` (:func:`quantization_config`):
symmetric ``int`` weights, strategy ``group``; a Linear whose input size is not a multiple
of the group size (compressed-tensors refuses ragged groups) is quantized per output
channel instead (strategy ``channel``, named in a second config group: exact names win
over the class target). Everything else (embeddings, norms, biases, the LM head unless
asked) is written as is, cast to the 16-bit dtype when floating point.

Tensors stream one at a time (``get(name)``), into shards planned up front from the
shapes, each written under a temp name and renamed: peak memory is one tensor plus its
quantized form.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

from infinity.quant import QuantizationError, QuantizedTensor, pack_bits, quantize

from . import dtypes
from .errors import CheckpointError
from .fsutil import atomic_write_text, fsync_dir, remove_tree
from .safetensors_stream import SafetensorsStreamWriter, header_reserve_for

log = logging.getLogger("infinity.checkpoint")

SCHEMES = {"int8": 8, "int4": 4}
FORMAT = "pack-quantized"
INDEX_NAME = "model.safetensors.index.json"
CT_VERSION = "0.20.0"        # the compressed-tensors release whose format this writes


@dataclass(frozen=True)
class QuantOptions:
    """What ``--quantize`` asks for. ``dtype``: the 16-bit dtype of everything not
    quantized and of the scales (None: bf16 when the source is fp32, else as saved)."""
    scheme: str
    group_size: int = 128
    dtype: torch.dtype | None = None
    include_lm_head: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise CheckpointError(f"quantize must be one of {sorted(SCHEMES)}, got {self.scheme!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise CheckpointError(f"group_size must be a positive integer, got {self.group_size!r}")
        if self.dtype is not None and self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CheckpointError(f"dtype must be bfloat16, float16 or float32, got {self.dtype}")

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]


@dataclass
class LinearPlan:
    """The quantized Linears: ``{weight name: (module name, strategy, group size)}`` and
    the Linear modules left 16-bit (``ignore``)."""
    layers: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    ignore: list[str] = field(default_factory=list)

    def __contains__(self, weight_name) -> bool:
        return weight_name in self.layers


def plan_linears(linears, opts: QuantOptions) -> LinearPlan:
    """``linears``: ``(module name, out_features, in_features, is_output_embedding)`` of
    every ``nn.Linear`` of the model. Returns the plan (see :class:`LinearPlan`)."""
    plan = LinearPlan()
    for mname, _out, inf, is_head in linears:
        if is_head and not opts.include_lm_head:
            plan.ignore.append(mname)
            continue
        if inf % opts.group_size == 0:
            plan.layers[f"{mname}.weight"] = (mname, "group", opts.group_size)
        else:
            plan.layers[f"{mname}.weight"] = (mname, "channel", inf)
    if not plan.layers:
        raise CheckpointError(
            "the model has no nn.Linear layer to quantize (GPT-2-style Conv1D layers are not "
            "nn.Linear and the compressed-tensors format does not cover them); export it "
            "without --quantize")
    channel = [m for m, s, _ in plan.layers.values() if s == "channel"]
    if channel:
        log.warning("%d Linear layer(s) have an input size that is not a multiple of the group "
                    "size %d and are quantized per output channel instead: %s", len(channel),
                    opts.group_size, ", ".join(channel[:8]) + (" ..." if len(channel) > 8 else ""))
    return plan


def _weights_args(bits, strategy, group_size):
    return {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy,
            "group_size": group_size if strategy == "group" else None, "block_structure": None,
            "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def quantization_config(plan: LinearPlan, opts: QuantOptions) -> dict:
    """The ``quantization_config`` entry of ``config.json``."""
    groups = {"group_0": {"targets": ["Linear"], "format": FORMAT,
                          "weights": _weights_args(opts.bits, "group", opts.group_size),
                          "input_activations": None, "output_activations": None}}
    channel = sorted(m for m, s, _ in plan.layers.values() if s == "channel")
    if channel:
        groups["group_1"] = {"targets": channel, "format": FORMAT,
                             "weights": _weights_args(opts.bits, "channel", None),
                             "input_activations": None, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": FORMAT,
            "quantization_status": "compressed", "config_groups": groups,
            "ignore": sorted(plan.ignore), "kv_cache_scheme": None,
            "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
            "version": CT_VERSION}


def output_dtype(src: torch.dtype, opts: QuantOptions) -> torch.dtype:
    """Dtype a floating-point tensor (and the scales) is written in."""
    if opts.dtype is not None:
        return opts.dtype
    return torch.bfloat16 if src == torch.float32 else src


def _entries(name, shape, dt, plan, opts):
    """Output ``(key, dtype, shape)`` for one source tensor."""
    if name in plan:
        _, strategy, g = plan.layers[name]
        out, inf = shape
        return [(f"{name[:-len('weight')]}weight_packed", torch.int32, (out, -(-inf * opts.bits // 32))),
                (f"{name[:-len('weight')]}weight_scale", output_dtype(dt, opts), (out, -(-inf // g))),
                (f"{name[:-len('weight')]}weight_shape", torch.int64, (2,))]
    return [(name, output_dtype(dt, opts) if dt.is_floating_point else dt, tuple(shape))]


def quantize_weight(name, w, plan, opts, scale_dtype) -> dict[str, torch.Tensor]:
    """The three stored tensors of Linear weight ``name``."""
    _, strategy, g = plan.layers[name]
    if w.dim() != 2:
        raise CheckpointError(f"{name}: a Linear weight must be 2-D, got shape {tuple(w.shape)}")
    try:
        qt = quantize(w, opts.bits, g, scale_dtype=scale_dtype, name=name)
    except QuantizationError as e:
        raise CheckpointError(str(e)) from e
    base = name[:-len("weight")]
    return {f"{base}weight_packed": pack_bits(qt.q, opts.bits),
            f"{base}weight_scale": qt.scale,
            f"{base}weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}


def write_quantized(out_dir, names, info, get, plan: LinearPlan, opts: QuantOptions, *,
                    max_shard_bytes: int, metadata=None) -> tuple[list[str], int]:
    """Write ``names`` (``info(name) -> (shape, dtype)``, ``get(name) -> tensor``, called
    once per name in order; a Linear weight may come as a :class:`QuantizedTensor`) to ``out_dir``; returns (files written, bytes of tensor data)."""
    plan_shards, cur, cur_bytes = [], [], 0
    for n in names:
        shape, dt = info(n)
        if n in plan and len(shape) != 2:
            raise CheckpointError(f"{n}: a Linear weight must be 2-D, got shape {list(shape)}")
        ents = _entries(n, shape, dt, plan, opts)
        nb = sum(dtypes.itemsize(d) * _numel(s) for _, d, s in ents)
        if cur and cur_bytes + nb > max_shard_bytes:
            plan_shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((n, ents))
        cur_bytes += nb
    plan_shards.append(cur)
    k = len(plan_shards)
    fnames = (["model.safetensors"] if k == 1 else
              [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)])
    weight_map, total, written = {}, 0, []
    for fname, group in zip(fnames, plan_shards):
        final = os.path.join(out_dir, fname)
        tmp = os.path.join(out_dir, f".{fname}.tmp-{os.getpid()}")
        remove_tree(tmp)
        reserve = header_reserve_for([(key, dtypes.to_st(d), s) for _, ents in group
                                      for key, d, s in ents])
        w = SafetensorsStreamWriter(tmp, header_reserve=reserve,
                                    metadata=metadata or {"format": "pt"})
        try:
            for n, ents in group:
                t = get(n)
                if isinstance(t, QuantizedTensor):        # already quantized (LKD)
                    base = n[:-len("weight")]
                    outs = {f"{base}weight_packed": pack_bits(t.q, opts.bits),
                            f"{base}weight_scale": t.scale,
                            f"{base}weight_shape": torch.tensor(list(t.q.shape), dtype=torch.int64)}
                elif n in plan:
                    outs = quantize_weight(n, t, plan, opts, ents[1][1])
                else:
                    outs = {n: t.to(ents[0][1]) if t.dtype != ents[0][1] else t}
                for key, d, s in ents:
                    o = outs[key].contiguous()
                    if o.dtype != d or tuple(o.shape) != tuple(s):
                        raise CheckpointError(f"{n}: produced {key} {o.dtype} {list(o.shape)}, "
                                              f"planned {d} {list(s)}")
                    w.add(key, o)
                    total += o.numel() * o.element_size()
                    weight_map[key] = fname
                del t, outs
            w.close()
            os.rename(tmp, final)
        except BaseException:
            w.abort()
            remove_tree(tmp)
            raise
        written.append(final)
    fsync_dir(out_dir)
    index = os.path.join(out_dir, INDEX_NAME)
    if k > 1:
        atomic_write_text(index, json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=2) + "\n")
        written.append(index)
    elif os.path.exists(index):
        os.unlink(index)
    return written, total


def set_quantization_config(config_path, qcfg: dict, dtype: torch.dtype) -> None:
    """Add ``quantization_config`` (and the 16-bit dtype) to a written ``config.json``."""
    with open(config_path, encoding="utf-8") as f:
        d = json.load(f)
    d["quantization_config"] = qcfg
    name = str(dtype).replace("torch.", "")
    for key in ("dtype", "torch_dtype"):
        if key in d:
            d[key] = name
    if "dtype" not in d and "torch_dtype" not in d:
        d["torch_dtype"] = name
    atomic_write_text(config_path, json.dumps(d, indent=2, sort_keys=True) + "\n")


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n
