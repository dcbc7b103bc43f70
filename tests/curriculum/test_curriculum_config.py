"""The ``curriculum_learning`` config section: DeepSpeed's legacy keys, validated with errors
naming the key and the allowed values; a DeepSpeed block translated as is; the
``--curriculum`` spec of ``infinity finetune``."""
import copy

import pytest

from infinity.config import ConfigError, CurriculumConfig, InfinityConfig
from infinity.curriculum import SeqlenSchedule, cli_block, parse_cli_spec

# DeepSpeed's curriculum learning tutorial (GPT-2 pre-training), as users bring it along
DS_BLOCK = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
            "max_difficulty": 1024, "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 15000, "difficulty_step": 8}}


def test_default_is_disabled_and_left_out_of_to_dict():
    cfg = InfinityConfig()
    assert cfg.curriculum_learning == CurriculumConfig() and not cfg.curriculum_learning.enabled
    assert "curriculum_learning" not in cfg.to_dict()


def test_an_enabled_block_round_trips():
    cfg = InfinityConfig.load({"curriculum_learning": DS_BLOCK})
    c = cfg.curriculum_learning
    assert (c.enabled, c.min_difficulty, c.max_difficulty, c.schedule_type) == \
        (True, 8, 1024, "fixed_linear")
    d = cfg.to_dict()
    assert d["curriculum_learning"] == DS_BLOCK
    d["curriculum_learning"]["schedule_config"]["difficulty_step"] = 16   # a copy
    assert cfg.curriculum_learning.schedule_config["difficulty_step"] == 8
    assert InfinityConfig.from_dict(cfg.to_dict()) == cfg
    # choices are case-insensitive; floats with integral values are integers
    c2 = InfinityConfig.load({"curriculum_learning": dict(
        DS_BLOCK, schedule_type="Fixed_Root", min_difficulty=8.0,
        schedule_config={"total_curriculum_step": 1e3, "difficulty_step": 8,
                         "root_degree": 2})}).curriculum_learning
    assert c2.schedule_type == "fixed_root" and c2.min_difficulty == 8
    assert c2.schedule_config["total_curriculum_step"] == 1000


def test_a_disabled_block_needs_nothing_but_is_type_checked():
    InfinityConfig.load({"curriculum_learning": {"enabled": False}})
    InfinityConfig.load({"curriculum_learning": {"enabled": False, "min_difficulty": 8}})
    with pytest.raises(ConfigError, match=r"curriculum_learning\.min_difficulty: expected an "
                                          r"integer"):
        InfinityConfig.load({"curriculum_learning": {"min_difficulty": "8"}})


def _with(**over):
    block = copy.deepcopy(DS_BLOCK)
    sc = over.pop("schedule_config", None)
    block.update(over)
    if sc is not None:
        block["schedule_config"] = sc
    return {"curriculum_learning": block}


BAD = [
    (_with(enabled="yes"), r"curriculum_learning\.enabled: expected true or false"),
    (_with(curriculum_type="vocab"),
     r'curriculum_learning\.curriculum_type: expected one of "seqlen", got "vocab"'),
    (_with(schedule_type="fixed_cosine"),
     r'curriculum_learning\.schedule_type: expected one of "fixed_linear", "fixed_root", '
     r'"fixed_discrete", got "fixed_cosine"'),
    (_with(schedule_type="custom"), r"curriculum_learning\.schedule_type: expected one of"),
    (_with(min_difficulty=None), r"curriculum_learning\.min_difficulty: required when "
                                 r"curriculum_learning\.enabled is true"),
    (_with(max_difficulty=None), r"curriculum_learning\.max_difficulty: required"),
    (_with(min_difficulty=0), r"curriculum_learning\.min_difficulty: expected an integer >= 1"),
    (_with(max_difficulty=4), r"curriculum_learning\.max_difficulty: must be >= "
                              r"curriculum_learning\.min_difficulty \(8\), got 4"),
    (_with(min_difficulty=12), r"curriculum_learning\.min_difficulty: must be a multiple of "
                               r"schedule_config\.difficulty_step \(8\), got 12.*use 8 or 16"),
    (_with(schedule_config={"difficulty_step": 8}),
     r"curriculum_learning\.schedule_config\.total_curriculum_step: required for "
     r'curriculum_learning\.schedule_type "fixed_linear"'),
    (_with(schedule_config={"total_curriculum_step": 10}),
     r"curriculum_learning\.schedule_config\.difficulty_step: required"),
    (_with(schedule_type="fixed_root"),
     r"curriculum_learning\.schedule_config\.root_degree: required for "
     r'curriculum_learning\.schedule_type "fixed_root"'),
    (_with(schedule_config={"total_curriculum_step": 10, "difficulty_step": 0}),
     r"curriculum_learning\.schedule_config\.difficulty_step: expected an integer >= 1"),
    (_with(schedule_config={"total_curriculum_step": 0, "difficulty_step": 8}),
     r"curriculum_learning\.schedule_config\.total_curriculum_step: expected an integer >= 1"),
    (_with(schedule_config={"total_curriculum_steps": 10, "difficulty_step": 8}),
     r"curriculum_learning\.schedule_config\.total_curriculum_steps: unknown key; did you mean "
     r"curriculum_learning\.schedule_config\.total_curriculum_step\?"),
    (_with(schedule_config=[1, 2]),
     r"curriculum_learning\.schedule_config: expected a mapping"),
    (_with(schedule_type="fixed_discrete", schedule_config={"difficulty": [8, 16]}),
     r"curriculum_learning\.schedule_config\.max_step: required for "
     r'curriculum_learning\.schedule_type "fixed_discrete"'),
    (_with(schedule_type="fixed_discrete",
           schedule_config={"difficulty": [8, 16], "max_step": [5, 9]}),
     r"curriculum_learning\.schedule_config\.max_step: expected one element fewer than "
     r"schedule_config\.difficulty \(2 elements"),
    (_with(schedule_type="fixed_discrete",
           schedule_config={"difficulty": [8, 16, 32], "max_step": [5, 5]}),
     r"curriculum_learning\.schedule_config\.max_step\[1\]: must be greater than max_step\[0\]"),
    (_with(schedule_type="fixed_discrete",
           schedule_config={"difficulty": [8, 32, 16], "max_step": [5, 9]}),
     r"curriculum_learning\.schedule_config\.difficulty\[2\]: must be >= difficulty\[1\]"),
    (_with(schedule_type="fixed_discrete",
           schedule_config={"difficulty": [8, 2048], "max_step": [5]}),
     r"curriculum_learning\.schedule_config\.difficulty\[1\]: must be <= "
     r"curriculum_learning\.max_difficulty \(1024\)"),
    (_with(schedule_type="fixed_discrete", schedule_config={"difficulty": [], "max_step": []}),
     r"curriculum_learning\.schedule_config\.difficulty: expected a non-empty list"),
    ({"curriculum_learning": {"enable": True}},
     r"curriculum_learning\.enable: unknown key; did you mean curriculum_learning\.enabled\?"),
    ({"curriculum_learning": "seqlen"}, r"curriculum_learning: expected a mapping"),
]


