"""2-D DMA with a descriptor queue, validation, ping-pong handshake; and the
memory system that composes DRAM timing, TSV links, DMA and SRAM.

Descriptors
-----------
A descriptor (``descriptor_layout``) moves ``rows`` rows of ``bytes_per_row``
bytes from ``src`` (row r at ``src + r*src_stride``) to ``dst`` (row r at
``dst + r*dst_stride``), DRAM -> SRAM (tile loads) or SRAM -> DRAM (O
write-back).  A Q/K/V tile of one head is one descriptor in either source
layout: ``[heads, seq, head_dim]`` has ``src_stride = head_dim*2``,
``[seq, heads, head_dim]`` has ``src_stride = heads*head_dim*2``.

Alignment rule (checked, ``MISALIGNED`` otherwise), one of:

* *word-aligned*: ``src``, ``dst``, ``src_stride`` and ``dst_stride`` are
  multiples of the bus word W (32 B by default), and ``bytes_per_row`` is a
  multiple of 2 (whole FP16 elements).  Such rows need no byte rotator, so
  every cycle moves up to a full word per channel; a row whose length is not
  a word multiple ends with a masked partial word (only its
  ``bytes_per_row`` bytes are written);
* *element gather/scatter*: ``bytes_per_row`` is 2, 4, ..., W/2 bytes (a
  power of two) and ``src``, ``dst`` and both strides are multiples of it
  (natural alignment), so no row crosses a word on either side.  Each row is
  one word access with a rotation by whole FP16 elements and a byte mask:
  one row per cycle.  Gathering 8 FP16 elements at an element stride of 2 is
  ``rows = 8, bytes_per_row = 2, src_stride = 4, dst_stride = 2``
  (case M2).

A descriptor that moves nothing (``rows == 0`` or ``bytes_per_row == 0``)
touches no memory and needs no queue slot: it completes at once with ``OK``
(case M2), whatever its addresses (it cannot commit a ping-pong half).

Validation happens when the descriptor is submitted, in one cycle (two
16x32-bit products for the row-end addresses; a timing-driven flow would
register them, adding a cycle of submit latency); a rejected
descriptor gets its completion record (``done`` stream: ``tag``, ``code``)
immediately and writes nothing.  Codes (:class:`DMAError`, the one list):
queue full, misaligned, source or destination outside
the configured region (``*_lo <= addr`` and ``end <= *_hi``), overlapping
destination rows (``rows > 1`` and ``dst_stride < bytes_per_row``), a
ping-pong descriptor outside its half or not DRAM -> SRAM, a non-ping-pong
write into the ping-pong window, and a link that is down when the descriptor
starts.  Every submitted descriptor yields exactly one completion.

Ping-pong handshake
-------------------
The ping-pong window is ``[pp_base, pp_base + 2*pp_half_bytes)`` of SRAM, two
halves.  A descriptor with ``pp_en`` must lie inside half ``pp_half``; it
starts only while that half is neither *full* nor awaiting a commit of an
earlier descriptor, and if ``pp_commit`` is set, the half becomes *full* once
its last byte is written (the K and V tiles of one kv tile are two
descriptors into one half, the second commits).  The consumer pulses
``pp_release[h]`` when it is done with half h.  Writing a full half is thus
impossible: the DMA waits.  A release of a half that is not full sets the
sticky ``pp_err``.  Prefetch: while the array consumes half j%2, the queue
already holds the descriptors of tile j+1 for the other half, so they run
during compute.

Engine
------
::

    desc ─► validate ─► queue ─► read generator ── one group per cycle ──► C channel access FIFOs ─► DRAM channel c
              │ reject           (SRAM-aligned groups of           │        (DRAM -> SRAM reads)       │ read data via
              ▼                   up to C words of one row)        └─ groups in flight (trk)           ▼ channel c's TSV
             done ◄── completion ◄── write side: takes each group when all its words are in, one wide SRAM write
                                     (SRAM -> DRAM: one wide SRAM read per group, one write per word to its channel)

Each box is one method of :class:`DMA`, called in this order by
``elaborate``: ``_queues`` (descriptor queue, completion FIFO, the write
side's descriptor FIFO, the groups in flight, the channel access FIFOs),
``_submit`` with ``_validate`` (validate, reject), ``_ping_pong`` (the
halves' full/pending state), ``_read_generator`` and ``_write_side`` (with
the completion).

Bandwidth: the DMA walks each descriptor in *groups*, up to C =
``dram_channels`` words of one row that fall in one C-word group of the SRAM
(its port is C words wide).  The DRAM words of a group are consecutive, so
they sit in C different channels (``hdl/dram.py``'s interleave): word i of
the group goes to channel ``(d + i) % C``, and the write side rotates the
channels' answers onto the SRAM lanes, so source and destination may have
any word alignment.  One group per cycle is C words per cycle, the DRAM roof;
rows that are contiguous on both sides are walked as one long row.  Up to
``track_depth`` groups (enough for the DRAM latency plus an activate) are in
flight, each channel keeps several reads outstanding, and completions come
in descriptor order.

The read generator starts the next descriptor in the cycle it issues the
last group of the current one (descriptors of the same direction only), so
DRAM latency is paid once per stream rather than once per descriptor; the
write side's descriptor FIFO (``ws_depth``) is deep enough for the
descriptors a stream has in flight.  A descriptor of the other direction
waits until the write side has drained, so an SRAM -> DRAM write-back never
reads SRAM before an earlier load has written it, and a load never
overwrites SRAM that an earlier write-back is still reading (separate read
and write engines would lift this).  An SRAM -> DRAM completion means every
word was issued by its DRAM channel (a later read sees it).  A host that
keeps at most ``queue_depth`` descriptors outstanding (submitted minus
completed) never sees ``QUEUE_FULL``.

MemorySystem
------------
At the bottom of this file, :class:`MemorySystem` wires DMA, the DRAM
channels, one TSV link pair per channel (read data DRAM->logic, write data
logic->DRAM) and the SRAM (DMA port + consumer ports + backdoor): the piece
the NPU top level instantiates.
"""

