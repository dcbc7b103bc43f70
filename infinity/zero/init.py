"""``infinity.Init(config)``: build a model straight into its offloaded home.

While the context is active, every ``nn.Module`` subclass's ``__init__`` is wrapped:
when the *outermost* ``__init__`` of a module returns (its own init functions have run,
on CPU, with the normal RNG stream), the module's direct parameters are moved to their
home and each ``param.data`` becomes a placeholder of the right shape and dtype (one NaN
element with zero strides, as for a released engine group).  So at most one module's
parameters are materialised at a time, and the same seed gives exactly the weights of
eager construction.

Homes (``offload.params``): ``"nvme"`` writes each parameter (at world size W > 1: only
this rank's 1/W chunk of it; reading it back all-gathers the chunks) to a swap file of this
rank (``<nvme_path>/init/infinity-rank<r>/``, private, unlinked, removed when the last
parameter has been adopted); ``"cpu"`` and ``"none"`` keep one compact host tensor per
parameter.  Each managed parameter has one :class:`InitRecord` in a registry keyed by the
parameter's id (no attributes are attached to the parameter).

Code that touches parameters after their module's ``__init__`` (Hugging Face
``post_init()`` re-initialises every module with ``_init_weights``) is handled by
faulting the module's parameters back in around each ``_initialize_weights(module)`` call
and storing the result again, one module at a time.  Any other in-place write to an
offloaded parameter fails loudly (the placeholder is not writable), never silently.

``initialize(model, config)`` adopts the parameters group by group
(:func:`adopting`): their values are streamed back from the Init home into the engine's
homes and the Init copy is freed.  :func:`load_safetensors` streams a checkpoint into an
Init-built model tensor by tensor.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from infinity.memory.record import placeholder
from infinity.memory.sources import record_source
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.zero")

__all__ = ["Init", "InitRecord", "adopting", "is_managed", "materialized", "load_safetensors",
           "managed_count", "nvme_need"]

_RECORDS: dict[int, "InitRecord"] = {}
_LOCK = threading.RLock()
_ACTIVE: "Init | None" = None


class InitRecord:
    """Where one Init-managed parameter's values live until ``initialize`` adopts them."""
    __slots__ = ("pid", "store", "shape", "dtype", "numel", "host", "extent", "finalizer")

    def __init__(self, store: "_InitStore", p: torch.Tensor):
        self.pid = id(p)
        self.store = store
        self.shape = p.shape
        self.dtype = p.dtype
        self.numel = p.numel()
        self.host = None
        self.extent = None
        self.finalizer = None

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class _InitStore:
    """The homes of the parameters built under one ``Init``: host tensors or a swap space."""

    def __init__(self, home: str, cfg, rank: int, world_size: int = 1, reserve: int = 0):
        self.home = "nvme" if home == "nvme" else "cpu"
        self.reserve = reserve    # bytes to preallocate at once (the checked Init copy)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.aio = self.swap = None
        self.live = 0
        self.context_open = True
        self.bytes_written = 0

    def _open_swap(self):
        from infinity.io import AioEngine, SwapSpace
        a = self.cfg.aio
        from infinity.memory.plan import note_created_dirs
        paths = [os.path.join(p, "init") for p in self.cfg.offload.nvme_paths]
        self.init_dirs = paths
        for p in paths:
            try:
                note_created_dirs(makedirs(p, 0o700, parents_mode=0o755))
            except OSError as e:
                raise OSError(e.errno, f"infinity.Init: cannot create {p!r}: {e.strerror}; "
                                       f"set offload.nvme_paths to a writable directory") from e
        self.aio = AioEngine(a.block_size, a.queue_depth, a.threads, a.engine)
        self.swap = SwapSpace(paths, self.aio, rank=self.rank)
        if self.reserve:
            # exactly what the free-space check counted: growing ahead (doubling) could
            # take more than that and leave the engine short on a tight file system
            self.swap.reserve(self.reserve)

    def _chunk(self, rec: InitRecord) -> tuple[int, int, int]:
        """(chunk elements per rank, this rank's first element, its element count)."""
        c = -(-max(rec.numel, 1) // self.world_size)
        lo = self.rank * c
        return c, lo, max(0, min(c, rec.numel - lo))

    def put(self, rec: InitRecord, value: torch.Tensor) -> None:
        """Store ``value`` (the parameter's full data, identical on every rank since every
        rank runs the same seeded init) as ``rec``'s home copy: the whole tensor at world
        size 1, else only this rank's 1/W chunk of it."""
        value = value.detach()
        if self.world_size == 1:
            mine = value.reshape(-1)
            c = rec.numel
        else:
            c, lo, n = self._chunk(rec)
            mine = torch.zeros(c, dtype=rec.dtype)
            mine[:n].copy_(value.reshape(-1)[lo:lo + n])
        if self.home == "cpu":
            if self.world_size > 1:
                rec.host = mine
            elif rec.host is None:
                rec.host = value.contiguous().clone() if not value.is_contiguous() or \
                    value.device.type != "cpu" else value
            else:
                rec.host.copy_(value)
            return
        if self.swap is None:
            self._open_swap()
        from infinity.memory.pool import aligned_buffer, round_up
        esize = torch.empty((), dtype=rec.dtype).element_size()
        nbytes = round_up(max(c * esize, 1), 4096)
        if rec.extent is None:
            try:
                rec.extent = self.swap.allocate(nbytes)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                from infinity.memory.plan import fmt_mb
                raise OSError(errno.ENOSPC, f"infinity.Init: the NVMe swap in "
                              f"{', '.join(self.swap.paths)} is full after {fmt_mb(self.bytes_written)} "
                              f"of parameters, and the model being built needs more (then the "
                              f"engine needs its own swap on top); free space or choose a larger "
                              f"offload.nvme_paths entry. To fail before building: "
                              f"Init(config, nvme_need=nvme_need(model_on_meta, config)) with "
                              f"nvme_need from infinity.zero.init ({e})") from e
        raw = aligned_buffer(nbytes)
        raw[c * esize:].zero_()
        raw[: c * esize].view(rec.dtype).copy_(mine)
        self.swap.write(rec.extent, raw).wait()
        self.bytes_written += nbytes

    def _mine(self, rec: InitRecord, c: int) -> torch.Tensor:
        if rec.host is not None:
            return rec.host.reshape(-1)[:c]
        from infinity.memory.pool import aligned_buffer, round_up
        esize = torch.empty((), dtype=rec.dtype).element_size()
        raw = aligned_buffer(round_up(max(c * esize, 1), 4096))
        self.swap.read(rec.extent, raw).wait()
        return raw[: c * esize].view(rec.dtype)

    def get(self, rec: InitRecord) -> torch.Tensor:
        """A tensor with ``rec``'s full values (the host copy itself for the cpu home at
        world size 1).  At world size > 1 this all-gathers the chunks: collective, every
        rank calls it for the same parameters in the same order."""
        if self.world_size == 1:
            return self._mine(rec, rec.numel).view(rec.shape)
        import torch.distributed as dist
        c, _, _ = self._chunk(rec)
        mine = self._mine(rec, c).clone()
        full = torch.empty(c * self.world_size, dtype=rec.dtype)
        try:
            dist.all_gather_into_tensor(full, mine)
        except Exception as e:
            raise RuntimeError(f"infinity.Init: rank {self.rank} of {self.world_size}: "
                               f"all_gather of a {tuple(rec.shape)} parameter failed: {e}; "
                               f"every rank must build and adopt the same model") from e
        return full[: rec.numel].view(rec.shape)

    def drop(self, rec: InitRecord) -> None:
        if rec.extent is not None and self.swap is not None and not self.swap.closed:
            self.swap.free(rec.extent)
        rec.extent = None
        rec.host = None
        self.live -= 1
        self.maybe_close()

    def maybe_close(self) -> None:
        if self.live <= 0 and not self.context_open:
            self.close()

    def close(self) -> None:
        if self.swap is not None:
            self.swap.close()
            self.swap = None
            # ``<path>/init`` is infinity's own name: whichever rank closes last removes it
            # (rmdir only succeeds once every rank's private directory inside is gone), and
            # with it the parents this process created, once empty
            from infinity.memory.plan import remove_if_empty
            remove_if_empty(getattr(self, "init_dirs", []))
        if self.aio is not None:
            self.aio.close()
            self.aio = None


def _forget(pid: int) -> None:
    with _LOCK:
        rec = _RECORDS.pop(pid, None)
    if rec is not None:
        try:
            rec.store.drop(rec)
        except Exception as e:  # finalizers must not raise
            log.debug("Init: freeing the home of a dropped parameter failed: %s", e)


def is_managed(p: torch.Tensor) -> bool:
    return id(p) in _RECORDS and _RECORDS[id(p)].finalizer is not None and \
        _RECORDS[id(p)].finalizer.alive


def managed_count() -> int:
    return len(_RECORDS)


def record_of(p: torch.Tensor) -> InitRecord | None:
    rec = _RECORDS.get(id(p))
    if rec is None or rec.finalizer is None or not rec.finalizer.alive:
        return None
    return rec


# ---------------------------------------------------------------------- fault in / adopt
@contextlib.contextmanager
def materialized(params, *, write_back: bool = True):
    """Temporarily give Init-managed ``params`` their real values (``p.data``); on exit the
    (possibly modified) values are stored again and the placeholders restored."""
    recs = []
    for p in params:
        rec = record_of(p)
        if rec is not None:
            p.data = rec.store.get(rec)
            recs.append((p, rec))
    try:
        yield
    finally:
        for p, rec in recs:
            if write_back and (rec.host is None or p.data.data_ptr() != rec.host.data_ptr()
                               or rec.store.world_size > 1):
                rec.store.put(rec, p.data)
            p.data = placeholder(rec.dtype, rec.shape)


# What a placeholder answers as the values would (its true shape and dtype over one
# element, infinity.memory.record.placeholder) and flag changes that leave the values alone:
# ``p.requires_grad_(False)`` or ``p.shape`` inside a module's ``__init__`` (a PEFT-style
# layer freezing its base) must not read the parameter back from its Init home and write it
# again.  Not ``stride`` / ``is_contiguous``: the placeholder's differ.
_META_METHODS = frozenset({
    torch.Tensor.requires_grad_, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.nelement, torch.Tensor.ndimension, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device})
_META_PROPERTIES = frozenset(
    [(torch.Tensor.requires_grad, "__get__"), (torch.Tensor.requires_grad, "__set__")]
    + [(getattr(torch.Tensor, a), "__get__") for a in (
        "shape", "dtype", "device", "ndim", "is_leaf", "layout", "is_cuda", "is_meta",
        "grad", "grad_fn")])


# Init(skip_init=True): the modules' own initialisation of a parameter (nn.init's
# functions, the random and constant fills they call) is skipped; the values stay undefined
# until a checkpoint is loaded into every parameter (load_safetensors(..., strict=True)).
_INIT_FILLS = frozenset(
    [getattr(torch.Tensor, m) for m in (
        "uniform_", "normal_", "zero_", "fill_", "random_", "bernoulli_", "exponential_",
        "cauchy_", "log_normal_", "geometric_")]
    + [f for f in (getattr(nn.init, n, None) for n in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
        "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
        "orthogonal_", "sparse_")) if f is not None])


