"""The frozen configuration object: defaults, derived values, validation."""

import dataclasses
import json
import subprocess
import sys

import pytest

from flashnpu.config import DEFAULT, NPUConfig, small_config


def test_defaults_are_the_design_point():
    c = DEFAULT
    assert (c.array_rows, c.array_cols, c.pe_registers, c.br, c.bc, c.max_head_dim) == (32, 32, 64, 64, 64, 128)
    assert (c.rows_per_pe, c.cols_per_pe, c.o_cols_per_pe(128), c.tree_levels) == (2, 2, 4, 5)
    # S, O_acc, m/l/alpha; the second S block at register 20 (softmax_overlap)
    assert c.s1_base(128) == 20 and c.registers_needed(128) == 20 + 4 <= c.pe_registers
    assert c.replace(softmax_overlap=False).registers_needed(128) == 4 + 8 + 6
    assert c.overlaps_softmax and not c.replace(softmax_overlap=False).overlaps_softmax
    assert c.macs_per_cycle == 1024 and c.peak_flops == 2 * 1024 * 1.5e9
    assert c.o_cols_per_pe(72) == 3 and c.o_cols_per_pe(8) == 1


def test_frozen_and_round_trips_through_json():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.array_rows = 8
    c = small_config(4, 4)
    assert NPUConfig.from_json(c.to_json()) == c
    assert json.loads(c.to_json())["array_rows"] == 4
    assert c.digest != DEFAULT.digest and len(c.digest) == 12


def test_config_imports_neither_amaranth_nor_cocotb():
    code = "import sys, flashnpu.config; print(any(m.split('.')[0] in ('amaranth','cocotb') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("change, words", [
    (dict(array_rows=24), "array_rows must be a power of 2, not 24"),
    (dict(array_cols=0), "array_cols must be positive, not 0"),
    (dict(br=48), "br must be a multiple of array_rows=32, not 48"),
    (dict(bc=40), "bc must be a multiple of array_cols=32, not 40"),
    (dict(max_head_dim=100), "max_head_dim must be a multiple of 8, not 100"),
    (dict(max_head_dim=1024), "max_head_dim=1024 needs 74 registers per PE"),
    (dict(clock_hz=-1.0), "clock_hz must be a positive finite number, not -1.0"),
    (dict(clock_hz=float("nan")), "clock_hz must be a positive finite number"),
    (dict(sram_banks=3), "sram_banks must be a power of 2, not 3"),
    (dict(tsv_spare_lanes=-1), "tsv_spare_lanes must be >= 0, not -1"),
    (dict(tsv_data_lanes=100), "tsv_data_lanes must equal 8*dram_channel_bytes=256, not 100"),
    (dict(dram_latency_cycles=1.5), "dram_latency_cycles must be an int, not 1.5"),
    (dict(pe_registers=True), "pe_registers must be an int, not True"),
    (dict(dram_banks=3), "dram_banks must be a power of 2, not 3"),
    (dict(dram_row_bytes=48), "dram_row_bytes must be a power of 2, not 48"),
    (dict(dram_row_bytes=16), "dram_row_bytes must be at least dram_channel_bytes=32, not 16"),
    (dict(dram_trcd_ns=0), "dram_trcd_ns must be positive, not 0"),
    (dict(dram_trfc_ns=2.5), "dram_trfc_ns must be an int, not 2.5"),
    (dict(dram_trefi_ns=274), "dram_trefi_ns=274 leaves no time between refreshes (tRFC 260 ns + tRP 14 ns)"),
])
def test_every_field_is_validated_with_its_value(change, words):
    with pytest.raises(ValueError) as e:
        DEFAULT.replace(**change)
    assert words in str(e.value)


def test_unknown_json_field_is_named():
    with pytest.raises(ValueError, match="rows_typo"):
        NPUConfig.from_dict({"rows_typo": 4})


def test_dram_defaults_and_timing_in_cycles():
    c = DEFAULT
    assert (c.dram_latency_cycles, c.dram_banks, c.dram_row_bytes) == (64, 16, 1024)
    ns = dict(trcd=14, trp=14, tras=34, trrd=6, tfaw=30, trefi=3900, trfc=260)     # HBM2 8Gb
    assert {k: getattr(c, f"dram_{k}_ns") for k in ns} == ns
    # ceil(ns * 1.5): 14 * 1.5 is 21.000000000000004 in floating point and stays 21
    assert c.dram_timing_cycles() == dict(trcd=21, trp=21, tras=51, trrd=9, tfaw=45, trefi=5850, trfc=390)
    assert c.replace(clock_hz=1e9).dram_timing_cycles() == ns
    assert c.replace(clock_hz=1.1e9).dram_timing_cycles()["trcd"] == 16             # 15.4 rounds up
    assert c.replace(clock_hz=1e6).dram_timing_cycles() == dict(trcd=1, trp=1, tras=1, trrd=1, tfaw=1,
                                                                 trefi=4, trfc=1)   # at least 1 cycle


@pytest.mark.parametrize("clock_hz, trefi_ns, ok", [
    (1.5e9, 274, False), (1.5e9, 275, True),      # 411 <= 390 + 21 cycles; 413 > 411
    (1e9, 274, False), (1e9, 275, True),          # 274 <= 260 + 14; 275 > 274
])
def test_trefi_must_leave_time_after_trfc_and_trp(clock_hz, trefi_ns, ok):
    """The check is in cycles (after rounding up), strictly tREFI > tRFC + tRP."""
    if ok:
        t = DEFAULT.replace(clock_hz=clock_hz, dram_trefi_ns=trefi_ns).dram_timing_cycles()
        assert t["trefi"] > t["trfc"] + t["trp"]
    else:
        with pytest.raises(ValueError, match=f"dram_trefi_ns={trefi_ns} leaves no time between refreshes"):
            DEFAULT.replace(clock_hz=clock_hz, dram_trefi_ns=trefi_ns)


def test_softmax_overlap_where_the_second_s_block_fits():
    wide = small_config(4, 4, bc=64, max_head_dim=16)       # a 2 x 16 S block per PE
    assert wide.softmax_overlap is None and not wide.overlaps_softmax
    assert wide.registers_needed(16) == 32 + 8 + 6
    with pytest.raises(ValueError, match="needs 96 registers per PE"):
        small_config(4, 4, bc=64, max_head_dim=16, softmax_overlap=True)
    with pytest.raises(ValueError, match="softmax_overlap must be True, False or None, not 'yes'"):
        NPUConfig(softmax_overlap="yes")
