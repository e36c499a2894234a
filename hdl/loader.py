"""The tile loader: moves a q tile's Q, K, V and mask tiles from SRAM into
the core's tile buffers.

::

   controller ──qtile──► [ WQ ─ Q ─ (WK ─ K ─ WV ─ V ─ WM ─ M ─ REL) x n_kv ]
                                │ segment: rows x words
   SRAM port (LW bytes / request) ──► row assembly ──wr (one FP16 row)──► core buffers

The core takes one whole FP16 row per beat; the loader reads
``loader_lanes`` bus words per request (a wide SRAM port: two banks at
once), so a K+V tile pair (2*Bc*2*d bytes) moves in half the ~2*Bc*d/C
cycles the pair computes, and the next q tile's Q and K_0 load during the
last P.V and the read-out.  Only the valid rows of a partial tile are loaded
(``last`` on the final one); the other rows keep stale data, which the core
masks (case A5).

A tile is loaded once it is in SRAM and its core buffer is free: Q after
the DMA completed this q tile's Q descriptor (``done_count[Q] > seq``);
resident K/V/mask tiles after their descriptors completed
(``done_count[K] > k_base + j``, …); streamed ones when the DMA committed
the ping-pong half, which the loader releases (``pp_release``) after V (or
the mask) went out.

Simulation-time checks (``fail`` with ``fail_code``):

* ``BUF_OVERWRITE``: a row write hits a buffer the core still holds —
  injectable with ``job.double_q``, which loads each Q tile twice.
* ``KV_STALE``: a K or V tile has been in the core's buffers (its ``full``
  bit set) for ``job.stale_limit`` cycles without being consumed; ``stale``
  names the buffer, the kv tile and the q tile.  A delivered tile normally
  waits at most about two tile pairs (it is loaded while the previous kv
  tile computes).  Injectable with ``job.kv_extra``: the loader delivers one
  kv tile more than the core runs (without waiting for its data), so the
  next q tile finds that half taken and the job stalls.
"""

from __future__ import annotations

import enum

from amaranth import Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from flashnpu.config import NPUConfig

from .npu_map import COUNT_BITS, LEN_BITS, NPUError, Tag, job_layout, qtile_layout, sram_map
from .sram import SRAMPortSignature
from .tilebuf import BufSel, write_layout

__all__ = ["LoaderState", "TileLoader", "stale_layout"]


class LoaderState(enum.IntEnum):
    """Tile-loader state: wait for a buffer (W*), stream it (Q, K, V, M)."""
    IDLE = 0
    WQ = 1
    Q = 2
    WK = 3
    K = 4
    WV = 5
    V = 6
    WM = 7
    M = 8
    REL = 9


def stale_layout() -> data.StructLayout:
    """The stale K/V tile of a ``KV_STALE`` error: buffer, kv tile, q tile."""
    return data.StructLayout({"buf": BufSel, "tile": LEN_BITS, "q_tile": 8})


