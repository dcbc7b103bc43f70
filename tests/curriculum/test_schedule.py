"""The seqlen schedule equals DeepSpeed's legacy curriculum step by step, and batches are
truncated to it.  The reference below is written from DeepSpeed's definition
(deepspeed/runtime/data_pipeline/curriculum_scheduler.py, and the engine calling
``update_difficulty(global_steps + 1)`` before each training forward), not from our code."""
import logging
import math

import pytest
import torch

from infinity.config import ConfigError
from infinity.curriculum import SeqlenSchedule, schedule_from_config, truncate_batch


class DeepSpeedReference:
    """DeepSpeed's CurriculumScheduler as its engine drives it: the current difficulty starts
    at min_difficulty and is recomputed (while still below max_difficulty) at every training
    forward from ``global_steps + 1``."""

    def __init__(self, block):
        self.b = block
        self.current = block["min_difficulty"]

    def _get(self, s):
        b, sc = self.b, self.b["schedule_config"]
        if b["schedule_type"] == "fixed_discrete":
            if s > sc["max_step"][-1]:
                return sc["difficulty"][-1]
            for i in range(len(sc["max_step"])):
                if s <= sc["max_step"][i]:
                    return sc["difficulty"][i]
        degree = 1 if b["schedule_type"] == "fixed_linear" else sc["root_degree"]
        nxt = (float(s) / sc["total_curriculum_step"]) ** (1.0 / degree)
        nxt = math.floor(nxt * (b["max_difficulty"] - b["min_difficulty"]) + b["min_difficulty"])
        nxt -= nxt % sc["difficulty_step"]
        return min(nxt, b["max_difficulty"])

    def forward_difficulty(self, global_steps):
        if self.current < self.b["max_difficulty"]:
            self.current = self._get(global_steps + 1)
        return self.current


def _block(typ, lo, hi, **sc):
    return {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": lo,
            "max_difficulty": hi, "schedule_type": typ, "schedule_config": sc}


CASES = [
    _block("fixed_linear", 8, 1024, total_curriculum_step=300, difficulty_step=8),
    _block("fixed_linear", 64, 2048, total_curriculum_step=37, difficulty_step=16),
    _block("fixed_linear", 3, 100, total_curriculum_step=50, difficulty_step=1),
    _block("fixed_linear", 8, 1001, total_curriculum_step=40, difficulty_step=8),  # max not x8
    _block("fixed_linear", 8, 64, total_curriculum_step=1000, difficulty_step=8),  # slow growth
    _block("fixed_root", 8, 1024, total_curriculum_step=300, difficulty_step=8, root_degree=2),
    _block("fixed_root", 16, 512, total_curriculum_step=77, difficulty_step=16, root_degree=3),
    _block("fixed_root", 8, 256, total_curriculum_step=20, difficulty_step=8, root_degree=1),
    _block("fixed_discrete", 8, 1024, difficulty=[8, 64, 512, 1024], max_step=[5, 20, 40]),
    _block("fixed_discrete", 16, 128, difficulty=[32, 128], max_step=[1]),
    _block("fixed_discrete", 16, 256, difficulty=[16, 16, 64, 200], max_step=[3, 9, 10]),
    _block("fixed_linear", 128, 128, total_curriculum_step=10, difficulty_step=8),  # min == max
]


@pytest.mark.parametrize("block", CASES, ids=lambda b: f"{b['schedule_type']}-"
                         f"{b['min_difficulty']}-{b['max_difficulty']}")
def test_lengths_equal_deepspeed_step_by_step(block):
    sched = SeqlenSchedule.from_config(block)
    ref = DeepSpeedReference(block)
    total = block["schedule_config"].get("total_curriculum_step") or \
        block["schedule_config"]["max_step"][-1]
    for g in range(3 * total + 5):
        assert sched.length(g) == ref.forward_difficulty(g), (g, block)


def test_the_helper_builds_the_same_schedules():
    lin = SeqlenSchedule(8, 1024, 300)           # fixed_linear, difficulty_step 8
    root = SeqlenSchedule(8, 1024, 300, schedule="root", root_degree=2)
    disc = SeqlenSchedule(8, 1024, schedule="discrete", difficulty=[8, 64, 512, 1024],
                          max_step=[5, 20, 40])
    for sched, block in ((lin, CASES[0]), (root, CASES[5]), (disc, CASES[8])):
        ref = DeepSpeedReference(block)
        assert [sched.length(g) for g in range(400)] == \
            [ref.forward_difficulty(g) for g in range(400)]


