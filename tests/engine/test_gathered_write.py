"""``infinity.GatheredParameters(params, modifier_rank=0)`` on parameters an engine holds:
the edit is stored into the engine (fp32 master + home, Adam moments kept), so training on
matches plain PyTorch + torch.optim.AdamW with the same edit made to ``p.data`` between
steps.  (World size 2: tests/integrations/test_torchrun.py::test_gathered_write_two_ranks.)"""
import pytest
import torch

import infinity
from infinity.memory.record import is_placeholder

# "none": the parameters stay resident (not released), the bf16 engine's fp32 master apart
CASES = [("cpu", "fp32"), ("nvme", "fp32"), ("nvme", "bf16"), ("cpu", "bf16"), ("none", "bf16")]


def _edit(model, gen):
    """The edit made inside the block (and to the reference): a new token row of the tied
    embedding, a scaled Linear, a frozen norm's weight."""
    with torch.no_grad():
        model.tok.weight.data[5] = torch.randn(model.tok.weight.shape[1], generator=gen)
        model.blocks[0].fc1.weight.data.mul_(0.5)
        model.ln_f.weight.data.fill_(1.5)


def _params(model):
    return [model.tok.weight, model.blocks[0].fc1.weight, model.ln_f.weight]


@pytest.mark.parametrize("params,prec", CASES)
def test_modifier_rank_writes_into_the_engine_like_torch(harness, swap_dir, params, prec):
    torch.manual_seed(0)
    ref = harness.TinyCausalLM()
    ref.ln_f.weight.requires_grad_(False)                  # a frozen parameter too
    model = harness.copy(ref)
    batches = harness.make_batches("lm", 8)
    first, second = batches[:4], batches[4:]
    cfg = {"precision": prec,
           "offload": {"params": params, "optimizer": params, "nvme_paths": [swap_dir]},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
           "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)

    def ref_steps(bs):
        for i, b in enumerate(bs):
            (harness.loss_of("lm", ref(b), b) / 2).backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

    ref_steps(first)
    _edit(ref, torch.Generator().manual_seed(7))
    tol = 1e-5 if prec == "fp32" else 3e-2
    with infinity.initialize(model, cfg) as eng:
        harness.engine_run(eng, "lm", first)
        released = params != "none"
        assert all(is_placeholder(p.data) == released for p in _params(model) if p.requires_grad)
        with infinity.GatheredParameters(_params(model), modifier_rank=0):
            assert not any(is_placeholder(p.data) for p in _params(model))
            _edit(model, torch.Generator().manual_seed(7))
        assert all(is_placeholder(p.data) == released for p in _params(model) if p.requires_grad)
        sd = eng.state_dict()
        # what the engine now holds is the edit made to its values
        assert torch.equal(sd["ln_f.weight"], torch.full_like(sd["ln_f.weight"], 1.5))
        assert harness.param_rel_err(ref, eng) < tol
        if prec == "fp32":      # the master is the edited value itself, not a rounded copy
            assert torch.equal(sd["tok.weight"][5], ref.tok.weight[5].detach())
        with torch.no_grad():
            got, want = eng(second[0]).float(), ref(second[0]).float()
        assert float((got - want).norm() / want.norm()) < tol       # forward sees the edit
        harness.engine_run(eng, "lm", second)
        ref_steps(second)
        # Adam moments kept (a reset or a stale master would leave this trajectory)
        assert harness.param_rel_err(ref, eng) < tol
        assert eng.stats()["step"] == 4


def test_modifier_rank_refuses_a_new_shape_and_stores_nothing(harness, swap_dir):
    torch.manual_seed(0)
    model = harness.TinyCausalLM()
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir]}}
    with infinity.initialize(model, cfg) as eng:
        before = {k: v.clone() for k, v in eng.state_dict().items()}
        w, b = model.blocks[1].fc2.weight, model.blocks[1].fc2.bias
        with pytest.raises(ValueError, match=r"blocks\.1\.fc2\.weight of shape \(32, 128\).*"
                                             r"given shape \(32, 129\).*before infinity.initialize"):
            with infinity.GatheredParameters([b, w], modifier_rank=0):
                b.data.fill_(3.0)
                w.data = torch.zeros(32, 129)
        assert is_placeholder(w.data) and is_placeholder(b.data)
        after = eng.state_dict()
        for k, v in before.items():
            assert torch.equal(after[k], v), k                   # not even the bias
        with pytest.raises(ValueError, match="modifier_rank=1 but the engine .* 1 rank"):
            with infinity.GatheredParameters([w], modifier_rank=1):
                pass
        with pytest.raises(RuntimeError, match="boom"):        # an error inside: nothing stored
            with infinity.GatheredParameters([b], modifier_rank=0):
                b.data.fill_(3.0)
                raise RuntimeError("boom")
        assert torch.equal(eng.state_dict()["blocks.1.fc2.bias"], before["blocks.1.fc2.bias"])
