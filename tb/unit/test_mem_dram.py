"""Stacked DRAM timing-model unit tests (amaranth.sim, storage in the Python model).

Every expected cycle count comes from ``config.dram_timing_cycles()`` and the
policy of ``hdl/dram.py``'s module docstring.  Conventions of the traces:

* cycle ``k`` is the k-th clock period of the simulation (the values the
  testbench samples just before the k-th rising edge);
* a request is *accepted* in the cycle its ``cmd.valid & cmd.ready`` is high;
* the *column command* of an access is the cycle the controller pops it from
  the column queue (``issue``); it is registered onto the backend bus, so
  ``bk[c].req_valid`` is high one cycle later (``BK_REG``);
* a read's data is *taken* in the cycle ``rdata.valid & rdata.ready`` is high,
  exactly ``dram_latency_cycles`` after its column command.

The column queue (``amaranth.lib.fifo.SyncFIFOBuffered``) passes an entry
through in ``QUEUE_PASS`` = 2 cycles (measured by
``test_row_hit_stream_latency_and_rate``): a row hit accepted into an empty
queue in cycle t has its column command in t + 2.  For a closed bank the
activate is issued in the acceptance cycle and the column command waits tRCD,
which hides the pass-through (tRCD >= 2): accept -> column = tRCD.
"""

import itertools
import random
from types import SimpleNamespace
from typing import NamedTuple

import pytest
from amaranth.sim import Simulator

from flashnpu.hdl.dram import COLUMN_QUEUE, DRAMChannel, StackedDRAM, dram_address
from flashnpu.sim.dram_model import DRAMModel
from flashnpu.tb.helpers import raises_quietly, stream_get, stream_put, tiny_mem_config

QUEUE_PASS = 2      # column-queue pass-through of a row hit (accept -> column command)
BK_REG = 1          # column command -> bk.req_valid (registered backend outputs)

# default HBM2 timing at 1.5 GHz (trcd 21, trp 21, tras 51, trrd 9, tfaw 45), 256-word rows
CFG = tiny_mem_config(dram_latency_cycles=12)
W = CFG.dram_channel_bytes
L = CFG.dram_latency_cycles
C = CFG.dram_channels
FULL = (1 << W) - 1


# ------------------------------------------------------------------ helpers
def word(cfg, channel, bank, row, column):
    """The word address of (channel, bank, row, column): the inverse of ``dram_address``."""
    cols = cfg.dram_row_bytes // cfg.dram_channel_bytes
    return ((row * cfg.dram_banks + bank) * cols + column) * cfg.dram_channels + channel


def merge(old, new, mask, wbytes):
    """``old`` with the bytes of ``new`` selected by ``mask``."""
    return sum((new if (mask >> b) & 1 else old) & (0xFF << 8 * b) for b in range(wbytes))


def full_delay_model(cfg, extra):
    """A model whose every read answer takes the full ``extra`` cycles (the worst case
    of ``DRAMModel(max_extra_delay=extra)``, whose delay is otherwise uniform in 0..extra)."""
    model = DRAMModel(cfg, max_extra_delay=extra)
    model.rng = SimpleNamespace(randint=lambda lo, hi: hi)
    return model


def make_sim(dut, model=None, testbenches=(), processes=()):
    sim = Simulator(dut)
    sim.add_clock(1e-6)
    for b in testbenches:
        sim.add_testbench(b)
    if model is not None:
        for c in range(dut.config.dram_channels):
            sim.add_process(model.amaranth_server(dut.bk[c]))
    for p in processes:
        sim.add_process(p)
    return sim


class Req(NamedTuple):
    addr: int
    write: int = 0
    wmask: int = 0
    wdata: int = 0
    at: int = 0          # presented at the port no earlier than this cycle


