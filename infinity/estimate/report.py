"""Text rendering of an :class:`infinity.estimate.Estimate` (what ``infinity estimate`` prints)."""
from __future__ import annotations

import dataclasses

from .machine import GB, fmt_seconds, machine_lines
from .memory_plan import TIER_NAMES
from .step_time import BOUND_NAMES, phase_text

NOTATION = ("N params, R ranks, r ranks/node, lp bytes/param (precision), sb bytes/Adam moment, "
            "Gmax largest group, d prefetch depth, T tile elements, D tile ring slots, "
            "S seq, B micro-batch, H hidden, L layers, V vocab, a heads, A grad accumulation")


def _gb(n):
    return f"{n / GB:,.2f}"


def fmt_num(n):
    if n >= 1e12:
        return f"{n / 1e12:.4g}T"
    return f"{n / 1e9:.4g}B" if n >= 1e9 else (f"{n / 1e6:.4g}M" if n >= 1e6 else str(n))


def format_header(est):
    """The machine first (each value with its source), then the model and the settings."""
    s, m, k = est.model, est.machine, est.knobs
    lines = machine_lines(m) + [
        f"model: {fmt_num(s.params)} parameters ({s.source}), L={s.layers} H={s.hidden}"
        + (f" V={s.vocab}" if s.vocab else "") + (f" heads={s.heads}" if s.heads else "")
        + f", S={s.seq} B={s.batch} per rank",
        f"infinity: precision {k.precision}, zero_stage {k.zero_stage}, prefetch depth {k.prefetch_depth}, "
        f"grad accumulation {k.grad_accum}, tile {k.tile_numel} x {k.pipeline_depth} slots, "
        f"Adam states {k.state_dtype}, largest group {fmt_num(s.group_numel(k.grouping))} params "
        f"(grouping: {k.grouping})" + (f", host cap {k.host_cap_gb:g} GB" if k.host_cap_gb else ""),
    ]
    if k.lora_rank is not None:
        lines.append(lora_line(s, m, k))
    return lines


def lora_line(spec, machine, knobs):
    """``LoRA: rank 64, 3.36B adapters train; frozen base 1T params as nf4 ...``."""
    from .lora import adapter_params, dequant_rate, frozen_home_bytes
    base = frozen_home_bytes(spec, knobs)
    fmt = knobs.frozen_dtype or f"{knobs.precision} (not quantized)"
    if knobs.frozen_dtype:
        fmt += f", group {knobs.frozen_group_size}" + (", double quant" if
                                                        knobs.frozen_double_quant else "")
    out = (f"LoRA: rank {knobs.lora_rank}, {fmt_num(adapter_params(spec, knobs.lora_rank))} "
           f"adapter params train; frozen base {fmt_num(spec.params)} params as {fmt}: "
           f"{base / GB:,.1f} GB at its home ({base / spec.params:.4g} B/param)")
    if knobs.frozen_dtype:
        out += (f", dequantized at {dequant_rate(machine, knobs):.4g} GB/s"
                + ("" if machine.dequant_gbps else " (default)"))
    return out


def binding_limit(totals, variant, machine, knobs):
    """The limit a configuration overshoots the most (need / have), as one phrase, e.g.
    "device: needs 242.1 GB per GPU, has 78 GB usable"; None when it fits every limit.

    ``totals``: a ConfigEstimate's totals, ``variant``: "checkpointing" or "none",
    ``knobs``: the configuration's Knobs (its activation offload home counts on NVMe)."""
    over = exceeded_limits(totals, variant, machine, knobs)
    return over[0] if over else None


def exceeded_limits(totals, variant, machine, knobs):
    """Every limit the configuration exceeds (phrases as :func:`binding_limit`), the binding
    one (largest need / have) first."""
    return [t for _, t in sorted(_overshoots(totals, variant, machine, knobs), reverse=True)]


def overshoot(totals, variant, machine, knobs):
    """need / have of each exceeded limit, largest first (empty: fits every limit): the
    planner's "closest" plan is the one with the smallest (compared in that order)."""
    return tuple(sorted((r for r, _ in _overshoots(totals, variant, machine, knobs)), reverse=True))


def _overshoots(totals, variant, machine, knobs):
    v = variant
    cands = []   # (need / have, phrase)
    if not machine.cpu_only:
        need, have = totals[f"device_{v}"], (machine.gpu_mem_gb - machine.gpu_reserve_gb) * GB
        cands.append((need, have, f"device: needs {need / GB:,.1f} GB per GPU, has "
                                  f"{have / GB:,.4g} GB usable ({machine.gpu_mem_gb:g} GB - "
                                  f"{machine.gpu_reserve_gb:g} GB reserve)"))
    host = totals[f"host_{v}"]
    if machine.host_mem_gb:
        have = machine.host_mem_gb * GB
        cands.append((host, have, f"host: needs {host / GB:,.1f} GB per node, has "
                                  f"{have / GB:,.4g} GB RAM"))
    if knobs.host_cap_gb:
        need, have = host - totals["host_reserve"], knobs.host_cap_gb * GB
        cands.append((need, have, f"host: needs {need / GB:,.1f} GB per node (without the "
                                  f"{totals['host_reserve'] / GB:.3g} GB reserve), has "
                                  f"{knobs.host_cap_gb:g} GB (offload.host_memory_gb)"))
    nvme = totals["nvme"] + (totals.get(f"activation_offload_{v}", 0)
                             if knobs.activation_home == "nvme" else 0)
    have = machine.nvme_gb * GB
    cands.append((nvme, have, f"NVMe: needs {nvme / GB:,.1f} GB per node, has {have / GB:,.4g} GB"))
    return [(need / have if have else float("inf"), text) for need, have, text in cands if need > have]


