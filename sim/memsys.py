"""Builds of the memory-system top (``flashnpu.hdl.dma.MemorySystem``) for
cocotb: the configuration of the Verilator runs and the cached build.  The
testbench is ``flashnpu.sim.mem_testbench``."""

from __future__ import annotations

from flashnpu.config import small_config
from flashnpu.hdl.dma import MemorySystem
from flashnpu.hdl.mem_common import verilog_text, word_bytes
from flashnpu.sim import runner

__all__ = ["sim_mem_config", "build_memsys"]


def sim_mem_config(**changes):
    """Default memory system (8 channels of 32 B words, 16 banks of 1 KiB rows
    each, HBM2 timing, 64-cycle latency, 256+8 TSV lanes per bundle, 16 SRAM
    banks) with a 64 KiB SRAM and a 16 MiB DRAM window, for Verilator runs.
    16 MiB leaves room for a row-hostile stride (one row per access: 128 KiB
    = channels x row bytes x banks) over a 64-row tile."""
    base = dict(sram_bytes=64 * 1024, dram_bytes=16 * 1024 * 1024)
    base.update(changes)
    return small_config(**base)


def build_memsys(cfg, n_consumers: int = 2, sim: str = "verilator", name: str = "memsys",
                 dram_hook: bool = True):
    """Build (once per configuration and source hash) the MemorySystem top for cocotb.

    The zero memory initialisers are stripped from the Verilog
    (``flashnpu.hdl.mem_common.verilog_text``).  ``dram_hook`` (Verilator
    only): link ``sim/dram_hook.cpp``, which serves every channel's backend
    bus from the simulator's main loop when the testbench asks for it
    (``mem_testbench.HOOK``); the Python server stays available for random
    answer delays.  Returns a ``BuildHandle`` whose ``meta`` carries
    ``n_consumers`` for the cocotb side.
    """
    hook = dram_hook and sim == "verilator"
    return runner.build(lambda: MemorySystem(cfg, n_consumers=n_consumers), cfg, name, sim=sim,
                        key=f"n_consumers={n_consumers}",
                        verilog_text=lambda c: verilog_text(c, name),
                        meta={"n_consumers": n_consumers},
                        dram_word=word_bytes(cfg) if hook else None, dram_channels=cfg.dram_channels)
