"""Malformed config input ends in ConfigError naming the key, the value and the allowed
range (issue 36): counts and sizes bounded, NUL bytes and duplicate directories in
``offload.nvme_paths`` refused, a NUL byte in a config file's path."""
import json
import os

import pytest

from infinity.config import (MAX_DIST_TIMEOUT_S, MAX_GB, MAX_HPZ_PARTITION, MAX_PREFETCH_DEPTH,
                             MAX_STEPS, ConfigError, InfinityConfig, max_aio_threads)

# (config, the key, the allowed range as the message states it); each value is one past it
OUT_OF_RANGE = [
    ({"prefetch": {"depth": 1e9}}, "prefetch.depth", f"<= {MAX_PREFETCH_DEPTH}"),
    ({"prefetch": {"depth": MAX_PREFETCH_DEPTH + 1}}, "prefetch.depth",
     f">= 0 and <= {MAX_PREFETCH_DEPTH}"),
    ({"prefetch": {"reuse_gb": 1e30}}, "prefetch.reuse_gb", f"<= {MAX_GB}"),
    ({"offload": {"host_memory_gb": 1e300}}, "offload.host_memory_gb", f"<= {MAX_GB}"),
    ({"offload": {"device_memory_gb": MAX_GB * 2}}, "offload.device_memory_gb", f"<= {MAX_GB}"),
    ({"tiling": {"max_group_gb": 1e12}}, "tiling.max_group_gb", f"<= {MAX_GB}"),
    ({"aio": {"queue_depth": 1025}}, "aio.queue_depth", "[1, 1024]"),
    ({"aio": {"queue_depth": 1e9}}, "aio.queue_depth", "[1, 1024]"),
    ({"aio": {"threads": 100000}}, "aio.threads", f"<= {max_aio_threads()}"),
    ({"aio": {"block_size": 1 << 31}}, "aio.block_size", f"<= {1 << 30}"),
    ({"gradient_accumulation_steps": 1e9}, "gradient_accumulation_steps", "<= 1048576"),
    ({"dist_timeout_s": 1e12}, "dist_timeout_s", f"> 0 and <= {MAX_DIST_TIMEOUT_S}"),
    ({"dist_timeout_s": float("inf")}, "dist_timeout_s", f"<= {MAX_DIST_TIMEOUT_S}"),
    ({"scheduler": {"warmup_steps": MAX_STEPS + 1}}, "scheduler.warmup_steps",
     f">= 0 and <= {MAX_STEPS}"),
    ({"scheduler": {"total_steps": 1e15}}, "scheduler.total_steps", f">= 1 and <= {MAX_STEPS}"),
    ({"fp16": {"growth_interval": MAX_STEPS + 1}}, "fp16.growth_interval",
     f">= 1 and <= {MAX_STEPS}"),
    ({"zero_pp": {"hpz_partition_size": MAX_HPZ_PARTITION + 1}}, "zero_pp.hpz_partition_size",
     f">= 1 and <= {MAX_HPZ_PARTITION}"),
]


@pytest.mark.parametrize("cfg,key,allowed", OUT_OF_RANGE,
                         ids=[json.dumps(c[0], default=str)[:60] for c in OUT_OF_RANGE])
def test_counts_and_sizes_are_bounded_and_the_error_gives_the_range(cfg, key, allowed):
    with pytest.raises(ConfigError) as ei:
        InfinityConfig.load(cfg)
    msg = str(ei.value)
    assert msg.startswith(key + ":"), msg
    assert allowed in msg and "got" in msg, msg


@pytest.mark.parametrize("cfg", [
    {"prefetch": {"depth": MAX_PREFETCH_DEPTH}}, {"prefetch": {"depth": 0}},
    {"dist_timeout_s": MAX_DIST_TIMEOUT_S}, {"dist_timeout_s": 0.5},
    {"scheduler": {"warmup_steps": MAX_STEPS}},
    {"scheduler": {"type": "cosine", "total_steps": MAX_STEPS}},
    {"fp16": {"growth_interval": MAX_STEPS}},
    {"zero_pp": {"hpz_partition_size": MAX_HPZ_PARTITION}},
    {"offload": {"host_memory_gb": MAX_GB, "device_memory_gb": 0.001}},
    {"prefetch": {"reuse_gb": MAX_GB}}, {"tiling": {"max_group_gb": MAX_GB}},
])
def test_the_bounds_themselves_are_accepted(cfg):
    InfinityConfig.load(cfg)


def test_nul_byte_in_nvme_path_is_a_config_error():
    with pytest.raises(ConfigError) as ei:
        InfinityConfig.load({"offload": {"nvme_paths": ["ok", "swap\x00dir"]}})
    msg = str(ei.value)
    assert msg.startswith("offload.nvme_paths[1]:") and "NUL byte" in msg
    assert "swap\\x00dir" in msg            # the path, printable
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("paths,dup", [
    (["a", "./a/"], 1),
    (["swap", "other", "swap//"], 2),
    (["x/../a", "a"], 1),
    (["ABS", "a"], 1),                 # the absolute path of "a" (cwd: tmp_path)
])
def test_duplicate_nvme_paths_are_refused(tmp_path, monkeypatch, paths, dup):
    monkeypatch.chdir(tmp_path)
    paths = [str(tmp_path / "a") if p == "ABS" else p for p in paths]
    with pytest.raises(ConfigError) as ei:
        InfinityConfig.load({"offload": {"nvme_paths": paths}})
    msg = str(ei.value)
    assert msg.startswith(f"offload.nvme_paths[{dup}]:"), msg
    assert "same directory as offload.nvme_paths[" in msg and "list each directory once" in msg


def test_distinct_nvme_paths_are_kept_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = InfinityConfig.load({"offload": {"nvme_paths": ["a", "./b/", "a/c"]}})
    assert cfg.offload.nvme_paths == ["a", "./b/", "a/c"]


def test_nul_byte_in_config_file_path(tmp_path):
    with pytest.raises(ConfigError, match="NUL byte"):
        InfinityConfig.load(os.path.join(str(tmp_path), "train\x00.yaml"))


def test_deeply_nested_config_file_is_a_config_error(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text('{"optimizer": {"betas": ' + "[" * 100000 + "]" * 100000 + "}}")
    with pytest.raises(ConfigError, match="deep.json"):
        InfinityConfig.load(str(p))


def test_initialize_refuses_a_nul_nvme_path_before_touching_the_disk(tmp_path, monkeypatch):
    import torch

    from infinity.engine import initialize
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="NUL byte"):
        initialize(torch.nn.Linear(2, 2), {"offload": {"params": "nvme", "optimizer": "nvme",
                                                       "nvme_paths": ["sw\x00ap"]}})
    assert os.listdir(tmp_path) == []
