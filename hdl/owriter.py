"""The O writer: takes the core's O beats, writes row-major FP32 rows into
the SRAM O regions, and issues their write-back to DRAM.

::

   controller ──otile──► destination table (O_TILES entries: rows, DRAM address, stride)
   core ──o (row, n, C FP32 lanes)──► row assembly ──► SRAM port (OW bytes / write) ──► O region t % 2
                                                            rows in SRAM ──► write-back ──wb──► DMA port

* **Row assembly.**  The core streams O in its natural layout (beat
  (row, n) carries O[row, od*c + n] in lane c); the writer permutes one row
  (od beats) into row-major FP32 in a register (one static permutation per
  possible od) and writes it to the SRAM O region ``o_lanes`` words per
  request (C FP32 lanes, 4 words at 32 x 32): a row's writes take no more
  cycles than its od beats, so the read-out never waits.  The SRAM grants
  its wide ports first, the widest first, so the O writer is not throttled
  by the loader it overtakes.
* **Two O regions.**  q tile t uses region t % 2, which is free once the
  write-back of q tile t - 2 completed (``done_count[O]``); the core's O
  stream waits otherwise.
* **Chunked write-back.**  A descriptor per ``o_chunk`` rows (tag ``OP``)
  as soon as they are in SRAM, the rest of the q tile (tag ``O``) once all
  its rows are, so the write-back of q tile t runs during t + 1.
"""

from __future__ import annotations

from amaranth import Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from flashnpu.config import NPUConfig

from .core import out_layout
from .dma import Direction, descriptor_layout
from .npu_map import COUNT_BITS, O_TILES, Tag, job_layout, o_chunk, otile_layout, sram_map
from .sram import SRAMPortSignature

__all__ = ["OWriter"]


