"""Floating-point units of the PE: binary32 add/sub, multiply, max, the FP16 MAC,
exp2, binary32 -> binary16 conversion and a sequential reciprocal.

Every unit reproduces one function of ``flashnpu.golden.numerics`` bit for bit
for every input pattern (the tests sweep special values exhaustively and 10^5
random operands per unit).  The rules those functions define shape the
hardware, and they were chosen to keep it small:

* **DAZ/FTZ** (subnormal inputs read as zero, subnormal results become zero of
  the same sign).  The adder and multiplier never see a significand without
  its hidden bit, so there is no input normaliser, and results never need the
  denormalising right shift.  The sum of two normals that lands below 2^-126 is
  exact, so the adder flushes it without a rounding question; the multiplier
  flushes on the exact product (before rounding), which is one compare on the
  pre-rounding exponent.
* **One rounding, RNE, with guard/round/sticky.**  The single-path adder keeps
  three bits below the significand while aligning (the sticky bit ORed into the
  lowest of them, "jamming"), which is the textbook minimum for a correctly
  rounded sum: a left shift of more than one place only happens when the
  exponents differ by at most one, and then nothing was shifted out.
  A dual-path (near/far) adder would be shorter in depth but twice the code;
  this is a model whose first job is to be read.
* **The FP16 x FP16 product is exact** (11 x 11 bits fit in 24), so the MAC is
  an exact product normaliser in front of the same binary32 adder: the product
  becomes an ordinary binary32 operand (its smallest non-zero magnitude, 2^-48,
  is a binary32 normal) and the MAC rounds once, in the adder.
* **exp2 by table and linear interpolation** on a 23-bit fixed-point input:
  a 256-entry ROM holding T[i] and the slope T[i+1] - T[i] (both derived from
  ``numerics.EXP2_TABLE`` at elaboration time), one 16 x 15-bit multiply and
  one add.  A polynomial would need two or three multiplies for the same
  error.
* **The reciprocal is a radix-2 restoring divider** (one quotient bit per
  cycle, 25 bits, then a rounding cycle).  It is used once per output row
  after the last KV tile, so its latency is invisible and its area matters
  more than its speed; a radix-4 SRT divider would halve the latency at the
  cost of a redundant remainder and a quotient-digit table.

Shared building blocks
----------------------
::

    _Unpacked32 ─► (sign, exponent, 24-bit significand with hidden bit,
                    31-bit magnitude, zero / Inf / NaN flags), DAZ applied
    leading_zeros ─► log-depth leading-zero counter (normalisation shifts)
    round_nearest_even(mant, guard, sticky) ─► mant + 1 when
        guard & (sticky | lsb); the carry out bumps the exponent

Units (ports are unsigned bit patterns)
---------------------------------------
============  =========================================  =====================
unit          ports                                      golden function
============  =========================================  =====================
Fp32AddSub    a(32), b(32), sub(1) -> o(32)              add32 / sub32
Fp32Mul       a(32), b(32) -> o(32)                      mul32
Fp16Mac       acc(32), a(16), b(16) -> o(32)             mac
Fp32Max       a(32), b(32) -> o(32)                      max32
Exp2          x(32) -> o(32)                             exp2_bits
Fp32ToFp16    a(32) -> o(16)                             to_fp16
Recip         start(1), x(32) -> busy, done, o(32)       recip32 (sequential)
============  =========================================  =====================

NaN results are the canonical quiet NaN 0x7FC00000 (0x7E00 for binary16);
``Fp32Max`` passes one of its operands through unchanged, NaN or not.

Pipelining
----------
Every unit but ``Fp32Max`` and ``Recip`` takes a ``latency`` (default 0:
combinational).  The unit names the places where a register may go
(``BOUNDARIES``, in dataflow order) and ``PLANS`` maps each latency to the
boundaries it registers; every value live across a registered boundary is
registered with it (``_Stages.cut``), so a pipelined unit takes one operand
set per cycle and returns each result exactly ``latency`` cycles later.
Special cases (NaN, Inf, zero operands) are decided in the first stage from
the operands and carried down, so no stage reaches back to an input.

Logic depth per stage, generic two-input gates and multiplexers
(``flashnpu depth``: Yosys with Booth multipliers and Kogge-Stone adders,
longest flip-flop-free path; ``results/depth.md``).  ``DESIGN_LATENCY`` is
the smallest latency within the design's 40-level budget:

============  ==========================  ==========  =====================
unit          boundaries (registered at   levels at   levels at the design
              the design latency)         latency 0   latency
============  ==========================  ==========  =====================
Fp16Mac       mult, product, swap, add,   141         30 (latency 5)
              norm
Fp32AddSub    swap, add, norm             93          30 (latency 3)
Fp32Mul       partial, product            75          33 (latency 2)
Exp2          lookup, interp              70          34 (latency 2)
Fp32ToFp16    shift                       47          25 (latency 1)
Fp32Max       --                          17          17 (combinational)
Recip         -- (one quotient bit per    16          16
              cycle)
============  ==========================  ==========  =====================

The MAC reads ``acc`` ``acc_delay`` cycles after ``a`` and ``b`` (when the
product reaches the adder), so the accumulation recurrence is the adder's
latency plus the write-back register: 4 cycles at the design latency, which
the PE hides by interleaving four or more independent accumulators.
"""

from types import SimpleNamespace

from amaranth.hdl import Cat, Const, Module, Mux, Signal, Value, signed, unsigned
from amaranth.lib import wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from flashnpu.golden.numerics import (
    EXP2_FRAC_BITS,
    EXP2_INDEX_BITS,
    EXP2_INTERP_BITS,
    EXP2_TABLE,
    NAN32_BITS,
    ONE32_BITS,
)

__all__ = ["Fp32AddSub", "Fp32Mul", "Fp16Mac", "Fp32Max", "Exp2", "Fp32ToFp16", "Recip",
           "NAN32", "NAN16", "INF32", "ONE32", "DESIGN_LATENCY"]

NAN32 = NAN32_BITS            # canonical binary32 quiet NaN
NAN16 = 0x7E00                # canonical binary16 quiet NaN
INF32 = 0x7F800000            # +Inf (OR the sign bit for -Inf)
ONE32 = ONE32_BITS            # 1.0
_EXP_MAX = 0xFF               # all-ones exponent field: Inf / NaN
_BIAS = 127


