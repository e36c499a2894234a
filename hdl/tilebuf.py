"""The compute core's tile buffers: Q, K and V of the current tiles and the
mask, written a row per cycle by the loader and read by the operand feeders.

Design trade-off
----------------
Each buffer is split where its reader is: one Q buffer and one mask buffer
per PE row (they feed that row's ``a16`` bus and visibility bits), one K
buffer per PE column (its ``b16`` bus in the S phase), and one V buffer for
all columns (every column reads lane ``od*c + n`` of the same V row in P.V).
So every read is one word of one small memory per cycle, no crossbar.  K and
V hold two halves (ping-pong, kv tile parity), so the loader fills the next
tile's half while the core computes on this one; Q and the mask have one.
Rows are stored as flat words of ``max_head_dim`` FP16 lanes (lane 0 =
bits 0..15); the reads are synchronous, so the data arrive one cycle after
the address — the core's operand register.

::

   wr (sel, row, last, FP16 row) ─┬─► Q buffer   r: rows wr*r .. wr*r+wr-1 ──► q_data[r]
                                  ├─► mask buffer r (bits 0..Bc-1)         ──► m_data[r]
                                  ├─► K buffer c: halves K0/K1, rows wc*c.. ──► k_data[c]
                                  ├─► V buffer: halves V0/V1, rows 0..Bc-1 ──► v_data
                                  └─► full flags (set by ``last``, cleared by ``release``)
"""

from __future__ import annotations

import enum

from amaranth.hdl import Const, Module, Mux
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

__all__ = ["BufSel", "write_layout", "TileBuffers"]


class BufSel(enum.IntEnum):
    """Tile buffer selected by a row write (bit index in ``full``)."""
    Q = 0
    K0 = 1
    V0 = 2
    K1 = 3
    V1 = 4
    MASK = 5


def write_layout(config: NPUConfig) -> data.StructLayout:
    """Row write into a tile buffer: ``sel`` (BufSel), ``row`` (0..Br-1 for
    Q/mask, 0..Bc-1 for K/V), ``last`` (the buffer is full after this row),
    ``data`` (max_head_dim FP16 lanes, lane 0 = bits 0..15; a mask row uses
    bits 0..Bc-1)."""
    return data.StructLayout({
        "sel": BufSel, "row": range(max(config.br, config.bc)), "last": 1,
        "data": data.ArrayLayout(16, config.max_head_dim),
    })


def _onehot(v, width):
    """Bit ``v`` of a ``width``-bit value (0 when ``v >= width``)."""
    return (Const(1, width) << v)[0:width]


