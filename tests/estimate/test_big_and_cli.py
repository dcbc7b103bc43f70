"""The 1T question, the CLI (--json) and counting a transformers model on the meta device."""
import json
import textwrap

import pytest

from infinity.cli.main import main
from infinity.estimate import Machine, estimate

ONE_T = dict(params=1_000_000_000_000, layers=128, hidden=25600, vocab=51200, heads=160, seq=2048, batch=1)
NODE = dict(gpus=8, gpu_mem_gb=80, host_mem_gb=2000, nvme_gb=30720, nvme_drives=8, nvme_gbps=48,
            nvme_write_gbps=32)


def test_one_trillion_on_one_8x80gb_node():
    # untiled, whole-group reductions (reduce_bucket_mb 0) do not fit the device: the engine
    # then reserves (4+3) full fp32 gradient buffers of the largest group (+ 9 shards)
    whole = estimate(**ONE_T, machine=Machine(**NODE), precision="bf16", reduce_bucket_mb=0)
    assert whole.best is None
    nn0 = {(c.params_home, c.optimizer_home): c for c in whole.configs}[("nvme", "nvme")]
    assert any(p.startswith("device") for p in nn0.problems["checkpointing"])
    # gradient buckets (the default, Note [Gradient buckets]): 7 buckets of 128 MB
    untiled = estimate(**ONE_T, machine=Machine(**NODE), precision="bf16")
    nb = {(c.params_home, c.optimizer_home): c for c in untiled.configs}[("nvme", "nvme")]
    grads = next(i for i in nb.plan.items if i.name == "grads of groups in backward")
    assert grads.nbytes == 7 * 128 * 10**6
    assert not any(p.startswith("device") for p in nb.problems["checkpointing"])
    # tiled (groups over 1.31 GB computed tile by tile, their gradients moved a tile at a time)
    est = estimate(**ONE_T, machine=Machine(**NODE), precision="bf16", tiling_max_group_gb=1.31)
    by = {(c.params_home, c.optimizer_home): c for c in est.configs}
    assert len(by) == 9
    # as the engine decides (ZeRO rule): the fp32 grad shard N/R*4 = 500 GB exceeds half of a
    # rank's share of the host (2000 GB - 9 GB reserve)/8 = 248.9 GB, optimizer on NVMe ->
    # gradients on NVMe: 2 TB params + 12 TB fp32 master/m/v + 4 TB grads = 18 TB of NVMe,
    # + 12 TB of commit shadows (all-or-nothing updates: one per NVMe state tensor) = 30 TB
    nn = by[("nvme", "nvme")]
    assert nn.plan.grads_on_nvme and nn.totals["nvme"] == 30 * 10**12
    assert any("ZeRO: fp32 grad shard" in n for n in nn.plan.notes)
    best, variant = est.best
    assert (best.params_home, best.optimizer_home, variant) == ("nvme", "nvme", "checkpointing")
    assert est.verdict().startswith("Yes: 1T parameters fit") and "gradients on NVMe" in est.verdict()
    # the device side does not fit without checkpointing
    assert any("device" in p for p in nn.problems["none"])
    s = best.steps["checkpointing"]
    # NVMe per step: read 2*N*lp params + N*12 master/m/v = 16 TB, plus the tiled groups
    # read again for the recompute, write N*12 + N*2 updated params = 14 TB: ZeRO stage 3
    # streams the final gradient shards (Note [Streamed gradients]: with one micro-batch per
    # step they are neither written nor read back)
    assert nn.plan.grads_streamed
    assert 16 * 10**12 < s.traffic["nvme_read"] < 16 * 10**12 + 2 * 2 * 10**12
    assert s.traffic["nvme_write"] == 14 * 10**12
    assert s.bound == "nvme" and 300 < s.step_s < 5000
    # optimizer on the host never spills (ZeRO rule needs it on NVMe): 4 TB of grads in RAM
    assert not by[("nvme", "cpu")].plan.grads_on_nvme
    # the comparison: fp32 grads kept in host memory (4 TB > 2 TB RAM) -> nothing fits
    w = est.what_if
    assert w is not None and w.knobs.grad_spill == "off" and w.best is None
    assert "nothing fits" in est.verdict()
    assert any("host: needs" in p for p in
               {(c.params_home, c.optimizer_home): c for c in w.configs}[("nvme", "nvme")].problems["checkpointing"])
    # explicit "off" answers No and offers the engine's placement for comparison
    off = estimate(**ONE_T, machine=Machine(**NODE), precision="bf16", grad_spill="off",
                   tiling_max_group_gb=1.31)
    assert off.best is None and off.verdict().startswith("No:")
    assert off.what_if.best[0].name == best.name
    # with 4 TB of NVMe nothing fits either way
    est3 = estimate(**ONE_T, machine=Machine(**{**NODE, "nvme_gb": 4000}), precision="bf16")
    assert est3.best is None and est3.what_if.best is None


