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
    NDATA,
    NSPARE,
    PP_BASE,
    PP_HALF,
    Q_BASE,
    REQ,
    SCRATCH,
    SRAM,
    STATIC,
    MemTB,
    W,
    env_seed,
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
    tb.stop()


REJECTS = [
    ("zero rows", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=0, bpr=64, ss=64, ds=64), DMAError.ZERO_ROWS),
    ("zero bytes", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=0, ss=64, ds=64), DMAError.ZERO_BYTES),
    ("src misaligned", dict(src=DRAM_TENSOR + 2, dst=SCRATCH, rows=4, bpr=64, ss=64, ds=64), DMAError.MISALIGNED),
    ("dst misaligned", dict(src=DRAM_TENSOR, dst=SCRATCH + 16, rows=4, bpr=64, ss=64, ds=64), DMAError.MISALIGNED),
    ("src stride misaligned", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=64, ss=66, ds=64),
     DMAError.MISALIGNED),
    ("dst stride misaligned", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=64, ss=64, ds=80),
     DMAError.MISALIGNED),
    ("odd bytes", dict(src=DRAM_TENSOR, dst=SCRATCH, rows=4, bpr=63, ss=64, ds=64), DMAError.MISALIGNED),
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


def _lanes(rng, n, exclude=()):
    lanes = rng.sample([x for x in range(NDATA + NSPARE) if x not in exclude], n)
    return lanes


@cocotb.test()
async def tsv_faults_repaired(dut):
    """As many stuck lanes as spares on each link (mixed stuck-at-0/1, some on
    spares when possible): BIST repairs, both directions deliver intact data."""
    seed = env_seed() + 3
    tb = MemTB(dut, seed)
    r = random.Random(seed)
    masks = {}
    for link in ("rd", "wr"):
        data_lanes = r.sample(range(NDATA), NSPARE)
        s0 = sum(1 << x for x in data_lanes[::2])
        s1 = sum(1 << x for x in data_lanes[1::2])
        masks[link] = (s0, s1, sorted(data_lanes))
    await tb.start(rd_stuck0=masks["rd"][0], rd_stuck1=masks["rd"][1],
                   wr_stuck0=masks["wr"][0], wr_stuck1=masks["wr"][1])
    for link in ("rd", "wr"):
        assert int(getattr(dut, f"tsv_{link}__status").value) == LinkStatus.OK
        failed = int(getattr(dut, f"tsv_{link}__failed_lanes").value)
        assert failed == masks[link][0] | masks[link][1], f"{link}: {failed:#x}"
    data = bytes(r.getrandbits(8) for _ in range(64 * 256))
    # all-ones and all-zeros rows exercise both stuck polarities on every lane
    data = bytes([0xFF]) * 1024 + bytes(1024) + data[2048:]
    tb.fill_dram(DRAM_TENSOR, data)
    await tb.submit(1, DRAM_TENSOR, SCRATCH, 64, 256, 256, 256)
    await tb.wait_done(1)
    await tb.check_sram(SCRATCH, SCRATCH + 64 * 256, "through repaired rd link")
    await tb.submit(2, SCRATCH, DRAM_TENSOR + 0x10000, 64, 256, 256, 256, Direction.SRAM_TO_DRAM)
    await tb.wait_done(2)
    await ClockCycles(dut.clk, 10)
    tb.check_dram(DRAM_TENSOR + 0x10000, DRAM_TENSOR + 0x10000 + 64 * 256, "through repaired wr link")
    assert [c for _, c in tb.completions] == [DMAError.OK, DMAError.OK]
    assert int(dut.tsv_rd_words.value) == 64 * 256 // W
    assert int(dut.tsv_wr_words.value) == 64 * 256 // W
    tb.stop()


@cocotb.test()
async def tsv_faults_unrepairable(dut):
    """One more stuck lane than spares on the read link, then a host map that
    leaves a failed lane uncovered on the write link: LINK_DOWN, nothing written."""
    seed = env_seed() + 4
    tb = MemTB(dut, seed)
    r = random.Random(seed)
    bad = r.sample(range(NDATA), NSPARE + 1)
    await tb.start(rd_stuck0=sum(1 << x for x in bad))
    assert int(dut.tsv_rd__status.value) == LinkStatus.TOO_MANY
    tb.fill_dram(DRAM_TENSOR, bytes([0xFF]) * 4096)
    await tb.sram_write(SCRATCH, bytes(4096))
    await tb.submit(1, DRAM_TENSOR, SCRATCH, 16, 256, 256, 256, expect_ok=False)
    await tb.wait_done(1)
    assert tb.completions == [(1, DMAError.LINK_DOWN)]
    await tb.check_sram(SCRATCH, SCRATCH + 4096, "nothing delivered")
    # read link healthy again; write link: one stuck lane, host clears its repair
    dut.tsv_rd__fault_stuck0.value = 0
    assert await tb.bist("tsv_rd") == LinkStatus.OK
    lane = r.randrange(NDATA)
    dut.tsv_wr__fault_stuck1.value = 1 << lane
    assert await tb.bist("tsv_wr") == LinkStatus.OK
    await RisingEdge(dut.clk)
    dut.tsv_wr__repair_we.value = 1
    dut.tsv_wr__repair_idx.value = 0
    dut.tsv_wr__repair_valid.value = 0
    dut.tsv_wr__repair_lane.value = 0
    await RisingEdge(dut.clk)
    dut.tsv_wr__repair_we.value = 0
    await FallingEdge(dut.clk)
    assert int(dut.tsv_wr__status.value) == LinkStatus.UNCOVERED
    writes0 = tb.model.writes
    await tb.submit(2, SCRATCH, DRAM_TENSOR, 16, 256, 256, 256, Direction.SRAM_TO_DRAM, expect_ok=False)
    await tb.wait_done(2)
    assert tb.completions[1] == (2, DMAError.LINK_DOWN)
    await ClockCycles(dut.clk, 10)
    assert tb.model.writes == writes0
    tb.check_dram(DRAM_TENSOR, DRAM_TENSOR + 4096)
    # host restores the entry: intact write-back
    await RisingEdge(dut.clk)
    dut.tsv_wr__repair_we.value = 1
    dut.tsv_wr__repair_valid.value = 1
    dut.tsv_wr__repair_lane.value = lane
    await RisingEdge(dut.clk)
    dut.tsv_wr__repair_we.value = 0
    await tb.submit(3, SCRATCH, DRAM_TENSOR, 16, 256, 256, 256, Direction.SRAM_TO_DRAM)
    await tb.wait_done(3)
    await ClockCycles(dut.clk, 10)
    assert tb.completions[2] == (3, DMAError.OK)
    tb.check_dram(DRAM_TENSOR, DRAM_TENSOR + 4096)
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
