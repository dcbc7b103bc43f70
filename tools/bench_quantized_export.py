#!/usr/bin/env python
"""Held-out perplexity of a model fine-tuned here, exported 16-bit vs INT8 vs INT4 vs
INT4 + layer-by-layer distillation (LKD), each loaded back with plain
``AutoModelForCausalLM.from_pretrained`` (compressed-tensors for the quantized ones).

1. ``infinity finetune`` a Llama-shaped byte-level LM (from ``--hidden/--inter/--layers``)
   on the first 90 % of the shipped corpus (``--steps``); the last 10 % is held out.
2. ``infinity export`` of its checkpoint: ``--dtype bf16``; ``--quantize int8``;
   ``--quantize int4``; ``--quantize int4 --lkd`` with calibration text from the training
   split, and with tokens the model generates itself, in both LKD modes (ste, scale).
3. Perplexity of each on ``--eval-windows`` held-out windows of ``--seq-len`` tokens, the
   INT4 gap closed by LKD (``(ppl_int4 - ppl_lkd) / (ppl_int4 - ppl_bf16)``), the export
   times and sizes.

    .venv/bin/python tools/bench_quantized_export.py --workdir /tmp/bq            # ~20 min on a loaded 2-core VM
    .venv/bin/python tools/bench_quantized_export.py --workdir /tmp/bq --reuse    # exports only
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(*args):
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "infinity", *args], capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"infinity {' '.join(args)} failed:\n{r.stderr[-4000:]}")
    return time.monotonic() - t, r.stderr


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))


def perplexity(path, ids, seq_len, batch=8):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch):
            x = ids[i:i + batch]
            logits = model(x).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1), reduction="sum")
            nll += loss.item()
            n += x[:, 1:].numel()
    return math.exp(nll / n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--lkd-steps", type=int, default=40)
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--calib-len", type=int, default=128)
    ap.add_argument("--reuse", action="store_true", help="keep an existing checkpoint")
    a = ap.parse_args(argv)
    import torch

    from infinity.data import ByteTokenizer, load_texts
    w = os.path.abspath(a.workdir)
    os.makedirs(w, exist_ok=True)
    text = load_texts()[0]
    cut = int(len(text) * 0.9)
    train = os.path.join(w, "train.txt")
    with open(train, "w", encoding="utf-8") as f:
        f.write(text[:cut])
    held = torch.tensor(ByteTokenizer().encode(text[cut:]), dtype=torch.long)
    n = min(a.eval_windows, held.numel() // a.seq_len)
    held = held[: n * a.seq_len].view(n, a.seq_len)
    ck = os.path.join(w, "ck")
    if not (a.reuse and os.path.exists(os.path.join(ck, "latest"))):
        cfg = dict(model_type="llama", vocab_size=264, hidden_size=a.hidden, intermediate_size=a.inter,
                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                   num_key_value_heads=a.heads, max_position_embeddings=max(512, a.seq_len),
                   tie_word_embeddings=False, use_cache=False, bos_token_id=257, eos_token_id=258,
                   pad_token_id=256)
        cpath = os.path.join(w, "model.json")
        with open(cpath, "w") as f:
            json.dump(cfg, f)
        secs, _ = sh("finetune", "--model", cpath, "--data", train, "--steps", str(a.steps),
                     "--seq-len", str(a.seq_len), "--batch-tokens", str(8 * a.seq_len),
                     "--save", ck, "--nvme-path", os.path.join(w, "swap"), "--no-bench-io")
        print(f"finetune: {a.steps} steps in {secs:.0f} s", file=sys.stderr)
    g = str(a.group_size)
    lkd = ["--lkd", "--lkd-steps", str(a.lkd_steps), "--calib-samples", str(a.calib_samples),
           "--calib-len", str(a.calib_len)]
    variants = [
        ("bf16", ["--dtype", "bf16"]),
        ("int8", ["--quantize", "int8", "--group-size", g]),
        ("int4", ["--quantize", "int4", "--group-size", g]),
        ("int4+lkd ste, train text", ["--quantize", "int4", "--group-size", g, *lkd, "--calib-data", train]),
        ("int4+lkd scale, train text", ["--quantize", "int4", "--group-size", g, *lkd, "--calib-data", train,
                                        "--lkd-mode", "scale"]),
        ("int4+lkd ste, self-generated", ["--quantize", "int4", "--group-size", g, *lkd]),
    ]
    rows = []
    for name, args in variants:
        out = os.path.join(w, "out-" + name.replace(" ", "_").replace(",", "").replace("+", "_"))
        secs, _ = sh("export", ck, out, "--no-tokenizer", *args)
        ppl = perplexity(out, held, a.seq_len)
        rows.append((name, ppl, dir_bytes(out), secs))
        print(f"{name}: ppl {ppl:.4f}  {dir_bytes(out) / 1e6:.2f} MB  {secs:.1f} s", file=sys.stderr)
    base = rows[0][1]
    int4 = rows[2][1]
    print(f"\nheld-out: {n} x {a.seq_len} tokens; model hidden {a.hidden}, inter {a.inter}, "
          f"{a.layers} layers; group {a.group_size}; LKD {a.lkd_steps} steps, "
          f"{a.calib_samples} x {a.calib_len} calibration tokens\n")
    print("| export | held-out ppl | vs 16-bit | INT4 gap closed | weights MB | export s |")
    print("|---|---|---|---|---|---|")
    for name, ppl, nbytes, secs in rows:
        closed = ""
        if "lkd" in name and int4 != base:
            closed = f"{(int4 - ppl) / (int4 - base) * 100:.0f} %"
        print(f"| {name} | {ppl:.4f} | {(ppl / base - 1) * 100:+.2f} % | {closed} | "
              f"{nbytes / 1e6:.2f} | {secs:.1f} |")


if __name__ == "__main__":
    main()
