#!/usr/bin/env python
"""ZeRO-3 across ranks: infinity against DeepSpeed ZeRO-3, interleaved in the same run.

Each round launches ``--ranks`` processes (torchrun-style: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT; gloo; OMP_NUM_THREADS=1 each) for infinity (this venv) and then
``--ranks`` processes for DeepSpeed (``tools/peers/deepspeed_e2e.py --distributed`` under
``--deepspeed-python``), alternating which goes first round by round.  Both train the
tools/e2e_model.py MLP stack (pre-norm residual blocks, fp32, AdamW, MSE loss), each rank
on its own ``--tokens`` micro-batch, ZeRO stage 3 with parameters and optimizer states
offloaded to ``--offload`` (nvme or cpu).  A round's figure is rank 0's median step time
(forward + backward + step) over ``--steps`` steps after ``--warmup``; the tool prints every
round and the median over rounds of each side and of their ratio.

    .venv/bin/python tools/bench_zero_vs_deepspeed.py --ranks 2 --layers 6 --hidden 1024 \\
        --tokens 64 --offload nvme --rounds 3 --deepspeed-python /tmp/infinity-dsvenv/bin/python

``--deepspeed-python ''`` runs infinity only.  ``--profile DIR`` records ``engine.profile``
of infinity's measured steps per rank (``DIR/rank<r>/``) and prints where each rank's
step time went (links' busy and exposed time, compute, waits, overhead).  Each round also
prints every rank's CPU seconds per step (all its threads: less sensitive to a loaded
machine than the wall time; infinity: the median step's, DeepSpeed: the mean over its
measured steps) and rank 0's CPU seconds per step by OS thread name.
A benchmark, not a test: on a shared 2-core machine the ranks compete for the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(TOOLS, "peers", "deepspeed_e2e.py")


# ---------------------------------------------------------------------- one infinity rank
def thread_cpu() -> dict:
    """``{tid: (thread name, CPU seconds)}`` of this process's threads (Linux /proc)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    base = "/proc/self/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = (name.rstrip("0123456789_-"), (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _merge(cfg: dict, extra: dict) -> None:
    """``--config`` into the base config, section by section: ``{"offload":
    {"host_memory_gb": 8}}`` sets the cap and keeps the offload homes."""
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            _merge(cfg[k], v)
        else:
            cfg[k] = v


def child(a) -> dict:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, TOOLS)
    import e2e_model
    import infinity
    torch.set_num_threads(1)
    if a.adam_threads:
        import infinity.optim
        infinity.optim.set_num_threads(a.adam_threads)
    rank = int(os.environ["RANK"])
    ws = int(os.environ["WORLD_SIZE"])
    model = e2e_model.build_model(a.layers, a.hidden, a.ffn_mult)
    cfg = {"zero_stage": 3, "precision": "fp32", "dist_timeout_s": 600,
           "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.0},
           "offload": {"params": a.offload, "optimizer": a.offload,
                       "nvme_paths": [os.path.join(a.swap, "infinity")]}}
    if a.config:
        _merge(cfg, json.loads(a.config))
    t0 = time.perf_counter()
    eng = infinity.initialize(model, cfg)
    init_s = time.perf_counter() - t0
    if a.no_overlap:
        eng.overlap_optimizer_step = False
    if a.no_commit_point:
        eng.commit_point = False     # A/B only: updates in place, not all-or-nothing
    x, y = e2e_model.make_batch(a.tokens, a.hidden, seed=1 + rank)
    steps, fb, opt, cpu = [], [], [], []
    prof = None
    try:
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                s0 = eng.stats()
                t0_threads = thread_cpu()
                if a.profile:
                    prof = eng.profile(os.path.join(a.profile, f"rank{rank}"), plot=False)
                    prof.__enter__()
            ta, ca = time.perf_counter(), time.process_time()
            loss = e2e_model.loss_fn(eng(x), y)
            eng.backward(loss)
            tb = time.perf_counter()
            eng.step()
            tc = time.perf_counter()
            steps.append(tc - ta)
            cpu.append(time.process_time() - ca)
            fb.append(tb - ta)
            opt.append(tc - tb)
        if prof is not None:
            prof.__exit__(None, None, None)
        st = eng.stats()
        t1_threads = thread_cpu()
    finally:
        eng.close()
    w = a.warmup
    n = max(1, a.steps)
    res = {"rank": rank, "world_size": ws, "median_step_s": statistics.median(steps[w:]),
           "step_s": steps[w:], "fwd_bwd_s": fb[w:], "optimizer_step_s": opt[w:],
           "median_cpu_s": statistics.median(cpu[w:]),
           "init_s": init_s, "loss": float(loss.detach()),
           "per_step": {k: (st.get(k, 0) - s0.get(k, 0)) / n for k in (
               "nvme_read_bytes", "nvme_write_bytes", "allgather_bytes", "reduce_scatter_bytes",
               "optimizer_groups_overlapped", "optimizer_master_handoffs",
               "on_demand_fetches", "prefetched_fetches", "reused_fetches", "reused_bytes",
               "param_cache_admitted", "param_cache_evicted", "param_cache_gathers",
               "optimizer_master_read_bytes_saved")}}
    by_name: dict = {}
    for tid, (name, cpu_s) in t1_threads.items():
        d = cpu_s - t0_threads.get(tid, (name, 0.0))[1]
        by_name[name] = by_name.get(name, 0.0) + d / n
    res["thread_cpu_s"] = {k: round(v, 4) for k, v in sorted(by_name.items(),
                                                              key=lambda kv: -kv[1]) if v > 1e-3}
    if prof is not None and prof.summary is not None:
        s = prof.summary
        res["profile"] = {
            "window_s": s["window_s"],
            "links": {k: {"busy_s": v["busy_s"], "exposed_s": v.get("exposed_s"),
                          "bytes": v["bytes"]} for k, v in s["links"].items()},
            "compute": {k: v["busy_s"] for k, v in s["compute"].items()},
            "wait_s": s["wait"]["total_s"],
            "idle_fraction": s.get("idle_fraction"),
            "bottleneck": s["bottleneck"]["sentence"]}
    dist.barrier()
    dist.destroy_process_group()
    return res


