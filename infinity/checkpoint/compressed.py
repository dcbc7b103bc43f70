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
channel instead (strategy ``channel``, named in a config group of its own listed first:
exact names win over the class target, and listed first they are matched, so the load does
not warn "Could not match"). Everything else (embeddings, norms, biases, the LM head unless
asked) is written as is, cast to the 16-bit dtype when floating point.

GPT-2-style ``Conv1D`` layers (``transformers.pytorch_utils.Conv1D``: ``y = x @ W + b``, the
weight stored ``(in, out)``, transposed against ``nn.Linear``) are quantized too, in their
stored layout: ``weight_shape`` is ``[in, out]`` and the groups run along the stored last
dimension (the output features), so what a loader decompresses has the Conv1D's own shape.
compressed-tensors only rebuilds ``nn.Linear`` modules in compressed form, so a model with
Conv1D layers is marked ``"dequantize": true`` in its ``quantization_config`` (named in the
config groups' targets): ``transformers`` then dequantizes every quantized weight while
loading (the model runs in 16-bit; the files stay INT8/INT4). That load applies the first
config group's scheme to every weight, so in such a model a layer whose row size is not a
multiple of the group size stays 16-bit (listed in ``ignore``, one warning) instead of
falling back to per-channel scales.

Tensors stream one at a time (``get(name)``) through the shared sharded writer
(:mod:`.hf_shards`): peak memory is one tensor plus its quantized form.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from infinity.quant import QuantizationError, QuantizedTensor, pack_bits, quantize

from .errors import CheckpointError
from .fsutil import atomic_write_text
from .hf_shards import Entry, write_hf_shards

log = logging.getLogger("infinity.checkpoint")

SCHEMES = {"int8": 8, "int4": 4}
FORMAT = "pack-quantized"
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
    """The quantized layers: ``{weight name: (module name, strategy, group size)}``, the
    Linear modules left 16-bit (``ignore``) and the quantized ``Conv1D`` modules (``conv1d``,
    stored transposed: see the module doc)."""
    layers: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    ignore: list[str] = field(default_factory=list)
    conv1d: list[str] = field(default_factory=list)

    def __contains__(self, weight_name) -> bool:
        return weight_name in self.layers


def plan_linears(linears, opts: QuantOptions) -> LinearPlan:
    """``linears``: ``(module name, rows, cols, is_output_embedding, is_conv1d)`` of every
    ``nn.Linear`` / ``Conv1D`` of the model (rows x cols: the stored weight's shape; groups
    run along cols). Returns the plan (see :class:`LinearPlan`)."""
    plan = LinearPlan()
    for mname, _rows, cols, is_head, is_conv1d in linears:
        if is_head and not opts.include_lm_head:
            plan.ignore.append(mname)
            continue
        if cols % opts.group_size == 0:
            plan.layers[f"{mname}.weight"] = (mname, "group", opts.group_size)
        else:
            plan.layers[f"{mname}.weight"] = (mname, "channel", cols)
        if is_conv1d:
            plan.conv1d.append(mname)
    ragged = [w for w, (m, s, _) in plan.layers.items() if s == "channel"]
    if plan.conv1d and ragged:
        # transformers dequantizes such a model with one scheme (the first config group's):
        # per-channel rows cannot be told apart, so those layers stay 16-bit
        for w in ragged:
            m = plan.layers.pop(w)[0]
            plan.ignore.append(m)
            if m in plan.conv1d:
                plan.conv1d.remove(m)
        log.warning("%d layer(s) of this Conv1D model have a weight row size that is not a "
                    "multiple of the group size %d and stay 16-bit (the dequantizing load of "
                    "such models applies one group size to every layer): %s", len(ragged),
                    opts.group_size, ", ".join(w[:-len(".weight")] for w in ragged[:8])
                    + (" ..." if len(ragged) > 8 else ""))
    if not plan.layers:
        raise CheckpointError(
            "the model has no nn.Linear or Conv1D layer to quantize (only an LM head, which "
            "stays 16-bit unless --quantize-lm-head); export it without --quantize")
    channel = [m for m, s, _ in plan.layers.values() if s == "channel"]
    if channel:
        log.warning("%d layer(s) have a weight row size that is not a multiple of the group "
                    "size %d and are quantized per output channel instead: %s", len(channel),
                    opts.group_size, ", ".join(channel[:8]) + (" ..." if len(channel) > 8 else ""))
    return plan


def _weights_args(bits, strategy, group_size):
    return {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy,
            "group_size": group_size if strategy == "group" else None, "block_structure": None,
            "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def quantization_config(plan: LinearPlan, opts: QuantOptions) -> dict:
    """The ``quantization_config`` entry of ``config.json``."""
    channel = sorted(m for m, s, _ in plan.layers.values() if s == "channel")
    conv_group = sorted(m for m in plan.conv1d if m not in channel)
    main = {"targets": ["Linear"] + conv_group, "format": FORMAT,
            "weights": _weights_args(opts.bits, "group", opts.group_size),
            "input_activations": None, "output_activations": None}
    # the per-channel layers' exact names come first (group_0): compressed-tensors matches a
    # module against the targets in config order and stops at the first match, so after
    # the class target "Linear" their exact names would never be reached and it would warn
    # "Could not match" for each of them (the scheme chosen is the same: exact names win)
    groups = {"group_0": main}
    if channel:
        groups = {"group_0": {"targets": channel, "format": FORMAT,
                              "weights": _weights_args(opts.bits, "channel", None),
                              "input_activations": None, "output_activations": None},
                  "group_1": main}
    out = {"quant_method": "compressed-tensors", "format": FORMAT,
           "quantization_status": "compressed", "config_groups": groups,
           "ignore": sorted(plan.ignore), "kv_cache_scheme": None,
           "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
           "version": CT_VERSION}
    if plan.conv1d:
        out["dequantize"] = True    # Conv1D is not rebuilt compressed: see the module doc
    return out


def output_dtype(src: torch.dtype, opts: QuantOptions) -> torch.dtype:
    """Dtype a floating-point tensor (and the scales) is written in."""
    if opts.dtype is not None:
        return opts.dtype
    return torch.bfloat16 if src == torch.float32 else src


def entries(name, shape, dt, plan, opts) -> list[Entry]:
    """The stored tensors of one source tensor."""
    if name in plan:
        _, strategy, g = plan.layers[name]
        rows, cols = shape
        base = name[:-len("weight")]
        return [Entry(f"{base}weight_packed", torch.int32, (rows, -(-cols * opts.bits // 32))),
                Entry(f"{base}weight_scale", output_dtype(dt, opts), (rows, -(-cols // g))),
                Entry(f"{base}weight_shape", torch.int64, (2,))]
    return [Entry(name, output_dtype(dt, opts) if dt.is_floating_point else dt, tuple(shape))]


def quantize_weight(name, w, plan, opts, scale_dtype) -> dict[str, torch.Tensor]:
    """The three stored tensors of Linear weight ``name``."""
    _, strategy, g = plan.layers[name]
    if w.dim() != 2:
        raise CheckpointError(f"{name}: a Linear weight must be 2-D, got shape {tuple(w.shape)}")
    try:
        qt = quantize(w, opts.bits, g, scale_dtype=scale_dtype, name=name)
    except QuantizationError as e:
        raise CheckpointError(str(e)) from e
    return stored_tensors(name, qt, opts)


def stored_tensors(name, qt: QuantizedTensor, opts) -> dict[str, torch.Tensor]:
    base = name[:-len("weight")]
    return {f"{base}weight_packed": pack_bits(qt.q, opts.bits),
            f"{base}weight_scale": qt.scale,
            f"{base}weight_shape": torch.tensor(list(qt.q.shape), dtype=torch.int64)}


def write_quantized(out_dir, names, info, get, plan: LinearPlan, opts: QuantOptions, *,
                    max_shard_bytes: int, metadata=None, write: bool = True
                    ) -> tuple[list[str], int]:
    """Write ``names`` (``info(name) -> (shape, dtype)``, ``get(name) -> tensor``, called
    once per name in order; a Linear weight may come as a :class:`QuantizedTensor`) to
    ``out_dir``; returns (files written, bytes of tensor data). ``write=False``: every
    ``get`` runs, nothing is written (see :func:`~.hf_shards.write_hf_shards`)."""
    sources = []
    for n in names:
        shape, dt = info(n)
        if n in plan and len(shape) != 2:
            raise CheckpointError(f"{n}: a Linear weight must be 2-D, got shape {list(shape)}")
        sources.append((n, entries(n, shape, dt, plan, opts)))
    planned = dict(sources)

    def produce(n):
        t = get(n)
        if not write:
            return {}
        if isinstance(t, QuantizedTensor):        # already quantized (LKD)
            return stored_tensors(n, t, opts)
        if n in plan:
            return quantize_weight(n, t, plan, opts, planned[n][1].dtype)
        odt = planned[n][0].dtype
        return {n: t.to(odt) if t.dtype != odt else t}

    return write_hf_shards(out_dir, sources, produce, max_shard_bytes=max_shard_bytes,
                           metadata=metadata, write=write)


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