class OWriter(wiring.Component):
    """Core O stream -> SRAM O regions -> DRAM write-back descriptors.

    Ports
    -----
    o : In(stream(out_layout))          the core's O beats.
    otile : In(stream(otile_layout))    a q tile's O destination, in q-tile order
        (taken while fewer than ``O_TILES`` q tiles await their write-back).
    job : In(job_layout)
    clear : In(1)                       a job starts: counts to 0.
    active : In(1)                      write-back may be issued.
    done_o : In(COUNT_BITS)             completed write-backs (tag ``O``) in the job.
    sram : Out(SRAMPortSignature)       ``OW`` bytes per write.
    wb : Out(stream(descriptor_layout)) write-back descriptors, SRAM -> DRAM.
    idle : Out(1)                       every q tile taken is written back.
    """

    def __init__(self, config: NPUConfig):
        self.config = config
        self.map = sram_map(config)
        W, OW = self.map["W"], self.map["OW"]
        super().__init__({
            "o": In(stream.Signature(out_layout(config))),
            "otile": In(stream.Signature(otile_layout(config))),
            "job": In(job_layout(config)),
            "clear": In(1), "active": In(1), "done_o": In(COUNT_BITS),
            "sram": Out(SRAMPortSignature.of(config, OW // W)),
            "wb": Out(stream.Signature(descriptor_layout)),
            "idle": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg, mp = self.config, self.map
        Br, C, mhd = cfg.br, cfg.array_cols, cfg.max_head_dim
        OW = mp["OW"]
        owb = exact_log2(OW)
        odm = cfg.o_cols_per_pe(mhd)
        hd, od = self.job.head_dim, self.job.od

        # destination table, written in q-tile order at ``t_in``
        table = Signal(data.ArrayLayout(otile_layout(cfg), O_TILES))
        ix = exact_log2(O_TILES)
        t_in = Signal(COUNT_BITS)            # q tiles taken
        ob_t = Signal(COUNT_BITS)            # q tiles whose O beats the core has streamed
        ow_t = Signal(COUNT_BITS)            # q tiles whose O rows are all in SRAM
        owb_iss = Signal(COUNT_BITS)         # q tiles whose write-back is issued
        ow_row = Signal(range(Br + 1))       # rows of q tile ow_t in SRAM
        owb_rows = Signal(range(Br + 1))     # rows of q tile owb_iss written back
        with m.If(self.clear):               # before the updates below: they win
            m.d.sync += [t_in.eq(0), ob_t.eq(0), ow_t.eq(0), owb_iss.eq(0), ow_row.eq(0), owb_rows.eq(0)]
        m.d.comb += [self.otile.ready.eq(t_in - owb_iss < O_TILES), self.idle.eq(self.done_o == t_in)]
        with m.If(self.otile.valid & self.otile.ready):
            m.d.sync += [table[t_in[:ix]].eq(self.otile.payload), t_in.eq(t_in + 1)]

        self._write_back(m, table[owb_iss[:ix]], owb_iss, owb_rows, ow_t, ow_row)

        # SRAM writes: ``wol`` requests per row
        wol = Signal(range(4 * mhd // OW + 2))
        m.d.comb += wol.eq((4 * hd + OW - 1) >> owb)
        sp = self.sram
        asm = Signal(32 * mhd)               # the row being assembled
        asm_full = Signal()
        asm_row = Signal(range(Br))
        asm_last = Signal()                  # the q tile's last valid row
        asm_reg = Signal()                   # its O region
        owords = max(1, -(-4 * mhd // OW))
        wbuf = Signal(owords * 8 * OW)
        w_on = Signal()
        w_word = Signal(range(owords + 1))
        w_addr = Signal(32)
        w_last = Signal()
        tail = Signal(range(OW + 1))
        m.d.comb += tail.eq((4 * hd) & (OW - 1))
        last_word = w_word + 1 == wol
        w_fire = sp.req.valid & sp.req.ready
        w_free = ~w_on | (w_fire & last_word)
        m.d.comb += [sp.req.valid.eq(w_on), sp.req.payload.addr.eq(w_addr + w_word),
                     sp.req.payload.write.eq(1),
                     sp.req.payload.wdata.eq(wbuf.word_select(w_word, 8 * OW)),
                     sp.req.payload.wmask.eq(Mux(last_word & (tail != 0),
                                                 (Const(1, OW + 1) << tail) - 1, (1 << OW) - 1)),
                     sp.rdata.ready.eq(1)]
        with m.If(w_fire):
            m.d.sync += w_word.eq(w_word + 1)
            with m.If(last_word):
                m.d.sync += [w_on.eq(0), ow_row.eq(ow_row + 1)]
                with m.If(w_last):
                    m.d.sync += [ow_t.eq(ow_t + 1), ow_row.eq(0)]
        with m.If(asm_full & w_free):
            m.d.sync += [wbuf.eq(asm), w_on.eq(1), w_word.eq(0), w_last.eq(asm_last), asm_full.eq(0),
                         w_addr.eq(((mp["o"] + Mux(asm_reg, mp["o_half"], 0)) >> owb)
                                   + asm_row * (mp["orow_bytes"] // OW))]

        # row assembly from the core's beats; region ob_t % 2 is free once the
        # write-back of q tile ob_t - 2 completed
        beat = self.o.payload
        ob_nq = table[ob_t[:ix]].nq
        o_free = ob_t - self.done_o < 2
        m.d.comb += self.o.ready.eq((~asm_full | w_free) & o_free)
        with m.If(self.o.valid & self.o.ready):
            with m.Switch(od):
                for v in range(1, odm + 1):
                    with m.Case(v):
                        for e in range(min(mhd, v * C)):
                            with m.If(beat.n == e % v):
                                m.d.sync += asm[32 * e:32 * (e + 1)].eq(beat.data[e // v])
            with m.If(beat.n == od - 1):
                with m.If(beat.row < ob_nq):
                    m.d.sync += [asm_full.eq(1), asm_row.eq(beat.row), asm_last.eq(beat.row == ob_nq - 1),
                                 asm_reg.eq(ob_t[0])]
                with m.If(beat.row == ob_nq - 1):     # the core streams the valid rows only
                    m.d.sync += ob_t.eq(ob_t + 1)
        return m

    def _write_back(self, m, ent, owb_iss, owb_rows, ow_t, ow_row):
        """A write-back descriptor per ``o_chunk`` rows once they are in SRAM,
        the rest of the q tile (tag O) once all its rows are."""
        mp = self.map
        och = o_chunk(self.config)
        o_tile_in = ow_t != owb_iss          # the whole q tile is in SRAM
        o_chunk_in = ~o_tile_in & (ow_row >= owb_rows + och)
        d = self.wb.payload
        m.d.comb += [self.wb.valid.eq((o_tile_in | o_chunk_in) & self.active),
                     d.src.eq(mp["o"] + Mux(owb_iss[0], mp["o_half"], 0) + owb_rows * mp["orow_bytes"]),
                     d.dst.eq(ent.dst + owb_rows * ent.stride),
                     d.rows.eq(Mux(o_tile_in, ent.nq - owb_rows, och)),
                     d.bytes_per_row.eq(4 * self.job.head_dim), d.src_stride.eq(mp["orow_bytes"]),
                     d.dst_stride.eq(ent.stride), d.direction.eq(Direction.SRAM_TO_DRAM),
                     d.tag.eq(Mux(o_tile_in, Tag.O, Tag.OP))]
        with m.If(self.wb.valid & self.wb.ready):
            with m.If(o_tile_in):
                m.d.sync += [owb_iss.eq(owb_iss + 1), owb_rows.eq(0)]
            with m.Else():
                m.d.sync += owb_rows.eq(owb_rows + och)
