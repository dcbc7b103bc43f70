"""Frozen and trainable parameters inside the same module (BitFit: frozen weights, trainable
biases), parameters and optimizer on NVMe, fp32: the frozen weights get no gradient buffer,
no master, no Adam state and are never written; the biases train exactly like
torch.optim.AdamW over the trainable parameters."""
import torch
from torch import nn
import torch.nn.functional as F

import infinity
from infinity.runtime.groups import build_groups


def _bitfit_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                      nn.Linear(256, 8))
    for mod in m:
        if isinstance(mod, nn.Linear):
            mod.weight.requires_grad_(False)
    return m


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


def test_build_groups_splits_a_module_into_trainable_and_frozen_groups():
    m = _bitfit_model()
    plan = build_groups(m, torch.float32, "nvme")
    assert [(g.name, g.trainable, [s.name for s in g.slots]) for g in plan.groups] == [
        ("0", True, ["0.bias"]), ("0", False, ["0.weight"]),
        ("2", True, ["2.bias"]), ("2", False, ["2.weight"]),
        ("4", True, ["4.bias"]), ("4", False, ["4.weight"])]
    for g in plan.groups:
        assert all(s.trainable == g.trainable for s in g.slots)
        assert g.slots[0].offset == 0
    # the module's hooks fetch both of its groups
    assert plan.module_groups[m[2]] == [plan.groups[2], plan.groups[3]]
    # a module that is all trainable (or all frozen) keeps a single group
    full = nn.Linear(4, 4)
    assert len(build_groups(full, torch.float32, "cpu").groups) == 1
    full.requires_grad_(False)
    assert len(build_groups(full, torch.float32, "cpu").groups) == 1


def test_bitfit_nvme_parity_and_no_frozen_state_or_writes(harness, swap_dir):
    ref = _bitfit_model()
    model = harness.copy(ref)
    batches = _batches(5)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    losses_ref = []
    for x, y in batches:
        loss = F.mse_loss(ref(x), y)
        losses_ref.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir]},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []}}
    with infinity.initialize(model, cfg) as eng:
        groups = eng.grouping.groups
        train_g = [g for g in groups if g.trainable]
        frozen_g = [g for g in groups if not g.trainable]
        assert len(train_g) == 3 and len(frozen_g) == 3
        frozen_bytes = sum(g.nbytes for g in frozen_g)            # fp32 weights on NVMe
        train_bytes = sum(g.nbytes for g in train_g)              # fp32 biases = the masters
        # NVMe holds every parameter once plus two Adam states of the trainable ones only
        s0 = eng.stats()
        assert s0["nvme_bytes"] == frozen_bytes + 3 * train_bytes, (s0["nvme_bytes"],
                                                                    frozen_bytes, train_bytes)
        for g in frozen_g:
            assert g.grad_buf is None
        frozen_before = {n: eng.state_dict()[n].clone() for n, p in model.named_parameters()
                         if not p.requires_grad}
        losses, writes = [], []
        for x, y in batches:
            w0 = eng.stats()["nvme_write_bytes"]
            loss = F.mse_loss(eng(x), y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
            writes.append(eng.stats()["nvme_write_bytes"] - w0)
        sd = eng.state_dict()
        for n, t in frozen_before.items():
            assert torch.equal(sd[n], t), n                      # bit-identical
        perr = harness.param_rel_err(ref, eng)
    assert harness.rel_err(losses, losses_ref) < 1e-5 and perr < 1e-5
    # each step writes the updated masters (= the fp32 params) and both Adam states of the
    # biases; nothing of the frozen weights (which are much larger)
    assert writes == [3 * train_bytes] * len(batches), (writes, train_bytes)
    assert frozen_bytes > 5 * train_bytes
