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
import gc
import glob
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)

SCHEMA = "gpu-check/1"
SCHEMA_KEYS = ("schema", "mode", "part", "started", "machine", "steps", "targets")
STEP_KEYS = ("status", "seconds", "limit_s", "dry", "result")
STATUSES = ("ok", "failed", "timeout", "skipped")

SEQ = {"gpu": 2048, "dry": 64}
SIZE = {"gpu": "3b", "dry": "dry"}
SMALL_BATCH = {"gpu": 8, "dry": 2}          # sequences per step of the small shape
SMALL_STEPS = {"gpu": 5, "dry": 3}          # the first is the warm-up (records the order)
PLANNED_STEPS = {"gpu": 2, "dry": 2}
LR = 1e-4
CLIP = 1.0

# part -> [(step, time limit in seconds on a GPU)]; the runner also stops at --budget-s
PARTS = {
    "core": [("tests", 90), ("rates", 45), ("infinity_small", 120), ("deepspeed_small", 150),
             ("infinity_planned", 150)],
    "nvme": [("rates", 45), ("infinity_nvme", 240), ("deepspeed_nvme", 240)],
    # diagnosis of a wrong first update (tools/gpu_diag.py) and the CPU Adam roofline
    "diag": [("diag", 170), ("adam", 30)],
}
SUMMARY_RESERVE_S = 15


def log(msg):
    print(f"[gpu-check] {msg}", flush=True)


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


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
    for name, limit in PARTS[args.part]:
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


def swap_root():
    d = os.environ.get("INFINITY_GPU_CHECK_SWAP") or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "infinity-gpu-check-swap")
    os.makedirs(d, exist_ok=True)
    return d


# ----------------------------------------------------------------------------- steps
def step_main(name, out, mode):
    dry = mode == "dry"
    path = os.path.join(out, "steps", f"{name}.json")
    fn = STEPS[name]
    res = fn(out, dry)
    write_json(path, res)
    return 0


def step_tests(out, dry):
    """tests/gpu and every test file that skips without CUDA (collected only in dry mode)."""
    files = sorted(set(glob.glob(os.path.join(ROOT, "tests", "gpu", "test_*.py")))
                   | {f for f in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"),
                                           recursive=True) if _mentions_cuda(f)})
    rel = [os.path.relpath(f, ROOT) for f in files]
    report = os.path.join(out, "steps", "pytest.xml")
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={report}", *rel]
    if dry:
        cmd.insert(5, "--collect-only")
    log("running " + " ".join(cmd[3:]))
    r = subprocess.run(cmd, cwd=ROOT)
    counts = _junit_counts(report)
    res = {"files": rel, "rc": r.returncode, "collect_only": dry, **counts}
    if r.returncode not in (0, 5):   # 5: nothing collected
        write_json(os.path.join(out, "steps", "tests.json"), res)
        raise SystemExit(1)
    return res


