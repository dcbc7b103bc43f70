"""One rank of the "a checkpoint load drops the shard cache" test (test_shard_cache.py).

For each config (spec ``configs``: name -> config): train 4 steps, save a checkpoint, note
the gathered parameters, train 2 more steps (the cached shard copies follow them), load
the checkpoint (which rewrites the NVMe homes: the copies must be dropped, or the next
fetches would all-gather the values of step 6), check the gathered parameters equal the
saved ones and nothing is cached, train 2 more steps.  Writes per config the losses of
the last 2 steps, the cache bytes after the load and at the end.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import child_entry  # noqa: E402
from zero_models import make_batches, make_model  # noqa: E402

BATCH = 8


def main():
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    import infinity
    from infinity.zero.comm import ensure_process_group
    from infinity.zero.distributed import gathered_state_dict
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {"rank": rank, "runs": {}}
    for name, cfg in spec["configs"].items():
        ensure_process_group(cfg.get("dist_timeout_s", 60))
        torch.manual_seed(1234)
        eng = infinity.initialize(make_model("awkward"), cfg)
        batches = make_batches("awkward", 8, BATCH)
        n = BATCH // ws

        def train(bs):
            losses = []
            for x, y in bs:
                out_ = eng(x[rank * n:(rank + 1) * n])
                loss = torch.nn.functional.mse_loss(out_, y[rank * n:(rank + 1) * n])
                eng.backward(loss)
                eng.step()
                t = loss.detach().reshape(1).clone()
                dist.all_reduce(t)
                losses.append(float(t) / ws)
            return losses
        try:
            train(batches[:4])
            eng.save_checkpoint(spec["ckpt"] + "-" + name, tag="t")
            saved = gathered_state_dict(eng)
            train(batches[4:6])
            before_load = eng.mm.cache_used
            eng.load_checkpoint(spec["ckpt"] + "-" + name, tag="t")
            after_load = eng.mm.cache_used
            loaded = gathered_state_dict(eng)
            same = all(torch.equal(saved[k], loaded[k]) for k in saved)
            losses = train(batches[6:8])
            out["runs"][name] = {"losses": losses, "cache_before_load": before_load,
                                 "cache_after_load": after_load, "cache_end": eng.mm.cache_used,
                                 "loaded_equal_saved": same}
        finally:
            eng.close()
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    child_entry(main)
