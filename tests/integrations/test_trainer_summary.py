"""InfinityTrainer shows where the offload puts things at the start of training: a placement
summary (homes, bytes per tier, swap path) and the DeepSpeed keys accepted but ignored, on
the main process at the Trainer's default log level, silenced by log_level="error"."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from infinity.integrations.transformers import InfinityTrainer  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_verbosity():
    """A Trainer sets transformers' verbosity from log_level for the whole process, and
    "passive" (the default) keeps whatever is set: start each test where a fresh process
    starts (WARNING), and leave it as found."""
    from transformers.utils import logging as hf_logging
    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    yield
    hf_logging.set_verbosity(old)


def _ds(swap):
    return {"zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": str(swap)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
                                  "stage3_max_live_parameters": 1e9},
            "steps_per_print": 10, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto"}


def _train(tmp_path, **kw):
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "out", max_steps=1, **kw),
                         train_dataset=H.TokenData(), infinity_config=_ds(tmp_path / "swap"))
    try:
        tr.train()
    finally:
        tr.close()


def test_summary_at_the_default_log_level(tmp_path, capfd):
    _train(tmp_path)
    err = capfd.readouterr().err
    assert ("infinity placement: offload.params nvme (params on NVMe), offload.optimizer nvme "
            "(optimizer states on NVMe)") in err, err
    assert "host memory" in err and "NVMe" in err
    assert f"infinity swap: {tmp_path / 'swap'}" in err
    line = next(x for x in err.splitlines()
                if x.startswith("infinity: DeepSpeed keys accepted but ignored"))
    assert "steps_per_print" in line and "zero_optimization.stage3_max_live_parameters" in line
    assert err.count("infinity placement:") == 1


@pytest.mark.parametrize("level", ["error", "critical"])
def test_summary_silenced_by_log_level(tmp_path, capfd, level):
    _train(tmp_path, log_level=level)
    out = capfd.readouterr()
    printed = (out.err + out.out).splitlines()
    assert not [x for x in printed if x.startswith(("infinity placement:", "infinity swap:",
                                                    "infinity: DeepSpeed keys"))], printed


def test_save_model_files_share_one_mode(tmp_path):
    """save_model's weights (written 0600 then renamed), config, tokenizer and training
    args all get the mode save_pretrained gives: 0666 under the umask."""
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "out", max_steps=1),
                         train_dataset=H.TokenData(), infinity_config=_ds(tmp_path / "swap"))
    try:
        tr.train()
        tr.save_model(str(tmp_path / "saved"))
    finally:
        tr.close()
    old = os.umask(0)
    os.umask(old)
    files = [f for f in (tmp_path / "saved").iterdir() if f.is_file()]
    assert any(f.name.endswith(".safetensors") for f in files), files
    modes = {f.name: f.stat().st_mode & 0o777 for f in files}
    assert set(modes.values()) == {0o666 & ~old}, modes
