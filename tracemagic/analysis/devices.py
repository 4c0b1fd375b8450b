"""Device peaks: the dense compute and memory-bandwidth ceilings of the GPUs in real traces.

The roofline of ``efficiency()`` compares what an op achieved with what its device can do
at most. ``PEAKS`` holds, per device, the vendor's dense (no structured sparsity) peak
TFLOP/s per precision and the HBM bandwidth in TB/s (10¹² bytes/s), each row with the
datasheet it comes from. Conventions, so the figures are comparable:

- ``fp64``, ``fp32``: the highest dense rate at that precision, matrix units included
  (A100 FP64 Tensor Core 19.5, MI250X FP32 matrix 95.7); NVIDIA has no FP32 tensor-core
  rate, so its ``fp32`` is the CUDA-core figure.
- ``tf32``: tensor-core TF32 (AMD: XF32 on MI300X); NaN where the device has none.
- ``bf16``, ``fp16``, ``fp8``: dense matrix/tensor-core rates; NaN where unsupported.
- AMD MI250X and MI250 are two dies (GCDs) per package, and the trace sees each die as a
  device (110 or 104 compute units, 64 GiB), so their rows hold half the package figures.

A trace's device is matched from Kineto's ``deviceProperties`` (``trace.devices``): by
the model number in its name, and only where the name does not say (AMD traces write
``AMD Radeon Graphics`` or nothing), by compute-unit/SM count and memory size
(``match``). Other named boards are unknown and get no peaks.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import pandas as pd

NAN = math.nan


class DevicePeaks(NamedTuple):
    """One device's dense peaks (TFLOP/s per precision, memory TB/s) and their source."""

    name: str
    fp64: float
    fp32: float
    tf32: float
    bf16: float
    fp16: float
    fp8: float
    tbytes_per_s: float
    #: SMs (NVIDIA) or compute units (AMD) of one device as the trace sees it
    sms: int
    #: memory of one device, GiB (to tell variants apart)
    memory_gib: float
    #: last-level cache of one device, MiB (L2; AMD MI300 series: Infinity Cache): an op
    #: whose data fits in it may be served from it, faster than ``tbytes_per_s``
    cache_mib: float
    source: str


_V100 = (
    "NVIDIA Tesla V100 GPU Accelerator datasheet "
    "(images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf)"
)
_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet "
    "(nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)"
)
_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet); "
    "dense = half the sparsity figures"
)
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/); dense = half the sparsity figures"
_B200 = (
    "NVIDIA HGX B200 datasheet (nvidia.com/en-us/data-center/hgx/), 8-GPU figures / 8; "
    "dense = half the sparsity figures"
)
_MI250X = (
    "AMD Instinct MI250X datasheet (amd.com/en/products/accelerators/instinct/mi200/mi250x.html), per GCD = package / 2"
)
_MI250 = (
    "AMD Instinct MI250 datasheet (amd.com/en/products/accelerators/instinct/mi200/mi250.html), per GCD = package / 2"
)
_MI300X = "AMD Instinct MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html), dense figures"
_MI325X = "AMD Instinct MI325X datasheet (amd.com/en/products/accelerators/instinct/mi300/mi325x.html), dense figures"
_MI355X = "AMD Instinct MI355X datasheet (amd.com/en/products/accelerators/instinct/mi350/mi355x.html), dense figures"

#: name, fp64, fp32, tf32, bf16, fp16, fp8 (TFLOP/s), TB/s, SMs/CUs, memory GiB, cache MiB, source.
#: Caches: the Volta (6 MB), A100 (40 MB) and H100 (50 MB) architecture whitepapers, AMD CDNA2
#: (8 MB L2 per GCD) and CDNA3/CDNA4 (256 MB Infinity Cache) whitepapers; B200's is not in its datasheet.
PEAKS: tuple[DevicePeaks, ...] = (
    DevicePeaks("V100 SXM2", 7.8, 15.7, NAN, NAN, 125.0, NAN, 0.9, 80, 32, 6, _V100),
    DevicePeaks("V100 PCIe", 7.0, 14.0, NAN, NAN, 112.0, NAN, 0.9, 80, 32, 6, _V100),
    DevicePeaks("A100 SXM 40GB", 19.5, 19.5, 156.0, 312.0, 312.0, NAN, 1.555, 108, 40, 40, _A100),
    DevicePeaks("A100 SXM 80GB", 19.5, 19.5, 156.0, 312.0, 312.0, NAN, 2.039, 108, 80, 40, _A100),
    DevicePeaks("A100 PCIe 40GB", 19.5, 19.5, 156.0, 312.0, 312.0, NAN, 1.555, 108, 40, 40, _A100),
    DevicePeaks("A100 PCIe 80GB", 19.5, 19.5, 156.0, 312.0, 312.0, NAN, 1.935, 108, 80, 40, _A100),
    DevicePeaks("H100 SXM", 67.0, 67.0, 494.5, 989.5, 989.5, 1979.0, 3.35, 132, 80, 50, _H100),
    DevicePeaks("H100 PCIe", 51.0, 51.0, 378.0, 756.0, 756.0, 1513.0, 2.0, 114, 80, 50, _H100),
    DevicePeaks("H200", 67.0, 67.0, 494.5, 989.5, 989.5, 1979.0, 4.8, 132, 141, 50, _H200),
    DevicePeaks("B200", 37.0, 75.0, 1125.0, 2250.0, 2250.0, 4500.0, 8.0, 148, 180, NAN, _B200),
    DevicePeaks("MI250X (one GCD)", 47.85, 47.85, NAN, 191.5, 191.5, NAN, 1.6384, 110, 64, 8, _MI250X),
    DevicePeaks("MI250 (one GCD)", 45.25, 45.25, NAN, 181.0, 181.0, NAN, 1.6384, 104, 64, 8, _MI250),
    DevicePeaks("MI300X", 163.4, 163.4, 653.7, 1307.4, 1307.4, 2614.9, 5.3, 304, 192, 256, _MI300X),
    DevicePeaks("MI325X", 163.4, 163.4, 653.7, 1307.4, 1307.4, 2614.9, 6.0, 304, 256, 256, _MI325X),
    DevicePeaks("MI355X", 78.6, 157.3, NAN, 2516.6, 2516.6, 5033.2, 8.0, 256, 288, 256, _MI355X),
)
#: precisions a peak is given for, in ``DevicePeaks`` order
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
_BY_NAME = {p.name: p for p in PEAKS}