def run_trace(dut, reqs, model=None, watch=None, max_cycles=20000, tail=0, ready_from=0):
    """Drive ``reqs[c]`` (a list of ``Req``) in order on port ``c`` (valid as early
    as allowed, ``rdata.ready`` high from cycle ``ready_from`` on) and record, per channel, the cycles
    of acceptance (``accept``), of ``bk.req_valid`` (``col``: (cycle, addr, write))
    and of read data (``data``: (cycle, value)); ``watch`` (name -> signal) is
    sampled every cycle.  Stops ``tail`` cycles after every request has had its
    column access and every read its data."""
    n_ch = dut.config.dram_channels
    reqs = [list(reqs.get(c, ())) if isinstance(reqs, dict) else list(reqs[c]) for c in range(n_ch)]
    watch = dict(watch or {})
    tr = SimpleNamespace(accept=[[] for _ in range(n_ch)], col=[[] for _ in range(n_ch)],
                         data=[[] for _ in range(n_ch)], watch={k: [] for k in watch}, cycles=0, final={})
    n_reads = [sum(1 for r in rq if not r.write) for rq in reqs]

    async def bench(ctx):
        sigs = []
        for c in range(n_ch):
            p, bk = dut.ports[c], dut.bk[c]
            sigs += [p.cmd.valid, p.cmd.ready, p.rdata.valid, p.rdata.payload, bk.req_valid, bk.req_addr,
                     bk.req_write]
        sigs += list(watch.values())
        idx = [0] * n_ch
        cycle = 0
        done_at = None
        while True:
            for c in range(n_ch):
                p = dut.ports[c]
                ctx.set(p.rdata.ready, int(cycle >= ready_from))
                if idx[c] < len(reqs[c]) and reqs[c][idx[c]].at <= cycle:
                    r = reqs[c][idx[c]]
                    ctx.set(p.cmd.payload, {"addr": r.addr, "write": r.write, "wmask": r.wmask})
                    ctx.set(p.cmd.valid, 1)
                    ctx.set(p.wdata.payload, r.wdata)
                    ctx.set(p.wdata.valid, r.write)
                else:
                    ctx.set(p.cmd.valid, 0)
                    ctx.set(p.wdata.valid, 0)
            _, _, *v = await ctx.tick().sample(*sigs)
            for c in range(n_ch):
                cv, cr, rv, rd, kv, ka, kw = v[7 * c:7 * c + 7]
                if cv and cr:
                    tr.accept[c].append(cycle)
                    idx[c] += 1
                if rv and cycle >= ready_from:
                    tr.data[c].append((cycle, rd))
                if kv:
                    tr.col[c].append((cycle, ka, kw))
            for k, x in zip(watch, v[7 * n_ch:]):
                tr.watch[k].append(x)
            cycle += 1
            done = all(idx[c] == len(reqs[c]) and len(tr.col[c]) == len(reqs[c])
                       and len(tr.data[c]) == n_reads[c] for c in range(n_ch))
            if done and done_at is None:
                done_at = cycle
            if done_at is not None and cycle >= done_at + tail:
                break
            assert cycle < max_cycles, f"stuck: accepted {idx}, columns {[len(x) for x in tr.col]}"
        tr.cycles = cycle
        for name in ("rd_bytes", "wr_bytes", "stall_cycles", "row_hits", "activates", "row_conflicts",
                     "refreshes", "refresh_stall_cycles", "late", "err_addr"):
            tr.final[name] = ctx.get(getattr(dut, name))

    make_sim(dut, model, [bench]).run()
    return tr


def steps(samples):
    """Cycles in which a sampled counter counted (its value grew in the next cycle)."""
    return [k for k in range(len(samples) - 1) for _ in range(samples[k + 1] - samples[k])]


