"""cocotb tests of the generated MemorySystem Verilog (DMA + DRAM timing + TSV
links + SRAM), on the testbench ``flashnpu.sim.mem_testbench.MemTB``; run by
``tb/rtl/test_mem_rtl.py``."""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.triggers import ClockCycles, FallingEdge, RisingEdge

from flashnpu.hdl.dma import Direction, DMAError
from flashnpu.hdl.tsv import LinkStatus
from flashnpu.sim.dram_model import copy2d
from flashnpu.sim.mem_testbench import (
    CFG,
    DRAM_TENSOR,
    LINKS,
    NDATA,
    NSPARE,
    PP_BASE,
    PP_HALF,
    Q_BASE,
    REQ,
    SCRATCH,
    SRAM,
    STATIC,
    C,
    MemTB,
    W,
    env_seed,
    now,
)
from flashnpu.sim.packing import pack


def _tensor(rng, heads, seq, hd):
    """FP16 tensor [heads, seq, hd] with random finite values, as raw bytes per layout."""
    x = (rng.standard_normal((heads, seq, hd)) * 4).astype(np.float16)
    return x


def _layout_bytes(x, layout):
    if layout == "heads_seq_dim":
        return np.ascontiguousarray(x).tobytes()
    return np.ascontiguousarray(x.transpose(1, 0, 2)).tobytes()


def _row_addr(base, layout, heads, seq, hd, h, s):
    """Byte address of row (head h, position s) and the row stride, per layout."""
    if layout == "heads_seq_dim":
        return base + (h * seq + s) * hd * 2, hd * 2
    return base + (s * heads + h) * hd * 2, heads * hd * 2


def _check_dram_counters(tb):
    """Every column access was queued either to an open row (hit) or with an
    activate; nothing answered late."""
    k = tb.dram_counters()
    assert k["row_hits"] + k["activates"] == (k["rd_bytes"] + k["wr_bytes"]) // W, k
    assert k["row_conflicts"] <= k["activates"], k
    assert int(tb.dut.dram_late.value) == 0
    tb.dut._log.info(f"DRAM counters: {k}")


