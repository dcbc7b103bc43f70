"""LoRA over a frozen base the engine keeps quantized (``infinity estimate --lora-rank R
--frozen-dtype nf4``): the bytes of a quantized base equal the engine's payload layout, the
FLOPs MFU counts, the planner's LoRA plan equals the brute-force best through
``estimate()``, the CLI flags and JSON keys, and the refusals."""
import dataclasses
import itertools
import json
import types

import pytest
import torch
from torch import nn

import infinity.estimate.lora as lora
from infinity.cli.main import main
from infinity.estimate import (EstimateError, Machine, estimate, knobs_from, spec_from_dims,
                               spec_from_module)
from infinity.estimate.memory_plan import Knobs, host_reserve_bytes
from infinity.estimate.planner import ACTIVATION_CHOICES, make_plan
from infinity.estimate.step_time import attention_flops_per_token, model_flops_per_token
from infinity.memory.frozen_quant import QuantSpec, layout_for
from infinity.quant import quantize_weight
from infinity.quant.weight import TORCH_PATH_CHUNK

GB = 10**9
NODE = dict(gpus=8, gpu_mem_gb=80, host_mem_gb=2000, nvme_gb=30000, nvme_drives=8,
            nvme_gbps=56, nvme_write_gbps=40, tflops=400)


# ------------------------------------------------------------------------- bytes

@pytest.mark.parametrize("dtype,double_quant", [(d, q) for d in ("nf4", "int8", "int4")
                                                for q in (False, True)])
def test_tensor_bytes_equal_the_quantizer(dtype, double_quant):
    """tensor_nbytes == QuantizedWeight.nbytes (payload + scales) at awkward sizes."""
    for n, gs in ((1, 64), (7, 2), (4095, 64), (4097, 64), (64 * 256 + 1, 64), (1000, 100)):
        qw = quantize_weight(torch.randn(n), dtype, gs, double_quant=double_quant)
        assert lora.tensor_nbytes(n, dtype, gs, double_quant) == qw.nbytes, (n, gs)


def test_group_payload_equals_layout_for():
    """payload_nbytes (64-byte aligned tensors, a bias in the working precision, padded to
    4096) == infinity.memory.frozen_quant.layout_for's, on a GroupRecord-free stand-in."""
    for dtype, dq, gs in (("nf4", False, 64), ("nf4", True, 64), ("int8", False, 128),
                          ("int4", True, 32)):
        lin = nn.Linear(4097, 7)          # 28679 weights + 7 biases
        emb = nn.Embedding(33, 5)
        params = [lin.weight, lin.bias, emb.weight]
        qids = {id(lin.weight), id(emb.weight)}
        g = types.SimpleNamespace(
            trainable=False, dtype=torch.bfloat16,
            slots=[types.SimpleNamespace(param=p, numel=p.numel()) for p in params])
        lay = layout_for(g, QuantSpec(dtype, gs, dq), qids)
        mine = lora.payload_nbytes([(p.numel(), id(p) in qids) for p in params], dtype, gs,
                                   dq, lp=2)
        assert mine == lay.nbytes, (dtype, dq)


def test_bytes_per_frozen_param_and_the_base_at_its_home():
    from infinity.quant import WEIGHT_DTYPES
    from infinity.quant.nf4 import DQ_BLOCK
    assert lora.FROZEN_DTYPES == WEIGHT_DTYPES and lora.DQ_BLOCK == DQ_BLOCK
    assert lora.bytes_per_frozen_param("nf4") == 0.5 + 4 / 64 == 0.5625
    assert lora.bytes_per_frozen_param("int4") == 0.5625
    assert lora.bytes_per_frozen_param("int8", 128) == 1 + 4 / 128
    assert lora.bytes_per_frozen_param("nf4", 64, True) == 0.5 + 1 / 64 + 4 / (64 * 256)
    assert lora.bytes_per_frozen_param(None, lp=2) == 2
    spec = spec_from_dims(10**12, 128, 25600, vocab=64000)
    k = Knobs(lora_rank=64, frozen_dtype="nf4")
    nq = 10**12 - (13 * 128 + 2) * 25600            # all but a GPT block's biases and norms
    assert lora.quantizable_params(spec) == nq
    assert lora.frozen_home_bytes(spec, k) == int(nq * 0.5625) + (10**12 - nq) * 2
    assert lora.frozen_home_bytes(spec, Knobs(lora_rank=64)) == 2 * 10**12   # not quantized


