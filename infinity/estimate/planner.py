"""The planner: the fastest configuration that fits (``infinity estimate --plan``).

For a model, a machine and a global batch (sequences per optimizer step across all
ranks), :func:`make_plan` evaluates, with the estimator's own memory and step-time
model (:mod:`.memory_plan`, :mod:`.step_time`):

* the (params, optimizer) homes the engine accepts (:func:`.memory_plan.valid_configs`);
* activation checkpointing on or off;
* activation offload: none, cpu or nvme, scope ``checkpoints`` or ``all``;
* the micro-batch ``B`` and the accumulation ``A`` with ``B * A * R`` = the global batch;
* the prefetch depth (the deepest of :data:`DEPTHS` that fits: the step-time model does
  not depend on it, a deeper read-ahead only absorbs jitter the model does not see);
* memory-centric tiling (``tiling.max_group_gb``, tiles of Gmax / :data:`TILE_FRACTIONS`)
  when nothing fits untiled at the shallowest depth (parameters paged: one rank, or
  ZeRO stage 3 without ZeRO++);
* with ``allow_lossy``: bf16 Adam moments (``optimizer.state_dtype``) and bf16 partial
  gradient sums (``gradient_accumulation_dtype``); without it the plan is lossless.

and keeps the configuration with the shortest step (= the most tokens per second, the
global batch being fixed); ties go to the lossless, the less offloaded and then the
larger micro-batch.  Nothing here adds a term to the model: the plan is exactly as good
as the estimator's validated terms (docs/estimator.md, "The planner").

The compute-bound rate is ``R * TFLOPS / (f * N)`` tokens per second with ``f`` = 8
FLOP per parameter and token with activation checkpointing (one recomputed forward),
6 without: what the GPUs would deliver if no transfer and no optimizer ever waited.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .machine import GB, fmt_seconds
from .memory_plan import HOMES, Knobs, host_reserve_bytes, valid_configs
from .model_spec import EstimateError
from .step_time import bound_text, model_flops_per_token, phase_text

#: activation placements searched: (activation_offload.home, .scope)
ACTIVATION_CHOICES = (("none", "checkpoints"), ("cpu", "checkpoints"), ("cpu", "all"),
                      ("nvme", "checkpoints"), ("nvme", "all"))
#: prefetch depths tried, deepest first (the deepest that fits is kept)
DEPTHS = (3, 2, 1)
#: global batch when none is given: this many tokens per optimizer step (rounded up to
#: whole sequences on every rank): 128 sequences of 2048 tokens, a common fine-tuning batch
DEFAULT_TOKENS_PER_STEP = 1 << 18
_HOME_RANK = {h: i for i, h in enumerate(HOMES)}
_ACT_RANK = {h: i for i, h in enumerate(ACTIVATION_CHOICES)}


@dataclass
class Choice:
    """One evaluated configuration: its knobs, homes, the estimator's answer for it."""
    params_home: str
    optimizer_home: str
    checkpointing: bool
    knobs: object             # memory_plan.Knobs (micro-batch is the spec's batch)
    micro_batch: int
    estimate: object          # ConfigEstimate
    host_cap_gb: float | None  # offload.host_memory_gb the plan sets (None: not set)

    @property
    def variant(self):
        return "checkpointing" if self.checkpointing else "none"

    @property
    def step(self):
        return self.estimate.steps[self.variant]

    @property
    def grad_accum(self):
        return self.knobs.grad_accum

    @property
    def lossy(self):
        k = self.knobs
        return k.state_dtype == "bf16" or (k.grad_accum_dtype == "bf16" and k.grad_accum > 1)

    @property
    def fits(self):
        return self.estimate.fits[self.variant]

    @property
    def problems(self):
        return self.estimate.problems[self.variant]

    def config(self):
        """The ``infinity`` config (JSON-ready dict) that runs this choice."""
        k = self.knobs
        off = {"params": self.params_home, "optimizer": self.optimizer_home}
        if self.host_cap_gb is not None:
            off["host_memory_gb"] = round(self.host_cap_gb, 3)
        if k.commit_shadow_gb is not None:
            off["commit_shadow_gb"] = k.commit_shadow_gb
        cfg = {"precision": k.precision, "zero_stage": k.zero_stage, "offload": off,
               "prefetch": {"depth": k.prefetch_depth},
               "gradient_accumulation_steps": k.grad_accum,
               "activation_offload": {"home": k.activation_home, "scope": k.activation_scope}}
        if k.state_dtype != "fp32":
            cfg["optimizer"] = {"state_dtype": k.state_dtype}
        if k.grad_accum_dtype != "fp32" and k.grad_accum > 1:
            cfg["gradient_accumulation_dtype"] = k.grad_accum_dtype
        if k.gradient_clipping:
            cfg["gradient_clipping"] = k.gradient_clipping
        if k.tiling_max_group_gb is not None:
            cfg["tiling"] = {"max_group_gb": k.tiling_max_group_gb}
        if k.reduce_bucket_mb != Knobs.reduce_bucket_mb:
            cfg["reduce_bucket_mb"] = k.reduce_bucket_mb
        if k.lora_rank is not None and k.frozen_dtype is not None:
            off["frozen_weights"] = {"dtype": k.frozen_dtype, "group_size": k.frozen_group_size,
                                     "double_quant": bool(k.frozen_double_quant)}
        return cfg

    def describe(self):
        k = self.knobs
        act = "no activation offload" if k.activation_home == "none" else \
            f"activations offloaded to {k.activation_home} (scope {k.activation_scope})"
        lossy = [w for w, on in (("bf16 Adam moments", k.state_dtype == "bf16"),
                                 ("bf16 gradient partial sums",
                                  k.grad_accum_dtype == "bf16" and k.grad_accum > 1)) if on]
        lora = "" if k.lora_rank is None else (
            f"LoRA r{k.lora_rank} over {k.frozen_dtype or k.precision} base, ")
        return (f"{lora}params={self.params_home}, optimizer={self.optimizer_home}, "
                f"{'activation checkpointing' if self.checkpointing else 'no checkpointing'}, "
                f"{act}, micro-batch {self.micro_batch} x accumulation {k.grad_accum}, "
                f"prefetch depth {k.prefetch_depth}, "
                + (f"tiling above {k.tiling_max_group_gb:g} GB, "
                   if k.tiling_max_group_gb is not None else "")
                + ("lossy: " + " + ".join(lossy) if lossy else "lossless"))

    def as_dict(self, compute_bound=None):
        s = self.step
        d = {"plan": self.config(), "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
             "activation_checkpointing": self.checkpointing, "step_s": s.step_s,
             "tokens_per_s": s.tokens_per_s, "lossy": self.lossy, "bound": s.bound,
             "summary": self.describe()}
        if compute_bound:
            d["fraction_of_compute_bound"] = s.tokens_per_s / compute_bound
        return d


