"""`infinity finetune --auto`: plan the run for this machine, then apply the plan.

The model is counted on the meta device (:func:`infinity.estimate.spec_from_module`);
the machine is this one as it is now: RAM = ``MemAvailable`` (the machine may be
shared; ``offload.host_memory_gb`` in ``--config`` caps it further), NVMe = the free
space at the first swap path, NVMe bandwidth from a saved ``infinity bench-io`` result
when there is one (else the estimator's default), and the achieved compute rate
measured here, over about a second, at the planned micro-batch and sequence: the whole
model's forward+backward where one pass costs at most :data:`BLOCK_PROBE_MAX_FLOP`
(:func:`measure_model_tflops`: small models, where embedding, head and per-pass costs
weigh), else one transformer block of the model's width (:func:`measure_block_tflops`),
else matrix products of the model's shape; on a CPU-only machine also the rate of a copy
into fresh host memory (:func:`measure_copy_gbps`: activation offload copies run on the
computing cores).  The
planner (:mod:`infinity.estimate.planner`) then picks homes, activation checkpointing
and offload, micro-batch x accumulation (their product stays the run's batch) and the
prefetch depth; lossy choices only with ``--allow-lossy``.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger("infinity.finetune")


@dataclass
class AutoPlan:
    plan: object            # infinity.estimate.planner.Plan
    config: dict            # the run's config with the plan applied
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    predicted_step_s: float
    predicted_host_bytes: int    # peak host memory above the runtime (no reserve, no init staging)
    predicted_nvme_bytes: int    # swap space the plan uses (files)
    machine: object

    def lines(self):
        m = self.machine
        return [self.plan.headline(),
                f"auto: planned for this machine: {m.host_mem_gb:g} GB RAM available, "
                f"{m.nvme_gb:g} GB free for swap, NVMe {m.nvme_gbps:g}/{m.nvme_write_gbps:g} GB/s "
                f"read/write, {m.tflops * 1000:.4g} GFLOPS measured"
                + (f", host copies {m.host_copy_gbps:g} GB/s" if not m.gpus else "") +
                f"; predicted host memory "
                f"{self.predicted_host_bytes / 1e9:.3g} GB, NVMe {self.predicted_nvme_bytes / 1e9:.3g} GB"] \
            + [f"auto: why {r}" for r in self.plan.reasons()]


def mem_available_gb():
    """``MemAvailable`` of this machine in GB (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 0.0


def _passes_per_s(step, seconds, *, min_passes=2, sync=None, check_every=1):
    """Calls of ``step`` per second: one warm-up call, then calls repeated for about
    ``seconds`` (at least ``min_passes``), timed in total.  ``sync`` (a device's
    synchronize) brackets the timed calls and runs before each clock check, which happens
    every ``check_every`` calls (device work queues without waiting in between)."""
    sync = sync or (lambda: None)
    step()
    sync()
    n, t0 = 0, time.perf_counter()
    while True:
        step()
        n += 1
        if n % check_every:
            continue
        sync()
        dt = time.perf_counter() - t0
        if dt >= seconds and n >= min_passes:
            return n / dt


def measure_tflops(hidden, tokens, *, seconds=1.0):
    """Achieved TFLOPS of fp32 ``(tokens x H) @ (H x 4H)`` products on this process's
    threads: total FLOPs over total time of products repeated for about ``seconds`` after
    one warm-up (a sustained rate: on a shared machine a few short products catch a burst
    of other work or a quiet moment, and the run that follows sees neither)."""
    import torch

    t = max(1, min(int(tokens), 8192))
    h = max(1, int(hidden))
    a, b = torch.randn(t, h), torch.randn(h, 4 * h)
    return 2 * t * h * 4 * h * _passes_per_s(lambda: torch.mm(a, b), seconds, min_passes=3) / 1e12


#: a block probe costing more than this (FLOPs of one forward+backward) falls back to the
#: matrix-product probe: a model that large is dominated by its large products anyway
BLOCK_PROBE_MAX_FLOP = 40e9


def measure_block_tflops(spec, seq, micro_batch, *, seconds=1.0, device=None, dtype=None):
    """The compute rate the estimator should use for this model at this micro-batch:
    forward+backward of one pre-norm transformer block of the model's width (attention over
    ``seq`` with the model's heads, an MLP holding the rest of a block's parameters), fp32,
    on this process's threads, repeated for about ``seconds``, counted the estimator's way
    (``6 * block params * tokens``).  The rate then carries what the FLOP count leaves out
    (attention scores, norms, activations, small-batch inefficiency): measured 0.5-0.75x of
    the matrix-product rate on the shipped tiny models.  None when one pass would cost more
    than :data:`BLOCK_PROBE_MAX_FLOP` (use :func:`measure_tflops`).  ``device`` / ``dtype``:
    probe on that device in that precision (the GPU check: ``cuda``, bf16; the FLOP limit
    then does not apply, and the device is synchronized around the timed passes)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    H = int(spec.hidden)
    heads = int(spec.heads or max(1, H // 64))
    if H % heads:
        heads = 1
    per_block = (spec.params - (spec.vocab or 0) * H) / max(1, spec.layers)
    ffn = max(H, int((per_block - 4 * H * H) / (2 * H)))
    b, S = max(1, int(micro_batch)), max(1, int(seq))
    p_block = 4 * H * H + 2 * H * ffn
    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    if 6 * p_block * b * S > BLOCK_PROBE_MAX_FLOP and not cuda:
        return None
    kw = {"device": device, "dtype": dtype or torch.float32}
    ln1, ln2 = nn.LayerNorm(H, **kw), nn.LayerNorm(H, **kw)
    qkv, out = nn.Linear(H, 3 * H, bias=False, **kw), nn.Linear(H, H, bias=False, **kw)
    up, down = nn.Linear(H, ffn, bias=False, **kw), nn.Linear(ffn, H, bias=False, **kw)
    x = torch.randn(b, S, H, requires_grad=True, **kw)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        h = ln1(x)
        q, k, v = qkv(h).view(b, S, 3, heads, H // heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = x + out(a.transpose(1, 2).reshape(b, S, H))
        y = y + down(F.gelu(up(ln2(y))))
        y.sum().backward()

    return 6 * p_block * b * S * _passes_per_s(step, seconds, sync=sync,
                                                 check_every=4 if cuda else 1) / 1e12


def measure_model_tflops(config, spec, seq, micro_batch, *, seconds=1.0):
    """The rate of the model itself: forward+backward of the whole model (random weights,
    plain PyTorch, fp32, this process's threads) at ``micro_batch`` x ``seq``, repeated for
    about ``seconds``, counted the estimator's way (``6 * N * tokens``).  For a model this
    small the per-pass costs the block probe leaves out (embedding, head and loss, the
    model's own norms and activations, small-batch inefficiency) are a large part of the
    step: timing the model carries them all.  None when one pass would cost more than
    :data:`BLOCK_PROBE_MAX_FLOP`."""
    import torch

    from infinity.finetune.model import build_model

    b, S = max(1, int(micro_batch)), max(1, int(seq))
    if 6 * spec.params * b * S > BLOCK_PROBE_MAX_FLOP:
        return None
    model = build_model(config)
    vocab = int(getattr(config, "vocab_size", 0) or spec.vocab or 256)
    ids = torch.randint(0, vocab, (b, S))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    return 6 * spec.params * b * S * _passes_per_s(step, seconds) / 1e12


def measure_copy_gbps(nbytes=64 << 20, *, seconds=0.2):
    """GB/s of one copy into a fresh page-aligned host buffer (what activation offload does
    per saved tensor on a CPU-only rank), median of repeats over about ``seconds``."""
    import statistics

    import torch

    from infinity.io import aligned_empty

    src = torch.ones(nbytes, dtype=torch.uint8)
    rates, t_end = [], time.perf_counter() + seconds
    while len(rates) < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        aligned_empty(nbytes, torch.uint8, lock=False).copy_(src)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def model_config_path(spec):
    """The config.json behind a ``--model`` value (shipped name, directory or file)."""
    from infinity.finetune.model import (DEFAULT_MODEL, SHIPPED_MODELS, ModelError,
                                         shipped_model_config)

    spec = spec or DEFAULT_MODEL
    if spec in SHIPPED_MODELS:
        return shipped_model_config(spec)
    if os.path.isdir(spec):
        return os.path.join(spec, "config.json")
    if os.path.isfile(spec):
        return spec
    raise ModelError(f"--model {spec!r} is neither a shipped model nor a local file/directory")


def make_auto_plan(opts, cfg, *, seq_len, global_batch, allow_lossy=False):
    """Plan for this machine, ``global_batch`` sequences per optimizer step over all ranks
    (the run's): returns an :class:`AutoPlan` (or raises ``ValueError`` with
    the planner's reason when nothing fits)."""
    from infinity.estimate import EstimateError, knobs_from, spec_from_module
    from infinity.estimate.machine import Machine, detect_free_disk_gb, detect_gpus
    from infinity.estimate.planner import make_plan
    from infinity.finetune.model import build_model, load_model_config, parameters_on_meta
    from infinity.finetune.settings import find_bench_io_result

    config = load_model_config(model_config_path(opts.model))
    with parameters_on_meta():
        meta = build_model(config)
    spec = spec_from_module(meta, seq=seq_len)
    del meta
    paths = cfg["offload"]["nvme_paths"]
    kw = dict(gpus=detect_gpus(), host_mem_gb=round(mem_available_gb(), 2),
              nvme_gb=round(detect_free_disk_gb(paths[0]), 1), nvme_drives=1)
    if opts.use_bench_io:
        from infinity.profile.summary import load_ceilings

        found, _ = find_bench_io_result(paths)
        if found:
            try:
                ceil = load_ceilings(found)
                kw.update({k: ceil[c] for k, c in (("nvme_gbps", "nvme_read"),
                                                   ("nvme_write_gbps", "nvme_write")) if c in ceil})
            except (OSError, ValueError) as e:
                log.warning("auto: ignoring bench-io result %s: %s", found, e)
    # LoRA (--lora R): the planner counts adapters on every projection of the blocks and
    # the frozen base in its stored format (offload.frozen_weights)
    lora = getattr(opts, "lora", None)
    knobs = knobs_from(cfg, {"lora_rank": lora} if lora else {})

    def rate(micro_batch):
        r = measure_model_tflops(config, spec, seq_len, micro_batch)
        if r is None:
            r = measure_block_tflops(spec, seq_len, micro_batch)
        return r if r is not None else measure_tflops(spec.hidden, seq_len * micro_batch)

    def plan_with(tflops):
        if tflops is not None:
            kw["tflops"] = tflops
        try:
            # this machine as it is now (MemAvailable, free space, measured rates; the
            # engine keeps its own reserves), and the run's own clipping: nothing added
            out = make_plan(spec, Machine(**kw), knobs, global_batch=global_batch,
                            allow_lossy=allow_lossy, nvme_headroom=0.0, host_headroom=0.0,
                            nvme_derate=1.0, clip=0.0)
        except EstimateError as e:
            raise ValueError(f"--auto: {e}") from e
        if out.best is None:
            raise ValueError(f"--auto: {out.headline()}")
        return out

    cpu = not kw["gpus"]
    if cpu:
        kw["host_copy_gbps"] = round(measure_copy_gbps(), 2)
    # CPU: plan with the matrix-product rate (cheap, small), then measure the rate of one
    # block at the micro-batch the plan chose (its memory within what the plan gives one
    # micro-batch's activations) and plan again; once more if the micro-batch changed
    plan = plan_with(measure_tflops(spec.hidden, seq_len * global_batch) if cpu else None)
    if cpu:
        for _ in range(2):
            b = plan.best.micro_batch
            plan = plan_with(rate(b))
            if plan.best.micro_batch == b:
                break
    machine = Machine(**kw)
    b = plan.best
    from infinity.finetune.settings import deep_merge

    new = deep_merge(cfg, b.config())
    c, v = b.estimate, b.variant
    init_only = sum(i.nbytes for i in c.plan.items if "initialisation only" in i.name)
    off = c.plan.activation_offload.get(v)
    off_host = off.nbytes if off is not None and off.tier == "pinned" else 0
    host = c.totals["pinned"] + c.totals["pageable"] + off_host - init_only + \
        (c.totals[f"device_{v}"] if machine.cpu_only else 0)
    nvme = c.totals["nvme"] + (off.nbytes if off is not None and off.tier == "nvme" else 0)
    return AutoPlan(plan, new, b.micro_batch, b.grad_accum, b.checkpointing, b.step.step_s,
                    host, nvme, machine)
