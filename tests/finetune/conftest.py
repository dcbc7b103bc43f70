"""Helpers for the finetune tests: tiny model configs and running the CLI in a child."""
import json
import os
import subprocess
import sys

import pytest

TINY_LLAMA = dict(model_type="llama", vocab_size=264, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=128, tie_word_embeddings=False, use_cache=False)
TINY_GPT2 = dict(model_type="gpt2", vocab_size=264, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                 use_cache=False)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def tiny_config(tmp_path):
    def make(kind="llama", **over):
        cfg = dict(TINY_LLAMA if kind == "llama" else TINY_GPT2, **over)
        path = tmp_path / f"tiny-{kind}.json"
        path.write_text(json.dumps(cfg))
        return str(path)
    return make


def files_under(path):
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.join(root, n) for n in names]
    return out


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    env.pop("INFINITY_BENCH_IO", None)
    return env


def finetune_cmd(*args):
    return [sys.executable, "-m", "infinity", "finetune", *args]


def run_finetune(*args, cwd, timeout=240):
    return subprocess.run(finetune_cmd(*args), cwd=cwd, env=child_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def ft():
    """Namespace of helpers (importlib mode: tests cannot import conftest)."""
    from types import SimpleNamespace
    return SimpleNamespace(run=run_finetune, cmd=finetune_cmd, env=child_env, files_under=files_under)