# ---------------------------------------------------------------- helpers
def leading_zeros(m: Module, value, name: str) -> Signal:
    """Count the leading zeros of ``value`` with a log-depth tree.

    The value is padded at the bottom with zeros to a power-of-two width, so
    the count is exact for every non-zero value; for an all-zero value the
    count is the padded width (callers test for zero separately).  Each tree
    level merges two halves: if the upper half is all zero the count is
    ``half + count(lower)``, else ``count(upper)`` — the classic LZC of
    Oklobdzija (IEEE TVLSI 1994), depth log2(width) multiplexers.

    Parameters
    ----------
    m : Module
        Module receiving the combinational logic.
    value : Value
        Unsigned value to examine (width >= 1).
    name : str
        Prefix of the named intermediate signals.

    Returns
    -------
    Signal
        Unsigned count, ``ceil(log2(padded width)) + 1`` bits.
    """
    width = len(value)
    padded = 1
    while padded < width:
        padded *= 2
    bits = Cat(Const(0, padded - width), value) if padded > width else value
    # Leaves: one bit each; (all_zero, count) with a zero-width count.
    nodes = [(~bits[i], None) for i in range(padded)]       # index 0 = LSB
    level = 0
    while len(nodes) > 1:
        merged = []
        for k in range(0, len(nodes), 2):
            lo_zero, lo_cnt = nodes[k]
            hi_zero, hi_cnt = nodes[k + 1]
            zero = Signal(name=f"{name}_z{level}_{k // 2}")
            cnt = Signal(level + 1, name=f"{name}_c{level}_{k // 2}")
            m.d.comb += zero.eq(hi_zero & lo_zero)
            if hi_cnt is None:                  # leaves: count is 0 or 1
                m.d.comb += cnt.eq(hi_zero)
            else:                               # upper half zero -> 1, lower count
                m.d.comb += cnt.eq(Mux(hi_zero, Cat(lo_cnt, Const(1, 1)), Cat(hi_cnt, Const(0, 1))))
            merged.append((zero, cnt))
        nodes = merged
        level += 1
    zero, cnt = nodes[0]
    count = Signal(range(padded + 1), name=f"{name}_lz")
    if cnt is None:                              # one-bit value
        m.d.comb += count.eq(zero)
    else:
        m.d.comb += count.eq(Mux(zero, padded, cnt))
    return count


def round_nearest_even(m: Module, mant, guard, sticky, name: str):
    """Round a truncated significand to nearest, ties to even.

    Parameters
    ----------
    m : Module
    mant : Value
        Kept significand bits (width w).
    guard : Value
        First bit below the kept bits.
    sticky : Value
        OR of every bit below ``guard``.
    name : str
        Prefix of the named signals.

    Returns
    -------
    (Signal, Signal)
        The rounded significand (w bits, wrapped) and the carry out of the
        increment (the rounded value was 2^w).  The carry is decided as
        ``round_up & (mant == all ones)``, not taken from the incrementer's
        carry chain, so a caller's exponent select does not wait for it.
    """
    width = len(mant)
    round_up = Signal(name=f"{name}_round_up")
    rounded = Signal(width, name=f"{name}_rounded")
    carry = Signal(name=f"{name}_carry")
    m.d.comb += [
        # Above the halfway point, or exactly halfway with an odd lsb.
        round_up.eq(guard & (sticky | mant[0])),
        rounded.eq(mant + round_up),
        carry.eq(round_up & mant.all()),
    ]
    return rounded, carry



def rounded_exponent(m: Module, exp_pre, carry, name: str):
    """The exponent after rounding and its overflow flag (>= 255, Inf
    under RNE), both selected by the rounding ``carry`` of
    ``round_nearest_even`` between values computed from ``exp_pre`` alone,
    so neither waits for the carry.  ``exp_pre``: signed, wide enough for
    exp_pre + 1.  Returns ``(exp_post, overflow)``."""
    exp_post = Signal(exp_pre.shape(), name=f"{name}_exp_post")
    overflow = Signal(name=f"{name}_overflow")
    m.d.comb += [exp_post.eq(Mux(carry, exp_pre + 1, exp_pre)),
                 overflow.eq(Mux(carry, exp_pre + 1 >= _EXP_MAX, exp_pre >= _EXP_MAX))]
    return exp_post, overflow

class _Stages:
    """The pipeline registers of one unit.

    A unit names the places in its dataflow where a register may go (its
    *boundaries*, in dataflow order, ``BOUNDARIES`` on the class) and passes
    every value that is live across a boundary through ``cut``.  The unit's
    ``latency`` picks how many boundaries are registered and ``PLANS`` which
    ones: the choice that keeps every stage's logic depth lowest, measured by
    ``flashnpu depth``.  With latency 0 the unit is the combinational one.

    Registers clock every cycle (no enable): a pipelined unit accepts one
    operand set per cycle and returns its result ``latency`` cycles later,
    whatever came before or after it (no stalls, no state across operations).
    """

    def __init__(self, unit, latency: int):
        plans = type(unit).PLANS
        if latency not in plans:
            raise ValueError(f"{type(unit).__name__} latency must be one of {sorted(plans)}, not {latency!r}")
        self.cuts = set(plans[latency])

    def cut(self, m: Module, boundary: str, **values):
        """``values`` (name -> Value) one register later when ``boundary``
        is registered, else unchanged; returned as a namespace."""
        out = {}
        for name, v in values.items():
            if boundary in self.cuts:
                r = Signal(Value.cast(v).shape(), name=f"{boundary}_{name}")
                m.d.sync += r.eq(v)
                v = r
            out[name] = v
        return SimpleNamespace(**out)


class _Pipelined(wiring.Component):
    """A unit whose ``latency`` (cycles, default 0) picks one of its ``PLANS``
    (see ``_Stages``); subclasses name their ``BOUNDARIES`` and ``PLANS`` and
    declare their ports as class annotations."""

    def __init__(self, latency: int = 0):
        self.latency = latency
        self._stages = _Stages(self, latency)
        super().__init__()


