"""engine.load_checkpoint refuses a (re-sealed) checkpoint whose states or meta make no
sense (issue 36): non-finite masters and Adam moments, a negative exp_avg_sq (corrupt, or
m and v swapped), moments whose shape or dtype is not their parameter's / the meta's, and
meta inconsistent with the tensors or the engine -- each with a CheckpointError naming the
file or key and what is wrong, the engine unchanged."""
import os
import shutil

import pytest
import torch

pytest.importorskip("infinity.engine")

from infinity.checkpoint import CheckpointError, CheckpointReader  # noqa: E402
from infinity.engine import initialize  # noqa: E402
from infinity.engine.checkpoint_state import EngineCheckpoint  # noqa: E402


def _rc():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_child.py")
    spec = importlib.util.spec_from_file_location("_infinity_ckpt_resume_child_checks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rc = _rc()
W = "0.weight"                       # Linear(16, 33): [33, 16]


def _cfg(swap, **kw):
    c = rc.config("cpu", str(swap))
    c.update(kw)
    return c


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint (2 updates, CPU offload), copied for each test."""
    root = tmp_path_factory.mktemp("engine-ckpt")
    with initialize(rc.model(0), _cfg(root / "swap")) as e:
        rc.train(e, 2, 0)
        e.save_checkpoint(root / "ck")
    return root / "ck"


@pytest.fixture
def ck(saved, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(saved, dst)
    return dst, dst / "step-2"


def _state(engine):
    return {n: t.clone() for n, t in EngineCheckpoint(engine).checkpoint_tensors()}


def _refused(root, tmp_path, match, **cfg):
    """Load into a trained engine: CheckpointError matching ``match``, engine unchanged."""
    with initialize(rc.model(7), _cfg(tmp_path / "swap2", **cfg)) as e:
        rc.train(e, 1, 0)
        before, rng = _state(e), torch.get_rng_state()
        with pytest.raises(CheckpointError, match=match) as ei:
            e.load_checkpoint(root)
        assert e.global_steps == 1 and torch.equal(torch.get_rng_state(), rng)
        after = _state(e)
        assert all(torch.equal(before[n], after[n]) for n in before)
        rc.train(e, 1, 1)                          # still usable
    return str(ei.value)


def _file_of(d, name):
    with CheckpointReader(d.parent, d.name) as r:
        return r.manifest["tensors"][name]["pieces"][0]["file"]


@pytest.mark.parametrize("name,value", [
    (W, float("nan")), (W, float("-inf")),
    (f"optim.{W}.exp_avg", float("inf")), (f"optim.{W}.exp_avg", float("nan")),
    (f"optim.{W}.exp_avg_sq", float("nan")), (f"optim.{W}.exp_avg_sq", float("inf")),
    ("optim.3.bias.exp_avg", float("nan")),
])
def test_non_finite_states_are_refused(ck, tmp_path, reseal, name, value):
    root, d = ck

    def poison(t):
        t.reshape(-1)[37 % t.numel()] = value
        return t
    reseal.tensor(d, name, poison)
    msg = _refused(root, tmp_path, "a non-finite value")
    assert f"tensor {name!r}" in msg and _file_of(d, name) in msg
    assert f"at flat element {37 % (4 if name.startswith('optim.3') else 528)}" in msg
    assert "the next update would write NaN weights" in msg or "writes NaN weights" in msg


def test_negative_second_moment_is_refused(ck, tmp_path, reseal):
    root, d = ck
    reseal.tensor(d, f"optim.{W}.exp_avg_sq",
                  lambda t: t.reshape(-1).index_fill_(0, torch.tensor([500]), -1e-12))
    msg = _refused(root, tmp_path, "a negative value")
    assert f"tensor 'optim.{W}.exp_avg_sq'" in msg and "at flat element 500" in msg


def test_swapped_moments_are_refused(ck, tmp_path, reseal):
    root, d = ck
    with CheckpointReader(root) as r:
        m, v = r.read(f"optim.{W}.exp_avg"), r.read(f"optim.{W}.exp_avg_sq")
    assert (m < 0).any() and (v >= 0).all()
    reseal.tensor(d, f"optim.{W}.exp_avg", v)
    reseal.tensor(d, f"optim.{W}.exp_avg_sq", m)
    msg = _refused(root, tmp_path, "a negative value")
    assert "exp_avg and exp_avg_sq were swapped" in msg


@pytest.mark.parametrize("key,value,why", [
    ("micro_step", 3, "outside the accumulation window of boundary 2 (micro-steps 2..2 at "
                      "gradient_accumulation_steps 1)"),
    ("micro_step", 1, "outside the accumulation window"),
    ("step", 3, "more applied updates than accumulation boundaries"),
    ("world_size", 2, "the manifest's shard files were written by 1 rank"),
    ("world_size", 0, "must be an integer >= 1"),
    ("optimizer_state_dtype", "int4", "'int4', not a dtype name this engine knows"),
    ("precision", "int4", "not a dtype name"),
    ("rng_ranks", [{}, {}], "holds 2 RNG states, but the checkpoint was written by 1 rank"),
    ("zero_stage", 4, "expected 1, 2, 3 or null"),
    ("config", {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps 0"),
    ("rng", {"numpy": ["MT19937", [1, 2], 0, 0, 0.0]}, "624 entries"),   # was IndexError
    ("rng", {"python": [3, [0] * 625, "x"]}, "cached gaussian"),
])
def test_inconsistent_meta_is_refused(ck, tmp_path, reseal, key, value, why):
    root, d = ck
    reseal.manifest(d, lambda m: m["meta"].update({key: value}))
    msg = _refused(root, tmp_path, rf"meta\['{key}'\]")
    assert why in msg and str(d) in msg, msg


def test_micro_step_window_follows_the_saved_accumulation(ck, tmp_path, reseal):
    root, d = ck

    def window(m):      # saved at accumulation 4: micro-step 9 is in boundary 2's window
        m["meta"]["config"]["gradient_accumulation_steps"] = 4
        m["meta"]["micro_step"] = 9
    reseal.manifest(d, window)
    with initialize(rc.model(7), _cfg(tmp_path / "swap2")) as e:
        e.load_checkpoint(root)                         # accepted; this engine: accumulation 1
        assert e.stats()["micro_step"] == 2 and e.global_steps == 2


def test_moment_shape_must_be_its_parameters(ck, tmp_path, reseal):
    root, d = ck
    reseal.manifest(d, lambda m: m["tensors"][f"optim.{W}.exp_avg"].update(shape=[16, 33]))
    msg = _refused(root, tmp_path, "has shape")
    assert f"tensor 'optim.{W}.exp_avg' has shape [16, 33] but its parameter '{W}' has " \
           f"[33, 16]" in msg


def test_moment_dtype_must_be_the_meta_ones(ck, tmp_path, reseal):
    root, d = ck
    reseal.manifest(d, lambda m: m["meta"].update(optimizer_state_dtype="bf16"))
    msg = _refused(root, tmp_path, "is F32, but meta")
    assert "optimizer_state_dtype" in msg and "'bf16' (BF16)" in msg


def test_moments_in_an_unreadable_dtype_are_refused(ck, tmp_path, reseal):
    root, d = ck

    def to_i32(m):      # same bytes, another dtype name (safetensors header left alone)
        m["tensors"][f"optim.{W}.exp_avg"]["dtype"] = "I32"
        del m["meta"]["optimizer_state_dtype"]
    reseal.manifest(d, to_i32)
    _refused(root, tmp_path, f"'optim.{W}.exp_avg' is I32; this engine reads Adam moments in "
                             f"F32 or BF16")


def test_the_engines_own_checkpoints_pass_every_check(ck, tmp_path):
    """Mid-window and at other accumulations: what the engine writes, it loads."""
    root, _ = ck
    with initialize(rc.model(1), _cfg(tmp_path / "s", gradient_accumulation_steps=3)) as e:
        for i in range(5):                              # boundary 1, 2 micro-steps into window 2
            x, y = rc.data(i)
            e.backward(torch.nn.functional.mse_loss(e(x), y))
            e.step()
        assert e.stats()["micro_step"] == 5
        e.save_checkpoint(tmp_path / "mid", tag="mid")
    with initialize(rc.model(2), _cfg(tmp_path / "s", gradient_accumulation_steps=3)) as e:
        e.load_checkpoint(tmp_path / "mid")
        assert e.stats()["micro_step"] == 5             # same accumulation: where it was
    with initialize(rc.model(2), _cfg(tmp_path / "s", gradient_accumulation_steps=2)) as e:
        e.load_checkpoint(tmp_path / "mid")
        assert e.stats()["micro_step"] == 2             # another one: its window restarts
        rc.train(e, 2, 0)
        assert e.global_steps == 2
