"""Memory-centric tiling at ZeRO world size > 1 (Note [Tiles across ranks] in
infinity/zero/partitioned_memory.py, Note [Tile gradients across ranks] in
partitioned_grads.py): at stage 3 a tiled Linear, Embedding and tied embedding / LM
head train like single-process torch AdamW on the global batch (fp32, < 1e-5), with the
tiles really used (``tiles_forward`` / ``tiles_backward`` / ``tile_gathers`` > 0 on every
rank), the ranks' lookups touching different embedding tiles, and the device working set
bounded by the tile, not the largest group.  Stages 1-2 keep parameters on the device
(``offload.params`` needs stage 3), so nothing is paged and nothing is tiled there: checked
too."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import run_ranks_ok  # noqa: E402

LIMIT_GB = 40e3 / 1e9          # the tiling limit: every layer of tile_child.TileLM but the norm
SIM = {"INFINITY_SIMULATE_DEVICE": "1"}
NOSIM = {"INFINITY_SIMULATE_DEVICE": "0"}


def _cfg(stage, home, swap, *, gas=1, clip=0.0, budget_gb=None):
    off = {"params": home if stage == 3 else "none", "optimizer": "cpu" if home == "none"
           else home, "nvme_paths": [swap]}
    if budget_gb is not None:
        off["device_memory_gb"] = budget_gb
    cfg = {"zero_stage": stage, "precision": "fp32", "dist_timeout_s": 60,
           "prefetch": {"depth": 2}, "offload": off,
           "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.05, "no_decay": []},
           "gradient_accumulation_steps": gas, "gradient_clipping": clip}
    if budget_gb is None:
        cfg["tiling"] = {"max_group_gb": LIMIT_GB}
    return cfg


def _runs(tmp_path, combos):
    """``(stage, home, model, flags)``; flags: gas, clip, sim, budget, spill (gradient
    shards spilled to NVMe: needs home nvme)."""
    runs = []
    for stage, home, model, *flags in combos:
        flags = set(flags)
        name = "-".join([f"s{stage}", home, model] + sorted(flags))
        cfg = _cfg(stage, home, str(tmp_path / f"swap-{name}"),
                   gas=2 if "gas" in flags else 1, clip=0.5 if "clip" in flags else 0.0,
                   budget_gb=160e3 / 1e9 if "budget" in flags else None)
        runs.append({"name": name, "model": model, "steps": 3, "config": cfg,
                     "env": SIM if "sim" in flags else NOSIM, "stage": stage,
                     "spill": "spill" in flags})
    return runs


def _check(tmp_path, combos, world_size):
    runs = _runs(tmp_path, combos)
    res = run_ranks_ok("tile_child.py", {"runs": runs}, tmp_path, world_size=world_size,
                       timeout=900)
    for run in runs:
        for r in res:
            got = r.result["runs"][run["name"]]
            where = f"{run['name']} rank {r.rank}"
            assert got["loss_err"] < 1e-5, (where, got["loss_err"])
            assert got["param_err"] < 1e-5, (where, got["param_err"])
            assert got["state_dict_matches"], where
            s = got["stats"]
            if run["stage"] < 3:
                # parameters stay on the device at stages 1-2: nothing paged, nothing tiled
                assert got["tiled"] == [] and s.get("tiles_forward", 0) == 0, where
                continue
            want = ["down", "emb", "head", "up"]
            assert got["tiled"] == want, (where, got["tiled"])
            assert s.get("tiles_forward", 0) > 0 and s.get("tiles_backward", 0) > 0, where
            assert s.get("tile_gathers", 0) > 0, where
            if run["model"] == "tied":                # the pair shares the rows per tile
                assert got["rows"]["emb"] == got["rows"]["head"], (where, got["rows"])
    return res


def test_tiling_zero3_default_slice(tmp_path):
    """2 ranks, stage 3: tied pair on NVMe homes with accumulation and clipping; untied
    (Linear head with bias, padding row) on cpu homes; the tied pair with the gradient
    shards spilled to NVMe (the 1T plan's configuration) and accumulation."""
    _check(tmp_path, [(3, "nvme", "tied", "gas", "clip"), (3, "cpu", "untied"),
                      (3, "nvme", "tied", "gas", "spill")], 2)


def test_tiling_zero3_recompute_keeps_its_tiles(tmp_path):
    """2 ranks, stage 3, NVMe homes, the MLP checkpointed: its recompute keeps the tiles it
    gathered and the backward gathers none of them again (Note [Recompute keeps its tiles]:
    every rank keeps the same tiles, so the gathers stay in step); parity with PyTorch."""
    res = _check(tmp_path, [(3, "nvme", "ckpt", "gas")], 2)
    for r in res:
        s = r.result["runs"]["s3-nvme-ckpt-gas"]["stats"]
        assert s.get("tiles_reused_from_recompute", 0) > 0, (r.rank, s)
        assert s["tiles_reused_from_recompute"] == s["tiles_kept_for_backward"], (r.rank, s)


def test_tiling_zero3_device_working_set_bounded_by_the_tile(tmp_path):
    """2 ranks, stage 3, NVMe homes, tiling limit from ``device_memory_gb`` (160 kB at depth
    2: 40 kB): no overflow of the device budget, and the device peak stays below the largest
    group (the tiles are what the device holds)."""
    res = _check(tmp_path, [(3, "nvme", "tied", "budget")], 2)
    for r in res:
        got = r.result["runs"]["s3-nvme-tied-budget"]
        s = got["stats"]
        assert s.get("device_budget_overflows", 0) == 0, (r.rank, s)
        # the window an untiled fetch of the largest group needs does not fit the budget
        assert s["device_peak_bytes"] <= 160e3 < 4 * got["largest_group"], \
            (r.rank, s["device_peak_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("sim", [False, True], ids=["cpu-tier", "simulated-device"])
def test_tiling_zero_matrix_2_ranks(tmp_path, sim):
    flags = ("sim",) if sim else ()
    combos = []
    for model in ("tied", "untied"):
        for home in ("cpu", "nvme"):
            combos.append((3, home, model, "gas", *flags))
        combos.append((3, "nvme", model, "clip", *flags))
        combos.append((3, "nvme", model, "gas", "spill", *flags))
        for stage in (1, 2):
            combos.append((stage, "cpu", model, "gas", *flags))
    _check(tmp_path, combos, 2)


@pytest.mark.slow
def test_tiling_zero3_4_ranks(tmp_path):
    """4 ranks: tiles span up to three shards; the lookups of ranks 0-1 and 2-3 touch
    different tiles."""
    _check(tmp_path, [(3, "nvme", "tied", "gas", "clip"), (3, "cpu", "untied", "sim")], 4)
