"""cocotb measurements of the DMA on the generated MemorySystem Verilog (used by
``scripts/bench_dma.py``): delivered bytes per cycle for K/V tile streams and
long bursts, and whether ping-pong prefetch hides DRAM behind a compute window.

Parameters arrive in ``FLASHNPU_BENCH`` (JSON: head_dims, n_tiles, bursts,
compute_cycles, pp_tiles); results are written as JSON to ``FLASHNPU_BENCH_OUT``.
Every transferred byte is still compared with the source.
"""

from __future__ import annotations

import json
import os

import cocotb
import numpy as np
from cocotb.triggers import ClockCycles
from cocotb.utils import get_sim_time

from flashnpu.hdl.dma import DMAError
from flashnpu.sim.mem_testbench import CFG, DRAM_TENSOR, PP_BASE, PP_HALF, MemTB, W

P = json.loads(os.environ.get("FLASHNPU_BENCH", "{}"))
OUT = os.environ.get("FLASHNPU_BENCH_OUT")
QUEUE_DEPTH = 4


def _now():
    return int(get_sim_time("ns"))        # 1 ns clock: cycles


async def _stream(tb, descs):
    """Submit ``descs`` keeping at most QUEUE_DEPTH outstanding; return (cycles, bytes)."""
    dut = tb.dut
    c0 = int(dut.dma_active_cycles.value)
    b0 = int(dut.dma_bytes_moved.value)
    n0 = len(tb.completions)
    t0 = _now()
    for i, d in enumerate(descs):
        while i - (len(tb.completions) - n0) >= QUEUE_DEPTH:
            await tb.wait_done(len(tb.completions) + 1)
        await tb.submit(*d)
    await tb.wait_done(n0 + len(descs))
    t1 = _now()
    assert all(c == DMAError.OK for _, c in tb.completions[n0:]), tb.completions[n0:]
    return dict(active_cycles=int(dut.dma_active_cycles.value) - c0, wall_cycles=t1 - t0,
                bytes=int(dut.dma_bytes_moved.value) - b0)


@cocotb.test()
async def dma_bandwidth(dut):
    tb = MemTB(dut, 1, desc_idle=0.0, done_bp=0.0, model_delay=0, consumers=False, bd_rand=0.0)
    await tb.start()
    dut.pp_half_bytes.value = 0                 # plain descriptors
    results = {"word_bytes": W, "latency": CFG.dram_latency_cycles, "kv_stream": {}, "burst": {}}
    rng = np.random.default_rng(1)
    heads, seq = 2, 64 * P.get("n_tiles", 8)
    for hd in P.get("head_dims", [64, 128]):
        tile = 64 * hd * 2
        k = rng.integers(0, 256, heads * seq * hd * 2, dtype=np.uint8).tobytes()
        v = rng.integers(0, 256, heads * seq * hd * 2, dtype=np.uint8).tobytes()
        kb, vb = DRAM_TENSOR, DRAM_TENSOR + len(k)
        tb.fill_dram(kb, k)
        tb.fill_dram(vb, v)
        descs = []
        tag = 0
        for j in range(seq // 64):           # layout [seq, heads, hd], head 0
            for base, dst in ((kb, PP_BASE), (vb, PP_BASE + tile)):
                src = base + (j * 64 * heads) * hd * 2
                descs.append((tag & 0xFF, src, dst + (j % 2) * 2 * tile, 64, hd * 2, heads * hd * 2, hd * 2))
                tag += 1
        r = await _stream(tb, descs)
        r["descriptors"] = len(descs)
        r["bytes_per_cycle"] = r["bytes"] / r["wall_cycles"]
        r["efficiency"] = r["bytes_per_cycle"] / W
        results["kv_stream"][str(hd)] = r
        await tb.check_sram(PP_BASE, PP_BASE + 4 * tile, f"K/V stream hd={hd}")
    for count, rows in P.get("bursts", [[1, 64], [1, 256], [4, 256]]):
        data = rng.integers(0, 256, rows * 256, dtype=np.uint8).tobytes()
        tb.fill_dram(DRAM_TENSOR, data)
        r = await _stream(tb, [(i, DRAM_TENSOR, PP_BASE, rows, 256, 256, 256) for i in range(count)])
        await tb.check_sram(PP_BASE, PP_BASE + rows * 256, f"burst {count}x{rows * 256}")
        r["descriptors"] = count
        r["bytes_per_cycle"] = r["bytes"] / r["wall_cycles"]
        r["efficiency"] = r["bytes_per_cycle"] / W
        results["burst"][f"{count}x{rows * 256}"] = r
    assert int(dut.dram_late.value) == 0
    tb.stop()
    _write(results, "bandwidth")


@cocotb.test()
async def prefetch_hiding(dut):
    """Consumer: wait for half j%2 full, compute for ``compute_cycles``, release,
    and queue tile j+2 into the released half."""
    tb = MemTB(dut, 2, desc_idle=0.0, done_bp=0.0, model_delay=0, consumers=False, bd_rand=0.0)
    await tb.start()
    compute = P.get("compute_cycles", 1024)
    n = P.get("pp_tiles", 8)
    res = {}
    rng = np.random.default_rng(2)
    for hd in P.get("head_dims", [64, 128]):
        tile = 64 * hd * 2
        kv = rng.integers(0, 256, 2 * n * tile, dtype=np.uint8).tobytes()
        tb.fill_dram(DRAM_TENSOR, kv)
        tag = [0]

        async def queue_tile(j):
            half = j % 2
            for kvi in range(2):
                src = DRAM_TENSOR + (2 * j + kvi) * tile
                await tb.submit(tag[0] & 0xFF, src, PP_BASE + half * PP_HALF + kvi * tile, 64, hd * 2, hd * 2,
                                hd * 2, pp_en=1, pp_half=half, pp_commit=kvi)
                tag[0] += 1

        n0 = len(tb.completions)
        t_start = _now()
        await queue_tile(0)
        await queue_tile(1)
        stalls = []
        for j in range(n):
            half = j % 2
            t = _now()
            await tb.wait_full(half)
            stalls.append(_now() - t)
            # compute window; spot-check the first and last 512 bytes of K and V inside it
            t_c = _now()
            lo = PP_BASE + half * PP_HALF
            for off in (0, tile - 512, tile, 2 * tile - 512):
                got = await tb.sram_read(lo + off, 512)
                exp = kv[2 * j * tile + off:2 * j * tile + off + 512]
                assert got == exp, f"tile {j} hd={hd} offset {off}"
            left = compute - (_now() - t_c)
            assert left > 0, "the spot check took longer than the compute window"
            await ClockCycles(dut.clk, left)
            await tb.release(half)
            if j + 2 < n:
                await queue_tile(j + 2)
        await tb.wait_done(n0 + 2 * n)
        res[str(hd)] = dict(tiles=n, compute_cycles=compute, first_tile_wait=stalls[0],
                            steady_stalls=stalls[1:], max_steady_stall=max(stalls[1:]),
                            hidden=max(stalls[1:]) == 0, total_cycles=_now() - t_start,
                            kv_bytes_per_tile=2 * tile)
    assert all(c == DMAError.OK for _, c in tb.completions), tb.completions
    tb.stop()
    _write({"prefetch": res}, "prefetch")


def _write(obj, key):
    if not OUT:
        return
    try:
        with open(OUT) as f:
            cur = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        cur = {}
    cur[key] = obj
    with open(OUT, "w") as f:
        json.dump(cur, f, indent=1)
