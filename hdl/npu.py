"""The NPU top level: host CSR bank, job controller, tile loader, O writer,
the memory system (DRAM timing + TSV + DMA + SRAM) and the compute core.

Dataflow
--------
::

  host ─CSR bus─► CSRBank ─descriptor─► Controller ─desc─► DMA ─┐
                    ▲ status, counters    │ cmd          ▲ done  │ DRAM ─TSV─► DMA ─► SRAM
                    │                     ▼              │       │                    │
                    └────────────────── Core ◄── wr ── TileLoader ◄── SRAM port 1 ─────┘
                                          │ o (row, n, C lanes FP32)
                                          ▼
                                       OWriter ── SRAM port 2 ──► O region ─DMA─► DRAM

SRAM map (bytes, ``sram_map``): the Q tile (Br rows of ``row_bytes``), the
O tile (Br rows of ``orow_bytes``, FP32) and the DMA's ping-pong window of
two halves, each [K tile | V tile | mask tile] (Bc, Bc and Br rows).

Design trade-offs
-----------------
* **One q tile at a time, K/V prefetched.**  Per q tile the controller
  queues the Q descriptor, then K, V (and mask) descriptors of kv tiles
  0..n_kv-1 into alternating ping-pong halves; the DMA itself refuses to
  overwrite a half before the loader released it, so the controller only
  keeps ``queue_depth`` descriptors outstanding and the queue stays ahead of
  the array (tile j+1 streams in while j computes).  The next q tile starts
  after the O write-back of this one has completed: this serialises
  ~(DRAM latency + Q load + first K/V tile + O write-back) per q tile, the
  cost of keeping one Q region and one O region.  A second Q/O region would
  hide it; measured in ``results/npu.md``.
* **Loader between SRAM and the core.**  The core takes one whole FP16 row
  per beat; SRAM gives one bus word (W bytes) per cycle per port, so the
  loader assembles ``ceil(2*head_dim/W)`` words into a row and writes it.
  Only the valid rows of a partial tile are loaded (``last`` on the final
  one); the other rows keep stale data, which the core masks (case A5).
* **O row assembly.**  The core streams O in its natural layout (beat
  (row, n) carries O[row, od*c + n] in lane c); the writer permutes one row
  (od beats) into row-major FP32 in a register (one static permutation per
  possible od) and writes it word by word to the SRAM O region, so the DMA
  moves plain rows to DRAM.
* **Skipping masked kv tiles.**  For q rows [q0, q0+nq) the last visible key
  is min(seq_kv, kv_valid_len, causal limit q0+nq-1+seq_kv-seq_q); tiles
  beyond it are neither loaded nor computed (``n_kv`` of the core command;
  the golden model shows a fully masked tile changes no bit).  At least one
  tile runs, so a q tile without any visible key still yields zeros.
* **Decode.**  When seq_q == 1 the controller stacks the query heads of one
  KV group on the q tile's rows (Q rows at the head stride, causal off — a
  no-op for one query row — and the core's ``seq_q`` = rows in the tile).
* **Validation before anything moves.**  A started job is checked (head_dim,
  zero lengths, heads % kv_heads, alignment to the bus word, strides, every
  tensor's extent inside DRAM, the TSV links) and rejected with an
  ``NPUError`` code; nothing is written.

Simulation-time checks (status error codes, the job stops):
``BUF_OVERWRITE`` a tile-buffer row written into a half the core still
holds (checked on every loader write; injectable: ``debug.inject_double_q``
loads the Q tile twice), ``QUEUE_OVERFLOW`` a DMA completion with
``QUEUE_FULL`` (injectable: ``debug.no_queue_limit``), ``WATCHDOG`` a DMA
with descriptors outstanding that makes no progress for ``watchdog`` cycles,
``DMA`` any other DMA completion error (code in ``status.dma_code``).
"""

from __future__ import annotations

import enum

from amaranth import Cat, Const, Module, Mux, Signal, Value
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from flashnpu.config import NPUConfig

from .core import BufSel, Core
from .csr import CSRBank, Field, Register, RegisterMap
from .dma import DMAError, Direction, MemorySystem, descriptor_layout
from .dram import DRAMBackendSignature
from .mem_common import addr_bits_for, word_bytes

__all__ = ["NPUError", "Tag", "COUNTERS", "register_map", "sram_map", "sim_config", "NPU",
           "NPU_MODULE", "npu_verilog"]

NPU_MODULE = "flashnpu_npu"
QUEUE_DEPTH = 4
WATCHDOG_DEFAULT = 1 << 20


class NPUError(enum.IntEnum):
    """Job error codes (``status.error``), written once; the driver uses this enum."""
    OK = 0
    BAD_HEAD_DIM = 1      #: head_dim == 0 or > max_head_dim
    ZERO_LENGTH = 2       #: heads, kv_heads, seq_q or seq_kv is 0
    BAD_HEADS = 3         #: heads % kv_heads != 0
    MISALIGNED = 4        #: a base or stride is not a multiple of the bus word
    BAD_STRIDE = 5        #: O rows overlap (row/head stride < 4*head_dim)
    RANGE = 6             #: a tensor reaches outside DRAM
    LINK_DOWN = 7         #: a TSV link is not OK (run its self-test)
    DMA = 8               #: a DMA completion carried an error (see status.dma_code)
    QUEUE_OVERFLOW = 9    #: a descriptor was refused: queue full
    WATCHDOG = 10         #: the DMA made no progress for ``watchdog`` cycles
    BUF_OVERWRITE = 11    #: a tile-buffer write into a half the core still holds
    CORE_REJECT = 12      #: the core refused a q-tile command


