"""Disk full during a save: a clear error naming the file, nothing half-written left,
the previous checkpoint still verifies and loads (needs root to mount a small tmpfs)."""
import os
import subprocess

import pytest
import torch

from infinity.checkpoint import CheckpointError, CheckpointReader, load_checkpoint, save_checkpoint


@pytest.fixture
def small_fs(mount_tmpfs):
    return mount_tmpfs("3m")


def test_disk_full_keeps_previous_checkpoint(small_fs, dict_state):
    small = {"w": torch.randn(50_000)}                      # 200 KB
    save_checkpoint(dict_state(small, {"step": 1}), small_fs / "ck")
    big = {"w": torch.randn(50_000), "x": torch.randn(1_000_000)}   # 4.2 MB > 3 MB fs
    with pytest.raises(CheckpointError) as ei:
        save_checkpoint(dict_state(big, {"step": 2}), small_fs / "ck")
    msg = str(ei.value)
    assert "No space left on device" in msg and "rank0-" in msg and "free disk space" in msg
    assert sorted(os.listdir(small_fs / "ck")) == ["latest", "step-1"]  # temp dir removed
    with CheckpointReader(small_fs / "ck") as r:
        r.verify()
        assert r.meta["step"] == 1
    dst = dict_state({"w": torch.empty(50_000)})
    load_checkpoint(dst, small_fs / "ck")
    assert torch.equal(dst.loaded["w"], small["w"])
