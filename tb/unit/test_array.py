"""amaranth.sim tests of the whole core (PE array, reduction trees,
feeders, sequencer) on 2 x 2 and 4 x 4 arrays: every checkpoint register of
every PE after every kv tile and the final O, bit for bit against
``flash_attention_hw``; plus the micro-programs, the scoreboard's ability to
fail, and command rejection."""


import numpy as np
import pytest
from amaranth.sim import Simulator

from flashnpu.config import DEFAULT, small_config
from flashnpu.golden import ComparisonError
from flashnpu.hdl.core import Core, PausePoint, cmd_layout, final_program, init_program, softmax_program
from flashnpu.hdl.pe import PeOp, RegMap, TreeOp
from flashnpu.sim.core_driver import (
    AmaranthIo,
    CoreDriver,
    check_run,
    expected_mac_cycles,
    expected_masked_macs,
    make_job,
    pv_keys,
)
from flashnpu.sim.packing import pack

ALL = (PausePoint.S_RAW, PausePoint.S, PausePoint.TILE)
CFG2 = small_config(2, 2, max_head_dim=16)
CFG4 = small_config(4, 4, max_head_dim=16)


def simulate(cfg, job, pause=ALL, backpressure=0.0, seed=0):
    dut = Core(cfg)
    out = {}

    async def tb(ctx):
        drv = CoreDriver(AmaranthIo(ctx, dut), cfg, seed=seed, backpressure=backpressure)
        drv.idle_inputs()
        out["run"] = await drv.run_job(job, pause=pause)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    return out["run"]


def _mask_a1():
    i = np.arange(6)[:, None]
    j = np.arange(10)[None, :]
    m = j <= i + 4
    m[5] = False
    return m


