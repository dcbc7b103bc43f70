"""InfinityTrainer with a ``curriculum_learning`` block: the callback is added by itself,
every micro-batch of an update is truncated to that update's length, the length is logged,
and a resumed run continues the schedule."""
import json
import os
import sys

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "integrations"))
import hf_helpers as H  # noqa: E402

from infinity.curriculum import SeqlenSchedule  # noqa: E402
from infinity.integrations.curriculum import LOG_KEY, CurriculumCallback  # noqa: E402
from infinity.integrations.transformers import InfinityTrainer  # noqa: E402

BLOCK = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4,
         "max_difficulty": H.SEQ, "schedule_type": "fixed_linear",
         "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 2}}


def _trainer(out, swap_dir, config, **kw):
    model = H.gpt2()
    seen = []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[1]),
                                    with_kwargs=True)
    tr = InfinityTrainer(model=model, args=H.args(out, **kw), train_dataset=H.TokenData(),
                         infinity_config=config)
    return tr, seen


def test_trainer_truncates_by_update_and_logs_the_length(tmp_path, swap_dir):
    expected = SeqlenSchedule.from_config(BLOCK).lengths(6)     # [6, 8, 10, 12, 12, 12]
    assert expected[0] < H.SEQ and expected[-1] == H.SEQ
    tr, seen = _trainer(tmp_path / "a", swap_dir, H.nvme_config(swap_dir, curriculum_learning=BLOCK),
                        max_steps=6, save_strategy="steps", save_steps=3)
    try:
        assert sum(isinstance(c, CurriculumCallback) for c in tr.callback_handler.callbacks) == 1
        tr.train()
        # accumulation 2: both micro-batches of an update have its length
        assert seen == [n for n in expected for _ in range(2)]
        assert H.log_values(tr, LOG_KEY) == expected
        assert tr.engine.stats()["curriculum_seqlen"] == expected[-1]     # the last update's
        with open(tmp_path / "a" / "checkpoint-3" / "trainer_state.json") as f:
            st = json.load(f)["stateful_callbacks"]["CurriculumCallback"]
        assert st["args"]["config"] == BLOCK and st["attributes"]["global_step"] == 2
    finally:
        tr.close()
    # resume from step 3: the schedule continues from the restored global step
    tr2, seen2 = _trainer(tmp_path / "a", swap_dir,
                          H.nvme_config(swap_dir, curriculum_learning=BLOCK),
                          max_steps=6, save_strategy="no",
                          restore_callback_states_from_checkpoint=True)
    try:
        tr2.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
        assert seen2 == [n for n in expected[3:] for _ in range(2)]
        assert H.log_values(tr2, LOG_KEY) == expected   # the restored history + steps 4..6
    finally:
        tr2.close()


def test_deepspeed_config_block_adds_the_callback(tmp_path, swap_dir):
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "curriculum_learning": dict(BLOCK, schedule_type="fixed_discrete",
                                      schedule_config={"difficulty": [4, 8, 12],
                                                       "max_step": [1, 2]})}
    tr, seen = _trainer(tmp_path / "b", swap_dir, ds, max_steps=4, gradient_accumulation_steps=1)
    try:
        tr.train()
        assert seen == [4, 8, 12, 12]
        assert H.log_values(tr, LOG_KEY) == [4, 8, 12, 12]
        assert tr.engine.cfg.curriculum_learning.schedule_type == "fixed_discrete"
    finally:
        tr.close()


def test_no_block_no_callback(tmp_path, swap_dir):
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "c"),
                         train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    assert not any(isinstance(c, CurriculumCallback) for c in tr.callback_handler.callbacks)
    tr.close()
