"""Test utilities: compare pytrees of tensors with per-dtype tolerances.

This module is for tests, so its failures are ``AssertionError`` (not funcpipe errors).
"""

from __future__ import annotations

from typing import Any

import torch

from funcpipe.tree import leaf_paths, tree_flatten

__all__ = ["DEFAULT_TOLERANCES", "assert_trees_close"]

# dtype -> (rtol, atol). Integer and bool tensors must match exactly.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.complex128: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-6),
    torch.complex64: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (1e-2, 1e-3),
}


def _tolerances(
    dtype: torch.dtype, rtol: float | None, atol: float | None
) -> tuple[float, float] | None:
    """The (rtol, atol) to use for ``dtype``; ``None`` means exact comparison."""
    default = DEFAULT_TOLERANCES.get(dtype)
    if default is None and rtol is None and atol is None:
        return None
    d_rtol, d_atol = default if default is not None else (0.0, 0.0)
    return (d_rtol if rtol is None else rtol, d_atol if atol is None else atol)


def assert_trees_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """Assert that two pytrees have the same structure and close tensor leaves.

    Per leaf: same shape, same dtype, and ``|actual - expected| <= atol + rtol * |expected|``
    elementwise. Tolerances default per dtype (:data:`DEFAULT_TOLERANCES`); integer and bool
    leaves must be equal. Non-tensor leaves must compare equal with ``==``. The error names the
    leaf path, the largest absolute difference and the tolerances used.
    """
    prefix = f"{msg}: " if msg else ""
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        raise AssertionError(
            f"{prefix}trees differ in structure:\n  actual:   {a_spec}\n  expected: {e_spec}"
        )
    paths = leaf_paths(actual, name="tree")
    for path, a, e in zip(paths, a_leaves, e_leaves, strict=True):
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            if isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor) or a != e:
                raise AssertionError(f"{prefix}leaf {path} differs: actual={a!r}, expected={e!r}")
            continue
        if a.shape != e.shape:
            raise AssertionError(
                f"{prefix}leaf {path} differs in shape: actual {tuple(a.shape)}, "
                f"expected {tuple(e.shape)}"
            )
        if a.dtype != e.dtype:
            raise AssertionError(
                f"{prefix}leaf {path} differs in dtype: actual {a.dtype}, expected {e.dtype}"
            )
        a_cpu, e_cpu = a.detach().cpu(), e.detach().cpu()
        tol = _tolerances(a.dtype, rtol, atol)
        if tol is None:
            if not torch.equal(a_cpu, e_cpu):
                bad = int((a_cpu != e_cpu).sum())
                raise AssertionError(
                    f"{prefix}leaf {path} ({a.dtype}, shape {tuple(a.shape)}) must be equal: "
                    f"{bad} of {a.numel()} elements differ"
                )
            continue
        leaf_rtol, leaf_atol = tol
        close = torch.isclose(a_cpu, e_cpu, rtol=leaf_rtol, atol=leaf_atol)
        if not bool(close.all()):
            diff = (a_cpu.to(torch.complex128 if a.is_complex() else torch.float64) - e_cpu).abs()
            max_diff = float(diff.nan_to_num(nan=float("inf")).max())
            bad = int((~close).sum())
            raise AssertionError(
                f"{prefix}leaf {path} ({a.dtype}, shape {tuple(a.shape)}) not close: "
                f"max abs diff {max_diff:.3g}, {bad} of {a.numel()} elements outside "
                f"rtol={leaf_rtol:g}, atol={leaf_atol:g}"
            )
