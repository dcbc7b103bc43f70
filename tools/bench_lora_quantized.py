"""LoRA over a frozen base kept quantized (``offload.frozen_weights``) against the same LoRA
over the base in bf16: quality, bytes moved, and step time on an I/O-bound shape.

    .venv/bin/python tools/bench_lora_quantized.py quality --workdir /tmp/blq
    .venv/bin/python tools/bench_lora_quantized.py bytes   --workdir /tmp/blq
    .venv/bin/python tools/bench_lora_quantized.py speed   --workdir /tmp/blq

``quality``: the ``infinity finetune`` default model (tiny-llama, byte tokenizer) is first
trained on the shipped corpus (plain PyTorch, AdamW, ``--base-steps`` steps of 8 x 256
tokens, until its loss plateaus; cached in the work directory), then LoRA-tuned (rank 16
on every attention and MLP projection) for ``--lora-steps`` steps on a different text --
this project's own documentation (docs/*.md) -- through ``infinity.initialize`` (bf16
working precision, params on NVMe), once per base format: bf16, nf4 (double-quantized
scales), int4, int8.  Printed: the base's held-out loss per format (the quantized base's
own quality), and per LoRA run the mean training loss of its last 20 steps and the
held-out loss on the text, each relative to the bf16 base's.

``bytes``: frozen-weight bytes per optimizer step, per format, on a wider Llama (d 1024,
4 layers): read from NVMe (params on NVMe) and copied host -> device (params in host
memory, the separate-device protocol of the simulated device), from ``stats()``.

``speed``: an I/O-bound shape -- a Llama (d ``--hidden``, ``--layers`` layers) whose bf16
base is on NVMe, the host cap below the base's size (no parameter cache), 1 x ``--tokens``
tokens per step -- two engines (bf16 base, nf4 base) stepped alternately in one process;
median step time of each and their ratio.  Where the bf16 step is not I/O-bound (compute
over a third of it) the shape is too small for this machine: say so.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import importlib.util
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("infinity") is None:   # else the installed or built one (the
    sys.path.insert(0, ROOT)                        # GPU check's, for its own Python)

import infinity  # noqa: E402
from infinity.quant import quantize_weight  # noqa: E402

FORMATS = (("bf16", None, {}), ("nf4", "nf4", {"double_quant": True}),
           ("int4", "int4", {}), ("int8", "int8", {}))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(hidden=None, layers=None, inter=None, seed=0):
    import transformers
    with open(os.path.join(ROOT, "infinity", "data", "tiny-llama.json")) as f:
        cfg = json.load(f)
    if hidden is not None:
        cfg.update(hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                   num_key_value_heads=max(1, hidden // 64),
                   intermediate_size=inter or (hidden * 8 // 3 // 64) * 64)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))


def _tokens(text):
    from infinity.data import ByteTokenizer
    return torch.tensor(ByteTokenizer().encode(text), dtype=torch.long)


def _split(ids, held=0.05):
    cut = int(len(ids) * (1 - held))
    return ids[:cut], ids[cut:]


def _batches(ids, n, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq] for s in starts.tolist()])


def _eval(model_fn, ids, seq=256, n=16):
    """Mean loss over ``n`` fixed windows of the held-out ids."""
    step = max(1, (len(ids) - seq - 1) // n)
    losses = []
    with torch.no_grad():
        for i in range(n):
            x = ids[i * step:i * step + seq].unsqueeze(0)
            losses.append(float(model_fn(x)))
    return sum(losses) / len(losses)


def _shakespeare():
    from infinity.data import load_texts
    return "\n".join(load_texts(None))


def _docs_text():
    parts = []
    for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(p, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


def train_base(workdir, steps, lr=3e-3):
    """The tiny-llama base trained on the shipped corpus (cached): its path, and the mean
    loss of its last two stretches of 100 steps (the plateau)."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(workdir, f"base-{steps}.safetensors")
    meta = path + ".json"
    model = _llama()
    if os.path.exists(path) and os.path.exists(meta):
        model.load_state_dict(load_file(path))
        with open(meta) as f:
            return model, json.load(f)
    train, _ = _split(_tokens(_shakespeare()))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.1, 1 - s / steps))
    losses, t0 = [], time.perf_counter()
    for i, x in enumerate(_batches(train, steps, 8, 256, seed=0)):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (i + 1) % 100 == 0:
            print(f"  base step {i + 1}/{steps}: loss {sum(losses[-100:]) / 100:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    w = max(1, min(100, steps // 2))
    info = {"last100": sum(losses[-w:]) / w, "prev100": sum(losses[-2 * w:-w]) / w,
            "steps": steps, "window": w}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    with open(meta, "w") as f:
        json.dump(info, f)
    return model, info


def _dequantized(model, dtype, **kw):
    """``model`` with every Linear / Embedding weight through a quantize round trip."""
    import copy
    out = copy.deepcopy(model)
    with torch.no_grad():
        for mod in out.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                mod.weight.copy_(quantize_weight(mod.weight.bfloat16(), dtype, 64,
                                                 **kw).dequantize().float())
    return out


def lora_run(base, fmt, fw, text_ids, held_ids, steps, workdir, lr=2e-3):
    import peft
    import copy
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    off = {"params": "nvme", "optimizer": "cpu",
           "nvme_paths": [os.path.join(workdir, "swap-" + fmt)]}
    if fmt != "bf16":
        off["frozen_weights"] = {"dtype": fmt, **fw}
    cfg = {"precision": "bf16", "offload": off,
           "optimizer": {"lr": lr, "weight_decay": 0.0}, "gradient_clipping": 1.0}
    losses, t0 = [], time.perf_counter()
    with infinity.initialize(model, cfg) as eng:
        eng.train()
        for x in _batches(text_ids, steps, 8, 256, seed=1):
            out = eng(input_ids=x, labels=x)
            eng.backward(out.loss)
            eng.step()
            losses.append(out.loss.item())
        eng.eval()
        held = _eval(lambda x: eng(input_ids=x, labels=x).loss, held_ids)
        st = eng.stats()
    return {"format": fmt, "train_last20": sum(losses[-20:]) / len(losses[-20:]), "held_out": held,
            "seconds": time.perf_counter() - t0, "frozen_nvme_read_bytes":
            st["frozen_nvme_read_bytes"], "losses": losses}


def cmd_quality(a):
    os.makedirs(a.workdir, exist_ok=True)
    base, info = train_base(a.workdir, a.base_steps)
    print(f"base: {info['steps']} steps on the shipped corpus, mean loss of the last "
          f"{info['window']} {info['last100']:.4f}, of the {info['window']} before "
          f"{info['prev100']:.4f} "
          f"({(info['prev100'] - info['last100']) / info['prev100'] * 100:+.2f} %)")
    _, sh_held = _split(_tokens(_shakespeare()))
    ref = None
    print("\nthe base's own held-out loss on the shipped corpus (bf16 forward):")
    for fmt, dt, fw in FORMATS:
        m = base if dt is None else _dequantized(base, dt, **fw)
        m = m.to(torch.bfloat16).eval()
        loss = _eval(lambda x: m(input_ids=x, labels=x).loss.float(), sh_held)
        ref = loss if ref is None else ref
        print(f"  {fmt:5s} loss {loss:.4f}  ppl {torch.exp(torch.tensor(loss)):.3f}  "
              f"({(loss - ref) / ref * 100:+.2f} % vs bf16)", flush=True)
    text, held = _split(_tokens(_docs_text()), 0.1)
    print(f"\nLoRA r=16, {a.lora_steps} steps of 8 x 256 tokens on docs/*.md "
          f"({len(text) / 1e6:.2f} M byte tokens, 10 % held out):")
    rows = []
    for fmt, dt, fw in FORMATS:
        r = lora_run(base, fmt, fw, text, held, a.lora_steps, a.workdir)
        rows.append(r)
        b = rows[0]
        print(f"  {fmt:5s} train (last 20) {r['train_last20']:.4f} "
              f"({(r['train_last20'] - b['train_last20']) / b['train_last20'] * 100:+.2f} %)"
              f"  held-out {r['held_out']:.4f} "
              f"({(r['held_out'] - b['held_out']) / b['held_out'] * 100:+.2f} %)  "
              f"{r['seconds']:.0f} s", flush=True)
    with open(os.path.join(a.workdir, "quality.json"), "w") as f:
        json.dump({"base": info, "lora": rows}, f)


def _step_bytes(model_fn, cfg, key, steps=3):
    with infinity.initialize(model_fn(), cfg) as eng:
        seen = []
        for x in _batches(torch.randint(0, 256, (10000,)), steps, 1, 64, seed=2):
            before = eng.stats()[key]
            out = eng(input_ids=x, labels=x)
            eng.backward(out.loss)
            eng.step()
            seen.append(eng.stats()[key] - before)
        base = sum(g.nbytes for g in eng.grouping.groups if not g.trainable)
    return seen[-1], base


def cmd_bytes(a):
    import peft
    os.makedirs(a.workdir, exist_ok=True)

    def model_fn():
        return peft.get_peft_model(_llama(hidden=1024, layers=4), peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    print("frozen-weight bytes per optimizer step (Llama d 1024, 4 layers, bf16 working "
          "precision, LoRA r=16):")
    ref = {}
    for fmt, dt, fw in FORMATS:
        row = []
        for home, key, sim in (("nvme", "frozen_nvme_read_bytes", False),
                               ("cpu", "frozen_host_read_bytes", True)):
            off = {"params": home, "optimizer": "cpu",
                   "nvme_paths": [os.path.join(a.workdir, "swap-bytes")]}
            if dt is not None:
                off["frozen_weights"] = {"dtype": dt, **fw}
            if sim:
                os.environ["INFINITY_SIMULATE_DEVICE"] = "1"
            try:
                got, _ = _step_bytes(model_fn, {"precision": "bf16", "offload": off}, key)
            finally:
                os.environ.pop("INFINITY_SIMULATE_DEVICE", None)
            ref.setdefault(home, got)
            row.append(f"{home}: {got / 1e6:8.1f} MB ({got / ref[home]:.3f}x)")
        print(f"  {fmt:5s} " + "   ".join(row).replace("cpu:", "host->device:")
              .replace("nvme:", "NVMe read:"), flush=True)


def cmd_speed(a):
    import peft
    os.makedirs(a.workdir, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def model_fn():
        return peft.get_peft_model(_llama(hidden=a.hidden, layers=a.layers), peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)).to(dev)
    engines = {}
    for fmt, dt, fw in (FORMATS[0], FORMATS[1]):
        off = {"params": "nvme", "optimizer": "cpu", "host_memory_gb": a.host_gb,
               "nvme_paths": [os.path.join(a.workdir, "swap-speed-" + fmt)]}
        if dt is not None:
            off["frozen_weights"] = {"dtype": dt, **fw}
        t0 = time.perf_counter()
        engines[fmt] = infinity.initialize(model_fn(), {"precision": "bf16", "offload": off})
        base = sum(g.nbytes for g in engines[fmt].grouping.groups if not g.trainable)
        print(f"  {fmt}: initialize {time.perf_counter() - t0:.1f} s, frozen base "
              f"{base / 1e9:.2f} GB in bf16, at its home "
              f"{sum(g.home_nbytes for g in engines[fmt].grouping.groups if not g.trainable) / 1e9:.2f}"
              f" GB", flush=True)
    times = {k: [] for k in engines}
    xs = [x.to(dev) for x in _batches(torch.randint(0, 256, (10000,)), a.steps + 1, 1,
                                      a.tokens, seed=3)]
    try:
        for i, x in enumerate(xs):
            for fmt, eng in engines.items():
                sync()
                t0 = time.perf_counter()
                out = eng(input_ids=x, labels=x)
                eng.backward(out.loss)
                eng.step()
                sync()
                if i:                               # the first step warms up
                    times[fmt].append(time.perf_counter() - t0)
        st = {k: e.stats() for k, e in engines.items()}
        for e in engines.values():
            e.close()
        # compute alone: the bf16 model resident, the same step
        m = model_fn().to(torch.bfloat16)
        ct = []
        for x in xs[1:4]:
            sync()
            t0 = time.perf_counter()
            m(input_ids=x, labels=x).loss.backward()
            sync()
            ct.append(time.perf_counter() - t0)
        del m
    finally:
        for e in engines.values():
            e.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    comp = statistics.median(ct)
    print(f"Llama d {a.hidden}, {a.layers} layers, 1 x {a.tokens} tokens per step, params on "
          f"NVMe, host cap {a.host_gb} GB, {a.steps} alternating steps each, on {dev.type}:")
    for k in engines:
        print(f"  {k:5s} median step {med[k]:.3f} s (min {min(times[k]):.3f}), frozen NVMe "
              f"read {st[k]['frozen_nvme_read_bytes'] / 1e9:.2f} GB in all")
    print(f"  compute alone (bf16, resident): {comp:.3f} s = {comp / med['bf16']:.2f}x the "
          f"bf16-base step{'' if comp < med['bf16'] / 3 else ' (NOT I/O-bound: over a third)'}")
    print(f"  nf4 / bf16 step: {med['nf4'] / med['bf16']:.3f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--workdir", required=True)
    q.add_argument("--base-steps", type=int, default=800)
    q.add_argument("--lora-steps", type=int, default=200)
    b = sub.add_parser("bytes")
    b.add_argument("--workdir", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--workdir", required=True)
    s.add_argument("--hidden", type=int, default=2048)
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--tokens", type=int, default=32)
    s.add_argument("--steps", type=int, default=6)
    s.add_argument("--host-gb", type=float, default=0.25)
    a = ap.parse_args(argv)
    {"quality": cmd_quality, "bytes": cmd_bytes, "speed": cmd_speed}[a.cmd](a)


if __name__ == "__main__":
    main()
