"""The R x C PE array with its row broadcast buses, the per-row reduction
trees, return registers and reciprocal units.

Design trade-off
----------------
All PEs execute the same control word in the same cycle, and every operand
the array needs in a cycle is a broadcast: Q or P along a PE row (one value
per row), K or V down a PE column (one value per column).  So the array
has no systolic skew: a broadcast costs wire, a systolic mesh costs R + C
cycles of fill/drain per phase and per-PE operand registers.  With only
2 x 2 scores per PE the phases are short (512 cycles), so the skew would
show.  Instead the distribution is pipelined, uniformly: the core drives
the control word, the Q lane of each row, the K/V lane of each column and
the visibility bits from its operand-stage flops, and every PE row
registers all of them once more (the row's operand stage: ``ctl_e0``,
``a16_e0``, ``b16_<c>``, ``vis_e0``) before its PEs see them in their stage
E0.  So the core's lane selects end at a flop, and each flop of a row
drives one row's C PEs (a row-long wire) instead of the whole array.  The
P broadcast joins the Q lane before that register: the source PE's
synchronous register-file port (a flop inside the PE), the row's psel mux,
then ``a16_e0``.  Every word and operand takes the same one extra cycle, so
the PEs' relative timing (``pe.OP_TIMING``), the programs and the schedule
do not change; the synchronous read port's address ``sa`` is not delayed,
and the register check (``Core``) verifies that every read still meets its
writes.  Measured: cycle-neutral on every core job of
``tb/unit/test_array.py``; ECP5 Fmax in ``results/fpga.md``.

::

               col_b16[0]   col_b16[1]   ...          (K or V, core flops)
                 [b16_0]      [b16_1]                 (row operand stage)
                   │            │
     row_a16[r] ─►[a16_e0]─►┌┴──┐      ┌─┴─┐           ctl, vis: [ctl_e0], [vis_e0]
     (Q, flop)     ▲        │PE │ ...  │PE │ ─ sd (sync RF port, flop) ─┐
        ▲          │        └┬──┘      └─┬─┘                            │
        │          P ◄─ mux by psel over the row's sd ◄─────────────────┘
        │          │ t         │ t
        │        ┌─┴───────────┴─┐
        │        │ RowReduce tree │ (log2 C registered levels)
        │        └───────┬────────┘
        │       ret regs [3 wr] ◄─ Recip x wr (operand: T of PE(r, 0))
        └────────── ret[ret_sel] broadcast to the row's PEs

Pipeline registers between PEs and why they exist:

* tree level registers (``RowReduce``): one FP adder per cycle, so
  reductions of the wr rows of a PE can overlap;
* the row return registers (``ret``): the tree root and the reciprocal
  write them, all C PEs of the row read them (a row-long wire) in later
  cycles, and they hold each row's max, sum and 1/l until used, which lets
  the sequencer schedule the consumers freely;
* the row's operand stage (above): it pipelines the distribution of the
  control word and the operand buses, so no wire from the core's lane
  selects reaches a multiplier in the same cycle;
* the P broadcast is taken from the source PE's synchronous register-file
  port (the flop is inside the PE), read two cycles ahead of its use.

With ``pe_as_instance=True`` the PE rows, PEs, tree nodes and reciprocal
units are Verilog ``Instance``s of modules generated once
(``module_texts``): 1.3 MB of Verilog at 32 x 32 instead of one module per
PE, and Verilator compiles the row once (a hierarchical block).
With ``False`` they are elaborated inline for ``amaranth.sim``.
"""

from __future__ import annotations

from amaranth.hdl import Array, Cat, ClockSignal, Instance, Module, Mux, ResetSignal, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .fpu import Recip
from .pe import Pe, RegMap, _bits, ctl_layout
from .reduce import ReduceNode, RowReduce

__all__ = ["PeRow", "PeArray", "module_texts", "flat_row", "FLAT_SUFFIX", "PE_MODULE", "NODE_MODULE",
           "RECIP_MODULE", "ROW_MODULE"]

PE_MODULE = "flashnpu_pe"
NODE_MODULE = "flashnpu_rnode"
RECIP_MODULE = "flashnpu_recip"
ROW_MODULE = "flashnpu_perow"


