"""amaranth.sim tests of the core's register read-before-write check on a
2 x 2 array: normal runs never fire it (several jobs back to back on one
core, so stale written-bits of a previous job would show), and each
injected fault fires it with the register, phase and kv tile of the first
unwritten read, and the core stops (a fresh core per injected fault: a
stopped core is reset before its next command)."""

import pytest
from amaranth.sim import Simulator

from flashnpu.config import small_config
from flashnpu.hdl.core import RF_USE, Core, Inject, Phase, register_name, tile_registers
from flashnpu.hdl.pe import PeOp, RegMap
from flashnpu.sim.core_driver import AmaranthIo, CoreDriver, RegisterCheckError, check_run, make_job

CFG2 = small_config(2, 2, max_head_dim=16)


def _run(jobs):
    """Run ``jobs`` [(job, inject)] one after another on one core; returns
    per job the CoreRun or the RegisterCheckError it raised."""
    dut = Core(CFG2)
    out = []

    async def tb(ctx):
        drv = CoreDriver(AmaranthIo(ctx, dut), CFG2, seed=0)
        drv.idle_inputs()
        for job, inject in jobs:
            try:
                out.append(await drv.run_job(job, inject=inject, max_cycles=20_000))
            except RegisterCheckError as e:
                out.append(e)
            drv.run = None
            drv.idle_inputs()
            for _ in range(3):
                await drv.tick()

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    return out


def test_register_lifetimes():
    g = RegMap(CFG2)
    per_tile = set(tile_registers(CFG2))
    assert CFG2.overlaps_softmax
    assert per_tile == ({g.S(a, b, p) for p in (0, 1) for a in range(g.wr) for b in range(g.wc)}
                        | {g.ALPHA(a) for a in range(g.wr)})
    carried = {g.M(a) for a in range(g.wr)} | {g.L(a) for a in range(g.wr)} | \
              {g.O(a, n) for a in range(g.wr) for n in range(g.od)}
    assert not per_tile & carried
    assert set(RF_USE) == set(PeOp)
    assert register_name(CFG2, g.M(1)) == "m_i(a=1)"
    assert register_name(CFG2, g.S(1, 0)) == "S(a=1, b=0)"
    assert register_name(CFG2, g.O(0, 1)) == "O_acc(a=0, n=1)"
    assert register_name(CFG2, g.S(1, 0, 1)) == "S(a=1, b=0, block 1)"
    with pytest.raises(ValueError, match="64"):
        register_name(CFG2, 64)


def test_register_check_fires_only_on_injection():
    g = RegMap(CFG2)
    job3 = make_job(CFG2, 8, 4, 3 * CFG2.bc - 1, causal=True, seed=1)   # 3 kv tiles
    job1 = make_job(CFG2, 8, 4, CFG2.bc, seed=2)                         # 1 kv tile
    normal, drop1, again = _run([(job3, 0), (job1, 1 << Inject.DROP_S_WRITE), (job3, 0)])
    skip, = _run([(job3, 1 << Inject.SKIP_INIT)])
    drop, = _run([(job3, 1 << Inject.DROP_S_WRITE)])
    # normal runs: no error, bit-exact, MAC cycles of the schedule
    for run in (normal, again, drop1):
        assert not isinstance(run, Exception), f"the register check fired on a normal run: {run}"
        check_run(job3 if run is not drop1 else job1, run)
    assert again.counters == normal.counters
    # skipped INIT: the first read of a q-tile register is m_i(a=0) in the softmax of tile 0
    assert isinstance(skip, RegisterCheckError), skip
    assert (skip.reg, skip.phase, skip.tile) == (g.M(0), Phase.SM, 0)
    assert "m_i(a=0)" in str(skip) and "read before it was written" in str(skip)
    # dropped first S write of kv tile 1 (S block 1, its Q.K^T running ahead
    # in tile 0's softmax): the k = 1 step of tile 1 reads an unwritten register
    assert isinstance(drop, RegisterCheckError), drop
    assert (drop.reg, drop.phase, drop.tile) == (g.S(0, 0, 1), Phase.S, 1)


def test_register_check_catches_a_pending_write():
    """With one S accumulator per PE (Br = R, Bc = C) the S loop must leave
    MAC_RECURRENCE - 1 bubbles between k rounds; without them (NO_GAP) the
    k = 1 MAC reads S(0, 0) while the k = 0 MAC's write is still in the
    pipeline, and the check stops the core there."""
    cfg = small_config(2, 2, max_head_dim=16, br=2, bc=2)
    g = RegMap(cfg)
    assert g.wr * g.wc == 1
    job = make_job(cfg, 8, 2, 4, seed=3)
    out = {}
    for inject in (0, 1 << Inject.NO_GAP):
        dut = Core(cfg)

        async def tb(ctx, dut=dut, inject=inject):
            drv = CoreDriver(AmaranthIo(ctx, dut), cfg, seed=0)
            drv.idle_inputs()
            try:
                out[inject] = await drv.run_job(job, inject=inject, max_cycles=20_000)
            except RegisterCheckError as e:
                out[inject] = e

        sim = Simulator(dut)
        sim.add_clock(1e-8)
        sim.add_testbench(tb)
        sim.run()
    check_run(job, out[0])
    err = out[1 << Inject.NO_GAP]
    assert isinstance(err, RegisterCheckError), err
    assert (err.reg, err.phase, err.tile) == (g.S(0, 0), Phase.S, 0)
    assert "in flight" in str(err)
