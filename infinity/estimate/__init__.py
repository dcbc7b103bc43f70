"""The memory and step-time estimator: ``infinity.estimate(...)`` and ``infinity estimate``.

    import infinity
    est = infinity.estimate(params=1_000_000_000_000, layers=128, hidden=25600, vocab=51200,
                            machine=dict(gpus=8, gpu_mem_gb=80, host_mem_gb=2000,
                                         nvme_gb=30720, nvme_drives=8, nvme_gbps=48),
                            config={"precision": "bf16"})
    print(est.text())          # per configuration: tiers, which fit, step time; the verdict
    print(est.text(details=True))   # + items, formulas and the step-time derivation
    est.best                   # fastest configuration that fits (or None)
    est.as_dict()              # JSON-ready

Formulas: :mod:`.memory_plan` (bytes per tier), :mod:`.step_time` (bytes per step and
time); docs/estimator.md explains them with sources.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

from .machine import GB, Machine, detect_free_disk_gb, detect_gpus, detect_host_mem_gb, fmt_seconds
from .memory_plan import (GRAD_SPILL_MODES, HOMES, HOST_RESERVE_BASE_GB,  # noqa: F401
                          HOST_RESERVE_PER_RANK_GB, SPILL_NOTE, TIER_NAMES, Knobs, MemoryPlan,
                          host_reserve_bytes, plan_memory, valid_configs)
from .model_spec import (GROUPINGS, EstimateError, ModelSpec, spec_from_dims, spec_from_factory,
                         spec_from_module)
from .report import fmt_num
from .step_time import StepEstimate, bound_text, estimate_step

__all__ = ["estimate", "Estimate", "ConfigEstimate", "ModelSpec", "Machine", "Knobs",
           "EstimateError", "spec_from_dims", "spec_from_module", "spec_from_factory"]

VARIANTS = ("checkpointing", "none")


@dataclass
class ConfigEstimate:
    params_home: str
    optimizer_home: str
    plan: MemoryPlan
    totals: dict            # tier -> bytes; device per variant
    fits: dict              # variant -> bool
    problems: dict          # variant -> [str]
    steps: dict             # variant -> StepEstimate

    @property
    def name(self):
        return f"params={self.params_home}, optimizer={self.optimizer_home}"

    def as_dict(self):
        return {"params": self.params_home, "optimizer": self.optimizer_home,
                "items": [i.as_dict() for i in self.plan.items],
                "activations": {k: v.as_dict() for k, v in self.plan.activations.items()},
                "activation_offload": {k: v.as_dict()
                                       for k, v in self.plan.activation_offload.items()},
                "notes": list(self.plan.notes), "grads_on_nvme": self.plan.grads_on_nvme,
                "totals_bytes": self.totals, "fits": self.fits, "problems": self.problems,
                "step": {k: v.as_dict() for k, v in self.steps.items()}}


@dataclass
class Estimate:
    model: ModelSpec
    machine: Machine
    knobs: Knobs
    configs: list = field(default_factory=list)
    what_if: "Estimate | None" = None   # the other gradient home, for comparison (see estimate())

    def fitting(self):
        """``[(ConfigEstimate, variant)]`` that fit, fastest first."""
        out = [(c, v) for c in self.configs for v in VARIANTS if c.fits[v]]
        order = {h: i for i, h in enumerate(HOMES)}
        out.sort(key=lambda cv: (cv[0].steps[cv[1]].step_s, order[cv[0].params_home] +
                                 order[cv[0].optimizer_home], cv[1] == "checkpointing"))
        return out

    def closest(self):
        """``(ConfigEstimate, variant)`` with the fewest problems (the most offloaded first on a
        tie: it needs the least fast memory), or None without configurations."""
        cands = [(len(c.problems[v]), -i, v == "none", c, v)
                 for i, c in enumerate(self.configs) for v in VARIANTS]
        if not cands:
            return None
        cands.sort(key=lambda t: t[:3])
        return cands[0][3], cands[0][4]

    @property
    def best(self):
        f = self.fitting()
        return f[0] if f else None

    def _where(self):
        m = self.machine
        return (f"{m.nodes}x" if m.nodes > 1 else "") + (
            f"{m.gpus}x{m.gpu_mem_gb:g} GB GPU" if m.gpus else "CPU-only") + \
            f", {m.host_mem_gb:g} GB RAM, {m.nvme_gb:g} GB NVMe"

    def _answer(self):
        b = self.best
        if b is None:
            out = f"No: no offload configuration fits {self._what()} on {self._where()}"
            near = self.closest()
            if near is None:
                return out + "."
            c, v = near
            ck = "with" if v == "checkpointing" else "without"
            return (out + f"; the closest, {c.name} {ck} activation checkpointing: "
                    + "; ".join(c.problems[v]) + " (--explain lists every configuration's "
                    "problems).")
        c, v = b
        s = c.steps[v]
        ck = "with activation checkpointing" if v == "checkpointing" else "without activation checkpointing"
        grads = "; fp32 gradients on NVMe" if c.plan.grads_on_nvme else ""
        return (f"Yes: {self._what()} fit on {self._where()} with {c.name} "
                f"({ck}{grads}); estimated {fmt_seconds(s.step_s)} s per step, {s.tokens_per_s:.3g} tokens/s, "
                f"{bound_text(s.bound)} (lower bound: perfect overlap).")

    def verdict(self):
        out = self._answer()
        w = self.what_if
        if w is not None:
            label = {"off": "keeping fp32 gradients in host memory",
                     "auto": "with the engine's own gradient placement",
                     "on": "with fp32 gradients always on NVMe"}[w.knobs.grad_spill]
            wb = w.best
            if wb is None:
                out += f" For comparison, {label} (grad_spill={w.knobs.grad_spill}) nothing fits."
            else:
                c, v = wb
                s = c.steps[v]
                out += (f" For comparison, {label} (grad_spill={w.knobs.grad_spill}) the best is "
                        f"{c.name}" + (" with activation checkpointing" if v == "checkpointing" else "")
                        + f": {fmt_seconds(s.step_s)} s per step.")
        return out

    def as_dict(self):
        b = self.best
        return {"model": self.model.as_dict(), "machine": self.machine.as_dict(),
                "knobs": self.knobs.as_dict(),
                "configs": [c.as_dict() for c in self.configs],
                "best": None if b is None else {"params": b[0].params_home, "optimizer": b[0].optimizer_home,
                                                "activation_checkpointing": b[1] == "checkpointing",
                                                "step_s": b[0].steps[b[1]].step_s},
                "verdict": self.verdict(),
                "lora": self.lora_summary(),
                "gpu_caveat": self.gpu_caveat(),
                "what_if": None if self.what_if is None else self.what_if.as_dict()}

    def lora_summary(self) -> dict | None:
        """LoRA (``knobs.lora_rank``): adapters, the frozen base's format and bytes at its
        home (:func:`.lora.summary`); the best configuration's home when one fits."""
        if self.knobs.lora_rank is None:
            return None
        from .lora import summary
        b = self.best
        return summary(self.model, self.machine, self.knobs, b[0].params_home if b else None)

    def _what(self):
        if self.knobs.lora_rank is None:
            return f"{fmt_num(self.model.params)} parameters"
        from .lora import describe
        return f"{fmt_num(self.model.params)} frozen parameters + {describe(self.model, self.knobs)}"

    def gpu_caveat(self) -> str | None:
        """One line while the GPU figures are not validated (``--gpus`` > 0)."""
        if not self.machine.gpus:
            return None
        return ("Note: on one GPU (an H200, docs/benchmarks.md \"On a GPU\") the step and "
                "device-peak predictions were off by up to 1.6x (over-predicted); several "
                "GPUs have not run infinity yet: treat GPU figures as unvalidated.")

    def text(self, details=False):
        from .report import format_estimate
        return format_estimate(self, details=details)