class _Unpacked32:
    """Named fields of a binary32 operand, DAZ applied.

    ``mant`` is the 24-bit significand with the hidden bit; ``mag`` the 31-bit
    magnitude field used for magnitude compares (both zero for a subnormal or
    zero input).
    """

    def __init__(self, m: Module, bits, name: str):
        self.sign = Signal(name=f"{name}_sign")
        self.exp = Signal(8, name=f"{name}_exp")
        self.frac = Signal(23, name=f"{name}_frac")
        self.is_zero = Signal(name=f"{name}_is_zero")     # +-0 and subnormals (DAZ)
        self.is_inf = Signal(name=f"{name}_is_inf")
        self.is_nan = Signal(name=f"{name}_is_nan")
        self.mag = Signal(31, name=f"{name}_mag")
        self.mant = Signal(24, name=f"{name}_mant")
        raw_exp = bits[23:31]
        raw_frac = bits[0:23]
        m.d.comb += [
            self.sign.eq(bits[31]),
            self.is_zero.eq(raw_exp == 0),
            self.is_inf.eq((raw_exp == _EXP_MAX) & (raw_frac == 0)),
            self.is_nan.eq((raw_exp == _EXP_MAX) & (raw_frac != 0)),
            # DAZ: a subnormal becomes a zero of the same sign.
            self.exp.eq(raw_exp),
            self.frac.eq(Mux(self.is_zero, 0, raw_frac)),
            self.mag.eq(Cat(self.frac, self.exp)),
            self.mant.eq(Cat(self.frac, ~self.is_zero)),
        ]


# ---------------------------------------------------------------- add / sub
class Fp32AddSub(_Pipelined):
    """binary32 adder/subtractor, RNE, DAZ/FTZ (``latency`` cycles, default 0).

    Bit-exact with ``numerics.add32`` (``sub = 0``) and ``numerics.sub32``
    (``sub = 1``).

    Datapath (single path, three extra bits G/R/S while aligning)::

        a ──unpack──┐                 ┌─ big ── mant<<3 ──────────────┐
                    ├─ |a| >= |b| ? ──┤                               ├─ +/- ─► S (28 b)
        b ^ sub ────┘   (swap)        └─ small ─ mant<<3 >> d, jam S ─┘
                                                   d = e_big - e_small
        S ─ LZC ─ << lz ─ RNE(G, R|S) ─ exp = e_big + 1 - lz (+ carry)
          ─ FTZ (exp <= 0) / overflow (exp >= 255) / Inf, NaN, exact zero

    Ports
    -----
    a, b : In(32)
        binary32 operands (bit patterns).
    sub : In(1)
        1 computes ``a - b`` (flips the sign of ``b``).
    o : Out(32)
        The rounded result of the operands of ``latency`` cycles ago.

    Parameters
    ----------
    latency : int
        0..3 (``PLANS``); ValueError otherwise.

    Notes
    -----
    Exact cancellation gives +0; ``(-0) + (-0)`` gives -0 (IEEE 754 §6.3).
    Inf - Inf and any NaN operand give 0x7FC00000.
    """

    a: In(32)
    b: In(32)
    sub: In(1)
    o: Out(32)

    #: register boundaries, in dataflow order: after the swap (operands
    #: ordered, exponent difference known), after the significand add, after
    #: the normalising shift
    BOUNDARIES = ("swap", "add", "norm")
    PLANS = {0: (), 1: ("add",), 2: ("swap", "norm"), 3: ("swap", "add", "norm")}

    def elaborate(self, platform):
        m = Module()
        st = self._stages
        ua = _Unpacked32(m, self.a, "a")
        ub = _Unpacked32(m, self.b, "b")
        b_sign = Signal()                     # sign of b after the sub flip
        m.d.comb += b_sign.eq(ub.sign ^ self.sub)

        # --- special results (NaN, Inf, exact zero of two zeros' sign) depend
        # on the operands only; decided here and carried down the pipeline
        special = Signal()
        special_o = Signal(32)
        with m.If(ua.is_nan | ub.is_nan | (ua.is_inf & ub.is_inf & (ua.sign != b_sign))):
            m.d.comb += [special.eq(1), special_o.eq(NAN32)]
        with m.Elif(ua.is_inf):
            m.d.comb += [special.eq(1), special_o.eq(Cat(Const(0, 23), Const(_EXP_MAX, 8), ua.sign))]
        with m.Elif(ub.is_inf):
            m.d.comb += [special.eq(1), special_o.eq(Cat(Const(0, 23), Const(_EXP_MAX, 8), b_sign))]
        zero_sign = Signal()                  # exact zero: -0 only when both operands are -0 (RNE rule)
        m.d.comb += zero_sign.eq(ua.sign & b_sign)

        # --- swap so that |big| >= |small| (magnitude fields compare like ints)
        swap = Signal()
        big_sign, small_sign = Signal(), Signal()
        big_exp, small_exp = Signal(8), Signal(8)
        big_mant, small_mant = Signal(24), Signal(24)
        exp_diff = Signal(8)
        m.d.comb += [
            swap.eq(ub.mag > ua.mag),
            big_sign.eq(Mux(swap, b_sign, ua.sign)),
            small_sign.eq(Mux(swap, ua.sign, b_sign)),
            big_exp.eq(Mux(swap, ub.exp, ua.exp)),
            small_exp.eq(Mux(swap, ua.exp, ub.exp)),
            big_mant.eq(Mux(swap, ub.mant, ua.mant)),
            small_mant.eq(Mux(swap, ua.mant, ub.mant)),
            exp_diff.eq(big_exp - small_exp),
        ]
        p = st.cut(m, "swap", special=special, special_o=special_o, zero_sign=zero_sign,
                   big_sign=big_sign, eff_sub=big_sign ^ small_sign, big_exp=big_exp,
                   big_mant=big_mant, small_mant=small_mant, exp_diff=exp_diff)

        # --- alignment: shift the small significand right by the exponent
        # difference with three extra bits (guard, round, sticky).  The shift
        # is clamped to 27: by then every bit sits below the sticky position.
        shift = Signal(range(28))
        aligned_wide = Signal(54)             # [53:27] kept part, [26:0] shifted out
        aligned = Signal(27)
        align_sticky = Signal()
        m.d.comb += [
            shift.eq(Mux(p.exp_diff > 27, 27, p.exp_diff)),
            aligned_wide.eq(Cat(Const(0, 27), Const(0, 3), p.small_mant) >> shift),
            align_sticky.eq(aligned_wide[0:27] != 0),
            # Jamming: OR the shifted-out bits into the lowest kept bit.
            aligned.eq(aligned_wide[27:54] | align_sticky),
        ]

        # --- significand add or subtract (never negative: |big| >= |small|)
        big_ext = Signal(27)
        total = Signal(28)                    # bit 27 is the carry of an add
        m.d.comb += [
            big_ext.eq(Cat(Const(0, 3), p.big_mant)),
            total.eq(Mux(p.eff_sub, big_ext - aligned, big_ext + aligned)),
        ]
        p = st.cut(m, "add", special=p.special, special_o=p.special_o, zero_sign=p.zero_sign,
                   big_sign=p.big_sign, big_exp=p.big_exp, total=total)

        # --- normalisation: bring the leading one to bit 27
        lz = leading_zeros(m, p.total, "add")
        normed = Signal(28)
        exp_pre = Signal(signed(10))          # exponent before rounding
        m.d.comb += [
            normed.eq(p.total << lz),
            # Leading one at bit 26 (lz = 1) keeps the exponent of big.
            exp_pre.eq(p.big_exp + 1 - lz),
        ]
        p = st.cut(m, "norm", special=p.special, special_o=p.special_o, zero_sign=p.zero_sign,
                   big_sign=p.big_sign, is_zero=p.total == 0, normed=normed, exp_pre=exp_pre)

        # --- rounding: 24 kept bits, guard below them, sticky = the rest
        mant_r, carry = round_nearest_even(
            m, p.normed[4:28], p.normed[3], p.normed[0:3] != 0, "add")
        exp_post, overflow = rounded_exponent(m, p.exp_pre, carry, "add")

        # --- result selection, special cases first
        with m.If(p.special):
            m.d.comb += self.o.eq(p.special_o)
        with m.Elif(p.is_zero):
            m.d.comb += self.o.eq(Cat(Const(0, 31), p.zero_sign))
        with m.Elif(p.exp_pre <= 0):
            # FTZ: the exact (unrounded) sum is below 2^-126.
            m.d.comb += self.o.eq(Cat(Const(0, 31), p.big_sign))
        with m.Elif(overflow):
            # Overflow under RNE goes to Inf.
            m.d.comb += self.o.eq(Cat(Const(0, 23), Const(_EXP_MAX, 8), p.big_sign))
        with m.Else():
            m.d.comb += self.o.eq(Cat(mant_r[0:23], exp_post[0:8], p.big_sign))
        return m


