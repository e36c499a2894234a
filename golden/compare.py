"""Comparison helpers shared by the tests, the CLI and the testbenches.

Every helper fails on a NaN on either side: a NaN-vs-NaN "match" is a bug in
the checker, not agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ComparisonError", "assert_bit_exact", "error_stats", "tolerance_check"]


class ComparisonError(AssertionError):
    """A comparison failed; the message names the first bad coordinates."""


def _no_nan(name, a):
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.floating) and np.isnan(a).any():
        idx = tuple(int(i) for i in np.argwhere(np.isnan(a))[0])
        raise ComparisonError(f"{name} holds NaN (first at index {idx}, {int(np.isnan(a).sum())} in all)")


def assert_bit_exact(actual, expected, what="value", where=None):
    """Raise ComparisonError unless ``actual`` and ``expected`` have identical bits.

    ``where`` (optional) maps an index tuple to a description, e.g. the tile and
    PE coordinates; the message prints the first mismatch with expected and
    actual value and bit pattern, and the mismatch count.
    """
    a = np.asarray(actual)
    e = np.asarray(expected)
    _no_nan(f"actual {what}", a)
    _no_nan(f"expected {what}", e)
    if a.shape != e.shape or a.dtype != e.dtype:
        raise ComparisonError(f"{what}: shape/dtype {a.shape}/{a.dtype} != expected {e.shape}/{e.dtype}")
    view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    ab, eb = a.view(view), e.view(view)
    bad = np.argwhere(ab != eb)
    if len(bad):
        idx = tuple(int(i) for i in bad[0])
        loc = where(idx) if where else f"index {idx}"
        w = 2 * a.dtype.itemsize
        raise ComparisonError(
            f"{what} differs at {loc}: expected {e[idx]!r} (0x{int(eb[idx]):0{w}x}), "
            f"actual {a[idx]!r} (0x{int(ab[idx]):0{w}x}); {len(bad)} of {a.size} differ")


@dataclass
class ErrorStats:
    max_abs: float
    max_rel: float          # max_abs relative to the output scale max|ref|
    scale: float


def error_stats(actual, reference) -> ErrorStats:
    """Max abs error and max abs error relative to max|reference| (NaN fails)."""
    a = np.asarray(actual, np.float64)
    r = np.asarray(reference, np.float64)
    _no_nan("actual", a)
    _no_nan("reference", r)
    if a.shape != r.shape:
        raise ComparisonError(f"shape {a.shape} != reference shape {r.shape}")
    if not np.isfinite(a).all():
        raise ComparisonError("actual holds Inf")
    err = float(np.max(np.abs(a - r))) if a.size else 0.0
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    return ErrorStats(err, err / scale if scale else err, scale)


def tolerance_check(actual, plain, reference, rel_limit=1e-3):
    """The tolerance rule of the bit-exact model.

    ``actual`` (bit-exact model or RTL) must be within 2x the max abs error of
    ``plain`` (the plain FP16/FP32 attention) against the float64
    ``reference``, and within ``rel_limit`` of the output scale.
    Returns (ok, message, stats, plain_stats).
    """
    s = error_stats(actual, reference)
    p = error_stats(plain, reference)
    ok = s.max_abs <= 2 * p.max_abs and s.max_rel <= rel_limit
    msg = (f"max abs error {s.max_abs:.3g} (plain FP16/FP32: {p.max_abs:.3g}, limit 2x), "
           f"relative to output scale {s.max_rel:.3g} (limit {rel_limit:g})")
    return ok, msg, s, p
