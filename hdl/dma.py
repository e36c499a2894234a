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

Alignment rule (checked, ``MISALIGNED`` otherwise): ``src``, ``dst``,
``src_stride`` and ``dst_stride`` are multiples of the bus word W (32 B by
default), and ``bytes_per_row`` is a multiple of 2 (whole FP16 elements).
Word-aligned rows need no byte rotator in the data path, so every cycle moves a
full word; a row whose length is not a word multiple ends with a masked
partial word (only its ``bytes_per_row`` bytes are written).

Validation happens when the descriptor is submitted, in one cycle (two
16x32-bit products for the row-end addresses; a timing-driven flow would
register them, adding a cycle of submit latency); a rejected
descriptor gets its completion record (``done`` stream: ``tag``, ``code``)
immediately and writes nothing.  Codes (:class:`DMAError`, the one list):
queue full, zero rows, zero bytes, misaligned, source or destination outside
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

    desc ─► validate ─► queue ─► read generator ──(addresses)──► src memory (DRAM port or SRAM port)
              │ reject           │ (next descriptor starts        │
              ▼                  │  while the last one drains)    ▼ read data (via TSV for DRAM)
             done ◄── completion ◄── write side (2-entry descriptor FIFO) ─► dst memory (SRAM or DRAM)

Each box is one method of :class:`DMA`, called in this order by
``elaborate``: ``_queues`` (descriptor queue, completion FIFO, the write
side's descriptor FIFO), ``_submit`` with ``_validate`` (validate, reject),
``_ping_pong`` (the halves' full/pending state), ``_read_generator`` and
``_write_side`` (with the completion).

The read generator issues one word per cycle and moves on to the next
descriptor as soon as it has issued the last read of the current one
(descriptors of the same direction only), so DRAM latency is paid once per
stream rather than once per descriptor.  The write side pairs each arriving
word with its destination address and byte mask.  A descriptor of the other
direction waits until the write side has drained, so an SRAM -> DRAM
write-back never reads SRAM before an earlier load has written it, and a load
never overwrites SRAM that an earlier write-back is still reading.  An
SRAM -> DRAM completion means every word was accepted by the DRAM port
(posted writes; a later read through the same port sees them).  A host that
keeps at most ``queue_depth`` descriptors outstanding (submitted minus
completed) never sees ``QUEUE_FULL``.

MemorySystem
------------
At the bottom of this file, :class:`MemorySystem` wires DMA, DRAM timing
(one port), two TSV links (read data DRAM->logic, write data logic->DRAM) and
the SRAM (DMA port + consumer ports + backdoor): the piece the NPU top level
instantiates.
"""

from __future__ import annotations

import enum

from amaranth import Const, Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from .dram import DRAMBackendSignature, DRAMPortSignature, StackedDRAM
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
    ZERO_ROWS = 2      #: rows == 0
    ZERO_BYTES = 3     #: bytes_per_row == 0
    MISALIGNED = 4     #: src/dst/strides not W-aligned, or bytes_per_row odd
    SRC_RANGE = 5      #: source rows reach outside the source region
    DST_RANGE = 6      #: destination rows reach outside the destination region
    DST_OVERLAP = 7    #: rows > 1 and dst_stride < bytes_per_row
    PP_RANGE = 8       #: ping-pong descriptor outside its half, or not DRAM->SRAM
    PP_WINDOW = 9      #: a non-ping-pong write into the ping-pong window
    LINK_DOWN = 10     #: the TSV link was not OK when the descriptor started


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
    """2-D DMA engine between a DRAM port and an SRAM port.

    Parameters
    ----------
    config : NPUConfig
        Bus word W (``word_bytes``), SRAM and DRAM sizes (address widths).
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
    dram : Out(DRAMPortSignature)   (cmd, wdata out; rdata in)
    sram : Out(SRAMPortSignature)   (req out; rdata in)
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
    n_done, n_rejected : Out(32)

    Raises
    ------
    ValueError
        For bad depths or a configuration whose widths disagree.
    """

    def __init__(self, config, queue_depth: int = 4, done_depth: int = 4):
        for name, v in (("queue_depth", queue_depth), ("done_depth", done_depth)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, not {v!r}")
        self.config = config
        self.queue_depth = queue_depth
        self.done_depth = done_depth
        self.wbytes = word_bytes(config)
        self.wbits = exact_log2(self.wbytes)
        self.sram_addr_bits = addr_bits_for(config.sram_bytes, self.wbytes)
        self.dram_addr_bits = addr_bits_for(config.dram_bytes, self.wbytes)
        super().__init__({
            "desc": In(stream.Signature(descriptor_layout)),
            "done": Out(stream.Signature(completion_layout)),
            "dram": Out(DRAMPortSignature(self.dram_addr_bits, self.wbytes)),
            "sram": Out(SRAMPortSignature(self.sram_addr_bits, self.wbytes)),
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
        """Combinational check of descriptor ``d``; returns a DMAError signal."""
        W = self.wbytes
        code = Signal(DMAError, name="chk_code")
        low = W - 1
        misaligned = ((d.src & low) != 0) | ((d.dst & low) != 0) | ((d.src_stride & low) != 0) | \
                     ((d.dst_stride & low) != 0) | d.bytes_per_row[0]
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
        with m.If(d.rows == 0):
            m.d.comb += code.eq(DMAError.ZERO_ROWS)
        with m.Elif(d.bytes_per_row == 0):
            m.d.comb += code.eq(DMAError.ZERO_BYTES)
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
        return code

    def elaborate(self, platform):
        m = Module()
        queue, done_q, ws_q = self._queues(m)
        ws_completing, reject, rej_rec = self._submit(m, queue, done_q)
        full, pend, set_full, set_pend, clr_pend = self._ping_pong(m)
        rg_active = self._read_generator(m, queue, ws_q, full, pend, set_pend)
        self._write_side(m, ws_q, done_q, ws_completing, reject, rej_rec, set_full, clr_pend)

        m.d.comb += self.busy.eq(queue.r_rdy | rg_active | ws_q.r_rdy)
        with m.If(rg_active | ws_q.r_rdy):
            m.d.sync += self.active_cycles.eq(self.active_cycles + 1)
        return m

    def _ws_layout(self):
        """A started descriptor as the write side needs it (``ws_q`` entry)."""
        return data.StructLayout({
            "dst": ADDR_BITS, "rows": ROWS_BITS, "words": BPR_BITS, "bytes_per_row": BPR_BITS,
            "dst_stride": ADDR_BITS, "tail_mask": self.wbytes, "direction": Direction,
            "pp_en": 1, "pp_half": 1, "pp_commit": 1, "tag": TAG_BITS, "code": DMAError,
        })

    # ------------------------------------------------------------ queues
    def _queues(self, m):
        """The descriptor queue, the completion FIFO (drives ``done``) and the
        2-entry FIFO of started descriptors between read generator and write
        side.  Returns ``(queue, done_q, ws_q)``."""
        m.submodules.queue = queue = fifo.SyncFIFO(width=descriptor_layout.size, depth=self.queue_depth)
        m.submodules.done_q = done_q = fifo.SyncFIFO(width=completion_layout.size, depth=self.done_depth)
        ws_layout = self._ws_layout()
        m.submodules.ws_q = ws_q = fifo.SyncFIFO(width=ws_layout.size, depth=2)

        m.d.comb += [
            self.done.valid.eq(done_q.r_rdy),
            self.done.payload.eq(done_q.r_data),
            done_q.r_en.eq(self.done.ready),
        ]
        return queue, done_q, ws_q

    # ------------------------------------------------- submit + validate
    def _submit(self, m, queue, done_q):
        """Accept a descriptor: validate it, queue it or build its rejection
        record.  Returns ``(ws_completing, reject, rej_rec)``: the write
        side's completion strobe (input: it blocks a submit), the reject
        strobe and record (for the completion FIFO)."""
        code = self._validate(m, self.desc.payload)
        ws_completing = Signal()        # write side pushes a completion this cycle
        m.d.comb += self.desc.ready.eq(done_q.w_rdy & ~ws_completing)
        submit = self.desc.valid & self.desc.ready
        reject_code = Signal(DMAError)
        m.d.comb += reject_code.eq(Mux(code != DMAError.OK, code, DMAError.QUEUE_FULL))
        reject = Signal()
        m.d.comb += reject.eq(submit & ((code != DMAError.OK) | ~queue.w_rdy))
        m.d.comb += [
            queue.w_data.eq(self.desc.payload.as_value()),
            queue.w_en.eq(submit & (code == DMAError.OK)),
        ]
        rej_rec = data.View(completion_layout, Signal(completion_layout.size, name="rej_rec"))
        m.d.comb += [rej_rec.tag.eq(self.desc.payload.tag), rej_rec.code.eq(reject_code)]
        with m.If(reject):
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
    def _read_generator(self, m, queue, ws_q, full, pend, set_pend):
        """Start the queue's head descriptor (direction and ping-pong rules,
        a ``ws_q`` record for the write side) and issue its source reads, one
        word per cycle.  Returns ``rg_active`` (reads still to issue)."""
        W = self.wbytes
        wb = self.wbits
        ws_layout = self._ws_layout()
        head = data.View(descriptor_layout, queue.r_data)
        rg_active = Signal()
        rg_dir = Signal(Direction)
        rg_addr = Signal(ADDR_BITS)
        rg_row_addr = Signal(ADDR_BITS)
        rg_stride = Signal(ADDR_BITS)
        rg_word = Signal(BPR_BITS)
        rg_words = Signal(BPR_BITS)
        rg_row = Signal(ROWS_BITS)
        rg_rows = Signal(ROWS_BITS)
        last_dir = Signal(Direction)

        words_of = Signal(BPR_BITS)
        m.d.comb += words_of.eq((head.bytes_per_row + (W - 1)) >> wb)
        tail = Signal(range(W + 1))
        m.d.comb += tail.eq(head.bytes_per_row - ((words_of - 1) << wb))
        tail_mask = Signal(W)
        m.d.comb += tail_mask.eq((Const(1, W + 1) << tail) - 1)

        ws_empty = ~ws_q.r_rdy
        dir_ok = (ws_empty & ~rg_active) | (head.direction == last_dir)
        pp_ok = ~head.pp_en | ~(full.bit_select(head.pp_half, 1) | pend.bit_select(head.pp_half, 1))
        can_start = queue.r_rdy & ~rg_active & dir_ok & pp_ok & ws_q.w_rdy
        ws_rec = data.View(ws_layout, Signal(ws_layout.size, name="ws_rec"))
        m.d.comb += [
            ws_rec.dst.eq(head.dst), ws_rec.rows.eq(head.rows), ws_rec.words.eq(words_of),
            ws_rec.bytes_per_row.eq(head.bytes_per_row), ws_rec.dst_stride.eq(head.dst_stride),
            ws_rec.tail_mask.eq(tail_mask), ws_rec.direction.eq(head.direction),
            ws_rec.pp_en.eq(head.pp_en), ws_rec.pp_half.eq(head.pp_half),
            ws_rec.pp_commit.eq(head.pp_commit), ws_rec.tag.eq(head.tag),
            ws_rec.code.eq(Mux(self.link_ok, DMAError.OK, DMAError.LINK_DOWN)),
            ws_q.w_data.eq(ws_rec.as_value()),
            ws_q.w_en.eq(can_start),
            queue.r_en.eq(can_start),
        ]
        with m.If(can_start):
            m.d.sync += last_dir.eq(head.direction)
            with m.If(self.link_ok):
                m.d.sync += [
                    rg_active.eq(1), rg_dir.eq(head.direction),
                    rg_addr.eq(head.src), rg_row_addr.eq(head.src), rg_stride.eq(head.src_stride),
                    rg_word.eq(0), rg_words.eq(words_of), rg_row.eq(0), rg_rows.eq(head.rows),
                ]
                with m.If(head.pp_en & head.pp_commit):
                    m.d.comb += set_pend.eq(Mux(head.pp_half, 0b10, 0b01))

        rd_fire = Signal()
        rg_word_addr = rg_addr >> wb
        with m.If(rg_dir == Direction.DRAM_TO_SRAM):
            m.d.comb += [
                self.dram.cmd.valid.eq(rg_active),
                self.dram.cmd.payload.addr.eq(rg_word_addr),
                self.dram.cmd.payload.write.eq(0),
                rd_fire.eq(rg_active & self.dram.cmd.ready),
            ]
        with m.Else():
            m.d.comb += [
                self.sram.req.valid.eq(rg_active),
                self.sram.req.payload.addr.eq(rg_word_addr),
                self.sram.req.payload.write.eq(0),
                rd_fire.eq(rg_active & self.sram.req.ready),
            ]
        with m.If(rd_fire):
            with m.If(rg_word == rg_words - 1):
                m.d.sync += [rg_word.eq(0), rg_row.eq(rg_row + 1),
                             rg_addr.eq(rg_row_addr + rg_stride), rg_row_addr.eq(rg_row_addr + rg_stride)]
                with m.If(rg_row == rg_rows - 1):
                    m.d.sync += rg_active.eq(0)
            with m.Else():
                m.d.sync += [rg_word.eq(rg_word + 1), rg_addr.eq(rg_addr + W)]
        return rg_active

    # -------------------------------------------------------- write side
    def _write_side(self, m, ws_q, done_q, ws_completing, reject, rej_rec, set_full, clr_pend):
        """Pair each arriving word with its destination address and byte
        mask, and retire the descriptor at ``ws_q``'s head into the
        completion FIFO (which also takes the submit side's rejections).
        Drives ``ws_completing``, ``set_full`` and ``clr_pend``."""
        W = self.wbytes
        wb = self.wbits
        cur = data.View(self._ws_layout(), ws_q.r_data)
        ws_loaded = Signal()
        ws_addr = Signal(ADDR_BITS)
        ws_row_addr = Signal(ADDR_BITS)
        ws_word = Signal(BPR_BITS)
        ws_row = Signal(ROWS_BITS)
        ws_done = Signal()
        wmask = Signal(W)
        m.d.comb += wmask.eq(Mux(ws_word == cur.words - 1, cur.tail_mask, Const(-1, W)))
        ws_word_addr = ws_addr >> wb
        wr_fire = Signal()
        in_valid = Signal()
        beat_en = ws_q.r_rdy & ws_loaded & ~ws_done & (cur.code == DMAError.OK)
        with m.If(cur.direction == Direction.DRAM_TO_SRAM):
            m.d.comb += [
                in_valid.eq(self.dram.rdata.valid),
                self.sram.req.valid.eq(beat_en & in_valid),
                self.sram.req.payload.addr.eq(ws_word_addr),
                self.sram.req.payload.write.eq(1),
                self.sram.req.payload.wmask.eq(wmask),
                self.sram.req.payload.wdata.eq(self.dram.rdata.payload),
                wr_fire.eq(beat_en & in_valid & self.sram.req.ready),
                self.dram.rdata.ready.eq(beat_en & self.sram.req.ready),
            ]
        with m.Else():
            m.d.comb += [
                in_valid.eq(self.sram.rdata.valid),
                self.dram.cmd.valid.eq(beat_en & in_valid),
                self.dram.cmd.payload.addr.eq(ws_word_addr),
                self.dram.cmd.payload.write.eq(1),
                self.dram.cmd.payload.wmask.eq(wmask),
                self.dram.wdata.valid.eq(beat_en & in_valid),
                self.dram.wdata.payload.eq(self.sram.rdata.payload),
                wr_fire.eq(beat_en & in_valid & self.dram.cmd.ready),
                self.sram.rdata.ready.eq(beat_en & self.dram.cmd.ready),
            ]

        with m.If(ws_q.r_rdy & ~ws_loaded):
            m.d.sync += [ws_loaded.eq(1), ws_addr.eq(cur.dst), ws_row_addr.eq(cur.dst),
                         ws_word.eq(0), ws_row.eq(0), ws_done.eq(cur.code != DMAError.OK)]
        with m.If(wr_fire):
            m.d.sync += [self.beats.eq(self.beats + 1)]
            with m.If(ws_word == cur.words - 1):
                m.d.sync += [ws_word.eq(0), ws_row.eq(ws_row + 1),
                             ws_addr.eq(ws_row_addr + cur.dst_stride),
                             ws_row_addr.eq(ws_row_addr + cur.dst_stride)]
                with m.If(ws_row == cur.rows - 1):
                    m.d.sync += ws_done.eq(1)
            with m.Else():
                m.d.sync += [ws_word.eq(ws_word + 1), ws_addr.eq(ws_addr + W)]

        done_rec = data.View(completion_layout, Signal(completion_layout.size, name="done_rec"))
        m.d.comb += [done_rec.tag.eq(cur.tag), done_rec.code.eq(cur.code)]
        m.d.comb += ws_completing.eq(ws_q.r_rdy & ws_loaded & ws_done & done_q.w_rdy)
        with m.If(ws_completing):
            m.d.comb += [
                done_q.w_en.eq(1), done_q.w_data.eq(done_rec.as_value()),
                ws_q.r_en.eq(1),
            ]
            m.d.sync += [ws_loaded.eq(0), ws_done.eq(0), self.n_done.eq(self.n_done + 1)]
            with m.If(cur.code == DMAError.OK):
                m.d.sync += self.bytes_moved.eq(self.bytes_moved + cur.rows * cur.bytes_per_row)
                with m.If(cur.pp_en & cur.pp_commit):
                    m.d.comb += [set_full.eq(Mux(cur.pp_half, 0b10, 0b01)),
                                  clr_pend.eq(Mux(cur.pp_half, 0b10, 0b01))]
        with m.Elif(reject):
            m.d.comb += [done_q.w_en.eq(1), done_q.w_data.eq(rej_rec.as_value())]


class MemorySystem(wiring.Component):
    """DMA + DRAM timing + two TSV links + banked SRAM, wired.

    ::

        DRAMModel ◄─bk─► StackedDRAM ─rdata─► TSV rd link ─► DMA ─► SRAM port 0
                              ▲ cmd ◄─────────────────────── DMA      SRAM ports 1..n_consumers (consumers)
                              └ wdata ◄─ TSV wr link ◄─────── DMA      SRAM backdoor ``bd``

    Parameters
    ----------
    config : NPUConfig
    n_consumers : int
        SRAM ports for consumers (operand feeders), >= 0.
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
    bk : Out(DRAMBackendSignature)  — to the Python DRAM model
    tsv_rd, tsv_wr : In(TSVControlSignature)
    sram_rd_bytes, sram_wr_bytes, dram_rd_bytes, dram_wr_bytes : Out(48)
    tsv_rd_words, tsv_wr_words : Out(32)
    dram_late : Out(1)
    sram_stall : In(1 + n_consumers)
        Test-only SRAM backpressure on the DMA's port (bit 0) and the
        consumer ports (``StackedSRAM.stall``); 0 in normal operation.
    """

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
            "bk": Out(DRAMBackendSignature(dab, self.wbytes)),
            "tsv_rd": In(TSVControlSignature(n, s)),
            "tsv_wr": In(TSVControlSignature(n, s)),
            "sram_rd_bytes": Out(48), "sram_wr_bytes": Out(48), "sram_conflict_cycles": Out(32),
            "dram_rd_bytes": Out(48), "dram_wr_bytes": Out(48), "dram_late": Out(1),
            "tsv_rd_words": Out(32), "tsv_wr_words": Out(32),
            "sram_stall": In(1 + n_consumers),
        }
        if n_consumers and all(v == 1 for v in self.consumer_lanes):
            members["sram_ports"] = In(SRAMPortSignature(sab, self.wbytes)).array(n_consumers)
        elif n_consumers:
            for i, v in enumerate(self.consumer_lanes):
                members[f"sram_port{i}"] = In(SRAMPortSignature.of(config, v))
        super().__init__(members)
        if n_consumers and "sram_ports" not in members:
            self.sram_ports = [getattr(self, f"sram_port{i}") for i in range(n_consumers)]

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        m.submodules.dma = dma = DMA(cfg, queue_depth=self.queue_depth)
        m.submodules.dram = dram = StackedDRAM(cfg, n_ports=1)
        m.submodules.sram = sram = StackedSRAM(cfg, n_ports=1 + self.n_consumers,
                                               lanes=(1,) + self.consumer_lanes)
        m.submodules.tsv_rd = trd = TSVLink.from_config(cfg, walking=self.walking_bist)
        m.submodules.tsv_wr = twr = TSVLink.from_config(cfg, walking=self.walking_bist)

        wiring.connect(m, wiring.flipped(self.desc), dma.desc)
        wiring.connect(m, dma.done, wiring.flipped(self.done))
        # DRAM side: commands direct, data through the TSV links
        wiring.connect(m, dma.dram.cmd, dram.ports[0].cmd)
        wiring.connect(m, dma.dram.wdata, twr.i)
        wiring.connect(m, twr.o, dram.ports[0].wdata)
        wiring.connect(m, dram.ports[0].rdata, trd.i)
        wiring.connect(m, trd.o, dma.dram.rdata)
        wiring.connect(m, dram.bk[0], wiring.flipped(self.bk))
        wiring.connect(m, wiring.flipped(self.tsv_rd), trd.ctl)
        wiring.connect(m, wiring.flipped(self.tsv_wr), twr.ctl)
        # SRAM side
        wiring.connect(m, dma.sram, sram.ports[0])
        for i in range(self.n_consumers):
            wiring.connect(m, wiring.flipped(self.sram_ports[i]), sram.ports[1 + i])
        wiring.connect(m, wiring.flipped(self.bd), sram.bd)

        m.d.comb += [
            dma.dram_lo.eq(self.dram_lo), dma.dram_hi.eq(self.dram_hi),
            dma.sram_lo.eq(self.sram_lo), dma.sram_hi.eq(self.sram_hi),
            dma.pp_base.eq(self.pp_base), dma.pp_half_bytes.eq(self.pp_half_bytes),
            dma.pp_release.eq(self.pp_release), self.pp_full.eq(dma.pp_full), self.pp_err.eq(dma.pp_err),
            dma.link_ok.eq(trd.ctl.ok & twr.ctl.ok),
            self.dma_busy.eq(dma.busy), self.dma_bytes_moved.eq(dma.bytes_moved),
            self.dma_beats.eq(dma.beats), self.dma_active_cycles.eq(dma.active_cycles),
            self.dma_n_done.eq(dma.n_done), self.dma_n_rejected.eq(dma.n_rejected),
            self.sram_rd_bytes.eq(sram.rd_bytes), self.sram_wr_bytes.eq(sram.wr_bytes),
            self.sram_conflict_cycles.eq(sram.conflict_cycles),
            self.dram_rd_bytes.eq(dram.rd_bytes), self.dram_wr_bytes.eq(dram.wr_bytes),
            self.dram_late.eq(dram.late),
            self.tsv_rd_words.eq(trd.words), self.tsv_wr_words.eq(twr.words),
            sram.stall.eq(self.sram_stall),
        ]
        return m
