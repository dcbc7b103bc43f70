#!/usr/bin/env python
"""Quantized export of a model far larger than what the export may hold: peak RSS and time.

Writes (once, lazily: one random tensor at a time) a checkpoint of the Llama shape
``tools/bench_big_model.py`` trains by default (30 layers, hidden 2560, intermediate 6912,
vocab 32000: 2.54B parameters) in bf16 — the weights' values do not matter for memory or
time — then runs ``infinity export CK OUT --quantize int4`` in a child and reports its
wall time and peak RSS (``ru_maxrss`` of the child), next to the checkpoint's size.

    .venv/bin/python tools/bench_big_export.py --workdir /work/big-export   # ~5 GB + ~1.5 GB disk
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--intermediate", type=int, default=6912)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--group-size", default="128")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more export flags")
    a = ap.parse_args(argv)
    import torch

    from infinity.checkpoint import model_meta, save_checkpoint
    from infinity.checkpoint.layerwise import meta_model
    w = os.path.abspath(a.workdir)
    ck = os.path.join(w, "ck")
    cfg = dict(model_type="llama", vocab_size=a.vocab, hidden_size=a.hidden,
               intermediate_size=a.intermediate, num_hidden_layers=a.layers,
               num_attention_heads=a.heads, num_key_value_heads=a.heads,
               max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16")
    skel = meta_model(cfg)
    nparams = sum(p.numel() for p in skel.parameters())
    if not os.path.exists(os.path.join(ck, "latest")):
        class Lazy:
            def checkpoint_tensors(self):
                g = torch.Generator().manual_seed(0)
                for n, p in skel.named_parameters():
                    yield n, (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)

            def checkpoint_meta(self):
                return {"step": 1, **model_meta(skel)}

        t = time.monotonic()
        save_checkpoint(Lazy(), ck)
        print(f"checkpoint written in {time.monotonic() - t:.0f} s", file=sys.stderr)
    del skel
    ck_bytes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs)
    out = os.path.join(w, f"out-{a.quantize}")
    env = dict(os.environ, PYTHONPATH=REPO)
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "infinity", "export", ck, out, "--no-tokenizer",
                        "--quantize", a.quantize, "--group-size", a.group_size, *a.extra],
                       env=env, capture_output=True, text=True)
    secs = time.monotonic() - t
    if r.returncode:
        sys.exit(r.stderr[-4000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    out_bytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    with open("/proc/meminfo") as f:
        ram = int(f.readline().split()[1]) * 1024
    res = {"params": nparams, "checkpoint_bytes": ck_bytes, "export_bytes": out_bytes,
           "export_s": round(secs, 1), "peak_rss_bytes": peak, "host_ram_bytes": ram,
           "quantize": a.quantize, "group_size": int(a.group_size), "extra": a.extra}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
