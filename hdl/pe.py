"""The processing element: one FP16 MAC per cycle, a 64 x 32-bit register
file and the few binary32 units its share of the online softmax needs.

Design trade-off
----------------
The PE is a tiny SIMD lane.  It has no program of its own: every cycle the
tile sequencer broadcasts one control word (``Ctl``: opcode + register
addresses) to all R x C PEs, and each PE applies it to its own registers and
operands.  Keeping control out of the PE makes it small and lets the Verilog
of one PE be generated once and instantiated R x C times (see ``array``).

The register file is an ``amaranth.lib.memory.Memory`` (64 x 32 bit) with
three read ports and one write port:

* two asynchronous ports (A, B) feed the arithmetic: ops such as
  ``l = alpha * l + rowsum`` and ``O = alpha * O`` read two registers in the
  cycle they write one, so the one-op-per-cycle rule needs two reads;
* one synchronous port (S) with its own address is the PE's outward window:
  during P.V it reads the P operand of the *next* step (the row broadcast
  register), and otherwise it serves the O read-out stream and the debug
  port.  It is transparent to the write port, so a read in the cycle of a
  write returns the new value.

A Memory becomes a plain Verilog array (the toolchain notes measured 23x
less Verilog than an Array of Signals), and a register file is what an ASIC
would build here (a 2R1W latch array).

Per PE the units are: one ``Fp16Mac`` (S = Q.K and O += P.V, and the row-sum
fold, which adds an FP16 P as ``P x 1.0``), one ``Fp32Mul``, one
``Fp32AddSub``, one ``Fp32Max``, one ``Exp2`` and one ``Fp32ToFp16``,
time-multiplexed by the opcode.  Two 32-bit temporaries: ``T`` (the fold
accumulator that feeds the row-reduction tree) and ``U`` (m_new of the row
being exponentiated).

Dataflow::

        a16 (row bus: Q or P) ──┐      b16 (column bus: K or V)
                                ▼        ▼
     ┌────────── RF 64x32 ──A──► Fp16Mac ─┐
     │   sa ─► S port ─► sd     B  Fp32Mul ├──► wdata ─► RF[wa]
     │                          ├► AddSub ─┤
     │  ret (row tree / recip) ─┼► Max     │
     │  cst (score constant) ───┘  Exp2 ─► ToFp16
     │                        T ──────────────────► t (tree leaf / recip operand)
     └─ U (m_new)

Timing: the control word and the operands of a step arrive in the same
cycle; register-file writes land at the end of that cycle (1 op / cycle).
The softmax ops chain up to four units combinationally (e.g. sub -> exp2 ->
to_fp16 -> MAC); a synthesised design would split them over two or three
cycles, adding about a dozen cycles per kv tile to the ~25-cycle softmax.
"""

from __future__ import annotations

import enum

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .fpu import ONE32, Exp2, Fp16Mac, Fp32AddSub, Fp32Max, Fp32Mul, Fp32ToFp16

__all__ = ["PeOp", "TreeOp", "ctl_layout", "RegMap", "Pe", "NEG_INF32", "ONE16"]

NEG_INF32 = 0xFF800000
ONE16 = 0x3C00


class PeOp(enum.IntEnum):
    """Opcodes of the PE control word (written once; used by the sequencer
    programs, the PE decoder and the tests).

    ``A``/``B`` are the registers at ``ra``/``rb``; ``ret`` is the row's
    returned reduction/reciprocal value selected by ``ret_sel``."""
    NOP = 0
    MAC = 1      # RF[wa] = mac(first ? +0 : A, a16, b16); no write if skipz and a16 == +-0
    SCALE = 2    # RF[wa] = vis ? mul32(A, cst) : -inf;  T = first ? that : max32(T, that)
    MALPHA = 3   # U = max32(A, ret) (m_new); RF[wa] = U == -inf ? 1 : exp2(sub32(A, U))
    PEXP = 4     # p = U == -inf ? 0 : to_fp16(exp2(sub32(A, U))); RF[wa] = p; T = mac(first ? 0 : T, p, 1.0)
    MSET = 5     # RF[wa] = U
    LUPD = 6     # RF[wa] = add32(mul32(A, B), ret)
    RESC = 7     # RF[wa] = mul32(A, B)
    LOADT = 8    # T = A
    FINAL = 9    # RF[wa] = B == +-0 ? +0 : mul32(A, ret)
    SETZ = 10    # RF[wa] = +0
    SETNI = 11   # RF[wa] = -inf