# ---------------------------------------------------------------- multiply
class Fp32Mul(_Pipelined):
    """binary32 multiplier, RNE, DAZ, FTZ decided on the exact product
    (``latency`` cycles, default 0).

    Bit-exact with ``numerics.mul32``.

    Datapath::

        a.mant (24) ─┐
                     ├─ x ─► P (48 b) ─ P[47] ? (P[47:24], G=P[23]) : (P[46:23], G=P[22])
        b.mant (24) ─┘                   ─ RNE ─ pack
        exp = e_a + e_b - 127 + P[47];  exp <= 0 -> signed zero (FTZ before
        rounding: the exact product is below 2^-126);  exp >= 255 after
        rounding -> Inf

    Ports
    -----
    a, b : In(32)
        binary32 operands.
    o : Out(32)
        The rounded product of the operands of ``latency`` cycles ago.

    Parameters
    ----------
    latency : int
        0..2 (``PLANS``); ValueError otherwise.

    Notes
    -----
    0 x Inf and any NaN operand give 0x7FC00000.
    """

    a: In(32)
    b: In(32)
    o: Out(32)

    #: register boundaries: after the four 12 x 12 partial products, after
    #: the full product
    BOUNDARIES = ("partial", "product")
    PLANS = {0: (), 1: ("product",), 2: ("partial", "product")}

    def elaborate(self, platform):
        m = Module()
        st = self._stages
        ua = _Unpacked32(m, self.a, "a")
        ub = _Unpacked32(m, self.b, "b")
        # special results from the operands alone: 0 none, 1 NaN, 2 Inf, 3 signed zero
        special = Signal(2)
        m.d.comb += special.eq(Mux(
            ua.is_nan | ub.is_nan | (ua.is_inf & ub.is_zero) | (ua.is_zero & ub.is_inf), 1,
            Mux(ua.is_inf | ub.is_inf, 2, Mux(ua.is_zero | ub.is_zero, 3, 0))))
        # four 12 x 12 partial products: each is one MULT18X18D on the ECP5
        # with nothing after it in its stage (a 24 x 12 product needs two and
        # an adder behind them, which was the core's critical path)
        al, ah, bl, bh = ua.mant[0:12], ua.mant[12:24], ub.mant[0:12], ub.mant[12:24]
        p = st.cut(m, "partial", special=special, sign=ua.sign ^ ub.sign,
                   exp_sum=ua.exp + ub.exp,
                   ll=al * bl, lh=al * bh, hl=ah * bl, hh=ah * bh)
        p = st.cut(m, "product", special=p.special, sign=p.sign, exp_sum=p.exp_sum,
                   product=p.ll + ((p.lh + p.hl) << 12) + (p.hh << 24))
        sign = p.sign
        product = Signal(48)                   # exact significand product in [2^46, 2^48)
        top = Signal()                         # product >= 2^47: one more exponent
        exp_pre = Signal(signed(11))
        kept = Signal(24)
        guard = Signal()
        sticky = Signal()
        m.d.comb += [
            product.eq(p.product),
            top.eq(product[47]),
            exp_pre.eq(p.exp_sum - _BIAS + top),
            # Normalise by at most one place: pick the 24 bits under the leading one.
            kept.eq(Mux(top, product[24:48], product[23:47])),
            guard.eq(Mux(top, product[23], product[22])),
            sticky.eq(Mux(top, product[0:23] != 0, product[0:22] != 0)),
        ]
        mant_r, carry = round_nearest_even(m, kept, guard, sticky, "mul")
        exp_post, overflow = rounded_exponent(m, exp_pre, carry, "mul")

        with m.If(p.special == 1):
            m.d.comb += self.o.eq(NAN32)
        with m.Elif(p.special == 2):
            m.d.comb += self.o.eq(Cat(Const(0, 23), Const(_EXP_MAX, 8), sign))
        with m.Elif((p.special == 3) | (exp_pre <= 0)):
            # Zero operand (incl. DAZ) or an exact product below 2^-126 (FTZ).
            m.d.comb += self.o.eq(Cat(Const(0, 31), sign))
        with m.Elif(overflow):
            m.d.comb += self.o.eq(Cat(Const(0, 23), Const(_EXP_MAX, 8), sign))
        with m.Else():
            m.d.comb += self.o.eq(Cat(mant_r[0:23], exp_post[0:8], sign))
        return m


