"""Testbench of the generated MemorySystem Verilog (DMA + DRAM channels + TSV
links + SRAM) for cocotb: runs inside the simulator process.

Layering: ``MemTB`` owns the drivers (descriptor source with random idle,
completion sink with random back-pressure, SRAM consumer traffic with random
idle/back-pressure, backdoor, the TSV control of every channel), the storage
model (``DRAMModel`` answering every channel's backend bus ``bk__<c>__``) and
the scoreboard (``ByteStore`` copies of SRAM and DRAM updated with ``copy2d``
for every accepted descriptor).  Every byte that arrives is compared with
what was sent.  The seed comes from ``FLASHNPU_SEED`` (or cocotb's seed) and
is logged.

Who answers the backend buses: a build made with ``build_memsys(...,
dram_hook=True)`` links ``sim/dram_hook.cpp``, which serves them from the
Verilator main loop with no Python per cycle (``HOOK``); ``MemTB`` uses it
when ``model_delay == 0`` and otherwise starts ``DRAMModel.cocotb_server``
(random answer delays).  The bytes live in one store either way.

Per-channel ports (``c`` in ``0 .. dram_channels-1``): ``bk__<c>__*`` and the
TSV bundles ``tsv_rd__<c>__*`` (DRAM -> logic) and ``tsv_wr__<c>__*``
(logic -> DRAM).  ``start(faults=...)`` injects stuck-at lanes per bundle
before the self-test; ``bist(link)`` runs the self-test of every channel's
bundle at once, as the NPU's ``tsv_ctl`` register does.

``StreamSource`` / ``StreamSink`` are the cocotb stream drivers, with seeded
idle and back-pressure generators (as cocotbext-axi's
``set_idle_generator`` / ``set_backpressure_generator``); they drive right
after the rising edge and sample in the falling-edge half, which is
race-free on Verilator and Icarus alike.

Used by the cocotb tests ``flashnpu.tb.rtl.cocotb_mem_system`` and the DMA
benchmark ``flashnpu.sim.cocotb_dma_bench``; the build of the top is
``flashnpu.sim.memsys``.
"""

from __future__ import annotations

import json
import os
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge, RisingEdge
from cocotb.utils import get_sim_time

from flashnpu.config import NPUConfig
from flashnpu.hdl.dma import Direction, DMAError, MemorySystem, completion_layout, descriptor_layout
from flashnpu.hdl.mem_common import addr_bits_for, sram_req_layout, word_bytes
from flashnpu.hdl.tsv import LinkStatus
from flashnpu.sim.dram_model import ByteStore, DRAMModel, copy2d, simulator_dram
from flashnpu.sim.packing import pack, unpack

CFG = NPUConfig.from_json(os.environ["FLASHNPU_CONFIG"])
META = json.loads(os.environ.get("FLASHNPU_META", "{}"))
W = word_bytes(CFG)
C = CFG.dram_channels
SRAM = CFG.sram_bytes
REQ = sram_req_layout(addr_bits_for(SRAM, W), W)
NDATA, NSPARE = CFG.tsv_data_lanes, CFG.tsv_spare_lanes
N_CONS = META.get("n_consumers", 2)
LINKS = ("rd", "wr")
#: MemorySystem's DRAM counters (ports ``dram_<name>``), summed over the channels
DRAM_COUNTERS = ("rd_bytes", "wr_bytes") + MemorySystem.DRAM_COUNTERS

# SRAM map used by the tests (bytes)
Q_BASE = 0x0
PP_BASE = 0x8000
PP_HALF = 0x8000
STATIC = (0x18000, 0x1C000)       # preloaded, read by consumer traffic, never a DMA target
SCRATCH = 0x1C000
DRAM_TENSOR = 0x10000


def env_seed() -> int:
    """The run's seed: ``FLASHNPU_SEED``, else cocotb's."""
    s = os.environ.get("FLASHNPU_SEED")
    return int(s) if s else int(cocotb.RANDOM_SEED)


def now() -> int:
    """The simulation time in cycles (1 ns clock)."""
    return int(get_sim_time("ns"))


HOOK = simulator_dram(CFG.dram_bytes)


