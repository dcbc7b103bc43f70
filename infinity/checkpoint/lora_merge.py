"""A LoRA checkpoint (``infinity finetune --lora R --save DIR``) seen as its base model.

Such a checkpoint holds a PEFT model's tensors under PEFT's names —
``base_model.model.<module>.base_layer.weight`` (the frozen base: stored in its compute
dtype, and dequantized when training kept it quantized, ``offload.frozen_weights``: the
values training used), ``<module>.lora_A.<adapter>.weight`` ``(r, in)`` and
``<module>.lora_B.<adapter>.weight`` ``(out, r)`` (fp32 masters) — and ``meta["lora"]``
(``rank``, ``alpha``, ``dropout``, ``targets``). :class:`LoraCheckpoint` gives the export
the base model's own names (``base_model.model.`` and ``base_layer.`` stripped) and, for
every adapted layer, the merged weight, computed as PEFT's ``merge_and_unload`` does
(``LoraLayer.get_delta_weight``)::

    W' = W + transpose(B @ A, fan_in_fan_out) * (alpha / r)

in fp32, then cast to the base weight's dtype (or the export's ``dtype``): ``fan_in_fan_out``
for GPT-2's ``Conv1D``, whose weight is stored ``(in, out)``. One layer at a time: its base
weight and its two adapters are read when the writer asks for it.

Everything is checked before a byte is written: a ``lora`` meta that is not ``{rank >= 1,
alpha > 0}``, adapters without that meta (no scaling to merge with), a layer with a base
weight but a missing ``lora_A``/``lora_B`` (or the reverse), ranks or shapes that do not fit
each other or the meta, adapter kinds this merge does not know (``lora_embedding_*``, DoRA's
``lora_magnitude_vector``, several adapter names), adapted layers the meta's targets do not
name: each a :class:`CheckpointError` naming the tensors.

:func:`adapter_tensors` / :func:`adapter_config` / :func:`write_adapter_weights` write the
adapters as PEFT's ``save_pretrained`` does instead (``adapter_model.safetensors``, keys
without the adapter name; ``adapter_config.json``), for ``infinity export --adapters-only``.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

import torch

from . import dtypes
from .errors import CheckpointError
from .fsutil import atomic_write_text, fsync_dir, remove_tree
from .safetensors_stream import SafetensorsStreamWriter, header_reserve_for

log = logging.getLogger("infinity.checkpoint")

META_KEY = "lora"
PEFT_PREFIX = "base_model.model."
BASE_LAYER = "base_layer"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_REQUIREMENT = "peft>=0.15"

_ADAPTER = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.(?P<adapter>[^.]+)\.weight$")
_SHOW = 5


def _listing(items, n=_SHOW):
    items = list(items)
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


@dataclass(frozen=True)
class LoraSettings:
    """``meta["lora"]`` of a checkpoint: what ``infinity finetune --lora`` trained."""
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = ()

    @property
    def scaling(self) -> float:
        """PEFT's ``lora_alpha / r`` (``use_rslora`` is never set by infinity)."""
        return self.alpha / self.rank


