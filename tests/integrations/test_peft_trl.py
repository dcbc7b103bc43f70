"""PEFT LoRA under InfinityTrainer and TRL's SFTTrainer as InfinitySFTTrainer, against the
plain trainers: losses, and adapters saved the way PEFT saves them."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _lora(model):
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
        fan_in_fan_out=True))


def test_lora_matches_plain_trainer_and_saves_adapters(tmp_path, swap_dir):
    from safetensors.torch import load_file

    from infinity.integrations.transformers import InfinityTrainer
    torch.manual_seed(0)
    ref = transformers.Trainer(model=_lora(H.gpt2()), args=H.args(tmp_path / "ref"),
                               train_dataset=H.TokenData())
    ref.train()
    ref.save_model(str(tmp_path / "ref_out"))
    torch.manual_seed(0)
    tr = InfinityTrainer(model=_lora(H.gpt2()), args=H.args(tmp_path / "inf"),
                         train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    try:
        tr.train()
        a, b = H.losses(tr), H.losses(ref)
        assert len(a) == 10 and all(abs(x - y) / y < 1e-5 for x, y in zip(a, b)), (a, b)
        tr.save_model(str(tmp_path / "out"))
    finally:
        tr.close()
    files = set(os.listdir(tmp_path / "out"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files          # adapters only, as PEFT saves them
    got = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    want = load_file(str(tmp_path / "ref_out" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert float((got[k] - want[k]).norm() / want[k].norm()) < 1e-5, k
    # PEFT loads them onto a fresh base model
    m = peft.PeftModel.from_pretrained(H.gpt2(), str(tmp_path / "out"))
    sd = m.state_dict()
    k = next(n for n in sd if "lora_B" in n)
    assert float(sd[k].abs().sum()) > 0


def _sft_config(out, **kw):
    trl = pytest.importorskip("trl")
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=4, learning_rate=3e-3, logging_steps=1, report_to=[],
                save_strategy="no", use_cpu=True, max_length=24, disable_tqdm=True, seed=0)
    base.update(kw)
    return trl.SFTConfig(**base)


def test_sft_trainer_with_lora(tmp_path, swap_dir):
    """InfinitySFTTrainer (TRL's fused LM head: its weight is declared to the engine) with a
    LoRA config trains like trl.SFTTrainer and saves the adapters.  TRL's fused LM head is
    not bit-reproducible across set-ups of the plain SFTTrainer itself (its first loss
    moves by ~1e-5 with max_steps or Accelerate's forward wrapper), hence 1e-3."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from infinity.integrations.trl import InfinitySFTTrainer
    tok = H.char_tokenizer()
    ds = datasets.Dataset.from_dict({"text": H.TEXTS})
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                           fan_in_fan_out=True)
    ref = trl.SFTTrainer(model=H.gpt2(), args=_sft_config(tmp_path / "ref"), train_dataset=ds,
                         processing_class=tok, peft_config=lcfg)
    ref.train()
    tr = InfinitySFTTrainer(model=H.gpt2(), args=_sft_config(tmp_path / "inf"), train_dataset=ds,
                            processing_class=tok, peft_config=lcfg,
                            infinity_config=H.nvme_config(swap_dir))
    try:
        tr.train()
        a, b = H.losses(tr), H.losses(ref)
        assert len(a) == 4 and all(abs(x - y) / y < 1e-3 for x, y in zip(a, b)), (a, b)
        assert a[-1] < a[0]
        tr.save_model(str(tmp_path / "out"))
    finally:
        tr.close()
    files = set(os.listdir(tmp_path / "out"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files


@pytest.mark.slow
def test_sft_trainer_full_model(tmp_path, swap_dir):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from infinity.integrations.trl import InfinitySFTTrainer
    tok = H.char_tokenizer()
    ds = datasets.Dataset.from_dict({"text": H.TEXTS})
    ref = trl.SFTTrainer(model=H.gpt2(), args=_sft_config(tmp_path / "ref"), train_dataset=ds,
                         processing_class=tok)
    ref.train()
    tr = InfinitySFTTrainer(model=H.gpt2(), args=_sft_config(tmp_path / "inf"), train_dataset=ds,
                            processing_class=tok, infinity_config=H.nvme_config(swap_dir))
    try:
        tr.train()
        a, b = H.losses(tr), H.losses(ref)
        assert len(a) == 4 and all(abs(x - y) / y < 1e-3 for x, y in zip(a, b)), (a, b)
        tr.save_model(str(tmp_path / "out"))
    finally:
        tr.close()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert m.config.n_embd == 32
