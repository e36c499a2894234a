"""Shared helpers of the memory-system testbenches (both tiers).

* amaranth.sim tier: ``stream_put`` / ``stream_get`` with random idle and
  back-pressure (async testbenches, ``ctx.set / ctx.tick / ctx.get``).
* cocotb tier: ``StreamSource`` / ``StreamSink`` drivers with seeded idle and
  back-pressure generators (as cocotbext-axi's ``set_idle_generator`` /
  ``set_backpressure_generator``); they drive right after the rising edge
  and sample in the falling-edge half, which is race-free on Verilator and
  Icarus alike.
* payload packing for ``data.StructLayout`` payloads (``pack`` / ``unpack``),
  since a struct payload reaches Verilog as one flat port.
* small configurations used by the memory tests.
"""

from __future__ import annotations

import random

from amaranth.lib import data

from flashnpu.config import small_config

__all__ = ["tiny_mem_config", "sim_mem_config", "pack", "unpack", "stream_put", "stream_get",
           "StreamSource", "StreamSink", "mismatch_report"]


def tiny_mem_config(**changes):
    """4-byte bus words, 32+2 TSV lanes, 4 banks/channels: fast amaranth.sim unit tests."""
    base = dict(sram_bytes=2048, sram_banks=4, sram_bank_bytes=4, dram_channel_bytes=4,
                dram_channels=4, tsv_data_lanes=32, tsv_spare_lanes=2, dram_bytes=65536,
                dram_latency_cycles=8)
    base.update(changes)
    return small_config(**base)


def sim_mem_config(**changes):
    """Default bus widths (32 B words, 256+8 TSV lanes, 16 banks, 8 channels, 100-cycle
    latency) with a 64 KiB SRAM and a 1 MiB DRAM window, for Verilator runs."""
    base = dict(sram_bytes=64 * 1024, dram_bytes=1024 * 1024)
    base.update(changes)
    return small_config(**base)


# ------------------------------------------------------------------ packing
def pack(layout: data.StructLayout, **fields) -> int:
    """Integer value of a struct payload (unnamed fields are 0)."""
    v = 0
    for name, field in layout:
        x = int(fields.pop(name, 0))
        w = field.width
        v |= (x & ((1 << w) - 1)) << field.offset
    if fields:
        raise KeyError(f"unknown fields {sorted(fields)!r}")
    return v


def unpack(layout: data.StructLayout, value: int) -> dict:
    """Fields of a struct payload as a dict of ints."""
    value = int(value)
    return {name: (value >> f.offset) & ((1 << f.width) - 1) for name, f in layout}


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


# ------------------------------------------------------------------ amaranth.sim
async def stream_put(ctx, s, payload, rng: random.Random | None = None, idle: float = 0.0):
    """Send one beat on stream ``s`` (after random idle cycles with probability ``idle``)."""
    if rng is not None:
        while rng.random() < idle:
            await ctx.tick()
    ctx.set(s.payload, payload)
    ctx.set(s.valid, 1)
    await ctx.tick().until(s.ready)
    ctx.set(s.valid, 0)


async def stream_get(ctx, s, rng: random.Random | None = None, backpressure: float = 0.0):
    """Receive one beat from stream ``s`` (holding ``ready`` low at random)."""
    while True:
        ready = not (rng is not None and rng.random() < backpressure)
        ctx.set(s.ready, int(ready))
        _, _, valid, payload = await ctx.tick().sample(s.valid, s.payload)
        if ready and valid:
            ctx.set(s.ready, 0)
            return payload


# ------------------------------------------------------------------ cocotb
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
        from cocotb.triggers import FallingEdge, RisingEdge
        from cocotb.utils import get_sim_time
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
        from cocotb.triggers import FallingEdge, RisingEdge
        while True:
            await RisingEdge(self.clk)
            r = 0 if self.rng.random() < self.backpressure else 1
            self.ready.value = r
            await FallingEdge(self.clk)
            if r and int(self.valid.value):
                self.items.append(int(self.payload.value))

    async def get(self, n: int = 1, timeout: int = 100000):
        """Wait until ``n`` items are available, pop and return them."""
        from cocotb.triggers import RisingEdge
        for _ in range(timeout):
            if len(self.items) >= n:
                out, self.items[:] = self.items[:n], self.items[n:]
                return out
            await RisingEdge(self.clk)
        raise TimeoutError(f"waited {timeout} cycles for {n} beats, got {len(self.items)}")


# ------------------------------------------------------------------ builds
def build_memsys(cfg, n_consumers: int = 2, sim: str = "verilator", name: str = "memsys"):
    """Build (once per configuration and source hash) the MemorySystem top for cocotb.

    The zero memory initialisers are stripped from the Verilog
    (``flashnpu.hdl.mem_common.verilog_text``).  Returns a ``BuildHandle``
    whose ``meta`` carries ``n_consumers`` for the cocotb side.
    """
    from flashnpu.hdl.dma import MemorySystem
    from flashnpu.hdl.mem_common import verilog_text
    from flashnpu.sim import runner

    return runner.build(lambda: MemorySystem(cfg, n_consumers=n_consumers), cfg, name, sim=sim,
                        key=f"n_consumers={n_consumers}",
                        verilog_text=lambda c: verilog_text(c, name),
                        meta={"n_consumers": n_consumers})


def raises_quietly(exc, match, fn):
    """``pytest.raises`` for a component constructor that rejects its
    parameters, without Amaranth's "created but never used" warning for the
    half-built object."""
    import gc
    import warnings

    import pytest

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(exc, match=match):
            fn()
        gc.collect()
