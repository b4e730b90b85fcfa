"""Peak dense matmul FLOP/s of the GPU the trainer runs on, for model FLOPs utilisation
(MFU = achieved model FLOP/s / peak): chosen from the device's own name, never a fixed
A100 figure. Unknown devices and the CPU have no peak: MFU is then left out, not guessed.

Figures are NVIDIA's datasheet numbers for dense tensor-core math (the datasheets print
the 2:4-sparsity figure, twice the dense one, with an asterisk; the dense one is used
here, as PaLM's and nanoGPT's MFU do). "fp32" is plain FP32 (CUDA cores), what PyTorch
uses for float32 matmuls unless TF32 is allowed; "tf32" is the TF32 tensor-core figure.

Sources (all nvidia.com datasheets):
- H100 SXM5 / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet (2023/2024): BF16/FP16
  1,979 / 1,513 / 1,671 TFLOPS with sparsity, TF32 989 / 756 / 835, FP32 67 / 51 / 60.
- H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" datasheet (2024): BF16/FP16 1,979 / 1,671
  sparse, TF32 989 / 835, FP32 67 / 60. GH200 (Grace Hopper superchip datasheet): the
  H100 SXM figures.
- A100 (40/80 GB, SXM4 and PCIe): "NVIDIA A100 Tensor Core GPU" datasheet: BF16/FP16 312
  dense (624 sparse), TF32 156 dense, FP32 19.5.
- L40S: datasheet (2023): BF16/FP16 362.05 dense (733 sparse), TF32 183 dense, FP32 91.6.
- L40: datasheet (2022): BF16/FP16 181.05 dense (362.1 sparse), TF32 90.5 dense, FP32 90.5.
- L4: datasheet (2023): BF16/FP16 242 sparse, TF32 120 sparse, FP32 30.3.
- A10: datasheet (2021): BF16/FP16 125 dense (250 sparse), TF32 62.5, FP32 31.2.
- V100 SXM2 / PCIe: "NVIDIA V100" datasheet: FP16 tensor 125 / 112, FP32 15.7 / 14; no
  BF16 or TF32 tensor cores (left out: bf16 runs emulated there).
- T4: datasheet: FP16 tensor 65, FP32 8.1; no BF16 or TF32.
"""

from __future__ import annotations

import re

import torch

T = 1e12

# (pattern over the upper-cased device name, label, {dtype: peak dense FLOP/s}), tried in
# order: the first match wins, so a variant (H100 PCIe, H100 NVL) comes before the name
# it contains (H100, which alone means the SXM part: torch names it "NVIDIA H100 80GB
# HBM3").
PEAKS: list[tuple[str, str, dict[str, float]]] = [
    (
        r"H100.*PCIE",
        "H100 PCIe",
        {"bf16": 756.5 * T, "fp16": 756.5 * T, "tf32": 378 * T, "fp32": 51 * T},
    ),
    (
        r"H100.*NVL",
        "H100 NVL",
        {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60 * T},
    ),
    (
        r"H200.*NVL",
        "H200 NVL",
        {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60 * T},
    ),
    (
        r"H100|GH200",
        "H100 SXM",
        {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T},
    ),
    (
        r"H200",
        "H200 SXM",
        {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T},
    ),
    (r"A100", "A100", {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}),
    (r"L40S", "L40S", {"bf16": 362.05 * T, "fp16": 362.05 * T, "tf32": 183 * T, "fp32": 91.6 * T}),
    (r"L40\b", "L40", {"bf16": 181.05 * T, "fp16": 181.05 * T, "tf32": 90.5 * T, "fp32": 90.5 * T}),
    (r"\bL4\b", "L4", {"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T}),
    (r"\bA10\b", "A10", {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T}),
    (r"V100.*PCIE", "V100 PCIe", {"fp16": 112 * T, "fp32": 14 * T}),
    (r"V100", "V100 SXM2", {"fp16": 125 * T, "fp32": 15.7 * T}),
    (r"\bT4\b", "T4", {"fp16": 65 * T, "fp32": 8.1 * T}),
]


def peak_flops(name: str, dtype: str) -> tuple[str, float] | None:
    """(the device's label in the table, its peak dense FLOP/s for `dtype`: bf16, fp16,
    tf32 or fp32), or None when the device is not in the table or has no such figure."""
    upper = name.upper()
    for pattern, label, peaks in PEAKS:
        if re.search(pattern, upper):
            return (label, peaks[dtype]) if dtype in peaks else None
    return None


def matmul_dtype(precision: str) -> str:
    """The dtype the model's matmuls run in for a `precision.dtype`: bf16/fp16 under
    autocast; fp32 is TF32 on tensor cores only when PyTorch is told to allow it."""
    if precision in ("bf16", "fp16"):
        return precision
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() in (
        "high",
        "medium",
    )
    return "tf32" if tf32 else "fp32"


def device_peak_flops(device: torch.device, precision: str) -> tuple[str, float] | None:
    """Peak FLOP/s of one `device` (a CUDA device) at `precision`; None on the CPU or an
    unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = matmul_dtype(precision)
    if dtype == "tf32" and torch.cuda.get_device_capability(device) < (8, 0):
        dtype = "fp32"  # no TF32 tensor cores before Ampere: the setting changes nothing
    return peak_flops(name, dtype)
