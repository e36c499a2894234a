"""The NPU's job controller: checks a started job, walks its q tiles, hands
each one to the core, the tile loader and the O writer, and issues its DMA
descriptors.

Dataflow (ports of :class:`Controller`)::

   CSRs ──job registers──► check ─► q-tile walk ──cmd────► core
                                         │ ──qtile──► tile loader   (qtile_layout)
                                         │ ──otile──► O writer      (otile_layout)
                                         └─ issue ──desc───► DMA port (Q, K, V, mask)
   failures (DMA, core, loader) ──► FAIL;  status / irq ──► CSRs

Loop order: KV head ─► query head of its group ─► q tile (Br query rows).
In decode (seq_q == 1) the query heads of one KV group are stacked on the
rows of one q tile instead (Q rows at the head stride, causal off).

Per q tile the controller waits until the core's command slot, the loader's
q-tile slot and a free entry of the O writer's destination table are all
empty (one q tile of issue-ahead: the next tile is handed over while the
previous one computes), hands the tile to all three in one cycle, then
issues Q, and for each kv tile K, V and mask descriptors (only the kv tiles
not yet resident in SRAM), one per cycle as the DMA port has room; the O
writer's write-back descriptors take precedence.

Skipping masked kv tiles: for q rows [q0, q0+nq) the last visible key is
min(seq_kv, kv_valid_len, causal limit q0+nq-1+seq_kv-seq_q); tiles beyond
it are neither loaded nor computed (``n_kv`` of the core command).  At least
one tile runs, so a q tile without any visible key still yields zeros.

K/V residency (argued in ``npu.py``): when every kv tile of a KV head has
an SRAM slot, kv tile j is DMA'd once, into slot j, by the first q tile that
needs it; otherwise K/V stream through slots 0 and 1 as the DMA's
ping-pong halves.
"""

from __future__ import annotations

import enum

from amaranth import Cat, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from flashnpu.config import NPUConfig

from .core import cmd_layout
from .csr import RegisterMap
from .dma import Direction, descriptor_layout
from .npu_map import COUNT_BITS, JOB_REGS, LEN_BITS, NPUError, Tag, job_layout, otile_layout, qtile_layout, sram_map

__all__ = ["CtrlState", "Controller"]


class CtrlState(enum.IntEnum):
    """Controller state (``status.state``)."""
    IDLE = 0
    DIV = 1          #: group size heads / kv_heads
    CHECK = 2        #: job validation
    SETUP = 3        #: q tile: rows, head
    SETUP2 = 4       #: q tile: addresses, kv tiles to run
    CMD = 5          #: wait for the core's command slot and the loader; hand the q tile over
    ISSUE = 6        #: Q, K/V(/mask) descriptors of the q tile
    DRAIN = 9        #: last q tile issued: wait for every O write-back
    NEXT = 10        #: advance q tile / head / kv head
    DONE = 11
    FAIL = 12        #: a simulation-time check fired; reset to leave


def div_const(v, d: int):
    """v // d for a constant d (a shift when d is a power of two)."""
    if d & (d - 1) == 0:
        return v >> exact_log2(d)
    return v // d