def _mentions_cuda(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return False
    return "cuda.is_available()" in text or "cuda.device_count()" in text


def _junit_counts(path):
    try:
        import xml.etree.ElementTree as ET
        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except (OSError, ValueError, AttributeError, ImportError) as e:
        return {"junit": f"unreadable: {e}"}
    except Exception as e:  # noqa: BLE001 -- ET.ParseError
        return {"junit": f"unreadable: {e}"}


def step_rates(out, dry):
    import torch

    from infinity.estimate import spec_from_module
    from infinity.finetune.auto import measure_block_tflops

    import llama_bench as lb
    res = {}
    cuda = torch.cuda.is_available() and not dry
    dev = torch.device("cuda" if cuda else "cpu")
    # the large matrix product (MFU's denominator): bf16 8192^3, median of timed runs
    n = 8192 if cuda else 256
    res["matmul_bf16_tflops"] = _matmul_rate(n, dev)
    res["matmul_n"] = n
    # one transformer block of the model's width at each shape's micro-batch (the estimator's
    # rate, as finetune --auto measures it, here in bf16 on the device)
    seq = SEQ["dry" if dry else "gpu"]
    spec = _meta_spec(lb, "dry" if dry else "3b", seq)
    res["block_tflops"] = {}
    for b in ((1, 2, 4) if dry else (1, 2, 4, 8, 16, 32)):
        r = measure_block_tflops(spec, seq, b, seconds=1.0 if cuda else 0.2, device=dev,
                                 dtype=torch.bfloat16)
        res["block_tflops"][str(b)] = r
        log(f"block rate at micro-batch {b}: {r:.4g} TFLOPS")
    if cuda:
        res.update(_pcie_rates())
    res.update(_disk_rates(dry))
    log("rates: " + json.dumps({k: v for k, v in res.items() if k != "block_tflops"}))
    return res


def _meta_spec(lb, size, seq):
    import torch

    from infinity.estimate import spec_from_module
    with torch.device("meta"):
        from transformers import LlamaForCausalLM
        m = LlamaForCausalLM(lb.llama_config(size, seq))
    return spec_from_module(m, seq=seq)


def _matmul_rate(n, dev):
    import torch
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dt, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dt, generator=g)
    times = []
    for i in range(13):
        _sync(dev)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(dev)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n ** 3 / times[len(times) // 2] / 1e12


def _sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _pcie_rates():
    import torch
    nbytes = 1 << 30
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    devb = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d_gbps", devb, host), ("d2h_gbps", host, devb)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def _disk_rates(dry):
    from infinity.io.bench import measure
    size = (64 << 20) if dry else (2 << 30)
    try:
        r = measure(swap_root(), size, block_size=1 << 20, queue_depth=32, repeats=2)
    except Exception as e:  # noqa: BLE001 -- the disk figure is informative
        return {"disk_error": f"{type(e).__name__}: {e}"}
    return {"disk": r if isinstance(r, dict) else getattr(r, "__dict__", str(r))}


def _rates(out):
    return read_json(os.path.join(out, "steps", "rates.json"), {}) or {}


def step_infinity_small(out, dry):
    m = "dry" if dry else "gpu"
    return infinity_run(out, dry, micro_batch=SMALL_BATCH[m], grad_accum=1,
                        steps=SMALL_STEPS[m], homes=("cpu", "cpu"), profile=True, tag="small")


def step_infinity_planned(out, dry):
    m = "dry" if dry else "gpu"
    seq = SEQ[m]
    from infinity.estimate.planner import default_global_batch
    gb = default_global_batch(seq, 1) if not dry else 16   # toy: 16 sequences per step
    plan = plan_for(out, dry, homes=("cpu", "cpu"), global_batch=gb)
    if plan.best is None:
        return {"skipped": f"the planner found no plan with params and optimizer in host "
                           f"memory: {plan.headline()}"}
    return infinity_run(out, dry, micro_batch=plan.best.micro_batch,
                        grad_accum=plan.best.grad_accum, steps=PLANNED_STEPS[m],
                        homes=("cpu", "cpu"), profile=False, tag="planned",
                        plan_config=plan.best.config())


def step_infinity_nvme(out, dry):
    return {"skipped": "the NVMe part is prepared for a later lent session: run --part nvme"}


def step_deepspeed_nvme(out, dry):
    return {"skipped": "the NVMe part is prepared for a later lent session: run --part nvme"}


def measured_machine(out, dry, micro_batch):
    """The estimator's machine from this run's measurements: one GPU (its memory), this
    host's RAM, the swap disk's free space and measured GB/s, the measured pinned H2D rate
    and the block rate at ``micro_batch``."""
    import shutil

    import torch

    from infinity.estimate.machine import Machine
    from infinity.finetune.auto import mem_available_gb
    r = _rates(out)
    kw = dict(host_mem_gb=round(mem_available_gb(), 1),
              nvme_gb=round(shutil.disk_usage(swap_root()).free / 1e9, 1))
    if dry:
        kw.update(gpus=0)
    else:
        kw.update(gpus=1, gpu_mem_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
    disk = r.get("disk") or {}
    if isinstance(disk, dict) and disk.get("read_gbps") and disk.get("write_gbps"):
        kw.update(nvme_gbps=disk["read_gbps"], nvme_write_gbps=disk["write_gbps"])
    if r.get("h2d_gbps"):
        kw["pcie_gbps"] = min(r["h2d_gbps"], r.get("d2h_gbps") or r["h2d_gbps"])
    rates = {int(k): v for k, v in (r.get("block_tflops") or {}).items() if v}
    if rates:   # the probe at this micro-batch, else at the nearest one probed
        kw["tflops"] = rates[min(rates, key=lambda b: (abs(b - micro_batch), -b))]
    return Machine(**kw)


def plan_for(out, dry, *, homes, global_batch=None, micro_batch=None, grad_accum=None):
    """The planner's choice for these homes with activation checkpointing on (the run's)."""
    from infinity.estimate import _knobs_from
    from infinity.estimate.planner import make_plan

    import llama_bench as lb
    m = "dry" if dry else "gpu"
    spec = _meta_spec(lb, SIZE[m], SEQ[m])
    knobs = _knobs_from(run_config(homes, 1), {})
    plan = None
    for _ in range(2):   # plan at the default rate, then at the block rate of the chosen micro-batch
        b = micro_batch or (plan.best.micro_batch if plan is not None and plan.best else 1)
        machine = measured_machine(out, dry, b)
        plan = make_plan(spec, machine, knobs, global_batch=global_batch, micro_batch=micro_batch,
                         grad_accum=grad_accum, checkpointing=True,
                         activations=(("none", "checkpoints"),), homes=[homes])
        if plan.best is None or plan.best.micro_batch == b:
            break
    return plan


def run_config(homes, grad_accum, swap=None):
    cfg = {"precision": "bf16", "zero_stage": 3,
           "offload": {"params": homes[0], "optimizer": homes[1]},
           "optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.0},
           "gradient_clipping": CLIP, "gradient_accumulation_steps": grad_accum}
    if swap:
        cfg["offload"]["nvme_paths"] = [swap]
    return cfg


def infinity_run(out, dry, *, micro_batch, grad_accum, steps, homes, profile, tag,
                 plan_config=None):
    import torch

    import infinity
    import llama_bench as lb
    m = "dry" if dry else "gpu"
    size, seq = SIZE[m], SEQ[m]
    cuda = torch.cuda.is_available() and not dry
    dev = "cuda" if cuda else "cpu"
    res = {"tag": tag, "size": size, "params": lb.count_params(size), "seq": seq,
           "micro_batch": micro_batch, "grad_accum": grad_accum, "homes": list(homes),
           "tokens_per_step": micro_batch * grad_accum * seq}
    partial = os.path.join(out, "steps", f"infinity_{tag}.json")
    cfg = run_config(homes, grad_accum)
    if plan_config:
        cfg["prefetch"] = dict(plan_config.get("prefetch", {}))
        if plan_config.get("offload", {}).get("host_memory_gb") is not None:
            cfg["offload"]["host_memory_gb"] = plan_config["offload"]["host_memory_gb"]
    res["config"] = cfg
    t0 = time.perf_counter()
    model = lb.build_model(size, seq, device=dev, seed=0, checkpointing=True)
    _sync(torch.device(dev))
    res["build_s"] = round(time.perf_counter() - t0, 2)
    data = lb.batches(steps * grad_accum, micro_batch, seq, seed=1)
    t0 = time.perf_counter()
    engine = infinity.initialize(model, cfg)
    del model
    res["initialize_s"] = round(time.perf_counter() - t0, 2)
    if cuda:   # the peak of training, not of the model built on the device before initialize
        res["cuda_allocated_after_initialize_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    log(f"[{tag}] {res['params'] / 1e9:.3g} B params, micro-batch {micro_batch} x accumulation "
        f"{grad_accum} x {seq} tokens; initialize {res['initialize_s']} s")
    losses, times = [], []
    prof_dir = os.path.join(out, "steps", f"profile_{tag}")
    try:
        # the profiled step comes after the timed ones (writing the trace and the plot is
        # not the engine's time); it trains on the first micro-batches again
        for s in range(steps + (1 if profile else 0)):
            prof = s == steps
            ctx = engine.profile(prof_dir) if prof else _Null()
            _sync(torch.device(dev))
            t0 = time.perf_counter()
            with ctx:
                step_loss = 0.0
                for a in range(grad_accum):
                    ids = data[(s % steps) * grad_accum + a].to(dev, non_blocking=True)
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                    engine.step()
                    step_loss += float(loss.detach()) / grad_accum
                _sync(torch.device(dev))
            dt = time.perf_counter() - t0
            if prof:
                res["profiled_step"] = {"loss": step_loss, "seconds": dt}
                log(f"[{tag}] profiled step: loss {step_loss:.4f}, {dt:.2f} s")
                continue
            times.append(dt)
            losses.append(step_loss)
            log(f"[{tag}] step {s + 1}/{steps}: loss {step_loss:.4f}, {times[-1]:.2f} s")
            res.update(losses=losses, step_s=times)
            write_json(partial, res)
        st = engine.stats()
        res["stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float, str))}
        res["skipped_updates"] = int(st.get("skipped_steps", 0))
        if profile:
            res["profile"] = _profile_facts(engine, prof_dir)
        if cuda:
            res["torch_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            res["torch_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    finally:
        engine.close()
    del engine
    ids = loss = None
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        res["cuda_allocated_after_close_raw_bytes"] = torch.cuda.memory_allocated()
        # torch keeps cuBLAS workspaces (32 MiB per handle and stream on Hopper) in the
        # caching allocator: torch's, not the engine's
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        res["cuda_allocated_after_close_bytes"] = torch.cuda.memory_allocated()
    measured = times[1:] or times
    med = sorted(measured)[len(measured) // 2]
    res["median_step_s"] = med
    res["tokens_per_s"] = res["tokens_per_step"] / med
    r = _rates(out)
    mm = r.get("matmul_bf16_tflops")
    if mm:
        res["mfu"] = res["tokens_per_s"] * lb.model_flops_per_token(size, seq) / (mm * 1e12)
        s = lb.SIZES[size]
        hw = 8 * res["params"] + 16 * s["num_hidden_layers"] * s["hidden_size"] * seq
        res["hfu"] = res["tokens_per_s"] * hw / (mm * 1e12)
    try:
        res["estimate"] = estimate_check(out, dry, res)
    except Exception as e:  # noqa: BLE001 -- the run's figures stand without it
        res["estimate"] = {"error": f"{type(e).__name__}: {e}"}
    return res


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _profile_facts(engine, prof_dir):
    evs = engine.timeline.events()
    h2d = [e for e in evs if e.lane == "h2d"]
    comp = [e for e in evs if e.lane in ("forward", "backward")]
    h2d_s = sum(e.t1 - e.t0 for e in h2d)
    over = 0.0
    for a in h2d:
        for c in comp:
            lo, hi = max(a.t0, c.t0), min(a.t1, c.t1)
            if hi > lo:
                over += hi - lo
    pngs = sorted(glob.glob(os.path.join(prof_dir, "*.png")))
    return {"h2d_s": h2d_s, "h2d_overlapped_s": min(over, h2d_s),
            "h2d_overlap_fraction": (min(over, h2d_s) / h2d_s) if h2d_s else None,
            "h2d_copies": len(h2d), "compute_spans": len(comp), "png": pngs}


def estimate_check(out, dry, res):
    """``infinity estimate`` for the run's configuration on the measured machine: predicted
    step time and device peak against the measured ones (target: within 25 %)."""
    homes = tuple(res["homes"])
    plan = plan_for(out, dry, homes=homes, micro_batch=res["micro_batch"],
                    grad_accum=res["grad_accum"])
    if plan.best is None:
        return {"fits": False, "headline": plan.headline()}
    b = plan.best
    dev_pred = b.estimate.totals[f"device_{b.variant}"]
    st = res.get("stats", {})
    dev_meas = res.get("torch_max_allocated_bytes") or st.get("device_peak_bytes")
    out_ = {"predicted_step_s": b.step.step_s, "measured_step_s": res["median_step_s"],
            "step_ratio": res["median_step_s"] / b.step.step_s,
            "predicted_device_bytes": dev_pred, "measured_device_bytes": dev_meas,
            "machine": b.estimate and plan.machine.as_dict(), "plan": b.describe()}
    if dev_meas:
        out_["device_ratio"] = dev_meas / dev_pred if dev_pred else None
    return out_


def step_deepspeed_small(out, dry):
    m = "dry" if dry else "gpu"
    py = os.environ.get("INFINITY_DS_PYTHON", sys.executable)
    probe = subprocess.run([py, "-c", "import deepspeed"], capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return {"skipped": f"deepspeed is not importable by {py}: {last}"}
    cmd = [py, os.path.join(TOOLS, "peers", "deepspeed_llama.py"), "--size", SIZE[m],
           "--seq", str(SEQ[m]), "--micro-batch", str(SMALL_BATCH[m]),
           "--steps", str(SMALL_STEPS[m]), "--lr", str(LR), "--clip", str(CLIP),
           "--device", "cpu" if dry else "cuda"]
    log("running " + " ".join(cmd[1:]))
    r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"error": f"no JSON line (rc {r.returncode})"}
    if r.returncode or "error" in res:
        write_json(os.path.join(out, "steps", "deepspeed_small.json"), res)
        raise SystemExit(1)
    return res


def step_diag(out, dry):
    """tools/gpu_diag.py: the first micro-step's gradient sums against plain PyTorch, per
    variant, then the default variant again with CUDA_LAUNCH_BLOCKING=1."""
    res = {}
    base = [sys.executable, "-P", os.path.join(TOOLS, "gpu_diag.py")]
    size = ["--size", "dry", "--layers", "2", "--seq", "64", "--batch", "2"] if dry else \
        ["--layers", "4"]
    probes = [] if dry else [a for v in ("default", "nockpt", "sync_all", "sync_giveback",
                                         "sync_h2d", "keep_bw", "nockpt_sync_all")
                             for a in ("--variant", v)]
    for tag, env_extra, variants in (("async", {}, probes),
                                     ("blocking", {"CUDA_LAUNCH_BLOCKING": "1"},
                                      ["--variant", "default"])):
        path = os.path.join(out, "steps", f"diag_{tag}.json")
        env = dict(os.environ, **env_extra)
        r = subprocess.run(base + [path] + size + variants, cwd=ROOT, env=env)
        res[tag] = {"rc": r.returncode, "variants": read_json(path)}
    return res


def step_adam(out, dry):
    """``infinity bench-adam``: CPU Adam against torch's fused Adam on this host."""
    n = "2000000" if dry else "200000000"
    r = subprocess.run([sys.executable, "-P", "-m", "infinity.cli.main", "bench-adam",
                        "--numel", n, "--rounds", "3", "--skip-foreach", "--json"],
                       cwd=ROOT, stdout=subprocess.PIPE, text=True)
    print(r.stdout[-3000:])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"rc": r.returncode}


STEPS = {"diag": step_diag, "adam": step_adam, "tests": step_tests, "rates": step_rates, "infinity_small": step_infinity_small,
         "deepspeed_small": step_deepspeed_small, "infinity_planned": step_infinity_planned,
         "infinity_nvme": step_infinity_nvme, "deepspeed_nvme": step_deepspeed_nvme}


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
              f"{ {True: 'MET', False: 'MISSED', None: 'not measured'}[v['met']] }")


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
    r.add_argument("--part", choices=sorted(PARTS), default="core")
    r.add_argument("--mode", choices=("gpu", "dry"), required=True)
    r.add_argument("--budget-s", type=float, default=360.0)
    s = sub.add_parser("step")
    s.add_argument("name", choices=sorted(STEPS))
    s.add_argument("--out", required=True)
    s.add_argument("--mode", choices=("gpu", "dry"), required=True)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run_steps(args)
    return step_main(args.name, args.out, args.mode)


if __name__ == "__main__":
    sys.exit(main())
