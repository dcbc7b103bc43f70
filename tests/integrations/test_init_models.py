"""Models bigger than RAM: a model built under infinity.Init from a local pretrained directory
(infinity.integrations.transformers.from_pretrained) trains under InfinityTrainer like the
eagerly loaded model under the plain Trainer; infinity.GatheredParameters +
resize_token_embeddings on an Init-built model."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402

transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from infinity.zero.init import is_managed  # noqa: E402


def _init_cfg(swap_dir):
    return {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir]}}


@pytest.mark.parametrize("model_fn", [H.gpt2, H.llama], ids=["gpt2-tied", "llama-untied"])
def test_gathered_parameters_resize_token_embeddings(swap_dir, model_fn):
    eager = model_fn()
    torch.manual_seed(5)
    eager.resize_token_embeddings(H.VOCAB + 6, mean_resizing=False)
    with infinity.Init(_init_cfg(swap_dir)):
        model = model_fn()
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert is_managed(emb.weight)
    # read only (modifier_rank=None): writes are discarded
    with infinity.GatheredParameters([emb.weight], modifier_rank=None):
        first = emb.weight.data[0].clone()
        assert torch.isfinite(emb.weight.data).all()
        emb.weight.data.zero_()
    with infinity.GatheredParameters([emb.weight], modifier_rank=None):
        assert torch.equal(emb.weight.data[0], first)
    torch.manual_seed(5)
    with infinity.GatheredParameters([emb.weight, head.weight], modifier_rank=0):
        model.resize_token_embeddings(H.VOCAB + 6, mean_resizing=False)
    assert tuple(model.get_input_embeddings().weight.shape) == (H.VOCAB + 6, 32)
    assert is_managed(model.get_input_embeddings().weight)
    assert model.get_input_embeddings().weight.data.stride() == (0, 0)   # still offloaded
    assert model.config.vocab_size == H.VOCAB + 6
    with infinity.initialize(model, _init_cfg(swap_dir)) as eng:
        got = dict(eng.state_dict())
        want = eager.state_dict()
        for k, v in want.items():
            if k in got:
                assert torch.equal(got[k], v), k
        ids = torch.tensor([[1, H.VOCAB + 3, 2, H.VOCAB + 5]])
        eng.eval()
        eager.eval()
        with torch.no_grad():
            a = model(ids).logits
            b = eager(ids).logits
        assert a.shape[-1] == H.VOCAB + 6
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gathered_parameters_reads_engine_held_params(swap_dir, precision):
    """Parameters an engine holds (released to placeholders between steps): modifier_rank=None
    gathers their current values (what engine.state_dict() gives) and discards writes;
    modifier_rank=0 stores them."""
    from infinity.memory.record import is_placeholder
    model = H.gpt2()
    cfg = dict(_init_cfg(swap_dir), precision=precision)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with infinity.initialize(model, cfg) as eng:
        loss = model(ids, labels=ids).loss
        eng.backward(loss)
        eng.step()                                           # the values moved off the init
        wte, head_b = model.transformer.wte.weight, model.transformer.h[1].mlp.c_fc.bias
        assert is_placeholder(wte.data) and is_placeholder(head_b.data)
        want = {n: eng.state_dict()[n] for n in ("transformer.wte.weight",
                                                  "transformer.h.1.mlp.c_fc.bias")}
        with torch.no_grad():
            before = model(ids).logits.clone()
        with infinity.GatheredParameters([wte, head_b], modifier_rank=None):
            assert not is_placeholder(wte.data) and wte.data.dtype == wte.dtype
            assert torch.equal(wte.data.float(), want["transformer.wte.weight"].to(wte.dtype).float())
            assert torch.equal(head_b.data.float(),
                               want["transformer.h.1.mlp.c_fc.bias"].to(wte.dtype).float())
            wte.data.zero_()                                 # discarded
        assert is_placeholder(wte.data) and is_placeholder(head_b.data)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before)    # the engine still trains on
        assert torch.equal(eng.state_dict()["transformer.wte.weight"],
                           want["transformer.wte.weight"])
        # modifier_rank=0: stored into the engine (tests/engine/test_gathered_write.py)
        with infinity.GatheredParameters([head_b], modifier_rank=0):
            head_b.data.fill_(0.25)
        assert is_placeholder(head_b.data)
        got = eng.state_dict()["transformer.h.1.mlp.c_fc.bias"]
        assert torch.equal(got, torch.full_like(got, 0.25))
        eng.backward(model(ids, labels=ids).loss)            # and trains on
        assert eng.step()
    plain = H.gpt2()
    with infinity.GatheredParameters(plain.parameters(), modifier_rank=0):  # no-op
        pass


def test_init_from_pretrained_trains_like_the_eager_model(tmp_path, swap_dir):
    """save a (trained-looking) tiny Llama to a local directory; build it under Init with
    infinity.integrations.transformers.from_pretrained (weights streamed tensor by tensor
    into their NVMe homes) and train it with InfinityTrainer: the plain Trainer on the
    eagerly loaded model gives the same losses."""
    from infinity.integrations.transformers import InfinityTrainer, from_pretrained
    src = H.llama(seed=3)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01 * torch.randn_like(p))   # not what a fresh init would give
    src.save_pretrained(str(tmp_path / "pretrained"))
    cfg = _init_cfg(swap_dir)
    model = from_pretrained(tmp_path / "pretrained", cfg)
    assert all(is_managed(p) for p in model.parameters())     # never whole in memory
    eager = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "pretrained"))
    ref = transformers.Trainer(model=eager, args=H.args(tmp_path / "ref", max_steps=4),
                               train_dataset=H.TokenData())
    ref.train()
    tr = InfinityTrainer(model=model, args=H.args(tmp_path / "inf", max_steps=4),
                         train_dataset=H.TokenData(), eval_dataset=H.TokenData(4, seed=8),
                         infinity_config=cfg)
    try:
        before = tr.evaluate()["eval_loss"]        # evaluation before training: engine made
        assert before == pytest.approx(transformers.Trainer(
            model=transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "pretrained")),
            args=H.args(tmp_path / "ev"), eval_dataset=H.TokenData(4, seed=8)
        ).evaluate()["eval_loss"], rel=1e-5)
        tr.train()
        a, b = H.losses(tr), H.losses(ref)
        assert len(a) == 4 and all(abs(x - y) / y < 1e-5 for x, y in zip(a, b)), (a, b)
    finally:
        tr.close()