class CtrlState(enum.IntEnum):
    """Controller state (``status.state``)."""
    IDLE = 0
    DIV = 1          #: group size heads / kv_heads
    CHECK = 2        #: job validation
    SETUP = 3        #: q tile: rows, head
    SETUP2 = 4       #: q tile: addresses, kv tiles to run
    CMD = 5          #: core command, loader start
    ISSUE = 6        #: Q, K/V(/mask) descriptors
    WAIT_CORE = 7    #: core finished, O rows in SRAM
    ISSUE_O = 8      #: O write-back descriptor
    DRAIN = 9        #: all completions in
    NEXT = 10        #: advance q tile / head / kv head
    DONE = 11
    FAIL = 12        #: a simulation-time check fired; reset to leave


class LoaderState(enum.IntEnum):
    """Tile-loader state: wait for a buffer (W*), stream it (Q, K, V, M)."""
    IDLE = 0
    WQ = 1
    Q = 2
    WK = 3
    K = 4
    WV = 5
    V = 6
    WM = 7
    M = 8
    REL = 9


def _zx(v, n: int):
    """``v`` (a value or enum-shaped signal) zero-extended or truncated to ``n`` bits."""
    v = Value.cast(v)
    return v[:n] if len(v) >= n else Cat(v, Const(0, n - len(v)))


def _div_const(v, d: int):
    """v // d for a constant d (a shift when d is a power of two)."""
    if d & (d - 1) == 0:
        return v >> exact_log2(d)
    return v // d


class Tag(enum.IntEnum):
    """DMA descriptor tags used by the controller."""
    Q = 0
    K = 1
    V = 2
    M = 3
    O = 4


#: performance counters, 64 bit each (``cnt_<name>_lo`` / ``_hi``), names of
#: ``scripts.perf_model.Counters``
COUNTERS = ("total_cycles", "mac_busy_cycles", "softmax_cycles", "dma_stall_cycles",
            "reg_bytes", "sram_bytes", "tsv_bytes", "dram_bytes",
            "mac_ops", "exp2_ops", "recip_ops", "q_tiles", "kv_tiles")

DESC_REGS = ("q_base", "k_base", "v_base", "o_base", "mask_base",
             "q_head_stride", "q_row_stride", "k_head_stride", "k_row_stride",
             "v_head_stride", "v_row_stride", "o_head_stride", "o_row_stride",
             "mask_head_stride", "mask_tile_stride")


