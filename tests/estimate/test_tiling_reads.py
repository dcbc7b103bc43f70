"""The estimator's term for memory-centric tiling's NVMe reads: a tiled group is read at
every use (Linear / Conv1D twice, an Embedding lookup once, a tied embedding / LM head
three times) instead of twice per micro-batch, and with fp32 params on NVMe its master is
read at the step (no whole buffer to hand off).  The counts per use follow the runner in
infinity/runtime/tiling.py, checked against the engine in tests/engine/test_tiling*.py and
tools/validate_estimator.py --tiling."""
import pytest

from infinity.estimate import Machine, ModelSpec, estimate, spec_from_dims

GB = 1e9


def _spec():
    # a 40 000-element tied embedding / LM head (3 reads when tiled), two 30 000-element
    # Linears (2 reads), a 20 000-element Embedding alone (1 read), small rest
    return ModelSpec(params=150_000, layers=2, hidden=64, seq=16, batch=2, vocab=None, heads=2,
                     largest_group={"module": 40_000, "block": 70_000},
                     groups={"module": 6, "block": 3}, largest_untileable=128,
                     tileable=[[20_000, 1, 1], [30_000, 2, 2], [40_000, 3, 1]])


def _reads(spec, tile_gb, params="nvme", **kw):
    m = Machine(gpus=0, host_mem_gb=64, nvme_gb=100)
    est = estimate(spec, machine=m, precision="fp32", configs=[(params, "nvme")],
                   tiling_max_group_gb=tile_gb, **kw)
    return est.configs[0].steps["none"].traffic["nvme_read"]


def test_tiled_reads_per_use_and_master():
    spec = _spec()
    base = _reads(spec, None)
    # limit 25 000 fp32 elements: the three larger groups are tiled, the 20 000 one is not
    tiled = _reads(spec, 100_000 / GB)
    extra_uses = (3 - 2) * 40_000 * 4 + (2 - 2) * 2 * 30_000 * 4
    masters = (40_000 + 2 * 30_000) * 4           # handed off untiled, read when tiled
    assert tiled - base == extra_uses + masters
    # limit 10 000: the lone Embedding too, read once instead of twice
    assert _reads(spec, 40_000 / GB) - base == extra_uses + masters - 20_000 * 4 + 20_000 * 4
    # with clipping the untiled masters are handed off too (speculative early steps,
    # tests/engine/test_param_cache.py): the same difference
    clip = dict(gradient_clipping=1.0)
    assert _reads(spec, 100_000 / GB, **clip) - _reads(spec, None, **clip) == \
        extra_uses + masters
    # params in host memory: tiles are read there, no NVMe term
    assert _reads(spec, 100_000 / GB, params="cpu") == _reads(spec, None, params="cpu")


def test_tiling_reads_are_in_the_step_derivation():
    m = Machine(gpus=0, host_mem_gb=64, nvme_gb=100)
    est = estimate(_spec(), machine=m, precision="fp32", configs=[("nvme", "nvme")],
                   tiling_max_group_gb=100_000 / GB)
    s = est.configs[0].steps["none"]
    text = " ".join(s.fwd_bwd.derivation + s.optimizer.derivation)
    assert "tiled groups read at every use" in text and "master of tiled groups" in text


def test_spec_counts_tileable_groups_and_their_uses():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from infinity.estimate import spec_from_module
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    s = spec_from_module(model, seq=16)
    got = {(n, r): c for n, r, c in s.tileable}
    assert got[(512 * 64, 3)] == 1                # tied wte / lm_head: lookup + head fwd, bwd
    assert got[(32 * 64, 1)] == 1                  # wpe: a lookup
    assert got[(64 * 192 + 192, 2)] == 2           # Conv1D c_attn per layer
    assert got[(64 * 256 + 256, 2)] == 2 and got[(256 * 64 + 64, 2)] == 2
    assert s.largest_untileable == 2 * 64          # a LayerNorm: Conv1D counts as tileable
    assert s.tiled_groups("module", 20_000) == [[512 * 64, 3, 1]]
    assert s.tiled_groups("block", 20_000) == [] and s.tiled_groups("module", None) == []


def test_spec_from_dims_tileable():
    s = spec_from_dims(params=10_000_000, layers=2, hidden=256, vocab=1000)
    assert [256_000, 3, 1] in s.tileable
    assert [4 * 256 * 256 + 4 * 256, 2, 4] in s.tileable
