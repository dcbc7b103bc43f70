#!/usr/bin/env python
"""ZeRO++ on a throttled inter-node link: step time of qwZ, hpZ, qgZ and all three against
plain ZeRO-3, on 4 local gloo ranks acting as 2 nodes x 2 (``LOCAL_WORLD_SIZE=2``).

The machine has no slow link between "nodes", so one is simulated per rank: every
collective's bytes addressed to ranks of another node (the ``*_sent_inter_bytes``
convention of ``engine.stats()``) go through one FIFO "link" that takes
``bytes / --inter-gbps`` seconds per transfer, shared by all the rank's threads; a
collective completes once its bytes went through (a blocking one before it returns, an
asynchronous one in its ``wait()``: prefetched gathers and the plain reduce-scatter still
overlap compute, as on a real link).  Intra-node traffic is not charged.  Every variant trains the same seeded bf16 Llama causal LM; the variants
alternate round by round in the same processes; the first step of each round is warm-up.
Prints the median step time of each, its ratio to plain ZeRO-3, and the bytes each rank
sent per step (total / to the other node).

    .venv/bin/python tools/bench_zeropp.py --inter-gbps 0.05 --rounds 3 --steps 4

``--quant``: the quantization kernels alone (qwZ int8 on bf16, qgZ int4 packed on fp32)
against a copy of the same bytes (memory bandwidth), interleaved, medians:

    .venv/bin/python tools/bench_zeropp.py --quant --numel 4194304
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = [("plain ZeRO-3", {}),
            ("qwZ", {"quantized_weights": True}),
            ("hpZ", {"hpz_partition_size": 2}),
            ("qgZ", {"quantized_gradients": True}),
            ("all three", {"quantized_weights": True, "hpz_partition_size": 2,
                           "quantized_gradients": True})]
COUNTERS = ("allgather_sent_bytes", "allgather_sent_inter_bytes", "grad_comm_sent_bytes",
            "grad_comm_sent_inter_bytes")


class _Charged:
    """An asynchronous collective that also waits for its bytes on the simulated link."""
    __slots__ = ("h", "fut")

    def __init__(self, h, fut):
        self.h, self.fut = h, fut

    def wait(self):
        self.fut.result()
        self.h.wait()

    def done(self) -> bool:
        """Polled by the overlapped step (Note [Overlap across ranks]): landed on both."""
        return self.fut.done() and self.h.done()


def throttle(gbps: float) -> None:
    """This rank's link to the other node: one FIFO resource (a thread that sleeps bytes /
    bandwidth per transfer), shared by every thread's collectives.  A collective's
    inter-node bytes (counted by Comm.count_sent just before it is issued) are queued on it;
    a blocking collective returns once they went through, an asynchronous one's wait() too
    (so the plain reduce-scatter still overlaps backward, as on a real link)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from infinity.zero.comm import Comm
    wire = ThreadPoolExecutor(1, thread_name_prefix="simulated-inter-node-link")
    pending = threading.local()
    orig_count, orig_run = Comm.count_sent, Comm._run

    def count_sent(self, kind, sent, inter):
        orig_count(self, kind, sent, inter)
        pending.inter = getattr(pending, "inter", 0) + inter

    def _run(self, fn, what, async_op, post=None, link=None, nbytes=0):
        inter, pending.inter = getattr(pending, "inter", 0), 0
        fut = wire.submit(time.sleep, inter / (gbps * 1e9)) if inter else None
        h = orig_run(self, fn, what, async_op, post, link, nbytes)
        if fut is None:
            return h
        if h is None:
            fut.result()
            return None
        return _Charged(h, fut)

    Comm.count_sent = count_sent
    Comm._run = _run


