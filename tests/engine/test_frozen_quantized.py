"""``offload.frozen_weights`` in one process: a PEFT LoRA model whose frozen base is kept
quantized (nf4 / int8 / int4) at its home (host memory or NVMe) trains exactly like plain
PyTorch PEFT + torch.optim.AdamW over the *dequantized* base, reads a fraction of the
bytes, and what is not supported yet is refused at initialize."""
import copy
import os
import sys

import pytest
import torch

import infinity
from infinity.config import ConfigError, InfinityConfig
from infinity.quant import quantize_weight

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integrations"))
import hf_helpers as H  # noqa: E402
from train_beside import train_beside  # noqa: E402

LR = 3e-3
TARGETS = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj", "up_proj"]}


def _wide_gpt2(seed=0, d=128):
    """GPT-2 wide enough (d 128) that the 4096-byte padding of each group is small next to
    its weights."""
    import transformers
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=H.VOCAB, n_positions=32, n_embd=d, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def _lora(kind, **kw):
    base = {"gpt2": H.gpt2, "llama": H.llama, "wide": _wide_gpt2}[kind](**kw)
    kind = "gpt2" if kind == "wide" else kind
    return peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS[kind], lora_dropout=0.0,
        fan_in_fan_out=kind == "gpt2"))


def _quantizable(mod):
    return isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) or \
        type(mod).__name__ == "Conv1D"


def _dequantized_reference(model, dtype, group_size=64, double_quant=False):
    """The reference: each frozen Linear / Conv1D / Embedding weight replaced by its
    quantize-dequantize round trip."""
    ref = copy.deepcopy(model)
    seen = set()                       # tied weights (GPT-2's wte / lm_head) once
    for mod in ref.modules():
        w = getattr(mod, "weight", None)
        if _quantizable(mod) and isinstance(w, torch.nn.Parameter) and not w.requires_grad \
                and id(w) not in seen:
            seen.add(id(w))
            with torch.no_grad():
                w.copy_(quantize_weight(w, dtype, group_size,
                                        double_quant=double_quant).dequantize())
    assert seen
    return ref


def _ids(n, seed=1, batch=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, H.VOCAB, (batch, H.SEQ), generator=g) for _ in range(n)]


def _cfg(home, swap_dir, dtype, **fw):
    fwd = {} if dtype is None else {"frozen_weights": {"dtype": dtype, **fw}}
    return {"offload": {"params": home, "optimizer": "cpu" if home == "cpu" else "nvme",
                        "nvme_paths": [swap_dir], **fwd},
            "optimizer": {"lr": LR, "weight_decay": 0.1}}


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


CASES = [("gpt2", "nf4", "cpu", {}), ("gpt2", "nf4", "nvme", {"double_quant": True}),
         ("llama", "int8", "nvme", {}), ("llama", "int4", "cpu", {"group_size": 32}),
         ("llama", "nf4", "nvme", {})]


@pytest.mark.parametrize("kind,dtype,home,fw", CASES,
                         ids=[f"{k}-{d}-{h}{'-dq' if fw.get('double_quant') else ''}"
                              for k, d, h, fw in CASES])
def test_lora_over_quantized_base_matches_peft_over_dequantized_base(kind, dtype, home, fw,
                                                                     swap_dir):
    model = _lora(kind)
    ref = _dequantized_reference(model, dtype, **fw)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    batches = _ids(5)
    with infinity.initialize(model, _cfg(home, swap_dir, dtype, **fw)) as eng:
        quant = [g for g in eng.grouping.groups if g.quant is not None]
        assert quant and all(not g.trainable for g in quant)
        assert all(g.home_nbytes < g.nbytes or g.nbytes <= 4096 for g in quant)
        losses, ref_losses = [], []
        for i, ids in enumerate(batches):
            out = eng(input_ids=ids, labels=ids)
            eng.backward(out.loss)
            r = ref(input_ids=ids, labels=ids)
            r.loss.backward()
            if i == 0:         # forward/backward: the adapters' gradients
                want = dict(ref.named_parameters())
                for g in eng.opt.groups:
                    gb = eng.opt.grads.grad_in_hand(g)
                    for s in g.slots:
                        got = gb[s.offset:s.offset + s.numel].view(s.shape)
                        assert _rel(got, want[s.name].grad) < 1e-5, s.name
            eng.step()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
            ref_losses.append(r.loss.item())
        assert _rel(losses, ref_losses) < 1e-5, (losses, ref_losses)
        sd = eng.state_dict()
        for n, p in ref.named_parameters():     # frozen: the dequantized base; LoRA: trained
            assert _rel(sd[n], p.detach()) < 1e-5, n
        st = eng.stats()
        tier = "frozen_nvme_read_bytes" if home == "nvme" else "frozen_host_read_bytes"
        assert st[tier] > 0
        # every quantized group is fetched twice per micro-step (forward, backward)
        # at most, and reads its payload, not the working-precision buffer
        assert st[tier] <= 2 * len(batches) * sum(g.home_nbytes for g in eng.grouping.groups
                                                  if not g.trainable)


