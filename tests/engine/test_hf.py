"""Hugging Face models while offloaded: generate() on the original model object gives the
plain model's tokens; save_pretrained() is reloaded by transformers with the same logits."""
import os

import pytest
import torch

import infinity

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _cfg(swap_dir):
    return {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir]},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0}}


def test_generate_and_save_pretrained_roundtrip(tmp_path, swap_dir, harness):
    ref = _gpt2()
    model = harness.copy(ref)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(2):
        ref(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    prompt = ids[:1, :5]
    ref.eval()
    want = ref.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with infinity.initialize(model, _cfg(swap_dir)) as eng:
        for _ in range(2):
            eng.backward(eng(ids, labels=ids).loss)
            eng.step()
        eng.eval()
        got = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want), (got, want)
        files = eng.save_pretrained(str(tmp_path / "out"))
    assert "config.json" in files
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out"))
    loaded.eval()
    with torch.no_grad():
        a = loaded(ids).logits
        b = ref(ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-5


def test_save_pretrained_shards_with_index(tmp_path, swap_dir):
    import json
    from safetensors.torch import load_file
    model = _gpt2()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with infinity.initialize(model, _cfg(swap_dir)) as eng:
        files = eng.save_pretrained(str(tmp_path), max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in files
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(tmp_path / f)))
    assert set(got) == set(index["weight_map"])
    for k, v in got.items():
        assert torch.equal(v, want[k]), k
    assert "lm_head.weight" not in got or "transformer.wte.weight" not in got  # tied: once


def test_hf_gradient_checkpointing_with_nvme_params(swap_dir, harness):
    """HF's gradient_checkpointing_enable() (reentrant checkpoint by default) trains like
    the plain model. GPT-2's fused c_attn bias holds the key bias, whose gradient is ~0
    (softmax is invariant to it): Adam turns that rounding noise into lr-sized steps, so it
    is compared loosely; everything else at 1e-5."""
    ref = _gpt2()
    model = harness.copy(ref)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    ref_losses, losses = [], []
    for _ in range(3):
        loss = ref(ids, labels=ids).loss
        ref_losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    with infinity.initialize(model, _cfg(swap_dir)) as eng:
        for _ in range(3):
            loss = eng(ids, labels=ids).loss
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
        sd = eng.state_dict()
        s = eng.stats()
        errs = {n: float((sd[n] - p.detach()).norm() / p.detach().norm())
                for n, p in ref.named_parameters()}
    assert harness.rel_err(losses, ref_losses) < 1e-5
    for n, err in errs.items():
        assert err < (1e-2 if n.endswith("attn.c_attn.bias") else 1e-5), (n, err)
    assert s["nvme_read_bytes"] > 0
