"""Checkpoints with compact Adam moments (``optimizer.state_dtype: "bf16"``): the moments
are saved in bf16 and the meta records the dtype; a round trip resumes bit for bit; a
checkpoint loads into an engine of the other state dtype, converted (fp32 -> bf16 rounds
to nearest even, bf16 -> fp32 is exact) with one INFO line."""
import logging
import os

import pytest
import torch

infinity = pytest.importorskip("infinity.engine")

from infinity.checkpoint import CheckpointReader  # noqa: E402
from infinity.engine.checkpoint_state import EngineCheckpoint  # noqa: E402


def _rc():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_child.py")
    spec = importlib.util.spec_from_file_location("_infinity_ckpt_resume_child_sd", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rc = _rc()


def _state(engine):
    return {n: t.clone() for n, t in EngineCheckpoint(engine).checkpoint_tensors()}


def _moments(state):
    return {n: t for n, t in state.items() if n.startswith("optim.")}


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_bf16_states_round_trip_bitwise(tmp_path, offload):
    from infinity.engine import initialize
    swap = str(tmp_path / "swap")
    cfg = rc.config(offload, swap, state_dtype="bf16")
    with initialize(rc.model(0), cfg) as e1:
        straight = rc.train(e1, 6, 0)
        ref = _state(e1)
    with initialize(rc.model(0), cfg) as e2:
        assert rc.train(e2, 3, 0) == straight[:3]
        e2.save_checkpoint(tmp_path / "ck")
    with CheckpointReader(tmp_path / "ck") as r:
        assert r.meta["optimizer_state_dtype"] == "bf16"
        names = [n for n in r.manifest["tensors"] if n.startswith("optim.")]
        assert len(names) == 2 * 6 and all(r.info(n)[1] == torch.bfloat16 for n in names)
        assert all(r.info(n)[1] == torch.float32 for n in r.manifest["tensors"]
                   if not n.startswith("optim."))        # masters stay fp32
    with initialize(rc.model(123), cfg) as e3:
        e3.load_checkpoint(tmp_path / "ck")
        assert rc.train(e3, 3, 3) == straight[3:]
        got = _state(e3)
    assert set(got) == set(ref)
    for n in ref:
        assert got[n].dtype == ref[n].dtype and torch.equal(got[n], ref[n]), n


@pytest.mark.parametrize("saved,loaded", [("fp32", "bf16"), ("bf16", "fp32")])
def test_load_into_the_other_state_dtype(tmp_path, caplog, saved, loaded):
    from infinity.engine import initialize
    swap = str(tmp_path / "swap")
    with initialize(rc.model(0), rc.config("nvme", swap, state_dtype=saved)) as e1:
        rc.train(e1, 3, 0)
        e1.save_checkpoint(tmp_path / "ck")
        src = _state(e1)
        after_src = rc.train(e1, 3, 3)
    with CheckpointReader(tmp_path / "ck") as r:
        assert r.meta["optimizer_state_dtype"] == saved
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[loaded]
    caplog.set_level(logging.INFO, logger="infinity.checkpoint")
    with initialize(rc.model(7), rc.config("nvme", swap, state_dtype=loaded)) as e2:
        e2.load_checkpoint(tmp_path / "ck")
        lines = [rec.getMessage() for rec in caplog.records if "Adam moments saved in" in rec.getMessage()]
        assert len(lines) == 1 and f"saved in {saved}, converted to {loaded}" in lines[0], lines
        got = _state(e2)
        after = rc.train(e2, 3, 3)
    for n, t in src.items():
        if n.startswith("optim."):
            assert got[n].dtype == want
            # fp32 -> bf16: each moment rounded to nearest even; bf16 -> fp32: exact
            assert torch.equal(got[n], t.to(want)), n
        else:
            assert torch.equal(got[n], t), n        # fp32 masters untouched
    assert any(bool((got[n].float() != 0).any()) for n in _moments(got))
    # training goes on from the converted moments: the first loss after the load is the
    # same (the weights are), later ones stay close to the source dtype's
    assert after[0] == after_src[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(after, after_src)) < 1e-2


def test_same_dtype_load_logs_no_conversion(tmp_path, caplog):
    from infinity.engine import initialize
    swap = str(tmp_path / "swap")
    cfg = rc.config("cpu", swap, state_dtype="bf16")
    with initialize(rc.model(0), cfg) as e1:
        rc.train(e1, 2, 0)
        e1.save_checkpoint(tmp_path / "ck")
    caplog.set_level(logging.INFO, logger="infinity.checkpoint")
    with initialize(rc.model(1), cfg) as e2:
        e2.load_checkpoint(tmp_path / "ck")
    assert not [r for r in caplog.records if "converted to" in r.getMessage()]
