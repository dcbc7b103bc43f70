"""InfinityConfig: defaults, validation errors (key + fix in the message), files, round trip."""
import dataclasses
import json

import pytest

from infinity.config import (AioConfig, ConfigError, InfinityConfig, LossScaleConfig,
                             OffloadConfig, OptimizerConfig, PrefetchConfig, SchedulerConfig,
                             load_config)

DESIGN_DEFAULTS = {
    "precision": "fp32", "zero_stage": 3,
    "offload": {"params": "none", "optimizer": "none", "nvme_paths": ["./infinity-swap"],
                "host_memory_gb": None, "device_memory_gb": None, "commit_shadow_gb": None},
    "prefetch": {"depth": 2, "reuse_gb": None},     # reuse_gb: issue 22 (not yet in DESIGN.md)
    "aio": {"engine": "auto", "block_size": 1048576, "queue_depth": 32, "threads": 1},
    "optimizer": {"type": "adamw", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                  "weight_decay": 0.0, "no_decay": ["bias", "norm"], "state_dtype": "fp32"},
    "scheduler": {"type": "constant", "warmup_steps": 0, "total_steps": None, "min_lr": 0.0},
    "fp16": {"initial_scale": 65536.0, "growth_interval": 1000, "backoff_factor": 0.5,
             "growth_factor": 2.0, "min_scale": 1.0},
    "gradient_clipping": 0.0, "gradient_accumulation_steps": 1, "dist_timeout_s": 600, "intra_node_transport": "auto", "reduce_bucket_mb": 128.0, "nonfinite_grads": "skip",
    "activation_offload": {"home": "none", "scope": "checkpoints"},
    "gradient_accumulation_dtype": "fp32",
    "zero_pp": {"quantized_weights": False, "hpz_partition_size": 1, "quantized_gradients": False},
    "tiling": {"max_group_gb": None},
}


def test_defaults_match_design():
    assert InfinityConfig().to_dict() == DESIGN_DEFAULTS
    assert InfinityConfig.load(None).to_dict() == DESIGN_DEFAULTS
    assert InfinityConfig.load({}).to_dict() == DESIGN_DEFAULTS
    assert load_config(None) == InfinityConfig()
    c = InfinityConfig()
    assert c.host_memory_bytes is None and c.device_memory_bytes is None
    assert isinstance(c.optimizer.betas, tuple)


def test_default_lists_are_not_shared():
    a, b = InfinityConfig(), InfinityConfig()
    a.offload.nvme_paths.append("/x")
    a.optimizer.no_decay.append("emb")
    assert b.offload.nvme_paths == ["./infinity-swap"]
    assert b.optimizer.no_decay == ["bias", "norm"]


def test_normalisation():
    c = InfinityConfig.load({
        "precision": "BF16",
        "offload": {"params": "NVMe", "optimizer": "cpu", "nvme_paths": "/mnt/a",
                    "host_memory_gb": 2, "device_memory_gb": 0.5},
        "optimizer": {"lr": 1, "betas": (0.8, 0.9), "eps": 1, "weight_decay": 0},
        "scheduler": {"type": "cosine", "warmup_steps": 10.0, "total_steps": 100},
        "gradient_clipping": 1, "dist_timeout_s": 30,
    })
    assert c.precision == "bf16" and c.offload.params == "nvme"
    assert c.offload.nvme_paths == ["/mnt/a"]
    assert c.host_memory_bytes == 2 * 10**9 and c.device_memory_bytes == 5 * 10**8
    assert isinstance(c.optimizer.lr, float) and c.optimizer.lr == 1.0
    assert c.optimizer.betas == (0.8, 0.9)
    assert c.scheduler.warmup_steps == 10 and isinstance(c.scheduler.warmup_steps, int)
    assert isinstance(c.gradient_clipping, float)


