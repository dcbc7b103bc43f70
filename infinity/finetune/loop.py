"""The fine-tuning loop: batches -> engine forward/backward/step -> report.

One finetune *step* is one optimizer update: ``gradient_accumulation_steps``
micro-batches, each ``engine(input_ids=x, labels=x)`` + ``engine.backward`` +
``engine.step()`` (the engine updates at the accumulation boundary). The stop
flag is checked only at step boundaries, so a Ctrl-C never leaves a
half-accumulated update behind.
"""
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from infinity.finetune.report import LINKS, link_bytes

log = logging.getLogger("infinity.finetune")


@dataclass
class LoopOptions:
    steps: int                      # last step number to run (inclusive)
    start_step: int = 0             # steps already done (resume)
    grad_accum: int = 1
    save_every: int = 0             # 0: only at the end (when a checkpointer is given)
    world_size: int = 1
    curriculum: object = None       # an infinity.curriculum.SeqlenSchedule: batches truncated


@dataclass
class LoopResult:
    last_step: int
    stop_reason: str
    saved: list = field(default_factory=list)


def _global_mean(value):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from infinity.finetune.stop import collective_device

        t = torch.tensor([float(value)], dtype=torch.float64, device=collective_device())
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()
    return float(value)


def _global_sum(values):
    """Per-link byte counts summed over ranks (unchanged at world size 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from infinity.finetune.stop import collective_device

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=collective_device())
        dist.all_reduce(t)
        return [int(v) for v in t.tolist()]
    return list(values)


def _grad_norm(stats):
    for key in ("grad_norm", "last_grad_norm"):
        v = stats.get(key) if isinstance(stats, dict) else None
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _lr(engine, stats):
    lr = getattr(engine, "lr", None)
    if callable(lr):
        lr = lr()
    if isinstance(lr, (list, tuple)):
        lr = lr[0] if lr else None
    if lr is None and isinstance(stats, dict):
        lr = stats.get("lr")
    return float(lr) if isinstance(lr, (int, float)) else float("nan")


def run(engine, batcher, opts, reporter, stopper, checkpointer=None, timeline=None,
        on_step_start=None):
    """Train from ``opts.start_step + 1`` to ``opts.steps``. Returns :class:`LoopResult`.
    ``timeline`` (an ``infinity.profile.Timeline`` or None) gets a mark at each step start,
    unless the engine marks it itself (the infinity engine marks the end of each optimizer
    step with its number: two marks a moment apart would label every boundary twice);
    ``on_step_start(step)`` (e.g. starting a profile after warm-up) runs at each step start."""
    if timeline is not None and getattr(engine, "timeline", None) is timeline:
        timeline = None
    step = opts.start_step
    saved = []
    stop_reason = "completed"
    prev_bytes = link_bytes(engine.stats())
    reporter.start()
    for step_no in range(opts.start_step + 1, opts.steps + 1):
        if stopper.should_stop():
            stop_reason = f"{stopper.reason}: stopped cleanly after step {step}"
            break
        lr = _lr(engine, None)
        if on_step_start is not None:
            on_step_start(step_no)
        if timeline is not None:
            timeline.mark_step(step_no)
        t0 = time.perf_counter()
        loss_sum = 0.0
        tokens = 0
        seqlen = opts.curriculum.length(step_no - 1) if opts.curriculum is not None else None
        if seqlen is not None:
            engine.set_curriculum_length(seqlen)
        for micro in range(opts.grad_accum):
            x = batcher.batch((step_no - 1) * opts.grad_accum + micro)
            if seqlen is not None:    # the length of this update (step_no - 1 updates done)
                x = opts.curriculum.truncate(x, step_no - 1)
            out = engine(input_ids=x, labels=x)
            loss = out.loss if hasattr(out, "loss") else out["loss"]
            engine.backward(loss)
            stopper.check_abort()
            engine.step()
            stopper.check_abort()
            loss_sum += float(loss.detach())
            tokens += x.numel()
        dt = time.perf_counter() - t0
        step = step_no
        stats = engine.stats()
        loss_val = _global_mean(loss_sum / opts.grad_accum)
        if not math.isfinite(loss_val):
            log.warning("step %d: loss is %s", step, loss_val)
        now_bytes = link_bytes(stats)
        delta = dict(zip(LINKS, _global_sum(max(0, now_bytes[k] - prev_bytes[k]) for k in LINKS)))
        prev_bytes = now_bytes
        total_tokens = tokens * opts.world_size
        rec = {
            "step": step,
            "loss": loss_val,
            "lr": lr,
            "grad_norm": _grad_norm(stats),
            "tokens": total_tokens,
            "tokens_per_s": total_tokens / dt if dt > 0 else 0.0,
            "step_time_s": dt,
            "bytes": delta,
            "gbps": {k: (delta[k] / dt / 1e9 if dt > 0 else 0.0) for k in LINKS},
        }
        if seqlen is not None:
            rec["seqlen"] = min(seqlen, x.shape[1])
        reporter.step(rec)
        if reporter.stdout_broken:
            stopper.request("stdout closed")
        if checkpointer is not None and opts.save_every and step % opts.save_every == 0 \
                and step != opts.steps:
            saved.append(checkpointer.save(engine, step))
    if checkpointer is not None and step > opts.start_step and \
            (not saved or saved[-1] != checkpointer.tag_for(step)):
        saved.append(checkpointer.save(engine, step))
    return LoopResult(last_step=step, stop_reason=stop_reason, saved=saved)
