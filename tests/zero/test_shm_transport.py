"""The shared-memory transport between the ranks of one machine
(infinity/zero/shm_transport.py): collectives equal to their definition over several
pieces per collective, async operations in flight on both channels, nothing left in
/dev/shm, off across (pretend) nodes and with ``intra_node_transport: process_group``,
and a failing rank ends the others clearly."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_stages import BATCH, STEPS, base_config, check_run  # noqa: E402
from zero_harness import rank0_prefix, run_ranks, run_ranks_ok  # noqa: E402


def _checks_pass(res):
    for r in res:
        bad = [k for k, ok in r.result["checks"].items() if not ok]
        assert not bad, f"rank {r.rank}: {bad}"
        assert not r.result["leftover"], "the slots' directory was left in /dev/shm"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_their_definition_across_pieces(tmp_path, world_size):
    # a 4 KiB slot: the larger collectives take many pieces (and both parities)
    res = run_ranks_ok("shm_child.py", {"transport": "auto", "slot_bytes": 4096}, tmp_path,
                       world_size=world_size, timeout=180)
    assert all(r.result["shm"] for r in res)
    _checks_pass(res)


def test_process_group_transport_and_several_nodes_keep_gloo(tmp_path):
    res = run_ranks_ok("shm_child.py", {"transport": "process_group"}, tmp_path, timeout=120)
    assert not any(r.result["shm"] for r in res)
    _checks_pass(res)
    # two pretend nodes of one rank each: no shared memory between them
    res = run_ranks_ok("shm_child.py", {"transport": "auto"}, tmp_path, timeout=120,
                       local_world_size=1)
    assert not any(r.result["shm"] for r in res)
    _checks_pass(res)


def test_a_full_dev_shm_on_one_rank_keeps_every_rank_on_gloo(tmp_path):
    """The slots are reserved up front; one rank that cannot (its /dev/shm too small, as
    in a container's 64 MB default) turns the transport off on every rank, and the
    collectives still give the right results over the process group."""
    res = run_ranks_ok("shm_child.py", {"transport": "auto", "tiny_shm_rank": 1}, tmp_path,
                       timeout=120)
    assert not any(r.result["shm"] for r in res)
    _checks_pass(res)
    assert "shm transport: off" in res[1].stderr and "MiB free" in res[1].stderr, res[1]


def test_a_failing_rank_ends_the_others_with_a_collective_error(tmp_path):
    res = run_ranks("shm_child.py", {"transport": "auto", "fail_rank": 1, "timeout_s": 8},
                    tmp_path, timeout=120)
    assert res[1].returncode != 0 and "injected failure on rank 1" in res[1].stderr
    assert res[0].returncode not in (0, None) and "killed after" not in res[0].stderr, res[0]
    assert "CollectiveError" in res[0].stderr and "[shm]" in res[0].stderr, res[0]


def test_engine_parity_through_shared_memory_at_every_stage(tmp_path):
    """Training through the shared-memory transport (the default on one machine) equals
    single-process torch AdamW (1e-5) at stages 1-3, and at 2 ranks is bit-identical to
    the same run over gloo (a sum of two terms does not depend on their order)."""
    runs = []
    for stage, home, extra in ((1, "cpu", {"gradient_accumulation_steps": 2}),
                               (2, "nvme", {"gradient_clipping": 3.0}),
                               (3, "cpu", {"gradient_clipping": 3.0})):
        for transport in ("auto", "process_group"):
            name = f"s{stage}-{home}-{transport}"
            cfg = base_config(stage, home, str(tmp_path / f"swap-{name}"),
                              intra_node_transport=transport, **extra)
            runs.append({"name": name, "model": "awkward", "steps": STEPS, "batch": BATCH,
                         "config": cfg, "env": {"INFINITY_SIMULATE_DEVICE": "0"}})
    res = run_ranks_ok("dist_child.py", {"runs": runs}, tmp_path, world_size=2, timeout=900)
    prefix = rank0_prefix(tmp_path)
    for run in runs:
        if run["name"].endswith("auto"):
            check_run(res, prefix, run["name"], run["config"])
    for r in res:
        for stage, home in ((1, "cpu"), (2, "nvme"), (3, "cpu")):
            shm = r.result["runs"][f"s{stage}-{home}-auto"]
            pg = r.result["runs"][f"s{stage}-{home}-process_group"]
            assert shm["shm_transport"] and not pg["shm_transport"], (stage, r.rank)
            # the placement plan counts the slot pages this rank touches
            assert shm["shm_plan_bytes"] > 0 and pg["shm_plan_bytes"] == 0, (stage, r.rank)
            assert shm["losses"] == pg["losses"], (stage, r.rank, shm["losses"], pg["losses"])


def test_zeropp_on_one_machine_goes_through_shared_memory(tmp_path):
    """qwZ's int8 all-gather and qgZ at 2 ranks of one machine (no LOCAL_WORLD_SIZE: one
    node): the same losses and parameters as over gloo."""
    zpp = {"quantized_weights": True, "quantized_gradients": True}
    runs = [{"name": t, "steps": 3, "hash": True,
             "config": {"precision": "bf16", "zero_stage": 3, "dist_timeout_s": 60,
                        "zero_pp": zpp, "intra_node_transport": t}}
            for t in ("auto", "process_group")]
    res = run_ranks_ok("zeropp_child.py", {"runs": runs, "batch": 4, "seq": 16}, tmp_path,
                       world_size=2, timeout=600)
    for r in res:
        got = r.result["runs"]
        assert got["auto"]["shm_transport"] and not got["process_group"]["shm_transport"]
        assert got["auto"]["losses"] == got["process_group"]["losses"], r.rank
        assert got["auto"]["params_sha"] == got["process_group"]["params_sha"], r.rank


def test_engine_parity_through_shared_memory_at_3_ranks(tmp_path):
    """An odd world size (shards padded, sub-slots of a third of the slot): stage 3 with
    NVMe homes, accumulation and clipping equals single-process torch AdamW."""
    cfg = base_config(3, "nvme", str(tmp_path / "swap"), gradient_accumulation_steps=2,
                      gradient_clipping=3.0)
    runs = [{"name": "s3", "model": "awkward", "steps": STEPS, "batch": 6, "config": cfg,
             "env": {"INFINITY_SIMULATE_DEVICE": "0"}}]
    res = run_ranks_ok("dist_child.py", {"runs": runs}, tmp_path, world_size=3, timeout=900)
    prefix = rank0_prefix(tmp_path)
    assert all(r.result["runs"]["s3"]["shm_transport"] for r in res)
    check_run(res, prefix, "s3", cfg, batch=6)
