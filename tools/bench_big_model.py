#!/usr/bin/env python
"""Train a transformer whose model states exceed host RAM, on this machine.

Builds a Llama-style causal LM (transformers, from a config) under ``infinity.Init`` with
parameters and optimizer states on NVMe, adopts it with ``infinity.initialize`` and trains
``--steps`` steps of random tokens, reporting parameters, model-state bytes vs host RAM,
construction/adoption/step times, peak RSS (``ru_maxrss``) and NVMe bytes moved per step.

Model states counted as DeepSpeed does for mixed precision: fp32 master + Adam m + v
(12 B/param) + bf16 params + bf16 grads (4 B/param) = 16 B/param.

Refuses (exit 2, clear message) when the NVMe path lacks the free space the run needs:
engine homes (bf16 params 2 B + fp32 master/m/v 12 B + spilled fp32 grads 4 B per param)
plus the Init copy (4 B/param, freed as it is adopted); the commit shadows take what
``--commit-shadow-gb`` says (default: automatic, what the free space leaves, up to 12 B/param;
Note [shadow budget]).  Reports the budget chosen, the most the shadows took and the groups
written after the commit decision.

``--ab``: alternate the optimizer step overlapped with backward (gradients streamed: each
group updated as its gradient arrives, Note [Streamed gradients]) and the serial step
(``engine.overlap_optimizer_step = False``) from step to step in the same process, and
print the medians of each.

    .venv/bin/python tools/bench_big_model.py --nvme-path /work/big-swap          # ~2.5B params
    .venv/bin/python tools/bench_big_model.py --layers 2 --hidden 512 --dry-run   # plan only
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import fio_bw  # noqa: E402  (fio's read / first write / rewrite, huge-page buffers)
from e2e_model import proc_io  # noqa: E402


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fio_gbps(path: str) -> dict | None:
    """fio on ``path`` in GB/s: ``read``, ``first_write`` and ``rewrite`` (None: no fio)."""
    bw = fio_bw(os.path.join(path, "fio"), 2048, 10)
    if bw is None:
        return None
    return {"read_gbps": bw["read"] / 1e9, "first_write_gbps": bw["first_write"] / 1e9,
            "rewrite_gbps": bw["write"] / 1e9}


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def count_params(a) -> int:
    h, i, L, V = a.hidden, a.intermediate, a.layers, a.vocab
    kv = h * a.kv_heads // a.heads
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h
    return L * per_layer + 2 * V * h + h


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--intermediate", type=int, default=6912)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--kv-heads", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nvme-path", default="./infinity-swap-big")
    ap.add_argument("--host-gb", type=float, default=6.0, help="offload.host_memory_gb")
    ap.add_argument("--device-gb", type=float, default=1.5, help="offload.device_memory_gb")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and checks only")
    ap.add_argument("--commit-shadow-gb", type=float, default=None,
                    help="offload.commit_shadow_gb (default: automatic from the free space)")
    ap.add_argument("--ab", action="store_true",
                    help="alternate overlapped (even steps) and serial (odd steps) optimizer steps")
    ap.add_argument("--json", action="store_true", help="print one JSON line at the end")
    ap.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="optimizer.state_dtype: the Adam moments' dtype (the master stays fp32)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="profile the last step into DIR (engine.profile: trace.json, "
                         "timeline.png, summary.txt)")
    ap.add_argument("--fio", action="store_true",
                    help="measure fio (tools/bench_e2e.py's fio_bw: io_uring, O_DIRECT, QD 32, "
                         "huge-page buffers, the best block shape; read, first write, rewrite) "
                         "on --nvme-path before the first and after the last step, and report "
                         "the step against the disk-bound time R/fio_read + W/fio_rewrite")
    a = ap.parse_args(argv)

    n = count_params(a)
    states = 16 * n
    ram = mem_total()
    states_b = 12 if a.state_dtype == "fp32" else 8     # master + m + v
    shadows = states_b * n if a.commit_shadow_gb is None else \
        min(states_b * n, int(a.commit_shadow_gb * 1e9))
    need_disk = int(1.05 * (2 + states_b + 4 + 4) * n) + \
        (0 if a.commit_shadow_gb is None else shadows)       # (automatic: what is left)
    os.makedirs(a.nvme_path, exist_ok=True)
    free = shutil.disk_usage(a.nvme_path).free
    print(f"model: Llama {a.layers} layers, hidden {a.hidden}, intermediate {a.intermediate}, "
          f"vocab {a.vocab}: {n / 1e9:.3f} B parameters")
    print(f"model states (fp32 master + m + v + bf16 params + bf16 grads, 16 B/param): "
          f"{states / 1e9:.1f} GB = {states / ram:.2f}x host RAM ({ram / 2**30:.1f} GiB)")
    print(f"NVMe: needs {need_disk / 1e9:.1f} GB free at {a.nvme_path}, has {free / 1e9:.1f} GB")
    if free < need_disk:
        print(f"refusing: {a.nvme_path} has {free / 1e9:.1f} GB free but this run needs "
              f"{need_disk / 1e9:.1f} GB (engine homes 18 B/param + Init copy 4 B/param + 5% "
              f"+ the commit shadows asked for); "
              f"free space, pick another --nvme-path, or shrink the model (--layers/--hidden)",
              file=sys.stderr)
        return 2
    if a.dry_run:
        return 0

    import torch
    torch.manual_seed(0)
    import infinity
    from transformers import AutoModelForCausalLM, LlamaConfig
    from infinity.zero.init import Init

    cfg = {"precision": "bf16", "zero_stage": 3,
           "offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [a.nvme_path],
                       "host_memory_gb": a.host_gb, "device_memory_gb": a.device_gb,
                       "commit_shadow_gb": a.commit_shadow_gb},
           "prefetch": {"depth": a.prefetch},
           "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.01,
                         "state_dtype": a.state_dtype}}
    lcfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads,
                       num_key_value_heads=a.kv_heads, max_position_embeddings=max(64, a.seq),
                       tie_word_embeddings=False, use_cache=False)
    res = {"params": n, "model_state_bytes": states, "host_ram_bytes": ram,
           "states_over_ram": states / ram, "rss_after_import": rss_now()}
    t0 = time.perf_counter()
    with Init(cfg):
        model = AutoModelForCausalLM.from_config(lcfg)
    res["construct_s"] = time.perf_counter() - t0
    res["rss_peak_after_construct"] = rss_peak()
    got = sum(p.numel() for p in model.parameters())
    if got != n:
        print(f"note: model has {got} parameters (formula said {n})", file=sys.stderr)
        res["params"] = n = got
    print(f"constructed under Init in {res['construct_s']:.1f} s, peak RSS "
          f"{res['rss_peak_after_construct'] / 2**30:.2f} GiB", flush=True)

    t0 = time.perf_counter()
    eng = infinity.initialize(model, cfg)
    res["initialize_s"] = time.perf_counter() - t0
    res["rss_peak_after_initialize"] = rss_peak()
    res["grads_spilled"] = bool(getattr(getattr(eng, "zero", None), "spill", False)) or \
        getattr(eng.placement, "grad_home", "host") == "nvme"
    res["commit_shadow_budget_bytes"] = eng.stats()["commit_shadow_budget_bytes"]
    res["optimizer_state_bytes"] = states_b * n
    print(f"commit shadows: budget {res['commit_shadow_budget_bytes'] / 1e9:.2f} GB = "
          f"{res['commit_shadow_budget_bytes'] / (states_b * n):.2f}x the optimizer states",
          flush=True)
    print(f"initialize (adopt) in {res['initialize_s']:.1f} s, peak RSS "
          f"{res['rss_peak_after_initialize'] / 2**30:.2f} GiB, grads spilled: "
          f"{res['grads_spilled']}", flush=True)
    if a.fio:
        res["fio_before"] = fio_gbps(a.nvme_path)
        if res["fio_before"] is None:
            print("--fio: fio did not run (see above)", file=sys.stderr)
            return 2
        print(f"fio before the steps: {res['fio_before']}", flush=True)
    g = torch.Generator().manual_seed(1)
    steps = []
    try:
        for i in range(a.steps):
            ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
            overlap = not (a.ab and i % 2)
            eng.overlap_optimizer_step = overlap
            prof = contextlib.nullcontext()
            if a.profile and i == a.steps - 1:
                prof = eng.profile(a.profile, note=f"bench_big_model step {i}")
            with prof:
                s0, k0 = eng.stats(), proc_io()
                t0 = time.perf_counter()
                out = eng(input_ids=ids, labels=ids)
                t1 = time.perf_counter()
                eng.backward(out.loss)
                t2 = time.perf_counter()
                eng.step()
                t3 = time.perf_counter()
                s1, k1 = eng.stats(), proc_io()
            st = {"loss": float(out.loss.detach().float()), "step_s": t3 - t0, "forward_s": t1 - t0,
                  "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                  "nvme_read_bytes": s1["nvme_read_bytes"] - s0["nvme_read_bytes"],
                  "nvme_write_bytes": s1["nvme_write_bytes"] - s0["nvme_write_bytes"],
                  # the kernel's count of this process's block-device bytes (/proc/self/io,
                  # io_uring workers included): O_DIRECT I/O shows up here 1:1
                  "kernel_read_bytes": k1["read_bytes"] - k0["read_bytes"],
                  "kernel_write_bytes": k1["write_bytes"] - k0["write_bytes"],
                  "rss_peak": rss_peak(), "overlap": overlap,
                  "groups_overlapped": s1.get("optimizer_groups_overlapped", 0)
                  - s0.get("optimizer_groups_overlapped", 0),
                  "stream_waits": s1.get("optimizer_stream_waits", 0)
                  - s0.get("optimizer_stream_waits", 0),
                  "groups_after_decision": s1["optimizer_groups_after_decision"]
                  - s0["optimizer_groups_after_decision"]}
            steps.append(st)
            print(f"step {i}: loss {st['loss']:.4f}, {st['step_s']:.1f} s (fwd {st['forward_s']:.1f}, "
                  f"bwd {st['backward_s']:.1f}, opt {st['optimizer_s']:.1f}), NVMe read "
                  f"{st['nvme_read_bytes'] / 1e9:.2f} GB (kernel {st['kernel_read_bytes'] / 1e9:.2f}), written "
                  f"{st['nvme_write_bytes'] / 1e9:.2f} GB (kernel {st['kernel_write_bytes'] / 1e9:.2f}), "
                  f"peak RSS {st['rss_peak'] / 2**30:.2f} GiB, groups stepped during backward "
                  f"{st['groups_overlapped']}, after the decision {st['groups_after_decision']}",
                  flush=True)
        res["commit_shadow_peak_bytes"] = eng.stats()["commit_shadow_peak_bytes"]
        print(f"commit shadows: at most {res['commit_shadow_peak_bytes'] / 1e9:.2f} GB = "
              f"{res['commit_shadow_peak_bytes'] / (states_b * n):.2f}x the optimizer states "
              f"beyond the homes", flush=True)
    finally:
        eng.close()
    if a.fio:
        res["fio_after"] = fio_gbps(a.nvme_path) or res["fio_before"]
        print(f"fio after the steps: {res['fio_after']}", flush=True)
    res["steps"] = steps
    res["rss_peak"] = rss_peak()
    for name, sel in (("overlapped", True), ("serial", False)):
        # (step 0 has no prefetch trace and step 1 is still warming up: medians from step 2)
        ss = [st for st in steps[2:] if st["overlap"] == sel]
        if not ss:
            continue
        import statistics
        med = {k: statistics.median(st[k] for st in ss)
               for k in ("step_s", "forward_s", "backward_s", "optimizer_s", "nvme_read_bytes",
                         "nvme_write_bytes", "kernel_read_bytes", "kernel_write_bytes")}
        if a.fio:     # the disk-bound time at the slower of fio's two measurements
            rd = min(res["fio_before"]["read_gbps"], res["fio_after"]["read_gbps"])
            wr = min(res["fio_before"]["rewrite_gbps"], res["fio_after"]["rewrite_gbps"])
            med["disk_bound_s"] = med["nvme_read_bytes"] / (rd * 1e9) + \
                med["nvme_write_bytes"] / (wr * 1e9)
            print(f"{name}: disk-bound step (R / fio read {rd:.2f} GB/s + W / fio rewrite "
                  f"{wr:.2f} GB/s) {med['disk_bound_s']:.1f} s; step / disk-bound "
                  f"{med['step_s'] / med['disk_bound_s']:.2f}")
        res[name] = med
        print(f"{name} ({len(ss)} steps from step 2, medians): step {med['step_s']:.1f} s (fwd "
              f"{med['forward_s']:.1f}, bwd {med['backward_s']:.1f}, optimizer exposed "
              f"{med['optimizer_s']:.1f} s = {med['optimizer_s'] / med['step_s']:.0%}); NVMe "
              f"{(med['nvme_read_bytes'] + med['nvme_write_bytes']) / n:.1f} B/param ("
              f"read {med['nvme_read_bytes'] / n:.1f} + written {med['nvme_write_bytes'] / n:.1f}; kernel "
              f"{(med['kernel_read_bytes'] + med['kernel_write_bytes']) / n:.1f})")
    print(f"peak RSS {res['rss_peak'] / 2**30:.2f} GiB for {n / 1e9:.2f} B params "
          f"({states / 1e9:.1f} GB of model states, {states / ram:.2f}x host RAM)")
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