def _host_reserve(machine):
    return host_reserve_bytes(machine)


def evaluate_config(spec, machine, knobs, p, o):
    plan = plan_memory(spec, machine, knobs, p, o)
    # fp32 NVMe params under offload.host_memory_gb: released groups stay as clean host
    # copies up to the cap (step_time.param_cache_reads); they are resident host memory
    from .memory_plan import Item
    from .step_time import PARAM_CACHE_ITEM, param_cache_reads
    cache = max(param_cache_reads(spec, machine, knobs, plan)[:3])
    if cache:   # it gives up its room to gradient buffers as they are leased: within the cap
        # (the cap is per rank, the plan's host items per node: r ranks)
        room = machine.ranks_per_node * int(knobs.host_cap_gb * GB) \
            - plan.tier_total("pinned") - plan.tier_total("pageable")
        cache = max(0, min(cache, room))
    if cache:
        plan.items.append(Item("pageable", PARAM_CACHE_ITEM, cache,
                               "min(N*lp, cap - other host items)" if machine.ranks == 1 else
                               "r*min(N/R*lp, cap - a rank's other host items): own shards"))
    dev = plan.tier_total("device")
    pinned, pageable, nvme = plan.tier_total("pinned"), plan.tier_total("pageable"), plan.tier_total("nvme")
    r = machine.ranks_per_node
    totals = {"pinned": pinned, "pageable": pageable, "nvme": nvme,
              "host_reserve": _host_reserve(machine), "gpu_reserve": int(machine.gpu_reserve_gb * GB)}
    fits, problems, steps = {}, {}, {}
    for v in VARIANTS:
        act = plan.activations[v].nbytes
        d = dev + act
        totals[f"device_{v}"] = d
        off = plan.activation_offload.get(v)      # activation offload: host or NVMe part
        off_host = off.nbytes if off is not None and off.tier == "pinned" else 0
        off_nvme = off.nbytes if off is not None and off.tier == "nvme" else 0
        totals[f"activation_offload_{v}"] = off_host + off_nvme
        host = pinned + pageable + off_host + totals["host_reserve"] + \
            (r * d if machine.cpu_only else 0)
        totals[f"host_{v}"] = host
        probs = []
        if not machine.cpu_only:
            avail = (machine.gpu_mem_gb - machine.gpu_reserve_gb) * GB
            if d > avail:
                probs.append(f"device: needs {d / GB:.1f} GB per GPU > {avail / GB:.1f} GB usable "
                             f"({machine.gpu_mem_gb:g} GB - {machine.gpu_reserve_gb:g} GB reserve)")
        ram = machine.host_mem_gb * GB
        if machine.host_mem_gb and host > ram:
            probs.append(f"host: needs {host / GB:.1f} GB per node > {ram / GB:.1f} GB RAM")
        # offload.host_memory_gb bounds infinity's own host tiers (not the OS/runtime reserve)
        elif knobs.host_cap_gb and host - totals["host_reserve"] > knobs.host_cap_gb * GB:
            probs.append(f"host: needs {(host - totals['host_reserve']) / GB:.3g} GB per node "
                         f"(without the {totals['host_reserve'] / GB:.3g} GB reserve) > "
                         f"{knobs.host_cap_gb:g} GB (offload.host_memory_gb)")
        if nvme + off_nvme > machine.nvme_gb * GB:
            probs.append(f"NVMe: needs {(nvme + off_nvme) / GB:.1f} GB per node > "
                         f"{machine.nvme_gb:g} GB")
        fits[v] = not probs
        problems[v] = probs
        steps[v] = estimate_step(spec, machine, knobs, plan, checkpointing=(v == "checkpointing"))
    return ConfigEstimate(p, o, plan, totals, fits, problems, steps)


