"""What an engine checkpoint must satisfy before the engine loads it.

Checksums prove the bytes are the ones written; they do not prove the ones written (or
re-sealed after an edit) make sense. :func:`check_engine_checkpoint` refuses, with a
:class:`CheckpointError` naming the manifest, the key or tensor and what is wrong, a
checkpoint whose meta or manifest the engine cannot restore consistently:

- meta: step counters that are not integers >= 0, more applied updates (``step``) than
  accumulation boundaries, a ``micro_step`` outside the window of its boundary (at the
  ``gradient_accumulation_steps`` of the saved config), a ``world_size`` other than the
  manifest's (the ranks that wrote the shard files), an ``rng_ranks`` list of another
  length, dtype names that are not the engine's (``precision``,
  ``optimizer_state_dtype``), a bad loss scaler, scheduler or RNG state;
- tensors: an ``exp_avg`` / ``exp_avg_sq`` whose shape is not its parameter's, Adam
  moments not in fp32 or bf16, in mixed dtypes, or in another dtype than
  ``optimizer_state_dtype`` says.

These are cheap (the manifest and meta only) and run before a byte is hashed. The
values themselves (no NaN/inf in a master or a moment, no negative ``exp_avg_sq``) are
checked by :func:`value_checks` while ``verify()`` hashes them
(:mod:`infinity.checkpoint.values`). Everything here runs before the engine changes.
"""
from __future__ import annotations

import math

from infinity.checkpoint.errors import CheckpointError
from infinity.checkpoint.rng import parse_rng_state
from infinity.checkpoint.values import ValueCheck
from infinity.config_sections import MAX_ACCUMULATION_STEPS, PRECISIONS

OPTIM_STATES = ("exp_avg", "exp_avg_sq")
STATE_DTYPE_NAMES = ("fp32", "bf16")
_STATE_ST = {"fp32": "F32", "bf16": "BF16"}   # optimizer_state_dtype -> safetensors dtype


def _bad(where, key, why):
    return CheckpointError(f"checkpoint {where}: meta[{key!r}] {why}; the checkpoint was not "
                           f"written by this engine or is damaged: load another tag")


def _is_int(v, lo=0):
    return type(v) is int and v >= lo


def saved_accumulation(meta, where, default):
    """``gradient_accumulation_steps`` of the run that saved the checkpoint (its config in
    the meta), or ``default`` when the meta records no config."""
    cfg = meta.get("config")
    if not isinstance(cfg, dict) or "gradient_accumulation_steps" not in cfg:
        return default
    gas = cfg["gradient_accumulation_steps"]
    if not _is_int(gas, 1) or gas > MAX_ACCUMULATION_STEPS:
        raise _bad(where, "config", f"has gradient_accumulation_steps {gas!r}; expected an "
                   f"integer in [1, {MAX_ACCUMULATION_STEPS}]")
    return gas


def check_meta(meta, where, *, gas, world_size=None):
    """Reject meta the engine cannot restore, so a load fails before it changes anything
    (meta is applied after the tensors; a bad value there would leave a half-loaded engine).
    ``gas``: the loading engine's accumulation (used when the meta has no config);
    ``world_size``: the manifest's (None: not checked)."""
    for key in ("step", "boundaries", "micro_step"):
        v = meta.get(key)
        if key == "step" or v is not None:
            if not _is_int(v):
                raise _bad(where, key, f"must be an integer >= 0, got {v!r}")
    step = meta["step"]
    boundaries = meta.get("boundaries")
    if boundaries is not None and step > boundaries:
        raise _bad(where, "step", f"is {step}: more applied updates than accumulation "
                   f"boundaries (meta['boundaries'] {boundaries})")
    micro = meta.get("micro_step")
    if micro is not None:
        b = step if boundaries is None else boundaries
        saved = saved_accumulation(meta, where, gas)
        if not b * saved <= micro < (b + 1) * saved:
            raise _bad(where, "micro_step", f"is {micro}, outside the accumulation window of "
                       f"boundary {b} (micro-steps {b * saved}..{(b + 1) * saved - 1} at "
                       f"gradient_accumulation_steps {saved})")
    ls = meta.get("loss_scaler")
    if ls is not None:
        if not isinstance(ls, dict):
            raise _bad(where, "loss_scaler", f"must be an object, got {type(ls).__name__}")
        sc = ls.get("scale", 1.0)
        if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not (0 < sc < math.inf):
            raise _bad(where, "loss_scaler", f"has scale {sc!r}; expected a finite number > 0")
        for k in ("clean_steps", "skipped_steps"):
            if k in ls and not _is_int(ls[k]):
                raise _bad(where, "loss_scaler", f"has {k} {ls[k]!r}; expected an integer >= 0")
    for key, allowed in (("precision", PRECISIONS), ("optimizer_state_dtype", STATE_DTYPE_NAMES)):
        v = meta.get(key)
        if key in meta and v not in allowed:
            raise _bad(where, key, f"is {v!r}, not a dtype name this engine knows (one of "
                       f"{', '.join(repr(a) for a in allowed)})")
    if "world_size" in meta:
        w = meta["world_size"]
        if not _is_int(w, 1):
            raise _bad(where, "world_size", f"must be an integer >= 1, got {w!r}")
        if world_size is not None and w != world_size:
            raise _bad(where, "world_size", f"is {w}, but the manifest's shard files were "
                       f"written by {world_size} rank(s)")
    zs = meta.get("zero_stage")
    if zs is not None and zs not in (1, 2, 3):
        raise _bad(where, "zero_stage", f"is {zs!r}; expected 1, 2, 3 or null")
    for key in ("torch_scheduler", "rng"):
        v = meta.get(key)
        if v is not None and not isinstance(v, dict):
            raise _bad(where, key, f"must be an object or null, got {type(v).__name__}")
    rr = meta.get("rng_ranks")
    if rr is not None:
        if not isinstance(rr, list) or not all(isinstance(x, dict) for x in rr):
            raise _bad(where, "rng_ranks", "must be a list of objects (one RNG state per rank) "
                       "or null")
        if world_size is not None and len(rr) != world_size:
            raise _bad(where, "rng_ranks", f"holds {len(rr)} RNG states, but the checkpoint was "
                       f"written by {world_size} rank(s)")
    for i, st in enumerate([meta.get("rng")] + list(rr or [])):
        if st is not None:   # every RNG state is tried on scratch generators (nothing changes)
            try:
                parse_rng_state(st)
            except CheckpointError as e:
                raise _bad(where, "rng" if i == 0 else f"rng_ranks[{i - 1}]", str(e)) from None