def _skipped_init(func, args, kwargs):
    """The parameter ``func(*args, **kwargs)`` initialises, which ``Init(skip_init=True)``
    leaves undefined, or None (``nn.init``'s functions pass it as ``tensor=``)."""
    try:
        if func not in _INIT_FILLS:
            return None
    except TypeError:        # an unhashable callable
        return None
    t = args[0] if args else kwargs.get("tensor")
    return t if isinstance(t, nn.Parameter) else None


def _metadata_only(func) -> bool:
    """Whether ``func`` reads or sets only what a placeholder keeps (shape, dtype,
    ``requires_grad`` ...), not the values."""
    try:
        if func in _META_METHODS:
            return True
    except TypeError:        # an unhashable callable
        return False
    owner = getattr(func, "__self__", None)
    if owner is None or not hasattr(owner, "__get__"):
        return False
    try:
        return (owner, getattr(func, "__name__", None)) in _META_PROPERTIES
    except TypeError:        # an unhashable owner
        return False


class _FaultInMode(TorchFunctionMode):
    """While Init is active: any torch operation that receives an offloaded parameter
    (``init.normal_(child.weight)``, ``child.weight.data`` ...) first gets the parameter's
    real values back (``p.data``); they stay materialised until the current scope ends (an
    outermost module ``__init__`` or a Hugging Face ``_initialize_weights`` call) and are
    then stored again."""

    def __init__(self, ctx: "Init"):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.ctx.skip_init:
            skipped = _skipped_init(func, args, kwargs)
            if skipped is not None:
                return skipped
        if _RECORDS and not _metadata_only(func):
            for a in (*args, *kwargs.values()):
                if isinstance(a, nn.Parameter):
                    self.ctx._fault_in(a)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, nn.Parameter):
                            self.ctx._fault_in(b)
        return func(*args, **kwargs)