class MemTB:
    """Testbench object: start/stop, drivers, model, scoreboard.

    ``model_delay``: the largest random extra delay of a DRAM answer (cycles);
    0 uses the simulator's own DRAM server when the build has it.
    """

    def __init__(self, dut, seed, desc_idle=0.3, done_bp=0.3, cons_idle=0.3, cons_bp=0.3,
                 model_delay=20, consumers=True, bd_rand=0.2):
        self.dut = dut
        self.seed = seed
        self.rng = random.Random(seed)
        self.use_hook = HOOK is not None and model_delay == 0
        self.model = DRAMModel(CFG, seed=seed, max_extra_delay=model_delay, buffer=HOOK[1] if HOOK else None)
        dut._log.info(f"seed={seed}, DRAM served by "
                      + ("the simulator (sim/dram_hook.cpp)" if self.use_hook else "the Python model"))
        self.sram = ByteStore(SRAM)
        self.dram = ByteStore(CFG.dram_bytes)
        self.desc = StreamSource(dut, "desc", dut.clk, random.Random(seed + 1), desc_idle)
        self.done = StreamSink(dut, "done", dut.clk, random.Random(seed + 2), done_bp)
        self.bd_req = StreamSource(dut, "bd__req", dut.clk, random.Random(seed + 3), bd_rand)
        self.bd_rdata = StreamSink(dut, "bd__rdata", dut.clk, random.Random(seed + 4), bd_rand)
        self.cons_idle, self.cons_bp = cons_idle, cons_bp
        self.use_consumers = consumers
        self.cons_checked = 0
        self.completions = []
        self._tasks = []

    # ------------------------------------------------------------ lifecycle
    async def start(self, faults=None, train=True):
        """Clock, reset, DRAM server, sinks; then (``train``) the self-test of
        every TSV bundle.  ``faults``: ``{(link, channel): (stuck0, stuck1)}``
        lane masks (``link`` "rd" or "wr") applied before the self-test."""
        d = self.dut
        self._tasks.append(cocotb.start_soon(Clock(d.clk, 1, unit="ns").start()))
        if HOOK:
            HOOK[0].flashnpu_dram_serve(0)
        d.rst.value = 1
        zero = ["pp_release", "sram_stall", *(f"bk__{c}__resp_valid" for c in range(C)),
                *(f"tsv_{link}__{c}__{n}" for link in LINKS for c in range(C) for n in ("repair_we", "bist_start"))]
        for name in zero:
            getattr(d, name).value = 0
        for i in range(N_CONS):
            getattr(d, f"sram_ports__{i}__req__valid").value = 0
            getattr(d, f"sram_ports__{i}__rdata__ready").value = 0
        d.dram_lo.value = DRAM_TENSOR
        d.dram_hi.value = CFG.dram_bytes
        d.sram_lo.value = 0
        d.sram_hi.value = SRAM
        d.pp_base.value = PP_BASE
        d.pp_half_bytes.value = PP_HALF
        for link in LINKS:
            for c in range(C):
                self.set_faults(link, c, *(faults or {}).get((link, c), (0, 0)))
        await ClockCycles(d.clk, 3)
        d.rst.value = 0
        if self.use_hook:
            HOOK[0].flashnpu_dram_serve(1)
        else:
            self._tasks.append(cocotb.start_soon(self.model.cocotb_server(d, d.clk)))
        self._tasks.append(cocotb.start_soon(self.done.run()))
        self._tasks.append(cocotb.start_soon(self.bd_rdata.run()))
        if train:
            for link in LINKS:
                await self.bist(link)

    def stop(self):
        """Stop every coroutine; with the simulator's DRAM server, stop it and
        fail on an access outside the DRAM."""
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        if HOOK:
            HOOK[0].flashnpu_dram_serve(0)
            assert HOOK[0].flashnpu_dram_errors() == 0, "the DRAM server saw an access outside the DRAM"

    # ------------------------------------------------------------ TSV bundles
    def tsv(self, link, c, name):
        """Port ``name`` of channel ``c``'s ``link`` ("rd" or "wr") bundle."""
        return getattr(self.dut, f"tsv_{link}__{c}__{name}")

    def status(self, link, c) -> LinkStatus:
        return LinkStatus(int(self.tsv(link, c, "status").value))

    def set_faults(self, link, c, stuck0=0, stuck1=0):
        """Test-only stuck-at lanes of one bundle (seen by the next self-test)."""
        self.tsv(link, c, "fault_stuck0").value = stuck0
        self.tsv(link, c, "fault_stuck1").value = stuck1

    async def bist(self, link, channels=None):
        """Self-test of the ``link`` bundles of ``channels`` (default every
        channel) at once; returns every channel's status once none is in BIST."""
        d = self.dut
        chans = range(C) if channels is None else channels
        await RisingEdge(d.clk)
        for c in chans:
            self.tsv(link, c, "bist_start").value = 1
        await RisingEdge(d.clk)
        for c in chans:
            self.tsv(link, c, "bist_start").value = 0
        for _ in range(4 * (NDATA + NSPARE) + 50):
            await FallingEdge(d.clk)
            st = [self.status(link, c) for c in range(C)]
            if LinkStatus.BIST not in st:
                return st
        raise AssertionError(f"{link} BIST did not finish: {st}")

    async def repair(self, link, c, idx, valid, lane):
        """Host write of repair-map entry ``idx`` of channel ``c``'s ``link`` bundle."""
        await RisingEdge(self.dut.clk)
        for name, v in (("repair_we", 1), ("repair_idx", idx), ("repair_valid", valid), ("repair_lane", lane)):
            self.tsv(link, c, name).value = v
        await RisingEdge(self.dut.clk)
        self.tsv(link, c, "repair_we").value = 0

    # ------------------------------------------------------------ counters
    def dram_counters(self) -> dict:
        """The DRAM counters (summed over the channels) and the DMA's."""
        d = self.dut
        out = {k: int(getattr(d, f"dram_{k}").value) for k in DRAM_COUNTERS}
        for k in ("bytes_moved", "beats", "active_cycles"):
            out[f"dma_{k}"] = int(getattr(d, f"dma_{k}").value)
        return out

    async def after_refresh(self, gap=None):
        """Wait until every channel has finished a refresh, then ``gap`` cycles
        more (default tRP + tRFC + tRCD + tRP: every bank closed, every timer
        run out): the DRAM is then in the same state at the same refresh phase
        every time, so two transfers started this way take equal cycles."""
        t = CFG.dram_timing_cycles()
        gap = 2 * t["trp"] + t["trfc"] + t["trcd"] + 8 if gap is None else gap
        d = self.dut
        await FallingEdge(d.clk)
        r0 = int(d.dram_refreshes.value)
        for _ in range(t["trefi"] + 200):
            await FallingEdge(d.clk)
            r = int(d.dram_refreshes.value)
            if r >= r0 + C and r % C == 0:
                break
        else:
            raise AssertionError("no refresh in tREFI cycles")
        await ClockCycles(d.clk, gap)

    # ------------------------------------------------------------ backdoor
    async def sram_write(self, addr, data: bytes):
        assert addr % W == 0 and len(data) % W == 0
        for i in range(0, len(data), W):
            await self.bd_req.send(pack(REQ, dict(addr=(addr + i) // W, write=1, wmask=(1 << W) - 1,
                                        wdata=int.from_bytes(data[i:i + W], "little"))))
        self.sram.write(addr, data)

    async def sram_read(self, addr, n) -> bytes:
        assert addr % W == 0 and n % W == 0
        for i in range(0, n, W):
            await self.bd_req.send(pack(REQ, dict(addr=(addr + i) // W, write=0)))
        words = await self.bd_rdata.get(n // W)
        return b"".join(int(v).to_bytes(W, "little") for v in words)

    async def check_sram(self, lo, hi, what=""):
        got = await self.sram_read(lo, hi - lo)
        exp = self.sram.read(lo, hi - lo)
        assert got == exp, f"SRAM {what} [{lo:#x},{hi:#x}) seed={self.seed}\n" + mismatch_report(exp, got, lo)

    def check_dram(self, lo, hi, what=""):
        got = self.model.read(lo, hi - lo)
        exp = self.dram.read(lo, hi - lo)
        assert got == exp, f"DRAM {what} [{lo:#x},{hi:#x}) seed={self.seed}\n" + mismatch_report(exp, got, lo)

    def fill_dram(self, addr, data: bytes):
        self.model.write(addr, data)
        self.dram.write(addr, data)

    # ------------------------------------------------------------ DMA
    async def submit(self, tag, src, dst, rows, bpr, src_stride, dst_stride, direction=Direction.DRAM_TO_SRAM,
                     pp_en=0, pp_half=0, pp_commit=0, expect_ok=True):
        await self.desc.send(pack(descriptor_layout, dict(src=src, dst=dst, rows=rows, bytes_per_row=bpr,
                                  src_stride=src_stride, dst_stride=dst_stride, direction=direction,
                                  pp_en=pp_en, pp_half=pp_half, pp_commit=pp_commit, tag=tag)))
        if expect_ok:
            if direction == Direction.DRAM_TO_SRAM:
                copy2d(self.dram, self.sram, src, dst, rows, bpr, src_stride, dst_stride)
            else:
                copy2d(self.sram, self.dram, src, dst, rows, bpr, src_stride, dst_stride)

    async def wait_done(self, n, timeout=200000):
        for _ in range(timeout):
            while self.done.items:
                r = unpack(completion_layout, self.done.items.pop(0))
                self.completions.append((r["tag"], DMAError(r["code"])))
            if len(self.completions) >= n:
                return self.completions
            await RisingEdge(self.dut.clk)
        raise AssertionError(f"{len(self.completions)} of {n} completions: {self.completions}")

    async def wait_full(self, half, timeout=200000):
        for i in range(timeout):
            await FallingEdge(self.dut.clk)
            if (int(self.dut.pp_full.value) >> half) & 1:
                return i
        raise AssertionError(f"half {half} never became full")

    async def release(self, half):
        await RisingEdge(self.dut.clk)
        self.dut.pp_release.value = 1 << half
        await RisingEdge(self.dut.clk)
        self.dut.pp_release.value = 0

    # ------------------------------------------------------------ consumer traffic
    def start_consumers(self):
        for i in range(N_CONS):
            self._tasks.append(cocotb.start_soon(self._consumer(i)))

    async def _consumer(self, i):
        """Random reads of the static region on SRAM port i, compared in order."""
        r = random.Random(self.seed * 31 + i)
        src = StreamSource(self.dut, f"sram_ports__{i}__req", self.dut.clk, r, self.cons_idle)
        sink = StreamSink(self.dut, f"sram_ports__{i}__rdata", self.dut.clk, r, self.cons_bp)
        self._tasks.append(cocotb.start_soon(sink.run()))
        expected = []
        lo, hi = STATIC
        while True:
            a = r.randrange(lo // W, hi // W)
            await src.send(pack(REQ, dict(addr=a, write=0)))
            expected.append(self.sram.read(a * W, W))
            while sink.items:
                got = int(sink.items.pop(0)).to_bytes(W, "little")
                exp = expected.pop(0)
                assert got == exp, f"consumer {i}: expected {exp.hex()} got {got.hex()} seed={self.seed}"
                self.cons_checked += 1


# ------------------------------------------------------------------ stream drivers
class StreamSource:
    """cocotb driver of a stream input of the DUT (``<name>__valid/payload/ready``).

    ``idle`` is the probability of an idle cycle before each beat (seeded).
    """

    def __init__(self, dut, name, clk, rng: random.Random, idle: float = 0.0):
        self.valid = getattr(dut, name + "__valid")
        self.payload = getattr(dut, name + "__payload")
        self.ready = getattr(dut, name + "__ready")
        self.clk = clk
        self.rng = rng
        self.idle = idle
        self.valid.value = 0
        self._edge_time = -1

    async def send(self, value: int):
        """Present ``value`` until it is taken; back-to-back calls give back-to-back beats."""
        if self._edge_time != get_sim_time("step"):
            await RisingEdge(self.clk)
        while self.rng.random() < self.idle:
            self.valid.value = 0
            await RisingEdge(self.clk)
        self.payload.value = value
        self.valid.value = 1
        while True:
            await FallingEdge(self.clk)
            taken = int(self.ready.value)
            await RisingEdge(self.clk)       # the beat transfers at this edge when taken
            if taken:
                break
        self.valid.value = 0
        self._edge_time = get_sim_time("step")


class StreamSink:
    """cocotb receiver of a stream output of the DUT; ``backpressure`` is the
    probability of holding ``ready`` low in a cycle (seeded).  Beats collect
    in ``self.items``."""

    def __init__(self, dut, name, clk, rng: random.Random, backpressure: float = 0.0):
        self.valid = getattr(dut, name + "__valid")
        self.payload = getattr(dut, name + "__payload")
        self.ready = getattr(dut, name + "__ready")
        self.clk = clk
        self.rng = rng
        self.backpressure = backpressure
        self.items: list[int] = []
        self.ready.value = 0

    async def run(self):
        while True:
            await RisingEdge(self.clk)
            r = 0 if self.rng.random() < self.backpressure else 1
            self.ready.value = r
            await FallingEdge(self.clk)
            if r and int(self.valid.value):
                self.items.append(int(self.payload.value))

    async def get(self, n: int = 1, timeout: int = 100000):
        """Wait until ``n`` items are available, pop and return them."""
        for _ in range(timeout):
            if len(self.items) >= n:
                out, self.items[:] = self.items[:n], self.items[n:]
                return out
            await RisingEdge(self.clk)
        raise TimeoutError(f"waited {timeout} cycles for {n} beats, got {len(self.items)}")


def mismatch_report(expected: bytes, actual: bytes, base: int = 0, limit: int = 8) -> str:
    """Human-readable diff of two byte strings (first ``limit`` differing bytes)."""
    lines = [f"{len(expected)} bytes expected, {len(actual)} got"]
    n = 0
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e != a:
            lines.append(f"  byte {base + i:#x}: expected {e:#04x} got {a:#04x} (xor {e ^ a:#04x})")
            n += 1
            if n >= limit:
                break
    return "\n".join(lines)
