"""Energy model: arithmetic on a hand-computed case, the SRAM size curve, and
the energy of one tile pair checked term by term."""

import math

import pytest

from flashnpu.config import DEFAULT
from flashnpu.scripts.energy import SOURCES, TERMS, EnergyTable, energy_of, sram_pj_per_64b, sram_pj_per_bit
from flashnpu.scripts.perf_model import Counters, Job, OpDetail, model

ROUND = EnergyTable(reg_pj_per_bit=0.1, sram_pj_per_bit=1.0, tsv_pj_per_bit=0.5, dram_pj_per_bit=4.0,
                    offchip_pj_per_bit=20.0, fp16_mul_pj=1.1, fp32_add_pj=0.9, fp32_mul_pj=3.7,
                    exp2_pj=14.0, recip_pj=16.0, cmp_pj=1.0, operand_pj_per_bit=0.2)


def test_hand_computed_small_case():
    c = Counters(reg_bytes=10, sram_bytes=100, tsv_bytes=50, dram_bytes=50, mac_ops=1000,
                 exp2_ops=20, recip_ops=2, offchip_bytes=3)
    ops = OpDetail(fp32_mul=7, fp32_add=11, operand_bytes=5)
    e = energy_of(c, ops, ROUND.replace(sram_crosses_tsv=True))
    # by hand, in pJ:
    assert e["mac"] == pytest.approx(2000.0)        # 1000 x (1.1 + 0.9)
    assert e["softmax_ops"] == pytest.approx(348.9)  # 7x3.7 + 11x1 + 20x14 + 2x16
    assert e["register"] == pytest.approx(8.0)      # 80 bit x 0.1
    assert e["operand"] == pytest.approx(8.0)       # 40 bit x 0.2
    assert e["sram"] == pytest.approx(800.0)        # 800 bit x 1
    assert e["sram_tsv"] == pytest.approx(400.0)    # 800 bit x 0.5 (die crossing)
    assert e["tsv"] == pytest.approx(200.0)         # 400 bit x 0.5
    assert e["dram"] == pytest.approx(1600.0)       # 400 bit x 4
    assert e["offchip"] == pytest.approx(480.0)     # 24 bit x 20
    assert e.total_pj == pytest.approx(5844.9)
    assert e.total_j == pytest.approx(5844.9e-12)
    assert list(e.terms) == list(TERMS)


def test_sram_die_crossing_is_off_by_default():
    """The RTL has no SRAM-to-logic link, so by default none is charged."""
    c = Counters(sram_bytes=100)
    e = energy_of(c, OpDetail(), ROUND)
    assert e["sram_tsv"] == 0 and e.total_pj == pytest.approx(800.0)
    assert energy_of(c, OpDetail(), ROUND.replace(sram_crosses_tsv=True))["sram_tsv"] == pytest.approx(400.0)


def test_sram_curve_passes_through_horowitz_points():
    assert sram_pj_per_64b(8 * 1024) == pytest.approx(10.0)
    assert sram_pj_per_64b(32 * 1024) == pytest.approx(20.0)
    assert sram_pj_per_64b(1024 * 1024) == pytest.approx(100.0)
    # below 8 KB: sqrt(size) slope; a 256-byte register file = 10 * sqrt(1/32) pJ per 64 bit
    assert sram_pj_per_64b(256) == pytest.approx(10.0 / math.sqrt(32))
    sizes = [2 ** k for k in range(6, 26)]
    e = [sram_pj_per_bit(s) for s in sizes]
    assert all(a < b for a, b in zip(e, e[1:]))
    with pytest.raises(ValueError, match="-1"):
        sram_pj_per_64b(-1)


def test_default_table_follows_sources_and_config():
    t = EnergyTable.for_config(DEFAULT)
    assert (t.fp16_mul_pj, t.fp32_add_pj, t.fp32_mul_pj, t.dram_pj_per_bit) == (1.1, 0.9, 3.7, 3.9)
    assert t.offchip_pj_per_bit == pytest.approx(1300 / 64)
    assert t.sram_pj_per_bit == pytest.approx(sram_pj_per_bit(DEFAULT.sram_bytes / DEFAULT.sram_banks))
    assert set(SOURCES) <= {f for f in t.__dataclass_fields__}
    # a bigger bank costs more per bit
    big = EnergyTable.for_config(DEFAULT.replace(sram_banks=4))
    assert big.sram_pj_per_bit > t.sram_pj_per_bit
    with pytest.raises(ValueError, match="tsv_pj_per_bit"):
        EnergyTable(tsv_pj_per_bit=-0.1)


def test_one_tile_pair_energy_term_by_term():
    """Job of exactly one (q tile, kv tile) pair at d = 128 on the default array."""
    r = model(Job(1, 64, 64, 128))
    t = EnergyTable.for_config(DEFAULT)
    e = energy_of(r.counters, r.ops, t)
    macs = 2 * 64 * 64 * 128
    assert r.counters.mac_ops == macs
    assert e["mac"] == pytest.approx(macs * 2.0)
    # K and V (64 x 128 FP16 each) cross DRAM -> TSV once, plus Q in and O (FP32) out
    dram_bytes = 2 * 64 * 128 * 2 + 64 * 128 * 2 + 64 * 128 * 4
    assert r.counters.dram_bytes == dram_bytes
    assert e["dram"] == pytest.approx(8 * dram_bytes * 3.9)
    assert e["tsv"] == pytest.approx(8 * dram_bytes * t.tsv_pj_per_bit)
    # every MAC reads and writes one 32-bit accumulator: at least 8 bytes per MAC
    assert e["register"] >= 8 * 8 * macs * t.reg_pj_per_bit
    # K and V each travel down the 32 PEs of a column, Q and P along the 32 PEs of a row
    hops = 2 * (2 * 64 * 128 * 32 + 64 * 128 * 32 + 64 * 64 * 32)
    assert e["operand"] == pytest.approx(8 * hops * t.operand_pj_per_bit)


def test_leakage_is_charged_per_cycle_and_excluded_by_default():
    c = Counters(total_cycles=1000, mac_ops=10)
    assert energy_of(c, OpDetail(), ROUND)["leakage"] == 0
    e = energy_of(c, OpDetail(), ROUND.replace(leakage_pj_per_cycle=2.5))
    assert e["leakage"] == pytest.approx(2500.0) and e.total_pj == pytest.approx(2520.0)
    with pytest.raises(ValueError, match="leakage_pj_per_cycle"):
        ROUND.replace(leakage_pj_per_cycle=-1.0)


def test_memory_classes_pair_energy_with_bandwidth():
    from flashnpu.scripts.energy import MEMORY_CLASSES
    assert [m.pj_per_bit for m in MEMORY_CLASSES] == sorted(m.pj_per_bit for m in MEMORY_CLASSES)
    hbm2, ddr3 = MEMORY_CLASSES[0], MEMORY_CLASSES[-1]
    assert hbm2.bytes_per_cycle(1.5e9) == pytest.approx(256e9 / 1.5e9)
    assert ddr3.pj_per_bit == EnergyTable().offchip_pj_per_bit      # Horowitz's DRAM figure
    assert all(m.source for m in MEMORY_CLASSES)
