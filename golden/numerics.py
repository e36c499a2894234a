"""The NPU's arithmetic, defined once.  The RTL reproduces every function here
bit for bit; the bit-exact golden model is built only from these functions.

Formats
-------
* Q, K, V and the P operand of P·V: IEEE binary16, subnormals kept.
* S, m_i, l_i, alpha, O_acc, O: IEEE binary32.

Rules (each applies everywhere the operation appears)
------------------------------------------------------
=====================  ======================================================
operation              definition
=====================  ======================================================
FP16 x FP16 product    exact (11 x 11 significand bits fit in binary32; the
                       smallest non-zero product, 2^-48, is a binary32 normal)
MAC                    ``add32(acc, a16 * b16)``: the product is exact, the
                       sum is rounded once (RNE).  In P·V the MAC is skipped
                       when the P operand is zero (masked keys never touch
                       O_acc, so 0 x NaN garbage cannot reach it)
add32 / sub32          IEEE binary32 add, round to nearest even; subnormal
                       inputs read as zero (DAZ), subnormal results become
                       zero of the same sign (FTZ)
mul32                  IEEE binary32 multiply, RNE, DAZ; a result whose
                       exact magnitude is below 2^-126 becomes a signed zero
                       (FTZ before rounding); overflow gives Inf
max32                  the larger in the total order of binary32 bit patterns
                       (-0 < +0); NaN never reaches it in a visible row
exp2                   table + linear interpolation, see ``exp2``;
                       max relative error 1.02e-6 vs float64 on [-126, 0]
recip32                correctly rounded 1/x (RNE; the RTL uses a radix-2
                       divider); max relative error 2^-24
to_fp16                binary32 -> binary16, RNE, subnormals kept
scale                  ``c = fp32(scale * log2(e))`` (float64 product, one
                       rounding); scores are kept in the log2 domain:
                       S' = mul32(S, c), P = exp2(S' - m).  Legal scales
                       (``scale_range``): c a binary32 normal, and c times
                       the largest reachable |S| (``max_score_raw``: about
                       head_dim * 65504^2) finite -- 8.15e-39 .. 4.29e26
                       at head_dim 128
row sum / row max      each PE folds its own Bc/C columns left to right, then
                       a pairwise tree over the C PEs of the row:
                       level k adds neighbours 2i, 2i+1 (``tree_reduce``)
=====================  ======================================================

A row whose running max is still -inf has seen no visible key: its P is zero
and its alpha is one, so it stays (m, l, O_acc) = (-inf, 0, 0).  The final
O = mul32(O_acc, recip32(l)); a row with l == 0 gives exactly +0.

Every function takes and returns numpy arrays of float32 (or float16 where
stated) and never changes its inputs.
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = [
    "F32_MIN_NORMAL", "daz", "ftz", "add32", "sub32", "mul32", "mac", "max32",
    "exp2", "exp2_bits", "recip32", "to_fp16", "scale_log2e", "scale_range", "max_score_raw",
    "max_score_constant", "FP16_MAX", "tree_reduce",
    "EXP2_TABLE", "EXP2_FRAC_BITS", "EXP2_INDEX_BITS", "bits32", "from_bits32",
    "NAN32_BITS", "ONE32_BITS",
]

F32_MIN_NORMAL = np.float32(2.0 ** -126)
NAN32_BITS = 0x7FC00000
ONE32_BITS = 0x3F800000        # binary32 1.0

# exp2 table: T[i] = round(2^(i/256) * 2^23), i = 0..256 (24-bit unsigned).
EXP2_INDEX_BITS = 8
EXP2_FRAC_BITS = 23            # fixed-point fraction bits of the exp2 input
EXP2_INTERP_BITS = EXP2_FRAC_BITS - EXP2_INDEX_BITS   # 15
EXP2_TABLE = np.array(
    [int(round(2.0 ** (i / 256.0) * 2 ** 23)) for i in range(257)], dtype=np.int64)


def bits32(x) -> np.ndarray:
    """float32 array -> uint32 bit patterns."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)