CASES = {
    "plain_2kv": lambda: (CFG2, make_job(CFG2, 8, 4, 7, seed=1), 0.0),
    "causal_3kv": lambda: (CFG2, make_job(CFG2, 8, 6, 10, causal=True, seed=2), 0.3),
    "A1_mask_empty_row": lambda: (CFG2, make_job(CFG2, 8, 6, 10, mask=_mask_a1(), q_tile=1,
                                                 seed=3), 0.5),
    "A3_more_q_than_kv": lambda: (CFG2, make_job(CFG2, 8, 3, 2, causal=True, seed=4), 0.0),
    "kvl_nan_fill_hd5": lambda: (CFG2, make_job(CFG2, 5, 4, 9, kv_valid_len=6, seed=5,
                                                fill=float("nan")), 0.0),
    "hd16_fill_65504": lambda: (CFG2, make_job(CFG2, 16, 4, 8, seed=6, fill=65504.0), 0.0),
    "4x4_causal_pad": lambda: (CFG4, make_job(CFG4, 6, 10, 13, causal=True, q_tile=1, seed=7,
                                              fill=-42.0), 0.2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_core_bit_exact(name):
    cfg, job, bp = CASES[name]()
    run = simulate(cfg, job, backpressure=bp)
    n = check_run(job, run)
    assert n > 0
    assert run.counters["cnt_mac"] == expected_mac_cycles(job)
    assert run.counters["ops_mac"] == expected_mac_cycles(job) * cfg.array_rows * cfg.array_cols
    assert run.counters["ops_recip"] == cfg.br
    assert run.counters["ops_masked"] == expected_masked_macs(job)
    assert run.counters["cnt_tile_sum"] <= run.counters["cnt_total"]
    assert np.isfinite(run.o).all()


def test_pv_stops_after_the_last_visible_key():
    """A decode-shaped q tile (3 rows, kv_valid_len 3 of 13 keys, two kv
    tiles of 8): P.V runs keys 0..2 of tile 0 and one key of tile 1 (no key
    visible there), so the MAC cycles are the Q.K rounds plus 4 P.V key
    rounds instead of 16; every register and O still bit-exact.  Causal:
    the keys stop at the q tile's last row's limit, below E."""
    cfg = CFG4
    wr, wc, od = cfg.rows_per_pe, cfg.cols_per_pe, cfg.o_cols_per_pe(8)
    job = make_job(cfg, 8, 3, 13, kv_valid_len=3, seed=11, fill=float("nan"))
    assert pv_keys(job) == [3, 1]
    # causal, the first q tile of 12 rows: its rows see keys 0..7 at most,
    # so tile 1 (keys 8..11, E = 4) runs one key
    causal = make_job(cfg, 8, 12, 12, causal=True, q_tile=0, seed=12)
    assert pv_keys(causal) == [8, 1]
    for j, keys in ((job, 4), (causal, 9)):
        run = simulate(cfg, j, pause=())
        assert check_run(j, run) > 0
        assert run.counters["cnt_mac"] == j.n_kv * 8 * wr * wc + keys * wr * od
        assert run.counters["ops_masked"] == expected_masked_macs(j)


def test_next_q_tile_runs_beside_the_read_out():
    """Read-out overlap: three q tiles back to back (the two of a causal job,
    then one of another head_dim, with O back-pressure): the core takes
    next command during the read-out (OUT, never IDLE in between), runs
    that q tile's first Q.K^T beside it and its INIT after it, and every O
    is bit-exact (the register check sees O_acc kept for the read-out and
    forgotten after it).  The cycles are checked against the perf model on
    the NPU (``tb/model/test_perf_model.py``)."""
    cfg = CFG4
    jobs = [make_job(cfg, 8, 12, 13, causal=True, q_tile=t, seed=20) for t in (0, 1)]
    jobs.append(make_job(cfg, 16, 3, 9, kv_valid_len=6, seed=21, fill=float("nan")))
    dut = Core(cfg)
    out = {}

    async def tb(ctx):
        drv = CoreDriver(AmaranthIo(ctx, dut), cfg, seed=3, backpressure=0.2)
        drv.idle_inputs()
        out["runs"], out["phases"] = await drv.run_jobs(jobs)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    assert [p.name for p in out["phases"]] == ["IDLE", "OUT", "OUT"]
    for job, run in zip(jobs, out["runs"]):
        assert check_run(job, run) > 0


def test_a2_beyond_fp16_range():
    hd = 16
    q = np.full((1, 1, hd), 256, np.float16)
    k = np.zeros((1, 2, hd), np.float16)
    k[0, 0] = 256
    v = np.random.default_rng(8).standard_normal((1, 2, hd)).astype(np.float16)
    job = make_job(CFG2, hd, 1, 2, q=q, k=k, v=v)
    run = simulate(CFG2, job)
    check_run(job, run)
    assert np.allclose(run.o[0], v[0, 0].astype(np.float32), rtol=1e-3)


def test_p1_running_max_never_goes_down():
    """Case P1: tile 0's scaled logits are about +100 (log2 units) with V = 1,
    tile 1's about -100 with V = 2.  O = 1.0 exactly, and every rescale
    factor alpha the PEs hold after each tile is <= 1 (taking the tile max
    instead of max(m_old, tile max) would give 2^200)."""
    hd, bc = 4, CFG2.bc
    c = 0.5 * 1.4426950408889634                  # scale * log2 e at head_dim 4
    kval = np.float16(100 / c / (4 * 4))           # q . k = 4 * 4 * kval = 100 / c
    q = np.full((1, 1, hd), 4, np.float16)
    k = np.concatenate([np.full((1, bc, hd), kval), np.full((1, bc, hd), -kval)], 1)
    v = np.concatenate([np.full((1, bc, hd), 1), np.full((1, bc, hd), 2)], 1).astype(np.float16)
    job = make_job(CFG2, hd, 1, 2 * bc, q=q, k=k.astype(np.float16), v=v)
    run = simulate(CFG2, job, pause=(PausePoint.TILE,))
    check_run(job, run)
    assert (run.o[0, :hd] == 1.0).all()
    g = RegMap(CFG2)
    for tile in (0, 1):
        alpha = run.regs[(tile, PausePoint.TILE)][:, :, [g.ALPHA(a) for a in range(g.wr)]]
        assert (alpha.view(np.float32) <= 1.0).all(), tile


def test_padding_garbage_does_not_change_valid_rows():
    outs = []
    for fill in (-42.0, 65504.0, float("nan")):
        job = make_job(CFG2, 6, 5, 9, q_tile=1, seed=9, fill=fill)
        run = simulate(CFG2, job, pause=())
        check_run(job, run)
        outs.append(run.o.view(np.uint32))
    assert all((o == outs[0]).all() for o in outs[1:])


def test_scoreboard_reports_location():
    job = make_job(CFG2, 8, 4, 7, seed=1)
    run = simulate(CFG2, job, pause=(PausePoint.TILE,))
    key = (1, PausePoint.TILE)
    regs = run.regs[key]
    g = RegMap(CFG2)
    regs[1, 0, g.L(1)] ^= 1                      # one bit of l_i in PE (1, 0), row a = 1
    with pytest.raises(ComparisonError, match=r"kv tile 1, PE \(r=1, c=0\), register l_i\(a=1\)"):
        check_run(job, run)
    run.regs[key][1, 0, g.L(1)] ^= 1
    run.o_beats[3] = (run.o_beats[3][0], run.o_beats[3][1], run.o_beats[3][2] + 1)
    with pytest.raises(ComparisonError, match="final O"):
        check_run(job, run)


@pytest.mark.parametrize("head_dim,n_kv", [(0, 1), (17, 1), (8, 0)])
def test_bad_command_is_rejected(head_dim, n_kv):
    dut = Core(CFG2)
    seen = {}

    async def tb(ctx):
        io = AmaranthIo(ctx, dut)
        io.set("cmd__payload", pack(cmd_layout(CFG2), dict(head_dim=head_dim, n_kv=n_kv,
                                                           seq_q=4, seq_kv=4, kv_valid_len=4)))
        io.set("cmd__valid", 1)
        await io.tick()
        io.set("cmd__valid", 0)
        await io.tick()
        seen["err"], seen["busy"] = io.get("err"), io.get("busy")

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    assert seen == {"err": 1, "busy": 0}


def test_programs_are_complete_and_never_wait():
    """Every variant of the scheduled programs holds its ops, and its
    return-register reads come after the results arrive, so the run-time
    wait never stalls (the perf model's walk, which stalls like the core,
    equals the program length)."""
    from flashnpu.hdl.fpu import Recip
    from flashnpu.scripts.perf_model import Timing, rtl_program_cycles
    for cfg in (CFG2, CFG4, DEFAULT):
        wr, wc = cfg.rows_per_pe, cfg.cols_per_pe
        for od in range(1, cfg.o_cols_per_pe(cfg.max_head_dim) + 1):
            prog = softmax_program(cfg, od)
            ops = [w["ctl"]["op"] for w in prog]
            assert ops.count(PeOp.SCALE) == wr * wc and ops.count(PeOp.PEXP) == wr * wc
            assert ops.count(PeOp.MALPHA) == wr and ops.count(PeOp.LADD) == wr
            assert ops.count(PeOp.RESC) == wr * od + wr
            trees = [w["ctl"]["tree"] for w in prog]
            assert trees.count(TreeOp.MAX) == wr and trees.count(TreeOp.SUM) == wr
            assert sum(w["pause"] for w in prog) == 1 and prog[-1]["last"] == 1
            assert sum(w["last"] for w in prog) == 1
            hd = min(od * cfg.array_cols, cfg.max_head_dim)
            walked = rtl_program_cycles(cfg, hd)
            slots = tuple(c for c, w in enumerate(prog) if w["mac_ok"])
            last = softmax_program(cfg, od, last=True)
            final = final_program(cfg, od)
            assert [w["ctl"]["op"] for w in last].count(PeOp.LOADT) == wr
            assert sum(w["ctl"]["rcp"] for w in last) == wr and not any(w["ctl"]["rcp"] for w in final)
            assert [w["ctl"]["op"] for w in final].count(PeOp.FINAL) == wr * od
            assert {k: v for k, v in walked.items() if k != "final_ready"} == {
                "init": len(init_program(cfg, od)), "softmax": len(prog), "softmax_last": len(last),
                "final": len(final), "softmax_slots": slots}, (cfg.array_rows, od)
            # every reciprocal has arrived once a P.V as long as the division has run
            assert Timing().final_wait(cfg, hd, Recip.LATENCY) == 0, (cfg.array_rows, od)
            # the program on S block 1 is the same schedule on other registers
            prog1 = softmax_program(cfg, od, 1)
            assert [(w["ctl"]["op"], w["mac_ok"]) for w in prog1] == [(w["ctl"]["op"], w["mac_ok"]) for w in prog]
            assert all(PeOp(w["ctl"]["op"]) == PeOp.NOP for w in prog if w["mac_ok"])
            assert slots, (cfg.array_rows, od)