# ---------------------------------------------------------------- FP16 MAC
class Fp16Mac(_Pipelined):
    """FP16 x FP16 -> FP32 multiply-accumulate, one rounding (``latency`` cycles).

    Bit-exact with ``numerics.mac``: ``add32(acc, fp16(a) * fp16(b))`` with
    the product exact.

    Datapath::

        a (fp16) ─ unpack (subnormals kept) ─┐  11 x 11
                                             ├─ x ─► P (22 b) ─ LZC ─ << ─► exact binary32
        b (fp16) ─ unpack ───────────────────┘  biased exp = p + max(e_a,1) + max(e_b,1) + 77
                                                (79 .. 158: always normal)
                                                               │
        acc ───────────────────────────────────────────────────┴─ Fp32AddSub ─► o

    An fp16 value is ``sig * 2^(max(e, 1) - 25)`` with ``sig`` the 11-bit
    significand (hidden bit = ``e != 0``).  The product ``P = sig_a * sig_b``
    has its leading one at bit ``p`` (0..21); as a binary32 value its
    exponent is ``p + max(e_a,1) + max(e_b,1) - 50``, between -48 and 31, so
    it is exact and normal and the adder's DAZ never touches it.

    Ports
    -----
    acc : In(32)
        binary32 accumulator.
    a, b : In(16)
        binary16 operands.
    o : Out(32)
        ``acc + a*b`` rounded once (RNE, FTZ): ``a``, ``b`` of ``latency``
        cycles ago, ``acc`` of ``latency - acc_delay`` cycles ago.

    Parameters
    ----------
    latency : int
        0..5 (``PLANS``); ValueError otherwise.

    Notes
    -----
    Inf x 0 and NaN operands give a NaN product and o = 0x7FC00000.
    """

    acc: In(32)
    a: In(16)
    b: In(16)
    o: Out(32)

    #: register boundaries: after the 11 x 11 multiply, after the product's
    #: normalisation (then the adder's own)
    BOUNDARIES = ("mult", "product") + Fp32AddSub.BOUNDARIES
    PLANS = {0: (), 1: ("product",), 2: ("product", "add"), 3: ("product", "swap", "norm"),
             4: ("product",) + Fp32AddSub.PLANS[3], 5: ("mult", "product") + Fp32AddSub.PLANS[3]}

    def __init__(self, latency: int = 0):
        super().__init__(latency)
        #: cycles after ``a``/``b`` in which ``acc`` is read: the accumulator
        #: enters at the adder, so the accumulation recurrence is the adder's
        #: latency, not the MAC's
        self.acc_delay = len(self._stages.cuts & {"mult", "product"})

    def elaborate(self, platform):
        m = Module()
        m.submodules.adder = adder = Fp32AddSub(self.latency - self.acc_delay)

        def unpack16(bits, name):
            exp = bits[10:15]
            frac = bits[0:10]
            sig = Signal(11, name=f"{name}_sig")
            exp_eff = Signal(5, name=f"{name}_exp_eff")   # max(e, 1): subnormals share e = 1
            is_zero = Signal(name=f"{name}_is_zero")
            is_inf = Signal(name=f"{name}_is_inf")
            is_nan = Signal(name=f"{name}_is_nan")
            m.d.comb += [
                sig.eq(Cat(frac, exp != 0)),
                exp_eff.eq(Mux(exp == 0, 1, exp)),
                is_zero.eq((exp == 0) & (frac == 0)),
                is_inf.eq((exp == 0x1F) & (frac == 0)),
                is_nan.eq((exp == 0x1F) & (frac != 0)),
            ]
            return sig, exp_eff, is_zero, is_inf, is_nan

        a_sig, a_exp, a_zero, a_inf, a_nan = unpack16(self.a, "a16")
        b_sig, b_exp, b_zero, b_inf, b_nan = unpack16(self.b, "b16")

        # --- exact product and its normalisation to a 24-bit significand
        special = Signal(2)                           # 0 none, 1 NaN, 2 Inf, 3 (no special)
        m.d.comb += special.eq(Mux(a_nan | b_nan | (a_inf & b_zero) | (a_zero & b_inf), 1,
                                   Mux(a_inf | b_inf, 2, 0)))
        q = self._stages.cut(m, "mult", special=special, sign=self.a[15] ^ self.b[15],
                             exp_sum=a_exp + b_exp, product=a_sig * b_sig)
        product = Signal(22)
        m.d.comb += product.eq(q.product)
        lz = leading_zeros(m, product, "prod")        # 0..21 for a non-zero product
        normed = Signal(22)
        prod_exp = Signal(8)                          # biased binary32 exponent, 79..158
        m.d.comb += [
            normed.eq(product << lz),                 # leading one now at bit 21
            # value = P * 2^(ea + eb - 50), leading one at 21 - lz:
            # biased exponent = (21 - lz) + ea + eb - 50 + 127
            prod_exp.eq(q.exp_sum + 98 - lz),
        ]
        prod_bits = Signal(32)
        with m.If(q.special == 1):
            m.d.comb += prod_bits.eq(NAN32)
        with m.Elif(q.special == 2):
            m.d.comb += prod_bits.eq(Cat(Const(0, 23), Const(_EXP_MAX, 8), q.sign))
        with m.Elif(product == 0):
            m.d.comb += prod_bits.eq(Cat(Const(0, 31), q.sign))
        with m.Else():
            # 21 bits below the leading one + 2 zero bits = 23 fraction bits (exact).
            m.d.comb += prod_bits.eq(Cat(Const(0, 2), normed[0:21], prod_exp, q.sign))

        p = self._stages.cut(m, "product", prod_bits=prod_bits)
        m.d.comb += [
            adder.a.eq(self.acc),
            adder.b.eq(p.prod_bits),
            adder.sub.eq(0),
            self.o.eq(adder.o),
        ]
        return m


