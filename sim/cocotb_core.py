"""cocotb tests of the compute core on its generated Verilog.

The configuration arrives as JSON in ``FLASHNPU_CONFIG``; the cases to run
as a comma-separated list in ``FLASHNPU_CORE_CASES`` (names of ``CASES``, or
``reg_check``: the injected register-check faults, ``reg_check_case``),
the random seed of the O-stream back-pressure in ``FLASHNPU_SEED``.  Every
case is checked bit for bit against ``flash_attention_hw`` (checkpoints and
final O, see ``core_driver.check_run``) and its cycle counters against the
schedule.  ``FLASHNPU_CORE_REPORT`` (optional) names a JSON file that
receives the counters and wall-clock time of every case (the benchmark
reads it).
"""

from __future__ import annotations

import json
import os
import time

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles

from flashnpu.config import NPUConfig
from flashnpu.hdl.core import Inject, PausePoint, Phase
from flashnpu.hdl.pe import RegMap
from flashnpu.sim.core_driver import (
    CocotbIo,
    CoreDriver,
    RegisterCheckError,
    check_run,
    expected_mac_cycles,
    expected_masked_macs,
    make_job,
)

ALL_PAUSES = (PausePoint.S_RAW, PausePoint.S, PausePoint.TILE)


def _rng(seed):
    return np.random.default_rng(seed)


# Each case returns a list of (job, pause points, backpressure) to run.
def case_multi_tile(cfg):
    """Several kv tiles, every checkpoint (S_raw, S, P, m, l, alpha, O_acc)."""
    return [(make_job(cfg, 64, cfg.br, 3 * cfg.bc, seed=11, name="multi_tile"), ALL_PAUSES, 0.0)]


def case_causal_pad(cfg):
    """Causal, seq not a multiple of Br/Bc (padded q rows and keys), q tile 1."""
    s = cfg.br + cfg.bc + cfg.bc // 2 + 3
    return [(make_job(cfg, 64, s, s, causal=True, q_tile=1, seed=12, name="causal_pad",
                      fill=-42.0), (PausePoint.S, PausePoint.TILE), 0.3)]


def case_kvl_mask(cfg):
    """kv_valid_len plus an arbitrary mask with an empty row."""
    sq, skv = cfg.br, 2 * cfg.bc + 5
    mask = _rng(13).random((sq, skv)) < 0.5
    mask[3] = False
    return [(make_job(cfg, 32, sq, skv, kv_valid_len=skv - 7, mask=mask, seed=13,
                      name="kvl_mask"), (PausePoint.TILE,), 0.5)]


def case_hd128(cfg):
    """head_dim 128 (A6): keys agree in dims 0..63 and differ only in 64..127."""
    hd = 128
    rng = _rng(14)
    sq, skv = cfg.br, 2 * cfg.bc
    q = rng.standard_normal((1, sq, hd)).astype(np.float16)
    k = rng.standard_normal((1, skv, hd)).astype(np.float16)
    k[:, :, :64] = k[:, :1, :64]
    v = rng.standard_normal((1, skv, hd)).astype(np.float16)
    return [(make_job(cfg, hd, sq, skv, causal=True, q=q, k=k, v=v, name="hd128"),
             (PausePoint.TILE,), 0.0)]


def case_a1(cfg):
    """A1: seq_q 6, seq_kv 10, head_dim 8; row 5 sees no key."""
    i = np.arange(6)[:, None]
    j = np.arange(10)[None, :]
    mask = j <= i + 4
    mask[5] = False
    return [(make_job(cfg, 8, 6, 10, mask=mask, seed=15, name="A1"), (PausePoint.TILE,), 0.0)]


def case_a3(cfg):
    """A3: causal with more queries than keys; row 0 sees nothing."""
    return [(make_job(cfg, 8, 3, 2, causal=True, seed=16, name="A3"), (PausePoint.TILE,), 0.0)]


def case_a2(cfg):
    """A2: dot products beyond the FP16 range (256 * 256 * 16)."""
    hd = 16
    q = np.full((1, 1, hd), 256, np.float16)
    k = np.zeros((1, 2, hd), np.float16)
    k[0, 0] = 256
    v = _rng(17).standard_normal((1, 2, hd)).astype(np.float16)
    return [(make_job(cfg, hd, 1, 2, q=q, k=k, v=v, name="A2"), ALL_PAUSES, 0.0)]


def case_a5(cfg):
    """A5: garbage (-42, 65504, NaN) in padded keys, q rows and unused dims."""
    out = []
    for fill in (-42.0, 65504.0, float("nan")):
        out.append((make_job(cfg, 16, cfg.br + 4, 4 * cfg.bc + 6, q_tile=1, seed=18, fill=fill,
                             name=f"A5 fill={fill}"), (PausePoint.TILE,), 0.2))
    return out


def case_full(cfg):
    """Default-size run: head_dim 128, causal, two kv tiles, q tile 1."""
    s = 2 * cfg.bc
    return [(make_job(cfg, 128, s, s, causal=True, q_tile=1, seed=19, name="full"),
             (PausePoint.TILE,), 0.2)]


def case_bench(cfg):
    """Benchmark: one q tile over 6 kv tiles at head_dim 64 and 128, no pauses."""
    out = []
    for hd in (64, 128):
        if hd <= cfg.max_head_dim:
            out.append((make_job(cfg, hd, cfg.br, 6 * cfg.bc, seed=20 + hd,
                                 name=f"bench hd={hd}"), (), 0.0))
    return out


CASES = {f.__name__[5:]: f for f in (case_multi_tile, case_causal_pad, case_kvl_mask, case_hd128,
                                      case_a1, case_a3, case_a2, case_a5, case_full, case_bench)}