def _frozen_read_per_step(model, cfg, home):
    key = f"frozen_{'nvme' if home == 'nvme' else 'host'}_read_bytes"
    with infinity.initialize(model, cfg) as eng:
        seen = []
        for ids in _ids(3, batch=1):
            before = eng.stats()[key]
            out = eng(input_ids=ids, labels=ids)
            eng.backward(out.loss)
            eng.step()
            seen.append(eng.stats()[key] - before)
        if "tiling" in cfg:                    # the frozen layers were read tile by tile
            assert eng.stats()["tiles_forward"] > 0
            assert any(g.quant is not None or not g.trainable
                       for sp in eng.tiling.specs.values() for g in sp.groups)
    assert len(set(seen[1:])) == 1, seen       # the same bytes every step (traced)
    return seen[-1]


@pytest.mark.parametrize("dtype,bound", [("nf4", 0.3), ("int4", 0.3), ("int8", 0.55)])
def test_frozen_base_bytes_read_per_step(dtype, bound, swap_dir, tmp_path):
    """NVMe bytes of the frozen base read per step: <= 0.3x (4-bit, scales included) /
    <= 0.55x (int8) of the same run in the working precision (fp32 here, so the bound is
    checked against a 4-byte base: looser than against bf16, see the report)."""
    plain = _frozen_read_per_step(_lora("wide"), _cfg("nvme", swap_dir, None), "nvme")
    quant = _frozen_read_per_step(_lora("wide"), _cfg("nvme", str(tmp_path / "s2"), dtype),
                                  "nvme")
    assert 0 < quant <= bound * plain, (quant, plain, quant / plain)
    # the host home moves the same ratio of bytes
    hp = _frozen_read_per_step(_lora("wide"), _cfg("cpu", swap_dir, None), "cpu")
    hq = _frozen_read_per_step(_lora("wide"), _cfg("cpu", swap_dir, dtype), "cpu")
    assert 0 < hq <= bound * hp, (hq, hp)


@pytest.mark.parametrize("dtype,fw,bound,tiled", [("nf4", {}, 0.3, False),
                                                   ("int8", {}, 0.55, False),
                                                   ("nf4", {"double_quant": True}, 0.3, True)])
def test_frozen_base_bytes_against_a_bf16_base(dtype, fw, bound, tiled, swap_dir, tmp_path):
    """The same bound against a bf16 working precision (2 bytes per element), on a model
    (d 256) whose layers dwarf the per-group 4096-byte padding; ``tiled``: the MLP and LM
    head computed tile by tile (Note [Quantized tiles]), each tile reading its spans."""
    def cfg(d, sw):
        c = _cfg("nvme", sw, d, **fw)
        c["precision"] = "bf16"
        if tiled:
            c["tiling"] = {"max_group_gb": 600e3 / 1e9}
        return c
    d = 512 if tiled else 256                 # tiles of ~0.5 MB, as a real layer's are larger
    plain = _frozen_read_per_step(_lora("wide", d=d), cfg(None, swap_dir), "nvme")
    quant = _frozen_read_per_step(_lora("wide", d=d), cfg(dtype, str(tmp_path / "s2")),
                                  "nvme")
    assert 0 < quant <= bound * plain, (quant, plain, quant / plain)
    print(f"{dtype} tiled={tiled}: {quant / plain:.3f}x the bf16 base's bytes")


def test_activation_checkpointing_recompute_reads_the_quantized_base(swap_dir):
    model = _lora("llama")
    model.base_model.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    ref = _dequantized_reference(model, "nf4")
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            weight_decay=0.1)
    with infinity.initialize(model, _cfg("nvme", swap_dir, "nf4")) as eng:
        eng.train()
        ref.train()
        losses, ref_losses = train_beside(eng, ref, opt, _ids(3))
        assert _rel(losses, ref_losses) < 1e-5
        sd = eng.state_dict()
        for n, p in ref.named_parameters():
            if p.requires_grad:
                assert _rel(sd[n], p.detach()) < 1e-5, n


