"""tools/e2e_model.py (the benchmark model shared with the DeepSpeed peer) and the peer scripts."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DS_PYTHON = os.environ.get("INFINITY_DS_PYTHON", "/tmp/infinity-dsvenv/bin/python")


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


e2e_model = _load("e2e_model", "tools/e2e_model.py")


@pytest.mark.parametrize("layers,hidden,mult", [(1, 1, 1), (3, 7, 4), (2, 64, 2)])
def test_count_params_matches_module(layers, hidden, mult):
    m = e2e_model.build_model(layers, hidden, ffn_mult=mult)
    assert sum(p.numel() for p in m.parameters()) == e2e_model.count_params(layers, hidden, mult)


def test_baseline_sizes():
    assert e2e_model.count_params(8, 2048) == 268_550_144   # BASELINE's "268.6M"
    assert e2e_model.count_params(2, 2048) == 67_137_536    # BASELINE's "67M"


def test_deterministic_and_seed_sensitive():
    a = e2e_model.build_model(2, 16)
    b = e2e_model.build_model(2, 16)
    c = e2e_model.build_model(2, 16, seed=5)
    for (ka, pa), (kb, pb), (_, pc) in zip(a.state_dict().items(), b.state_dict().items(),
                                           c.state_dict().items()):
        assert ka == kb and torch.equal(pa, pb)
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.state_dict().values(),
                                                         c.state_dict().values()))
    x1, y1 = e2e_model.make_batch(5, 16, seed=3)
    x2, y2 = e2e_model.make_batch(5, 16, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, y1)


def test_forward_is_residual_mlp_and_loss_is_mse():
    m = e2e_model.build_model(1, 8)
    blk = m[0]
    x, y = e2e_model.make_batch(4, 8)
    ref = x + blk.down(torch.nn.functional.gelu(blk.up(torch.nn.functional.layer_norm(
        x, (8,), blk.norm.weight, blk.norm.bias))))
    torch.testing.assert_close(m(x), ref)
    assert e2e_model.loss_fn(ref, y).item() == pytest.approx(((ref - y) ** 2).mean().item())


def test_bf16_dtype_and_bad_sizes():
    m = e2e_model.build_model(1, 8, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    with pytest.raises(ValueError, match="layers"):
        e2e_model.build_model(0, 8)


needs_ds = pytest.mark.skipif(not os.access(DS_PYTHON, os.X_OK),
                              reason="DeepSpeed venv missing: run tools/setup_deepspeed_venv.sh")


@pytest.mark.slow
@needs_ds
def test_deepspeed_aio_peer_one_json_line(tmp_path):
    r = subprocess.run([DS_PYTHON, os.path.join(ROOT, "tools/peers/deepspeed_aio.py"),
                        "--path", str(tmp_path), "--size-mb", "8", "--block-kb", "1024",
                        "--queue-depth", "8", "--passes", "1", "--json"],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert res["bytes"] == 8 << 20 and res["verified"] and res["read_gbps"] > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@needs_ds
def test_deepspeed_e2e_peer_matches_torch_adamw(tmp_path):
    r = subprocess.run([DS_PYTHON, os.path.join(ROOT, "tools/peers/deepspeed_e2e.py"),
                        "--layers", "2", "--hidden", "64", "--tokens", "16", "--steps", "2",
                        "--warmup", "1", "--nvme-path", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=3600)
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stderr[-2000:]
    res = json.loads(lines[0])
    assert r.returncode == 0 and "error" not in res, res.get("error")
    assert res["swap_dir_removed"] and os.listdir(tmp_path) == []
    assert len(res["io_read_bytes"]) == len(res["io_write_bytes"]) == 2  # per measured step
    assert res["config"]["zero_optimization"]["offload_param"]["max_in_cpu"] == int(1e9)
    model = e2e_model.build_model(2, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    x, y = e2e_model.make_batch(16, 64)
    ref = []
    for _ in range(3):
        loss = e2e_model.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref), rtol=1e-4, atol=0)
