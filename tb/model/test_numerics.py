"""The numerics module is the specification the RTL must meet: check each rule."""

import math

import numpy as np
import pytest

from flashnpu.golden import numerics as nx

RNG = np.random.default_rng(1234)


def rand_normal32(n, lo=-30, hi=30):
    return (RNG.standard_normal(n) * 2.0 ** RNG.integers(lo, hi, n)).astype(np.float32)


def test_add_and_mul_are_ieee_rne_in_the_normal_range():
    a, b = rand_normal32(100_000), rand_normal32(100_000)
    assert np.array_equal(nx.add32(a, b), a + b)
    assert np.array_equal(nx.sub32(a, b), a - b)
    assert np.array_equal(nx.mul32(a, b), a * b)


def test_flush_to_zero_and_denormals_are_zero():
    tiny = np.float32(2.0 ** -126)
    sub = np.float32(2.0 ** -130)              # a binary32 subnormal
    assert nx.add32(sub, np.float32(0)) == 0 and np.signbit(nx.add32(-sub, np.float32(-0.0)))
    assert nx.add32(tiny * np.float32(1.5), -tiny) == 0          # exact result 2^-127 -> flushed
    assert nx.add32(-tiny * np.float32(0.5), tiny) == tiny        # subnormal input reads as 0
    assert nx.mul32(tiny, np.float32(0.75)) == 0                # subnormal product -> 0
    assert np.signbit(nx.mul32(-tiny, np.float32(0.75)))        # sign kept
    # FTZ is decided on the exact product: just below 2^-126 flushes even
    # though IEEE rounding with gradual underflow would give 2^-126.
    just_below = np.float32(1 - 2.0 ** -24)
    assert nx.mul32(tiny, just_below) == 0
    assert nx.mul32(sub, np.float32(2.0 ** 20)) == 0            # DAZ on the input
    assert nx.mul32(np.float32(3e38), np.float32(10)) == np.inf


def test_mac_product_is_exact_including_fp16_subnormals():
    a = RNG.standard_normal(50_000).astype(np.float16)
    b = (RNG.standard_normal(50_000) * 1e-6).astype(np.float16)   # many fp16 subnormals
    acc = rand_normal32(50_000, -20, 5)
    exact = a.astype(np.float64) * b.astype(np.float64)
    assert np.array_equal(exact.astype(np.float32).astype(np.float64), exact)
    assert np.array_equal(nx.mac(acc, a, b), nx.add32(acc, exact.astype(np.float32)))
    smallest = np.float16(2.0 ** -24)
    assert nx.mac(np.float32(0), smallest, smallest) == np.float32(2.0 ** -48)


def test_max32_is_the_bit_pattern_total_order():
    pz, nz = np.float32(0.0), np.float32(-0.0)
    assert not np.signbit(nx.max32(nz, pz)) and not np.signbit(nx.max32(pz, nz))
    assert nx.max32(np.float32(-np.inf), np.float32(-3)) == -3
    a, b = rand_normal32(10_000), rand_normal32(10_000)
    assert np.array_equal(nx.max32(a, b), np.maximum(a, b))


def test_exp2_special_values():
    x = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, -128.0, -127.9, -126.0, -1.0, -0.5], np.float32)
    got = nx.exp2(x)
    assert list(got[:5]) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert np.isnan(got[5]) and nx.exp2_bits(nx.bits32(x[5:6]))[0] == nx.NAN32_BITS
    assert got[6] == 0 and got[7] == 0
    assert got[8] == np.float32(2.0 ** -126) and got[9] == 0.5
    assert abs(got[10] - math.sqrt(0.5)) < 1e-6


def test_exp2_error_bound_and_monotonicity():
    x = np.concatenate([-RNG.uniform(0, 126, 300_000), -RNG.uniform(0, 1, 300_000),
                        -(2.0 ** -RNG.uniform(0, 40, 50_000))]).astype(np.float32)
    y = nx.exp2(x).astype(np.float64)
    r = np.exp2(x.astype(np.float64))
    rel = np.abs(y - r) / r
    assert rel.max() < 1.1e-6, rel.max()       # documented bound
    xs = np.sort(x)
    assert np.all(np.diff(nx.exp2(xs).astype(np.float64)) >= 0)
    assert nx.EXP2_TABLE[0] == 2 ** 23 and nx.EXP2_TABLE[256] == 2 ** 24


def test_recip_is_correctly_rounded():
    x = np.concatenate([RNG.uniform(1, 4096, 100_000), 2.0 ** RNG.uniform(-120, 120, 50_000)]).astype(np.float32)
    r = nx.recip32(x)
    exact = 1.0 / x.astype(np.float64)
    ulp = np.spacing(np.abs(r)).astype(np.float64)
    assert np.all(np.abs(r - exact) <= ulp / 2)
    assert nx.recip32(np.float32(1.0)) == 1.0 and nx.recip32(np.float32(0)) == np.inf


def test_fp16_rounding_is_rne_with_subnormals():
    one_ulp = 2.0 ** -10
    tie_even = np.float32(1 + one_ulp / 2)        # tie -> even (1.0)
    tie_odd = np.float32(1 + 3 * one_ulp / 2)     # tie -> 1 + 2 ulp
    assert nx.to_fp16(tie_even) == 1.0 and nx.to_fp16(tie_odd) == np.float16(1 + 2 * one_ulp)
    assert nx.to_fp16(np.float32(2.0 ** -24)) == np.float16(2.0 ** -24)
    assert nx.to_fp16(np.float32(2.0 ** -26)) == 0
    assert nx.to_fp16(np.float32(70000)) == np.inf


def test_tree_reduce_follows_the_hardware_order():
    # Values chosen so that the summation order changes the float32 result.
    x = np.array([1.0, 2.0 ** -24, 2.0 ** -24, 1.0, 3.0, 2.0 ** -23, -3.0, 2.0 ** -23], np.float32)
    # 4 PE columns, 2 values each: fold (a+b), then pairwise tree.
    local = [nx.add32(x[2 * i], x[2 * i + 1]) for i in range(4)]
    want = nx.add32(nx.add32(local[0], local[1]), nx.add32(local[2], local[3]))
    assert nx.tree_reduce(x, 4, nx.add32) == want
    assert nx.tree_reduce(x, 4, nx.add32) != np.float32(np.sum(x.astype(np.float64)))
    assert nx.tree_reduce(x, 8, nx.max32) == 3.0
    with pytest.raises(ValueError, match="tile width 8 is not a multiple of the PE columns 3"):
        nx.tree_reduce(x, 3, nx.add32)


def test_score_constant():
    assert nx.scale_log2e(0.125) == np.float32(0.125 / math.log(2))
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            nx.scale_log2e(bad)
