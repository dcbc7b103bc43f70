"""Parameter groups on tiny GPT-2 and Llama models built from configs (no network)."""
import pytest
import torch
from torch import nn

from infinity.config import InfinityConfig, OptimizerConfig
from infinity.optim.param_groups import (build_param_groups, build_param_groups_for_model,
                                         is_norm_module)


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                      n_positions=32, bos_token_id=0, eos_token_id=0))


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        vocab_size=64, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


OPT = OptimizerConfig(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6)


def _by_wd(groups):
    assert len({g["weight_decay"] for g in groups}) == len(groups)
    return {g["weight_decay"]: g for g in groups}


def _check_complete(model, groups):
    # every trainable parameter exactly once; names and params aligned
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters() if p.requires_grad}
    named = dict(model.named_parameters())
    for g in groups:
        assert len(g["names"]) == len(g["params"])
        for n, p in zip(g["names"], g["params"]):
            assert named[n] is p
        assert g["lr"] == OPT.lr and g["betas"] == (0.9, 0.95) and g["eps"] == 1e-6


def test_gpt2_groups(gpt2):
    groups = build_param_groups_for_model(gpt2, OPT)
    _check_complete(gpt2, groups)
    g = _by_wd(groups)
    decay, no = set(g[0.1]["names"]), set(g[0.0]["names"])
    # ln_1 / ln_2 / ln_f have no "norm" in their names: caught by the norm-module rule
    for n in ["transformer.h.0.ln_1.weight", "transformer.h.1.ln_2.weight",
              "transformer.ln_f.weight", "transformer.ln_f.bias",
              "transformer.h.0.attn.c_attn.bias", "transformer.h.1.mlp.c_proj.bias"]:
        assert n in no, n
    for n in ["transformer.wte.weight", "transformer.wpe.weight",
              "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"]:
        assert n in decay, n
    # every 1-D parameter of GPT-2 is a bias or a LayerNorm weight: none decays
    assert all(p.dim() >= 2 for p in g[0.1]["params"])
    assert all(p.dim() == 1 for p in g[0.0]["params"])
    # tied lm_head/wte appears once
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert "lm_head.weight" not in decay | no


def test_gpt2_without_module_map_misses_ln(gpt2):
    # names alone: ln_1.weight does not contain "norm" -> it would decay (why the rule exists)
    groups = build_param_groups(gpt2.named_parameters(), OPT)
    assert "transformer.h.0.ln_1.weight" in _by_wd(groups)[0.1]["names"]
    # unless the user adds a pattern for it
    opt = OptimizerConfig(weight_decay=0.1, no_decay=["bias", "ln_"], lr=3e-4,
                          betas=(0.9, 0.95), eps=1e-6)
    groups = build_param_groups(gpt2.named_parameters(), opt)
    assert "transformer.h.0.ln_1.weight" in _by_wd(groups)[0.0]["names"]


def test_llama_groups(llama):
    groups = build_param_groups_for_model(llama, OPT)
    _check_complete(llama, groups)
    g = _by_wd(groups)
    no = set(g[0.0]["names"])
    assert no == {f"model.layers.{i}.{n}.weight" for i in range(2)
                  for n in ("input_layernorm", "post_attention_layernorm")} | {"model.norm.weight"}
    assert "lm_head.weight" in g[0.1]["names"] and "model.embed_tokens.weight" in g[0.1]["names"]


def test_norm_rule_follows_no_decay_patterns(gpt2):
    # removing "norm" from no_decay turns the module rule off as well
    opt = OptimizerConfig(weight_decay=0.1, no_decay=["bias"])
    g = _by_wd(build_param_groups_for_model(gpt2, opt))
    assert "transformer.ln_f.weight" in g[0.1]["names"]
    assert "transformer.ln_f.bias" in g[0.0]["names"]
    # empty no_decay: one group, everything decays
    groups = build_param_groups_for_model(gpt2, OptimizerConfig(weight_decay=0.1, no_decay=[]))
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1


def test_case_insensitive_substring_and_frozen():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.Proj = nn.Linear(4, 4)
            self.LayerNORM_custom = nn.Linear(4, 4, bias=False)  # name matches "norm"
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
    m = M()
    g = _by_wd(build_param_groups_for_model(m, OptimizerConfig(weight_decay=0.01)))
    assert g[0.01]["names"] == ["Proj.weight"]
    assert g[0.0]["names"] == ["Proj.bias", "LayerNORM_custom.weight"]
    assert not any("frozen" in n for gg in g.values() for n in gg["names"])


def test_norm_modules_detected():
    class MyRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
    assert is_norm_module(nn.LayerNorm(4)) and is_norm_module(nn.BatchNorm1d(4))
    assert is_norm_module(nn.GroupNorm(2, 4)) and is_norm_module(MyRMSNorm())
    assert not is_norm_module(nn.Linear(2, 2))
    m = nn.Sequential(nn.Linear(4, 4), MyRMSNorm())
    g = _by_wd(build_param_groups_for_model(m, OptimizerConfig(weight_decay=0.1)))
    assert g[0.0]["names"] == ["0.bias", "1.scale"]


def test_empty_groups_dropped_and_all_frozen_is_an_error():
    m = nn.Linear(3, 3, bias=False)
    groups = build_param_groups_for_model(m, OptimizerConfig(weight_decay=0.1))
    assert len(groups) == 1 and groups[0]["names"] == ["weight"]
    m.requires_grad_(False)
    assert build_param_groups(m.named_parameters(), OPT) == []
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_param_groups_for_model(m, OPT)


def test_accepts_infinity_config_and_dict_and_bad_input():
    m = nn.Linear(3, 3)
    a = build_param_groups_for_model(m, InfinityConfig.load({"optimizer": {"weight_decay": 0.2}}))
    b = build_param_groups_for_model(m, {"weight_decay": 0.2})
    assert [g["weight_decay"] for g in a] == [g["weight_decay"] for g in b] == [0.2, 0.0]
    with pytest.raises(TypeError, match=r"\(name, parameter\)"):
        build_param_groups([m.weight], OPT)
    with pytest.raises(TypeError, match="OptimizerConfig"):
        build_param_groups(m.named_parameters(), 0.1)


def test_groups_drive_torch_adamw_like_hand_split(gpt2):
    """The groups give torch.optim.AdamW the same update as a hand-written split."""
    import copy
    m1, m2 = copy.deepcopy(gpt2).eval(), copy.deepcopy(gpt2).eval()  # eval: no dropout RNG
    groups = build_param_groups_for_model(m1, OPT)
    opt1 = torch.optim.AdamW([{k: v for k, v in g.items() if k != "names"} for g in groups])
    nd = [p for n, p in m2.named_parameters() if p.dim() == 1]  # GPT-2: 1-D == bias/LN
    d = [p for n, p in m2.named_parameters() if p.dim() >= 2]
    opt2 = torch.optim.AdamW([{"params": d, "weight_decay": 0.1},
                              {"params": nd, "weight_decay": 0.0}],
                             lr=OPT.lr, betas=OPT.betas, eps=OPT.eps)
    x = torch.randint(0, 64, (2, 8))
    for m, o in ((m1, opt1), (m2, opt2)):
        for _ in range(2):
            o.zero_grad()
            m(input_ids=x, labels=x).loss.backward()
            o.step()
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0, msg=n)
