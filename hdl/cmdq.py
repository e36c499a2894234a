"""The command queue: a ring of job descriptors behind the CSRs, a doorbell,
and a completion record (status, cycle stamps, every counter) per job.

::

   host ─CSR window cq_ring──► ring memory (CQ_ENTRIES x 32 words) ──FETCH──► job registers (flops)
   host ─cq_doorbell.tail──► tail        head ──► entry head % CQ_ENTRIES        │ Mux(active)
                                                                               ▼
                                                  Controller ◄── job registers, start
                                                     │ irq.done (suppressed while active)
                                                     ▼
   host ◄─CSR window cq_cpl── completion memory ◄─WRITE─ status, tag, t_start, t_done, counters
   host ◄─irq (done/error)── per entry with cq_flags.irq, and on every error

Protocol (NVMe-style producer/consumer indices, 16 bit, entry = index %
``CQ_ENTRIES``): the host writes descriptor words into the free entries
``tail .. head + CQ_ENTRIES - 1`` (word i = the value of register
``CQ_DESC[i]``), then rings the doorbell once with the new tail.  The queue
runs entries ``head .. tail - 1`` in order, one job at a time: it reads the
descriptor into its job registers (``len(CQ_DESC)`` + 1 cycles), starts the
controller with them, waits for done, writes the entry's completion record
(``CQ_CPL``, 32 cycles) and then advances ``head``.  A descriptor's words are
read only while its entry lies between head and tail, so stale descriptors
in the ring never run: after ``cq_ctl.reset`` (head = tail = 0) exactly the
entries the next doorbell covers run (case R2).

Errors: a doorbell whose tail lies more than ``CQ_ENTRIES`` ahead of head is
refused (``cq_status.overrun``, ``irq.error``; nothing runs, head and tail
keep their values).  A job that completes with an error still gets its
completion record and raises ``irq.done`` and ``irq.error``; the queue then
halts (``cq_status.halted``) until ``cq_ctl.reset`` -- after a job that
stopped in ``FAIL`` the NPU needs a reset anyway.

Direct jobs (registers and ``ctrl.start``) still work and may interleave:
a queued job waits while a direct job runs, and while a queued job runs the
host's ``ctrl.start`` is ignored and the controller sees the queue's job
registers (the host's job CSRs keep their values).

Cost per queued job: from one job's done to the next one's start 60 cycles
(the record, ``len(CQ_CPL)`` + 1; IDLE; the fetch, ``len(CQ_DESC)`` + 1;
START), outside the jobs' ``total_cycles`` (as the host's register writes
are for a direct job); the stamps ``t_start`` and ``t_done`` of consecutive
records show it (``tb/unit/test_cmdq.py``).  Fetching the next descriptor
while a job runs would hide most of it, at the price of a second set of
job registers (24 x 32 flops) and a counter snapshot; at about 1.5 % of a
decode job it is not worth it yet.
"""

from __future__ import annotations

import enum

from amaranth import Array, Cat, Module, Signal, Value
from amaranth.lib import data, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .counters import counters_layout
from .csr import RegisterMap
from .npu_map import COUNTERS, CQ_CPL, CQ_DESC, CQ_ENTRIES, CQ_ENTRY_WORDS, CQ_FLAGS, JOB_REGS

__all__ = ["CQState", "CommandQueue"]

PTR_BITS = 16


class CQState(enum.IntEnum):
    """Queue engine state (``cq_status.state``)."""
    IDLE = 0
    FETCH = 1      # descriptor words from the ring into the job registers
    START = 2      # waits for the controller to be idle, then the start pulse
    WAIT = 3       # the job runs
    WRITE = 4      # the completion record goes into cq_cpl


def _window_ports(words: int, writable: bool) -> dict:
    bits = max(1, (words - 1).bit_length())
    ports = {"addr": In(bits), "r_en": In(1), "r_data": Out(32)}
    if writable:
        ports.update({"w_en": In(1), "w_data": In(32)})
    return ports


