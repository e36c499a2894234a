"""Builds of the memory-system top (``flashnpu.hdl.dma.MemorySystem``) for
cocotb: the configuration of the Verilator runs and the cached build.  The
testbench is ``flashnpu.sim.mem_testbench``."""

from __future__ import annotations

from flashnpu.config import small_config
from flashnpu.hdl.dma import MemorySystem
from flashnpu.hdl.mem_common import verilog_text
from flashnpu.sim import runner

__all__ = ["sim_mem_config", "build_memsys"]


def sim_mem_config(**changes):
    """Default bus widths (32 B words, 256+8 TSV lanes, 16 banks, 8 channels, 100-cycle
    latency) with a 64 KiB SRAM and a 1 MiB DRAM window, for Verilator runs."""
    base = dict(sram_bytes=64 * 1024, dram_bytes=1024 * 1024)
    base.update(changes)
    return small_config(**base)


def build_memsys(cfg, n_consumers: int = 2, sim: str = "verilator", name: str = "memsys"):
    """Build (once per configuration and source hash) the MemorySystem top for cocotb.

    The zero memory initialisers are stripped from the Verilog
    (``flashnpu.hdl.mem_common.verilog_text``).  Returns a ``BuildHandle``
    whose ``meta`` carries ``n_consumers`` for the cocotb side.
    """
    return runner.build(lambda: MemorySystem(cfg, n_consumers=n_consumers), cfg, name, sim=sim,
                        key=f"n_consumers={n_consumers}",
                        verilog_text=lambda c: verilog_text(c, name),
                        meta={"n_consumers": n_consumers})