def test_boundaries_linear():
    s = SeqlenSchedule(8, 1024, 100, difficulty_step=8)
    # the first update already uses the formula at step 1, as DeepSpeed's engine does
    assert s.length(0) == (math.floor(1 / 100 * 1016 + 8) // 8) * 8 == 16
    assert s.length(99) == 1024           # global_steps + 1 == total_curriculum_step
    assert s.length(98) == 1008
    assert all(s.length(g) == 1024 for g in range(99, 500))
    assert s.length(10**9) == 1024
    lens = s.lengths(100)
    assert lens == sorted(lens)                               # never shrinks
    assert all(x % 8 == 0 for x in lens)                      # multiples of difficulty_step
    assert all(8 <= x <= 1024 for x in lens)


def test_boundaries_discrete():
    s = SeqlenSchedule(8, 1024, schedule="fixed_discrete", difficulty=[8, 64, 1024],
                       max_step=[5, 20])
    # DeepSpeed's global_steps argument is our step + 1: max_step 5 is our steps 0..4
    assert [s.length(g) for g in (0, 4, 5, 19, 20, 21, 1000)] == [8, 8, 64, 64, 1024, 1024, 1024]


def test_boundaries_root_and_min_equal_max():
    s = SeqlenSchedule(8, 64, 16, schedule="root", root_degree=2)
    assert s.length(15) == 64 and s.length(14) < 64
    assert SeqlenSchedule(64, 64, 10).lengths(5) == [64] * 5


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_a_bad_step_is_an_error(step):
    with pytest.raises(ValueError, match="curriculum step"):
        SeqlenSchedule(8, 64, 10).length(step)


@pytest.mark.parametrize("block", [CASES[0], CASES[6], CASES[8]],
                         ids=["linear", "root", "discrete"])
def test_resume_mid_schedule(block):
    """A schedule rebuilt from a checkpoint's state continues exactly where the run was."""
    full = SeqlenSchedule.from_config(block)
    whole = full.lengths(200)
    k = 37
    state = full.state_dict(k)
    assert state["global_step"] == k and state["seqlen"] == whole[k]
    resumed = SeqlenSchedule.from_config(state["config"])
    assert resumed.load_state_dict(state) == k
    assert [resumed.length(g) for g in range(k, 200)] == whole[k:]


def test_resume_with_a_changed_schedule_warns(caplog):
    old = SeqlenSchedule(8, 256, 100)
    new = SeqlenSchedule(16, 256, 100)
    with caplog.at_level(logging.WARNING, logger="infinity.curriculum"):
        assert new.load_state_dict(old.state_dict(50)) == 50
    assert "changed since the checkpoint" in caplog.text
    with pytest.raises(ValueError, match="global_step"):
        new.load_state_dict({"seqlen": 3})


def test_helper_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"curriculum_learning\.min_difficulty: must be a "
                                          r"multiple of schedule_config\.difficulty_step \(8\)"):
        SeqlenSchedule(12, 64, 10)
    with pytest.raises(ConfigError, match="curriculum_learning.schedule_type: expected one of "
                                          '"fixed_linear", "fixed_root", "fixed_discrete"'):
        SeqlenSchedule(8, 64, 10, schedule="cosine")
    with pytest.raises(ConfigError, match="total_curriculum_step: required"):
        SeqlenSchedule(8, 64)
    with pytest.raises(ConfigError, match="enabled"):
        SeqlenSchedule.from_config({"enabled": False})
    assert schedule_from_config({"enabled": False}) is None
    assert schedule_from_config(None) is None


# ------------------------------------------------------------------------------ truncation

def _right_padded(lengths, seq, vocab=50, pad=0):
    ids = torch.full((len(lengths), seq), pad)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    labels = torch.full((len(lengths), seq), -100)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) % vocab + 1
        mask[i, :n] = 1
        labels[i, :n] = ids[i, :n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_truncation_of_a_right_padded_batch():
    b = _right_padded([20, 5, 12], seq=20)
    b["sample_id"] = torch.tensor([7, 8, 9])          # not per-token: untouched
    b["note"] = ["a", "b", "c"]
    out = SeqlenSchedule(8, 20, 10).truncate(b, 0)     # length(0) == 8
    assert out is not b and b["input_ids"].shape == (3, 20)    # the input is not modified
    for k in ("input_ids", "attention_mask", "labels"):
        assert out[k].shape == (3, 8)
        assert torch.equal(out[k], b[k][:, :8])
    # the short row keeps its padding: mask 0 and label -100 past its 5 tokens
    assert out["attention_mask"][1].tolist() == [1] * 5 + [0] * 3
    assert out["labels"][1, 5:].tolist() == [-100] * 3
    assert out["input_ids"][0].tolist() == list(range(2, 10))
    assert out["sample_id"] is b["sample_id"] and out["note"] is b["note"]


def test_truncation_keeps_the_batch_type_and_forms():
    from transformers import BatchEncoding
    enc = BatchEncoding(_right_padded([10, 10], seq=10))
    out = truncate_batch(enc, 4)
    assert isinstance(out, BatchEncoding) and out["input_ids"].shape == (2, 4)
    assert enc["input_ids"].shape == (2, 10)
    x = torch.arange(30).view(3, 10)
    assert torch.equal(truncate_batch(x, 6), x[:, :6])
    pair = truncate_batch((x, x.clone(), torch.ones(3)), 2)
    assert isinstance(pair, tuple) and pair[0].shape == (3, 2) and pair[2].shape == (3,)
    # a 4-D (batch, heads, query, key) mask is cut on both sequence dims
    m4 = torch.ones(3, 1, 10, 10)
    out = truncate_batch({"input_ids": x, "attention_mask": m4}, 4)
    assert out["attention_mask"].shape == (3, 1, 4, 4)


def test_a_batch_already_short_enough_is_returned_as_is():
    b = _right_padded([6, 3], seq=6)
    assert truncate_batch(b, 6) is b and truncate_batch(b, 100) is b
    assert truncate_batch({"labels": torch.ones(3)}, 2)["labels"].shape == (3,)
    with pytest.raises(ValueError, match="integer >= 1"):
        truncate_batch(b, 0)


def test_left_padding_is_warned(caplog):
    import infinity.curriculum as cur
    cur._warned_left_padding = False
    b = _right_padded([8, 3], seq=8)
    b = {k: v.flip(1) for k, v in b.items()}            # left padded
    with caplog.at_level(logging.WARNING, logger="infinity.curriculum"):
        out = truncate_batch(b, 4)
    assert out["input_ids"].shape == (2, 4)
    assert "left-padded" in caplog.text and "padding_side" in caplog.text
