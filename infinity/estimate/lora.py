"""LoRA over a frozen base the engine may keep quantized (``infinity estimate --lora-rank R
[--frozen-dtype nf4]``): what is trained, what the frozen base costs at its home, on the
device and per step, and the FLOPs MFU counts.

The model (docs/estimator.md, "LoRA over a quantized base"):

* **adapters** on every attention and MLP projection of each layer (the ``nn.Linear`` /
  GPT-2 ``Conv1D`` inside the repeated blocks; the LM head and embeddings are not
  adapted): ``R*(in + out)`` parameters per projection, in two groups (``lora_A``
  ``R x in``, ``lora_B`` ``out x R``).  By dimensions the block is GPT-shaped as
  :func:`~.model_spec.spec_from_dims` has it: a fused QKV ``H -> 3H``, the attention output
  ``H -> H``, the MLP ``H -> 4H -> H``: ``16*R*H`` per layer.  Counted from a module, the
  shapes are the module's (Llama's q/k/v/o with GQA, gate/up/down: whatever it holds).
  Only the adapters train: gradients, fp32 masters and Adam moments are the adapters'
  (the estimator's full-fine-tuning lines, with ``N`` = adapter parameters).
* **the frozen base** (the spec's ``params``) is never written back nor stepped.  At its
  home (``offload.params``: the device, host memory or NVMe -- the adapters share the
  home, the engine has one) it takes :func:`frozen_home_bytes`: the quantizable weights
  (``nn.Linear`` / ``Conv1D`` / ``nn.Embedding``) in the payload layout of
  ``infinity/memory/frozen_quant.py`` (nf4 / int4 0.5 B per element, int8 1 B, an fp32
  scale per ``group_size`` block, or with ``double_quant`` a uint8 code per block + an fp32
  per 256 blocks) and the rest (biases, norms) in the working precision.  Each use
  fetches a group (ZeRO stage 3 across ranks: each rank homes a byte shard of the payload
  and the all-gather moves the quantized bytes, Note [Quantized shards]) and dequantizes it
  into a working-precision compute buffer on the device.
* per micro-batch the base is read twice, forward and backward; with activation
  checkpointing the recompute's fetch serves the backward that follows, so the recompute
  reads nothing more.  The engine releases a frozen group fetched by a recompute once the
  module's backward ran (Note [Recomputed frozen groups], ``infinity/runtime/hooks.py``):
  the fetch window covers it, checkpointing adds no frozen-base line.
* the dequantize: ``2*Nq`` elements per micro-batch per rank (every rank dequantizes
  every gathered group it uses), at :func:`dequant_rate` -- on a GPU the engine runs the
  torch reference path (:data:`GPU_DEQUANT_HBM_BYTES` of device-memory traffic per
  element at :data:`GPU_HBM_GBPS`, and :data:`GPU_DEQUANT_SCRATCH_BYTES` of temporaries per
  element of a pass: the largest weight's elements, at most
  ``infinity.quant.weight.TORCH_PATH_CHUNK``), on a CPU the C++ kernel
  (:data:`CPU_DEQUANT_GBPS`, measured).  It adds to the compute of a micro-batch (the same
  stream / cores).
* model FLOPs per token ``4*Nf + 6*Na + 12*L*H*S`` (../shared/DESIGN.md §3.5); the
  hardware FLOPs with checkpointing add the recomputed forward: ``6*Nf + 8*Na + 16*L*H*S``.

Not modelled for LoRA (refused by :func:`check_knobs`): memory-centric tiling, ZeRO++,
the "block" grouping (a block group holding adapters is trainable: the engine would not
quantize it).  Nor the parameter cache and the reuse of released groups (the estimate
reads the base twice per micro-batch whatever the host or device memory left).
"""
from __future__ import annotations

import dataclasses

from infinity.quant.weight import TORCH_PATH_CHUNK

from infinity.config_sections import FROZEN_WEIGHT_DTYPES as FROZEN_DTYPES

from .machine import GB
from .model_spec import EstimateError

#: what ``--frozen-dtype`` accepts: a quantized format, or the working precision's name
#: (= no quantization)
FROZEN_CHOICES = ("bf16", "fp16", "fp32") + FROZEN_DTYPES
#: double quantization: block scales coded in runs of this many (infinity.quant.nf4.DQ_BLOCK)
DQ_BLOCK = 256
#: the payload layout (infinity/memory/frozen_quant.py): each stored tensor starts at a
#: multiple of 64 bytes, a group's payload is padded to a multiple of 4096
TENSOR_ALIGN = 64
PAYLOAD_ALIGN = 4096