from __future__ import annotations

import enum

from amaranth import Array, Cat, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from .dram import COUNTER_NAMES, DRAMBackendSignature, DRAMPortSignature, StackedDRAM
from .mem_common import addr_bits_for, word_bytes
from .sram import SRAMPortSignature, StackedSRAM
from .tsv import TSVControlSignature, TSVLink

__all__ = ["Direction", "DMAError", "descriptor_layout", "completion_layout", "DMA", "MemorySystem"]


class Direction(enum.IntEnum):
    """Transfer direction of a descriptor."""
    DRAM_TO_SRAM = 0
    SRAM_TO_DRAM = 1


class DMAError(enum.IntEnum):
    """Completion codes of the DMA (written once; the driver uses this enum)."""
    OK = 0
    QUEUE_FULL = 1     #: the descriptor queue was full: refused
    MISALIGNED = 2     #: neither word-aligned nor an aligned element gather (module docstring)
    SRC_RANGE = 3      #: source rows reach outside the source region
    DST_RANGE = 4      #: destination rows reach outside the destination region
    DST_OVERLAP = 5    #: rows > 1 and dst_stride < bytes_per_row
    PP_RANGE = 6       #: ping-pong descriptor outside its half, or not DRAM->SRAM
    PP_WINDOW = 7      #: a non-ping-pong write into the ping-pong window
    LINK_DOWN = 8      #: the TSV link was not OK when the descriptor started


ADDR_BITS = 32
ROWS_BITS = 16
BPR_BITS = 16
TAG_BITS = 8

descriptor_layout = data.StructLayout({
    "src": ADDR_BITS,            # byte address
    "dst": ADDR_BITS,            # byte address
    "rows": ROWS_BITS,
    "bytes_per_row": BPR_BITS,
    "src_stride": ADDR_BITS,     # bytes
    "dst_stride": ADDR_BITS,     # bytes
    "direction": Direction,
    "pp_en": 1,
    "pp_half": 1,
    "pp_commit": 1,
    "tag": TAG_BITS,
})
"""DMA descriptor (172 bits).  Field order is the bit order, LSB first."""

completion_layout = data.StructLayout({
    "tag": TAG_BITS,
    "code": DMAError,
})
"""Completion record: the descriptor's tag and its :class:`DMAError` code."""


