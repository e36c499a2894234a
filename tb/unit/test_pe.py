"""amaranth.sim unit tests of one PE and of the row-reduction tree: every
opcode against ``golden.numerics`` bit for bit, including the special rows
(empty row: m = -inf, alpha = 1, P = 0; l == 0 -> O = 0; P == 0 skips the
MAC; a masked MAC neither writes nor feeds its multiplier).  Ops are issued
one at a time and the pipeline drained after each, except in the MAC stream
test, which issues a MAC every cycle on ``MAC_RECURRENCE`` interleaved
accumulators as the S and P.V loops do."""

import numpy as np
import pytest
from amaranth.sim import Simulator

from flashnpu.config import small_config
from flashnpu.golden import numerics as nx
from flashnpu.hdl.pe import MAC_RECURRENCE, NEG_INF32, PIPE_DEPTH, Pe, PeOp, TreeOp, ctl_layout
from flashnpu.hdl.reduce import RowReduce
from flashnpu.sim.packing import pack

CFG = small_config(2, 2, max_head_dim=16)
U32 = np.uint32


def b32(x):
    return int(np.asarray(x, np.float32).reshape(()).view(U32))


def f16b(x):
    return int(np.float16(x).view(np.uint16))


def _run(tb_body):
    dut = Pe(CFG)
    sim = Simulator(dut)
    sim.add_clock(1e-8)

    async def tb(ctx):
        lay = ctl_layout(CFG)
        ctx.set(dut.vis, 1)

        async def op(drain=True, **kw):
            ctx.set(dut.ctl.as_value(), pack(lay, kw))
            await ctx.tick()
            ctx.set(dut.ctl.as_value(), 0)
            if drain:
                await ctx.tick().repeat(PIPE_DEPTH)

        async def read(addr):
            ctx.set(dut.sa, addr)
            await ctx.tick()
            return int(ctx.get(dut.sd))

        await tb_body(ctx, dut, op, read)
    sim.add_testbench(tb)
    sim.run()


async def _load(ctx, dut, op, addr, value_bits):
    """Put a binary32 pattern into a register: S = mac(0, x16, 1.0) cannot
    hold every binary32, so use LADD: A + ret with A = +0 (SETZ) -> ret
    exactly (add32(+0, x) = x for normal x and zeros)."""
    await op(op=PeOp.SETZ, wa=60)
    ctx.set(dut.ret, value_bits)
    await op(op=PeOp.LADD, ra=60, wa=addr)


VALS = [0.0, 1.5, -3.25, 1e-3, 7.0e4, -2.0 ** -120, 3.0e38]


def test_mac_and_skip():
    rng = np.random.default_rng(1)
    a16 = rng.standard_normal(40).astype(np.float16)
    b16 = rng.standard_normal(40).astype(np.float16)
    a16[5] = 0
    a16[9] = -0.0

    async def body(ctx, dut, op, read):
        acc = np.float32(0)
        for i in range(40):
            ctx.set(dut.a16, int(a16[i].view(np.uint16)))
            ctx.set(dut.b16, int(b16[i].view(np.uint16)))
            await op(op=PeOp.MAC, ra=3, wa=3, first=int(i == 0), skipz=1)
            if a16[i] != 0:
                acc = nx.mac(np.float32(0) if i == 0 else acc, a16[i], b16[i])
        got = await read(3)
        assert got == int(np.float32(acc).view(U32)), (hex(got), acc)
    _run(body)


def test_masked_mac_is_skipped_and_isolated():
    """A MAC at a masked position (vis 0) leaves its accumulator alone,
    raises ``msk`` for one cycle, and its multiplier sees +0 operands
    (operand isolation) while the buses carry data; P.V's zero-P skip
    writes nothing but is not counted as masked."""
    rng = np.random.default_rng(3)
    a16 = rng.standard_normal(8).astype(np.float16)
    b16 = rng.standard_normal(8).astype(np.float16)
    vis = [1, 0, 1, 1, 0, 0, 1, 1]

    async def body(ctx, dut, op, read):
        acc = np.float32(0)
        first = True
        for i in range(8):
            ctx.set(dut.a16, int(a16[i].view(np.uint16)))
            ctx.set(dut.b16, int(b16[i].view(np.uint16)))
            ctx.set(dut.vis, vis[i])
            ctx.set(dut.ctl.as_value(), pack(ctl_layout(CFG), dict(op=PeOp.MAC, ra=5, wa=5,
                                                                  first=int(i == 0))))
            assert ctx.get(dut.mult_in) == (0 if not vis[i] else
                                            int(a16[i].view(np.uint16)) | int(b16[i].view(np.uint16)) << 16)
            await ctx.tick()
            assert ctx.get(dut.msk) == 1 - vis[i]
            ctx.set(dut.ctl.as_value(), 0)
            await ctx.tick().repeat(PIPE_DEPTH)
            assert ctx.get(dut.msk) == 0
            if vis[i]:
                acc = nx.mac(np.float32(0) if first else acc, a16[i], b16[i])
                first = False
        # the first MAC (vis 1) zeroed the accumulator; the masked ones kept it
        assert await read(5) == b32(acc)
        ctx.set(dut.vis, 1)
        ctx.set(dut.a16, 0)
        await op(op=PeOp.MAC, ra=5, wa=5, skipz=1)
        assert await read(5) == b32(acc)
    _run(body)


