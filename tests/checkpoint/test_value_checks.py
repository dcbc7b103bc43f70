"""Malformed checkpoint input ends in CheckpointError (issue 36): values checked while
verify() hashes them (every element, also those a read chunk cuts), JSON nested too deep,
a 'ranks' list that does not match world_size, NUL bytes in paths, malformed RNG states."""
import json
import os

import pytest
import torch

from infinity.checkpoint import (CheckpointError, CheckpointReader, export_model,
                                 load_checkpoint, save_checkpoint)
from infinity.checkpoint import reader as reader_mod
from infinity.checkpoint.manifest import MAX_DEPTH
from infinity.checkpoint.rng import parse_rng_state, rng_state_to_json
from infinity.checkpoint.values import ValueCheck


def _awkward():
    """A bf16 tensor of odd numel first, so the fp32 tensor after it starts 2 bytes off a
    4-byte boundary: hash blocks of 4096 bytes cut its elements in two."""
    g = torch.Generator().manual_seed(3)
    return {"odd": torch.randn(4095, generator=g).to(torch.bfloat16),
            "m": torch.randn(3001, generator=g), "v": torch.rand(2999, generator=g),
            "h": torch.rand(7, generator=g).to(torch.float16)}


@pytest.fixture
def awkward(tmp_path, dict_state):
    save_checkpoint(dict_state(_awkward(), {"step": 1}), tmp_path, hash_block_bytes=4096)
    return tmp_path, tmp_path / "step-1"


CHECKS = {"m": ValueCheck("the first moment"), "odd": ValueCheck("a bf16 tensor"),
          "v": ValueCheck("the second moment", nonneg=True, nonneg_hint="swapped?"),
          "h": ValueCheck("half")}


def _verify(root):
    with CheckpointReader(root) as r:
        return r.verify(value_checks=CHECKS)