def knobs_from(config, overrides):
    kw = {}
    if config is not None:
        from infinity.config import InfinityConfig
        cfg = InfinityConfig.load(config)
        kw.update(precision=cfg.precision, zero_stage=cfg.zero_stage, prefetch_depth=cfg.prefetch.depth,
                  aio_block_size=cfg.aio.block_size, aio_queue_depth=cfg.aio.queue_depth,
                  aio_threads=cfg.aio.threads, grad_accum=cfg.gradient_accumulation_steps,
                  host_cap_gb=cfg.offload.host_memory_gb,
                  gradient_clipping=float(cfg.gradient_clipping),
                  activation_home=cfg.activation_offload.home,
                  activation_scope=cfg.activation_offload.scope,
                  grad_accum_dtype=cfg.gradient_accumulation_dtype,
                  state_dtype=cfg.optimizer.state_dtype,
                  qwz=cfg.zero_pp.quantized_weights, hpz=cfg.zero_pp.hpz_partition_size,
                  qgz=cfg.zero_pp.quantized_gradients,
                  tiling_max_group_gb=cfg.tiling.max_group_gb,
                  reuse_gb=cfg.prefetch.reuse_gb,
                  commit_shadow_gb=cfg.offload.commit_shadow_gb,
                  reduce_bucket_mb=cfg.reduce_bucket_mb,
                  frozen_dtype=cfg.offload.frozen_weights.dtype,
                  frozen_group_size=cfg.offload.frozen_weights.group_size,
                  frozen_double_quant=cfg.offload.frozen_weights.double_quant)
    frozen_given = any(overrides.get(n) not in (None, False) for n in
                       ("frozen_dtype", "frozen_group_size", "frozen_double_quant"))
    kw.update({k: v for k, v in overrides.items() if v is not None})
    from .lora import check_knobs, normalize_frozen_dtype
    if kw.get("lora_rank") is None:
        # a frozen-base setting means nothing without LoRA (nothing is frozen): refused
        # when passed, a config's offload.frozen_weights ignored
        check_knobs(Knobs(), frozen_given=frozen_given)
        for n in ("frozen_dtype", "frozen_group_size", "frozen_double_quant"):
            kw.pop(n, None)
    else:
        kw["frozen_dtype"] = normalize_frozen_dtype(kw.get("frozen_dtype"),
                                                    kw.get("precision", Knobs.precision))
    k = Knobs(**kw)
    if k.precision not in ("fp32", "bf16", "fp16"):
        raise EstimateError(f"precision must be fp32, bf16 or fp16, got {k.precision!r}")
    if k.zero_stage not in (1, 2, 3):
        raise EstimateError(f"zero_stage must be 1, 2 or 3, got {k.zero_stage!r}")
    if k.state_dtype not in ("fp32", "bf16"):
        raise EstimateError(f"state_dtype must be fp32 or bf16, got {k.state_dtype!r}")
    if k.grad_spill is True or k.grad_spill is False:
        k.grad_spill = "on" if k.grad_spill else "off"
    if k.grad_spill not in GRAD_SPILL_MODES:
        raise EstimateError(f"grad_spill must be one of {GRAD_SPILL_MODES}, got {k.grad_spill!r}")
    if k.activation_model not in (None, "megatron", "eager"):
        raise EstimateError(f"activation_model must be 'megatron' or 'eager', got {k.activation_model!r}")
    if k.activation_home not in ("none", "cpu", "nvme"):
        raise EstimateError(f"activation_home must be 'none', 'cpu' or 'nvme', got {k.activation_home!r}")
    if k.activation_scope not in ("checkpoints", "all"):
        raise EstimateError(f"activation_scope must be 'checkpoints' or 'all', got {k.activation_scope!r}")
    if k.grad_accum_dtype not in ("fp32", "bf16"):
        raise EstimateError(f"grad_accum_dtype must be 'fp32' or 'bf16', got {k.grad_accum_dtype!r}")
    if k.grouping not in GROUPINGS:
        raise EstimateError(f"grouping must be one of {GROUPINGS}, got {k.grouping!r}")
    for name in ("prefetch_depth",):
        if not isinstance(getattr(k, name), int) or getattr(k, name) < 0:
            raise EstimateError(f"{name} must be an integer >= 0, got {getattr(k, name)!r}")
    for name in ("tile_numel", "pipeline_depth", "grad_accum"):
        if not isinstance(getattr(k, name), int) or getattr(k, name) < 1:
            raise EstimateError(f"{name} must be a positive integer, got {getattr(k, name)!r}")
    check_knobs(k)
    return k


