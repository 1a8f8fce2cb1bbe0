"""Throughput and model FLOPs utilisation (MFU) of a training run.

MFU is the model's FLOPs per second (``flops_per_token`` x tokens/s: the arithmetic the model
needs, not what the kernels happen to do, so recomputation does not count) over the devices'
dense peak FLOP/s. Peaks come from the vendors' spec sheets (:data:`PEAK_FLOPS`); CPUs and GPUs
not in the table have none, and their MFU is not reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PEAK_FLOPS", "peak_flops", "throughput", "warmup_steps"]


def warmup_steps(n: int, compiled: bool) -> int:
    """Steps left out of the throughput: the first quarter (compiling, warming caches and
    allocators), at least the first step (two when compiled), never all of them."""
    least = 2 if compiled else 1
    return min(max(least, n // 4), n - 1) if n > 1 else 0


# Dense peak FLOP/s of one GPU per precision, from the vendors' spec sheets (NVIDIA H100/H200
# and A100 datasheets; the sparse figures there are twice these). Matched by substring of
# torch.cuda.get_device_name, first match wins; "tf32" applies to fp32 when
# torch.get_float32_matmul_precision() is not "highest".
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),  # SXM
    ("H200", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),  # SXM
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
)


def peak_flops(device: torch.device | str, precision: str) -> float | None:
    """The device's dense peak FLOP/s for ``precision`` (:data:`PEAK_FLOPS`); None for the CPU
    and GPUs not in the table (MFU is then not reported)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = precision
    if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    return next((peaks[key] for sub, peaks in PEAK_FLOPS if sub in name), None)


def throughput(
    step_times: Sequence[float],
    *,
    tokens_per_step: int,
    flops_per_token: float,
    peak: float | None,
    devices: int,
) -> dict[str, Any]:
    """Tokens/s over ``step_times`` (seconds of the timed steps) and the model FLOPs
    utilisation: achieved model FLOP/s over ``peak`` (one device's) x ``devices``."""
    timed = sum(step_times)
    tps = tokens_per_step * len(step_times) / timed if step_times and timed > 0 else None
    achieved = tps * flops_per_token if tps is not None else None
    return {
        "tokens_per_s": tps,
        "flops_per_token": flops_per_token,
        "model_flops_per_s": achieved,
        "peak_flops_per_device": peak,
        "mfu": achieved / (peak * devices) if achieved is not None and peak else None,
        "timed_steps": len(step_times) if tps is not None else 0,
    }
