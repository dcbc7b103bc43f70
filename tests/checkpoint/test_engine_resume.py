"""Resume equality through the engine: 6 steps straight == 3 steps, save, fresh engine
loads, 3 more steps (losses and parameters bitwise equal in fp32)."""
import os

import pytest
import torch
from torch import nn

infinity = pytest.importorskip("infinity.engine")

from infinity.checkpoint import CheckpointReader, export_model  # noqa: E402
from infinity.engine.checkpoint_state import (load_engine_checkpoint,  # noqa: E402
                                              save_engine_checkpoint)
from infinity.checkpoint.export import load_exported  # noqa: E402


def _load_resume_child():
    """The model, data, config and loop live in resume_child.py (also run as a child
    process by the new-process test); load it by path (tests use importlib mode)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_child.py")
    spec = importlib.util.spec_from_file_location("_infinity_ckpt_resume_child", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rc = _load_resume_child()
_model, _data, _cfg, _train = rc.model, rc.data, rc.config, rc.train


def _state(engine):
    """fp32 masters + Adam states as the engine holds them (params may be paged out, so
    model.parameters() is not a valid view between steps for offloaded homes)."""
    from infinity.engine.checkpoint_state import EngineCheckpoint
    return {n: t.clone() for n, t in EngineCheckpoint(engine).checkpoint_tensors()}


@pytest.mark.parametrize("offload,precision", [("none", "fp32"), ("cpu", "fp32"),
                                               ("nvme", "fp32"), ("nvme", "bf16")])
def test_resume_bitwise_equal(tmp_path, offload, precision):
    from infinity.engine import initialize
    swap = str(tmp_path / "swap")
    m1 = _model(0)
    with initialize(m1, _cfg(offload, swap, precision)) as e1:
        straight = _train(e1, 6, 0)
        ref = _state(e1)
        ref_lr = e1.lr

    m2 = _model(0)
    with initialize(m2, _cfg(offload, swap, precision)) as e2:
        first = _train(e2, 3, 0)
        save_engine_checkpoint(e2, tmp_path / "ck")
    assert first == straight[:3]

    m3 = _model(123)  # different init: everything must come from the checkpoint
    with initialize(m3, _cfg(offload, swap, precision)) as e3:
        meta = load_engine_checkpoint(e3, tmp_path / "ck")
        assert meta["step"] == 3 and e3.global_steps == 3
        second = _train(e3, 3, 3)
        got = _state(e3)
        assert e3.lr == ref_lr
    assert second == straight[3:]
    assert set(got) == set(ref) and len(ref) == 3 * 6
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    assert not os.listdir(swap) if os.path.isdir(swap) else True


def test_cross_offload_config_and_export(tmp_path):
    """Saved with NVMe offload, loaded with CPU offload; export has model names only."""
    from infinity.engine import initialize
    swap = str(tmp_path / "swap")
    m1 = _model(0)
    with initialize(m1, _cfg("nvme", swap)) as e1:
        _train(e1, 2, 0)
        save_engine_checkpoint(e1, tmp_path / "ck")
        after = _train(e1, 2, 2)
        ref = _state(e1)
    m2 = _model(5)
    with initialize(m2, _cfg("cpu", swap)) as e2:
        load_engine_checkpoint(e2, tmp_path / "ck")
        assert _train(e2, 2, 2) == after
        got = _state(e2)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    export_model(tmp_path / "ck", tmp_path / "out")
    exported = load_exported(tmp_path / "out")
    assert set(exported) == set(dict(m1.named_parameters()))
    with CheckpointReader(tmp_path / "ck") as r:
        assert r.meta["step"] == 2 and r.meta["precision"] == "fp32"


def test_resume_in_a_new_process_through_engine_methods(tmp_path):
    """engine.save_checkpoint in this process, engine.load_checkpoint in a child."""
    import json
    import subprocess
    import sys

    import infinity
    from infinity.checkpoint import CheckpointReader
    here = os.path.dirname(__file__)
    swap = str(tmp_path / "swap")
    with infinity.initialize(rc.model(0), rc.config("nvme", swap)) as e1:
        straight = rc.train(e1, 6, 0)
        ref = _state(e1)
    with infinity.initialize(rc.model(0), rc.config("nvme", swap)) as e2:
        assert rc.train(e2, 3, 0) == straight[:3]
        h = e2.save_checkpoint(tmp_path / "ck")
        assert h.tag == "step-3"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, os.path.join(here, "resume_child.py"), str(tmp_path / "ck"),
                        "nvme", swap], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == straight[3:]
    with CheckpointReader(tmp_path / "ck", "end") as r:
        r.verify()
        assert r.meta["step"] == 6
        for n, t in ref.items():
            assert torch.equal(r.read(n), t), n


@pytest.mark.parametrize("offload", [pytest.param("cpu", marks=pytest.mark.slow), "nvme"])
def test_frozen_params_and_buffers(tmp_path, offload):
    """Frozen params (read from their home) and BatchNorm running stats are saved,
    exported under model names, and buffers are restored on load."""
    from infinity.engine import initialize

    def build(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(16, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 4))
        m[0].requires_grad_(False)  # a frozen base
        return m

    swap = str(tmp_path / "swap")
    m1 = build(0)
    frozen = {n: p.detach().clone() for n, p in m1.named_parameters() if not p.requires_grad}
    with initialize(m1, _cfg(offload, swap)) as e1:
        _train(e1, 2, 0)
        e1.save_checkpoint(tmp_path / "ck")
        bufs = {n: b.clone() for n, b in m1.named_buffers()}
        after = _train(e1, 2, 2)
    assert bufs["1.num_batches_tracked"].item() == 2
    m2 = build(9)
    with initialize(m2, _cfg(offload, swap)) as e2:
        e2.load_checkpoint(tmp_path / "ck")
        for n, b in m2.named_buffers():
            assert torch.equal(b, bufs[n]), n
        assert _train(e2, 2, 2) == after
    export_model(tmp_path / "ck", tmp_path / "out")
    exported = load_exported(tmp_path / "out")
    assert set(exported) == set(dict(m1.named_parameters())) | set(bufs)
    for n, t in frozen.items():
        assert torch.equal(exported[n], t), n


def test_async_save_through_engine_is_a_consistent_snapshot(tmp_path):
    from infinity.checkpoint import CheckpointReader
    from infinity.engine import initialize
    swap = str(tmp_path / "swap")
    with initialize(_model(0), _cfg("nvme", swap)) as e:
        _train(e, 2, 0)
        ref = _state(e)
        h = e.save_checkpoint(tmp_path / "ck", async_=True, max_host_bytes=600)
        _train(e, 2, 2)  # keeps changing masters and states while the save may still write
        assert h.wait() == str(tmp_path / "ck" / "step-2")
        assert h.peak_queued_bytes <= 33 * 16 * 4  # bound (a single larger tensor alone)
        changed = _state(e)
    with CheckpointReader(tmp_path / "ck") as r:
        r.verify()
        for n, t in ref.items():
            assert torch.equal(r.read(n), t), n
    assert any(not torch.equal(changed[n], ref[n]) for n in ref)


def test_export_from_engine_checkpoint_loads_in_transformers(tmp_path):
    """GPT-2 (tied embeddings) trained with NVMe offload: `export` of its checkpoint is
    loaded by transformers' from_pretrained and gives the engine's logits exactly."""
    transformers = pytest.importorskip("transformers")
    from infinity.engine import initialize
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    swap = str(tmp_path / "swap")
    with initialize(m, {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap]}}) as e:
        for _ in range(2):
            out = e(input_ids=ids, labels=ids)
            e.backward(out.loss)
            e.step()
        e.save_checkpoint(tmp_path / "ck")
        m.eval()
        with torch.no_grad():
            ref = e(input_ids=ids).logits.clone()
    export_model(tmp_path / "ck", tmp_path / "out")
    # engine.save_checkpoint records the model's config itself: export wrote config.json,
    # so AutoModelForCausalLM loads the directory as is (no config saved by hand)
    m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(m2).__name__ == "GPT2LMHeadModel" and m2.config.n_embd == 16
    with torch.no_grad():
        got = m2(input_ids=ids).logits
    assert torch.equal(got, ref)


def test_engine_rejects_other_model_and_keeps_its_state(tmp_path):
    from infinity.checkpoint import CheckpointError
    from infinity.engine import initialize
    swap = str(tmp_path / "swap")
    with initialize(_model(0), _cfg("nvme", swap)) as e1:
        _train(e1, 1, 0)
        e1.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4),
                          nn.Linear(4, 4))
    with initialize(other, _cfg("nvme", swap)) as e2:
        _train(e2, 1, 0)
        before = _state(e2)
        with pytest.raises(CheckpointError) as ei:
            e2.load_checkpoint(tmp_path / "ck")
        msg = str(ei.value)
        assert "0.weight: checkpoint [33, 16] torch.float32, model [32, 16]" in msg
        assert "missing from checkpoint (6): 4.weight" in msg  # 4.weight, 4.bias + their states
        assert e2.global_steps == 1
        after = _state(e2)
        assert all(torch.equal(before[n], after[n]) for n in before)
        _train(e2, 1, 1)  # still usable


@pytest.mark.parametrize("key,value", [("step", "3"), ("loss_scaler", {"scale": -1.0}),
                                       ("loss_scaler", [1]), ("rng", [0]),
                                       ("rng", {"torch": [1, 2, 3]}),   # wrong size: was applied
                                       ("rng", {"python": [3, [1, 2], None]})])  # after the weights
def test_engine_rejects_bad_meta_before_changing_anything(tmp_path, key, value):
    """A manifest whose meta the engine cannot restore (resealed, so checksums pass) is
    refused before any tensor is written into the engine."""
    import json

    from infinity.checkpoint import CheckpointError
    from infinity.checkpoint import manifest as mf
    from infinity.engine import initialize
    swap = str(tmp_path / "swap")
    with initialize(_model(0), _cfg("nvme", swap)) as e1:
        _train(e1, 2, 0)
        e1.save_checkpoint(tmp_path / "ck")
    mpath = tmp_path / "ck" / "step-2" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["meta"][key] = value
    mpath.write_text(mf.seal(m))
    with initialize(_model(7), _cfg("nvme", swap)) as e2:
        _train(e2, 1, 0)
        before = _state(e2)
        rng_before = torch.get_rng_state()
        with pytest.raises(CheckpointError, match=f"meta\\['{key}'\\]"):
            e2.load_checkpoint(tmp_path / "ck")
        assert torch.equal(torch.get_rng_state(), rng_before)
        assert e2.global_steps == 1
        after = _state(e2)
        assert all(torch.equal(before[n], after[n]) for n in before)
