"""Testbench for the compute core, shared by ``amaranth.sim`` and cocotb.

Layers (as in cocotb's matrix_multiplier example):

* ``Io`` adapters hide the simulator: ``set``/``get`` a port by its Verilog
  name, ``await tick()`` one clock.  Both sample and drive between rising
  edges (cocotb: on the falling edge), so one driver runs on both.
* ``CoreDriver`` drives the command, the tile-buffer write stream (loading
  K/V halves as soon as the core releases them), the pause/debug protocol and
  the O stream (random write gaps and O back-pressure from one seeded
  generator), and monitors
  the result into ``CoreRun``.
* ``QTileJob`` is the stimulus + model: the golden ``flash_attention_hw`` run
  and the q-tile slice the core must reproduce.
* ``check_run`` is the scoreboard: every checkpoint register of every PE and
  the final O, bit for bit, each mismatch naming the tile, PE (r, c),
  register, expected and actual value.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from flashnpu.config import NPUConfig
from flashnpu.golden import assert_bit_exact, flash_attention_hw, visible_mask
from flashnpu.golden import numerics as nx
from flashnpu.hdl.core import (
    CORE_MODULE,
    BufSel,
    Core,
    PausePoint,
    Phase,
    cmd_layout,
    core_verilog,
    out_layout,
    register_name,
    write_layout,
)
from flashnpu.hdl.pe import RegMap
from flashnpu.sim import runner
from flashnpu.sim.packing import pack, unpack

__all__ = ["pack", "AmaranthIo", "CocotbIo", "QTileJob", "CoreRun", "CoreDriver", "check_run",
           "computed_positions", "pv_keys", "expected_mac_cycles", "expected_masked_macs", "make_job",
           "RegisterCheckError"]


class RegisterCheckError(AssertionError):
    """The core's register check fired (``reg_err``): a PE register was read
    before it was written.  ``reg``, ``phase`` and ``tile`` name the read."""

    def __init__(self, msg, reg, phase, tile):
        super().__init__(msg)
        self.reg, self.phase, self.tile = reg, phase, tile


def lanes_to_int(arr16) -> int:
    """uint16 lanes -> integer, lane 0 in the least significant bits."""
    b = np.ascontiguousarray(np.asarray(arr16, np.uint16)).tobytes()
    return int.from_bytes(b, "little")


def int_to_u32(v: int, n: int) -> np.ndarray:
    return np.frombuffer(int(v).to_bytes(4 * n, "little"), np.uint32).copy()


class AmaranthIo:
    """``Io`` over an amaranth.sim testbench context and the ``Core``."""

    def __init__(self, ctx, dut):
        self.ctx, self.dut = ctx, dut
        self._cache = {}

    def _sig(self, name):
        s = self._cache.get(name)
        if s is None:
            s = self.dut
            for part in name.split("__"):
                s = getattr(s, part)
            if hasattr(s, "as_value"):
                s = s.as_value()
            self._cache[name] = s
        return s

    def set(self, name, value):
        self.ctx.set(self._sig(name), int(value))

    def get(self, name) -> int:
        return int(self.ctx.get(self._sig(name)))

    async def tick(self):
        await self.ctx.tick()


class CocotbIo:
    """``Io`` over a cocotb DUT: drive and sample on the falling edge."""

    def __init__(self, dut):
        # deferred: cocotb is importable only inside the simulator process
        # (this module also serves the amaranth.sim tests)
        from cocotb.triggers import FallingEdge
        self.dut = dut
        self._fe = FallingEdge(dut.clk)
        self._h = {}

    def _handle(self, name):
        h = self._h.get(name)
        if h is None:
            h = self._h[name] = getattr(self.dut, name)
        return h

    def set(self, name, value):
        self._handle(name).value = int(value)

    def get(self, name) -> int:
        return int(self._handle(name).value)

    async def tick(self):
        await self._fe


@dataclass
class QTileJob:
    """One q tile of a golden run.

    ``q_tile`` (Br x max_hd FP16 bits incl. garbage padding), ``k``/``v``
    (n_kv*Bc x max_hd), ``mask`` (Br x n_kv*Bc bool or None) are what the
    core is loaded with; ``golden`` is the full-sequence golden result,
    ``q_row0`` selects the tile's rows.
    """
    config: NPUConfig
    head_dim: int
    seq_q: int
    seq_kv: int
    q_row0: int
    causal: bool
    kv_valid_len: int
    c_bits: int
    q_tile: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    golden: object
    name: str = ""

    @property
    def n_kv(self):
        return -(-self.seq_kv // self.config.bc)


def computed_positions(job: QTileJob) -> np.ndarray:
    """Bool [Br, n_kv * Bc]: the (query, key) positions of the q tile whose
    MACs the core runs: visible by the causal, padding and kv_valid_len
    rules (the attention mask's bits arrive for the softmax, after Q.K)."""
    cfg = job.config
    rows = max(0, min(cfg.br, job.seq_q - job.q_row0))
    vis = np.zeros((cfg.br, job.n_kv * cfg.bc), bool)
    vis[:rows, :job.seq_kv] = visible_mask(1, job.seq_q, job.seq_kv, job.causal,
                                           kv_valid_len=job.kv_valid_len)[0, job.q_row0:job.q_row0 + rows]
    return vis


def pv_keys(job: QTileJob) -> list:
    """Keys the P.V phase of each kv tile runs (``Core``): up to the tile's
    last key that a valid row sees by the causal, padding and kv_valid_len
    rules, at least one."""
    bc = job.config.bc
    vis = computed_positions(job).any(axis=0)
    return [max(1, int(np.flatnonzero(vis[j * bc:(j + 1) * bc]).max(initial=-1)) + 1) for j in range(job.n_kv)]


def expected_mac_cycles(job: QTileJob) -> int:
    """MAC-issuing cycles of the q tile (``Core.cnt_mac``): head_dim*wr*wc
    per kv tile for Q.K and keys*wr*od for P.V (``pv_keys``)."""
    cfg = job.config
    wr, wc, od = cfg.rows_per_pe, cfg.cols_per_pe, cfg.o_cols_per_pe(job.head_dim)
    return sum(job.head_dim * wr * wc + keys * wr * od for keys in pv_keys(job))


def expected_masked_macs(job: QTileJob) -> int:
    """MAC slots the core issues at masked positions over the q tile
    (``Core.ops_masked``): head_dim Q.K slots per position of every tile
    outside ``computed_positions``, and od x C P.V slots (one per O column
    of the row's PEs) per such position among the keys P.V runs."""
    cfg = job.config
    vis = computed_positions(job)
    n_s = int((~vis).sum())
    n_pv = sum(int((~vis[:, j * cfg.bc:j * cfg.bc + keys]).sum()) for j, keys in enumerate(pv_keys(job)))
    return n_s * job.head_dim + n_pv * cfg.o_cols_per_pe(job.head_dim) * cfg.array_cols


def make_job(config: NPUConfig, head_dim, seq_q, seq_kv, causal=False, kv_valid_len=None,
             mask=None, q_tile=0, seed=0, fill=0.0, q=None, k=None, v=None, name="",
             scale_q=1.0) -> QTileJob:
    """Random FP16 Q/K/V (or the given ones), padding filled with ``fill``,
    and the golden run with checkpoints."""
    rng = np.random.default_rng(seed)
    br, bc, mhd = config.br, config.bc, config.max_head_dim
    if q is None:
        q = (rng.standard_normal((1, seq_q, head_dim)) * scale_q).astype(np.float16)
    if k is None:
        k = rng.standard_normal((1, seq_kv, head_dim)).astype(np.float16)
    if v is None:
        v = rng.standard_normal((1, seq_kv, head_dim)).astype(np.float16)
    g = flash_attention_hw(q, k, v, causal=causal, mask=mask, kv_valid_len=kv_valid_len,
                           config=config, checkpoints=True)
    n_kv = -(-seq_kv // bc)
    f16 = np.float16(fill)
    qt = np.full((br, mhd), f16, np.float16)
    r0 = q_tile * br
    rows = min(br, seq_q - r0)
    qt[:rows, :head_dim] = q[0, r0:r0 + rows]
    kt = np.full((n_kv * bc, mhd), f16, np.float16)
    vt = np.full((n_kv * bc, mhd), f16, np.float16)
    kt[:seq_kv, :head_dim] = k[0]
    vt[:seq_kv, :head_dim] = v[0]
    mt = None
    if mask is not None:
        mt = np.zeros((br, n_kv * bc), bool)
        mt[:rows, :seq_kv] = np.asarray(mask, bool)[r0:r0 + rows]
    c = nx.scale_log2e(1.0 / math.sqrt(head_dim))
    return QTileJob(config, head_dim, seq_q, seq_kv, r0, causal,
                    seq_kv if kv_valid_len is None else int(kv_valid_len),
                    int(np.float32(c).view(np.uint32)), qt.view(np.uint16), kt.view(np.uint16),
                    vt.view(np.uint16), mt, g, name)


@dataclass
class CoreRun:
    """What the core produced: per-tile register dumps and O."""
    regs: dict = field(default_factory=dict)    # (tile, PausePoint) -> uint32 [R, C, regs]
    o_beats: list = field(default_factory=list)  # (row, n, uint32[C])
    counters: dict = field(default_factory=dict)
    cycles: int = 0
    o: np.ndarray | None = None                  # final O [valid rows, head_dim] (check_run)
    overlap: bool = False                        # kv tile j used S block j % 2


class CoreDriver:
    """Drives one ``Core`` through the ``Io`` adapter (see the module docstring)."""

    COUNTERS = ("cnt_total", "cnt_mac", "cnt_softmax", "cnt_stall", "cnt_tile_last",
                "cnt_tile_sum", "ops_mac", "ops_exp2", "ops_recip", "ops_masked")

    def __init__(self, io, config: NPUConfig, seed=0, backpressure=0.0, idle=None, log=print):
        self.io, self.cfg = io, config
        self.rng = random.Random(seed)
        self.backpressure = backpressure
        self.idle = backpressure if idle is None else idle   # write-stream idle cycles
        self.log = log
        self.BufSel, self.PausePoint, self.Phase = BufSel, PausePoint, Phase
        self.cmd_l, self.out_l, self.wr_l = cmd_layout(config), out_layout(config), write_layout(config)
        self.g = RegMap(config)
        self.run = None
        self.cycle = 0

    # ----------------------------------------------------------- primitives
    async def tick(self):
        io = self.io
        ready = 1 if self.rng.random() >= self.backpressure else 0
        io.set("o__ready", ready)
        if ready and io.get("o__valid") and self.run is not None:
            p = unpack(self.out_l, io.get("o__payload"))
            data = int_to_u32(p["data"], self.cfg.array_cols)
            self.run.o_beats.append((p["row"], p["n"], data))
        await io.tick()
        self.cycle += 1

    def idle_inputs(self):
        for name in ("cmd__valid", "wr__valid", "resume", "o__ready", "dbg_addr", "dbg_row", "inject"):
            self.io.set(name, 0)

    async def write_rows(self, sel, rows: np.ndarray):
        io = self.io
        for i, row in enumerate(rows):
            if sel == self.BufSel.MASK:
                data = int(sum(1 << j for j, bit in enumerate(row) if bit))
            else:
                data = lanes_to_int(row)
            io.set("wr__payload", pack(self.wr_l, dict(sel=sel, row=i, last=int(i == len(rows) - 1),
                                                        data=data)))
            io.set("wr__valid", 1)
            await self.tick()
            while self.rng.random() < self.idle:       # random gaps in the write stream
                io.set("wr__valid", 0)
                await self.tick()
        io.set("wr__valid", 0)

    async def read_regs(self, addrs):
        """Register ``addrs`` of every PE -> uint32 [R, C, len(addrs)]."""
        R, C = self.cfg.array_rows, self.cfg.array_cols
        out = np.zeros((R, C, len(addrs)), np.uint32)
        for ai, addr in enumerate(addrs):
            for r in range(R):
                self.io.set("dbg_addr", addr)
                self.io.set("dbg_row", r)
                await self.tick()
                out[r, :, ai] = int_to_u32(self.io.get("dbg_data"), C)
        return out

    # ----------------------------------------------------------------- job
    def check_registers(self):
        """Raise ``RegisterCheckError`` when the core's register check has fired."""
        io = self.io
        if io.get("reg_err"):
            reg, tile = io.get("reg_err_addr"), io.get("reg_err_tile")
            phase = self.Phase(io.get("reg_err_phase"))
            raise RegisterCheckError(
                f"PE register {reg} ({register_name(self.cfg, reg)}) read before it was written "
                f"or while a write to it was in flight "
                f"(phase {phase.name}, kv tile {tile}); the core stopped", reg, phase, tile)

    async def run_job(self, job: QTileJob, pause=(), max_cycles=2_000_000, inject=0) -> CoreRun:
        """Run one q tile; ``inject`` drives the core's test-only ``inject``
        port (``Inject`` bits).  Raises ``RegisterCheckError`` if the core's
        register check fires, ``TimeoutError`` after ``max_cycles``."""
        cfg, io, B = self.cfg, self.io, self.BufSel
        io.set("inject", inject)
        bc = cfg.bc
        self.run = run = CoreRun()
        n_kv = job.n_kv
        pmask = sum(1 << int(p) for p in pause)
        # the S and S_RAW pause points stop the core between Q.K^T and the
        # softmax, so the core runs its phases one after the other then
        run.overlap = cfg.overlaps_softmax and not {PausePoint.S_RAW, PausePoint.S} & set(pause)
        # Q first (the core waits for it)
        while io.get("full") & (1 << B.Q):
            await self.tick()
        await self.write_rows(B.Q, job.q_tile)
        cmd = dict(head_dim=job.head_dim, n_kv=n_kv, c=job.c_bits, causal=int(job.causal),
                   q_row0=job.q_row0, seq_q=job.seq_q, seq_kv=job.seq_kv,
                   kv_valid_len=job.kv_valid_len, mask_en=int(job.mask is not None), pause=pmask)
        io.set("cmd__payload", pack(self.cmd_l, cmd))
        io.set("cmd__valid", 1)
        while True:
            accepted = io.get("cmd__ready")
            await self.tick()
            if accepted:
                break
        io.set("cmd__valid", 0)
        if io.get("err"):
            raise ValueError(f"core rejected the command {cmd}")
        start = self.cycle
        next_k = next_v = next_m = 0
        all_regs = list(range(self.g.used))
        while True:
            full = io.get("full")
            if next_k < n_kv and not full & (1 << (B.K0 if next_k % 2 == 0 else B.K1)):
                await self.write_rows(B.K0 if next_k % 2 == 0 else B.K1,
                                      job.k[next_k * bc:(next_k + 1) * bc])
                next_k += 1
                continue
            if next_v < n_kv and not full & (1 << (B.V0 if next_v % 2 == 0 else B.V1)):
                await self.write_rows(B.V0 if next_v % 2 == 0 else B.V1,
                                      job.v[next_v * bc:(next_v + 1) * bc])
                next_v += 1
                continue
            if job.mask is not None and next_m < n_kv and not full & (1 << B.MASK):
                await self.write_rows(B.MASK, job.mask[:, next_m * bc:(next_m + 1) * bc])
                next_m += 1
                continue
            if io.get("paused"):
                point = self.PausePoint(io.get("pause_at"))
                tile = io.get("tile")
                if point == self.PausePoint.TILE:
                    tile -= 1
                run.regs[(tile, point)] = await self.read_regs(all_regs)
                io.set("resume", 1)
                await self.tick()
                io.set("resume", 0)
                continue
            self.check_registers()
            if io.get("phase") == self.Phase.IDLE and self.cycle > start + 1:
                break
            if self.cycle - start > max_cycles:
                raise TimeoutError(f"core did not finish within {max_cycles} cycles "
                                   f"(phase {self.Phase(io.get('phase')).name})")
            await self.tick()
        self.check_registers()
        run.cycles = self.cycle - start
        run.counters = {n: io.get(n) for n in self.COUNTERS}
        self.run = None
        return run


    async def run_jobs(self, jobs, max_cycles=2_000_000) -> tuple:
        """Run q tiles back to back, as the NPU's controller and loader feed
        them: each command is offered as soon as the one before was taken
        and its Q is in the Q buffer (written once the buffer is free), and
        each job's K/V/mask tiles follow the previous job's.  Returns
        ``(runs, accepted_in)``: one ``CoreRun`` per job (its O beats, in
        order; ``cycles`` from the first command's accept to the job's last
        beat) and the core's phase in the cycle each command was taken.
        Raises ``RegisterCheckError`` or ``TimeoutError`` as ``run_job``."""
        cfg, io, B = self.cfg, self.io, self.BufSel
        bc = cfg.bc
        od = [-(-j.head_dim // cfg.array_cols) for j in jobs]
        beats = [min(cfg.br, j.seq_q - j.q_row0) * o for j, o in zip(jobs, od)]
        runs = [CoreRun() for _ in jobs]
        self.run = collect = CoreRun()
        accepted_in = []
        nq = ci = li = 0                     # Q tiles written, commands taken, job loading
        nxt = {"k": 0, "v": 0, "m": 0}
        start = None
        while True:
            full = io.get("full")
            job = jobs[li] if li < len(jobs) else None
            moved = False
            # a command is offered only between buffer writes, so none is
            # taken unseen while rows go in
            io.set("cmd__valid", 0)
            if nq < len(jobs) and nq <= ci and not full & (1 << B.Q):
                await self.write_rows(B.Q, jobs[nq].q_tile)
                nq += 1
                continue
            if job is not None:
                for key, b0, b1, src in (("k", B.K0, B.K1, job.k), ("v", B.V0, B.V1, job.v),
                                         ("m", B.MASK, B.MASK, job.mask)):
                    t = nxt[key]
                    if src is None or t >= job.n_kv or full & (1 << (b0 if t % 2 == 0 else b1)):
                        continue
                    rows = src[:, t * bc:(t + 1) * bc] if key == "m" else src[t * bc:(t + 1) * bc]
                    await self.write_rows(b0 if t % 2 == 0 else b1, rows)
                    nxt[key] += 1
                    moved = True
                    break
                if all(nxt[k] >= job.n_kv for k in "kv") and (job.mask is None or nxt["m"] >= job.n_kv):
                    li += 1
                    nxt = {"k": 0, "v": 0, "m": 0}
                if moved:
                    continue
            offer = ci < nq and ci < len(jobs)
            if offer:
                j = jobs[ci]
                cmd = dict(head_dim=j.head_dim, n_kv=j.n_kv, c=j.c_bits, causal=int(j.causal),
                           q_row0=j.q_row0, seq_q=j.seq_q, seq_kv=j.seq_kv, kv_valid_len=j.kv_valid_len,
                           mask_en=int(j.mask is not None), pause=0)
                io.set("cmd__payload", pack(self.cmd_l, cmd))
            io.set("cmd__valid", int(offer))
            taken = offer and io.get("cmd__ready")
            phase = self.Phase(io.get("phase"))
            self.check_registers()
            await self.tick()
            if taken:
                accepted_in.append(phase)
                ci += 1
                start = self.cycle - 1 if start is None else start
                io.set("cmd__valid", 0)
            done = len(collect.o_beats)
            for i, run in enumerate(runs):
                if not run.cycles and done >= sum(beats[:i + 1]):
                    run.cycles = self.cycle - start
            if done >= sum(beats) and phase == self.Phase.IDLE and ci == len(jobs):
                break
            if start is not None and self.cycle - start > max_cycles:
                raise TimeoutError(f"core did not finish within {max_cycles} cycles (phase {phase.name})")
        self.run = None
        k = 0
        for run, n in zip(runs, beats):
            run.o_beats, k = collect.o_beats[k:k + n], k + n
        return runs, accepted_in


# ----------------------------------------------------------------- scoreboard
def check_run(job: QTileJob, run: CoreRun, log=print):
    """Compare every dumped checkpoint and the final O with the golden model.

    Raises ``ComparisonError`` naming tile, PE, register, expected, actual.
    Returns the number of values compared.
    """
    cfg = job.config
    g = RegMap(cfg)
    C, wr, wc = cfg.array_cols, g.wr, g.wc
    br, bc, hd = cfg.br, cfg.bc, job.head_dim
    od = cfg.o_cols_per_pe(hd)
    r0 = job.q_row0
    nrows = min(br, job.seq_q - r0)            # valid query rows of the tile
    gold = job.golden
    count = 0

    def f32(u):
        return np.asarray(u, np.uint32).view(np.float32)

    def s_block(regs, p=0):
        """[R, C, regs] -> [Br, Bc] uint32 of the S/P registers of block ``p``."""
        out = np.zeros((br, bc), np.uint32)
        for a in range(wr):
            for b in range(wc):
                out[a::wr, b::wc] = regs[:, :, g.S(a, b, p)]
        return out

    def sp_where(tile, what):
        return lambda idx: (f"kv tile {tile}, PE (r={idx[0] // wr}, c={idx[1] // wc}), register "
                            f"{what}(a={idx[0] % wr}, b={idx[1] % wc})")

    for (tile, point), regs in sorted(run.regs.items()):
        cp = gold.checkpoints[tile]
        if point in (PausePoint.S_RAW, PausePoint.S):
            s = f32(s_block(regs))[:nrows]
            if point == PausePoint.S_RAW:
                # S_raw is only defined where the core runs the MACs (it
                # skips masked positions, padding keys included)
                vis = computed_positions(job)[:nrows, tile * bc:(tile + 1) * bc]
                exp = cp.S_raw[0, r0:r0 + nrows]
                assert_bit_exact(np.where(vis, s, 0), np.where(vis, exp, 0).astype(np.float32), "S_raw",
                                 where=sp_where(tile, "S"))
            else:
                assert_bit_exact(s, cp.S[0, r0:r0 + nrows], "S", where=sp_where(tile, "S"))
            count += s.size
            continue
        # tile end: P, m, l, O_acc (and every PE's copy of m, l)
        p = s_block(regs, tile % 2 if run.overlap else 0)
        if (p >> 16).any():
            idx = np.argwhere((p >> 16) != 0)[0]
            raise AssertionError(f"kv tile {tile}: P register of row {idx[0]} col {idx[1]} has "
                                 f"upper bits set: 0x{int(p[tuple(idx)]):08x}")
        p16 = p.astype(np.uint16).view(np.float16)[:nrows]
        assert_bit_exact(p16, cp.P[0, r0:r0 + nrows], "P", where=sp_where(tile, "P"))
        count += p16.size
        for name, base, gv in (("m_i", g.m_base, cp.m_i), ("l_i", g.l_base, cp.l_i)):
            vals = np.zeros((br, C), np.uint32)
            for a in range(wr):
                vals[a::wr] = regs[:, :, base + a]
            exp = np.repeat(gv[0, r0:r0 + nrows, None], C, axis=1).astype(np.float32)
            assert_bit_exact(f32(vals[:nrows]), exp, name,
                             where=lambda idx, name=name: (
                                 f"kv tile {tile}, PE (r={idx[0] // wr}, c={idx[1]}), register "
                                 f"{name}(a={idx[0] % wr})"))
            count += exp.size
        o = np.zeros((br, C * od), np.uint32)
        for a in range(wr):
            for n in range(od):
                o[a::wr, n::od] = regs[:, :, g.O(a, n)]
        assert_bit_exact(f32(o[:nrows, :hd]), cp.O_acc[0, r0:r0 + nrows],
                         "O_acc", where=lambda idx: (
                             f"kv tile {tile}, PE (r={idx[0] // wr}, c={idx[1] // od}), register "
                             f"O_acc(a={idx[0] % wr}, n={idx[1] % od})"))
        count += nrows * hd
    # final O from the stream
    beats = {(row, n): d for row, n, d in run.o_beats}
    exp_beats = nrows * od                   # the read-out stops after the last valid row
    if len(run.o_beats) != exp_beats or len(beats) != exp_beats:
        raise AssertionError(f"O stream: {len(run.o_beats)} beats ({len(beats)} distinct), "
                             f"expected {exp_beats}")
    o = np.zeros((br, C * od), np.uint32)
    for (row, n), d in beats.items():
        o[row, n::od] = d
    assert_bit_exact(f32(o[:nrows, :hd]), gold.o[0, r0:r0 + nrows], "O",
                     where=lambda idx: (f"final O row {idx[0]} (PE r={idx[0] // wr}), column "
                                        f"{idx[1]} (PE c={idx[1] // od}, n={idx[1] % od})"))
    count += nrows * hd
    run.o = f32(o[:nrows, :hd]).copy()
    return count


# ------------------------------------------------------------------ building
#: Verilator arguments of core builds: the PE row is a ``hier_block`` (see
#: ``hdl.array.module_texts``), verilated and compiled once.
CORE_BUILD_ARGS = ["--hierarchical"]


def build_core(config: NPUConfig, sim: str = "verilator", waves: bool = False):
    """Build (or reuse) the core's Verilog model for ``config``; returns the
    runner's ``BuildHandle``."""
    return runner.build(lambda: Core(config, pe_as_instance=True), config, CORE_MODULE, sim=sim,
                        waves=waves, key="core", verilog_text=lambda top: core_verilog(config, top=top),
                        build_args=CORE_BUILD_ARGS if sim == "verilator" else None)