def test_sections_can_be_dataclasses_or_dicts():
    c = InfinityConfig(offload={"optimizer": "nvme"}, aio=AioConfig(threads=2))
    assert isinstance(c.offload, OffloadConfig) and c.offload.optimizer == "nvme"
    assert c.aio.threads == 2
    c2 = InfinityConfig.from_dict({"aio": AioConfig(queue_depth=4)})
    assert c2.aio.queue_depth == 4


# (config, substrings the message must contain: the dotted key, the bad value, the fix)
BAD = [
    ({"offload": {"params": "ssd"}},
     ['offload.params: expected one of "none", "cpu", "nvme", got "ssd"']),
    ({"offload": {"optimizer": "gpu"}}, ["offload.optimizer", '"gpu"', '"nvme"']),
    ({"ofload": {}}, ["ofload", "did you mean offload"]),
    ({"offload": {"parms": "cpu"}}, ["offload.parms", "did you mean offload.params"]),
    ({"aio": {"queue_dept": 8}}, ["aio.queue_dept", "aio.queue_depth"]),
    ({"zeroes": 1}, ["zeroes", "unknown key"]),
    ({"precision": "bf"}, ["precision", '"bf"', 'did you mean "bf16"']),
    ({"precision": 16}, ["precision", "16"]),
    ({"zero_stage": 0}, ["zero_stage", "1, 2, 3", "got 0"]),
    ({"zero_stage": 4}, ["zero_stage", "got 4"]),
    ({"zero_stage": True}, ["zero_stage", "True"]),
    ({"zero_stage": "3"}, ["zero_stage", "expected an integer", '"3"']),
    ({"zero_stage": 2, "offload": {"params": "cpu"}},
     ["offload.params", "zero_stage 3", "got zero_stage 2", "set zero_stage to 3"]),
    ({"zero_stage": 1, "offload": {"params": "nvme"}}, ["offload.params", "zero_stage 3"]),
    ({"offload": {"nvme_paths": []}}, ["offload.nvme_paths", "at least one"]),
    ({"offload": {"nvme_paths": ["/a", ""]}}, ["offload.nvme_paths[1]", "non-empty string"]),
    ({"offload": {"nvme_paths": 5}}, ["offload.nvme_paths", "list of strings"]),
    ({"offload": {"host_memory_gb": 0}}, ["offload.host_memory_gb", "> 0", "null"]),
    ({"offload": {"device_memory_gb": -1}}, ["offload.device_memory_gb", "-1"]),
    ({"offload": {"host_memory_gb": "8"}}, ["offload.host_memory_gb", "expected a number"]),
    ({"offload": "nvme"}, ["offload", "expected a mapping"]),
    ({"prefetch": {"depth": -1}}, ["prefetch.depth", ">= 0", "-1"]),
    ({"prefetch": {"depth": 1.5}}, ["prefetch.depth", "integer", "1.5"]),
    ({"prefetch": {"reuse_gb": -1}}, ["prefetch.reuse_gb", ">= 0", "-1"]),
    ({"aio": {"engine": "libaio"}}, ["aio.engine", '"auto", "uring", "posix"', '"libaio"']),
    ({"aio": {"block_size": 5000}}, ["aio.block_size", "power of two", "5000", "4096 or 8192"]),
    ({"aio": {"block_size": 2048}}, ["aio.block_size", ">= 4096", "2048"]),
    ({"aio": {"queue_depth": 0}}, ["aio.queue_depth", "[1, 1024]", "got 0"]),
    ({"aio": {"queue_depth": 1025}}, ["aio.queue_depth", "1025"]),
    ({"aio": {"threads": 0}}, ["aio.threads", ">= 1"]),
    ({"aio": {"threads": 100000}}, ["aio.threads", "<= ", "4 per CPU", "100000"]),
    ({"aio": {"block_size": 1 << 31}}, ["aio.block_size", "<= 1073741824", str(1 << 31)]),
    ({"gradient_accumulation_steps": (1 << 20) + 1}, ["gradient_accumulation_steps", "<= 1048576"]),
    ({"nonfinite_grads": "ignore"}, ["nonfinite_grads", '"skip"', '"raise"', '"ignore"']),
    ({"optimizer": {"type": "sgd"}}, ["optimizer.type", '"adamw"', '"sgd"']),
    ({"optimizer": {"lr": -1e-3}}, ["optimizer.lr", ">= 0"]),
    ({"optimizer": {"lr": "1e-3"}}, ["optimizer.lr", "expected a number", "without quotes"]),
    ({"optimizer": {"lr": float("nan")}}, ["optimizer.lr", "nan"]),
    ({"optimizer": {"betas": [0.9]}}, ["optimizer.betas", "two numbers", "[0.9, 0.999]"]),
    ({"optimizer": {"betas": [0.9, 1.0]}}, ["optimizer.betas[1]", "< 1", "1.0"]),
    ({"optimizer": {"betas": [-0.1, 0.9]}}, ["optimizer.betas[0]", ">= 0"]),
    ({"optimizer": {"betas": "0.9,0.99"}}, ["optimizer.betas"]),
    ({"optimizer": {"eps": 0}}, ["optimizer.eps", "> 0"]),
    ({"optimizer": {"weight_decay": -0.1}}, ["optimizer.weight_decay", ">= 0"]),
    ({"optimizer": {"no_decay": "bias"}}, ["optimizer.no_decay", "list of strings"]),
    ({"optimizer": {"momentum": 0.9}}, ["optimizer.momentum", "unknown key"]),
    ({"optimizer": {"state_dtype": "fp16"}}, ["optimizer.state_dtype", '"fp32", "bf16"', '"fp16"']),
    ({"optimizer": {"state_dtype": 16}}, ["optimizer.state_dtype", "\"fp32\", \"bf16\"", "got 16"]),
    ({"scheduler": {"type": "step"}}, ["scheduler.type", '"constant", "linear", "cosine"']),
    ({"scheduler": {"type": "cosine"}}, ["scheduler.total_steps", "required", '"cosine"']),
    ({"scheduler": {"type": "linear", "warmup_steps": 100, "total_steps": 100}},
     ["scheduler.total_steps", "greater than scheduler.warmup_steps (100)", "got 100"]),
    ({"scheduler": {"warmup_steps": -5}}, ["scheduler.warmup_steps", ">= 0"]),
    ({"scheduler": {"total_steps": 0}}, ["scheduler.total_steps", ">= 1"]),
    ({"scheduler": {"min_lr": -1.0}}, ["scheduler.min_lr", ">= 0"]),
    ({"scheduler": {"min_lr": 0.1}}, ["scheduler.min_lr", "<= optimizer.lr"]),
    ({"scheduler": {"warmup": 10}}, ["scheduler.warmup", "did you mean scheduler.warmup_steps"]),
    ({"fp16": {"initial_scale": 0}}, ["fp16.initial_scale", "> 0"]),
    ({"fp16": {"growth_interval": 0}}, ["fp16.growth_interval", ">= 1"]),
    ({"fp16": {"backoff_factor": 1.0}}, ["fp16.backoff_factor", "< 1"]),
    ({"fp16": {"growth_factor": 1.0}}, ["fp16.growth_factor", "> 1"]),
    ({"fp16": {"min_scale": 1e6}}, ["fp16.min_scale", "<= fp16.initial_scale"]),
    ({"fp16": {"loss_scale_window": 100}}, ["fp16.loss_scale_window", "unknown key"]),
    ({"gradient_clipping": -1}, ["gradient_clipping", ">= 0", "0 turns clipping off"]),
    ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps", ">= 1"]),
    ({"gradient_accumulation_steps": 2.5}, ["gradient_accumulation_steps", "2.5"]),
    ({"dist_timeout_s": 0}, ["dist_timeout_s", "> 0"]),
]