class Controller(wiring.Component):
    """Job controller (see the module docstring).

    Parameters
    ----------
    config : NPUConfig
    regmap : RegisterMap
        The NPU's map (``register_map``): the job-register ports take its shapes.

    Ports
    -----
    <name> : In(register shape), for each name in ``JOB_REGS``
        The job registers (CSR values), read by field.
    start : In(1)             ``ctrl.start`` pulse; taken in IDLE only.
    link_ok : In(1)           both TSV links repaired and up.
    core_busy, core_err, reg_err : In(1)
        The core runs a q tile / refused a command / read an unwritten register.
    ld_busy, ld_fail : In(1), ld_fail_code : In(NPUError)
        The tile loader holds a q tile / one of its checks fired (``BUF_OVERWRITE``,
        ``KV_STALE``).
    dma_fail : In(1), dma_fail_code : In(NPUError), dma_code : In(8)
        A DMA check fired (DMA port), and the last DMA error code.
    dma_pending, dma_idle : In(1)
        The DMA port holds a descriptor / holds none and none is outstanding.
    o_idle : In(1)            every q tile handed to the O writer is written back.
    cmd : Out(stream(cmd_layout))        q-tile commands to the core.
    qtile : Out(stream(qtile_layout))    q tiles to the tile loader.
    otile : Out(stream(otile_layout))    O destinations to the O writer.
    desc : Out(stream(descriptor_layout))  Q/K/V/mask descriptors (``ready``
        is the DMA port's room, also without ``valid``).
    job : Out(job_layout)     the running job, for the datapath blocks.
    pp_half_bytes : Out(32)   ping-pong half size for the DMA (0 when resident).
    job_start : Out(1)        one cycle: a job starts (blocks clear their state).
    running : Out(1)          a job runs (not IDLE, FAIL or DONE).
    active : Out(1)           not IDLE and not FAIL.
    status : Out(status shape), irq : Out(irq shape)  to the CSRs (``irq``: set bits).
    """

    def __init__(self, config: NPUConfig, regmap: RegisterMap):
        self.config = config
        self.map = sram_map(config)
        members = {name: In(regmap[name].shape) for name in JOB_REGS}
        members.update({
            "start": In(1), "link_ok": In(1),
            "core_busy": In(1), "core_err": In(1), "reg_err": In(1),
            "ld_busy": In(1), "ld_fail": In(1), "ld_fail_code": In(NPUError),
            "dma_fail": In(1), "dma_fail_code": In(NPUError), "dma_code": In(8),
            "dma_pending": In(1), "dma_idle": In(1), "o_idle": In(1),
            "cmd": Out(stream.Signature(cmd_layout(config))),
            "qtile": Out(stream.Signature(qtile_layout(config))),
            "otile": Out(stream.Signature(otile_layout(config))),
            "desc": Out(stream.Signature(descriptor_layout)),
            "job": Out(job_layout(config)), "pp_half_bytes": Out(32),
            "job_start": Out(1), "running": Out(1), "active": Out(1),
            "status": Out(regmap["status"].shape), "irq": Out(regmap["irq"].shape),
        })
        super().__init__(members)

    # ------------------------------------------------------------------ checks
    def _check(self, m, kvl, rem, n_kv_all):
        """The job's ``NPUError`` before anything moves (comb): head_dim, zero
        lengths, heads % kv_heads (``rem``), alignment to the bus word,
        strides, every tensor's extent inside DRAM, the TSV links."""
        cfg = self.config
        W = self.map["W"]
        heads, kv_heads = self.heads.heads, self.heads.kv_heads
        seq_q, seq_kv = self.seq.seq_q, self.seq.seq_kv
        hd = self.head_dim.head_dim
        mask_en = self.flags.mask_en
        mis = Signal()
        terms = [getattr(self, n) for n in ("q_base", "k_base", "v_base", "o_base", "q_head_stride",
                                            "q_row_stride", "k_head_stride", "k_row_stride", "v_head_stride",
                                            "v_row_stride", "o_head_stride", "o_row_stride")]
        mterms = [getattr(self, n) for n in ("mask_base", "mask_head_stride", "mask_tile_stride")]
        m.d.comb += mis.eq(Cat(*[(t & (W - 1)) != 0 for t in terms]).any()
                           | (mask_en & Cat(*[(t & (W - 1)) != 0 for t in mterms]).any()))
        # tensor ends: base + (heads-1)*head stride + (rows-1)*row stride + row bytes
        end_bits = 32 + LEN_BITS + 4
        ends = []
        for base, hs, rs, nh, ns, eb in (("q_base", "q_head_stride", "q_row_stride", heads, seq_q, 2),
                                         ("k_base", "k_head_stride", "k_row_stride", kv_heads, seq_kv, 2),
                                         ("v_base", "v_head_stride", "v_row_stride", kv_heads, seq_kv, 2),
                                         ("o_base", "o_head_stride", "o_row_stride", heads, seq_q, 4)):
            e = Signal(end_bits, name=f"end_{base[0]}")
            m.d.comb += e.eq(getattr(self, base) + (nh - 1) * getattr(self, hs) + (ns - 1) * getattr(self, rs)
                             + eb * hd)
            ends.append(e)
        e_m = Signal(end_bits)
        m.d.comb += e_m.eq(self.mask_base + (heads - 1) * self.mask_head_stride
                           + (n_kv_all - 1) * self.mask_tile_stride + seq_q * W)
        out_range = Cat(*[e > cfg.dram_bytes for e in ends]).any() | (mask_en & (e_m > cfg.dram_bytes))
        bad_stride = ((seq_q > 1) & (self.o_row_stride < 4 * hd)) | \
                     ((seq_q == 1) & (heads > 1) & (self.o_head_stride < 4 * hd))
        code = Signal(NPUError)
        with m.If((hd == 0) | (hd > cfg.max_head_dim)):
            m.d.comb += code.eq(NPUError.BAD_HEAD_DIM)
        with m.Elif((heads == 0) | (kv_heads == 0) | (seq_q == 0) | (seq_kv == 0)):
            m.d.comb += code.eq(NPUError.ZERO_LENGTH)
        with m.Elif(rem != 0):
            m.d.comb += code.eq(NPUError.BAD_HEADS)
        with m.Elif(mis):
            m.d.comb += code.eq(NPUError.MISALIGNED)
        with m.Elif(bad_stride):
            m.d.comb += code.eq(NPUError.BAD_STRIDE)
        with m.Elif(out_range):
            m.d.comb += code.eq(NPUError.RANGE)
        with m.Elif(~self.link_ok):
            m.d.comb += code.eq(NPUError.LINK_DOWN)
        return code

    # ------------------------------------------------------------- the FSM
    def elaborate(self, platform):
        """The job FSM; the checks (``_check``), the issue of one q tile's
        descriptors (``_issue``), the step to the next q tile (``_advance``)
        and the failure sources (``_failure``) are their own methods."""
        m = Module()
        cfg = self.config
        Br, Bc, C = cfg.br, cfg.bc, cfg.array_cols
        heads, kv_heads = self.heads.heads, self.heads.kv_heads
        seq_q, seq_kv = self.seq.seq_q, self.seq.seq_kv
        hd = self.head_dim.head_dim
        causal, mask_en = self.flags.causal, self.flags.mask_en

        State = CtrlState
        state = Signal(State)
        err = Signal(NPUError)
        done_flag = Signal()
        irq_done, irq_error = Signal(), Signal()     # set bits of ``irq``, this cycle
        busy = state != State.IDLE
        running = busy & (state != State.FAIL) & (state != State.DONE)
        m.d.comb += [self.job_start.eq((state == State.IDLE) & self.start),
                     self.running.eq(running),
                     self.active.eq(busy & (state != State.FAIL)),
                     self.status.busy.eq(busy), self.status.done.eq(done_flag),
                     self.status.error.eq(err), self.status.dma_code.eq(self.dma_code),
                     self.status.state.eq(state),
                     # outside the FSM's process, so the register's unused bits are plain wires
                     self.irq.done.eq(irq_done), self.irq.error.eq(irq_error)]

        # job values
        G = Signal(LEN_BITS)                 # group size heads / kv_heads
        rem = Signal(LEN_BITS)
        kvl = Signal(LEN_BITS)
        m.d.comb += kvl.eq(Mux(self.kv_valid_len.kv_valid_len < seq_kv, self.kv_valid_len.kv_valid_len, seq_kv))
        stacked = Signal()                   # decode mapping: seq_q == 1
        job = self.job
        m.d.comb += [job.head_dim.eq(hd), job.mask_en.eq(mask_en), job.double_q.eq(self.debug.inject_double_q),
                     job.kv_extra.eq(self.debug.inject_kv_extra), job.stale_limit.eq(self.kv_stale_limit),
                     self.pp_half_bytes.eq(Mux(job.resident, 0, self.map["pp_half"]))]
        n_kv_all = Signal(LEN_BITS + 1)
        m.d.comb += n_kv_all.eq(div_const(seq_kv + Bc - 1, Bc))
        n_kv_need = Signal(LEN_BITS + 1)     # kv tiles any q tile of the job can see
        m.d.comb += n_kv_need.eq(div_const(kvl + Bc - 1, Bc))
        code = self._check(m, kvl, rem, n_kv_all)

        # the q-tile walk
        w = _Walk(cfg)
        t_iss = Signal(COUNT_BITS)           # q tiles handed over so far (this one's index)
        kv_gcnt = Signal(COUNT_BITS)         # K/V tile pairs issued in the job
        head_base = Signal(COUNT_BITS)       # kv_gcnt at this KV head's tile 0
        m_gcnt = Signal(COUNT_BITS)          # mask tiles issued in the job

        # core command and the loader's q tile: valid until taken
        with m.If(self.cmd.valid & self.cmd.ready):
            m.d.sync += self.cmd.valid.eq(0)
        with m.If(self.qtile.valid & self.qtile.ready):
            m.d.sync += self.qtile.valid.eq(0)
        # the O writer's destination entry: offered in CMD, taken with the rest
        m.d.comb += [self.otile.valid.eq((state == State.CMD) & ~self.cmd.valid & ~self.qtile.valid),
                     self.otile.payload.nq.eq(w.nq), self.otile.payload.dst.eq(w.o_dst),
                     self.otile.payload.stride.eq(w.o_str)]

        with m.Switch(state):
            with m.Case(State.IDLE):
                with m.If(self.start):
                    m.d.sync += [state.eq(State.DIV), err.eq(NPUError.OK), done_flag.eq(0),
                                 G.eq(0), rem.eq(heads), t_iss.eq(0), kv_gcnt.eq(0), m_gcnt.eq(0),
                                 self.qtile.valid.eq(0)]
            with m.Case(State.DIV):
                # G = heads / kv_heads by repeated subtraction (heads <= 65535 cycles)
                with m.If((kv_heads != 0) & (rem >= kv_heads)):
                    m.d.sync += [rem.eq(rem - kv_heads), G.eq(G + 1)]
                with m.Else():
                    m.d.sync += state.eq(State.CHECK)
            with m.Case(State.CHECK):
                with m.If(code != NPUError.OK):
                    m.d.sync += [err.eq(code), state.eq(State.DONE)]
                with m.Else():
                    m.d.sync += [state.eq(State.SETUP), w.kvh.eq(0), w.hg.eq(0), w.q0.eq(0),
                                 stacked.eq(seq_q == 1),
                                 job.od.eq((hd + C - 1) >> exact_log2(C)),
                                 job.resident.eq(n_kv_need <= cfg.kv_slots),
                                 w.kv_loaded.eq(0), w.new_head.eq(1), head_base.eq(0)]
            with m.Case(State.SETUP):
                # tile rows, head
                with m.If(stacked):
                    m.d.sync += w.nq.eq(Mux(G - w.hg > Br, Br, G - w.hg))
                with m.Else():
                    m.d.sync += w.nq.eq(Mux(seq_q - w.q0 > Br, Br, seq_q - w.q0))
                m.d.sync += [w.h.eq(w.kvh * G + w.hg), state.eq(State.SETUP2)]
            with m.Case(State.SETUP2):
                t = Signal(LEN_BITS + 2)
                ce = Signal(LEN_BITS + 1)
                e0 = Signal(LEN_BITS + 1)
                m.d.comb += [t.eq(w.q0 + w.nq + seq_kv), ce.eq(Mux(t > seq_q, t - seq_q, 0)),
                             e0.eq(Mux(causal & ~stacked & (ce < kvl), ce, kvl))]
                nk_all = Signal(LEN_BITS + 1)
                m.d.comb += nk_all.eq(div_const(e0 + Bc - 1, Bc))
                W = self.map["W"]
                m.d.sync += [
                    w.kv_end.eq(e0), w.kv_left.eq(e0), w.kvo.eq(0), w.n_kv.eq(Mux(nk_all == 0, 1, nk_all)),
                    w.q_src.eq(self.q_base + w.h * self.q_head_stride + w.q0 * self.q_row_stride),
                    w.q_str.eq(Mux(stacked, self.q_head_stride, self.q_row_stride)),
                    w.o_dst.eq(self.o_base + w.h * self.o_head_stride + w.q0 * self.o_row_stride),
                    w.o_str.eq(Mux(stacked, self.o_head_stride, self.o_row_stride)),
                    w.m_src.eq(self.mask_base + w.h * self.mask_head_stride + w.q0 * W),
                    w.m_str.eq(Mux(stacked, self.mask_head_stride, W)),
                    w.k_src.eq(self.k_base + w.kvh * self.k_head_stride),
                    w.v_src.eq(self.v_base + w.kvh * self.v_head_stride),
                    w.j.eq(0), w.item.eq(0), w.q_issued.eq(0), state.eq(State.CMD),
                ]
            with m.Case(State.CMD):
                # the core holds at most one pending command, the loader one
                # pending q tile, and the O writer ``O_TILES`` q tiles
                cmd, qt = self.cmd.payload, self.qtile.payload
                with m.If(self.otile.valid & self.otile.ready):
                    m.d.sync += [cmd.head_dim.eq(hd), cmd.n_kv.eq(w.n_kv), cmd.c.eq(self.scale_c),
                                 cmd.causal.eq(causal & ~stacked), cmd.q_row0.eq(Mux(stacked, 0, w.q0)),
                                 cmd.seq_q.eq(Mux(stacked, w.nq, seq_q)), cmd.seq_kv.eq(seq_kv),
                                 cmd.kv_valid_len.eq(kvl), cmd.mask_en.eq(mask_en), cmd.pause.eq(0),
                                 self.cmd.valid.eq(1), state.eq(State.ISSUE),
                                 self.qtile.valid.eq(1), qt.region.eq(t_iss[0]), qt.nq.eq(w.nq),
                                 qt.n_kv.eq(w.n_kv), qt.kv_end.eq(w.kv_end), qt.k_base.eq(head_base),
                                 qt.m_base.eq(m_gcnt), qt.seq.eq(t_iss)]
            with m.Case(State.ISSUE):
                self._issue(m, w, kvl, t_iss[0], kv_gcnt, m_gcnt)
                with m.If(w.q_issued & (w.j == w.n_kv) & ~self.dma_pending):
                    m.d.sync += state.eq(State.NEXT)
            with m.Case(State.NEXT):
                m.d.sync += t_iss.eq(t_iss + 1)
                new_kvh = self._advance(m, w, state, stacked, G)
                with m.If(new_kvh):
                    m.d.sync += [w.kv_loaded.eq(0), w.new_head.eq(1), head_base.eq(kv_gcnt)]
            with m.Case(State.DRAIN):
                with m.If(self.dma_idle & self.o_idle & ~self.qtile.valid & ~self.ld_busy
                          & ~self.cmd.valid & ~self.core_busy):
                    m.d.sync += state.eq(State.DONE)
            with m.Case(State.DONE):
                m.d.sync += [state.eq(State.IDLE), done_flag.eq(1)]
                m.d.comb += [irq_done.eq(1), irq_error.eq(err != NPUError.OK)]
            with m.Case(State.FAIL):
                # stays here until reset: the datapath may hold a half-done tile
                pass

        fail, fail_code = self._failure(m, busy)
        with m.If(fail & (state != State.FAIL) & busy):
            m.d.sync += [state.eq(State.FAIL), err.eq(fail_code), done_flag.eq(1)]
            m.d.comb += [irq_done.eq(1), irq_error.eq(1)]
        return m

    def _advance(self, m, w, state, stacked, G):
        """NEXT state: step (q0, hg, kvh) to the next q tile (stacked: hg by
        Br over the group), or to DRAIN after the last; returns the comb
        signal "a new KV head starts"."""
        Br = self.config.br
        State = CtrlState
        seq_q, kv_heads = self.seq.seq_q, self.heads.kv_heads
        new_kvh = Signal()
        with m.If(stacked):
            with m.If(w.hg + Br < G):
                m.d.sync += [w.hg.eq(w.hg + Br), state.eq(State.SETUP)]
            with m.Elif(w.kvh + 1 < kv_heads):
                m.d.sync += [w.hg.eq(0), w.kvh.eq(w.kvh + 1), state.eq(State.SETUP)]
                m.d.comb += new_kvh.eq(1)
            with m.Else():
                m.d.sync += state.eq(State.DRAIN)
        with m.Else():
            with m.If(w.q0 + Br < seq_q):
                m.d.sync += [w.q0.eq(w.q0 + Br), state.eq(State.SETUP)]
            with m.Elif(w.hg + 1 < G):
                m.d.sync += [w.q0.eq(0), w.hg.eq(w.hg + 1), state.eq(State.SETUP)]
            with m.Elif(w.kvh + 1 < kv_heads):
                m.d.sync += [w.q0.eq(0), w.hg.eq(0), w.kvh.eq(w.kvh + 1), state.eq(State.SETUP)]
                m.d.comb += new_kvh.eq(1)
            with m.Else():
                m.d.sync += state.eq(State.DRAIN)
        return new_kvh

    def _failure(self, m, busy):
        """(fail, code): a simulation-time check fired this cycle, and its
        ``NPUError``; the later source in this list wins: the DMA port's
        checks, a core reject, an unwritten register, the loader's checks."""
        fail = Signal()
        code = Signal(NPUError)
        m.d.comb += [fail.eq(self.dma_fail), code.eq(self.dma_fail_code)]
        for bad, c in ((self.core_err, NPUError.CORE_REJECT), (self.reg_err, NPUError.REG_UNWRITTEN)):
            with m.If(bad & busy):
                m.d.comb += [fail.eq(1), code.eq(c)]
        with m.If(self.ld_fail):
            m.d.comb += [fail.eq(1), code.eq(self.ld_fail_code)]
        return fail, code

    def _issue(self, m, w, kvl, region, kv_gcnt, m_gcnt):
        """ISSUE state: the q tile's Q descriptor, then per kv tile K, V (when
        not resident yet) and the mask tile, one per cycle as the DMA port
        has room (``desc.ready``, also without ``valid``)."""
        cfg, mp = self.config, self.map
        Br, Bc, W = cfg.br, cfg.bc, mp["W"]
        hd, mask_en = self.head_dim.head_dim, self.flags.mask_en
        resident = self.job.resident
        slot_bits = max(1, ceil_log2(cfg.kv_slots))
        d = self.desc.payload
        nk = Signal(LEN_BITS + 1)
        m.d.comb += nk.eq(Mux(w.kv_left >= Bc, Bc, Mux(w.kv_left == 0, 1, w.kv_left)))
        # resident tiles are loaded whole (up to kv_valid_len): a later q
        # tile of the head may see more of them than this one
        nk_res = Signal(LEN_BITS + 1)
        m.d.comb += nk_res.eq(Mux(kvl - w.kvo >= Bc, Bc, Mux(kvl <= w.kvo, 1, kvl - w.kvo)))
        half = w.j[0]
        hb = mp["pp"] + Mux(half, mp["pp_half"], 0)
        sb = Signal(32)
        m.d.comb += sb.eq(Mux(resident, mp["kv"] + w.j[:slot_bits] * mp["slot"], hb))
        need_kv = ~resident | (w.j >= w.kv_loaded)
        # a new KV head overwrites the slots only after the loader has
        # finished the previous q tile (it took this one's parameters)
        kv_block = resident & w.new_head & self.qtile.valid
        with m.If(w.new_head & ~self.qtile.valid):
            m.d.sync += w.new_head.eq(0)

        def put(src, dst, rows, src_stride, dst_stride, bpr, tag, pp=0, pp_half=0, commit=0):
            m.d.comb += [self.desc.valid.eq(1), d.src.eq(src), d.dst.eq(dst), d.rows.eq(rows),
                         d.bytes_per_row.eq(bpr), d.src_stride.eq(src_stride), d.dst_stride.eq(dst_stride),
                         d.direction.eq(Direction.DRAM_TO_SRAM), d.pp_en.eq(pp), d.pp_half.eq(pp_half),
                         d.pp_commit.eq(commit), d.tag.eq(tag)]

        def next_j():
            m.d.sync += [w.item.eq(0), w.j.eq(w.j + 1), w.kv_left.eq(w.kv_left - nk), w.kvo.eq(w.kvo + Bc),
                         w.k_src.eq(w.k_src + Bc * self.k_row_stride),
                         w.v_src.eq(w.v_src + Bc * self.v_row_stride),
                         w.m_src.eq(w.m_src + self.mask_tile_stride)]

        go = self.desc.ready
        with m.If(~w.q_issued):
            put(w.q_src, mp["q"] + Mux(region, mp["q_half"], 0), w.nq, w.q_str, mp["row_bytes"], 2 * hd, Tag.Q)
            with m.If(go):
                m.d.sync += w.q_issued.eq(1)
        with m.Elif(w.j == w.n_kv):
            pass
        with m.Elif(w.item == 0):
            with m.If(~need_kv):
                with m.If(go):
                    with m.If(mask_en):
                        m.d.sync += w.item.eq(2)
                    with m.Else():
                        next_j()
            with m.Elif(~kv_block):
                put(w.k_src, sb, Mux(resident, nk_res, nk), self.k_row_stride, mp["row_bytes"], 2 * hd,
                    Tag.K, pp=~resident, pp_half=half)
                with m.If(go):
                    m.d.sync += w.item.eq(1)
        with m.Elif(w.item == 1):
            put(w.v_src, sb + mp["slot_v"], Mux(resident, nk_res, nk), self.v_row_stride, mp["row_bytes"],
                2 * hd, Tag.V, pp=~resident, pp_half=half, commit=~resident & ~mask_en)
            with m.If(go):
                m.d.sync += [kv_gcnt.eq(kv_gcnt + 1), w.kv_loaded.eq(w.j + 1)]
                with m.If(mask_en):
                    m.d.sync += w.item.eq(2)
                with m.Else():
                    next_j()
        with m.Else():
            mdst = Signal(32)
            m.d.comb += mdst.eq(Mux(resident, mp["mres"] + Mux(region, mp["mres_half"], 0)
                                    + w.j[:slot_bits] * (Br * mp["mrow_bytes"]),
                                    hb + mp["pp_m"]))
            put(w.m_src, mdst, w.nq, w.m_str, mp["mrow_bytes"], W, Tag.M, pp=~resident, pp_half=half,
                commit=~resident)
            with m.If(go):
                m.d.sync += m_gcnt.eq(m_gcnt + 1)
                next_j()


