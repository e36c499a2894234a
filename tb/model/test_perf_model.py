"""Analytical performance model: agreement with the golden model's op counts,
causal tile skipping against an independent mask count, the baseline
differing from the register-level design only in S/P traffic, the report,
and the validation against the RTL NPU's counters (skipped until it exists)."""

import json

import numpy as np
import pytest

from flashnpu.cli import main
from flashnpu.config import DEFAULT, small_config
from flashnpu.golden import op_counts, visible_mask
from flashnpu.hdl import npu
from flashnpu.scripts import bench
from flashnpu.scripts.perf_model import (
    RTL_COUNTER_FIELDS,
    Counters,
    Job,
    RTLUnavailable,
    Timing,
    calibrate_timing,
    counters_from_stats,
    kv_tile_intensity,
    model,
    roofs,
    rtl_core_counters,
    rtl_counters_many,
    rtl_program_cycles,
)
from flashnpu.sim import runner

SMALL = small_config(4, 4)

JOBS = [
    (DEFAULT, Job(1, 64, 64, 128)),
    (DEFAULT, Job(2, 100, 130, 128)),
    (DEFAULT, Job(3, 1, 300, 64)),
    (DEFAULT, Job(1, 512, 512, 72)),
    (SMALL, Job(2, 9, 21, 16)),
    (SMALL, Job(1, 13, 40, 64, causal=True)),
]


@pytest.mark.parametrize("config,job", JOBS)
def test_agrees_with_golden_op_counts(config, job):
    r = model(job, config, causal_skip=False, stack_decode=False)
    g = op_counts(job.heads, job.seq_q, job.seq_kv, job.head_dim, config)
    assert (r.q_tiles, r.kv_tiles, r.tile_pairs) == (g["q_tiles"], g["kv_tiles"], g["tile_pairs"])
    c = r.counters
    assert c.recip_ops == g["recip"]
    # the RTL counts R*C MAC slots per MAC cycle: the golden count of Q·Kᵀ
    # (every pair), and for P·V Br x od*C slots per key it runs (od*C >=
    # head_dim: the idle O columns count), up to the tile's last key a row of
    # the q tile sees, at least one
    vis = visible_mask(1, job.seq_q, job.seq_kv, job.causal, None, None)[0]
    br, bc = config.br, config.bc
    pv_keys = sum(max(1, int(np.flatnonzero(vis[q0:q0 + br, k0:k0 + bc].any(axis=0)).max(initial=-1)) + 1)
                  for q0 in range(0, job.seq_q, br) for k0 in range(0, job.seq_kv, bc))
    od = config.o_cols_per_pe(job.head_dim)
    assert c.mac_ops == g["macs"] // 2 + job.heads * pv_keys * br * od * config.array_cols
    # every PE of a row evaluates the row's alpha itself: C alphas per row, not 1
    assert c.exp2_ops == g["exp2"] + r.tile_pairs * config.br * (config.array_cols - 1)


@pytest.mark.parametrize("seq_q,seq_kv", [(13, 40), (40, 13), (16, 16), (1, 33), (30, 31)])
def test_causal_skip_counts_tiles_with_a_visible_key(seq_q, seq_kv):
    cfg = SMALL
    job = Job(2, seq_q, seq_kv, 16, causal=True)
    vis = visible_mask(1, seq_q, seq_kv, True, None, None)[0]
    want = 0
    for q0 in range(0, seq_q, cfg.br):
        tiles = sum(bool(vis[q0:q0 + cfg.br, k0:k0 + cfg.bc].any()) for k0 in range(0, seq_kv, cfg.bc))
        want += max(1, tiles)       # the controller runs at least one kv tile per q tile
    r = model(job, cfg, stack_decode=False)
    assert r.tile_pairs == 2 * want
    assert r.useful_flops == 4 * 16 * 2 * int(vis.sum())
    full = model(job, cfg, causal_skip=False, stack_decode=False)
    assert full.tile_pairs >= r.tile_pairs


