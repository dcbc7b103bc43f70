"""Activation offload on a long-sequence causal LM: peak RSS, step time and NVMe bytes of
each ``activation_offload`` home and scope against no offload, in the same run.

Each configuration trains the same Llama-shaped model (transformers, built from a local
config; no download) for a few steps in a child process and reports the steady-state peak
RSS above the process's RSS after the warm-up steps (VmHWM, reset with
``/proc/self/clear_refs`` then, so the measured peak is that of the steady-state steps), the median step time, the losses,
``engine.stats()`` ``activation_offload_bytes`` per step and the NVMe bytes per step.  The
parent prints each against the no-offload run of the same checkpointing:

* RSS saved / activation bytes offloaded (the target for home "nvme", scope "all": >= 0.8);
* step time ratio (cost);
* max |loss - loss without offload| (fp32: the target is < 1e-5).

    .venv/bin/python tools/bench_activation_offload.py              # S=2048, 16 layers, sdpa
    .venv/bin/python tools/bench_activation_offload.py --seq 1024 --only none --only nvme/all
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = [  # (label, checkpointing, home, scope)
    ("none", False, "none", "checkpoints"),
    ("cpu/all", False, "cpu", "all"),
    ("nvme/all", False, "nvme", "all"),
    ("none + ckpt", True, "none", "checkpoints"),
    ("cpu/checkpoints + ckpt", True, "cpu", "checkpoints"),
    ("nvme/checkpoints + ckpt", True, "nvme", "checkpoints"),
    ("nvme/all + ckpt", True, "nvme", "all"),
]


def _kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def child(spec):
    import ctypes

    import torch
    import transformers

    import infinity

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                                   intermediate_size=spec["hidden"] * 4,
                                   num_hidden_layers=spec["layers"],
                                   num_attention_heads=spec["hidden"] // 64,
                                   num_key_value_heads=spec["hidden"] // 64,
                                   max_position_embeddings=spec["seq"],
                                   attn_implementation=spec["attn"])
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    if spec["ckpt"]:
        model.gradient_checkpointing_enable()
    model.train()
    conf = {"offload": {"nvme_paths": [spec["swap"]]},
            "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
            "activation_offload": {"home": spec["home"], "scope": spec["scope"]}}
    eng = infinity.initialize(model, conf)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
    losses, times, offl, nvme = [], [], [], []
    for i in range(spec["steps"]):
        if i == spec["warmup"]:                    # after the warm-up steps (heap settled)
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            base = _kb("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        s0 = eng.stats()
        t0 = time.perf_counter()
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.step()
        times.append(time.perf_counter() - t0)
        s1 = eng.stats()
        losses.append(float(out.loss))
        del out
        offl.append(s1["activation_offload_bytes"] - s0["activation_offload_bytes"])
        nvme.append(s1["nvme_read_bytes"] + s1["nvme_write_bytes"]
                    - s0["nvme_read_bytes"] - s0["nvme_write_bytes"])
    res = {"peak_above_base": _kb("VmHWM") - base, "step_s": statistics.median(times[spec["warmup"]:]),
           "losses": losses, "offload_bytes": offl[-1], "nvme_bytes": nvme[-1]}
    eng.close()
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--attn", default="sdpa", help="attention implementation (default sdpa)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="steps before measuring (default 2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", action="append", help="labels to run (repeatable)")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = {}
    for label, ckpt, home, scope in CONFIGS:
        if args.only and label not in args.only:
            continue
        with tempfile.TemporaryDirectory(prefix="bench-act-", dir=root) as swap:
            spec = {"seq": args.seq, "hidden": args.hidden, "layers": args.layers,
                    "vocab": args.vocab, "batch": args.batch, "steps": args.steps,
                    "warmup": args.warmup,
                    "threads": args.threads, "attn": args.attn, "ckpt": ckpt, "home": home, "scope": scope,
                    "swap": swap}
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                json.dumps(spec)], capture_output=True, text=True, timeout=1800)
            if p.returncode:
                print(f"{label}: child failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                continue
            rows[label] = (ckpt, json.loads(p.stdout.strip().splitlines()[-1]))
    MB = 1e6
    print(f"Llama-shaped causal LM: seq {args.seq}, batch {args.batch}, hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}, fp32, {args.attn} attention, {args.threads} thread(s)")
    print(f"{'configuration':<26}{'peak RSS MB':>12}{'offloaded MB':>13}{'RSS saved/offl':>15}"
          f"{'NVMe MB/step':>13}{'step s':>8}{'x time':>8}{'max |dloss|':>12}")
    for label, (ckpt, r) in rows.items():
        ref = rows.get("none + ckpt" if ckpt else "none")
        saved = ratio = dl = ""
        if ref is not None and label not in ("none", "none + ckpt"):
            ref = ref[1]
            if r["offload_bytes"]:
                saved = f"{(ref['peak_above_base'] - r['peak_above_base']) / r['offload_bytes']:.3f}"
            ratio = f"{r['step_s'] / ref['step_s']:.2f}"
            dl = f"{max(abs(a - b) for a, b in zip(r['losses'], ref['losses'])):.1e}"
        print(f"{label:<26}{r['peak_above_base'] / MB:>12.1f}{r['offload_bytes'] / MB:>13.1f}"
              f"{saved:>15}{r['nvme_bytes'] / MB:>13.1f}{r['step_s']:>8.2f}{ratio:>8}{dl:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