def test_cli_json_parses(capsys):
    args = ["estimate", "--params", "1T", "--layers", "128", "--hidden", "25600", "--vocab", "51200",
            "--heads", "160", "--gpus", "8", "--gpu-mem", "80", "--host-mem", "2000",
            "--nvme-gb", "30720", "--nvme-drives", "8", "--nvme-gbps", "48", "--nvme-write-gbps", "32",
            "--tiling-max-group-gb", "1.31", "--json"]
    rc = main(args)
    d = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert d["best"]["params"] == "nvme" and d["best"]["optimizer"] == "nvme"
    assert d["best"]["activation_checkpointing"] is True and d["verdict"].startswith("Yes:")
    assert d["what_if"]["best"] is None and d["what_if"]["knobs"]["grad_spill"] == "off"
    assert {(c["params"], c["optimizer"]) for c in d["configs"]} >= {("nvme", "nvme"), ("none", "none")}
    assert d["model"]["params"] == 10**12
    # until the GPU figures are validated, a GPU answer says so (one line), a CPU-only one
    # does not
    assert "treat GPU figures as unvalidated" in d["gpu_caveat"]
    assert main([a for a in args if a != "--json"]) == 0
    text = capsys.readouterr().out
    assert sum("treat GPU figures as unvalidated" in line for line in text.splitlines()) == 1
    from types import SimpleNamespace as NS
    from infinity.estimate import Estimate
    assert Estimate.gpu_caveat(NS(machine=NS(gpus=0))) is None      # CPU only: no caveat
    assert main(args + ["--grad-spill", "off"]) == 1       # nothing fits: exit 1, still the JSON
    d = json.loads(capsys.readouterr().out)
    assert d["best"] is None and d["what_if"]["best"]["params"] == "nvme"


def test_cli_text_and_errors(capsys, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"results": [{"read_gbps": 2.0, "write_gbps": 1.0}]}))
    rc = main(["estimate", "--params", "125M", "--layers", "12", "--hidden", "768", "--gpus", "0",
               "--host-mem", "24", "--nvme-gb", "100", "--bench-io", str(bench), "--only", "nvme/nvme",
               "--explain"])
    out = capsys.readouterr().out
    assert rc == 0 and "== params=nvme, optimizer=nvme ==" in out and "Verdict:" in out
    assert "NVMe 2 GB/s read (measured: --bench-io), 1 GB/s write (measured: --bench-io)" in out
    assert main(["estimate", "--layers", "2"]) == 2
    assert "describe the model" in capsys.readouterr().err
    assert main(["estimate", "--params", "12Q", "--layers", "2", "--hidden", "8"]) == 2
    assert main(["estimate", "--params", "1M", "--layers", "2", "--hidden", "8", "--only", "x/y"]) == 2


FACTORY = textwrap.dedent("""
    from transformers import GPT2Config, GPT2LMHeadModel

    def tiny_gpt2():
        cfg = GPT2Config(vocab_size=1000, n_embd=32, n_layer=3, n_head=2, n_positions=64)
        return GPT2LMHeadModel(cfg)
""")


