"""Why the planner chose what it chose: one sentence per choice, with the number that
decided it (``infinity finetune --auto``, ``infinity estimate --plan``).

Each sentence compares the chosen configuration with the configuration that differs from
it only in that choice (or, when no such configuration was evaluated, the closest one that
does): either that one does not fit -- the sentence then quotes the limit it exceeds --
or it fits and is slower -- the sentence gives both step times.  The comparisons come from
the candidates :func:`infinity.estimate.planner.make_plan` evaluated (``Plan.candidates``:
the fitting ones, fastest first; ``Plan.rejected``: the others), so a reason never adds a
term the plan itself did not use.
"""
from __future__ import annotations

from .machine import GB, fmt_seconds

__all__ = ["plan_reasons"]

_HOME_ORDER = {"none": 0, "cpu": 1, "nvme": 2}


def _act(ch):
    return ch.knobs.activation_home, ch.knobs.activation_scope


def _facets(ch):
    k = ch.knobs
    return {"homes": (ch.params_home, ch.optimizer_home), "checkpointing": ch.checkpointing,
            "activations": _act(ch), "micro_batch": ch.micro_batch, "depth": k.prefetch_depth,
            "lossy": (k.state_dtype, k.grad_accum_dtype), "tiling": k.tiling_max_group_gb}


def _like(ch, best, **want):
    """``ch`` equals ``best`` except in the facets given (which must equal ``want``'s
    values, or satisfy them when a callable)."""
    a, b = _facets(ch), _facets(best)
    for key, val in a.items():
        if key in want:
            w = want[key]
            if not (w(val) if callable(w) else val == w):
                return False
        elif val != b[key]:
            return False
    return True


def _first(seq, pred):
    return next((c for c in seq if pred(c)), None)


def _gb(nbytes) -> str:
    x = nbytes / GB
    return f"{x:,.1f} GB" if x >= 10 else f"{x:.3g} GB"


def _secs(ch):
    return f"{fmt_seconds(ch.step.step_s)} s per step"


def _problem(ch):
    probs = ch.problems
    return probs[0] if probs else "does not fit"


def _versus(plan, best, what: str, **want) -> str | None:
    """The comparison with the configuration that differs from ``best`` in ``want``: a
    fitting one (``what`` takes N s per step, this one M s) or, failing that, a rejected
    one (``what`` does not fit: <limit>).  None when neither was evaluated."""
    alt = _first(plan.candidates, lambda c: _like(c, best, **want))
    if alt is not None:
        if alt.step.step_s <= best.step.step_s * 1.005:
            return f"{what} is no faster ({_secs(alt)}; ties go to the lossless, less offloaded)"
        return f"{what} takes {_secs(alt)}, this {_secs(best)}"
    rej = _first(plan.rejected, lambda c: _like(c, best, **want))
    if rej is None:
        return None
    return f"{what} does not fit ({_problem(rej)})"


def _home_reason(plan, b) -> str:
    p, o = b.params_home, b.optimizer_home
    head = f"homes offload.params {p}, offload.optimizer {o}"
    rank = _HOME_ORDER[p] + _HOME_ORDER[o]
    resident = sorted({(c.params_home, c.optimizer_home) for c in plan.candidates + plan.rejected
                       if _HOME_ORDER[c.params_home] + _HOME_ORDER[c.optimizer_home] < rank},
                      key=lambda h: (-(_HOME_ORDER[h[0]] + _HOME_ORDER[h[1]]), h[0] != p, h[1] != o))
    totals = b.estimate.totals
    v = b.variant
    m = plan.machine
    used = f"host memory {_gb(totals[f'host_{v}'])} of {m.host_mem_gb:,.1f} GB" \
        if m.host_mem_gb else f"host memory {_gb(totals[f'host_{v}'])}"
    if not resident:
        nxt = _first(plan.candidates, lambda c: (c.params_home, c.optimizer_home) != (p, o))
        tail = ""
        if nxt is not None:
            other = f"the fastest plan with other homes ({nxt.params_home}/{nxt.optimizer_home})"
            tail = f"; {other} is no faster ({_secs(nxt)})" \
                if nxt.step.step_s <= b.step.step_s * 1.005 else f"; {other} takes {_secs(nxt)}"
        return f"{head}: the least offloaded homes fit ({used}){tail}."
    h = resident[0]
    vs = _versus(plan, b, f"keeping more in memory (params {h[0]}, optimizer {h[1]})", homes=h)
    return f"{head}: {vs or 'no less offloaded home was evaluated'}; {used}."


