"""Bytes each tier needs for one offload configuration, as named line items with formulas.

Notation (printed with every estimate):

    N    parameters                     R    ranks (GPUs x nodes; 1 on a CPU-only node)
    r    ranks per node                 lp   bytes per low-precision param (4 fp32, 2 bf16/fp16)
    sb   bytes per Adam moment (4, or 2 with bf16 states)
    Gmax largest parameter group (elements; one group = one module's own params)
    Gf   with tiling: max(tile, largest group tiling cannot split) (elements)
    d    prefetch depth                 T    optimizer tile (elements)   D  tile ring depth (3)
    S, B, H, L, V, a   sequence, micro-batch, hidden, layers, vocabulary, heads

Device items are per GPU (per rank). Host and NVMe items are per node (r ranks).
On a CPU-only node the device tier *is* host memory: its items are added to the
host total when checking the fit.

The data path follows the engine (``infinity/engine/build.py``, ``infinity/memory``,
``infinity/runtime``, ``infinity/grads``, ``infinity/optim/offload_step.py``,
``infinity/zero``):

* parameters are flattened per module into groups; a group is fetched whole into a
  device-tier buffer (NVMe-homed groups are read straight into it on a CPU-only node,
  through a pinned staging buffer on GPU nodes) and released after use; parameters do not
  change during forward/backward so nothing is written back on release;
* the device tier holds the group in use, ``d`` prefetched groups and one being
  released: ``(d+2)*Gmax*lp`` (``PlacementPlan``'s "fetch window"; LoRA on a CPU-only node:
  the frozen groups' share of it, :func:`infinity.estimate.lora.frozen_in_window`); on a CPU-only node a
  host-homed group is used in place (no copy) and an NVMe-homed group is read straight
  into a device-tier buffer, with one group-sized staging buffer during initialisation;
* each group's gradient accumulates into an fp32 buffer (4 bytes per element) in host
  memory (on a GPU with the optimizer on the device: on the device), unless the engine
  homes the fp32 gradients on NVMe (see :func:`grad_spill_decision` for its two rules);
  then each group is assembled in a host staging buffer (``2*Gmax*4`` at most: one being
  filled, one being written), written to its NVMe extent, read back and re-written on
  later micro-steps of an accumulation window, and read tile-wise by the optimizer;
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

# infinity.memory.plan.STREAM_GRAD_WINDOW (not imported: the estimator does not load torch;
# tests/engine/test_streamed_step.py checks they agree)
STREAM_GRAD_WINDOW = 2

# Where the engine homes fp32 gradients (see grad_spill_decision)
GRAD_SPILL_MODES = ("auto", "on", "off")
SPILL_NOTE = ("infinity's engine pages them itself: single process when the host tier exceeds "
              "offload.host_memory_gb and an NVMe swap space exists; ZeRO stage >= 2 across "
              "ranks when the optimizer is on NVMe and the grad shard exceeds half the host budget")

HOST_RESERVE_BASE_GB = 1.0      # OS and page cache headroom per node
HOST_RESERVE_PER_RANK_GB = 1.0  # a torch process's own resident memory (libraries, allocator)


def host_reserve_bytes(machine):
    """Host memory per node not available to infinity (OS, page cache, torch runtime)."""
    return int((HOST_RESERVE_BASE_GB + HOST_RESERVE_PER_RANK_GB * machine.ranks_per_node) * GB)


HOMES = ("none", "cpu", "nvme")
#: infinity.zero.partitioned_grads.MAX_INFLIGHT_REDUCTIONS (kept in step by a test)
ZERO_INFLIGHT_REDUCTIONS = 4
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
    gradient_clipping: float = 0.0     # [gradient_clipping] (0: the step overlaps backward)
    grouping: str = "module"           # how params are flattened into groups
    activation_model: str | None = None  # "megatron" | "eager" (None: eager CPU-only, megatron GPU)
    activation_home: str = "none"      # [activation_offload.home]: "none" | "cpu" | "nvme"
    activation_scope: str = "checkpoints"  # [activation_offload.scope]: "checkpoints" | "all"
    grad_accum_dtype: str = "fp32"     # [gradient_accumulation_dtype] NVMe partial sums
    tiling_max_group_gb: float | None = None  # [tiling.max_group_gb] (None: no tiling; at
                                       # world size > 1 only stage 3 without ZeRO++ tiles)
    grad_spill: str = "auto"           # fp32 gradient home: "auto" decides as the engine does
                                       # (grad_spill_decision), "on" = on NVMe whenever a swap
                                       # space exists, "off" = always in host memory
    qwz: bool = False                  # [zero_pp.quantized_weights]
    hpz: int = 1                       # [zero_pp.hpz_partition_size]
    qgz: bool = False                  # [zero_pp.quantized_gradients]
    reduce_bucket_mb: float = 128.0    # [reduce_bucket_mb] (0: whole groups)
    reuse_gb: float | None = None      # [prefetch.reuse_gb] (None: automatic, as the engine)
    commit_shadow_gb: float | None = None  # [offload.commit_shadow_gb] per rank (None:
                                       # automatic from the NVMe left, as the engine)
    # LoRA over a frozen base (infinity/estimate/lora.py; `infinity finetune --lora R`):
    lora_rank: int | None = None       # adapters' rank (None: full fine-tuning)
    frozen_dtype: str | None = None    # [offload.frozen_weights.dtype] None: working precision
    frozen_group_size: int = 64        # [offload.frozen_weights.group_size]
    frozen_double_quant: bool = False  # [offload.frozen_weights.double_quant]

    def __post_init__(self):
        if self.grad_spill is True or self.grad_spill is False:   # the old boolean form
            self.grad_spill = "on" if self.grad_spill else "off"

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
    # activation offload: "checkpointing"|"none" -> Item (tier pinned or nvme, per node) of
    # the saved activations moved off the device per micro-batch (absent: none moved)
    activation_offload: dict = field(default_factory=dict)
    grad_host_bytes: int = 0      # grads on NVMe: fp32 accumulators that still fit the cap
    notes: list = field(default_factory=list)
    grads_on_nvme: bool = False
    grads_streamed: bool = False  # grads on NVMe, final sums stepped from memory (no round trip)
    master_is_param: bool = False
    tiles_kept: bool = False      # tiled layers' recompute keeps its tiles for the backward

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
    layer stores ``S*B*H*(34 + 5*a*S/H)`` bytes with 16-bit activations (x2 for fp32),
    ``34*S*B*H`` when the attention is a fused kernel that keeps no S x S scores
    (``spec.attention_scores`` False: SDPA / flash attention; measured on an H200 with a
    3B Llama in bf16: 0.99x and 1.08x the prediction at micro-batch 8 and 64);
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
    per_layer, fl = _megatron_layer(spec)
    per_layer *= scale
    logits = S * B * V * 8
    lg = " + S*B*V*8" if V else ""
    sc = "2*" if scale == 2 else ""
    fused = "" if spec.attention_scores is not False else ", fused attention"
    full = Item("device", "activations (no checkpointing)", L * per_layer + logits,
                f"{sc}L*{fl}{lg}  [Korthikanti et al., a={a}{fused}]")
    ckpt = Item("device", "activations (checkpointing)", L * 2 * S * B * H * scale + per_layer + logits,
                f"{sc}(L*2*S*B*H + {fl}){lg}")
    return {"none": full, "checkpointing": ckpt}


def _megatron_layer(spec) -> tuple[int, str]:
    """One layer's 16-bit stored activations (Korthikanti et al.) and the formula: the
    attention scores' ``5*a*S/H`` term unless the attention is fused (no S x S scores)."""
    S, B, H = spec.seq, spec.batch, spec.hidden
    if spec.attention_scores is False:
        return 34 * S * B * H, "S*B*H*34"
    a = spec.heads or max(1, H // 128)
    return int(S * B * H * (34 + 5 * a * S / H)), "S*B*H*(34 + 5*a*S/H)"


def saved_activation_bytes(spec, knobs, model="megatron"):
    """``(per_layer, outside, formula_layer, formula_outside)``: bytes autograd *saves* per
    micro-batch — what activation offload with scope "all" moves — per transformer layer
    and outside the layers (embeddings, final norm, logits).

    ``"megatron"``: the stored activations of Korthikanti et al. (they are the saved
    tensors), ``S*B*H*(34 + 5*a*S/H)`` per layer (16-bit; x2 fp32), the fp32 logits
    ``S*B*V*4`` outside.  ``"eager"`` (measured on this machine with transformers' GPT-2
    and infinity's ``activation_offload_bytes``, L = 2 and 6 differenced, S*B*H = 65536 at
    a*S/H = 1 and 2): ``S*B*H*(120 + 12*a*S/H)`` per layer in fp32,
    ``4*S*B*V + 12*S*B*H`` outside (the logits saved for the loss, embedding and final norm
    inputs); in bf16/fp16 ``S*B*H*(66 + 12*a*S/H)`` per layer (the attention-score part
    does not halve, the rest is 0.55x) and ``4*S*B*V + 6*S*B*H`` outside (the loss saves
    the logits upcast to fp32) -- measured the same way on the simulated device at a*S/H =
    1 and 2, checked at 4 (``tools/validate_estimator.py --pcie``); saved tensors under
    4096 bytes are not offloaded and not counted."""
    S, B, H = spec.seq, spec.batch, spec.hidden
    a = spec.heads or max(1, H // 128)
    V = spec.vocab or 0
    if model == "eager":
        if knobs.precision == "fp32":
            return (int(S * B * H * (120 + 12 * a * S / H)), 4 * S * B * V + 12 * S * B * H,
                    "S*B*H*(120 + 12*a*S/H)", "4*S*B*V + 12*S*B*H")
        return (int(S * B * H * (66 + 12 * a * S / H)), 4 * S * B * V + 6 * S * B * H,
                "S*B*H*(66 + 12*a*S/H)", "4*S*B*V + 6*S*B*H")
    scale = 2 if knobs.precision == "fp32" else 1
    sc = "2*" if scale == 2 else ""
    per_layer, fl = _megatron_layer(spec)
    return per_layer * scale, S * B * V * 4, f"{sc}{fl}", "S*B*V*4"


def offload_activations(pl, spec, machine, knobs, model):
    """Activation offload (``knobs.activation_home`` cpu/nvme): per variant, the saved
    bytes moved off the device per micro-batch (scope "checkpoints": the layer inputs
    ``L*S*B*H*lp`` kept by checkpointing; scope "all": every saved tensor) become a host
    or NVMe item, and the device keeps its activations minus those plus a read-ahead
    window of ``d`` of the largest offloaded tensors."""
    home, scope = knobs.activation_home, knobs.activation_scope
    if home == "none":
        return
    S, B, H, L = spec.seq, spec.batch, spec.hidden, spec.layers
    r = machine.ranks_per_node
    d = max(1, knobs.prefetch_depth)
    inputs = L * S * B * H * knobs.lp
    per_layer, outside, f_layer, f_out = saved_activation_bytes(spec, knobs, model)
    moved = {"checkpointing": (inputs, "L*S*B*H*lp") if scope == "checkpoints" else
             (inputs + outside, f"L*S*B*H*lp + {f_out}"),
             "none": (0, "0 (no checkpoint boundaries)") if scope == "checkpoints" else
             (L * per_layer + outside, f"L*{f_layer} + {f_out}")}
    largest = S * B * H * knobs.lp * (1 if scope == "checkpoints" else 4)   # MLP hidden
    tier = "pinned" if home == "cpu" else "nvme"
    for v, (nbytes, formula) in moved.items():
        if not nbytes:
            continue
        dev = pl.activations[v]
        window = d * largest
        left = max(dev.nbytes - nbytes, 0) + window
        pl.activations[v] = Item("device", dev.name + f", {nbytes / GB:.3g} GB offloaded",
                                 left, f"{dev.formula} - ({formula}) + d*{largest} read-ahead")
        pl.activation_offload[v] = Item(tier, f"activations offloaded ({home}, scope {scope})",
                                        r * nbytes, "r*(" + formula + ")")


def reuse_budget(machine, knobs) -> int | None:
    """Bytes of released groups one rank keeps for their next use in the micro-step
    (Note [Reuse within a micro-step] in infinity/runtime/prefetch.py, as
    ``infinity.engine.build.reuse_bytes_for``): ``prefetch.reuse_gb`` when set; automatic
    at stage 3 across ranks: ``DEFAULT_REUSE_BYTES`` on a CPU-only rank, None on a GPU
    (whatever the device budget leaves; kept groups give way when it is needed); else 0."""
    from infinity.runtime.prefetch import DEFAULT_REUSE_BYTES
    if knobs.reuse_gb is not None:
        return int(round(knobs.reuse_gb * GB))
    if knobs.zero_stage != 3 or machine.ranks == 1:
        return 0
    return DEFAULT_REUSE_BYTES if machine.cpu_only else None


def plan_memory(spec, machine, knobs, params_home, optimizer_home):
    if knobs.lora_rank is not None:
        return _plan_lora(spec, machine, knobs, params_home, optimizer_home)
    return _plan(spec, machine, knobs, params_home, optimizer_home)


def _plan_lora(spec, machine, knobs, params_home, optimizer_home):
    """LoRA (infinity/estimate/lora.py): the frozen base and the adapters at their home
    (:func:`.lora.param_items`), then the full-fine-tuning lines of the trainable part,
    with ``N`` = the adapters."""
    from .lora import adapter_spec, param_items
    base = [Item(*t) for t in param_items(spec, machine, knobs, params_home)]
    pl = _plan(adapter_spec(spec, knobs), machine, knobs, params_home, optimizer_home,
               param_items=base)
    pl.notes.insert(0, "LoRA: the gradient, optimizer and tile-ring lines count the adapters "
                       "(N = Na adapter params, Gmax = the largest adapter group); Nf, qb: the "
                       "frozen base's params and bytes per param at its home; in the frozen "
                       "base's lines Gmax is the largest frozen group, Ga the largest adapter "
                       "group")
    return pl


def _plan(spec, machine, knobs, params_home, optimizer_home, param_items=None):
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
    # memory-centric tiling (module grouping; params paged: one rank, or ZeRO stage 3 without
    # ZeRO++, where each rank holds the whole gathered tile): a fetch puts at most a tile of
    # the tiled groups on the device, Gf = max(min(Gmax, tile), largest untileable group)
    Gf, gname = G, "Gmax"
    zpp = knobs.qwz or knobs.hpz > 1 or knobs.qgz
    if knobs.tiling_max_group_gb is not None and params_home != "none" \
            and (R == 1 or (stage == 3 and not zpp)):
        Gf = spec.fetched_numel(knobs.grouping, int(knobs.tiling_max_group_gb * GB) // lp)
        if Gf < G:
            gname = "Gf"
            pl.notes.append(f"tiling: groups over {knobs.tiling_max_group_gb:g} GB are computed "
                            f"tile by tile; Gf = max(tile, largest untileable group) = "
                            f"{Gf:,} elements (Gmax {G:,})")

    # ---------------------------------------------------------------- parameters
    if param_items is not None:     # LoRA: the frozen base and the adapters (lora.py)
        pl.items.extend(param_items)
    elif params_home == "none":
        if stage == 3 and R > 1:
            add(Item("device", "param shard", shard * lp, "N/R*lp"))
            add(Item("device", "gathered groups (all-gather window)", win * G * lp, "(d+2)*Gmax*lp"))
        else:
            add(Item("device", "params", N * lp, "N*lp" + (" (replicated: stage < 3)" if R > 1 else "")))
    else:
        if gpu or params_home == "nvme":
            # CPU-only: a host-homed group is used in place (no copy); NVMe-homed groups are
            # read straight into device-tier buffers
            add(Item("device", "fetched groups (in use + prefetch)", win * Gf * lp,
                     f"(d+2)*{gname}*lp"))
        if params_home == "cpu":
            add(Item("pinned", "param home (host)", r * shard * lp, "r*N/R*lp"))
        else:  # nvme
            add(Item("nvme", "param home (NVMe)", r * shard * lp, "r*N/R*lp"))
            if gpu:
                # each rank reads its 1/R share of a group, then the ranks all-gather it
                # (tiled: the owner of a tile's piece reads it whole, at most a tile or
                # a shard: Note [Tiles across ranks])
                stg = -(-G // R) if Gf == G else min(Gf, -(-G // R))
                add(Item("pinned", "NVMe->GPU staging (prefetch window)", r * win * stg * lp,
                         f"r*(d+2)*{gname}/R*lp" if Gf == G else "r*(d+2)*min(Gf,Gmax/R)*lp"))
            else:
                add(Item("pinned", "NVMe staging (initialisation only)", G * lp, "Gmax*lp"))

    kept = reuse_budget(machine, knobs) if param_items is None else 0   # (LoRA: not modelled)
    if kept and (R > 1 or params_home == "nvme"):
        # groups kept resident from forward for backward (not counted on a GPU by default:
        # they only use what the device budget leaves)
        # the groups in use and prefetched in backward are kept ones when everything is
        # kept: a rank's gathered parameters never exceed the model plus one group in
        # flight (window + kept <= N*lp + Gf*lp)
        windowed = gpu or params_home == "nvme"
        room = N * lp - (win - 1) * Gf * lp if windowed else N * lp
        add(Item("device", "groups kept for reuse (prefetch.reuse_gb)",
                 max(0, min(kept, room)),
                 "min(reuse, N*lp - (d+1)*Gf*lp)" if windowed else "min(reuse, N*lp)"))

    if stage == 3 and R > 1 and knobs.hpz > 1:
        # hpZ (infinity/zero/zeropp.py): a secondary copy partitioned over hpz ranks,
        # kept from forward to the step, on the device tier
        add(Item("device", f"hpZ secondary partition (1/{knobs.hpz} of the params)",
                 -(-N // knobs.hpz) * lp, "N/hpz*lp"))

    # ---------------------------------------------------------------- gradients
    # the engine's optimizer runs on the CPU whatever offload.optimizer says ("none" keeps
    # its states in host memory like "cpu"): gradients always leave the device
    if gpu and stage >= 2 and R > 1:  # reduced on the device: each rank copies its 1/R
        # as the engine reserves (infinity/zero/distributed.py device_grad_lines)
        from infinity.zero.partitioned_grads import MAX_INFLIGHT_REDUCTIONS as kr
        bucket = int(knobs.reduce_bucket_mb * 1e6)
        dev_b, pin_b, fd, fp = 0, 0, [], []
        if bucket > 0 and not knobs.qgz:
            # Note [Gradient buckets]: kr reducing or landing + MAX_OPEN_BUCKETS being
            # filled, in the working precision, each at most a shard of the largest group
            from infinity.zero.grad_buckets import MAX_OPEN_BUCKETS as ko, bucket_numel
            b = min(bucket_numel(bucket, lp), -(-Gf // R)) * lp
            dev_b, pin_b = (kr + ko) * b, r * kr * b
            fd.append(f"({kr}+{ko})*min(reduce_bucket_mb, {gname}/R*lp)")
            fp.append(f"r*{kr}*min(reduce_bucket_mb, {gname}/R*lp)")
        if gname == "Gf" or not dev_b:
            # whole groups (reduce_bucket_mb 0, qgZ) or a tiled group's tiles of rows (Gf):
            # full fp32 buffers of the groups being assembled and reduced (kr in flight,
            # + 3), the reduced shards, and their D2H staging
            dev_b += (kr + 3) * Gf * 4 + (2 * kr + 1) * -(-Gf // R) * 4
            pin_b += r * kr * -(-Gf // R) * 4
            fd.append(f"({kr}+3)*{gname}*4 + (2*{kr}+1)*{gname}/R*4")
            fp.append(f"r*{kr}*{gname}/R*4")
        add(Item("device", "grads of groups in backward", dev_b,
                 " + ".join(fd) + " (as the engine reserves)"))
        add(Item("pinned", "GPU->host grad staging", pin_b, " + ".join(fp)))
    elif gpu:
        # engine (GradD2H, the placement plan's "gradient D2H sources"): the group being
        # assembled and one open across backward, and the sources of the copies in flight
        add(Item("device", "grads of groups in backward", 4 * G * lp, "2*2*Gmax*lp"))
        add(Item("pinned", "GPU->host grad staging", r * 2 * G * lp, "r*2*Gmax*lp"))
    grad_item = Item("pageable", "grad accumulation (fp32, host)", r * shard * 4, "r*N/R*4")
    add(grad_item)
    if not gpu and stage >= 2 and R > 1:
        # engine (PartitionedGrads._lease_full, host pool on a CPU-only rank): a
        # group's full fp32 gradient assembled for its reduce-scatter, up to
        # MAX_INFLIGHT_REDUCTIONS in flight, one being assembled and a tied group open
        # across backward; tiled groups never (their rows are reduced tile by tile, so
        # the largest group reduced whole is at most Gf)
        k = ZERO_INFLIGHT_REDUCTIONS
        add(Item("pageable", f"gradients awaiting reduce-scatter (fp32, {k + 2} x {gname})",
                 r * (k + 2) * Gf * 4, f"r*{k + 2}*{gname}*4"))
    if R > 1 and machine.nodes == 1 and (not gpu or stage == 1):
        # engine (infinity.zero.shm_transport, intra_node_transport "auto"): every rank's
        # shared-memory slots for the host-tensor collectives between the node's ranks
        from infinity.zero.shm_transport import ShmTransport
        add(Item("pageable", "shared-memory slots (intra_node_transport)",
                 r * ShmTransport.plan_bytes(lp * G, 4 * G, R),
                 "r*2*(Gmax*lp/R + Gmax*4), each part <= 64 MB"))

    # ---------------------------------------------------------------- optimizer
    if master_is_param:
        states, f_states, what = shard * 2 * sb, f"N/R*2*{sb}", "m + v"
    else:
        states, f_states, what = shard * (4 + 2 * sb), f"N/R*(4+2*{sb})", "master + m + v"
    if optimizer_home in ("none", "cpu"):   # the CPU optimizer's states: host memory
        add(Item("pageable", f"optimizer: {what} (host)", r * states, "r*" + f_states))
    else:
        add(Item("nvme", f"optimizer: {what} (NVMe)", r * states, "r*" + f_states))
    # all-or-nothing updates (Note [commit point]): one shadow per NVMe state tensor an
    # update writes; fp32 with NVMe params: the param home is the master
    shadow = (states if optimizer_home == "nvme" else 0) + \
        (shard * 4 if master_is_param and params_home == "nvme" else 0)
    if shadow:
        add(Item("nvme", "commit shadows (all-or-nothing updates)", r * shadow,
                 "r*(NVMe optimizer states + fp32 NVMe master)"))
    # a swap space exists when anything lives on NVMe (activations too)
    swap = params_home == "nvme" or optimizer_home == "nvme" or knobs.activation_home == "nvme"
    # OptimizerStateStore ring: D slots of one tile each of master + grad (fp32, when a swap
    # space exists), m + v (NVMe home) and the low-precision params for an NVMe param home
    sink = lp if (not master_is_param and params_home == "nvme") else 0
    per_slot = (8 if swap else 0) + (2 * sb if optimizer_home == "nvme" else 0) + sink
    if per_slot:
        # a tile never spans two partitions (groups): pages of a slot beyond the largest group
        # are allocated but never touched, so resident bytes use min(T, Gmax)
        D = knobs.pipeline_depth
        # (a rank's tile covers at most its shard of the largest group: the engine sizes the
        # ring by the largest trainable shard)
        Gr = -(-(-(-G // R)) // 2048) * 2048
        T = min(knobs.tile_numel, Gr)
        if knobs.host_cap_gb:   # engine: the ring stays within ~15 % of offload.host_memory_gb
            T = min(max(65536, min(T, int(knobs.host_cap_gb * GB * 0.15) // 48)), Gr)
        add(Item("pinned", "optimizer tile ring", r * D * T * per_slot,
                 f"r*D*min(T,Gmax/R)*{per_slot}  [D={D}, T={knobs.tile_numel}]"))

    # ---------------------------------------------------------------- NVMe grads (engine rule)
    spill, why = grad_spill_decision(pl, machine, knobs, shard)
    if spill:
        pl.items.remove(grad_item)
        # lossless (engine: PlacementPlan.grad_host_gids): the accumulators that fit in
        # what the host cap leaves stay in host memory (one process, cap set)
        keep = 0
        # engine (infinity/engine/build.py placement.stream_grads): fp32/bf16, one
        # process or ZeRO stage 3 across ranks (the reduce-scattered shard), on any
        # device (a separate one: once the D2H landed): groups are updated as their
        # final gradient arrives, up to STREAM_GRAD_WINDOW of them in hand (what the cap
        # leaves), so the final sums never go to NVMe (Note [Streamed gradients])
        streams = knobs.precision != "fp16" and (machine.ranks == 1 or stage == 3)
        window = STREAM_GRAD_WINDOW if streams else 0
        Gs = G if machine.ranks == 1 else -(-G // R)     # one final sum (shard) in hand
        if machine.ranks > 1 and knobs.host_cap_gb is not None and Gs:
            # engine (infinity/zero/distributed.py stream_window): what this rank's cap
            # leaves above its placement plan, which does not count the full-size
            # buffers awaiting their reduce-scatter on a zero-copy tier
            unplanned = sum(i.nbytes for i in pl.items
                            if i.name.startswith("gradients awaiting reduce-scatter"))
            spare = int(knobs.host_cap_gb * GB) - (
                pl.tier_total("pinned") + pl.tier_total("pageable") - grad_item.nbytes
                - unplanned) // r
            window = max(0, min(window, spare // (Gs * 4)))
        if machine.ranks == 1 and knobs.host_cap_gb is not None:
            stage_b = 2 * G * 4 + (G * 2 if knobs.grad_accum_dtype == "bf16"
                                   and knobs.grad_accum > 1 else 0)
            spare = int(knobs.host_cap_gb * GB) - pl.tier_total("pinned") \
                - pl.tier_total("pageable") - stage_b
            window = max(0, min(window, spare // (G * 4))) if G else 0
            spare -= window * G * 4
            if window and knobs.grad_accum == 1:
                spare = 0      # streamed, one micro-step: no round trip to save
            keep = max(0, min(grad_item.nbytes, spare // 4096 * 4096))
        if window:
            add(Item("pageable", "gradients in hand for their early step (grads on NVMe)",
                     (r if R > 1 else 1) * window * Gs * 4,
                     f"r*{window}*Gmax/R*4" if R > 1 else f"{window}*Gmax*4"))
        pl.grads_streamed = bool(window)
        pl.grad_host_bytes = keep
        if keep:
            add(Item("pageable", "grad accumulation (fp32, host: what fits the cap)", keep,
                     "min(r*N/R*4, cap - other host items)"))
        add(Item("nvme", "grad accumulation (fp32, NVMe)", grad_item.nbytes - keep,
                 grad_item.formula + (" - host part" if keep else "")))
        if knobs.grad_accum_dtype == "bf16" and knobs.grad_accum > 1:
            add(Item("nvme", "bf16 partial gradient sums", (grad_item.nbytes - keep) // 2,
                     "(NVMe grads)/2"))
        if stage >= 2 and R > 1:   # a rank stages its reduce-scattered 1/R of a group
            add(Item("pageable", "grad staging (grads on NVMe)", r * 2 * -(-G // R) * 4,
                     "r*2*Gmax/R*4"))
        elif keep >= G * 4:
            # staging serves only NVMe-homed groups; the largest (an embedding, first
            # in module order) keeps its accumulator in host memory: the rest are the
            # other groups, of the average size of those
            n_groups = max(1, int(spec.groups.get(knobs.grouping, 1)) - 1)
            Grest = min(G, -(-(N - G) // n_groups))
            add(Item("pageable", "grad staging (grads on NVMe)", 2 * Grest * 4,
                     "2*Grest*4 (Grest: average group but the largest, kept in host)"))
        else:
            add(Item("pageable", "grad staging (grads on NVMe)", r * 2 * G * 4, "r*2*Gmax*4"))
        pl.grads_on_nvme = True
    if why:
        pl.notes.append(why)

    undo_items(pl, machine, knobs, shard, states, params_home, optimizer_home)
    if params_home == "nvme" and gname == "Gf" and spec.layers:
        # Note [Recompute keeps its tiles] (infinity/runtime/tiling.py): a checkpointed
        # tiled layer's recompute keeps the (whole, gathered) tiles it read for its backward:
        # one layer's tiled weights per rank at once
        tiled = sum(int(n) * int(c) for n, _, c in spec.tiled_groups(
            knobs.grouping, int(knobs.tiling_max_group_gb * GB) // lp))
        if tiled:
            add(Item("pageable", "tiles kept from the recompute for the backward",
                     r * -(-tiled // spec.layers) * lp, "r*(tiled params / L)*lp"))
            pl.tiles_kept = True
    act_model = knobs.activation_model or ("eager" if machine.cpu_only else "megatron")
    pl.activations = activation_items(spec, knobs, act_model)
    offload_activations(pl, spec, machine, knobs, act_model)
    if shadow:
        size_shadows(pl, machine, knobs, r * shadow, r * -(-shadow * G // max(1, shard)) // max(1, R))
    return pl


SHADOW_ITEM = "commit shadows (all-or-nothing updates)"


def size_shadows(pl, machine, knobs, full: int, ring: int) -> None:
    """Note [shadow budget] (infinity/memory/shadow_budget.py, as the engine sizes it):
    ``offload.commit_shadow_gb`` per rank, or automatic -- every shadow where the NVMe
    has room beside everything else and the free-space headroom, else what is left (at
    least the largest group's: ``ring``).  Groups beyond the budget are written after the
    commit decision; the step-time model does not credit the optimizer's overlap with
    backward, so it prices no loss for them (docs/estimator.md)."""
    from infinity.memory.shadow_budget import nvme_headroom, shadow_budget
    item = next((it for it in pl.items if it.name == SHADOW_ITEM), None)
    if item is None:
        return
    r = machine.ranks_per_node
    others = pl.tier_total("nvme") - item.nbytes
    have = int(machine.nvme_gb * GB) if machine.nvme_gb else None
    free = None if have is None else (have, nvme_headroom(have))
    per_rank = shadow_budget(knobs.commit_shadow_gb, -(-full // r), -(-ring // r),
                             -(-others // r), free, r)
    if per_rank is not None:
        item.nbytes = r * per_rank
        item.formula = ("r*commit_shadow_gb" if knobs.commit_shadow_gb is not None else
                        "NVMe left beside the rest and the headroom (automatic)") + \
            " (< one shadow per state tensor: groups beyond it are finished after the decision)"


def undo_items(pl, machine, knobs, shard, states, params_home, optimizer_home):
    """Note [commit point]: an update is all-or-nothing; optimizer states updated in place
    in host memory before the commit decision get an undo copy each until the window
    commits: the steps overlapped with backward (one process or ZeRO stage 3, fp32 or
    bf16) and groups with NVMe states beside host ones; groups of host states only are
    finished after the decision without copies (Note [finish only]).  Within what the host
    cap leaves (the overlapped step steps early only as far as they fit)."""
    host_states = (states if optimizer_home in ("none", "cpu") else 0) + \
        (shard * 4 if pl.master_is_param and params_home != "nvme" else 0)
    if not host_states:
        return
    # (clipping: speculative; gradients on NVMe: streamed -- Note [Speculative clipping],
    # Note [Streamed gradients])
    # (engine: infinity.engine.overlap.eligible, on any device tier)
    overlap = knobs.precision in ("fp32", "bf16") and (machine.ranks == 1 or knobs.zero_stage == 3)
    # without the overlap only a group with NVMe states beside host ones is stepped before
    # the decision; groups of host states only are finished after it, in place (Note
    # [finish only])
    if not (overlap or optimizer_home == "nvme"):
        return
    cap = int(knobs.host_cap_gb * GB) if knobs.host_cap_gb is not None else \
        int(machine.host_mem_gb * GB) - host_reserve_bytes(machine) if machine.host_mem_gb \
        else None
    undo = machine.ranks_per_node * host_states
    if cap is not None:
        left = max(0, cap - pl.tier_total("pinned") - pl.tier_total("pageable"))
        undo = min(undo, left) if overlap else (undo if undo <= left else 0)
    if undo:
        pl.items.append(Item("pageable", "commit undo copies (host states, per update)", undo,
                             "r*(host states updated in place), within the cap's room"))


def _host_cap(machine, knobs):
    caps = [c for c in (knobs.host_cap_gb, machine.host_mem_gb) if c]
    return int(min(caps) * GB) if caps else None


def grad_spill_decision(pl, machine, knobs, shard):
    """``(on_nvme, note)``: where the engine homes the fp32 gradients for this plan.

    ``pl`` holds every item except activations, with the gradients still in host memory.
    The engine has two rules (``knobs.grad_spill == "auto"``):

    * one process (``infinity/engine/build.py``): after computing its placement plan with the
      gradients in host memory, if ``offload.host_memory_gb`` is set, the plan's host
      total exceeds it and an NVMe swap space exists (params or optimizer on NVMe), the
      gradients get an NVMe home (``infinity/grads/nvme_store.py``). The host total is
      the estimator's pinned + pageable (the device tier is checked on its own). Without
      ``offload.host_memory_gb`` the engine does not page them, it refuses to start when
      the host is short: the estimator assumes the cap is set to the RAM left after the
      reserve (``r`` = 1).
    * ZeRO across ranks (``infinity/zero/distributed.py`` ``grad_spill_needed``): with the
      optimizer on NVMe and stage >= 2, a rank pages its fp32 gradient shard when
      ``N/R*4`` exceeds half its host budget (``offload.host_memory_gb``, else available
      RAM / ``LOCAL_WORLD_SIZE``; the estimator takes the node's RAM after the reserve divided by ``r``).

    ``"on"``: on NVMe whenever a swap space exists; ``"off"``: always in host memory.
    """
    mode = knobs.grad_spill
    swap = pl.params_home == "nvme" or pl.optimizer_home == "nvme" or \
        knobs.activation_home == "nvme"
    if mode == "off" or not swap:
        return False, ""
    if mode == "on":
        return True, "grad_spill on: fp32 gradients homed on NVMe (forced)"
    r = machine.ranks_per_node
    set_cap = knobs.host_cap_gb is not None
    if machine.ranks == 1:
        cap = int(knobs.host_cap_gb * GB) if set_cap else \
            int(machine.host_mem_gb * GB) - host_reserve_bytes(machine)
        host = pl.tier_total("pinned") + pl.tier_total("pageable")
        if host <= cap:
            return False, ""
        how = "" if set_cap else f" (set offload.host_memory_gb to {cap / GB:.4g}: without it the engine does not page gradients and refuses to start)"
        return True, (f"engine: host tier with fp32 grads {host / GB:.4g} GB > host cap "
                      f"{cap / GB:.4g} GB, so the fp32 gradients live on NVMe{how}")
    if pl.optimizer_home != "nvme" or knobs.zero_stage < 2:
        return False, ""
    cap = int(knobs.host_cap_gb * GB) if set_cap else \
        (int(machine.host_mem_gb * GB) - host_reserve_bytes(machine)) // r
    if shard * 4 <= cap // 2:
        return False, ""
    how = "" if set_cap else (" (without offload.host_memory_gb each rank's budget is the node's "
                              "available RAM / LOCAL_WORLD_SIZE, as here)")
    return True, (f"ZeRO: fp32 grad shard N/R*4 = {shard * 4 / GB:.4g} GB > half the per-rank host "
                  f"budget {cap / GB:.4g} GB, so each rank's gradient shard lives on NVMe{how}")
