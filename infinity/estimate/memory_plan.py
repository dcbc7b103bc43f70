"""Bytes each tier needs for one offload configuration, as named line items with formulas.

Notation (printed with every estimate):

    N    parameters                     R    ranks (GPUs x nodes; 1 on a CPU-only node)
    r    ranks per node                 lp   bytes per low-precision param (4 fp32, 2 bf16/fp16)
    sb   bytes per Adam moment (4, or 2 with bf16 states)
    Gmax largest parameter group (elements; one group = one module's own params)
    d    prefetch depth                 T    optimizer tile (elements)   D  tile ring depth (3)
    S, B, H, L, V, a   sequence, micro-batch, hidden, layers, vocabulary, heads

Device items are per GPU (per rank). Host and NVMe items are per node (r ranks).
On a CPU-only node the device tier *is* host memory: its items are added to the
host total when checking the fit.

The data path follows the engine (``infinity/engine.py``, ``infinity/memory``,
``infinity/zero``, ``infinity/optim/offload_step.py``):

* parameters are flattened per module into groups; a group is fetched whole into a
  device-tier buffer (NVMe-homed groups are read straight into it on a CPU-only node,
  through a pinned staging buffer on GPU nodes) and released after use; parameters do not
  change during forward/backward so nothing is written back on release;
* the working set is the group in use plus ``d`` prefetched groups: ``(d+1)*Gmax*lp``;
* each group's gradient accumulates into an fp32 buffer (4 bytes per element) that lives
  in host memory when the optimizer is offloaded, on the device otherwise;
* the optimizer keeps fp32 master + m + v at its home; with fp32 precision and the same
  home for params and optimizer the parameter *is* the master (stored once);
* the NVMe optimizer step streams tiles through a ring of D slots, each holding one tile
  of master (4 B), grad (4 B), m and v (sb each) and, when the params need a low-precision
  copy, lp bytes: ``D*T*(8 + 2*sb [+ lp])``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .machine import GB

HOMES = ("none", "cpu", "nvme")
TIER_NAMES = {"device": "device per GPU", "pinned": "pinned host per node",
              "pageable": "pageable host per node", "nvme": "NVMe per node"}


@dataclass
class Knobs:
    """infinity's settings that change the memory and traffic (config keys in brackets)."""
    precision: str = "bf16"            # [precision]
    zero_stage: int = 3                # [zero_stage]
    prefetch_depth: int = 2            # [prefetch.depth]
    aio_block_size: int = 1 << 20      # [aio.block_size]
    aio_queue_depth: int = 32          # [aio.queue_depth]
    aio_threads: int = 1               # [aio.threads]
    tile_numel: int = 4 * 1024 * 1024  # OptimizerStateStore tile (elements)
    pipeline_depth: int = 3            # OptimizerStateStore ring slots
    state_dtype: str = "fp32"          # Adam moments: "fp32" | "bf16"
    grad_accum: int = 1                # [gradient_accumulation_steps]
    host_cap_gb: float | None = None   # [offload.host_memory_gb]
    grouping: str = "module"           # how params are flattened into groups

    @property
    def lp(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def sb(self) -> int:
        return 4 if self.state_dtype == "fp32" else 2

    def as_dict(self):
        return asdict(self)


@dataclass
class Item:
    tier: str          # "device" | "pinned" | "pageable" | "nvme"
    name: str
    nbytes: int
    formula: str

    def as_dict(self):
        return asdict(self)


@dataclass
class MemoryPlan:
    params_home: str
    optimizer_home: str
    items: list = field(default_factory=list)
    activations: dict = field(default_factory=dict)   # "checkpointing"|"none" -> Item
    notes: list = field(default_factory=list)
    grads_on_nvme: bool = False
    master_is_param: bool = False

    def tier_total(self, tier):
        return sum(i.nbytes for i in self.items if i.tier == tier)


def valid_configs(knobs):
    """The (params, optimizer) homes the engine accepts for ``knobs``.

    Parameters can only be offloaded at ZeRO stage 3 (config rule). The optimizer must be
    offloaded at least as far as the parameters (params on NVMe with fp32 master + Adam
    states kept on the device would use *more* device memory than keeping the params there).
    """
    order = {h: i for i, h in enumerate(HOMES)}
    out = []
    for p in HOMES:
        if p != "none" and knobs.zero_stage != 3:
            continue
        for o in HOMES:
            if order[o] >= order[p]:
                out.append((p, o))
    return out


def activation_items(spec, knobs):
    """Per-GPU activation memory with and without activation checkpointing.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198), eq. 1: one transformer layer stores ``S*B*H*(34 + 5*a*S/H)`` bytes of
    activations with 16-bit activations (2-byte elements, 1-byte dropout masks); ``x2`` for fp32.
    Without attention heads given, ``a = H/128``. With full activation checkpointing each
    layer keeps only its 16-bit input (``2*S*B*H`` bytes, x2 for fp32) and one layer's full
    activations exist at a time during recomputation. The logits add ``S*B*V*4*2`` bytes
    (fp32 logits and their gradient) when V is known.
    """
    S, B, H, L = spec.seq, spec.batch, spec.hidden, spec.layers
    a = spec.heads or max(1, H // 128)
    scale = 2 if knobs.precision == "fp32" else 1
    per_layer = int(S * B * H * (34 + 5 * a * S / H)) * scale
    logits = S * B * spec.vocab * 8 if spec.vocab else 0
    lg = " + S*B*V*8" if spec.vocab else ""
    sc = "2*" if scale == 2 else ""
    full = Item("device", "activations (no checkpointing)", L * per_layer + logits,
                f"{sc}L*S*B*H*(34 + 5*a*S/H){lg}  [a={a}]")
    ckpt = Item("device", "activations (checkpointing)", L * 2 * S * B * H * scale + per_layer + logits,
                f"{sc}(L*2*S*B*H + S*B*H*(34 + 5*a*S/H)){lg}")
    return {"none": full, "checkpointing": ckpt}


def plan_memory(spec, machine, knobs, params_home, optimizer_home):
    N, R, r = spec.params, machine.ranks, machine.ranks_per_node
    lp, sb = knobs.lp, knobs.sb
    G = spec.group_numel(knobs.grouping)
    d = knobs.prefetch_depth
    stage = knobs.zero_stage
    gpu = not machine.cpu_only
    pl = MemoryPlan(params_home, optimizer_home)
    add = pl.items.append
    shard = -(-N // R)  # elements of one rank's shard

    # the fp32 master is the parameter itself when both live in the same home at fp32
    master_is_param = knobs.precision == "fp32" and params_home == optimizer_home
    pl.master_is_param = master_is_param
    opt_part = shard if stage >= 1 else N
    master_b = 0 if master_is_param else 4

    # ---------------------------------------------------------------- parameters
    if params_home == "none":
        if stage == 3 and R > 1:
            add(Item("device", "param shard", shard * lp, "N/R*lp"))
            add(Item("device", "gathered groups (all-gather window)", (d + 1) * G * lp, "(d+1)*Gmax*lp"))
        else:
            add(Item("device", "params", N * lp, "N*lp" + (" (replicated: stage < 3)" if R > 1 else "")))
    else:
        add(Item("device", "fetched groups (working set + prefetch)", (d + 1) * G * lp, "(d+1)*Gmax*lp"))
        if params_home == "cpu":
            if master_is_param:
                pl.notes.append("fp32: the parameter is the optimizer's master, stored once (in the optimizer line)")
            else:
                add(Item("pinned", "param home (host)", r * shard * lp, "r*N/R*lp"))
        else:  # nvme
            if master_is_param:
                pl.notes.append("fp32: the parameter extent is the optimizer's master, stored once")
            else:
                add(Item("nvme", "param home (NVMe)", r * shard * lp, "r*N/R*lp"))
            if gpu:
                # each rank reads its 1/R share of a group, then the ranks all-gather it
                add(Item("pinned", "NVMe->GPU staging (prefetch window)", r * (d + 1) * -(-G // R) * lp,
                         "r*(d+1)*Gmax/R*lp"))

    # ---------------------------------------------------------------- gradients
    if optimizer_home == "none":
        if stage >= 2:
            add(Item("device", "grad shard (fp32 accumulation)", shard * 4, "N/R*4"))
            add(Item("device", "reduce-scatter buckets", 2 * G * lp, "2*Gmax*lp"))
        else:
            add(Item("device", "grads (fp32 accumulation)", N * 4, "N*4"))
    else:
        add(Item("device", "grads of groups in backward", 2 * G * lp, "2*Gmax*lp"))
        if gpu:
            if stage >= 2 and R > 1:  # reduce-scattered on the device: each rank copies its 1/R
                add(Item("pinned", "GPU->host grad staging", r * 2 * -(-G // R) * lp, "r*2*Gmax/R*lp"))
            else:
                add(Item("pinned", "GPU->host grad staging", r * 2 * G * lp, "r*2*Gmax*lp"))
        grad_item = Item("pageable", "grad accumulation (fp32, host)", r * shard * 4, "r*N/R*4")
        add(grad_item)

    # ---------------------------------------------------------------- optimizer
    states = opt_part * (master_b + 2 * sb)
    f_states = f"N/R*({master_b}+2*{sb})" if master_b else f"N/R*(2*{sb}) + master=param N/R*4"
    if master_is_param:
        states += opt_part * 4
    if optimizer_home == "none":
        add(Item("device", "optimizer: master + m + v", states, f_states))
    elif optimizer_home == "cpu":
        add(Item("pageable", "optimizer: master + m + v (host)", r * states, "r*" + f_states))
    else:
        add(Item("nvme", "optimizer: master + m + v (NVMe)", r * states, "r*" + f_states))
    swap = params_home == "nvme" or optimizer_home == "nvme"
    if optimizer_home != "none":
        sink = 0 if master_is_param else lp
        per_slot = (8 if swap else 0) + (2 * sb if optimizer_home == "nvme" else 0) + sink
        if per_slot:
            T, D = knobs.tile_numel, knobs.pipeline_depth
            add(Item("pinned", "optimizer tile ring", r * D * T * per_slot,
                     f"r*D*T*{per_slot}  [D={D}, T={T}]"))

    if swap:
        # the I/O engine lazily gives each in-flight slot a block-sized bounce buffer for
        # transfers it cannot do with O_DIRECT in place (unaligned pieces): worst case
        nb = knobs.aio_threads * knobs.aio_queue_depth * knobs.aio_block_size
        add(Item("pageable", "aio bounce buffers (worst case)", r * nb,
                 f"r*threads*queue_depth*block_size  [{knobs.aio_threads}*{knobs.aio_queue_depth}*{knobs.aio_block_size}]"))

    # ---------------------------------------------------------------- NVMe grads if host is short
    if optimizer_home != "none":
        host_now = pl.tier_total("pinned") + pl.tier_total("pageable")
        if machine.cpu_only:
            host_now += pl.tier_total("device")
        cap = _host_cap(machine, knobs)
        if cap is not None and host_now > cap and optimizer_home == "nvme":
            pl.items.remove(grad_item)
            add(Item("nvme", "grad accumulation (fp32, NVMe: host cap too small)",
                     grad_item.nbytes, grad_item.formula))
            pl.grads_on_nvme = True
            pl.notes.append("gradients spill to NVMe: the host cannot hold the fp32 grad partition")

    pl.activations = activation_items(spec, knobs)
    return pl


def _host_cap(machine, knobs):
    caps = [c for c in (knobs.host_cap_gb, machine.host_mem_gb) if c]
    return int(min(caps) * GB) if caps else None
