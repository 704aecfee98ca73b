"""Compressor throughput measured on a GPU: how ``simulate`` prices compressors on GPUs.

A compressor's encode and decode on a GPU are not memory-bound in practice: on the first
GPU Hexagram ran on, its eager kernels reached 3-57 % of ``x.clone()``'s bandwidth
(:data:`SOURCE`). Pricing them as memory-bound passes would predict compression winning
where it measurably loses (PowerSGD 1.78x faster than allreduce on one NVLink host, for
example). So for the devices of that class (:data:`MEASURED_DEVICES`) the model reads the
measured ratios below; devices without measurements keep the stated memory-bound
assumption of :func:`hexagram.cost.simulate.device_compressor_cost`.

A ratio is clone time over kernel time for a 25M-element float32 tensor; the seconds per
element follow from the measured clone rate (:data:`CLONE_S_PER_ELEMENT`). The figures
describe the compressors as they were measured (eager kernels); a new GPU run of
``benchmarks/compress_throughput.py --device cuda`` replaces them here.

Example:
    >>> cost = measured_cost("h100", "fp16")
    >>> round(cost.encode(25_000_000) * 1e3, 2), round(cost.decode(25_000_000) * 1e3, 2)
    (0.13, 0.07)
    >>> measured_cost("a100", "fp16") is None
    True
"""

from __future__ import annotations

from hexagram.cost.profile import CompressorCost

__all__ = ["CLONE_S_PER_ELEMENT", "H200_RATIOS", "MEASURED_DEVICES", "SOURCE", "SPARSE_DECODE",
           "measured_cost"]

#: where the figures come from (shown by ``hexagram simulate`` when it uses them)
SOURCE = ("compressor throughput measured on one NVIDIA H200 (torch 2.11, CUDA 13.0, "
          "2026-11-28; benchmarks/compress_throughput.py --device cuda --rounds 3, 25M "
          "floats, eager kernels)")

#: seconds per float32 element of ``clone()`` on that H200: a 100M-element bucket in 0.19 ms
CLONE_S_PER_ELEMENT = 0.19e-3 / 100e6

#: compressor -> (compress, decompress) throughput as a fraction of ``clone()``'s
H200_RATIOS: dict[str, tuple[float, float]] = {
    "fp16": (0.41, 0.76), "bf16": (0.57, 0.76),
    "minmax8": (0.07, 0.13), "minmax4": (0.07, 0.12),
    "qsgd": (0.06, 0.25), "terngrad": (0.06, 0.33),
    "onebit": (0.07, 0.03), "sign": (0.17, 0.03), "efsign": (0.09, 0.03),
    "topk": (0.09, 1.05), "randomk": (0.20, 0.32), "threshold": (0.15, 0.79),
    "powersgd": (0.10, 0.35),
}

#: device presets priced with :data:`H200_RATIOS` (the H100 shares the H200's architecture;
#: until it is measured itself, its compressors are taken to run at the H200's figures)
MEASURED_DEVICES = ("h100", "h200")

#: formats whose decode adds (index, value) pairs into the output: adding one more rank's
#: payload costs in proportion to the payload, not to the dense tensor (the measured
#: decompress also fills the dense output once)
SPARSE_DECODE = frozenset({"topk", "randomk", "threshold"})

#: kernel launches around one encode or decode (seconds; the memory-bound model's figure)
LAUNCH_S = 10e-6


def measured_cost(device: str, compressor: str, payload_ratio: float = 1.0
                  ) -> CompressorCost | None:
    """The measured cost of ``compressor`` (a registry name) on the device preset
    ``device``, or None where either has no measurement.

    ``payload_ratio``: the payload's bytes over the dense tensor's; it scales the decode of
    :data:`SPARSE_DECODE` formats, whose decode adds pairs; every other decode writes or
    adds the whole tensor, as measured.
    """
    ratios = H200_RATIOS.get(compressor)
    if device.lower() not in MEASURED_DEVICES or ratios is None:
        return None
    enc, dec = (CLONE_S_PER_ELEMENT / r for r in ratios)
    if compressor in SPARSE_DECODE:
        dec *= payload_ratio
    return CompressorCost((LAUNCH_S, enc), (LAUNCH_S, dec))
