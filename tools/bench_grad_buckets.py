"""The device peak at ZeRO stage 3 with gradient buckets against whole-group reductions.

Note [Gradient buckets] (infinity/zero/grad_buckets.py): on a separate device, stages 2-3
reduce gradients in buckets of ``reduce_bucket_mb`` in the working precision instead of
whole fp32 groups.  This runs a Llama-shaped model (transformers, from a config) at ZeRO
stage 3, bf16, parameters and optimizer in host memory, on the simulated device tier
(``INFINITY_SIMULATE_DEVICE=1``: the CUDA protocol with host memory as "device") at 2 and 4
ranks, once per setting, and prints per setting: the device peak (``engine.stats()``
``device_peak_bytes``, rank 0 and the largest over ranks), the placement plan's gradient
line, the estimator's gradient line for the same model and ranks, the gradient bytes
reduced per step and the step time.  Losses of every setting are printed against the
whole-group run (bf16 reductions differ from fp32 ones by rounding only).

    .venv/bin/python tools/bench_grad_buckets.py                 # 2 and 4 ranks
    .venv/bin/python tools/bench_grad_buckets.py --ranks 2 --steps 3
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

SETTINGS = [("whole groups (reduce_bucket_mb 0)", 0), ("buckets 128 MB (default)", 128),
            ("buckets 4 MB", 4)]
DIMS = dict(hidden=1024, intermediate=2816, layers=4, heads=8, vocab=8000)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=DIMS["hidden"], intermediate_size=DIMS["intermediate"],
                      num_hidden_layers=DIMS["layers"], num_attention_heads=DIMS["heads"],
                      num_key_value_heads=DIMS["heads"], vocab_size=DIMS["vocab"],
                      max_position_embeddings=256, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def child(spec):
    import torch
    import infinity
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = {"precision": "bf16", "zero_stage": 3, "reduce_bucket_mb": spec["bucket_mb"],
           "offload": {"params": "cpu", "optimizer": "cpu", "nvme_paths": [spec["swap"]]}}
    model = _model()
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, DIMS["vocab"], (spec["steps"], ws * spec["batch"], spec["seq"]),
                         generator=g)
    losses, times = [], []
    with infinity.initialize(model, cfg) as eng:
        line = {k: v for k, v in eng.placement.device.items() if "gradient" in k}
        for step in range(spec["steps"]):
            x = data[step, rank * spec["batch"]:(rank + 1) * spec["batch"]]
            t0 = time.perf_counter()
            out = eng(input_ids=x, labels=x)
            eng.backward(out.loss)
            eng.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(out.loss.detach().float()))
        st = eng.stats()
    print(json.dumps({"rank": rank, "losses": losses, "step_s": min(times[1:] or times),
                      "device_peak": st["device_peak_bytes"], "plan_line": line,
                      "reduced": st.get("reduce_scatter_bytes", 0) / spec["steps"],
                      "buckets": st.get("grad_buckets_reduced", 0) / spec["steps"],
                      "overflows": st.get("device_budget_overflows", 0)}))


def run(ws, bucket_mb, args, swap):
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    spec = {"bucket_mb": bucket_mb, "steps": args.steps, "batch": 1, "seq": args.seq,
            "swap": swap}
    env = dict(os.environ, INFINITY_SIMULATE_DEVICE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE=str(ws), LOCAL_WORLD_SIZE=str(ws),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                               json.dumps(spec)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(ws)]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a rank failed:\n{se[-3000:]}")
        out.append(json.loads(so.strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["rank"])


def predicted_line(ws, bucket_mb, seq):
    import torch
    from infinity.estimate import Machine, spec_from_module
    from infinity.estimate.memory_plan import Knobs, plan_memory
    with torch.device("meta"):
        m = _model()
    spec = spec_from_module(m, seq=seq, batch=1)
    pl = plan_memory(spec, Machine(gpus=ws, gpu_mem_gb=80, host_mem_gb=64, nvme_gb=10),
                     Knobs(precision="bf16", zero_stage=3, reduce_bucket_mb=bucket_mb),
                     "cpu", "cpu")
    return next(i.nbytes for i in pl.items if i.name == "grads of groups in backward")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    import tempfile
    MB = 1e6
    print(f"Llama {DIMS}, bf16, ZeRO stage 3, params/optimizer in host memory, simulated "
          f"device; {args.steps} steps of 1 x {args.seq} tokens per rank")
    print(f"{'ranks':>5}  {'setting':<34}{'peak r0':>9}{'peak max':>10}{'plan line':>10}"
          f"{'est line':>10}{'reduced/step':>13}{'buckets':>8}{'step s':>8}  losses vs whole")
    for ws in args.ranks:
        ref = None
        for name, mb in SETTINGS:
            with tempfile.TemporaryDirectory() as swap:
                res = run(ws, mb, args, swap)
            r0 = res[0]
            plan = sum(r0["plan_line"].values())
            est = predicted_line(ws, mb, args.seq)
            if ref is None:
                ref = r0["losses"]
            dl = max(abs(a - b) / abs(b) for a, b in zip(r0["losses"], ref))
            print(f"{ws:>5}  {name:<34}{r0['device_peak'] / MB:>8.1f}M"
                  f"{max(r['device_peak'] for r in res) / MB:>9.1f}M{plan / MB:>9.1f}M"
                  f"{est / MB:>9.1f}M{r0['reduced'] / MB:>12.1f}M{r0['buckets']:>8.0f}"
                  f"{r0['step_s']:>8.2f}  {dl:.1e}"
                  + ("  (device budget overflowed)" if any(r["overflows"] for r in res)
                     else ""))


if __name__ == "__main__":
    main()
