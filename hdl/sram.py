"""Stacked SRAM: word-interleaved banks, N request ports, bank-conflict stalls.

The SRAM die sits above the logic die; each bank is a single-ported macro
(one read *or* one write of one bus word per cycle).  Consecutive words go to
consecutive banks (``bank = word_addr % sram_banks``, ``row = word_addr //
sram_banks``), so a unit-stride stream from one port never conflicts, and P
ports streaming at different addresses collide only when they hit the same
bank in the same cycle.  A collision is resolved by a round-robin arbiter per
bank; the loser's ``req.ready`` stays low (a stall) and the cycle is counted
in ``conflict_cycles``.  The trade-off: single-ported banks and per-bank
arbitration are what real stacked SRAM offers; multi-ported storage would hide
conflicts the hardware would have.

Dataflow (P ports + the backdoor, B banks)::

    req[0] ─┐                   ┌─ bank 0: Memory(W bytes x rows) ─┐
    req[1] ─┼─ bank select ─ RR arbiter per bank ─ ...            ─┼─ read mux ─ out FIFO[p] ─ rdata[p]
    bd_req ─┘  (word % B)      (bd_req lowest)  └─ bank B-1        ─┘  (1-cycle read)

Wide ports (``lanes`` > 1) move ``L`` consecutive words per request: the
port's word address counts groups of ``L`` words, a request needs the ``L``
banks of its group (lane i = bank ``(g % (B/L))*L + i``) and is granted all of
them or none.  Wide ports are granted first, in a fixed order (``priority``;
default the widest first, ties in port order), then the narrow ports share the
remaining banks round-robin per bank.  A wide port models a wider bank-group access (e.g. the
NPU's O writer taking C FP32 lanes per cycle); the fixed priority keeps the
grant atomic without a multi-bank round-robin, and the widest-first order
keeps a wide stream from being throttled to the speed of a narrower one it
catches up with.  Narrow-only configurations use the per-bank round-robin only.

Reads return in request order per port, one cycle after acceptance at the
earliest; each port has a small output FIFO and accepts a read only when the
FIFO has room for it (so back-pressure on ``rdata`` never loses data).

The backdoor (``bd_req``/``bd_rdata``) is an ordinary port with the lowest
priority: it is granted a bank only when no other port requests that bank.
Testbenches and the host driver use it to load and inspect storage without
touching the protocol of the functional ports.

Verilog size: Yosys writes a zero initialiser for every memory word (~0.7 MB
per 256 KiB bank); generate through :func:`flashnpu.hdl.mem_common.verilog_text`,
which strips it (the storage then powers up undefined, like a real macro).
Memory-system tests use a smaller ``sram_bytes`` (64 KiB); the NPU's
``sim_config`` uses its SRAM map (1 MiB at 32 x 32).
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from .mem_common import addr_bits_for, round_robin, sram_req_layout, word_bytes

__all__ = ["StackedSRAM", "SRAMPortSignature"]

_OUT_DEPTH = 4


class SRAMPortSignature(wiring.Signature):
    """One SRAM port, written from the initiator's side (the SRAM uses ``In(...)``).

    Members
    -------
    req : Out(stream of ``sram_req_layout``)
    rdata : In(stream of 8*W bits), one beat per accepted read, in order.
    """

    def __init__(self, addr_bits: int, wbytes: int):
        self.addr_bits = addr_bits
        self.wbytes = wbytes
        super().__init__({
            "req": Out(stream.Signature(sram_req_layout(addr_bits, wbytes))),
            "rdata": In(stream.Signature(8 * wbytes)),
        })

    @classmethod
    def of(cls, config, lanes: int = 1) -> "SRAMPortSignature":
        """The port of ``config``'s SRAM that moves ``lanes`` bus words per
        request (word address of ``lanes`` words, ``lanes`` x W data bytes)."""
        W = word_bytes(config)
        return cls(addr_bits_for(config.sram_bytes, W) - exact_log2(lanes), W * lanes)


class StackedSRAM(wiring.Component):
    """Banked stacked SRAM with ``n_ports`` request ports and a backdoor.

    Parameters
    ----------
    config : NPUConfig
        Uses ``sram_bytes`` (capacity, bytes), ``sram_banks`` (power of 2),
        ``sram_bank_bytes`` (bus word W, bytes).
    n_ports : int
        Functional request ports (>= 1).
    lanes : tuple of int, optional
        Words per request of each functional port (a power of two dividing
        ``sram_banks``; default 1 each).  Port p then has word address width
        ``addr_bits - log2(lanes[p])`` and data width ``8*W*lanes[p]``.
    priority : tuple of int, optional
        The wide ports (lanes > 1) in grant order; default the widest first
        (ties in port order).

    Ports
    -----
    ports[p] : In(SRAMPortSignature)
        ``req`` stream (word address, write, wmask, wdata); ``rdata`` stream.
        A write completes in the cycle it is accepted; a read's data appears on
        ``rdata`` one cycle after acceptance at the earliest.
    bd : In(SRAMPortSignature)
        Backdoor port, lowest priority.
    rd_bytes, wr_bytes : Out(48)
        Bytes read / written over all ports, backdoor excluded: W per bank
        word, so L words per read of an L-lane port, and per write the
        words whose byte mask is not empty (a partial word counts whole).
    conflict_cycles : Out(32)
        Sum over functional ports of cycles with a valid request that was not
        granted because another port held its bank (or its output FIFO was full).
    err_addr : Out(1)
        Sticky: a request addressed a row beyond ``sram_bytes``.
    stall : In(n_ports)
        Test-only backpressure: functional port p is granted nothing in a
        cycle with ``stall[p]`` set (counted as a conflict cycle); 0 in
        normal operation.

    Raises
    ------
    ValueError
        If ``n_ports`` < 1, a lane count is not a power of two dividing the
        bank count, ``priority`` is not an order of the wide ports, or the
        configuration's word widths disagree.
    """

    def __init__(self, config, n_ports: int = 2, lanes=None, priority=None):
        if not isinstance(n_ports, int) or n_ports < 1:
            raise ValueError(f"n_ports must be a positive int, not {n_ports!r}")
        self.config = config
        self.n_ports = n_ports
        self.wbytes = word_bytes(config)
        self.words = config.sram_bytes // self.wbytes
        self.banks = config.sram_banks
        self.bank_bits = exact_log2(self.banks)
        self.rows = self.words // self.banks
        self.addr_bits = addr_bits_for(config.sram_bytes, self.wbytes)
        lanes = tuple(lanes) if lanes is not None else (1,) * n_ports
        if len(lanes) != n_ports or any(not isinstance(v, int) or v < 1 or v & (v - 1) or self.banks % v
                                        for v in lanes):
            raise ValueError(f"lanes must be {n_ports} powers of 2 dividing sram_banks={self.banks}, "
                             f"not {lanes!r}")
        self.lanes = lanes
        wide = sorted((p for p in range(n_ports) if lanes[p] > 1), key=lambda p: (-lanes[p], p))
        if priority is not None:
            if sorted(priority) != sorted(wide):
                raise ValueError(f"priority must order the wide ports {sorted(wide)!r}, not {priority!r}")
            wide = list(priority)
        self.wide_order = wide
        sig = SRAMPortSignature(self.addr_bits, self.wbytes)
        narrow = all(v == 1 for v in lanes)
        if narrow:
            pmembers = {"ports": In(sig).array(n_ports)}
        else:        # differing widths: one member per port, ``ports`` lists them
            pmembers = {f"port{p}": In(SRAMPortSignature.of(config, v))
                        for p, v in enumerate(lanes)}
        super().__init__({
            **pmembers,
            "bd": In(sig),
            "rd_bytes": Out(48),
            "wr_bytes": Out(48),
            "conflict_cycles": Out(32),
            "err_addr": Out(1),
            "stall": In(n_ports),
        })
        if not narrow:
            self.ports = [getattr(self, f"port{p}") for p in range(n_ports)]

    def elaborate(self, platform):
        m = Module()
        W = self.wbytes
        allp = list(self.ports) + [self.bd]
        N = len(allp)
        BD = N - 1
        L = list(self.lanes) + [1]
        gbits = [self.bank_bits - exact_log2(v) for v in L]       # bank-group index bits
        wide = self.wide_order       # wide ports in grant order

        # per-port output FIFOs and read credits
        outs = []
        pend = []      # a read accepted last cycle whose data lands this cycle
        pend_bank = []
        can_read = []
        for p, port in enumerate(allp):
            f = fifo.SyncFIFO(width=8 * W * L[p], depth=_OUT_DEPTH)
            m.submodules[f"out{p}"] = f
            outs.append(f)
            pe = Signal(name=f"pend{p}")
            pb = Signal(max(1, gbits[p]), name=f"pend_bank{p}")
            pend.append(pe)
            pend_bank.append(pb)
            cr = Signal(name=f"can_read{p}")
            m.d.comb += cr.eq(f.level + pe < _OUT_DEPTH)
            can_read.append(cr)
            m.d.comb += [
                port.rdata.valid.eq(f.r_rdy),
                port.rdata.payload.eq(f.r_data),
                f.r_en.eq(port.rdata.ready),
            ]

        # requests per port (a read needs a credit); bank_of = bank (narrow)
        # or bank group (wide)
        want = []
        bank_of = []
        row_of = []
        for p, port in enumerate(allp):
            w = Signal(name=f"want{p}")
            stalled = self.stall[p] if p != BD else 0
            m.d.comb += w.eq(port.req.valid & (port.req.payload.write | can_read[p]) & ~stalled)
            want.append(w)
            b = Signal(max(1, gbits[p]), name=f"bank{p}")
            r = Signal(range(max(2, 1 << (self.addr_bits - self.bank_bits))), name=f"row{p}")
            if gbits[p]:
                m.d.comb += b.eq(port.req.payload.addr[:gbits[p]])
            m.d.comb += r.eq(port.req.payload.addr[gbits[p]:])
            bank_of.append(b)
            row_of.append(r)
            with m.If(port.req.valid & (r >= self.rows)):
                m.d.sync += self.err_addr.eq(1)

        # wide ports first, fixed priority, all banks of the group or none
        granted = [Const(0, 1) for _ in range(N)]
        taken = Const(0, self.banks)
        wide_g = {}
        for p in wide:
            msk = Signal(self.banks, name=f"wmask{p}")
            m.d.comb += msk.eq(Const((1 << L[p]) - 1, self.banks) << (bank_of[p] * L[p]))
            g = Signal(name=f"wgrant{p}")
            m.d.comb += g.eq(want[p] & ((msk & taken) == 0))
            wide_g[p] = (g, msk)
            taken = taken | Mux(g, msk, 0)
            granted[p] = g
        wtaken = Signal(self.banks, name="wide_taken")
        m.d.comb += wtaken.eq(taken)

        bank_rdata = []
        for b in range(self.banks):
            mem = memory.Memory(shape=8 * W, depth=self.rows, init=[])
            m.submodules[f"bank{b}"] = mem
            wp = mem.write_port(granularity=8)
            rp = mem.read_port()
            bank_rdata.append(rp.data)
            reqs = []
            narrow = [p for p in range(N) if L[p] == 1]
            for p in narrow:
                rq = Signal(name=f"b{b}_req{p}")
                m.d.comb += rq.eq(want[p] & (bank_of[p] == b) & ~wtaken[b])
                reqs.append(rq)
            rr = round_robin(m, reqs, low=(narrow.index(BD),), name=f"b{b}_rr")
            row = Signal.like(row_of[0], name=f"b{b}_row")
            wr = Signal(name=f"b{b}_wr")
            wdata = Signal(8 * W, name=f"b{b}_wdata")
            wmask = Signal(W, name=f"b{b}_wmask")
            for k, p in enumerate(narrow):
                with m.If(rr.grant[k]):
                    m.d.comb += [
                        row.eq(row_of[p]),
                        wr.eq(allp[p].req.payload.write),
                        wdata.eq(allp[p].req.payload.wdata),
                        wmask.eq(allp[p].req.payload.wmask),
                    ]
                granted[p] = granted[p] | rr.grant[k]
            use = rr.any
            for p in wide:
                g, msk = wide_g[p]
                lane = b % L[p]
                hit = g & msk[b]
                with m.If(hit):
                    m.d.comb += [
                        row.eq(row_of[p]),
                        wr.eq(allp[p].req.payload.write),
                        wdata.eq(allp[p].req.payload.wdata[8 * W * lane:8 * W * (lane + 1)]),
                        wmask.eq(allp[p].req.payload.wmask[W * lane:W * (lane + 1)]),
                    ]
                use = use | hit
            m.d.comb += [
                wp.addr.eq(row),
                rp.addr.eq(row),
                wp.data.eq(wdata),
                wp.en.eq(Mux(use & wr, wmask, 0)),
            ]

        rd_words = Signal(range(N * self.banks + 1))
        wr_words = Signal(range(N * self.banks + 1))
        rd_terms = []
        wr_terms = []
        stalls = []
        for p, port in enumerate(allp):
            g = Signal(name=f"granted{p}")
            m.d.comb += [g.eq(granted[p]), port.req.ready.eq(g)]
            is_rd = g & ~port.req.payload.write
            m.d.sync += [pend[p].eq(is_rd), pend_bank[p].eq(bank_of[p])]
            f = outs[p]
            nb = self.banks // L[p]
            m.d.comb += [
                f.w_en.eq(pend[p]),
                f.w_data.eq(Cat(*bank_rdata).word_select(pend_bank[p], 8 * W * L[p]) if nb > 1
                            else Cat(*bank_rdata)),
            ]
            if p != BD:
                rd_terms.append(Mux(is_rd, L[p], 0))
                # a write moves the words whose byte mask is not empty (a
                # bank with no byte enabled is not written)
                lanes_written = sum(port.req.payload.wmask[W * i:W * (i + 1)].any() for i in range(L[p]))
                wr_terms.append(Mux(g & port.req.payload.write, lanes_written, 0))
                st = Signal(name=f"stall{p}")
                m.d.comb += st.eq(port.req.valid & ~g)
                stalls.append(st)
        m.d.comb += [
            rd_words.eq(sum(rd_terms)),
            wr_words.eq(sum(wr_terms)),
        ]
        m.d.sync += [
            self.rd_bytes.eq(self.rd_bytes + rd_words * W),
            self.wr_bytes.eq(self.wr_bytes + wr_words * W),
            self.conflict_cycles.eq(self.conflict_cycles + sum(stalls)),
        ]
        return m