#: GPU dequantize (the engine's CUDA path is the torch reference of infinity.quant, not a
#: fused kernel): bytes of device-memory traffic per element, counted from the ops
#: (nf4: nibble unpack, int64 codes, code-book gather, fp32 scale, cast, copy into the
#: compute buffer; int8: float, scale, cast-copy; int4: int64 word unpack, shift, mask,
#: recentre, int8, then as int8) ...
GPU_DEQUANT_HBM_BYTES = {"nf4": 43, "int8": 19, "int4": 73}
#: ... at this achieved device-memory bandwidth (GB/s; ~75 % of an H100 SXM's 3.35 TB/s)
GPU_HBM_GBPS = 2500.0
#: ... and the temporaries the reference path holds at its peak, bytes per element of one
#: pass (nf4: int64 codes 8 + fp32 values 4 + scaled 4 + cast 2); a pass is the weight, or
#: :data:`~infinity.quant.weight.TORCH_PATH_CHUNK` elements of a larger one
GPU_DEQUANT_SCRATCH_BYTES = {"nf4": 18, "int8": 8, "int4": 18}
#: CPU dequantize (the C++ kernel infinity._quant; double quantization decodes the scales
#: with torch first), GB/s of working-precision output per node, measured on the 2-core
#: reference machine (16 Mi elements, group 64): fp32 / bf16 output
CPU_DEQUANT_GBPS = {("nf4", False): (3.50, 0.97), ("nf4", True): (1.36, 0.42),
                    ("int8", False): (6.85, 2.25), ("int8", True): (1.68, 0.52),
                    ("int4", False): (5.95, 1.89), ("int4", True): (1.39, 0.48)}

__all__ = ["FROZEN_DTYPES", "FROZEN_CHOICES", "tensor_nbytes", "payload_nbytes",
           "bytes_per_frozen_param", "projections", "adapter_params", "largest_adapter_group",
           "adapter_groups", "quantizable_params", "frozen_home_bytes", "largest_payload",
           "adapter_spec", "check_knobs", "normalize_frozen_dtype", "dequant_scratch_bytes",
           "param_items", "frozen_traffic", "dequant_rate",
           "dequant_seconds", "lora_flops", "summary", "describe"]


# ---------------------------------------------------------------------------- bytes

