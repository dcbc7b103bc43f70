"""Bytes moved per optimizer step on each link, and a bandwidth-bound step time.

A step is ``A`` micro-batches of forward+backward (A = gradient accumulation steps)
followed by one optimizer pass. Within each phase the engine overlaps its links and
compute (prefetch during forward/backward; read ‖ update ‖ write tiles in the
optimizer), so a phase takes as long as its slowest resource:

    t(fwd+bwd, one micro-batch) = max(compute, NVMe, PCIe, collectives)
    t(optimizer)                = max(NVMe read + NVMe write, CPU Adam, PCIe, collectives)
    step                        = A * t(fwd+bwd) + t(optimizer)

NVMe reads and writes of the optimizer pass share the same drives, so their times
add. The estimate is a lower bound (perfect overlap, no Python overhead); the
profiler (docs/profiling.md) shows how close a real step gets.

Bytes per step (node-level for NVMe, per GPU for PCIe and collectives):

* params on NVMe: every micro-batch reads each group twice (forward, and again for
  backward after release): ``A*2*N*lp`` NVMe read per node, less the fraction ``k`` of
  the parameters kept resident from forward for backward (``prefetch.reuse_gb``,
  :func:`reused_fraction`), which backward neither reads nor all-gathers again.
* optimizer on NVMe: m and v are read and written once per step: ``N*2*sb`` each way
  (not read on the very first step). The fp32 master moves too (``N*4`` each way) when it
  lives on NVMe: bf16/fp16 with the optimizer on NVMe, or fp32 with the params on NVMe
  (the fp32 param is the master). bf16/fp16 params homed on NVMe receive the updated
  low-precision copy in the same pass (``N*lp`` written).
* memory-centric tiling (``tiling.max_group_gb``; across ranks at stage 3, each rank reading
  its shard's part ``ceil(n/R)`` of every tile): a tiled group is read tile by
  tile at every use, not twice per micro-batch: ``reads`` times its bytes (a Linear /
  Conv1D use 2, an Embedding lookup 1, a tied embedding / LM head group 3;
  ``ModelSpec.tileable``), i.e. ``(reads-2+k)*n*lp`` more than the base term (never kept
  for backward).  No whole buffer of a tiled group is released, so none is handed off as
  the master: fp32 params on NVMe read the tiled groups' masters (``n*4``) at the step.
* fp32 params on NVMe, CPU: the overlapped step takes a group's master from the buffer
  backward read (at ZeRO-3 across ranks a rank's slice of the gathered buffer): no master
  read at the step (an upper bound: the engine holds at most a few such buffers).
* fp32 params on NVMe, CPU, ``offload.host_memory_gb`` above the plan: the parameter
  cache keeps clean host copies in that headroom (:func:`param_cache_reads`); a cached group is
  read neither by forward, backward nor the step.  Across ranks (ZeRO stage 3) each rank
  caches its own shards in its own cap's headroom (:func:`_shard_cache`).
* grads spilled to NVMe (host too small): ``A*N*4`` written during backward, read back
  ``(A-1)*N*4`` to accumulate and ``N*4`` by the optimizer.
* PCIe (GPU nodes): params offloaded: ``A*2*N/R*lp`` H2D per GPU (each rank uploads its
  shard, then all-gathers); optimizer offloaded: ``A*N/R*lp`` grads D2H per GPU.
* collectives (R > 1): stage 3 all-gathers ``A*(2-k)*N*lp*(R-1)/R`` per GPU; stage >= 2
  reduce-scatters ``A*N*lp*(R-1)/R``; stage 1 all-reduces twice that.
* compute: ``6*N*S*B`` FLOPs per micro-batch per rank (Kaplan et al. 2020), ``8*N*S*B``
  with activation checkpointing (one extra forward); attention-score FLOPs are ignored
  (relative size ``S/(6H)``).
* CPU Adam (every optimizer home: the engine has no device optimizer): ``r*N/R`` parameters per node at ``cpu_adam_gparams``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .machine import GB, fmt_seconds


@dataclass
class Phase:
    name: str
    seconds: float
    bound: str
    terms: dict = field(default_factory=dict)        # resource -> seconds
    derivation: list = field(default_factory=list)   # human-readable lines

    def as_dict(self):
        return asdict(self)


@dataclass
class StepEstimate:
    traffic: dict            # per step: nvme_read/nvme_write (node), h2d/d2h/allgather/reduce_scatter (GPU)
    fwd_bwd: Phase           # one micro-batch
    optimizer: Phase
    step_s: float
    tokens_per_s: float
    bound: str               # what limits the step as a whole
    checkpointing: bool
    # the last micro-batch with the optimizer overlapped with its backward (None: serial)
    last_s: float | None = None

    def formula(self, A: int) -> str:
        """``"A x t(fwd+bwd) + t(optimizer) = ..."`` (or the overlapped form)."""
        if self.last_s is None:
            return (f"A x t(fwd+bwd) + t(optimizer) = {A} x {fmt_seconds(self.fwd_bwd.seconds)} s "
                    f"+ {fmt_seconds(self.optimizer.seconds)} s = {fmt_seconds(self.step_s)} s")
        return (f"(A-1) x t(fwd+bwd) + t(last micro-batch with the optimizer overlapped) = "
                f"{A - 1} x {fmt_seconds(self.fwd_bwd.seconds)} s + {fmt_seconds(self.last_s)} s "
                f"= {fmt_seconds(self.step_s)} s")

    def as_dict(self):
        d = asdict(self)
        d["fwd_bwd"] = self.fwd_bwd.as_dict()
        d["optimizer"] = self.optimizer.as_dict()
        return d


def _fmt_b(n):
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


BOUND_NAMES = {"host_memory": "host memory", "compute": "compute", "nvme": "NVMe",
               "cpu_adam": "CPU Adam", "pcie": "PCIe",
               "collectives": "collectives"}


def bound_text(bound):
    """``"nvme"`` -> ``"NVMe-bound"``; what a step or phase is limited by, in English."""
    if bound in (None, "none"):
        return "nothing to move or update off the device"
    return f"{BOUND_NAMES.get(bound, bound)}-bound"


def phase_text(phase):
    """``"optimizer: 17.5 s, CPU Adam-bound"``; a phase with no offloaded work says so."""
    if not phase.seconds:
        what = ("Adam runs on the device with its states there; no transfers to time"
                if phase.name == "optimizer" else "nothing to move or compute")
        return f"{phase.name}: 0 s ({what})"
    return f"{phase.name}: {fmt_seconds(phase.seconds)} s, {bound_text(phase.bound)}"


def _phase(name, terms, derivation):
    terms = {k: v for k, v in terms.items() if v > 0}
    if not terms:
        return Phase(name, 0.0, "none", {}, derivation)
    bound = max(terms, key=terms.get)
    return Phase(name, terms[bound], bound, terms, derivation)


PARAM_CACHE_ITEM = "parameter cache (clean host copies within offload.host_memory_gb)"


def param_cache_reads(spec, machine, knobs, plan):
    """``(cached before forward, cached before backward, cached at the step, hand-off)``
    in bytes for the engine's fp32 NVMe-param shortcuts on one CPU process (see
    docs/architecture.md, "The step"): the overlapped step takes each group's master from
    the buffer backward read (with clipping too: its early steps are speculative, Note
    [Speculative clipping], and hand off the same as long as the clip does not bind -- the
    assumption the streamed gradients make as well); with ``offload.host_memory_gb`` set and
    room above the plan, released groups stay as clean host copies in the host pool,
    which gives them up to gradient buffers (leased only while held): with the overlap
    about two groups' gradients are live, without it all of them by the end of backward."""
    N = spec.params
    if knobs.lora_rank is not None:      # LoRA: not modelled (a quantized group is never
        return 0, 0, 0, False            # cached; the base is read at every use)
    if not (machine.cpu_only and plan.params_home == "nvme"
            and plan.master_is_param and not plan.grads_on_nvme):
        return 0, 0, 0, False
    if machine.ranks > 1:
        return _shard_cache(spec, machine, knobs, plan)
    handoff = True     # (tests/engine/test_param_cache.py: the engine hands off under clipping)
    if not knobs.host_cap_gb:
        return 0, 0, 0, handoff
    cap = int(knobs.host_cap_gb * GB)
    host = [i for i in plan.items if i.tier in ("pinned", "pageable") and i.name != PARAM_CACHE_ITEM]
    grads = sum(i.nbytes for i in host if i.name.startswith("grad accumulation"))
    init = sum(i.nbytes for i in host if "initialisation only" in i.name)
    others = sum(i.nbytes for i in host) - grads - init
    if cap <= others + grads + init:            # no headroom above the plan: no cache
        return 0, 0, 0, handoff
    P = N * knobs.lp
    G = spec.group_numel(knobs.grouping)

    def fit(b):
        return max(0, min(P, b))
    # gradient buffers go back once their group was stepped, unless kept for a clipped redo
    # (bf16 moments: no redo from the moments, Note [Redo from moments])
    lazy = knobs.gradient_clipping == 0 or knobs.state_dtype == "fp32"
    if handoff and lazy and knobs.grad_accum == 1:
        live = fit(cap - others - 2 * G * 4)
        return live, live, live, True
    # gradient buffers leased in the first micro-batch stay leased until the boundary:
    # only the first backward of a window sees the cache without them
    A = knobs.grad_accum
    bwd = (fit(cap - others) + (A - 1) * fit(cap - others - grads)) // A
    return fit(cap - others - grads), bwd, fit(cap - others - grads), handoff


