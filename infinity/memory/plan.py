"""The placement plan: what lives where, what it needs, and the up-front "does not fit" check.

``initialize`` builds one :class:`PlacementPlan`, checks it against the caps
(``offload.host_memory_gb``, ``offload.device_memory_gb``, free NVMe space) before
allocating anything large, and logs it once at INFO.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from .pool import ALIGN, round_up
from .record import GroupRecord
from .shadow_budget import SHADOW_LINE
from infinity.fsmode import existing_ancestor, makedirs

log = logging.getLogger("infinity.memory")

__all__ = ["PlacementPlan", "WorkingSetError", "mem_available_bytes", "STREAM_GRAD_WINDOW"]

GB = 10 ** 9
# gradients homed on NVMe kept in memory for their group's early optimizer step at once
# (Note [Streamed gradients] in infinity/engine/overlap.py)
STREAM_GRAD_WINDOW = 2


class WorkingSetError(MemoryError):
    """The configured caps cannot hold the working set; the message names the knob."""


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rss_bytes() -> int:
    """Current resident set size of this process (0 if /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _gb(n: int | float) -> str:
    return f"{n / GB:.3f} GB"


@dataclass
class PlacementPlan:
    precision: str
    param_home: str           # device | cpu | nvme
    optimizer_home: str       # none | cpu | nvme
    depth: int
    groups: list[GroupRecord]
    host_cap: int | None
    device_cap: int | None
    optimizer_ring_bytes: int = 0
    grad_home: str = "host"   # "host" | "nvme" (when the host cap cannot hold the grads)
    # grad_home "nvme": the accumulation window's partial sums on NVMe in this dtype
    # ("bf16": lossy, gradient_accumulation_dtype); the final sum is always fp32
    grad_accum_dtype: str = "fp32"
    # grad_home "nvme": trainable groups whose fp32 accumulators still fit in the host cap
    # keep them there (no NVMe round trip); set by compute()
    grad_host_gids: frozenset = frozenset()
    separate_device: bool = False   # device tier is not host memory (CUDA): copies + staging
    # grad_home "nvme": groups are updated as their gradient arrives (the overlapped step,
    # Note [Streamed gradients]): the final sums never go to NVMe and back
    stream_grads: bool = False
    clipping: bool = False          # clipping with bf16 moments: streamed sums are written (redo)
    stream_window: int = 0          # final sums in hand at once (compute(); 0: no streaming)
    param_cache_budget: int = 0     # host bytes for clean copies of NVMe params (fp32, CPU)
    # ZeRO stage 3 across ranks: a rank caches its shard (1/param_shards) of each group
    # (Note [Shard cache] in infinity/zero/partitioned_memory.py)
    param_shards: int = 1
    state_bytes: int = 4            # bytes per Adam moment (optimizer.state_dtype: 4 fp32, 2 bf16)
    # memory-centric tiling (infinity.runtime.tiling): gid -> device bytes of one tile; a
    # tiled group is never fetched whole, its tile is what it adds to the fetch window
    tile_bytes: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)      # item -> bytes
    device: dict = field(default_factory=dict)
    nvme: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)     # link -> expected bytes per optimizer step

    def compute(self, grad_accum: int) -> "PlacementPlan":
        # fetched and released: every group off the device, and a quantized group on any
        # home (its compute buffer is dequantized from the payload for each use)
        paged = [g for g in self.groups if g.home != "device" or g.quant is not None]
        trainable = [g for g in self.groups if g.trainable]
        # what the homes hold (a quantized group's payload: Note [Quantized homes])
        param_bytes = sum(g.home_nbytes for g in self.groups)
        largest_group = max((g.home_nbytes for g in paged), default=0)
        # what one fetch puts on the device: a tiled group's tile, any other group whole
        largest = max((self.tile_bytes.get(g.gid, g.nbytes) for g in paged), default=0)
        n_train = sum(g.padded_numel for g in trainable)
        fp32 = self.precision == "fp32"
        self.host, self.device, self.nvme = {}, {}, {}
        largest_trainable = max((4 * g.padded_numel for g in trainable), default=0)
        sep = self.separate_device
        # device tier
        self.device["resident params"] = sum(g.home_nbytes for g in self.groups
                                             if g.home == "device")
        if self.param_home == "nvme" or (sep and self.param_home == "cpu"):
            self.device["fetch window (largest group x (depth + 2))"] = largest * (self.depth + 2)
        elif self.param_home == "device" and paged:    # a quantized base kept on the device
            self.device["dequantized fetch window (largest group x (depth + 2))"] = \
                largest * (self.depth + 2)
        qpaged = max((g.home_nbytes for g in paged if g.quant is not None and g.home != "device"),
                     default=0)
        if sep and qpaged:        # a quantized payload lands on the device, then dequantized
            self.device["quantized payloads in flight (largest x (depth + 2))"] = \
                qpaged * (self.depth + 2)
        if sep and trainable:     # GradD2H: groups assembled for their one D2H each (two:
            # the current one and one open across backward, e.g. tied weights) and the
            # sources of the copies in flight (as many as the staging bound)
            self.device["gradient D2H sources"] = 2 * self.grad_d2h_bytes
        # host tier
        if self.param_home == "cpu":
            self.host["param home"] = param_bytes
        if sep and self.param_home == "device":
            self.host["host mirror of resident params (optimizer side)"] = \
                sum(g.nbytes for g in self.groups if g.home == "device" and g.quant is None)
        if self.param_home == "nvme" and not sep:
            self.host["staging (init only)"] = largest_group
            # quantized payloads read from NVMe land in host leases, dequantized from there
            # (Note [Quantized homes] in infinity/memory/frozen_quant.py)
            qlargest = max((g.home_nbytes for g in paged if g.quant is not None), default=0)
            if qlargest:
                self.host["quantized payload reads (largest x (depth + 2))"] = \
                    qlargest * (self.depth + 2)
        if self.param_home == "nvme" and sep:     # NVMe -> pinned staging -> H2D
            self.host["H2D staging (largest group x (depth + 2))"] = largest * (self.depth + 2)
        if sep and trainable:
            self.host["gradient D2H staging"] = self.grad_d2h_bytes
        n_grad_nvme = n_train
        if self.grad_home == "host":
            self.host["fp32 gradient accumulation"] = 4 * n_train
        else:
            self.host["gradient staging (grads on NVMe)"] = 2 * largest_trainable
            if self.grad_accum_dtype == "bf16" and grad_accum > 1:
                self.host["gradient staging (grads on NVMe)"] += largest_trainable // 2
        # bytes per trainable element of the optimizer home: m and v at state_bytes each,
        # + the fp32 master unless fp32 (then the param home is the master)
        sb = self.state_bytes
        states_b = 2 * sb + (0 if fp32 else 4)
        if self.optimizer_home in ("none", "cpu"):
            self.host[self._states_label("host")] = states_b * n_train
        # Note [commit point]: what an update changes in place in host memory (the undo
        # copies' most): host optimizer states, and an fp32 master that is the parameter
        self.host_state_bytes = (states_b * n_train if self.optimizer_home in ("none", "cpu")
                                 else 0) + (4 * n_train if fp32 and self.param_home != "nvme"
                                            else 0)
        self.host["optimizer tile ring"] = self.optimizer_ring_bytes
        self.stream_window = 0
        if self.grad_home == "nvme" and self.stream_grads and trainable:
            # Note [Streamed gradients]: up to STREAM_GRAD_WINDOW final sums in hand for
            # their group's early step, in what the cap leaves (none: no streaming)
            size = round_up(largest_trainable, ALIGN)
            spare = None if self.host_cap is None else self.host_cap - sum(self.host.values())
            self.stream_window = STREAM_GRAD_WINDOW if spare is None else \
                max(0, min(STREAM_GRAD_WINDOW, spare // size))
            if self.stream_window:
                self.host["gradients in hand for their early step (grads on NVMe)"] = \
                    self.stream_window * size
        if self.grad_home == "nvme":
            # lossless: the groups whose fp32 accumulators fit in what the cap leaves stay
            # in host memory (module order); only the rest make NVMe round trips
            spare = None if self.host_cap is None else self.host_cap - sum(self.host.values())
            if self.stream_window and grad_accum == 1:
                spare = 0     # streamed, one micro-step (Note [Streamed gradients]): no
            keep, used = set(), 0   # round trip to save, the cap's rest stays free (RSS)
            for g in trainable:
                size = round_up(4 * g.padded_numel, ALIGN)
                if spare is not None and used + size <= spare:
                    keep.add(g.gid)
                    used += size
            self.grad_host_gids = frozenset(keep)
            n_grad_nvme = sum(g.padded_numel for g in trainable if g.gid not in keep)
            # staging serves only the groups homed on NVMe (the kept ones add in place)
            largest_nvme = max((4 * g.padded_numel for g in trainable if g.gid not in keep),
                               default=0)
            self.host["gradient staging (grads on NVMe)"] = 2 * largest_nvme + (
                largest_nvme // 2 if self.grad_accum_dtype == "bf16" and grad_accum > 1 else 0)
            if keep:
                self.host["fp32 gradient accumulation (groups that fit)"] = used
            self.nvme["fp32 gradients"] = 4 * n_grad_nvme
            if self.grad_accum_dtype == "bf16" and grad_accum > 1:
                self.nvme["bf16 partial gradient sums"] = 2 * n_grad_nvme
        # parameter cache (MemoryManager.enable_cache): first released, first kept; across
        # ranks a rank keeps its shard of each group (``cached`` counts whole groups, as
        # the links below do)
        cached = cached_trainable = used = 0
        if self.param_cache_budget and self.param_home == "nvme":
            self.host["parameter cache (clean copies of NVMe params)"] = self.param_cache_budget
            w = max(1, self.param_shards)
            for g in paged:
                size = round_up(-(-g.nbytes // w), ALIGN)
                if used + size <= self.param_cache_budget:
                    used += size
                    cached += round_up(g.nbytes, ALIGN)
                    cached_trainable += round_up(g.nbytes, ALIGN) if g.trainable else 0
        # nvme
        if self.param_home == "nvme":
            self.nvme["param home"] = sum(g.home_nbytes for g in paged)
        if self.optimizer_home == "nvme":
            self.nvme[self._states_label("nvme")] = states_b * n_train
        # Note [commit point]: one shadow per NVMe state tensor an update writes (fp32 with
        # NVMe params: the param home is the master), so an update is all-or-nothing
        shadow = (states_b * n_train if self.optimizer_home == "nvme" else 0) \
            + (4 * n_train if fp32 and self.param_home == "nvme" else 0)
        if shadow:
            self.nvme[SHADOW_LINE] = shadow
        # links per optimizer step (grad_accum micro-steps)
        nvme_params = sum(g.home_nbytes for g in paged) if self.param_home == "nvme" else 0
        rd = 2 * max(0, nvme_params - cached) * grad_accum   # forward + backward re-fetch
        wr = 0
        if self.optimizer_home == "nvme":           # exp_avg, exp_avg_sq
            rd += 2 * sb * n_train
            wr += 2 * sb * n_train
        master_on_nvme = (fp32 and self.param_home == "nvme") or \
            (not fp32 and self.optimizer_home == "nvme")
        if master_on_nvme:
            rd += max(0, 4 * n_train - (cached_trainable if fp32 else 0))  # cached: in hand
            wr += 4 * n_train
        if not fp32 and self.param_home == "nvme":  # updated low-precision params
            wr += sum(g.nbytes for g in trainable)
        if self.grad_home == "nvme":                # written per micro-step, read-modify-
            window = self.grad_window_bytes(n_grad_nvme, grad_accum)   # written across
            wr += window                                               # micro-steps, and
            rd += window                                               # as much read
            if self.stream_window:  # the final sums are stepped from memory: not written
                rd -= 4 * n_grad_nvme                 # (unless a clipped step may redo them)
                wr -= 0 if self.clipping else 4 * n_grad_nvme   # nor read by the optimizer
        self.links = {"nvme_read": rd, "nvme_write": wr}
        return self

    def _states_label(self, tier: str) -> str:
        """The plan item of the optimizer home: ``optimizer states (...)`` (ZeRO scales
        every item named so to one rank's share); on NVMe plain ``optimizer states`` with
        fp32 moments (its long-standing name), else the moments' dtype is named."""
        master = "" if self.precision == "fp32" else ", master"
        if self.state_bytes == 4:
            return "optimizer states" if tier == "nvme" else f"optimizer states (fp32 m, v{master})"
        return f"optimizer states (bf16 m, v{', fp32 master' if master else ''})"

    def grad_window_bytes(self, numel: int, grad_accum: int) -> int:
        """NVMe bytes the gradient home writes over one accumulation window of
        ``grad_accum`` micro-steps for ``numel`` NVMe-homed gradient elements, and as many
        it reads (the optimizer's read of the final fp32 sums included).  fp32: the first
        micro-step writes 4 B/elem, each later one reads and writes them back.  bf16
        partial sums: 2 B/elem between micro-steps, the last one reads the bf16 sum and
        writes fp32."""
        k = max(1, grad_accum)
        if self.grad_accum_dtype == "bf16" and k > 1:
            return 2 * numel * (k - 1) + 4 * numel
        return 4 * numel * k

    @property
    def grad_d2h_bytes(self) -> int:
        """Bound on pinned staging held by gradient D2H copies not yet accumulated
        (separate device only): two of the largest trainable group, rounded to pages."""
        largest = max((g.nbytes for g in self.groups if g.trainable), default=0)
        return 2 * round_up(largest, ALIGN)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def nvme_total(self) -> int:
        return sum(self.nvme.values())

    def check(self) -> None:
        """Raise :class:`WorkingSetError` naming what is needed and which knob to turn."""
        host_cap = self.host_cap
        source = "offload.host_memory_gb"
        if host_cap is not None:
            avail = mem_available_bytes()
            if avail is not None and host_cap > avail + _rss_bytes():
                raise WorkingSetError(
                    f"initialize: offload.host_memory_gb is {_gb(host_cap)} but this machine has "
                    f"only {_gb(avail)} of RAM available (MemAvailable in /proc/meminfo) plus "
                    f"{_gb(_rss_bytes())} this process already uses; a cap the machine cannot "
                    "honour would end in the OOM killer half-way through training: lower "
                    "offload.host_memory_gb (or leave it unset to use the available RAM)")
        if host_cap is None:
            host_cap = mem_available_bytes()
            source = "available RAM (MemAvailable)"
        if host_cap is not None and self.host_total > host_cap:
            parts = ", ".join(f"{k} {_gb(v)}" for k, v in self.host.items() if v)
            hints = ["raise offload.host_memory_gb"]
            if self.param_home == "cpu":
                hints.append('set offload.params to "nvme"')
            if self.optimizer_home in ("none", "cpu"):
                hints.append('set offload.optimizer to "nvme"')
            raise WorkingSetError(
                f"initialize: the host tier needs {_gb(self.host_total)} ({parts}) but "
                f"{source} is {_gb(host_cap)}; " + " or ".join(hints))
        if self.device_cap is not None and self.device_total > self.device_cap:
            parts = ", ".join(f"{k} {_gb(v)}" for k, v in self.device.items() if v)
            hints = ["raise offload.device_memory_gb"]
            if self.param_home == "device":
                hints.append('set offload.params to "cpu" or "nvme"')
            if self.depth > 0 and self.param_home == "nvme":
                hints.append("lower prefetch.depth")
            raise WorkingSetError(
                f"initialize: the device tier needs {_gb(self.device_total)} ({parts}) but "
                f"offload.device_memory_gb is {_gb(self.device_cap)}; " + " or ".join(hints))

    def summary(self) -> str:
        """One line for a user: where each kind of state lives and the bytes per tier
        (the full breakdown is :meth:`describe`)."""
        grads = "NVMe" if self.grad_home == "nvme" else "host memory"

        def cap(c):
            return "" if c is None else f" (cap {fmt_mb(c)})"
        return (f"{self.homes_text()}, gradients in {grads}; "
                f"host memory {fmt_mb(self.host_total)}{cap(self.host_cap)}, NVMe "
                f"{fmt_mb(self.nvme_total)}, device {fmt_mb(self.device_total)}{cap(self.device_cap)}")

    def homes_text(self) -> str:
        """The two homes by their config names and values (one name per home: the config's,
        as in the planner and ``finetune``), with where that puts the state."""
        params = "none" if self.param_home == "device" else self.param_home
        p_where = {"none": "on the device", "cpu": "in host memory", "nvme": "on NVMe"}
        # the CPU optimizer keeps "none" and "cpu" states alike in host memory
        o_where = {"none": "in host memory", "cpu": "in host memory", "nvme": "on NVMe"}
        return (f"offload.params {params} (params {p_where.get(params, params)}), "
                f"offload.optimizer {self.optimizer_home} (optimizer states "
                f"{o_where.get(self.optimizer_home, self.optimizer_home)})")

    def describe(self) -> str:
        lines = [f"placement plan: precision {self.precision}, {self.homes_text()}, "
                 f"{len(self.groups)} groups "
                 f"(largest {_gb(max((g.nbytes for g in self.groups), default=0))}), "
                 f"prefetch depth {self.depth}"]
        for tier, d, cap in (("device", self.device, self.device_cap),
                             ("host", self.host, self.host_cap), ("nvme", self.nvme, None)):
            items = "; ".join(f"{k} {_gb(v)}" for k, v in d.items() if v) or "nothing"
            capstr = "" if cap is None else f" (cap {_gb(cap)})"
            lines.append(f"  {tier}: {_gb(sum(d.values()))}{capstr}: {items}")
        states = getattr(self, "host_state_bytes", 0)
        if states:            # Note [commit point]: undo copies of host states updated in place
            room = states if self.host_cap is None else \
                min(states, max(0, self.host_cap - self.host_total))
            lines.append(f"  commit undo copies (host, transient, per update): up to {_gb(room)} "
                         f"(the host states an update changes in place"
                         + (", within what the cap leaves" if room < states else "") + ")")
        lines.append("  expected per optimizer step: " +
                     ", ".join(f"{k} {_gb(v)}" for k, v in self.links.items()))
        return "\n".join(lines)


# Swap directories this process created (``nvme_dirs_ok``, ``infinity.Init``): removed when
# empty by whichever closes last -- the engine, the Init store or finetune -- not only by
# the one that created them (an Init store creates ``<path>`` before the engine exists).
_CREATED_SWAP_DIRS: set[str] = set()


def note_created_dirs(dirs) -> None:
    """Record directories this process created for swap (see :func:`remove_if_empty`)."""
    _CREATED_SWAP_DIRS.update(os.path.abspath(d) for d in dirs)


def nvme_dirs_ok(paths: list[str]) -> list[str]:
    """Create NVMe directories if missing (race-safe); raise with the path if impossible.
    Returns the directories this call created (to remove at close when left empty)."""
    created = []
    for p in paths:
        missing = []
        d = os.path.abspath(p)
        while d and not os.path.exists(d):
            missing.append(d)
            d = os.path.dirname(d)
        try:
            makedirs(p, 0o755)
            created.extend(missing)
        except OSError as e:
            raise OSError(e.errno, f"offload.nvme_paths: cannot create {p!r}: {e.strerror}; "
                          f"choose a writable directory on a local NVMe/SSD") from e
    note_created_dirs(created)
    return created


def remove_if_empty(dirs: list[str]) -> None:
    """Remove directories created for swap when nothing else is in them: ``dirs`` and
    every other directory this process created for swap (deepest first; ``rmdir`` only
    succeeds on an empty directory, so one still in use stays)."""
    todo = {os.path.abspath(d) for d in dirs} | _CREATED_SWAP_DIRS
    for d in sorted(todo, key=len, reverse=True):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            _CREATED_SWAP_DIRS.discard(d)
        except OSError:
            pass
        else:
            _CREATED_SWAP_DIRS.discard(d)


def fmt_mb(n: int | float) -> str:
    """Bytes in the unit that reads best: 16.0 MB, 61.6 MB, 1.234 GB."""
    if n >= GB:
        return f"{n / GB:.3f} GB"
    if n >= 10 ** 6:
        return f"{n / 10 ** 6:.1f} MB"
    return f"{n / 10 ** 3:.1f} kB"


class NvmeSpaceError(OSError):
    """The NVMe paths do not have the free space a plan needs (raised before writing)."""


def check_nvme_free(paths: list[str], need: int, *, what: str, parts: dict | None = None,
                    hint: str = "") -> None:
    """Raise :class:`NvmeSpaceError` (errno ENOSPC) when ``paths`` (striped evenly) lack
    ``need`` bytes of free space in total on any file system; the message names the total,
    its parts, the path and what it has. Paths on one file system share its free space."""
    import errno
    if need <= 0 or not paths:
        return
    per_fs: dict[int, list] = {}
    for p in paths:
        base = existing_ancestor(p)
        try:
            st = os.statvfs(base)
            dev = os.stat(base).st_dev
        except OSError:
            continue
        entry = per_fs.setdefault(dev, [0, st.f_bavail * st.f_frsize, []])
        entry[0] += need / len(paths)
        entry[2].append(p)
    for share, free, ps in per_fs.values():
        if share > free:
            detail = f" ({', '.join(f'{k} {fmt_mb(v)}' for k, v in parts.items() if v)})" if parts else ""
            where = ps[0] if len(ps) == 1 else f"{', '.join(ps)} (one file system)"
            share_txt = "" if len(per_fs) == 1 and len(ps) == len(paths) else \
                f"; its share is {fmt_mb(share)}"
            raise NvmeSpaceError(
                errno.ENOSPC,
                f"{what} needs {fmt_mb(need)} of NVMe swap{detail}{share_txt} but {where} has only "
                f"{fmt_mb(free)} free ({fmt_mb(share - free)} short); free space there or point the "
                f"swap at a larger file system"
                + (f" ({hint})" if hint else ""))