def local_machine(nvme_path="."):
    """This machine: its GPUs, RAM and free disk space at ``nvme_path``."""
    return Machine(gpus=detect_gpus(), host_mem_gb=round(detect_host_mem_gb(), 1),
                   nvme_gb=round(detect_free_disk_gb(nvme_path), 1))


def estimate(model=None, *, params=None, layers=None, hidden=None, seq=2048, batch=1, vocab=None,
             heads=None, machine=None, config=None, precision=None, zero_stage=None,
             prefetch_depth=None, grad_accum=None, host_cap_gb=None, tile_numel=None,
             state_dtype=None, grouping=None, grad_spill=None, activation_model=None, configs=None,
             gradient_clipping=None, activation_home=None, activation_scope=None,
             grad_accum_dtype=None, tiling_max_group_gb=None, commit_shadow_gb=None,
             lora_rank=None, frozen_dtype=None, frozen_group_size=None, double_quant=None,
             reduce_bucket_mb=None):
    """Estimate memory per tier and step time for every valid offload configuration.

    model: an ``nn.Module`` (ideally built on the meta device), a factory (callable or
        ``"module:function"`` / ``"file.py:function"``, built under ``torch.device("meta")``),
        a :class:`ModelSpec`, or None with ``params``/``layers``/``hidden`` given.
    machine: a :class:`Machine`, a dict of its fields, or None for this machine.
    config: anything ``InfinityConfig.load`` accepts; its precision, zero_stage,
        prefetch.depth, aio.*, gradient_accumulation_steps, gradient_clipping,
        optimizer.state_dtype and offload.host_memory_gb are used (keyword arguments override them). Its offload homes are ignored: every valid
        (params, optimizer) pair is estimated, or only ``configs=[("nvme", "nvme"), ...]``.
    activation_home / activation_scope: activation offload (``activation_offload.home`` /
        ``.scope``): the saved activations moved off the device become a host or NVMe item
        and, on NVMe, traffic per micro-batch (:func:`.memory_plan.offload_activations`).
    grad_accum_dtype: ``gradient_accumulation_dtype`` ("bf16": the NVMe gradient home's
        partial sums in bf16).
    commit_shadow_gb: ``offload.commit_shadow_gb`` (None: automatic, as the engine sizes
        it from the NVMe left: :func:`.memory_plan.size_shadows`).
    lora_rank: LoRA adapters of this rank on every projection of each layer over the
        frozen base (the spec's parameters); ``frozen_dtype`` ("nf4", "int8", "int4", or
        the working precision's name / None: not quantized), ``frozen_group_size``,
        ``double_quant``: ``offload.frozen_weights`` (docs/estimator.md, "LoRA over a
        quantized base"; :mod:`.lora`).  Without ``lora_rank`` they are refused.
    tiling_max_group_gb: ``tiling.max_group_gb``: groups above it that tiling can split
        (``nn.Linear``/``nn.Embedding``, one rank) put one tile on the device per fetch.
    reduce_bucket_mb: ``reduce_bucket_mb``: ZeRO stages 2-3 on GPUs reduce gradients in
        device buckets of this size (0: whole groups in fp32, as before buckets).
    grad_spill: where the fp32 gradients live: ``"auto"`` (default) as the engine decides
        (:func:`.memory_plan.grad_spill_decision`), ``"on"`` on NVMe whenever a swap space
        exists, ``"off"`` always in host memory (``True``/``False`` mean on/off).
        ``Estimate.what_if`` holds the estimate with the other home for comparison: with
        ``"off"`` when ``"auto"`` paged gradients somewhere, with ``"auto"`` when
        ``"off"`` was asked for and nothing fits.
    Returns an :class:`Estimate`.
    """
    if isinstance(model, ModelSpec):
        spec = model
    elif model is not None:
        import torch.nn as nn
        if isinstance(model, nn.Module):
            spec = spec_from_module(model, seq=seq, batch=batch, layers=layers, hidden=hidden,
                                    vocab=vocab, heads=heads)
        elif isinstance(model, str) or callable(model):
            spec = spec_from_factory(model, seq=seq, batch=batch, layers=layers, hidden=hidden,
                                     vocab=vocab, heads=heads)
        else:
            raise EstimateError(f"model must be an nn.Module, a factory or a ModelSpec, got "
                                f"{type(model).__name__}")
    else:
        missing = [n for n, v in (("params", params), ("layers", layers), ("hidden", hidden)) if v is None]
        if missing:
            raise EstimateError(f"describe the model: give {', '.join(missing)} "
                                "(or a model / model factory)")
        spec = spec_from_dims(params, layers, hidden, seq=seq, batch=batch, vocab=vocab, heads=heads)
    if machine is None:
        machine = local_machine()
    elif isinstance(machine, dict):
        machine = Machine(**machine)
    elif not isinstance(machine, Machine):
        raise EstimateError(f"machine must be a Machine, a dict or None, got {type(machine).__name__}")
    knobs = knobs_from(config, dict(precision=precision, zero_stage=zero_stage,
                                     prefetch_depth=prefetch_depth, grad_accum=grad_accum,
                                     host_cap_gb=host_cap_gb, tile_numel=tile_numel,
                                     state_dtype=state_dtype, grouping=grouping,
                                     grad_spill=grad_spill, activation_model=activation_model,
                                     gradient_clipping=gradient_clipping,
                                     tiling_max_group_gb=tiling_max_group_gb,
                                     activation_home=activation_home,
                                     activation_scope=activation_scope,
                                     grad_accum_dtype=grad_accum_dtype,
                                     commit_shadow_gb=commit_shadow_gb,
                                     reduce_bucket_mb=reduce_bucket_mb,
                                     lora_rank=lora_rank, frozen_dtype=frozen_dtype,
                                     frozen_group_size=frozen_group_size,
                                     frozen_double_quant=double_quant))
    valid = valid_configs(knobs)
    if configs is not None:
        want = [tuple(c) for c in configs]
        bad = [c for c in want if c not in valid]
        if bad:
            raise EstimateError(f"configuration(s) {bad} are not valid for zero_stage {knobs.zero_stage}; "
                                f"valid (params, optimizer) homes: {valid}")
        valid = want
    est = Estimate(spec, machine, knobs)
    est.configs = [evaluate_config(spec, machine, knobs, p, o) for p, o in valid]
    import dataclasses
    alt = None
    if knobs.grad_spill == "auto" and any(c.plan.grads_on_nvme for c in est.configs):
        alt = "off"
    elif knobs.grad_spill == "off" and est.best is None:
        alt = "auto"
    if alt is not None:
        k2 = dataclasses.replace(knobs, grad_spill=alt)
        est.what_if = Estimate(spec, machine, k2)
        est.what_if.configs = [evaluate_config(spec, machine, k2, p, o) for p, o in valid]
    return est


class _CallableModule(types.ModuleType):
    """``import infinity.estimate`` binds the package as ``infinity.estimate``; make calling it
    work the same as calling the function, so ``infinity.estimate(...)`` always works."""

    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