@contextlib.contextmanager
def adopting(slots):
    """Used by ``initialize`` for one parameter group: Init-managed parameters of ``slots``
    hold their real values inside the block; afterwards their Init home is freed (the
    engine has copied them into its own homes)."""
    params = [s.param for s in slots if record_of(s.param) is not None]
    if not params:
        yield
        return
    recs = [record_of(p) for p in params]
    for p, rec in zip(params, recs):
        p.data = rec.store.get(rec)
    try:
        yield
    finally:
        for p, rec in zip(params, recs):
            if rec.finalizer is not None:
                rec.finalizer.detach()
            _forget(rec.pid)


def prefix_resolver(names, prefix: str):
    """A ``resolve`` for :func:`load_safetensors`: a checkpoint key maps to the parameter
    name in ``names`` as is, with the model's ``base_model_prefix`` added, or with it
    removed (Hugging Face checkpoints are saved with or without it); None otherwise."""
    def resolve(key):
        if key in names:
            return key
        if prefix and f"{prefix}.{key}" in names:
            return f"{prefix}.{key}"
        if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in names:
            return key[len(prefix) + 1:]
        return None
    return resolve


def load_safetensors(model: nn.Module, files, *, strict: bool = True, resolve=None) -> list[str]:
    """Stream safetensors ``files`` into ``model`` tensor by tensor (names as in
    ``model.named_parameters()``; ``resolve(key) -> name | None`` maps checkpoint keys
    that differ, e.g. a missing ``model.`` prefix).  Init-managed parameters are written to
    their Init home without materialising the model; ordinary parameters are copied in
    place.  Returns the checkpoint keys that matched no parameter; with ``strict`` a
    missing parameter raises."""
    from safetensors import safe_open
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    params = dict(model.named_parameters(remove_duplicate=False))
    seen, unexpected = set(), []
    for fp in files:
        with safe_open(os.fspath(fp), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = resolve(key) if resolve is not None else key
                p = params.get(name) if name is not None else None
                if p is None:
                    unexpected.append(key)
                    continue
                t = f.get_tensor(key)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"load_safetensors: {fp}: {key} has shape "
                                     f"{tuple(t.shape)}, the model expects {tuple(p.shape)}")
                rec = record_of(p)
                with torch.no_grad():
                    if rec is not None:
                        rec.store.put(rec, t.to(rec.dtype))
                    else:
                        p.data.copy_(t)
                record_source(p, fp, key)        # Note [Base by reference]
                seen.add(id(p))
                del t
    if strict:
        missing = [n for n, p in params.items() if id(p) not in seen]
        if missing:
            raise ValueError(f"load_safetensors: {len(missing)} parameter(s) not in "
                             f"{[os.fspath(x) for x in files]}, e.g. {missing[:5]}")
    return unexpected