@pytest.mark.parametrize("cfg,match", BAD, ids=range(len(BAD)))
def test_bad_blocks_name_the_key_and_the_allowed_values(cfg, match):
    with pytest.raises(ConfigError, match=match):
        InfinityConfig.load(cfg)


# ------------------------------------------------------------------------------ DeepSpeed

def test_deepspeed_block_is_translated_as_is():
    for block in (DS_BLOCK,
                  dict(DS_BLOCK, schedule_type="fixed_root",
                       schedule_config={"total_curriculum_step": 300, "difficulty_step": 8,
                                        "root_degree": 2}),
                  dict(DS_BLOCK, schedule_type="fixed_discrete",
                       schedule_config={"difficulty": [8, 64, 1024], "max_step": [10, 20]})):
        ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
              "curriculum_learning": block}
        cfg = InfinityConfig.from_deepspeed(ds)
        assert cfg.to_dict()["curriculum_learning"] == block
        assert SeqlenSchedule.from_config(cfg).lengths(5) == \
            SeqlenSchedule.from_config(block).lengths(5)
    off = InfinityConfig.from_deepspeed({"curriculum_learning": {"enabled": False}})
    assert not off.curriculum_learning.enabled


def test_deepspeed_block_errors_name_the_deepspeed_key():
    ds = {"curriculum_learning": dict(DS_BLOCK, schedule_config={"total_curriculum_step": 10})}
    with pytest.raises(ConfigError, match=r"curriculum_learning\.schedule_config\.difficulty_step"
                                          r": required"):
        InfinityConfig.from_deepspeed(ds)
    ds = {"curriculum_learning": dict(DS_BLOCK, max_difficulty="auto")}
    with pytest.raises(ConfigError, match=r"curriculum_learning\.max_difficulty"):
        InfinityConfig.from_deepspeed(ds)
    ds = {"curriculum_learning": dict(DS_BLOCK, min_difficulty=-1)}
    with pytest.raises(ConfigError, match=r"translated from DeepSpeed key "
                                          r"curriculum_learning\.min_difficulty"):
        InfinityConfig.from_deepspeed(ds)
    # the newer data_efficiency pipeline is still refused
    with pytest.raises(ConfigError, match="data_efficiency: unknown or unsupported key"):
        InfinityConfig.from_deepspeed({"data_efficiency": {"enabled": True}})


# ------------------------------------------------------------------------------ --curriculum

def test_cli_spec():
    assert parse_cli_spec("seqlen:64:1000") == (64, 1000, "fixed_linear")
    assert parse_cli_spec("seqlen:64:1000:root") == (64, 1000, "fixed_root")
    assert parse_cli_spec("SEQLEN:8:10:discrete") == (8, 10, "fixed_discrete")
    for bad, match in (("vocab:8:10", "expected seqlen:START:STEPS"), ("seqlen:8", "expected"),
                       ("seqlen:a:10", "whole numbers"), ("seqlen:0:10", ">= 1"),
                       ("seqlen:8:10:cosine", "linear, root or discrete")):
        with pytest.raises(ValueError, match=match):
            parse_cli_spec(bad)


def test_cli_block():
    b = cli_block("seqlen:16:100", 256)
    assert b["max_difficulty"] == 256 and b["schedule_config"] == {
        "total_curriculum_step": 100, "difficulty_step": 8}
    assert cli_block("seqlen:12:100:root", 256)["schedule_config"] == {
        "total_curriculum_step": 100, "difficulty_step": 1, "root_degree": 2}
    d = cli_block("seqlen:32:300:discrete", 256)["schedule_config"]
    assert d == {"difficulty": [32, 64, 128, 256], "max_step": [75, 150, 225]}
    assert SeqlenSchedule.from_config(cli_block("seqlen:64:5:discrete", 64)).lengths(8) == [64] * 8
    with pytest.raises(ValueError, match="longer than the run's sequence length 128"):
        cli_block("seqlen:256:10", 128)
    with pytest.raises(ValueError, match="need STEPS >= 4"):
        cli_block("seqlen:32:3:discrete", 256)
    for spec in ("seqlen:16:100", "seqlen:12:100:root", "seqlen:32:300:discrete"):
        InfinityConfig.load({"curriculum_learning": cli_block(spec, 256)})