# ---------------------------------------------------------------- max
class Fp32Max(wiring.Component):
    """The larger of two binary32 bit patterns in the total order (combinational).

    Bit-exact with ``numerics.max32``: patterns are ordered as
    ``-NaN < -Inf < ... < -0 < +0 < ... < +Inf < +NaN``; on equal patterns
    ``a`` is returned.  No canonicalisation: the output is one of the inputs.

    Datapath::

        sign_a != sign_b :  the positive one
        both positive    :  larger 31-bit magnitude field
        both negative    :  smaller 31-bit magnitude field

    Ports
    -----
    a, b : In(32)
    o : Out(32)
    """

    a: In(32)
    b: In(32)
    o: Out(32)

    def elaborate(self, platform):
        m = Module()
        a_sign, b_sign = self.a[31], self.b[31]
        a_mag, b_mag = self.a[0:31], self.b[0:31]
        pick_b = Signal()
        with m.If(a_sign != b_sign):
            m.d.comb += pick_b.eq(a_sign)                 # b is the positive one
        with m.Elif(a_sign == 0):
            m.d.comb += pick_b.eq(b_mag > a_mag)
        with m.Else():
            m.d.comb += pick_b.eq(b_mag < a_mag)
        m.d.comb += self.o.eq(Mux(pick_b, self.b, self.a))
        return m


# ---------------------------------------------------------------- exp2
_EXP2_SLOPES = [int(EXP2_TABLE[i + 1] - EXP2_TABLE[i]) for i in range(1 << EXP2_INDEX_BITS)]
_EXP2_BASE = [int(EXP2_TABLE[i]) for i in range(1 << EXP2_INDEX_BITS)]
_EXP2_BASE_BITS = 24
_EXP2_SLOPE_BITS = max(_EXP2_SLOPES).bit_length()          # 16


class Exp2(_Pipelined):
    """2^x for x <= 0 by table lookup and linear interpolation (``latency`` cycles).

    Bit-exact with ``numerics.exp2_bits``.  Measured error vs float64 2^x on
    [-126, 0] (exhaustively over every binary32 input, ``tb/unit/test_fpu.py``):
    at most 1.02e-6 relative (worst at x = -0.21289073).  The parts: the
    linear interpolation error of the chord, up to (ln 2)^2 / 8 / 256^2 =
    9.2e-7 in the middle of a table interval, the table entries' rounding
    (2^-24) and the truncating ``>> 15`` (up to 2^-23); for |x| < 1 the input
    truncation to 23 fraction bits adds up to ln 2 x 2^-23 = 8.3e-8.  On
    [-126, -1] the maximum is 9.63e-7.

    Datapath::

        x ─ unpack ─ M (24 b) ─ shift by e-127 (left <= 6 / right) ─► Y = floor(|x| 2^23)
          ─ X = -Y (two's complement, 23 fraction bits)
          ─ n = X >> 23 (integer part, floor)   f = X[22:0]
                        i = f[22:15] ─ ROM (256 x {T[i], T[i+1]-T[i]})
                        t = f[14:0]  ─ slope x t >> 15 ─ + T[i] ─► mant (24 b, hidden bit set)
          ─ o = {0, n + 127, mant[22:0]}
        overrides: NaN -> 0x7FC00000; x >= +0 (sign 0, also +Inf) or x = -0 or
        subnormal -> 1.0; |x| >= 128 (also -Inf) -> +0; n < -126 -> +0 (FTZ)

    The ROM is an ``amaranth.lib.memory.Memory`` with an asynchronous read
    port (a LUT ROM after synthesis); T[i] and the slope are derived from
    ``numerics.EXP2_TABLE`` when the module is built.

    Ports
    -----
    x : In(32)
        binary32 exponent (the unit's domain is x <= 0).
    o : Out(32)
        binary32 2^x of the ``x`` of ``latency`` cycles ago.

    Parameters
    ----------
    latency : int
        0..2 (``PLANS``); ValueError otherwise.
    """

    x: In(32)
    o: Out(32)

    #: register boundaries: after the table read, after the slope multiply
    BOUNDARIES = ("lookup", "interp")
    PLANS = {0: (), 1: ("lookup",), 2: ("lookup", "interp")}

    def elaborate(self, platform):
        m = Module()
        st = self._stages
        sign = self.x[31]
        exp = self.x[23:31]
        frac = self.x[0:23]
        is_nan = Signal()
        is_zero = Signal()
        too_small = Signal()
        m.d.comb += [
            is_nan.eq((exp == _EXP_MAX) & (frac != 0)),
            is_zero.eq(exp == 0),                          # +-0 and subnormals
            too_small.eq(exp >= _BIAS + 7),                # |x| >= 128, also -Inf
        ]

        # --- fixed point: Y = floor(|x| * 2^23) (truncation), X = -Y
        mant = Signal(24)
        left = Signal(3)                                   # exponent 0..6: shift left
        right = Signal(5)                                  # exponent < 0: shift right (>= 24 gives 0)
        fixed = Signal(30)                                 # Y, |x| < 128 so 7 + 23 bits
        fixed_neg = Signal(signed(32))                     # X
        m.d.comb += [
            mant.eq(Cat(frac, 1)),
            left.eq(Mux(exp >= _BIAS, exp - _BIAS, 0)),
            right.eq(Mux(exp >= _BIAS, 0, Mux(exp < _BIAS - 31, 31, _BIAS - exp))),
            fixed.eq(Mux(exp >= _BIAS, mant << left, mant >> right)),
            fixed_neg.eq(-fixed),
        ]
        int_part = Signal(signed(9))                       # n = floor(X / 2^23), -128..0
        frac_part = Signal(EXP2_FRAC_BITS)                 # f
        index = Signal(EXP2_INDEX_BITS)                    # i
        interp = Signal(EXP2_INTERP_BITS)                  # t
        m.d.comb += [
            int_part.eq(fixed_neg[EXP2_FRAC_BITS:32].as_signed()),
            frac_part.eq(fixed_neg[0:EXP2_FRAC_BITS]),
            index.eq(frac_part[EXP2_INTERP_BITS:]),
            interp.eq(frac_part[0:EXP2_INTERP_BITS]),
        ]

        # --- table lookup: one ROM word holds {slope, base}
        word_bits = _EXP2_BASE_BITS + _EXP2_SLOPE_BITS
        m.submodules.rom = rom = Memory(
            shape=unsigned(word_bits), depth=1 << EXP2_INDEX_BITS,
            init=[b | (s << _EXP2_BASE_BITS) for b, s in zip(_EXP2_BASE, _EXP2_SLOPES)])
        rom_rd = rom.read_port(domain="comb")
        base = Signal(_EXP2_BASE_BITS)
        slope = Signal(_EXP2_SLOPE_BITS)
        m.d.comb += [
            rom_rd.addr.eq(index),
            base.eq(rom_rd.data[0:_EXP2_BASE_BITS]),
            slope.eq(rom_rd.data[_EXP2_BASE_BITS:word_bits]),
        ]
        # the overrides, decided from the input
        override = Signal(2)                               # 0 none, 1 NaN, 2 one, 3 zero
        m.d.comb += override.eq(Mux(is_nan, 1, Mux(is_zero | (sign == 0), 2,
                                                   Mux(too_small | (int_part < -126), 3, 0))))
        p = st.cut(m, "lookup", override=override, base=base, slope=slope, interp=interp,
                   result_exp=(int_part + _BIAS)[0:8])

        # --- linear interpolation: mant = T[i] + ((T[i+1] - T[i]) * t >> 15)
        slope_t = Signal(_EXP2_SLOPE_BITS + EXP2_INTERP_BITS)
        m.d.comb += slope_t.eq(p.slope * p.interp)
        p = st.cut(m, "interp", override=p.override, base=p.base, result_exp=p.result_exp,
                   slope_t=slope_t)
        result_mant = Signal(24)                           # in [2^23, 2^24)
        m.d.comb += result_mant.eq(p.base + (p.slope_t >> EXP2_INTERP_BITS))

        with m.If(p.override == 1):
            m.d.comb += self.o.eq(NAN32)
        with m.Elif(p.override == 2):
            m.d.comb += self.o.eq(ONE32)
        with m.Elif(p.override == 3):
            m.d.comb += self.o.eq(0)                        # underflow: +0 (FTZ)
        with m.Else():
            m.d.comb += self.o.eq(Cat(result_mant[0:23], p.result_exp, 0))
        return m


