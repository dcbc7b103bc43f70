"""How well `infinity finetune --auto`'s compute rate predicts a training step here.

Alternates, in one process, the rate ``--auto`` samples
(:func:`infinity.finetune.auto.measure_tflops`, ~1 s of fp32 products of the model's
shape) with one plain-PyTorch forward/backward/AdamW step of a shipped model at the given
shape, and prints per step predicted/measured for 6*N*tokens at the mean of the rates
sampled just before and after it (and with attention-score FLOPs, 12*L*S^2*H*B, whole or
halved for causal masking), then the medians.

    .venv/bin/python tools/bench_compute_rate.py --seq 256 --batch 16 --steps 4
"""
import argparse
import statistics
import time

import torch

from infinity.finetune.auto import measure_tflops, model_config_path
from infinity.finetune.model import build_model, load_model_config


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    cfg = load_model_config(model_config_path(args.model))
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    h = getattr(cfg, "hidden_size", None) or cfg.n_embd
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    seq, b = args.seq, args.batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (b, seq))

    def step():
        t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    step()
    print(f"{args.model}: N={n} H={h} L={layers} seq={seq} B={b} threads={torch.get_num_threads()}")
    rows = []
    for _ in range(args.steps):
        r0 = measure_tflops(h, seq * b) * 1e12
        t = step()
        r1 = measure_tflops(h, seq * b) * 1e12
        rate = (r0 + r1) / 2
        f6, att = 6 * n * seq * b, 12 * layers * seq * seq * h * b
        rows.append((f6 / rate / t, (f6 + att) / rate / t, (f6 + att / 2) / rate / t))
        print(f"rate {r0 / 1e9:.1f}/{r1 / 1e9:.1f} GFLOPS, step {t:.2f} s: predicted/measured "
              f"6N {rows[-1][0]:.2f}, +attention {rows[-1][1]:.2f}, +attention/2 {rows[-1][2]:.2f}",
              flush=True)
    print("medians (6N, +attention, +attention/2):",
          [round(statistics.median(c), 3) for c in zip(*rows)])


if __name__ == "__main__":
    main()
