"""engine.state_dict(): equal to the reference model's after training, produced one tensor
at a time (resident memory does not grow by the model size while iterating it)."""
import torch
from torch import nn

import infinity


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_state_dict_streams_and_matches_reference(harness, swap_dir):
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])      # 12.6M params, 50 MB
    model = harness.copy(ref)
    x = torch.randn(4, 1024)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    ref(x).square().mean().backward()
    opt.step()
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir]},
           "optimizer": {"lr": 1e-3, "weight_decay": 0.0}}
    model_bytes = sum(p.numel() * 4 for p in ref.parameters())
    with infinity.initialize(model, cfg) as eng:
        eng.backward(eng(x).square().mean())
        eng.step()
        base = _rss_bytes()
        sd = eng.state_dict()
        peak = _rss_bytes()
        want = ref.state_dict()
        assert list(sd) == list(want)
        for k in sd:
            got = sd[k]
            assert got.dtype == want[k].dtype and got.shape == want[k].shape
            assert float((got - want[k]).norm() / want[k].norm()) < 1e-5, k
            del got
            peak = max(peak, _rss_bytes())
    # one 4 MB tensor at a time (+ read buffers the allocator keeps), never the 50 MB model
    assert peak - base < model_bytes / 2, (peak - base, model_bytes)