class TreeOp(enum.IntEnum):
    """What the row-reduction tree does with the PEs' ``T`` this cycle."""
    NONE = 0
    MAX = 1
    SUM = 2


def _bits(n: int) -> int:
    return max(1, (n - 1).bit_length())


def ctl_layout(config: NPUConfig) -> data.StructLayout:
    """The control word broadcast to every PE each cycle.

    Fields: ``op`` (PeOp), ``ra``/``rb``/``wa`` register addresses, ``first``
    (start a fold / zero accumulator), ``skipz`` (skip the write when the
    row operand is zero: P.V), ``pv`` (row/column buses carry P/V instead of
    Q/K), ``ret_sel`` (which returned value the PE sees), ``tree`` + ``tag``
    (inject every PE's T into the row trees, result stored under ``tag``),
    ``rcp`` (start each row's reciprocal on PE(r, 0)'s T, result under
    ``tag``).
    """
    rb = _bits(config.pe_registers)
    tb = _bits(3 * config.rows_per_pe)
    return data.StructLayout({
        "op": PeOp, "ra": rb, "rb": rb, "wa": rb, "first": 1, "skipz": 1, "pv": 1,
        "ret_sel": tb, "tree": TreeOp, "tag": tb, "rcp": 1,
    })


class RegMap:
    """Register allocation of one PE (compile time, from the configuration).

    ====================  ===================================  =============
    registers             meaning                              count
    ====================  ===================================  =============
    ``S(a, b)``           S / P of row wr*r+a, column wc*c+b   wr * wc
    ``O(a, n)``           O_acc of row a, column od*c+n        wr * od_max
    ``M(a)``, ``L(a)``    m_i, l_i of row a                    2 wr
    ``ALPHA(a)``          alpha of row a (last kv tile)        wr
    ====================  ===================================  =============

    P is stored in place of S as a zero-extended FP16 pattern.
    Return tags (``ret_sel``/``tag``): row max of row a -> ``a``, row sum ->
    ``wr + a``, reciprocal -> ``2 wr + a``.
    """

    def __init__(self, config: NPUConfig):
        self.wr = config.rows_per_pe
        self.wc = config.cols_per_pe
        self.od = config.o_cols_per_pe(config.max_head_dim)
        need = config.registers_needed(config.max_head_dim)
        if need > config.pe_registers:
            raise ValueError(f"the PE needs {need} registers but pe_registers={config.pe_registers}")
        self.o_base = self.wr * self.wc
        self.m_base = self.o_base + self.wr * self.od
        self.l_base = self.m_base + self.wr
        self.alpha_base = self.l_base + self.wr
        self.used = self.alpha_base + self.wr

    def S(self, a, b):
        return a * self.wc + b

    def O(self, a, n):
        return self.o_base + a * self.od + n

    def M(self, a):
        return self.m_base + a

    def L(self, a):
        return self.l_base + a

    def ALPHA(self, a):
        return self.alpha_base + a

    def tag_max(self, a):
        return a

    def tag_sum(self, a):
        return self.wr + a

    def tag_rcp(self, a):
        return 2 * self.wr + a