def test_simulated_device_dequantizes_on_the_device_tier(swap_dir, monkeypatch):
    """Separate device memory (the CUDA protocol through SimulatedDevice): the payload is
    copied H2D and dequantized there; same numbers as the CPU path."""
    monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    res = {}
    for home in ("cpu", "nvme"):
        model = _lora("gpt2")
        with infinity.initialize(model, _cfg(home, swap_dir, "nf4")) as eng:
            assert not eng.mm.dev.zero_copy
            # the payloads landing on the device before they are dequantized are planned
            qmax = max(g.home_nbytes for g in eng.grouping.groups if g.quant is not None)
            assert eng.placement.device["quantized payloads in flight (largest x "
                                        "(depth + 2))"] == qmax * (eng.cfg.prefetch.depth + 2)
            res[home] = []
            for ids in _ids(3):
                out = eng(input_ids=ids, labels=ids)
                eng.backward(out.loss)
                eng.step()
                res[home].append(out.loss.item())
    monkeypatch.delenv("INFINITY_SIMULATE_DEVICE")
    model = _lora("gpt2")
    with infinity.initialize(model, _cfg("cpu", swap_dir, "nf4")) as eng:
        cpu = []
        for ids in _ids(3):
            out = eng(input_ids=ids, labels=ids)
            eng.backward(out.loss)
            eng.step()
            cpu.append(out.loss.item())
    assert res["cpu"] == cpu and res["nvme"] == cpu


def test_checkpoint_round_trip_keeps_the_quantized_base(tmp_path, swap_dir):
    model = _lora("gpt2")
    cfg = _cfg("nvme", swap_dir, "int8")
    with infinity.initialize(model, cfg) as eng:
        for ids in _ids(2):
            out = eng(input_ids=ids, labels=ids)
            eng.backward(out.loss)
            eng.step()
        eng.save_checkpoint(str(tmp_path / "ck"))
        sd = {k: v.clone() for k, v in eng.state_dict().items()}
    model2 = _lora("gpt2", seed=5)
    with infinity.initialize(model2, _cfg("cpu", swap_dir, "int8")) as eng2:
        eng2.load_checkpoint(str(tmp_path / "ck"))
        sd2 = eng2.state_dict()
        for k, v in sd.items():
            assert _rel(sd2[k], v) < 1e-6, k


# ---------------------------------------------------------------- config and refusals

def test_config_key_validated_and_round_trips():
    c = InfinityConfig.load({"offload": {"frozen_weights": {"dtype": "NF4", "group_size": 128,
                                                            "double_quant": True}}})
    fw = c.offload.frozen_weights
    assert (fw.dtype, fw.group_size, fw.double_quant) == ("nf4", 128, True)
    assert InfinityConfig.load(c.to_dict()).offload.frozen_weights == fw
    assert "frozen_weights" not in InfinityConfig().to_dict()["offload"]   # default: left out
    assert InfinityConfig.load({"offload": {"frozen_weights": {"dtype": None}}}) \
        .offload.frozen_weights.dtype is None
    bad = [({"dtype": "fp8"}, "offload.frozen_weights.dtype"),
           ({"dtype": "nf4", "group_size": 63}, "offload.frozen_weights.group_size"),
           ({"group_size": 0}, "offload.frozen_weights.group_size"),
           ({"group_size": 1 << 20}, "offload.frozen_weights.group_size"),
           ({"double_quant": "yes"}, "offload.frozen_weights.double_quant"),
           ({"dtyp": "nf4"}, "offload.frozen_weights.dtyp")]
    for fw, key in bad:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            InfinityConfig.load({"offload": {"frozen_weights": fw}})
    with pytest.raises(ConfigError, match=r"nf4.*int8.*int4"):
        InfinityConfig.load({"offload": {"frozen_weights": {"dtype": "int2"}}})
    with pytest.raises(ConfigError, match="offload.frozen_weights"):
        InfinityConfig.load({"offload": {"frozen_weights": "nf4"}})