@pytest.mark.parametrize("chunk", [reader_mod._HASH_CHUNK, 1001])   # 1001: odd read chunks
def test_every_element_is_checked_even_where_a_chunk_cuts_it(awkward, reseal, monkeypatch,
                                                            chunk):
    root, d = awkward
    monkeypatch.setattr(reader_mod, "_HASH_CHUNK", chunk)
    assert _verify(root)
    with CheckpointReader(root) as r:
        b = r.manifest["tensors"]["m"]["pieces"][0]["offsets"][0]
    assert b % 4 == 2                                    # elements straddle the blocks
    cut = [k for k in range(3001) if (b + 4 * k) // 4096 != (b + 4 * k + 3) // 4096]
    assert len(cut) >= 2                                 # elements 4096-byte blocks cut
    for name, idx, value in [("m", cut[0], float("nan")), ("m", cut[1], float("inf")),
                             ("m", cut[1] + 1, float("-inf")), ("m", 3000, float("nan")),
                             ("m", 1, float("nan")), ("odd", 2047, float("nan")),
                             ("odd", 4094, float("inf")), ("h", 6, float("nan")),
                             ("v", 0, -1e-30), ("v", 2998, -5.0)]:
        orig = _awkward()[name]

        def poison(t, idx=idx, value=value):
            t.reshape(-1)[idx] = value
            return t
        reseal.tensor(d, name, poison)
        with pytest.raises(CheckpointError) as ei:
            _verify(root)
        msg = str(ei.value)
        assert f"tensor {name!r}" in msg and f"at flat element {idx}" in msg, msg
        assert "rank0-00000.safetensors" in msg and "load another tag" in msg
        assert ("a negative value" in msg and "swapped?" in msg) if name == "v" \
            else "a non-finite value" in msg
        reseal.tensor(d, name, orig)
    assert _verify(root)


def test_values_are_checked_only_when_asked_and_minus_zero_is_not_negative(awkward, reseal):
    root, d = awkward
    reseal.tensor(d, "v", lambda t: t.fill_(-0.0))
    reseal.tensor(d, "m", lambda t: t.fill_(float("nan")))
    with CheckpointReader(root) as r:
        assert r.verify()                                      # no value checks: loads
    with pytest.raises(CheckpointError, match="tensor 'm'"):
        _verify(root)
    with CheckpointReader(root) as r:                          # v: -0.0 is >= 0
        assert r.verify(value_checks={"v": CHECKS["v"]})


def test_a_digest_mismatch_is_reported_before_a_bad_value(awkward):
    root, d = awkward
    with CheckpointReader(root) as r:
        b = r.manifest["tensors"]["m"]["pieces"][0]["offsets"][0]
    with open(d / "rank0-00000.safetensors", "r+b") as f:     # a NaN, not re-sealed
        f.seek(b)
        f.write(torch.tensor([float("nan")]).view(torch.uint8).numpy().tobytes())
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        _verify(root)


def test_load_checkpoint_uses_the_objects_checks_before_touching_it(awkward, reseal,
                                                                   dict_state):
    root, d = awkward
    reseal.tensor(d, "v", lambda t: -t)
    calls = []

    class Checked(dict_state):
        def check_checkpoint(self, reader):
            calls.append(reader.path)

        def checkpoint_value_checks(self):
            return CHECKS

    dst = Checked({k: torch.zeros_like(v) for k, v in _awkward().items()})
    with pytest.raises(CheckpointError, match="tensor 'v'.*a negative value"):
        load_checkpoint(dst, root)
    assert calls == [str(d)] and dst.load_calls == 0 and dst.loaded_meta is None


# ------------------------------------------------------------------------- nesting depth
def _nested(depth):
    v = 0
    for _ in range(depth - 1):
        v = [v]
    return {"x": v} if depth else v


def test_deeply_nested_manifest_is_a_checkpoint_error(tmp_path, dict_state, tensors, reseal):
    save_checkpoint(dict_state(tensors, {"step": 5}), tmp_path)
    d = tmp_path / "step-5"
    mpath = d / "manifest.json"
    good = mpath.read_text()
    # too deep for the JSON parser itself (was RecursionError)
    mpath.write_text(good[:-2] + ',"deep":' + "[" * 200000 + "]" * 200000 + "}\n")
    with pytest.raises(CheckpointError, match="nests JSON too deeply"):
        CheckpointReader(tmp_path)
    # parseable, but deeper than MAX_DEPTH (in the meta and in an extra top-level key)
    mpath.write_text(good)
    reseal.manifest(d, lambda m: m["meta"].update(deep=_nested(MAX_DEPTH + 1)))
    with pytest.raises(CheckpointError, match=f"'meta' nests .* more than {MAX_DEPTH} levels"):
        CheckpointReader(tmp_path)
    mpath.write_text(good)
    reseal.manifest(d, lambda m: m.update(extra=_nested(MAX_DEPTH + 1)))
    with pytest.raises(CheckpointError, match="'extra' nests"):
        CheckpointReader(tmp_path)


def test_save_refuses_too_deep_a_meta_and_accepts_the_limit(tmp_path, dict_state, tensors):
    with pytest.raises(CheckpointError, match=f"extra_meta: the meta nests .* {MAX_DEPTH}"):
        save_checkpoint(dict_state(tensors, {"step": 1}), tmp_path / "a",
                        extra_meta={"deep": _nested(MAX_DEPTH)})     # 1 + MAX_DEPTH levels
    assert not (tmp_path / "a" / "step-1").exists()
    with pytest.raises(CheckpointError, match="not JSON-serialisable: RecursionError"):
        save_checkpoint(dict_state(tensors, {"step": 1, "deep": _nested(100000)}),
                        tmp_path / "b")
    meta = {"step": 1, "deep": _nested(MAX_DEPTH - 1)}                   # exactly MAX_DEPTH
    save_checkpoint(dict_state(tensors, meta), tmp_path / "c")
    dst = dict_state({k: torch.zeros_like(v) for k, v in tensors.items()})
    assert load_checkpoint(dst, tmp_path / "c")["deep"] == meta["deep"]


# ------------------------------------------------------------------ world size and ranks
@pytest.mark.parametrize("edit,match", [
    (lambda m: m.update(world_size=2), "'ranks' must list the 2 ranks of world_size 2, got 1"),
    (lambda m: m["ranks"].append({"rank": 1, "files": []}), "'ranks' must list the 1 ranks"),
    (lambda m: m["ranks"][0].update(rank=3), r"'ranks'\[0\] must be"),
    (lambda m: m["ranks"][0]["files"].pop(), "are not listed under 'ranks'"),
    (lambda m: m["ranks"][0]["files"].append(m["ranks"][0]["files"][0]), "listed twice"),
    (lambda m: [fi.update(rank=1) for fi in m["files"].values()] and m.update(world_size=2)
     or m["ranks"].append({"rank": 1, "files": []}), "its name says another rank"),
])
def test_world_size_must_match_the_ranks_that_wrote_the_files(tmp_path, dict_state, tensors,
                                                              reseal, edit, match):
    save_checkpoint(dict_state(tensors, {"step": 5}), tmp_path, shard_bytes=2000)
    reseal.manifest(tmp_path / "step-5", edit)
    dst = dict_state({k: torch.zeros_like(v) for k, v in tensors.items()})
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(dst, tmp_path)
    assert dst.load_calls == 0


# ------------------------------------------------------------------------------ NUL paths
def test_nul_bytes_in_checkpoint_paths(tmp_path, dict_state, tensors):
    bad = str(tmp_path / "ck\x00pt")
    with pytest.raises(CheckpointError, match="checkpoint directory .* contains a NUL byte"):
        save_checkpoint(dict_state(tensors, {"step": 1}), bad)
    with pytest.raises(CheckpointError, match="NUL byte"):
        CheckpointReader(bad)
    with pytest.raises(CheckpointError, match="NUL byte"):
        load_checkpoint(dict_state(tensors), bad)
    save_checkpoint(dict_state(tensors, {"step": 1}), tmp_path / "ck")
    with pytest.raises(CheckpointError, match="export target .* contains a NUL byte"):
        export_model(tmp_path / "ck", str(tmp_path / "o\x00ut"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# ------------------------------------------------------------------------------ RNG states
def _rng_cases():
    good = rng_state_to_json()
    words = good["python"][1]
    np_keys = good.get("numpy", [None, [0] * 624])[1]
    return [
        ({"numpy": ["MT19937", [1, 2], 0, 0, 0.0]}, "'numpy'", "624 entries, got 2"),  # IndexError
        ({"numpy": ["MT19937", np_keys, 10 ** 6, 0, 0.0]}, "'numpy'", "index 1000000"),
        ({"numpy": ["MT19937", np_keys, 0, 2, 0.0]}, "'numpy'", "has_gauss 2"),
        ({"numpy": ["PCG64", np_keys, 0, 0, 0.0]}, "'numpy'", "'PCG64'"),
        ({"numpy": ["MT19937", [1.5] * 624, 0, 0, 0.0]}, "'numpy'", "state word 0 is 1.5"),
        ({"numpy": None}, "'numpy'", "list of 5 entries, got NoneType"),
        ({"python": [3, words[:-1] + [10 ** 6], None]}, "'python'", "index 1000000"),
        ({"python": [3, words, "x"]}, "'python'", "cached gaussian 'x'"),
        ({"python": [2, words, None]}, "'python'", "version 2"),
        ({"python": [3, [2 ** 40] * 625, None]}, "'python'", "state word 0"),
        ({"python": {"a": 1}}, "'python'", "list of 3 entries, got dict"),
        ({"torch": [1, 2, 999]}, "'torch'", "integers in [0, 255]"),
        ({"torch": [1, 2, 3]}, "'torch'", "refused by torch"),
        ({"torch": "x"}, "'torch'", "list of integers"),
    ]


@pytest.mark.parametrize("state,entry,why", _rng_cases(),
                         ids=[f"{c[1]}-{c[2][:20]}" for c in _rng_cases()])
def test_malformed_rng_entries_are_checkpoint_errors(state, entry, why):
    before = (torch.get_rng_state(), json.dumps(rng_state_to_json()))
    with pytest.raises(CheckpointError) as ei:
        parse_rng_state(state)
    msg = str(ei.value)
    assert f"rng state {entry}" in msg and why in msg and "expected" in msg, msg
    assert torch.equal(torch.get_rng_state(), before[0])


def test_a_saved_rng_state_still_parses():
    parse_rng_state(json.loads(json.dumps(rng_state_to_json())))()
