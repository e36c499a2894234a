"""cocotb smoke test of the simulation runner (a counter)."""
import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge


@cocotb.test()
async def counter_counts(dut):
    cocotb.start_soon(Clock(dut.clk, 1, unit="ns").start())
    dut.rst.value = 1
    dut.en.value = 0
    await ClockCycles(dut.clk, 2)
    dut.rst.value = 0
    dut.en.value = 1
    await ClockCycles(dut.clk, 10)
    await RisingEdge(dut.clk)
    v = int(dut.count.value)
    assert 9 <= v <= 11, v
