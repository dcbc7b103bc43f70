"""One rank of the world-size-2 engine tests (torchrun, ZeRO-3 over gloo): for each params
home, the tiny GPT-2 (ln_f frozen) trains 2 steps on this rank's half of each global batch,
``GatheredParameters(modifier_rank=1)`` edits engine-held parameters (rank 0 writes other
values, which must be discarded), 2 more steps; rank 0 writes the gathered weights.  On the
last home the engine then writes ``save_pretrained(quantize="int4")`` and the 16-bit
``save_pretrained`` (both collective)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402


def edit(model, gen):
    """The edit: a new row of the tied embedding, a scaled Conv1D weight, the frozen norm."""
    import torch
    with torch.no_grad():
        model.transformer.wte.weight.data[5] = torch.randn(32, generator=gen)
        model.transformer.h[0].mlp.c_fc.weight.data.mul_(0.5)
        model.transformer.ln_f.weight.data.fill_(1.5)


def edited(model):
    return [model.transformer.wte.weight, model.transformer.h[0].mlp.c_fc.weight,
            model.transformer.ln_f.weight]


def batches(n, seed=3):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, H.VOCAB, (2, H.SEQ), generator=g) for _ in range(n)]


def config(swap, home):
    """``home``: params and optimizer home at ZeRO-3, or "stage2" (parameters resident and
    replicated, optimizer states partitioned on the host)."""
    off = ({"params": "none", "optimizer": "cpu"} if home == "stage2" else
           {"params": home, "optimizer": home})
    return {"offload": {**off, "nvme_paths": [swap]},
            "zero_stage": 2 if home == "stage2" else 3,
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
            "gradient_clipping": 1.0}


def main():
    import torch
    from safetensors.torch import save_file

    import infinity
    spec = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    for i, home in enumerate(spec["homes"]):
        model = H.gpt2()
        model.transformer.ln_f.weight.requires_grad_(False)
        bs = batches(4)
        with infinity.initialize(model, config(spec["swap"], home)) as eng:
            def train(part):
                for ids in part:
                    mine = ids[rank:rank + 1]
                    eng.backward(eng(input_ids=mine, labels=mine).loss)
                    eng.step()
            train(bs[:2])
            with infinity.GatheredParameters(edited(model), modifier_rank=1):
                edit(model, torch.Generator().manual_seed(7 if rank == 1 else 99))
            sd_edit = {k: v.clone().contiguous() for k, v in eng.state_dict().items()}
            train(bs[2:])
            sd = {k: v.clone().contiguous() for k, v in eng.state_dict().items()}
            if i == len(spec["homes"]) - 1:
                files = eng.save_pretrained(spec["quantized"], quantize="int4", group_size=32)
                assert "model.safetensors" in files, files
                eng.save_pretrained(spec["full"])
        if rank == 0:
            save_file(sd, spec["weights"] % home)
            save_file(sd_edit, spec["edited"] % home)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "zero"))
    from zero_harness import child_entry  # noqa: E402 (prints the traceback, exits 3 at once)
    child_entry(main)
