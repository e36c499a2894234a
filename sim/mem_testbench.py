"""Testbench of the generated MemorySystem Verilog (DMA + DRAM timing + TSV
links + SRAM) for cocotb: runs inside the simulator process.

Layering: ``MemTB`` owns the drivers (descriptor source with random idle,
completion sink with random back-pressure, SRAM consumer traffic with random
idle/back-pressure, backdoor), the storage model (``DRAMModel`` answering the
backend bus with random delay) and the scoreboard (``ByteStore`` copies of
SRAM and DRAM updated with ``copy2d`` for every accepted descriptor).  Every
byte that arrives is compared with what was sent.  The seed comes from
``FLASHNPU_SEED`` (or cocotb's seed) and is logged.

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
from flashnpu.hdl.dma import Direction, DMAError, completion_layout, descriptor_layout
from flashnpu.hdl.mem_common import addr_bits_for, sram_req_layout, word_bytes
from flashnpu.hdl.tsv import LinkStatus
from flashnpu.sim.dram_model import ByteStore, DRAMModel, copy2d
from flashnpu.sim.packing import pack, unpack

CFG = NPUConfig.from_json(os.environ["FLASHNPU_CONFIG"])
META = json.loads(os.environ.get("FLASHNPU_META", "{}"))
W = word_bytes(CFG)
SRAM = CFG.sram_bytes
REQ = sram_req_layout(addr_bits_for(SRAM, W), W)
NDATA, NSPARE = CFG.tsv_data_lanes, CFG.tsv_spare_lanes
N_CONS = META.get("n_consumers", 2)

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


class MemTB:
    """Testbench object: start/stop, drivers, model, scoreboard."""

    def __init__(self, dut, seed, desc_idle=0.3, done_bp=0.3, cons_idle=0.3, cons_bp=0.3,
                 model_delay=20, consumers=True, bd_rand=0.2):
        self.dut = dut
        self.seed = seed
        dut._log.info(f"seed={seed}")
        self.rng = random.Random(seed)
        self.model = DRAMModel(CFG, seed=seed, max_extra_delay=model_delay)
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
    async def start(self, rd_stuck0=0, rd_stuck1=0, wr_stuck0=0, wr_stuck1=0, train=True):
        d = self.dut
        self._tasks.append(cocotb.start_soon(Clock(d.clk, 1, unit="ns").start()))
        d.rst.value = 1
        for name in ("pp_release", "tsv_rd__repair_we", "tsv_wr__repair_we", "tsv_rd__bist_start",
                     "tsv_wr__bist_start", "bk__resp_valid", "sram_stall"):
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
        d.tsv_rd__fault_stuck0.value = rd_stuck0
        d.tsv_rd__fault_stuck1.value = rd_stuck1
        d.tsv_wr__fault_stuck0.value = wr_stuck0
        d.tsv_wr__fault_stuck1.value = wr_stuck1
        await ClockCycles(d.clk, 3)
        d.rst.value = 0
        self._tasks.append(cocotb.start_soon(self.model.cocotb_server(d, d.clk)))
        self._tasks.append(cocotb.start_soon(self.done.run()))
        self._tasks.append(cocotb.start_soon(self.bd_rdata.run()))
        if train:
            await self.bist("tsv_rd")
            await self.bist("tsv_wr")

    def stop(self):
        for t in self._tasks:
            t.cancel()
        self._tasks = []

    async def bist(self, link):
        d = self.dut
        await RisingEdge(d.clk)
        getattr(d, f"{link}__bist_start").value = 1
        await RisingEdge(d.clk)
        getattr(d, f"{link}__bist_start").value = 0
        for _ in range(4 * (NDATA + NSPARE) + 50):
            await FallingEdge(d.clk)
            if int(getattr(d, f"{link}__status").value) != LinkStatus.BIST:
                return LinkStatus(int(getattr(d, f"{link}__status").value))
        raise AssertionError(f"{link} BIST did not finish")

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
