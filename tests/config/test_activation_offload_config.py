"""activation_offload / gradient_accumulation_dtype: defaults, validation, DeepSpeed keys."""
import pytest

from infinity.config import ConfigError, InfinityConfig


def test_defaults_and_round_trip():
    c = InfinityConfig.load(None)
    assert (c.activation_offload.home, c.activation_offload.scope) == ("none", "checkpoints")
    assert c.gradient_accumulation_dtype == "fp32"
    d = {"activation_offload": {"home": "NVMe", "scope": "all"},
         "gradient_accumulation_dtype": "bf16"}
    c = InfinityConfig.load(d)
    assert (c.activation_offload.home, c.activation_offload.scope) == ("nvme", "all")
    assert InfinityConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("d,parts", [
    ({"activation_offload": {"home": "gpu"}}, ["activation_offload.home", '"cpu"']),
    ({"activation_offload": {"scope": "checkpoint"}},
     ["activation_offload.scope", 'did you mean "checkpoints"']),
    ({"activation_offload": {"where": "cpu"}}, ["activation_offload.where", "unknown"]),
    ({"activation_offload": "cpu"}, ["activation_offload", "mapping"]),
    ({"gradient_accumulation_dtype": "fp16"}, ["gradient_accumulation_dtype", '"bf16"']),
])
def test_bad_values_name_the_key(d, parts):
    with pytest.raises(ConfigError) as e:
        InfinityConfig.load(d)
    for p in parts:
        assert p in str(e.value)


def test_deepspeed_cpu_checkpointing_and_grad_accum_dtype():
    c = InfinityConfig.from_deepspeed({
        "activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4,
                                     "contiguous_memory_optimization": False},
        "data_types": {"grad_accum_dtype": "bf16"}})
    assert (c.activation_offload.home, c.activation_offload.scope) == ("cpu", "checkpoints")
    assert c.gradient_accumulation_dtype == "bf16"
    c = InfinityConfig.from_deepspeed({"activation_checkpointing": {"cpu_checkpointing": False}})
    assert c.activation_offload.home == "none"
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpoint"):
        InfinityConfig.from_deepspeed({"activation_checkpointing": {"cpu_checkpoint": True}})