class TileBuffers(wiring.Component):
    """The core's Q, K0/K1, V0/V1 and mask buffers (see the module docstring).

    Parameters
    ----------
    config : NPUConfig

    Ports
    -----
    wr : In(stream.Signature(write_layout))
        Row writes, one per cycle, always ready.
    release : In(len(BufSel))
        Clears ``full`` bits (bit ``BufSel``) in this cycle.
    full : Out(len(BufSel))
        Buffer full flags: set by the write with ``last``, cleared by
        ``release``.
    half : In(1)
        K/V half the reads use (kv tile parity).
    q_row : In(range(wr))
        Row within every PE row's Q buffer (the Q.K^T step's ``a``).
    m_row : In(range(wr))
        Row within every PE row's mask buffer (the SCALE word's ``a``).
    k_row : In(range(wc))
        Row within every PE column's K half (the step's ``b``).
    v_row : In(range(max(max_head_dim, Bc) + 1))
        Row within the V half (the step's ``k``; meaningful below Bc).
    q_data[r] : Out(16 * max_head_dim), r < R; m_data[r] : Out(Bc), r < R
    k_data[c] : Out(16 * max_head_dim), c < C; v_data : Out(16 * max_head_dim)
        The addressed rows, one cycle after the address.
    """

    def __init__(self, config: NPUConfig):
        self.config = config
        R, C, Bc = config.array_rows, config.array_cols, config.bc
        lanes = 16 * config.max_head_dim
        super().__init__({
            "wr": In(stream.Signature(write_layout(config))),
            "release": In(len(BufSel)), "full": Out(len(BufSel)),
            "half": In(1), "q_row": In(range(config.rows_per_pe)), "m_row": In(range(config.rows_per_pe)),
            "k_row": In(range(config.cols_per_pe)),
            "v_row": In(range(max(config.max_head_dim, Bc) + 1)),
            # one port per row / column: a single R x 16 x max_head_dim-bit port
            # reaches Amaranth's 65,536-bit limit of one net at 32 x 32, d 128
            "q_data": Out(lanes).array(R), "m_data": Out(Bc).array(R),
            "k_data": Out(lanes).array(C), "v_data": Out(lanes),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        R, C, Bc = cfg.array_rows, cfg.array_cols, cfg.bc
        wr, wc = cfg.rows_per_pe, cfg.cols_per_pe
        lanes = 16 * cfg.max_head_dim   # tile rows are stored as flat words (lane 0 = bits 0..15)
        wdata = self.wr.payload.data.as_value()
        w = self.wr.payload
        full, release = self.full, self.release
        m.d.comb += self.wr.ready.eq(1)
        wvalid = self.wr.valid
        with m.If(wvalid & w.last):
            m.d.sync += full.eq((full & ~release) | _onehot(w.sel, len(BufSel)))
        with m.Else():
            m.d.sync += full.eq(full & ~release)

        for r in range(R):
            mem = Memory(shape=lanes, depth=wr, init=[])
            m.submodules[f"qbuf{r}"] = mem
            wp = mem.write_port()
            hit = (w.row >= wr * r) & (w.row < wr * (r + 1))
            m.d.comb += [wp.addr.eq(w.row - wr * r), wp.data.eq(wdata),
                         wp.en.eq(wvalid & hit & (w.sel == BufSel.Q))]
            rp = mem.read_port(domain="sync")
            m.d.comb += [rp.addr.eq(self.q_row), self.q_data[r].eq(rp.data)]
            mm = Memory(shape=Bc, depth=wr, init=[])
            m.submodules[f"mbuf{r}"] = mm
            wp = mm.write_port()
            m.d.comb += [wp.addr.eq(w.row - wr * r), wp.data.eq(wdata[0:Bc]),
                         wp.en.eq(wvalid & hit & (w.sel == BufSel.MASK))]
            rp = mm.read_port(domain="sync")
            m.d.comb += [rp.addr.eq(self.m_row), self.m_data[r].eq(rp.data)]
        for c in range(C):
            mem = Memory(shape=lanes, depth=2 * wc, init=[])
            m.submodules[f"kbuf{c}"] = mem
            wp = mem.write_port()
            hit = (w.row >= wc * c) & (w.row < wc * (c + 1))
            half = w.sel == BufSel.K1
            m.d.comb += [wp.addr.eq(Mux(half, wc, 0) + w.row - wc * c), wp.data.eq(wdata),
                         wp.en.eq(wvalid & hit & ((w.sel == BufSel.K0) | half))]
            rp = mem.read_port(domain="sync")
            m.d.comb += [rp.addr.eq(Mux(self.half, wc, 0) + self.k_row), self.k_data[c].eq(rp.data)]
        m.submodules.vbuf = vmem = Memory(shape=lanes, depth=2 * Bc, init=[])
        wp = vmem.write_port()
        vhalf = w.sel == BufSel.V1
        m.d.comb += [wp.addr.eq(Mux(vhalf, Bc, 0) + w.row), wp.data.eq(wdata),
                     wp.en.eq(wvalid & ((w.sel == BufSel.V0) | vhalf))]
        rp = vmem.read_port(domain="sync")
        m.d.comb += [rp.addr.eq(Mux(self.half, Bc, 0) + self.v_row), self.v_data.eq(rp.data)]
        return m
