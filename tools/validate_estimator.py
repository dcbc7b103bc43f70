"""Check `infinity estimate` against measurements on this machine.

For each configuration a child process builds a small GPT-2 (transformers, from a
config), trains it with the infinity engine, and reports

* host memory: the steady-state peak RSS above the torch baseline. Baseline = the
  process's RSS after importing torch/transformers/infinity and running one plain-PyTorch
  forward/backward of a tiny GPT-2 (so lazily loaded kernels and thread pools count as
  torch's), before building the model.
  The peak is the kernel's high-water mark (VmHWM, what ``ru_maxrss`` reports) over
  steady-state steps, reset with ``/proc/self/clear_refs`` (5) after the warm-up step so
  the one-off initialisation peak (the eagerly built fp32 model and its copy into the
  homes) is excluded; ``ru_maxrss`` above the baseline over the whole run is printed too.
* NVMe bytes per step over one steady-state step (not the first two: Adam moments are
  not read before they have been written): what the kernel saw the process read from and
  write to the block layer (``/proc/self/io`` ``read_bytes``/``write_bytes``, all threads
  including io_uring workers; O_DIRECT, so no page cache in between), and, for
  comparison, the engine's own ``engine.stats()`` ``nvme_read_bytes``/``nvme_write_bytes``.

and the parent compares them with ``infinity.estimate`` for the same model, machine
(CPU-only, so the device tier is host memory) and settings. The predicted host figure
is pinned + pageable + device (activations without checkpointing), excluding the
estimator's OS/runtime reserve and the initialisation-only staging buffer.

    .venv/bin/python tools/validate_estimator.py            # default configurations
    .venv/bin/python tools/validate_estimator.py --quick    # smaller model, 4 configurations
    .venv/bin/python tools/validate_estimator.py --zero     # ZeRO-3, 2 ranks, streamed shards
    .venv/bin/python tools/validate_estimator.py --lora     # LoRA over a bf16 / nf4 / int8 base
    .venv/bin/python tools/validate_estimator.py --pcie     # activation offload's D2H / H2D bytes
    .venv/bin/python tools/validate_estimator.py --device-line  # ZeRO-3 device gradient line
"""
import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_model import proc_io  # noqa: E402  (this process's block-layer bytes)

# (precision, params home, optimizer home, gradient accumulation steps, offload.host_memory_gb)
# The last two run under a host cap too small for the fp32 gradients: the engine homes them
# on NVMe (infinity/grads/nvme_store.py) and the estimator must predict that by itself.
CONFIGS = [
    ("fp32", "none", "none", 1, None),
    ("fp32", "cpu", "cpu", 1, None),
    ("bf16", "cpu", "nvme", 1, None),
    ("bf16", "nvme", "nvme", 1, None),
    ("fp32", "nvme", "nvme", 1, None),
    ("bf16", "nvme", "nvme", 3, None),
    ("bf16", "nvme", "nvme", 1, 0.08),
    ("bf16", "nvme", "nvme", 2, 0.08),
    # accumulation schemes of the NVMe gradient home (issue 17): bf16 partial sums (lossy)
    ("bf16", "nvme", "nvme", 2, 0.08, {"gdtype": "bf16"}),
    # activation offload (issue 17): home / scope, with Hugging Face gradient checkpointing
    ("fp32", "cpu", "cpu", 1, None, {"act": ("cpu", "all")}),
    ("fp32", "cpu", "cpu", 1, None, {"act": ("nvme", "all")}),
    ("fp32", "cpu", "cpu", 1, None, {"act": ("cpu", "checkpoints"), "ckpt": True}),
    ("fp32", "cpu", "cpu", 1, None, {"act": ("nvme", "checkpoints"), "ckpt": True}),
    # memory-centric tiling (issue 18): the tied wte / lm_head group (16.8 MB) in tiles under
    # a 6 MB limit; the fp32 nvme/nvme row above is the same run untiled
    ("fp32", "nvme", "nvme", 1, None, {"tile": 0.006}),
]
# --quick: a 4.2M-parameter model; its cap scaled so the gradients still go to NVMe
QUICK = [CONFIGS[1], CONFIGS[2], CONFIGS[5], ("bf16", "nvme", "nvme", 1, 0.021)]
# --only-new: the rows issues 17 and 18 added
NEW = CONFIGS[8:]
# --tiling: the tiling row and its untiled peer, then the same pair at ZeRO stage 3 on 2
# ranks (each rank a process; predicted per rank as 2 CPU-only one-rank "nodes", measured
# on rank 0, rank 1 shown in the JSON)
TILING = [CONFIGS[4], CONFIGS[-1],
          ("fp32", "nvme", "nvme", 1, None, {"ws": 2}),
          ("fp32", "nvme", "nvme", 1, None, {"ws": 2, "tile": 0.006})]