@pytest.mark.parametrize("cfg,parts", BAD, ids=[json.dumps(b[0], default=str)[:60] for b in BAD])
def test_validation_errors_name_key_value_and_fix(cfg, parts):
    with pytest.raises(ConfigError) as ei:
        InfinityConfig.load(cfg)
    msg = str(ei.value)
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"
    assert isinstance(ei.value, ValueError)


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="aio.threads"):
        AioConfig(threads=0)
    with pytest.raises(ConfigError, match="prefetch.depth"):
        PrefetchConfig(depth=-2)
    with pytest.raises(ConfigError, match="scheduler.total_steps"):
        SchedulerConfig(type="linear")
    with pytest.raises(ConfigError, match="fp16.growth_factor"):
        LossScaleConfig(growth_factor=0.5)
    with pytest.raises(ConfigError, match="optimizer.betas"):
        OptimizerConfig(betas=(0.9, 0.999, 0.1))
    c = InfinityConfig()
    c.aio.queue_depth = 0
    with pytest.raises(ConfigError, match="aio.queue_depth"):
        c.validate()


def test_top_level_must_be_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        InfinityConfig.from_dict([("precision", "fp32")])
    with pytest.raises(ConfigError, match="expected a dict, a path"):
        InfinityConfig.load(42)


FULL = {
    "precision": "bf16", "zero_stage": 3,
    "offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": ["/mnt/nvme0", "/mnt/nvme1"],
                "host_memory_gb": 16.5, "device_memory_gb": 20, "commit_shadow_gb": 2.5},
    "prefetch": {"depth": 3, "reuse_gb": 0.5},
    "aio": {"engine": "uring", "block_size": 262144, "queue_depth": 64, "threads": 2},
    "optimizer": {"type": "adam", "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                  "weight_decay": 0.1, "no_decay": ["bias", "norm", "ln_"],
                  "state_dtype": "bf16"},
    "scheduler": {"type": "cosine", "warmup_steps": 100, "total_steps": 10000, "min_lr": 3e-5},
    "fp16": {"initial_scale": 1024.0, "growth_interval": 500, "backoff_factor": 0.25,
             "growth_factor": 4.0, "min_scale": 0.5},
    "gradient_clipping": 1.0, "gradient_accumulation_steps": 4, "dist_timeout_s": 120.0,
    "intra_node_transport": "process_group", "reduce_bucket_mb": 64.0, "nonfinite_grads": "skip",
    "activation_offload": {"home": "nvme", "scope": "all"},
    "gradient_accumulation_dtype": "bf16",
    "zero_pp": {"quantized_weights": True, "hpz_partition_size": 4, "quantized_gradients": True},
    "tiling": {"max_group_gb": 0.5},
}