class _Walk:
    """The registers of the q-tile walk: loop indices and the current q
    tile's rows, kv tiles and DRAM addresses (one place to declare them)."""

    def __init__(self, cfg: NPUConfig):
        addr = descriptor_layout["src"].shape
        stride = descriptor_layout["src_stride"].shape
        self.kvh = Signal(LEN_BITS)          # KV head
        self.hg = Signal(LEN_BITS)           # query head within its group (stacked: first row's)
        self.q0 = Signal(LEN_BITS)           # first query row of the q tile
        self.h = Signal(LEN_BITS)            # query head
        self.nq = Signal(range(cfg.br + 1))  # valid rows of the q tile
        self.kv_end = Signal(LEN_BITS + 1)   # keys visible to the q tile
        self.n_kv = Signal(cmd_layout(cfg)["n_kv"].shape)   # kv tiles the core runs
        self.q_src, self.o_dst, self.m_src = Signal(addr), Signal(addr), Signal(addr)
        self.k_src, self.v_src = Signal(addr), Signal(addr)
        self.q_str, self.o_str, self.m_str = Signal(stride), Signal(stride), Signal(stride)
        self.kv_left = Signal(LEN_BITS + 1)  # keys of the q tile not yet issued
        self.kvo = Signal(LEN_BITS + 1)      # first key of kv tile j
        self.j = Signal.like(self.n_kv)      # kv tile being issued
        self.item = Signal(2)                # 0 K, 1 V, 2 mask within a kv tile
        self.q_issued = Signal()
        self.kv_loaded = Signal(LEN_BITS + 1)   # resident: kv tiles of this KV head issued
        self.new_head = Signal()             # resident: first K/V of a KV head not yet issued