class DMA(wiring.Component):
    """2-D DMA engine between the DRAM channels and a wide SRAM port.

    Parameters
    ----------
    config : NPUConfig
        Bus word W (``word_bytes``), ``dram_channels`` C (the SRAM port moves
        C words per request, so ``sram_banks`` must be a multiple of C), SRAM
        and DRAM sizes (address widths), DRAM latency and tRCD (the depth of
        the in-flight group FIFO).
    queue_depth : int
        Descriptor queue entries (>= 1).
    done_depth : int
        Completion FIFO entries (>= 1).

    Ports
    -----
    desc : In(stream(descriptor_layout))
        Submit.  ``ready`` is high whenever the completion FIFO can take a
        record and the write side is not retiring a descriptor in that cycle;
        every accepted beat is queued or rejected with a code (a full queue
        gives ``QUEUE_FULL``, it never back-pressures).
    done : Out(stream(completion_layout))
    dram[c] : Out(DRAMPortSignature)   channel c (cmd, wdata out; rdata in)
    dram_idle : In(1)
        Every DRAM channel has issued all it accepted (an SRAM -> DRAM
        descriptor completes only then).
    sram : Out(SRAMPortSignature, C words wide)   (req out; rdata in)
    dram_lo, dram_hi, sram_lo, sram_hi : In(ADDR_BITS)
        Allowed byte regions ``[lo, hi)`` for sources and destinations.
    pp_base, pp_half_bytes : In(ADDR_BITS)
        Ping-pong window in SRAM (bytes); ``pp_half_bytes == 0`` disables it.
    pp_release : In(2)
        Consumer releases half h (one-cycle pulse on bit h).
    pp_full : Out(2), pp_err : Out(1)
    link_ok : In(1)
        The TSV links are OK (sampled when a descriptor starts).
    busy : Out(1)
    bytes_moved : Out(48)      bytes written to the destination (row bytes).
    beats : Out(32)            words written.
    active_cycles : Out(32)    cycles with any descriptor in flight.
    n_done, n_rejected : Out(32)   completions with ``OK`` (empty ones included) / with an error.

    Raises
    ------
    ValueError
        For bad depths or a configuration whose widths disagree.
    """

    def __init__(self, config, queue_depth: int = 4, done_depth: int = 4):
        for name, v in (("queue_depth", queue_depth), ("done_depth", done_depth)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, not {v!r}")
        if config.sram_banks % config.dram_channels:
            raise ValueError(f"sram_banks={config.sram_banks} must be a multiple of "
                             f"dram_channels={config.dram_channels} (the DMA's SRAM port is one word per channel)")
        self.config = config
        self.queue_depth = queue_depth
        self.done_depth = done_depth
        self.wbytes = word_bytes(config)
        self.wbits = exact_log2(self.wbytes)
        self.C = config.dram_channels
        self.cbits = exact_log2(self.C)
        self.sram_addr_bits = addr_bits_for(config.sram_bytes, self.wbytes)
        self.dram_addr_bits = addr_bits_for(config.dram_bytes, self.wbytes)
        #: groups in flight between issue and write (covers latency + tRCD)
        self.track_depth = 1 << ceil_log2(config.dram_latency_cycles + config.dram_timing_cycles()["trcd"] + 16)
        #: started descriptors the write side holds: enough that descriptors of
        #: 32 groups (8 KiB at 8 x 32 B, a head_dim-64 tile) follow each other
        #: without a gap across the read path (latency + tRCD + a few stages)
        self.ws_depth = max(2, -(-(config.dram_latency_cycles + config.dram_timing_cycles()["trcd"] + 8) // 32) + 1)
        super().__init__({
            "desc": In(stream.Signature(descriptor_layout)),
            "done": Out(stream.Signature(completion_layout)),
            "dram": Out(DRAMPortSignature(self.dram_addr_bits, self.wbytes)).array(self.C),
            "dram_idle": In(1),
            "sram": Out(SRAMPortSignature.of(config, self.C)),
            "dram_lo": In(ADDR_BITS), "dram_hi": In(ADDR_BITS),
            "sram_lo": In(ADDR_BITS), "sram_hi": In(ADDR_BITS),
            "pp_base": In(ADDR_BITS), "pp_half_bytes": In(ADDR_BITS),
            "pp_release": In(2), "pp_full": Out(2), "pp_err": Out(1),
            "link_ok": In(1),
            "busy": Out(1),
            "bytes_moved": Out(48), "beats": Out(32), "active_cycles": Out(32),
            "n_done": Out(32), "n_rejected": Out(32),
        })

    # ----------------------------------------------------------- validation
    def _validate(self, m, d):
        """Combinational check of descriptor ``d``; returns ``(code, empty)``:
        a DMAError signal (``OK`` for an empty descriptor) and whether ``d``
        moves nothing (0 rows or 0 bytes per row)."""
        W = self.wbytes
        code = Signal(DMAError, name="chk_code")
        low = W - 1
        addr_or = d.src | d.dst | d.src_stride | d.dst_stride
        bpr = d.bytes_per_row
        gather_ok = (bpr < W) & ((bpr & (bpr - 1)) == 0) & ((addr_or & (bpr - 1)) == 0)
        misaligned = d.bytes_per_row[0] | (((addr_or & low) != 0) & ~gather_ok)
        rows_m1 = Signal(ROWS_BITS)
        m.d.comb += rows_m1.eq(d.rows - 1)
        src_end = Signal(ADDR_BITS + ROWS_BITS + 2)
        dst_end = Signal(ADDR_BITS + ROWS_BITS + 2)
        m.d.comb += [
            src_end.eq(d.src + rows_m1 * d.src_stride + d.bytes_per_row),
            dst_end.eq(d.dst + rows_m1 * d.dst_stride + d.bytes_per_row),
        ]
        d2s = d.direction == Direction.DRAM_TO_SRAM
        src_lo = Mux(d2s, self.dram_lo, self.sram_lo)
        src_hi = Mux(d2s, self.dram_hi, self.sram_hi)
        dst_lo = Mux(d2s, self.sram_lo, self.dram_lo)
        dst_hi = Mux(d2s, self.sram_hi, self.dram_hi)
        src_bad = (d.src < src_lo) | (src_end > src_hi)
        dst_bad = (d.dst < dst_lo) | (dst_end > dst_hi)
        overlap = (d.rows > 1) & (d.dst_stride < d.bytes_per_row)
        pp_on = self.pp_half_bytes != 0
        half_lo = Signal(ADDR_BITS + 2)
        half_hi = Signal(ADDR_BITS + 2)
        pp_end = Signal(ADDR_BITS + 2)
        m.d.comb += [
            half_lo.eq(self.pp_base + Mux(d.pp_half, self.pp_half_bytes, 0)),
            half_hi.eq(half_lo + self.pp_half_bytes),
            pp_end.eq(self.pp_base + 2 * self.pp_half_bytes),
        ]
        pp_bad = d.pp_en & (~pp_on | ~d2s | (d.dst < half_lo) | (dst_end > half_hi))
        win_bad = ~d.pp_en & d2s & pp_on & (d.dst < pp_end) & (dst_end > self.pp_base)
        empty = Signal(name="chk_empty")
        m.d.comb += empty.eq((d.rows == 0) | (d.bytes_per_row == 0))
        with m.If(empty):
            m.d.comb += code.eq(DMAError.OK)         # completes at once (``_submit``)
        with m.Elif(misaligned):
            m.d.comb += code.eq(DMAError.MISALIGNED)
        with m.Elif(src_bad):
            m.d.comb += code.eq(DMAError.SRC_RANGE)
        with m.Elif(dst_bad):
            m.d.comb += code.eq(DMAError.DST_RANGE)
        with m.Elif(overlap):
            m.d.comb += code.eq(DMAError.DST_OVERLAP)
        with m.Elif(pp_bad):
            m.d.comb += code.eq(DMAError.PP_RANGE)
        with m.Elif(win_bad):
            m.d.comb += code.eq(DMAError.PP_WINDOW)
        with m.Else():
            m.d.comb += code.eq(DMAError.OK)
        return code, empty

    def elaborate(self, platform):
        m = Module()
        queue, done_q, ws_q, trk, chq = self._queues(m)
        ws_completing, reject, rej_rec = self._submit(m, queue, done_q)
        full, pend, set_full, set_pend, clr_pend = self._ping_pong(m)
        rg_active = self._read_generator(m, queue, ws_q, trk, chq, full, pend, set_pend)
        self._write_side(m, ws_q, trk, chq, done_q, ws_completing, reject, rej_rec, set_full, clr_pend)

        m.d.comb += self.busy.eq(queue.r_rdy | rg_active | ws_q.r_rdy)
        with m.If(rg_active | ws_q.r_rdy):
            m.d.sync += self.active_cycles.eq(self.active_cycles + 1)
        return m

    def _ws_layout(self):
        """A started descriptor as the write side needs it (``ws_q`` entry)."""
        return data.StructLayout({
            "rows": ROWS_BITS, "bytes_per_row": BPR_BITS, "tail_mask": self.wbytes, "direction": Direction,
            "pp_en": 1, "pp_half": 1, "pp_commit": 1, "tag": TAG_BITS, "code": DMAError,
        })

    def _group_layout(self):
        """One group in flight (``trk`` entry): up to C words of one row,
        SRAM words ``lo .. lo+cnt-1`` of SRAM group ``sgrp``, DRAM words
        ``d .. d+cnt-1``; ``tail``: the group holds the row's last word;
        ``last``: the descriptor's last group; ``rot``, ``moff``: an element
        gather's rotation (destination minus source byte offset, mod W) and
        destination byte offset, 0 otherwise."""
        return data.StructLayout({
            "sgrp": self.sram_addr_bits - self.cbits, "d": self.dram_addr_bits,
            "lo": max(1, self.cbits), "cnt": self.cbits + 1, "tail": 1, "last": 1,
            "rot": self.wbits, "moff": self.wbits,
        })

    def _chq_layout(self):
        """One DRAM access waiting for its channel (``chq[c]`` entry)."""
        return data.StructLayout({"addr": self.dram_addr_bits, "write": 1, "wmask": self.wbytes,
                                  "wdata": 8 * self.wbytes})

    # ------------------------------------------------------------ queues
    def _queues(self, m):
        """The descriptor queue, the completion FIFO (drives ``done``), the
        FIFO of started descriptors for the write side (``ws_depth``), the FIFO of
        groups in flight and one access FIFO per DRAM channel (drives
        ``dram[c]``).  Returns ``(queue, done_q, ws_q, trk, chq)``."""
        m.submodules.queue = queue = fifo.SyncFIFO(width=descriptor_layout.size, depth=self.queue_depth)
        m.submodules.done_q = done_q = fifo.SyncFIFO(width=completion_layout.size, depth=self.done_depth)
        m.submodules.ws_q = ws_q = fifo.SyncFIFO(width=self._ws_layout().size, depth=self.ws_depth)
        m.submodules.trk = trk = fifo.SyncFIFOBuffered(width=self._group_layout().size, depth=self.track_depth)
        chq = []
        for c in range(self.C):
            f = fifo.SyncFIFO(width=self._chq_layout().size, depth=4)
            m.submodules[f"chq{c}"] = f
            chq.append(f)
            e = data.View(self._chq_layout(), f.r_data)
            port = self.dram[c]
            m.d.comb += [
                port.cmd.valid.eq(f.r_rdy), port.cmd.payload.addr.eq(e.addr),
                port.cmd.payload.write.eq(e.write), port.cmd.payload.wmask.eq(e.wmask),
                port.wdata.valid.eq(f.r_rdy & e.write), port.wdata.payload.eq(e.wdata),
                f.r_en.eq(port.cmd.ready),
            ]
        m.d.comb += [
            self.done.valid.eq(done_q.r_rdy),
            self.done.payload.eq(done_q.r_data),
            done_q.r_en.eq(self.done.ready),
        ]
        return queue, done_q, ws_q, trk, chq

    # ------------------------------------------------- submit + validate
    def _submit(self, m, queue, done_q):
        """Accept a descriptor: validate it, queue it or build its rejection
        record.  Returns ``(ws_completing, reject, rej_rec)``: the write
        side's completion strobe (input: it blocks a submit), the reject
        strobe and record (for the completion FIFO)."""
        code, empty = self._validate(m, self.desc.payload)
        ws_completing = Signal()        # write side pushes a completion this cycle
        m.d.comb += self.desc.ready.eq(done_q.w_rdy & ~ws_completing)
        submit = self.desc.valid & self.desc.ready
        reject_code = Signal(DMAError)
        m.d.comb += reject_code.eq(Mux(code != DMAError.OK, code,
                                       Mux(empty, DMAError.OK, DMAError.QUEUE_FULL)))
        reject = Signal()               # completes at submit: rejected, or empty (OK)
        m.d.comb += reject.eq(submit & ((code != DMAError.OK) | empty | ~queue.w_rdy))
        m.d.comb += [
            queue.w_data.eq(self.desc.payload.as_value()),
            queue.w_en.eq(submit & (code == DMAError.OK) & ~empty),
        ]
        rej_rec = data.View(completion_layout, Signal(completion_layout.size, name="rej_rec"))
        m.d.comb += [rej_rec.tag.eq(self.desc.payload.tag), rej_rec.code.eq(reject_code)]
        with m.If(reject & (reject_code != DMAError.OK)):
            m.d.sync += self.n_rejected.eq(self.n_rejected + 1)
        return ws_completing, reject, rej_rec

    # --------------------------------------------------- ping-pong state
    def _ping_pong(self, m):
        """Per half: *full* and *commit pending*, ``pp_release`` and the
        sticky ``pp_err``.  Returns ``(full, pend, set_full, set_pend,
        clr_pend)``; the set/clear strobes are driven by the read generator
        (a committing descriptor starts) and the write side (it completes)."""
        full = Signal(2)
        pend = Signal(2)                 # a commit to this half is in flight
        m.d.comb += self.pp_full.eq(full)
        set_full = Signal(2)
        set_pend = Signal(2)
        clr_pend = Signal(2)
        rel = self.pp_release & full
        with m.If((self.pp_release & ~full) != 0):
            m.d.sync += self.pp_err.eq(1)
        m.d.sync += [
            full.eq((full & ~rel) | set_full),
            pend.eq((pend & ~clr_pend) | set_pend),
        ]
        return full, pend, set_full, set_pend, clr_pend

    # ---------------------------------------------------- read generator
    def _read_generator(self, m, queue, ws_q, trk, chq, full, pend, set_pend):
        """Start the queue's head descriptor (direction and ping-pong rules,
        a ``ws_q`` record for the write side) and walk it in groups: up to
        C words of one row per cycle, aligned to the SRAM port's C-word
        groups.  DRAM -> SRAM: one read per word into the access FIFOs of
        the word's channels; SRAM -> DRAM: one wide SRAM read.  Each group
        goes into ``trk`` for the write side.  Returns ``rg_active``."""
        W, wb, C, cb = self.wbytes, self.wbits, self.C, self.cbits
        head = data.View(descriptor_layout, queue.r_data)
        rg_active = Signal()
        rg_dir = Signal(Direction)
        s_row = Signal(ADDR_BITS)           # SRAM byte address of the row's first byte
        d_row = Signal(ADDR_BITS)           # DRAM byte address of the row's first byte
        s_stride = Signal(ADDR_BITS)        # bytes
        d_stride = Signal(ADDR_BITS)
        k = Signal(ADDR_BITS)               # word of the row
        wpr = Signal(ADDR_BITS)             # words per row
        row = Signal(ROWS_BITS)
        rows = Signal(ROWS_BITS)
        last_dir = Signal(Direction)

        words_of = Signal(BPR_BITS)
        m.d.comb += words_of.eq((head.bytes_per_row + (W - 1)) >> wb)
        tail = Signal(range(W + 1))
        m.d.comb += tail.eq(head.bytes_per_row - ((words_of - 1) << wb))
        tail_mask = Signal(W)
        m.d.comb += tail_mask.eq((Const(1, W + 1) << tail) - 1)
        # rows back to back on both sides (no partial word): walk as one row
        contiguous = (head.src_stride == head.bytes_per_row) & (head.dst_stride == head.bytes_per_row) & \
            (tail == W)

        ws_empty = ~ws_q.r_rdy
        dir_ok = (ws_empty & ~rg_active) | (head.direction == last_dir)
        pp_ok = ~head.pp_en | ~(full.bit_select(head.pp_half, 1) | pend.bit_select(head.pp_half, 1))
        finishing = Signal()                # the last group of the current descriptor goes out now
        can_start = queue.r_rdy & (~rg_active | finishing) & dir_ok & pp_ok & ws_q.w_rdy
        ws_rec = data.View(self._ws_layout(), Signal(self._ws_layout().size, name="ws_rec"))
        m.d.comb += [
            ws_rec.rows.eq(head.rows), ws_rec.bytes_per_row.eq(head.bytes_per_row),
            ws_rec.tail_mask.eq(tail_mask), ws_rec.direction.eq(head.direction),
            ws_rec.pp_en.eq(head.pp_en), ws_rec.pp_half.eq(head.pp_half),
            ws_rec.pp_commit.eq(head.pp_commit), ws_rec.tag.eq(head.tag),
            ws_rec.code.eq(Mux(self.link_ok, DMAError.OK, DMAError.LINK_DOWN)),
            ws_q.w_data.eq(ws_rec.as_value()),
            ws_q.w_en.eq(can_start),
            queue.r_en.eq(can_start),
        ]
        d2s_head = head.direction == Direction.DRAM_TO_SRAM
        with m.If(can_start):
            m.d.sync += last_dir.eq(head.direction)
            with m.If(self.link_ok):
                m.d.sync += [
                    rg_active.eq(1), rg_dir.eq(head.direction), k.eq(0), row.eq(0),
                    s_row.eq(Mux(d2s_head, head.dst, head.src)),
                    d_row.eq(Mux(d2s_head, head.src, head.dst)),
                    s_stride.eq(Mux(d2s_head, head.dst_stride, head.src_stride)),
                    d_stride.eq(Mux(d2s_head, head.src_stride, head.dst_stride)),
                    wpr.eq(Mux(contiguous, head.rows * words_of, words_of)),
                    rows.eq(Mux(contiguous, 1, head.rows)),
                ]
                with m.If(head.pp_en & head.pp_commit):
                    m.d.comb += set_pend.eq(Mux(head.pp_half, 0b10, 0b01))
            with m.Else():
                m.d.sync += rg_active.eq(0)

        # the group at (row, k)
        s = Signal(ADDR_BITS)
        d = Signal(ADDR_BITS)
        lo = Signal(max(1, cb))
        rem = Signal(ADDR_BITS)
        cnt = Signal(cb + 1)
        m.d.comb += [s.eq((s_row >> wb) + k), d.eq((d_row >> wb) + k), lo.eq(s[:cb] if cb else 0),
                     rem.eq(wpr - k)]
        m.d.comb += cnt.eq(Mux(rem < C - lo, rem, C - lo))
        row_end = rem == cnt
        last_row = row == rows - 1
        # byte offsets in the word: non-zero only in an element gather (one word per row)
        dst_off = Mux(rg_dir == Direction.DRAM_TO_SRAM, s_row[:wb], d_row[:wb])
        src_off = Mux(rg_dir == Direction.DRAM_TO_SRAM, d_row[:wb], s_row[:wb])
        g = data.View(self._group_layout(), Signal(self._group_layout().size, name="group"))
        m.d.comb += [g.sgrp.eq(s >> cb), g.d.eq(d), g.lo.eq(lo), g.cnt.eq(cnt), g.tail.eq(row_end),
                     g.last.eq(row_end & last_row), g.rot.eq(dst_off - src_off), g.moff.eq(dst_off),
                     trk.w_data.eq(g.as_value())]

        fire = Signal()
        with m.If(rg_dir == Direction.DRAM_TO_SRAM):
            room = Cat(*(f.w_rdy for f in chq)).all()
            m.d.comb += fire.eq(rg_active & trk.w_rdy & room)
            for c, f in enumerate(chq):
                i = Signal(cb + 1, name=f"rg_i{c}")
                m.d.comb += i.eq((c - d) & (C - 1))
                e = data.View(self._chq_layout(), Signal(self._chq_layout().size, name=f"rg_acc{c}"))
                m.d.comb += [e.addr.eq(d + i), e.write.eq(0), e.wmask.eq(0), e.wdata.eq(0)]
                with m.If(fire & (i < cnt)):
                    m.d.comb += [f.w_en.eq(1), f.w_data.eq(e.as_value())]
        with m.Else():
            m.d.comb += [
                self.sram.req.valid.eq(rg_active & trk.w_rdy),
                self.sram.req.payload.addr.eq(s >> cb),
                self.sram.req.payload.write.eq(0),
                fire.eq(rg_active & trk.w_rdy & self.sram.req.ready),
            ]
        m.d.comb += trk.w_en.eq(fire)
        m.d.comb += finishing.eq(fire & row_end & last_row)
        with m.If(fire & ~(finishing & can_start)):     # else the next descriptor's start wins
            with m.If(row_end):
                m.d.sync += [k.eq(0), row.eq(row + 1), s_row.eq(s_row + s_stride), d_row.eq(d_row + d_stride)]
                with m.If(last_row):
                    m.d.sync += rg_active.eq(0)
            with m.Else():
                m.d.sync += k.eq(k + cnt)
        return rg_active

    # -------------------------------------------------------- write side
    def _write_side(self, m, ws_q, trk, chq, done_q, ws_completing, reject, rej_rec, set_full, clr_pend):
        """Complete the groups of ``trk`` in order and retire the descriptor
        at ``ws_q``'s head into the completion FIFO (which also takes the
        submit side's rejections).  DRAM -> SRAM: once every channel of the
        group has its word, one wide SRAM write (lane j takes channel
        ``(j + d - lo) % C``).  SRAM -> DRAM: once the SRAM data is back,
        one write per word into its channel's access FIFO.  Drives
        ``ws_completing``, ``set_full`` and ``clr_pend``."""
        W, C, cb = self.wbytes, self.C, self.cbits
        cur = data.View(self._ws_layout(), ws_q.r_data)
        g = data.View(self._group_layout(), trk.r_data)
        ws_done = Signal()
        rot = Signal(max(1, cb))
        m.d.comb += rot.eq(g.d - g.lo)
        ones = Const((1 << W) - 1, W)
        tmask = Signal(W)           # the row's last word's byte mask, at the gather's offset
        m.d.comb += tmask.eq(cur.tail_mask << g.moff)

        def rotated(word, name):
            """``word`` rotated up by ``g.rot`` bytes (whole FP16 elements)."""
            w = Signal(8 * W, name=name)
            m.d.comb += w.eq(word)
            return Array(w.rotate_left(16 * i) for i in range(W // 2))[g.rot >> 1]
        fire = Signal()
        ok = ws_q.r_rdy & ~ws_done & trk.r_rdy
        # channel c carries word i = (c - d) % C of the group
        need = []
        for c in range(C):
            i = Signal(cb + 1, name=f"ws_i{c}")
            m.d.comb += i.eq((c - g.d) & (C - 1))
            n = Signal(name=f"ws_need{c}")
            m.d.comb += n.eq(i < g.cnt)
            need.append((i, n))
        with m.If(cur.direction == Direction.DRAM_TO_SRAM):
            have = Cat(*(~n | self.dram[c].rdata.valid for c, (_, n) in enumerate(need))).all()
            wdata = []
            wmask = []
            rdata = Array(self.dram[c].rdata.payload for c in range(C))
            gathered = Signal(8 * W)        # an element gather's one word (lane lo)
            m.d.comb += gathered.eq(rotated(rdata[g.d & (C - 1)], "gather_in"))
            for j in range(C):
                # (lane j >= lo is always true for the last lane)
                act = ((j >= g.lo) if j < C - 1 else 1) & (j < g.lo + g.cnt)
                lastw = g.tail & (j == g.lo + g.cnt - 1)
                wdata.append(Mux(g.rot != 0, gathered, rdata[(j + rot) & (C - 1)]))
                wmask.append(Mux(act, Mux(lastw, tmask, ones), 0))
            m.d.comb += [
                self.sram.req.valid.eq(ok & have),
                self.sram.req.payload.addr.eq(g.sgrp),
                self.sram.req.payload.write.eq(1),
                self.sram.req.payload.wdata.eq(Cat(*wdata)),
                self.sram.req.payload.wmask.eq(Cat(*wmask)),
                fire.eq(ok & have & self.sram.req.ready),
            ]
            for c, (_, n) in enumerate(need):
                m.d.comb += self.dram[c].rdata.ready.eq(fire & n)
        with m.Else():
            room = Cat(*(f.w_rdy for f in chq)).all()
            m.d.comb += [fire.eq(ok & self.sram.rdata.valid & room), self.sram.rdata.ready.eq(fire)]
            lanes = [self.sram.rdata.payload[8 * W * j:8 * W * (j + 1)] for j in range(C)]
            lane_of = Array(lanes)
            scattered = Signal(8 * W)       # an element scatter's one word (from lane lo)
            m.d.comb += scattered.eq(rotated(lane_of[g.lo], "scatter_in"))
            for c, (i, n) in enumerate(need):
                e = data.View(self._chq_layout(), Signal(self._chq_layout().size, name=f"ws_acc{c}"))
                m.d.comb += [e.addr.eq(g.d + i), e.write.eq(1),
                             e.wmask.eq(Mux(g.tail & (i == g.cnt - 1), tmask, ones)),
                             e.wdata.eq(Mux(g.rot != 0, scattered, lane_of[(g.lo + i) & (C - 1)]))]
                with m.If(fire & n):
                    m.d.comb += [chq[c].w_en.eq(1), chq[c].w_data.eq(e.as_value())]
        m.d.comb += trk.r_en.eq(fire)
        with m.If(fire):
            m.d.sync += self.beats.eq(self.beats + g.cnt)
            with m.If(g.last):
                m.d.sync += ws_done.eq(1)

        # a started descriptor that failed (LINK_DOWN) has no groups
        # a DRAM -> SRAM descriptor retires in the cycle its last group is written
        finished = ws_done | (cur.code != DMAError.OK) | (fire & g.last & (cur.direction == Direction.DRAM_TO_SRAM))
        drained = Cat(*(~f.r_rdy for f in chq)).all() & self.dram_idle
        retire = ws_q.r_rdy & finished & (drained | (cur.direction == Direction.DRAM_TO_SRAM))
        done_rec = data.View(completion_layout, Signal(completion_layout.size, name="done_rec"))
        m.d.comb += [done_rec.tag.eq(cur.tag), done_rec.code.eq(cur.code)]
        m.d.comb += ws_completing.eq(retire & done_q.w_rdy)
        with m.If(ws_completing):
            m.d.comb += [
                done_q.w_en.eq(1), done_q.w_data.eq(done_rec.as_value()),
                ws_q.r_en.eq(1),
            ]
            m.d.sync += [ws_done.eq(0), self.n_done.eq(self.n_done + 1)]
            with m.If(cur.code == DMAError.OK):
                m.d.sync += self.bytes_moved.eq(self.bytes_moved + cur.rows * cur.bytes_per_row)
                with m.If(cur.pp_en & cur.pp_commit):
                    m.d.comb += [set_full.eq(Mux(cur.pp_half, 0b10, 0b01)),
                                  clr_pend.eq(Mux(cur.pp_half, 0b10, 0b01))]
        with m.Elif(reject):
            m.d.comb += [done_q.w_en.eq(1), done_q.w_data.eq(rej_rec.as_value())]
            with m.If(rej_rec.code == DMAError.OK):     # an empty descriptor
                m.d.sync += self.n_done.eq(self.n_done + 1)


class MemorySystem(wiring.Component):
    """DMA + DRAM channels + one TSV bundle pair per channel + banked SRAM, wired.

    ::

        DRAMModel ◄─bk[c]─► DRAM channel c ─rdata─► TSV rd link c ─► DMA ─► SRAM port 0 (C words)
                                 ▲ cmd ◄────────────────────────── DMA      SRAM ports 1..n_consumers
                                 └ wdata ◄─ TSV wr link c ◄──────── DMA      SRAM backdoor ``bd``

    Parameters
    ----------
    config : NPUConfig
    n_consumers : int
        SRAM ports for consumers (operand feeders), >= 0.  Wide consumer
        ports are granted before the DMA's port (the DMA runs ahead of
        them and has slack; a consumer stalled is a compute cycle lost).
    queue_depth : int
        DMA descriptor queue depth.
    consumer_lanes : tuple of int, optional
        Words per request of each consumer port (``StackedSRAM`` ``lanes``;
        default 1 each): consumer i's port has ``8*W*lanes[i]`` data bits.
    walking_bist : bool
        Include the walking patterns in the TSV self-test.

    Ports
    -----
    desc, done, region/ping-pong inputs, counters : as :class:`DMA` (prefixed ``dma_`` for counters)
    sram_ports[i] : In(SRAMPortSignature) (``consumer_lanes[i]`` words wide); bd : In(SRAMPortSignature)
    bk[c] : Out(DRAMBackendSignature)  — channel c to the Python DRAM model
    tsv_rd[c], tsv_wr[c] : In(TSVControlSignature)   channel c's read and write bundles
    sram_rd_bytes, sram_wr_bytes, dram_rd_bytes, dram_wr_bytes : Out(48)
    dram_row_hits, dram_activates, dram_row_conflicts, dram_refreshes,
    dram_refresh_stall_cycles, dram_stall_cycles : Out(32)   summed over the channels
    tsv_rd_words, tsv_wr_words : Out(32)   words over all bundles
    dram_late : Out(1)
    sram_stall : In(1 + n_consumers)
        Test-only SRAM backpressure on the DMA's port (bit 0) and the
        consumer ports (``StackedSRAM.stall``); 0 in normal operation.
    """

    #: the DRAM channels' event counts, exported as ``dram_<name>``
    DRAM_COUNTERS = COUNTER_NAMES[2:]

    def __init__(self, config, n_consumers: int = 1, queue_depth: int = 4, walking_bist: bool = True,
                 consumer_lanes=None):
        if not isinstance(n_consumers, int) or n_consumers < 0:
            raise ValueError(f"n_consumers must be a non-negative int, not {n_consumers!r}")
        self.config = config
        self.n_consumers = n_consumers
        self.consumer_lanes = tuple(consumer_lanes) if consumer_lanes is not None else (1,) * n_consumers
        if len(self.consumer_lanes) != n_consumers:
            raise ValueError(f"consumer_lanes must have {n_consumers} entries, not {consumer_lanes!r}")
        self.queue_depth = queue_depth
        self.walking_bist = walking_bist
        self.wbytes = word_bytes(config)
        C = config.dram_channels
        sab = addr_bits_for(config.sram_bytes, self.wbytes)
        dab = addr_bits_for(config.dram_bytes, self.wbytes)
        n, s = config.tsv_data_lanes, config.tsv_spare_lanes
        members = {
            "desc": In(stream.Signature(descriptor_layout)),
            "done": Out(stream.Signature(completion_layout)),
            "dram_lo": In(ADDR_BITS), "dram_hi": In(ADDR_BITS),
            "sram_lo": In(ADDR_BITS), "sram_hi": In(ADDR_BITS),
            "pp_base": In(ADDR_BITS), "pp_half_bytes": In(ADDR_BITS),
            "pp_release": In(2), "pp_full": Out(2), "pp_err": Out(1),
            "dma_busy": Out(1), "dma_bytes_moved": Out(48), "dma_beats": Out(32),
            "dma_active_cycles": Out(32), "dma_n_done": Out(32), "dma_n_rejected": Out(32),
            "bd": In(SRAMPortSignature(sab, self.wbytes)),
            "bk": Out(DRAMBackendSignature(dab, self.wbytes)).array(C),
            "tsv_rd": In(TSVControlSignature(n, s)).array(C),
            "tsv_wr": In(TSVControlSignature(n, s)).array(C),
            "sram_rd_bytes": Out(48), "sram_wr_bytes": Out(48), "sram_conflict_cycles": Out(32),
            "dram_rd_bytes": Out(48), "dram_wr_bytes": Out(48), "dram_late": Out(1),
            **{f"dram_{k}": Out(32) for k in self.DRAM_COUNTERS},
            "tsv_rd_words": Out(32), "tsv_wr_words": Out(32),
            "sram_stall": In(1 + n_consumers),
        }
        if n_consumers and all(v == 1 for v in self.consumer_lanes):
            members["sram_ports"] = In(SRAMPortSignature(sab, self.wbytes)).array(n_consumers)
        else:
            for i, v in enumerate(self.consumer_lanes):
                members[f"sram_port{i}"] = In(SRAMPortSignature.of(config, v))
        super().__init__(members)
        if "sram_ports" not in members:
            self.sram_ports = [getattr(self, f"sram_port{i}") for i in range(n_consumers)]

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        C = cfg.dram_channels
        m.submodules.dma = dma = DMA(cfg, queue_depth=self.queue_depth)
        m.submodules.dram = dram = StackedDRAM(cfg)
        lanes = (C,) + self.consumer_lanes
        wide_consumers = sorted((p for p in range(1, len(lanes)) if lanes[p] > 1), key=lambda p: (-lanes[p], p))
        m.submodules.sram = sram = StackedSRAM(cfg, n_ports=1 + self.n_consumers, lanes=lanes,
                                               priority=tuple(wide_consumers) + ((0,) if C > 1 else ()))
        trd = [TSVLink.from_config(cfg, walking=self.walking_bist) for _ in range(C)]
        twr = [TSVLink.from_config(cfg, walking=self.walking_bist) for _ in range(C)]

        wiring.connect(m, wiring.flipped(self.desc), dma.desc)
        wiring.connect(m, dma.done, wiring.flipped(self.done))
        # DRAM side, per channel: commands direct, data through the channel's TSV bundles
        for c in range(C):
            m.submodules[f"tsv_rd{c}"] = trd[c]
            m.submodules[f"tsv_wr{c}"] = twr[c]
            port = dram.ports[c]
            wiring.connect(m, dma.dram[c].cmd, port.cmd)
            wiring.connect(m, dma.dram[c].wdata, twr[c].i)
            wiring.connect(m, twr[c].o, port.wdata)
            wiring.connect(m, port.rdata, trd[c].i)
            wiring.connect(m, trd[c].o, dma.dram[c].rdata)
            wiring.connect(m, dram.bk[c], wiring.flipped(self.bk[c]))
            wiring.connect(m, wiring.flipped(self.tsv_rd[c]), trd[c].ctl)
            wiring.connect(m, wiring.flipped(self.tsv_wr[c]), twr[c].ctl)
        # SRAM side
        wiring.connect(m, dma.sram, sram.ports[0])
        for i in range(self.n_consumers):
            wiring.connect(m, wiring.flipped(self.sram_ports[i]), sram.ports[1 + i])
        wiring.connect(m, wiring.flipped(self.bd), sram.bd)

        links_ok = Cat(*(t.ctl.ok for t in trd + twr)).all()
        m.d.comb += [
            dma.dram_lo.eq(self.dram_lo), dma.dram_hi.eq(self.dram_hi),
            dma.sram_lo.eq(self.sram_lo), dma.sram_hi.eq(self.sram_hi),
            dma.pp_base.eq(self.pp_base), dma.pp_half_bytes.eq(self.pp_half_bytes),
            dma.pp_release.eq(self.pp_release), self.pp_full.eq(dma.pp_full), self.pp_err.eq(dma.pp_err),
            dma.link_ok.eq(links_ok), dma.dram_idle.eq(dram.idle),
            self.dma_busy.eq(dma.busy), self.dma_bytes_moved.eq(dma.bytes_moved),
            self.dma_beats.eq(dma.beats), self.dma_active_cycles.eq(dma.active_cycles),
            self.dma_n_done.eq(dma.n_done), self.dma_n_rejected.eq(dma.n_rejected),
            self.sram_rd_bytes.eq(sram.rd_bytes), self.sram_wr_bytes.eq(sram.wr_bytes),
            self.sram_conflict_cycles.eq(sram.conflict_cycles),
            self.dram_rd_bytes.eq(dram.rd_bytes), self.dram_wr_bytes.eq(dram.wr_bytes),
            self.dram_late.eq(dram.late),
            self.tsv_rd_words.eq(sum(t.words for t in trd)), self.tsv_wr_words.eq(sum(t.words for t in twr)),
            sram.stall.eq(self.sram_stall),
        ]
        m.d.comb += [getattr(self, f"dram_{k}").eq(getattr(dram, k)) for k in self.DRAM_COUNTERS]
        return m