def from_bits32(b) -> np.ndarray:
    """uint32 bit patterns -> float32 array."""
    return np.ascontiguousarray(np.asarray(b, dtype=np.uint32)).view(np.float32)


def ftz(x) -> np.ndarray:
    """Subnormal binary32 values -> zero of the same sign."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.abs(x) < F32_MIN_NORMAL, np.copysign(np.float32(0), x), x).astype(np.float32)


daz = ftz  # the input rule is the same mapping


def add32(a, b) -> np.ndarray:
    """binary32 a + b, RNE, DAZ/FTZ."""
    with np.errstate(invalid="ignore", over="ignore"):
        return ftz(daz(a) + daz(b))


def sub32(a, b) -> np.ndarray:
    """binary32 a - b, RNE, DAZ/FTZ."""
    with np.errstate(invalid="ignore", over="ignore"):
        return ftz(daz(a) - daz(b))


def mul32(a, b) -> np.ndarray:
    """binary32 a * b, RNE, DAZ, FTZ decided on the exact product."""
    a64 = daz(a).astype(np.float64)
    b64 = daz(b).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = a64 * b64                       # exact: 24 x 24 bits fit in 53
        tiny = np.abs(p) < 2.0 ** -126
        r = p.astype(np.float32)            # one RNE rounding
    return np.where(tiny, np.copysign(np.float32(0), p).astype(np.float32), r).astype(np.float32)


def mac(acc, a16, b16) -> np.ndarray:
    """``add32(acc, a16 * b16)`` with the FP16 x FP16 product exact."""
    with np.errstate(invalid="ignore", over="ignore"):
        prod = np.asarray(a16, np.float16).astype(np.float32) * np.asarray(b16, np.float16).astype(np.float32)
    return add32(acc, prod)


def _order_key(x) -> np.ndarray:
    """Signed int64 key whose order is the total order of binary32 patterns."""
    b = bits32(x).astype(np.int64)
    return np.where(b & 0x80000000, -(b & 0x7FFFFFFF) - 1, b)


def max32(a, b) -> np.ndarray:
    """The larger of a and b in the bit-pattern total order (-0 < +0)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return np.where(_order_key(b) > _order_key(a), b, a).astype(np.float32)


def exp2_bits(x_bits) -> np.ndarray:
    """The hardware exp2 on binary32 bit patterns (uint32 in, uint32 out).

    Algorithm (all integer; the RTL does exactly this):

    1. NaN -> canonical NaN 0x7FC00000.  Sign bit 0 (x >= +0, the unit's
       domain is x <= 0) or x == -0 -> 1.0.  |x| >= 128 (also -Inf) -> +0.
    2. Y = floor(|x| * 2^23): the 24-bit significand shifted by the unbiased
       exponent (truncation).  X = -Y is x in two's-complement fixed point with
       23 fraction bits.
    3. n = X >> 23 (floor), f = X & (2^23 - 1);  i = f >> 15 (8 bits),
       t = f & (2^15 - 1).
    4. mant = T[i] + (((T[i+1] - T[i]) * t) >> 15), with T the 257-entry
       table ``EXP2_TABLE`` (2^23 <= mant < 2^24).
    5. n < -126 -> +0 (FTZ); otherwise the result is
       ((n + 127) << 23) | (mant - 2^23).

    Error vs float64 2^x on [-126, 0]: at most 1.02e-6 relative (measured by
    ``tb/model/test_numerics.py``; the interpolation bound is (ln 2)^2 / 8 / 256^2).
    """
    b = np.asarray(x_bits, dtype=np.uint32).astype(np.int64)
    sign = (b >> 31) & 1
    e = (b >> 23) & 0xFF
    frac = b & 0x7FFFFF
    is_nan = (e == 0xFF) & (frac != 0)
    is_zero = e == 0                         # +-0 and (DAZ) subnormals
    too_small = e >= 127 + 7                  # |x| >= 128, includes -Inf
    M = frac | (1 << 23)
    sh = e - 127                              # unbiased exponent
    # Y = floor(M * 2^sh) for sh in [-149, 6]; shifts beyond 24 give 0.
    right = np.clip(-sh, 0, 63)
    left = np.clip(sh, 0, 6)
    Y = np.where(sh >= 0, M << left, M >> right)
    X = -Y
    n = X >> EXP2_FRAC_BITS
    f = X & ((1 << EXP2_FRAC_BITS) - 1)
    i = f >> EXP2_INTERP_BITS
    t = f & ((1 << EXP2_INTERP_BITS) - 1)
    T0 = EXP2_TABLE[i]
    T1 = EXP2_TABLE[i + 1]
    mant = T0 + (((T1 - T0) * t) >> EXP2_INTERP_BITS)
    out = ((n + 127) << 23) | (mant - (1 << 23))
    out = np.where(n < -126, 0, out)
    out = np.where(too_small, 0, out)
    out = np.where(is_zero | (sign == 0), ONE32_BITS, out)
    out = np.where(is_nan, NAN32_BITS, out)
    return out.astype(np.uint32)