# --recompute: Hugging Face gradient checkpointing with the blocks' MLP matrices (4.2 MB,
# fp32) tiled under a 2 MB limit: the recompute keeps its tiles for the backward (Note
# [Recompute keeps its tiles]), so the tiled groups are read twice per step, not three times
RECOMPUTE = [("fp32", "nvme", "nvme", 1, None, {"ckpt": True}),
             ("fp32", "nvme", "nvme", 1, None, {"ckpt": True, "tile": 0.002})]
# --zero (issue 18): ZeRO stage 3 at 2 ranks (gloo, this machine) with the fp32 gradient
# shards spilled to NVMe by the cap (N/R*4 above half of it) and the last micro-step's final
# shards streamed (Note [Streamed gradients]); predicted as two one-rank CPU nodes (per rank)
ZERO = [("bf16", "nvme", "nvme", 2, 0.08, {"ws": 2}),
        ("bf16", "nvme", "nvme", 2, 0.08, {"ws": 2, "gdtype": "bf16"})]
# --lora: PEFT LoRA (rank 8 on every projection of the blocks) over the frozen base, params
# and optimizer on NVMe: the base in the working precision, then kept quantized
# (offload.frozen_weights): the frozen bytes read per step are what the estimator counts
LORA = [("bf16", "nvme", "nvme", 1, None, {"lora": 8}),
        ("bf16", "nvme", "nvme", 1, None, {"lora": 8, "frozen": "nf4"}),
        ("bf16", "nvme", "nvme", 1, None, {"lora": 8, "frozen": "int8"})]
# --pcie: activation offload to host memory on the simulated device (INFINITY_SIMULATE_DEVICE=1,
# the GPU protocol on this CPU): the bytes the estimator puts on PCIe for it, D2H in forward
# and H2D in backward per micro-batch, against the engine's activation_offload_bytes /
# activation_fetch_bytes (predicted for one GPU with the eager activation model: the model
# runs eagerly on this CPU)
PCIE = [("fp32", "cpu", "cpu", 1, None, {"act": ("cpu", "all"), "sim": True}),
        ("fp32", "cpu", "cpu", 1, None, {"act": ("cpu", "checkpoints"), "ckpt": True,
                                        "sim": True}),
        ("bf16", "cpu", "cpu", 1, None, {"act": ("cpu", "all"), "sim": True}),
        # a*S/H = 2, batch 1 (the bf16 constants come from this row and the one above)
        ("bf16", "cpu", "cpu", 1, None, {"act": ("cpu", "all"), "sim": True, "seq": 128,
                                        "batch": 1, "depth": 2}),
        ("bf16", "cpu", "cpu", 1, None, {"act": ("cpu", "checkpoints"), "ckpt": True,
                                        "sim": True, "seq": 128, "batch": 1, "depth": 2}),
        # a*S/H = 4: beyond both shapes the bf16 constants were measured at
        ("bf16", "cpu", "cpu", 1, None, {"act": ("cpu", "all"), "sim": True, "seq": 256,
                                        "batch": 1, "depth": 2})]
# --planned (issue 18): the configuration `infinity estimate --plan` picks for the validation
# model under these offload.host_memory_gb caps (global batch 4 sequences, fp32), run here
PLANNED_CAPS = (0.5, 0.4)
PLANNED_GLOBAL_BATCH = 4