def tensor_nbytes(n: int, dtype: str, group_size: int = 64, double_quant: bool = False) -> int:
    """Bytes ``infinity.quant.quantize_weight`` stores for ``n`` elements (its
    ``QuantizedWeight.nbytes``): the payload (nf4 ``ceil(n/2)`` bytes, int8 ``n``, int4
    ``ceil(n/8)`` int32 words) and the block scales (fp32 per block, or with double
    quantization a uint8 code per block + an fp32 per 256 blocks + an fp32 offset)."""
    if dtype not in FROZEN_DTYPES:
        raise EstimateError(f"frozen dtype must be one of {FROZEN_DTYPES}, got {dtype!r}")
    nblocks = -(-n // group_size)
    data = {"nf4": (n + 1) // 2, "int8": n, "int4": 4 * -(-n // 8)}[dtype]
    if not double_quant:
        return data + 4 * nblocks
    return data + nblocks + 4 * -(-nblocks // DQ_BLOCK) + 4


def _sizes(n, dtype, group_size, double_quant):
    nblocks = -(-n // group_size)
    data = {"nf4": (n + 1) // 2, "int8": n, "int4": 4 * -(-n // 8)}[dtype]
    if not double_quant:
        return [data, 4 * nblocks]
    return [data, nblocks, 4 * -(-nblocks // DQ_BLOCK), 4]


def payload_nbytes(slots, dtype: str, group_size: int, double_quant: bool, lp: int) -> int:
    """Bytes of one quantized group's payload at its home (``QuantLayout.nbytes`` of
    ``layout_for``): ``slots`` = ``[(numel, quantized)]`` in the group's order; each stored
    tensor 64-byte aligned, a slot not quantized (a bias, a norm) in the working precision
    (``lp`` bytes), the whole padded to 4096."""
    end = 0
    for numel, quantized in slots:
        for nb in (_sizes(numel, dtype, group_size, double_quant) if quantized
                   else [numel * lp]):
            end = -(-end // TENSOR_ALIGN) * TENSOR_ALIGN + nb
    return -(-max(end, 1) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def bytes_per_frozen_param(dtype: str | None, group_size: int = 64, double_quant: bool = False,
                           lp: int = 2) -> float:
    """Bytes per quantizable frozen element at its home, scales included, for large
    tensors (nf4 at group 64: 0.5 + 4/64 = 0.5625); ``dtype`` None: ``lp``."""
    if dtype is None:
        return float(lp)
    data = {"nf4": 0.5, "int8": 1.0, "int4": 0.5}[dtype]
    if not double_quant:
        return data + 4 / group_size
    return data + 1 / group_size + 4 / (group_size * DQ_BLOCK)


# ---------------------------------------------------------------------------- shapes

def projections(spec) -> list:
    """``[in, out, count]`` of the projections LoRA adapts: the spec's own (counted from a
    module), else a GPT block's by dimensions (QKV ``H -> 3H``, output ``H -> H``, MLP
    ``H -> 4H`` and ``4H -> H``, one each per layer)."""
    if spec.projections or spec.quantizable is not None:    # counted from a module
        return [list(p) for p in spec.projections]
    H, L = spec.hidden, spec.layers
    return [[H, 3 * H, L], [H, H, L], [H, 4 * H, L], [4 * H, H, L]]


def adapter_params(spec, rank: int) -> int:
    """``R * sum(in + out)`` over the adapted projections."""
    return sum(rank * (int(i) + int(o)) * int(c) for i, o, c in projections(spec))


def largest_adapter_group(spec, rank: int) -> int:
    """The largest adapter group: ``lora_A`` (``R x in``) or ``lora_B`` (``out x R``)."""
    return max((rank * max(int(i), int(o)) for i, o, _ in projections(spec)), default=rank)


def adapter_groups(spec) -> int:
    return 2 * sum(int(c) for _, _, c in projections(spec))


def quantizable_params(spec) -> int:
    """Elements of the frozen weights the engine quantizes (``nn.Linear`` / ``Conv1D`` /
    ``nn.Embedding`` weights): counted from a module, else by dimensions everything but a
    GPT block's biases and norms (``13*H`` per layer) and the final norm (``2*H``)."""
    if spec.quantizable is not None:
        return int(spec.quantizable)
    return max(0, spec.params - (13 * spec.layers + 2) * spec.hidden)


def frozen_home_bytes(spec, knobs) -> int:
    """Bytes of the whole frozen base at its home: the quantizable weights in the payload
    layout (:func:`bytes_per_frozen_param`, per-tensor rounding and the < 4 KiB padding
    per group not counted), the rest in the working precision; unquantized: ``N*lp``."""
    lp, n = knobs.lp, spec.params
    if knobs.frozen_dtype is None:
        return n * lp
    q = quantizable_params(spec)
    per = bytes_per_frozen_param(knobs.frozen_dtype, knobs.frozen_group_size,
                                 knobs.frozen_double_quant)
    return int(q * per) + (n - q) * lp


def largest_payload(spec, knobs) -> int:
    """Bytes of the largest frozen group at its home (quantized: its weight's payload)."""
    G = spec.group_numel(knobs.grouping)
    if knobs.frozen_dtype is None:
        return G * knobs.lp
    return tensor_nbytes(G, knobs.frozen_dtype, knobs.frozen_group_size,
                         knobs.frozen_double_quant)


def adapter_spec(spec, knobs):
    """The trainable part as a model of its own: ``N`` = the adapters, groups = theirs
    (what the gradient and optimizer lines of the full-fine-tuning model then count)."""
    Na = adapter_params(spec, knobs.lora_rank)
    if not Na:
        raise EstimateError("LoRA: the model has no nn.Linear / Conv1D projection inside "
                            "repeated blocks to adapt")
    Ga = largest_adapter_group(spec, knobs.lora_rank)
    return dataclasses.replace(spec, params=Na, largest_group={"module": Ga, "block": Ga},
                               groups={"module": adapter_groups(spec), "block": spec.layers},
                               tileable=[], largest_untileable=Ga, projections=[],
                               quantizable=0, source="LoRA adapters")


# ---------------------------------------------------------------------------- knobs

def check_knobs(k, frozen_given: bool = False) -> None:
    """Refuse LoRA settings the estimator cannot model (and bad values); ``frozen_given``:
    a frozen-base setting was passed explicitly (it means nothing without a LoRA rank)."""
    if k.lora_rank is None:
        if frozen_given:
            raise EstimateError("--frozen-dtype / --frozen-group-size / --double-quant describe "
                                "the frozen base of a LoRA run: add --lora-rank R (without it "
                                "every parameter trains and nothing is frozen)")
        return
    if isinstance(k.lora_rank, bool) or not isinstance(k.lora_rank, int) or k.lora_rank < 1:
        raise EstimateError(f"lora_rank must be an integer >= 1, got {k.lora_rank!r}")
    if k.frozen_dtype is not None and k.frozen_dtype not in FROZEN_DTYPES:
        raise EstimateError(f"frozen_dtype must be one of {FROZEN_CHOICES}, got "
                            f"{k.frozen_dtype!r}")
    g = k.frozen_group_size
    if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= 65536:
        raise EstimateError(f"frozen_group_size must be an integer in [1, 65536], got {g!r}")
    if k.frozen_dtype == "nf4" and g % 2:
        raise EstimateError(f"frozen_group_size: nf4 stores two codes per byte, so the block "
                            f"size must be even, got {g}")
    if not isinstance(k.frozen_double_quant, bool):
        raise EstimateError(f"double_quant must be true or false, got {k.frozen_double_quant!r}")
    if k.tiling_max_group_gb is not None:
        raise EstimateError("memory-centric tiling (tiling.max_group_gb) with LoRA is not "
                            "modelled by the estimator: drop --tiling-max-group-gb")
    if k.qwz or k.hpz > 1 or k.qgz:
        raise EstimateError("ZeRO++ (zero_pp) with LoRA is not modelled by the estimator (the "
                            "engine does not apply qwZ/hpZ to a quantized base either)")
    if k.grouping != "module":
        raise EstimateError("LoRA needs the module grouping: a block group holding adapters "
                            "is trainable, so the engine would not quantize its frozen weights")


def normalize_frozen_dtype(value, precision):
    """``--frozen-dtype``: a quantized format, or the working precision's name (None)."""
    if value is None or value in FROZEN_DTYPES:
        return value
    if value in ("bf16", "fp16", "fp32"):
        if value != precision:
            raise EstimateError(
                f"--frozen-dtype {value}: the engine keeps a frozen base in the working "
                f"precision ({precision}) or quantized (nf4, int8, int4), not in {value}")
        return None
    raise EstimateError(f"frozen_dtype must be one of {FROZEN_CHOICES}, got {value!r}")


# ---------------------------------------------------------------------------- memory

def dequant_scratch_bytes(numel: int, knobs) -> int:
    """Bytes of temporaries the torch path (CUDA) holds dequantizing a weight of ``numel``
    elements: :data:`GPU_DEQUANT_SCRATCH_BYTES` per element of its largest pass
    (``min(numel, TORCH_PATH_CHUNK)``: ``QuantizedWeight.dequantize`` runs a larger weight
    in passes of at most that many)."""
    return GPU_DEQUANT_SCRATCH_BYTES[knobs.frozen_dtype] * min(int(numel), TORCH_PATH_CHUNK)


def frozen_in_window(d: int) -> int:
    """Frozen groups at most in a fetch window of ``d + 2`` groups (in use, ``d`` prefetched,
    one being released): each adapted projection's adapter groups are used right after its
    frozen weight, forward and backward alike, so at most every other group of the window
    is a frozen one (the estimator adapts every projection of the blocks)."""
    return -(-(d + 2) // 2)


def param_items(spec, machine, knobs, params_home) -> list:
    """``[(tier, name, bytes, formula)]`` of the frozen base and the adapters at their home,
    the fetch window, the quantized payloads in flight and the dequantize scratch (device
    lines per GPU, host and NVMe per node)."""
    R, r = machine.ranks, machine.ranks_per_node
    lp, d = knobs.lp, knobs.prefetch_depth
    gpu = not machine.cpu_only
    quant = knobs.frozen_dtype is not None
    win = d + 2
    fw = frozen_in_window(d)
    Ga = largest_adapter_group(spec, knobs.lora_rank)
    G = spec.group_numel(knobs.grouping)
    Gq = largest_payload(spec, knobs)
    base = frozen_home_bytes(spec, knobs)
    Na = adapter_params(spec, knobs.lora_rank)
    qb = "qb" if quant else "lp"
    sharded = knobs.zero_stage == 3 and R > 1
    out = []
    add = out.append
    if params_home == "none":
        if sharded:
            add(("device", "frozen base shard" + (" (quantized)" if quant else ""),
                 -(-base // R), f"Nf/R*{qb}"))
            add(("device", "adapter shard", -(-Na // R) * lp, "Na/R*lp"))
            add(("device", "gathered groups (all-gather window)", win * G * lp, "(d+2)*Gmax*lp"))
        else:
            rep = " (replicated: stage < 3)" if R > 1 else ""
            add(("device", "frozen base" + (" (quantized payload)" if quant else "") + rep,
                 base, f"Nf*{qb}"))
            add(("device", "adapters" + rep, Na * lp, "Na*lp"))
            if quant:   # every use dequantizes the payload into a compute buffer
                add(("device", "dequantized fetch window", win * G * lp, "(d+2)*Gmax*lp"))
    else:
        if gpu:
            add(("device", "fetched groups (in use + prefetch)", win * G * lp, "(d+2)*Gmax*lp"))
        elif params_home == "nvme" or quant:
            # CPU-only: an unquantized host home is used in place; a quantized one is
            # dequantized into device-tier (host) buffers, an NVMe one read into them.  What
            # the window holds at once (host memory, measured: the 26B run): frozen groups
            # and adapter groups alternate (the GPU lines keep the engine's device budget,
            # which is sized for the whole window)
            nvme = params_home == "nvme"     # (a host home's adapters are used in place)
            add(("device", "fetched groups (in use + prefetch)",
                 fw * G * lp + ((win - fw) * Ga * lp if nvme else 0),
                 "ceil((d+2)/2)*Gmax*lp" + (" + (d+2-ceil((d+2)/2))*Ga*lp" if nvme else "")
                 + "  [frozen and adapter groups alternate]"))
        home = "pinned" if params_home == "cpu" else "nvme"
        where = "host" if params_home == "cpu" else "NVMe"
        add((home, f"frozen base home ({where}" + (", quantized)" if quant else ")"),
             r * -(-base // R), f"r*Nf/R*{qb}"))
        add((home, f"adapters home ({where})", r * -(-Na // R) * lp, "r*Na/R*lp"))
        if params_home == "nvme":
            if gpu:
                add(("pinned", "NVMe->GPU staging (prefetch window)", r * win * -(-Gq // R),
                     f"r*(d+2)*Gmax/R*{qb}"))
            else:
                add(("pinned", "NVMe staging (initialisation only)", G * lp, "Gmax*lp"))
                if quant:
                    add(("pinned", "quantized payload reads", r * fw * Gq,
                         "r*ceil((d+2)/2)*Gmax*qb"))
    if quant and gpu and (params_home != "none" or sharded):
        # the payload leased on the device per fetch (gathered: the whole payload) until
        # it is dequantized: the prefetched ones and the one being dequantized
        add(("device", "quantized payloads in flight", (d + 1) * Gq, "(d+1)*Gmax*qb"))
    if quant and gpu:
        s = GPU_DEQUANT_SCRATCH_BYTES[knobs.frozen_dtype]
        add(("device", "dequantize scratch (torch path on CUDA)", dequant_scratch_bytes(G, knobs),
             f"{s}*min(Gmax, {TORCH_PATH_CHUNK:,})  [{knobs.frozen_dtype} reference path's "
             f"temporaries, one pass]"))
    return out


# ---------------------------------------------------------------------------- traffic

def frozen_traffic(spec, machine, knobs, params_home) -> dict:
    """``{link: [(what, bytes)]}`` of the frozen base per micro-batch (NVMe per node, the
    others per GPU): read forward and backward from its home (no write-back), each rank its
    shard; at ZeRO stage 3 across ranks the quantized bytes all-gathered."""
    R, r = machine.ranks, machine.ranks_per_node
    base = frozen_home_bytes(spec, knobs)
    shard = -(-base // R)
    qb = "qb" if knobs.frozen_dtype is not None else "lp"
    out = {"nvme_read": [], "h2d": [], "allgather": [], "inter_node": []}
    if params_home == "nvme":
        out["nvme_read"].append((f"frozen base fwd+bwd 2*Nf*{qb}", 2 * r * shard))
    if not machine.cpu_only and params_home != "none":
        out["h2d"].append((f"frozen base shards fwd+bwd 2*Nf/R*{qb}", 2 * shard))
    if R > 1 and knobs.zero_stage == 3:
        out["allgather"].append((f"frozen base fwd+bwd 2*Nf*{qb}*(R-1)/R",
                                 int(2 * base * (R - 1) / R)))
        out["inter_node"].append(("frozen base to other nodes", int(2 * base * (R - r) / R)))
    return out


def dequant_rate(machine, knobs) -> float:
    """GB/s of working-precision output one rank dequantizes: ``machine.dequant_gbps`` when
    given, else on a GPU :data:`GPU_HBM_GBPS` / :data:`GPU_DEQUANT_HBM_BYTES` x lp, on a
    CPU-only node :data:`CPU_DEQUANT_GBPS` (measured)."""
    if machine.dequant_gbps:
        return float(machine.dequant_gbps)
    dt = knobs.frozen_dtype
    if not machine.cpu_only:
        return GPU_HBM_GBPS / GPU_DEQUANT_HBM_BYTES[dt] * knobs.lp
    fp32, low = CPU_DEQUANT_GBPS[(dt, bool(knobs.frozen_double_quant))]
    return fp32 if knobs.precision == "fp32" else low


def dequant_seconds(spec, machine, knobs, lines=None) -> float:
    """Seconds one rank spends dequantizing per micro-batch: ``2*Nq*lp`` bytes of output
    (forward and backward fetch every quantized weight) over :func:`dequant_rate`."""
    if knobs.frozen_dtype is None:
        return 0.0
    out = 2 * quantizable_params(spec) * knobs.lp
    rate = dequant_rate(machine, knobs)
    t = out / (rate * GB)
    if lines is not None:
        src = "" if machine.dequant_gbps else (
            f" [torch path on CUDA: {GPU_HBM_GBPS:g} GB/s / {GPU_DEQUANT_HBM_BYTES[knobs.frozen_dtype]}"
            f" B per element]" if not machine.cpu_only else " [CPU kernel, measured]")
        amount = f"{out / 1e12:.2f} TB" if out >= 1e12 else f"{out / GB:.4g} GB"
        lines.append(f"dequantize: 2*Nq*lp = {amount} / {rate:.4g} GB/s{src} = "
                     f"{t:.4g} s (on the compute stream: added to compute)")
    return t


# ---------------------------------------------------------------------------- FLOPs

def lora_flops(spec, knobs, attention: int, *, checkpointing=False, hardware=False):
    """Model FLOPs per token ``4*Nf + 6*Na + attention`` (DESIGN §3.5); hardware FLOPs
    with checkpointing add the recomputed forward ``2*Nf + 2*Na + attention/3``."""
    Nf, Na = spec.params, adapter_params(spec, knobs.lora_rank)
    if hardware and checkpointing:
        return 6 * Nf + 8 * Na + attention * 4 // 3
    return 4 * Nf + 6 * Na + attention


# ---------------------------------------------------------------------------- summary

def summary(spec, machine, knobs, params_home=None) -> dict:
    """The LoRA figures ``--json`` reports."""
    base = frozen_home_bytes(spec, knobs)
    out = {"lora_rank": knobs.lora_rank,
           "frozen_dtype": knobs.frozen_dtype or knobs.precision,
           "frozen_group_size": knobs.frozen_group_size if knobs.frozen_dtype else None,
           "frozen_double_quant": bool(knobs.frozen_double_quant) if knobs.frozen_dtype else None,
           "frozen_params": spec.params, "frozen_quantized_params":
               quantizable_params(spec) if knobs.frozen_dtype else 0,
           "frozen_bytes": base, "frozen_bytes_per_param": base / spec.params,
           "adapter_params": adapter_params(spec, knobs.lora_rank),
           "trainable_params": adapter_params(spec, knobs.lora_rank),
           "dequant_gbps": dequant_rate(machine, knobs) if knobs.frozen_dtype else None}
    if params_home is not None:
        out["frozen_home"] = {"none": "device", "cpu": "host", "nvme": "nvme"}[params_home]
    return out


def describe(spec, knobs) -> str:
    """``"LoRA rank 64 (3.36B adapters) over an nf4 base (562.5 GB)"``."""
    na = adapter_params(spec, knobs.lora_rank)
    base = frozen_home_bytes(spec, knobs)
    fmt = f"{knobs.frozen_dtype}" + (f" g{knobs.frozen_group_size}"
                                      + (" dq" if knobs.frozen_double_quant else "")
                                      if knobs.frozen_dtype else "")
    return (f"LoRA rank {knobs.lora_rank} ({na / 1e9:.3g}B adapters) over a "
            f"{fmt if knobs.frozen_dtype else knobs.precision} base ({base / GB:,.1f} GB)")
