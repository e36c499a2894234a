"""Stacked DRAM timing model: channels, banks, rows and refresh in RTL; storage outside.

What is RTL and what is the model
---------------------------------
* **RTL (this file)**: ``dram_channels`` independent channels
  (:class:`DRAMChannel`), each with its own request port, its own backend
  bus and, at the memory-system level, its own TSV bundle.  Per channel: an
  open-page controller with ``dram_banks`` banks, activate/precharge timing
  (tRCD, tRP, tRAS, tRRD, tFAW), all-bank refresh (tREFI, tRFC), one column
  access of one bus word (``dram_channel_bytes``) per cycle, the read
  latency ``dram_latency_cycles`` from the column command to the first cycle
  the data can be taken (exact), bounded outstanding reads (credits), and
  counters (bytes, row hits, activates, row conflicts, refreshes, stall
  cycles).
* **Storage model (Python, ``flashnpu.sim.dram_model.DRAMModel``)**: the
  bytes.  A many-megabyte DRAM never becomes Verilog.  Each channel forwards
  its column accesses on its *backend bus* ``bk[c]`` (registered outputs);
  the model applies writes and answers reads in request order on
  ``bk[c].resp_valid`` / ``resp_data``, at most ``dram_latency_cycles - 2``
  cycles after the request appeared on the bus (the adapters answer in 1
  cycle plus ``max_extra_delay <= dram_latency_cycles - 3``).  The RTL
  buffers the answer and releases it when the latency has elapsed; an
  answer too late for its deadline sets the sticky ``late`` flag (tests
  check it never happens).  Backdoor access is the model's own
  ``read``/``write``.

Address interleave (word address ``w`` of ``W``-byte words, the one rule)::

    channel = w % C                       C = dram_channels
    column  = (w // C) % (row_bytes / W)  row_bytes = dram_row_bytes
    bank    = (w // C // (row_bytes / W)) % dram_banks
    row     =  w // C // (row_bytes / W) // dram_banks

Consecutive words go to consecutive channels, so one 2-D descriptor row of
``C x W`` bytes (256 B by default: a head_dim-128 FP16 row) spreads over all
channels; a channel's page holds ``row_bytes / W`` consecutive channel words,
and consecutive pages of a stream sit in consecutive banks.

Channel controller (in order, open page)::

    port.cmd ─► stage A (row check) ─► column queue (Q entries) ─► column issue ─► bk.req
                 hit: enqueue              waits for its bank's tRCD      │
                 closed bank: ACT+enqueue                                 └ read: L-cycle delay line
                 other row open: PRE (when no queued access and tRAS)       ─► matured + bk.resp FIFO ─► rdata

* Stage A handles the port's head request.  A row hit is queued at once.
  A closed bank is activated (when tRP since its precharge, tRRD since the
  channel's last activate and at most 3 activates in the last tFAW) and the
  request queued in the same cycle; it waits in the column queue for tRCD.
  A bank open on another row is precharged first (once no queued access
  needs that row and tRAS has passed).  Because the column queue runs up to
  ``Q`` entries ahead, the activate of the next page overlaps the column
  accesses still queued.
* Idle close: a bank open for ``idle_close`` cycles with no queued access is
  precharged (timer-based page policy), so a stream that comes back to the
  bank with a new row pays only tRCD, which the queue hides.  Default
  ``idle_close = tRP + tRCD``: keeping a row open longer saves less than
  reopening costs.
* Refresh: every tREFI cycles a refresh becomes due; stage A stops, the
  queue drains, all banks are precharged (after tRAS), and the channel is
  busy for tRP + tRFC.  ``refresh_stall_cycles`` counts the cycles a request
  waited at the port meanwhile.
* Writes carry their data through the queue and are posted.  A channel's
  accesses reach the model in port order, so a read after a write of the
  same channel sees it.

Not modelled (assumptions): bank groups (tRRD is the conservative same-group
tRRD_L for every pair, tCCD is one column per cycle), read/write turnaround
(tWTR, tRTW), write recovery before precharge (tWR), per-bank refresh.
``dram_dies`` does not change the timing: each die holds one channel by
default, and a channel's timing is the same whichever die it sits on.
Timing values: ``NPUConfig.dram_timing_cycles`` (HBM2 8Gb, DRAMsim3
``configs/HBM2_8Gb_x128.ini``).
"""