def _with_meta(text: str, name: str, meta: str) -> str:
    head = f"module {name}("
    i = text.index(head)
    j = text.index(";\n", i) + 2
    return text[:j] + f"  /* verilator {meta} */\n" + text[j:]


def module_texts(config: NPUConfig) -> str:
    """Verilog of the PE-row, PE, tree-node and reciprocal modules, each once.

    The PE row carries Verilator's ``hier_block`` metacomment (build with
    ``--hierarchical``): it is verilated and compiled once as its own model
    and the core instantiates it R times; its C PEs and C - 1 tree nodes are
    ``inline_module``s, compiled into the row model.  Measured on the 32 x 32
    NPU (C++ replay, idle 2-core machine; README, "Simulator speed"): PEs and
    tree nodes as hier blocks of their own cost each of the 2,016 blocks
    three model calls per cycle (both clock edges and the input update),
    each with Verilator's end-of-eval locking -- half the run time, 1,239
    simulated cycles/s on 1 thread -- against 3,432 with them inside the
    row (build about 115 s against 82 s).  Other measured alternatives: PEs merely
    not inlined still get per-instance combinational code (8 x 8: 14 MB of
    C++, a 6-minute build); hier blocks directly under the core put a
    wrapper per PE and node into the top model (32 x 32: 35 MB of C++); a
    fully flat build takes about 15 minutes.
    """
    from amaranth.back import verilog
    texts = []
    for comp, name, meta in ((PeRow(config, pe_as_instance=True), ROW_MODULE, "hier_block"),
                             (Pe(config), PE_MODULE, "inline_module"),
                             (ReduceNode(), NODE_MODULE, "inline_module"),
                             (Recip(), RECIP_MODULE, "no_inline_module")):
        texts.append(_with_meta(verilog.convert(comp, name=name, emit_src=False), name, meta))
    return "\n".join(texts)


def sum_or(values):
    """OR of a list of values (0 for none)."""
    out = 0
    for v in values:
        out = out | v
    return out


#: module-name suffix of the flat copies that ``flat_row`` adds
FLAT_SUFFIX = "_flat"


def flat_row(text: str, row: int) -> str:
    """``text`` (a design with ``module_texts`` appended) with PE row ``row``
    built from a plain copy of the row module: no ``hier_block``, so a
    ``--hierarchical`` Verilator build keeps that row in the top model, where
    its trace sees every register file, MAC, softmax unit and tree node.
    The other rows stay hierarchical blocks; instance paths do not change.

    Raises
    ------
    ValueError
        when the design has no instance ``row<row>`` of the PE-row module.
    """
    inst = f"  {ROW_MODULE} row{row} ("
    if text.count(inst) != 1:
        raise ValueError(f"no PE row instance row{row} in the design")
    head = f"module {ROW_MODULE}("
    i = text.index(head)
    j = text.index("\nendmodule", i) + len("\nendmodule")
    copy = text[i:j].replace(head, f"module {ROW_MODULE}{FLAT_SUFFIX}(", 1)
    copy = copy.replace("  /* verilator hier_block */\n", "")
    return text.replace(inst, f"  {ROW_MODULE}{FLAT_SUFFIX} row{row} (") + "\n" + copy + "\n"


