"""DMA unit tests (amaranth.sim) on the composed MemorySystem with tiny bus words:
2-D transfers both ways through every channel's TSV bundles, every rejection
code, the queue, the ping-pong handshake, link faults in every channel at once,
random 2-D descriptors.  Every byte is compared with ``copy2d``."""

import random

import numpy as np
import pytest
from amaranth.sim import Simulator

from flashnpu.hdl.dma import DMA, Direction, DMAError, MemorySystem
from flashnpu.hdl.tsv import LinkStatus
from flashnpu.sim.dram_model import ByteStore, DRAMModel, copy2d
from flashnpu.tb.helpers import raises_quietly, stream_get, stream_put, tiny_mem_config

CFG = tiny_mem_config()
W = CFG.sram_bank_bytes
SRAM = CFG.sram_bytes
NL = CFG.tsv_data_lanes + CFG.tsv_spare_lanes
C = CFG.dram_channels


class Bench:
    """amaranth.sim testbench around MemorySystem: DRAM model, SRAM shadow, completions."""

    def __init__(self, seed=0, pp=(1024, 256), done_bp=0.0, desc_idle=0.0, model_delay=2,
                 rd_faults=(), fault_channels=range(C), queue_depth=4):
        self.dut = MemorySystem(CFG, n_consumers=1, queue_depth=queue_depth, walking_bist=False)
        self.model = DRAMModel(CFG, seed=seed, max_extra_delay=model_delay)
        self.rng = random.Random(seed)
        self.pp = pp
        self.done_bp = done_bp
        self.desc_idle = desc_idle
        self.rd_faults = rd_faults
        self.fault_channels = tuple(fault_channels)
        self.done = []
        self.sram = ByteStore(SRAM)          # expected SRAM contents
        self.dram = ByteStore(CFG.dram_bytes)
        print(f"seed={seed}")

    # ------------------------------------------------------------ helpers
    async def setup(self, ctx):
        d = self.dut
        ctx.set(d.dram_lo, 0)
        ctx.set(d.dram_hi, CFG.dram_bytes)
        ctx.set(d.sram_lo, 0)
        ctx.set(d.sram_hi, SRAM)
        ctx.set(d.pp_base, self.pp[0])
        ctx.set(d.pp_half_bytes, self.pp[1])
        stuck = 0
        for lane in self.rd_faults:
            stuck |= 1 << lane
        links = [*d.tsv_rd, *d.tsv_wr]
        for c in self.fault_channels:
            ctx.set(d.tsv_rd[c].fault_stuck0, stuck)
        for link in links:
            ctx.set(link.bist_start, 1)
        await ctx.tick()
        for link in links:
            ctx.set(link.bist_start, 0)
        for _ in range(200):
            await ctx.tick()
            if all(ctx.get(link.status) != LinkStatus.BIST for link in links):
                break

    async def fill_sram(self, ctx, addr, data):
        """Backdoor write (W-aligned, whole words)."""
        for i in range(0, len(data), W):
            word = int.from_bytes(data[i:i + W], "little")
            await stream_put(ctx, self.dut.bd.req,
                             {"addr": (addr + i) // W, "write": 1, "wdata": word, "wmask": (1 << W) - 1})
        self.sram.write(addr, data)

    async def read_sram(self, ctx, addr, n):
        """Backdoor read of n bytes (W-aligned)."""
        out = bytearray()
        for i in range(0, n, W):
            await stream_put(ctx, self.dut.bd.req, {"addr": (addr + i) // W, "write": 0, "wdata": 0, "wmask": 0})
            v = await stream_get(ctx, self.dut.bd.rdata)
            out += int(v).to_bytes(W, "little")
        return bytes(out)

    def fill_dram(self, addr, data):
        self.model.write(addr, data)
        self.dram.write(addr, data)

    async def submit(self, ctx, tag, src, dst, rows, bpr, src_stride, dst_stride,
                     direction=Direction.DRAM_TO_SRAM, pp_en=0, pp_half=0, pp_commit=0, expect_ok=True):
        await stream_put(ctx, self.dut.desc, {
            "src": src, "dst": dst, "rows": rows, "bytes_per_row": bpr, "src_stride": src_stride,
            "dst_stride": dst_stride, "direction": direction, "pp_en": pp_en, "pp_half": pp_half,
            "pp_commit": pp_commit, "tag": tag}, self.rng, self.desc_idle)
        if expect_ok:
            if direction == Direction.DRAM_TO_SRAM:
                copy2d(self.dram, self.sram, src, dst, rows, bpr, src_stride, dst_stride)
            else:
                copy2d(self.sram, self.dram, src, dst, rows, bpr, src_stride, dst_stride)

    def done_process(self):
        async def proc(ctx):
            r = random.Random(self.rng.random())
            while True:
                v = await stream_get(ctx, self.dut.done, r, self.done_bp)
                self.done.append((int(v.tag), DMAError(int(v.code))))
        return proc

    async def wait_done(self, ctx, n, limit=20000):
        for _ in range(limit):
            if len(self.done) >= n:
                return
            await ctx.tick()
        raise AssertionError(f"{len(self.done)} of {n} completions after {limit} cycles: {self.done}")

    async def check_sram(self, ctx, lo=0, hi=SRAM):
        got = await self.read_sram(ctx, lo, hi - lo)
        exp = self.sram.read(lo, hi - lo)
        if got != exp:
            bad = [i for i in range(len(exp)) if got[i] != exp[i]]
            raise AssertionError(f"SRAM mismatch at {len(bad)} bytes, first {lo + bad[0]:#x}: "
                                 f"expected {exp[bad[0]]:#04x} got {got[bad[0]]:#04x}")

    def check_dram(self, lo, hi):
        assert self.model.read(lo, hi - lo) == self.dram.read(lo, hi - lo)

    def run(self, main):
        sim = Simulator(self.dut)
        sim.add_clock(1e-6)
        sim.add_testbench(main)
        for c in range(C):
            sim.add_process(self.model.amaranth_server(self.dut.bk[c]))
        sim.add_process(self.done_process())
        sim.run()


def _rand(rng, n):
    return bytes(rng.getrandbits(8) for _ in range(n))


# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["heads_seq_dim", "seq_heads_dim"])
def test_tile_loads_both_layouts(layout):
    """K tiles of each head (head_dim 8 FP16 = 16 B rows), 6 rows, from either
    source layout into packed SRAM tiles; with random idle and back-pressure."""
    b = Bench(seed=3, done_bp=0.5, desc_idle=0.5)
    heads, seq, hd = 2, 12, 8
    rowb = hd * 2
    base = 0x400
    tensor = _rand(b.rng, heads * seq * rowb)
    b.fill_dram(base, tensor)

    async def main(ctx):
        await b.setup(ctx)
        await b.fill_sram(ctx, 0, _rand(b.rng, 1024))       # known garbage around the tiles
        n = 0
        for h in range(heads):
            for t0 in (0, 6):
                if layout == "heads_seq_dim":
                    src, stride = base + (h * seq + t0) * rowb, rowb
                else:
                    src, stride = base + (t0 * heads + h) * rowb, heads * rowb
                dst = (h * 2 + t0 // 6) * 6 * rowb
                await b.submit(ctx, n, src, dst, 6, rowb, stride, rowb)
                n += 1
        await b.wait_done(ctx, n)
        assert sorted(b.done) == [(i, DMAError.OK) for i in range(n)]
        await b.check_sram(ctx, 0, 1024)
        assert ctx.get(b.dut.dma_bytes_moved) == n * 6 * rowb
        assert ctx.get(b.dut.dram_late) == 0

    b.run(main)


def test_partial_words_strides_and_writeback():
    """Rows of 6 bytes (a masked tail word), a destination stride with gaps that
    must stay untouched, then write-back SRAM -> DRAM with a DRAM stride."""
    b = Bench(seed=4, model_delay=4)
    b.fill_dram(0x2000, _rand(b.rng, 4096))

    async def main(ctx):
        await b.setup(ctx)
        await b.fill_sram(ctx, 0, _rand(b.rng, 1024))
        await b.submit(ctx, 1, 0x2000, 0x40, 5, 6, 40, 12)           # gaps of 6 bytes per row
        await b.submit(ctx, 2, 0x2100, 0x100, 3, 30, 32, 32)         # 30-byte rows
        await b.wait_done(ctx, 2)
        await b.check_sram(ctx, 0, 1024)
        await b.submit(ctx, 3, 0x40, 0x3000, 5, 6, 12, 64, Direction.SRAM_TO_DRAM)
        await b.submit(ctx, 4, 0x100, 0x3400, 3, 32, 32, 36, Direction.SRAM_TO_DRAM)
        await b.wait_done(ctx, 4)
        for _ in range(10):
            await ctx.tick()                      # posted writes reach the model
        b.check_dram(0x2F00, 0x3600)
        assert [c for _, c in b.done] == [DMAError.OK] * 4
        assert ctx.get(b.dut.dram_wr_bytes) == (5 * 2 + 3 * 8) * W
        assert ctx.get(b.dut.tsv_wr_words) == 5 * 2 + 3 * 8

    b.run(main)


REJECTS = [
    # (name, descriptor fields, expected code)
    ("src misaligned", dict(src=0x2002, dst=0, rows=2, bpr=16, src_stride=16, dst_stride=16), DMAError.MISALIGNED),
    ("dst misaligned", dict(src=0x2000, dst=2, rows=2, bpr=16, src_stride=16, dst_stride=16), DMAError.MISALIGNED),
    ("stride misaligned", dict(src=0x2000, dst=0, rows=2, bpr=16, src_stride=18, dst_stride=16), DMAError.MISALIGNED),
    ("odd bytes", dict(src=0x2000, dst=0, rows=2, bpr=15, src_stride=16, dst_stride=16), DMAError.MISALIGNED),
    ("gather odd address", dict(src=0x2001, dst=0, rows=4, bpr=2, src_stride=4, dst_stride=2), DMAError.MISALIGNED),
    ("gather odd stride", dict(src=0x2000, dst=0, rows=4, bpr=2, src_stride=3, dst_stride=2), DMAError.MISALIGNED),
    ("src past end", dict(src=CFG.dram_bytes - 32, dst=0, rows=3, bpr=16, src_stride=16, dst_stride=16),
     DMAError.SRC_RANGE),
    ("src huge stride", dict(src=0x2000, dst=0, rows=2, bpr=16, src_stride=1 << 30, dst_stride=16),
     DMAError.SRC_RANGE),
    ("dst past end", dict(src=0x2000, dst=SRAM - 16, rows=2, bpr=16, src_stride=16, dst_stride=16),
     DMAError.DST_RANGE),
    ("dst overlap", dict(src=0x2000, dst=0, rows=2, bpr=16, src_stride=16, dst_stride=8), DMAError.DST_OVERLAP),
    ("pp outside half", dict(src=0x2000, dst=1024 + 240, rows=2, bpr=16, src_stride=16, dst_stride=16,
                             pp_en=1, pp_half=0), DMAError.PP_RANGE),
    ("pp write-back", dict(src=1024, dst=0x2000, rows=1, bpr=16, src_stride=16, dst_stride=16, pp_en=1,
                           direction=Direction.SRAM_TO_DRAM), DMAError.PP_RANGE),
    ("into pp window", dict(src=0x2000, dst=1024 + 256, rows=1, bpr=16, src_stride=16, dst_stride=16),
     DMAError.PP_WINDOW),
    ("wb src past end", dict(src=SRAM - 8, dst=0x2000, rows=1, bpr=16, src_stride=16, dst_stride=16,
                             direction=Direction.SRAM_TO_DRAM), DMAError.SRC_RANGE),
    ("wb dst below region", dict(src=0, dst=0x100, rows=1, bpr=16, src_stride=16, dst_stride=16,
                                 direction=Direction.SRAM_TO_DRAM), DMAError.DST_RANGE),
]


def test_every_rejection_writes_nothing():
    b = Bench(seed=5)
    b.fill_dram(0x0, _rand(b.rng, 0x3000))

    async def main(ctx):
        await b.setup(ctx)
        ctx.set(b.dut.dram_lo, 0x1000)                # DRAM region [0x1000, end)
        await b.fill_sram(ctx, 0, _rand(b.rng, SRAM))
        for tag, (_name, f, _code) in enumerate(REJECTS):
            await b.submit(ctx, tag, f["src"], f["dst"], f["rows"], f["bpr"], f["src_stride"], f["dst_stride"],
                           f.get("direction", Direction.DRAM_TO_SRAM), f.get("pp_en", 0), f.get("pp_half", 0),
                           0, expect_ok=False)
        await b.wait_done(ctx, len(REJECTS))
        for _ in range(20):
            await ctx.tick()
        got = dict(b.done)
        for tag, (name, _f, code) in enumerate(REJECTS):
            assert got[tag] == code, f"{name}: expected {code.name}, got {got[tag].name}"
        assert ctx.get(b.dut.dma_n_rejected) == len(REJECTS)
        assert ctx.get(b.dut.dma_bytes_moved) == 0
        assert ctx.get(b.dut.sram_wr_bytes) == 0
        assert ctx.get(b.dut.dram_wr_bytes) == 0
        await b.check_sram(ctx)
        b.check_dram(0, 0x3000)

    b.run(main)


def test_m2_empty_descriptor_and_element_gather():
    """Case M2: a descriptor with 0 rows (and one with 0 bytes per row)
    completes at once with OK, moves 0 bytes and leaves the canary pattern in
    SRAM; the next descriptor runs normally.  A gather of 8 FP16 elements at
    an element stride of 2 (rows of 2 bytes, source stride 4) reads elements
    0, 2, ..., 14; the scatter back (SRAM -> DRAM, destination stride 6)
    puts them at every third element."""
    b = Bench(seed=21, model_delay=3)
    elems = np.arange(64, dtype=np.float16)
    b.fill_dram(0x2000, elems.tobytes())
    b.fill_dram(0x3000, bytes(64))

    async def main(ctx):
        await b.setup(ctx)
        await b.fill_sram(ctx, 0, b"\xa5" * 1024)                  # canary
        await b.submit(ctx, 0, 0x2000, 0x40, 0, 16, 16, 16)
        cycles = 0
        while not b.done and cycles < 8:
            await ctx.tick()
            cycles += 1
        assert b.done == [(0, DMAError.OK)] and cycles <= 3, (b.done, cycles)
        await b.submit(ctx, 1, 0x2000, 0x40, 4, 0, 16, 16)
        await b.wait_done(ctx, 2)
        assert ctx.get(b.dut.dma_bytes_moved) == 0 and ctx.get(b.dut.sram_wr_bytes) == 0
        await b.check_sram(ctx, 0, 1024)                           # canary intact
        await b.submit(ctx, 2, 0x2000, 0x80, 4, 16, 16, 16)        # the next one runs normally
        await b.submit(ctx, 3, 0x2000, 0x100, 8, 2, 4, 2)           # the gather
        await b.wait_done(ctx, 4)
        got = np.frombuffer(await b.read_sram(ctx, 0x100, 16), np.float16)
        assert got.tolist() == list(range(0, 16, 2)), got
        await b.submit(ctx, 4, 0x100, 0x3000, 8, 2, 2, 6, Direction.SRAM_TO_DRAM)
        await b.wait_done(ctx, 5)
        for _ in range(10):
            await ctx.tick()
        await b.check_sram(ctx, 0, 1024)
        b.check_dram(0x2000, 0x3040)
        back = np.frombuffer(b.model.read(0x3000, 48), np.float16)
        assert back[::3].tolist() == list(range(0, 16, 2)) and not back.reshape(-1, 3)[:, 1:].any()
        assert [c for _, c in b.done] == [DMAError.OK] * 5
        assert ctx.get(b.dut.dma_n_done) == 5 and ctx.get(b.dut.dma_n_rejected) == 0
        assert ctx.get(b.dut.dma_bytes_moved) == 4 * 16 + 2 * 8 * 2

    b.run(main)


def test_queue_full_and_ping_pong():
    """Tile j fills half 0 (commit), tile j+1 fills half 1 while half 0 is
    full, tile j+2 for half 0 waits until the consumer releases it; the queue
    overflows with a QUEUE_FULL completion, nothing is dropped silently."""
    b = Bench(seed=6, pp=(1024, 256), queue_depth=2)
    b.fill_dram(0x2000, _rand(b.rng, 2048))
    H0, H1 = 1024, 1280

    async def main(ctx):
        await b.setup(ctx)
        d = b.dut
        await b.fill_sram(ctx, 1024, bytes(512))
        # tile 0 -> half 0: K (no commit) + V (commit)
        await b.submit(ctx, 0, 0x2000, H0, 4, 16, 16, 16, pp_en=1, pp_half=0)
        await b.submit(ctx, 1, 0x2100, H0 + 64, 4, 16, 16, 16, pp_en=1, pp_half=0, pp_commit=1)
        await b.wait_done(ctx, 2)
        assert ctx.get(d.pp_full) == 0b01
        # tile 1 -> half 1 proceeds while half 0 is full (prefetch)
        await b.submit(ctx, 2, 0x2200, H1, 8, 16, 16, 16, pp_en=1, pp_half=1, pp_commit=1)
        await b.wait_done(ctx, 3)
        assert ctx.get(d.pp_full) == 0b11
        # tile 2 -> half 0 must wait; fill the queue behind it (depth 2)
        before = b.sram.read(H0, 256)
        await stream_put(ctx, d.desc, {"src": 0x2400, "dst": H0, "rows": 4, "bytes_per_row": 16,
                                       "src_stride": 16, "dst_stride": 16, "direction": 0, "pp_en": 1,
                                       "pp_half": 0, "pp_commit": 1, "tag": 3})
        for t in (4, 5):       # 3 and 4 fill the queue (depth 2); 5 overflows
            await stream_put(ctx, d.desc, {"src": 0x2500, "dst": 0x80 * t, "rows": 1, "bytes_per_row": 16,
                                           "src_stride": 16, "dst_stride": 16, "direction": 0, "tag": t})
        await b.wait_done(ctx, 4)
        for _ in range(50):
            await ctx.tick()
        assert b.done[3] == (5, DMAError.QUEUE_FULL)
        assert len(b.done) == 4                        # 3 and 4 are held
        assert await b.read_sram(ctx, H0, 256) == before   # half 0 not overwritten
        # the consumer releases half 0
        ctx.set(d.pp_release, 0b01)
        await ctx.tick()
        ctx.set(d.pp_release, 0)
        copy2d(b.dram, b.sram, 0x2400, H0, 4, 16, 16, 16)
        copy2d(b.dram, b.sram, 0x2500, 0x80 * 4, 1, 16, 16, 16)
        await b.wait_done(ctx, 6)
        assert [t for t, _ in b.done[4:]] == [3, 4]
        assert all(c == DMAError.OK for t, c in b.done if t != 5)
        assert ctx.get(d.pp_full) == 0b11
        assert ctx.get(d.pp_err) == 0
        await b.check_sram(ctx, 0, 2048)
        # releasing an empty half is a protocol error
        ctx.set(d.pp_release, 0b11)
        await ctx.tick()
        ctx.set(d.pp_release, 0b01)
        await ctx.tick()
        ctx.set(d.pp_release, 0)
        await ctx.tick()
        assert ctx.get(d.pp_err) == 1
        assert ctx.get(d.pp_full) == 0

    b.run(main)


@pytest.mark.parametrize("faults,channels,ok", [((3, 20), range(C), True), ((3, 20, 31), (2,), False)])
def test_link_faults(faults, channels, ok):
    """Two stuck read-link lanes in every channel at once are repaired by the
    BIST (data intact, the same bytes and cycles as without faults); three in
    one channel exceed its two spares: the descriptor completes with
    LINK_DOWN, nothing written."""
    b = Bench(seed=7, rd_faults=faults, fault_channels=channels)
    b.fill_dram(0x2000, bytes([0xFF]) * 256)

    async def main(ctx):
        await b.setup(ctx)
        for c in range(C):
            st = LinkStatus(ctx.get(b.dut.tsv_rd[c].status))
            assert st == (LinkStatus.OK if ok or c not in channels else LinkStatus.TOO_MANY)
        await b.fill_sram(ctx, 0, bytes(256))
        await b.submit(ctx, 9, 0x2000, 0, 8, 32, 32, 32, expect_ok=ok)
        await b.wait_done(ctx, 1)
        assert b.done == [(9, DMAError.OK if ok else DMAError.LINK_DOWN)]
        await b.check_sram(ctx, 0, 256)
        assert ctx.get(b.dut.dma_bytes_moved) == (256 if ok else 0)

    b.run(main)


@pytest.mark.parametrize("seed", [11, 12])
def test_random_descriptors_byte_exact(seed):
    """Random 2-D descriptors both ways (any word-aligned offsets, so the DRAM
    words of a group start at any channel; partial tail words; strides with
    gaps; contiguous rows; element gathers and scatters at any element
    offset and stride), random idle, back-pressure and model delay: every
    byte of SRAM and DRAM equals ``copy2d``."""
    b = Bench(seed=seed, done_bp=0.3, desc_idle=0.3, model_delay=3)
    r = b.rng
    b.fill_dram(0x1000, _rand(r, 0x2000))

    async def main(ctx):
        await b.setup(ctx)
        await b.fill_sram(ctx, 0, _rand(r, 1024))
        n = 0
        for _ in range(18):
            await b.wait_done(ctx, n - 3)                 # at most queue_depth outstanding
            bpr = 2 * r.randint(1, 3 * W)
            rows = r.randint(1, 6)
            span = lambda stride: (rows - 1) * stride + bpr
            gather = r.random() < 0.25
            if gather:                                    # element gather/scatter, any element offset
                bpr = 2
                s_stride, d_stride = 2 * r.randint(1, 5), 2 * r.randint(1, 5)
                if r.random() < 0.5:
                    src = 0x1000 + 2 * r.randint(0, (0x1000 - span(s_stride)) // 2)
                    dst = 2 * r.randint(0, (1024 - span(d_stride)) // 2)
                    await b.submit(ctx, n, src, dst, rows, bpr, s_stride, d_stride)
                else:
                    src = 2 * r.randint(0, (1024 - span(s_stride)) // 2)
                    dst = 0x2000 + 2 * r.randint(0, (0x1000 - span(d_stride)) // 2)
                    await b.submit(ctx, n, src, dst, rows, bpr, s_stride, d_stride, Direction.SRAM_TO_DRAM)
                n += 1
                continue
            if r.random() < 0.3:
                s_stride = d_stride = bpr + (-bpr) % W          # rows back to back
            else:
                s_stride = bpr + (-bpr) % W + W * r.randint(0, 3)
                d_stride = bpr + (-bpr) % W + W * r.randint(0, 3)
            if r.random() < 0.5:
                src = 0x1000 + W * r.randint(0, (0x1000 - span(s_stride)) // W)
                dst = W * r.randint(0, (1024 - span(d_stride)) // W)
                await b.submit(ctx, n, src, dst, rows, bpr, s_stride, d_stride)
            else:
                src = W * r.randint(0, (1024 - span(s_stride)) // W)
                dst = 0x2000 + W * r.randint(0, (0x1000 - span(d_stride)) // W)
                await b.submit(ctx, n, src, dst, rows, bpr, s_stride, d_stride, Direction.SRAM_TO_DRAM)
            n += 1
        await b.wait_done(ctx, n)
        assert [c for _, c in b.done] == [DMAError.OK] * n
        for _ in range(10):
            await ctx.tick()
        await b.check_sram(ctx, 0, 1024)
        b.check_dram(0x1000, 0x3000)
        assert ctx.get(b.dut.dram_late) == 0

    b.run(main)


def test_bad_parameters():
    raises_quietly(ValueError, "queue_depth", lambda: DMA(CFG, queue_depth=0))
    raises_quietly(ValueError, "dram_channel_bytes",
                   lambda: DMA(tiny_mem_config(dram_channel_bytes=8, tsv_data_lanes=64)))
    raises_quietly(ValueError, "n_consumers", lambda: MemorySystem(CFG, n_consumers=-1))
