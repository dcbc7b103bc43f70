"""`infinity estimate` plans for the machine you describe (issue 35): the machine comes first
in every mode with the source of each value, describing GPUs without their node's RAM and
disk is refused, "No plan fits" names the binding limit of the closest plan and exits 1, and
step times read as plain decimals."""
import json
import re

import pytest

from infinity.cli.main import main

ONE_T = ["--params", "1T", "--layers", "128", "--hidden", "25600", "--vocab", "51200",
         "--heads", "160"]
NODE = ["--gpus", "8", "--gpu-mem", "80", "--host-mem", "2000", "--nvme-gb", "30000",
        "--tiling-max-group-gb", "1.31"]   # (untiled, stage 3 gradients overflow 80 GB)
SMALL = ["estimate", "--params", "125M", "--layers", "12", "--hidden", "768"]


@pytest.mark.parametrize("given, missing", [([], ["--host-mem", "--nvme-gb"]),
                                            (["--host-mem", "2000"], ["--nvme-gb"]),
                                            (["--nvme-gb", "30000"], ["--host-mem"])])
@pytest.mark.parametrize("plan", [[], ["--plan"]])
def test_gpus_without_host_mem_and_nvme_gb_is_refused(capsys, given, missing, plan):
    assert main(["estimate", *ONE_T, "--gpus", "8", *given, *plan]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpus 8" in err
    for flag in missing:
        assert flag in err
    assert "Traceback" not in err


def test_cpu_only_or_undescribed_still_uses_this_machine(capsys):
    assert main(SMALL + ["--gpus", "0"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("machine: CPU only (described)")
    assert "RAM" in out.splitlines()[0] and "(detected)" in out.splitlines()[0]


@pytest.mark.parametrize("mode", [[], ["--explain"], ["--plan"]])
def test_the_machine_is_printed_first_with_its_sources(capsys, mode):
    assert main(["estimate", *ONE_T, *NODE, "--tflops", "400", *mode]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("machine: 8 GPU(s) (described) x 80 GB (described), "
                               "RAM 2,000 GB (described), NVMe 30,000 GB (described)")
    assert "400 TFLOPS/rank achieved (described)" in lines[1]
    assert "PCIe 25 GB/s/GPU (default)" in lines[1]


@pytest.mark.parametrize("plan", [[], ["--plan"]])
def test_json_has_the_machine_with_its_sources(capsys, plan):
    assert main(["estimate", *ONE_T, *NODE, "--json", *plan]) == 0
    d = json.loads(capsys.readouterr().out)
    m = d["machine"]
    assert (m["gpus"], m["gpu_mem_gb"], m["host_mem_gb"], m["nvme_gb"]) == (8, 80, 2000, 30000)
    assert m["sources"]["host_mem_gb"] == "described" and m["sources"]["tflops"] == "default"


def test_no_plan_fits_names_the_binding_limit_and_exits_1(capsys):
    # 3 TB of NVMe and 200 GB of RAM for 1T parameters: every plan overshoots the NVMe (9x
    # at least), the host (80x) or the GPU; the closest is the one that overshoots least
    args = ["estimate", *ONE_T, "--gpus", "8", "--gpu-mem", "80", "--host-mem", "200",
            "--nvme-gb", "3000", "--plan"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert out.startswith("machine:")
    head = next(line for line in out.splitlines() if line.startswith("No plan fits"))
    # (10 % of the NVMe kept free: 2,700 of its 3,000 GB usable)
    assert "the closest plan is held back by NVMe: needs " in head and "has 2,700 GB" in head
    assert main(args + ["--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["plan"] is None and d["closest"]["problems"]
    assert d["closest"]["binding_limit"].startswith("NVMe: needs")
    # a GPU too small for even the most offloaded plan: the device is the binding limit
    args = ["estimate", "--params", "70B", "--layers", "80", "--hidden", "8192", "--gpus", "1",
            "--gpu-mem", "2.2", "--host-mem", "2000", "--nvme-gb", "30000", "--plan"]
    assert main(args) == 1
    head = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("No plan fits"))
    assert "held back by device: needs " in head and "GB per GPU, has 0.2 GB usable" in head


def test_plain_estimate_with_nothing_fitting_exits_1_and_names_the_limit(capsys):
    args = ["estimate", *ONE_T, "--gpus", "8", "--gpu-mem", "80", "--host-mem", "2000",
            "--nvme-gb", "3000"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "Verdict: No:" in out
    assert "Binding limit of the closest (params=nvme, optimizer=nvme): NVMe: needs" in out
    assert main(args + ["--json"]) == 1
    assert json.loads(capsys.readouterr().out)["best"] is None


@pytest.mark.parametrize("x, text", [(10400.0, "10400"), (14000.4, "14000"), (1234.5, "1234"),
                                     (17.53, "17.53"), (0.5, "0.5"), (0.001234, "0.001234"),
                                     (0.0, "0"), (2e-05, "0.00002"), (123456789.0, "123456789")])
def test_seconds_are_plain_decimals(x, text):
    from infinity.estimate.machine import fmt_seconds
    assert fmt_seconds(x) == text


def test_no_exponent_in_any_printed_step_time(capsys):
    # a 1T model on 8 GPUs at 3 GB/s of NVMe: steps of about 10^4 s
    args = ["estimate", *ONE_T, *NODE]
    for mode in ([], ["--explain"], ["--plan"]):
        assert main(args + mode) == 0
        out = capsys.readouterr().out
        assert not re.search(r"\de[+-]?\d+ s\b", out), (mode, re.findall(r".*\de[+-]?\d+ s\b.*", out))
    assert main(args + ["--plan"]) == 0
    assert "step 17502 s" in capsys.readouterr().out
