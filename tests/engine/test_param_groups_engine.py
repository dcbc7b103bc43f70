"""``optimizer.param_groups``: per-group lr / weight decay / betas / eps honoured by the CPU
Adam wherever the optimizer states live, compared with torch.optim.AdamW given the same
groups (fp32, norm-relative < 1e-5); the schedule scales every group's lr; config errors."""
import re
from pathlib import Path

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import infinity
from infinity.config import ConfigError, InfinityConfig, OptimizerConfig, SchedulerConfig
from infinity.optim.param_groups import build_param_groups, name_matches
from infinity.optim.schedule import make_lambda
from infinity.zero.partition import clip_segments


class LoRALinear(nn.Module):
    def __init__(self, d_in, d_out, r=4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_a = nn.Parameter(torch.randn(r, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, r) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(LoRALinear(16, 64), nn.GELU(), LoRALinear(64, 64), nn.GELU(),
                         nn.Linear(64, 8))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


LR, WD = 1e-2, 0.1
ADAPTER = {"params": ["*lora_*"], "lr": 10 * LR, "weight_decay": 0.0,
           "betas": [0.8, 0.99], "eps": 1e-6}
SCHED = {"type": "linear", "warmup_steps": 2, "total_steps": 5, "min_lr": 1e-3}


@pytest.mark.parametrize("opt_home", ["none", "cpu", "nvme"])
def test_lora_adapter_at_10x_lr_matches_torch_adamw(harness, swap_dir, opt_home):
    ref = _model()
    model = harness.copy(ref)
    batches = _batches(5)
    adapter = [p for n, p in ref.named_parameters() if "lora_" in n]
    base = [p for n, p in ref.named_parameters() if "lora_" not in n]
    opt = torch.optim.AdamW([{"params": base},
                             {"params": adapter, "lr": 10 * LR, "weight_decay": 0.0,
                              "betas": (0.8, 0.99), "eps": 1e-6}],
                            lr=LR, weight_decay=WD, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, make_lambda(LR, SchedulerConfig(**SCHED)))
    losses_ref, lrs_ref = [], []
    for x, y in batches:
        lrs_ref.append([g["lr"] for g in opt.param_groups])
        loss = F.mse_loss(ref(x), y)
        losses_ref.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    cfg = {"offload": {"params": "cpu", "optimizer": opt_home, "nvme_paths": [swap_dir]},
           "optimizer": {"lr": LR, "weight_decay": WD, "no_decay": [],
                         "param_groups": [ADAPTER]},
           "scheduler": SCHED}
    with infinity.initialize(model, cfg) as eng:
        pgs = eng.opt.param_groups
        assert [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in pgs] == [
            (LR, WD, (0.9, 0.999), 1e-8), (10 * LR, 0.0, (0.8, 0.99), 1e-6)]
        assert sorted(pgs[1]["names"]) == sorted(n for n, _ in model.named_parameters()
                                                 if "lora_" in n)
        losses, lrs = [], []
        for x, y in batches:
            lrs.append([eng.opt.lr_for_group(i) for i in range(len(pgs))])
            loss = F.mse_loss(eng(x), y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
        perr = harness.param_rel_err(ref, eng)
    flat = lambda rows: [v for r in rows for v in r]
    assert flat(lrs) == pytest.approx(flat(lrs_ref), rel=1e-12)
    assert lrs[2] == pytest.approx([LR, 10 * LR])        # after the warmup: the two peaks
    assert harness.rel_err(losses, losses_ref) < 1e-5 and perr < 1e-5, (losses, losses_ref, perr)


def test_groups_change_the_result():
    """The reference above is sensitive to the groups: one shared lr gives other weights."""
    def run(groups):
        m = _model()
        opt = torch.optim.AdamW(groups(m), lr=LR, weight_decay=WD)
        for x, y in _batches(3):
            F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    a = run(lambda m: m.parameters())
    b = run(lambda m: [{"params": [p for n, p in m.named_parameters() if "lora_" not in n]},
                       {"params": [p for n, p in m.named_parameters() if "lora_" in n],
                        "lr": 10 * LR, "weight_decay": 0.0}])
    assert float((a - b).norm() / a.norm()) > 1e-3


def test_torch_scheduler_factory_sees_every_group(harness, swap_dir):
    ref = _model()
    model = harness.copy(ref)
    batches = _batches(4)
    adapter = [p for n, p in ref.named_parameters() if "lora_" in n]
    base = [p for n, p in ref.named_parameters() if "lora_" not in n]
    factory = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    opt = torch.optim.AdamW([{"params": base},
                             {"params": adapter, "lr": 10 * LR, "weight_decay": 0.0,
                              "betas": (0.8, 0.99), "eps": 1e-6}], lr=LR, weight_decay=WD)
    sched = factory(opt)
    for x, y in batches:
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    cfg = {"offload": {"params": "cpu", "optimizer": "cpu"},
           "optimizer": {"lr": LR, "weight_decay": WD, "no_decay": [],
                         "param_groups": [ADAPTER]}}
    with infinity.initialize(model, cfg, lr_scheduler=factory) as eng:
        for x, y in batches:
            eng.backward(F.mse_loss(eng(x), y))
            eng.step()
        assert [g["lr"] for g in eng.opt.sched_target.param_groups] == \
            pytest.approx([g["lr"] for g in opt.param_groups])
        perr = harness.param_rel_err(ref, eng)
    assert perr < 1e-5


# ---------------------------------------------------------------------- grouping rules
def _named():
    return list(_model().named_parameters())


def test_entry_weight_decay_overrides_no_decay_else_no_decay_applies():
    named = _named()
    opt = OptimizerConfig(lr=1.0, weight_decay=0.1, no_decay=["bias", "lora_b"],
                          param_groups=[{"params": ["0.*"], "lr": 2.0},
                                        {"params": ["2.base"], "weight_decay": 0.5}])
    groups = build_param_groups(named, opt)
    got = [(g["lr"], g["weight_decay"], g["names"]) for g in groups]
    assert got == [
        (1.0, 0.1, ["2.lora_a", "4.weight"]),                    # top level, decay
        (1.0, 0.0, ["2.lora_b", "4.bias"]),                      # top level, no_decay
        (2.0, 0.1, ["0.lora_a", "0.base.weight"]),               # entry 0, no_decay applies
        (2.0, 0.0, ["0.lora_b", "0.base.bias"]),
        (1.0, 0.5, ["2.base.weight", "2.base.bias"]),            # entry 1: wd for all
    ]


def test_first_matching_entry_wins_and_frozen_params_are_left_out():
    m = _model()
    m[4].requires_grad_(False)
    opt = OptimizerConfig(no_decay=[], param_groups=[{"params": ["*lora_a"], "lr": 0.5},
                                                     {"params": ["lora_"], "lr": 0.25},
                                                     {"params": ["4."], "lr": 0.125}])
    groups = build_param_groups(m.named_parameters(), opt)
    by_lr = {g["lr"]: g["names"] for g in groups}
    assert by_lr == {1e-3: ["0.base.weight", "0.base.bias", "2.base.weight", "2.base.bias"],
                     0.5: ["0.lora_a", "2.lora_a"], 0.25: ["0.lora_b", "2.lora_b"]}


def test_name_matches():
    assert name_matches("*lora_*", "layers.0.attn.LORA_A")
    assert name_matches("lora_", "layers.0.attn.lora_a")
    assert name_matches("layers.[01].*", "layers.1.mlp.weight")
    assert not name_matches("layers.[01].*", "layers.2.mlp.weight")
    assert not name_matches("*.bias", "layers.0.bias_scale")


def test_pattern_matching_nothing_is_an_error_naming_it():
    opt = OptimizerConfig(param_groups=[{"params": ["*lora_*", "*adapter*"], "lr": 1.0}])
    with pytest.raises(ConfigError, match=r"optimizer\.param_groups\[0\]\.params\[1\]: "
                                          r"pattern '\*adapter\*' matches no parameter"):
        build_param_groups(_named(), opt)


def test_initialize_refuses_a_pattern_matching_nothing():
    cfg = {"optimizer": {"param_groups": [{"params": ["decoder.*"], "lr": 1.0}]}}
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\.params\[0\].*decoder"):
        infinity.initialize(_model(), cfg)


def test_segments_with_overrides_are_clipped_to_shards():
    ov = (0.8, 0.99, 1e-6)
    segs = [(0, 6, 0.1, 0.0, ov), (6, 4, 0.2, 0.1), (10, 6, 0.0, 0.0, None)]
    assert clip_segments(segs, 4, 12) == [(0, 2, 0.1, 0.0, ov), (2, 4, 0.2, 0.1),
                                          (6, 2, 0.0, 0.0, None)]


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize("groups, msg", [
    ({"params": ["a"]}, r"optimizer\.param_groups: expected a list of groups"),
    ([{"params": ["a"], "lrr": 1.0}],
     r"optimizer\.param_groups\[0\]\.lrr: unknown key; did you mean optimizer\.param_groups\[0\]\.lr\?"),
    ([{"lr": 1.0}], r"optimizer\.param_groups\[0\]\.params: missing"),
    ([{"params": []}], r"optimizer\.param_groups\[0\]\.params: expected at least one entry"),
    ([{"params": [3]}], r"optimizer\.param_groups\[0\]\.params\[0\]: expected a non-empty string"),
    ([{"params": ["a"]}, "b"], r"optimizer\.param_groups\[1\]: expected a mapping"),
    ([{"params": ["a"], "lr": "1e-3"}], r"optimizer\.param_groups\[0\]\.lr: expected a number"),
    ([{"params": ["a"], "lr": -1}], r"optimizer\.param_groups\[0\]\.lr: expected a number >= 0"),
    ([{"params": ["a"], "weight_decay": -0.1}], r"param_groups\[0\]\.weight_decay: expected"),
    ([{"params": ["a"], "betas": [0.9]}], r"param_groups\[0\]\.betas: expected a list of two"),
    ([{"params": ["a"], "betas": [0.9, 1.0]}], r"param_groups\[0\]\.betas\[1\]: expected"),
    ([{"params": ["a"], "eps": 0}], r"param_groups\[0\]\.eps: expected a number > 0"),
])
def test_config_errors(groups, msg):
    with pytest.raises(ConfigError, match=msg):
        InfinityConfig.load({"optimizer": {"param_groups": groups}})


def test_config_round_trip_and_default_left_out():
    d = {"optimizer": {"param_groups": [{"params": "*lora_*", "lr": 1, "betas": (0.8, 0.9)}]}}
    cfg = InfinityConfig.load(d)
    assert cfg.optimizer.param_groups == [{"params": ["*lora_*"], "lr": 1.0,
                                           "betas": [0.8, 0.9]}]
    out = cfg.to_dict()
    assert out["optimizer"]["param_groups"] == cfg.optimizer.param_groups
    assert InfinityConfig.from_dict(out) == cfg
    assert "param_groups" not in InfinityConfig().to_dict()["optimizer"]


def test_documented_example_loads():
    doc = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    (block,) = re.findall(r"```yml\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S)
    import yaml
    from infinity.config import _yaml_loader
    cfg = InfinityConfig.load(yaml.load(block, Loader=_yaml_loader()))
    assert cfg.optimizer.param_groups == [
        {"params": ["*lora_*"], "lr": 1e-3, "weight_decay": 0.0},
        {"params": ["embed_tokens"], "betas": [0.9, 0.95]}]
