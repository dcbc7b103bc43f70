"""LoRA at a scale beyond RAM: a Llama-shaped model whose bf16 weights are over twice this
machine's RAM, built under ``infinity.Init`` (streamed to NVMe, never whole in memory),
its base kept as nf4 on NVMe (``offload.frozen_weights``, quantized group by group as
``initialize`` adopts it), LoRA adapters trained on it; peak RSS per phase against the
estimator's host prediction for the same run.

    .venv/bin/python tools/bench_lora_big.py --workdir /work/big-lora   # d 6144, 58 layers

Prints one line per phase and a JSON line at the end.  Needs about 1.3 x the bf16 model's
bytes free on the work directory's file system (the Init copy, then the nf4 base beside it
while it is adopted).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--intermediate", type=int, default=16384)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args(argv)
    import peft
    import transformers

    import infinity
    from infinity.estimate import Machine, estimate, spec_from_module
    from infinity.zero.init import Init

    os.makedirs(a.workdir, exist_ok=True)
    base_rss = rss_gb()               # torch, transformers, peft and infinity imported
    heads = max(1, a.hidden // 128)
    mcfg = transformers.LlamaConfig(vocab_size=264, hidden_size=a.hidden,
                                    intermediate_size=a.intermediate,
                                    num_hidden_layers=a.layers, num_attention_heads=heads,
                                    num_key_value_heads=heads, max_position_embeddings=256,
                                    use_cache=False, tie_word_embeddings=False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    off = {"params": "nvme", "optimizer": "cpu", "nvme_paths": [a.workdir],
           "frozen_weights": {"dtype": "nf4"}}
    cfg = {"precision": "bf16", "offload": off, "optimizer": {"lr": 1e-4}}
    out = {"hidden": a.hidden, "layers": a.layers, "intermediate": a.intermediate}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with Init({"offload": {"params": "nvme", "nvme_paths": [a.workdir]}}):
            base = transformers.LlamaForCausalLM(mcfg)
    finally:
        torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in base.parameters())
    out.update(params=n, bf16_gb=2 * n / 1e9, build_s=round(time.perf_counter() - t0, 1),
               rss_built_gb=round(rss_gb(), 2))
    print(f"built under Init: {n / 1e9:.2f} B params ({2 * n / 1e9:.1f} GB in bf16) in "
          f"{out['build_s']} s, peak RSS {out['rss_built_gb']} GB", flush=True)
    with torch.device("meta"):
        spec = spec_from_module(transformers.LlamaForCausalLM(mcfg), seq=a.tokens)
    from infinity.estimate.machine import detect_free_disk_gb
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    est = estimate(spec, machine=Machine(gpus=0, host_mem_gb=mem_gb,
                                         nvme_gb=detect_free_disk_gb(a.workdir)),
                   precision="bf16", configs=[("nvme", "cpu")], lora_rank=a.rank,
                   frozen_dtype="nf4")
    c = est.configs[0]
    # the estimator's host total at steady state: without the OS reserve and the
    # initialisation-only staging (the peak is in the steps)
    init_only = sum(i.nbytes for i in c.plan.items if "initialisation only" in i.name)
    pred = (c.totals["host_none"] - c.totals["host_reserve"] - init_only) / 1e9
    out["predicted_host_gb"] = round(pred, 2)
    model = peft.get_peft_model(base, peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank,
                                                      target_modules=targets,
                                                      lora_dropout=0.0))
    t0 = time.perf_counter()
    eng = infinity.initialize(model, cfg)
    out.update(initialize_s=round(time.perf_counter() - t0, 1), rss_adopted_gb=round(rss_gb(), 2),
               frozen_home_gb=round(sum(g.home_nbytes for g in eng.grouping.groups
                                        if g.quant is not None) / 1e9, 2))
    print(f"initialize (adopt + quantize to nf4): {out['initialize_s']} s, base at its home "
          f"{out['frozen_home_gb']} GB, peak RSS {out['rss_adopted_gb']} GB", flush=True)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    try:
        for i in range(a.steps):
            x = torch.randint(0, 256, (1, a.tokens), generator=g)
            before = eng.stats()
            t0 = time.perf_counter()
            loss = eng(input_ids=x, labels=x).loss
            eng.backward(loss)
            eng.step()
            times.append(round(time.perf_counter() - t0, 1))
            losses.append(float(loss.detach()))
            st = eng.stats()
            rd = st["frozen_nvme_read_bytes"] - before["frozen_nvme_read_bytes"]
            print(f"step {i}: {times[-1]} s, loss {losses[-1]:.4f}, frozen NVMe read "
                  f"{rd / 1e9:.2f} GB, peak RSS {rss_gb():.2f} GB", flush=True)
        out.update(step_s=times, losses=losses, frozen_read_gb_per_step=round(rd / 1e9, 2),
                   rss_peak_gb=round(rss_gb(), 2))
    finally:
        eng.close()
    out["rss_base_gb"] = round(base_rss, 2)
    out["rss_vs_predicted"] = round((out["rss_peak_gb"] - base_rss) / pred, 3)
    print(f"peak RSS {out['rss_peak_gb']} GB, {out['rss_peak_gb'] - base_rss:.2f} GB above the "
          f"imports ({base_rss:.2f} GB), vs the estimator's host prediction {pred:.2f} GB: "
          f"{out['rss_vs_predicted']}x; RAM {mem_gb:.1f} GB", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
