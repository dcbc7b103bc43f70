"""Tiny models, data and TrainingArguments shared by the Trainer integration tests (also
imported by the torchrun child).  Everything is built from configs: no hub access."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402

VOCAB = 64
SEQ = 12


def gpt2(seed=0, **kw):
    import transformers
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0,
                                  use_cache=False, **kw)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def llama(seed=0, **kw):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False, tie_word_embeddings=False, **kw)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


class TokenData(torch.utils.data.Dataset):
    """``n`` fixed random sequences (input_ids = labels), the same for every run."""

    def __init__(self, n=40, seq=SEQ, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def args(out, **kw):
    import transformers
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=10, learning_rate=3e-3, weight_decay=0.1, warmup_steps=3,
                lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1,
                save_strategy="no", report_to=[], seed=0, use_cpu=True,
                dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def nvme_config(swap_dir, **kw):
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(swap_dir)]}}
    cfg.update(kw)
    return cfg


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def log_values(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "loss" in h]


TEXTS = ["the cat sat on the mat", "a dog ran in the park", "offload to nvme and train",
         "small models train fast", "hello world from infinity", "one two three four five",
         "zero stage three shards", "gradients flow backwards"] * 2


def char_tokenizer():
    """A character-level fast tokenizer built in memory (no hub): ids < VOCAB."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = ["<pad>", "<eos>", "<unk>"] + list(string.ascii_lowercase + " .,!?")
    vocab = {c: i for i, c in enumerate(chars)}
    assert len(vocab) <= VOCAB
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")
