"""One GPU (``make test-gpu``; skipped without CUDA): the engine on ``cuda:0`` against
plain PyTorch on the same GPU, every parameter home x fp32/bf16, the device peak within
the budget, and no CUDA memory left behind after ``close()``.

Written before any GPU was available to this project: the GPU path is tested through
simulated devices (tests/zero/test_simulated_device.py, tests/memory/test_cuda_wiring.py)."""
import gc

import pytest
import torch
from torch import nn

import infinity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BUDGET_GB = 0.05
STEPS = 6


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 32))


def _batches(n):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g))
            for _ in range(n)]


def _reference():
    ref = _model().cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.05)
    losses = []
    for x, y in _batches(STEPS):
        loss = nn.functional.mse_loss(ref(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("params", ["none", "cpu", "nvme"])
def test_single_gpu_matches_torch(tmp_path, params, precision):
    ref_losses, ref_sd = _reference()
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    cfg = {"precision": precision,
           "optimizer": {"lr": 1e-3, "weight_decay": 0.05, "no_decay": []},
           "offload": {"params": params, "optimizer": "cpu", "nvme_paths": [str(tmp_path)],
                       "device_memory_gb": BUDGET_GB}}
    model = _model().cuda()
    losses = []
    with infinity.initialize(model, cfg) as e:
        assert e.mm.dev.kind == "cuda"
        for x, y in _batches(STEPS):
            loss = nn.functional.mse_loss(e(x).float(), y.cuda())
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        sd = {k: v.float() for k, v in e.state_dict().items()}
        st = e.stats()
    tol = 1e-5 if precision == "fp32" else 3e-2
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= tol * abs(b) + 1e-7, (losses, ref_losses)
    for k, want in ref_sd.items():
        rel = float((sd[k] - want).norm() / want.norm().clamp_min(1e-12))
        assert rel <= (1e-5 if precision == "fp32" else 3e-2), (k, rel)
    assert st["h2d_bytes"] > 0 and st["d2h_bytes"] > 0
    assert st["device_budget_overflows"] == 0
    assert 0 < st["device_peak_bytes"] <= BUDGET_GB * 1e9
    del e, model
    gc.collect()
    torch.cuda.synchronize()
    # the pools are freed at close(): what is left is the placeholders (a few bytes)
    assert torch.cuda.memory_allocated() - base < 1 << 20, "CUDA memory leaked after close()"


def test_h2d_overlaps_compute_on_the_timeline(tmp_path):
    """Host-homed params paged through a small budget with prefetch depth 2: after the
    recording step, some H2D copies of the next groups run while earlier modules compute
    (their intervals on the timeline intersect forward/backward spans)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU())
                            for _ in range(8)]).cuda()
    cfg = {"prefetch": {"depth": 2},
           "offload": {"params": "cpu", "optimizer": "cpu", "device_memory_gb": 0.02}}
    x, y = torch.randn(256, 512), torch.randn(256, 512)
    with infinity.initialize(model, cfg) as e:
        for _ in range(2):                              # the first step records the trace
            loss = nn.functional.mse_loss(e(x), y.cuda())
            e.backward(loss)
            e.step()
        with e.profile(str(tmp_path / "prof")):
            for _ in range(2):
                loss = nn.functional.mse_loss(e(x), y.cuda())
                e.backward(loss)
                e.step()
        evs = e.timeline.events()
        st = e.stats()
    h2d = [ev for ev in evs if ev.lane == "h2d"]
    comp = [ev for ev in evs if ev.lane in ("forward", "backward")]
    assert h2d and comp
    overlapping = [a for a in h2d if any(a.t0 < c.t1 and c.t0 < a.t1 for c in comp)]
    assert overlapping, "no H2D copy overlapped compute"
    assert st["prefetched_fetches"] > st["on_demand_fetches"]
    assert 0 < st["device_peak_bytes"] <= 0.02e9


@pytest.mark.parametrize("checkpointing", [True, False])
def test_first_update_gradients_equal_torch_on_a_hf_llama(checkpointing):
    """The defect the first GPU run found (Note [fresh device memory]): in the first
    micro-step every fetch is on demand into buffers fresh from the allocator while
    backward frees (recomputed) activations; a copy into such memory not ordered after
    compute overwrote weights queued kernels still read (NaN with activation checkpointing,
    wrong gradients without).  The engine's first gradient sums equal plain PyTorch's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                          tie_word_embeddings=False)
        m = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.config.use_cache = False
        return m.train()

    ids = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
    ref = build()
    ref(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad.float().cpu() for n, p in ref.named_parameters()}
    del ref
    model = build()
    # accumulation 2: the first micro-step is no boundary, so no group is stepped early
    # (the overlapped step) and every gradient sum is in its host buffer afterwards
    cfg = {"precision": "bf16", "gradient_accumulation_steps": 2,
           "offload": {"params": "cpu", "optimizer": "cpu"}}
    with infinity.initialize(model, cfg) as e:
        names = {id(p): n for n, p in e.module.named_parameters()}
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss)
        torch.cuda.synchronize()
        for g in e.grouping.groups:
            for s in g.slots:
                # backward scaled the loss by 1/accumulation
                got = 2 * g.grad_buf[s.offset:s.offset + s.numel].reshape(s.shape)
                w = want[names[id(s.param)]]
                assert torch.isfinite(got).all(), names[id(s.param)]
                rel = float((got - w).norm() / w.norm().clamp_min(1e-20))
                assert rel <= 1e-2, (names[id(s.param)], rel)
        e.step()
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()
        assert e.stats()["nonfinite_steps"] == 0 and e.stats()["step"] == 1
