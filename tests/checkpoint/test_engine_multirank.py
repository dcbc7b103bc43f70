"""Engine checkpoints at world size > 1 (ZeRO shards), loaded at the same and at other
world sizes and offload configurations.

References: an uninterrupted run (the continuation after the save point), and for
cross-world-size loads the same continuation at the other world size (each rank's
loss is the mean over its half of the global batch, so 2 ranks and 1 process on the
whole batch compute the same gradient up to rounding).
"""
import importlib.util
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from infinity.checkpoint import CheckpointReader

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "engine_rank_child.py")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


harness = _load(os.path.join(HERE, "..", "zero", "zero_harness.py"), "_ckpt_zero_harness")
child = _load(CHILD, "_ckpt_engine_rank_child")


def config(stage, offload, swap, precision="fp32"):
    return {"zero_stage": stage, "precision": precision, "dist_timeout_s": 60,
            "prefetch": {"depth": 2},
            "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.05},
            "scheduler": {"type": "cosine", "warmup_steps": 2, "total_steps": 6},
            "offload": {"params": offload if stage == 3 else "none", "optimizer": offload,
                        "nvme_paths": [swap]}}


def ranks(spec_runs, tmp_path, timeout=300):
    res = harness.run_ranks(CHILD, {"runs": spec_runs}, tmp_path, world_size=2, timeout=timeout)
    for r in res:
        assert r.returncode == 0 and r.result is not None, r
    return res


def in_process(run):
    """A world-size-1 run in this process (no torch.distributed)."""
    return child.run_one(run, 0, 1)


def rel(a, b):
    a, b = a.float(), b.float()
    d = float((a - b).norm())
    n = float(b.norm())
    return d / n if n else d


def assert_close(got, ref, tol, what):
    assert set(got) == set(ref), what
    worst = max((rel(got[k], ref[k]), k) for k in ref)
    assert worst[0] < tol, f"{what}: {worst[1]} differs by rel {worst[0]:.3g}"


def assert_losses(got, ref, tol):
    assert len(got) == len(ref) and got
    for a, b in zip(got, ref):
        assert abs(a - b) <= tol * abs(b), (got, ref)


def rank0_state(tmp_path, name):
    """The gathered parameters rank 0 wrote for run ``name`` (harness output dirs)."""
    found = list(tmp_path.glob(f"ranks-*/rank0.json.{name}.safetensors"))
    assert len(found) == 1, found
    return load_file(str(found[0]))