def _shard_cache(spec, machine, knobs, plan):
    """:func:`param_cache_reads` at ZeRO stage 3 across ranks (node bytes, ``r`` ranks per
    node): a rank hands off its slice of the released gathered buffer as its master (Note
    [Overlap across ranks]), and with ``offload.host_memory_gb`` above its share of the
    plan keeps clean copies of its own shards, up to ``N/R*lp``, in that headroom (Note
    [Shard cache] in infinity/zero/partitioned_memory.py; not with ZeRO++).  The full-size
    fp32 gradients awaiting their reduce-scatter are leased from the same host pool during
    backward and evict copies: backward and the step see the cache without them."""
    if knobs.zero_stage != 3:
        return 0, 0, 0, False
    if not knobs.host_cap_gb or knobs.qwz or knobs.hpz > 1 or knobs.qgz:
        return 0, 0, 0, True
    r = machine.ranks_per_node
    cap = int(knobs.host_cap_gb * GB)
    host = [i for i in plan.items if i.tier in ("pinned", "pageable") and i.name != PARAM_CACHE_ITEM
            and "initialisation only" not in i.name]
    awaiting = sum(i.nbytes for i in host if i.name.startswith("gradients awaiting reduce-scatter"))
    others = sum(i.nbytes for i in host) - awaiting
    if cap * r <= others:                      # no headroom above the plan: no cache
        return 0, 0, 0, True
    S = -(-spec.params // machine.ranks) * knobs.lp     # one rank's shard of the params

    def fit(b):
        return r * max(0, min(S, b // r))
    fwd, bwd = fit(cap * r - others), fit(cap * r - others - awaiting)
    return fwd, bwd, bwd, True


def tiled_groups(spec, machine, knobs, plan):
    """``[numel, reads, count]`` of the groups the runtime tiles in this configuration
    (``infinity.runtime.tiling``: parameters paged, "module" grouping; across ranks at ZeRO
    stage 3 only, where each rank reads its shard's part of every tile: ``numel`` is then
    the rank's share, ``ceil(n/R)``)."""
    if knobs.tiling_max_group_gb is None or plan.params_home == "none":
        return []
    R = machine.ranks
    if R > 1 and knobs.zero_stage != 3:
        return []
    out = spec.tiled_groups(knobs.grouping, int(knobs.tiling_max_group_gb * GB) // knobs.lp)
    return [[-(-int(n) // R), r, c] for n, r, c in out] if R > 1 else out


def reused_fraction(spec, machine, knobs, plan) -> float:
    """The fraction ``k`` of the parameters backward finds still resident from forward
    (Note [Reuse within a micro-step]): the kept bytes (:func:`reuse_budget`) over
    ``N*lp``, at most 1.  On a GPU by default the engine keeps what the device budget
    leaves besides activations, which the plan does not know: not counted (0)."""
    from .memory_plan import reuse_budget
    if knobs.lora_rank is not None:      # LoRA: not modelled (the memory plan keeps none)
        return 0.0
    if plan.params_home == "none" and (machine.ranks == 1 or knobs.zero_stage != 3):
        return 0.0
    kept = reuse_budget(machine, knobs)
    if not kept:
        return 0.0
    P = spec.params * knobs.lp
    return min(1.0, kept / P) if P else 0.0


def traffic_per_step(spec, machine, knobs, plan):
    """Bytes moved, as ``{"mb": {link: [(what, bytes)]}, "opt": {...}}``.

    "mb" is one micro-batch of forward+backward, "opt" the optimizer pass; NVMe links are
    per node, the others per GPU.
    """
    N, R, r = spec.params, machine.ranks, machine.ranks_per_node
    lp, sb = knobs.lp, knobs.sb
    shard = -(-N // R)
    node_params = r * shard  # parameters whose shards this node owns
    p, o = plan.params_home, plan.optimizer_home
    gpu = not machine.cpu_only
    links = ("nvme_read", "nvme_write", "h2d", "d2h", "allgather", "reduce_scatter",
             "inter_node")
    mb = {k: [] for k in links}
    opt = {k: [] for k in links}
    cache_fwd, cache_bwd, cache_master, handoff = param_cache_reads(spec, machine, knobs, plan)
    k = reused_fraction(spec, machine, knobs, plan)
    if p == "nvme" and R > 1 and (cache_fwd or cache_bwd):
        # shards: forward reads what is not cached; backward what was neither kept from
        # forward (k) nor cached
        mb["nvme_read"].append((f"param shards fwd+bwd (2-k)*N*lp minus host-cached shard "
                                f"copies, k={k:.3g}",
                                max(0, node_params * lp - cache_fwd)
                                + max(0, int((1 - k) * node_params * lp) - cache_bwd)))
    elif p == "nvme" and (cache_fwd or cache_bwd):
        mb["nvme_read"].append(("params fwd+bwd 2*N*lp minus host-cached copies",
                                2 * node_params * lp - cache_fwd - cache_bwd))
    elif p == "nvme" and k:
        mb["nvme_read"].append((f"params fwd+bwd (2-k)*N*lp, k={k:.3g} kept for backward",
                                int((2 - k) * node_params * lp)))
    elif p == "nvme":
        mb["nvme_read"].append(("params fwd+bwd 2*N*lp", 2 * node_params * lp))
    tiled = tiled_groups(spec, machine, knobs, plan)
    if p == "nvme" and tiled:
        # per node: r ranks' shares; a tiled group is never kept for backward (reuse: the
        # base term above counted it (2-k) times)
        extra = int(sum((rd - 2 + k) * n * c for n, rd, c in tiled) * lp * r)
        if extra:
            what = "sum((reads-2+k)*n)*lp" if k else "sum((reads-2)*n)*lp"
            mb["nvme_read"].append((f"tiled groups read at every use {what}", extra))
    if plan.grads_on_nvme:
        A = knobs.grad_accum
        gn = node_params * 4 - plan.grad_host_bytes      # bytes of fp32 grads homed on NVMe
        g = "fp32 grads N*4" + (" (minus the part in host memory)" if plan.grad_host_bytes else "")
        # streamed (Note [Streamed gradients]): the last micro-batch's final sums are stepped
        # from memory, not written (with clipping they are, for a redo, unless it redoes
        # from fp32 moments: Note [Redo from moments], on every rank) nor read back
        keep = knobs.gradient_clipping and knobs.state_dtype != "fp32"
        last = 0 if plan.grads_streamed and not keep else gn
        if knobs.grad_accum_dtype == "bf16" and A > 1:
            # bf16 partial sums between micro-batches, fp32 written by the last one
            mb["nvme_write"].append(("grads: bf16 partials N*2*(A-1)/A + fp32 N*4/A"
                                     + (" (streamed: no fp32)" if not last else ""),
                                     (gn // 2 * (A - 1) + last) // A))
            mb["nvme_read"].append(("bf16 partial grads N*2*(A-1)/A", gn // 2 * (A - 1) // A))
        else:
            mb["nvme_write"].append((g + ("*(A-1)/A (streamed: not the last)" if not last else ""),
                                     (gn * (A - 1) + last) // A))
            if A > 1:  # accumulating reads the partial sums back on all but the first one
                mb["nvme_read"].append((g + "*(A-1)/A", gn * (A - 1) // A))
        if not plan.grads_streamed:
            opt["nvme_read"].append((g, gn))
    if o == "nvme":
        opt["nvme_read"].append((f"m+v N*2*{sb}", node_params * 2 * sb))
        opt["nvme_write"].append((f"m+v N*2*{sb}", node_params * 2 * sb))
    # the fp32 master is on NVMe when it is the NVMe-homed fp32 param, or the optimizer's
    # own master (bf16/fp16) homed on NVMe
    if (plan.master_is_param and p == "nvme") or (not plan.master_is_param and o == "nvme"):
        if handoff:
            # the buffer backward read (or a cached copy) is the master in hand; a tiled
            # group has no whole buffer: its master is read
            nt = r * sum(n * c for n, _, c in tiled)
            if nt and p == "nvme":
                opt["nvme_read"].append(("master of tiled groups n*4", nt * 4))
        elif cache_master:
            opt["nvme_read"].append(("master N*4 minus host-cached copies",
                                     node_params * 4 - cache_master))
        else:
            opt["nvme_read"].append(("master N*4", node_params * 4))
        opt["nvme_write"].append(("master N*4", node_params * 4))
    if p == "nvme" and not plan.master_is_param:
        opt["nvme_write"].append(("updated params N*lp", node_params * lp))
    if gpu:
        if p != "none" and k:
            mb["h2d"].append((f"param shards fwd+bwd (2-k)*N/R*lp, k={k:.3g}",
                              int((2 - k) * shard * lp)))
        elif p != "none":
            mb["h2d"].append(("param shards fwd+bwd 2*N/R*lp", 2 * shard * lp))
        else:       # (the CPU optimizer updates the host mirror: copied to the device)
            n = shard if knobs.zero_stage == 3 else N
            opt["h2d"].append(("updated params", n * lp))
        mb["d2h"].append(("grad shard N/R*lp", shard * lp))
    if R > 1:
        collective_traffic(N, machine, knobs, mb, opt, reused=k)
    return {"mb": mb, "opt": opt}


def collective_traffic(N, machine, knobs, mb, opt, reused=0.0):
    """Bytes one rank sends per micro-batch (``mb``) and per step (``opt``), by the
    convention of ``engine.stats()`` (an all-gather sends the rank's shard to every other
    rank of its group; a reduce-scatter or all-to-all each peer its chunk), with the part
    to other nodes under ``inter_node`` (in the totals above too).  ZeRO++ (``knobs.qwz``,
    ``hpz``, ``qgz``; infinity/zero/zeropp.py) changes the bytes per element and the groups."""
    from infinity.zero.zeropp import qgz_wire_bytes, qwz_wire_bytes
    R, r, lp = machine.ranks, machine.ranks_per_node, knobs.lp
    nodes = machine.nodes
    frac, off = (R - 1) / R, (R - r) / R           # of the world; to other nodes
    inter = mb.setdefault("inter_node", [])
    if knobs.zero_stage == 3:
        w = qwz_wire_bytes(N) / N if knobs.qwz else lp
        tag = "qwZ int8 " if knobs.qwz else ""
        mb["allgather"].append((f"params fwd {tag}N*{w:.3g}*(R-1)/R", int(N * w * frac)))
        inter.append(("params fwd to other nodes", int(N * w * off)))
        H = knobs.hpz if knobs.hpz > 1 else 0
        Nb = int(N * (1 - reused))      # backward gathers what was not kept from forward
        kt = f"(1-k)*N, k={reused:.3g}" if reused else "N"
        if H:     # backward gathers the secondary copy within groups of H ranks
            mb["allgather"].append((f"params bwd hpZ {kt}*lp*(H-1)/H",
                                    int(Nb * lp * (H - 1) / H)))
            if H > r:
                inter.append(("params bwd hpZ beyond the node", int(Nb * lp * (H - r) / H)))
        else:
            mb["allgather"].append((f"params bwd {tag}{kt}*{w:.3g}*(R-1)/R", int(Nb * w * frac)))
            inter.append(("params bwd to other nodes", int(Nb * w * off)))
    else:
        opt["allgather"].append(("updated params N*lp*(R-1)/R", int(N * lp * frac)))
        opt.setdefault("inter_node", []).append(("updated params to other nodes",
                                                 int(N * lp * off)))
    if knobs.zero_stage >= 2 and knobs.qgz:
        g = qgz_wire_bytes(N) / N
        mb["reduce_scatter"].append((f"grads qgZ int4 intra N*{g:.3g}*(r-1)/r",
                                     int(N * g * (r - 1) / r)))
        mb["reduce_scatter"].append((f"grads qgZ int4 inter N*{g:.3g}*(nodes-1)/R",
                                     int(N * g * (nodes - 1) / R)))
        inter.append(("grads qgZ inter", int(N * g * (nodes - 1) / R)))
    elif knobs.zero_stage >= 2:
        # GPUs: buckets reduced in the working precision (Note [Gradient buckets]); whole
        # groups (reduce_bucket_mb 0, CPU-only ranks) are reduced in fp32
        gb, gn = (lp, "lp") if not machine.cpu_only and knobs.reduce_bucket_mb > 0 else (4, "4")
        mb["reduce_scatter"].append((f"grads N*{gn}*(R-1)/R", int(N * gb * frac)))
        inter.append(("grads to other nodes", int(N * gb * off)))
    else:
        mb["reduce_scatter"].append(("grads all-reduce 2*N*lp*(R-1)/R", int(2 * N * lp * frac)))
        inter.append(("grads all-reduce to other nodes", int(2 * N * lp * off)))


def _with_activations(parts, plan, checkpointing, machine=None):
    """Activation offload: to NVMe written in forward and read back in backward, per
    micro-batch; on a GPU node every offloaded byte also crosses PCIe, D2H in forward and
    H2D in backward (per GPU: the node's bytes over its ranks)."""
    it = plan.activation_offload.get("checkpointing" if checkpointing else "none")
    if it is not None and it.tier == "nvme":
        parts["mb"]["nvme_write"].append(("activations " + it.formula, it.nbytes))
        parts["mb"]["nvme_read"].append(("activations " + it.formula, it.nbytes))
    if it is not None and it.nbytes and machine is not None and not machine.cpu_only:
        per_gpu = it.nbytes // machine.ranks_per_node
        parts["mb"]["d2h"].append(("offloaded activations", per_gpu))
        parts["mb"]["h2d"].append(("offloaded activations", per_gpu))
    return parts


def _recompute_tiles(parts, spec, machine, knobs, plan, checkpointing):
    """Activation checkpointing re-runs a tiled layer's forward (infinity.runtime.tiling
    re-reads its tiles); the recompute keeps them in host memory for the backward that
    follows (Note [Recompute keeps its tiles]; the memory plan's "tiles kept from the
    recompute" line), so a tiled group is read once more per micro-batch only when they do
    not fit (``plan.tiles_kept`` False)."""
    if not checkpointing or plan.params_home != "nvme" or getattr(plan, "tiles_kept", False):
        return
    tiled = tiled_groups(spec, machine, knobs, plan)
    n = sum(n * c for n, _, c in tiled)
    if not n:
        return
    lp, r = knobs.lp, machine.ranks_per_node
    parts["mb"]["nvme_read"].append(("tiled groups re-read for recompute sum(n)*lp",
                                     n * lp * r))
    if not machine.cpu_only:
        parts["mb"]["h2d"].append(("tiled groups re-read for recompute", n * lp))


#: bytes of host memory traffic per parameter the CPU optimizer moves (reads grad, master,
#: m, v; writes master, m, v and the low-precision copy: the basis of DEFAULT_CPU_ADAM_GPARAMS)
ADAM_HOST_BYTES_PER_PARAM = 30


def _host_memory(machine, links, lines, n_node_adam: int = 0) -> float:
    """GPU nodes: NVMe DMA, PCIe copies and CPU Adam all go through host DRAM, at
    ``host_mem_gbps`` per node (modelled, not validated: docs/estimator.md)."""
    if machine.cpu_only or not machine.host_mem_gbps:
        return 0.0
    r = machine.ranks_per_node
    b = links["nvme_read"] + links["nvme_write"] + r * (links["h2d"] + links["d2h"]) \
        + ADAM_HOST_BYTES_PER_PARAM * n_node_adam
    if not b:
        return 0.0
    t = b / (machine.host_mem_gbps * GB)
    lines.append(f"host memory: NVMe + PCIe{' + CPU Adam 30 B/param' if n_node_adam else ''} "
                 f"{_fmt_b(b)} / {machine.host_mem_gbps:g} GB/s = {fmt_seconds(t)} s")
    return t


#: saved tensors per layer that activation offload moves, by scope (measured on the shipped
#: Llama and GPT-2 shapes: 27 and 33 per layer at scope "all"; one layer input at
#: "checkpoints"), and the fixed cost of moving one to NVMe and back on a CPU-only rank (an
#: aligned staging buffer, an extent, a write and a read submitted; measured 0.6 ms on the
#: 2-core reference machine, docs/estimator.md "CPU-only activation offload")
SAVED_TENSORS_PER_LAYER = {"all": 30, "checkpoints": 1}
ACTIVATION_NVME_TENSOR_S = 6e-4


def _activation_copies(spec, machine, knobs, plan, checkpointing, lines) -> float:
    """CPU-only activation offload: the copies into staging (forward) and back (backward)
    run on the cores that compute, and each saved tensor sent to NVMe has a fixed cost;
    both add to the compute of a micro-batch (on a GPU the copies are DMA, overlapped)."""
    it = plan.activation_offload.get("checkpointing" if checkpointing else "none")
    if it is None or not machine.cpu_only or not it.nbytes:
        return 0.0
    per_rank = it.nbytes / max(1, machine.ranks_per_node)
    t = 2 * per_rank / (machine.host_copy_gbps * GB)
    n = spec.layers * SAVED_TENSORS_PER_LAYER.get(knobs.activation_scope, 1)
    text = (f"activation copies (CPU-only, on the computing cores): 2 x {_fmt_b(per_rank)} / "
            f"{machine.host_copy_gbps:g} GB/s")
    if knobs.activation_home == "nvme":
        t += n * ACTIVATION_NVME_TENSOR_S
        text += f" + {n} tensors x {ACTIVATION_NVME_TENSOR_S * 1e3:g} ms"
    lines.append(text + f" = {fmt_seconds(t)} s")
    return t


def _sum(parts):
    return {k: sum(b for _, b in v) for k, v in parts.items()}


def _what(parts, link):
    return " + ".join(w for w, _ in parts[link])


def attention_flops_per_token(spec) -> int:
    """Attention-score FLOPs per token of forward + backward as PaLM's MFU counts them:
    ``12 * layers * hidden * seq`` (QK^T and AV, 2 FLOP per multiply-add, x3 for backward)."""
    if not spec.layers or not spec.hidden:
        return 0
    return 12 * spec.layers * spec.hidden * spec.seq


def model_flops_per_token(spec, *, checkpointing: bool = False, hardware: bool = False,
                          knobs=None) -> float:
    """Model FLOPs per token (../shared/DESIGN.md §3.5, "MFU"): ``6*N`` + attention.  With
    ``hardware`` and activation checkpointing the recomputed forward counts too
    (``8*N`` + 4/3 of the attention): the hardware FLOPs the device executes.  LoRA
    (``knobs.lora_rank``): ``4*Nf + 6*Na`` + attention, ``6*Nf + 8*Na`` + 4/3 of it
    (:func:`.lora.lora_flops`)."""
    if knobs is not None and knobs.lora_rank is not None:
        from .lora import lora_flops
        return lora_flops(spec, knobs, attention_flops_per_token(spec),
                          checkpointing=checkpointing, hardware=hardware)
    if hardware and checkpointing:
        return 8 * spec.params + attention_flops_per_token(spec) * 4 // 3
    return 6 * spec.params + attention_flops_per_token(spec)


#: ranks whose optimizer step the engine overlaps with the last micro-batch's backward
#: (infinity.engine.overlap.eligible: fp32/bf16, one process or ZeRO stage 3)
def overlaps_optimizer(machine, knobs) -> bool:
    return knobs.precision in ("fp32", "bf16") and (machine.ranks == 1 or knobs.zero_stage == 3)


def _lora_traffic(spec, machine, knobs, plan):
    """LoRA: the adapters' traffic (the full-fine-tuning terms with ``N`` = the adapters)
    plus the frozen base read at every use (:func:`.lora.frozen_traffic`)."""
    from .lora import adapter_spec, frozen_traffic
    parts = traffic_per_step(adapter_spec(spec, knobs), machine, knobs, plan)
    for ph in parts.values():
        for link, terms in ph.items():
            ph[link] = [("adapters " + w.replace("N*", "Na*").replace("N/", "Na/"), b)
                        for w, b in terms]
    for link, terms in frozen_traffic(spec, machine, knobs, plan.params_home).items():
        parts["mb"][link] = terms + parts["mb"][link]
    return parts


def estimate_step(spec, machine, knobs, plan, *, checkpointing):
    lora = knobs.lora_rank is not None
    parts = _with_activations(_lora_traffic(spec, machine, knobs, plan) if lora else
                              traffic_per_step(spec, machine, knobs, plan), plan, checkpointing,
                              machine)
    _recompute_tiles(parts, spec, machine, knobs, plan, checkpointing)
    mb, opt = _sum(parts["mb"]), _sum(parts["opt"])
    A = knobs.grad_accum
    total = {k: A * mb[k] + opt[k] for k in mb}
    rd, wr = machine.nvme_gbps * GB, machine.nvme_write_gbps * GB
    share_pcie = machine.pcie_share
    pcie, ic = machine.pcie_gbps * GB / share_pcie, machine.interconnect_gbps * GB
    fpt = model_flops_per_token(spec, checkpointing=checkpointing, hardware=True, knobs=knobs)
    tokens = spec.seq * spec.batch
    flops = fpt * tokens
    t_comp = flops / (machine.tflops * 1e12)
    what = ("8*N + 16*L*H*S" if checkpointing else "6*N + 12*L*H*S") \
        if attention_flops_per_token(spec) else ("8*N" if checkpointing else "6*N")
    if lora:
        what = ("6*Nf + 8*Na" if checkpointing else "4*Nf + 6*Na") + (
            (" + 16*L*H*S" if checkpointing else " + 12*L*H*S")
            if attention_flops_per_token(spec) else "")
    d1 = [f"compute: ({what})*S*B = {flops:.3g} FLOP / {machine.tflops:g} TFLOPS = {fmt_seconds(t_comp)} s"]
    t_deq = 0.0
    if lora:   # the frozen base dequantized at every fetch, on the compute stream / cores
        from .lora import dequant_seconds
        t_deq = dequant_seconds(spec, machine, knobs, d1)
    t_nvme = mb["nvme_read"] / rd + mb["nvme_write"] / wr
    if t_nvme:
        txt = f"NVMe: read {_fmt_b(mb['nvme_read'])} ({_what(parts['mb'], 'nvme_read')}) / {machine.nvme_gbps:g} GB/s"
        if mb["nvme_write"]:
            txt += (f" + write {_fmt_b(mb['nvme_write'])} ({_what(parts['mb'], 'nvme_write')}) / "
                    f"{machine.nvme_write_gbps:g} GB/s")
        d1.append(txt + f" = {fmt_seconds(t_nvme)} s")
    t_pcie = max(mb["h2d"], mb["d2h"]) / pcie
    shared = f" / {share_pcie} GPUs per link" if share_pcie > 1 else ""
    if t_pcie:
        d1.append(f"PCIe per GPU: max(H2D {_fmt_b(mb['h2d'])}, D2H {_fmt_b(mb['d2h'])}) / "
                  f"({machine.pcie_gbps:g} GB/s{shared}) = {fmt_seconds(t_pcie)} s")
    t_mem = _host_memory(machine, mb, d1)
    xb = machine.inter_node_gbps * GB
    t_coll = (mb["allgather"] + mb["reduce_scatter"] - mb["inter_node"]) / ic + mb["inter_node"] / xb
    if t_coll:
        d1.append(f"collectives per GPU: all-gather {_fmt_b(mb['allgather'])} + reduce "
                  f"{_fmt_b(mb['reduce_scatter'])}, of which {_fmt_b(mb['inter_node'])} to other "
                  f"nodes at {machine.inter_node_gbps:g} GB/s, the rest at "
                  f"{machine.interconnect_gbps:g} GB/s = {fmt_seconds(t_coll)} s")
    t_act = _activation_copies(spec, machine, knobs, plan, checkpointing, d1)
    fb = _phase("forward+backward (one micro-batch)",
                {"compute": t_comp + t_act + t_deq, "nvme": t_nvme, "pcie": t_pcie, "collectives": t_coll,
                 "host_memory": t_mem}, d1)

    d2 = []
    t_onvme = opt["nvme_read"] / rd + opt["nvme_write"] / wr
    if t_onvme:
        txt = "NVMe: "
        if opt["nvme_read"]:
            txt += f"read {_fmt_b(opt['nvme_read'])} ({_what(parts['opt'], 'nvme_read')}) / {machine.nvme_gbps:g} GB/s + "
        txt += (f"write {_fmt_b(opt['nvme_write'])} ({_what(parts['opt'], 'nvme_write')}) / "
                f"{machine.nvme_write_gbps:g} GB/s = {fmt_seconds(t_onvme)} s (same drives: times add)")
        d2.append(txt)
    # the engine's optimizer is CPU Adam for every offload.optimizer ("none" included);
    # LoRA: it steps the adapters only
    n_train = spec.params
    if lora:
        from .lora import adapter_params
        n_train = adapter_params(spec, knobs.lora_rank)
    n_node = machine.ranks_per_node * -(-n_train // machine.ranks)
    t_adam = n_node / (machine.cpu_adam_gparams * 1e9)
    d2.append(f"CPU Adam: {n_node:.3g} params / {machine.cpu_adam_gparams:g} G params/s = {fmt_seconds(t_adam)} s")
    t_opcie = opt["h2d"] / pcie
    if t_opcie:
        d2.append(f"PCIe: updated params H2D {_fmt_b(opt['h2d'])} / ({machine.pcie_gbps:g} GB/s"
                  f"{shared}) = {fmt_seconds(t_opcie)} s")
    t_omem = _host_memory(machine, opt, d2, n_node_adam=n_node)
    t_ocoll = (opt["allgather"] - opt["inter_node"]) / ic + opt["inter_node"] / xb
    if t_ocoll:
        d2.append(f"collectives: all-gather updated params {_fmt_b(opt['allgather'])} / "
                  f"{machine.interconnect_gbps:g} GB/s = {fmt_seconds(t_ocoll)} s")
    op = _phase("optimizer", {"nvme": t_onvme, "cpu_adam": t_adam, "pcie": t_opcie,
                              "collectives": t_ocoll, "host_memory": t_omem}, d2)
    step = A * fb.seconds + op.seconds
    last_s = None
    if not machine.cpu_only and op.seconds and overlaps_optimizer(machine, knobs):
        # the engine steps each group as its gradient is final during the last
        # micro-batch's backward (Note [Streamed gradients]): the optimizer's work shares
        # that micro-batch's links and starts after its forward
        fwd = t_comp / (4 if checkpointing else 3)
        if lora:      # forward: 2*Nf + 2*Na + attention/3 of the hardware FLOPs
            fwd = t_comp * (2 * spec.params + 2 * n_train + attention_flops_per_token(spec) / 3) \
                / fpt + t_deq / 2
        last = {"compute": t_comp + t_act + t_deq, "nvme": t_nvme + t_onvme, "pcie": t_pcie + t_opcie,
                "collectives": t_coll + t_ocoll, "host_memory": t_mem + t_omem,
                "optimizer after forward": fwd + op.seconds}
        t_last = max(last.values())
        last_s = None
        if t_last < fb.seconds + op.seconds:
            step = (A - 1) * fb.seconds + t_last
            last_s = t_last
            op.derivation.append(
                f"overlapped with the last micro-batch's backward (as the engine streams it; "
                f"assumes updates below the clip norm): last micro-batch + optimizer = "
                f"max(compute, NVMe {fmt_seconds(last['nvme'])} s, PCIe, collectives, host "
                f"memory, forward + optimizer {fmt_seconds(last['optimizer after forward'])} s)"
                f" = {fmt_seconds(t_last)} s, {max(last, key=last.get)}-bound")
    # the resource that accounts for most of the step
    share = {}
    if fb.seconds:
        share[fb.bound] = share.get(fb.bound, 0.0) + A * fb.seconds
    if op.seconds:
        share[op.bound] = share.get(op.bound, 0.0) + op.seconds
    bound = max(share, key=share.get) if share else "none"
    tps = A * machine.ranks * tokens / step if step > 0 else float("inf")
    return StepEstimate(traffic=total, fwd_bwd=fb, optimizer=op, step_s=step, tokens_per_s=tps,
                        bound=bound, checkpointing=checkpointing, last_s=last_s)