def register_map(config: NPUConfig) -> RegisterMap:
    """The NPU's memory map (one source for the RTL bank and the host driver)."""
    rm = RegisterMap("flashnpu_npu")
    rm.add(Register("ctrl", "w1p", [Field("start", 1, 0, "start the programmed job")]))
    rm.add(Register("status", "ro", [Field("busy", 1, 0), Field("done", 1, 1, "last job finished"),
                                     Field("error", 8, 8, "NPUError of the last job"),
                                     Field("dma_code", 8, 16, "DMAError when error == DMA"),
                                     Field("state", 5, 24, "controller state")]))
    rm.add(Register("irq", "w1c", [Field("done", 1, 0, "job finished (ok or error)"),
                                   Field("error", 1, 1, "job finished with an error")]))
    for name in DESC_REGS:
        rm.add(Register(name, "rw", doc="DRAM byte address / stride in bytes (multiple of the bus word)"))
    rm.add(Register("heads", "rw", [Field("heads", 16, 0), Field("kv_heads", 16, 16)]))
    rm.add(Register("seq", "rw", [Field("seq_q", 16, 0), Field("seq_kv", 16, 16)]))
    rm.add(Register("head_dim", "rw", [Field("head_dim", 16, 0)]))
    rm.add(Register("flags", "rw", [Field("causal", 1, 0), Field("mask_en", 1, 1)]))
    rm.add(Register("kv_valid_len", "rw", [Field("kv_valid_len", 16, 0, "keys >= it are invisible")],
                    reset=0xFFFF))
    rm.add(Register("scale_c", "rw", doc="binary32 bits of numerics.scale_log2e(scale)"))
    rm.add(Register("watchdog", "rw", doc="DMA no-progress limit in cycles", reset=WATCHDOG_DEFAULT))
    rm.add(Register("debug", "rw", [Field("inject_double_q", 1, 0, "load the Q tile twice (tests)"),
                                    Field("no_queue_limit", 1, 1, "ignore the descriptor credit (tests)")]))
    rm.add(Register("tsv_ctl", "w1p", [Field("bist_rd", 1, 0), Field("bist_wr", 1, 1),
                                       Field("repair_we", 1, 2, "write tsv_repair into a map")]))
    rm.add(Register("tsv_repair", "rw", [Field("idx", 8, 0), Field("lane", 16, 8), Field("valid", 1, 24),
                                         Field("link", 1, 25, "0 = read link, 1 = write link")]))
    rm.add(Register("tsv_status", "ro", [Field("rd_status", 4, 0), Field("wr_status", 4, 4),
                                         Field("rd_ok", 1, 8), Field("wr_ok", 1, 9)]))
    S = config.tsv_spare_lanes
    for link in ("rd", "wr"):
        for i in range((S + 1) // 2):
            rm.add(Register(f"tsv_{link}_map{i}", "ro",
                            [Field("e0_lane", 15, 0), Field("e0_valid", 1, 15),
                             Field("e1_lane", 15, 16), Field("e1_valid", 1, 31)]))
    for name in COUNTERS:
        rm.add(Register(f"cnt_{name}_lo", "ro"))
        rm.add(Register(f"cnt_{name}_hi", "ro"))
    return rm


def sram_map(config: NPUConfig) -> dict:
    """SRAM regions in bytes: ``row_bytes`` (one FP16 tile row), ``orow_bytes``
    (one FP32 O row), ``q``, ``o``, ``pp`` (window base), ``pp_half``, offsets
    ``pp_v`` and ``pp_m`` inside a half, and ``end`` (bytes used)."""
    W = word_bytes(config)
    rup = lambda n: -(-n // W) * W
    rowb = rup(2 * config.max_head_dim)
    orowb = rup(4 * config.max_head_dim)
    q = 0
    o = q + config.br * rowb
    pp = o + config.br * orowb
    half = 2 * config.bc * rowb + config.br * W
    return dict(W=W, row_bytes=rowb, orow_bytes=orowb, q=q, o=o, pp=pp, pp_half=half,
                pp_v=config.bc * rowb, pp_m=2 * config.bc * rowb, end=pp + 2 * half)


def sim_config(config: NPUConfig) -> NPUConfig:
    """``config`` with the smallest power-of-two ``sram_bytes`` that holds the
    NPU's SRAM map (the 4 MiB default makes a slow build and changes no
    result; the golden model does not use ``sram_bytes``)."""
    need = sram_map(config)["end"]
    unit = config.sram_banks * config.sram_bank_bytes
    return config.replace(sram_bytes=max(unit, 1 << ceil_log2(need)))


class NPU(wiring.Component):
    """The whole NPU.

    Parameters
    ----------
    config : NPUConfig
        ``sram_bytes`` must hold ``sram_map(config)`` (see ``sim_config``).
    pe_as_instance : bool
        Core PEs as shared module instances (Verilog builds, ``npu_verilog``).

    Ports
    -----
    csr_addr : In(word address), csr_w_en, csr_w_data (32), csr_r_en : In
    csr_r_data : Out(32)   valid one cycle after ``csr_r_en``
    irq : Out(1)           any ``irq`` bit set
    bk : Out(DRAMBackendSignature)   to the DRAM storage model (outside the RTL)
    """

    def __init__(self, config: NPUConfig, pe_as_instance: bool = False):
        self.config = config
        self.pe_as_instance = pe_as_instance
        self.map = sram_map(config)
        if self.map["end"] > config.sram_bytes:
            raise ValueError(f"sram_bytes={config.sram_bytes} cannot hold the NPU's SRAM map "
                             f"({self.map['end']} bytes); use sim_config(config)")
        if config.bc > 8 * self.map["W"]:
            raise ValueError(f"bc={config.bc} does not fit a mask row of one bus word")
        self.regmap = register_map(config)
        W = self.map["W"]
        dab = addr_bits_for(config.dram_bytes, W)
        super().__init__({
            "csr_addr": In(self.regmap.addr_width), "csr_w_en": In(1), "csr_w_data": In(32),
            "csr_r_en": In(1), "csr_r_data": Out(32), "irq": Out(1),
            "bk": Out(DRAMBackendSignature(dab, W)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        mp = self.map
        W = mp["W"]
        wb = exact_log2(W)
        Br, Bc, C = cfg.br, cfg.bc, cfg.array_cols
        mhd = cfg.max_head_dim
        odm = cfg.o_cols_per_pe(mhd)

        m.submodules.csr = csr = CSRBank(self.regmap)
        m.submodules.mem = mem = MemorySystem(cfg, n_consumers=2, queue_depth=QUEUE_DEPTH)
        m.submodules.core = core = Core(cfg, self.pe_as_instance)
        m.d.comb += [csr.addr.eq(self.csr_addr), csr.w_en.eq(self.csr_w_en),
                     csr.w_data.eq(self.csr_w_data), csr.r_en.eq(self.csr_r_en),
                     self.csr_r_data.eq(csr.r_data)]
        wiring.connect(m, mem.bk, wiring.flipped(self.bk))
        reg = lambda n: csr.port(n, "value")

        # ------------------------------------------------------------ TSV control
        tpulse = csr.port("tsv_ctl", "pulse")
        rep = reg("tsv_repair")
        for i, (name, link) in enumerate((("rd", mem.tsv_rd), ("wr", mem.tsv_wr))):
            m.d.comb += [link.bist_start.eq(tpulse[i]),
                         link.repair_we.eq(tpulse[2] & (rep[25] == i)),
                         link.repair_idx.eq(rep[0:8]), link.repair_lane.eq(rep[8:24]),
                         link.repair_valid.eq(rep[24])]
            S = cfg.tsv_spare_lanes
            for k in range((S + 1) // 2):
                words = []
                for e in (2 * k, 2 * k + 1):
                    if e < S:
                        ent = link.repair_map[e]
                        words += [_zx(ent.lane, 15), ent.valid]
                    else:
                        words += [Const(0, 15), Const(0, 1)]
                m.d.comb += csr.port(f"tsv_{name}_map{k}", "status").eq(Cat(*words))
        m.d.comb += csr.port("tsv_status", "status").eq(
            Cat(_zx(mem.tsv_rd.status, 4), _zx(mem.tsv_wr.status, 4),
                mem.tsv_rd.ok, mem.tsv_wr.ok))
        link_ok = mem.tsv_rd.ok & mem.tsv_wr.ok

        # ------------------------------------------------------------ memory system set-up
        m.d.comb += [mem.dram_lo.eq(0), mem.dram_hi.eq(cfg.dram_bytes),
                     mem.sram_lo.eq(0), mem.sram_hi.eq(cfg.sram_bytes),
                     mem.pp_base.eq(mp["pp"]), mem.pp_half_bytes.eq(mp["pp_half"])]

        # ------------------------------------------------------------ job registers
        heads = reg("heads")[0:16]
        kv_heads = reg("heads")[16:32]
        seq_q = reg("seq")[0:16]
        seq_kv = reg("seq")[16:32]
        hd = reg("head_dim")[0:16]
        causal = reg("flags")[0]
        mask_en = reg("flags")[1]
        kvl_raw = reg("kv_valid_len")[0:16]
        dbg = reg("debug")
        R_ = {n: reg(n) for n in DESC_REGS}

        State = CtrlState
        state = Signal(State)
        err = Signal(NPUError)
        dma_code = Signal(8)
        done_flag = Signal()
        start = csr.port("ctrl", "pulse")[0]
        busy = (state != State.IDLE)
        m.d.comb += csr.port("status", "status").eq(
            Cat(busy, done_flag, Const(0, 6), _zx(err, 8), dma_code, _zx(state, 5)))
        irq_set = Signal(2)
        m.d.comb += [csr.port("irq", "set").eq(irq_set), self.irq.eq(csr.port("irq", "value") != 0)]

        # derived job values
        G = Signal(16)                       # group size heads / kv_heads
        rem = Signal(16)
        kvl = Signal(16)
        m.d.comb += kvl.eq(Mux(kvl_raw < seq_kv, kvl_raw, seq_kv))
        stacked = Signal()                   # decode mapping: seq_q == 1
        od = Signal(range(odm + 1))
        wq = Signal(range(2 * mhd // W + 2))      # words per FP16 row
        wo = Signal(range(4 * mhd // W + 2))      # words per FP32 row
        m.d.comb += [wq.eq((2 * hd + W - 1) >> wb), wo.eq((4 * hd + W - 1) >> wb)]

        # loop indices and per-tile values
        kvh = Signal(16)
        hg = Signal(16)
        q0 = Signal(16)
        h = Signal(16)
        nq = Signal(range(Br + 1))
        kv_end = Signal(17)
        n_kv = Signal(16)
        q_src = Signal(48)
        q_str = Signal(32)
        o_dst = Signal(48)
        o_str = Signal(32)
        m_src = Signal(48)
        m_str = Signal(32)
        k_src = Signal(48)
        v_src = Signal(48)
        kv_left = Signal(17)
        j = Signal(16)                       # kv tile being issued
        item = Signal(2)                     # 0 K, 1 V, 2 M within a tile
        q_issued = Signal()

        # ---------------------------------------------------------- DMA interface
        desc = Signal(descriptor_layout)
        desc_valid = Signal()
        outstanding = Signal(range(64))
        sub = mem.desc.valid & mem.desc.ready
        comp = mem.done.valid
        m.d.comb += [mem.desc.valid.eq(desc_valid), mem.desc.payload.eq(desc), mem.done.ready.eq(1)]
        m.d.sync += outstanding.eq(outstanding + sub - comp)
        credit = (outstanding < QUEUE_DEPTH) | dbg[1]
        q_loaded = Signal()
        o_complete = Signal()
        fail = Signal()
        fail_code = Signal(NPUError)
        with m.If(comp):
            with m.If(mem.done.payload.code == DMAError.QUEUE_FULL):
                m.d.comb += [fail.eq(1), fail_code.eq(NPUError.QUEUE_OVERFLOW)]
            with m.Elif(mem.done.payload.code != DMAError.OK):
                m.d.comb += [fail.eq(1), fail_code.eq(NPUError.DMA)]
                m.d.sync += dma_code.eq(mem.done.payload.code)
            with m.If(mem.done.payload.tag == Tag.Q):
                m.d.sync += q_loaded.eq(1)
            with m.If(mem.done.payload.tag == Tag.O):
                m.d.sync += o_complete.eq(1)

        # watchdog: descriptors outstanding and no beat moved, no completion
        wd = Signal(32)
        last_beats = Signal(32)
        m.d.sync += last_beats.eq(mem.dma_beats)
        progress = (mem.dma_beats != last_beats) | comp | (outstanding == 0)
        wd_armed = (state != State.IDLE) & (state != State.FAIL) & (state != State.DONE)
        with m.If(progress | ~wd_armed):
            m.d.sync += wd.eq(0)
        with m.Else():
            m.d.sync += wd.eq(wd + 1)
        with m.If(wd_armed & (wd >= reg("watchdog")) & ~progress):
            m.d.comb += [fail.eq(1), fail_code.eq(NPUError.WATCHDOG)]

        def put_desc(src, dst, rows, bpr, src_stride, dst_stride, direction, tag, pp=0, half=0, commit=0):
            m.d.sync += [desc.src.eq(src), desc.dst.eq(dst), desc.rows.eq(rows),
                         desc.bytes_per_row.eq(bpr), desc.src_stride.eq(src_stride),
                         desc.dst_stride.eq(dst_stride), desc.direction.eq(direction),
                         desc.pp_en.eq(pp), desc.pp_half.eq(half), desc.pp_commit.eq(commit),
                         desc.tag.eq(tag), desc_valid.eq(1)]

        with m.If(sub):
            m.d.sync += desc_valid.eq(0)

        # ---------------------------------------------------------- core command
        ccmd = core.cmd.payload
        cmd_valid = Signal()
        m.d.comb += core.cmd.valid.eq(cmd_valid)
        with m.If(core.cmd.valid & core.cmd.ready):
            m.d.sync += cmd_valid.eq(0)
        core_done = Signal()
        with m.If(core.done):
            m.d.sync += core_done.eq(1)

        # ---------------------------------------------------------- loader start / status
        ld_start = Signal()
        ld_busy = Signal()
        o_idle = Signal()

        # ---------------------------------------------------------- validation terms
        lowW = W - 1
        mis = Signal()
        terms = [R_[n] for n in ("q_base", "k_base", "v_base", "o_base", "q_head_stride", "q_row_stride",
                                 "k_head_stride", "k_row_stride", "v_head_stride", "v_row_stride",
                                 "o_head_stride", "o_row_stride")]
        mterms = [R_[n] for n in ("mask_base", "mask_head_stride", "mask_tile_stride")]
        m.d.comb += mis.eq(Cat(*[(t & lowW) != 0 for t in terms]).any()
                           | (mask_en & Cat(*[(t & lowW) != 0 for t in mterms]).any()))
        ends = []
        for base, hs, rs, nh, ns, eb in (("q_base", "q_head_stride", "q_row_stride", heads, seq_q, 2),
                                         ("k_base", "k_head_stride", "k_row_stride", kv_heads, seq_kv, 2),
                                         ("v_base", "v_head_stride", "v_row_stride", kv_heads, seq_kv, 2),
                                         ("o_base", "o_head_stride", "o_row_stride", heads, seq_q, 4)):
            e = Signal(52, name=f"end_{base[0]}")
            m.d.comb += e.eq(R_[base] + (nh - 1) * R_[hs] + (ns - 1) * R_[rs] + eb * hd)
            ends.append(e)
        n_kv_all = Signal(17)
        m.d.comb += n_kv_all.eq(_div_const(seq_kv + Bc - 1, Bc))
        e_m = Signal(52)
        m.d.comb += e_m.eq(R_["mask_base"] + (heads - 1) * R_["mask_head_stride"]
                           + (n_kv_all - 1) * R_["mask_tile_stride"] + seq_q * W)
        out_range = Cat(*[e > cfg.dram_bytes for e in ends]).any() | (mask_en & (e_m > cfg.dram_bytes))
        bad_stride = ((seq_q > 1) & (R_["o_row_stride"] < 4 * hd)) | \
                     ((seq_q == 1) & (heads > 1) & (R_["o_head_stride"] < 4 * hd))

        # ---------------------------------------------------------- counters
        cnt = {n: Signal(64, name=f"cnt_{n}") for n in COUNTERS}
        for n in COUNTERS:
            m.d.comb += [csr.port(f"cnt_{n}_lo", "status").eq(cnt[n][0:32]),
                         csr.port(f"cnt_{n}_hi", "status").eq(cnt[n][32:64])]
        snap = {k: Signal(48, name=f"snap_{k}") for k in ("sram", "tsv", "dram")}
        cur_sram = mem.sram_rd_bytes + mem.sram_wr_bytes
        cur_tsv = (mem.tsv_rd_words + mem.tsv_wr_words) * W
        cur_dram = mem.dram_rd_bytes + mem.dram_wr_bytes
        running = busy & (state != State.FAIL) & (state != State.DONE)
        with m.If(running):
            m.d.sync += [cnt["total_cycles"].eq(cnt["total_cycles"] + 1),
                         cnt["sram_bytes"].eq(cur_sram - snap["sram"]),
                         cnt["tsv_bytes"].eq(cur_tsv - snap["tsv"]),
                         cnt["dram_bytes"].eq(cur_dram - snap["dram"])]
        with m.If(core.done):
            m.d.sync += [cnt["mac_busy_cycles"].eq(cnt["mac_busy_cycles"] + core.cnt_mac),
                         cnt["softmax_cycles"].eq(cnt["softmax_cycles"] + core.cnt_softmax),
                         cnt["dma_stall_cycles"].eq(cnt["dma_stall_cycles"] + core.cnt_stall),
                         cnt["mac_ops"].eq(cnt["mac_ops"] + core.ops_mac),
                         cnt["exp2_ops"].eq(cnt["exp2_ops"] + core.ops_exp2),
                         cnt["recip_ops"].eq(cnt["recip_ops"] + core.ops_recip),
                         # ASSUMPTION: 8 register-file bytes per MAC slot (read + write of
                         # the FP32 accumulator) and per exp2 (read S, write P)
                         cnt["reg_bytes"].eq(cnt["reg_bytes"] + 8 * (core.ops_mac + core.ops_exp2)),
                         cnt["q_tiles"].eq(cnt["q_tiles"] + 1),
                         cnt["kv_tiles"].eq(cnt["kv_tiles"] + n_kv)]

        # ---------------------------------------------------------- controller FSM
        with m.Switch(state):
            with m.Case(State.IDLE):
                with m.If(start):
                    m.d.sync += [state.eq(State.DIV), err.eq(NPUError.OK), dma_code.eq(0),
                                 done_flag.eq(0), G.eq(0), rem.eq(heads),
                                 snap["sram"].eq(cur_sram), snap["tsv"].eq(cur_tsv),
                                 snap["dram"].eq(cur_dram)]
                    m.d.sync += [c.eq(0) for c in cnt.values()]
            with m.Case(State.DIV):
                # G = heads / kv_heads by repeated subtraction (heads <= 65535 cycles)
                with m.If((kv_heads != 0) & (rem >= kv_heads)):
                    m.d.sync += [rem.eq(rem - kv_heads), G.eq(G + 1)]
                with m.Else():
                    m.d.sync += state.eq(State.CHECK)
            with m.Case(State.CHECK):
                code = Signal(NPUError)
                with m.If((hd == 0) | (hd > mhd)):
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
                with m.Elif(~link_ok):
                    m.d.comb += code.eq(NPUError.LINK_DOWN)
                with m.If(code != NPUError.OK):
                    m.d.sync += [err.eq(code), state.eq(State.DONE)]
                with m.Else():
                    m.d.sync += [state.eq(State.SETUP), kvh.eq(0), hg.eq(0), q0.eq(0),
                                 stacked.eq(seq_q == 1),
                                 od.eq((hd + C - 1) >> exact_log2(C))]
            with m.Case(State.SETUP):
                # tile rows, head
                with m.If(stacked):
                    m.d.sync += nq.eq(Mux(G - hg > Br, Br, G - hg))
                with m.Else():
                    m.d.sync += nq.eq(Mux(seq_q - q0 > Br, Br, seq_q - q0))
                m.d.sync += [h.eq(kvh * G + hg), state.eq(State.SETUP2)]
            with m.Case(State.SETUP2):
                t = Signal(18)
                ce = Signal(17)
                e0 = Signal(17)
                m.d.comb += [t.eq(q0 + nq + seq_kv), ce.eq(Mux(t > seq_q, t - seq_q, 0)),
                             e0.eq(Mux(causal & ~stacked & (ce < kvl), ce, kvl))]
                nk_all = Signal(17)
                m.d.comb += nk_all.eq(_div_const(e0 + Bc - 1, Bc))
                m.d.sync += [
                    kv_end.eq(e0), kv_left.eq(e0), n_kv.eq(Mux(nk_all == 0, 1, nk_all)),
                    q_src.eq(R_["q_base"] + h * R_["q_head_stride"] + q0 * R_["q_row_stride"]),
                    q_str.eq(Mux(stacked, R_["q_head_stride"], R_["q_row_stride"])),
                    o_dst.eq(R_["o_base"] + h * R_["o_head_stride"] + q0 * R_["o_row_stride"]),
                    o_str.eq(Mux(stacked, R_["o_head_stride"], R_["o_row_stride"])),
                    m_src.eq(R_["mask_base"] + h * R_["mask_head_stride"] + q0 * W),
                    m_str.eq(Mux(stacked, R_["mask_head_stride"], W)),
                    k_src.eq(R_["k_base"] + kvh * R_["k_head_stride"]),
                    v_src.eq(R_["v_base"] + kvh * R_["v_head_stride"]),
                    j.eq(0), item.eq(0), q_issued.eq(0), q_loaded.eq(0), o_complete.eq(0),
                    core_done.eq(0), state.eq(State.CMD),
                ]
            with m.Case(State.CMD):
                m.d.sync += [ccmd.head_dim.eq(hd), ccmd.n_kv.eq(n_kv), ccmd.c.eq(reg("scale_c")),
                             ccmd.causal.eq(causal & ~stacked), ccmd.q_row0.eq(Mux(stacked, 0, q0)),
                             ccmd.seq_q.eq(Mux(stacked, nq, seq_q)), ccmd.seq_kv.eq(seq_kv),
                             ccmd.kv_valid_len.eq(kvl), ccmd.mask_en.eq(mask_en), ccmd.pause.eq(0),
                             cmd_valid.eq(1), state.eq(State.ISSUE)]
                m.d.comb += ld_start.eq(1)
            with m.Case(State.ISSUE):
                nk = Signal(17)
                m.d.comb += nk.eq(Mux(kv_left >= Bc, Bc, Mux(kv_left == 0, 1, kv_left)))
                half = j[0]
                hb = mp["pp"] + Mux(half, mp["pp_half"], 0)
                with m.If(~desc_valid & credit):
                    with m.If(~q_issued):
                        put_desc(q_src, mp["q"], nq, 2 * hd, q_str, mp["row_bytes"],
                                 Direction.DRAM_TO_SRAM, Tag.Q)
                        m.d.sync += q_issued.eq(1)
                    with m.Elif(j == n_kv):
                        pass
                    with m.Elif(item == 0):
                        put_desc(k_src, hb, nk, 2 * hd, R_["k_row_stride"], mp["row_bytes"],
                                 Direction.DRAM_TO_SRAM, Tag.K, pp=1, half=half)
                        m.d.sync += [item.eq(1), k_src.eq(k_src + Bc * R_["k_row_stride"])]
                    with m.Elif(item == 1):
                        put_desc(v_src, hb + mp["pp_v"], nk, 2 * hd, R_["v_row_stride"], mp["row_bytes"],
                                 Direction.DRAM_TO_SRAM, Tag.V, pp=1, half=half, commit=~mask_en)
                        m.d.sync += v_src.eq(v_src + Bc * R_["v_row_stride"])
                        with m.If(mask_en):
                            m.d.sync += item.eq(2)
                        with m.Else():
                            m.d.sync += [item.eq(0), j.eq(j + 1), kv_left.eq(kv_left - nk)]
                    with m.Else():
                        put_desc(m_src, hb + mp["pp_m"], nq, W, m_str, W,
                                 Direction.DRAM_TO_SRAM, Tag.M, pp=1, half=half, commit=1)
                        m.d.sync += [item.eq(0), j.eq(j + 1), kv_left.eq(kv_left - nk),
                                     m_src.eq(m_src + R_["mask_tile_stride"])]
                with m.If(q_issued & (j == n_kv) & ~desc_valid):
                    m.d.sync += state.eq(State.WAIT_CORE)
            with m.Case(State.WAIT_CORE):
                with m.If(core_done & o_idle & ~ld_busy):
                    m.d.sync += state.eq(State.ISSUE_O)
            with m.Case(State.ISSUE_O):
                with m.If(~desc_valid & credit):
                    put_desc(mp["o"], o_dst, nq, 4 * hd, mp["orow_bytes"], o_str,
                             Direction.SRAM_TO_DRAM, Tag.O)
                    m.d.sync += state.eq(State.DRAIN)
            with m.Case(State.DRAIN):
                with m.If(~desc_valid & (outstanding == 0) & o_complete):
                    m.d.sync += state.eq(State.NEXT)
            with m.Case(State.NEXT):
                # advance (q0, hg, kvh); stacked: hg steps by Br over the group
                with m.If(stacked):
                    with m.If(hg + Br < G):
                        m.d.sync += [hg.eq(hg + Br), state.eq(State.SETUP)]
                    with m.Elif(kvh + 1 < kv_heads):
                        m.d.sync += [hg.eq(0), kvh.eq(kvh + 1), state.eq(State.SETUP)]
                    with m.Else():
                        m.d.sync += state.eq(State.DONE)
                with m.Else():
                    with m.If(q0 + Br < seq_q):
                        m.d.sync += [q0.eq(q0 + Br), state.eq(State.SETUP)]
                    with m.Elif(hg + 1 < G):
                        m.d.sync += [q0.eq(0), hg.eq(hg + 1), state.eq(State.SETUP)]
                    with m.Elif(kvh + 1 < kv_heads):
                        m.d.sync += [q0.eq(0), hg.eq(0), kvh.eq(kvh + 1), state.eq(State.SETUP)]
                    with m.Else():
                        m.d.sync += state.eq(State.DONE)
            with m.Case(State.DONE):
                m.d.sync += [state.eq(State.IDLE), done_flag.eq(1)]
                m.d.comb += irq_set.eq(Cat(Const(1, 1), err != NPUError.OK))
            with m.Case(State.FAIL):
                # stays here until reset: the datapath may hold a half-done tile
                pass
        with m.If(core.err & (state != State.IDLE)):
            m.d.comb += [fail.eq(1), fail_code.eq(NPUError.CORE_REJECT)]
        ld_fail = Signal()
        with m.If(ld_fail):
            m.d.comb += [fail.eq(1), fail_code.eq(NPUError.BUF_OVERWRITE)]
        with m.If(fail & (state != State.FAIL) & (state != State.IDLE)):
            m.d.sync += [state.eq(State.FAIL), err.eq(fail_code), done_flag.eq(1)]
            m.d.comb += irq_set.eq(0b11)

        # ---------------------------------------------------------- tile loader
        sp = mem.sram_ports[0]
        nslot = max(1, -(-2 * mhd // W))
        row_reg = Signal(nslot * 8 * W)
        L = LoaderState
        ls = Signal(L)
        lj = Signal(16)
        lhalf = lj[0]
        seg_sel = Signal(BufSel)
        seg_rows = Signal(range(max(Br, Bc) + 1))
        seg_wpr = Signal(range(nslot + 1))
        seg_rstride = Signal(16)
        rq_row = Signal(range(max(Br, Bc) + 1))
        rq_w = Signal(range(nslot + 1))
        rq_addr = Signal(32)
        rq_rowaddr = Signal(32)
        rq_on = Signal()
        rs_row = Signal(range(max(Br, Bc) + 1))
        rs_w = Signal(range(nslot + 1))
        seg_on = Signal()
        seg_done = Signal()
        twice = Signal()
        redo = Signal()
        ld_nk = Signal(17)
        ld_left = Signal(17)
        m.d.comb += ld_nk.eq(Mux(ld_left >= Bc, Bc, Mux(ld_left == 0, 1, ld_left)))
        m.d.comb += ld_busy.eq(ls != L.IDLE)

        def seg(sel, base, rows, wpr, rstride):
            m.d.sync += [seg_sel.eq(sel), seg_rows.eq(rows), seg_wpr.eq(wpr), seg_rstride.eq(rstride),
                         rq_row.eq(0), rq_w.eq(0), rq_addr.eq(base // W if isinstance(base, int) else base >> wb),
                         rq_rowaddr.eq(base // W if isinstance(base, int) else base >> wb),
                         rq_on.eq(1), rs_row.eq(0), rs_w.eq(0), seg_on.eq(1)]

        rowW = mp["row_bytes"] // W
        hbase = mp["pp"] + Mux(lhalf, mp["pp_half"], 0)
        kfree = ~core.full.bit_select(Mux(lhalf, BufSel.K1, BufSel.K0), 1)
        vfree = ~core.full.bit_select(Mux(lhalf, BufSel.V1, BufSel.V0), 1)
        mfree = ~core.full[BufSel.MASK]
        pp_rel = Signal(2)
        m.d.comb += mem.pp_release.eq(pp_rel)
        with m.Switch(ls):
            with m.Case(L.IDLE):
                with m.If(ld_start):
                    m.d.sync += [ls.eq(L.WQ), lj.eq(0), twice.eq(dbg[0])]
            with m.Case(L.WQ):
                with m.If(q_loaded & (~core.full[BufSel.Q] | redo) & ~seg_on):
                    seg(BufSel.Q, mp["q"], nq, wq, rowW)
                    m.d.sync += [ls.eq(L.Q), ld_left.eq(kv_end), redo.eq(0)]
            with m.Case(L.Q):
                with m.If(seg_done):
                    with m.If(twice):        # injected fault: load the Q tile again
                        m.d.sync += [ls.eq(L.WQ), twice.eq(0), redo.eq(1)]
                    with m.Else():
                        m.d.sync += ls.eq(L.WK)
            with m.Case(L.WK):
                with m.If(mem.pp_full.bit_select(lhalf, 1) & kfree & ~seg_on):
                    seg(Mux(lhalf, BufSel.K1, BufSel.K0), hbase, ld_nk, wq, rowW)
                    m.d.sync += ls.eq(L.K)
            with m.Case(L.K):
                with m.If(seg_done):
                    m.d.sync += ls.eq(L.WV)
            with m.Case(L.WV):
                with m.If(vfree & ~seg_on):
                    seg(Mux(lhalf, BufSel.V1, BufSel.V0), hbase + mp["pp_v"], ld_nk, wq, rowW)
                    m.d.sync += ls.eq(L.V)
            with m.Case(L.V):
                with m.If(seg_done):
                    m.d.sync += ls.eq(Mux(mask_en, L.WM, L.REL))
            with m.Case(L.WM):
                with m.If(mfree & ~seg_on):
                    seg(BufSel.MASK, hbase + mp["pp_m"], nq, 1, 1)
                    m.d.sync += ls.eq(L.M)
            with m.Case(L.M):
                with m.If(seg_done):
                    m.d.sync += ls.eq(L.REL)
            with m.Case(L.REL):
                with m.If(~seg_on):       # the last row write has gone out
                    m.d.comb += pp_rel.eq(Mux(lhalf, 0b10, 0b01))
                    m.d.sync += [lj.eq(lj + 1), ld_left.eq(ld_left - ld_nk)]
                    with m.If(lj + 1 == n_kv):
                        m.d.sync += ls.eq(L.IDLE)
                    with m.Else():
                        m.d.sync += ls.eq(L.WK)

        # segment request generator
        m.d.comb += [sp.req.valid.eq(rq_on), sp.req.payload.addr.eq(rq_addr),
                     sp.req.payload.write.eq(0), sp.rdata.ready.eq(1)]
        with m.If(sp.req.valid & sp.req.ready):
            with m.If(rq_w + 1 == seg_wpr):
                m.d.sync += [rq_w.eq(0), rq_row.eq(rq_row + 1), rq_rowaddr.eq(rq_rowaddr + seg_rstride),
                             rq_addr.eq(rq_rowaddr + seg_rstride)]
                with m.If(rq_row + 1 == seg_rows):
                    m.d.sync += rq_on.eq(0)
            with m.Else():
                m.d.sync += [rq_w.eq(rq_w + 1), rq_addr.eq(rq_addr + 1)]
        # responses: assemble a row, write it to the core the next cycle
        wr_valid = Signal()
        wr_row = Signal(range(max(Br, Bc)))
        wr_last = Signal()
        m.d.sync += wr_valid.eq(0)
        m.d.comb += seg_done.eq(0)
        with m.If(sp.rdata.valid & seg_on):
            for s in range(nslot):
                with m.If(rs_w == s):
                    m.d.sync += row_reg[s * 8 * W:(s + 1) * 8 * W].eq(sp.rdata.payload)
            with m.If(rs_w + 1 == seg_wpr):
                last_row = rs_row + 1 == seg_rows
                m.d.sync += [rs_w.eq(0), rs_row.eq(rs_row + 1), wr_valid.eq(1), wr_row.eq(rs_row),
                             wr_last.eq(last_row)]
                with m.If(last_row):
                    m.d.sync += seg_on.eq(0)
                    m.d.comb += seg_done.eq(1)
            with m.Else():
                m.d.sync += rs_w.eq(rs_w + 1)
        wr_sel = Signal(BufSel)
        m.d.sync += wr_sel.eq(seg_sel)
        m.d.comb += [core.wr.valid.eq(wr_valid), core.wr.payload.sel.eq(wr_sel),
                     core.wr.payload.row.eq(wr_row), core.wr.payload.last.eq(wr_last),
                     core.wr.payload.data.eq(row_reg[:16 * mhd])]
        # simulation-time check: a row write into a buffer the core still holds
        m.d.comb += ld_fail.eq(wr_valid & core.full.bit_select(wr_sel, 1))

        # ---------------------------------------------------------- O writer
        op = mem.sram_ports[1]
        asm = Signal(32 * mhd)
        asm_full = Signal()
        asm_row = Signal(range(Br))
        owords = max(1, -(-4 * mhd // W))
        wbuf = Signal(owords * 8 * W)
        w_on = Signal()
        w_row = Signal(range(Br))
        w_word = Signal(range(owords + 1))
        w_addr = Signal(32)
        beat = core.o.payload
        m.d.comb += core.o.ready.eq(~asm_full)
        with m.If(core.o.valid & core.o.ready):
            with m.Switch(od):
                for v in range(1, odm + 1):
                    with m.Case(v):
                        for e in range(min(mhd, v * C)):
                            with m.If(beat.n == e % v):
                                m.d.sync += asm[32 * e:32 * (e + 1)].eq(beat.data[e // v])
            with m.If((beat.n == od - 1) & (beat.row < nq)):
                m.d.sync += [asm_full.eq(1), asm_row.eq(beat.row)]
        with m.If(asm_full & ~w_on):
            m.d.sync += [wbuf.eq(asm), w_on.eq(1), w_row.eq(asm_row), w_word.eq(0), asm_full.eq(0),
                         w_addr.eq((mp["o"] >> wb) + asm_row * (mp["orow_bytes"] // W))]
        tail = Signal(range(W + 1))
        m.d.comb += tail.eq((4 * hd) & (W - 1))
        last_word = w_word + 1 == wo
        m.d.comb += [op.req.valid.eq(w_on), op.req.payload.addr.eq(w_addr + w_word),
                     op.req.payload.write.eq(1),
                     op.req.payload.wdata.eq(wbuf.word_select(w_word, 8 * W)),
                     op.req.payload.wmask.eq(Mux(last_word & (tail != 0),
                                                 (Const(1, W + 1) << tail) - 1, (1 << W) - 1)),
                     op.rdata.ready.eq(1)]
        with m.If(op.req.valid & op.req.ready):
            m.d.sync += w_word.eq(w_word + 1)
            with m.If(last_word):
                m.d.sync += w_on.eq(0)
        m.d.comb += o_idle.eq(~asm_full & ~w_on)
        return m


def npu_verilog(config: NPUConfig, top: "NPU | None" = None, name: str = NPU_MODULE) -> str:
    """Verilog of the NPU (zero memory initialisers stripped) with the PE,
    PE-row, tree-node and reciprocal modules appended once."""
    from amaranth.back import verilog

    from .array import module_texts
    from .mem_common import strip_zero_memory_init
    if top is None:
        top = NPU(config, pe_as_instance=True)
    text = strip_zero_memory_init(verilog.convert(top, name=name, emit_src=False))
    return text + "\n" + module_texts(config)