def test_mac_stream_on_interleaved_accumulators():
    """One MAC per cycle, accumulators 0..MAC_RECURRENCE-1 in turn: each
    MAC reads the result its predecessor on the same register wrote
    ``MAC_RECURRENCE`` cycles earlier (P1: the accumulation dependence)."""
    rng = np.random.default_rng(2)
    n = MAC_RECURRENCE
    a16 = rng.standard_normal((12, n)).astype(np.float16)
    b16 = rng.standard_normal((12, n)).astype(np.float16)

    async def body(ctx, dut, op, read):
        for k in range(12):
            for r in range(n):
                ctx.set(dut.a16, int(a16[k, r].view(np.uint16)))
                ctx.set(dut.b16, int(b16[k, r].view(np.uint16)))
                await op(drain=False, op=PeOp.MAC, ra=r, wa=r, first=int(k == 0))
        await ctx.tick().repeat(PIPE_DEPTH)
        for r in range(n):
            acc = np.float32(0)
            for k in range(12):
                acc = nx.mac(acc, a16[k, r], b16[k, r])
            assert await read(r) == b32(acc), r
    _run(body)


def test_p3_two_latencies_one_write_port():
    """Case P3: a long-latency op (MALPHA: exp2, writes in stage 9) for one
    row issued the cycle before short ones for the next (SCALE: stage 4,
    MSET: stage 2), all through the one write port: each result lands in
    its own register and nothing is dropped."""
    c = nx.scale_log2e(0.125)

    async def body(ctx, dut, op, read):
        ctx.set(dut.cst, b32(c))
        await _load(ctx, dut, op, 10, b32(2.0))           # m_old of row 0
        await _load(ctx, dut, op, 3, b32(1.5))            # a score of row 1
        ctx.set(dut.ret, b32(3.5))                        # row 0's tile max
        ctx.set(dut.vis, 1)
        await op(drain=False, op=PeOp.MALPHA, ra=10, wa=11)
        await op(drain=False, op=PeOp.SCALE, ra=3, wa=4, first=1)
        await op(drain=False, op=PeOp.MSET, wa=12)
        await ctx.tick().repeat(PIPE_DEPTH)
        m_new = nx.max32(np.float32(2.0), np.float32(3.5))
        assert await read(11) == b32(nx.exp2(nx.sub32(np.float32(2.0), m_new)))
        assert await read(4) == b32(nx.mul32(np.float32(1.5), c))
        assert await read(12) == b32(m_new)
        assert await read(3) == b32(1.5) and await read(10) == b32(2.0)
    _run(body)


def test_scale_mask_and_max_fold():
    c = nx.scale_log2e(0.125)
    xs = [1.5, -40.0, 3.0, 2.5]
    vis = [1, 1, 0, 1]

    async def body(ctx, dut, op, read):
        ctx.set(dut.cst, b32(c))
        for i, x in enumerate(xs):
            await _load(ctx, dut, op, i, b32(x))
        exp_fold = None
        for i, x in enumerate(xs):
            ctx.set(dut.vis, vis[i])
            await op(op=PeOp.SCALE, ra=i, wa=i, first=int(i == 0))
            s = nx.mul32(np.float32(x), c) if vis[i] else np.float32(-np.inf)
            exp_fold = s if exp_fold is None else nx.max32(exp_fold, s)
            assert await read(i) == b32(s), i
        assert int(ctx.get(dut.t)) == b32(exp_fold)
    _run(body)


@pytest.mark.parametrize("m_old,m_tile", [(-np.inf, -np.inf), (-np.inf, 3.5), (2.0, 3.5),
                                          (5.0, 3.5)])
