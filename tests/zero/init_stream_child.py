"""A pretrained bf16 safetensors checkpoint of a Llama-ish stack streamed into a model
built under infinity.Init (NVMe home), its frozen base kept nf4 (``offload.frozen_weights``),
adopted by ``initialize`` and trained one LoRA step; the host memory of each phase.

Modes (argv):

* ``write CKPT``: write the checkpoint (every frozen tensor of the model, bf16, seeded) and
  exit.  It runs in a process of its own so that no process that is measured ever held
  the whole model.
* ``stream SWAP CKPT``: the measured run (Init + load_safetensors + initialize + a step).
* ``eager SWAP CKPT``: the control -- the same checkpoint loaded into a plain, eagerly
  built model -- to show the measure sees a materialised model.

What is measured, and why (see also tests/zero/test_init_streaming.py): ``safe_open``
memory-maps the checkpoint, and ``get_tensor`` returns views of that mapping; every page
``load_safetensors`` reads becomes resident as a *file-backed* page of this process
(``RssFile``, so VmRSS / VmHWM / ru_maxrss grow by up to the whole file while the mapping
lives).  Those pages are clean page cache the kernel reclaims at will, not memory this
process holds.  What it cannot give back is its anonymous memory (heap, ``aligned_empty``
mappings, tensors): ``RssAnon`` (+ ``RssShmem``, 0 here) of /proc/self/status.  There is
no kernel high-water mark of RssAnon alone (VmHWM is reset by writing "5" to
/proc/self/clear_refs, but counts file pages too), so a thread samples /proc/self/status
every ~0.5 ms (the big temporaries live inside torch ops that release the GIL, and the
switch interval is lowered so Python stretches do not starve it) and keeps each phase's
maximum; VmHWM and RssFile per phase are reported alongside, for the record.

Prints one JSON line.
"""
import gc
import json
import os
import re
import sys
import threading
import time

import torch
from torch import nn

LAYERS, D, FF, R = 16, 1024, 2816, 8          # Llama-ish proportions; R: LoRA rank
DTYPE = torch.bfloat16


