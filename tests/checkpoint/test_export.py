import json
import os

import pytest
import torch
from safetensors import safe_open

from infinity.checkpoint import CheckpointError, Piece, export_model, save_checkpoint
from infinity.checkpoint.export import load_exported
from infinity.cli.main import main as cli_main


def test_export_single_file_model_names_only(tmp_path, dict_state, tensors):
    save_checkpoint(dict_state(tensors, {"step": 3}), tmp_path / "ck", shard_bytes=500)
    files = export_model(tmp_path / "ck", tmp_path / "out")
    assert files == [str(tmp_path / "out" / "model.safetensors")]
    got = load_exported(tmp_path / "out")
    want = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    with safe_open(files[0], framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_export_sharded_with_index_and_cast(tmp_path, dict_state):
    t = {f"h.{i}.w": torch.randn(300) for i in range(10)}  # 1200 bytes each in fp32
    t["optim.h.0.w.exp_avg"] = torch.randn(300)
    save_checkpoint(dict_state(t, {"step": 1}), tmp_path / "ck")
    files = export_model(tmp_path / "ck", tmp_path / "out", max_shard_bytes=1500, dtype=torch.bfloat16)
    idx = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(files) == 6  # 5 shards of 2 x 600 bytes + index
    assert idx["metadata"]["total_size"] == 10 * 600
    assert sorted(idx["weight_map"]) == sorted(k for k in t if not k.startswith("optim."))
    got = load_exported(tmp_path / "out")
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, t[k].bfloat16())


def test_export_reassembles_rank_pieces(tmp_path):
    full = torch.randn(6, 5)

    class TwoPieces:  # a rank-partitioned tensor written by one process for the test
        def checkpoint_tensors(self):
            yield "w", full.reshape(-1)[:17], Piece((6, 5), 0)
            yield "w", full.reshape(-1)[17:], Piece((6, 5), 17)

        def checkpoint_meta(self):
            return {"step": 1}

    save_checkpoint(TwoPieces(), tmp_path / "ck", shard_bytes=40)
    export_model(tmp_path / "ck", tmp_path / "out")
    assert torch.equal(load_exported(tmp_path / "out")["w"], full)


@pytest.fixture
def restore_logging():
    import logging
    lg = logging.getLogger("infinity")
    saved = (lg.handlers[:], lg.level, lg.propagate)
    yield
    lg.handlers[:], lg.level, lg.propagate = saved


def test_export_cli(tmp_path, dict_state, tensors, capsys, restore_logging):
    save_checkpoint(dict_state(tensors, {"step": 1}), tmp_path / "ck", tag="a")
    save_checkpoint(dict_state({"only": torch.ones(2)}, {"step": 2}), tmp_path / "ck", tag="b")
    assert cli_main(["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--tag", "a"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    assert "layer.0.weight" in load_exported(tmp_path / "out")
    assert cli_main(["export", str(tmp_path / "ck"), str(tmp_path / "out2")]) == 0  # latest = b
    assert set(load_exported(tmp_path / "out2")) == {"only"}
    assert cli_main(["export", str(tmp_path / "nope"), str(tmp_path / "out3")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out3")


def test_export_refuses_corrupt_checkpoint(tmp_path, dict_state, tensors):
    save_checkpoint(dict_state(tensors, {"step": 1}), tmp_path / "ck")
    p = tmp_path / "ck" / "step-1" / "rank0-00000.safetensors"
    with open(p, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="rank0-00000.safetensors is corrupt"):
        export_model(tmp_path / "ck", tmp_path / "out")
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


@pytest.mark.slow  # the engine-level GPT-2 export test covers this in the default suite
def test_export_loads_into_transformers_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)

    class FromModel:
        def checkpoint_tensors(self):
            for n, p in model.named_parameters():
                yield n, p.detach()
                yield f"optim.{n}.exp_avg", torch.zeros_like(p)

        def checkpoint_meta(self):
            return {"step": 1}

    save_checkpoint(FromModel(), tmp_path / "ck")
    export_model(tmp_path / "ck", tmp_path / "out")
    cfg.save_pretrained(tmp_path / "out")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    for (n, p), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