def planned_configs(model, seq=64, caps=PLANNED_CAPS, global_batch=PLANNED_GLOBAL_BATCH):
    """The planner's choice for ``model`` (a GPT2Config dict) on this CPU-only machine under
    each cap, as CONFIGS rows (its micro-batch, accumulation, depth, activations, homes)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from infinity.estimate import Machine, knobs_from, spec_from_module
    from infinity.estimate.planner import make_plan
    with torch.device("meta"):
        meta = GPT2LMHeadModel(GPT2Config(**model))
    spec = spec_from_module(meta, seq=seq)
    rows = []
    for cap in caps:
        knobs = knobs_from({"precision": "fp32", "offload": {"host_memory_gb": cap}}, {})
        b = make_plan(spec, Machine(gpus=0, host_mem_gb=1000, nvme_gb=1000), knobs,
                      global_batch=global_batch, clip=0.0).best   # (the runs do not clip)
        if b is None:
            raise RuntimeError(f"the planner finds no plan under a {cap} GB cap")
        k = b.knobs
        extra = {"batch": b.micro_batch, "depth": k.prefetch_depth, "planned": True}
        if k.activation_home != "none":
            extra["act"] = (k.activation_home, k.activation_scope)
        if b.checkpointing:
            extra["ckpt"] = True
        rows.append(("fp32", b.params_home, b.optimizer_home, k.grad_accum, cap, extra))
    return rows

def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _trim():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def child(spec):
    import resource

    import torch
    import transformers  # noqa: F401  (part of the baseline)

    import infinity
    import infinity.io  # noqa: F401  (extensions loaded: part of the baseline)
    import infinity.optim  # noqa: F401
    from transformers import GPT2Config, GPT2LMHeadModel
    if spec.get("lora"):
        import peft  # noqa: F401  (part of the baseline, as transformers is)

    torch.set_num_threads(1)
    # torch-only baseline: the runtime after one plain-PyTorch forward/backward of a tiny
    # model of the same family (lazily loaded kernels, thread pools, allocator arenas)
    tiny = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32))
    t = torch.randint(0, 64, (2, 16))
    tiny(input_ids=t, labels=t).loss.backward()
    del tiny, t
    _trim()
    base = _status_kb("VmRSS")
    torch.manual_seed(0)
    cfg = GPT2Config(**spec["model"])
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    if spec.get("ckpt"):
        model.gradient_checkpointing_enable()
        model.train()
    if spec.get("lora"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=spec["lora"], lora_alpha=2 * spec["lora"], lora_dropout=0.0,
            target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))
    conf = {"precision": spec["precision"],
            "offload": {"params": spec["params"], "optimizer": spec["optimizer"],
                        "nvme_paths": [spec["swap"]]},
            "prefetch": {"depth": spec["depth"]},
            "gradient_accumulation_steps": spec["accum"],
            "gradient_accumulation_dtype": spec.get("gdtype", "fp32")}
    if spec.get("act"):
        conf["activation_offload"] = {"home": spec["act"][0], "scope": spec["act"][1]}
    if spec["cap"] is not None:
        conf["offload"]["host_memory_gb"] = spec["cap"]
    if spec.get("tile"):
        conf["tiling"] = {"max_group_gb": spec["tile"]}
    if spec.get("frozen"):
        conf["offload"]["frozen_weights"] = {"dtype": spec["frozen"]}
    if spec.get("ws", 1) > 1:
        conf["zero_stage"] = 3
        conf["dist_timeout_s"] = 300
    eng = infinity.initialize(model, conf)
    del model
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]), generator=g)

    micro = {}

    def step():  # one optimizer step = `accum` micro-batches
        for i in range(spec["accum"]):
            io_a = proc_io()
            out = eng(input_ids=x, labels=x)
            eng.backward(out.loss)
            eng.step()
            if i == 0:                  # NVMe bytes of a micro-batch without the optimizer
                io_b = proc_io()       # (accumulation > 1) or with it (accumulation 1)
                micro["bytes"] = (io_b["read_bytes"] - io_a["read_bytes"]
                                  + io_b["write_bytes"] - io_a["write_bytes"])
        return float(out.loss.detach())

    step()                       # warm-up: records the module order, writes m/v once
    step()                       # first step that reads m/v back
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")             # reset VmHWM to the current RSS
    s0, io0 = eng.stats(), proc_io()
    loss = step()
    s1, io1 = eng.stats(), proc_io()
    loss = step()
    hwm = _status_kb("VmHWM")
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = {"base_rss": base, "steady_hwm": hwm, "maxrss": maxrss,
           "nvme_read": s1["nvme_read_bytes"] - s0["nvme_read_bytes"],
           "nvme_write": s1["nvme_write_bytes"] - s0["nvme_write_bytes"],
           "proc_read": io1["read_bytes"] - io0["read_bytes"],
           "proc_write": io1["write_bytes"] - io0["write_bytes"],
           "micro_nvme": micro["bytes"],
           "act_offload": (s1["activation_offload_bytes"] - s0["activation_offload_bytes"])
           // spec["accum"],
           "act_fetch": (s1["activation_fetch_bytes"] - s0["activation_fetch_bytes"])
           // spec["accum"],
           "sim_device": eng.mm.dev.kind,
           "loss": loss, "engine_plan_host": eng.placement.host_total,
           "tiles_forward": s1.get("tiles_forward", 0) - s0.get("tiles_forward", 0),
           "engine_grad_home": "nvme" if eng.zero is not None and eng.zero.spill
           else eng.placement.grad_home,
           "overlapped": s1.get("optimizer_groups_overlapped", 0)
           - s0.get("optimizer_groups_overlapped", 0),
           "stream_window": eng.placement.stream_window}
    eng.close()
    print(json.dumps(res))


def predict(spec):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from infinity.estimate import Machine, estimate, spec_from_module
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(**spec["model"]))
    ms = spec_from_module(model, seq=spec["seq"], batch=spec["batch"])
    act = spec.get("act") or ("none", "checkpoints")
    # ZeRO on CPU-only ranks: one rank per "node", so the per-node figures are per rank
    machine = Machine(gpus=1, gpu_mem_gb=1000, host_mem_gb=1000, nvme_gb=1000) \
        if spec.get("sim") else Machine(gpus=0, host_mem_gb=1000, nvme_gb=1000,
                                        nodes=spec.get("ws", 1))
    est = estimate(ms, machine=machine, activation_model="eager" if spec.get("sim") else None,
                   precision=spec["precision"], prefetch_depth=spec["depth"], grad_accum=spec["accum"],
                   host_cap_gb=spec["cap"], configs=[(spec["params"], spec["optimizer"])],
                   activation_home=act[0], activation_scope=act[1],
                   grad_accum_dtype=spec.get("gdtype", "fp32"),
                   tiling_max_group_gb=spec.get("tile"), lora_rank=spec.get("lora"),
                   frozen_dtype=spec.get("frozen"))
    c = est.configs[0]
    v = "checkpointing" if spec.get("ckpt") else "none"
    init_only = sum(i.nbytes for i in c.plan.items if "initialisation only" in i.name)
    off = c.plan.activation_offload.get(v)
    off_host = off.nbytes if off is not None and off.tier == "pinned" else 0
    host = c.totals["pinned"] + c.totals["pageable"] + c.totals[f"device_{v}"] + off_host - init_only
    if est.machine.cpu_only:     # the estimator's own host total (undo copies and activations
        host = c.totals[f"host_{v}"] - c.totals["host_reserve"] - init_only   # share backward)
    tr = c.steps[v].traffic
    from infinity.estimate.step_time import _sum, _with_activations, traffic_per_step
    parts = _with_activations(traffic_per_step(ms, est.machine, est.knobs, c.plan), c.plan,
                              v == "checkpointing", machine=est.machine)
    act_pcie = {link: sum(b for w, b in parts["mb"][link] if w == "offloaded activations")
                for link in ("d2h", "h2d")}
    mb, opt = _sum(parts["mb"]), _sum(parts["opt"])
    micro = mb["nvme_read"] + mb["nvme_write"] + (
        opt["nvme_read"] + opt["nvme_write"] if spec["accum"] == 1 else 0)
    if spec["accum"] > 1 and c.plan.grads_on_nvme:
        # the first micro-batch of a window only writes the gradients' partial sums (fp32
        # N*4, bf16 N*2 of the NVMe part); the estimator's per-micro-batch traffic averages
        # the window's reads and writes
        grads = sum(b for link in ("nvme_read", "nvme_write") for w, b in parts["mb"][link]
                    if "grads" in w)
        gn = spec_grad = -(-ms.params // spec.get("ws", 1)) * 4 - c.plan.grad_host_bytes
        micro += -grads + (gn // 2 if spec.get("gdtype") == "bf16" else spec_grad)
    return {"host": host, "nvme_read": tr["nvme_read"], "nvme_write": tr["nvme_write"],
            "params": ms.params, "grads_on_nvme": c.plan.grads_on_nvme,
            "grads_streamed": c.plan.grads_streamed, "micro_nvme": micro,
            "act_offload": 0 if off is None else off.nbytes,
            "act_d2h": act_pcie["d2h"], "act_h2d": act_pcie["h2d"]}


def _run_children(spec):
    """One child (world size 1) or ``spec["ws"]`` ranks as torchrun would start them; the
    measurements of each rank in rank order, or None when one failed."""
    ws = spec.get("ws", 1)
    env = dict(os.environ)
    if spec.get("sim"):
        env["INFINITY_SIMULATE_DEVICE"] = "1"
    if ws > 1:
        import socket
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            port = so.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ws),
                   LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    procs = []
    for r in range(ws):
        e = dict(env, RANK=str(r), LOCAL_RANK="0") if ws > 1 else env
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                       json.dumps(spec)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=900)
            if p.returncode != 0:
                print(se[-3000:], file=sys.stderr)
                return None
            out.append(json.loads(so.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _ratio(pred, meas):
    if meas == 0 and pred == 0:
        return "  exact"
    if meas == 0:
        return "   n/a"
    return f"{pred / meas:6.3f}"


def _print_pcie(rows, model) -> int:
    MB = 1e6
    print(f"model: GPT-2 {model}, seq 64, batch 2; per micro-batch, MB: activation offload's "
          f"D2H (forward) and H2D (backward), predicted vs engine.stats() on the simulated device")
    print(f"{'configuration':<52}{'device':>10}{'D2H pred':>10}{'meas':>8}{'ratio':>7}"
          f"{'H2D pred':>10}{'meas':>8}{'ratio':>7}")
    ok = 0
    for r in rows:
        good = r["device"] == "simulated" and all(
            r[f"meas_{k}"] > 0 and abs(r[f"pred_{k}"] / r[f"meas_{k}"] - 1) <= 0.15
            for k in ("act_d2h", "act_h2d"))
        ok += good
        print(f"{r['config']:<52}{r['device']:>10}{r['pred_act_d2h'] / MB:>10.2f}"
              f"{r['meas_act_d2h'] / MB:>8.2f}{_ratio(r['pred_act_d2h'], r['meas_act_d2h']):>7}"
              f"{r['pred_act_h2d'] / MB:>10.2f}{r['meas_act_h2d'] / MB:>8.2f}"
              f"{_ratio(r['pred_act_h2d'], r['meas_act_h2d']):>7}  "
              f"{'within 15 %' if good else 'OFF'}")
    print(f"{ok} of {len(rows)} configurations within 15 % on activation offload's PCIe bytes")
    return 0


def _device_line_rows() -> int:
    """The estimator's device gradient line at ZeRO stage 3 (buckets and whole groups)
    against the placement plan the engine builds for the same model and ranks."""
    import bench_grad_buckets as bgb
    args = argparse.Namespace(steps=1, seq=64)
    ok = n = 0
    print("Llama (tools/bench_grad_buckets.py), ZeRO-3 bf16 on the simulated device: the "
          "device gradient line, MB")
    for ws in (2, 4):
        for name, mb in bgb.SETTINGS:
            with tempfile.TemporaryDirectory() as swap:
                res = bgb.run(ws, mb, args, swap)
            eng = sum(res[0]["plan_line"].values())
            est = bgb.predicted_line(ws, mb, args.seq)
            good = eng > 0 and abs(est / eng - 1) <= 0.15
            ok, n = ok + good, n + 1
            print(f"  {ws} ranks, {name:<34} engine {eng / 1e6:8.1f}  estimator "
                  f"{est / 1e6:8.1f}  ratio {est / eng:6.3f}  {'within 15 %' if good else 'OFF'}")
    print(f"{ok} of {n} rows within 15 %")
    return 0 if ok == n else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smaller model, 4 configurations")
    ap.add_argument("--only-new", action="store_true",
                    help="only the activation-offload and accumulation-scheme rows")
    ap.add_argument("--planned", action="store_true",
                    help="only the planner's choices under squeezed host caps (issue 18)")
    ap.add_argument("--tiling", action="store_true",
                    help="only the tiling row and its untiled peer (issue 18)")
    ap.add_argument("--recompute", action="store_true",
                    help="only the checkpointed rows, untiled and tiled (the recompute's tiles)")
    ap.add_argument("--zero", action="store_true",
                    help="only the ZeRO rows: 2 ranks, spilled and streamed gradient shards")
    ap.add_argument("--lora", action="store_true",
                    help="only the LoRA rows: the base in bf16, nf4 and int8")
    ap.add_argument("--pcie", action="store_true",
                    help="only activation offload's PCIe bytes, on the simulated device")
    ap.add_argument("--device-line", action="store_true",
                    help="only the ZeRO-3 device gradient line against the engine's own plan "
                         "(tools/bench_grad_buckets.py, 2 and 4 simulated-device ranks)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    if args.device_line:
        return _device_line_rows()
    if args.quick:
        model = dict(vocab_size=4096, n_embd=256, n_layer=4, n_head=4, n_positions=128)
        configs = QUICK
    else:
        model = dict(vocab_size=8192, n_embd=512, n_layer=6, n_head=8, n_positions=256)
        configs = NEW if args.only_new else CONFIGS
        if args.tiling:
            configs = TILING
        elif args.recompute:
            configs = RECOMPUTE
        elif args.zero:
            configs = ZERO
        elif args.lora:
            configs = LORA
        elif args.pcie:
            configs = PCIE
        elif args.planned:
            configs = planned_configs(model)
        elif not args.only_new:
            configs = configs + planned_configs(model)
    rows = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for precision, params, optimizer, accum, cap, *more in configs:
        extra = more[0] if more else {}
        with tempfile.TemporaryDirectory(prefix="validate-est-", dir=root) as swap:
            spec = {"model": model, "precision": precision, "params": params,
                    "optimizer": optimizer, "swap": swap, "depth": 2, "seq": 64, "batch": 2,
                    "accum": accum, "cap": cap, **extra}
            spec.pop("planned", None)
            t0 = time.perf_counter()
            ranks = _run_children(spec)
            if ranks is None:
                print(f"{precision} {params}/{optimizer} accum {accum}: child failed", file=sys.stderr)
                continue
            meas = ranks[0]
            for r, m in enumerate(ranks if len(ranks) > 1 else []):
                print(f"  rank {r}: host {(m['steady_hwm'] - m['base_rss']) / 1e6:.1f} MB, NVMe "
                      f"read {m['proc_read'] / 1e6:.1f} MB, write {m['proc_write'] / 1e6:.1f} MB "
                      f"per step; {m['overlapped']} groups stepped as their shard landed "
                      f"(window {m['stream_window']})", file=sys.stderr)
            pred = predict(spec)
            name = (("planned " if extra.get("planned") else "")
                    + f"{precision} params={params} optimizer={optimizer}"
                    + (f" B={extra['batch']} d={extra['depth']}" if "batch" in extra else "")
                    + (f" S={extra['seq']}" if "seq" in extra else "")
                    + (f" accum={accum}" if accum > 1 else "")
                    + (f" cap={cap:g}GB" if cap is not None else "")
                    + (f" grads {extra['gdtype']}" if extra.get("gdtype") else "")
                    + (f" act={extra['act'][0]}/{extra['act'][1]}" if extra.get("act") else "")
                    + (" ckpt" if extra.get("ckpt") else "")
                    + (f" LoRA r={extra['lora']}" if extra.get("lora") else "")
                    + (f" base {extra['frozen']}" if extra.get("frozen") else "")
                    + (f" tiling={extra['tile']:g}GB" if extra.get("tile") else "")
                    + (f" ZeRO-3 ws={extra['ws']} rank 0" if extra.get("ws", 1) > 1 else "")
                    + (" streamed" if pred["grads_streamed"] and extra.get("ws", 1) > 1
                       else ""))
            rows.append({"config": name,
                         "params": pred["params"], "seconds": time.perf_counter() - t0,
                         "pred_host": pred["host"], "meas_host": meas["steady_hwm"] - meas["base_rss"],
                         "meas_host_maxrss": meas["maxrss"] - meas["base_rss"],
                         "pred_nvme_read": pred["nvme_read"], "meas_nvme_read": meas["proc_read"],
                         "stats_nvme_read": meas["nvme_read"],
                         "pred_nvme_write": pred["nvme_write"], "meas_nvme_write": meas["proc_write"],
                         "stats_nvme_write": meas["nvme_write"],
                         "pred_micro_nvme": pred["micro_nvme"], "meas_micro_nvme": meas["micro_nvme"],
                         "pred_act_offload": pred["act_offload"], "meas_act_offload": meas["act_offload"],
                         "pred_act_d2h": pred["act_d2h"], "meas_act_d2h": meas["act_offload"],
                         "pred_act_h2d": pred["act_h2d"], "meas_act_h2d": meas["act_fetch"],
                         "device": meas["sim_device"],
                         "tiles_forward": meas["tiles_forward"],
                         "other_ranks": [{k: m[k] for k in ("steady_hwm", "base_rss", "proc_read",
                                                            "proc_write")} for m in ranks[1:]],
                         "pred_grads": "nvme" if pred["grads_on_nvme"] else "host",
                         "meas_grads": meas["engine_grad_home"]})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    MB = 1e6
    if args.pcie:
        return _print_pcie(rows, model)
    print(f"model: GPT-2 {model}, {rows[0]['params'] / 1e6:.1f}M params, seq 64, batch 2, prefetch depth 2"
          if rows else "no rows")
    print("host = steady-state peak RSS above the torch baseline (MB); NVMe = MB per step, measured by "
          "the kernel (/proc/self/io), engine.stats() in brackets")
    print(f"{'configuration':<50}{'grads pred/eng':>15}{'host pred':>10}{'meas':>8}{'ratio':>7}"
          f"{'rd pred':>10}{'meas':>8}{'[stats]':>9}{'ratio':>7}"
          f"{'wr pred':>10}{'meas':>8}{'[stats]':>9}{'ratio':>7}")
    ok = 0
    for r in rows:
        good = all(
            (r[f"pred_{k}"] == r[f"meas_{k}"] == 0) or
            (r[f"meas_{k}"] > 0 and abs(r[f"pred_{k}"] / r[f"meas_{k}"] - 1) <= 0.15)
            for k in ("host", "nvme_read", "nvme_write")) and r["pred_grads"] == r["meas_grads"]
        ok += good
        print(f"{r['config']:<50}{r['pred_grads'] + '/' + r['meas_grads']:>15}{r['pred_host'] / MB:>10.1f}{r['meas_host'] / MB:>8.1f}"
              f"{_ratio(r['pred_host'], r['meas_host']):>7}"
              f"{r['pred_nvme_read'] / MB:>10.1f}{r['meas_nvme_read'] / MB:>8.1f}"
              f"{'[' + format(r['stats_nvme_read'] / MB, '.1f') + ']':>9}"
              f"{_ratio(r['pred_nvme_read'], r['meas_nvme_read']):>7}"
              f"{r['pred_nvme_write'] / MB:>10.1f}{r['meas_nvme_write'] / MB:>8.1f}"
              f"{'[' + format(r['stats_nvme_write'] / MB, '.1f') + ']':>9}"
              f"{_ratio(r['pred_nvme_write'], r['meas_nvme_write']):>7}  {'within 15 %' if good else 'OFF'}")
    print(f"{ok} of {len(rows)} configurations within 15 % on host memory and NVMe bytes per step "
          f"(and the gradient home predicted as the engine chose it)")
    extra = [r for r in rows if r["meas_act_offload"] or " accum=" in r["config"]]
    if extra:
        print("\nper micro-batch (the first of a step; with accumulation 1 it includes the optimizer): "
              "NVMe MB read + written (kernel), activations offloaded MB (engine.stats())")
        print(f"{'configuration':<62}{'NVMe pred':>10}{'meas':>8}{'ratio':>7}"
              f"{'act pred':>10}{'meas':>8}{'ratio':>7}")
        for r in extra:
            print(f"{r['config']:<62}{r['pred_micro_nvme'] / MB:>10.1f}{r['meas_micro_nvme'] / MB:>8.1f}"
                  f"{_ratio(r['pred_micro_nvme'], r['meas_micro_nvme']):>7}"
                  f"{r['pred_act_offload'] / MB:>10.1f}{r['meas_act_offload'] / MB:>8.1f}"
                  f"{_ratio(r['pred_act_offload'], r['meas_act_offload']):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
