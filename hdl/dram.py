"""Stacked DRAM timing model: channels, latency and bandwidth in RTL; storage outside.

What is RTL and what is the model
---------------------------------
* **RTL (this file)**: request ports, channel interleaving
  (``channel = word_addr % dram_channels``), one access of one bus word
  (``dram_channel_bytes``) per channel per cycle (the channel bandwidth), a
  round-robin arbiter per channel with stalls for conflicting ports, the
  access latency ``dram_latency_cycles`` (exact, from the accepting edge to the
  first cycle the data can be taken from ``rdata``), bounded outstanding reads
  (credits), byte and conflict counters.
* **Storage model (Python, ``flashnpu.sim.dram_model.DRAMModel``)**: the bytes.
  A many-megabyte DRAM never becomes Verilog.  The RTL forwards every accepted
  access on a per-port *backend bus* ``bk`` (registered outputs); the model
  applies writes and answers reads in request order on ``bk.resp_valid`` /
  ``bk.resp_data``, with any delay shorter than the modelled latency (the
  amaranth.sim and cocotb adapters answer in 1 cycle).  The RTL buffers the
  answer and releases it when the modelled latency has elapsed.  An answer
  that arrives too late for its deadline sets the sticky ``late`` flag: the
  latency seen by the port would then be longer than configured, and tests
  check that this never happens.  Backdoor access is the model's own
  ``read``/``write`` methods.

Not modelled (assumptions): row-buffer hits/misses, bank groups, refresh and
read/write turnaround; every access costs the same latency.  ``dram_dies``
does not change the timing: by default each of the 8 dies holds one channel
(pseudo-channel group), and a channel's bandwidth and latency are the same
whichever die it sits on.  The default
latency (100 cycles, ~67 ns at 1.5 GHz) and bandwidth (32 B/cycle/channel)
are assumptions documented in ``flashnpu/config.py``.

Dataflow (one port shown)::

    cmd ──┐  (word % C)                                        ┌── backend bus bk.req ──► DRAMModel
    wdata ┴─► channel RR arbiter ── accept ──► register ────────┘                          │ (reads)
                  │ (1 word/cycle/channel)        │                                       ▼
                  │                       issue bit ─► L-cycle delay line ─► matured   bk.resp ─► data FIFO
                  │                                                  └──── release when matured & data ──► rdata

Write data travels on its own stream (``wdata``) so that the top level can
route it through a TSV link; a write is accepted only when its command and
its data are both valid, and both ``ready`` signals rise together.
Writes are posted (no response).  Reads and writes of one port reach the
model in acceptance order, so a read after a write of the same port sees it.
"""

from __future__ import annotations

from amaranth import Const, Module, Signal
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from .mem_common import addr_bits_for, dram_cmd_layout, round_robin, word_bytes

__all__ = ["StackedDRAM", "DRAMPortSignature", "DRAMBackendSignature"]


class DRAMPortSignature(wiring.Signature):
    """One DRAM request port, written from the initiator's side (the DRAM uses ``In(...)``).

    Members
    -------
    cmd : Out(stream of ``dram_cmd_layout``) — word address, write, wmask.
    wdata : Out(stream of 8*W bits) — one beat per write command.
    rdata : In(stream of 8*W bits) — one beat per read, in order.
    """

    def __init__(self, addr_bits: int, wbytes: int):
        super().__init__({
            "cmd": Out(stream.Signature(dram_cmd_layout(addr_bits, wbytes))),
            "wdata": Out(stream.Signature(8 * wbytes)),
            "rdata": In(stream.Signature(8 * wbytes)),
        })


class DRAMBackendSignature(wiring.Signature):
    """Backend bus from the DRAM timing RTL to the external storage model.

    Members (Out = driven by the RTL)
    ---------------------------------
    req_valid, req_write : Out(1); req_addr : Out(word address);
    req_wmask : Out(W); req_wdata : Out(8W)
        One accepted access per cycle at most; the model must take it (no
        back-pressure) in the cycle it is valid.
    resp_valid : In(1); resp_data : In(8W)
        The model's read answers, in request order, one per cycle at most.
    """

    def __init__(self, addr_bits: int, wbytes: int):
        super().__init__({
            "req_valid": Out(1),
            "req_write": Out(1),
            "req_addr": Out(addr_bits),
            "req_wmask": Out(wbytes),
            "req_wdata": Out(8 * wbytes),
            "resp_valid": In(1),
            "resp_data": In(8 * wbytes),
        })