def child(a) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    import infinity
    torch.set_num_threads(1)
    throttle(a.inter_gbps)
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    mcfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 2,
                       num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=a.seq, tie_word_embeddings=False, use_cache=False)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, a.vocab, (a.steps, a.batch, a.seq), generator=g)
    times = {name: [] for name, _ in VARIANTS}
    sent = {}
    for _ in range(a.rounds):
        for name, zpp in VARIANTS:
            torch.manual_seed(0)
            eng = infinity.initialize(LlamaForCausalLM(mcfg), {
                "precision": "bf16", "zero_stage": 3, "zero_pp": zpp, "dist_timeout_s": 300})
            n = a.batch // ws
            try:
                before = None
                for i in range(a.steps):
                    if i == 1:
                        st = eng.stats()
                        before = {k: st[k] for k in COUNTERS}
                    x = data[i, rank * n:(rank + 1) * n]
                    dist.barrier()
                    t0 = time.perf_counter()
                    out = eng(input_ids=x, labels=x)
                    eng.backward(out.loss)
                    eng.step()
                    t = time.perf_counter() - t0
                    if i:
                        times[name].append(t)
                st = eng.stats()
                sent[name] = {k: (st[k] - before[k]) / (a.steps - 1) for k in COUNTERS}
            finally:
                eng.close()
    res = {"times": times, "sent": sent}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def spawn(a) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="bench-zeropp-")
    args = [a_ for a_ in sys.argv[1:]] + ["--child", "--out", out]
    procs = []
    for r in range(a.ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.ranks), LOCAL_RANK=str(r % 2),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        procs.append(subprocess.Popen([sys.executable, __file__] + args, env=env))
    rcs = [p.wait() for p in procs]
    if any(rcs):
        raise SystemExit(f"bench_zeropp: ranks exited with {rcs}")
    res = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(a.ranks)]
    # a step ends when the slowest rank ends it: per step, the max over ranks
    base = None
    print(f"4 ranks = 2 nodes x 2, inter-node link {a.inter_gbps:g} GB/s (simulated), "
          f"Llama {a.layers}x{a.hidden}, vocab {a.vocab}, batch {a.batch}x{a.seq}, bf16; "
          f"{a.rounds} rounds x {a.steps - 1} timed steps")
    print(f"{'variant':<14}{'step s (median)':>16}{'vs plain':>10}{'sent MB/step':>14}"
          f"{'to other node':>15}")
    for name, _ in VARIANTS:
        per_step = [max(r["times"][name][i] for r in res)
                    for i in range(len(res[0]["times"][name]))]
        med = statistics.median(per_step)
        base = base or med
        s = res[0]["sent"][name]
        tot = (s["allgather_sent_bytes"] + s["grad_comm_sent_bytes"]) / 1e6
        inter = (s["allgather_sent_inter_bytes"] + s["grad_comm_sent_inter_bytes"]) / 1e6
        print(f"{name:<14}{med:>16.3f}{med / base:>10.2f}{tot:>14.2f}{inter:>15.2f}")


def quant_bench(a) -> None:
    import torch
    from infinity.quant import dequantize, pack_bits, quantize, unpack_bits
    from infinity.quant.kernel import dequantize_flat, quantize_flat
    from infinity.zero.zeropp import GRAD_BLOCK, WEIGHT_BLOCK
    torch.set_num_threads(a.threads)
    n = a.numel
    w = torch.randn(n, dtype=torch.bfloat16)
    gr = torch.randn(n, dtype=torch.float32)
    qw, sw = quantize_flat(w, 8, WEIGHT_BLOCK)
    qg, sg = quantize_flat(gr, 4, GRAD_BLOCK)
    ow, og = torch.empty_like(w), torch.empty_like(gr)
    tq = quantize(w.view(1, -1), 8, WEIGHT_BLOCK, nonfinite="nan")
    ops = {   # name: (fn, bytes of the full-precision side)
        "copy bf16 (memory bw: read+write)": (lambda: ow.copy_(w), 2 * n * 2),
        "qwZ quantize int8, C++ kernel": (lambda: quantize_flat(w, 8, WEIGHT_BLOCK), n * 2),
        "qwZ quantize int8, torch ops": (
            lambda: quantize(w.view(1, -1), 8, WEIGHT_BLOCK, nonfinite="nan"), n * 2),
        "qwZ dequantize to bf16, C++ kernel": (
            lambda: dequantize_flat(qw, sw, n, 8, WEIGHT_BLOCK, ow), n * 2),
        "qwZ dequantize to bf16, torch ops": (
            lambda: dequantize(tq.q, tq.scale, WEIGHT_BLOCK, dtype=torch.bfloat16), n * 2),
        "copy fp32 (memory bw: read+write)": (lambda: og.copy_(gr), 2 * n * 4),
        "qgZ quantize+pack int4, C++ kernel": (lambda: quantize_flat(gr, 4, GRAD_BLOCK), n * 4),
        "qgZ quantize+pack int4, torch ops": (
            lambda: pack_bits(quantize(gr.view(1, -1), 4, GRAD_BLOCK, nonfinite="nan").q, 4),
            n * 4),
        "qgZ unpack+dequantize, C++ kernel": (
            lambda: dequantize_flat(qg, sg, n, 4, GRAD_BLOCK, og), n * 4),
        "qgZ unpack+dequantize, torch ops": (
            lambda: dequantize(unpack_bits(qg.view(1, -1), 4, n), sg.view(1, -1), GRAD_BLOCK,
                               dtype=torch.float32), n * 4),
    }
    t = {k: [] for k in ops}
    for _ in range(a.reps):
        for k, (fn, _) in ops.items():
            t0 = time.perf_counter()
            fn()
            t[k].append(time.perf_counter() - t0)
    print(f"{n} elements, {a.threads} thread(s), median of {a.reps} interleaved repetitions; "
          f"GB/s of the full-precision tensor read or written")
    for k, (_, nbytes) in ops.items():
        print(f"  {k:<38}{nbytes / statistics.median(t[k]) / 1e9:8.2f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inter-gbps", type=float, default=0.05)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--quant", action="store_true")
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quant:
        quant_bench(a)
    elif a.child:
        child(a)
    else:
        if a.ranks % 2:
            raise SystemExit("--ranks must be even (2 ranks per simulated node)")
        spawn(a)


if __name__ == "__main__":
    main()
