"""One rank of the InfinityTrainer world-size-2 test (launched by torchrun): trains the tiny
GPT-2 with ZeRO-3 and NVMe offload over gloo, checkpoints, saves the model; rank 0 writes
the logged losses and the final weights."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402


def main():
    spec = json.load(open(sys.argv[1]))
    from safetensors.torch import save_file

    from infinity.integrations.transformers import InfinityTrainer
    rank = int(os.environ["RANK"])
    args = H.args(spec["out"], per_device_train_batch_size=1, save_strategy="steps",
                  save_steps=5, save_total_limit=1)
    tr = InfinityTrainer(model=H.gpt2(), args=args, train_dataset=H.TokenData(),
                         infinity_config=H.nvme_config(spec["swap"]))
    try:
        tr.train()
        assert tr.engine.stats()["step"] == 10
        # the engine replaces Accelerate's wrapping: no DDP around the model at world size 2
        import torch
        assert tr.model_wrapped is tr.model and not isinstance(
            tr.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(tr.model_wrapped)
        sd = {k: v.clone().contiguous() for k, v in tr.engine.state_dict().items()}  # collective
        tr.save_model(spec["final"])                                                  # collective
        ws = tr.args.world_size
    finally:
        tr.close()
    if rank == 0:
        save_file(sd, spec["weights"])
        json.dump({"losses": H.losses(tr), "world_size": ws,
                   "grad_norms": H.log_values(tr, "grad_norm")}, open(spec["result"], "w"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "zero"))
    from zero_harness import child_entry  # noqa: E402 (prints the traceback, exits 3 at once)
    child_entry(main)
