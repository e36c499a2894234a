"""The NPU's performance counters: 64-bit job counts of cycles, bytes per
memory level and operations, read by the host as ``cnt_<name>_lo/_hi``.

Cycle and byte counters run while the job runs (bytes as the difference of
the memory system's free-running counters to a snapshot taken at the job's
start); the core's events (``Core.ev``) are counted as they happen, so a q
tile the core takes during the previous one's read-out counts once.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .core import event_layout
from .mem_common import word_bytes
from .npu_map import COUNTERS

__all__ = ["counters_layout", "PerfCounters"]

#: width of the memory system's byte counters (``MemorySystem`` ports)
BYTE_BITS = 48


def counters_layout() -> data.StructLayout:
    """One 64-bit member per name in ``COUNTERS``."""
    return data.StructLayout({name: 64 for name in COUNTERS})


class PerfCounters(wiring.Component):
    """Job performance counters.

    Ports
    -----
    clear : In(1)          a job starts: counters to 0, byte snapshots taken.
    running : In(1)        the job runs: cycles and bytes count.
    core_done : In(1)      the core finished a q tile.
    ev : In(event_layout)  the core's events this cycle (``mac_masked``: MAC slots skipped
                           at masked positions).
    sram_rd_bytes, sram_wr_bytes, dram_rd_bytes, dram_wr_bytes : In(48)
    tsv_rd_words, tsv_wr_words : In(32)        the memory system's free-running counts.
    counters : Out(counters_layout())
    """

    def __init__(self, config: NPUConfig):
        self.config = config
        members = {"clear": In(1), "running": In(1), "core_done": In(1), "ev": In(event_layout(config))}
        members.update({n: In(32) for n in ("tsv_rd_words", "tsv_wr_words")})
        members.update({n: In(BYTE_BITS) for n in ("sram_rd_bytes", "sram_wr_bytes",
                                                   "dram_rd_bytes", "dram_wr_bytes")})
        members["counters"] = Out(counters_layout())
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        cnt = self.counters
        cur = {"sram": self.sram_rd_bytes + self.sram_wr_bytes,
               "tsv": (self.tsv_rd_words + self.tsv_wr_words) * word_bytes(self.config),
               "dram": self.dram_rd_bytes + self.dram_wr_bytes}
        snap = {k: Signal(BYTE_BITS, name=f"snap_{k}") for k in cur}
        with m.If(self.running):
            m.d.sync += [cnt.total_cycles.eq(cnt.total_cycles + 1)]
            m.d.sync += [cnt[f"{k}_bytes"].eq(cur[k] - snap[k]) for k in cur]
        ev, RC = self.ev, self.config.array_rows * self.config.array_cols
        m.d.sync += [cnt.mac_busy_cycles.eq(cnt.mac_busy_cycles + ev.mac),
                     cnt.softmax_cycles.eq(cnt.softmax_cycles + ev.softmax),
                     cnt.dma_stall_cycles.eq(cnt.dma_stall_cycles + ev.stall),
                     cnt.mac_ops.eq(cnt.mac_ops + Mux(ev.mac, RC, 0)),
                     cnt.exp2_ops.eq(cnt.exp2_ops + Mux(ev.exp2, RC, 0)),
                     cnt.recip_ops.eq(cnt.recip_ops + Mux(ev.recip, self.config.array_rows, 0)),
                     cnt.mac_masked.eq(cnt.mac_masked + ev.masked),
                     # ASSUMPTION: 8 register-file bytes per MAC slot (read + write of
                     # the FP32 accumulator) and per exp2 (read S, write P)
                     cnt.reg_bytes.eq(cnt.reg_bytes + Mux(ev.mac, 8 * RC, 0) + Mux(ev.exp2, 8 * RC, 0)),
                     cnt.q_tiles.eq(cnt.q_tiles + self.core_done),
                     cnt.kv_tiles.eq(cnt.kv_tiles + ev.kv_tile)]
        with m.If(self.clear):               # after the updates above: a new job wins
            m.d.sync += [snap[k].eq(cur[k]) for k in cur]
            m.d.sync += [cnt[name].eq(0) for name in COUNTERS]
        return m
