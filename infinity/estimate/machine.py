"""The machine the estimate is for: one node (times ``nodes``) of GPUs, RAM and NVMe drives.

Sizes are in GB = 10^9 bytes (as in the config); bandwidths in GB/s; compute in
TFLOPS *achieved* per GPU (not the datasheet peak). Defaults are stated in
docs/estimator.md and printed with every estimate.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field

from .model_spec import EstimateError

log = logging.getLogger("infinity.estimate")

GB = 10**9

# Defaults (documented in docs/estimator.md, "Machine defaults").
DEFAULT_GPU_MEM_GB = 80.0
DEFAULT_NVME_GBPS_PER_DRIVE = 3.0      # sustained large-block read of a PCIe 4.0 datacenter drive, conservative
DEFAULT_PCIE_GBPS = 25.0               # per GPU, PCIe 4.0 x16 effective
DEFAULT_TFLOPS_GPU = 150.0             # achieved dense bf16 per GPU (~50 % of an A100's peak)
DEFAULT_TFLOPS_CPU = 0.2               # achieved by a CPU-only rank (few cores, fp32)
DEFAULT_INTERCONNECT_GBPS = 100.0      # per GPU collective bus bandwidth (NVLink-class)
DEFAULT_CPU_ADAM_GPARAMS = 4.0         # 10^9 params/s per node: ~120 GB/s of DRAM / ~30 B touched per param
DEFAULT_GPU_RESERVE_GB = 2.0           # CUDA context, cuBLAS workspace, allocator slack per GPU
DEFAULT_HOST_COPY_GBPS = 4.0           # one thread's copy into a fresh page-aligned host buffer
DEFAULT_HOST_MEM_GBPS = 200.0          # sustained DRAM bandwidth of a GPU node (2 sockets)
PCIE_LINK_SHARING_GPUS = 8             # from this many GPUs per node, 2 share a host link


@dataclass
class Machine:
    gpus: int = 1                       # GPUs per node (0: CPU only, the device tier is host memory)
    gpu_mem_gb: float = DEFAULT_GPU_MEM_GB
    host_mem_gb: float = 0.0            # RAM per node
    nvme_gb: float = 0.0                # NVMe capacity per node usable for swap
    nvme_drives: int = 1
    nvme_gbps: float | None = None      # aggregate read GB/s per node (None: drives x default)
    nvme_write_gbps: float | None = None  # aggregate write GB/s (None: same as read)
    pcie_gbps: float = DEFAULT_PCIE_GBPS
    tflops: float | None = None         # achieved per GPU (None: GPU or CPU default)
    interconnect_gbps: float = DEFAULT_INTERCONNECT_GBPS
    inter_node_gbps: float | None = None  # per GPU to other nodes (None: interconnect_gbps)
    cpu_adam_gparams: float = DEFAULT_CPU_ADAM_GPARAMS
    # CPU-only: the copies of offloaded activations (into staging, back out) run on the
    # cores that compute (GB/s of one copy; infinity finetune --auto measures it)
    host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS
    gpu_reserve_gb: float | None = None  # None: DEFAULT_GPU_RESERVE_GB with GPUs, 0 without
    nodes: int = 1
    # GPU nodes: host DRAM bandwidth that NVMe DMA, PCIe copies and CPU Adam share (None:
    # DEFAULT_HOST_MEM_GBPS), and GPUs behind one PCIe link to the host (None: 2 on a node
    # of 8 or more GPUs -- a PCIe switch per pair -- else 1)
    host_mem_gbps: float | None = None
    gpus_per_pcie_link: int | None = None
    # LoRA over a quantized base: GB/s of working-precision output one rank dequantizes
    # (None: infinity/estimate/lora.py's default for the device and the format)
    dequant_gbps: float | None = None
    #: where each value came from, by field name: "described" (a flag), "detected" (this
    #: machine), "default" or "measured (...)"; printed with the machine (machine_lines)
    sources: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name in ("gpus", "nvme_drives", "nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "gpus" else 1):
                raise EstimateError(f"machine.{name} must be an integer >= "
                                    f"{0 if name == 'gpus' else 1}, got {v!r}")
        for name in ("gpu_mem_gb", "host_mem_gb", "nvme_gb", "pcie_gbps", "interconnect_gbps",
                     "cpu_adam_gparams", "host_copy_gbps", "nvme_gbps", "nvme_write_gbps", "tflops", "gpu_reserve_gb",
                     "inter_node_gbps", "host_mem_gbps", "dequant_gbps"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
                raise EstimateError(f"machine.{name} must be a number >= 0, got {v!r}")
        if self.nvme_gbps is None:
            self.nvme_gbps = DEFAULT_NVME_GBPS_PER_DRIVE * self.nvme_drives
        if self.nvme_write_gbps is None:
            self.nvme_write_gbps = self.nvme_gbps
        if self.inter_node_gbps is None:
            self.inter_node_gbps = self.interconnect_gbps
        if self.tflops is None:
            self.tflops = DEFAULT_TFLOPS_GPU if self.gpus else DEFAULT_TFLOPS_CPU
        if self.gpu_reserve_gb is None:
            self.gpu_reserve_gb = DEFAULT_GPU_RESERVE_GB if self.gpus else 0.0
        if self.host_mem_gbps is None:
            self.host_mem_gbps = DEFAULT_HOST_MEM_GBPS
        if self.gpus_per_pcie_link is None:
            self.gpus_per_pcie_link = 2 if self.gpus >= PCIE_LINK_SHARING_GPUS else 1
        v = self.gpus_per_pcie_link
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise EstimateError(f"machine.gpus_per_pcie_link must be an integer >= 1, got {v!r}")
        if self.dequant_gbps is not None and not self.dequant_gbps > 0:
            raise EstimateError(f"machine.dequant_gbps must be > 0, got {self.dequant_gbps!r}")
        for name in ("nvme_gbps", "nvme_write_gbps", "tflops", "pcie_gbps", "cpu_adam_gparams",
                     "inter_node_gbps", "host_copy_gbps"):
            if not getattr(self, name) > 0:
                raise EstimateError(f"machine.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.gpus)

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def cpu_only(self) -> bool:
        return self.gpus == 0

    @property
    def pcie_share(self) -> int:
        """GPUs sharing one host link (their transfers run at once: each gets a share)."""
        return max(1, min(self.gpus_per_pcie_link, self.ranks_per_node)) if self.gpus else 1

    def as_dict(self):
        return asdict(self)


def fmt_seconds(x):
    """A duration in plain decimals, never in exponent notation: 10400, 1.234, 0.01234."""
    x = float(x)
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if abs(x) >= 1e4:
        return f"{x:.0f}"
    if x == 0 or abs(x) >= 1e-4:
        return f"{x:.4g}"
    return f"{x:.8f}".rstrip("0")


def _gb_text(v):
    return f"{v:,.1f}".rstrip("0").rstrip(".") if v != int(v) else f"{int(v):,}"


def machine_lines(m):
    """The machine an estimate is for, each value with where it came from (described /
    detected / default): what ``infinity estimate`` prints first."""
    src = m.sources or {}

    def tag(*names):
        got = [src[n] for n in names if n in src]
        return f" ({'/'.join(dict.fromkeys(got))})" if got else ""

    nodes = f"{m.nodes} nodes x " if m.nodes > 1 else ""
    dev = (f"{m.gpus} GPU(s){tag('gpus')} x {_gb_text(m.gpu_mem_gb)} GB{tag('gpu_mem_gb')}" if m.gpus
           else f"CPU only{tag('gpus')} (device tier = host memory)")
    return [
        f"machine: {nodes}{dev}, RAM {_gb_text(m.host_mem_gb)} GB{tag('host_mem_gb')}, "
        f"NVMe {_gb_text(m.nvme_gb)} GB{tag('nvme_gb')} on {m.nvme_drives} drive(s)",
        f"         NVMe {m.nvme_gbps:g} GB/s read{tag('nvme_gbps')}, {m.nvme_write_gbps:g} GB/s "
        f"write{tag('nvme_write_gbps')}, PCIe {m.pcie_gbps:g} GB/s/GPU{tag('pcie_gbps')}, "
        f"{m.tflops:g} TFLOPS/rank achieved{tag('tflops')}",
        f"         collectives {m.interconnect_gbps:g} GB/s/GPU{tag('interconnect_gbps')}, "
        f"CPU Adam {m.cpu_adam_gparams:g} G params/s/node{tag('cpu_adam_gparams')}"
        + (f", host copies {m.host_copy_gbps:g} GB/s{tag('host_copy_gbps')}" if not m.gpus else
           f", host memory {m.host_mem_gbps:g} GB/s{tag('host_mem_gbps')}, "
           f"{m.gpus_per_pcie_link} GPU(s) per PCIe link{tag('gpus_per_pcie_link')}"),
    ]


def detect_host_mem_gb():
    """MemTotal of this machine in GB (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 0.0


def detect_free_disk_gb(path):
    """Free space in GB of the filesystem holding ``path`` (its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
        return st.f_bavail * st.f_frsize / GB
    except OSError:
        return 0.0


def detect_gpus():
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch broken: estimating must still work
        return 0
