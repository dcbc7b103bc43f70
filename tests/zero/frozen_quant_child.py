"""One rank of a LoRA-style run over a frozen base kept quantized across ranks
(``offload.frozen_weights``; Note [Quantized shards] in infinity/zero/quantized_shards.py),
spawned by zero_harness.run_ranks.  Spec (JSON): ``{"runs": [{"name", "config", "steps",
"env"}...]}``.

Every rank builds the same seeded model -- a frozen embedding, frozen Linear layers with
trainable low-rank adapters beside them, a frozen head -- and, as the reference, a copy
whose frozen weights went through the same quantize round trip, trained in this process
by plain PyTorch + torch.optim.AdamW on the *global* batch; the engine trains on this
rank's slice.  Reported: loss and final-parameter errors (gathered ``state_dict``), the
counters, and after a checkpoint round trip into a fresh engine the error of two more
steps against the reference continued.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import child_entry  # noqa: E402

VOCAB, D, R = 512, 256, 4


class LoRALinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.weight.requires_grad_(False)
        self.base.bias.requires_grad_(False)
        self.a = nn.Linear(d_in, R, bias=False)
        self.b = nn.Linear(R, d_out, bias=False)
        nn.init.normal_(self.b.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.emb.weight.requires_grad_(False)
        self.up = LoRALinear(D, 3 * D)
        self.down = LoRALinear(3 * D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight.requires_grad_(False)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


def dequantized(model, fw):
    from infinity.quant import quantize_weight
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)) and not mod.weight.requires_grad:
                mod.weight.copy_(quantize_weight(
                    mod.weight, fw["dtype"], fw.get("group_size", 64),
                    double_quant=fw.get("double_quant", False)).dequantize())
    return model


def batches(n, ws, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (2 * ws, 8), generator=g),
             torch.randint(0, VOCAB, (2 * ws, 8), generator=g)) for _ in range(n)]


def lm_loss(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def main():
    spec = json.loads(open(sys.argv[1]).read())
    out_path = sys.argv[2]
    torch.set_num_threads(1)
    import torch.distributed as dist
    import infinity
    from infinity.zero.comm import ensure_process_group
    from infinity.zero.distributed import gathered_state_dict
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = {"rank": rank, "runs": {}}
    for run in spec["runs"]:
        cfg = run["config"]
        ensure_process_group(cfg.get("dist_timeout_s", 60))
        os.environ.update(run.get("env", {}))
        torch.manual_seed(1234)
        model = Net()
        ref = Net()
        ref.load_state_dict(model.state_dict())
        if run.get("from_files"):
            # Note [Base by reference]: the base read from a pretrained file
            from safetensors.torch import save_file
            from infinity.zero.init import load_safetensors
            path = os.path.join(run["ckpt"], "base.safetensors")
            if rank == 0:
                save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                          path)
            dist.barrier()
            load_safetensors(model, [path])
        fw = cfg["offload"].get("frozen_weights")
        if fw is not None:
            dequantized(ref, fw)
        steps = run["steps"]
        data = batches(steps + 2, ws)
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad],
                                lr=cfg["optimizer"]["lr"], weight_decay=0.0)
        ref_losses = []
        for x, y in data:
            loss = lm_loss(ref(x), y)
            ref_losses.append(float(loss))
            loss.backward()
            opt.step()
            opt.zero_grad()
        def train(eng, batches, n=2):
            """This rank's slice of each global batch; the losses averaged over ranks."""
            out = []
            for x, y in batches:
                loss = lm_loss(eng(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
                eng.backward(loss)
                eng.step()
                t = loss.detach().clone().reshape(1)
                dist.all_reduce(t)
                out.append(float(t) / ws)
            return out
        eng = infinity.initialize(model, cfg)
        losses = train(eng, data[:steps])
        quantized = sum(1 for g in eng.grouping.groups if g.quant is not None)
        stats = {k: v for k, v in eng.stats().items() if isinstance(v, (int, float))}
        sd = gathered_state_dict(eng)
        ckpt = os.path.join(run["ckpt"], "ck")
        eng.save_checkpoint(ckpt)
        eng.close()
        from infinity.checkpoint import CheckpointReader
        with CheckpointReader(ckpt) as r:
            by_ref = sorted(r.meta.get("frozen_base", {}).get("tensors", {}))
            by_ref_stored = [n for n in by_ref if n in r._tensors]
        # a fresh engine over the same base (as a resume builds it), its adapters
        # re-initialised: they and their Adam states come from the checkpoint; a base kept
        # by reference is built other (seed 999): the load re-quantizes it from its file
        torch.manual_seed(999 if run.get("from_files") else 1234)
        model2 = Net()
        with torch.no_grad():
            for p in model2.parameters():
                if p.requires_grad:
                    p.normal_()
        eng2 = infinity.initialize(model2, cfg)
        eng2.load_checkpoint(ckpt)
        more = train(eng2, data[steps:])
        sd2 = gathered_state_dict(eng2)
        eng2.close()
        ref_sd = dict(ref.named_parameters())

        def rel(a, b):
            a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
            return float((a - b).norm() / b.norm().clamp_min(1e-30))
        result["runs"][run["name"]] = {
            "loss_err": rel(losses, ref_losses[:steps]),
            "resume_loss_err": rel(more, ref_losses[steps:]),
            "param_err": max(rel(sd2[k], p.detach()) for k, p in ref_sd.items() if k in sd2),
            "frozen_err": max(rel(sd[k], ref_sd[k].detach()) for k in
                              ("emb.weight", "head.weight", "up.base.weight")),
            "quantized_groups": quantized, "stats": stats,
            "by_reference": by_ref, "by_reference_stored": by_ref_stored}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    child_entry(main)