# ----------------------------------------------------------------------------
@cocotb.test()
async def qkv_tiles_ping_pong(dut):
    """Q/K/V tiles, head_dim 64 and 128, both source layouts, ping-pong K/V
    halves with prefetch, consumer traffic on both SRAM ports (bank conflicts),
    random idle/back-pressure everywhere, random DRAM-model delay."""
    seed = env_seed()
    tb = MemTB(dut, seed)
    await tb.start()
    await tb.sram_write(STATIC[0], bytes(tb.rng.getrandbits(8) for _ in range(STATIC[1] - STATIC[0])))
    tb.start_consumers()
    nprng = np.random.default_rng(seed)
    tag = 0
    heads, seq, br = 2, 128, 64
    for hd in (64, 128):
        for layout in ("heads_seq_dim", "seq_heads_dim"):
            qkv = [_tensor(nprng, heads, seq, hd) for _ in range(3)]
            bases = [DRAM_TENSOR + k * heads * seq * hd * 2 for k in range(3)]
            for k in range(3):
                tb.fill_dram(bases[k], _layout_bytes(qkv[k], layout))
            tile_bytes = br * hd * 2
            for h in range(heads):
                src, stride = _row_addr(bases[0], layout, heads, seq, hd, h, 0)
                await tb.submit(tag, src, Q_BASE, br, hd * 2, stride, hd * 2)
                tag += 1
                # kv tiles j = 0, 1: K then V into half j % 2; the V descriptor commits
                for j in range(seq // br):
                    half = j % 2
                    for kv in (1, 2):
                        src, stride = _row_addr(bases[kv], layout, heads, seq, hd, h, j * br)
                        dst = PP_BASE + half * PP_HALF + (kv - 1) * tile_bytes
                        await tb.submit(tag, src, dst, br, hd * 2, stride, hd * 2,
                                        pp_en=1, pp_half=half, pp_commit=int(kv == 2))
                        tag += 1
                # consume: Q tile, then each half once full, release it
                await tb.wait_done(tag - 4)
                await tb.check_sram(Q_BASE, Q_BASE + tile_bytes, f"Q h={h} hd={hd} {layout}")
                got_q = np.frombuffer(await tb.sram_read(Q_BASE, tile_bytes), np.float16).reshape(br, hd)
                assert np.array_equal(got_q.view(np.uint16), qkv[0][h, :br].view(np.uint16))
                for j in range(seq // br):
                    half = j % 2
                    await tb.wait_full(half)
                    lo = PP_BASE + half * PP_HALF
                    await tb.check_sram(lo, lo + 2 * tile_bytes, f"KV h={h} j={j} hd={hd} {layout}")
                    got_k = np.frombuffer(await tb.sram_read(lo, tile_bytes), np.float16).reshape(br, hd)
                    assert np.array_equal(got_k.view(np.uint16), qkv[1][h, j * br:(j + 1) * br].view(np.uint16))
                    await tb.release(half)
                await tb.wait_done(tag)
    assert all(c == DMAError.OK for _, c in tb.completions), tb.completions
    assert sorted(t for t, _ in tb.completions) == list(range(tag))
    assert int(dut.dram_late.value) == 0
    assert int(dut.pp_err.value) == 0
    moved = int(dut.dma_bytes_moved.value)
    assert moved == 2 * 2 * 5 * br * 2 * (64 + 128)          # 2 layouts x 2 heads x 5 tiles
    assert int(dut.sram_wr_bytes.value) == moved             # backdoor writes are not counted
    assert int(dut.dram_rd_bytes.value) == moved
    assert tb.cons_checked > 100, tb.cons_checked
    assert int(dut.sram_conflict_cycles.value) > 0
    dut._log.info(f"consumer reads checked: {tb.cons_checked}, SRAM conflict cycles: "
                  f"{int(dut.sram_conflict_cycles.value)}")
    _check_dram_counters(tb)
    tb.stop()


@cocotb.test()
async def o_write_back(dut):
    """O tiles SRAM -> DRAM into [seq, heads, head_dim], rows of 6 bytes too;
    neighbouring DRAM bytes stay untouched."""
    seed = env_seed() + 1
    tb = MemTB(dut, seed)
    await tb.start()
    heads, seq, hd, br = 3, 64, 128, 64
    background = bytes(tb.rng.getrandbits(8) for _ in range(heads * seq * hd * 2 + 4096))
    tb.fill_dram(DRAM_TENSOR, background)
    o_tile = bytes(tb.rng.getrandbits(8) for _ in range(br * hd * 2))
    await tb.sram_write(SCRATCH, o_tile)
    for h in range(heads):
        dst, stride = _row_addr(DRAM_TENSOR, "seq_heads_dim", heads, seq, hd, h, 0)
        await tb.submit(h, SCRATCH, dst, br, hd * 2, hd * 2, stride, Direction.SRAM_TO_DRAM)
    await tb.submit(7, SCRATCH, DRAM_TENSOR + heads * seq * hd * 2, 5, 6, 64, 32, Direction.SRAM_TO_DRAM)
    await tb.wait_done(heads + 1)
    await ClockCycles(dut.clk, 10)
    assert all(c == DMAError.OK for _, c in tb.completions), tb.completions
    tb.check_dram(DRAM_TENSOR, DRAM_TENSOR + len(background), "O write-back")
    assert int(dut.dram_wr_bytes.value) == (heads * br * hd * 2 // W + 5) * W
    _check_dram_counters(tb)
    tb.stop()


REJECTS = [
    ("src misaligned", dict(src=DRAM_TENSOR + 2, dst=SCRATCH, rows=4, bpr=64, ss=64, ds=64), DMAError.MISALIGNED),
    ("dst misaligned", dict(src=DRAM_TENSOR, dst=SCRATCH + 16, rows=4, bpr=64, ss=64, ds=64), DMAError.MISALIGNED),
    ("src stride misaligned", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=64, ss=66, ds=64),
     DMAError.MISALIGNED),
    ("dst stride misaligned", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=64, ss=64, ds=80),
     DMAError.MISALIGNED),
    ("odd bytes", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=63, ss=64, ds=64), DMAError.MISALIGNED),
    ("gather not naturally aligned", dict(src=DRAM_TENSOR + 2, dst=SCRATCH, rows=4, bpr=4, ss=4, ds=4),
     DMAError.MISALIGNED),
    ("gather row not a power of two", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=6, ss=6, ds=6),
     DMAError.MISALIGNED),
    ("src below region", dict(src=DRAM_TENSOR - 64, dst=SCRATCH, rows=4, bpr=64, ss=64, ds=64),
     DMAError.SRC_RANGE),
    ("src past end", dict(src=CFG.dram_bytes - 128, dst=SCRATCH, rows=4, bpr=64, ss=64, ds=64),
     DMAError.SRC_RANGE),
    ("src stride wraps", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=2, bpr=64, ss=0xFFFFFFE0, ds=64),
     DMAError.SRC_RANGE),
    ("dst past end", dict(src=DRAM_TENSOR, dst=SRAM - 128, rows=4, bpr=64, ss=64, ds=64), DMAError.DST_RANGE),
    ("dst overlap", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=64, ss=64, ds=32), DMAError.DST_OVERLAP),
    ("pp outside half", dict(src=DRAM_TENSOR, dst=PP_BASE + PP_HALF - 64, rows=2, bpr=64, ss=64, ds=64,
                             pp_en=1, pp_half=0), DMAError.PP_RANGE),
    ("pp wrong half", dict(src=DRAM_TENSOR, dst=PP_BASE, rows=2, bpr=64, ss=64, ds=64, pp_en=1, pp_half=1),
     DMAError.PP_RANGE),
    ("pp write-back", dict(src=PP_BASE, dst=DRAM_TENSOR, rows=1, bpr=64, ss=64, ds=64, pp_en=1,
                           dir=Direction.SRAM_TO_DRAM), DMAError.PP_RANGE),
    ("into pp window", dict(src=DRAM_TENSOR, dst=PP_BASE + 0x100, rows=1, bpr=64, ss=64, ds=64),
     DMAError.PP_WINDOW),
    ("wb src past end", dict(src=SRAM - 32, dst=DRAM_TENSOR, rows=1, bpr=64, ss=64, ds=64,
                             dir=Direction.SRAM_TO_DRAM), DMAError.SRC_RANGE),
    ("wb dst below region", dict(src=SCRATCH, dst=0x100, rows=1, bpr=64, ss=64, ds=64,
                                 dir=Direction.SRAM_TO_DRAM), DMAError.DST_RANGE),
]


