"""The command queue (``hdl/cmdq.py``) on its own: the testbench is the host
(ring window, doorbell, completion window) and a stand-in controller that
records every start pulse with the job registers it saw and answers done
after a few cycles.  The whole-NPU path is tested in tb/rtl/test_cmdq_rtl.py."""

from amaranth.sim import Simulator

from flashnpu.config import NPUConfig
from flashnpu.hdl.cmdq import CommandQueue, CQState
from flashnpu.hdl.npu_map import (
    COUNTERS,
    CQ_CPL,
    CQ_DESC,
    CQ_ENTRIES,
    CQ_ENTRY_WORDS,
    CQ_FLAGS,
    JOB_REGS,
    NPUError,
    register_map,
)

RM = register_map(NPUConfig())
JOB_CYCLES = 7


def run(bench_body, error_for=None):
    """Simulate ``bench_body(host)``; returns the stand-in controller's log:
    one dict per start pulse (job registers, cycle).  ``error_for``: the
    ``q_base`` values whose job completes with NPUError.RANGE."""
    dut = CommandQueue(RM)
    starts = []
    error_for = set(error_for or ())

    async def controller(ctx):
        cycle = 0
        ctx.set(dut.counters, {n: 0 for n in COUNTERS})
        while True:
            # values as the clock edge takes them
            _, _, start, active, job = await ctx.tick().sample(dut.start, dut.active, dut.job)
            cycle += 1
            if not start:
                continue
            regs = {n: getattr(job, n) for n in JOB_REGS}
            starts.append(dict(regs=regs, cycle=cycle, active=active))
            ctx.set(dut.ctrl_busy, 1)
            for _ in range(JOB_CYCLES):
                await ctx.tick()
            err = NPUError.RANGE if regs["q_base"] in error_for else NPUError.OK
            ctx.set(dut.counters, {n: regs["q_base"] + k for k, n in enumerate(COUNTERS)})
            ctx.set(dut.ctrl_status, (err << 8) | 1)          # busy, error
            ctx.set(dut.ctrl_done, 1)
            await ctx.tick()
            ctx.set(dut.ctrl_done, 0)
            ctx.set(dut.ctrl_status, (err << 8) | 2)          # idle, done, error
            ctx.set(dut.ctrl_busy, 0)

    async def bench(ctx):
        await bench_body(Host(ctx, dut))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(controller, background=True)
    sim.add_testbench(bench)
    sim.run()
    return starts


class Host:
    def __init__(self, ctx, dut):
        self.ctx, self.dut = ctx, dut
        self.irqs = []

    async def tick(self, n=1):
        for _ in range(n):
            await self.ctx.tick()
            irq = self.ctx.get(self.dut.irq)
            if irq.done or irq.error:
                self.irqs.append((irq.done, irq.error))

    async def submit(self, entry, q_base, irq=1, tag=0):
        """Descriptor of a job named by its q_base into ring entry ``entry``."""
        vals = {n: 0 for n in JOB_REGS} | dict(q_base=q_base, heads=0x10001)
        vals["cq_flags"] = CQ_FLAGS.pack(irq=irq, tag=tag)
        d = self.dut
        for k, n in enumerate(CQ_DESC):
            self.ctx.set(d.ring__addr, (entry % CQ_ENTRIES) * CQ_ENTRY_WORDS + k)
            self.ctx.set(d.ring__w_data, vals[n])
            self.ctx.set(d.ring__w_en, 1)
            await self.tick()
        self.ctx.set(d.ring__w_en, 0)

    async def doorbell(self, tail):
        self.ctx.set(self.dut.doorbell, {"tail": tail, "ring": 1})
        await self.tick()
        self.ctx.set(self.dut.doorbell, {"tail": 0, "ring": 0})

    async def reset_ring(self):
        self.ctx.set(self.dut.ctl, {"reset": 1})
        await self.tick()
        self.ctx.set(self.dut.ctl, {"reset": 0})
        await self.tick(2)

    async def wait_idle(self, limit=2000):
        for _ in range(limit):
            await self.tick()
            if not self.ctx.get(self.dut.status.busy):
                return
        raise AssertionError("queue still busy")

    async def record(self, entry) -> dict:
        words = []
        for k in range(len(CQ_CPL)):
            self.ctx.set(self.dut.cpl__addr, (entry % CQ_ENTRIES) * CQ_ENTRY_WORDS + k)
            self.ctx.set(self.dut.cpl__r_en, 1)
            await self.tick()
            self.ctx.set(self.dut.cpl__r_en, 0)
            words.append(self.ctx.get(self.dut.cpl__r_data))
        return dict(zip(CQ_CPL, words))

    def ptr(self):
        p = self.ctx.get(self.dut.ptr)
        return p.head, p.tail