def format_summary_table(est):
    cpu = est.machine.cpu_only
    dev = "device*" if cpu else "device/GPU"
    lines = [f"{'':<14}{dev:^26}{'host per node':^21}{'':>11}{'fits':>10}{'step s':^19}",
             f"{'params':<7}{'optim':<7}{'ckpt':>13}{'no ckpt':>13}{'pinned':>10}"
             f"{'pageable':>11}{'NVMe':>11}{'ckpt/no':>10}{'ckpt':>10}{'no ckpt':>9}  bound"]
    for c in est.configs:
        t = c.totals
        fit = "/".join("yes" if c.fits[v] else "no" for v in ("checkpointing", "none"))
        sc, sf = c.steps["checkpointing"], c.steps["none"]
        lines.append(f"{c.params_home:<7}{c.optimizer_home:<7}{_gb(t['device_checkpointing']):>13}"
                     f"{_gb(t['device_none']):>13}{_gb(t['pinned']):>10}{_gb(t['pageable']):>11}"
                     f"{_gb(t['nvme']):>11}{fit:>10}{fmt_seconds(sc.step_s):>10}{fmt_seconds(sf.step_s):>9}  "
                     f"{BOUND_NAMES.get(sc.bound, sc.bound)}"
                     + ("  (grads on NVMe)" if c.plan.grads_on_nvme else ""))
    lines.append("GB = 10^9 bytes; device per GPU" + (" (*CPU-only: counted in host memory)" if cpu else "")
                 + ", host and NVMe per node; host fit also counts "
                 f"{_gb(est.configs[0].totals['host_reserve']) if est.configs else '?'} GB reserve "
                 "for the OS and the torch runtime")
    return lines


def format_config(est, c):
    lines = [f"== {c.name} =="]
    for tier in ("device", "pinned", "pageable", "nvme"):
        items = [i for i in c.plan.items if i.tier == tier]
        if tier == "device":
            items = items + [c.plan.activations["checkpointing"], c.plan.activations["none"]]
            items = items + [dataclasses.replace(it, name=f"{it.name} ({'with' if v == 'checkpointing' else 'without'} checkpointing)")
                             for v, it in c.plan.activation_offload.items()]
        if not items:
            continue
        label = TIER_NAMES[tier]
        if tier == "device" and est.machine.cpu_only:
            label = "device tier (host memory on a CPU-only node)"
        lines.append(f"  {label}:")
        for i in items:
            lines.append(f"    {i.name:<44}{_gb(i.nbytes):>12} GB   {i.formula}")
    for n in c.plan.notes:
        lines.append(f"  note: {n}")
    for v in ("checkpointing", "none"):
        label = "with activation checkpointing" if v == "checkpointing" else "without checkpointing"
        if c.fits[v]:
            lines.append(f"  fits {label}")
        else:
            lines.append(f"  does NOT fit {label}: " + "; ".join(c.problems[v]))
    s = c.steps["checkpointing"]
    A = est.knobs.grad_accum
    lines.append(f"  step time (with checkpointing) = {s.formula(A)}, {s.tokens_per_s:.3g} tokens/s")
    for ph in (s.fwd_bwd, s.optimizer):
        lines.append(f"    {phase_text(ph)}")
        for d in ph.derivation:
            lines.append(f"      {d}")
    tr = s.traffic
    lines.append("    bytes per step: " + (", ".join(f"{k} {tr[k] / GB:,.1f} GB" for k in tr if tr[k])
                                         or "none moved between tiers"))
    return lines


def format_estimate(est, details=False):
    """The header, the table and the verdict; ``details`` (``--explain``) adds each
    configuration's items, formulas and step-time derivation."""
    lines = format_header(est) + [""] + format_summary_table(est) + ["", "Verdict: " + est.verdict()]
    if est.best is None and est.closest() is not None:
        c, v = est.closest()
        limit = binding_limit(c.totals, v, est.machine, est.knobs)
        if limit:
            lines += [f"Binding limit of the closest ({c.name}): {limit}"]
    if est.gpu_caveat():
        lines += [est.gpu_caveat()]
    if not details:
        lines += ["", "(per-configuration items, formulas and the step-time derivation: --explain)"]
    if details:
        lines += ["", "Notation: " + NOTATION, ""]
        for c in est.configs:
            lines += format_config(est, c) + [""]
    return "\n".join(lines).rstrip() + "\n"