class Pe(wiring.Component):
    """One processing element (see the module docstring).

    Parameters
    ----------
    config : NPUConfig
        Sets the register count and the control-word layout.

    Ports
    -----
    ctl : In(ctl_layout(config))
        Control word of this cycle (same for every PE).
    a16 : In(16)
        Row broadcast operand (Q[i, k] in the S phase, P[i, k] in P.V).
    b16 : In(16)
        Column operand (K[j, k] in the S phase, V[k, col] in P.V).
    cst : In(32)
        The score constant c = fp32(scale * log2 e), binary32.
    vis : In(1)
        1 when the score this SCALE op touches is visible (else -> -inf).
    ret : In(32)
        The row's returned value (row max, row sum or 1/l) chosen by
        ``ctl.ret_sel``.
    sa : In(log2 regs)
        Address of the synchronous read port.
    sd : Out(32)
        Register ``sa`` of the previous cycle (1-cycle latency).
    t : Out(32)
        The T temporary: leaf of the row-reduction tree, operand of the
        row's reciprocal unit.
    pnz : Out(1)
        1 the cycle after a PEXP op wrote a non-zero P (registered): the
        array counts them for the S-tile check (``hdl/s_check.py``).
    """

    def __init__(self, config: NPUConfig):
        self.config = config
        self.regs = RegMap(config)
        ab = _bits(config.pe_registers)
        super().__init__({
            "ctl": In(ctl_layout(config)),
            "a16": In(16), "b16": In(16), "cst": In(32), "vis": In(1), "ret": In(32),
            "sa": In(ab), "sd": Out(32), "t": Out(32), "pnz": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        ctl = self.ctl
        m.submodules.rf = rf = Memory(shape=32, depth=self.config.pe_registers, init=[])
        wp = rf.write_port()
        rpa = rf.read_port(domain="comb")
        rpb = rf.read_port(domain="comb")
        rps = rf.read_port(domain="sync", transparent_for=(wp,))
        m.submodules.mac = mac = Fp16Mac()
        m.submodules.mul = mul = Fp32Mul()
        m.submodules.add = add = Fp32AddSub()
        m.submodules.mx = mx = Fp32Max()
        m.submodules.ex = ex = Exp2()
        m.submodules.cv = cv = Fp32ToFp16()

        T = Signal(32)
        U = Signal(32)
        A = rpa.data
        B = rpb.data
        m.d.comb += [
            rpa.addr.eq(ctl.ra), rpb.addr.eq(ctl.rb),
            rps.addr.eq(self.sa), self.sd.eq(rps.data),
            wp.addr.eq(ctl.wa),
            self.t.eq(T),
        ]
        wdata = wp.data
        we = wp.en

        # Operand steering: defaults keep the unit inputs stable (no toggling
        # in NOP cycles); each op overrides what it uses.
        m.d.comb += [
            mac.acc.eq(Mux(ctl.first, 0, A)), mac.a.eq(self.a16), mac.b.eq(self.b16),
            mul.a.eq(A), mul.b.eq(B),
            add.a.eq(A), add.b.eq(U), add.sub.eq(1),
            mx.a.eq(A), mx.b.eq(self.ret),
            ex.x.eq(add.o),
            cv.a.eq(ex.o),
        ]
        u_empty = U == NEG_INF32
        p_new = Signal(16)                   # PEXP's P: 0 for a row without a visible key
        m.d.comb += p_new.eq(Mux(u_empty, 0, cv.o))
        m.d.sync += self.pnz.eq((ctl.op == PeOp.PEXP) & (p_new[0:15] != 0))
        with m.Switch(ctl.op):
            with m.Case(PeOp.MAC):
                m.d.comb += [wdata.eq(mac.o),
                             we.eq(~(ctl.skipz & (self.a16[0:15] == 0)))]
            with m.Case(PeOp.SCALE):
                s = Signal(32)
                m.d.comb += [
                    mul.b.eq(self.cst),
                    s.eq(Mux(self.vis, mul.o, NEG_INF32)),
                    wdata.eq(s), we.eq(1),
                    mx.a.eq(T), mx.b.eq(s),
                ]
                m.d.sync += T.eq(Mux(ctl.first, s, mx.o))
            with m.Case(PeOp.MALPHA):
                mnew = mx.o
                m.d.comb += [
                    add.b.eq(mnew),
                    wdata.eq(Mux(mnew == NEG_INF32, ONE32, ex.o)), we.eq(1),
                ]
                m.d.sync += U.eq(mnew)
            with m.Case(PeOp.PEXP):
                m.d.comb += [
                    wdata.eq(p_new), we.eq(1),
                    mac.acc.eq(Mux(ctl.first, 0, T)), mac.a.eq(p_new), mac.b.eq(ONE16),
                ]
                m.d.sync += T.eq(mac.o)
            with m.Case(PeOp.MSET):
                m.d.comb += [wdata.eq(U), we.eq(1)]
            with m.Case(PeOp.LUPD):
                m.d.comb += [add.a.eq(mul.o), add.b.eq(self.ret), add.sub.eq(0),
                             wdata.eq(add.o), we.eq(1)]
            with m.Case(PeOp.RESC):
                m.d.comb += [wdata.eq(mul.o), we.eq(1)]
            with m.Case(PeOp.LOADT):
                m.d.sync += T.eq(A)
            with m.Case(PeOp.FINAL):
                m.d.comb += [mul.b.eq(self.ret),
                             wdata.eq(Mux(B[0:31] == 0, 0, mul.o)), we.eq(1)]
            with m.Case(PeOp.SETZ):
                m.d.comb += [wdata.eq(0), we.eq(1)]
            with m.Case(PeOp.SETNI):
                m.d.comb += [wdata.eq(NEG_INF32), we.eq(1)]
        return m
