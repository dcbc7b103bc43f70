"""InfinityTrainer at world size 2 under torchrun (ZeRO-3 over gloo, params and optimizer on
NVMe, one micro-batch per rank) equals the plain single-process Trainer on the same global
batch: losses, gradient norms and weights; checkpoints and save_model are collective."""
import json
import os
import socket
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402

transformers = pytest.importorskip("transformers")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(child, spec, tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_port()}",
           os.path.join(HERE, child), str(tmp_path / "spec.json")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-6000:]


def test_two_ranks_match_single_process_trainer(tmp_path):
    from safetensors.torch import load_file
    spec = {"out": str(tmp_path / "out"), "swap": str(tmp_path / "swap"),
            "final": str(tmp_path / "final"), "weights": str(tmp_path / "w.safetensors"),
            "result": str(tmp_path / "result.json")}
    _torchrun("torchrun_child.py", spec, tmp_path)
    res = json.load(open(spec["result"]))
    assert res["world_size"] == 2
    ref = transformers.Trainer(model=H.gpt2(), args=H.args(tmp_path / "ref"),
                               train_dataset=H.TokenData())
    ref.train()
    a, b = res["losses"], H.losses(ref)
    assert len(a) == 10 and all(abs(x - y) / y < 1e-5 for x, y in zip(a, b)), (a, b)
    for x, y in zip(res["grad_norms"], H.log_values(ref, "grad_norm")):
        assert abs(x - y) / y < 1e-4
    got = load_file(spec["weights"])
    for n, v in ref.model.named_parameters():
        d = float((got[n] - v.detach()).norm() / v.detach().norm())
        assert d < (5e-3 if "c_attn.bias" in n else 1e-5), (n, d)
    assert sorted(os.listdir(spec["out"])) == ["checkpoint-10"]      # save_total_limit=1
    assert os.path.isdir(os.path.join(spec["out"], "checkpoint-10", "infinity"))
    m = transformers.AutoModelForCausalLM.from_pretrained(spec["final"])
    for n, v in m.named_parameters():
        assert float((v.detach() - got[n]).norm()) == 0.0, n


def test_gathered_parameters_two_ranks(tmp_path):
    """Init at world size 2 (each rank homes half of every parameter): resizing inside
    GatheredParameters(modifier_rank=0) stores rank 0's values on both ranks."""
    import torch
    from safetensors.torch import load_file
    spec = {"swap": str(tmp_path / "swap"), "weights": str(tmp_path / "w.safetensors")}
    _torchrun("gathered_child.py", spec, tmp_path)
    got = load_file(spec["weights"])
    eager = H.gpt2()
    torch.manual_seed(5)
    eager.resize_token_embeddings(H.VOCAB + 6, mean_resizing=False)
    for k, v in eager.state_dict().items():
        if k in got:
            assert torch.equal(got[k], v), k
    assert got["transformer.wte.weight"].shape == (H.VOCAB + 6, 32)
    # GatheredParameters over the engine's ZeRO-3 shards (read only) gives the full value
    assert torch.equal(got["gathered.engine_held_wte"], got["transformer.wte.weight"])


def test_engine_edits_and_quantized_save_two_ranks(tmp_path):
    """World size 2 (ZeRO-2 with resident parameters, then ZeRO-3 with params and optimizer
    on cpu, then nvme): GatheredParameters with
    modifier_rank=1 on engine-held parameters stores rank 1's edit on both ranks (rank 0's
    writes discarded), Adam moments kept: training on equals one process with
    torch.optim.AdamW on the global batch and the same edit to p.data.  Then
    save_pretrained(quantize="int4") at world size 2 loads with transformers, its weights
    exactly our quantizer's output of the trained values."""
    import torch
    from safetensors.torch import load_file

    import engine_edit_child as C
    from infinity.checkpoint.layerwise import is_conv1d
    from infinity.quant import quantize
    homes = ["stage2", "cpu", "nvme"]
    spec = {"swap": str(tmp_path / "swap"), "homes": homes,
            "weights": str(tmp_path / "w-%s.safetensors"),
            "edited": str(tmp_path / "e-%s.safetensors"),
            "quantized": str(tmp_path / "q"), "full": str(tmp_path / "full")}
    _torchrun("engine_edit_child.py", spec, tmp_path)
    ref = H.gpt2()
    ref.transformer.ln_f.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    bs = C.batches(4)

    def train(part):
        for ids in part:
            losses = [ref(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss for r in (0, 1)]
            (sum(losses) / 2).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

    train(bs[:2])
    C.edit(ref, torch.Generator().manual_seed(7))
    want_edit = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    train(bs[2:])
    for home in homes:
        got_edit, got = load_file(spec["edited"] % home), load_file(spec["weights"] % home)
        assert torch.equal(got_edit["transformer.ln_f.weight"],
                           torch.full((32,), 1.5))               # rank 1's value, not rank 0's
        assert torch.allclose(got_edit["transformer.wte.weight"][5],
                              want_edit["transformer.wte.weight"][5], atol=1e-6)
        for n, v in ref.named_parameters():
            d = float((got[n] - v.detach()).norm() / v.detach().norm())
            assert d < (5e-3 if "c_attn.bias" in n else 1e-5), (home, n, d)
    # the quantized export of the trained engine (world size 2)
    q = transformers.AutoModelForCausalLM.from_pretrained(spec["quantized"]).eval()
    sub = transformers.AutoModelForCausalLM.from_pretrained(spec["full"],
                                                            dtype=torch.bfloat16).eval()
    full = load_file(os.path.join(spec["full"], "model.safetensors"))
    with torch.no_grad():
        for name, mod in sub.named_modules():
            if is_conv1d(mod):
                mod.weight.copy_(quantize(full[f"{name}.weight"], 4, 32,
                                          scale_dtype=torch.bfloat16).dequantize(torch.bfloat16))
        ids = bs[0]
        a, b = q(ids).logits.float(), sub(ids).logits.float()
    assert float((a - b).norm() / b.norm()) < 1e-3
