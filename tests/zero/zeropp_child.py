"""One rank of a ZeRO++ run (spawned by zero_harness.run_ranks with LOCAL_WORLD_SIZE set, so
4 ranks act as 2 nodes x 2).  Spec (JSON): {"runs": [{"name", "config", "steps", "env"}],
"model": {...LlamaConfig kwargs}, "batch": int, "seq": int}.

For each run: a seeded small Llama causal LM, ``steps`` steps of a seeded next-token task
(each rank its slice of the global batch), the global mean loss per step, the four
``*_sent_*`` counters of ``engine.stats()``, the step seconds, and a hash of the gathered
final parameters.
"""
import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import child_entry  # noqa: E402


def make_lm(model_kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "max_position_embeddings": 64,
                         "tie_word_embeddings": False, "use_cache": False, **model_kw})
    return LlamaForCausalLM(cfg)


def make_tokens(vocab, n_batches, batch, seq, seed=7):
    """A learnable next-token task: each sequence follows x[t+1] = (a * x[t] + b) % vocab
    with (a, b) from a small set, starting anywhere."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        a = torch.tensor([1, 3, 5, 7])[torch.randint(0, 4, (batch, 1), generator=g)]
        b = torch.randint(0, 4, (batch, 1), generator=g)
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            x[:, t] = (a[:, 0] * x[:, t - 1] + b[:, 0]) % vocab
        out.append(x)
    return out


def main():
    spec = json.loads(open(sys.argv[1]).read())
    out_path = sys.argv[2]
    torch.set_num_threads(1)
    import torch.distributed as dist
    import infinity
    from infinity.zero.comm import ensure_process_group
    from infinity.zero.distributed import gathered_state_dict
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch, seq = spec["batch"], spec["seq"]
    result = {"rank": rank, "runs": {}}
    for run in spec["runs"]:
        cfg = run["config"]
        ensure_process_group(60)
        saved = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        try:
            torch.manual_seed(1234)
            model = make_lm(spec.get("model", {}))
            eng = infinity.initialize(model, cfg)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        data = make_tokens(model.config.vocab_size, run["steps"], batch, seq)
        losses, secs = [], []
        try:
            for x in data:
                n = batch // ws
                xs = x[rank * n:(rank + 1) * n]
                t0 = time.perf_counter()
                out = eng(input_ids=xs, labels=xs)
                eng.backward(out.loss)
                eng.step()
                secs.append(time.perf_counter() - t0)
                t = out.loss.detach().float().reshape(1)
                dist.all_reduce(t)
                losses.append(float(t) / ws)
            stats = eng.stats()
            sd = gathered_state_dict(eng) if run.get("hash") else {}
            plan = {k: v for k, v in eng.placement.device.items()}
            shm = eng.zero.comm.shm is not None
        finally:
            eng.close()
        h = hashlib.sha256()
        for k in sorted(sd):
            h.update(k.encode())
            h.update(sd[k].float().numpy().tobytes())
        result["runs"][run["name"]] = {
            "losses": losses, "seconds": secs, "params_sha": h.hexdigest(),
            "plan_device": plan, "shm_transport": shm,
            **{k: stats.get(k, 0) for k in (
                "allgather_sent_bytes", "allgather_sent_inter_bytes", "grad_comm_sent_bytes",
                "grad_comm_sent_inter_bytes", "allgather_bytes", "device_budget_overflows",
                "skipped_steps")}}
        dist.barrier()
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    child_entry(main)
