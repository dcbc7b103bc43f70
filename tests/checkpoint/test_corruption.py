"""Bad checkpoints get a CheckpointError naming the problem, before any state changes."""
import json
import os

import pytest
import torch

from infinity.checkpoint import CheckpointError, CheckpointReader, load_checkpoint, save_checkpoint
from infinity.checkpoint import manifest as mf


@pytest.fixture
def ckpt(tmp_path, dict_state, tensors):
    save_checkpoint(dict_state(tensors, {"step": 5}), tmp_path, shard_bytes=2000)
    return tmp_path, tmp_path / "step-5"


def _shards(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def _assert_load_fails_untouched(root, dict_state, tensors, match):
    dst = dict_state({k: torch.zeros_like(v) for k, v in tensors.items()})
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(dst, root)
    assert dst.load_calls == 0 and dst.loaded_meta is None  # nothing was changed


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_corrupt_data_byte_names_file(ckpt, dict_state, tensors):
    root, d = ckpt
    victim = _shards(d)[1]
    _flip(d / victim, os.path.getsize(d / victim) - 3)
    _assert_load_fails_untouched(root, dict_state, tensors, rf"{victim} is corrupt \(SHA-256 mismatch in its data")


def test_corrupt_header_byte_names_file(ckpt, dict_state, tensors):
    root, d = ckpt
    victim = _shards(d)[0]
    _flip(d / victim, 20)
    _assert_load_fails_untouched(root, dict_state, tensors, rf"{victim} is corrupt \(SHA-256 mismatch in its header")


def test_truncated_file_names_file(ckpt, dict_state, tensors):
    root, d = ckpt
    victim = _shards(d)[-1]
    os.truncate(d / victim, os.path.getsize(d / victim) - 100)
    _assert_load_fails_untouched(root, dict_state, tensors, rf"{victim} has \d+ bytes, the manifest records \d+: the file is truncated")


def test_missing_file_names_file(ckpt, dict_state, tensors):
    root, d = ckpt
    victim = _shards(d)[2]
    os.unlink(d / victim)
    _assert_load_fails_untouched(root, dict_state, tensors, rf"{victim} is missing")


def test_missing_manifest(ckpt, dict_state, tensors):
    root, d = ckpt
    os.unlink(d / "manifest.json")
    _assert_load_fails_untouched(root, dict_state, tensors, r"manifest.json is missing")


def test_symlinked_shard_rejected(ckpt, dict_state, tensors, tmp_path_factory):
    root, d = ckpt
    victim = _shards(d)[0]
    elsewhere = tmp_path_factory.mktemp("other") / "x"
    os.rename(d / victim, elsewhere)
    os.symlink(elsewhere, d / victim)
    _assert_load_fails_untouched(root, dict_state, tensors, rf"{victim} is not a regular file")


def _edit_manifest(d, fn, reseal=True):
    p = d / "manifest.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(mf.seal(m) if reseal else json.dumps(m))


def test_edited_manifest_fails_self_checksum(ckpt, dict_state, tensors):
    root, d = ckpt

    def bump(m):
        m["meta"]["step"] = 6
    _edit_manifest(d, bump, reseal=False)
    _assert_load_fails_untouched(root, dict_state, tensors, "manifest checksum mismatch")


def test_garbage_manifest(ckpt, dict_state, tensors):
    root, d = ckpt
    (d / "manifest.json").write_text("{not json")
    _assert_load_fails_untouched(root, dict_state, tensors, "manifest is not valid JSON")


@pytest.mark.parametrize("bad", ["../evil.safetensors", "/etc/passwd", "rank0-00000.safetensors/../../x",
                                 "..", "sub/rank0-00000.safetensors", ".hidden.safetensors"])
def test_manifest_path_traversal_rejected(ckpt, dict_state, tensors, bad):
    # a hand-crafted manifest with a valid self-checksum: validation must still refuse it
    root, d = ckpt

    def traverse(m):
        first = sorted(m["files"])[0]
        m["files"][bad] = m["files"].pop(first)
        for t in m["tensors"].values():
            for p in t["pieces"]:
                if p["file"] == first:
                    p["file"] = bad
    _edit_manifest(d, traverse)
    _assert_load_fails_untouched(root, dict_state, tensors, "invalid file")


def test_manifest_unknown_dtype_rejected(ckpt, dict_state, tensors):
    root, d = ckpt

    def evil_dtype(m):
        m["tensors"]["big"]["dtype"] = "PICKLE"
    _edit_manifest(d, evil_dtype)
    _assert_load_fails_untouched(root, dict_state, tensors, r"tensor 'big': unknown dtype 'PICKLE'")


@pytest.mark.parametrize("shape", [[-1, 3], [2.5], "7", [True]])
def test_manifest_bad_shape_rejected(ckpt, dict_state, tensors, shape):
    root, d = ckpt

    def bad_shape(m):
        m["tensors"]["layer.0.weight"]["shape"] = shape
    _edit_manifest(d, bad_shape)
    _assert_load_fails_untouched(root, dict_state, tensors, "layer.0.weight")


def test_manifest_inconsistent_byte_range_rejected(ckpt, dict_state, tensors):
    root, d = ckpt

    def widen(m):
        p = m["tensors"]["big"]["pieces"][0]
        p["offsets"][1] += 4
    _edit_manifest(d, widen)
    _assert_load_fails_untouched(root, dict_state, tensors, r"tensor 'big' piece 0: byte range")


def test_manifest_overlapping_tensors_rejected(ckpt, dict_state, tensors):
    root, d = ckpt

    def alias(m):
        a = m["tensors"]["layer.0.weight"]
        b = m["tensors"]["optim.layer.0.weight.exp_avg"]
        b["pieces"] = [dict(p) for p in a["pieces"]]
    _edit_manifest(d, alias)
    _assert_load_fails_untouched(root, dict_state, tensors, "overlap")


def test_latest_with_traversal_rejected(ckpt, dict_state, tensors):
    root, _ = ckpt
    (root / "latest").write_text("../../etc\n")
    _assert_load_fails_untouched(root, dict_state, tensors, "invalid checkpoint tag")


def test_no_checkpoint_and_unknown_tag(tmp_path, dict_state, ckpt, tensors):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        CheckpointReader(tmp_path / "empty")
    root, _ = ckpt
    with pytest.raises(CheckpointError, match=r"step-4 does not exist \(tags here: \['step-5'\]"):
        CheckpointReader(root, "step-4")


def test_mismatched_model_lists_names_and_shapes(ckpt, dict_state, tensors):
    root, _ = ckpt
    model = {k: torch.zeros_like(v) for k, v in tensors.items()}
    model["layer.0.weight"] = torch.zeros(3, 7)  # shape changed
    model["layer.1.weight"] = torch.zeros(2)     # not in checkpoint
    del model["big"]                             # in checkpoint, not in model
    dst = dict_state(model)
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(dst, root)
    msg = str(ei.value)
    assert "layer.0.weight: checkpoint [7, 3] torch.float32, model [3, 7]" in msg
    assert "missing from checkpoint (1): layer.1.weight" in msg
    assert "unexpected in checkpoint (1): big" in msg
    assert dst.load_calls == 0
    # non-strict tolerates unexpected names, still rejects the rest
    del model["layer.1.weight"]
    model["layer.0.weight"] = torch.zeros(7, 3)
    dst = dict_state(model)
    load_checkpoint(dst, root, strict=False)
    assert torch.equal(dst.loaded["layer.0.weight"], tensors["layer.0.weight"])


def test_previous_checkpoint_still_loads_after_corrupting_latest(tmp_path, dict_state, tensors):
    save_checkpoint(dict_state(tensors, {"step": 1}), tmp_path)
    save_checkpoint(dict_state(tensors, {"step": 2}), tmp_path)
    d = tmp_path / "step-2"
    _flip(d / _shards(d)[0], os.path.getsize(d / _shards(d)[0]) - 1)
    with pytest.raises(CheckpointError, match="step-2/rank0-00000.safetensors is corrupt"):
        load_checkpoint(dict_state(tensors), tmp_path)
    dst = dict_state(tensors)
    assert load_checkpoint(dst, tmp_path, "step-1")["step"] == 1


def test_block_digests_locate_corruption(tmp_path, dict_state):
    t = {"w": torch.randn(25_000), "v": torch.randn(3)}  # 100 KB -> 25 blocks of 4 KiB
    save_checkpoint(dict_state(t, {"step": 1}), tmp_path, hash_block_bytes=4096)
    d = tmp_path / "step-1"
    man = json.loads((d / "manifest.json").read_text())
    fi = man["files"]["rank0-00000.safetensors"]
    assert fi["hash_block_bytes"] == 4096 and len(fi["data_sha256_blocks"]) == 25
    dst = dict_state({k: torch.zeros_like(v) for k, v in t.items()})
    load_checkpoint(dst, tmp_path)
    assert all(torch.equal(dst.loaded[k], v) for k, v in t.items())
    lo = fi["data_start"] + 10 * 4096
    _flip(d / "rank0-00000.safetensors", lo + 123)
    _assert_load_fails_untouched(tmp_path, dict_state, t,
                                 rf"rank0-00000.safetensors is corrupt \(SHA-256 mismatch in its data at bytes {lo}\.\.")


def test_latest_symlink_outside_root_refused(ckpt, dict_state, tensors, tmp_path_factory):
    root, d = ckpt
    outside = tmp_path_factory.mktemp("elsewhere")
    (outside / "latest").write_text("step-5")
    os.unlink(root / "latest")
    os.symlink(outside / "latest", root / "latest")
    _assert_load_fails_untouched(root, dict_state, tensors, r"symlink leading outside")


def test_tag_dir_symlink_outside_root_refused(ckpt, dict_state, tensors, tmp_path_factory):
    import shutil
    root, d = ckpt
    outside = tmp_path_factory.mktemp("elsewhere") / "step-9"
    shutil.copytree(d, outside)
    os.symlink(outside, root / "step-9")
    dst = dict_state({k: torch.zeros_like(v) for k, v in tensors.items()})
    with pytest.raises(CheckpointError, match=r"symlink leading outside"):
        load_checkpoint(dst, root, tag="step-9")
    assert dst.load_calls == 0
    # a symlink inside the root is fine
    os.symlink(d, root / "step-6")
    load_checkpoint(dst, root, tag="step-6")
