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
three synchronous read ports (data registered after the read mux, made
transparent to the one write port by a bypass): A and B (the op's
``ra``/``rb``, addresses registered in stage E1, data in E2)
and S, the PE's outward window with its own address (the P operand of the
next P.V step, the O read-out stream and the debug port).  A Memory becomes
a plain Verilog array, and a register file is what an ASIC would build here
(a 3R1W latch array).

Per PE the units are: one ``Fp16Mac`` (S = Q.K and O += P.V, and the row-sum
fold, which adds an FP16 P as ``P x 1.0``), one ``Fp32Mul``, one
``Fp32AddSub``, two ``Fp32Max`` (m_new, and the T fold of the row max),
one ``Exp2`` and one ``Fp32ToFp16``, each pipelined at its
``fpu.DESIGN_LATENCY`` and shared by the opcodes in time.  Two 32-bit
temporaries: ``T`` (the fold accumulator that feeds the row-reduction tree)
and ``U`` (m_new of the row being exponentiated).

Pipeline
--------
The control word, the bus operands (a16, b16) and ``vis`` arrive in stage
E0, each from a flop of the PE row's operand stage (``array.PeRow``: two
cycles after the core issues the word); the op's fields travel down a stage pipeline (``st``), and every op
touches each resource in fixed stages (``OP_TIMING``)::

    stage   E0     E1      E2        E3     E4     E5     E6..E9         E10   E11..E16
    MAC     mult   product acc+RF A  swap   add    norm -> RF write (E5)
    SCALE          ra      mul       mul    s      RF, T = max(T, s)
    MALPHA         ra      U=max(A,ret)  sub(A3, U) ... E6 | exp2 E7-E9 -> RF (E10)
    PEXP           ra      sub(A, U) .. E5 | exp2 E6-E8 | to_fp16 E9 -> RF (E10) | T += P (MAC, E11-E16)
    LADD           ra      add(A, ret) .. -> RF (E5)
    RESC/FINAL     ra,rb   mul .. -> RF (E5)
    MSET/SETZ/SETNI        -> RF (E2)          LOADT: T = A (E2)

