"""Text rendering of an :class:`infinity.estimate.Estimate` (what ``infinity estimate`` prints)."""
from __future__ import annotations

import dataclasses

from .machine import GB
from .memory_plan import TIER_NAMES
from .step_time import BOUND_NAMES, phase_text

NOTATION = ("N params, R ranks, r ranks/node, lp bytes/param (precision), sb bytes/Adam moment, "
            "Gmax largest group, d prefetch depth, T tile elements, D tile ring slots, "
            "S seq, B micro-batch, H hidden, L layers, V vocab, a heads, A grad accumulation")


def _gb(n):
    return f"{n / GB:,.2f}"


def _num(n):
    if n >= 1e12:
        return f"{n / 1e12:.4g}T"
    return f"{n / 1e9:.4g}B" if n >= 1e9 else (f"{n / 1e6:.4g}M" if n >= 1e6 else str(n))


def format_header(est):
    s, m, k = est.model, est.machine, est.knobs
    lines = [
        f"model: {_num(s.params)} parameters ({s.source}), L={s.layers} H={s.hidden}"
        + (f" V={s.vocab}" if s.vocab else "") + (f" heads={s.heads}" if s.heads else "")
        + f", S={s.seq} B={s.batch} per rank",
        "machine: " + (f"{m.nodes} nodes x " if m.nodes > 1 else "")
        + (f"{m.gpus} GPU x {m.gpu_mem_gb:g} GB" if m.gpus else "CPU only (device tier = host memory)")
        + f", RAM {m.host_mem_gb:g} GB, NVMe {m.nvme_gb:g} GB on {m.nvme_drives} drive(s) "
        f"({m.nvme_gbps:g} GB/s read, {m.nvme_write_gbps:g} GB/s write)",
        f"         PCIe {m.pcie_gbps:g} GB/s/GPU, {m.tflops:g} TFLOPS/rank achieved, collectives "
        f"{m.interconnect_gbps:g} GB/s/GPU, CPU Adam {m.cpu_adam_gparams:g} G params/s/node",
        f"infinity: precision {k.precision}, zero_stage {k.zero_stage}, prefetch depth {k.prefetch_depth}, "
        f"grad accumulation {k.grad_accum}, tile {k.tile_numel} x {k.pipeline_depth} slots, "
        f"Adam states {k.state_dtype}, largest group {_num(s.group_numel(k.grouping))} params "
        f"(grouping: {k.grouping})" + (f", host cap {k.host_cap_gb:g} GB" if k.host_cap_gb else ""),
    ]
    return lines


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
                     f"{_gb(t['nvme']):>11}{fit:>10}{sc.step_s:>10.4g}{sf.step_s:>9.4g}  "
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
    lines.append(f"  step time (with checkpointing) = {A} x {s.fwd_bwd.seconds:.3g} s + "
                 f"{s.optimizer.seconds:.3g} s = {s.step_s:.3g} s, {s.tokens_per_s:.3g} tokens/s")
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
    if est.gpu_caveat():
        lines += [est.gpu_caveat()]
    if not details:
        lines += ["", "(per-configuration items, formulas and the step-time derivation: --explain)"]
    if details:
        lines += ["", "Notation: " + NOTATION, ""]
        for c in est.configs:
            lines += format_config(est, c) + [""]
    return "\n".join(lines).rstrip() + "\n"