def test_phase_cycles_of_one_pair():
    t = Timing()
    r = model(Job(1, 64, 64, 128), timing=t)
    c = r.counters
    sm = t.softmax_cycles(DEFAULT, 128)
    rtl = rtl_program_cycles(DEFAULT, 128)
    if rtl is not None:                       # read from the RTL core's micro-program
        assert sm == rtl["softmax"] and t.source(DEFAULT, 128) == "rtl micro-program"
    assert c.mac_busy_cycles == 128 * 2 * 2 + 64 * 2 * 4     # d·wr·wc + Bc·wr·od
    # the one kv tile is the q tile's last: its softmax also starts the reciprocals
    sm += t.softmax_last_extra(DEFAULT, 128)
    assert c.softmax_cycles == sm
    assert c.mac_ops == c.mac_busy_cycles * 1024
    out = 64 * 4 + 1                                         # Br·od beats + priming
    # DMA cycles per row (one group of the 8 channels' words), loader requests per row
    gq, wql = -(-128 * 2 // (32 * DEFAULT.dram_channels)), 128 * 2 // (4 * 32)
    # one q tile: controller set-up, the last O write-back after the read-out
    # (model tail), DIV (group + 1) and CHECK; the O writer (4 words per
    # request at 32x32) never holds the core
    assert c.total_cycles == (c.mac_busy_cycles + sm + t.init_cycles(DEFAULT, 128)
                              + t.final_cycles(DEFAULT, 128) + out + t.qtile_gap_cycles + c.dma_stall_cycles
                              + t.qtile_ctrl_cycles + r.bytes_detail["tail_cycles"] + 3)
    # the core waits after INIT for Q and K_0: one DRAM latency (activate +
    # column) + fixed, the DMA's Q and K_0 rows, then the loader's K_0 requests
    lat = DEFAULT.dram_latency_cycles + DEFAULT.dram_timing_cycles()["trcd"]
    assert c.dma_stall_cycles == (lat + 11 + gq * 64 + max(wql * 64 - 1, gq * 64 + 64 // t.start_conflict_rows)
                                  + wql * 64 - t.init_cycles(DEFAULT, 128))
    slow = model(Job(1, 64, 64, 128), DEFAULT.replace(dram_latency_cycles=200), timing=t)
    assert slow.counters.dma_stall_cycles - c.dma_stall_cycles == 200 - DEFAULT.dram_latency_cycles
    over = model(Job(1, 64, 64, 128), timing=t.replace(softmax_override=7))
    assert over.counters.total_cycles - c.total_cycles == 7 + t.softmax_last_extra(DEFAULT, 128) - sm
    formula = Timing(use_rtl_programs=False)
    assert formula.source(DEFAULT, 128) == "formula (ASSUMPTION)"
    # the formula fallback stays within a quarter of the scheduled program
    assert abs(formula.softmax_cycles(DEFAULT, 128) - sm) <= sm / 4


def test_prefill_utilization_and_dma_stalls():
    # 512 tokens: K/V resident, q tiles overlapped, each q tile's Q·Kᵀ of kv
    # tiles 1..7 partly in the softmax before it (results/npu.md)
    r = model(Job(1, 512, 512, 128))
    assert r.bytes_detail["kv_reused"] and 0.95 < r.mac_utilization < 0.96
    assert r.bytes_detail["hidden_s_cycles"] == 8 * 7 * len(Timing().softmax_slots(DEFAULT, 128))
    serial = model(Job(1, 512, 512, 128), DEFAULT.replace(softmax_overlap=False))
    assert serial.counters.total_cycles - r.counters.total_cycles == r.bytes_detail["hidden_s_cycles"]
    # 2048 tokens (32 kv tiles > config.kv_slots): K/V stream through the ping-pong
    # halves for every q tile; the 8 channels move a kv tile (64 rows of K and
    # of V) in 128 cycles against a pair's ~1,050 of compute, so the core
    # waits only for the first tile of each q tile
    r = model(Job(1, 2048, 2048, 128))
    assert not r.bytes_detail["kv_reused"]
    assert r.bytes_detail["pair_stall_cycles"] == 0
    # on one channel (32 B/cycle) the DMA takes a pair's compute per kv tile
    # and the core waits between pairs
    one = model(Job(1, 2048, 2048, 128), DEFAULT.replace(dram_channels=1))
    assert one.bytes_detail["pair_stall_cycles"] > 0
    slow = model(Job(1, 2048, 2048, 128), DEFAULT.replace(dram_latency_cycles=400))
    assert slow.counters.dma_stall_cycles > r.counters.dma_stall_cycles
    assert slow.counters.mac_busy_cycles == r.counters.mac_busy_cycles


@pytest.mark.parametrize("level", ["sram", "stacked_dram", "offchip"])
@pytest.mark.parametrize("config,job", JOBS)
def test_baseline_differs_only_in_s_traffic(config, job, level):
    reg = model(job, config, "register").counters
    base = model(job, config, "baseline", spill_level=level)
    b = base.counters
    pairs = base.tile_pairs
    s_tile = config.br * config.bc
    W = config.sram_bank_bytes                 # counters count whole bus words per row
    s_bytes = config.br * -(-config.bc * 4 // W) * W
    p_bytes = config.br * -(-config.bc * 2 // W) * W
    spill = pairs * 2 * (s_bytes + p_bytes)    # S FP32 and P FP16, each written and read once
    # dma_stall_cycles: the baseline's longer pairs hide more of the K/V DMA
    changed = {"total_cycles", "spill_cycles", "dma_stall_cycles",
               {"sram": "sram_bytes", "stacked_dram": "dram_bytes", "offchip": "offchip_bytes"}[level]}
    if level == "stacked_dram":
        changed.add("tsv_bytes")
    for f in Counters.__dataclass_fields__:
        if f not in changed:
            assert getattr(b, f) == getattr(reg, f), f
    key = {"sram": "sram_bytes", "stacked_dram": "dram_bytes", "offchip": "offchip_bytes"}[level]
    assert getattr(b, key) - getattr(reg, key) == spill
    if level == "stacked_dram":
        assert b.tsv_bytes - reg.tsv_bytes == spill
    # S and P drained from and reloaded into the registers: 4 accesses of 4
    # bytes, outside the RTL's reg_bytes counter (MAC and exp2 only)
    assert b.reg_bytes == reg.reg_bytes
    ro = model(job, config, "register").ops
    assert base.ops.reg_extra_bytes - ro.reg_extra_bytes == pairs * s_tile * 4 * 4
    assert b.spill_cycles > 0 and b.dma_stall_cycles <= reg.dma_stall_cycles
    exits = model(job, config, "register").bytes_detail["wait_exits"] - base.bytes_detail["wait_exits"]
    # the register design also runs the next tile's Q·Kᵀ in the softmax's
    # free slots, which the baseline's S spill between the phases rules out
    hidden = model(job, config, "register").bytes_detail["hidden_s_cycles"]
    assert base.bytes_detail["hidden_s_cycles"] == 0
    assert b.total_cycles - reg.total_cycles == (b.spill_cycles - (reg.dma_stall_cycles - b.dma_stall_cycles)
                                                 - exits + hidden)
    assert reg.spill_cycles == 0 and reg.offchip_bytes == 0


def test_unfused_baseline_spills_off_chip_only_when_the_row_block_does_not_fit():
    assert model(Job(1, 8192, 8192, 128), design="baseline", spill_level="unfused").spill_level == "sram"
    r = model(Job(1, 16384, 16384, 128), design="baseline", spill_level="unfused")
    assert r.spill_level == "offchip" and r.counters.offchip_bytes > 0


def test_decode_stacks_query_heads_of_a_group():
    job = Job(9, 1, 256, 64, kv_heads=3)
    stacked = model(job)
    flat = model(job, stack_decode=False)
    assert stacked.q_tiles == 3 and flat.q_tiles == 9
    assert stacked.counters.total_cycles < flat.counters.total_cycles
    assert stacked.useful_flops == flat.useful_flops == 4 * 64 * 9 * 256
    # K/V of each group fetched once: resident K/V serves the group's query
    # heads either way; streamed, the flat mapping fetches it once per head
    assert stacked.bytes_detail["dram_kv"] == flat.bytes_detail["dram_kv"] == 3 * 256 * 64 * 2 * 2
    streamed = model(job, stack_decode=False, kv_reuse=False)
    assert stacked.bytes_detail["dram_kv"] * 3 == streamed.bytes_detail["dram_kv"]


def test_kv_reuse_loads_each_head_once_when_it_fits():
    job = Job(2, 1024, 1024, 128)     # 16 kv tiles: one of the kv_slots slots each, as the RTL does
    r = model(job)
    assert r.bytes_detail["dram_kv"] == 2 * 2 * 1024 * 128 * 2
    assert model(job, kv_reuse=True).bytes_detail["dram_kv"] == r.bytes_detail["dram_kv"]
    assert model(job, kv_reuse=False).bytes_detail["dram_kv"] == 16 * r.bytes_detail["dram_kv"]
    longer = Job(1, 2048, 2048, 128)  # 32 kv tiles: the RTL streams them, 1 MiB fits half the SRAM
    assert model(longer).bytes_detail["dram_kv"] == 32 * model(longer, kv_reuse=True).bytes_detail["dram_kv"]
    big = Job(1, 16384, 16384, 128)   # 8 MiB of K/V per head does not fit
    assert model(big, kv_reuse=True).bytes_detail["dram_kv"] == model(big).bytes_detail["dram_kv"]


def test_roofs_and_intensity():
    rf = roofs(DEFAULT)
    assert rf["compute_flops"] == 2 * 1024 * 1.5e9
    assert rf["dram_bw"] == 256 * 1.5e9
    ki = kv_tile_intensity(DEFAULT, 128)
    assert ki["flop_per_element"] == 2 * DEFAULT.br == 128


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="kv_heads"):
        Job(3, 4, 4, 8, kv_heads=2)
    with pytest.raises(ValueError, match="head_dim"):
        model(Job(1, 4, 4, 256))
    with pytest.raises(ValueError, match="design"):
        model(Job(1, 4, 4, 8), design="gpu")


def test_counters_from_stats_names_what_is_missing():
    stats = {"cycles": 10, "mac_busy_cycles": 5, "softmax_cycles": 2, "dma_stall_cycles": 1,
             "bytes_register": 3, "bytes_sram": 4, "bytes_tsv": 5, "bytes_dram": 5, "macs": 6, "exp2": 7}
    with pytest.raises(KeyError, match="recip_ops"):
        counters_from_stats(stats)
    c = counters_from_stats({"counters": dict(stats, recip=1, mac_masked=0)})
    assert (c.total_cycles, c.reg_bytes, c.recip_ops) == (10, 3, 1)


def test_calibration_recovers_a_known_softmax_phase():
    job = Job(2, 20, 30, 16)
    truth_t = Timing(softmax_override=37, final_override=44)
    truth = model(job, SMALL, timing=truth_t).counters
    t = calibrate_timing(job, truth, SMALL)
    assert (t.softmax_override, t.final_override) == (37, 44)
    assert model(job, SMALL, timing=t).counters.total_cycles == truth.total_cycles
    with pytest.raises(ValueError, match="softmax_cycles"):
        calibrate_timing(job, Counters(softmax_cycles=truth.softmax_cycles + 1), SMALL)


# Every counter must agree on the validation jobs (8x8 NPU): bytes and op
# counts exactly, every cycle counter within 1.6 % of the job's total
# cycles.  The core's phases are read from the RTL's scheduled programs and
# agree exactly; the DMA start-up and O tail terms are fitted
# (``Timing.first_tile_fixed_cycles``, ``first_v_fixed_cycles``,
# ``qtile_ctrl_cycles``, ``o_done_cycles``), and the model tracks neither the
# DRAM's row state (an access to a closed bank pays tRCD, 21 cycles) nor the
# phase of its refresh (tRP + tRFC every tREFI, which the job's slack mostly
# hides): on these jobs that leaves -13 to +15 cycles, most of it in the
# last q tile's O tail (o_done_cycles is the median fit: +5 where that tile
# has 14 or 16 valid rows, -8 where it has at most 9); 1.6 % of the
# 848-cycle decode job.  These are the jobs the constants were fitted on (in
# sample); the 32x32 NPU's difference is measured and reported in
# results/rtl_validation.json.
CYCLE_TOLERANCE = 0.016


def _assert_model_matches(jobs, measured, cfg, cycle_tolerance):
    """Every job ran without error, and the model's counters equal the
    RTL's: cycle counters within ``cycle_tolerance`` of the job's cycles,
    all others exactly."""
    bad = []
    for job, m in zip(jobs, measured, strict=True):
        assert m["error"] == 0, f"{job}: the NPU reported error {m['error']}"
        mod = model(job, cfg, "register").counters
        for f in RTL_COUNTER_FIELDS:
            a, b = getattr(mod, f), getattr(m["counters"], f)
            tol = cycle_tolerance * m["counters"].total_cycles if f.endswith("_cycles") else 0
            if abs(a - b) > tol:
                bad.append(f"{job}: {f} model {a} rtl {b}")
    assert not bad, "\n".join(bad)


@pytest.mark.rtl
# slow: builds of its own (several minutes on 2 cores); runs in `make test-all`
@pytest.mark.slow
def test_model_matches_rtl_counters():
    """~30 s with a cached 8x8 NPU build (one simulator session for every job)."""
    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator is not installed")
    cfg = small_config(**bench.VALIDATION_CONFIG)
    try:
        measured = rtl_counters_many(bench.VALIDATION_JOBS, cfg)
    except RTLUnavailable as e:
        pytest.skip(f"RTL NPU not available yet: {e}")
    _assert_model_matches(bench.VALIDATION_JOBS, measured, cfg, CYCLE_TOLERANCE)


#: the model's promise on jobs it was not fitted on (issue "figures an
#: architect can trust"): every cycle counter within 2 % of the job's cycles
HELDOUT_TOLERANCE = 0.02


@pytest.mark.rtl
# slow: the 8x8 NPU build and a simulator session; runs in `make test-all`
@pytest.mark.slow
def test_model_holds_on_held_out_jobs():
    """``bench.HELDOUT_JOBS``: shapes the model's constants never saw.
    Cycle counters within ``HELDOUT_TOLERANCE`` of the job's cycles, every
    byte and operation counter exact."""
    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator is not installed")
    cfg = small_config(**bench.VALIDATION_CONFIG)
    assert not set(bench.HELDOUT_JOBS) & set(bench.VALIDATION_JOBS)
    measured = rtl_counters_many(bench.HELDOUT_JOBS, cfg)
    _assert_model_matches(bench.HELDOUT_JOBS, measured, cfg, HELDOUT_TOLERANCE)


@pytest.mark.rtl
# slow: the full 32x32 NPU build (about 6 min on 2 cores); runs in `make test-all`
@pytest.mark.slow
def test_model_holds_on_held_out_jobs_at_32x32():
    """``bench.VALIDATION_JOBS_32`` (a prefill and a grouped-query decode job)
    on the design-point NPU, which no timing constant was fitted on: the
    same promise as at 8x8."""
    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator is not installed")
    measured = rtl_counters_many(bench.VALIDATION_JOBS_32, DEFAULT)
    _assert_model_matches(bench.VALIDATION_JOBS_32, measured, DEFAULT, HELDOUT_TOLERANCE)


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return out, bench.run(out, quick=True, show_progress=False)


def _points(tree):
    """Every model point (a dict with counters and cycles) anywhere in a bench result."""
    if isinstance(tree, dict):
        if "counters" in tree and "cycles" in tree:
            yield tree
        for v in tree.values():
            yield from _points(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _points(v)


def test_no_bench_figure_exceeds_its_roof(quick_bench):
    """Every point of the report: useful MACs <= MACs run <= R x C x cycles,
    useful FLOP/s <= peak, and no level moves more bytes per cycle than its
    ports (SRAM banks, DRAM channels, the off-chip spill's bandwidth)."""
    _, res = quick_bench
    pts = list(_points(res))
    assert len(pts) > 50
    for p in pts:
        rows, cols = map(int, p["array"].split("x"))
        c, cyc = p["counters"], p["cycles"]
        slots = rows * cols * cyc
        useful_macs = p["useful_flops"] // 2
        assert useful_macs <= c["mac_ops"] - c["mac_masked"] <= c["mac_ops"] <= slots, p["job"]
        assert 0 < p["useful_utilization"] <= p["mac_utilization"] <= 1, p["job"]
        assert p["achieved_tflops"] * 1e12 <= 2 * rows * cols * DEFAULT.clock_hz * (1 + 1e-12), p["job"]
        assert c["dram_bytes"] <= DEFAULT.dram_bytes_per_cycle * cyc, p["job"]
        assert c["sram_bytes"] <= DEFAULT.sram_banks * DEFAULT.sram_bank_bytes * cyc, p["job"]
    for r in res["memory"]:
        b = r["baseline"]
        assert b["counters"]["offchip_bytes"] <= r["bytes_per_cycle"] * b["counters"]["spill_cycles"], r["name"]
    for p in res["roofline"]:
        assert p["achieved_flops"] <= res["roofs"]["compute_flops"]
        assert p["dram_bytes_per_cycle"] <= DEFAULT.dram_bytes_per_cycle


def test_bench_rewrites_only_the_readme_blocks(tmp_path, quick_bench):
    _, res = quick_bench
    readme = tmp_path / "README.md"
    text = "intro\n<!-- bench:energy -->\nold\n<!-- /bench:energy -->\nmiddle\n" \
           "<!-- bench:memory -->\n<!-- /bench:memory -->\nend\n"
    readme.write_text(text)
    bench.update_readme(bench.check_readme(readme), res)
    new = readme.read_text()
    assert "old" not in new and new.startswith("intro\n") and "\nmiddle\n" in new and new.endswith("end\n")
    assert bench._readme_energy(res) in new and bench._readme_memory(res) in new
    assert "| 512 |" in new and "| DDR3-1600 channel |" in new
    bench.update_readme(readme, res)
    assert readme.read_text() == new                               # idempotent


def test_bench_rejects_a_readme_without_its_blocks(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:energy -->\n<!-- /bench:energy -->\n")
    out = tmp_path / "out"
    assert main(["bench", "--out", str(out), "--readme", str(readme)]) == 2
    err = capsys.readouterr().err
    assert "bench:memory" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()                                        # checked before any work


def test_the_readme_tables_are_the_bench_output():
    """README.md's bench blocks are what `make bench` writes from the model
    today (a stale table fails here)."""
    from pathlib import Path
    readme = Path(__file__).resolve().parents[2] / "README.md"
    res = dict(seq=bench.sweep_seq(bench.README_SEQS), memory=bench.sweep_memory(bench.SEQS[-1]))
    text = readme.read_text()
    for name, (i, j) in bench._readme_spans(text, readme).items():
        assert text[i:j].strip() == bench.README_BLOCKS[name](res).strip(), name


def test_bench_report(quick_bench):
    tmp_path, res = quick_bench
    report = (tmp_path / "report.md").read_text()
    for png in ("energy_vs_seq.png", "energy_breakdown.png", "roofline.png", "scaling.png",
                "tsv_sensitivity.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # sim speed, decode, validation, and the clock section's fpga and depth evidence
    assert report.count("not measured yet") == 5
    assert "1.5 GHz, which is an ASSUMPTION" in report
    # the key table carries the model's numbers
    first = res["seq"][0]
    ratio = first["sram"]["energy_uj"] / first["register"]["energy_uj"]
    assert f"| 512 | {bench._fmt(first['register']['energy_uj'])} |" in report
    assert 1.0 < ratio < 10
    # a measurement file written by another script shows up, nothing else invented
    (tmp_path / "sim_speed.json").write_text(json.dumps(
        {"rows": [{"simulator": "verilator", "array": "32x32", "cycles_per_s": 12345}]}))
    (tmp_path / "fpga.json").write_text(json.dumps(
        {"command": "flashnpu fpga --rows 2 --cols 2", "seed": 1, "runs": [
            {"size": "2x2", "rows": 2, "cols": 2, "top": "core", "pnr": {"fmax_mhz": 51.09}}]}))
    bench.write_report(tmp_path, res, [])
    report = (tmp_path / "report.md").read_text()
    assert report.count("not measured yet") == 3 and "12,345" in report
    assert "**51.09 MHz**" in report and "| 51.09 MHz | routed on the ECP5 (above) | 0.105 |" in report
    for f in ("sim_speed.json", "fpga.json"):
        (tmp_path / f).unlink()


def test_bench_cli_rejects_a_file_as_out(tmp_path):
    f = tmp_path / "x"
    f.write_text("")
    assert main(["bench", "--out", str(f)]) == 2


@pytest.mark.rtl
def test_model_matches_rtl_core_counters():
    """The RTL compute core's own counters for one q tile (two kv tiles, fed
    without gaps) against the model: every counter exactly, no calibration."""
    cfg = SMALL
    d, n_kv = 8, 2
    try:
        rtl = rtl_core_counters(cfg, d, n_kv)
    except RTLUnavailable as e:
        pytest.skip(f"RTL core not available: {e}")
    r = model(Job(1, cfg.br, n_kv * cfg.bc, d), cfg)
    c = r.counters
    want = {"cnt_mac": c.mac_busy_cycles, "cnt_softmax": c.softmax_cycles, "cnt_stall": 0,
            "ops_mac": c.mac_ops, "ops_exp2": c.exp2_ops, "ops_recip": c.recip_ops,
            # the core does not see the NPU around it: no DMA wait, O write-back or controller
            "cnt_total": (c.total_cycles - c.dma_stall_cycles - r.bytes_detail["drain_cycles"]
                          - r.bytes_detail["job_cycles"])}
    assert rtl == want


def test_model_follows_the_npu_sram_map():
    """The model's K/V slot count and request widths are the RTL's."""
    for cfg in (DEFAULT, SMALL, small_config(8, 8)):
        m = npu.sram_map(cfg)
        assert m["slots"] == cfg.kv_slots
        # the model's LW (perf_model: min(4, banks) words) and OW
        assert (m["LW"], m["OW"]) == (min(4, cfg.sram_banks) * cfg.sram_bank_bytes,
                                      npu.o_lanes(cfg) * cfg.sram_bank_bytes)
        assert npu.o_chunk(cfg) == max(1, cfg.br // 4)