Every unit's inputs come from flops (register-file data, the pipeline's
own registers, the row's registered ``ret``), and every stage is within
the 40-level budget (``results/depth.md``).  There are no interlocks: the
sequencer issues MACs on ``MAC_RECURRENCE`` (4) or more independent
accumulators, and the softmax, INIT and FINAL programs are scheduled
statically against ``OP_TIMING`` (``hdl/schedule.py``); the core's
register check flags any read that meets a pending write.
"""

from __future__ import annotations

import enum

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .fpu import DESIGN_LATENCY, ONE32, Exp2, Fp16Mac, Fp32AddSub, Fp32Max, Fp32Mul, Fp32ToFp16

__all__ = ["PeOp", "TreeOp", "ctl_layout", "RegMap", "Pe", "NEG_INF32", "ONE16", "OpTiming", "OP_TIMING",
           "PIPE_DEPTH", "MAC_RECURRENCE", "RF_READ_STAGE", "RET_STAGE"]

NEG_INF32 = 0xFF800000
ONE16 = 0x3C00


class PeOp(enum.IntEnum):
    """Opcodes of the PE control word (written once; used by the sequencer
    programs, the PE decoder and the tests).

    ``A``/``B`` are the registers at ``ra``/``rb``; ``ret`` is the row's
    returned reduction/reciprocal value selected by ``ret_sel``."""
    NOP = 0
    MAC = 1      # RF[wa] = mac(first ? +0 : A, a16, b16); no write if ~vis or (skipz
                 # and a16 == +-0); multiplier operands held at 0 if ~vis
    SCALE = 2    # RF[wa] = vis ? mul32(A, cst) : -inf;  T = first ? that : max32(T, that)
    MALPHA = 3   # U = max32(A, ret) (m_new); RF[wa] = U == -inf ? 1 : exp2(sub32(A, U))
    PEXP = 4     # p = U == -inf ? 0 : to_fp16(exp2(sub32(A, U))); RF[wa] = p; T = mac(first ? 0 : T, p, 1.0)
    MSET = 5     # RF[wa] = U
    LADD = 6     # RF[wa] = add32(A, ret)  (l_i = alpha * l_i (RESC) + row sum)
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
    ``S(a, b, 1)``        the second S / P block (from         wr * wc
                          ``s1_base``; ``softmax_overlap``)
    ====================  ===================================  =============

    P is stored in place of S as a zero-extended FP16 pattern.  With
    ``softmax_overlap`` kv tile j uses S block j % 2, so Q.K^T of tile j+1
    can write its block while the softmax of tile j works on the other.
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
        self.overlap = config.overlaps_softmax
        self.s1_base = config.s1_base(config.max_head_dim) if self.overlap else 0
        #: the S blocks the PE has: (0, 1) with ``softmax_overlap``, else (0,)
        self.blocks = (0, 1) if self.overlap else (0,)
        self.used = need

    def S(self, a, b, p=0):
        """Register of S/P element (a, b) in block ``p`` (0, or 1 with
        ``softmax_overlap``)."""
        if p and not self.overlap:
            raise ValueError("the second S block needs softmax_overlap")
        return (self.s1_base if p else 0) + a * self.wc + b

    def s_block(self, p=0):
        """Registers of S block ``p``, row-major (a, b)."""
        return [self.S(a, b, p) for a in range(self.wr) for b in range(self.wc)]

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


# ------------------------------------------------------------------ timing
#: Stage (cycles after the control word reaches the PE, "E0") at which the
#: register file's A and B ports take their addresses; the data follow one
#: cycle later (registered reads, transparent to the write port).
RF_READ_STAGE = 1
#: Stage at which ``ret`` is valid for the op (the PE row registers it).
RET_STAGE = 2


class OpTiming:
    """When an opcode touches each PE resource, in stages after E0.

    ``write``: stage of its register-file write (None: none); ``t_read`` /
    ``t_write``, ``u_read`` / ``u_write``: stages of its reads and writes of
    the T and U temporaries (``t_read`` only when ``first`` is 0);
    ``units``: the stage at which it enters each pipelined unit (a unit
    takes one operand set per cycle).  The tile sequencer's program
    scheduler (``hdl/schedule.py``) and the core's register check read
    this table; ``Pe.elaborate`` implements it.
    """

    def __init__(self, write=None, t_read=(), t_write=None, u_read=(), u_write=None, units=None,
                 ret=False):
        self.write, self.t_read, self.t_write = write, tuple(t_read), t_write
        self.u_read, self.u_write, self.units, self.ret = tuple(u_read), u_write, dict(units or {}), ret

    def last_stage(self, first: bool = False) -> int:
        """The last stage in which the op is still active."""
        stages = [0, *self.units.values(), *(s for s in (self.write, self.t_write, self.u_write)
                                               if s is not None), *self.u_read]
        if not first:
            stages += list(self.t_read)
        return max(stages)


#: Per-op timing of the pipelined PE (see the ``Pe`` docstring's diagram).
OP_TIMING = {
    PeOp.NOP: OpTiming(),
    PeOp.MAC: OpTiming(write=5, units={"mac": 0}),
    PeOp.SCALE: OpTiming(write=5, t_read=(5,), t_write=5, units={"mul": 2, "tmax": 5}),
    PeOp.MALPHA: OpTiming(write=10, u_read=(3,), u_write=2, units={"max": 2, "add": 3, "exp2": 7},
                          ret=True),
    PeOp.PEXP: OpTiming(write=10, t_read=(13,), t_write=16, u_read=(2,),
                        units={"add": 2, "exp2": 6, "to_fp16": 9, "mac": 11}),
    PeOp.MSET: OpTiming(write=2, u_read=(2,)),
    PeOp.LADD: OpTiming(write=5, units={"add": 2}, ret=True),
    PeOp.RESC: OpTiming(write=5, units={"mul": 2}),
    PeOp.LOADT: OpTiming(t_write=2),
    PeOp.FINAL: OpTiming(write=5, units={"mul": 2}, ret=True),
    PeOp.SETZ: OpTiming(write=2),
    PeOp.SETNI: OpTiming(write=2),
}
#: Deepest stage of any op (the PE's pipeline length after E0).
PIPE_DEPTH = max(t.last_stage() for t in OP_TIMING.values())
#: Issue distance (cycles) between two MACs on the same accumulator: the
#: first writes in stage 5, the second reads its address in stage 1.
MAC_RECURRENCE = OP_TIMING[PeOp.MAC].write - RF_READ_STAGE


class Pe(wiring.Component):
    """One processing element (see the module docstring).

    Parameters
    ----------
    config : NPUConfig
        Sets the register count and the control-word layout.

    Ports
    -----
    ctl : In(ctl_layout(config))
        Control word of this cycle, stage E0 (same for every PE).
    a16 : In(16)
        Row broadcast operand (Q[i, k] in the S phase, P[i, k] in P.V), E0.
    b16 : In(16)
        Column operand (K[j, k] in the S phase, V[k, col] in P.V), E0.
    cst : In(32)
        The score constant c = fp32(scale * log2 e), binary32 (static).
    vis : In(1)
        1 when the (query, key) position of this op is visible, E0: SCALE
        writes -inf where it is 0, and a MAC there is skipped (Q.K: the S
        element's position; P.V: the position of the P on the row bus).
    ret : In(32)
        The row's returned value (row max, row sum or 1/l) chosen by the
        ``ctl.ret_sel`` of the op now in stage ``RET_STAGE`` (E2).
    sa : In(log2 regs)
        Address of the synchronous read port.
    sd : Out(32)
        Register ``sa`` of the previous cycle (1-cycle latency, transparent).
    t : Out(32)
        The T temporary: leaf of the row-reduction tree, operand of the
        row's reciprocal unit.
    pnz : Out(1)
        1 when a PEXP op wrote a non-zero P the cycle before (registered):
        the array counts them for the S-tile check (``hdl/s_check.py``).
    msk : Out(1)
        1 when the op of the cycle before was a MAC at a masked position
        (``vis`` 0; registered): the array sums them for the core's count
        of skipped MAC slots (``Core.ops_masked``).

    Masked work
    -----------
    A MAC at a masked position (``vis`` 0) does not write and feeds the
    multiplier zeros instead of the bus operands (operand isolation from
    the control bit: the multiplier's inputs stay constant over a run of
    masked MACs).  A P.V MAC whose P is +-0 (``skipz``) does not write
    either (a masked P is exactly 0, and 0 x inf must not reach O_acc).
    """

    def __init__(self, config: NPUConfig):
        self.config = config
        self.regs = RegMap(config)
        ab = _bits(config.pe_registers)
        super().__init__({
            "ctl": In(ctl_layout(config)),
            "a16": In(16), "b16": In(16), "cst": In(32), "vis": In(1), "ret": In(32),
            "sa": In(ab), "sd": Out(32), "t": Out(32), "pnz": Out(1), "msk": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        ctl = self.ctl
        ab = _bits(self.config.pe_registers)
        # ``ram_style``: FPGA flows build it from LUT RAM and flip-flops, not
        # block RAM (an ECP5 DP16KD's read register alone has 5.8 ns
        # clock-to-out, the longest path of the placed 2x2 core otherwise)
        m.submodules.rf = rf = Memory(shape=32, depth=self.config.pe_registers, init=[],
                                      attrs={"ram_style": "distributed"})
        wp = rf.write_port()
        # Read ports with the data registered after the read mux, made
        # transparent by a bypass: a read of the register written in the
        # same cycle returns the written value (one registered copy of the
        # write data serves the three ports).
        wd = Signal(32)
        m.d.sync += wd.eq(wp.data)

        def read_port(addr, name):
            port = rf.read_port(domain="sync")
            byp = Signal(name=f"{name}_bypass")
            data = Signal(32, name=f"{name}_data")
            m.d.comb += [port.addr.eq(addr), data.eq(Mux(byp, wd, port.data))]
            m.d.sync += byp.eq(wp.en & (wp.addr == addr))
            return data
        L = DESIGN_LATENCY
        m.submodules.mac = mac = Fp16Mac(L[Fp16Mac])
        m.submodules.mul = mul = Fp32Mul(L[Fp32Mul])
        m.submodules.add = add = Fp32AddSub(L[Fp32AddSub])
        m.submodules.mx = mx = Fp32Max()
        m.submodules.tmx = tmx = Fp32Max()
        m.submodules.ex = ex = Exp2(L[Exp2])
        m.submodules.cv = cv = Fp32ToFp16(L[Fp32ToFp16])
        tm = OP_TIMING
        assert (mac.latency, mul.latency, add.latency, ex.latency, cv.latency, mac.acc_delay) == (
            tm[PeOp.MAC].write, 2, 3, 2, 1, 2), "OP_TIMING assumes these unit latencies"

        # --- the op's control travels down a stage pipeline: st[s] is the op
        # in stage Es.  ``flag`` is the op's E0 data bit: MAC -> no write
        # (masked, or skipz and P == +-0), SCALE -> vis.
        stage = data.StructLayout({"op": PeOp, "wa": ab, "first": 1, "flag": 1})
        n_st = max(t.write or 0 for t in tm.values()) + 1
        st = [Signal(stage, name=f"st{s}") for s in range(n_st)]
        is_mac = ctl.op == PeOp.MAC
        masked = Signal()                  # a MAC at a masked position, E0
        m.d.comb += [masked.eq(is_mac & ~self.vis),
                     st[0].op.eq(ctl.op), st[0].wa.eq(ctl.wa), st[0].first.eq(ctl.first),
                     st[0].flag.eq(Mux(is_mac, masked | (ctl.skipz & (self.a16[0:15] == 0)),
                                       self.vis))]
        m.d.sync += self.msk.eq(masked)
        for s in range(1, n_st):
            m.d.sync += st[s].eq(st[s - 1])
        # PEXP's sum fold runs past the last write stage: only its first bit travels on
        px = {n_st - 1: st[-1].op == PeOp.PEXP}
        pf = {n_st - 1: st[-1].first}
        for s in range(n_st, tm[PeOp.PEXP].t_write + 1):
            px[s], pf[s] = Signal(name=f"pexp{s}"), Signal(name=f"pexp_first{s}")
            m.d.sync += [px[s].eq(px[s - 1]), pf[s].eq(pf[s - 1])]

        def at(s, op):
            return st[s].op == op

        # --- E1: register-file addresses (registered); E2: A, B
        ra1, rb1 = Signal(ab), Signal(ab)
        m.d.sync += [ra1.eq(ctl.ra), rb1.eq(ctl.rb)]
        A2, B2 = read_port(ra1, "rfa"), read_port(rb1, "rfb")
        m.d.comb += self.sd.eq(read_port(self.sa, "rfs"))
        A3 = Signal(32)
        m.d.sync += A3.eq(A2)

        T = Signal(32)
        U = Signal(32)
        m.d.comb += self.t.eq(T)

        # --- units (a unit's inputs are flops; its entry stage is unique per
        # cycle by the sequencer's schedule, so the steering is by stage)
        p10 = Signal(16)                  # PEXP's P (E10)
        p11 = Signal(16)
        m.d.sync += p11.eq(p10)
        m.d.comb += [
            # operand isolation: a masked MAC multiplies zeros
            mac.a.eq(Mux(px[11], p11, Mux(masked, 0, self.a16))),
            mac.b.eq(Mux(px[11], ONE16, Mux(masked, 0, self.b16))),
            mac.acc.eq(Mux(px[13], Mux(pf[13], 0, T), Mux(st[2].first, 0, A2))),
            mul.a.eq(A2),
            mul.b.eq(Mux(at(2, PeOp.SCALE), self.cst, Mux(at(2, PeOp.FINAL), self.ret, B2))),
            add.a.eq(Mux(at(3, PeOp.MALPHA), A3, A2)),
            add.b.eq(Mux(at(2, PeOp.LADD), self.ret, U)),
            add.sub.eq(~at(2, PeOp.LADD)),
            mx.a.eq(A2), mx.b.eq(self.ret),
        ]
        add_r, ex_r = Signal(32), Signal(32)
        m.d.sync += [add_r.eq(add.o), ex_r.eq(ex.o)]
        m.d.comb += [ex.x.eq(add_r), cv.a.eq(ex_r)]
        #: the multiplier's operand inputs, {b, a} (read by the unit tests)
        self.mult_in = Cat(mac.a, mac.b)

        # U: m_new (MALPHA, E2); ``empty`` = m_new == -inf travels with the op
        with m.If(at(2, PeOp.MALPHA)):
            m.d.sync += U.eq(mx.o)
        empty = {2: Signal(name="empty2")}
        m.d.comb += empty[2].eq(Mux(at(2, PeOp.MALPHA), mx.o == NEG_INF32, U == NEG_INF32))
        for s in range(3, tm[PeOp.PEXP].write + 1):
            empty[s] = Signal(name=f"empty{s}")
            m.d.sync += empty[s].eq(empty[s - 1])
        bzero = {2: Signal(name="bzero2")}                # FINAL: l == +-0
        m.d.comb += bzero[2].eq(B2[0:31] == 0)
        for s in (3, 4, 5):
            bzero[s] = Signal(name=f"bzero{s}")
            m.d.sync += bzero[s].eq(bzero[s - 1])
        s4 = Signal(32)                                   # SCALE's score (E4)
        s5 = Signal(32)
        mo5 = Signal(32)                                  # the product, registered (E5)
        m.d.sync += mo5.eq(mul.o)
        m.d.comb += [s4.eq(Mux(st[4].flag, mul.o, NEG_INF32)),
                     p10.eq(Mux(empty[10], 0, cv.o)),
                     tmx.a.eq(T), tmx.b.eq(s5)]
        m.d.sync += s5.eq(s4)

        # T: LOADT (E2), SCALE's max fold (E5), PEXP's sum fold (E16)
        with m.If(at(2, PeOp.LOADT)):
            m.d.sync += T.eq(A2)
        with m.If(at(5, PeOp.SCALE)):
            m.d.sync += T.eq(Mux(st[5].first, s5, tmx.o))
        with m.If(px[16]):
            m.d.sync += T.eq(mac.o)

        # --- the register-file write: the op whose write stage it is (at most
        # one per cycle by the schedule), as an AND-OR of the candidates.  The
        # multiplier's and exp2's results are registered first: their last
        # stages are the deepest (35 and 34 levels), the MAC's and the
        # adder's (30) go straight in.
        cands = [(PeOp.MSET, U, 1), (PeOp.SETZ, 0, 1), (PeOp.SETNI, NEG_INF32, 1),
                 (PeOp.SCALE, s5, 1), (PeOp.RESC, mo5, 1),
                 (PeOp.FINAL, Mux(bzero[5], 0, mo5), 1),
                 (PeOp.MAC, mac.o, ~st[5].flag), (PeOp.LADD, add.o, 1),
                 (PeOp.MALPHA, Mux(empty[10], ONE32, ex_r), 1), (PeOp.PEXP, p10, 1)]
        wdata, waddr, wen = 0, 0, 0
        for op, value, en in cands:
            s = tm[op].write
            hit = Signal(name=f"wr_{op.name.lower()}")
            m.d.comb += hit.eq(at(s, op))
            wdata = wdata | Mux(hit, value, 0)
            waddr = waddr | Mux(hit, st[s].wa, 0)
            wen = wen | (hit & en)
        m.d.comb += [wp.data.eq(wdata), wp.addr.eq(waddr), wp.en.eq(wen)]
        m.d.sync += self.pnz.eq(at(10, PeOp.PEXP) & (p10[0:15] != 0))
        return m