def test_model_factory_on_meta_device(tmp_path, capsys):
    pytest.importorskip("transformers")
    f = tmp_path / "factory_mod.py"
    f.write_text(FACTORY)
    import importlib.util
    spec_ = importlib.util.spec_from_file_location("factory_ref", f)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    ref = mod.tiny_gpt2()                       # real weights, the reference count
    n_ref = sum(p.numel() for p in ref.parameters())   # tied wte/lm_head counted once
    est = estimate(f"{f}:tiny_gpt2", seq=64, machine=Machine(gpus=0, host_mem_gb=16, nvme_gb=10))
    s = est.model
    assert s.params == n_ref
    assert (s.layers, s.hidden, s.vocab, s.heads) == (3, 32, 1000, 2)
    assert s.largest_group["module"] == 1000 * 32          # the (tied) token embedding
    block = sum(p.numel() for p in ref.transformer.h[0].parameters())
    assert s.largest_group["block"] == max(block, 1000 * 32)
    # the same through the CLI (file path form) with --json
    rc = main(["estimate", "--model-factory", f"{f}:tiny_gpt2", "--seq", "64", "--gpus", "0",
               "--host-mem", "16", "--nvme-gb", "10", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] == n_ref


SMALL = ["estimate", "--params", "125M", "--layers", "12", "--hidden", "768", "--gpus", "0",
         "--host-mem", "24", "--nvme-gb", "100"]


def test_cli_default_is_the_brief_table_and_explain_adds_the_derivation(capsys):
    assert main(SMALL) == 0
    brief = capsys.readouterr().out
    assert "Verdict:" in brief and "params optim" in brief
    assert "==" not in brief and "Notation:" not in brief and "derivation: --explain" in brief
    assert len(brief.splitlines()) < 30
    assert main(SMALL + ["--brief"]) == 0           # still accepted: the same output
    assert capsys.readouterr().out == brief
    assert main(SMALL + ["--explain"]) == 0
    full = capsys.readouterr().out
    assert full.startswith(brief.split("(per-configuration")[0].rstrip("\n"))
    assert "== params=nvme, optimizer=nvme ==" in full and "Notation:" in full
    assert len(full.splitlines()) > 100
    # bounds read as English, not "none-bound"; the engine's optimizer is CPU Adam for
    # every offload.optimizer ("none" keeps its states in host memory too)
    assert "none-bound" not in full
    assert "optimizer: 0 s" not in full
    assert "CPU Adam-bound" in full and "cpu_adam" not in full


def test_cli_params_alone_says_which_flags_to_add(capsys):
    assert main(["estimate", "--params", "70B"]) == 2
    err = capsys.readouterr().err
    assert "--params 70B is not enough" in err and "add --layers L --hidden H" in err
    assert "--layers 80 --hidden 8192" in err and "--model-factory" in err
    assert main(["estimate", "--params", "7B", "--layers", "32"]) == 2
    err = capsys.readouterr().err
    assert "add --hidden H" in err and "add --layers" not in err and "--hidden 4096" in err
    assert main(["estimate"]) == 2
    assert "describe the model: add --params N --layers L --hidden H" in capsys.readouterr().err


def test_brief_no_verdict_names_the_closest_configuration_and_its_problems(capsys):
    """The default (brief) output has no per-configuration problem list, so a "No" verdict
    says what keeps the closest configuration from fitting instead of pointing at a list
    that only --explain prints."""
    args = ["estimate", "--params", "70B", "--layers", "80", "--hidden", "8192", "--gpus", "0",
            "--host-mem", "24", "--nvme-gb", "100"]
    assert main(args) == 1                      # nothing fits: exit 1
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("Verdict:"))
    assert verdict.startswith("Verdict: No:")
    assert "the closest, params=nvme, optimizer=nvme with activation checkpointing: NVMe: needs" \
        in verdict and "> 100 GB" in verdict
    assert "see the problems listed" not in out and "--explain lists every configuration" in out
    # the problem quoted is the one --explain lists for that configuration
    assert main(args + ["--explain"]) == 1
    full = capsys.readouterr().out
    block = full.split("== params=nvme, optimizer=nvme ==")[1]
    quoted = verdict.split("with activation checkpointing: ")[1].split(" (--explain")[0]
    assert f"does NOT fit with activation checkpointing: {quoted}" in block