def check_tensors(reader, names):
    """The Adam moments of each trainable parameter in ``names`` against the checkpoint's own
    entry of that parameter (shape) and against each other and the meta (dtype). Names
    missing from the checkpoint are left to ``check_compatible``."""
    tensors = reader.manifest["tensors"]
    want = _STATE_ST.get(reader.meta.get("optimizer_state_dtype"))
    seen = None
    for name in names:
        p = tensors.get(name)
        for which in OPTIM_STATES:
            key = f"optim.{name}.{which}"
            t = tensors.get(key)
            if t is None or p is None:
                continue
            if t["shape"] != p["shape"]:
                raise CheckpointError(
                    f"checkpoint {reader.path}: tensor {key!r} has shape {t['shape']} but its "
                    f"parameter {name!r} has {p['shape']}; an Adam moment has its parameter's "
                    f"shape: the checkpoint is corrupt, load another tag")
            dt = t["dtype"]
            if dt not in _STATE_ST.values():
                raise CheckpointError(
                    f"checkpoint {reader.path}: tensor {key!r} is {dt}; this engine reads Adam "
                    f"moments in F32 or BF16: the checkpoint was not written by infinity or is "
                    f"damaged")
            if want is not None and dt != want:
                raise CheckpointError(
                    f"checkpoint {reader.path}: tensor {key!r} is {dt}, but meta "
                    f"['optimizer_state_dtype'] says {reader.meta['optimizer_state_dtype']!r} "
                    f"({want}): the checkpoint is corrupt, load another tag")
            if seen is not None and dt != seen[1]:
                raise CheckpointError(
                    f"checkpoint {reader.path}: tensor {key!r} is {dt} but {seen[0]!r} is "
                    f"{seen[1]}; all Adam moments are saved in one dtype: the checkpoint is "
                    f"corrupt, load another tag")
            seen = seen or (key, dt)


def check_engine_checkpoint(reader, names, *, gas):
    """Everything :mod:`this module <infinity.engine.checkpoint_checks>` checks before the
    bytes: ``names`` are the engine's trainable parameters, ``gas`` its accumulation."""
    check_meta(reader.meta, reader.path, gas=gas, world_size=reader.world_size)
    check_tensors(reader, names)


def value_checks(names):
    """``{tensor: ValueCheck}`` for :meth:`CheckpointReader.verify`: the fp32 master and
    both Adam moments of every trainable parameter in ``names`` finite, ``exp_avg_sq``
    also >= 0."""
    out = {}
    for n in names:
        out[n] = ValueCheck("the fp32 master weight", hint="training from it writes NaN weights")
        out[f"optim.{n}.exp_avg"] = ValueCheck("the Adam first moment",
                                               hint="the next update would write NaN weights")
        out[f"optim.{n}.exp_avg_sq"] = ValueCheck(
            "the Adam second moment", nonneg=True,
            hint="the next update would write NaN weights",
            nonneg_hint="a running mean of squared gradients is >= 0 everywhere: the state "
                        "is corrupt, or exp_avg and exp_avg_sq were swapped")
    return out
