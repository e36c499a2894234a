"""cocotb measurements of the DMA on the generated MemorySystem Verilog (used by
``scripts/bench_dma.py``): delivered bytes per cycle for K/V tile streams of
several source layouts and for single bursts, the DRAM counters of each, and
whether ping-pong prefetch hides the DRAM behind a compute window.

Parameters arrive in ``FLASHNPU_BENCH`` (JSON: ``streams``, ``bursts``,
``compute_cycles``, ``pp_tiles``, ``pp_head_dims``, ``outstanding``; see
``scripts/bench_dma.py``); results are written as JSON to
``FLASHNPU_BENCH_OUT``.  The DRAM answers through the simulator's own server
(``sim/dram_hook.cpp``) with no extra delay.

A K/V stream is a FlashAttention kv loop: for kv tile j, a K descriptor and
a V descriptor of 64 rows of ``head_dim`` FP16 elements, source rows
``stride`` bytes apart, into two alternating SRAM slots; the stream runs
over ``seq_tiles`` kv tiles again and again (one pass per q tile), keeping
at most ``QUEUE_DEPTH`` descriptors outstanding.  Two figures per stream:

* *window*: words written into SRAM in exactly ``window_trefi`` refresh
  intervals (tREFI cycles each), sampled at fixed cycles after a
  ``warmup``: the steady-state rate with refresh at its true share;
* *end to end*: bytes of the whole stream over the cycles from the first
  submit to the last completion (start-up latency included).

Checks: every descriptor completes OK; the last tiles in SRAM equal the
source (backdoor read, the scoreboard ``MemTB.sram``); no late DRAM answer.
"""

from __future__ import annotations

import json
import os

import cocotb
import numpy as np
from cocotb.triggers import ClockCycles

from flashnpu.hdl.dma import DMAError
from flashnpu.sim.mem_testbench import CFG, DRAM_TENSOR, PP_BASE, PP_HALF, MemTB, W, now

P = json.loads(os.environ.get("FLASHNPU_BENCH", "{}"))
OUT = os.environ.get("FLASHNPU_BENCH_OUT")
#: descriptors a host keeps outstanding: the DMA queue depth (never QUEUE_FULL)
QUEUE_DEPTH = P.get("outstanding", 4)
TILE_ROWS = 64
T = CFG.dram_timing_cycles()


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def _bench_tb(dut, seed):
    return MemTB(dut, seed, desc_idle=0.0, done_bp=0.0, model_delay=0, consumers=False, bd_rand=0.0)


async def _run_stream(tb, descs, window=None):
    """Submit the descriptors of ``descs`` (an iterator) keeping at most
    QUEUE_DEPTH outstanding.  ``window = (warmup, cycles)``: sample the
    counters ``warmup`` cycles after the first submit and ``cycles`` later,
    then stop taking descriptors at the next even count (a whole K/V pair).
    Returns the end-to-end figures and the window's."""
    dut = tb.dut
    n0 = len(tb.completions)
    k0 = tb.dram_counters()
    t0 = now()
    win = {}

    async def sampler():
        await ClockCycles(dut.clk, window[0])
        win["t0"], win["k0"] = now(), tb.dram_counters()
        await ClockCycles(dut.clk, window[1])
        win["t1"], win["k1"] = now(), tb.dram_counters()

    task = cocotb.start_soon(sampler()) if window else None
    n = 0
    for d in descs:
        if task is not None and task.done() and n % 2 == 0:
            break
        while n - (len(tb.completions) - n0) >= QUEUE_DEPTH:
            await tb.wait_done(len(tb.completions) + 1)
        await tb.submit(*d)
        n += 1
    await tb.wait_done(n0 + n)
    t1 = now()
    assert task is None or task.done(), "the stream ended before its measurement window"
    assert all(c == DMAError.OK for _, c in tb.completions[n0:]), tb.completions[n0:]
    k = _delta(k0, tb.dram_counters())
    r = dict(descriptors=n, bytes=k["dma_bytes_moved"], cycles=t1 - t0, counters=k)
    r["bytes_per_cycle"] = r["bytes"] / r["cycles"]
    if window:
        kw = _delta(win["k0"], win["k1"])
        cyc = win["t1"] - win["t0"]
        r["window"] = dict(cycles=cyc, bytes=kw["dma_beats"] * W, bytes_per_cycle=kw["dma_beats"] * W / cyc,
                           counters=kw)
    return r


def _fill_rows(tb, rng, base, rows, stride, bpr):
    for i in range(rows):
        tb.fill_dram(base + i * stride, rng.integers(0, 256, bpr, dtype=np.uint8).tobytes())


