"""fp16: dynamic loss scaling, overflow -> the step is skipped and the scale backs off."""
import torch

import infinity
from infinity.optim.loss_scaler import DynamicLossScaler


def test_scaler_backoff_growth_floor():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=2, backoff_factor=0.5,
                          growth_factor=2.0, min_scale=2.0)
    assert s.update(True) is False and s.scale == 4.0 and s.skipped_steps == 1
    assert s.update(True) is False and s.scale == 2.0
    assert s.update(True) is False and s.scale == 2.0          # floored
    assert s.update(False) and s.scale == 2.0
    assert s.update(False) and s.scale == 4.0                  # grew after 2 clean steps
    s2 = DynamicLossScaler()
    s2.load_state_dict(s.state_dict())
    assert s2.scale == 4.0 and s2.skipped_steps == 3


def test_fp16_overflow_skips_step_then_trains_close_to_fp32(harness, swap_dir):
    torch.manual_seed(0)
    init = harness.MLPStack()
    model = harness.copy(init)
    batches = harness.make_batches("mlp", 12)
    cfg = {"precision": "fp16",
           "offload": {"params": "nvme", "optimizer": "cpu", "nvme_paths": [swap_dir]},
           "fp16": {"initial_scale": 2.0 ** 20, "backoff_factor": 0.0625, "growth_interval": 1000},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
           "gradient_clipping": 1.0}
    with infinity.initialize(model, cfg) as eng:
        before = {k: v.clone() for k, v in eng.state_dict().items()}
        losses = []
        first_applied = None
        skipped = []
        for i, b in enumerate(batches):
            loss = harness.loss_of("mlp", eng(b[0]), b)
            losses.append(loss.item())
            eng.backward(loss)
            applied = eng.step()
            if not applied:
                skipped.append(i)
            if applied and first_applied is None:
                first_applied = i
            if first_applied is None:
                now = eng.state_dict()
                assert all(torch.equal(now[k], before[k]) for k in before)   # skipped: untouched
        s = eng.stats()
        final = {k: v.clone() for k, v in eng.state_dict().items()}
    assert s["skipped_steps"] >= 1 and s["loss_scale"] < 2.0 ** 20
    assert s["step"] == len(batches) - s["skipped_steps"]
    # a skipped step changes nothing: training must match fp32 on the applied batches only
    assert len(skipped) == s["skipped_steps"] and skipped[0] == 0
    ref = harness.copy(init)
    harness.reference_run(ref, "mlp", [b for i, b in enumerate(batches) if i not in skipped],
                          accum=1, clip=1.0)
    num = den = 0.0
    for name, p in ref.named_parameters():
        num += float((final[name].double() - p.detach().double()).pow(2).sum())
        den += float(p.detach().double().pow(2).sum())
    err = (num / den) ** 0.5
    assert err < 2e-2, err          # fp16 compute: ~1e-3 rounding per op over 12 steps