@dataclass
class Plan:
    model: object             # ModelSpec (batch = the chosen micro-batch, else 1)
    machine: object
    global_batch: int
    allow_lossy: bool
    best: Choice | None
    alternatives: list = field(default_factory=list)
    closest: Choice | None = None     # nothing fits: the candidate with the fewest problems
    evaluated: int = 0
    fitting: int = 0
    searched: str = ""
    candidates: list = field(default_factory=list)   # every fitting choice, fastest first
    rejected: list = field(default_factory=list)     # every choice that does not fit
    # what the plan assumed (:func:`planned_machine`): headroom, derate, clipping, the
    # machine as given and the drives' rating (None: not given)
    assumptions: dict = field(default_factory=dict)
    lora: object = None       # LoRA: the base Knobs (lora_rank, frozen_*); None: full fine-tuning

    def mfu(self, choice=None):
        """Model FLOPs utilization (../shared/DESIGN.md §3.5): model FLOPs per second (6*N
        + attention per token, recompute not counted) over the devices' rate."""
        b = choice or self.best
        if b is None:
            return None
        return b.step.tokens_per_s * model_flops_per_token(self.model, knobs=b.knobs) / \
            (self.machine.ranks * self.machine.tflops * 1e12)

    def hfu(self, choice=None):
        """Hardware FLOPs utilization: the same with the recomputed forward counted."""
        b = choice or self.best
        if b is None:
            return None
        return b.step.tokens_per_s * model_flops_per_token(
            self.model, checkpointing=b.checkpointing, hardware=True, knobs=b.knobs) / \
            (self.machine.ranks * self.machine.tflops * 1e12)

    def wear(self):
        """Drive wear of the best plan: TB written per step and per million tokens, and
        (with a rating) the drives' life in steps and tokens."""
        b = self.best
        if b is None:
            return None
        tb = b.step.traffic.get("nvme_write", 0) / 1e12
        tokens = self.global_batch * self.model.seq
        out = {"tb_written_per_step": tb, "tb_written_per_million_tokens": tb * 1e6 / tokens}
        tbw = self.assumptions.get("drive_tbw")
        if tbw and tb > 0:
            out["drive_life_steps"] = tbw / tb
            out["drive_life_tokens"] = tbw / tb * tokens
        return out

    def reasons(self) -> list:
        """One sentence per choice of the best plan, with the number that decided it
        (:mod:`.plan_reasons`)."""
        from .plan_reasons import plan_reasons
        return plan_reasons(self)

    def compute_bound(self, checkpointing=None):
        """Tokens/s if compute were the only limit (8 FLOP/param/token with checkpointing)."""
        if checkpointing is None:
            checkpointing = self.best.checkpointing if self.best is not None else True
        f = 8 if checkpointing else 6
        flops = f * self.model.params
        if self.lora is not None:     # LoRA: 6*Nf + 8*Na (4*Nf + 6*Na without checkpointing)
            from .lora import adapter_params
            na = adapter_params(self.model, self.lora.lora_rank)
            flops = (6 if checkpointing else 4) * self.model.params + f * na
        return self.machine.ranks * self.machine.tflops * 1e12 / flops

    def headline(self):
        if self.best is None:
            why = ""
            if self.closest is not None:
                why = (f"; the closest, {self.closest.describe()}: "
                       + "; ".join(self.closest.problems))
            return (f"No plan fits: nothing of {self.searched} fits "
                    f"{self.machine.ranks} rank(s) at global batch {self.global_batch}{why}")
        b, s = self.best, self.best.step
        return (f"Plan: MFU {100 * self.mfu():.1f} % (hardware FLOPs utilization "
                f"{100 * self.hfu():.1f} %{', recompute counted' if b.checkpointing else ''}): "
                f"{b.describe()}: step {fmt_seconds(s.step_s)} s, {s.tokens_per_s:.4g} tokens/s")

    def as_dict(self):
        b = self.best
        cb = self.compute_bound()
        out = {"plan": None if b is None else b.config(),
               "micro_batch": None if b is None else b.micro_batch,
               "grad_accum": None if b is None else b.grad_accum,
               "step_s": None if b is None else b.step.step_s,
               "tokens_per_s": None if b is None else b.step.tokens_per_s,
               "compute_bound_tokens_per_s": cb,
               "lossy": False if b is None else b.lossy,
               "alternatives": [a.as_dict(self.compute_bound(a.checkpointing))
                                for a in self.alternatives],
               "activation_checkpointing": None if b is None else b.checkpointing,
               "global_batch": self.global_batch, "seq": self.model.seq,
               "evaluated": self.evaluated, "fitting": self.fitting,
               "mfu": self.mfu(), "hardware_flops_utilization": self.hfu(),
               "nvme_used_fraction": self.nvme_used_fraction(),
               "nvme_derate": self.assumptions.get("nvme_derate"),
               "nvme_headroom": self.assumptions.get("nvme_headroom"),
               "host_headroom": self.assumptions.get("host_headroom"),
               "gradient_clipping": None if b is None else b.knobs.gradient_clipping,
               "drive_tb_written_per_step": None if b is None else self.wear()["tb_written_per_step"]}
        if b is not None:
            out["drive_wear"] = self.wear()
        if self.lora is not None:
            from .lora import summary
            out.update(summary(self.model, self.machine, self.lora,
                               None if b is None else b.params_home))
            out["frozen_home"] = out.get("frozen_home")
        if b is None and self.closest is not None:
            out["closest"] = self.closest.as_dict()
            out["closest"]["problems"] = list(self.closest.problems)
        return out

    def nvme_used_fraction(self):
        """NVMe the best plan uses over the drives' whole capacity (as given)."""
        b = self.best
        given = self.assumptions.get("machine", self.machine)
        if b is None or not given.nvme_gb:
            return None
        t, v = b.estimate.totals, b.variant
        used = t["nvme"] + (t[f"activation_offload_{v}"] if b.knobs.activation_home == "nvme" else 0)
        return used / (given.nvme_gb * GB)

    def assumption_lines(self) -> list:
        a, m = self.assumptions, self.machine
        if not a:
            return []
        g = a["machine"]
        lines = [f"  assumptions: NVMe {100 * a['nvme_headroom']:g} % kept free ({m.nvme_gb:,.2f} of "
                 f"{g.nvme_gb:,.2f} GB usable, --nvme-headroom), host memory "
                 f"{100 * a['host_headroom']:g} % kept free ({m.host_mem_gb:,.2f} of "
                 f"{g.host_mem_gb:,.2f} GB, --host-headroom); drives at {a['nvme_derate']:g} of "
                 f"{'the measured' if a['nvme_measured'] else 'the given'} figures "
                 f"({m.nvme_gbps:g} / {m.nvme_write_gbps:g} GB/s read / write, --nvme-derate); "
                 f"gradient clipping {a['gradient_clipping']:g}"
                 + (" (--no-clip to plan without)" if a["gradient_clipping"] else "")]
        w = self.wear()
        if w is not None:
            txt = (f"  drive wear: {w['tb_written_per_step']:,.2f} TB written per step, "
                   f"{w['tb_written_per_million_tokens']:,.2f} TB per million tokens")
            if "drive_life_steps" in w:
                txt += (f"; rated {a['drive_tbw']:,.0f} TB written: {w['drive_life_steps']:,.0f} "
                        f"steps, {w['drive_life_tokens'] / 1e9:,.2f} B tokens")
            else:
                txt += " (--drive-tbw TB for the drives' life)"
            lines.append(txt)
        return lines

    def text(self):
        """The headline, its derivation, then the config block."""
        import json

        lines = [self.headline()]
        b = self.best
        m = self.machine
        lines.append("")
        lines.append("derivation:")
        lines.append(f"  searched {self.searched}: {self.evaluated} configurations evaluated, "
                     f"{self.fitting} fit; global batch {self.global_batch} sequences x "
                     f"{self.model.seq} tokens = {self.global_batch * self.model.seq:,} tokens "
                     f"per step")
        if self.lora is not None:
            from .report import lora_line
            lines.append("  " + lora_line(self.model, m, self.lora))
        if b is None:
            return "\n".join(lines + self.assumption_lines()) + "\n"
        lines.extend(self.assumption_lines())
        c, v = b.estimate, b.variant
        t = c.totals
        dev = t[f"device_{v}"]
        if m.cpu_only:
            lines.append("  memory: device tier counted in host memory (CPU-only)")
        else:
            lines.append(f"  memory: device {dev / GB:,.2f} of {m.gpu_mem_gb - m.gpu_reserve_gb:,.2f} "
                         f"GB usable per GPU")
        cap = b.knobs.host_cap_gb
        lines.append(f"          host {t[f'host_{v}'] / GB:,.2f} of {m.host_mem_gb:,.2f} GB RAM per node "
                     f"(incl. {t['host_reserve'] / GB:.2f} GB reserve"
                     + (f"; {(t[f'host_{v}'] - t['host_reserve']) / GB:,.3g} GB of the "
                        f"{cap:g} GB offload.host_memory_gb" if cap else "") + "); NVMe "
                     f"{(t['nvme'] + (t[f'activation_offload_{v}'] if b.knobs.activation_home == 'nvme' else 0)) / GB:,.2f}"
                     f" of {m.nvme_gb:,.2f} GB")
        s = b.step
        lines.append(f"  step = {s.formula(b.grad_accum)}, {bound_text(s.bound)} (lower bound: "
                     f"perfect overlap)")
        for ph in (s.fwd_bwd, s.optimizer):
            lines.append(f"    {phase_text(ph)}")
            for d in ph.derivation:
                lines.append(f"      {d}")
        for n in c.plan.notes:
            lines.append(f"  note: {n}")
        lines.append("  why:")
        for r in self.reasons():
            lines.append(f"    {r}")
        if self.alternatives:
            lines.append("  next best:")
            for a in self.alternatives:
                lines.append(f"    {fmt_seconds(a.step.step_s):>10} s  {a.step.tokens_per_s:9.4g} tokens/s  "
                             f"{a.describe()}")
        lines.append("")
        lines.append(f"config (infinity JSON; the training loop feeds micro-batches of {b.micro_batch} "
                     f"sequence(s) per rank, {b.grad_accum} per optimizer step"
                     + (", with activation checkpointing enabled on the model, e.g. "
                        "model.gradient_checkpointing_enable()" if b.checkpointing else
                        ", without activation checkpointing") + "):")
        lines.append(json.dumps(b.config(), indent=2))
        return "\n".join(lines) + "\n"


