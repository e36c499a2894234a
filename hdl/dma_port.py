"""The NPU's side of the DMA: one descriptor register fed by two issuers, the
queue credit, completion counts per tag, and the DMA's simulation-time checks.

::

   O writer ──wb──┐ (first)
                  ├─► descriptor register ──desc──► DMA queue
   controller ─iss┘                                   │
            ◄── done counts per Tag, fail ◄── done ◄──┘

* **Credit.**  A descriptor is taken only while fewer than ``QUEUE_DEPTH``
  are outstanding (submitted, not completed), so the DMA never answers
  ``QUEUE_FULL`` (``no_limit``, from ``debug.no_queue_limit``, lifts the
  credit to prove the check).  ``iss.ready`` is the room for the
  controller, offered also without ``valid``: the controller's steps that
  issue nothing advance in the same slots.
* **Completion counts.**  The DMA completes in submission order; the tile
  loader and the O writer wait on the count of their tag (e.g. K tile j of a
  KV head is in SRAM once ``done_count[K] > k_base + j``).
* **Checks** (``fail`` with ``fail_code``): a ``QUEUE_FULL`` completion
  (``QUEUE_OVERFLOW``), any other error completion (``DMA``, code kept in
  ``dma_code``), and the watchdog: descriptors outstanding and no beat or
  completion for ``limit`` cycles while ``armed`` (``WATCHDOG``, which wins).
"""

# no ``from __future__ import annotations``: the signature is read from the
# class annotations, which must be objects, not strings
from amaranth import Module, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from .dma import DMAError, completion_layout, descriptor_layout
from .npu_map import COUNT_BITS, QUEUE_DEPTH, NPUError, Tag

__all__ = ["DMAPort"]

#: outstanding descriptors the counter can hold (> QUEUE_DEPTH, so that the
#: ``no_limit`` test mode overruns the queue instead of the counter)
OUTSTANDING_MAX = 63


class DMAPort(wiring.Component):
    """Descriptor arbitration, credit, completion counts and DMA checks.

    Ports
    -----
    wb, iss : In(stream(descriptor_layout))
        O write-back and controller descriptors; ``wb`` goes first.
    desc : Out(stream(descriptor_layout))    to the DMA (registered).
    done : In(stream(completion_layout))     from the DMA (always ready).
    beats : In(32)          words the DMA has moved (free-running).
    limit : In(32)          watchdog limit in cycles (``watchdog`` register).
    armed : In(1)           a job runs: the watchdog counts.
    no_limit : In(1)        ignore the credit (tests).
    clear : In(1)           a job starts: completion counts and ``dma_code`` to 0.
    done_count : Out(ArrayLayout(COUNT_BITS, len(Tag)))   completions per tag in the job.
    pending : Out(1)        a descriptor waits in the register.
    idle : Out(1)           none waits and none is outstanding.
    fail : Out(1), fail_code : Out(NPUError), dma_code : Out(DMAError)
    """

    wb: In(stream.Signature(descriptor_layout))
    iss: In(stream.Signature(descriptor_layout))
    desc: Out(stream.Signature(descriptor_layout))
    done: In(stream.Signature(completion_layout))
    beats: In(32)
    limit: In(32)
    armed: In(1)
    no_limit: In(1)
    clear: In(1)
    done_count: Out(data.ArrayLayout(COUNT_BITS, len(Tag)))
    pending: Out(1)
    idle: Out(1)
    fail: Out(1)
    fail_code: Out(NPUError)
    dma_code: Out(DMAError)

    def elaborate(self, platform):
        m = Module()
        outstanding = Signal(range(OUTSTANDING_MAX + 1))
        sub = self.desc.valid & self.desc.ready
        comp = self.done.valid
        m.d.comb += [self.done.ready.eq(1), self.pending.eq(self.desc.valid),
                     self.idle.eq(~self.desc.valid & (outstanding == 0))]
        m.d.sync += outstanding.eq(outstanding + sub - comp)

        # the descriptor register: write-back first, then the controller
        room = ~self.desc.valid & ((outstanding < QUEUE_DEPTH) | self.no_limit)
        m.d.comb += [self.wb.ready.eq(room), self.iss.ready.eq(room & ~self.wb.valid)]
        with m.If(sub):
            m.d.sync += self.desc.valid.eq(0)
        for src in (self.iss, self.wb):          # wb last: it wins (the two never fire together)
            with m.If(src.valid & src.ready):
                m.d.sync += [self.desc.payload.eq(src.payload), self.desc.valid.eq(1)]

        # completions: per tag, and the error codes
        with m.If(comp):
            with m.If(self.done.payload.code == DMAError.QUEUE_FULL):
                m.d.comb += [self.fail.eq(1), self.fail_code.eq(NPUError.QUEUE_OVERFLOW)]
            with m.Elif(self.done.payload.code != DMAError.OK):
                m.d.comb += [self.fail.eq(1), self.fail_code.eq(NPUError.DMA)]
                m.d.sync += self.dma_code.eq(self.done.payload.code)
            for t in Tag:
                with m.If(self.done.payload.tag == t):
                    m.d.sync += self.done_count[t].eq(self.done_count[t] + 1)

        # watchdog: descriptors outstanding and no beat moved, no completion
        wd = Signal(32)
        last_beats = Signal(32)
        m.d.sync += last_beats.eq(self.beats)
        progress = (self.beats != last_beats) | comp | (outstanding == 0)
        with m.If(progress | ~self.armed):
            m.d.sync += wd.eq(0)
        with m.Else():
            m.d.sync += wd.eq(wd + 1)
        with m.If(self.armed & (wd >= self.limit) & ~progress):
            m.d.comb += [self.fail.eq(1), self.fail_code.eq(NPUError.WATCHDOG)]

        with m.If(self.clear):                   # after the updates above: a new job wins
            m.d.sync += [self.dma_code.eq(DMAError.OK)] + [c.eq(0) for c in self.done_count]
        return m