class LoRA(nn.Module):
    """A frozen base Linear (from the checkpoint) with a trainable low-rank adapter."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False, dtype=DTYPE)
        self.a = nn.Linear(d_in, R, bias=False, dtype=DTYPE)
        self.b = nn.Linear(R, d_out, bias=False, dtype=DTYPE)
        nn.init.zeros_(self.b.weight)                # LoRA: starts as the base model

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class Block(nn.Module):
    """RMSNorm -> causal self-attention (LoRA on q and v) -> RMSNorm -> SwiGLU MLP."""

    def __init__(self):
        super().__init__()
        self.attn_norm = nn.RMSNorm(D, dtype=DTYPE)
        self.q = LoRA(D, D)
        self.k = nn.Linear(D, D, bias=False, dtype=DTYPE)
        self.v = LoRA(D, D)
        self.o = nn.Linear(D, D, bias=False, dtype=DTYPE)
        self.mlp_norm = nn.RMSNorm(D, dtype=DTYPE)
        self.gate = nn.Linear(D, FF, bias=False, dtype=DTYPE)
        self.up = nn.Linear(D, FF, bias=False, dtype=DTYPE)
        self.down = nn.Linear(FF, D, bias=False, dtype=DTYPE)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (m(h).view(b, t, 8, D // 8).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, D))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x.float().square().mean()


def is_adapter(name):
    return ".a." in name or ".b." in name


def freeze(model):
    """Only the adapters train.  After building, outside Init (as a PEFT wrapper does; and
    ``requires_grad_`` inside Init faults a parameter in and writes it back)."""
    for n, p in model.named_parameters():
        p.requires_grad_(is_adapter(n))


def write(path):
    """The checkpoint: every frozen tensor, seeded per name (no process measured holds it)."""
    from safetensors.torch import save_file
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Model().named_parameters() if not is_adapter(n)}
    g = torch.Generator().manual_seed(1234)
    sd = {}
    for n, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        sd[n] = (1 + 0.1 * t if n.endswith("norm.weight") else 0.02 * t).to(DTYPE)
    save_file(sd, path)


# ---------------------------------------------------------------------- measuring
_FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmHWM")


def status():
    """The fields of /proc/self/status we use, in bytes."""
    with open("/proc/self/status") as f:
        s = f.read()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", s, re.M).group(1)) * 1024 for k in _FIELDS}


class Sampler:
    """A thread sampling RssAnon + RssShmem (and RssFile) every ~0.5 ms; ``phase()``
    returns the maxima since the previous call and starts a new phase (resetting VmHWM)."""

    def __init__(self):
        self._fd = os.open("/proc/self/status", os.O_RDONLY)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.samples = 0
        self._reset()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _read(self):
        s = os.pread(self._fd, 8192, 0).decode()
        v = {k: int(m.group(1)) * 1024 for k in ("RssAnon", "RssFile", "RssShmem")
             if (m := re.search(rf"^{k}:\s+(\d+) kB", s, re.M))}
        return v["RssAnon"] + v.get("RssShmem", 0), v["RssFile"]

    def _reset(self):
        with self._lock:
            self._max_held, self._max_file = self._read()
        try:                         # VmHWM := VmRSS now (for the record only)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def _run(self):
        while not self._stop.is_set():
            h, fl = self._read()
            with self._lock:
                self._max_held = max(self._max_held, h)
                self._max_file = max(self._max_file, fl)
                self.samples += 1
            time.sleep(0.0005)

    def phase(self):
        h, fl = self._read()             # the level at the end of the phase counts too
        with self._lock:
            out = {"peak": max(self._max_held, h), "peak_file": max(self._max_file, fl)}
        s = status()
        out.update(end=s["RssAnon"] + s["RssShmem"], end_file=s["RssFile"], hwm=s["VmHWM"])
        self._reset()
        return out

    def close(self):
        self._stop.set()
        self._t.join()
        os.close(self._fd)


def model_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def largest_layer_bytes(model):
    return max(model_bytes(b) for b in model.layers)


# ---------------------------------------------------------------------- the runs
def configs(swap):
    init_cfg = {"offload": {"params": "nvme", "nvme_paths": [swap]}}
    cfg = {"precision": "bf16",
           "offload": {"params": "nvme", "optimizer": "cpu", "nvme_paths": [swap],
                       "frozen_weights": {"dtype": "nf4", "group_size": 64}},
           "optimizer": {"lr": 1e-2}}
    return init_cfg, cfg


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, D, generator=g).to(DTYPE)


def stream(swap, ckpt):
    import infinity
    from infinity.procutil import trim_heap
    from infinity.quant import quantize_weight
    from infinity.zero.init import Init, load_safetensors
    init_cfg, cfg = configs(swap)
    t0 = time.perf_counter()
    # warm up every path measured below on a one-layer model (its tensors are the first
    # layer's of the checkpoint): Init + swap + aio, safetensors, the engine, the
    # quantizer, the optimizer, one step; then give freed heap back so the baseline is
    # what is live, not what a warm-up happened to leave in malloc's free lists
    with Init(init_cfg):
        warm = Model(1)
    freeze(warm)
    load_safetensors(warm, [ckpt], strict=False)
    with infinity.initialize(warm, cfg) as e:
        e.backward(e(batch(0)))
        e.step()
    del warm, e
    gc.collect()
    trim_heap()
    sampler = Sampler()
    time.sleep(0.05)
    phases = {"base": sampler.phase()}
    t1 = time.perf_counter()
    with Init(init_cfg):
        model = Model()
    freeze(model)
    phases["build"] = sampler.phase()
    unexpected = load_safetensors(model, [ckpt], strict=False)   # the adapters are not in it
    phases["load"] = sampler.phase()
    eng = infinity.initialize(model, cfg)
    phases["adopt"] = sampler.phase()
    pool = {"adopt": eng.host_pool.allocated}
    loss = eng(batch(1))
    eng.backward(loss)
    eng.step()
    phases["step"] = sampler.phase()
    pool["step"] = eng.host_pool.allocated
    t2 = time.perf_counter()
    sampler.close()
    quant = sum(1 for g in eng.grouping.groups if g.quant is not None)
    # the trained result: the adapters (b started at zero, so one step moves it)
    sd = eng.state_dict()
    adapters = [n for n in sd if is_adapter(n)]
    finite = all(bool(torch.isfinite(sd[n]).all()) for n in adapters)
    moved = any(bool(sd[n].ne(0).any()) for n in adapters if n.endswith(".b.weight"))
    # the frozen values: nf4 round trip of the checkpoint's (the library's quantizer, used
    # eagerly on the tensor as read from the file); norms unchanged
    from safetensors import safe_open
    picks = [f"layers.{i}.{t}" for i in (0, LAYERS // 2, LAYERS - 1)
             for t in ("q.base.weight", "k.weight", "down.weight", "gate.weight")]
    norms = [f"layers.{i}.attn_norm.weight" for i in (0, LAYERS - 1)]
    bad = []
    with safe_open(ckpt, framework="pt", device="cpu") as f:
        for n in picks:
            want = quantize_weight(f.get_tensor(n), "nf4", 64).dequantize()
            if not torch.equal(sd[n], want):
                bad.append(n)
        for n in norms:
            if not torch.equal(sd[n], f.get_tensor(n)):
                bad.append(n)
    groups = len(eng.grouping.groups)
    eng.close()
    print(json.dumps({"phases": phases, "model_bytes": model_bytes(model),
                      "layer_bytes": largest_layer_bytes(model),
                      "max_tensor_bytes": max(p.numel() * p.element_size()
                                              for p in model.parameters()),
                      "ckpt_bytes": os.path.getsize(ckpt), "layers": LAYERS,
                      "groups": groups, "quantized_groups": quant, "unexpected": unexpected,
                      "adapters": len(adapters),
                      "trainable_numel": sum(p.numel() for n, p in model.named_parameters()
                                             if is_adapter(n)),
                      "finite": finite, "moved": moved, "bad": bad,
                      "loss": float(loss.detach()), "pool": pool, "samples": sampler.samples,
                      "warmup_s": t1 - t0, "measured_s": t2 - t1}))


def eager(ckpt):
    """The control: a plain model (allocated, not initialised: ``to_empty``), the
    checkpoint copied into it -- its pages become resident as the load writes them."""
    from infinity.procutil import trim_heap
    from infinity.zero.init import load_safetensors
    warm = Model(1)
    load_safetensors(warm, [ckpt], strict=False)
    del warm
    gc.collect()
    trim_heap()
    sampler = Sampler()
    time.sleep(0.05)
    phases = {"base": sampler.phase()}
    with torch.device("meta"):
        model = Model()
    model.to_empty(device="cpu")
    phases["build"] = sampler.phase()
    load_safetensors(model, [ckpt], strict=False)
    phases["load"] = sampler.phase()
    sampler.close()
    print(json.dumps({"phases": phases, "model_bytes": model_bytes(model),
                      "layer_bytes": largest_layer_bytes(model),
                      "ckpt_bytes": os.path.getsize(ckpt), "samples": sampler.samples}))


def main():
    torch.set_num_threads(1)
    sys.setswitchinterval(0.0005)       # the sampler thread gets the GIL often
    mode = sys.argv[1]
    if mode == "write":
        write(sys.argv[2])
    elif mode == "stream":
        stream(sys.argv[2], sys.argv[3])
    elif mode == "eager":
        eager(sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
