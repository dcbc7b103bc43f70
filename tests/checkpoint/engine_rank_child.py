"""One rank of a multi-rank engine checkpoint test (spawned by tests/zero/zero_harness.py
``run_ranks``, or run in-process at world size 1 through :func:`run`). Spec (JSON)::

    {"runs": [{"name", "config", "seed", "start", "steps", "batch",
               "load": dir | null, "load_tag": tag | null,
               "load_by_rank": {"<rank>": dir},          # optional per-rank override
               "save": [{"after": k, "dir": d, "tag": t | null}]}]}

Each run builds a fresh engine over the seeded AwkwardNet (``seed`` for its init:
loaded runs use another seed so every value must come from the checkpoint), loads
when asked, trains ``steps`` steps on the global batches ``start..start+steps-1`` of
tests/zero/zero_models.make_batches (this rank's slice of each), saving after
``after`` of them. Result per run: the global mean losses, the loaded meta step, the
load error (``"Type: message"``) and whether the engine was left unchanged by it; rank
0 writes the gathered parameters to ``<out>.<name>.safetensors``.
"""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "zero"))
from zero_harness import child_entry  # noqa: E402
from zero_models import make_batches, make_model  # noqa: E402


def _slice(t, rank, ws):
    n = t.shape[0] // ws
    return t[rank * n:(rank + 1) * n]


def _rng_digest():
    import hashlib
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def run_one(run, rank, ws, out_path=None):
    import infinity
    from infinity.zero.distributed import gathered_state_dict
    dist = torch.distributed if ws > 1 else None
    torch.manual_seed(run.get("seed", 1234))
    model = make_model("awkward")
    torch.manual_seed(1000 * run.get("seed", 1234) + rank)   # a different stream per rank
    res = {"losses": [], "load_error": None, "unchanged": None, "meta_step": None,
           "rng_at_save": None, "rng_after_load": None}
    saves = {s["after"]: s for s in run.get("save", [])}
    batches = make_batches("awkward", run["start"] + run["steps"], run.get("batch", 8))
    steps = run["steps"]
    with infinity.initialize(model, run["config"]) as eng:
        src = run.get("load_by_rank", {}).get(str(rank), run.get("load"))
        if src is not None:
            before = gathered_state_dict(eng) if ws > 1 else None
            try:
                meta = eng.load_checkpoint(src, run.get("load_tag"))
                res["meta_step"] = meta["step"]
                res["rng_after_load"] = _rng_digest()
            except Exception as e:  # noqa: BLE001 - reported to the test
                res["load_error"] = f"{type(e).__name__}: {e}"
                after = gathered_state_dict(eng) if ws > 1 else None
                res["unchanged"] = before is not None and all(
                    torch.equal(before[k], after[k]) for k in before) and eng.global_steps == 0
                steps, saves = 0, {}
        for i in range(steps):
            if i in saves:
                if res["rng_at_save"] is None:
                    res["rng_at_save"] = _rng_digest()
                eng.save_checkpoint(saves[i]["dir"], saves[i].get("tag"))
            x, y = batches[run["start"] + i]
            xs, ys = _slice(x, rank, ws), _slice(y, rank, ws)
            loss = torch.nn.functional.mse_loss(eng(xs).float(), ys)
            eng.backward(loss)
            eng.step()
            t = loss.detach().clone().reshape(1)
            if dist is not None:
                dist.all_reduce(t)
            res["losses"].append(float(t) / ws)
        if steps in saves:
            s = saves[steps]
            eng.save_checkpoint(s["dir"], s.get("tag"))
        res["global_steps"] = eng.global_steps
        sd = gathered_state_dict(eng)
    if rank == 0 and out_path is not None:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, f"{out_path}.{run['name']}.safetensors")
    if dist is not None:
        dist.barrier()   # every rank closed its engine (swap dirs) before the next run
    res["state"] = None if out_path is not None else sd
    return res


def main():
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(1)
    import torch.distributed as dist
    from infinity.zero.comm import ensure_process_group
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ensure_process_group(60)
    result = {"rank": rank, "runs": {}}
    for run in spec["runs"]:
        result["runs"][run["name"]] = run_one(run, rank, ws, out_path)
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    child_entry(main)