def exp2(x) -> np.ndarray:
    """The hardware exp2 on binary32 values (see ``exp2_bits``)."""
    return from_bits32(exp2_bits(bits32(x)))


def recip32(x) -> np.ndarray:
    """Correctly rounded binary32 1/x (RNE), DAZ/FTZ; 1/±0 = ±Inf."""
    x = daz(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return ftz(np.float32(1.0) / x)


def to_fp16(x) -> np.ndarray:
    """binary32 -> binary16, RNE, subnormals kept, overflow -> Inf."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32).astype(np.float16)


_INV_LN2 = 1.0 / math.log(2.0)
FP16_MAX = 65504.0


def _constant(scale: float) -> np.float32:
    with np.errstate(over="ignore"):
        return np.float32(scale * _INV_LN2)


@functools.lru_cache(maxsize=None)
def max_score_raw(head_dim: int) -> float:
    """The largest |S_raw| the MAC chain can reach at ``head_dim``.

    Every product of two finite FP16 values is exact and at most
    65504^2; ``add32`` is monotone in each operand, so no partial sum can
    exceed the chain that adds ``head_dim`` copies of 65504^2 (which
    q = k = 65504 reaches).  At head_dim 128 it is 549218975744 (5.49e11,
    a little below 128 * 65504^2 because the chain rounds down).
    """
    if isinstance(head_dim, bool) or int(head_dim) != head_dim or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, not {head_dim!r}")
    p = np.float32(FP16_MAX) * np.float32(FP16_MAX)
    acc = np.float32(0)
    for _ in range(int(head_dim)):
        acc = add32(acc, p)
    return float(acc)


@functools.lru_cache(maxsize=None)
def max_score_constant(head_dim: int) -> np.float32:
    """The largest binary32 c for which ``mul32(S_raw, c)`` is finite for every
    reachable S_raw at ``head_dim`` (see ``max_score_raw``).  At head_dim 128
    it is 6.196e26."""
    b = np.float32(max_score_raw(head_dim))
    c = np.float32(np.finfo(np.float32).max / float(b))
    while np.isfinite(mul32(b, np.nextafter(c, np.float32(np.inf)))):
        c = np.nextafter(c, np.float32(np.inf))
    while not np.isfinite(mul32(b, c)):
        c = np.nextafter(c, np.float32(0))
    return np.float32(c)


def _legal(scale: float, head_dim: int | None) -> bool:
    c = _constant(scale)
    return bool(np.isfinite(c) and c >= F32_MIN_NORMAL
                and (head_dim is None or c <= max_score_constant(head_dim)))


def _bisect(good: float, bad: float, head_dim) -> float:
    """The legal float64 next to the boundary between ``good`` and ``bad``."""
    g = int(np.float64(good).view(np.int64))
    b = int(np.float64(bad).view(np.int64))
    while abs(b - g) > 1:
        m = (g + b) // 2
        if _legal(float(np.int64(m).view(np.float64)), head_dim):
            g = m
        else:
            b = m
    return float(np.int64(g).view(np.float64))


@functools.lru_cache(maxsize=None)
def scale_range(head_dim: int | None = None) -> tuple[float, float]:
    """The smallest and the largest float64 scale that ``scale_log2e`` accepts.

    The lower end makes c = fp32(scale * log2 e) the smallest binary32
    normal, 2^-126 (scale ~ 8.15e-39; below it c would be subnormal, which
    the hardware reads as zero).  The upper end keeps every score finite:
    c <= ``max_score_constant(head_dim)`` (scale ~ 4.29e26 at head_dim 128);
    without ``head_dim`` only c itself must be finite (scale ~ 2.36e38).
    Inside the range no step of the tile loop sees Inf or NaN: S is finite,
    S - m and m_old - m_new are <= 0 (an overflow there gives -Inf, and
    exp2(-Inf) = 0 is the right value), and P, l_i and O_acc are bounded as
    for any scale.
    """
    tiny = float(F32_MIN_NORMAL) / _INV_LN2
    lo = _bisect(tiny * 2, tiny / 2, head_dim)
    cmax = np.finfo(np.float32).max if head_dim is None else max_score_constant(head_dim)
    guess = float(cmax) / _INV_LN2
    hi = _bisect(guess / 2, guess * 2, head_dim)
    return lo, hi


def scale_log2e(scale: float, head_dim: int | None = None) -> np.float32:
    """The score constant c = fp32(scale * log2(e)).

    Raises
    ------
    ValueError
        naming the scale, unless it is finite and positive, c is a binary32
        normal and -- with ``head_dim`` -- ``mul32(S_raw, c)`` is finite for
        every S_raw the MAC chain can reach (the legal range is
        ``scale_range(head_dim)``).
    """
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be a positive finite number, not {scale!r}")
    if not _legal(s, head_dim):
        lo, hi = scale_range(head_dim)
        if s < lo:
            raise ValueError(f"scale={s!r} is below {lo!r}: its score constant "
                             f"fp32(scale * log2 e) is not a binary32 normal")
        if head_dim is None:
            raise ValueError(f"scale={s!r} is above {hi!r}: its score constant "
                             f"fp32(scale * log2 e) overflows binary32")
        raise ValueError(f"scale={s!r} is above {hi!r}, the largest at head_dim={head_dim} "
                         f"whose scores stay finite in binary32 (|Q K^T| reaches "
                         f"{max_score_raw(head_dim):.6g})")
    return _constant(s)


def tree_reduce(x, cols: int, op) -> np.ndarray:
    """Reduce the last axis of ``x`` (length Bc) as the hardware does.

    The axis is split into ``cols`` contiguous groups of Bc/cols values (one
    group per PE column); each PE folds its group left to right with ``op``,
    then a pairwise tree over the PEs combines neighbours (2i, 2i+1) level by
    level (log2(cols) levels).

    Parameters
    ----------
    x : ndarray, float32 [..., Bc]
    cols : int
        PE columns C (power of two, divides Bc).
    op : callable
        ``add32`` or ``max32``.

    Returns
    -------
    ndarray, float32 [...]
    """
    x = np.asarray(x, np.float32)
    bc = x.shape[-1]
    if bc % cols:
        raise ValueError(f"tile width {bc} is not a multiple of the PE columns {cols}")
    g = x.reshape(x.shape[:-1] + (cols, bc // cols))
    acc = g[..., 0]
    for k in range(1, g.shape[-1]):
        acc = op(acc, g[..., k])
    while acc.shape[-1] > 1:
        acc = op(acc[..., 0::2], acc[..., 1::2])
    return acc[..., 0]
