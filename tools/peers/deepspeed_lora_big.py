#!/usr/bin/env python
"""DeepSpeed ZeRO-3 as the peer of tools/bench_lora_big.py: LoRA on a Llama-shaped model far
larger than RAM, its bf16 base built under ``deepspeed.zero.Init(remote_device="nvme")`` and
kept on NVMe (``offload_param``), peft LoRA adapters (same rank and targets) trained with
AdamW (DeepSpeedCPUAdam, ``offload_optimizer`` cpu) over the trainable params only.

Run with the python of the separate DeepSpeed venv (tools/setup_deepspeed_venv.sh; it also
needs ``transformers`` and ``peft`` there), never the project's .venv:

    /tmp/infinity-dsvenv/bin/python tools/peers/deepspeed_lora_big.py \
        --workdir /work/ds-lora-big --steps 2          # d 6144, 58 layers: 26.3 B params

Single process on CPU (gloo; it sets the rank environment itself). Prints one line per phase
(build, peft, initialize, each step: wall time, peak RSS ``ru_maxrss``, bytes in the swap
directory), a progress line every ``--progress-s`` seconds, and at the end one JSON line
(also on failure or SIGTERM, with ``error``; exit code 1). Needs the bf16 model's bytes free
on the work directory's file system; the swap files stay there (DeepSpeed leaves them).
Config beyond DeepSpeed's defaults: ``buffer_size`` = the largest param, ``buffer_count``
8, ``stage3_max_reuse_distance`` 0 (see ``--max-reuse-distance``), aio 1 MiB blocks, QD 32.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepspeed_e2e import dir_bytes, single_process_env  # noqa: E402

T0 = time.perf_counter()


def peak_rss_gb():
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)


def cur_rss_gb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) * 1024 / 1e9, 2)
    return None


def log(msg):
    print(f"[deepspeed_lora_big +{time.perf_counter() - T0:.0f}s] {msg}", flush=True)


def ds_config(a, swap_dir, largest):
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3, "overlap_comm": False, "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": a.prefetch_bucket_size,
            "stage3_max_reuse_distance": a.max_reuse_distance,
            # buffer_size (elements) must hold the largest parameter (DeepSpeed default 1e8).
            "offload_param": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True,
                              "buffer_count": a.buffer_count,
                              "buffer_size": max(int(1e8), largest)},
            "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True, "use_gds": False},
    }


def run(a, res, swap_dir):
    single_process_env()
    import torch
    import deepspeed
    import peft
    import transformers
    res.update(versions={"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "peft": peft.__version__},
               rss_imports_gb=peak_rss_gb())
    deepspeed.init_distributed(dist_backend="gloo")

    def phase(name, t0, **extra):
        rec = {"s": round(time.perf_counter() - t0, 1), "peak_rss_gb": peak_rss_gb(),
               "rss_gb": cur_rss_gb(), "swap_gb": round(dir_bytes(swap_dir) / 1e9, 2), **extra}
        res["phases"][name] = rec
        log(f"phase {name}: {rec}")

    heads = max(1, a.hidden // 128)
    mcfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                                    intermediate_size=a.intermediate,
                                    num_hidden_layers=a.layers, num_attention_heads=heads,
                                    num_key_value_heads=heads, max_position_embeddings=256,
                                    use_cache=False, tie_word_embeddings=False)
    cfg = ds_config(a, swap_dir, largest=max(a.hidden * a.intermediate, a.vocab * a.hidden))
    res["config"] = cfg
    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)   # as bench_lora_big: no fp32 copy per weight
    try:
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme",
                                 pin_memory=True, dtype=torch.bfloat16):
            base = transformers.LlamaForCausalLM(mcfg)
    finally:
        torch.set_default_dtype(torch.float32)
    n = sum(getattr(p, "ds_numel", p.numel()) for p in base.parameters())
    res.update(params=n, bf16_gb=round(2 * n / 1e9, 2))
    phase("build", t0, params=n)

    t0 = time.perf_counter()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank,
                                                      target_modules=targets,
                                                      lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    res["trainable_params"] = sum(p.numel() for p in trainable)
    phase("peft", t0, trainable=res["trainable_params"])

    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=cfg)
    phase("initialize", t0)

    g = torch.Generator().manual_seed(1)
    res["losses"] = []
    for i in range(a.steps):
        x = torch.randint(0, min(256, a.vocab), (1, a.tokens), generator=g)
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        res["losses"].append(float(loss.detach()))
        phase(f"step{i}", t0, fwd_s=round(t1 - t0, 1), bwd_s=round(t2 - t1, 1),
              opt_s=round(time.perf_counter() - t2, 1), loss=res["losses"][-1])


def progress(swap_dir, every):
    while True:
        time.sleep(every)
        log(f"progress: rss {cur_rss_gb()} GB, peak {peak_rss_gb()} GB, swap dir "
            f"{dir_bytes(swap_dir) / 1e9:.2f} GB")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="swap files go under WORKDIR/swap")
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--intermediate", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=264, help="as bench_lora_big (264)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--buffer-count", type=int, default=8,
                    help="offload_param.buffer_count (each buffer holds the largest param)")
    ap.add_argument("--prefetch-bucket-size", type=int, default=int(5e7),
                    help="stage3_prefetch_bucket_size (DeepSpeed's default 5e7; 0: no prefetch)")
    ap.add_argument("--max-reuse-distance", type=int, default=0,
                    help="stage3_max_reuse_distance (DeepSpeed default 1e9): params reused within "
                         "it stay gathered, each holding an NVMe swap buffer; with 1e9 the second "
                         "step fails ('Not enough buffers 0 for swapping 1' at buffer_count 4 "
                         "or 8; 'param N already assigned swap buffer id M' at 16)")
    ap.add_argument("--progress-s", type=float, default=60.0)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt("SIGTERM")))
    swap_dir = os.path.join(os.path.abspath(a.workdir), "swap")
    os.makedirs(swap_dir, exist_ok=True)
    res = {"peer": "deepspeed-zero3-lora", "hidden": a.hidden, "layers": a.layers,
           "intermediate": a.intermediate, "vocab": a.vocab, "rank": a.rank,
           "tokens": a.tokens, "steps": a.steps, "swap_dir": swap_dir, "phases": {}}
    threading.Thread(target=progress, args=(swap_dir, a.progress_s), daemon=True).start()
    rc = 0
    try:
        run(a, res, swap_dir)
    except BaseException as e:  # noqa: BLE001 -- reported in the JSON line
        traceback.print_exc(file=sys.stdout)
        res["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    res.update(phases_reached=list(res["phases"]), peak_rss_gb=peak_rss_gb(),
               swap_gb_end=round(dir_bytes(swap_dir) / 1e9, 2),
               wall_s=round(time.perf_counter() - T0, 1))
    print(json.dumps(res, default=str), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