# ---------------------------------------------------------------------- the context
def _build_groups():
    from infinity.runtime.groups import build_groups
    return build_groups


INIT_COPY = "Init copy of the parameters"
SWAP_OVERHEAD = "swap files' whole stripes and lock files"


def nvme_need(model: nn.Module, config=None, *, world_size: int = 1) -> dict:
    """NVMe bytes one rank needs to build ``model`` under ``Init(config)`` and then
    ``initialize`` it: ``{"Init copy of the parameters": ..., "engine param home": ...,
    "engine optimizer states": ...}`` (plus "engine fp32 gradients" when they spill).
    ``model`` may live on the ``meta`` device (only shapes and dtypes are read), so the
    check can run before anything is built or written.  The Init copy and the engine's
    swap coexist while ``initialize`` adopts the parameters, so the sum is the peak.  Each
    swap file is reserved in whole stripes (``infinity.io.swap.reserved_bytes``) beside a
    one-block lock file: that overhead is a part of its own."""
    from infinity.config import InfinityConfig
    from infinity.io.swap import reserved_bytes
    from infinity.memory.plan import PlacementPlan
    from infinity.memory.pool import round_up
    cfg = InfinityConfig.load(config)
    out: dict[str, int] = {}
    spaces = []                      # bytes of each swap space (Init's, the engine's)
    if cfg.offload.params == "nvme":
        init = 0
        seen = set()
        for p in model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            c = -(-max(p.numel(), 1) // world_size)
            init += round_up(max(c * p.element_size(), 1), 4096)
        out[INIT_COPY] = init
        spaces.append(init)
    if cfg.offload.params == "nvme" or cfg.offload.optimizer == "nvme":
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16,
                 "fp16": torch.float16}[cfg.precision]
        home = {"none": "device", "cpu": "cpu", "nvme": "nvme"}[cfg.offload.params]
        gp = _build_groups()(model, dtype, home, world_size=world_size)
        plan = PlacementPlan(cfg.precision, home, cfg.offload.optimizer, cfg.prefetch.depth,
                             gp.groups, None, None,
                             state_bytes=2 if cfg.optimizer.state_dtype == "bf16" else 4,
                             ).compute(cfg.gradient_accumulation_steps)
        for k, v in plan.nvme.items():
            out[f"engine {k}"] = v // max(1, world_size)
        spaces.append(sum(v for k, v in out.items() if k.startswith("engine ")))
    extra = sum(reserved_bytes(n, cfg.aio.block_size) - n for n in spaces if n)
    extra += len([n for n in spaces if n]) * sum(_fs_block(p) for p in cfg.offload.nvme_paths)
    if extra:
        out[SWAP_OVERHEAD] = extra
    return out