@cocotb.test()
async def dma_bandwidth(dut):
    """The K/V streams of ``P["streams"]`` and the bursts of ``P["bursts"]``."""
    tb = _bench_tb(dut, 1)
    await tb.start()
    dut.pp_half_bytes.value = 0                 # plain descriptors
    results = {"word_bytes": W, "latency": CFG.dram_latency_cycles, "timing": T, "streams": {}, "burst": {}}
    rng = np.random.default_rng(1)
    for case in P.get("streams", []):
        hd, stride, n_seq = case["head_dim"], case["stride"], case["seq_tiles"]
        bpr = 2 * hd
        tile = TILE_ROWS * bpr
        kb = DRAM_TENSOR
        vb = kb + case["v_offset"]
        for base in (kb, vb):
            _fill_rows(tb, rng, base, n_seq * TILE_ROWS, stride, bpr)

        def descs():
            j = 0
            while True:
                src = (j % n_seq) * TILE_ROWS * stride
                dst = PP_BASE + (j % 2) * 2 * tile
                yield (2 * j & 0xFF, kb + src, dst, TILE_ROWS, bpr, stride, bpr)
                yield ((2 * j + 1) & 0xFF, vb + src, dst + tile, TILE_ROWS, bpr, stride, bpr)
                j += 1

        window = (case["warmup"], case["window_trefi"] * T["trefi"])
        r = await _run_stream(tb, descs(), window)
        r["kv_tiles"] = r["descriptors"] // 2
        results["streams"][case["name"]] = r
        await tb.check_sram(PP_BASE, PP_BASE + 4 * tile, f"K/V stream {case['name']}")
        dut._log.info(f"stream {case['name']}: {r['window']['bytes_per_cycle']:.1f} B/cycle in the window, "
                      f"{r['bytes_per_cycle']:.1f} end to end")
    for count, rows in P.get("bursts", []):
        data = rng.integers(0, 256, rows * 256, dtype=np.uint8).tobytes()
        tb.fill_dram(DRAM_TENSOR, data)
        await tb.after_refresh()
        r = await _run_stream(tb, [(i, DRAM_TENSOR, PP_BASE, rows, 256, 256, 256) for i in range(count)])
        await tb.check_sram(PP_BASE, PP_BASE + rows * 256, f"burst {count}x{rows * 256}")
        results["burst"][f"{count}x{rows * 256}"] = r
    assert int(dut.dram_late.value) == 0
    tb.stop()
    _write(results, "bandwidth")


@cocotb.test()
async def prefetch_hiding(dut):
    """Consumer: wait for half j%2 full, compute for ``compute_cycles``, release,
    and queue tile j+2 into the released half."""
    tb = _bench_tb(dut, 2)
    await tb.start()
    compute = P.get("compute_cycles", 1024)
    n = P.get("pp_tiles", 8)
    res = {}
    rng = np.random.default_rng(2)
    for hd in P.get("pp_head_dims", [64, 128]):
        tile = TILE_ROWS * hd * 2
        kv = rng.integers(0, 256, 2 * n * tile, dtype=np.uint8).tobytes()
        tb.fill_dram(DRAM_TENSOR, kv)
        tag = [0]

        async def queue_tile(j):
            half = j % 2
            for kvi in range(2):
                src = DRAM_TENSOR + (2 * j + kvi) * tile
                await tb.submit(tag[0] & 0xFF, src, PP_BASE + half * PP_HALF + kvi * tile, TILE_ROWS, hd * 2,
                                hd * 2, hd * 2, pp_en=1, pp_half=half, pp_commit=kvi)
                tag[0] += 1

        n0 = len(tb.completions)
        await tb.after_refresh()
        t_start = now()
        await queue_tile(0)
        await queue_tile(1)
        stalls = []
        for j in range(n):
            half = j % 2
            t = now()
            await tb.wait_full(half)
            stalls.append(now() - t)
            # compute window; spot-check the first and last 512 bytes of K and V inside it
            t_c = now()
            lo = PP_BASE + half * PP_HALF
            for off in (0, tile - 512, tile, 2 * tile - 512):
                got = await tb.sram_read(lo + off, 512)
                exp = kv[2 * j * tile + off:2 * j * tile + off + 512]
                assert got == exp, f"tile {j} hd={hd} offset {off}"
            left = compute - (now() - t_c)
            assert left > 0, "the spot check took longer than the compute window"
            await ClockCycles(dut.clk, left)
            await tb.release(half)
            if j + 2 < n:
                await queue_tile(j + 2)
        await tb.wait_done(n0 + 2 * n)
        res[str(hd)] = dict(tiles=n, compute_cycles=compute, first_tile_wait=stalls[0],
                            steady_stalls=stalls[1:], max_steady_stall=max(stalls[1:]),
                            hidden=max(stalls[1:]) == 0, total_cycles=now() - t_start,
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