class TileLoader(wiring.Component):
    """SRAM -> core tile buffers (see the module docstring).

    Ports
    -----
    qtile : In(stream(qtile_layout))  the next q tile (taken when idle and ``run``).
    run : In(1)                       a job runs.
    job : In(job_layout)
    done_count : In(ArrayLayout(COUNT_BITS, len(Tag)))  DMA completions per tag.
    core_full : In(len(BufSel))       the core's buffers that are full (bit per BufSel).
    pp_full : In(2)                   the DMA's committed ping-pong halves.
    pp_release : Out(2)               one cycle: the loader is done with a half.
    sram : Out(SRAMPortSignature)     ``LW`` bytes per request (reads only).
    wr : Out(stream(write_layout))    one row per beat into the core (always accepted).
    busy : Out(1)                     a q tile is being loaded.
    fail : Out(1), fail_code : Out(NPUError)   a check fired (see the module docstring).
    stale : Out(stale_layout)         the first stale tile: ``buf`` (BufSel), ``tile``
        (kv tile index in its q tile), ``q_tile`` (q tiles handed over before it).
    """

    def __init__(self, config: NPUConfig):
        self.config = config
        self.map = sram_map(config)
        W, LW = self.map["W"], self.map["LW"]
        super().__init__({
            "qtile": In(stream.Signature(qtile_layout(config))),
            "run": In(1),
            "job": In(job_layout(config)),
            "done_count": In(data.ArrayLayout(COUNT_BITS, len(Tag))),
            "core_full": In(len(BufSel)),
            "pp_full": In(2), "pp_release": Out(2),
            "sram": Out(SRAMPortSignature.of(config, LW // W)),
            "wr": Out(stream.Signature(write_layout(config))),
            "busy": Out(1), "fail": Out(1), "fail_code": Out(NPUError), "stale": Out(stale_layout()),
        })

    def elaborate(self, platform):
        m = Module()
        cfg, mp = self.config, self.map
        Br, Bc, mhd = cfg.br, cfg.bc, cfg.max_head_dim
        LW = mp["LW"]
        lwb = exact_log2(LW)
        slot_bits = max(1, ceil_log2(cfg.kv_slots))
        job, cnt, full = self.job, self.done_count, self.core_full
        nslot = max(1, -(-2 * mhd // LW))    # requests per FP16 row at max_head_dim
        wql = Signal(range(2 * mhd // LW + 2))   # requests per FP16 row at head_dim
        m.d.comb += wql.eq((2 * job.head_dim + LW - 1) >> lwb)
        rowW = mp["row_bytes"] // LW

        L = LoaderState
        ls = Signal(L)
        t = Signal(qtile_layout(cfg))        # the q tile being loaded
        lj = Signal(LEN_BITS)                # its kv tile
        lhalf = lj[0]
        ld_left = Signal(LEN_BITS + 1)       # keys still to load
        ld_nk = Signal(LEN_BITS + 1)         # keys of kv tile lj
        m.d.comb += ld_nk.eq(Mux(ld_left >= Bc, Bc, Mux(ld_left == 0, 1, ld_left)))
        twice = Signal()                     # injected fault: load the Q tile again
        redo = Signal()
        extra = Signal()                     # injected fault: one kv tile more than the core runs
        extra_on = Signal()                  # ... it is being delivered
        m.d.comb += [self.busy.eq(ls != L.IDLE), self.qtile.ready.eq((ls == L.IDLE) & self.run)]

        seg = _Segments(m, cfg, mp, self.sram, nslot)
        lslot = Signal(32)                   # K/V source of kv tile lj: its slot or ping-pong half
        m.d.comb += lslot.eq(Mux(job.resident, mp["kv"] + lj[:slot_bits] * mp["slot"],
                                 mp["pp"] + Mux(lhalf, mp["pp_half"], 0)))
        lmask = Signal(32)
        m.d.comb += lmask.eq(Mux(job.resident, mp["mres"] + Mux(t.region, mp["mres_half"], 0)
                                 + lj[:slot_bits] * (Br * mp["mrow_bytes"]), lslot + mp["pp_m"]))
        kfree = ~full.bit_select(Mux(lhalf, BufSel.K1, BufSel.K0), 1)
        vfree = ~full.bit_select(Mux(lhalf, BufSel.V1, BufSel.V0), 1)
        mfree = ~full[BufSel.MASK]
        # K_j / V_j / mask_j in SRAM: resident, the DMA completed them (in
        # issue order); streaming, the DMA committed the ping-pong half
        k_in = Mux(job.resident, cnt[Tag.K] > t.k_base + lj, self.pp_full.bit_select(lhalf, 1))
        v_in = Mux(job.resident, cnt[Tag.V] > t.k_base + lj, 1)
        m_in = Mux(job.resident, cnt[Tag.M] > t.m_base + lj, 1)
        with m.Switch(ls):
            with m.Case(L.IDLE):
                with m.If(self.qtile.valid & self.qtile.ready):
                    m.d.sync += [ls.eq(L.WQ), lj.eq(0), twice.eq(job.double_q), extra.eq(job.kv_extra),
                                 t.eq(self.qtile.payload),
                                 ld_left.eq(self.qtile.payload.kv_end)]
            with m.Case(L.WQ):
                with m.If((cnt[Tag.Q] > t.seq) & (~full[BufSel.Q] | redo) & ~seg.on):
                    seg.start(BufSel.Q, mp["q"] + Mux(t.region, mp["q_half"], 0), t.nq, wql, rowW)
                    m.d.sync += [ls.eq(L.Q), redo.eq(0)]
            with m.Case(L.Q):
                with m.If(seg.done):
                    with m.If(twice):
                        m.d.sync += [ls.eq(L.WQ), twice.eq(0), redo.eq(1)]
                    with m.Else():
                        m.d.sync += ls.eq(L.WK)
            with m.Case(L.WK):
                with m.If((k_in | extra_on) & kfree & ~seg.on):
                    seg.start(Mux(lhalf, BufSel.K1, BufSel.K0), lslot, ld_nk, wql, rowW)
                    m.d.sync += ls.eq(L.K)
            with m.Case(L.K):
                with m.If(seg.done):
                    m.d.sync += ls.eq(L.WV)
            with m.Case(L.WV):
                with m.If((v_in | extra_on) & vfree & ~seg.on):
                    seg.start(Mux(lhalf, BufSel.V1, BufSel.V0), lslot + mp["slot_v"], ld_nk, wql, rowW)
                    m.d.sync += ls.eq(L.V)
            with m.Case(L.V):
                with m.If(seg.done):
                    m.d.sync += ls.eq(Mux(job.mask_en & ~extra_on, L.WM, L.REL))
            with m.Case(L.WM):
                with m.If(m_in & mfree & ~seg.on):
                    seg.start(BufSel.MASK, lmask, t.nq, 1, 1)
                    m.d.sync += ls.eq(L.M)
            with m.Case(L.M):
                with m.If(seg.done):
                    m.d.sync += ls.eq(L.REL)
            with m.Case(L.REL):
                with m.If(~seg.on):       # the last row write has gone out
                    m.d.comb += self.pp_release.eq(Mux(job.resident | extra_on, 0, Mux(lhalf, 0b10, 0b01)))
                    m.d.sync += [lj.eq(lj + 1), ld_left.eq(ld_left - ld_nk)]
                    with m.If(extra_on):
                        m.d.sync += [ls.eq(L.IDLE), extra_on.eq(0)]
                    with m.Elif((lj + 1 == t.n_kv) & extra):
                        m.d.sync += [ls.eq(L.WK), extra.eq(0), extra_on.eq(1)]
                    with m.Elif(lj + 1 == t.n_kv):
                        m.d.sync += ls.eq(L.IDLE)
                    with m.Else():
                        m.d.sync += ls.eq(L.WK)

        # one row per beat into the core, the cycle after its last word arrived
        wr_sel = Signal(BufSel)
        m.d.sync += wr_sel.eq(seg.sel)
        m.d.comb += [self.wr.valid.eq(seg.wr_valid), self.wr.payload.sel.eq(wr_sel),
                     self.wr.payload.row.eq(seg.wr_row), self.wr.payload.last.eq(seg.wr_last),
                     self.wr.payload.data.eq(seg.row_reg[:16 * mhd])]
        overwrite = seg.wr_valid & full.bit_select(wr_sel, 1)   # into a buffer the core still holds
        stale = self._stale_check(m, lj, t.seq)
        m.d.comb += [self.fail.eq(overwrite | stale),
                     self.fail_code.eq(Mux(overwrite, NPUError.BUF_OVERWRITE, NPUError.KV_STALE))]
        return m

    def _stale_check(self, m, lj, q_seq):
        """KV_STALE: per K/V buffer half, the cycles its ``full`` bit has been
        set while the job runs; the first half past ``job.stale_limit`` is
        named in ``stale`` (returns the comb "a half is stale")."""
        full = self.core_full
        hit = Signal()
        seen = Signal()
        for b in (BufSel.K0, BufSel.V0, BufSel.K1, BufSel.V1):
            age = Signal(32, name=f"age_{b.name.lower()}")
            tile = Signal(LEN_BITS, name=f"tile_{b.name.lower()}")
            q_tile = Signal(8, name=f"qtile_{b.name.lower()}")
            # the kv tile a half holds: the loader's while it writes that half
            with m.If(self.wr.valid & (self.wr.payload.sel == b)):
                m.d.sync += [tile.eq(lj), q_tile.eq(q_seq[:8])]
            with m.If(full[b] & self.run):
                m.d.sync += age.eq(age + 1)
            with m.Else():
                m.d.sync += age.eq(0)
            with m.If(full[b] & self.run & (age >= self.job.stale_limit)):
                m.d.comb += hit.eq(1)
                with m.If(~seen):
                    m.d.sync += [seen.eq(1), self.stale.buf.eq(b), self.stale.tile.eq(tile),
                                 self.stale.q_tile.eq(q_tile)]
        with m.If(~self.run):
            m.d.sync += seen.eq(0)
        return hit


class _Segments:
    """The loader's segment engine: reads ``rows`` x ``wpr`` SRAM words
    (``rstride`` words between rows) and assembles each row in ``row_reg``;
    ``wr_valid`` / ``wr_row`` / ``wr_last`` announce a finished row one cycle
    later, ``done`` pulses with the last row's data."""

    def __init__(self, m, cfg, mp, sp, nslot):
        LW = mp["LW"]
        self.m, self.lwb = m, exact_log2(LW)
        rows = max(cfg.br, cfg.bc)
        self.sel = Signal(BufSel)
        self.rows = Signal(range(rows + 1))
        self.wpr = Signal(range(nslot + 1))
        self.rstride = Signal(range(mp["row_bytes"] // LW + 1))   # words between rows
        self.on = Signal()
        self.done = Signal()
        self.row_reg = Signal(nslot * 8 * LW)
        self.wr_valid = Signal()
        self.wr_row = Signal(range(rows))
        self.wr_last = Signal()
        rq_row, rs_row = Signal(range(rows + 1)), Signal(range(rows + 1))
        rq_w, rs_w = Signal(range(nslot + 1)), Signal(range(nslot + 1))
        self.rq_addr, self.rq_rowaddr = Signal(32), Signal(32)
        self.rq_on = Signal()
        self._idx = (rq_row, rq_w, rs_row, rs_w)

        # request generator
        m.d.comb += [sp.req.valid.eq(self.rq_on), sp.req.payload.addr.eq(self.rq_addr),
                     sp.req.payload.write.eq(0), sp.rdata.ready.eq(1)]
        with m.If(sp.req.valid & sp.req.ready):
            with m.If(rq_w + 1 == self.wpr):
                m.d.sync += [rq_w.eq(0), rq_row.eq(rq_row + 1),
                             self.rq_rowaddr.eq(self.rq_rowaddr + self.rstride),
                             self.rq_addr.eq(self.rq_rowaddr + self.rstride)]
                with m.If(rq_row + 1 == self.rows):
                    m.d.sync += self.rq_on.eq(0)
            with m.Else():
                m.d.sync += [rq_w.eq(rq_w + 1), self.rq_addr.eq(self.rq_addr + 1)]
        # responses: assemble a row, write it to the core the next cycle
        m.d.sync += self.wr_valid.eq(0)
        m.d.comb += self.done.eq(0)
        with m.If(sp.rdata.valid & self.on):
            for s in range(nslot):
                with m.If(rs_w == s):
                    m.d.sync += self.row_reg[s * 8 * LW:(s + 1) * 8 * LW].eq(sp.rdata.payload)
            with m.If(rs_w + 1 == self.wpr):
                last_row = rs_row + 1 == self.rows
                m.d.sync += [rs_w.eq(0), rs_row.eq(rs_row + 1), self.wr_valid.eq(1), self.wr_row.eq(rs_row),
                             self.wr_last.eq(last_row)]
                with m.If(last_row):
                    m.d.sync += self.on.eq(0)
                    m.d.comb += self.done.eq(1)
            with m.Else():
                m.d.sync += rs_w.eq(rs_w + 1)

    def start(self, sel, base, rows, wpr, rstride):
        """Start a segment at SRAM byte address ``base`` (from inside an FSM case)."""
        rq_row, rq_w, rs_row, rs_w = self._idx
        a = base >> self.lwb if not isinstance(base, int) else base // (1 << self.lwb)
        self.m.d.sync += [self.sel.eq(sel), self.rows.eq(rows), self.wpr.eq(wpr), self.rstride.eq(rstride),
                          rq_row.eq(0), rq_w.eq(0), self.rq_addr.eq(a), self.rq_rowaddr.eq(a),
                          self.rq_on.eq(1), rs_row.eq(0), rs_w.eq(0), self.on.eq(1)]