def _checkpointing_reason(plan, b) -> str:
    head = f"activation checkpointing {'on' if b.checkpointing else 'off'}"
    vs = _versus(plan, b, "with it" if not b.checkpointing else "without it",
                 checkpointing=not b.checkpointing)
    if vs is None:
        return f"{head}: the only variant searched (pinned by the configuration)."
    return f"{head}: {vs}."


def _activation_reason(plan, b) -> str:
    home, scope = _act(b)
    if home == "none":
        head = "no activation offload"
        vs = _versus(plan, b, "the fastest offloaded placement",
                     activations=lambda a: a[0] != "none")
        act = b.estimate.plan.activations[b.variant].nbytes
        size = f" (activations {_gb(act)} per micro-batch)"
        return f"{head}{size}: {vs or 'the only placement searched'}."
    head = f"activations offloaded to {home} (scope {scope})"
    vs = _versus(plan, b, "keeping them on the device", activations=("none", "checkpoints"))
    return f"{head}: {vs or 'the only placement searched'}."


def _micro_batch_reason(plan, b) -> str:
    B, A = b.micro_batch, b.grad_accum
    head = f"micro-batch {B} x accumulation {A} ({B * A} sequences per rank and step)"
    larger = sorted({c.micro_batch for c in plan.candidates + plan.rejected if c.micro_batch > B})
    if not larger:
        vs = _versus(plan, b, "the fastest smaller micro-batch", micro_batch=lambda x: x < B)
        return f"{head}: the whole batch in one micro-batch per rank" + \
            (f"; {vs}." if vs else ".")
    nb = larger[0]
    vs = _versus(plan, b, f"micro-batch {nb}", micro_batch=nb)
    return f"{head}: {vs or f'micro-batch {nb} was not evaluated'}."


def _depth_reason(plan, b) -> str:
    d = b.knobs.prefetch_depth
    deepest = max(c.knobs.prefetch_depth for c in plan.candidates + plan.rejected)
    head = f"prefetch depth {d}"
    if b.params_home == "none":
        return f"{head}: the parameters stay on the device, nothing is fetched (depth unused)."
    if d >= deepest:
        dev = b.estimate.totals[f"device_{b.variant}"]
        where = "host memory (CPU-only: the device tier)" if plan.machine.cpu_only else \
            "device memory"
        return (f"{head}: the deepest read-ahead tried fits ({_gb(dev)} of {where}; "
                f"the step-time model does not depend on it, depth absorbs jitter).")
    vs = _versus(plan, b, f"depth {d + 1}", depth=d + 1)
    return f"{head}: {vs or f'depth {d + 1} was not evaluated'}."


def plan_reasons(plan) -> list[str]:
    """One sentence per choice of ``plan.best`` (homes, checkpointing, activation offload,
    micro-batch x accumulation, prefetch depth); empty when nothing fits."""
    b = plan.best
    if b is None:
        return []
    out = [_home_reason(plan, b), _checkpointing_reason(plan, b), _activation_reason(plan, b),
           _micro_batch_reason(plan, b), _depth_reason(plan, b)]
    if b.knobs.tiling_max_group_gb is not None:
        out.append(f"tiling above {b.knobs.tiling_max_group_gb:g} GB: nothing fits untiled at "
                   f"the shallowest prefetch depth.")
    return out
