"""Free space is checked up front on the ``infinity.Init`` path: ``finetune --nvme-path`` on
a 16 MB tmpfs fails before writing anything, naming the whole plan's total and the path
(not the last swap-file increment mid-construction). Needs root (tmpfs mounts)."""
import io
import os
import subprocess

import pytest
import torch
from torch import nn

pytest.importorskip("infinity.engine", reason="the offload engine is not in this build yet")


@pytest.fixture
def tmpfs16(mount_tmpfs):
    return mount_tmpfs("16m")


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def test_finetune_checks_the_whole_plan_before_writing(tmpfs16):
    from infinity.finetune.model import load_model_config, plan_nvme_need, shipped_model_config
    from infinity.finetune.run import FinetuneError, FinetuneOptions, finetune
    from infinity.finetune.settings import FINETUNE_DEFAULTS
    from infinity.io.doctor import format_bytes

    swap = str(tmpfs16 / "swap")
    parts = plan_nvme_need(load_model_config(shipped_model_config("tiny-llama")), FINETUNE_DEFAULTS)
    assert set(parts) == {"Init copy of the parameters", "engine param home",
                          "engine optimizer states", "engine commit shadows (all-or-nothing updates)",
                          "swap files' whole stripes and lock files"}
    total = sum(parts.values())
    assert total > 60e6                  # the default model needs far more than 16 MB
    opts = FinetuneOptions(nvme_paths=[swap], steps=1, use_bench_io=False)
    with pytest.raises(FinetuneError) as ei:
        finetune(opts, reporter_streams={"stdout": io.StringIO(), "stderr": io.StringIO()})
    msg = str(ei.value)
    assert "\n" not in msg
    assert f"needs {format_bytes(total)} of NVMe swap" in msg, msg
    assert swap in msg and "free" in msg and "short)" in msg
    assert "cannot grow the swap file" not in msg
    assert _files(tmpfs16) == []         # nothing was written, nothing left behind


def test_init_checks_nvme_need_on_enter(tmpfs16):
    import infinity
    from infinity.zero.init import nvme_need

    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmpfs16)]}}

    def build():
        return nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])   # 2.1 M params, 8.4 MB fp32

    with torch.device("meta"):
        need = nvme_need(build(), cfg)
    # Init copy 4 B + param home 4 B + Adam m, v 8 B per parameter (page-rounded)
    assert sum(need.values()) >= 16 * 8 * (512 * 512 + 512)
    # Init copy 8.4 MB + param home 8.4 MB + Adam m, v 16.8 MB + commit shadows of
    # m, v and the fp32 master 25.2 MB + both swap files in whole 1 MiB stripes, lock files
    with pytest.raises(OSError, match=r"needs 60\.\d MB of NVMe swap .* has only 16\.\d MB free"):
        with infinity.Init(cfg, nvme_need=need):
            build()
    assert _files(tmpfs16) == []
    # a plan that fits passes the check and builds
    small = {"offload": {"params": "nvme", "optimizer": "cpu", "nvme_paths": [str(tmpfs16)]}}
    with torch.device("meta"):
        need = nvme_need(nn.Linear(64, 64), small)
    with infinity.Init(small, nvme_need=need):
        m = nn.Linear(64, 64)
    with infinity.initialize(m, small) as e:
        e(torch.ones(1, 64))
    assert _files(tmpfs16) == []


def test_init_without_nvme_need_says_what_ran_out(tmpfs16):
    """Without nvme_need the total is unknown up front; running out mid-construction says how
    much was written, that more is needed, and how to check first (not a bare increment)."""
    import infinity

    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmpfs16)]}}
    with pytest.raises(OSError) as ei:
        with infinity.Init(cfg):
            nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])   # 25 MB > 16 MB
    msg = str(ei.value)
    assert ei.value.errno == 28
    assert "infinity.Init: the NVMe swap in" in msg and "is full after 1" in msg
    assert "nvme_need=nvme_need(model_on_meta, config)) with nvme_need from infinity.zero.init" \
        in msg
    assert _files(tmpfs16) == []


def test_the_checked_total_is_enough_and_exact(mount_tmpfs, tiny_config):
    """The total the check names is what the run really takes: a file system with exactly that
    much free trains (the Init copy takes no more than counted, e.g. no grow-ahead, and the
    engine's swap file and lock files are counted), and one page less is refused up front."""
    from infinity.finetune.model import load_model_config, plan_nvme_need
    from infinity.finetune.run import FinetuneError, FinetuneOptions, finetune
    from infinity.finetune.settings import FINETUNE_DEFAULTS

    model = tiny_config("llama", hidden_size=256, intermediate_size=512)   # ~6 MB of fp32
    need = sum(plan_nvme_need(load_model_config(model), FINETUNE_DEFAULTS).values())
    assert need % 4096 == 0
    for size, fits in ((need, True), (need - 4096, False)):
        mnt = mount_tmpfs(str(size))
        opts = FinetuneOptions(model=model, nvme_paths=[str(mnt / "swap")], steps=1,
                               batch_tokens=64, seq_len=32, use_bench_io=False)
        streams = {"stdout": io.StringIO(), "stderr": io.StringIO()}
        if fits:
            assert finetune(opts, reporter_streams=streams)["result"].last_step == 1
        else:
            with pytest.raises(FinetuneError, match="4.1 kB short"):
                finetune(opts, reporter_streams=streams)
        assert _files(mnt) == []
