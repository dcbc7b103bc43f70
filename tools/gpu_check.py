#!/usr/bin/env python
"""The GPU check's steps (``make gpu-check``; tools/gpu_check.sh builds, then runs ``run``).

    python -P tools/gpu_check.py run --out DIR [--part core|nvme] [--mode gpu|dry] [--budget-s S]

``run`` executes the part's steps one after another, each in its own process with its own
time limit (so one hang or crash cannot eat the lease), and writes into ``DIR``:

* ``log.txt``: everything every step printed (the shell script tees into it);
* ``summary.json``: schema ``gpu-check/1`` (:data:`SCHEMA_KEYS`): the mode, the machine, one
  entry per step (status ``ok|failed|timeout|skipped``, seconds, the step's figures) and the
  targets with measured value, bound and verdict;
* ``profile.png`` (one offloaded step's timeline) and ``figures.png`` (tokens/s and losses,
  infinity beside DeepSpeed);
* ``extra.tar.gz``: every step's JSON, the profile's trace and summary, pytest's report.

Steps of ``--part core``: ``tests`` (tests/gpu and every test that skips without CUDA),
``rates`` (bf16 matrix-product rate, one transformer block's rate, pinned H2D/D2H, the swap
disk), ``infinity_small`` (a Llama-shaped 3.0B model, bf16, params and optimizer in host
memory, activation checkpointing, 8 x 2048 tokens per step, one step profiled),
``deepspeed_small`` (DeepSpeed ZeRO-3 with the same offload, model, seeds, data and batch),
``infinity_planned`` (the planner's global batch, 262,144 tokens per step, at the
micro-batch x accumulation the planner picks for those homes). ``--part nvme``: ``rates``,
then ``infinity_nvme`` (the largest model whose params and optimizer fit the free disk with
NVMe homes) and ``deepspeed_nvme``.

``--mode dry`` (no CUDA device): the same steps on the simulated device
(``INFINITY_SIMULATE_DEVICE=1``) at toy sizes, pytest collecting only; every step says
``dry`` and no figure in it is a GPU figure.  Exit status: 0 in GPU mode whatever the steps
did (the files must come back); in dry mode 1 when a step failed (so the script cannot rot).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

from gpu_check_steps import ROOT, STEPS, log, read_json, swap_root, write_json  # noqa: E402

SCHEMA = "gpu-check/1"
SCHEMA_KEYS = ("schema", "mode", "part", "started", "machine", "steps", "targets")
STEP_KEYS = ("status", "seconds", "limit_s", "dry", "result")
STATUSES = ("ok", "failed", "timeout", "skipped")


# part -> [(step, time limit in seconds on a GPU)]; the runner also stops at --budget-s
PARTS = {
    "core": [("tests", 90), ("rates", 45), ("infinity_small", 120), ("deepspeed_small", 150),
             ("infinity_planned", 150)],
    "nvme": [("rates", 45), ("infinity_nvme", 240), ("deepspeed_nvme", 240)],
    # diagnosis of a wrong first update (tools/gpu_diag.py) and the CPU Adam roofline
    "diag": [("diag", 170), ("adam", 30)],
    # LoRA over an nf4 base against a bf16 base, params on NVMe (tools/bench_lora_quantized.py)
    "lora": [("rates", 45), ("lora_speed", 300)],
    # the 8 x 2048 comparison alone (a re-measure after a change, in a short lease)
    "small": [("rates", 45), ("infinity_small", 120), ("infinity_small_in_step", 100),
              ("deepspeed_small", 150)],
}
SUMMARY_RESERVE_S = 15


def part_steps(part: str) -> list[tuple[str, int]]:
    """The steps of ``part``: one part's name, or several joined by commas ("core,lora"),
    in order, a step shared by two parts run once.  ValueError names an unknown part."""
    steps: dict[str, int] = {}
    for p in part.split(","):
        if p not in PARTS:
            raise ValueError(f"unknown part {p!r} in {part!r}: one of {', '.join(sorted(PARTS))}"
                             f", or several joined by commas")
        for name, limit in PARTS[p]:
            steps.setdefault(name, limit)
    return list(steps.items())


# ----------------------------------------------------------------------------- runner
def run_steps(args):
    out = os.path.abspath(args.out)
    steps_dir = os.path.join(out, "steps")
    os.makedirs(steps_dir, exist_ok=True)
    dry = args.mode == "dry"
    summary = {"schema": SCHEMA, "mode": args.mode, "part": args.part,
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": {}, "steps": {},
               "targets": {}, "build": read_json(os.path.join(out, "build.json"), {})}
    try:
        os.remove(os.path.join(out, "build.json"))   # folded into summary.json
    except OSError:
        pass
    t_start = time.monotonic()
    env = dict(os.environ)
    if dry:
        env["INFINITY_SIMULATE_DEVICE"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        summary["machine"] = machine_facts(dry)
    except Exception as e:  # noqa: BLE001 -- reported, never fatal
        summary["machine"] = {"error": f"{type(e).__name__}: {e}"}
    write_json(os.path.join(out, "summary.json"), summary)
    for name, limit in part_steps(args.part):
        left = args.budget_s - (time.monotonic() - t_start) - SUMMARY_RESERVE_S
        lim = int(min(limit, left)) if not dry else int(limit)
        entry = {"status": "skipped", "seconds": 0.0, "limit_s": lim, "dry": dry, "result": None}
        if lim < 10:
            entry["reason"] = f"the budget of {args.budget_s} s is spent"
            log(f"step {name}: skipped ({entry['reason']})")
            summary["steps"][name] = entry
            continue
        cmd = [sys.executable, "-P", os.path.abspath(__file__), "step", name, "--out", out,
               "--mode", args.mode]
        log(f"step {name}: start (limit {lim} s)")
        t0 = time.monotonic()
        rc = run_limited(cmd, lim, env)
        entry["seconds"] = round(time.monotonic() - t0, 1)
        res = read_json(os.path.join(steps_dir, f"{name}.json"))
        entry["result"] = res
        if rc == "timeout":
            entry["status"] = "timeout"
        elif rc != 0:
            entry["status"] = "failed"
            entry["rc"] = rc
        elif res is not None and res.get("skipped"):
            entry["status"] = "skipped"
            entry["reason"] = res["skipped"]
        else:
            entry["status"] = "ok" if res is not None else "failed"
        log(f"step {name}: {entry['status']} in {entry['seconds']} s"
            + (f" ({entry.get('reason')})" if entry.get("reason") else ""))
        summary["steps"][name] = entry
        write_json(os.path.join(out, "summary.json"), summary)
    summary["targets"] = targets(summary)
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    write_json(os.path.join(out, "summary.json"), summary)
    try:
        figures_png(summary, os.path.join(out, "figures.png"))
    except Exception as e:  # noqa: BLE001
        log(f"figures.png not drawn: {type(e).__name__}: {e}")
    pack(out)
    print_table(summary)
    failed = [n for n, s in summary["steps"].items() if s["status"] in ("failed", "timeout")]
    return 1 if (dry and failed) else 0


def run_limited(cmd, limit, env):
    """Run ``cmd`` in its own process group; kill the group after ``limit`` s."""
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
    try:
        return p.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        log(f"time limit {limit} s reached: killing {' '.join(cmd[3:5])}")
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        return "timeout"


def machine_facts(dry):
    import platform

    import torch
    facts = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "cpus": os.cpu_count(), "host": platform.node(),
             "kernel": platform.release()}
    try:
        with open("/proc/meminfo") as f:
            facts["mem_total_gb"] = round(int(f.readline().split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, gpu_mem_gb=round(p.total_memory / 1e9, 2),
                     sms=p.multi_processor_count)
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,"
                                "pcie.link.width.current", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            facts["nvidia_smi"] = q.stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            facts["nvidia_smi"] = f"unavailable: {e}"
    else:
        facts["gpu"] = None
    import shutil
    facts["disk_free_gb"] = round(shutil.disk_usage(swap_root()).free / 1e9, 1)
    return facts


def step_main(name, out, mode):
    write_json(os.path.join(out, "steps", f"{name}.json"), STEPS[name](out, mode == "dry"))
    return 0


# ----------------------------------------------------------------------------- verdicts
def _res(summary, name):
    s = summary["steps"].get(name) or {}
    return s.get("result") if s.get("status") == "ok" else None


def targets(summary):
    """Each target of the issue: measured value, bound, verdict (True/False/None = not run)."""
    t = {}
    small, ds, big = (_res(summary, n) for n in ("infinity_small", "deepspeed_small",
                                                 "infinity_planned"))

    def put(name, value, bound, ok):
        t[name] = {"value": value, "bound": bound, "met": ok}

    put("mfu_planned_batch", big and big.get("mfu"), ">= 0.40",
        None if not big or big.get("mfu") is None else big["mfu"] >= 0.40)
    ratio = None
    if small and ds and ds.get("tokens_per_s"):
        ratio = small["tokens_per_s"] / ds["tokens_per_s"]
    put("tokens_per_s_vs_deepspeed_small", ratio, ">= 1.5", None if ratio is None else ratio >= 1.5)
    agree = None
    if small and ds and ds.get("losses"):
        k = min(len(small["losses"]), len(ds["losses"]))
        agree = max(abs(a - b) / abs(b) for a, b in zip(small["losses"][:k], ds["losses"][:k]))
    put("first_losses_vs_deepspeed", agree, "<= 0.02", None if agree is None else agree <= 0.02)
    for tag, r in (("small", small), ("planned", big)):
        if not r:
            continue
        st = r.get("stats", {})
        cap, peak = st.get("device_cap_bytes"), st.get("device_peak_bytes")
        put(f"device_peak_within_budget_{tag}", peak, f"<= {cap}",
            None if not cap or peak is None else peak <= cap)
        left = r.get("cuda_allocated_after_close_bytes")
        put(f"no_cuda_memory_after_close_{tag}", left, "< 1 MiB",
            None if left is None else left < (1 << 20))
        e = r.get("estimate") or {}
        for k in ("step_ratio", "device_ratio"):
            v = e.get(k)
            put(f"estimate_{k}_{tag}", v, "within 25 %",
                None if v is None else abs(v - 1) <= 0.25)
    for tag, r in (("small", small), ("planned", big)):
        if r and "skipped_updates" in r:
            put(f"no_skipped_updates_{tag}", r["skipped_updates"], "== 0",
                r["skipped_updates"] == 0)
    nv, dsn = _res(summary, "infinity_nvme"), _res(summary, "deepspeed_nvme")
    if nv:
        for k in ("nvme_bytes_per_param_per_step", "step_over_disk_bound", "mfu", "tokens_per_s"):
            put(f"nvme_{k}", nv.get(k), "reported", None)
        r = nv["tokens_per_s"] / dsn["tokens_per_s"] if dsn and dsn.get("tokens_per_s") else None
        put("nvme_tokens_per_s_vs_deepspeed", r, "> 1", None if r is None else r > 1)
    ins = _res(summary, "infinity_small_in_step")
    if small and ins and ins.get("tokens_per_s"):
        put("finish_in_next_forward_speedup", small["tokens_per_s"] / ins["tokens_per_s"],
            "reported", None)
    lo = _res(summary, "lora_speed")
    if lo:
        v = lo.get("nf4_over_bf16_step")
        put("lora_nf4_over_bf16_step", v, "<= 0.4", None if v is None else v <= 0.4)
    if small and small.get("profile"):
        f = small["profile"].get("h2d_overlap_fraction")
        put("h2d_overlaps_compute", f, "> 0", None if f is None else f > 0)
    return t


def print_table(summary):
    print(f"\n== gpu-check {summary['mode']} --part {summary['part']}: "
          f"{summary['machine'].get('gpu') or 'no GPU'} ==")
    for n, s in summary["steps"].items():
        r = s.get("result") or {}
        extra = ""
        if "tokens_per_s" in r:
            extra = f"{r['tokens_per_s']:.4g} tok/s, step {r.get('median_step_s', 0):.3g} s"
            if r.get("mfu") is not None:
                extra += f", MFU {100 * r['mfu']:.1f} %"
        elif n == "tests":
            extra = ", ".join(f"{k} {r[k]}" for k in ("tests", "failures", "errors", "skipped")
                              if k in r)
        print(f"  {n:<18} {s['status']:<8} {s['seconds']:>6.1f} s  {extra}")
    for n, v in summary["targets"].items():
        val = v["value"]
        val = f"{val:.4g}" if isinstance(val, float) else val
        print(f"  target {n:<40} {str(val):>12} {v['bound']:<14} "
              f"{ {True: 'MET', False: 'MISSED'}.get(v['met'], 'reported' if val is not None else 'not measured') }")


def figures_png(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {n: s.get("result") for n, s in summary["steps"].items()
            if s.get("status") == "ok" and isinstance(s.get("result"), dict)
            and "losses" in s["result"]}
    if not runs:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for n, r in runs.items():
        a1.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", label=n)
    a1.set_xlabel("step")
    a1.set_ylabel("loss")
    a1.legend()
    names = list(runs)
    a2.bar(names, [runs[n].get("tokens_per_s", 0) for n in names])
    a2.set_ylabel("tokens/s")
    a2.tick_params(axis="x", rotation=20)
    fig.suptitle(f"gpu-check ({summary['mode']}): {summary['machine'].get('gpu') or 'no GPU'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def pack(out):
    """Copy the profile picture to the top and pack the rest into one archive (at most 8 files
    come back from the device machine)."""
    import shutil
    pngs = sorted(glob.glob(os.path.join(out, "steps", "profile_*", "*.png")))
    if pngs:
        shutil.copy(pngs[0], os.path.join(out, "profile.png"))
    arc = os.path.join(out, "extra.tar.gz")
    with tarfile.open(arc, "w:gz") as tar:
        tar.add(os.path.join(out, "steps"), arcname="steps")
    shutil.rmtree(os.path.join(out, "steps"), ignore_errors=True)


# ----------------------------------------------------------------------------- CLI
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--part", default="core", help="core, nvme, diag, lora or small; or several "
                   "joined by commas (core,lora)")
    r.add_argument("--mode", choices=("gpu", "dry"), required=True)
    r.add_argument("--budget-s", type=float, default=360.0)
    s = sub.add_parser("step")
    s.add_argument("name", choices=sorted(STEPS))
    s.add_argument("--out", required=True)
    s.add_argument("--mode", choices=("gpu", "dry"), required=True)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        try:
            part_steps(args.part)
        except ValueError as e:
            ap.error(str(e))
        return run_steps(args)
    return step_main(args.name, args.out, args.mode)


if __name__ == "__main__":
    sys.exit(main())
