"""Weights out of an engine: a streamed state dict and ``save_pretrained`` (safetensors).

``engine.state_dict()`` is a read-only mapping whose values are produced one tensor at a
time from their homes (device/host buffer, NVMe extent, or the optimizer's fp32 master
in bf16/fp16), so iterating it never holds the whole model in memory.  Values are CPU
tensors also when the model trains on a GPU.
``save_pretrained(dir)`` writes ``model.safetensors`` (or shards
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``) with the
model's own parameter names, and the Hugging Face ``config.json`` when there is one.
``save_pretrained_quantized`` writes the same with the ``nn.Linear`` weights quantized
(compressed-tensors format, :mod:`infinity.checkpoint.compressed`), still one tensor at a
time.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from infinity.memory.pool import ALIGN, aligned_buffer, round_up
from infinity.memory.record import GroupRecord, Location, ParamSlot
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.engine")

__all__ = ["StreamedStateDict", "save_pretrained", "save_pretrained_quantized"]


class StreamedStateDict(Mapping):
    """``{name: tensor}`` over parameters (tied ones under every name, like torch) and
    persistent buffers; each value is read from its home when accessed."""

    def __init__(self, engine):
        self.engine = engine
        self._params: dict[str, torch.nn.Parameter] = {}
        for name, p in engine.module.named_parameters(remove_duplicate=False):
            self._params[name] = p
        self._buffers: dict[str, torch.Tensor] = {}
        for mname, mod in engine.module.named_modules():
            for bname, b in mod._buffers.items():
                if b is None or bname in mod._non_persistent_buffers_set:
                    continue
                self._buffers[f"{mname}.{bname}" if mname else bname] = b
        self._keys = list(self._params) + [k for k in self._buffers if k not in self._params]

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        return iter(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._params or key in self._buffers

    def __getitem__(self, key: str) -> torch.Tensor:
        self.engine.check_call("state_dict")
        if key in self._params:
            return read_param(self.engine, self._params[key])
        if key in self._buffers:
            return self._buffers[key].detach().to(device="cpu", copy=True)
        raise KeyError(key)


def slot_of(engine, p) -> tuple[GroupRecord, ParamSlot]:
    g = engine.grouping.param_group[id(p)]
    for s in g.slots:
        if s.param is p:
            return g, s
    raise KeyError(f"state_dict: parameter not found in its group {g.name}")


def read_param(engine, p: torch.nn.Parameter) -> torch.Tensor:
    """The current value of ``p`` (its original dtype), read from where it lives."""
    zero = engine.zero
    out_dtype = engine.orig_dtypes.get(id(p), torch.float32)
    if zero is not None and zero.world_size > 1:   # ZeRO shards: gather (collective)
        from infinity.zero.distributed import read_param_gathered
        return read_param_gathered(engine, p, out_dtype)
    g, s = slot_of(engine, p)
    if s.trainable and engine.dtype != torch.float32:
        out = torch.empty(s.numel, dtype=torch.float32)
        engine.store.read_master(engine.opt.key(g), out, start=s.offset)
        return out.view(s.shape).to(out_dtype)
    if g.quant is not None:               # stored quantized: its dequantized values
        from infinity.memory.frozen_quant import slot_value
        flat = slot_value(g, engine.swap, s)
    elif g.host_buf is not None:          # host home, or the host mirror of a resident
        flat = g.host_buf[s.offset:s.offset + s.numel]      # group on a separate device
    elif g.state is Location.DEVICE and g.device_buf is not None:
        flat = g.device_buf[s.offset:s.offset + s.numel]
    elif g.home == "nvme":
        flat = _read_extent_range(engine, g, s)
    else:
        raise RuntimeError(f"state_dict: group {g.name} in state {g.state.name} has no readable copy")
    return flat.view(s.shape).to(device="cpu", dtype=out_dtype, copy=True)


def _read_extent_range(engine, g: GroupRecord, s: ParamSlot) -> torch.Tensor:
    es = torch.empty((), dtype=g.dtype).element_size()
    start = s.offset * es
    end = start + s.numel * es
    a0 = start // ALIGN * ALIGN
    a1 = min(round_up(end, ALIGN), g.padded_numel * es)
    buf = aligned_buffer(round_up(a1 - a0, ALIGN))[: a1 - a0]
    engine.swap.read(g.extent, buf, offset=a0).wait()
    return buf[start - a0:end - a0].view(g.dtype).clone()


def save_pretrained(engine, directory, *, max_shard_bytes: int = 2 * 10 ** 9) -> list[str]:
    """Write safetensors shard(s) (+ index) and the HF config; returns the files written."""
    from infinity.checkpoint.hf_shards import Entry, write_hf_shards

    def write(sd, names, writer):
        sources = []
        for n in names:
            t, dt = _source(engine, sd, n)
            sources.append((n, [Entry(n, dt, tuple(t.shape))]))
        # one tensor in memory at a time: each is written as soon as it is read
        return write_hf_shards(directory, sources, lambda n: {n: sd[n]},
                               max_shard_bytes=max_shard_bytes, write=writer)[0]

    def finish(sd, files):
        log.info("save_pretrained: wrote %d file(s) to %s", len(files), directory)
    return _save(engine, directory, write, finish)


def _save(engine, directory, write, finish) -> list[str]:
    """The collective frame of both forms of save_pretrained: every rank streams the state
    dict in the same order (at world size > 1 its values are gathered: collectives), only
    rank 0 writes.  ``write(sd, names, writer)`` -> the paths written (unique tensors only:
    safetensors cannot store aliases, tied weights keep the first name); ``finish(sd, files)``
    runs on the writer after config.json."""
    zero = engine.zero
    writer = zero is None or zero.rank == 0
    if writer:
        makedirs(directory)
    sd = StreamedStateDict(engine)
    files = [os.path.basename(f) for f in write(sd, _unique_names(sd), writer)]
    if writer:
        files += _write_hf_config(engine, directory)
        finish(sd, files)
    if zero is not None and zero.world_size > 1:
        zero.comm.barrier("save_pretrained")
    return files


def _write_hf_config(engine, directory) -> list[str]:
    """``config.json`` (+ ``generation_config.json``) of a Hugging Face model."""
    files = []
    cfg = getattr(engine.module, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(directory)
        files.append("config.json")
        gen = getattr(engine.module, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            try:
                gen.save_pretrained(directory)
                files.append("generation_config.json")
            except Exception as e:  # generation config is optional metadata
                log.debug("save_pretrained: generation_config not written: %s", e)
    return files


def _source(engine, sd: StreamedStateDict, name: str):
    """The parameter or buffer behind ``name`` and the dtype it is written in."""
    t = sd._params.get(name)
    if t is None:
        t = sd._buffers[name]
    return t, engine.orig_dtypes.get(id(t), t.dtype)


def _unique_names(sd: StreamedStateDict) -> list[str]:
    seen: set[int] = set()
    names: list[str] = []
    for name in sd:
        t = sd._params.get(name)
        if t is not None:
            if id(t) in seen:
                continue
            seen.add(id(t))
        names.append(name)
    return names


def save_pretrained_quantized(engine, directory, *, quantize: str, group_size: int = 128,
                              max_shard_bytes: int = 2 * 10 ** 9,
                              quantize_lm_head: bool = False) -> list[str]:
    """``save_pretrained`` with the Linear weights quantized (``quantize``: "int8" |
    "int4", groups of ``group_size`` along the input dimension); the embeddings and the LM
    head (unless ``quantize_lm_head``) and every other tensor in 16-bit. Needs the model's
    Hugging Face config (``engine.module.config``) for ``config.json``."""
    from infinity.checkpoint.compressed import (QuantOptions, output_dtype, plan_linears,
                                                quantization_config, set_quantization_config,
                                                write_quantized)
    from infinity.checkpoint.layerwise import linear_modules
    if quantize not in ("int8", "int4"):
        raise ValueError(f"save_pretrained: quantize must be 'int8' or 'int4', got {quantize!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"save_pretrained: group_size must be a positive integer, got {group_size!r}")
    cfg = getattr(engine.module, "config", None)
    if cfg is None or not hasattr(cfg, "save_pretrained"):
        raise ValueError("save_pretrained(quantize=...) needs a Hugging Face model (with a "
                         "config) to write config.json with its quantization_config; "
                         f"{type(engine.module).__name__} has none")
    opts = QuantOptions(quantize, group_size=group_size, include_lm_head=quantize_lm_head)
    plan = plan_linears(linear_modules(engine.module), opts)

    def info(sd, name):
        t, dt = _source(engine, sd, name)
        return tuple(t.shape), dt

    def write(sd, names, writer):
        # the gathers are collectives: every rank reads every tensor in the same order
        return write_quantized(directory, names, lambda n: info(sd, n), lambda n: sd[n], plan,
                               opts, max_shard_bytes=max_shard_bytes, write=writer)[0]

    def finish(sd, files):
        src = next((info(sd, n)[1] for n in plan.layers), torch.float32)
        set_quantization_config(os.path.join(directory, "config.json"),
                                quantization_config(plan, opts), output_dtype(src, opts))
        log.info("save_pretrained(quantize=%s): %d Linear layers quantized, wrote %d file(s) "
                 "to %s", quantize, len(plan.layers), len(files), directory)
    return _save(engine, directory, write, finish)