@pytest.mark.parametrize("simulate", [False, True], ids=["zero-copy", "simulated-device"])
def test_device_home_keeps_the_payload_on_the_device(simulate, swap_dir, monkeypatch):
    """``offload.params: "none"``: the quantized payload is the frozen base's home in
    device memory (QLoRA's layout), dequantized into a leased compute buffer for each
    use; the device holds the payload's bytes, not the working precision's.  Training
    equals PEFT + AdamW over the dequantized base, on a zero-copy tier and through the
    separate-device protocol (SimulatedDevice)."""
    if simulate:
        monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    model = _lora("llama")
    ref = _dequantized_reference(model, "nf4", double_quant=True)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            weight_decay=0.1)
    cfg = {"offload": {"params": "none", "optimizer": "cpu",
                       "frozen_weights": {"dtype": "nf4", "double_quant": True}},
           "optimizer": {"lr": LR, "weight_decay": 0.1}}
    with infinity.initialize(model, cfg) as eng:
        assert eng.mm.dev.zero_copy is not simulate
        quant = [g for g in eng.grouping.groups if g.quant is not None]
        assert quant and all(g.home == "device" for g in quant)
        assert all(eng.mm.paged(g) for g in quant)
        # the device holds the payloads and the plain groups, not the quantized ones whole
        want = sum(g.home_nbytes for g in eng.grouping.groups if g.home == "device")
        assert eng.placement.device["resident params"] == want
        assert want < sum(g.nbytes for g in eng.grouping.groups)
        def released():                          # after each step: released after use
            assert all(g.device_buf is None for g in quant)
        losses, ref_losses = train_beside(eng, ref, opt, _ids(3), after_step=released)
        assert _rel(losses, ref_losses) < 1e-5, (losses, ref_losses)
        sd = eng.state_dict()
        for n, p in ref.named_parameters():
            assert _rel(sd[n], p.detach()) < 1e-5, n
        st = eng.stats()
        assert st["frozen_nvme_read_bytes"] == 0 and st["frozen_host_read_bytes"] == 0


def _wide_llama(seed=0, d=64):
    import transformers
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=H.VOCAB, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False, tie_word_embeddings=False))


TILED = [("wide", "nf4", "nvme", {"double_quant": True}, False),
         ("wide-llama", "int4", "cpu", {"group_size": 12}, True),
         ("wide-llama", "int8", "nvme", {}, False),
         ("wide-llama", "nf4", "nvme", {}, True)]


@pytest.mark.parametrize("kind,dtype,home,fw,ckpt", TILED,
                         ids=[f"{k}-{d}-{h}{'-dq' if fw.get('double_quant') else ''}"
                              f"{'-ckpt' if c else ''}" for k, d, h, fw, c in TILED])
def test_tiled_quantized_base_matches_peft_over_dequantized_base(kind, dtype, home, fw, ckpt,
                                                                 swap_dir):
    """Memory-centric tiling of a quantized base (Note [Quantized tiles]): each tile
    decodes alone from the spans of its blocks; with activation checkpointing the
    recompute reads quantized tiles too (kept for the backward).  Training equals PEFT +
    AdamW over the dequantized base, and the tiles read a fraction of the bytes."""
    if kind == "wide-llama":
        base = _wide_llama()
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=TARGETS["llama"], lora_dropout=0.0))
    else:
        model = _lora(kind)
    if ckpt:
        model.base_model.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    ref = _dequantized_reference(model, dtype, **fw)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            weight_decay=0.1)
    cfg = _cfg(home, swap_dir, dtype, **fw)
    cfg["tiling"] = {"max_group_gb": 40e3 / 1e9}       # 40 kB: the MLP and LM head tiled
    with infinity.initialize(model, cfg) as eng:
        eng.train()
        ref.train()
        tiled = [g for sp in eng.tiling.specs.values() for g in sp.groups]
        assert any(g.quant is not None for g in tiled), eng.tiling.describe()
        losses, ref_losses = train_beside(eng, ref, opt, _ids(3))
        assert _rel(losses, ref_losses) < 1e-5, (losses, ref_losses)
        sd = eng.state_dict()
        for n, p in ref.named_parameters():
            assert _rel(sd[n], p.detach()) < 1e-5, n
        st = eng.stats()
        assert st["tiles_forward"] > 0
        tier = "frozen_nvme_read_bytes" if home == "nvme" else "frozen_host_read_bytes"
        assert st[tier] > 0