def test_round_trip_and_json_able():
    c = InfinityConfig.load(FULL)
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d == FULL
    assert InfinityConfig.from_dict(d) == c
    assert InfinityConfig.from_dict(InfinityConfig().to_dict()) == InfinityConfig()


def test_load_copies_instances():
    c = InfinityConfig.load(FULL)
    c2 = InfinityConfig.load(c)
    assert c2 == c and c2 is not c and c2.offload is not c.offload
    c2.offload.nvme_paths.append("/x")
    assert c.offload.nvme_paths == ["/mnt/nvme0", "/mnt/nvme1"]


def test_json_file(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(FULL))
    assert InfinityConfig.load(str(p)) == InfinityConfig.load(FULL)
    assert InfinityConfig.load(p) == InfinityConfig.load(FULL)  # PathLike


YAML_TEXT = """\
precision: bf16
offload:
  params: nvme
  optimizer: nvme
  nvme_paths: [/mnt/nvme0, /mnt/nvme1]
  host_memory_gb: 16.5
  device_memory_gb: 20
  commit_shadow_gb: 2.5
prefetch: {depth: 3, reuse_gb: 0.5}
aio: {engine: uring, block_size: 262144, queue_depth: 64, threads: 2}
optimizer:
  type: adam
  lr: 3e-4          # YAML 1.1 reads this as a string; infinity reads it as a float
  betas: [0.9, 0.95]
  eps: 1.0e-6
  weight_decay: 0.1
  no_decay: [bias, norm, ln_]
  state_dtype: bf16
scheduler: {type: cosine, warmup_steps: 100, total_steps: 10000, min_lr: 3e-5}
fp16: {initial_scale: 1024, growth_interval: 500, backoff_factor: 0.25, growth_factor: 4, min_scale: 0.5}
gradient_clipping: 1.0
gradient_accumulation_steps: 4
dist_timeout_s: 120
intra_node_transport: process_group
reduce_bucket_mb: 64
activation_offload: {home: nvme, scope: all}
gradient_accumulation_dtype: bf16
zero_pp: {quantized_weights: true, hpz_partition_size: 4, quantized_gradients: true}
tiling: {max_group_gb: 0.5}
"""