# ------------------------------------------------------------------ address map
@pytest.mark.parametrize("changes", [
    dict(),
    dict(dram_banks=4, dram_row_bytes=64),
    dict(dram_channels=1, dram_banks=2, dram_row_bytes=4),
    dict(dram_banks=1, dram_row_bytes=16),
])
def test_dram_address_follows_the_docstring_formulas(changes):
    cfg = tiny_mem_config(**changes)
    Cc, cols, B = cfg.dram_channels, cfg.dram_row_bytes // cfg.dram_channel_bytes, cfg.dram_banks
    words = cfg.dram_bytes // cfg.dram_channel_bytes
    r = random.Random(3)
    for w in [0, 1, words - 1] + [r.randrange(words) for _ in range(300)]:
        loc = dram_address(cfg, w)
        assert loc == {"channel": w % Cc, "column": (w // Cc) % cols, "bank": (w // Cc // cols) % B,
                       "row": w // Cc // cols // B}
        assert word(cfg, **loc) == w
    # consecutive words: consecutive channels; a page holds `cols` consecutive channel words;
    # consecutive pages of a stream sit in consecutive banks
    assert [dram_address(cfg, w)["channel"] for w in range(2 * Cc)] == list(range(Cc)) * 2
    assert [dram_address(cfg, Cc * k)["bank"] for k in range(0, 3 * cols * B, cols)] == list(range(B)) * 3
    with pytest.raises(ValueError, match="word_addr must be >= 0, not -1"):
        dram_address(cfg, -1)


# ------------------------------------------------------------------ 1. row hits
def test_row_hit_stream_latency_and_rate():
    """One channel, n reads of one row: one activate, then one read per cycle;
    first data tRCD + L after acceptance (the queue pass-through hidden under
    tRCD); a lone hit into the empty queue later: QUEUE_PASS + L.  The model
    answers every read with the whole allowed extra delay (L - 3): never late."""
    t = CFG.dram_timing_cycles()
    ch, n = 1, 40
    model = full_delay_model(CFG, L - 3)
    addrs = [word(CFG, ch, 3, 0, k) for k in range(n + 1)]
    for a in addrs:
        model.write_word(a, 0x1000 + a, FULL)
    lone_at = n + t["trcd"] + 5           # queue empty again, bank still open (before idle close)
    assert lone_at < t["trcd"] + n + t["trp"] + t["trcd"]     # default idle_close = tRP + tRCD
    dut = StackedDRAM(CFG)
    tr = run_trace(dut, {ch: [Req(a) for a in addrs[:n]] + [Req(addrs[n], at=lone_at)]}, model)

    acc, col, dat = tr.accept[ch], [x[0] for x in tr.col[ch]], [x[0] for x in tr.data[ch]]
    assert acc == list(range(n)) + [lone_at]                                  # one per cycle
    assert [x[1] for x in tr.col[ch]] == addrs
    assert [x[1] for x in tr.data[ch]] == [0x1000 + a for a in addrs]        # exact, in order
    # the first read opens the row: column command tRCD after acceptance
    assert col[:n] == [t["trcd"] + BK_REG + k for k in range(n)]
    assert dat[:n] == [t["trcd"] + L + k for k in range(n)]
    # measured pass-through of a row hit through the empty column queue
    assert col[n] - BK_REG - acc[n] == QUEUE_PASS
    assert dat[n] - acc[n] == QUEUE_PASS + L
    assert all(d - (c - BK_REG) == L for c, d in zip(col, dat))              # latency exact
    f = tr.final
    assert (f["activates"], f["row_hits"], f["row_conflicts"]) == (1, n, 0)
    assert (f["late"], f["err_addr"], f["stall_cycles"]) == (0, 0, 0)
    assert f["rd_bytes"] == (n + 1) * W and f["wr_bytes"] == 0


@pytest.mark.parametrize("extra", [L - 3, L - 2])
def test_late_flag_marks_the_model_budget(extra):
    """An answer ``extra`` cycles late: L - 3 is the last one in time (registered
    request, 1-cycle model, response FIFO); L - 2 misses its deadline -> ``late``."""
    ch, n = 2, 6
    model = full_delay_model(CFG, extra)
    addrs = [word(CFG, ch, 5, 0, k) for k in range(n)]
    for a in addrs:
        model.write_word(a, a * 3, FULL)
    tr = run_trace(StackedDRAM(CFG), {ch: [Req(a) for a in addrs]}, model)
    assert [x[1] for x in tr.data[ch]] == [a * 3 for a in addrs]
    assert tr.final["late"] == (extra > L - 3)


def test_unserved_backend_is_late():
    """No model on the backend bus: the matured read finds no data -> ``late``."""
    dut = StackedDRAM(CFG)
    t = CFG.dram_timing_cycles()

    async def main(ctx):
        port = dut.ports[3]
        ctx.set(port.rdata.ready, 1)
        await stream_put(ctx, port.cmd, {"addr": 3, "write": 0, "wmask": 0})
        for _ in range(t["trcd"] + L - 1):
            await ctx.tick()
        assert ctx.get(dut.late) == 0
        for _ in range(3):
            await ctx.tick()
        assert ctx.get(dut.late) == 1 and ctx.get(dut.channels[3].late) == 1
        assert ctx.get(port.rdata.valid) == 0

    make_sim(dut, None, [main]).run()


@pytest.mark.parametrize("max_outstanding", [None, 4])
def test_read_credits(max_outstanding):
    """Reads stop at ``max_outstanding`` not yet taken (default: the power of 2 >=
    L + 4, enough for one read per cycle); with 4 credits a stream gets 4 reads
    per L + 1 cycles (a credit returns when its data is taken)."""
    t = CFG.dram_timing_cycles()
    ch, n = 0, 40
    D = max_outstanding or 1 << (L + 3).bit_length()
    assert D >= L + 4 if max_outstanding is None else D < L
    model = DRAMModel(CFG)
    addrs = [word(CFG, ch, 7, 0, k) for k in range(n)]
    for a in addrs:
        model.write_word(a, 0xA000 + a, FULL)
    ready_from = 2 * (t["trcd"] + L + n)         # consumer asleep while every read could have matured
    dut = StackedDRAM(CFG, max_outstanding=max_outstanding)
    tr = run_trace(dut, {ch: [Req(a) for a in addrs]}, model, ready_from=ready_from)
    col = [x[0] for x in tr.col[ch]]
    assert len([c for c in col if c < ready_from]) == D           # stopped at D outstanding
    assert [x[1] for x in tr.data[ch]] == [0xA000 + a for a in addrs]
    dat = [x[0] for x in tr.data[ch]]
    if max_outstanding is None:
        assert dat == list(range(ready_from, ready_from + n))      # then one per cycle
    else:
        # first D matured; then each credit returned in cycle x buys a read whose data is taken in x + 1 + L
        assert dat == [ready_from + (k // D) * (L + 1) + k % D for k in range(n)]
    assert tr.final["late"] == 0 and tr.final["rd_bytes"] == n * W


# ------------------------------------------------------------------ 2. all channels
def test_all_channels_stream_at_full_rate():
    """A sequential stream over every channel: each channel takes and returns one
    word per cycle across page boundaries (the next page's activate hides under
    the column queue) and when it returns to bank 0 with a new row (closed by the
    idle timer): C words per cycle in n + tRCD + L cycles."""
    cfg = tiny_mem_config(dram_latency_cycles=12, dram_banks=4, dram_row_bytes=128)
    t = cfg.dram_timing_cycles()
    Cc, cols, B = cfg.dram_channels, cfg.dram_row_bytes // cfg.dram_channel_bytes, cfg.dram_banks
    n = B * cols + cols // 2                      # every bank, then bank 0 again in row 1
    idle_close = t["trp"] + t["trcd"]
    # bank 0's last column (cols - 1 + tRCD), idle close, tRP: done before the stream returns
    assert (cols - 1 + t["trcd"]) + 1 + idle_close + t["trp"] <= B * cols
    assert t["trcd"] <= COLUMN_QUEUE and cols >= t["trrd"] and 4 * cols >= t["tfaw"]
    model = DRAMModel(cfg)
    for a in range(n * Cc):
        model.write_word(a, 0x5000_0000 + a, FULL)
    tr = run_trace(StackedDRAM(cfg), [[Req(c + Cc * k) for k in range(n)] for c in range(Cc)], model)
    for c in range(Cc):
        assert tr.accept[c] == list(range(n))
        assert [x[0] for x in tr.data[c]] == [t["trcd"] + L + k for k in range(n)]
        assert [x[1] for x in tr.data[c]] == [0x5000_0000 + c + Cc * k for k in range(n)]
    last = max(x[0] for d in tr.data for x in d)
    assert last + 1 == n + t["trcd"] + L                      # C*n words in n + startup cycles
    pages = -(-n // cols)
    f = tr.final
    assert (f["activates"], f["row_conflicts"], f["row_hits"]) == (Cc * pages, 0, Cc * (n - pages))
    assert f["stall_cycles"] == 0 and f["rd_bytes"] == Cc * n * W and f["late"] == 0


# ------------------------------------------------------------------ 3. bank conflicts
BANKCFG = tiny_mem_config(dram_latency_cycles=12, dram_banks=4, dram_row_bytes=64)


@pytest.mark.parametrize("tras_ns", [34, 10])       # tRAS or the queued access holds the precharge
def test_bank_conflict_stride_vs_row_friendly_stride(tras_ns):
    """Alternating between two rows: in one bank every access precharges and
    re-activates (period max(tRAS, tRCD + 1) + tRP; the + 1: the precharge waits
    until no queued access needs the row); in two banks both rows stay open and
    the accesses stream at one per cycle after two activates (tRRD apart)."""
    cfg = BANKCFG.replace(dram_tras_ns=tras_ns)
    t = cfg.dram_timing_cycles()
    ch, n = 0, 10
    span = {}
    for same_bank in (True, False):
        rows = [(1, 0), (1, 1)] if same_bank else [(1, 0), (2, 1)]
        addrs = [word(cfg, ch, *rows[k % 2], k // 2) for k in range(n)]
        model = DRAMModel(cfg)
        for a in addrs:
            model.write_word(a, ~a & 0xFFFF_FFFF, FULL)
        tr = run_trace(StackedDRAM(cfg), {ch: [Req(a) for a in addrs]}, model)
        issue = [x[0] - BK_REG for x in tr.col[ch]]
        assert [x[1] for x in tr.col[ch]] == addrs
        assert [x[1] for x in tr.data[ch]] == [~a & 0xFFFF_FFFF for a in addrs]
        f = tr.final
        if same_bank:
            period = max(t["tras"], t["trcd"] + 1) + t["trp"]
            assert issue == [t["trcd"] + k * period for k in range(n)]
            assert (f["activates"], f["row_conflicts"], f["row_hits"]) == (n, n - 1, 0)
            assert f["stall_cycles"] == (n - 1) * (period - 1)
        else:
            assert issue == [t["trcd"]] + [t["trrd"] + t["trcd"] + k for k in range(n - 1)]
            assert (f["activates"], f["row_conflicts"], f["row_hits"]) == (2, 0, n - 2)
            assert f["stall_cycles"] == t["trrd"] - 1
        assert f["activates"] + f["row_hits"] == n and f["late"] == 0
        span[same_bank] = issue[-1] - issue[0]
    assert span[True] / (n - 1) >= t["trp"] + t["trcd"]         # per access: at least a precharge + activate
    assert span[False] / (n - 1) < 2 and span[True] > 20 * span[False]


# ------------------------------------------------------------------ 4. tRAS
@pytest.mark.parametrize("tras_ns", [34, 60])
def test_tras_delays_the_precharge_of_a_just_activated_bank(tras_ns):
    """Row 0 then row 1 of one bank: the precharge waits tRAS from the activate,
    then tRP, then the new row's tRCD."""
    cfg = BANKCFG.replace(dram_tras_ns=tras_ns)
    t = cfg.dram_timing_cycles()
    assert t["tras"] > t["trcd"] + 1              # tRAS, not the queued access, holds the precharge
    ch = 3
    addrs = [word(cfg, ch, 2, 0, 5), word(cfg, ch, 2, 1, 5)]
    model = DRAMModel(cfg)
    tr = run_trace(StackedDRAM(cfg), {ch: [Req(a) for a in addrs]}, model)
    issue = [x[0] - BK_REG for x in tr.col[ch]]
    assert tr.accept[ch][0] == 0
    assert issue == [t["trcd"], t["tras"] + t["trp"] + t["trcd"]]
    assert tr.accept[ch][1] == t["tras"] + t["trp"]              # activate of row 1
    assert (tr.final["activates"], tr.final["row_conflicts"]) == (2, 1)


# ------------------------------------------------------------------ 5. tRRD / tFAW
@pytest.mark.parametrize("tfaw_ns", [30, 20])       # tFAW binding (45 > 4 x 9); only tRRD (30 <= 36)
def test_activates_respect_trrd_and_tfaw(tfaw_ns):
    """One read to each of 8 banks, back to back: activates tRRD apart and at
    most 4 in any tFAW window (the greedy schedule); each column tRCD after its
    activate."""
    cfg = tiny_mem_config(dram_latency_cycles=12, dram_banks=8, dram_row_bytes=64, dram_tfaw_ns=tfaw_ns)
    t = cfg.dram_timing_cycles()
    ch, nb = 2, cfg.dram_banks
    addrs = [word(cfg, ch, b, b % 3, b) for b in range(nb)]
    dut = StackedDRAM(cfg)
    tr = run_trace(dut, {ch: [Req(a) for a in addrs]}, DRAMModel(cfg),
                   watch={"act": dut.channels[ch].activates})
    acts = steps(tr.watch["act"])
    expect = [0]
    for k in range(1, nb):
        expect.append(max(expect[-1] + t["trrd"], expect[k - 4] + t["tfaw"] if k >= 4 else 0))
    assert acts == expect
    assert all(b - a >= t["trrd"] for a, b in zip(acts, acts[1:]))
    assert all(sum(1 for x in acts if s <= x < s + t["tfaw"]) <= 4 for s in range(acts[-1] + 1))
    if t["tfaw"] > 4 * t["trrd"]:
        assert acts[4] - acts[0] == t["tfaw"]                   # tFAW actually bound
    assert acts == tr.accept[ch]                                # activate in the acceptance cycle
    assert [x[0] - BK_REG for x in tr.col[ch]] == [a + t["trcd"] for a in acts]
    assert tr.final["activates"] == nb and tr.final["row_conflicts"] == 0


# ------------------------------------------------------------------ 6. refresh
REFCFG = BANKCFG.replace(dram_trefi_ns=100, dram_trfc_ns=20)      # tREFI 150, tRFC 30 cycles


@pytest.mark.parametrize("idle_close", [None, 1000])   # 1000: only the refresh closes the banks
def test_refresh_collides_with_a_stream(idle_close):
    """Small tREFI, a long mixed read/write stream on one channel: data exact,
    one refresh per tREFI (+-1), the stream stalls for it, no column access from
    the precharge-all through tRP + tRFC, and the first access after it pays an
    activate (tRCD) since refresh closes every bank."""
    cfg = REFCFG
    t = cfg.dram_timing_cycles()
    ch = 1
    r = random.Random(11)
    cols = cfg.dram_row_bytes // W
    seq = [word(cfg, ch, (k // cols) % cfg.dram_banks, k // cols // cfg.dram_banks, k % cols) for k in range(160)]
    addrs = [seq[k // 2] for k in range(2 * len(seq))]      # every word written twice (masked rewrite)
    model = DRAMModel(cfg, seed=1, max_extra_delay=L - 3)
    shadow = {}
    reqs, expect = [], []
    for k, a in enumerate(addrs):
        wd, mask = r.getrandbits(8 * W), r.getrandbits(W) if a in shadow else FULL
        shadow[a] = merge(shadow.get(a, 0), wd, mask, W)
        reqs.append(Req(a, 1, mask, wd))
        if k >= 3:                                  # read back a word written 3 requests ago
            b = addrs[k - 3]
            reqs.append(Req(b))
            expect.append(shadow[b])
    dut = StackedDRAM(cfg, idle_close=idle_close)
    chan = dut.channels[ch]
    tr = run_trace(dut, {ch: reqs}, model, watch={"ref": chan.refreshes, "rs": chan.refresh_stall_cycles,
                                                  "other": dut.channels[0].refreshes, "act": chan.activates},
                   tail=5)
    assert [x[1] for x in tr.data[ch]] == expect
    for a, v in shadow.items():
        assert model.read_word(a) == v
    ref = tr.watch["ref"]
    assert tr.cycles > 4 * t["trefi"]
    assert abs(ref[-1] - tr.cycles // t["trefi"]) <= 1
    assert abs(tr.watch["other"][-1] - tr.cycles // t["trefi"]) <= 1
    assert abs(tr.final["refreshes"] - C * (tr.cycles // t["trefi"])) <= C          # every channel refreshes
    assert tr.watch["rs"][-1] > 0 and tr.final["refresh_stall_cycles"] == tr.watch["rs"][-1]
    cols_at = [x[0] for x in tr.col[ch]]
    busy = t["trp"] + t["trfc"]
    windows = steps(ref)                                            # precharge-all cycles
    assert len(windows) == ref[-1] >= 4
    for p in windows:
        nxt = [x for x in cols_at if x > p]
        # nothing on the bus from the precharge-all to the end of tRP + tRFC;
        # then an activate and its tRCD before the next column access
        assert not nxt or nxt[0] - BK_REG >= p + busy + t["trcd"]
        assert not any(p < x - BK_REG < p + busy for x in cols_at)
        if nxt:                                     # it activates: refresh closed its bank
            assert steps(tr.watch["act"][p:])[0] + p == nxt[0] - BK_REG - t["trcd"]
    assert tr.final["late"] == 0 and tr.final["err_addr"] == 0
    assert tr.final["wr_bytes"] == len(addrs) * W and tr.final["rd_bytes"] == len(expect) * W


def test_refresh_timing_on_idle_and_busy_channels():
    """Idle channels refresh every tREFI, the first time in cycle tREFI + 1 (the
    counter, loaded with tREFI, reaches 0 in cycle tREFI); a request arriving
    then waits exactly tRP + tRFC (``refresh_stall_cycles``); a channel whose
    bank was activated just before a refresh became due waits tRAS from that
    activate before its precharge-all."""
    cfg = REFCFG
    t = cfg.dram_timing_cycles()
    busy = t["trp"] + t["trfc"]
    assert t["tras"] > t["trcd"] + QUEUE_PASS           # the queue drains before tRAS has passed
    ch, waiter = 2, 0
    dut = StackedDRAM(cfg)
    n_ref = 3
    act_at = n_ref * t["trefi"]                  # in the cycle before the third refresh is due
    watch = {f"ref{c}": dut.channels[c].refreshes for c in range(C)}
    watch |= {f"rs{c}": dut.channels[c].refresh_stall_cycles for c in range(C)}
    tr = run_trace(dut, {ch: [Req(word(cfg, ch, 1, 2, 3), at=act_at)],
                         waiter: [Req(word(cfg, waiter, 0, 0, 0), at=t["trefi"] + 1)]},
                   DRAMModel(cfg), watch=watch, tail=t["tras"] + 10)
    idle = steps(tr.watch["ref1"])
    assert idle == [t["trefi"] + 1 + k * t["trefi"] for k in range(n_ref)]
    assert all(steps(tr.watch[f"ref{c}"]) == idle for c in range(C) if c != ch)
    # the waiter: halted from the precharge-all for tRP + tRFC, then activates
    assert tr.accept[waiter] == [idle[0] + busy]
    assert tr.watch[f"rs{waiter}"][-1] == busy and tr.final["refresh_stall_cycles"] == busy
    assert tr.final["stall_cycles"] == busy
    # the late activate holds the third refresh of its channel for tRAS
    assert tr.accept[ch] == [act_at] and tr.col[ch][0][0] - BK_REG == act_at + t["trcd"]
    assert act_at < idle[-1]
    assert steps(tr.watch[f"ref{ch}"]) == idle[:-1] + [act_at + t["tras"]]


# ------------------------------------------------------------------ 7. random traffic
@pytest.mark.parametrize("seed", [5, 6, 7])
def test_random_traffic_on_all_channels(seed):
    """Random reads/writes with byte masks on every channel at once, random idle
    and back-pressure, write data sometimes after its command, random model
    delay (within budget), refreshes: read data
    exact and in order per channel, byte counters exact, never late."""
    print(f"seed={seed}")
    cfg = tiny_mem_config(dram_latency_cycles=12, dram_banks=4, dram_row_bytes=16, clock_hz=0.5e9,
                          dram_trefi_ns=400, dram_trfc_ns=40)
    Cc = cfg.dram_channels
    dut = StackedDRAM(cfg)
    model = DRAMModel(cfg, seed=seed, max_extra_delay=L - 3)
    n_ops = 150
    expect = [[] for _ in range(Cc)]
    got = [[] for _ in range(Cc)]
    stats = {"fin": 0, "reads": 0, "writes": 0}

    def driver(c):
        async def run(ctx):
            r = random.Random(seed * 101 + c)
            port = dut.ports[c]
            addrs = [word(cfg, c, b, row, col) for b in range(cfg.dram_banks) for row in range(3)
                     for col in range(2)]
            shadow = {}
            for _ in range(n_ops):
                a = r.choice(addrs)
                if a not in shadow or r.random() < 0.45:
                    wd = r.getrandbits(8 * W)
                    mask = r.getrandbits(W) if a in shadow else FULL
                    shadow[a] = merge(shadow.get(a, 0), wd, mask, W)
                    while r.random() < 0.3:
                        await ctx.tick()
                    lag = r.randrange(1, 4) if r.random() < 0.3 else 0     # the command before its data
                    ctx.set(port.cmd.payload, {"addr": a, "write": 1, "wmask": mask})
                    ctx.set(port.cmd.valid, 1)
                    ctx.set(port.wdata.payload, wd)
                    for k in itertools.count():
                        ctx.set(port.wdata.valid, int(k >= lag))
                        _, _, c_rdy, d_rdy = await ctx.tick().sample(port.cmd.ready, port.wdata.ready)
                        assert c_rdy == d_rdy and not (c_rdy and k < lag)   # taken together, with the data
                        if c_rdy:
                            break
                    ctx.set(port.cmd.valid, 0)
                    ctx.set(port.wdata.valid, 0)
                    stats["writes"] += 1
                else:
                    expect[c].append(shadow[a])
                    await stream_put(ctx, port.cmd, {"addr": a, "write": 0, "wmask": 0}, r, 0.3)
                    stats["reads"] += 1
            stats["fin"] += 1
        return run

    def reader(c):
        async def run(ctx):
            r = random.Random(seed * 103 + c)
            while True:
                got[c].append(await stream_get(ctx, dut.ports[c].rdata, r, 0.4))
        return run

    async def main(ctx):
        for _ in range(30000):
            await ctx.tick()
            if stats["fin"] == Cc and all(len(got[c]) == len(expect[c]) for c in range(Cc)):
                break
        for _ in range(20):                 # let the last posted writes reach the model
            await ctx.tick()
        assert stats["fin"] == Cc
        assert got == expect
        assert all(len(e) > 5 for e in expect)
        assert ctx.get(dut.late) == 0 and ctx.get(dut.err_addr) == 0
        assert ctx.get(dut.rd_bytes) == stats["reads"] * W
        assert ctx.get(dut.wr_bytes) == stats["writes"] * W == model.writes * W
        assert ctx.get(dut.row_hits) + ctx.get(dut.activates) == Cc * n_ops
        assert ctx.get(dut.row_conflicts) > 0 and ctx.get(dut.row_hits) > 0 and ctx.get(dut.refreshes) > 0

    sim = make_sim(dut, model, [main] + [driver(c) for c in range(Cc)], [reader(c) for c in range(Cc)])
    sim.run()


# ------------------------------------------------------------------ 8. err_addr
ERRCFG = tiny_mem_config(dram_bytes=12288)          # 3072 words: addresses up to 4095 fit the port


@pytest.mark.parametrize("port, addr, err", [
    (1, 1, False), (1, 2, True),                            # wrong channel
    (0, 3068, False), (0, 3072, True), (3, 3071, False), (3, 4095, True),   # beyond dram_bytes
])
def test_err_addr(port, addr, err):
    """``err_addr`` (sticky, of the port's channel only) for a request of another
    channel or beyond ``dram_bytes``, not for the last words in range."""
    dut = StackedDRAM(ERRCFG)
    assert dut.addr_bits == 12 and ERRCFG.dram_bytes // W == 3072

    async def main(ctx):
        p = dut.ports[port]
        ctx.set(p.cmd.payload, {"addr": addr, "write": 0, "wmask": 0})
        ctx.set(p.cmd.valid, 1)
        await ctx.tick()
        ctx.set(p.cmd.valid, 0)
        for _ in range(3):
            await ctx.tick()
        assert ctx.get(dut.err_addr) == err
        assert [ctx.get(ch.err_addr) for ch in dut.channels] == [int(err and c == port) for c in range(C)]

    make_sim(dut, None, [main]).run()


# ------------------------------------------------------------------ 9. parameters
def test_bad_parameters():
    raises_quietly(ValueError, "dram_latency_cycles must be >= 4 .* not 3",
                   lambda: StackedDRAM(tiny_mem_config(dram_latency_cycles=3)))
    for mo in (3, 0, 6, 2.0):
        raises_quietly(ValueError, "max_outstanding must be a power of 2", lambda: StackedDRAM(CFG, max_outstanding=mo))
    for ch in (-1, C, 1.0):
        raises_quietly(ValueError, rf"channel must be in 0\.\.{C - 1}", lambda: DRAMChannel(CFG, ch))
    for ic in (0, -3, 2.5):
        raises_quietly(ValueError, "idle_close must be a positive int", lambda: StackedDRAM(CFG, idle_close=ic))
        raises_quietly(ValueError, "idle_close must be a positive int", lambda: DRAMChannel(CFG, 1, idle_close=ic))


# ------------------------------------------------------------------ 10. idle close
@pytest.mark.parametrize("idle_close", [None, 80])
@pytest.mark.parametrize("row, offset, hit, conflict", [
    (1, 0, False, True),      # other row in the last open cycle: a demand precharge (conflict)
    (1, 1, False, False),     # one cycle later: idle-closed, activate without conflict (waits tRP)
    (1, "trp", False, False),  # tRP after the close: pays only tRCD
    (0, 0, True, False),      # same row in the last open cycle: a hit
    (0, 1, False, False),     # same row after the close: a new activate
])
def test_idle_close(idle_close, row, offset, hit, conflict):
    """A bank with nothing queued is precharged idle_close cycles after its last
    column command (once tRAS has passed); a later access to it activates
    without counting a row conflict."""
    cfg = BANKCFG
    t = cfg.dram_timing_cycles()
    ic = t["trp"] + t["trcd"] if idle_close is None else idle_close
    offset = t[offset] if isinstance(offset, str) else offset
    ch, bank = 2, 3
    # first read: activate in cycle 0, column command in tRCD, nothing queued from tRCD + 1:
    # precharged by the idle timer idle_close cycles later (not before tRAS)
    close = max(t["trcd"] + 1 + ic, t["tras"])
    x = close + offset
    a0, a1 = word(cfg, ch, bank, 0, 1), word(cfg, ch, bank, row, 2)
    tr = run_trace(StackedDRAM(cfg, idle_close=idle_close), {ch: [Req(a0), Req(a1, at=x)]}, DRAMModel(cfg))
    f = tr.final
    assert tr.accept[ch][0] == 0
    assert (f["row_hits"], f["row_conflicts"], f["activates"]) == (int(hit), int(conflict), 1 + (not hit))
    issue = tr.col[ch][1][0] - BK_REG
    if hit:
        assert issue == x + QUEUE_PASS
    else:
        assert issue == max(x, close + t["trp"]) + t["trcd"]
