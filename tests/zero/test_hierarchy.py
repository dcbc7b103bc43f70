"""Node topology from LOCAL_WORLD_SIZE and the byte-counting convention (pure arithmetic)."""
import pytest

from infinity.zero.hierarchy import Topology, env_local_world_size


def test_groups_of_two_nodes_by_two():
    t = Topology(rank=3, world_size=4, local_size=2)
    assert (t.nodes, t.node, t.local_rank) == (2, 1, 1)
    assert t.intra_groups() == [[0, 1], [2, 3]]
    assert t.inter_groups() == [[0, 2], [1, 3]]
    assert t.blocks(2) == [[0, 1], [2, 3]] and t.blocks(4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="hpz_partition_size=3 must divide the world size 4"):
        t.blocks(3)


def test_counting_convention():
    t = Topology(rank=0, world_size=8, local_size=4)
    # an all-gather over the world: the shard to 7 peers, 4 of them on the other node
    assert t.sent_all_gather(100) == (700, 400)
    # within the node: nothing leaves it
    assert t.sent_all_gather(100, [0, 1, 2, 3]) == (300, 0)
    assert t.sent_reduce_scatter(10, [0, 4]) == (10, 10)
    one = Topology(rank=2, world_size=4, local_size=4)
    assert one.sent_all_gather(5) == (15, 0)


def test_env(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert env_local_world_size(8) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert env_local_world_size(8) == 2
    assert Topology.from_env(5, 8).node == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide the world size 8"):
        env_local_world_size(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="not an integer"):
        env_local_world_size(8)