@pytest.mark.parametrize("ext", [".yaml", ".yml"])
def test_yaml_file(tmp_path, ext):
    p = tmp_path / f"cfg{ext}"
    p.write_text(YAML_TEXT)
    assert InfinityConfig.load(str(p)) == InfinityConfig.load(FULL)


def test_yaml_is_safe(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("precision: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        InfinityConfig.load(str(p))


def test_empty_yaml_is_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing\n")
    assert InfinityConfig.load(str(p)) == InfinityConfig()


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        InfinityConfig.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{precision: fp32}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        InfinityConfig.load(str(bad))
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        InfinityConfig.load(str(lst))
    toml = tmp_path / "cfg.toml"
    toml.write_text("")
    with pytest.raises(ConfigError, match="unsupported extension"):
        InfinityConfig.load(str(toml))
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"aio": {"thread": 2}}))
    with pytest.raises(ConfigError, match="aio.thread: unknown key; did you mean aio.threads"):
        InfinityConfig.load(str(typo))


def test_every_field_has_a_default():
    # "every key optional": constructing with no arguments works for every section
    for cls in (OffloadConfig, PrefetchConfig, AioConfig, OptimizerConfig, SchedulerConfig,
                LossScaleConfig, InfinityConfig):
        for f in dataclasses.fields(cls):
            assert (f.default is not dataclasses.MISSING
                    or f.default_factory is not dataclasses.MISSING), (cls, f.name)


def test_yaml_exponent_ints_and_bytes(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("scheduler: {warmup_steps: 1e3}\noffload: {host_memory_gb: 0.1}\n")
    c = InfinityConfig.load(str(p))
    assert c.scheduler.warmup_steps == 1000 and isinstance(c.scheduler.warmup_steps, int)
    assert c.host_memory_bytes == 100_000_000


def test_nonfinite_grads_default_and_values():
    assert InfinityConfig().nonfinite_grads == "skip"
    assert InfinityConfig.from_dict({"nonfinite_grads": "RAISE"}).nonfinite_grads == "raise"
    from infinity.config import max_aio_threads
    hi = max_aio_threads()
    assert InfinityConfig.from_dict({"aio": {"threads": hi}}).aio.threads == hi
    assert InfinityConfig.from_dict({"gradient_accumulation_steps": 1 << 20}).gradient_accumulation_steps == 1 << 20


@pytest.mark.parametrize("key,bad,example", [
    ("prefetch.depth", "2", "such as 2"),          # not "such as 0", which turns prefetch off
    ("aio.queue_depth", "deep", "such as 32"),
    ("aio.block_size", "1M", "such as 1048576"),
])
def test_int_hint_suggests_a_sensible_value(key, bad, example):
    from infinity.config import ConfigError, InfinityConfig
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"{key}: expected an integer.*{example}$"):
        InfinityConfig.load({section: {name: bad}})
