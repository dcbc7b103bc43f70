"""``zero_pp`` (ZeRO++): defaults, validation with the stage, the DeepSpeed translation."""
import pytest

from infinity.config import ConfigError, InfinityConfig


def test_defaults_off_and_round_trip():
    c = InfinityConfig.load({})
    assert (c.zero_pp.quantized_weights, c.zero_pp.hpz_partition_size,
            c.zero_pp.quantized_gradients) == (False, 1, False)
    assert not c.zero_pp.enabled
    d = {"zero_pp": {"quantized_weights": True, "hpz_partition_size": 8,
                     "quantized_gradients": True}}
    c = InfinityConfig.load(d)
    assert c.zero_pp.enabled and c.to_dict()["zero_pp"] == d["zero_pp"]
    assert InfinityConfig.load(c.to_dict()).zero_pp == c.zero_pp


@pytest.mark.parametrize("zpp,stage,match", [
    ({"quantized_weights": True}, 2, r"zero_pp.quantized_weights: .*zero_stage 3.*got zero_stage 2"),
    ({"hpz_partition_size": 2}, 1, r"zero_pp.hpz_partition_size: .*zero_stage 3"),
    ({"quantized_gradients": True}, 1, r"zero_pp.quantized_gradients: .*zero_stage to 2 or 3"),
    ({"quantized_weights": 1}, 3, r"zero_pp.quantized_weights: expected true or false"),
    ({"hpz_partition_size": 0}, 3, r"zero_pp.hpz_partition_size: expected an integer >= 1"),
    ({"hpz_partition_size": 2.5}, 3, r"zero_pp.hpz_partition_size: expected an integer"),
    ({"quantised_weights": True}, 3, r"zero_pp.quantised_weights"),
])
def test_validation(zpp, stage, match):
    with pytest.raises(ConfigError, match=match):
        InfinityConfig.load({"zero_stage": stage, "zero_pp": zpp})


def test_qgz_allowed_at_stage_2():
    c = InfinityConfig.load({"zero_stage": 2, "zero_pp": {"quantized_gradients": True}})
    assert c.zero_pp.quantized_gradients


def test_deepspeed_keys_translate():
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                "zero_hpz_partition_size": 8,
                                "zero_quantized_gradients": True}}
    c = InfinityConfig.from_deepspeed(ds)
    assert (c.zero_pp.quantized_weights, c.zero_pp.hpz_partition_size,
            c.zero_pp.quantized_gradients) == (True, 8, True)
    ds["zero_optimization"]["stage"] = 2
    with pytest.raises(ConfigError, match=r"zero_pp.quantized_weights.*\[translated from "
                                          r"DeepSpeed key zero_optimization.zero_quantized_weights\]"):
        InfinityConfig.from_deepspeed(ds)
    neutral = {"zero_optimization": {"stage": 3, "zero_quantized_weights": False,
                                     "zero_hpz_partition_size": 1}}
    assert not InfinityConfig.from_deepspeed(neutral).zero_pp.enabled