#: planning defaults: NVMe and host memory kept free, drive bandwidth derated (unless
#: measured on this machine), gradient clipping of fine-tuning runs
NVME_HEADROOM = 0.10
HOST_HEADROOM = 0.10
NVME_DERATE = 0.8
PLAN_CLIP = 1.0


def planned_machine(machine, nvme_headroom=NVME_HEADROOM, host_headroom=HOST_HEADROOM,
                    nvme_derate=None):
    """The machine a plan is made for: ``nvme_headroom`` / ``host_headroom`` of NVMe and RAM
    kept free, drive bandwidth times ``nvme_derate`` (None: 0.8, or 1 when measured here:
    ``--bench-io``).  Returns ``(machine, assumptions)``."""
    for name, v in (("nvme_headroom", nvme_headroom), ("host_headroom", host_headroom)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1:
            raise EstimateError(f"{name} must be a fraction in [0, 1), got {v!r}")
    measured = str((machine.sources or {}).get("nvme_gbps", "")).startswith("measured")
    if nvme_derate is None:
        nvme_derate = 1.0 if measured else NVME_DERATE
    if not isinstance(nvme_derate, (int, float)) or isinstance(nvme_derate, bool) \
            or not 0 < nvme_derate <= 1:
        raise EstimateError(f"nvme_derate must be in (0, 1], got {nvme_derate!r}")
    m = dataclasses.replace(machine, nvme_gb=machine.nvme_gb * (1 - nvme_headroom),
                            host_mem_gb=machine.host_mem_gb * (1 - host_headroom),
                            nvme_gbps=machine.nvme_gbps * nvme_derate,
                            nvme_write_gbps=machine.nvme_write_gbps * nvme_derate)
    return m, {"machine": machine, "nvme_headroom": nvme_headroom,
               "host_headroom": host_headroom, "nvme_derate": nvme_derate,
               "nvme_measured": measured}


def default_global_batch(seq, ranks, tokens=DEFAULT_TOKENS_PER_STEP):
    """Sequences per step for ``tokens`` tokens, rounded up to a multiple of ``ranks``."""
    per_rank = max(1, math.ceil(tokens / (seq * ranks)))
    return per_rank * ranks


#: tiling tried when nothing fits untiled: tiles of Gmax / f elements (memory-centric
#: tiling; params paged: one rank, or ZeRO stage 3 without ZeRO++): the step-time model is the same, only the fetch window
#: shrinks (docs/estimator.md, "Memory-centric tiling")
TILE_FRACTIONS = (4, 16)


def _zeropp(knobs) -> bool:
    return bool(knobs.qwz or knobs.hpz > 1 or knobs.qgz)


def _tile_choices(spec, knobs, R, params_home):
    """``tiling.max_group_gb`` values to try after the untiled depths (none when tiling does
    not apply or is set already; nor with LoRA: not modelled)."""
    if params_home == "none" or knobs.tiling_max_group_gb is not None \
            or knobs.lora_rank is not None \
            or knobs.grouping != "module" or (R > 1 and (knobs.zero_stage != 3 or _zeropp(knobs))):
        return []
    G = spec.group_numel("module")
    out = []
    for f in TILE_FRACTIONS:
        gb = round(max(1, G // f) * knobs.lp / GB, 6)
        if gb > 0 and spec.fetched_numel("module", int(gb * GB) // knobs.lp) < G \
                and gb not in out:
            out.append(gb)
    return out


def _divisors(n):
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _key(ch):
    k = ch.knobs
    return (round(ch.step.step_s, 9 - int(math.floor(math.log10(max(ch.step.step_s, 1e-12))))),
            ch.lossy, _ACT_RANK[(k.activation_home, k.activation_scope)],
            _HOME_RANK[ch.params_home] + _HOME_RANK[ch.optimizer_home], ch.checkpointing,
            -ch.micro_batch)


def make_plan(spec, machine, knobs, *, global_batch=None, micro_batch=None, grad_accum=None,
              allow_lossy=False, checkpointing=None, activations=ACTIVATION_CHOICES,
              depths=DEPTHS, alternatives=5, homes=None, nvme_headroom=NVME_HEADROOM,
              host_headroom=HOST_HEADROOM, nvme_derate=None, clip=PLAN_CLIP, drive_tbw=None):
    """Search the configurations (module docstring) and return a :class:`Plan`.

    spec: a ModelSpec (its ``batch`` is ignored); knobs: the base Knobs (precision,
    zero stage, clipping, host cap, tile, grouping ... are kept; homes, prefetch depth,
    accumulation, activation offload and, with ``allow_lossy``, the state and
    accumulation dtypes are searched).  ``global_batch``: sequences per optimizer step
    across all ranks (default: :func:`default_global_batch`, or ``micro_batch *
    grad_accum * R`` when both are given); ``micro_batch`` / ``grad_accum`` pin one of
    them.  ``checkpointing``: None searches both, True/False pins it.  ``homes``: only
    these ``(params, optimizer)`` pairs (default: every valid pair).  ``nvme_headroom``,
    ``host_headroom``, ``nvme_derate``: :func:`planned_machine`; ``clip``: the gradient
    clipping planned when ``knobs`` has none (0: none); ``drive_tbw``: the node's drives'
    rated TB written (drive life in :meth:`Plan.wear`).
    """
    from . import evaluate_config  # the estimator's per-configuration evaluation
    from .lora import check_knobs

    check_knobs(knobs)
    machine, assumptions = planned_machine(machine, nvme_headroom, host_headroom, nvme_derate)
    if clip and not knobs.gradient_clipping:
        knobs = dataclasses.replace(knobs, gradient_clipping=float(clip))
    assumptions["gradient_clipping"] = knobs.gradient_clipping
    assumptions["drive_tbw"] = drive_tbw

    R = machine.ranks
    if global_batch is None:
        if micro_batch is not None and grad_accum is not None:
            global_batch = micro_batch * grad_accum * R
        else:
            global_batch = default_global_batch(spec.seq, R)
            if micro_batch is not None:
                global_batch = math.ceil(global_batch / (micro_batch * R)) * micro_batch * R
            elif grad_accum is not None:
                global_batch = math.ceil(global_batch / (grad_accum * R)) * grad_accum * R
    if not isinstance(global_batch, int) or global_batch < 1 or global_batch % R:
        raise EstimateError(f"the global batch ({global_batch!r} sequences per step) must be a "
                            f"positive multiple of the {R} rank(s)")
    per_rank = global_batch // R
    pairs = []
    for B in _divisors(per_rank):
        A = per_rank // B
        if micro_batch is not None and B != micro_batch:
            continue
        if grad_accum is not None and A != grad_accum:
            continue
        pairs.append((B, A))
    if not pairs:
        raise EstimateError(f"no micro-batch x accumulation gives {per_rank} sequences per rank "
                            f"with micro_batch={micro_batch}, grad_accum={grad_accum}")
    states = ("fp32", "bf16") if allow_lossy else (knobs.state_dtype,)
    if not allow_lossy and knobs.state_dtype != "fp32":
        raise EstimateError("optimizer.state_dtype bf16 is lossy: pass --allow-lossy to plan with it")
    variants = (True, False) if checkpointing is None else (bool(checkpointing),)
    host_cap = knobs.host_cap_gb
    if host_cap is None and R == 1 and machine.host_mem_gb:
        # one process pages gradients to NVMe only under offload.host_memory_gb: the plan
        # sets it to the RAM left after the reserve (as the estimator assumes)
        host_cap = max(0.0, (machine.host_mem_gb * GB - host_reserve_bytes(machine)) / GB)
    valid = valid_configs(knobs)
    if homes is None:
        homes = valid
    else:
        homes = [tuple(h) for h in homes]
        bad = [h for h in homes if h not in valid]
        if bad:
            raise EstimateError(f"homes {bad} are not valid at zero_stage {knobs.zero_stage}; "
                                f"valid (params, optimizer) homes: {valid}")
    evaluated = 0
    found = []          # fitting choices
    near = []           # non-fitting, for "closest"
    rejected = []       # every non-fitting choice (the reasons quote their limits)
    for B, A in pairs:
        s = dataclasses.replace(spec, batch=B)
        gdts = ("fp32", "bf16") if allow_lossy and A > 1 else ("fp32",)
        for sd in states:
            for gd in gdts:
                for ah, sc in activations:
                    for p, o in homes:
                        done = {v: False for v in variants}
                        for d, tile in [(d, None) for d in depths] + [
                                (depths[-1], t) for t in _tile_choices(spec, knobs, R, p)]:
                            if tile is not None and all(done.values()):
                                break
                            k = dataclasses.replace(knobs, prefetch_depth=d, grad_accum=A,
                                                    state_dtype=sd, grad_accum_dtype=gd,
                                                    activation_home=ah, activation_scope=sc,
                                                    host_cap_gb=host_cap)
                            if tile is not None:
                                k = dataclasses.replace(k, tiling_max_group_gb=tile)
                            ce = evaluate_config(s, machine, k, p, o)
                            evaluated += 1
                            for v in variants:
                                if done[v]:
                                    continue
                                ch = Choice(p, o, v, k, B, ce, host_cap if R == 1 else knobs.host_cap_gb)
                                if ch.fits:
                                    found.append(ch)
                                    done[v] = True
                                    continue
                                rejected.append(ch)
                                if d == depths[-1] and tile is None:
                                    near.append(ch)
                            if all(done.values()):
                                break
    n_act = len(activations)
    searched = (f"{len(homes)} homes x {len(variants)} checkpointing x {n_act} activation "
                f"placements x {len(pairs)} micro-batch/accumulation splits x "
                f"{len(depths)} prefetch depths" + (" x lossy dtypes" if allow_lossy else " (lossless)"))
    found.sort(key=_key)
    best = found[0] if found else None
    alts, seen = [], set()
    for ch in found[1:]:
        k = ch.knobs
        fam = (ch.params_home, ch.optimizer_home, ch.checkpointing, k.activation_home,
               k.activation_scope, ch.lossy)
        if fam in seen or fam == (best.params_home, best.optimizer_home, best.checkpointing,
                                  best.knobs.activation_home, best.knobs.activation_scope,
                                  best.lossy):
            continue
        seen.add(fam)
        alts.append(ch)
        if len(alts) >= alternatives:
            break
    closest = None
    if best is None and near:
        from .report import overshoot   # the closest: the smallest binding need / have
        closest = min(near, key=lambda ch: (overshoot(ch.estimate.totals, ch.variant, machine,
                                                      ch.knobs), len(ch.problems), -ch.micro_batch,
                                            _ACT_RANK[(ch.knobs.activation_home,
                                                       ch.knobs.activation_scope)]))
    model = dataclasses.replace(spec, batch=best.micro_batch if best else 1)
    return Plan(model, machine, global_batch, allow_lossy, best, alts, closest, evaluated,
                len(found), searched, candidates=found, rejected=rejected,
                assumptions=assumptions, lora=knobs if knobs.lora_rank is not None else None)
