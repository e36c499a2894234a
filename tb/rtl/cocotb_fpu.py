"""cocotb driver of the FPU vector harness (``tb/unit/test_fpu.py::FpuVectorHarness``).

The harness holds ``lanes`` copies of every FPU unit fed from shared wide
buses, so one bus write evaluates ``lanes`` vectors of every unit.  This module
only moves data: it reads the operand arrays that pytest wrote (``.npz`` named
by ``FPU_VECTORS``), drives them through the harness ``lanes`` at a time and
writes the unit outputs to ``FPU_RESULTS``; pytest compares them with
``flashnpu.golden.numerics`` (the golden model never runs in here).

Input archive: for every job name ``<unit>`` the arrays ``<unit>_a``,
``<unit>_b`` and ``<unit>_c`` (uint32, equal length, a multiple of
``lanes``).  Output archive: ``<unit>`` (uint32) per job, and the measured
rates (vectors per second) in ``rates`` / ``rate_jobs``.  The reciprocal
run fails unless busy and done follow ``Recip.LATENCY`` exactly (checked in
cycles 1, LATENCY-1, LATENCY and LATENCY+1 of every batch).
"""

import json
import os
import time

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge, Timer

# unit -> (output port, output lane width)
OUTPUTS = {
    "add": ("o_add", 32), "mul": ("o_mul", 32), "mac": ("o_mac", 32), "max": ("o_max", 32),
    "exp2": ("o_exp2", 32), "f16": ("o_f16", 16), "recip": ("o_recip", 32),
}


def _pack(values: np.ndarray, width: int) -> int:
    """Lane k of the bus = values[k] (lane 0 in the low bits)."""
    dtype = {16: "<u2", 32: "<u4"}[width]
    return int.from_bytes(values.astype(dtype).tobytes(), "little")


def _unpack(bus: int, lanes: int, width: int) -> np.ndarray:
    dtype = {16: "<u2", 32: "<u4"}[width]
    return np.frombuffer(bus.to_bytes(lanes * width // 8, "little"), dtype=dtype).astype(np.uint32)


@cocotb.test()
async def fpu_vectors(dut):
    """Run every job of the vector archive through the harness."""
    meta = json.loads(os.environ["FLASHNPU_META"])
    lanes = int(meta["lanes"])
    latency = int(meta["recip_latency"])
    vectors = np.load(os.environ["FPU_VECTORS"])
    jobs = sorted({k.rsplit("_", 1)[0] for k in vectors.files})
    results = {}
    rates = {}

    cocotb.start_soon(Clock(dut.clk, 2, unit="ns").start())
    dut.rst.value = 1
    dut.start.value = 0
    await ClockCycles(dut.clk, 2)
    dut.rst.value = 0

    for job in jobs:
        a, b, c = (vectors[f"{job}_{s}"] for s in "abc")
        if len(a) % lanes:
            raise ValueError(f"job {job}: {len(a)} vectors is not a multiple of {lanes} lanes")
        port, width = OUTPUTS[job]
        out = np.zeros(len(a), np.uint32)
        t0 = time.perf_counter()
        if job != "recip":
            # Combinational units: write the buses, let them settle, read.
            for k in range(0, len(a), lanes):
                dut.a.value = _pack(a[k:k + lanes], 32)
                dut.b.value = _pack(b[k:k + lanes], 32)
                dut.c.value = _pack(c[k:k + lanes], 32)
                await Timer(1, unit="ns")
                out[k:k + lanes] = _unpack(getattr(dut, port).value.to_unsigned(), lanes, width)
        else:
            # The sequential reciprocal: start on one edge, expect done exactly
            # LATENCY cycles later on every lane, and busy in between.
            full = (1 << lanes) - 1
            for k in range(0, len(a), lanes):
                await FallingEdge(dut.clk)
                dut.a.value = _pack(a[k:k + lanes], 32)
                dut.start.value = 1
                await FallingEdge(dut.clk)                     # now in cycle 1
                dut.start.value = 0
                dut.a.value = _pack(~a[k:k + lanes], 32)      # x must be latched, not followed
                if dut.busy.value.to_unsigned() != full or dut.done.value.to_unsigned() != 0:
                    raise AssertionError(f"recip batch {k}: not busy in cycle 1")
                await ClockCycles(dut.clk, latency - 2)
                await FallingEdge(dut.clk)                     # cycle LATENCY - 1
                if dut.busy.value.to_unsigned() != full or dut.done.value.to_unsigned() != 0:
                    raise AssertionError(f"recip batch {k}: done early or not busy in cycle {latency - 1}")
                await FallingEdge(dut.clk)                     # cycle LATENCY
                if dut.done.value.to_unsigned() != full or dut.busy.value.to_unsigned() != 0:
                    raise AssertionError(f"recip batch {k}: done = {dut.done.value} in cycle {latency}")
                out[k:k + lanes] = _unpack(dut.o_recip.value.to_unsigned(), lanes, 32)
                await FallingEdge(dut.clk)                     # done is a one-cycle pulse, o holds
                if dut.done.value.to_unsigned() != 0:
                    raise AssertionError(f"recip batch {k}: done longer than one cycle")
                if not np.array_equal(_unpack(dut.o_recip.value.to_unsigned(), lanes, 32), out[k:k + lanes]):
                    raise AssertionError(f"recip batch {k}: o did not hold after done")
        rates[job] = len(a) / (time.perf_counter() - t0)
        results[job] = out
        dut._log.info(f"{job}: {len(a)} vectors, {rates[job]:.0f} vectors/s")
    results["rates"] = np.array([rates[j] for j in jobs])
    results["rate_jobs"] = np.array(jobs)
    np.savez(os.environ["FPU_RESULTS"], **results)
