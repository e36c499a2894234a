"""cocotb bench of the waveform test design (``tb/rtl/test_waves.py``).

Runs the clock (period ``WAVES_PERIOD_NS``, first rising edge at time 0),
releases reset after two cycles, drives ``fp_in`` with a known FP32 ramp
and samples the top's ports in the middle of every cycle (falling edge);
the samples go to the JSON file ``WAVES_SAMPLES`` so the test can compare
the dump with what the design did.
"""

import json
import os
import struct

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, RisingEdge
from cocotb.utils import get_sim_time

CYCLES = 40


def fp_ramp(k: int) -> float:
    """The FP32 value driven on ``fp_in`` during cycle k (exact in FP32)."""
    return k * 0.375 - 5.0


def f2u(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


@cocotb.test()
async def run_design(dut):
    period = float(os.environ.get("WAVES_PERIOD_NS", "10"))
    cocotb.start_soon(Clock(dut.clk, period, unit="ns").start(start_high=True))
    dut.rst.value = 1
    dut.en.value = 0
    dut.fp_in.value = 0
    samples = []
    for k in range(CYCLES):
        await FallingEdge(dut.clk)
        samples.append(dict(t_ps=get_sim_time("ps"), cycle=k, count=int(dut.count.value),
                            out=int(dut.out.value), lanes=int(dut.lanes.value)))
        dut.rst.value = 1 if k < 1 else 0
        dut.en.value = 0 if k < 1 else 1
        dut.fp_in.value = f2u(fp_ramp(k))
    await RisingEdge(dut.clk)
    with open(os.environ["WAVES_SAMPLES"], "w") as f:
        json.dump(samples, f)
