"""One rank of the world-size-2 GatheredParameters test (torchrun): a GPT-2 built under
Init (each rank homes its 1/2 chunk on NVMe) is resized inside GatheredParameters with
modifier_rank=0; rank 1 draws different new-token values, which must be overwritten by
rank 0's (broadcast).  Rank 0 writes the adopted engine's weights."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402


def main():
    import torch
    from safetensors.torch import save_file

    import infinity
    spec = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [spec["swap"]]}}
    with infinity.Init(cfg):
        model = H.gpt2()
    emb = model.get_input_embeddings()
    torch.manual_seed(5 if rank == 0 else 99)
    with infinity.GatheredParameters([emb.weight], modifier_rank=0):
        model.resize_token_embeddings(H.VOCAB + 6, mean_resizing=False)
    with infinity.initialize(model, cfg) as eng:
        sd = {k: v.clone().contiguous() for k, v in eng.state_dict().items()}
        w = model.get_input_embeddings().weight          # now held by the engine (ZeRO-3)
        with infinity.GatheredParameters([w], modifier_rank=None):   # collective read
            sd["gathered.engine_held_wte"] = w.data.clone().contiguous()
    if rank == 0:
        save_file(sd, spec["weights"])


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "zero"))
    from zero_harness import child_entry  # noqa: E402 (prints the traceback, exits 3 at once)
    child_entry(main)