def lora_settings(meta, where) -> LoraSettings | None:
    """The validated ``meta["lora"]`` (None when the meta has none)."""
    d = meta.get(META_KEY) if isinstance(meta, dict) else None
    if d is None:
        return None
    what = f"{where}: meta['{META_KEY}']"
    if not isinstance(d, dict):
        raise CheckpointError(f"{what} must be an object with rank and alpha, got {d!r}")
    rank, alpha = d.get("rank"), d.get("alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{what}['rank'] must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not \
            (0 < alpha < float("inf")):
        raise CheckpointError(f"{what}['alpha'] must be a finite number > 0, got {alpha!r}")
    dropout = d.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or \
            not 0 <= dropout < 1:
        raise CheckpointError(f"{what}['dropout'] must be in [0, 1), got {dropout!r}")
    targets = d.get("targets", [])
    if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
        raise CheckpointError(f"{what}['targets'] must be a list of module names, got "
                              f"{targets!r}")
    return LoraSettings(int(rank), float(alpha), float(dropout), tuple(targets))


def base_name(name: str) -> str:
    """A PEFT name as the base model names it: ``base_model.model.X.base_layer.weight`` ->
    ``X.weight``."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return ".".join(p for p in name.split(".") if p != BASE_LAYER)


def _is_adapter_name(name: str) -> bool:
    return any(p.startswith("lora_") for p in name.split("."))


def has_adapters(names) -> bool:
    """Does any of ``names`` belong to a (PEFT) LoRA adapter?"""
    return any(_is_adapter_name(n) for n in names)


@dataclass(frozen=True)
class AdaptedLayer:
    """One Linear/Conv1D layer with adapters: the checkpoint names of its base weight and
    its two adapter matrices, and whether its weight is stored ``(in, out)`` (Conv1D)."""
    module: str             # the base model's module name
    base: str
    lora_a: str
    lora_b: str
    fan_in_fan_out: bool


def _module_kinds(model_config):
    """``{module name: is Conv1D}`` of the Linear/Conv1D layers of the model the checkpoint
    records (built on the meta device), or None when it records none or it cannot be built."""
    if not isinstance(model_config, dict) or "model_type" not in model_config:
        return None
    from .layerwise import linear_modules, meta_model
    try:
        model = meta_model(model_config)
    except Exception as e:  # noqa: BLE001 - an unknown architecture: decide by the shapes
        log.debug("LoRA merge: the recorded model could not be built (%s); layer kinds "
                  "follow the weights' shapes", e)
        return None
    return {name: conv1d for name, _rows, _cols, _head, conv1d in linear_modules(model)}


class LoraCheckpoint:
    """The model tensors of a LoRA checkpoint under the base model's names, adapters merged.

    ``names``: the base model's tensor names in checkpoint order; ``info(name)`` ->
    (shape, dtype) as the base stores it; ``read(name, dtype=None)``: the tensor, merged
    for an adapted layer's weight (:attr:`layers`), cast to ``dtype`` when floating point;
    ``read_base(name)``: the unmerged base tensor."""

    def __init__(self, reader, names, settings: LoraSettings | None):
        self.r, self.settings = reader, settings
        where = str(reader.path)
        if settings is None:
            shown = _listing(n for n in names if _is_adapter_name(n))
            raise CheckpointError(
                f"{where} holds LoRA adapter tensors ({shown}) but its meta records no "
                f"'{META_KEY}' entry (rank, alpha): the merge scales them by alpha / rank and "
                f"cannot guess it. infinity finetune --lora records it; for a checkpoint saved "
                f"otherwise, merge with PEFT (merge_and_unload) and save that model")
        parts: dict[str, dict[str, str]] = {}     # PEFT module -> {"lora_A"|"lora_B"|"base": name}
        adapters, unsupported, sources = set(), [], {}
        for n in names:
            if any(p in ("modules_to_save", "original_module") for p in n.split(".")):
                unsupported.append(n)       # PEFT's modules_to_save copies: never infinity's
                continue
            if _is_adapter_name(n):
                m = _ADAPTER.match(n)
                if m is None or sum(p.startswith("lora_") for p in n.split(".")) != 1:
                    unsupported.append(n)
                    continue
                adapters.add(m["adapter"])
                parts.setdefault(m["module"], {})[m["kind"]] = n
                continue
            segs = n.split(".")
            if BASE_LAYER in segs:
                i = segs.index(BASE_LAYER)
                if segs[i + 1:] == ["weight"]:
                    parts.setdefault(".".join(segs[:i]), {})["base"] = n
            out = base_name(n)
            if out in sources:
                raise CheckpointError(f"{where}: {sources[out]} and {n} are both the base "
                                      f"model's {out}; the checkpoint is inconsistent")
            sources[out] = n
        if unsupported:
            raise CheckpointError(
                f"{where}: adapter tensors this export cannot merge: {_listing(unsupported)} "
                f"(it merges lora_A/lora_B of Linear and Conv1D layers: no LoRA on "
                f"embeddings, no DoRA, no adapter biases, no modules_to_save)")
        if len(adapters) > 1:
            raise CheckpointError(f"{where}: the checkpoint holds several adapters "
                                  f"({', '.join(sorted(adapters))}); one is merged at a time")
        if not adapters:
            raise CheckpointError(
                f"{where}: meta['{META_KEY}'] records LoRA adapters (rank {settings.rank}) but "
                f"the checkpoint holds no lora_A/lora_B tensor; it is not the checkpoint of a "
                f"LoRA run (or its adapters were lost): export another tag (--tag)")
        self.adapter = next(iter(adapters))
        missing = []
        for mod, p in parts.items():
            for kind, want in (("base", f"{mod}.{BASE_LAYER}.weight"),
                               ("lora_A", f"{mod}.lora_A.{self.adapter}.weight"),
                               ("lora_B", f"{mod}.lora_B.{self.adapter}.weight")):
                if kind not in p:
                    missing.append(want)
        if missing:
            raise CheckpointError(
                f"{where}: inconsistent LoRA checkpoint: every adapted layer needs its base "
                f"weight, lora_A and lora_B, and {len(missing)} tensor(s) are missing: "
                f"{_listing(missing)}. The checkpoint cannot be merged; export another tag "
                f"(--tag) or the run's --output adapters")
        kinds = _module_kinds(reader.meta.get("model_config"))
        self.layers: dict[str, AdaptedLayer] = {}
        for mod, p in parts.items():
            layer = self._layer(where, mod, p, kinds)
            self.layers[f"{layer.module}.weight"] = layer
        self._check_targets(where)
        self.sources = sources
        self.names = list(sources)

    def _layer(self, where, mod, p, kinds) -> AdaptedLayer:
        r = self.settings.rank
        (a_shape, a_dt), (b_shape, b_dt) = self.r.info(p["lora_A"]), self.r.info(p["lora_B"])
        w_shape, w_dt = self.r.info(p["base"])
        for n, dt in ((p["lora_A"], a_dt), (p["lora_B"], b_dt), (p["base"], w_dt)):
            if not dt.is_floating_point:
                raise CheckpointError(f"{where}: {n} is {dt}, not a floating-point tensor")
        if len(a_shape) != 2 or len(b_shape) != 2 or len(w_shape) != 2:
            raise CheckpointError(f"{where}: {mod}: lora_A {list(a_shape)}, lora_B "
                                  f"{list(b_shape)} and the base weight {list(w_shape)} must "
                                  f"all be 2-D")
        if a_shape[0] != r or b_shape[1] != r:
            raise CheckpointError(f"{where}: {mod}: lora_A {list(a_shape)} and lora_B "
                                  f"{list(b_shape)} are not of rank {r}, the rank "
                                  f"meta['{META_KEY}'] records")
        out_f, in_f = int(b_shape[0]), int(a_shape[1])
        module = base_name(mod)
        w_shape = tuple(int(s) for s in w_shape)
        conv1d = None if kinds is None else kinds.get(module)
        if conv1d is None:        # the recorded model does not say: the weight's layout does
            if out_f == in_f and w_shape == (out_f, in_f):
                raise CheckpointError(
                    f"{where}: {mod}: a square layer whose kind (nn.Linear, or a Conv1D stored "
                    f"transposed) the checkpoint does not record: the merge needs "
                    f"meta['model_config'] naming the layer (save with "
                    f"extra_meta=model_meta(model), as infinity finetune does)")
            conv1d = w_shape == (in_f, out_f)
        want = (in_f, out_f) if conv1d else (out_f, in_f)
        if w_shape != want:
            layout = "a Conv1D stores it (in, out)" if conv1d else "a Linear stores it (out, in)"
            raise CheckpointError(
                f"{where}: {mod}: base weight {list(w_shape)} does not fit lora_B @ lora_A "
                f"({out_f} x {in_f}; {layout}: {list(want)})")
        return AdaptedLayer(module, p["base"], p["lora_A"], p["lora_B"], bool(conv1d))

    def _check_targets(self, where):
        targets = self.settings.targets
        if not targets:
            return
        modules = [layer.module for layer in self.layers.values()]

        def hit(m, t):
            return m == t or m.endswith("." + t)
        stray = [m for m in modules if not any(hit(m, t) for t in targets)]
        unused = [t for t in targets if not any(hit(m, t) for m in modules)]
        if stray or unused:
            raise CheckpointError(
                f"{where}: the adapters do not match meta['{META_KEY}']['targets'] "
                f"({', '.join(targets)}): "
                + "; ".join(x for x in (
                    f"adapters on {_listing(stray)}, which no target names" if stray else "",
                    f"no adapters on a layer named {_listing(unused)}" if unused else "") if x)
                + ". The checkpoint is inconsistent")

    @property
    def fan_in_fan_out(self) -> bool:
        return any(layer.fan_in_fan_out for layer in self.layers.values())

    def __contains__(self, name) -> bool:
        return name in self.sources

    def info(self, name):
        return self.r.info(self.sources[name])

    def read_base(self, name, dtype=None) -> torch.Tensor:
        t = self.r.read(self.sources[name])
        if dtype is not None and t.dtype != dtype and t.dtype.is_floating_point:
            t = t.to(dtype)
        return t

    def read(self, name, dtype=None) -> torch.Tensor:
        layer = self.layers.get(name)
        if layer is None:
            return self.read_base(name, dtype)
        w = self.r.read(layer.base)
        out_dtype = dtype or w.dtype
        merged = w if w.dtype == torch.float32 else w.float()
        a = self.r.read(layer.lora_a).float()
        b = self.r.read(layer.lora_b).float()
        # peft LoraLayer.get_delta_weight: transpose(B @ A, fan_in_fan_out) * scaling,
        # added to the base weight (merge / merge_and_unload), here in fp32
        delta = b @ a
        if layer.fan_in_fan_out:
            delta = delta.T
        merged.add_(delta * self.settings.scaling)
        if not bool(torch.isfinite(merged).all()):
            bad = int((~torch.isfinite(merged)).flatten().nonzero()[0])
            raise CheckpointError(f"{self.r.path}: merging the adapters of {layer.module} gives a "
                                  f"non-finite weight (flat element {bad}): the adapters or the "
                                  f"base are broken")
        return merged if merged.dtype == out_dtype else merged.to(out_dtype)

    def describe(self, merged=True) -> str:
        s = self.settings
        return (f"LoRA rank {s.rank}, alpha {s.alpha:g} (scaling {s.scaling:g}) "
                f"{'merged into' if merged else 'on'} {len(self.layers)} layer(s)")


def lora_checkpoint(reader, names) -> LoraCheckpoint | None:
    """:class:`LoraCheckpoint` over ``names`` (the checkpoint's model tensors) when the
    checkpoint is a LoRA one (``meta["lora"]`` or adapter tensors), else None."""
    settings = lora_settings(reader.meta, str(reader.path))
    if settings is None and not has_adapters(names):
        return None
    return LoraCheckpoint(reader, names, settings)


# --- the adapters as PEFT writes them (infinity export --adapters-only) ----------------------

def adapter_tensors(lora: LoraCheckpoint):
    """``[(key, checkpoint name)]`` of the adapter matrices under the keys PEFT's
    ``save_pretrained`` uses (``base_model.model.<module>.lora_A.weight``: no adapter name)."""
    out = []
    for layer in lora.layers.values():
        for kind, n in (("lora_A", layer.lora_a), ("lora_B", layer.lora_b)):
            out.append((f"{PEFT_PREFIX}{layer.module}.{kind}.weight", n))
    return out


def adapter_config(lora: LoraCheckpoint, base_model_name_or_path: str) -> dict:
    """``adapter_config.json`` as PEFT writes it for these adapters (``peft.LoraConfig``:
    rank, alpha, dropout, targets, ``fan_in_fan_out`` for Conv1D, no bias, causal LM)."""
    try:
        import peft
    except ImportError as e:
        raise CheckpointError(f"writing PEFT adapter files needs the peft package "
                              f"({PEFT_REQUIREMENT}; pip install '{PEFT_REQUIREMENT}'): {e}") from e
    s = lora.settings
    targets = list(s.targets) or sorted({layer.module.rsplit(".", 1)[-1]
                                        for layer in lora.layers.values()})
    cfg = peft.LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout,
                          target_modules=targets, fan_in_fan_out=lora.fan_in_fan_out,
                          bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model_name_or_path,
                          inference_mode=True)
    d = cfg.to_dict()
    for k, v in d.items():          # as PeftConfigMixin.save_pretrained does
        if isinstance(v, set):
            d[k] = sorted(v)
    return json.loads(json.dumps(d, default=str))


def write_adapter_weights(lora: LoraCheckpoint, out_dir, dtype=None) -> str:
    """``out_dir/adapter_model.safetensors`` (temp name, fsync, rename); returns its path."""
    keys = adapter_tensors(lora)
    infos = []
    for key, n in keys:
        shape, dt = lora.r.info(n)
        infos.append((key, n, dtype or dt, tuple(shape)))
    final = os.path.join(out_dir, ADAPTER_WEIGHTS)
    tmp = os.path.join(out_dir, f".{ADAPTER_WEIGHTS}.tmp-{os.getpid()}")
    remove_tree(tmp)
    w = SafetensorsStreamWriter(tmp, header_reserve=header_reserve_for(
        [(k, dtypes.to_st(dt), shape) for k, _n, dt, shape in infos]),
        metadata={"format": "pt"})
    try:
        for key, n, dt, _shape in infos:
            t = lora.r.read(n)
            w.add(key, t if t.dtype == dt else t.to(dt))
        w.close()
        os.rename(tmp, final)
    except BaseException:
        w.abort()
        remove_tree(tmp)
        raise
    fsync_dir(out_dir)
    return final


def write_adapter_config(config: dict, out_dir) -> str:
    """``out_dir/adapter_config.json`` from :func:`adapter_config`'s dict (atomically)."""
    path = os.path.join(out_dir, ADAPTER_CONFIG)
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def recorded_base_dir(meta) -> str | None:
    """The ``--model`` directory an ``infinity finetune`` run loaded its base from (its
    ``meta["run"]["model"]["path"]``) when it still holds a model, else None (a shipped
    model or a config ``.json``: the base was randomly initialised and exists nowhere else)."""
    run = meta.get("run") if isinstance(meta, dict) else None
    model = run.get("model") if isinstance(run, dict) else None
    path = model.get("path") if isinstance(model, dict) else None
    if isinstance(path, str) and os.path.isdir(path) and \
            os.path.isfile(os.path.join(path, "config.json")):
        return path
    return None
