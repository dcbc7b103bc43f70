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
* the device tier holds the group in use, ``d`` prefetched groups and one being
  released: ``(d+2)*Gmax*lp`` (``PlacementPlan``'s "fetch window"); on a CPU-only node a
  host-homed group is used in place (no copy) and an NVMe-homed group is read straight
  into a device-tier buffer, with one group-sized staging buffer during initialisation;
* each group's gradient accumulates into an fp32 buffer (4 bytes per element) in host
  memory (on a GPU with the optimizer on the device: on the device);
* fp32: the parameter at its home *is* the fp32 master; the optimizer home keeps m and v
  (``2*sb`` bytes per param). bf16/fp16: the optimizer home keeps master + m + v
  (``4 + 2*sb``) and the low-precision params stay at their own home;
* the optimizer step streams tiles through a ring of D slots, each holding one tile of
  master and grad (8 B, when a swap space exists), m and v (``2*sb``, NVMe home) and the
  low-precision params for an NVMe param home (lp): ``D*T*(8 + 2*sb + lp)`` at most.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .machine import GB

# What the engine does with fp32 gradients the host cannot hold (infinity/engine.py,
# infinity/zero/distributed.py: grad_spill_needed); the estimator models it only with grad_spill.
SPILL_NOTE = ("infinity's engine pages them itself when the optimizer is on NVMe and the host "
              "budget cannot hold them")

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
    activation_model: str | None = None  # "megatron" | "eager" (None: eager CPU-only, megatron GPU)
    grad_spill: bool = False           # page fp32 grads to NVMe when the host is short (an
                                       # opt-in what-if here; see SPILL_NOTE for the engine)

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
    """The (params, optimizer) homes the engine accepts for ``knobs``: every pair at ZeRO
    stage 3; parameters can only be offloaded at stage 3 (config rule)."""
    return [(p, o) for p in HOMES for o in HOMES if p == "none" or knobs.zero_stage == 3]


ACTIVATION_MODELS = ("megatron", "eager")


def activation_items(spec, knobs, model="megatron"):
    """Per-GPU activation memory with and without activation checkpointing.

    ``"megatron"`` (fused kernels, GPU): Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models" (arXiv:2205.05198), eq. 1: one transformer
    layer stores ``S*B*H*(34 + 5*a*S/H)`` bytes with 16-bit activations (x2 for fp32);
    the logits add ``S*B*V*8`` (fp32 logits and their gradient). Checkpointing keeps each
    layer's 16-bit input (``2*S*B*H``) plus one layer's full activations.

    ``"eager"`` (PyTorch eager, Hugging Face models, measured on CPU; see docs/estimator.md
    "Activation constants"): one layer ``S*B*H*(140 + 16*a*S/H)`` bytes in fp32 (x0.625 in
    bf16/fp16), ``L+1`` layers' worth at the backward peak, the loss ``S*B*V*24`` bytes (fp32
    upcast, shifted copy, log-softmax and their gradients) plus ``2*V*H*4`` for the
    transient output-embedding gradients. Checkpointing: ``L*S*B*H*lp`` of layer inputs plus
    two layers' full activations and the loss.

    Without attention heads given, ``a = H/128``.
    """
    S, B, H, L = spec.seq, spec.batch, spec.hidden, spec.layers
    a = spec.heads or max(1, H // 128)
    V = spec.vocab or 0
    if model == "eager":
        f = 1.0 if knobs.precision == "fp32" else 0.625
        per_layer = int(S * B * H * (140 + 16 * a * S / H) * f)
        loss = S * B * V * 24 + 2 * V * H * 4
        fs = "" if f == 1.0 else "0.625*"
        lg = " + S*B*V*24 + 2*V*H*4" if V else ""
        full = Item("device", "activations (no checkpointing)", (L + 1) * per_layer + loss,
                    f"{fs}(L+1)*S*B*H*(140 + 16*a*S/H){lg}  [eager, a={a}]")
        ckpt = Item("device", "activations (checkpointing)", L * S * B * H * knobs.lp + 2 * per_layer + loss,
                    f"L*S*B*H*lp + {fs}2*S*B*H*(140 + 16*a*S/H){lg}")
        return {"none": full, "checkpointing": ckpt}
    if model != "megatron":
        raise ValueError(f"activation model must be one of {ACTIVATION_MODELS}, got {model!r}")
    scale = 2 if knobs.precision == "fp32" else 1
    per_layer = int(S * B * H * (34 + 5 * a * S / H)) * scale
    logits = S * B * V * 8
    lg = " + S*B*V*8" if V else ""
    sc = "2*" if scale == 2 else ""
    full = Item("device", "activations (no checkpointing)", L * per_layer + logits,
                f"{sc}L*S*B*H*(34 + 5*a*S/H){lg}  [Korthikanti et al., a={a}]")
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

    # fp32: the parameter at its home IS the fp32 master (the optimizer keeps only m, v);
    # bf16/fp16: the optimizer home holds an fp32 master besides the low-precision params
    master_is_param = knobs.precision == "fp32"
    pl.master_is_param = master_is_param
    if master_is_param:
        pl.notes.append("fp32: the parameter at its home is the optimizer's master (stored once)")
    # groups in the device tier while paged: in use, d prefetched, one being released
    win = d + 2

    # ---------------------------------------------------------------- parameters
    if params_home == "none":
        if stage == 3 and R > 1:
            add(Item("device", "param shard", shard * lp, "N/R*lp"))
            add(Item("device", "gathered groups (all-gather window)", win * G * lp, "(d+2)*Gmax*lp"))
        else:
            add(Item("device", "params", N * lp, "N*lp" + (" (replicated: stage < 3)" if R > 1 else "")))
    else:
        if gpu or params_home == "nvme":
            # CPU-only: a host-homed group is used in place (no copy); NVMe-homed groups are
            # read straight into device-tier buffers
            add(Item("device", "fetched groups (in use + prefetch)", win * G * lp, "(d+2)*Gmax*lp"))
        if params_home == "cpu":
            add(Item("pinned", "param home (host)", r * shard * lp, "r*N/R*lp"))
        else:  # nvme
            add(Item("nvme", "param home (NVMe)", r * shard * lp, "r*N/R*lp"))
            if gpu:
                # each rank reads its 1/R share of a group, then the ranks all-gather it
                add(Item("pinned", "NVMe->GPU staging (prefetch window)", r * win * -(-G // R) * lp,
                         "r*(d+2)*Gmax/R*lp"))
            else:
                add(Item("pinned", "NVMe staging (initialisation only)", G * lp, "Gmax*lp"))

    # ---------------------------------------------------------------- gradients
    grad_item = None
    if optimizer_home == "none" and gpu:
        if stage >= 2:
            add(Item("device", "grad shard (fp32 accumulation)", shard * 4, "N/R*4"))
            add(Item("device", "reduce-scatter buckets", 2 * G * lp, "2*Gmax*lp"))
        else:
            add(Item("device", "grads (fp32 accumulation)", N * 4, "N*4"))
    else:
        if gpu:
            add(Item("device", "grads of groups in backward", 2 * G * lp, "2*Gmax*lp"))
            if stage >= 2 and R > 1:  # reduce-scattered on the device: each rank copies its 1/R
                add(Item("pinned", "GPU->host grad staging", r * 2 * -(-G // R) * lp, "r*2*Gmax/R*lp"))
            else:
                add(Item("pinned", "GPU->host grad staging", r * 2 * G * lp, "r*2*Gmax*lp"))
        grad_item = Item("pageable", "grad accumulation (fp32, host)", r * shard * 4, "r*N/R*4")
        add(grad_item)

    # ---------------------------------------------------------------- optimizer
    if master_is_param:
        states, f_states, what = shard * 2 * sb, f"N/R*2*{sb}", "m + v"
    else:
        states, f_states, what = shard * (4 + 2 * sb), f"N/R*(4+2*{sb})", "master + m + v"
    if optimizer_home == "none":
        add(Item("device", f"optimizer: {what}", states, f_states))
    elif optimizer_home == "cpu":
        add(Item("pageable", f"optimizer: {what} (host)", r * states, "r*" + f_states))
    else:
        add(Item("nvme", f"optimizer: {what} (NVMe)", r * states, "r*" + f_states))
    swap = params_home == "nvme" or optimizer_home == "nvme"
    # OptimizerStateStore ring: D slots of one tile each of master + grad (fp32, when a swap
    # space exists), m + v (NVMe home) and the low-precision params for an NVMe param home
    sink = lp if (not master_is_param and params_home == "nvme") else 0
    per_slot = (8 if swap else 0) + (2 * sb if optimizer_home == "nvme" else 0) + sink
    if per_slot:
        # a tile never spans two partitions (groups): pages of a slot beyond the largest group
        # are allocated but never touched, so resident bytes use min(T, Gmax)
        D = knobs.pipeline_depth
        T = min(knobs.tile_numel, -(-G // 2048) * 2048)
        add(Item("pinned", "optimizer tile ring", r * D * T * per_slot,
                 f"r*D*min(T,Gmax)*{per_slot}  [D={D}, T={knobs.tile_numel}]"))

    # ---------------------------------------------------------------- NVMe grads if host is short
    if grad_item is not None:
        host_now = pl.tier_total("pinned") + pl.tier_total("pageable")
        if machine.cpu_only:
            host_now += pl.tier_total("device")
        cap = _host_cap(machine, knobs)
        if knobs.grad_spill and cap is not None and host_now > cap and optimizer_home == "nvme":
            pl.items.remove(grad_item)
            add(Item("nvme", "grad accumulation (fp32, NVMe)",
                     grad_item.nbytes, grad_item.formula))
            pl.grads_on_nvme = True
            pl.notes.append("what-if: gradients paged to NVMe because the host cannot hold the fp32 "
                            f"grad partition ({SPILL_NOTE})")

    act_model = knobs.activation_model or ("eager" if machine.cpu_only else "megatron")
    pl.activations = activation_items(spec, knobs, act_model)
    return pl


def _host_cap(machine, knobs):
    caps = [c for c in (knobs.host_cap_gb, machine.host_mem_gb) if c]
    return int(min(caps) * GB) if caps else None