# ------------------------------------------------------------------------- shapes, FLOPs

class _Block(nn.Module):
    """A Llama-shaped block with GQA: q/o H x H, k/v H -> H/4, gate/up H -> I, down I -> H."""

    def __init__(self, H=64, I=176):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H, bias=False), nn.Linear(H, H // 4, bias=False), \
            nn.Linear(H, H // 4, bias=False)
        self.o = nn.Linear(H, H, bias=False)
        self.gate, self.up = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down = nn.Linear(I, H, bias=False)
        self.norm = nn.LayerNorm(H)


class _Llama(nn.Module):
    def __init__(self, L=3, H=64, V=100):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList([_Block(H) for _ in range(L)])
        self.head = nn.Linear(H, V, bias=False)


def test_adapters_follow_the_model_shapes():
    with torch.device("meta"):
        m = _Llama()
    spec = spec_from_module(m, seq=16)
    H, I, L, R = 64, 176, 3, 8
    per_layer = R * ((H + H) * 2 + (H + H // 4) * 2 + (H + I) * 2 + (I + H))
    assert lora.adapter_params(spec, R) == L * per_layer       # the LM head is not adapted
    assert lora.largest_adapter_group(spec, R) == R * I
    # quantizable: every Linear / Embedding weight (not the norms)
    norms = L * 2 * H
    assert spec.quantizable == spec.params - norms
    # by dimensions: a GPT block (QKV H->3H, output, MLP H->4H->H): 16*R*H per layer
    d = spec_from_dims(10**9, 24, 2048, vocab=50000)
    assert lora.adapter_params(d, 16) == 16 * 16 * 2048 * 24
    assert lora.largest_adapter_group(d, 16) == 16 * 4 * 2048


def test_lora_flops_formula_and_mfu():
    spec = spec_from_dims(20_000_000_000, 44, 6144, vocab=50000, seq=2048)
    k = Knobs(lora_rank=16, frozen_dtype="nf4")
    na = 16 * 16 * 6144 * 44
    att = 12 * 44 * 6144 * 2048
    assert attention_flops_per_token(spec) == att
    assert model_flops_per_token(spec, knobs=k) == 4 * spec.params + 6 * na + att
    assert model_flops_per_token(spec, knobs=k, checkpointing=True, hardware=True) == \
        6 * spec.params + 8 * na + att * 4 // 3
    # without checkpointing nothing is recomputed
    assert model_flops_per_token(spec, knobs=k, hardware=True) == 4 * spec.params + 6 * na + att
    m = Machine(gpus=1, gpu_mem_gb=48, host_mem_gb=32, nvme_gb=2000, nvme_drives=2,
                nvme_gbps=12, nvme_write_gbps=8, tflops=100)
    p = make_plan(spec, m, k, global_batch=16)
    tps = p.best.step.tokens_per_s
    assert p.mfu() == pytest.approx(tps * (4 * spec.params + 6 * na + att) / 100e12)
    # the compute term of a micro-batch is the hardware FLOPs over the rate
    s = p.best.step
    c = p.best.checkpointing
    fl = model_flops_per_token(spec, knobs=k, checkpointing=c, hardware=True) * 2048 \
        * p.best.micro_batch
    assert s.fwd_bwd.derivation[0].endswith(f"= {fl / 100e12:.4g} s")


# ------------------------------------------------------------------------- memory, traffic

def _spec20():
    return spec_from_dims(20_000_000_000, 44, 6144, vocab=50000, seq=2048)


def test_frozen_base_lines_traffic_and_dequantize():
    spec = _spec20()
    m = Machine(gpus=2, gpu_mem_gb=80, host_mem_gb=512, nvme_gb=4000, nvme_drives=2,
                nvme_gbps=12, nvme_write_gbps=8, tflops=100)
    k = dict(lora_rank=16, frozen_dtype="nf4", precision="bf16")
    est = estimate(spec, machine=m, configs=[("nvme", "cpu"), ("none", "none")], **k)
    by = {(c.params_home, c.optimizer_home): c for c in est.configs}
    kn = est.knobs
    base = lora.frozen_home_bytes(spec, kn)
    na = lora.adapter_params(spec, 16)
    nv = by[("nvme", "cpu")]
    items = {i.name: i for i in nv.plan.items}
    assert items["frozen base home (NVMe, quantized)"].nbytes == 2 * -(-base // 2)
    assert items["adapters home (NVMe)"].nbytes == 2 * -(-na // 2) * 2
    # only the adapters train: fp32 master + m + v and fp32 gradients of Na
    assert items["optimizer: master + m + v (host)"].nbytes == 2 * -(-na // 2) * 12
    assert items["grad accumulation (fp32, host)"].nbytes == 2 * -(-na // 2) * 4
    G = spec.group_numel("module")
    # the torch path dequantizes in passes of TORCH_PATH_CHUNK: its temporaries are bounded
    # by that, not by the 151M-element MLP matrix
    assert G > TORCH_PATH_CHUNK
    assert items["dequantize scratch (torch path on CUDA)"].nbytes == 18 * TORCH_PATH_CHUNK
    # per micro-batch the base is read forward + backward, never written; the all-gather
    # moves the quantized bytes
    s = nv.steps["none"]
    assert s.traffic["nvme_read"] == 2 * 2 * -(-base // 2) + 2 * 2 * -(-na // 2) * 2
    assert s.traffic["nvme_write"] == 2 * -(-na // 2) * 2      # the adapters' updated bf16
    assert s.traffic["allgather"] == int(2 * base / 2) + int(2 * na * 2 / 2)
    # the dequantize: 2*Nq*lp per micro-batch at the GPU default, added to compute
    deq = 2 * lora.quantizable_params(spec) * 2 / (2500 / 43 * 2 * GB)
    comp = model_flops_per_token(spec, knobs=kn, hardware=True) * 2048 / 100e12
    assert s.fwd_bwd.terms["compute"] == pytest.approx(comp + deq)
    # CPU Adam steps the adapters only
    assert s.optimizer.terms["cpu_adam"] == pytest.approx(2 * -(-na // 2) / 4e9)
    # a recomputed frozen group is released after its module's backward (Note [Recomputed
    # frozen groups]): checkpointing changes the activations only, no frozen-base line
    assert nv.totals["device_checkpointing"] - nv.totals["device_none"] == \
        nv.plan.activations["checkpointing"].nbytes - nv.plan.activations["none"].nbytes
    # a bf16 base: no dequantize, no scratch, twice ... the bytes of the home
    est2 = estimate(spec, machine=m, configs=[("nvme", "cpu")], lora_rank=16)
    c2 = est2.configs[0]
    assert "dequantize scratch (torch path on CUDA)" not in {i.name for i in c2.plan.items}
    assert c2.steps["none"].traffic["nvme_read"] == 2 * 2 * -(-spec.params * 2 // 2) \
        + 2 * 2 * -(-na // 2) * 2


def test_dequantize_scratch_is_one_pass_of_the_torch_path():
    """The scratch line counts GPU_DEQUANT_SCRATCH_BYTES per element of one pass: the whole
    weight up to infinity.quant.weight.TORCH_PATH_CHUNK elements (the constant imported,
    not repeated), that many above it; none CPU-only (the C++ kernel)."""
    import infinity.quant.weight as qw
    assert lora.TORCH_PATH_CHUNK is qw.TORCH_PATH_CHUNK == 1 << 24
    for dt, per in (("nf4", 18), ("int8", 8), ("int4", 18)):
        k = Knobs(lora_rank=4, frozen_dtype=dt)
        assert lora.dequant_scratch_bytes(1000, k) == per * 1000
        assert lora.dequant_scratch_bytes(qw.TORCH_PATH_CHUNK, k) == per * qw.TORCH_PATH_CHUNK
        assert lora.dequant_scratch_bytes(10**10, k) == per * qw.TORCH_PATH_CHUNK
    small = spec_from_dims(10**8, 8, 1024)            # Gmax = 4*H*H = 4 Mi elements
    k = Knobs(lora_rank=4, frozen_dtype="nf4")
    gpu = Machine(gpus=1, gpu_mem_gb=80, host_mem_gb=64, nvme_gb=100)
    by = {n: b for _, n, b, _ in lora.param_items(small, gpu, k, "cpu")}
    assert by["dequantize scratch (torch path on CUDA)"] == 18 * small.group_numel("module")
    cpu = Machine(gpus=0, host_mem_gb=64, nvme_gb=100)
    assert not any("scratch" in n for _, n, _, _ in lora.param_items(small, cpu, k, "cpu"))


# ------------------------------------------------------------------------- the planner

def _brute_force(spec, machine, global_batch, knobs, clip):
    """The fastest fitting (step_s, choice) by calling estimate() per combination."""
    R = machine.ranks
    per_rank = global_batch // R
    best = None
    for B in [b for b in range(1, per_rank + 1) if per_rank % b == 0]:
        for (ah, sc), d in itertools.product(ACTIVATION_CHOICES, (1, 2, 3)):
            est = estimate(dataclasses.replace(spec, batch=B), machine=machine, precision="bf16",
                           grad_accum=per_rank // B, prefetch_depth=d, activation_home=ah,
                           activation_scope=sc, gradient_clipping=clip,
                           lora_rank=knobs.lora_rank, frozen_dtype=knobs.frozen_dtype,
                           host_cap_gb=(machine.host_mem_gb * GB - host_reserve_bytes(machine))
                           / GB if R == 1 else None)
            for c in est.configs:
                for v in ("checkpointing", "none"):
                    if c.fits[v] and (best is None or c.steps[v].step_s < best[0] * (1 - 1e-9)):
                        best = (c.steps[v].step_s, (c.params_home, c.optimizer_home, v, ah, sc, B))
    return best


@pytest.mark.parametrize("frozen,gpus", [("nf4", 1), ("int8", 1), (None, 1), ("nf4", 2)])
def test_lora_plan_equals_the_brute_force_best(frozen, gpus):
    """One GPU, and two ranks sharding the quantized payload."""
    spec = _spec20()
    m = Machine(gpus=gpus, gpu_mem_gb=48 if gpus == 1 else 24, host_mem_gb=32, nvme_gb=2000,
                nvme_drives=2, nvme_gbps=12, nvme_write_gbps=8, tflops=100)
    k = knobs_from(None, dict(precision="bf16", lora_rank=16, frozen_dtype=frozen))
    plan = make_plan(spec, m, k, global_batch=16)
    bf = _brute_force(spec, plan.machine, 16, k, plan.best.knobs.gradient_clipping)
    assert plan.best is not None and bf is not None
    assert plan.best.step.step_s == pytest.approx(bf[0], rel=1e-9)
    b = plan.best
    assert b.knobs.lora_rank == 16 and b.knobs.frozen_dtype == frozen
    cfg = b.config()
    if frozen:
        assert cfg["offload"]["frozen_weights"] == {"dtype": frozen, "group_size": 64,
                                                     "double_quant": False}
    else:
        assert "frozen_weights" not in cfg["offload"]
    from infinity.config import InfinityConfig
    InfinityConfig.load(cfg)                       # a valid infinity config
    d = plan.as_dict()
    assert d["frozen_home"] == {"none": "device", "cpu": "host", "nvme": "nvme"}[b.params_home]
    assert d["frozen_bytes"] == lora.frozen_home_bytes(spec, k)


def test_the_1t_reference_node_lora_plan():
    """The 1T target (docs/estimator.md): rank 64 over an nf4 base in host memory, with
    checkpointing (the recomputed frozen groups released after each module's backward),
    micro-batch 8, compute-bound: MFU 58.8 % with the torch-path dequantize the engine runs
    (34.4 s per micro-batch at the counted 116 GB/s), 66.1 % with a fused kernel's rate
    (not what the engine does), against the 66.8 % ceiling of checkpointing; the >= 50 %
    holds while the dequantize reaches ~48 GB/s of bf16 output."""
    spec = spec_from_dims(10**12, 128, 25600, vocab=64000, seq=2048)
    k = knobs_from(None, dict(precision="bf16", lora_rank=64, frozen_dtype="nf4"))
    p = make_plan(spec, Machine(**NODE), k)
    b = p.best
    assert b is not None and b.checkpointing and b.params_home == "cpu" and b.micro_batch == 8
    assert p.mfu() == pytest.approx(0.588, abs=0.001) and b.step.bound == "compute"
    items = {i.name: i.nbytes for i in b.estimate.plan.items}
    assert items["dequantize scratch (torch path on CUDA)"] == 18 * TORCH_PATH_CHUNK
    deq = 2 * lora.quantizable_params(spec) * 2 / (2500 / 43 * 2 * GB)
    assert any(f"= {deq:.4g} s" in line for line in b.step.fwd_bwd.derivation)
    fused = make_plan(spec, Machine(**NODE, dequant_gbps=1500), k)
    assert fused.mfu() == pytest.approx(0.661, abs=0.001) and fused.hfu() <= 1.0 + 1e-9
    ceiling = model_flops_per_token(spec, knobs=k) / model_flops_per_token(
        spec, knobs=k, checkpointing=True, hardware=True)    # compute-bound, checkpointing
    assert fused.mfu() < ceiling == pytest.approx(0.668, abs=0.001)
    assert make_plan(spec, Machine(**NODE, dequant_gbps=45), k).mfu() < 0.5


# ------------------------------------------------------------------------- CLI

def test_cli_plan_flags_and_json_keys(capsys):
    model = ["estimate", "--params", "20B", "--layers", "44", "--hidden", "6144", "--vocab",
             "50000", "--gpus", "1", "--gpu-mem", "48", "--host-mem", "32", "--nvme-gb", "2000",
             "--nvme-gbps", "12", "--tflops", "100"]
    args = model + ["--global-batch", "16", "--plan", "--lora-rank", "16", "--frozen-dtype",
                    "nf4", "--double-quant", "--frozen-group-size", "128"]
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"lora_rank", "frozen_dtype", "frozen_bytes", "frozen_home", "adapter_params",
            "frozen_group_size", "frozen_double_quant", "frozen_bytes_per_param",
            "dequant_gbps", "mfu"} <= set(d)
    assert d["lora_rank"] == 16 and d["frozen_dtype"] == "nf4" and d["frozen_group_size"] == 128
    assert "recompute_holds_frozen" not in d
    assert d["frozen_double_quant"] is True
    assert d["adapter_params"] == 16 * 16 * 6144 * 44
    assert d["plan"]["offload"]["frozen_weights"] == {"dtype": "nf4", "group_size": 128,
                                                      "double_quant": True}
    assert d["frozen_bytes_per_param"] == pytest.approx(
        lora.bytes_per_frozen_param("nf4", 128, True), rel=1e-3)
    assert main(args + ["--dequant-gbps", "500"]) == 0
    out = capsys.readouterr().out
    assert "LoRA: rank 16" in out and "dequantized at 500 GB/s" in out
    assert "dequantize: 2*Nq*lp" in out
    # the estimate (no --plan) reports the same in its "lora" object
    assert main(model + ["--lora-rank", "16", "--frozen-dtype", "int4", "--json",
                         "--only", "cpu/cpu"]) in (0, 1)
    e = json.loads(capsys.readouterr().out)
    assert e["lora"]["frozen_dtype"] == "int4" and e["knobs"]["lora_rank"] == 16


@pytest.mark.parametrize("extra,msg", [
    (["--frozen-dtype", "nf4"], "add --lora-rank"),
    (["--double-quant"], "add --lora-rank"),
    (["--lora-rank", "0"], "lora_rank must be an integer >= 1"),
    (["--lora-rank", "4", "--frozen-dtype", "fp32"], "working precision"),
    (["--lora-rank", "4", "--frozen-dtype", "nf4", "--frozen-group-size", "63"], "even"),
    (["--lora-rank", "4", "--tiling-max-group-gb", "1"], "tiling"),
    (["--lora-rank", "4", "--grouping", "block"], "module grouping"),
])
def test_cli_refuses_bad_lora_input(capsys, extra, msg):
    base = ["estimate", "--params", "7B", "--layers", "32", "--hidden", "4096", "--gpus", "1",
            "--host-mem", "100", "--nvme-gb", "100"]
    assert main(base + extra) == 2
    assert msg in capsys.readouterr().err


def test_python_api_refusals():
    with pytest.raises(EstimateError, match="add --lora-rank"):
        estimate(params=10**9, layers=24, hidden=2048, machine=Machine(gpus=0, host_mem_gb=64,
                                                                      nvme_gb=10),
                 frozen_dtype="nf4")
    with pytest.raises(EstimateError, match="lora_rank"):
        make_plan(_spec20(), Machine(**NODE), Knobs(lora_rank=-1))
    # a config's offload.frozen_weights without LoRA means nothing: ignored
    k = knobs_from({"offload": {"frozen_weights": {"dtype": "nf4"}}}, {})
    assert k.frozen_dtype is None and k.lora_rank is None
    k = knobs_from({"offload": {"frozen_weights": {"dtype": "int8", "group_size": 32}}},
                   {"lora_rank": 4})
    assert (k.frozen_dtype, k.frozen_group_size) == ("int8", 32)


# ------------------------------------------------------------------------- the engine

class _Frozen(nn.Module):
    """A frozen Linear with a LoRA-like trainable pair."""

    def __init__(self, H):
        super().__init__()
        self.base = nn.Linear(H, H)
        self.base.requires_grad_(False)
        self.a, self.b = nn.Linear(H, 4, bias=False), nn.Linear(4, H, bias=False)

    def forward(self, x):
        return torch.relu(self.base(x) + self.b(self.a(x)))


class _Stack(nn.Module):
    def __init__(self, H=256, L=8, ckpt=False):
        super().__init__()
        self.layers = nn.ModuleList(_Frozen(H) for _ in range(L))
        self.ckpt = ckpt

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x)
        return x.sum()


def test_the_engine_releases_recomputed_frozen_groups_as_the_estimate_says(tmp_path):
    """The estimate counts no frozen-base line for checkpointing (the fetch window covers
    a recomputed group): the engine releases a frozen group fetched by a recompute once its
    module's backward ran (infinity/runtime/hooks.py, Note [Recomputed frozen groups]).  So
    with checkpointing the device peak grows by less than two frozen groups -- not by the
    eight of an engine that held them to the end of the backward."""
    import infinity

    peaks = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = _Stack(ckpt=ckpt)
        cfg = {"precision": "fp32", "prefetch": {"depth": 1},
               "offload": {"params": "nvme", "optimizer": "cpu",
                           "nvme_paths": [str(tmp_path / f"swap{int(ckpt)}")],
                           "frozen_weights": {"dtype": "nf4"}}}
        with infinity.initialize(model, cfg) as e:
            for _ in range(2):
                e.backward(e(torch.randn(4, 256)))
                e.step()
            peaks[ckpt] = e.stats()["device_peak_bytes"]
    group = spec_from_module(_Stack(), seq=4, hidden=256, heads=1).group_numel("module") * 4
    assert group == 257 * 256 * 4                     # the frozen Linear, weight and bias
    grown = peaks[True] - peaks[False]
    assert grown < 2 * group, (peaks, group)


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_cpu_only_fetch_window_holds_every_other_group_frozen(depth):
    """CPU-only, LoRA on every projection: adapter groups are used right after the frozen
    weight they adapt, so the fetch window of d+2 groups holds ceil((d+2)/2) frozen ones
    (NVMe home: the rest are adapter groups; host home: adapters used in place); the
    quantized payloads read from NVMe, one per frozen group in the window.  With GPUs the device line stays the engine's budget, the whole window."""
    spec = spec_from_dims(7e9, 32, 4096, seq=512, vocab=32000)
    k = Knobs(precision="bf16", lora_rank=16, frozen_dtype="nf4", prefetch_depth=depth)
    G, Ga = spec.group_numel(k.grouping), lora.largest_adapter_group(spec, 16)
    Gq = lora.largest_payload(spec, k)
    fw = -(-(depth + 2) // 2)
    assert lora.frozen_in_window(depth) == fw
    cpu = Machine(gpus=0, host_mem_gb=64, nvme_gb=500)
    nv = {n: b for _, n, b, _ in lora.param_items(spec, cpu, k, "nvme")}
    assert nv["fetched groups (in use + prefetch)"] == fw * G * 2 + (depth + 2 - fw) * Ga * 2
    assert nv["quantized payload reads"] == fw * Gq
    host = {n: b for _, n, b, _ in lora.param_items(spec, cpu, k, "cpu")}
    assert host["fetched groups (in use + prefetch)"] == fw * G * 2
    gpu = Machine(gpus=1, gpu_mem_gb=80, host_mem_gb=64, nvme_gb=500)
    dev = {n: b for _, n, b, _ in lora.param_items(spec, gpu, k, "nvme")}
    assert dev["fetched groups (in use + prefetch)"] == (depth + 2) * G * 2