@cocotb.test()
async def rejected_descriptors_write_nothing(dut):
    """Every rejection code; SRAM, DRAM and every write counter unchanged."""
    seed = env_seed() + 2
    tb = MemTB(dut, seed)
    await tb.start()
    tb.fill_dram(0, bytes(tb.rng.getrandbits(8) for _ in range(DRAM_TENSOR + 0x2000)))
    area = [(SCRATCH, SCRATCH + 0x1000), (PP_BASE, PP_BASE + 2 * PP_HALF), (SRAM - 0x1000, SRAM)]
    for lo, hi in area:
        await tb.sram_write(lo, bytes(tb.rng.getrandbits(8) for _ in range(hi - lo)))
    wr0, dwr0 = int(dut.sram_wr_bytes.value), int(dut.dram_wr_bytes.value)
    writes0 = tb.model.writes
    for tag, (_name, f, _code) in enumerate(REJECTS):
        await tb.submit(tag, f["src"], f["dst"], f["rows"], f["bpr"], f["ss"], f["ds"],
                        f.get("dir", Direction.DRAM_TO_SRAM), f.get("pp_en", 0), f.get("pp_half", 0), 0,
                        expect_ok=False)
    await tb.wait_done(len(REJECTS))
    await ClockCycles(dut.clk, 20)
    got = dict(tb.completions)
    for tag, (name, _f, code) in enumerate(REJECTS):
        assert got[tag] == code, f"{name}: expected {code.name}, got {got[tag].name}"
    assert int(dut.dma_n_rejected.value) == len(REJECTS)
    assert int(dut.dma_bytes_moved.value) == 0
    assert int(dut.sram_wr_bytes.value) == wr0
    assert int(dut.dram_wr_bytes.value) == dwr0 and tb.model.writes == writes0
    for lo, hi in area:
        await tb.check_sram(lo, hi, "after rejections")
    tb.check_dram(0, DRAM_TENSOR + 0x2000)
    tb.stop()