# ---------------------------------------------------------------------- launcher
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd_of_rank, ranks: int, timeout: float) -> list[dict]:
    """Run ``ranks`` processes torchrun-style; each prints one JSON line last on stdout."""
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd_of_rank(r), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for r, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"rank {r} did not finish within {timeout:.0f} s")
        lines = [ln for ln in so.strip().splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            raise RuntimeError(f"rank {r} failed (exit {p.returncode}):\n{se[-3000:]}")
        res = json.loads(lines[-1])
        if res.get("error"):
            raise RuntimeError(f"rank {r}: {res['error']}\n{se[-3000:]}")
        out.append(res)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn-mult", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per round")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--offload", choices=("nvme", "cpu"), default="nvme")
    ap.add_argument("--swap", default=None, help="directory for both sides' swap files")
    ap.add_argument("--deepspeed-python", default="/tmp/infinity-dsvenv/bin/python",
                    help="python of the DeepSpeed venv (tools/setup_deepspeed_venv.sh); '' "
                         "runs infinity only")
    ap.add_argument("--config", default=None,
                    help="JSON merged into infinity's config (e.g. to A/B a setting)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="infinity: step every group at the boundary (engine."
                         "overlap_optimizer_step = False), for A/B runs")
    ap.add_argument("--no-commit-point", action="store_true",
                    help="infinity: updates in place without shadows or undo copies (engine."
                         "commit_point = False; not all-or-nothing), for A/B runs of its cost")
    ap.add_argument("--adam-threads", type=int, default=0,
                    help="infinity: infinity.optim.set_num_threads(N) in every rank (0: the "
                         "engine's default)")
    ap.add_argument("--profile", default=None, help="engine.profile per rank into DIR/rank<r>")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", action="store_true", help="also print one JSON line at the end")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        res = child(a)
        print(json.dumps(res), flush=True)
        return 0
    swap = a.swap or tempfile.mkdtemp(prefix="bench-zero-ds-")
    os.makedirs(swap, exist_ok=True)
    sys.path.insert(0, TOOLS)
    import e2e_model
    nparams = e2e_model.count_params(a.layers, a.hidden, a.ffn_mult)
    common = [f"--layers={a.layers}", f"--hidden={a.hidden}", f"--ffn-mult={a.ffn_mult}",
              f"--tokens={a.tokens}", f"--steps={a.steps}", f"--warmup={a.warmup}"]

    def infinity_cmd(r):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"--swap={swap}",
               f"--offload={a.offload}"] + common
        if a.config:
            cmd.append(f"--config={a.config}")
        if a.profile:
            cmd.append(f"--profile={a.profile}")
        if a.no_overlap:
            cmd.append("--no-overlap")
        if a.no_commit_point:
            cmd.append("--no-commit-point")
        if a.adam_threads:
            cmd.append(f"--adam-threads={a.adam_threads}")
        return cmd

    def ds_cmd(r):
        return [a.deepspeed_python, PEER, "--distributed", f"--offload={a.offload}",
                f"--nvme-path={os.path.join(swap, 'deepspeed')}"] + common

    sides = {"infinity": infinity_cmd}
    if a.deepspeed_python:
        sides["deepspeed"] = ds_cmd
    rounds = []
    print(f"ZeRO-3, {a.ranks} gloo ranks, {nparams / 1e6:.1f}M params fp32 ({a.layers} x "
          f"hidden {a.hidden}), {a.tokens} tokens per rank, params + optimizer on {a.offload}; "
          f"median of {a.steps} steps after {a.warmup} warm-up, {a.rounds} rounds", flush=True)
    for rnd in range(a.rounds):
        order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
        row = {}
        for side in order:
            res = launch(sides[side], a.ranks, a.timeout)
            row[side] = res
            for r in res:          # the DeepSpeed peer reports its measured steps' CPU time
                if "median_cpu_s" not in r and "measured_user_s" in r:
                    r["median_cpu_s"] = (r["measured_user_s"] + r.get("measured_sys_s", 0)) / \
                        max(1, a.steps)
            cpu = "" if "median_cpu_s" not in res[0] else \
                " cpu s per step (all threads): " + ", ".join(f"{r['median_cpu_s']:.3f}" for r in res)
            if "thread_cpu_s" in res[0]:
                cpu += "\n    rank 0 CPU s per step by thread: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in res[0]["thread_cpu_s"].items())
            print(f"  round {rnd}: {side:>9} {res[0]['median_step_s']:.3f} s (ranks: " +
                  ", ".join(f"{r['median_step_s']:.3f}" for r in res) + ")" + cpu, flush=True)
            if side == "infinity" and "profile" in res[0]:
                for r in res:
                    p = r["profile"]
                    links = ", ".join(f"{k} {v['busy_s']:.2f}/{(v['exposed_s'] or 0):.2f}"
                                      for k, v in p["links"].items() if v["bytes"])
                    comp = ", ".join(f"{k} {v:.2f}" for k, v in p["compute"].items())
                    print(f"    rank {r['rank']} profile ({a.steps} steps, {p['window_s']:.2f} s):"
                          f" links busy/exposed s: {links}; compute s: {comp}; wait "
                          f"{p['wait_s']:.2f} s; {p['bottleneck']}", flush=True)
        rounds.append(row)
    med = {s: statistics.median(r[s][0]["median_step_s"] for r in rounds) for s in sides}
    out = {"ranks": a.ranks, "params": nparams, "offload": a.offload, "tokens": a.tokens,
           "median_step_s": med,
           "rounds": [{s: [x["median_step_s"] for x in r[s]] for s in r} for r in rounds],
           "cpu_s_per_step": [{s: [x.get("median_cpu_s") for x in r[s]] for s in r}
                              for r in rounds],
           "infinity_per_step": rounds[-1]["infinity"][0]["per_step"]}
    line = f"median over rounds: infinity {med['infinity']:.3f} s"
    if "deepspeed" in med:
        ratios = [r["infinity"][0]["median_step_s"] / r["deepspeed"][0]["median_step_s"]
                  for r in rounds]
        out["ratio_per_round"] = ratios
        out["ratio_median"] = statistics.median(ratios)
        line += (f", DeepSpeed {med['deepspeed']:.3f} s; infinity/DeepSpeed per round " +
                 " / ".join(f"{x:.2f}" for x in ratios) + f" (median {out['ratio_median']:.2f})")
    print(line, flush=True)
    print("  infinity per step (rank 0, last round): " +
          ", ".join(f"{k} {v:.3g}" for k, v in out["infinity_per_step"].items()), flush=True)
    if a.json:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