def test_bitsandbytes_layers_refused(swap_dir):
    fake = type("Linear4bit", (torch.nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
    model = torch.nn.Sequential(fake(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"offload\.frozen_weights"):
        infinity.initialize(model, _cfg("cpu", swap_dir, None))


def test_without_frozen_weights_nothing_changes(swap_dir):
    model = _lora("gpt2")
    with infinity.initialize(model, _cfg("nvme", swap_dir, None)) as eng:
        assert all(g.quant is None and g.home_nbytes == g.nbytes for g in eng.grouping.groups)


def test_trainable_and_unquantizable_params_stay_in_working_precision(swap_dir):
    model = _lora("llama")
    with infinity.initialize(model, _cfg("cpu", swap_dir, "nf4")) as eng:
        for g in eng.grouping.groups:
            kinds = {s.name.rsplit(".", 1)[-1] for s in g.slots}
            if g.trainable or "norm" in g.name:
                assert g.quant is None, g.name
            if g.quant is not None:
                q = {g.slots[ps.index].name for ps in g.quant.slots if ps.quantized}
                assert q and all(n.endswith("weight") for n in q), kinds


class _FrozenLayer(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.base = torch.nn.Linear(h, h)
        self.base.requires_grad_(False)
        self.a = torch.nn.Linear(h, 4, bias=False)
        self.b = torch.nn.Linear(4, h, bias=False)

    def forward(self, x):
        return torch.relu(self.base(x) + self.b(self.a(x)))


class _CheckpointedStack(torch.nn.Module):
    def __init__(self, ckpt, h=128, n=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(_FrozenLayer(h) for _ in range(n))
        self.ckpt = ckpt

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x)
        return x.square().mean()


@pytest.mark.parametrize("dtype", [None, "nf4"])
def test_recomputed_frozen_groups_go_after_their_backward(dtype, swap_dir):
    """Note [Recomputed frozen groups]: under activation checkpointing a frozen group
    fetched by the recompute is released once its layer's backward ran, not held to the
    end of the backward -- the device peak grows by less than two frozen groups over the
    run without checkpointing (it held all eight before) -- and training still equals
    plain PyTorch + AdamW (over the dequantized base)."""
    peaks, losses = {}, {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = _CheckpointedStack(ckpt)
        ref = copy.deepcopy(model)
        if dtype is not None:
            with torch.no_grad():
                for layer in ref.layers:
                    layer.base.weight.copy_(
                        quantize_weight(layer.base.weight, dtype).dequantize())
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                                weight_decay=0.1)
        cfg = _cfg("nvme", swap_dir, dtype)
        cfg["prefetch"] = {"depth": 1}
        xs = [torch.randn(4, 128, generator=torch.Generator().manual_seed(i))
              for i in range(3)]
        with infinity.initialize(model, cfg) as eng:
            eng.train()
            got, want = [], []
            for x in xs:
                loss = eng(x)
                eng.backward(loss)
                eng.step()
                r = ref(x)
                r.backward()
                opt.step()
                opt.zero_grad()
                got.append(loss.item())
                want.append(r.item())
            assert _rel(got, want) < 1e-5, (ckpt, got, want)
            peaks[ckpt] = eng.stats()["device_peak_bytes"]
            group = max(g.nbytes for g in eng.grouping.groups if not g.trainable)
        losses[ckpt] = got
    assert peaks[True] - peaks[False] < 2 * group, (peaks, group)


def test_gathered_parameters_over_a_quantized_base(swap_dir):
    """GatheredParameters(modifier_rank=0) over a set holding quantized frozen weights: the
    adapters' changes are stored, the quantized weights given back unchanged are skipped;
    changing one is refused before anything is written."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model[0].requires_grad_(False)
    with infinity.initialize(model, _cfg("cpu", swap_dir, "nf4")) as eng:
        before = eng.state_dict()["0.weight"].clone()
        with infinity.GatheredParameters(list(model.parameters()), modifier_rank=0):
            with torch.no_grad():
                model[1].weight.zero_()
        sd = eng.state_dict()
        assert torch.equal(sd["0.weight"], before) and not sd["1.weight"].any()
        with pytest.raises(ValueError, match=r"0\.weight is a frozen weight stored quantized"):
            with infinity.GatheredParameters(list(model.parameters()), modifier_rank=0):
                with torch.no_grad():
                    model[1].weight.fill_(1.0)
                    model[0].weight.zero_()
        assert not eng.state_dict()["1.weight"].any()      # nothing was written
