"""Child process for the kill -9 tests: saves checkpoints in a loop until killed.

usage: python ckpt_child.py ROOT READY_FILE [--no-exchange]
Tags cycle over slot-0..slot-2 (so existing tags are overwritten all the time);
tensor values are a function of the step stored in meta, checked by the parent.
"""
import os
import sys

import torch

from infinity.checkpoint import save_checkpoint
from infinity.checkpoint import writer as ckpt_writer


def expected_tensors(step):
    return {f"t{i}": torch.full((200_000 + 37 * i,), float(step * 10 + i)) for i in range(5)}


class State:
    def __init__(self, step):
        self.step = step

    def checkpoint_tensors(self):
        yield from expected_tensors(self.step).items()

    def checkpoint_meta(self):
        return {"step": self.step}


def main():
    root, ready = sys.argv[1], sys.argv[2]
    if "--no-exchange" in sys.argv:
        ckpt_writer.exchange = lambda a, b: False  # exercise the two-rename fallback
    step = 0
    while True:
        step += 1
        save_checkpoint(State(step), root, tag=f"slot-{step % 3}", shard_bytes=300_000)
        if step == 1:
            with open(ready, "w") as f:
                f.write(str(os.getpid()))


if __name__ == "__main__":
    main()