class CommandQueue(wiring.Component):
    """The command ring, its engine and the completion records (see the module docstring).

    Ports
    -----
    ring__addr/w_en/w_data/r_en : In, ring__r_data : Out(32)   the ``cq_ring`` window (host side)
    cpl__addr/r_en : In, cpl__r_data : Out(32)                  the ``cq_cpl`` window
    doorbell : In(cq_doorbell shape), ctl : In(cq_ctl shape)   the CSR pulses
    ptr : Out(cq_ptr shape), status : Out(cq_status shape)
    ctrl_busy : In(1)          the controller is not idle
    ctrl_done : In(1)          the controller's done pulse (``irq.done`` set bit)
    ctrl_status : In(32)       the ``status`` register's word
    counters : In(counters_layout())   the job counters (stable after done)
    active : Out(1)            the controller runs (or is being started with) the queue's job
    start : Out(1)             the start pulse of a queued job
    job : Out(layout)          one 32-bit member per ``JOB_REGS`` name: the queued job's registers
    irq : Out(irq shape)       set bits of ``irq`` (done, error)
    """

    def __init__(self, regmap: RegisterMap):
        words = CQ_ENTRIES * CQ_ENTRY_WORDS
        sig = {f"ring__{k}": v for k, v in _window_ports(words, True).items()}
        sig.update({f"cpl__{k}": v for k, v in _window_ports(words, False).items()})
        sig.update({
            "doorbell": In(regmap["cq_doorbell"].shape), "ctl": In(regmap["cq_ctl"].shape),
            "ptr": Out(regmap["cq_ptr"].shape), "status": Out(regmap["cq_status"].shape),
            "ctrl_busy": In(1), "ctrl_done": In(1), "ctrl_status": In(32),
            "counters": In(counters_layout()),
            "active": Out(1), "start": Out(1),
            "job": Out(data.StructLayout({n: 32 for n in JOB_REGS})),
            "irq": Out(regmap["irq"].shape),
        })
        super().__init__(sig)

    def elaborate(self, platform):
        m = Module()
        N, EW = CQ_ENTRIES, CQ_ENTRY_WORDS
        eb = (EW - 1).bit_length()
        m.submodules.ring = ring = Memory(shape=32, depth=N * EW, init=[])
        m.submodules.cpl = cpl = Memory(shape=32, depth=N * EW, init=[])
        host_wr, host_rd, eng_rd = ring.write_port(), ring.read_port(domain="sync"), ring.read_port(domain="sync")
        eng_wr, cpl_rd = cpl.write_port(), cpl.read_port(domain="sync")
        m.d.comb += [host_wr.addr.eq(self.ring__addr), host_wr.data.eq(self.ring__w_data),
                     host_wr.en.eq(self.ring__w_en),
                     host_rd.addr.eq(self.ring__addr), host_rd.en.eq(self.ring__r_en),
                     self.ring__r_data.eq(host_rd.data),
                     cpl_rd.addr.eq(self.cpl__addr), cpl_rd.en.eq(self.cpl__r_en),
                     self.cpl__r_data.eq(cpl_rd.data)]

        state = Signal(CQState)
        head, tail = Signal(PTR_BITS), Signal(PTR_BITS)
        halted, overrun, reset_pending = Signal(), Signal(), Signal()
        i = Signal(range(EW + 1))                       # word of the entry being read / written
        slot = head[:(N - 1).bit_length()]
        now = Signal(32)                                # free-running cycle stamp
        t_start, t_done = Signal(32), Signal(32)
        done_status = Signal(32)
        words = [Signal(32, name=f"desc_{n}") for n in CQ_DESC]
        flags = data.View(CQ_FLAGS.shape, words[-1])
        m.d.sync += now.eq(now + 1)

        pending = Signal(PTR_BITS)
        m.d.comb += pending.eq(tail - head)
        err = Signal()
        m.d.comb += err.eq(done_status[8:16].any())     # the record's status.error != OK
        active = ((state == CQState.START) & ~self.ctrl_busy) | (state == CQState.WAIT) \
            | (state == CQState.WRITE)
        m.d.comb += [
            self.active.eq(active),
            self.ptr.head.eq(head), self.ptr.tail.eq(tail),
            self.status.busy.eq((state != CQState.IDLE) | ((pending != 0) & ~halted)),
            self.status.halted.eq(halted), self.status.overrun.eq(overrun), self.status.state.eq(state),
        ]
        m.d.comb += [getattr(self.job, n).eq(words[k]) for k, n in enumerate(JOB_REGS)]

        # set bits of irq, driven outside the processes below so the
        # register's unused bits are plain zero wires (as in the controller)
        irq_done, irq_error, irq_overrun = Signal(), Signal(), Signal()
        m.d.comb += [self.irq.done.eq(irq_done), self.irq.error.eq(irq_error | irq_overrun)]

        # the doorbell: refused when it would queue more than the ring holds
        db_pending = Signal(PTR_BITS)
        m.d.comb += db_pending.eq(self.doorbell.tail - head)
        with m.If(self.doorbell.ring):
            with m.If(db_pending > N):
                m.d.sync += overrun.eq(1)
                m.d.comb += irq_overrun.eq(1)
            with m.Else():
                m.d.sync += tail.eq(self.doorbell.tail)
        with m.If(self.ctl.reset):
            m.d.sync += reset_pending.eq(1)

        # the completion record's words, in CQ_CPL order
        cnt = {n: Value.cast(self.counters[n]) for n in COUNTERS}
        rec = [done_status, Cat(flags.tag, head), t_start, t_done]
        rec += [cnt[n][h * 32:(h + 1) * 32] for n in COUNTERS for h in (0, 1)]
        assert len(rec) == len(CQ_CPL)

        with m.Switch(state):
            with m.Case(CQState.IDLE):
                with m.If(reset_pending):
                    m.d.sync += [head.eq(0), tail.eq(0), halted.eq(0), overrun.eq(0), reset_pending.eq(0)]
                with m.Elif((pending != 0) & ~halted & ~overrun):
                    m.d.sync += [state.eq(CQState.FETCH), i.eq(0)]
            with m.Case(CQState.FETCH):
                # read address in cycle i, the word arrives in cycle i + 1
                m.d.comb += [eng_rd.addr.eq(Cat(i[:eb], slot)), eng_rd.en.eq(1)]
                m.d.sync += i.eq(i + 1)
                with m.If(i != 0):
                    m.d.sync += Array(words)[i - 1].eq(eng_rd.data)
                with m.If(i == len(CQ_DESC)):
                    m.d.sync += state.eq(CQState.START)
            with m.Case(CQState.START):
                with m.If(~self.ctrl_busy):
                    m.d.comb += self.start.eq(1)
                    m.d.sync += [state.eq(CQState.WAIT), t_start.eq(now)]
            with m.Case(CQState.WAIT):
                with m.If(self.ctrl_done):
                    m.d.sync += [state.eq(CQState.WRITE), i.eq(0), t_done.eq(now)]
            with m.Case(CQState.WRITE):
                # status is final one cycle after the done pulse
                with m.If(i == 0):
                    m.d.sync += done_status.eq(self.ctrl_status)
                with m.Else():
                    m.d.comb += [eng_wr.addr.eq(Cat((i - 1)[:eb], slot)), eng_wr.data.eq(Array(rec)[i - 1]),
                                 eng_wr.en.eq(1)]
                m.d.sync += i.eq(i + 1)
                with m.If(i == len(CQ_CPL)):
                    m.d.sync += [state.eq(CQState.IDLE), head.eq(head + 1), halted.eq(err)]
                    m.d.comb += [irq_done.eq(flags.irq | err), irq_error.eq(err)]
        return m