@cocotb.test()
async def degenerate_descriptors(dut):
    """Case M2 on the 8-channel path: a 0-row descriptor completes at once
    (OK, 0 bytes, canary intact), the next runs normally; gathers of FP16
    elements at element strides 2 and 17 (every element offset of a word,
    words in every channel) both ways, byte-exact against ``copy2d``."""
    seed = env_seed() + 5
    tb = MemTB(dut, seed, desc_idle=0.0, done_bp=0.0)     # "at once" is timed: no idle, no back-pressure
    await tb.start()
    elems = (np.arange(0x3000 // 2) % 2048).astype(np.float16)
    tb.fill_dram(DRAM_TENSOR, elems.tobytes())
    canary = bytes([0x5A]) * 0x1000
    await tb.sram_write(SCRATCH, canary)
    t0 = now()
    await tb.submit(0, DRAM_TENSOR, SCRATCH, 0, 64, 64, 64)
    await tb.wait_done(1)
    assert tb.completions == [(0, DMAError.OK)] and now() - t0 <= 4, (tb.completions, now() - t0)
    assert int(dut.dma_bytes_moved.value) == 0
    await tb.check_sram(SCRATCH, SCRATCH + 0x1000, "canary after a 0-row descriptor")
    await tb.submit(1, DRAM_TENSOR, SCRATCH, 4, 64, 64, 64)         # the next one runs normally
    await tb.submit(2, DRAM_TENSOR, SCRATCH + 0x400, 8, 2, 4, 2)     # elements 0, 2, ..., 14
    await tb.submit(3, DRAM_TENSOR + 6, SCRATCH + 0x800, 64, 2, 34, 2)   # 3, 20, ... (stride 17)
    await tb.wait_done(4)
    got = np.frombuffer(await tb.sram_read(SCRATCH + 0x400, 32), np.float16)[:8]
    assert got.tolist() == list(range(0, 16, 2)), got
    await tb.submit(4, SCRATCH + 0x800, DRAM_TENSOR + 0x2000 + 2, 64, 2, 2, 18, Direction.SRAM_TO_DRAM)
    await tb.wait_done(5)
    await ClockCycles(dut.clk, 20)
    assert all(c == DMAError.OK for _, c in tb.completions), tb.completions
    await tb.check_sram(SCRATCH, SCRATCH + 0x1000, "after the gathers")
    tb.check_dram(DRAM_TENSOR, DRAM_TENSOR + 0x3000, "after the scatter")
    assert int(dut.dma_bytes_moved.value) == 4 * 64 + 2 * (8 + 64 + 64)
    tb.stop()


def _mask(lanes):
    return sum(1 << x for x in lanes)


async def _fault_program(tb, data_seed):
    """One DRAM -> SRAM and one SRAM -> DRAM transfer of 64 rows of 256 B (a
    word per channel per row), started at the same refresh phase
    (``MemTB.after_refresh``); the first rows are all-ones and all-zeros, so
    every lane of every bundle carries both values.  Checks the data; returns
    the cycles of each transfer (submit to completion) and the DMA's active
    cycles."""
    r = random.Random(data_seed)
    n = 64 * 256

    def data():
        return bytes([0xFF]) * 1024 + bytes(1024) + bytes(r.getrandbits(8) for _ in range(n - 2048))

    tb.fill_dram(DRAM_TENSOR, data())
    await tb.sram_write(SCRATCH + n, data())
    out = {}
    tag = len(tb.completions)
    await tb.after_refresh()
    for what, args in (("load", (DRAM_TENSOR, SCRATCH, 64, 256, 256, 256)),
                       ("write-back", (SCRATCH + n, DRAM_TENSOR + 0x10000, 64, 256, 256, 256,
                                       Direction.SRAM_TO_DRAM))):
        a0, t0 = int(tb.dut.dma_active_cycles.value), now()
        await tb.submit(tag, *args)
        tag += 1
        await tb.wait_done(tag)
        out[what] = (now() - t0, int(tb.dut.dma_active_cycles.value) - a0)
    assert [c for _, c in tb.completions[-2:]] == [DMAError.OK, DMAError.OK], tb.completions
    await ClockCycles(tb.dut.clk, 10)
    await tb.check_sram(SCRATCH, SCRATCH + n, "through the rd bundles")
    tb.check_dram(DRAM_TENSOR + 0x10000, DRAM_TENSOR + 0x10000 + n, "through the wr bundles")
    return out


@cocotb.test()
async def tsv_faults_repaired(dut):
    """Faults up to the spares in every bundle of every channel at once (mixed
    stuck-at-0/1; in one channel per direction a failed spare and one failed
    data lane fewer): one self-test per direction repairs them all, the data
    stays bit-exact both ways, and the DMA takes exactly as many cycles as
    before the faults (same transfers at the same refresh phase)."""
    seed = env_seed() + 3
    tb = MemTB(dut, seed, desc_idle=0, done_bp=0, model_delay=0, consumers=False, bd_rand=0)
    r = random.Random(seed)
    await tb.start(train=False)
    for link in LINKS:
        assert await tb.bist(link) == [LinkStatus.OK] * C
    w0 = (int(dut.tsv_rd_words.value), int(dut.tsv_wr_words.value))
    clean = await _fault_program(tb, seed)
    faults = {}
    for link in LINKS:
        spare_channel = r.randrange(C) if NSPARE else -1
        for c in range(C):
            bad_spare = int(c == spare_channel)
            lanes = r.sample(range(NDATA), NSPARE - bad_spare) + r.sample(range(NDATA, NDATA + NSPARE), bad_spare)
            r.shuffle(lanes)
            faults[(link, c)] = (_mask(lanes[::2]), _mask(lanes[1::2]))
            tb.set_faults(link, c, *faults[(link, c)])
    for link in LINKS:
        st = await tb.bist(link)
        assert st == [LinkStatus.OK] * C, f"{link}: {st}"
        for c in range(C):
            failed = int(tb.tsv(link, c, "failed_lanes").value)
            s0, s1 = faults[(link, c)]
            assert failed == s0 | s1, f"{link} channel {c}: failed {failed:#x}, injected {s0 | s1:#x}"
    faulty = await _fault_program(tb, seed + 1)
    dut._log.info(f"cycles (submit to completion, DMA active) without faults {clean}, "
                  f"with {NSPARE} faults per bundle {faulty}")
    assert faulty == clean, (clean, faulty)
    words = 2 * 64 * 256 // W
    assert (int(dut.tsv_rd_words.value) - w0[0], int(dut.tsv_wr_words.value) - w0[1]) == (words, words)
    assert int(dut.dram_late.value) == 0
    tb.stop()


@cocotb.test()
async def tsv_faults_unrepairable(dut):
    """One more stuck data lane than spares in a single channel's read bundle,
    then in another channel's write bundle, then a host map that leaves a
    failed lane of that write bundle uncovered: only that bundle is down, every
    descriptor completes with LINK_DOWN and nothing is read or written; once
    the host restores the map, an intact write-back."""
    seed = env_seed() + 4
    tb = MemTB(dut, seed)
    r = random.Random(seed)
    await tb.start()
    tb.fill_dram(DRAM_TENSOR, bytes(r.getrandbits(8) for _ in range(4096)))
    await tb.sram_write(SCRATCH, bytes(r.getrandbits(8) for _ in range(4096)) + bytes(4096))
    before = tb.dram_counters()
    sram_wr0 = int(dut.sram_wr_bytes.value)
    tag = 0

    async def refused(*descs):
        """Every descriptor completes with LINK_DOWN; nothing moved anywhere."""
        nonlocal tag
        writes0 = tb.model.writes
        for d in descs:
            await tb.submit(tag, *d, expect_ok=False)
            tag += 1
        await tb.wait_done(tag)
        assert tb.completions[-len(descs):] == [(t, DMAError.LINK_DOWN) for t in range(tag - len(descs), tag)], \
            tb.completions
        await ClockCycles(dut.clk, 20)
        assert tb.model.writes == writes0
        now_ = tb.dram_counters()
        for k in ("rd_bytes", "wr_bytes", "activates", "row_hits", "dma_bytes_moved", "dma_beats"):
            assert now_[k] == before[k], (k, before[k], now_[k])
        assert int(dut.sram_wr_bytes.value) == sram_wr0
        await tb.check_sram(SCRATCH, SCRATCH + 8192, "nothing delivered")
        tb.check_dram(DRAM_TENSOR, DRAM_TENSOR + 0x20000, "nothing written")

    load = (DRAM_TENSOR, SCRATCH + 4096, 16, 256, 256, 256)
    wb = (SCRATCH, DRAM_TENSOR + 0x10000, 16, 256, 256, 256, Direction.SRAM_TO_DRAM)
    for link in LINKS:
        k = r.randrange(C)
        bad = r.sample(range(NDATA), NSPARE + 1)
        tb.set_faults(link, k, *((_mask(bad), 0) if link == "rd" else (0, _mask(bad))))
        st = await tb.bist(link)
        assert st[k] == LinkStatus.TOO_MANY and all(s == LinkStatus.OK for c, s in enumerate(st) if c != k), st
        await refused(load, wb)
        tb.set_faults(link, k)
        assert await tb.bist(link) == [LinkStatus.OK] * C
    # one stuck lane on channel k's write bundle: repaired, then the host clears the entry
    k = r.randrange(C)
    lane = r.randrange(NDATA)
    tb.set_faults("wr", k, 0, 1 << lane)
    assert await tb.bist("wr") == [LinkStatus.OK] * C
    await tb.repair("wr", k, 0, 0, 0)
    await FallingEdge(dut.clk)
    assert [tb.status("wr", c) for c in range(C)] == [LinkStatus.UNCOVERED if c == k else LinkStatus.OK
                                                      for c in range(C)]
    await refused(wb)
    # the host restores the entry: an intact write-back through the repaired lane
    await tb.repair("wr", k, 0, 1, lane)
    await FallingEdge(dut.clk)
    assert tb.status("wr", k) == LinkStatus.OK
    await tb.submit(tag, *wb)
    await tb.wait_done(tag + 1)
    await ClockCycles(dut.clk, 10)
    assert tb.completions[-1] == (tag, DMAError.OK)
    tb.check_dram(DRAM_TENSOR, DRAM_TENSOR + 0x20000, "write-back after the repair")
    tb.stop()


@cocotb.test()
async def bank_conflict_patterns(dut):
    """Consumer ports 0 and 1 stream reads: same bank -> they share it (about
    2n cycles, conflicts counted); different banks -> n cycles; data exact."""
    seed = env_seed() + 5
    tb = MemTB(dut, seed)
    await tb.start()
    banks = CFG.sram_banks
    await tb.sram_write(STATIC[0], bytes(tb.rng.getrandbits(8) for _ in range(STATIC[1] - STATIC[0])))
    n = 64
    base = STATIC[0] // W
    results = {}
    for same in (True, False):
        addrs = [[base + banks * i for i in range(n)],
                 [base + banks * (i + n) + (0 if same else 1) for i in range(n)]]
        c0 = int(dut.sram_conflict_cycles.value)
        for i in range(2):
            getattr(dut, f"sram_ports__{i}__rdata__ready").value = 1
        idx = [0, 0]
        got = [[], []]
        cycles = 0
        await RisingEdge(dut.clk)
        while idx[0] < n or idx[1] < n or len(got[0]) < n or len(got[1]) < n:
            for i in range(2):
                v = getattr(dut, f"sram_ports__{i}__req__valid")
                if idx[i] < n:
                    getattr(dut, f"sram_ports__{i}__req__payload").value = pack(REQ, dict(addr=addrs[i][idx[i]]))
                    v.value = 1
                else:
                    v.value = 0
            await FallingEdge(dut.clk)
            if idx[0] < n or idx[1] < n:
                cycles += 1                     # cycles until every request is accepted
            for i in range(2):
                if idx[i] < n and int(getattr(dut, f"sram_ports__{i}__req__ready").value):
                    idx[i] += 1
                if int(getattr(dut, f"sram_ports__{i}__rdata__valid").value):
                    got[i].append(int(getattr(dut, f"sram_ports__{i}__rdata__payload").value))
            await RisingEdge(dut.clk)
        for i in range(2):
            getattr(dut, f"sram_ports__{i}__req__valid").value = 0
            exp = [int.from_bytes(tb.sram.read(a * W, W), "little") for a in addrs[i]]
            assert got[i] == exp, f"port {i} same={same} seed={seed}"
        results[same] = (cycles, int(dut.sram_conflict_cycles.value) - c0)
    dut._log.info(f"same bank: {results[True]}, different banks: {results[False]}")
    assert results[True][0] >= 2 * n - 1 and results[True][1] >= n
    assert results[False][0] <= n + 1 and results[False][1] == 0
    tb.stop()


@cocotb.test()
async def queue_overflow_refused(dut):
    """A descriptor waits for a full ping-pong half; three more fill the queue
    (depth 4); the next is refused with QUEUE_FULL and writes nothing; after
    the release everything queued completes in order with exact data."""
    seed = env_seed() + 6
    tb = MemTB(dut, seed, done_bp=0.5)
    await tb.start()
    tb.fill_dram(DRAM_TENSOR, bytes(tb.rng.getrandbits(8) for _ in range(0x4000)))
    await tb.sram_write(SCRATCH, bytes(tb.rng.getrandbits(8) for _ in range(0x2000)))
    await tb.submit(0, DRAM_TENSOR, PP_BASE, 4, 256, 256, 256, pp_en=1, pp_half=0, pp_commit=1)
    await tb.wait_full(0)
    await tb.submit(1, DRAM_TENSOR + 0x1000, PP_BASE, 4, 256, 256, 256, pp_en=1, pp_half=0, pp_commit=1,
                    expect_ok=False)                       # applied to the scoreboard after the release
    for t in (2, 3, 4):
        await tb.submit(t, DRAM_TENSOR + 0x400 * t, SCRATCH + 0x400 * t, 4, 256, 256, 256, expect_ok=False)
    await tb.submit(5, DRAM_TENSOR, SCRATCH + 0x1400, 4, 256, 256, 256, expect_ok=False)
    await tb.wait_done(2)
    await ClockCycles(dut.clk, 200)
    assert tb.completions == [(0, DMAError.OK), (5, DMAError.QUEUE_FULL)], tb.completions
    await tb.check_sram(PP_BASE, PP_BASE + 0x400, "half 0 before release")
    await tb.check_sram(SCRATCH, SCRATCH + 0x2000, "queued descriptors before release")
    await tb.release(0)
    copy2d(tb.dram, tb.sram, DRAM_TENSOR + 0x1000, PP_BASE, 4, 256, 256, 256)
    for t in (2, 3, 4):
        copy2d(tb.dram, tb.sram, DRAM_TENSOR + 0x400 * t, SCRATCH + 0x400 * t, 4, 256, 256, 256)
    await tb.wait_done(6)
    assert [t for t, _ in tb.completions[2:]] == [1, 2, 3, 4]
    assert all(c == DMAError.OK for _, c in tb.completions[2:])
    await tb.check_sram(PP_BASE, PP_BASE + 0x400, "half 0 after release")
    await tb.check_sram(SCRATCH, SCRATCH + 0x2000, "after release")
    assert int(dut.pp_full.value) == 0b01 and int(dut.pp_err.value) == 0
    tb.stop()