class StackedDRAM(wiring.Component):
    """Timing model of the stacked DRAM (storage lives in a Python model).

    Parameters
    ----------
    config : NPUConfig
        Uses ``dram_bytes`` (address space), ``dram_channels`` (power of 2),
        ``dram_channel_bytes`` (= bus word W, bytes per cycle per channel),
        ``dram_latency_cycles`` (>= 4).
    n_ports : int
        Request ports (>= 1).
    max_outstanding : int or None
        Read credits per port (power of 2); default the smallest power of 2
        >= latency + 4, enough for one read per cycle back to back.

    Ports
    -----
    ports[p] : In(DRAMPortSignature)
    bk[p] : Out(DRAMBackendSignature)
    rd_bytes, wr_bytes : Out(48)
        Bytes read/written (W per access).
    conflict_cycles : Out(32)
        Port-cycles with a valid request that did not win its channel or
        lacked a read credit.
    late : Out(1)
        Sticky: a model answer arrived after its release deadline.
    err_addr : Out(1)
        Sticky: an access beyond ``dram_bytes``.

    Raises
    ------
    ValueError
        For n_ports < 1, a latency < 4, or a bad ``max_outstanding``.
    """

    def __init__(self, config, n_ports: int = 1, max_outstanding: int | None = None):
        if not isinstance(n_ports, int) or n_ports < 1:
            raise ValueError(f"n_ports must be a positive int, not {n_ports!r}")
        if config.dram_latency_cycles < 4:
            raise ValueError(f"dram_latency_cycles must be >= 4 for this timing model, "
                             f"not {config.dram_latency_cycles!r}")
        self.config = config
        self.n_ports = n_ports
        self.wbytes = word_bytes(config)
        self.latency = config.dram_latency_cycles
        self.channels = config.dram_channels
        self.ch_bits = exact_log2(self.channels)
        self.words = config.dram_bytes // self.wbytes
        self.addr_bits = addr_bits_for(config.dram_bytes, self.wbytes)
        if max_outstanding is None:
            max_outstanding = 1 << ceil_log2(self.latency + 4)
        if not isinstance(max_outstanding, int) or max_outstanding < 1 or max_outstanding & (max_outstanding - 1):
            raise ValueError(f"max_outstanding must be a power of 2, not {max_outstanding!r}")
        self.max_outstanding = max_outstanding
        super().__init__({
            "ports": In(DRAMPortSignature(self.addr_bits, self.wbytes)).array(n_ports),
            "bk": Out(DRAMBackendSignature(self.addr_bits, self.wbytes)).array(n_ports),
            "rd_bytes": Out(48),
            "wr_bytes": Out(48),
            "conflict_cycles": Out(32),
            "late": Out(1),
            "err_addr": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        W = self.wbytes
        P = self.n_ports
        L = self.latency
        D = self.max_outstanding

        want, chan, credit_ok = [], [], []
        fifos, outstanding = [], []
        for p, port in enumerate(self.ports):
            f = fifo.SyncFIFO(width=8 * W, depth=D)
            m.submodules[f"resp{p}"] = f
            fifos.append(f)
            outs = Signal(range(D + 1), name=f"outstanding{p}")
            outstanding.append(outs)
            c = Signal(name=f"credit{p}")
            m.d.comb += c.eq(outs < D)
            credit_ok.append(c)
            w = Signal(name=f"want{p}")
            wr = port.cmd.payload.write
            m.d.comb += w.eq(port.cmd.valid & (wr & port.wdata.valid | ~wr & c))
            want.append(w)
            ch = Signal(max(1, self.ch_bits), name=f"chan{p}")
            if self.ch_bits:
                m.d.comb += ch.eq(port.cmd.payload.addr[:self.ch_bits])
            chan.append(ch)
            with m.If(port.cmd.valid & (port.cmd.payload.addr >= self.words)):
                m.d.sync += self.err_addr.eq(1)

        granted = [Const(0, 1) for _ in range(P)]
        for c in range(self.channels):
            reqs = []
            for p in range(P):
                r = Signal(name=f"c{c}_req{p}")
                m.d.comb += r.eq(want[p] & (chan[p] == c))
                reqs.append(r)
            rr = round_robin(m, reqs, name=f"c{c}_rr")
            for p in range(P):
                granted[p] = granted[p] | rr.grant[p]

        rd_terms, wr_terms, stall_terms = [], [], []
        for p, port in enumerate(self.ports):
            bk = self.bk[p]
            g = Signal(name=f"grant{p}")
            m.d.comb += g.eq(granted[p])
            wr = port.cmd.payload.write
            m.d.comb += [port.cmd.ready.eq(g), port.wdata.ready.eq(g & wr)]
            acc_rd = Signal(name=f"acc_rd{p}")
            m.d.comb += acc_rd.eq(g & ~wr)
            # backend request (registered)
            m.d.sync += [
                bk.req_valid.eq(g),
                bk.req_write.eq(wr),
                bk.req_addr.eq(port.cmd.payload.addr),
                bk.req_wmask.eq(port.cmd.payload.wmask),
                bk.req_wdata.eq(port.wdata.payload),
            ]
            # latency: an issue bit travels L-1 registers; it matures in the
            # L-th cycle after the accepting edge.
            line = Signal(L, name=f"line{p}")
            m.d.sync += line.eq((line << 1) | acc_rd)
            mature_now = line[L - 1]
            matured = Signal(range(D + 1), name=f"matured{p}")
            f = fifos[p]
            m.d.comb += [f.w_en.eq(bk.resp_valid), f.w_data.eq(bk.resp_data)]
            eff = Signal(range(D + 2), name=f"eff_matured{p}")
            m.d.comb += eff.eq(matured + mature_now)
            m.d.comb += [
                port.rdata.valid.eq((eff != 0) & f.r_rdy),
                port.rdata.payload.eq(f.r_data),
                f.r_en.eq(port.rdata.ready & (eff != 0)),
            ]
            pop = Signal(name=f"pop{p}")
            m.d.comb += pop.eq(port.rdata.valid & port.rdata.ready)
            m.d.sync += matured.eq(eff - pop)
            m.d.sync += outstanding[p].eq(outstanding[p] + acc_rd - pop)
            with m.If((eff != 0) & ~f.r_rdy):
                m.d.sync += self.late.eq(1)
            rd_terms.append(acc_rd)
            wr_terms.append(g & wr)
            st = Signal(name=f"stall{p}")
            m.d.comb += st.eq(port.cmd.valid & ~g)
            stall_terms.append(st)

        m.d.sync += [
            self.rd_bytes.eq(self.rd_bytes + sum(rd_terms) * W),
            self.wr_bytes.eq(self.wr_bytes + sum(wr_terms) * W),
            self.conflict_cycles.eq(self.conflict_cycles + sum(stall_terms)),
        ]
        return m
