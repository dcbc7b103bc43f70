"""Memory-centric tiling (infinity/runtime/tiling.py): an nn.Linear whose group is larger
than the tiling limit is computed tile by tile (never fetched whole) and trains exactly like
plain PyTorch + torch.optim.AdamW; the rule only triggers above the limit."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import infinity
from infinity.config import ConfigError, InfinityConfig
from infinity.memory.record import Location


class Wide(nn.Module):
    """A first layer whose input needs no gradient, a bias-free middle layer and a head:
    the two wide layers are tiled under a 40 kB limit, the others are not."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(40, 300)                 # 12 300 floats: tiled
        self.b = nn.Linear(300, 64, bias=False)     # 19 200 floats: tiled
        self.c = nn.Linear(64, 8)                   # small: fetched whole

    def forward(self, x):
        return self.c(F.gelu(self.b(F.gelu(self.a(x)))))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 5, 40, generator=g), torch.randn(2, 5, 8, generator=g))
            for _ in range(n)]


def _cfg(swap_dir, home, limit_gb=40e3 / 1e9, **kw):
    c = {"offload": {"params": home, "optimizer": "cpu", "nvme_paths": [swap_dir]},
         "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []}, "gradient_clipping": 1.0,
         "gradient_accumulation_steps": 2, "tiling": {"max_group_gb": limit_gb}}
    c.update(kw)
    return c


def _train(eng, batches):
    """The engine's side of :func:`_ref`: the losses of an MSE step per batch."""
    losses = []
    for x, y in batches:
        loss = F.mse_loss(eng(x), y)
        losses.append(loss.item())
        eng.backward(loss)
        eng.step()
    return losses


def _ref(model, batches, accum=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for i, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(x), y)
        out.append(loss.item())
        (loss / accum).backward()
        if (i + 1) % accum == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return out


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_tiled_linear_trains_like_pytorch(harness, swap_dir, home):
    torch.manual_seed(0)
    ref = Wide()
    model = harness.copy(ref)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    batches = _batches(6)
    ref_l = _ref(ref, batches)
    with infinity.initialize(model, _cfg(swap_dir, home)) as eng:
        assert set(eng.tiling.specs) == {model.a, model.b}
        assert {s.rows for s in eng.tiling.specs.values()} == {144, 19}
        seen = []                                   # a tiled group is never fetched whole
        orig = eng.mm.wait_resident
        eng.mm.wait_resident = lambda g: (seen.append(g.gid), orig(g))[1]
        losses = _train(eng, batches)
        tiled = eng.tiling.gids
        assert not tiled & set(seen) and seen
        assert all(g.state is not Location.DEVICE for g in eng.mm.groups if g.gid in tiled)
        perr = harness.param_rel_err(ref, eng)
        sd = eng.state_dict()
        s = eng.stats()
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    # parameters keep their names and objects
    assert [n for n, _ in model.named_parameters()] == names
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert set(sd) == set(ref.state_dict())
    if home == "nvme":                              # the tiles were read from NVMe
        assert s["nvme_read_bytes"] > 0


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_tiled_forward_and_backward_match_untiled(harness, swap_dir, home):
    """One forward/backward: output and every gradient (read from the engine's gradient
    buffers) equal plain PyTorch's; the input gradient flows through the tiles."""
    torch.manual_seed(0)
    ref = Wide()
    cfg = _cfg(swap_dir, home, gradient_accumulation_steps=1, gradient_clipping=0.0)
    harness.one_backward_matches(ref, torch.randn(3, 40), cfg)


def test_tiling_off_below_the_limit(harness, swap_dir):
    """No limit (no device budget, no max_group_gb) or a limit above every group: nothing
    is tiled, the hooks fetch every group."""
    torch.manual_seed(0)
    for limit in (None, 1.0):
        with infinity.initialize(Wide(), _cfg(swap_dir, "cpu", limit_gb=limit)) as eng:
            assert eng.tiling is None


def test_tiling_limit_from_the_device_budget(harness, swap_dir):
    """Without max_group_gb the limit is device_memory_gb / (prefetch.depth + 2), and the
    plan's fetch window counts a tiled group's tile, not the group."""
    torch.manual_seed(0)
    cfg = _cfg(swap_dir, "nvme", limit_gb=None)
    cfg["offload"]["device_memory_gb"] = 160e3 / 1e9        # limit 40 kB at depth 2
    cfg["prefetch"] = {"depth": 2}
    model = Wide()
    with infinity.initialize(model, cfg) as eng:
        assert set(eng.tiling.specs) == {model.a, model.b}
        window = eng.placement.device["fetch window (largest group x (depth + 2))"]
        biggest = max(g.nbytes for g in eng.mm.groups)
        assert window < biggest * 4
        assert window == 4 * max(s.tile_bytes() for s in eng.tiling.specs.values())
        x, y = _batches(1)[0]
        eng.backward(F.mse_loss(eng(x), y))
        eng.step()
        s = eng.stats()
    assert s.get("device_budget_overflows", 0) == 0


def test_tiling_config_validated():
    assert InfinityConfig.load({"tiling": {"max_group_gb": 0.5}}).tiling.max_group_gb == 0.5
    assert InfinityConfig.load({}).tiling.max_group_gb is None
    for bad in (-1, 0, "big"):
        with pytest.raises(ConfigError, match="tiling.max_group_gb"):
            InfinityConfig.load({"tiling": {"max_group_gb": bad}})
    with pytest.raises(ConfigError, match="tiling.max_group"):
        InfinityConfig.load({"tiling": {"max_group": 1}})