class PeRow(wiring.Component):
    """One PE row: C PEs, the row's P broadcast, reduction tree, return
    registers and reciprocal unit.

    Parameters
    ----------
    config : NPUConfig
    pe_as_instance : bool
        PEs and tree nodes as ``Instance``s of the shared modules.

    Ports
    -----
    ctl : In(ctl_layout)        control word (same cycle as the operands; the PEs
                                execute it one cycle later, after the row's
                                operand stage)
    q16 : In(16)                the row's Q operand (S phase)
    col_b16 : In(ArrayLayout(16, C))  K or V operand of each PE column
    psel : In(range(C))         P.V: PE column whose ``sd`` drives the P broadcast
    cst : In(32)                score constant
    vis : In(C)                 visibility bit of each PE (SCALE and MAC ops)
    sa : In(log2 regs)          synchronous read address (the data ``sd`` follow
                                one cycle later; for P.V, one cycle before the
                                word's ``ctl``)
    sd : Out(ArrayLayout(32, C))  every PE's synchronous read data
    pnz : Out(range(C + 1))     non-zero P written by the row's PEXP ops (registered
                                again: 3 cycles after the word enters ``ctl``)
    msk : Out(range(C + 1))     masked (skipped) MACs of the row, 3 cycles after
                                the word enters ``ctl``
    ev_tree, ev_tree_tag, ev_rcp, ev_rcp_tag : Out
        the tree / the reciprocal delivers a result with this tag in the next
        cycle (it is in the return registers from the cycle after): one cycle
        ahead, so the core sees them at the time it would without the row's
        operand stage
    """

    def __init__(self, config: NPUConfig, pe_as_instance: bool = False):
        self.config = config
        self.pe_as_instance = bool(pe_as_instance)
        C = config.array_cols
        tagw = _bits(3 * config.rows_per_pe)
        super().__init__({
            "ctl": In(ctl_layout(config)), "q16": In(16),
            "col_b16": In(data.ArrayLayout(16, C)), "psel": In(range(C)), "cst": In(32),
            "vis": In(C), "sa": In(_bits(config.pe_registers)),
            "sd": Out(data.ArrayLayout(32, C)), "pnz": Out(range(C + 1)), "msk": Out(range(C + 1)),
            "ev_tree": Out(1), "ev_tree_tag": Out(tagw), "ev_rcp": Out(1), "ev_rcp_tag": Out(tagw),
        })

    @staticmethod
    def _node_instance(a, b, is_sum, o):
        return Instance(NODE_MODULE, i_clk=ClockSignal(), i_rst=ResetSignal(), i_a=a, i_b=b,
                        i_sum=is_sum, o_o=o)

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        C = cfg.array_cols
        wr = cfg.rows_per_pe
        tagw = _bits(3 * wr)
        # --- the row's operand stage (see the module docstring): the control
        # word, the operand buses and the visibility bits enter the row's
        # flops and reach its PEs one cycle later (their stage E0)
        ctl = Signal(ctl_layout(cfg), name="ctl_e0")
        b16 = [Signal(16, name=f"b16_{c}") for c in range(C)]
        vis = Signal(C, name="vis_e0")
        m.d.sync += [ctl.eq(self.ctl), vis.eq(self.vis)] + [b16[c].eq(self.col_b16[c]) for c in range(C)]
        if self.pe_as_instance:
            # port bundles only: the PE itself is the shared Verilog module
            proto = Pe(cfg)
            proto._MustUse__silence = True
            pes = [proto.signature.create(path=(f"pe{c}",)) for c in range(C)]
        else:
            pes = [Pe(cfg) for _ in range(C)]
        # --- return registers of the row (see the module docstring)
        ret = Array([Signal(32, name=f"ret{i}") for i in range(3 * wr)])
        # --- reduction tree
        tree = RowReduce(C, tagw, self._node_instance if self.pe_as_instance else None)
        m.submodules.tree = tree
        m.d.comb += [tree.op.eq(ctl.tree), tree.tag.eq(ctl.tag)]
        with m.If(tree.res_valid):
            m.d.sync += ret[tree.res_tag].eq(tree.res)
        # --- reciprocals: one divider per query row a (return tag
        # tag_rcp(a)), each started by its own tag; operand T of PE (r, 0)
        g = RegMap(cfg)
        rnexts, rtags = [], []
        for a in range(wr):
            tag = g.tag_rcp(a)
            start = ctl.rcp & (ctl.tag == tag)
            rdone, rnext, ro = Signal(name=f"rcp{a}_done"), Signal(name=f"rcp{a}_next"), Signal(32, name=f"rcp{a}_o")
            if self.pe_as_instance:
                m.submodules[f"rcp{a}"] = Instance(
                    RECIP_MODULE, i_clk=ClockSignal(), i_rst=ResetSignal(), i_start=start,
                    i_x=pes[0].t, o_busy=Signal(name=f"rcp{a}_busy"), o_done=rdone, o_done_next=rnext,
                    o_o=ro)
            else:
                m.submodules[f"rcp{a}"] = rc = Recip()
                m.d.comb += [rc.start.eq(start), rc.x.eq(pes[0].t), rdone.eq(rc.done),
                             rnext.eq(rc.done_next), ro.eq(rc.o)]
            with m.If(rdone):
                m.d.sync += ret[tag].eq(ro)
            rnexts.append(rnext)
            rtags.append(Mux(rnext, tag, 0))
        # the events are reported one cycle ahead of the result, so that they
        # keep their timing against the core's issue stage across the
        # operand stage (two dividers never finish in the same cycle: their
        # starts are in different slots and they take the same time)
        m.d.comb += [self.ev_tree.eq(tree.res_valid_next), self.ev_tree_tag.eq(tree.res_tag_next),
                     self.ev_rcp.eq(Cat(rnexts).any()), self.ev_rcp_tag.eq(sum_or(rtags))]
        # the op's returned value, registered twice: it reaches the PEs in
        # stage E2 (``pe.RET_STAGE``), from a flop, over the row-long wire
        ret_sel1 = Signal.like(ctl.ret_sel)
        ret_sel = Signal(32)
        m.d.sync += [ret_sel1.eq(ctl.ret_sel), ret_sel.eq(ret[ret_sel1])]
        # --- P broadcast: the psel column's synchronous read
        # (Q or P, chosen by the incoming word and registered with it)
        sds = Array([pe.sd for pe in pes])
        a16 = Signal(16, name="a16_e0")
        m.d.sync += a16.eq(Mux(self.ctl.pv, sds[self.psel][0:16], self.q16))
        for c, pe in enumerate(pes):
            m.d.comb += [
                pe.ctl.eq(ctl), pe.a16.eq(a16), pe.b16.eq(b16[c]), pe.cst.eq(self.cst),
                pe.vis.eq(vis[c]), pe.ret.eq(ret_sel), pe.sa.eq(self.sa),
                tree.leaves[c].eq(pe.t), self.sd[c].eq(pe.sd),
            ]
            if self.pe_as_instance:
                m.submodules[f"pe{c}"] = Instance(
                    PE_MODULE, i_clk=ClockSignal(), i_rst=ResetSignal(),
                    i_ctl=pe.ctl.as_value(), i_a16=pe.a16, i_b16=pe.b16, i_cst=pe.cst,
                    i_vis=pe.vis, i_ret=pe.ret, i_sa=pe.sa, o_sd=pe.sd, o_t=pe.t, o_pnz=pe.pnz,
                    o_msk=pe.msk)
            else:
                m.submodules[f"pe{c}"] = pe
        # S-tile check: the row's count of non-zero P (one register stage)
        m.d.sync += self.pnz.eq(sum(pe.pnz for pe in pes))
        # skipped-MAC count (one register stage)
        m.d.sync += self.msk.eq(sum(pe.msk for pe in pes))
        return m


