"""One rank of a memory-centric tiling run at ZeRO world size > 1 (spawned by
zero_harness.run_ranks).  Spec (JSON): ``{"runs": [{"name", "model", "config", "steps",
"env", "spill"}...]}`` (``spill``: the averaged gradient shards spilled to NVMe).

For each run every rank builds the same seeded model and, as the reference, a copy trained
in this process by plain PyTorch + torch.optim.AdamW on the *global* batch (clipping and
accumulation as configured); the engine trains on this rank's slice of that batch.  The
rank reports the loss error, the final-parameter error (gathered from the shards), which
modules were tiled and the engine's counters.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import child_entry  # noqa: E402

VOCAB, D, H = 300, 64, 256


class TileLM(nn.Module):
    """An embedding, a two-layer MLP and an LM head, each larger than the 40 kB tiling limit
    the tests set: ``tied``: the head shares the embedding's weight (one group, two tiled
    modules); otherwise the head has its own weight and bias and the embedding a padding
    row."""

    def __init__(self, tied: bool, ckpt: bool = False):
        super().__init__()
        self.ckpt = ckpt          # the MLP under activation checkpointing (recomputed)
        self.emb = nn.Embedding(VOCAB, D, padding_idx=None if tied else 1)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=not tied)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        if self.ckpt:
            from torch.utils.checkpoint import checkpoint
            h = h + checkpoint(lambda t: self.down(F.gelu(self.up(t))), h, use_reentrant=False)
        else:
            h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.norm(h))


def batches(n, ws, seed=7):
    """``n`` global batches of ``2 * ws`` sequences: the first half of each batch uses
    token ids below 100, the second half ids from 150 up, so the ranks' lookups touch
    different embedding tiles."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lo = torch.randint(0, 100, (ws, 6), generator=g)
        hi = torch.randint(150, VOCAB, (ws, 6), generator=g)
        ids = torch.cat([lo, hi])
        ids[0, 0] = 1                                  # the padding row (untied): no gradient
        out.append((ids, torch.randint(0, VOCAB, (2 * ws, 6), generator=g)))
    return out


def lm_loss(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def main():
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(1)
    import torch.distributed as dist
    import infinity
    from infinity.zero.comm import ensure_process_group
    from infinity.zero.distributed import gathered_state_dict
    rank = int(os.environ["RANK"])
    ws = int(os.environ["WORLD_SIZE"])
    result = {"rank": rank, "runs": {}}
    for run in spec["runs"]:
        cfg = run["config"]
        ensure_process_group(cfg.get("dist_timeout_s", 60))
        torch.manual_seed(1234)
        tied = run["model"] == "tied"
        ckpt = run["model"] == "ckpt"
        ref = TileLM(tied, ckpt)
        model = TileLM(tied, ckpt)
        model.load_state_dict(ref.state_dict())
        gas = cfg.get("gradient_accumulation_steps", 1)
        clip = float(cfg.get("gradient_clipping", 0.0))
        data = batches(run["steps"] * gas, ws)
        # the reference: one process, the global batch
        opt = torch.optim.AdamW(ref.parameters(), lr=cfg["optimizer"]["lr"],
                                weight_decay=cfg["optimizer"]["weight_decay"])
        ref_losses = []
        for i, (x, y) in enumerate(data):
            loss = lm_loss(ref(x), y)
            ref_losses.append(float(loss))
            (loss / gas).backward()
            if (i + 1) % gas == 0:
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                opt.step()
                opt.zero_grad()
        saved_env = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        try:
            if run.get("spill"):
                from dist_child import make_engine
                eng = make_engine(model, cfg, force_spill=True)
                if not eng.zero.spill:
                    raise AssertionError("gradient spill was requested but not taken")
            else:
                eng = infinity.initialize(model, cfg)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            tiled = sorted(n for n, m in model.named_modules()
                           if eng.tiling is not None and m in eng.tiling.specs)
            rows = {n: eng.tiling.specs[m].rows for n, m in model.named_modules()
                    if eng.tiling is not None and m in eng.tiling.specs}
            tile_bytes = max((s.tile_bytes() for s in eng.tiling.specs.values()), default=0) \
                if eng.tiling is not None else 0
            largest = max(g.nbytes for g in eng.grouping.groups)
            eng.acct.reset_peaks()
            losses = []
            n = 2 * ws // ws
            for x, y in data:
                xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
                loss = lm_loss(eng(xs), ys)
                eng.backward(loss)
                eng.step()
                t = loss.detach().clone().reshape(1)
                dist.all_reduce(t)
                losses.append(float(t) / ws)
            sd = gathered_state_dict(eng)
            stats = eng.stats()
            # the engine's own state_dict (gathered from the shards) holds the same values:
            # tiling does not change the shard layout
            esd = eng.state_dict()
            sd_same = all(torch.equal(esd[k].float(), sd[k].float()) for k in sd if k in esd) \
                and set(dict(ref.named_parameters())) <= set(esd)
            device_kind = eng.mm.dev.kind
        finally:
            eng.close()
        want = dict(ref.named_parameters())
        num = sum(float((sd[k].float() - want[k].detach()).norm()) ** 2 for k in want)
        den = sum(float(want[k].detach().norm()) ** 2 for k in want)
        lerr = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        result["runs"][run["name"]] = {
            "loss_err": lerr, "param_err": (num / den) ** 0.5, "tiled": tiled, "rows": rows,
            "state_dict_matches": sd_same,
            "tile_bytes": tile_bytes, "largest_group": largest, "device": device_kind,
            "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}
        dist.barrier()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    child_entry(main)