def ckpt_tensors(path, tag=None):
    with CheckpointReader(path, tag) as r:
        r.verify()
        return {n: r.read(n) for n in r.names()}, r


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Everything is trained once (one spawn of 2 ranks, process start-up dominates):

    - ``one``: 1 process, CPU offload: 3 steps, save ``ck1``, 3 more (the world-size-1
      reference continuation),
    - ``a``: 2 ranks, stage 3, params + optimizer on NVMe: 3 steps, save ``ck2``, 3 more,
      save ``endA``,
    - ``b``: fresh 2-rank engines (other init) load ``ck2``, train the same 3, save ``endB``,
    - ``from1``: 2 ranks load ``ck1`` (a 1-process checkpoint), train 3,
    - ``bad``: rank 1 is given a directory that does not exist,
    - ``corrupt``: both load a copy of ``ck1`` with a flipped data byte,
    - ``s2``: 2 ranks, stage 2, optimizer CPU offload: 3 steps, save ``ck_s2``,
    - ``from2``: 1 process, CPU offload (no ZeRO) loads ``ck2`` and trains 3.
    """
    return build_world(tmp_path_factory.mktemp("multirank"))


def build_world(tmp):
    swap = str(tmp / "swap")
    d = {k: str(tmp / k) for k in ("ck1", "ck2", "endA", "endB", "ck_s2")}
    z3 = config(3, "nvme", swap)
    cpu1 = config(3, "cpu", swap)   # at world size 1 the stage does not matter
    one = in_process({"name": "one", "config": cpu1, "seed": 1234, "start": 0, "steps": 6,
                      "save": [{"after": 3, "dir": d["ck1"]}]})
    # a copy of it with one flipped data byte: only the rank that hashes that file sees it
    d["bad1"] = str(tmp / "bad1")
    shutil.copytree(d["ck1"], d["bad1"])
    shard = os.path.join(d["bad1"], "step-3", "rank0-00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))
    res = ranks([
        {"name": "a", "config": z3, "seed": 1234, "start": 0, "steps": 6,
         "save": [{"after": 3, "dir": d["ck2"]}, {"after": 6, "dir": d["endA"]}]},
        {"name": "b", "config": z3, "seed": 777, "start": 3, "steps": 3, "load": d["ck2"],
         "save": [{"after": 3, "dir": d["endB"]}]},
        {"name": "from1", "config": z3, "seed": 5, "start": 3, "steps": 3, "load": d["ck1"]},
        {"name": "bad", "config": z3, "seed": 9, "start": 3, "steps": 3, "load": d["ck2"],
         "load_by_rank": {"1": str(tmp / "missing")}},
        {"name": "corrupt", "config": z3, "seed": 11, "start": 3, "steps": 3, "load": d["bad1"]},
        {"name": "s2", "config": config(2, "cpu", swap), "seed": 1234, "start": 0, "steps": 3,
         "save": [{"after": 3, "dir": d["ck_s2"]}]},
    ], tmp)
    from2 = in_process({"name": "from2", "config": cpu1, "seed": 4, "start": 3, "steps": 3,
                        "load": d["ck2"]})
    runs = [r.result["runs"] for r in res]
    return {"tmp": tmp, "dirs": d, "swap": swap, "one": one, "from2": from2, "ranks": runs,
            "r0": runs[0]}


def test_stage3_nvme_two_rank_resume_equal(world):
    """2 ranks, stage 3, NVMe: save, continue == fresh 2-rank engines load and continue."""
    a, b = world["r0"]["a"], world["r0"]["b"]
    assert b["meta_step"] == 3 and b["global_steps"] == 6
    assert_losses(b["losses"], a["losses"][3:], 1e-6)
    assert_close(rank0_state(world["tmp"], "b"), rank0_state(world["tmp"], "a"), 1e-6,
                 "2-rank resume: final parameters")
    end_a, _ = ckpt_tensors(world["dirs"]["endA"])
    end_b, _ = ckpt_tensors(world["dirs"]["endB"])
    m = child.make_model("awkward")
    n_train = sum(1 for p in m.parameters() if p.requires_grad)   # tied ones counted once
    n_frozen = sum(1 for p in m.parameters() if not p.requires_grad)
    assert len(end_a) == 3 * n_train + n_frozen
    assert_close(end_b, end_a, 1e-6, "2-rank resume: masters and Adam states")
    swap = world["swap"]
    assert not os.listdir(swap) if os.path.isdir(swap) else True


def test_two_rank_checkpoint_layout(world):
    """Both ranks wrote pieces; the tensors are whole and unpadded (same names and shapes
    as a 1-process checkpoint, values equal up to reduction-order rounding)."""
    full2, r = ckpt_tensors(world["dirs"]["ck2"])
    assert r.world_size == 2 and r.meta["world_size"] == 2 and r.meta["zero_stage"] == 3
    assert len(r.meta["rng_ranks"]) == 2
    files = os.listdir(os.path.join(world["dirs"]["ck2"], "step-3"))
    assert any(f.startswith("rank0-") for f in files) and any(f.startswith("rank1-") for f in files)
    split = [n for n, t in r.manifest["tensors"].items() if len(t["pieces"]) > 1]
    assert split, "no tensor crosses the shard boundary: the test model is too regular"
    full1, r1 = ckpt_tensors(world["dirs"]["ck1"])
    assert r1.world_size == 1 and r1.meta["rng_ranks"] is None
    assert {n: t.shape for n, t in full2.items()} == {n: t.shape for n, t in full1.items()}
    assert_close(full2, full1, 1e-5, "2-rank vs 1-process checkpoint after 3 steps")


def test_two_rank_checkpoint_loads_in_one_process_with_cpu_offload(world):
    a, one = world["r0"]["a"], world["from2"]
    assert one["meta_step"] == 3
    assert_losses(one["losses"], a["losses"][3:], 1e-5)
    assert_close(one["state"], rank0_state(world["tmp"], "a"), 1e-5,
                 "2 ranks (stage 3, NVMe) -> 1 process (CPU): final parameters")


def test_one_process_checkpoint_loads_on_two_ranks(world):
    ref, rf = world["one"], world["r0"]["from1"]
    assert rf["meta_step"] == 3
    assert_losses(rf["losses"], ref["losses"][3:], 1e-5)
    assert_close(rank0_state(world["tmp"], "from1"), ref["state"], 1e-5,
                 "1 process (CPU) -> 2 ranks (stage 3, NVMe): final parameters")


def test_load_failing_on_one_rank_fails_every_rank_unchanged(world):
    for rank, runs in enumerate(world["ranks"]):
        bad = runs["bad"]
        assert bad["load_error"] and bad["unchanged"], (rank, bad)
        assert bad["load_error"].startswith("CheckpointError"), bad
    assert "another rank" in world["ranks"][0]["bad"]["load_error"]
    assert "does not exist" in world["ranks"][1]["bad"]["load_error"]


def test_corruption_seen_by_one_rank_fails_every_rank_unchanged(world):
    """Ranks hash disjoint shares of the files (here: one file, rank 0's share); the
    corruption found by one rank fails the load everywhere before anything changed."""
    from infinity.engine.checkpoint_state import hash_share
    with CheckpointReader(world["dirs"]["bad1"]) as r:
        files = r.manifest["files"]
    shares = [hash_share(files, k, 2) for k in range(2)]
    assert shares == [sorted(files), []]
    errs = [runs["corrupt"]["load_error"] for runs in world["ranks"]]
    assert all(runs["corrupt"]["unchanged"] for runs in world["ranks"])
    assert "SHA-256 mismatch" in errs[0] and "another rank" in errs[1], errs


def test_hash_share_balances_and_covers_every_file():
    from infinity.engine.checkpoint_state import hash_share
    files = {f"rank{i % 3}-{i:05d}.safetensors": {"size": s}
             for i, s in enumerate([10, 500, 7, 7, 300, 200, 1])}
    shares = [hash_share(files, k, 3) for k in range(3)]
    assert sorted(sum(shares, [])) == sorted(files)
    loads = sorted(sum(files[n]["size"] for n in sh) for sh in shares)
    assert loads == [225, 300, 500]


def test_each_rank_gets_its_own_rng_state_back(world):
    """Ranks draw from different streams; after a load each is where it was at the save."""
    at_save = [runs["a"]["rng_at_save"] for runs in world["ranks"]]
    assert at_save[0] != at_save[1]
    assert [runs["b"]["rng_after_load"] for runs in world["ranks"]] == at_save
    assert world["from2"]["rng_after_load"] == at_save[0]        # 1 process: rank 0's
    one_at_save = world["one"]["rng_at_save"]
    assert [runs["from1"]["rng_after_load"] for runs in world["ranks"]] == [one_at_save] * 2


def test_stage2_checkpoint_export_gives_gathered_weights(world, tmp_path):
    """Stage 2 with CPU optimizer offload saved on 2 ranks; ``infinity export`` of it."""
    from infinity.cli.main import main as cli
    ck, out = world["dirs"]["ck_s2"], tmp_path / "export"
    assert cli(["export", ck, str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    gathered = rank0_state(world["tmp"], "s2")
    assert set(exported) == set(gathered)
    for k, v in gathered.items():
        assert torch.equal(exported[k], v), k
    with CheckpointReader(ck) as r:
        assert r.world_size == 2 and r.meta["zero_stage"] == 2
        frozen = r.manifest["tensors"]["frozen.weight"]["pieces"]
        assert [pc["rank"] for pc in frozen] == [0]   # complete on every rank: rank 0 writes it


@pytest.mark.slow
@pytest.mark.parametrize("stage,offload,precision", [
    (1, "cpu", "fp32"), (2, "nvme", "fp32"), (3, "cpu", "fp32"),
    (1, "cpu", "bf16"), (2, "cpu", "bf16"), (3, "nvme", "bf16"), (3, "cpu", "bf16")])
def test_two_rank_resume_matrix(tmp_path, stage, offload, precision):
    """Every stage, both optimizer homes, fp32 and bf16: save on 2 ranks, continue ==
    fresh 2-rank engines load and continue; the checkpoint also loads in 1 process."""
    swap = str(tmp_path / "swap")
    cfg = config(stage, offload, swap, precision)
    ck = str(tmp_path / "ck")
    res = ranks([
        {"name": "a", "config": cfg, "seed": 1234, "start": 0, "steps": 5,
         "save": [{"after": 2, "dir": ck}, {"after": 5, "dir": str(tmp_path / "endA")}]},
        {"name": "b", "config": cfg, "seed": 3, "start": 2, "steps": 3, "load": ck,
         "save": [{"after": 3, "dir": str(tmp_path / "endB")}]}], tmp_path)
    a, b = res[0].result["runs"]["a"], res[0].result["runs"]["b"]
    assert_losses(b["losses"], a["losses"][2:], 1e-6)
    assert_close(rank0_state(tmp_path, "b"), rank0_state(tmp_path, "a"), 1e-6, "final params")
    end_a, _ = ckpt_tensors(str(tmp_path / "endA"))
    end_b, _ = ckpt_tensors(str(tmp_path / "endB"))
    assert_close(end_b, end_a, 1e-6, "masters and Adam states")
    one = in_process({"name": "one", "config": config(3, "nvme", swap, precision), "seed": 8,
                      "start": 2, "steps": 3, "load": ck})
    tol = 1e-5 if precision == "fp32" else 2e-2    # bf16 compute: rounding of a different sum
    assert_losses(one["losses"], a["losses"][2:], tol)
    assert_close(one["state"], rank0_state(tmp_path, "a"), tol, "2 ranks -> 1 process")


@pytest.mark.slow
def test_finetune_torchrun_two_ranks_save_and_resume(tmp_path):
    """`infinity finetune --save` then `--resume` under torchrun at 2 ranks continues the
    loss curve of an uninterrupted 2-rank run exactly."""
    import json
    import subprocess
    import sys
    tiny = dict(model_type="llama", vocab_size=264, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=128, tie_word_embeddings=False, use_cache=False)
    (tmp_path / "tiny.json").write_text(json.dumps(tiny))
    env = dict(os.environ, PYTHONPATH=str(harness.REPO), OMP_NUM_THREADS="1")

    def run(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "-m", "infinity", "finetune", "--model", "tiny.json", "--seq-len", "64", "--json",
               "--batch-tokens", "128", "--nvme-path", str(tmp_path / "swap"), *args]
        p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        return [json.loads(ln)["loss"] for ln in p.stdout.splitlines()]

    straight = run("--steps", "6")
    ck = str(tmp_path / "ck")
    assert run("--steps", "3", "--save", ck) == straight[:3]
    assert run("--steps", "6", "--save", ck, "--resume") == straight[3:]
    with CheckpointReader(ck) as r:
        assert r.tag == "step-00000006" and r.world_size == 2
