#!/usr/bin/env python
"""GPU diagnosis of the first update's gradients: the engine's host gradient sums after the
first micro-step, slot by slot, against plain PyTorch on the same GPU (same seed, weights
and batch), for a Llama of the GPU check's width with few layers.

    python -P tools/gpu_diag.py OUT.json [--layers 4] [--variant NAME ...]

Variants: ``default`` (params and optimizer in host memory, checkpointing), ``nockpt`` (no
activation checkpointing), ``depth0`` (prefetch depth 0), ``devicehome`` (params home on
the device).  Each variant runs in this process one after the other; CUDA_LAUNCH_BLOCKING=1
in the environment serializes kernels (a stream race then disappears).  Prints one line per
variant and writes every slot's relative error and non-finite count to OUT.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

import llama_bench as lb  # noqa: E402

VARIANTS = {
    "default": dict(params="cpu", ckpt=True, depth=2),
    "nockpt": dict(params="cpu", ckpt=False, depth=2),
    "depth0": dict(params="cpu", ckpt=True, depth=0),
    "devicehome": dict(params="none", ckpt=True, depth=2),
    # the default set-up with a probe patched in (see PATCHES)
    "sync_all": dict(params="cpu", ckpt=True, depth=2, patch="sync_all"),
    "sync_giveback": dict(params="cpu", ckpt=True, depth=2, patch="sync_giveback"),
    "sync_h2d": dict(params="cpu", ckpt=True, depth=2, patch="sync_h2d"),
    "keep_bw": dict(params="cpu", ckpt=True, depth=2, patch="keep_bw"),
    "nockpt_sync_all": dict(params="cpu", ckpt=False, depth=2, patch="sync_all"),
}


def _patches(name):
    """Probes: ``sync_h2d`` (every H2D completes before the host goes on), ``sync_giveback``
    (the device is idle whenever a buffer goes back to its pool), ``sync_all`` (both),
    ``keep_bw`` (no group released inside backward: only at its end)."""
    from infinity.memory import device as D
    from infinity.runtime.hooks import ParamHooks
    undo = []

    def put(cls, attr, fn):
        undo.append((cls, attr, cls.__dict__[attr]))
        setattr(cls, attr, fn)
    if name in ("sync_all", "sync_h2d"):
        h2d = D.CudaDevice.h2d

        def h2d_sync(self, dst, src, _f=h2d):
            t = _f(self, dst, src)
            torch.cuda.synchronize()
            return t
        put(D.CudaDevice, "h2d", h2d_sync)
    if name in ("sync_all", "sync_giveback"):
        gb = D.DeviceTier.give_back

        def gb_sync(self, buf, _f=gb):
            torch.cuda.synchronize()
            _f(self, buf)
        put(D.DeviceTier, "give_back", gb_sync)
    if name == "keep_bw":
        put(ParamHooks, "_maybe_release_bw", lambda self, g: None)
    return undo


DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a dry run (simulated device)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def build(size, layers, seq, ckpt):
    from transformers import LlamaForCausalLM
    cfg = lb.llama_config(size, seq)
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            m = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    m.to(torch.bfloat16)
    if ckpt:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.config.use_cache = False
    m.train()
    return m


_REF = {}


def reference(size, layers, seq, batch, ckpt):
    key = (size, layers, seq, batch, ckpt)
    if key not in _REF:
        ids = lb.batches(1, batch, seq, seed=1)[0].to(DEV)
        ref = build(size, layers, seq, ckpt)
        loss_ref = ref(input_ids=ids, labels=ids).loss
        loss_ref.backward()
        _sync()
        _REF[key] = {n: p.grad.float().cpu() for n, p in ref.named_parameters()}
        del ref, loss_ref
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return _REF[key]


def run(variant, size, layers, seq, batch):
    import infinity
    v = VARIANTS[variant]
    ids = lb.batches(1, batch, seq, seed=1)[0].to(DEV)
    ref_grads = reference(size, layers, seq, batch, v["ckpt"])
    undo = _patches(v["patch"]) if v.get("patch") else []
    model = build(size, layers, seq, v["ckpt"])
    cfg = {"precision": "bf16", "offload": {"params": v["params"], "optimizer": "cpu"},
           "prefetch": {"depth": v["depth"]}, "gradient_clipping": 1.0,
           "optimizer": {"lr": 1e-4}}
    out = {"variant": variant, "layers": layers, "env_launch_blocking":
           os.environ.get("CUDA_LAUNCH_BLOCKING")}
    e = infinity.initialize(model, cfg)
    names = {id(p): n for n, p in e.module.named_parameters()}
    try:
        losses = []
        for step in range(3):
            loss = e(input_ids=ids, labels=ids).loss
            e.backward(loss)
            losses.append(float(loss.detach()))
            if step == 0:
                _sync()
                slots = []
                for g in e.grouping.groups:
                    buf = getattr(g, "grad_buf", None)
                    for s in g.slots:
                        if not s.trainable:
                            continue
                        n = names.get(id(s.param), s.name)
                        want = ref_grads.get(n)
                        if buf is None:
                            slots.append({"name": n, "group": g.name, "missing": True})
                            continue
                        got = buf[s.offset:s.offset + s.numel].float().reshape(-1)
                        bad = int((~torch.isfinite(got)).sum())
                        rel = None
                        if want is not None and not bad:
                            w = want.reshape(-1)
                            rel = float((got - w).norm() / w.norm().clamp_min(1e-20))
                        slots.append({"name": n, "group": g.name, "nonfinite": bad, "rel": rel})
                out["slots"] = slots
                bad = [s for s in slots if s.get("nonfinite") or s.get("missing")]
                worst = max((s for s in slots if s.get("rel") is not None),
                            key=lambda s: s["rel"], default=None)
                out["nonfinite_slots"] = [s["name"] for s in bad]
                out["worst"] = worst
            e.step()
        st = e.stats()
        out.update(losses=losses, nonfinite_steps=st.get("nonfinite_steps"),
                   skipped=st.get("skipped_steps"))
    finally:
        e.close()
        for cls, attr, fn in undo:
            setattr(cls, attr, fn)
    del e, model
    gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--size", default="3b", choices=sorted(lb.SIZES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    a = ap.parse_args()
    res = []
    for v in a.variant or list(VARIANTS):
        t0 = time.perf_counter()
        try:
            r = run(v, a.size, a.layers, a.seq, a.batch)
        except Exception as ex:  # noqa: BLE001 -- the next variant still runs
            import traceback
            traceback.print_exc()
            r = {"variant": v, "error": f"{type(ex).__name__}: {ex}"}
        r["seconds"] = round(time.perf_counter() - t0, 1)
        res.append(r)
        print(f"[gpu-diag] {v} (CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING')}): "
              f"nonfinite slots {len(r.get('nonfinite_slots', []))} "
              f"{r.get('nonfinite_slots', [])[:6]}, worst rel {r.get('worst')}, "
              f"losses {r.get('losses')}, nonfinite steps {r.get('nonfinite_steps')}, "
              f"{r['seconds']} s {r.get('error', '')}", flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
