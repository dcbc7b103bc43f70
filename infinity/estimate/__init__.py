"""The memory and step-time estimator: ``infinity.estimate(...)`` and ``infinity estimate``.

    import infinity
    est = infinity.estimate(params=1_000_000_000_000, layers=128, hidden=25600, vocab=51200,
                            machine=dict(gpus=8, gpu_mem_gb=80, host_mem_gb=2000,
                                         nvme_gb=30720, nvme_drives=8, nvme_gbps=48),
                            config={"precision": "bf16"})
    print(est.text())          # per tier, per configuration; which fit; step time derivation
    est.best                   # fastest configuration that fits (or None)
    est.as_dict()              # JSON-ready

Formulas: :mod:`.memory_plan` (bytes per tier), :mod:`.step_time` (bytes per step and
time); docs/estimator.md explains them with sources.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

from .machine import GB, Machine, detect_free_disk_gb, detect_gpus, detect_host_mem_gb
from .memory_plan import (HOMES, SPILL_NOTE, TIER_NAMES, Knobs, MemoryPlan, plan_memory,
                          valid_configs)
from .model_spec import (GROUPINGS, EstimateError, ModelSpec, spec_from_dims, spec_from_factory,
                         spec_from_module)
from .report import _num
from .step_time import StepEstimate, estimate_step

__all__ = ["estimate", "Estimate", "ConfigEstimate", "ModelSpec", "Machine", "Knobs",
           "EstimateError", "spec_from_dims", "spec_from_module", "spec_from_factory"]

HOST_RESERVE_BASE_GB = 1.0      # OS and page cache headroom per node
HOST_RESERVE_PER_RANK_GB = 1.0  # a torch process's own resident memory (libraries, allocator)
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
                "notes": list(self.plan.notes), "grads_on_nvme": self.plan.grads_on_nvme,
                "totals_bytes": self.totals, "fits": self.fits, "problems": self.problems,
                "step": {k: v.as_dict() for k, v in self.steps.items()}}


@dataclass
class Estimate:
    model: ModelSpec
    machine: Machine
    knobs: Knobs
    configs: list = field(default_factory=list)
    what_if: "Estimate | None" = None   # the same with gradients paged to NVMe, when nothing fits

    def fitting(self):
        """``[(ConfigEstimate, variant)]`` that fit, fastest first."""
        out = [(c, v) for c in self.configs for v in VARIANTS if c.fits[v]]
        order = {h: i for i, h in enumerate(HOMES)}
        out.sort(key=lambda cv: (cv[0].steps[cv[1]].step_s, order[cv[0].params_home] +
                                 order[cv[0].optimizer_home], cv[1] == "checkpointing"))
        return out

    @property
    def best(self):
        f = self.fitting()
        return f[0] if f else None

    def verdict(self):
        b = self.best
        m = self.machine
        where = (f"{m.nodes}x" if m.nodes > 1 else "") + (
            f"{m.gpus}x{m.gpu_mem_gb:g} GB GPU" if m.gpus else "CPU-only") + \
            f", {m.host_mem_gb:g} GB RAM, {m.nvme_gb:g} GB NVMe"
        if b is None:
            out = (f"No: no offload configuration fits {_num(self.model.params)} parameters on "
                   f"{where}; see the problems listed per configuration.")
            w = self.what_if.best if self.what_if is not None else None
            if w is not None:
                c, v = w
                s = c.steps[v]
                out += (f" What-if: with gradients paged to NVMe (--grad-spill; "
                        f"{SPILL_NOTE}) it fits with {c.name}"
                        + (" and activation checkpointing" if v == "checkpointing" else "")
                        + f": {s.step_s:.4g} s per step, {s.tokens_per_s:.3g} tokens/s, {s.bound}-bound.")
            return out
        c, v = b
        s = c.steps[v]
        ck = "with activation checkpointing" if v == "checkpointing" else "without activation checkpointing"
        return (f"Yes: {_num(self.model.params)} parameters fit on {where} with {c.name} "
                f"({ck}); estimated {s.step_s:.4g} s per step, {s.tokens_per_s:.3g} tokens/s, "
                f"{s.bound}-bound (lower bound: perfect overlap).")

    def as_dict(self):
        b = self.best
        return {"model": self.model.as_dict(), "machine": self.machine.as_dict(),
                "knobs": self.knobs.as_dict(),
                "configs": [c.as_dict() for c in self.configs],
                "best": None if b is None else {"params": b[0].params_home, "optimizer": b[0].optimizer_home,
                                                "activation_checkpointing": b[1] == "checkpointing",
                                                "step_s": b[0].steps[b[1]].step_s},
                "verdict": self.verdict(),
                "what_if_grad_spill": None if self.what_if is None else self.what_if.as_dict()}

    def text(self, details=True):
        from .report import format_estimate
        return format_estimate(self, details=details)


def _host_reserve(machine):
    return int((HOST_RESERVE_BASE_GB + HOST_RESERVE_PER_RANK_GB * machine.ranks_per_node) * GB)


def _evaluate(spec, machine, knobs, p, o):
    plan = plan_memory(spec, machine, knobs, p, o)
    dev = plan.tier_total("device")
    pinned, pageable, nvme = plan.tier_total("pinned"), plan.tier_total("pageable"), plan.tier_total("nvme")
    r = machine.ranks_per_node
    totals = {"pinned": pinned, "pageable": pageable, "nvme": nvme,
              "host_reserve": _host_reserve(machine), "gpu_reserve": int(machine.gpu_reserve_gb * GB)}
    fits, problems, steps = {}, {}, {}
    cap = [c for c in (knobs.host_cap_gb, machine.host_mem_gb) if c]
    host_limit = min(cap) * GB if cap else 0
    for v in VARIANTS:
        act = plan.activations[v].nbytes
        d = dev + act
        totals[f"device_{v}"] = d
        host = pinned + pageable + totals["host_reserve"] + (r * d if machine.cpu_only else 0)
        totals[f"host_{v}"] = host
        probs = []
        if not machine.cpu_only:
            avail = (machine.gpu_mem_gb - machine.gpu_reserve_gb) * GB
            if d > avail:
                probs.append(f"device: needs {d / GB:.1f} GB per GPU > {avail / GB:.1f} GB usable "
                             f"({machine.gpu_mem_gb:g} GB - {machine.gpu_reserve_gb:g} GB reserve)")
        if host > host_limit:
            probs.append(f"host: needs {host / GB:.1f} GB per node > {host_limit / GB:.1f} GB"
                         + (" (offload.host_memory_gb)" if knobs.host_cap_gb and host_limit == knobs.host_cap_gb * GB
                            else " RAM"))
        if nvme > machine.nvme_gb * GB:
            probs.append(f"NVMe: needs {nvme / GB:.1f} GB per node > {machine.nvme_gb:g} GB")
        fits[v] = not probs
        problems[v] = probs
        steps[v] = estimate_step(spec, machine, knobs, plan, checkpointing=(v == "checkpointing"))
    return ConfigEstimate(p, o, plan, totals, fits, problems, steps)


def _knobs_from(config, overrides):
    kw = {}
    if config is not None:
        from infinity.config import InfinityConfig
        cfg = InfinityConfig.load(config)
        kw.update(precision=cfg.precision, zero_stage=cfg.zero_stage, prefetch_depth=cfg.prefetch.depth,
                  aio_block_size=cfg.aio.block_size, aio_queue_depth=cfg.aio.queue_depth,
                  aio_threads=cfg.aio.threads, grad_accum=cfg.gradient_accumulation_steps,
                  host_cap_gb=cfg.offload.host_memory_gb)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    k = Knobs(**kw)
    if k.precision not in ("fp32", "bf16", "fp16"):
        raise EstimateError(f"precision must be fp32, bf16 or fp16, got {k.precision!r}")
    if k.zero_stage not in (1, 2, 3):
        raise EstimateError(f"zero_stage must be 1, 2 or 3, got {k.zero_stage!r}")
    if k.state_dtype not in ("fp32", "bf16"):
        raise EstimateError(f"state_dtype must be fp32 or bf16, got {k.state_dtype!r}")
    if k.activation_model not in (None, "megatron", "eager"):
        raise EstimateError(f"activation_model must be 'megatron' or 'eager', got {k.activation_model!r}")
    if k.grouping not in GROUPINGS:
        raise EstimateError(f"grouping must be one of {GROUPINGS}, got {k.grouping!r}")
    for name in ("prefetch_depth",):
        if not isinstance(getattr(k, name), int) or getattr(k, name) < 0:
            raise EstimateError(f"{name} must be an integer >= 0, got {getattr(k, name)!r}")
    for name in ("tile_numel", "pipeline_depth", "grad_accum"):
        if not isinstance(getattr(k, name), int) or getattr(k, name) < 1:
            raise EstimateError(f"{name} must be a positive integer, got {getattr(k, name)!r}")
    return k


def local_machine(nvme_path="."):
    """This machine: its GPUs, RAM and free disk space at ``nvme_path``."""
    return Machine(gpus=detect_gpus(), host_mem_gb=round(detect_host_mem_gb(), 1),
                   nvme_gb=round(detect_free_disk_gb(nvme_path), 1))


def estimate(model=None, *, params=None, layers=None, hidden=None, seq=2048, batch=1, vocab=None,
             heads=None, machine=None, config=None, precision=None, zero_stage=None,
             prefetch_depth=None, grad_accum=None, host_cap_gb=None, tile_numel=None,
             state_dtype=None, grouping=None, grad_spill=None, activation_model=None, configs=None):
    """Estimate memory per tier and step time for every valid offload configuration.

    model: an ``nn.Module`` (ideally built on the meta device), a factory (callable or
        ``"module:function"`` / ``"file.py:function"``, built under ``torch.device("meta")``),
        a :class:`ModelSpec`, or None with ``params``/``layers``/``hidden`` given.
    machine: a :class:`Machine`, a dict of its fields, or None for this machine.
    config: anything ``InfinityConfig.load`` accepts; its precision, zero_stage,
        prefetch.depth, aio.*, gradient_accumulation_steps and offload.host_memory_gb are
        used (keyword arguments override them). Its offload homes are ignored: every valid
        (params, optimizer) pair is estimated, or only ``configs=[("nvme", "nvme"), ...]``.
    grad_spill: page fp32 gradients to NVMe when the host cannot hold them (the engine
        does so itself when the optimizer is on NVMe; here it stays an opt-in what-if). When nothing fits without it, ``Estimate.what_if`` holds the
        estimate with it.
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
    knobs = _knobs_from(config, dict(precision=precision, zero_stage=zero_stage,
                                     prefetch_depth=prefetch_depth, grad_accum=grad_accum,
                                     host_cap_gb=host_cap_gb, tile_numel=tile_numel,
                                     state_dtype=state_dtype, grouping=grouping,
                                     grad_spill=grad_spill, activation_model=activation_model))
    valid = valid_configs(knobs)
    if configs is not None:
        want = [tuple(c) for c in configs]
        bad = [c for c in want if c not in valid]
        if bad:
            raise EstimateError(f"configuration(s) {bad} are not valid for zero_stage {knobs.zero_stage}; "
                                f"valid (params, optimizer) homes: {valid}")
        valid = want
    est = Estimate(spec, machine, knobs)
    est.configs = [_evaluate(spec, machine, knobs, p, o) for p, o in valid]
    if est.best is None and not knobs.grad_spill and any(o == "nvme" for _, o in valid):
        import dataclasses
        k2 = dataclasses.replace(knobs, grad_spill=True)
        est.what_if = Estimate(spec, machine, k2)
        est.what_if.configs = [_evaluate(spec, machine, k2, p, o) for p, o in valid]
    return est


class _CallableModule(types.ModuleType):
    """``import infinity.estimate`` binds the package as ``infinity.estimate``; make calling it
    work the same as calling the function, so ``infinity.estimate(...)`` always works."""

    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
