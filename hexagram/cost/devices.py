"""Device and link presets for :mod:`hexagram.cost.simulate`: figures with their sources.

Devices are the SXM parts; throughputs are *dense* (no structured sparsity) BF16 tensor-core
figures from NVIDIA's datasheets, multiplied by :data:`EFFICIENCY` (the model FLOP
utilisation a well-tuned data-parallel job reaches; stated, not measured). Link rates are
per direction, in bytes per second; latencies are typical one-hop figures of each class
(assumptions, labelled as such: no datasheet gives an end-to-end collective latency).

Example:
    >>> round(DEVICES["h100"].flops / 1e12)
    989
    >>> LINKS["25gbe"].rate_bps
    3125000000.0
"""

from __future__ import annotations

from dataclasses import dataclass

from hexagram.errors import ConfigError

__all__ = ["DEVICES", "EFFICIENCY", "LINKS", "Device", "Link", "device", "link"]

#: fraction of peak dense throughput a training step reaches (model FLOP utilisation).
#: Assumption: 0.4, in the range large-model training reports (PaLM, Chowdhery et al. 2022,
#: table 3: 46.2% MFU; Megatron-LM on A100, Narayanan et al. 2021: 44-52% of peak).
EFFICIENCY = 0.4


@dataclass(frozen=True)
class Device:
    """An accelerator: peak dense BF16 FLOP/s, HBM bytes/s and bytes, its NVLink rate
    (a measured device, e.g. the planner's calibrated one, has no preset fabric: ``""``)."""

    name: str
    flops: float  # peak dense BF16 FLOP/s
    hbm_bps: float  # memory bandwidth, bytes/s
    memory: float  # bytes
    nvlink: str = ""  # the LINKS preset of its intra-host fabric


DEVICES: dict[str, Device] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense (624 with
    # sparsity), HBM2e 2,039 GB/s, 80 GB, NVLink 600 GB/s (both directions together).
    "a100": Device("a100", 312e12, 2.039e12, 80e9, "nvlink3"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS *with* sparsity, so
    # 989 dense; HBM3 3.35 TB/s, 80 GB, NVLink 900 GB/s (both directions together).
    "h100": Device("h100", 989e12, 3.35e12, 80e9, "nvlink4"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity, so 989
    # dense; HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s (both directions together).
    "h200": Device("h200", 989e12, 4.8e12, 141e9, "nvlink4"),
    # NVIDIA V100 Tensor Core GPU datasheet (SXM2 32GB): 125 TFLOPS tensor (mixed precision),
    # HBM2 900 GB/s, 32 GB, NVLink 300 GB/s (both directions together). BAGUA's cluster.
    "v100": Device("v100", 125e12, 900e9, 32e9, "nvlink2"),
    # NVIDIA P102-100 (the gTop-k paper's mining GPU; GP102, no tensor cores): FP32
    # 10.8 TFLOPS, GDDR5X 440 GB/s, 5 GB. Approximate, from public GPU databases (NVIDIA
    # publishes no datasheet for it); no NVLink: PCIe 3.0 x4 on mining boards (assumption).
    "p102": Device("p102", 10.8e12, 440e9, 5e9, "pcie3x4"),
}


@dataclass(frozen=True)
class Link:
    """A link class: ``rate_bps`` bytes/s per direction, ``latency_s`` per hop."""

    name: str
    rate_bps: float
    latency_s: float


LINKS: dict[str, Link] = {
    # NVLink 3 (A100): 600 GB/s total over 12 links = 300 GB/s per direction (A100 datasheet);
    # NVLink 4 (H100): 900 GB/s total = 450 GB/s per direction (H100 datasheet).
    # Latency: assumption, a few microseconds (NCCL intra-node small-message figures).
    "nvlink3": Link("nvlink3", 300e9, 3e-6),
    "nvlink4": Link("nvlink4", 450e9, 3e-6),
    # NVLink 2 (V100): 300 GB/s total = 150 GB/s per direction (V100 datasheet).
    "nvlink2": Link("nvlink2", 150e9, 3e-6),
    # PCIe 3.0 x4: 8 GT/s x 4 lanes, 128b/130b = 3.94 GB/s per direction (PCI-SIG spec).
    "pcie3x4": Link("pcie3x4", 3.94e9, 5e-6),
    # PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction (PCI-SIG spec).
    "pcie4": Link("pcie4", 31.5e9, 5e-6),
    # InfiniBand HDR 200 Gbit/s, NDR 400 Gbit/s per port (InfiniBand Trade Association
    # roadmap); latency: assumption, ~2 us per hop through one switch (RDMA).
    "ib-hdr": Link("ib-hdr", 200e9 / 8, 2e-6),
    "ib-ndr": Link("ib-ndr", 400e9 / 8, 2e-6),
    # Ethernet line rates (IEEE 802.3: 100GBASE, 25GBASE, 10GBASE, 1000BASE); latency:
    # assumption for TCP through the kernel (the socket transport gloo and NCCL use there).
    "100gbe": Link("100gbe", 100e9 / 8, 10e-6),
    "25gbe": Link("25gbe", 25e9 / 8, 20e-6),
    "10gbe": Link("10gbe", 10e9 / 8, 30e-6),
    "1gbe": Link("1gbe", 1e9 / 8, 50e-6),
}
# aliases: the intra-host fabric of each device
LINKS["nvlink"] = LINKS["nvlink4"]
LINKS["infiniband"] = LINKS["ib-ndr"]


def device(name: str) -> Device:
    """The :data:`DEVICES` entry ``name`` (case-insensitive).

    Raises:
        ConfigError: unknown name (lists the known ones).
    """
    key = name.lower()
    if key not in DEVICES:
        raise ConfigError(f"unknown device profile {name!r}; known: {', '.join(DEVICES)} "
                          "(or 'local' to measure compute on this machine)")
    return DEVICES[key]


def link(name: str) -> Link:
    """The :data:`LINKS` entry ``name``, or a rate as ``'40gbit'`` or ``'100mbit'`` (20 us
    latency, an assumption).

    Raises:
        ConfigError: unknown preset or a rate that is not positive.
    """
    key = name.lower()
    if key in LINKS:
        return LINKS[key]
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6)):
        if key.endswith(unit):
            try:
                rate = float(key[:-4])
            except ValueError:
                rate = -1.0
            if rate > 0:
                return Link(key, rate * scale / 8, 20e-6)
            raise ConfigError(f"link {name!r}: the rate must be a positive number of "
                              f"{unit[0].upper()}bit/s, e.g. '40gbit' or '100mbit'")
    raise ConfigError(f"unknown link preset {name!r}; known: {', '.join(LINKS)}, or a rate "
                      "such as '40gbit' or '100mbit'")