async def _reset(dut):
    cocotb.start_soon(Clock(dut.clk, 2, unit="ns").start())
    dut.rst.value = 1
    for name in ("cmd__valid", "wr__valid", "resume", "o__ready", "dbg_addr", "dbg_row", "inject"):
        getattr(dut, name).value = 0
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0


async def reg_check_case(dut, io, cfg, seed):
    """The register read-before-write check on the Verilog: each injected
    fault stops the core with the expected register, phase and kv tile (a
    reset after each), and a normal job afterwards is bit-exact with no
    error; with the return values made late (``Inject.LATE_RET``) the same
    job stalls on its waiting words and stays bit-exact."""
    g = RegMap(cfg)
    job = make_job(cfg, 16, cfg.br, 2 * cfg.bc + 3, causal=True, seed=21, name="reg_check")
    for inject, want in ((Inject.SKIP_INIT, (g.M(0), Phase.SM, 0)),
                         # tile 1's Q.K^T writes S block 1 when the softmax overlap is on
                         (Inject.DROP_S_WRITE, (g.S(0, 0, int(g.overlap)), Phase.S, 1))):
        drv = CoreDriver(io, cfg, seed=seed, log=dut._log.info)
        try:
            await drv.run_job(job, inject=1 << inject, max_cycles=200_000)
        except RegisterCheckError as e:
            got = (e.reg, e.phase, e.tile)
            assert got == want, f"{inject.name}: check fired at {got}, expected {want}"
            dut._log.info(f"{inject.name}: {e}")
        else:
            raise AssertionError(f"{inject.name}: the register check did not fire")
        assert not io.get("busy"), f"{inject.name}: the core did not stop"
        drv.idle_inputs()
        dut.rst.value = 1
        await ClockCycles(dut.clk, 3)
        dut.rst.value = 0
        await io.tick()
    run = await CoreDriver(io, cfg, seed=seed, log=dut._log.info).run_job(job)
    check_run(job, run)
    assert run.counters["cnt_mac"] == expected_mac_cycles(job)
    # late return values: the words that wait for one hold the ROM and the pc
    # (``rom_hold``) until it is in; the result stays bit-exact, only later
    late = await CoreDriver(io, cfg, seed=seed, log=dut._log.info).run_job(job, inject=1 << Inject.LATE_RET)
    check_run(job, late)
    assert late.counters["cnt_mac"] == run.counters["cnt_mac"]
    assert late.cycles > run.cycles, f"LATE_RET: {late.cycles} cycles, no stall (normal run {run.cycles})"
    dut._log.info(f"LATE_RET: {late.cycles} cycles against {run.cycles}, bit-exact")


@cocotb.test()
async def core_cases(dut):
    cfg = NPUConfig.from_json(os.environ["FLASHNPU_CONFIG"])
    names = [n for n in os.environ.get("FLASHNPU_CORE_CASES", "").split(",") if n]
    if not names:
        raise ValueError("FLASHNPU_CORE_CASES names no case")
    seed = int(os.environ.get("FLASHNPU_SEED", "1"))
    dut._log.info(f"config {cfg.array_rows}x{cfg.array_cols} Br={cfg.br} Bc={cfg.bc}, "
                  f"cases {names}, back-pressure seed {seed}")
    await _reset(dut)
    io = CocotbIo(dut)
    await io.tick()
    report = []
    for name in names:
        if name == "reg_check":
            await reg_check_case(dut, io, cfg, seed)
            continue
        if name not in CASES:
            raise ValueError(f"unknown case {name!r}; known: {sorted(CASES)}")
        o_by_fill = []
        for job, pauses, bp in CASES[name](cfg):
            drv = CoreDriver(io, cfg, seed=seed, backpressure=bp, log=dut._log.info)
            t0 = time.time()
            run = await drv.run_job(job, pause=pauses)
            wall = time.time() - t0
            n = check_run(job, run)
            mac = expected_mac_cycles(job)
            assert run.counters["cnt_mac"] == mac, \
                f"{job.name}: MAC cycles {run.counters['cnt_mac']} != schedule {mac}"
            assert run.counters["ops_recip"] == cfg.br, \
                f"{job.name}: {run.counters['ops_recip']} reciprocals, expected {cfg.br}"
            masked = expected_masked_macs(job)
            assert run.counters["ops_masked"] == masked, \
                f"{job.name}: {run.counters['ops_masked']} masked MACs skipped, expected {masked}"
            dut._log.info(f"{job.name}: bit-exact ({n} values), {run.cycles} cycles in "
                          f"{wall:.1f} s ({run.cycles / wall:.0f} cycles/s), counters {run.counters}")
            report.append(dict(name=job.name, head_dim=job.head_dim, n_kv=job.n_kv,
                               cycles=run.cycles, wall_s=wall, counters=run.counters))
            if name == "a5":
                o_by_fill.append(run.o)
            if name == "a2":
                v0 = job.v[0, :job.head_dim].view(np.float16).astype(np.float32)
                assert np.isfinite(run.o).all(), f"A2: non-finite O {run.o}"
                assert np.allclose(run.o[0], v0, rtol=1e-3, atol=1e-3), f"A2: O {run.o[0]} != V[0] {v0}"
        for o in o_by_fill[1:]:
            # valid rows must be bit-identical whatever the padding holds
            assert (o.view(np.uint32) == o_by_fill[0].view(np.uint32)).all(), \
                "A5: valid output rows differ between padding fills"
    out = os.environ.get("FLASHNPU_CORE_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