def test_r2_recycled_slot_runs_exactly_one_job():
    """Case R2: 5 jobs through the 8-entry ring, then a ring reset with the
    stale descriptors left in entries 0-4, one new job, one doorbell: one
    start, one completion record, one interrupt."""
    seen = {}

    async def body(h):
        for e in range(5):
            await h.submit(e, 0x1000 * (e + 1), irq=int(e == 4), tag=e)
        await h.doorbell(5)
        await h.wait_idle()
        seen["first"] = (h.ptr(), list(h.irqs), [await h.record(e) for e in range(5)])
        await h.reset_ring()
        h.irqs.clear()
        assert h.ptr() == (0, 0)
        await h.submit(0, 0x9000, tag=9)
        await h.doorbell(1)
        await h.wait_idle()
        await h.tick(50)                     # nothing more starts on its own
        seen["second"] = (h.ptr(), list(h.irqs), [await h.record(e) for e in range(5)])

    starts = run(body)
    (ptr1, irqs1, rec1), (ptr2, irqs2, rec2) = seen["first"], seen["second"]
    assert ptr1 == (5, 5) and irqs1 == [(1, 0)]         # irq only on the last entry of the sweep
    assert [s["regs"]["q_base"] for s in starts] == [0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x9000]
    assert all(s["active"] for s in starts)
    assert ptr2 == (1, 1) and irqs2 == [(1, 0)]
    assert rec2[0]["tag"] == 9 and rec2[0]["q_tiles_lo"] == 0x9000 + COUNTERS.index("q_tiles")
    assert rec2[1:] == rec1[1:]                        # entries 1-4: their old records, untouched
    for e, r in enumerate(rec1):
        assert r["tag"] == e | (e << 16)
        assert r["status"] >> 8 & 0xFF == NPUError.OK
        assert r["total_cycles_lo"] == 0x1000 * (e + 1) and r["total_cycles_hi"] == 0
        assert r["t_done"] - r["t_start"] == JOB_CYCLES + 1
    # one job at a time, in order: each start after the previous record, the
    # gap being the record (len(CQ_CPL) + 1 cycles), IDLE, the descriptor
    # fetch (len(CQ_DESC) + 1) and START: 60 cycles
    assert all(b["t_start"] - a["t_done"] == len(CQ_CPL) + len(CQ_DESC) + 4 == 60
               for a, b in zip(rec1, rec1[1:]))


def test_overrun_doorbell_is_refused():
    seen = {}

    async def body(h):
        await h.doorbell(CQ_ENTRIES + 1)
        await h.tick(40)
        st = h.ctx.get(h.dut.status)
        seen["after"] = (h.ptr(), st.overrun, st.busy, list(h.irqs))
        await h.reset_ring()
        await h.submit(0, 0x1000)
        await h.doorbell(1)
        await h.wait_idle()
        seen["ok"] = (h.ptr(), h.ctx.get(h.dut.status).overrun)

    starts = run(body)
    assert seen["after"] == ((0, 0), 1, 0, [(0, 1)])
    assert seen["ok"] == ((1, 1), 0)
    assert len(starts) == 1


def test_error_halts_the_queue_until_reset():
    seen = {}

    async def body(h):
        for e, qb in enumerate((0x1000, 0x2000, 0x3000)):
            await h.submit(e, qb, irq=0)
        await h.doorbell(3)
        await h.tick(300)
        st = h.ctx.get(h.dut.status)
        seen["halted"] = (h.ptr(), st.halted, list(h.irqs), await h.record(1))
        await h.reset_ring()
        await h.submit(0, 0x4000)
        await h.doorbell(1)
        await h.wait_idle()
        seen["after"] = (h.ptr(), h.ctx.get(h.dut.status).halted)

    starts = run(body, error_for={0x2000})
    ptr, halted, irqs, rec = seen["halted"]
    assert ptr == (2, 3) and halted == 1
    assert irqs == [(1, 1)]                      # the failing entry interrupts though its irq flag is 0
    assert rec["status"] >> 8 & 0xFF == NPUError.RANGE
    assert [s["regs"]["q_base"] for s in starts] == [0x1000, 0x2000, 0x4000]
    assert seen["after"] == ((1, 1), 0)


def test_queued_job_waits_for_a_running_direct_job():
    seen = {}

    async def body(h):
        h.ctx.set(h.dut.ctrl_busy, 1)            # a direct job runs
        await h.submit(0, 0x1000)
        await h.doorbell(1)
        await h.tick(60)
        seen["waiting"] = (h.ctx.get(h.dut.status.state), h.ctx.get(h.dut.active), h.ctx.get(h.dut.start))
        h.ctx.set(h.dut.ctrl_busy, 0)
        await h.wait_idle()

    starts = run(body)
    assert seen["waiting"] == (CQState.START, 0, 0)
    assert len(starts) == 1
