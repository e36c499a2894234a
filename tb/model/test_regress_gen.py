"""The regression's job generator, seeds, checker and coverage model, without a
simulator (``flashnpu.sim.regress``, ``flashnpu.sim.regress_coverage``).

* generation is deterministic per seed and JSON round-trips; job seeds are
  ``SeedSequence(base).spawn(n)`` and do not depend on n;
* case S3: 8 workers from one base seed get pairwise different streams
  (their session seeds, and the job seeds dealt to them), none equal to a
  job seed;
* legal jobs respect the hardware limits and validate, with garbage where
  they say; illegal jobs name the code they must produce;
* the checker reports a golden output with one bit flipped, a wrong error
  code, and a rejected job that wrote O;
* the TSV repair expectation matches the allocator's documented order;
* the coverage model counts passed jobs only and lists its holes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from cocotb_coverage.coverage import coverage_db

from flashnpu.golden import flash_attention_hw, visible_mask
from flashnpu.hdl.npu import NPUError
from flashnpu.sim import regress as rg
from flashnpu.sim.cli import array_config
from flashnpu.sim.regress_coverage import RegressCoverage

CFG4 = array_config(4, 4)
CFG8 = array_config(8, 8)


def test_generation_is_deterministic_per_seed():
    a = rg.generate_jobs(11, 40, CFG8)
    b = rg.generate_jobs(11, 40, CFG8)
    assert a == b
    assert json.loads(json.dumps(a)) == a                       # plain JSON
    assert rg.generate_jobs(12, 40, CFG8) != a
    for s in a[:10]:
        j1, j2 = rg.make_job(s, CFG8), rg.make_job(json.loads(json.dumps(s)), CFG8)
        for name in ("q", "k", "v"):
            assert np.array_equal(getattr(j1["case"], name).view(np.uint16),
                                  getattr(j2["case"], name).view(np.uint16))
        assert j1["overrides"] == j2["overrides"] and j1["tsv_fault"] == j2["tsv_fault"]


def test_job_seeds_are_spawned_and_independent_of_n():
    seeds = rg.job_seeds(5, 20)
    assert seeds == [rg.job_seed(5, i) for i in range(20)]
    assert rg.job_seeds(5, 7) == seeds[:7]
    assert len(set(seeds)) == 20
    # --only picks the same job as the full run
    assert rg.generate_jobs(5, 20, CFG4, only=[13]) == [rg.generate_jobs(5, 20, CFG4)[13]]


def test_s3_eight_workers_have_distinct_streams():
    base, W = 2024, 8
    ws = rg.worker_seeds(base, W)
    jobs = rg.job_seeds(base, 64)
    assert len(set(ws)) == W and not set(ws) & set(jobs)
    draws = [tuple(np.random.default_rng(s).integers(0, 2**32, 4)) for s in ws]
    assert len(set(draws)) == W
    dealt = [jobs[w::W] for w in range(W)]                      # any dealing: jobs are disjoint
    for i in range(W):
        for k in range(i + 1, W):
            assert dealt[i] != dealt[k] and not set(dealt[i]) & set(dealt[k])
    specs = [rg.generate_job(s, CFG4) for s in jobs]
    shapes = {json.dumps({k: v for k, v in s.items() if k not in ("id", "seed")}, sort_keys=True) for s in specs}
    assert len(shapes) > 60                                      # the streams make different jobs
    # the same base seed with one worker or eight: the same jobs
    assert rg.generate_jobs(base, 64, CFG4) == [dict(s, id=i) for i, s in enumerate(specs)]


def test_legal_jobs_respect_the_limits_and_hide_garbage():
    specs = rg.generate_jobs(3, 300, CFG4)
    legal = [s for s in specs if s["kind"] == "legal"]
    assert len(legal) > 200
    seen_nan = False
    for s in legal:
        assert 1 <= s["head_dim"] <= CFG4.max_head_dim
        assert s["heads"] % s["kv_heads"] == 0
        assert 0 <= s["dram_delay"] <= CFG4.dram_latency_cycles - 3
        assert s["expect"]["error"] == "OK"
        job = rg.make_job(s, CFG4)                 # make_job validates a legal case
        if s["hidden"] == "nan":
            seen_nan |= bool(np.isnan(job["case"].k).any() or np.isnan(job["case"].q).any())
    assert seen_nan
    kinds = {s["seq_q"] == 1 for s in legal}
    assert kinds == {True, False}                              # decode and prefill


def test_illegal_jobs_name_their_code():
    specs = [rg.generate_job(s, CFG4, illegal=1.0) for s in rg.job_seeds(9, 120)]
    codes = {s["fault"]: s["expect"]["error"] for s in specs}
    assert codes == {"head_dim": "BAD_HEAD_DIM", "zero_length": "ZERO_LENGTH", "heads": "BAD_HEADS",
                     "misaligned": "MISALIGNED", "stride": "BAD_STRIDE", "range": "RANGE", "tsv": "LINK_DOWN"}
    for s in specs:
        job = rg.make_job(s, CFG4)
        if s["fault"] == "misaligned":
            assert job["overrides"][s["fault_reg"]] % 32 != 0
        if s["fault"] == "tsv":
            assert any(rg.expected_tsv(f, rg.Limits.of(CFG4))["status"] == "TOO_MANY" for f in s["tsv"])
        if s["fault"] == "range":
            assert job["overrides"][s["fault_reg"]] + 1 > CFG4.dram_bytes - 2**20


def test_expected_tsv_follows_the_allocator():
    lim = rg.Limits.of(CFG4)
    N, S = lim.tsv_data, lim.tsv_spares
    # three data lanes and spare 0 (tb/rtl/test_npu_faults.py: WR_MIX)
    f = dict(link="wr", base=N - 8, lanes=[0, 3, 7, 8], stuck=0)
    assert rg.expected_tsv(f, lim) == dict(status="OK", map=[None, N - 8, N - 5, N - 1] + [None] * (S - 4), used=3)
    too_many = dict(link="rd", base=0, lanes=list(range(S + 1)), stuck=1)
    assert rg.expected_tsv(too_many, lim)["status"] == "TOO_MANY"


def _legal_spec(seed=1):
    for s in rg.job_seeds(seed, 50):
        spec = rg.generate_job(s, CFG4)
        if spec["kind"] == "legal" and not spec["tsv"] and spec["seq_q"] > 1:
            return spec
    raise AssertionError("no legal spec")


def _counters(case, **extra):
    """Counters of a plausible run of ``case``: exactly its useful MACs
    (2 x visible pairs x head_dim), in as few cycles as the array allows."""
    h, sq, hd = case.q.shape
    vis = visible_mask(h, sq, case.k.shape[1], causal=bool(case.causal), mask=case.mask,
                       kv_valid_len=case.kv_valid_len)
    useful = 2 * hd * int(vis.sum())
    cyc = max(1, -(-useful // CFG4.macs_per_cycle))
    return dict(total_cycles=cyc, mac_busy_cycles=cyc, mac_ops=useful, mac_masked=0, reg_bytes=0, sram_bytes=0,
                tsv_bytes=0, dram_bytes=0, **extra)


def test_checker_catches_a_flipped_golden_bit():
    spec = dict(_legal_spec(), s_check=False)
    job = rg.make_job(spec, CFG4)
    c = job["case"]
    gold = flash_attention_hw(c.q, c.k, c.v, config=CFG4, **c.kwargs()).o
    res = dict(error=0, error_name="OK", o=gold.copy(), counters=_counters(c), tsv=None)
    assert rg.check(spec, c, res, CFG4) == []
    bad = gold.copy()
    bad.view(np.uint32)[0, 0, 0] ^= 1
    fails = rg.check(spec, c, res, CFG4, golden_o=bad)
    assert len(fails) == 1 and fails[0].startswith("bit-exact vs golden") and "1 of" in fails[0]
    fails = rg.check(spec, c, dict(res, error=3, error_name="BAD_HEADS"), CFG4)
    assert fails and "expected OK, got BAD_HEADS" in fails[0]


def test_checker_catches_impossible_mac_counts():
    """Useful MACs (2 x visible pairs x head_dim) <= MACs run (issued - masked),
    and issued <= R x C x cycles: a job breaking either fails, so useful
    FLOP/s can never be reported above the peak."""
    spec = dict(_legal_spec(), s_check=False)
    c = rg.make_job(spec, CFG4)["case"]
    gold = flash_attention_hw(c.q, c.k, c.v, config=CFG4, **c.kwargs()).o
    cnt = _counters(c)
    res = dict(error=0, error_name="OK", o=gold.copy(), counters=cnt, tsv=None)
    assert rg.check(spec, c, res, CFG4) == []
    for bad in (dict(cnt, mac_masked=1),                                  # one useful MAC not run
                dict(cnt, total_cycles=cnt["total_cycles"] - 1),          # more MACs than slots
                dict(cnt, mac_masked=cnt["mac_ops"] + 1)):                # more skipped than issued
        (fail,) = rg.check(spec, c, dict(res, counters=bad), CFG4)
        assert fail.startswith("MAC counts: useful") and "does not hold" in fail


def test_checker_catches_a_rejected_job_that_wrote():
    spec = rg.generate_job(rg.job_seed(4, 0), CFG4, illegal=1.0)
    c = rg.make_job(spec, CFG4)["case"]
    code = NPUError[spec["expect"]["error"]]
    ok = dict(error=int(code), error_name=code.name, o=np.zeros(1, np.float32), o_untouched=True, irq=3,
              counters=dict(dram_bytes=0, mac_ops=0, total_cycles=5),
              tsv=dict(rd_status="OK", wr_status="OK", rd_map=[None] * 8, wr_map=[None] * 8))
    if spec["fault"] == "tsv":
        link = spec["tsv"][-1]["link"]
        ok["tsv"][f"{link}_status"] = "TOO_MANY"
    assert rg.check(spec, c, ok, CFG4) == []
    assert any("wrote" in f for f in rg.check(spec, c, dict(ok, o_untouched=False), CFG4))


def test_repro_command():
    spec = _legal_spec()
    assert rg.repro_command(spec, 8, 8) == f"flashnpu regress --rows 8 --cols 8 --replay {spec['seed']}"
    assert rg.repro_command(spec, 4, 4, "icarus", illegal=0.5).endswith("--sim icarus --illegal-fraction 0.5")


def test_coverage_counts_passed_jobs_and_lists_holes():
    specs = rg.generate_jobs(8, 30, CFG4)
    cov = RegressCoverage(CFG4)
    try:
        for s in specs:
            rec = dict(passed=True, error=s["expect"]["error"], counters=dict(total_cycles=100, dma_stall_cycles=5),
                       tsv=None)
            cov.sample(s, rec)
        cov.sample(specs[0], dict(passed=False, error="DMA"))        # a failed job counts nowhere
        rep = cov.report()
        assert rep["samples"] == 30
        assert 0 < rep["percent"] < 100 and rep["covered"] < rep["bins"]
        assert "error.code: DMA" in rep["holes"] and "error.code: CORE_REJECT" in rep["holes"]
        assert "dma.stall: >30%" in rep["holes"]
        assert rep["points"]["dma.stall"]["bins"]["<=10%"] == sum(s["kind"] == "legal" for s in specs)
        assert rep["points"]["error.code"]["bins"]["OK"] == sum(s["expect"]["error"] == "OK" for s in specs)
        assert len(rep["holes"]) == rep["bins"] - rep["covered"]
    finally:
        cov.close()
    assert not [k for k in coverage_db if k.startswith(cov.top)]


@pytest.mark.parametrize("cfg", [CFG4, CFG8])
def test_every_legal_kind_is_reachable(cfg):
    """Over a few hundred seeds the generator reaches streaming K/V, decode
    with grouped heads, every mask kind and every hidden fill."""
    specs = [s for s in rg.generate_jobs(1, 400, cfg) if s["kind"] == "legal"]
    assert any(s["seq_kv"] > cfg.kv_slots * cfg.bc for s in specs)
    assert any(s["seq_q"] == 1 and s["heads"] > s["kv_heads"] for s in specs)
    assert {s["hidden"] for s in specs} == set(rg.HIDDEN_KINDS)
    assert any(s["mask"] and s["mask"]["per_head"] for s in specs)
    assert any(s["kv_valid_len"] == 0 for s in specs)


def test_checker_reads_the_s_tile_check():
    """A legal job run with the S-tile check fails when the check stopped it,
    when it has no result, or when it compared fewer tiles than the NPU ran."""
    spec = dict(_legal_spec(), s_check=True)
    job = rg.make_job(spec, CFG4)
    assert job["s_check"] == dict(threshold=0)
    c = job["case"]
    gold = flash_attention_hw(c.q, c.k, c.v, config=CFG4, **c.kwargs()).o
    res = dict(error=0, error_name="OK", o=gold.copy(), counters=_counters(c, kv_tiles=3), tsv=None,
               s_check=dict(stopped=False, tiles=3))
    assert rg.check(spec, c, res, CFG4) == []
    assert rg.check(spec, c, dict(res, s_check=None), CFG4) == ["S-tile check: no result"]
    assert "2 tiles compared" in rg.check(spec, c, dict(res, s_check=dict(stopped=False, tiles=2)), CFG4)[0]
    stop = dict(stopped=True, tiles=1, head=0, q_tile=0, job_q_tile=0, kv_tile=1, count=5, expected=6)
    assert rg.check(spec, c, dict(res, s_check=stop), CFG4)[0].startswith("S-tile check: head 0 q tile 0 kv tile 1")
