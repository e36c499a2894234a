"""cocotb smoke tests of the simulation runner (a counter, a decoded ready)."""
import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge, Timer


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


@cocotb.test()
async def idle_ready_is_defined(dut):
    """``ready`` comes from the reset state, which no input changes: it must
    be 1 (not X) with no clock and no reset yet, and stay 1 through reset."""
    dut.go.value = 0
    await Timer(1, unit="ns")
    assert str(dut.ready.value) == "1", f"ready = {dut.ready.value} at time 0"
    assert str(dut.flags.value) == "00000001", f"flags = {dut.flags.value} at time 0"
    cocotb.start_soon(Clock(dut.clk, 1, unit="ns").start())
    dut.rst.value = 1
    await ClockCycles(dut.clk, 2)
    dut.rst.value = 0
    await ClockCycles(dut.clk, 2)
    assert str(dut.ready.value) == "1", f"ready = {dut.ready.value} after reset"