from __future__ import annotations

from amaranth import Array, Cat, Const, Module, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from .mem_common import addr_bits_for, dram_cmd_layout, word_bytes

__all__ = ["StackedDRAM", "DRAMChannel", "DRAMPortSignature", "DRAMBackendSignature",
           "dram_address", "COLUMN_QUEUE"]

COLUMN_QUEUE = 32
"""Entries of a channel's column queue (>= tRCD at 1.5 GHz, so an activate
issued when a request is queued never delays its column command)."""


def dram_address(config, word_addr: int) -> dict:
    """Where word ``word_addr`` lives: ``{"channel", "bank", "row", "column"}``.

    The interleave of the module docstring (the one definition; the RTL
    slices the same bits).  Raises ``ValueError`` for a negative address.
    """
    if word_addr < 0:
        raise ValueError(f"word_addr must be >= 0, not {word_addr!r}")
    W = config.dram_channel_bytes
    C = config.dram_channels
    cols = config.dram_row_bytes // W
    cw = word_addr // C
    return {"channel": word_addr % C, "column": cw % cols, "bank": (cw // cols) % config.dram_banks,
            "row": cw // cols // config.dram_banks}


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
    """Backend bus from one channel's timing RTL to the external storage model.

    Members (Out = driven by the RTL)
    ---------------------------------
    req_valid, req_write : Out(1); req_addr : Out(word address);
    req_wmask : Out(W); req_wdata : Out(8W)
        One column access per cycle at most; the model must take it (no
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


#: the channels' counters: two 48-bit byte counts, then the 32-bit event counts
COUNTER_NAMES = ("rd_bytes", "wr_bytes", "stall_cycles", "row_hits", "activates", "row_conflicts",
                 "refreshes", "refresh_stall_cycles")


class DRAMChannel(wiring.Component):
    """One DRAM channel: open-page bank timing, refresh, latency, credits.

    Parameters
    ----------
    config : NPUConfig
        ``dram_*`` fields (see the module docstring).
    channel : int
        This channel's index: every request's ``addr % dram_channels`` must
        equal it (``err_addr`` otherwise).
    max_outstanding : int or None
        Read credits (power of 2); default the smallest power of 2 >=
        latency + 4, enough for one read per cycle back to back.
    idle_close : int or None
        Cycles an open bank without queued accesses stays open (default tRP +
        tRCD, see the module docstring).

    Ports
    -----
    port : In(DRAMPortSignature)
    bk : Out(DRAMBackendSignature)
    rd_bytes, wr_bytes : Out(48)          bytes read / written (W per column access)
    stall_cycles : Out(32)                cycles with a valid request at the port not taken
    row_hits, activates, row_conflicts : Out(32)
        requests queued to an open row; activates; precharges that closed a
        row another request needed to replace
    refreshes, refresh_stall_cycles : Out(32)
        refreshes done; cycles a request waited at the port for a refresh
    late, err_addr : Out(1)               sticky (see the module docstring); ``err_addr``:
        a request at the port (taken or not) addressed another channel or a
        word beyond ``dram_bytes``
    idle : Out(1)                         the column queue is empty (every accepted access issued)

    Raises
    ------
    ValueError
        For a latency < 4, a bad ``channel``, ``max_outstanding`` or ``idle_close``.
    """

    def __init__(self, config, channel: int = 0, max_outstanding: int | None = None,
                 idle_close: int | None = None):
        if config.dram_latency_cycles < 4:
            raise ValueError(f"dram_latency_cycles must be >= 4 for this timing model, "
                             f"not {config.dram_latency_cycles!r}")
        if not isinstance(channel, int) or not 0 <= channel < config.dram_channels:
            raise ValueError(f"channel must be in 0..{config.dram_channels - 1}, not {channel!r}")
        self.config = config
        self.channel = channel
        self.wbytes = word_bytes(config)
        self.latency = config.dram_latency_cycles
        self.t = config.dram_timing_cycles()
        self.words = config.dram_bytes // self.wbytes
        self.addr_bits = addr_bits_for(config.dram_bytes, self.wbytes)
        if max_outstanding is None:
            max_outstanding = 1 << ceil_log2(self.latency + 4)
        if not isinstance(max_outstanding, int) or max_outstanding < 1 or max_outstanding & (max_outstanding - 1):
            raise ValueError(f"max_outstanding must be a power of 2, not {max_outstanding!r}")
        self.max_outstanding = max_outstanding
        if idle_close is None:
            idle_close = self.t["trp"] + self.t["trcd"]
        if not isinstance(idle_close, int) or idle_close < 1:
            raise ValueError(f"idle_close must be a positive int, not {idle_close!r}")
        self.idle_close = idle_close
        super().__init__({
            "port": In(DRAMPortSignature(self.addr_bits, self.wbytes)),
            "bk": Out(DRAMBackendSignature(self.addr_bits, self.wbytes)),
            "rd_bytes": Out(48), "wr_bytes": Out(48),
            **{n: Out(32) for n in COUNTER_NAMES[2:]},
            "late": Out(1), "err_addr": Out(1), "idle": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        W = self.wbytes
        L = self.latency
        D = self.max_outstanding
        t = self.t
        port, bk = self.port, self.bk
        ch_bits = exact_log2(cfg.dram_channels)
        col_bits = exact_log2(cfg.dram_row_bytes // W)
        bank_bits = exact_log2(cfg.dram_banks)
        B = cfg.dram_banks

        def bank_of(addr):
            return addr[ch_bits + col_bits:ch_bits + col_bits + bank_bits] if bank_bits else Const(0, 1)

        def row_of(addr):
            return addr[ch_bits + col_bits + bank_bits:]

        row_w = max(1, self.addr_bits - ch_bits - col_bits - bank_bits)
        cnt_w = max(t.values()).bit_length() + 1

        # ---- bank state
        is_open = Signal(B)
        open_row = Array(Signal(row_w, name=f"open_row{b}") for b in range(B))
        t_rcd = Array(Signal(range(t["trcd"] + 1), name=f"t_rcd{b}") for b in range(B))
        t_ras = Array(Signal(range(t["tras"] + 1), name=f"t_ras{b}") for b in range(B))
        t_rp = Array(Signal(range(t["trp"] + 1), name=f"t_rp{b}") for b in range(B))
        idle = Array(Signal(range(self.idle_close + 1), name=f"idle{b}") for b in range(B))
        queued = Array(Signal(range(COLUMN_QUEUE + 1), name=f"queued{b}") for b in range(B))
        t_rrd = Signal(range(t["trrd"] + 1))
        faw = Array(Signal(range(t["tfaw"] + 1), name=f"faw{k}") for k in range(4))
        faw_ptr = Signal(2)
        refi = Signal(cnt_w, init=t["trefi"])
        ref_due = Signal()
        ref_busy = Signal(range(t["trp"] + t["trfc"] + 1))

        # ---- column queue: the request and its write data
        entry = data.StructLayout({"addr": self.addr_bits, "write": 1, "wmask": W, "wdata": 8 * W})
        m.submodules.colq = colq = fifo.SyncFIFOBuffered(width=entry.size, depth=COLUMN_QUEUE)
        head = data.View(entry, colq.r_data)
        m.d.comb += self.idle.eq(colq.level == 0)

        # ---- stage A: the port's head request
        cmd = port.cmd.payload
        a_bank = Signal(max(1, bank_bits))
        a_row = Signal(row_w)
        m.d.comb += [a_bank.eq(bank_of(cmd.addr)), a_row.eq(row_of(cmd.addr))]
        a_valid = Signal()
        m.d.comb += a_valid.eq(port.cmd.valid & (~cmd.write | port.wdata.valid))
        a_open = is_open.bit_select(a_bank, 1)
        a_hit = a_open & (open_row[a_bank] == a_row)
        act_ok = (t_rp[a_bank] == 0) & (t_rrd == 0) & (faw[faw_ptr] == 0)
        halted = ref_due | (ref_busy != 0)
        do_act = Signal()
        do_pre = Signal()
        push = Signal()
        m.d.comb += [
            push.eq(a_valid & ~halted & colq.w_rdy & (a_hit | ~a_open & act_ok)),
            do_act.eq(push & ~a_open),
            do_pre.eq(a_valid & ~halted & a_open & ~a_hit & (queued[a_bank] == 0) & (t_ras[a_bank] == 0)),
            port.cmd.ready.eq(push),
            port.wdata.ready.eq(push & cmd.write),
        ]
        qe = data.View(entry, Signal(entry.size, name="q_entry"))
        m.d.comb += [qe.addr.eq(cmd.addr), qe.write.eq(cmd.write), qe.wmask.eq(cmd.wmask),
                     qe.wdata.eq(port.wdata.payload), colq.w_data.eq(qe.as_value()), colq.w_en.eq(push)]
        with m.If(port.cmd.valid & ((cmd.addr >= self.words) | (cmd.addr[:ch_bits] != self.channel
                                                                 if ch_bits else 0))):
            m.d.sync += self.err_addr.eq(1)

        # ---- column issue: the queue's head once its bank's tRCD has passed
        outstanding = Signal(range(D + 1))
        h_bank = Signal(max(1, bank_bits))
        m.d.comb += h_bank.eq(bank_of(head.addr))
        issue = Signal()
        m.d.comb += issue.eq(colq.r_rdy & (t_rcd[h_bank] == 0) & (head.write | (outstanding < D)))
        m.d.comb += colq.r_en.eq(issue)
        m.d.sync += [
            bk.req_valid.eq(issue), bk.req_write.eq(head.write), bk.req_addr.eq(head.addr),
            bk.req_wmask.eq(head.wmask), bk.req_wdata.eq(head.wdata),
        ]
        acc_rd = Signal()
        m.d.comb += acc_rd.eq(issue & ~head.write)

        # ---- bank timers, precharges (on demand, idle, refresh), activates
        pre_all = Signal()
        idle_pre = Signal(B)
        for b in range(B):
            q_inc = push & (a_bank == b)
            q_dec = issue & (h_bank == b)
            m.d.sync += queued[b].eq(queued[b] + q_inc - q_dec)
            for timer in (t_rcd, t_ras, t_rp):
                with m.If(timer[b] != 0):
                    m.d.sync += timer[b].eq(timer[b] - 1)
            quiet = (queued[b] == 0) & ~q_inc
            with m.If(is_open[b] & quiet):
                with m.If(idle[b] != 0):
                    m.d.sync += idle[b].eq(idle[b] - 1)
            with m.Else():
                m.d.sync += idle[b].eq(self.idle_close)
            m.d.comb += idle_pre[b].eq(is_open[b] & quiet & (idle[b] == 0) & (t_ras[b] == 0)
                                       & ~(do_pre & (a_bank == b)))
            close = (do_pre & (a_bank == b)) | idle_pre[b] | pre_all
            with m.If(close):
                m.d.sync += [is_open[b].eq(0), t_rp[b].eq(t["trp"] - 1)]
            with m.If(do_act & (a_bank == b)):
                m.d.sync += [is_open[b].eq(1), open_row[b].eq(a_row), t_rcd[b].eq(t["trcd"] - 1),
                             t_ras[b].eq(t["tras"] - 1)]
        with m.If(t_rrd != 0):
            m.d.sync += t_rrd.eq(t_rrd - 1)
        for k in range(4):
            with m.If(faw[k] != 0):
                m.d.sync += faw[k].eq(faw[k] - 1)
        with m.If(do_act):
            m.d.sync += [t_rrd.eq(t["trrd"] - 1), faw[faw_ptr].eq(t["tfaw"] - 1), faw_ptr.eq(faw_ptr + 1)]

        # ---- refresh: due every tREFI; drain, precharge all, tRP + tRFC busy
        with m.If(refi == 0):
            m.d.sync += [refi.eq(t["trefi"] - 1), ref_due.eq(1)]
        with m.Else():
            m.d.sync += refi.eq(refi - 1)
        ras_done = Cat(*(t_ras[b] == 0 for b in range(B))).all()
        m.d.comb += pre_all.eq(ref_due & (colq.level == 0) & ras_done)
        with m.If(pre_all):
            m.d.sync += [ref_due.eq(0), ref_busy.eq(t["trp"] + t["trfc"] - 1),
                         self.refreshes.eq(self.refreshes + 1)]
        with m.Elif(ref_busy != 0):
            m.d.sync += ref_busy.eq(ref_busy - 1)

        # ---- read latency: an issue bit travels L-1 registers and matures in
        # the L-th cycle after the column command's edge
        m.submodules.resp = f = fifo.SyncFIFO(width=8 * W, depth=D)
        line = Signal(L)
        m.d.sync += line.eq((line << 1) | acc_rd)
        mature_now = line[L - 1]
        matured = Signal(range(D + 1))
        eff = Signal(range(D + 2))
        m.d.comb += [f.w_en.eq(bk.resp_valid), f.w_data.eq(bk.resp_data), eff.eq(matured + mature_now)]
        m.d.comb += [
            port.rdata.valid.eq((eff != 0) & f.r_rdy),
            port.rdata.payload.eq(f.r_data),
            f.r_en.eq(port.rdata.ready & (eff != 0)),
        ]
        pop = Signal()
        m.d.comb += pop.eq(port.rdata.valid & port.rdata.ready)
        m.d.sync += [matured.eq(eff - pop), outstanding.eq(outstanding + acc_rd - pop)]
        with m.If((eff != 0) & ~f.r_rdy):
            m.d.sync += self.late.eq(1)

        # ---- counters
        waiting = port.cmd.valid & ~push
        with m.If(issue):
            with m.If(head.write):
                m.d.sync += self.wr_bytes.eq(self.wr_bytes + W)
            with m.Else():
                m.d.sync += self.rd_bytes.eq(self.rd_bytes + W)
        with m.If(waiting):
            m.d.sync += self.stall_cycles.eq(self.stall_cycles + 1)
            with m.If(halted):
                m.d.sync += self.refresh_stall_cycles.eq(self.refresh_stall_cycles + 1)
        with m.If(push & a_hit):
            m.d.sync += self.row_hits.eq(self.row_hits + 1)
        with m.If(do_act):
            m.d.sync += self.activates.eq(self.activates + 1)
        with m.If(do_pre):
            m.d.sync += self.row_conflicts.eq(self.row_conflicts + 1)
        return m


class StackedDRAM(wiring.Component):
    """The stacked DRAM: ``dram_channels`` independent :class:`DRAMChannel` s.

    Parameters
    ----------
    config : NPUConfig
    max_outstanding, idle_close : passed to every channel.

    Ports
    -----
    ports[c] : In(DRAMPortSignature)     channel c (addresses with ``addr % C == c``)
    bk[c] : Out(DRAMBackendSignature)    channel c's backend bus
    rd_bytes, wr_bytes : Out(48); stall_cycles, row_hits, activates, row_conflicts,
    refreshes, refresh_stall_cycles : Out(32)
        sums over the channels
    late, err_addr : Out(1)              any channel's sticky flag
    idle : Out(1)                        every channel is idle
    """

    def __init__(self, config, max_outstanding: int | None = None, idle_close: int | None = None):
        self.config = config
        self.channels = [DRAMChannel(config, c, max_outstanding, idle_close)
                         for c in range(config.dram_channels)]
        ch = self.channels[0]
        self.wbytes, self.addr_bits, self.latency = ch.wbytes, ch.addr_bits, ch.latency
        super().__init__({
            "ports": In(DRAMPortSignature(self.addr_bits, self.wbytes)).array(config.dram_channels),
            "bk": Out(DRAMBackendSignature(self.addr_bits, self.wbytes)).array(config.dram_channels),
            "rd_bytes": Out(48), "wr_bytes": Out(48),
            **{n: Out(32) for n in COUNTER_NAMES[2:]},
            "late": Out(1), "err_addr": Out(1), "idle": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        for c, ch in enumerate(self.channels):
            m.submodules[f"ch{c}"] = ch
            wiring.connect(m, wiring.flipped(self.ports[c]), ch.port)
            wiring.connect(m, ch.bk, wiring.flipped(self.bk[c]))
        for n in COUNTER_NAMES:
            m.d.comb += getattr(self, n).eq(sum(getattr(ch, n) for ch in self.channels))
        m.d.comb += [self.late.eq(Cat(ch.late for ch in self.channels).any()),
                     self.err_addr.eq(Cat(ch.err_addr for ch in self.channels).any()),
                     self.idle.eq(Cat(ch.idle for ch in self.channels).all())]
        return m