def _fs_block(path) -> int:
    """The block a small file (a swap directory's lock file) takes on ``path``'s file system."""
    from infinity.fsmode import existing_ancestor
    try:
        return max(4096, os.statvfs(existing_ancestor(path)).f_frsize)
    except OSError:
        return 4096


class Init:
    """Context manager: modules built inside have their parameters in their offloaded
    home (see module doc).  ``config``: dict, JSON/YAML path, InfinityConfig or None.
    ``nvme_need``: bytes (or a dict of named parts, e.g. from :func:`nvme_need` over the
    model built on ``meta``) the whole plan needs on the NVMe paths; with params homed on
    NVMe, entering checks that much free space before anything is written and raises
    ``OSError(ENOSPC)`` naming the total and the path otherwise.  ``skip_init``: the
    modules' own initialisation of their parameters (``nn.init``'s functions and the
    random or constant fills of a parameter, Hugging Face's ``_init_weights``) is skipped,
    for a model whose every parameter is loaded next (:func:`load_safetensors` with
    ``strict=True``): their values are undefined until then, and building costs no random
    numbers and no second write of each parameter."""

    def __init__(self, config=None, *, enabled: bool = True, nvme_need=None,
                 skip_init: bool = False):
        from infinity.config import InfinityConfig
        self.cfg = InfinityConfig.load(config)
        self.nvme_need = nvme_need
        self.skip_init = bool(skip_init)
        self.enabled = bool(enabled)
        self.store: _InitStore | None = None
        self._patched: list[tuple[type, object]] = []
        self._constructing: set[int] = set()
        self._orig_init_subclass = None
        self._orig_hf = None
        self.params_managed = 0
        self._faulted: dict[int, tuple] = {}     # id(p) -> (p, record): materialised again
        self._mode = None

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> "Init":
        global _ACTIVE
        if not self.enabled:
            return self
        with _LOCK:
            if _ACTIVE is not None:
                raise RuntimeError("infinity.Init: already inside an Init context (nesting is "
                                   "not supported)")
            import torch.distributed as dist
            from infinity.zero.comm import ensure_process_group
            ensure_process_group(self.cfg.dist_timeout_s)
            rank, world = 0, 1
            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
            if self.nvme_need and self.cfg.offload.params == "nvme":
                self._check_free_space()
            from infinity.io.swap import reserved_bytes
            reserve = reserved_bytes(self.nvme_need.get(INIT_COPY, 0), self.cfg.aio.block_size) \
                if isinstance(self.nvme_need, dict) else 0
            self.store = _InitStore(self.cfg.offload.params, self.cfg, rank, world,
                                    reserve=reserve)
            try:
                self._patch()
                self._mode = _FaultInMode(self)
                self._mode.__enter__()
            except BaseException:
                self._unpatch()
                raise
            _ACTIVE = self
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        if not self.enabled:
            return
        with _LOCK:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
            self._unpatch()
            try:
                self._flush_faulted()
            finally:
                _ACTIVE = None
            self._constructing.clear()
            if self.store is not None:
                self.store.context_open = False
                self.store.maybe_close()

    def _check_free_space(self) -> None:
        from infinity.memory.plan import check_nvme_free
        parts = dict(self.nvme_need) if isinstance(self.nvme_need, dict) else None
        need = sum(parts.values()) if parts else int(self.nvme_need)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)   # ranks sharing the paths
        if ranks > 1:
            need *= ranks
            parts = {f"{k} x {ranks} local ranks": v * ranks for k, v in parts.items()} \
                if parts else None
        from infinity.memory.plan import nvme_dirs_ok, remove_if_empty
        paths = list(self.cfg.offload.nvme_paths)
        # a path that cannot be created fails here with its own error, not as "0 B free"
        created = nvme_dirs_ok(paths)
        try:
            check_nvme_free(paths, need, what="infinity.Init: building and initializing this "
                            "model", parts=parts, hint="offload.nvme_paths / --nvme-path")
        finally:
            remove_if_empty(created)   # as found

    # ------------------------------------------------------------------ patching
    def _all_module_classes(self):
        seen, todo = set(), [nn.Module]
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            todo.extend(c.__subclasses__())
        return seen

    def _wrap_class(self, cls) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_infinity_init_wrapper", False):
            return
        ctx = self

        @functools.wraps(orig)
        def __init__(module, *args, **kwargs):
            outer = id(module) not in ctx._constructing
            if outer:
                ctx._constructing.add(id(module))
            try:
                orig(module, *args, **kwargs)
            finally:
                if outer:
                    ctx._constructing.discard(id(module))
            if outer:
                ctx._flush_faulted()
                ctx._offload_module(module)
        __init__._infinity_init_wrapper = True
        cls.__init__ = __init__
        self._patched.append((cls, orig))

    def _patch(self) -> None:
        for cls in self._all_module_classes():
            self._wrap_class(cls)
        # classes defined while the context is active (e.g. modeling code imported lazily)
        self._orig_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        ctx = self

        def __init_subclass__(cls, **kw):
            super(nn.Module, cls).__init_subclass__(**kw)
            ctx._wrap_class(cls)
            if cls.__name__ == "PreTrainedModel" and cls.__module__ == "transformers.modeling_utils":
                ctx._patch_transformers(cls)
        nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        self._patch_transformers()

    def _patch_transformers(self, base=None) -> None:
        """Fault-in scope around Hugging Face's per-module ``_initialize_weights`` (patched
        now if transformers is imported, else when its PreTrainedModel class is defined)."""
        import sys
        if self._orig_hf is not None:
            return
        if base is None:
            mu = sys.modules.get("transformers.modeling_utils")
            if mu is None:
                return
            base = mu.PreTrainedModel
        ctx = self
        orig = base.__dict__.get("_initialize_weights")
        if orig is None:
            return

        @functools.wraps(orig)
        def _initialize_weights(model, module, *args, **kwargs):
            if ctx.skip_init:          # (the checkpoint loaded next sets every value)
                return None
            try:
                return orig(model, module, *args, **kwargs)
            finally:
                ctx._flush_faulted()
        base._initialize_weights = _initialize_weights
        self._orig_hf = (base, orig)

    def _unpatch(self) -> None:
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig
        self._patched.clear()
        if self._orig_init_subclass is not None:
            nn.Module.__init_subclass__ = self._orig_init_subclass
        elif "__init_subclass__" in nn.Module.__dict__:
            del nn.Module.__init_subclass__
        self._orig_init_subclass = None
        if self._orig_hf is not None:
            base, orig = self._orig_hf
            base._initialize_weights = orig
            self._orig_hf = None

    # ------------------------------------------------------------------ fault in
    def _fault_in(self, p: nn.Parameter) -> None:
        if id(p) in self._faulted:
            return
        rec = record_of(p)
        if rec is None:
            return
        with torch._C.DisableTorchFunction():
            p.data = rec.store.get(rec)
        self._faulted[id(p)] = (p, rec)

    def _flush_faulted(self) -> None:
        """Store every parameter materialised since the last flush and restore its
        placeholder (only those still managed: an adopted or dropped one is skipped)."""
        items, self._faulted = list(self._faulted.values()), {}
        with torch._C.DisableTorchFunction():
            for p, rec in items:
                if record_of(p) is rec:
                    if rec.host is None or p.data.data_ptr() != rec.host.data_ptr() or \
                            rec.store.world_size > 1:
                        rec.store.put(rec, p.data)
                    p.data = placeholder(rec.dtype, rec.shape)

    # ------------------------------------------------------------------ offload
    def _offload_module(self, module: nn.Module) -> None:
        for name, p in module._parameters.items():
            if p is None or record_of(p) is not None or p.device.type == "meta":
                continue
            if p.device.type != "cpu":
                raise RuntimeError(f"infinity.Init: parameter {type(module).__name__}.{name} "
                                   f"was created on {p.device}; build the model on CPU")
            rec = InitRecord(self.store, p)
            self.store.put(rec, p.data)
            with _LOCK:
                _RECORDS[rec.pid] = rec
                self.store.live += 1
            rec.finalizer = weakref.finalize(p, _forget, rec.pid)
            with torch._C.DisableTorchFunction():
                p.data = placeholder(p.dtype, p.shape)
            self.params_managed += 1
