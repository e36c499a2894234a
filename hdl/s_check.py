"""The S-tile check's hardware side: per kv tile, the count of non-zero P
entries the array wrote, queued for the host.

::

   PE PEXP ─pnz─► row sum ─► array sum ─► accumulate over the softmax of kv tile j
                                              │ the core leaves P.V of tile j
                                              ▼
                             FIFO (q tile, kv tile, count) ──► CSRs s_tile / s_count, pop by s_tile_pop

The host (``sim/cocotb_npu.py``) compares every entry with the golden
model's count of non-zero P in the same tile and stops the job when they
differ by more than its threshold, naming head, q tile and kv tile: a wrong
mask, a corrupted K or Q row, or a softmax fault shows up at the tile where
it happens instead of as a wrong O at the end.  A P entry is non-zero when
its key is visible and exp2(S - m) does not underflow in FP16, so the count
is exact, not statistical.  The entries wait in a FIFO of ``DEPTH``; when
the host does not keep up the newest are dropped and ``overflow`` is set.
"""

from __future__ import annotations

from amaranth import Module, Signal
from amaranth.lib import data, fifo, wiring
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .core import LEN_BITS, Phase
from .csr import RegisterMap

__all__ = ["STileMonitor", "DEPTH"]

#: queued tile counts
DEPTH = 8


class STileMonitor(wiring.Component):
    """Per-kv-tile counts of non-zero P (see the module docstring).

    Ports
    -----
    pnz : In(range(R * C + 1))   non-zero P this cycle (``Core.pnz``).
    phase : In(Phase), tile : In(LEN_BITS), core_done : In(1)   from the core.
    clear : In(1)                a job starts: counts, queue and flags cleared.
    en : In(1)                   queue the counts (``s_check.en``).
    pop : In(1)                  drop the head entry (``s_tile_pop``).
    head : Out(s_tile shape)     ``valid``, ``overflow``, ``q_tile``, ``kv_tile`` of the head entry.
    count : Out(32)              its count of non-zero P.
    """

    def __init__(self, config: NPUConfig, regmap: RegisterMap):
        self.config = config
        R, C = config.array_rows, config.array_cols
        super().__init__({
            "pnz": In(range(R * C + 1)), "phase": In(Phase), "tile": In(LEN_BITS), "core_done": In(1),
            "clear": In(1), "en": In(1), "pop": In(1),
            "head": Out(regmap["s_tile"].shape), "count": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        entry = data.StructLayout({"q_tile": self.head.q_tile.shape(), "kv_tile": self.head.kv_tile.shape(),
                                   "count": range(cfg.br * cfg.bc + 1)})
        m.submodules.queue = q = fifo.SyncFIFO(width=entry.size, depth=DEPTH)
        acc = Signal(range(cfg.br * cfg.bc + 1))
        q_tile = Signal(self.head.q_tile.shape())
        kv_tile = Signal(LEN_BITS)           # the tile of the P.V phase (it steps at its last cycle)
        in_pv = self.phase == Phase.PV
        was_pv = Signal()
        m.d.sync += [was_pv.eq(in_pv), acc.eq(acc + self.pnz)]
        with m.If(in_pv):
            m.d.sync += kv_tile.eq(self.tile)
        with m.If(self.core_done):
            m.d.sync += q_tile.eq(q_tile + 1)
        push = Signal(entry)
        m.d.comb += [push.q_tile.eq(q_tile), push.kv_tile.eq(kv_tile), push.count.eq(acc),
                     q.w_data.eq(push), q.w_en.eq(was_pv & ~in_pv & self.en), q.r_en.eq(self.pop)]
        with m.If(was_pv & ~in_pv):           # P.V of kv tile ``kv_tile`` ended: every count is in
            m.d.sync += acc.eq(self.pnz)
            with m.If(self.en & ~q.w_rdy):
                m.d.sync += self.head.overflow.eq(1)
        head = data.View(entry, q.r_data)
        m.d.comb += [self.head.valid.eq(q.r_rdy), self.head.q_tile.eq(head.q_tile),
                     self.head.kv_tile.eq(head.kv_tile), self.count.eq(head.count)]
        with m.If(self.clear):
            m.d.sync += [acc.eq(0), q_tile.eq(0), self.head.overflow.eq(0)]
        return m