#: (pattern on the device name, candidate rows told apart by memory size). Model numbers are
#: whole words: ``GH200`` and ``GB200`` (Grace superchips) are not H200 and B200, ``V100S``
#: is not a V100; an H100 NVL (94 GB, its own figures) is not in ``PEAKS`` and matches none.
_NAME_RULES: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = (
    (re.compile(r"\bV100\b.*\bPCIE\b", re.I), ("V100 PCIe",)),
    (re.compile(r"\bV100\b(?!.*\bPCIE\b)", re.I), ("V100 SXM2",)),  # SXM2 and DGXS (the DGX Station's SXM2 boards)
    (re.compile(r"\bA100\b.*\bPCIE\b", re.I), ("A100 PCIe 40GB", "A100 PCIe 80GB")),
    (re.compile(r"\bA100\b(?!.*\bPCIE\b)", re.I), ("A100 SXM 40GB", "A100 SXM 80GB")),  # SXM4 and PG509 (an SXM4 board)
    (re.compile(r"\bH100\b.*\bPCIE\b", re.I), ("H100 PCIe",)),
    (re.compile(r"\bH100\b(?!.*\b(?:NVL|PCIE)\b)", re.I), ("H100 SXM",)),
    (re.compile(r"\bH200\b(?!.*\bNVL\b)", re.I), ("H200",)),
    (re.compile(r"\bB200\b", re.I), ("B200",)),
    (re.compile(r"\bMI250X\b", re.I), ("MI250X (one GCD)",)),
    (re.compile(r"\bMI250\b", re.I), ("MI250 (one GCD)",)),
    (re.compile(r"\bMI300X\b", re.I), ("MI300X",)),
    (re.compile(r"\bMI325X\b", re.I), ("MI325X",)),
    (re.compile(r"\bMI355X\b", re.I), ("MI355X",)),
)
#: names that do not say which board it is (ROCm writes ``AMD Radeon Graphics``, an
#: architecture like ``gfx90a:sramecc+:xnack-`` or nothing): matched by SM/CU count instead
_GENERIC_NAME = re.compile(
    r"^\s*(?:(?:AMD|ATI|NVIDIA)\b\s*)?(?:Radeon\s+Graphics|Graphics|Device|GPU|Instinct|gfx[0-9a-f]+(?::\S*)?)?\s*$",
    re.I,
)


def is_generic(name: str) -> bool:
    """Whether a ``deviceProperties`` name says nothing of the board (empty, ``AMD Radeon
    Graphics``, ``Device``, a ``gfx`` architecture)."""
    return bool(_GENERIC_NAME.match(name))


def table() -> pd.DataFrame:
    """``PEAKS`` as a DataFrame, one row per device (to read, or to edit and pass as ``peaks``)."""
    return pd.DataFrame([p._asdict() for p in PEAKS])


def _closest_memory(names: tuple[str, ...], memory_bytes: float | None) -> DevicePeaks:
    """Of ``names``, the row whose memory is closest to ``memory_bytes`` (the first without it)."""
    rows = [_BY_NAME[n] for n in names]
    if not memory_bytes:
        return rows[0]
    gib = memory_bytes / 2**30
    return min(rows, key=lambda p: abs(p.memory_gib - gib))


def match(device: dict[str, Any]) -> DevicePeaks | None:
    """The ``PEAKS`` row of a ``trace.devices`` entry (``name``, ``sm_count``, ``memory_bytes``), None if unknown.

    By the model number in the name (a whole word: ``GH200`` is not an H200); only a
    generic or empty name (``AMD Radeon Graphics`` on ROCm traces, see ``is_generic``) is
    matched by its SM/compute-unit count, with memory size telling apart devices with the
    same count (H100 SXM 80 GB and H200 141 GB, MI300X and MI325X). A named board that is
    not in ``PEAKS`` (TITAN V, Quadro GV100, H100 NVL, GH200) is unknown: None, not the
    figures of another board with as many SMs.
    """
    name = str(device.get("name") or "")
    memory = device.get("memory_bytes")
    for pattern, names in _NAME_RULES:
        if pattern.search(name):
            return _closest_memory(names, memory)
    if not is_generic(name):
        return None
    sms = device.get("sm_count")
    if not sms:
        return None
    same = tuple(p.name for p in PEAKS if p.sms == sms)
    if not same:
        return None
    same = tuple(n for n in same if "PCIe" not in n) or same  # an unnamed board: the SXM figures
    nvidia = "NVIDIA" in name.upper() or "TESLA" in name.upper()
    amd = "AMD" in name.upper() or not name
    if nvidia:
        same = tuple(n for n in same if not n.startswith("MI")) or same
    elif amd:
        same = tuple(n for n in same if n.startswith("MI")) or same
    return _closest_memory(same, memory)