class Lookup(nn.Module):
    """A wide embedding (tiled under a 40 kB limit) and a small head."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(1000, 16, padding_idx=padding_idx)   # 64 kB: tiled
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_tiled_embedding_trains_like_pytorch(harness, swap_dir, home):
    """Lookups touch only some tiles (indices below 700 of 1000 rows, tiles of 184): the
    untouched tiles are never read and their gradient rows are zero."""
    torch.manual_seed(0)
    ref = Lookup(padding_idx=3)
    model = harness.copy(ref)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 700, (3, 7), generator=g), torch.randn(3, 7, 4, generator=g))
               for _ in range(6)]
    batches[0][0][0, 0] = 3                          # the padding row gets no gradient
    ref_l = _ref(ref, batches)
    with infinity.initialize(model, _cfg(swap_dir, home)) as eng:
        (spec,) = eng.tiling.specs.values()
        assert spec.module is model.emb and spec.rows == 184      # 6 tiles, the last two untouched
        losses = _train(eng, batches)
        s = eng.stats()
        perr = harness.param_rel_err(ref, eng)
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    # each lookup touched at most 4 of the 6 tiles
    assert 0 < s["tiles_forward"] <= 4 * len(batches)


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_tied_embedding_and_lm_head_tiled_consistently(harness, swap_dir, home):
    """A tied token embedding / LM head (one group, two modules) is tiled as a pair with the
    same rows per tile, and trains like plain PyTorch (gradients of both uses summed)."""
    torch.manual_seed(0)
    ref = harness.TinyCausalLM(vocab=512, layers=2)
    model = harness.copy(ref)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 512, (2, 16), generator=g) for _ in range(4)]
    ref_l = harness.reference_run(ref, "lm", batches, accum=2)
    cfg = _cfg(swap_dir, home)
    with infinity.initialize(model, cfg) as eng:
        specs = eng.tiling.specs
        assert set(specs) == {model.tok, model.lm_head}
        assert specs[model.tok].rows == specs[model.lm_head].rows == 92
        assert specs[model.tok].weight[0] is specs[model.lm_head].weight[0]
        losses = harness.engine_run(eng, "lm", batches)
        perr = harness.param_rel_err(ref, eng)
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5


def test_whole_slot_fallback_trains_like_pytorch(harness, swap_dir):
    """Where gradients only leave as whole slots (the D2H route of separate device memory,
    the NVMe gradient home), a use's rows are assembled and accumulate() is called once per
    slot: forced here on the host route, the tied pair (two uses per step) included."""
    torch.manual_seed(0)
    ref = harness.TinyCausalLM(vocab=512, layers=1)
    model = harness.copy(ref)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 512, (2, 16), generator=g) for _ in range(4)]
    ref_l = harness.reference_run(ref, "lm", batches, accum=2)
    with infinity.initialize(model, _cfg(swap_dir, "cpu")) as eng:
        assert eng.tiling is not None
        eng.tiling.accepts_rows = lambda g: False
        losses = harness.engine_run(eng, "lm", batches)
        perr = harness.param_rel_err(ref, eng)
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_tiling_on_separate_device_memory(harness, swap_dir, home, monkeypatch):
    """The CUDA data path on the simulated device: each tile is copied H2D into a device
    lease (NVMe: through pinned staging), gradients leave by the D2H route (whole slots)."""
    monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    torch.manual_seed(0)
    ref = Wide()
    model = harness.copy(ref)
    batches = _batches(4)
    ref_l = _ref(ref, batches)
    with infinity.initialize(model, _cfg(swap_dir, home)) as eng:
        assert eng.mm.dev.kind == "simulated" and set(eng.tiling.specs) == {model.a, model.b}
        assert not eng.opt.grads.accumulates_rows(eng.tiling.specs[model.a].weight[0])
        losses = _train(eng, batches)
        perr = harness.param_rel_err(ref, eng)
        s = eng.stats()
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    assert s.get("device_budget_overflows", 0) == 0 and s["h2d_bytes"] > 0


def test_tiled_embedding_rejects_out_of_range_indices(harness, swap_dir):
    """As F.embedding: an index outside the table raises IndexError (a tile is never read
    from outside the weight's rows)."""
    model = Lookup()
    with infinity.initialize(model, _cfg(swap_dir, "cpu")) as eng:
        for bad in (1000, -1):
            with pytest.raises(IndexError, match="emb.weight.*1000 rows"):
                eng(torch.tensor([[0, bad]]))
        out = eng(torch.tensor([[0, 999]]))        # the engine is usable afterwards
        assert out.shape == (1, 2, 4) and torch.isfinite(out).all()


def test_next_tile_is_read_while_the_current_one_computes(harness, swap_dir):
    """Note [Tile prefetch]: with NVMe homes the read of tile i+1 is started before tile i
    is given back (two tiles leased at once, never more), forward and backward, and the
    run stays at parity with PyTorch."""
    torch.manual_seed(0)
    ref = Wide()
    model = harness.copy(ref)
    batches = _batches(2)
    ref_l = _ref(ref, batches)
    with infinity.initialize(model, _cfg(swap_dir, "nvme")) as eng:
        mm = eng.mm
        live, most = [0], [0]
        start, give_back = mm.read_range_start, mm.give_back_range

        def counting_start(g, lo, hi):
            live[0] += 1
            most[0] = max(most[0], live[0])
            return start(g, lo, hi)

        def counting_give_back(lease):
            if lease is not None:
                live[0] -= 1
            give_back(lease)
        mm.read_range_start, mm.give_back_range = counting_start, counting_give_back
        losses = _train(eng, batches)
        perr = harness.param_rel_err(ref, eng)
    # model.a: weight + bias rows per tile, two tiles in flight; nothing left leased
    assert most[0] == 4 and live[0] == 0
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
