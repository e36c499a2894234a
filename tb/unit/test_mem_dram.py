"""Stacked DRAM timing-model unit tests (amaranth.sim, storage in the Python model):
exact latency, one word per cycle per channel, channel conflicts, ordering, counters."""

import random

import pytest
from amaranth.sim import Simulator

from flashnpu.hdl.dram import StackedDRAM
from flashnpu.sim.dram_model import DRAMModel
from flashnpu.tb.helpers import raises_quietly, stream_get, stream_put, tiny_mem_config

CFG = tiny_mem_config(dram_latency_cycles=12)
W = CFG.dram_channel_bytes
L = CFG.dram_latency_cycles
C = CFG.dram_channels


def _sim(dut, model, benches, processes=()):
    sim = Simulator(dut)
    sim.add_clock(1e-6)
    for b in benches:
        sim.add_testbench(b)
    for p in range(dut.n_ports):
        sim.add_process(model.amaranth_server(dut.bk[p]))
    for p in processes:
        sim.add_process(p)
    return sim


def test_latency_is_exact_and_reads_stream_back_to_back():
    dut = StackedDRAM(CFG, n_ports=1)
    model = DRAMModel(CFG, seed=0, max_extra_delay=L - 4)     # model answers late, within budget
    n = 40
    for a in range(n):
        model.write_word(a, 0x1000 + a, (1 << W) - 1)
    accept, arrive, data = [], [], []

    async def main(ctx):
        port = dut.ports[0]
        ctx.set(port.rdata.ready, 1)
        cycle = 0
        i = 0
        ctx.set(port.cmd.valid, 1)
        while len(data) < n:
            if i < n:
                ctx.set(port.cmd.payload, {"addr": i, "write": 0, "wmask": 0})
            else:
                ctx.set(port.cmd.valid, 0)
            _, _, cr, rv, rp = await ctx.tick().sample(port.cmd.ready, port.rdata.valid, port.rdata.payload)
            if cr and i < n:
                accept.append(cycle)
                i += 1
            if rv:
                arrive.append(cycle)
                data.append(rp)
            cycle += 1
            assert cycle < 10 * n + 200
        assert ctx.get(dut.late) == 0
        assert ctx.get(dut.rd_bytes) == n * W

    _sim(dut, model, [main]).run()
    assert data == [0x1000 + a for a in range(n)]
    assert accept == list(range(n))                      # one read per cycle
    assert [b - a for a, b in zip(accept, arrive)] == [L] * n


def test_late_model_is_flagged():
    """No model serves the backend bus: the matured read finds no data -> ``late``."""
    dut = StackedDRAM(CFG, n_ports=1)

    async def main(ctx):
        port = dut.ports[0]
        ctx.set(port.rdata.ready, 1)
        assert ctx.get(dut.late) == 0
        await stream_put(ctx, port.cmd, {"addr": 3, "write": 0, "wmask": 0})
        for _ in range(L + 4):
            await ctx.tick()
        assert ctx.get(dut.late) == 1

    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(main)
    sim.run()


@pytest.mark.parametrize("seed", [5, 6])
def test_two_ports_random_traffic(seed):
    """Two ports, random reads/writes with masks to private interleaved words,
    random idle/back-pressure, random model delay; read data in order and exact."""
    print(f"seed={seed}")
    dut = StackedDRAM(CFG, n_ports=2)
    model = DRAMModel(CFG, seed=seed, max_extra_delay=3)
    expect = [[], []]
    got = [[], []]
    fin = [0]

    def driver(p):
        async def run(ctx):
            r = random.Random(seed * 7 + p)
            shadow = {}
            addrs = [C * (2 * k + p) + k % C for k in range(24)]   # every channel, private words
            for _ in range(50):
                a = r.choice(addrs)
                port = dut.ports[p]
                if a not in shadow or r.random() < 0.4:
                    wd = r.getrandbits(8 * W)
                    mask = r.getrandbits(W) if a in shadow else (1 << W) - 1
                    old = shadow.get(a, 0)
                    shadow[a] = sum(((wd if (mask >> b) & 1 else old) & (0xFF << 8 * b)) for b in range(W))
                    # command and data must be valid together
                    ctx.set(port.wdata.payload, wd)
                    ctx.set(port.wdata.valid, 1)
                    await stream_put(ctx, port.cmd, {"addr": a, "write": 1, "wmask": mask}, r, 0.3)
                    ctx.set(port.wdata.valid, 0)
                else:
                    expect[p].append(shadow[a])
                    await stream_put(ctx, port.cmd, {"addr": a, "write": 0, "wmask": 0}, r, 0.3)
            fin[0] += 1
        return run

    def reader(p):
        async def run(ctx):
            r = random.Random(seed * 9 + p)
            while True:
                got[p].append(await stream_get(ctx, dut.ports[p].rdata, r, 0.4))
        return run

    async def main(ctx):
        for _ in range(8000):
            await ctx.tick()
            if fin[0] == 2 and all(len(got[p]) == len(expect[p]) for p in range(2)):
                break
        assert fin[0] == 2
        assert got == expect
        assert sum(map(len, expect)) > 20
        assert ctx.get(dut.late) == 0
        assert ctx.get(dut.conflict_cycles) > 0         # both ports share channels
        assert ctx.get(dut.rd_bytes) == sum(map(len, expect)) * W
        assert ctx.get(dut.wr_bytes) == model.writes * W

    _sim(dut, model, [main, driver(0), driver(1)], [reader(0), reader(1)]).run()


@pytest.mark.parametrize("same_channel", [True, False])
def test_channel_bandwidth(same_channel):
    """Two ports stream n reads: on different channels both run at one word
    per cycle; on the same channel they share it (2n cycles)."""
    dut = StackedDRAM(CFG, n_ports=2)
    model = DRAMModel(CFG)
    n = 24
    addrs = [[C * i for i in range(n)], [C * (i + 100) + (0 if same_channel else 1) for i in range(n)]]
    res = {}

    async def main(ctx):
        for p in range(2):
            ctx.set(dut.ports[p].rdata.ready, 1)
            ctx.set(dut.ports[p].cmd.valid, 1)
        idx = [0, 0]
        cycles = 0
        while min(idx) < n:
            for p in range(2):
                if idx[p] < n:
                    ctx.set(dut.ports[p].cmd.payload, {"addr": addrs[p][idx[p]], "write": 0, "wmask": 0})
                else:
                    ctx.set(dut.ports[p].cmd.valid, 0)
            _, _, r0, r1 = await ctx.tick().sample(dut.ports[0].cmd.ready, dut.ports[1].cmd.ready)
            cycles += 1
            idx[0] += bool(r0 and idx[0] < n)
            idx[1] += bool(r1 and idx[1] < n)
        res["cycles"] = cycles

    _sim(dut, model, [main]).run()
    assert res["cycles"] == (2 * n if same_channel else n)


def test_bad_parameters():
    raises_quietly(ValueError, "dram_latency_cycles", lambda: StackedDRAM(tiny_mem_config(dram_latency_cycles=2)))
    raises_quietly(ValueError, "max_outstanding", lambda: StackedDRAM(CFG, max_outstanding=3))