# ---------------------------------------------------------------- fp32 -> fp16
class Fp32ToFp16(_Pipelined):
    """binary32 -> binary16 conversion, RNE, binary16 subnormals kept
    (``latency`` cycles, default 0).

    Bit-exact with ``numerics.to_fp16`` (NaN gives 0x7E00 here; the golden
    function may keep a payload, both are NaN).

    Datapath::

        h = e - 112 (binary16 biased exponent)
        normal    (h >= 1):  shift = 13          pre = ((h - 1) << 10) + kept
        subnormal (h <= 0):  shift = 14 - h      pre = kept
                             (clamped to 26: everything below the guard bit)
        kept, G, S = M >> shift, next bit, OR of the rest   (M: 24-bit significand)
        o = sign | min(pre + RNE(G, S), 0x7C00)

    A rounding carry walks from the fraction into the exponent field on its
    own: the largest subnormal rounds up to the smallest normal, and 65520 and
    above round up to 0x7C00 (Inf).

    Ports
    -----
    a : In(32)
        binary32 value (binary32 subnormals are below half the smallest
        binary16 subnormal and give a signed zero).
    o : Out(16)
        binary16 result of the ``a`` of ``latency`` cycles ago.

    Parameters
    ----------
    latency : int
        0 or 1 (``PLANS``); ValueError otherwise.
    """

    a: In(32)
    o: Out(16)

    #: register boundary: after the alignment shift
    BOUNDARIES = ("shift",)
    PLANS = {0: (), 1: ("shift",)}

    def elaborate(self, platform):
        m = Module()
        sign = self.a[31]
        exp = self.a[23:31]
        frac = self.a[0:23]
        half_exp = Signal(signed(10))
        is_normal16 = Signal()
        shift = Signal(range(27))
        m.d.comb += [
            half_exp.eq(exp - 112),
            is_normal16.eq(half_exp >= 1),
            shift.eq(Mux(is_normal16, 13, Mux(half_exp < -12, 26, 14 - half_exp))),
        ]
        # The significand at bits [49:26] of a 50-bit field, shifted right:
        # [49:26] kept, [25] guard, [24:0] sticky.
        shifted = Signal(50)
        m.d.comb += shifted.eq(Cat(Const(0, 26), frac, exp != 0) >> shift)
        overflow = Signal()                                # NaN, Inf or beyond binary16 before rounding
        m.d.comb += overflow.eq((exp == _EXP_MAX) | (half_exp >= 31))
        p = self._stages.cut(m, "shift", sign=sign, nan=(exp == _EXP_MAX) & (frac != 0),
                             overflow=overflow, is_normal16=is_normal16, half_exp=half_exp,
                             kept=shifted[26:37], guard=shifted[25], sticky=shifted[0:25] != 0)
        kept_r, carry = round_nearest_even(m, p.kept, p.guard, p.sticky, "cvt")
        rounded = Signal(12)
        pre = Signal(16)
        packed = Signal(16)
        m.d.comb += [
            rounded.eq(Cat(kept_r, carry)),
            # Normal: the hidden bit (bit 10 of kept) adds the final 1 to h - 1.
            pre.eq(Mux(p.is_normal16, ((p.half_exp - 1) << 10)[0:16], 0)),
            packed.eq(pre + rounded),
        ]
        with m.If(p.nan):
            m.d.comb += self.o.eq(NAN16)
        with m.Elif(p.overflow | (packed >= 0x7C00)):
            m.d.comb += self.o.eq(Cat(Const(0x7C00, 15), p.sign))   # Inf and overflow
        with m.Else():
            m.d.comb += self.o.eq(Cat(packed[0:15], p.sign))
        return m


