"""Memory-centric tiling of GPT-2's Conv1D (transformers.pytorch_utils.Conv1D: weight
stored (in, out), y = x @ W + b), by rows of the stored weight (input features): the
output, every gradient and AdamW training match plain PyTorch, alone and inside a real
(tiny) GPT-2 whose tied embedding / LM head is tiled too."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import infinity
from infinity.memory.record import Location

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

LIMIT_GB = 40e3 / 1e9          # 40 kB


class Convs(nn.Module):
    """A Conv1D whose input needs no gradient (weight 40 x 300, tiled), a second one
    (300 x 64, tiled) and a small Linear head (fetched whole)."""

    def __init__(self):
        super().__init__()
        self.a = Conv1D(300, 40)
        self.b = Conv1D(64, 300)
        self.c = nn.Linear(64, 8)
        for p in self.parameters():                 # Conv1D starts with a zero bias
            nn.init.normal_(p, std=0.1)

    def forward(self, x):
        return self.c(F.gelu(self.b(F.gelu(self.a(x)))))


def _cfg(swap_dir, home, **kw):
    c = {"offload": {"params": home, "optimizer": "cpu", "nvme_paths": [swap_dir]},
         "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []}, "gradient_clipping": 1.0,
         "gradient_accumulation_steps": 2, "tiling": {"max_group_gb": LIMIT_GB}}
    c.update(kw)
    return c


def test_conv1d_tile_plan(harness, swap_dir):
    """Rows of the stored weight per tile within the limit (the whole bias beside them:
    (40 000 - 4*4096 - 300*4) // (300*4) = 18; (40 000 - 4*4096 - 64*4) // (64*4) = 91)."""
    model = Convs()
    with infinity.initialize(model, _cfg(swap_dir, "cpu")) as eng:
        specs = eng.tiling.specs
        assert set(specs) == {model.a, model.b}
        assert (specs[model.a].rows, specs[model.b].rows) == (18, 91)
        assert all(s.tile_bytes() <= 40e3 for s in specs.values())
        assert "Conv1D a.weight (40 rows in tiles of 18)" in eng.tiling.describe()


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_tiled_conv1d_forward_and_backward_match_untiled(harness, swap_dir, home):
    torch.manual_seed(0)
    ref = Convs()
    cfg = _cfg(swap_dir, home, gradient_accumulation_steps=1, gradient_clipping=0.0)
    s = harness.one_backward_matches(ref, torch.randn(3, 5, 40), cfg)
    assert s["tiles_forward"] == 3 + 4 and s["tiles_backward"] == 3 + 4


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_tiled_conv1d_trains_like_pytorch(harness, swap_dir, home):
    torch.manual_seed(0)
    ref = Convs()
    model = harness.copy(ref)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 5, 40, generator=g), torch.randn(2, 5, 8, generator=g))
               for _ in range(6)]
    ref_l = harness.reference_run(ref, "mlp", batches, accum=2)
    with infinity.initialize(model, _cfg(swap_dir, home)) as eng:
        seen = []                                   # a tiled group is never fetched whole
        orig = eng.mm.wait_resident
        eng.mm.wait_resident = lambda g: (seen.append(g.gid), orig(g))[1]
        losses = harness.engine_run(eng, "mlp", batches)
        tiled = eng.tiling.gids
        assert not tiled & set(seen) and seen
        assert all(g.state is not Location.DEVICE for g in eng.mm.groups if g.gid in tiled)
        perr = harness.param_rel_err(ref, eng)
        s = eng.stats()
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    assert s["tiles_forward"] > 0
    if home == "nvme":
        assert s["nvme_read_bytes"] > 0


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_tiny_gpt2_tiled_trains_like_pytorch(harness, swap_dir, home):
    """Under a 40 kB limit GPT-2's c_attn (64 x 192), mlp.c_fc (64 x 256) and mlp.c_proj
    (256 x 64) Conv1Ds and the tied wte / lm_head are tiled; attn.c_proj (64 x 64) and wpe
    are not.  Losses and parameters after AdamW steps (clipping, accumulation 2) match."""
    torch.manual_seed(0)
    ref = _gpt2()
    model = harness.copy(ref)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 512, (2, 16), generator=g) for _ in range(4)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_l = []
    for i, ids in enumerate(batches):
        loss = ref(ids, labels=ids).loss
        ref_l.append(loss.item())
        (loss / 2).backward()
        if i % 2 == 1:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    with infinity.initialize(model, _cfg(swap_dir, home)) as eng:
        names = {s.weight[1].name for s in eng.tiling.specs.values()}
        want = {"transformer.wte.weight"} | {f"transformer.h.{i}.{m}.weight" for i in range(2)
                                             for m in ("attn.c_attn", "mlp.c_fc", "mlp.c_proj")}
        assert names == want
        losses = []
        for ids in batches:
            loss = eng(ids, labels=ids).loss
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
        perr = harness.param_rel_err(ref, eng)
        s = eng.stats()
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    assert s["tiles_forward"] > 0 and s["tiles_backward"] > 0