class PeArray(wiring.Component):
    """R PE rows and the read-out mux.

    Parameters
    ----------
    config : NPUConfig
    pe_as_instance : bool
        Instantiate the shared Verilog modules (``module_texts``; for Verilog
        builds) instead of elaborating the blocks inline (for ``amaranth.sim``).

    Ports
    -----
    ctl : In(ctl_layout)
        Control word, aligned with the operand buses (same cycle); the PEs
        execute it one cycle later (the rows' operand stage).
    row_a16 : In(ArrayLayout(16, R))
        Q operand of each PE row (S phase).
    col_b16 : In(ArrayLayout(16, C))
        K (S phase) or V (P.V phase) operand of each PE column.
    psel : In(range(C))
        P.V: the PE column whose ``sd`` drives the row's P broadcast.
    cst : In(32)
        Score constant (binary32).
    vis : In(ArrayLayout(1, R * C))
        Visibility bit of PE (r, c) at index r * C + c (SCALE and MAC ops).
    sa : In(log2 regs)
        Synchronous read address of every PE (``rd_data`` and the P
        broadcast follow one cycle later).
    rd_row : In(range(R))
        Row whose ``sd`` values appear on ``rd_data`` (aligned with ``sd``,
        i.e. give it one cycle after the ``sa`` it belongs to).
    rd_data : Out(ArrayLayout(32, C))
        ``sd`` of the PEs of row ``rd_row`` (combinational from flops).
    pnz : Out(range(R * C + 1))
        Non-zero P written by PEXP ops over the array, 4 cycles after the
        word enters ``ctl`` (row operand, PE, row and array register
        stages): the S-tile check's input.
    msk : Out(range(R * C + 1))
        MACs skipped at masked positions over the array, 4 cycles after the
        word enters ``ctl``: the core's ``ops_masked``.
    ev_tree, ev_tree_tag : Out(1), Out(tag)
        PE row 0's tree delivers a result with this tag in the next cycle
        (it is in the return registers from the cycle after; all rows run in
        lockstep).
    ev_rcp, ev_rcp_tag : Out(1), Out(tag)
        Likewise for PE row 0's reciprocal.
    """

    def __init__(self, config: NPUConfig, pe_as_instance: bool = False):
        self.config = config
        self.pe_as_instance = bool(pe_as_instance)
        R, C = config.array_rows, config.array_cols
        self.regs = RegMap(config)
        super().__init__({
            "ctl": In(ctl_layout(config)),
            "row_a16": In(data.ArrayLayout(16, R)),
            "col_b16": In(data.ArrayLayout(16, C)),
            "psel": In(range(C)),
            "cst": In(32),
            "vis": In(data.ArrayLayout(1, R * C)),
            "sa": In(_bits(config.pe_registers)),
            "rd_row": In(range(R)),
            "rd_data": Out(data.ArrayLayout(32, C)), "pnz": Out(range(R * C + 1)),
            "msk": Out(range(R * C + 1)),
            "ev_tree": Out(1), "ev_tree_tag": Out(_bits(3 * config.rows_per_pe)),
            "ev_rcp": Out(1), "ev_rcp_tag": Out(_bits(3 * config.rows_per_pe)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        R, C = cfg.array_rows, cfg.array_cols
        if self.pe_as_instance:
            proto = PeRow(cfg, pe_as_instance=True)
            proto._MustUse__silence = True
            rows = [proto.signature.create(path=(f"row{r}",)) for r in range(R)]
        else:
            rows = [PeRow(cfg) for _ in range(R)]
        for r, row in enumerate(rows):
            m.d.comb += [
                row.ctl.eq(self.ctl), row.q16.eq(self.row_a16[r]), row.col_b16.eq(self.col_b16),
                row.psel.eq(self.psel), row.cst.eq(self.cst), row.sa.eq(self.sa),
                row.vis.eq(Cat(*[self.vis[r * C + c] for c in range(C)])),
            ]
            if self.pe_as_instance:
                m.submodules[f"row{r}"] = Instance(
                    ROW_MODULE, i_clk=ClockSignal(), i_rst=ResetSignal(),
                    i_ctl=row.ctl.as_value(), i_q16=row.q16, i_col_b16=row.col_b16.as_value(),
                    i_psel=row.psel, i_cst=row.cst, i_vis=row.vis, i_sa=row.sa,
                    o_sd=row.sd.as_value(), o_pnz=row.pnz, o_msk=row.msk, o_ev_tree=row.ev_tree,
                    o_ev_tree_tag=row.ev_tree_tag, o_ev_rcp=row.ev_rcp, o_ev_rcp_tag=row.ev_rcp_tag)
            else:
                m.submodules[f"row{r}"] = row
        m.d.comb += [self.ev_tree.eq(rows[0].ev_tree), self.ev_tree_tag.eq(rows[0].ev_tree_tag),
                     self.ev_rcp.eq(rows[0].ev_rcp), self.ev_rcp_tag.eq(rows[0].ev_rcp_tag)]
        sd_rows = Array([rows[r].sd.as_value() for r in range(R)])
        m.d.comb += self.rd_data.eq(sd_rows[self.rd_row])
        # S-tile check: non-zero P over the array, 4 cycles after the PEXP word
        m.d.sync += self.pnz.eq(sum(row.pnz for row in rows))
        m.d.sync += self.msk.eq(sum(row.msk for row in rows))
        return m