# ---------------------------------------------------------------- reciprocal
class Recip(wiring.Component):
    """Correctly rounded binary32 reciprocal, radix-2 restoring divider.

    Bit-exact with ``numerics.recip32`` (RNE, DAZ/FTZ); measured error vs
    float64 1/x: at most 0.5 ulp (``tb/unit/test_fpu.py``), i.e. correctly rounded.

    Datapath and timing::

        cycle 0          start = 1: latch D = 1.f (24 b), R = 2^24 (= 2.0),
                         the result sign/exponent and the special class
        cycles 1 .. 25   one quotient bit per cycle (restoring):
                             q = R >= D;  R = (R - q D) << 1;  Q = Q << 1 | q
                         Q = floor(2^48 / D), read as q0.q1...q24 = 2/1.f in (1, 2)
        cycle 26         RNE on Q[24:1] with guard Q[0] and sticky R != 0,
                         pack -> o (registered), done = 1 in cycle 27

    For x = (-1)^s 1.f 2^E with f != 0 the result is (2/1.f) 2^(-E-1), biased
    exponent 253 - e; for f = 0 it is exactly 2^-E (biased 254 - e, the
    divider result is ignored).  A result exponent below 1 is flushed to a
    signed zero: for e = 253, f != 0 the quotient is at most 2 - 2^-22 + 2^-45,
    which does not round to 2^-126 even at subnormal precision, so flushing
    before rounding matches the golden FTZ-after-rounding.  Special inputs:
    NaN -> 0x7FC00000, +-Inf -> +-0, +-0 and subnormals (DAZ) -> +-Inf.

    Ports
    -----
    start : In(1)
        Sampled every cycle; 1 latches ``x`` and (re)starts the division, also
        while busy (the running division is abandoned).
    x : In(32)
        binary32 operand, sampled in the start cycle.
    busy : Out(1)
        1 in cycles 1 .. LATENCY-1 after a start.
    done : Out(1)
        One-cycle pulse in cycle LATENCY after the start cycle (cycle 0).
    done_next : Out(1)
        ``done`` in the next cycle (1 in cycle LATENCY - 1 unless a new start
        abandons the division), for consumers one register stage ahead.
    o : Out(32)
        binary32 1/x, valid from the done cycle; holds until the next result.

    Attributes
    ----------
    LATENCY : int
        Cycles from the start cycle to the done cycle (27).
    """

    ITERATIONS = 25                  # quotient bits q0..q24
    LATENCY = ITERATIONS + 2

    start: In(1)
    x: In(32)
    busy: Out(1)
    done: Out(1)
    done_next: Out(1)
    o: Out(32)

    # special classes of the latched operand
    _NORMAL, _POW2, _ZERO, _INF, _NAN = range(5)

    def elaborate(self, platform):
        m = Module()
        ux = _Unpacked32(m, self.x, "x")

        # --- operand class decided in the start cycle
        cls = Signal(range(5))
        with m.If(ux.is_nan):
            m.d.comb += cls.eq(self._NAN)
        with m.Elif(ux.is_zero):
            m.d.comb += cls.eq(self._INF)                 # 1/+-0 (and DAZ) = +-Inf
        with m.Elif(ux.is_inf | (ux.exp >= 254) | ((ux.exp == 253) & (ux.frac != 0))):
            m.d.comb += cls.eq(self._ZERO)                # 1/+-Inf, or FTZ of a result < 2^-126
        with m.Elif(ux.frac == 0):
            m.d.comb += cls.eq(self._POW2)
        with m.Else():
            m.d.comb += cls.eq(self._NORMAL)
        res_exp_in = Signal(8)
        m.d.comb += res_exp_in.eq(Mux(ux.frac == 0, 254 - ux.exp, 253 - ux.exp))

        # --- state
        r_sign = Signal()
        r_exp = Signal(8)
        r_cls = Signal(range(5))
        divisor = Signal(24)
        remainder = Signal(25)          # R < 2 D <= 2^25 - 2
        quotient = Signal(self.ITERATIONS)
        count = Signal(range(self.ITERATIONS + 2))   # iterations left + the rounding cycle
        finish = Signal()

        # --- one restoring step
        diff = Signal(26)
        q_bit = Signal()
        m.d.comb += [
            diff.eq(remainder - divisor),
            q_bit.eq(~diff[25]),                        # R >= D (no borrow)
        ]

        # --- rounding of the finished quotient
        mant_r, carry = round_nearest_even(
            m, quotient[1:25], quotient[0], remainder != 0, "recip")
        packed = Signal(32)
        with m.Switch(r_cls):
            with m.Case(self._NAN):
                m.d.comb += packed.eq(NAN32)
            with m.Case(self._INF):
                m.d.comb += packed.eq(Cat(Const(0, 23), Const(_EXP_MAX, 8), r_sign))
            with m.Case(self._ZERO):
                m.d.comb += packed.eq(Cat(Const(0, 31), r_sign))
            with m.Case(self._POW2):
                m.d.comb += packed.eq(Cat(Const(0, 23), r_exp, r_sign))
            with m.Default():
                # A carry out of the rounding cannot happen (Q <= 2 - 2^-22 +
                # 2^-45 truncates to 1.11..10), but is honoured for safety.
                m.d.comb += packed.eq(Cat(mant_r[0:23], (r_exp + carry)[0:8], r_sign))

        m.d.comb += [
            self.busy.eq(count != 0),
            finish.eq(count == 1),
            self.done_next.eq(finish & ~self.start),
        ]
        m.d.sync += self.done.eq(0)
        with m.If(self.start):
            m.d.sync += [
                r_sign.eq(ux.sign),
                r_exp.eq(res_exp_in),
                r_cls.eq(cls),
                divisor.eq(ux.mant),
                remainder.eq(1 << 24),
                quotient.eq(0),
                count.eq(self.ITERATIONS + 1),
            ]
        with m.Elif(finish):
            m.d.sync += [
                self.o.eq(packed),
                self.done.eq(1),
                count.eq(0),
            ]
        with m.Elif(self.busy):
            m.d.sync += [
                quotient.eq(Cat(q_bit, quotient[0:self.ITERATIONS - 1])),
                remainder.eq(Mux(q_bit, diff[0:24], remainder[0:24]) << 1),
                count.eq(count - 1),
            ]
        return m


#: The latency (cycles) at which the pipelined design uses each unit: the
#: smallest that keeps every stage within 40 generic gate levels, measured by
#: ``flashnpu depth`` (``results/depth.md``).  ``Fp32Max`` (15 levels) and the
#: sequential ``Recip`` stay as they are.
DESIGN_LATENCY = {Fp16Mac: 5, Fp32AddSub: 3, Fp32Mul: 2, Exp2: 2, Fp32ToFp16: 1, Fp32Max: 0, Recip: 0}