def test_malpha_pexp_mset(m_old, m_tile):
    svals = [3.5, -np.inf, 1.0, 3.25]

    async def body(ctx, dut, op, read):
        if np.isfinite(m_old):
            await _load(ctx, dut, op, 10, b32(m_old))
        else:
            await op(op=PeOp.SETNI, wa=10)
        for i, s in enumerate(svals):
            if np.isfinite(s):
                await _load(ctx, dut, op, i, b32(s))
            else:
                await op(op=PeOp.SETNI, wa=i)
        ctx.set(dut.ret, b32(m_tile))
        await op(op=PeOp.MALPHA, ra=10, wa=11)
        m_new = nx.max32(np.float32(m_old), np.float32(m_tile))
        empty = np.isneginf(m_new)
        alpha = np.float32(1) if empty else nx.exp2(nx.sub32(np.float32(m_old), m_new))
        assert await read(11) == b32(alpha)
        total = None
        for i, s in enumerate(svals):
            await op(op=PeOp.PEXP, ra=i, wa=i, first=int(i == 0))
            p = np.float16(0) if empty else nx.to_fp16(nx.exp2(nx.sub32(np.float32(s), m_new)))
            assert await read(i) == int(np.asarray(p, np.float16).reshape(()).view(np.uint16)), (i, p)
            p32 = np.float32(p)
            total = p32 if total is None else nx.add32(total, p32)
        assert int(ctx.get(dut.t)) == b32(total)
        await op(op=PeOp.MSET, wa=10)
        assert await read(10) == b32(m_new)
    _run(body)


def test_ladd_resc_final():
    async def body(ctx, dut, op, read):
        alpha, l_old, l_tile, o = np.float32(0.75), np.float32(3.5), np.float32(1.25), np.float32(-2.5)
        await _load(ctx, dut, op, 1, b32(alpha))
        await _load(ctx, dut, op, 2, b32(l_old))
        await _load(ctx, dut, op, 3, b32(o))
        ctx.set(dut.ret, b32(l_tile))
        await op(op=PeOp.RESC, ra=1, rb=2, wa=2)
        await op(op=PeOp.LADD, ra=2, wa=2)
        l_new = nx.add32(nx.mul32(alpha, l_old), l_tile)
        assert await read(2) == b32(l_new)
        await op(op=PeOp.RESC, ra=1, rb=3, wa=3)
        o2 = nx.mul32(alpha, o)
        assert await read(3) == b32(o2)
        r = nx.recip32(l_new)
        ctx.set(dut.ret, b32(r))
        await op(op=PeOp.FINAL, ra=3, rb=2, wa=3)
        assert await read(3) == b32(nx.mul32(o2, r))
        # l == 0 -> O = +0 whatever O_acc and 1/l hold
        await op(op=PeOp.SETZ, wa=2)
        ctx.set(dut.ret, 0x7F800000)
        await op(op=PeOp.FINAL, ra=3, rb=2, wa=3)
        assert await read(3) == 0
        await op(op=PeOp.SETNI, wa=4)
        assert await read(4) == NEG_INF32
        await op(op=PeOp.LOADT, ra=4)
        assert int(ctx.get(dut.t)) == NEG_INF32
    _run(body)


@pytest.mark.parametrize("cols", [2, 8])
def test_row_reduce_matches_tree_reduce(cols):
    rng = np.random.default_rng(cols)
    dut = RowReduce(cols, 3)
    vals = [(rng.standard_normal(cols) * 100).astype(np.float32) for _ in range(6)]
    vals[1][:] = -np.inf
    ops = [TreeOp.MAX, TreeOp.SUM] * 3
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    got = []

    async def tb(ctx):
        for cyc in range(len(vals) + dut.LATENCY + 1):
            if cyc < len(vals):
                for i in range(cols):
                    ctx.set(dut.leaves[i], b32(vals[cyc][i]))
                ctx.set(dut.op, ops[cyc])
                ctx.set(dut.tag, cyc)
            else:
                ctx.set(dut.op, TreeOp.NONE)
            if ctx.get(dut.res_valid):
                got.append((int(ctx.get(dut.res_tag)), int(ctx.get(dut.res))))
            await ctx.tick()
    sim.add_testbench(tb)
    sim.run()
    assert [t for t, _ in got] == list(range(len(vals))), "one result per injection, in order"
    for tag, res in got:
        op = nx.max32 if ops[tag] == TreeOp.MAX else nx.add32
        exp = nx.tree_reduce(vals[tag][None, :], cols, op)[0]
        assert res == b32(exp), (tag, hex(res), exp)
