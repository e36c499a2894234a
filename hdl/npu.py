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

SRAM map (bytes, ``sram_map``): two Q regions (Br rows of ``row_bytes``),
two O regions (Br rows of ``orow_bytes``, FP32), ``config.kv_slots`` K/V slots,
each [K tile | V tile | mask tile] (Bc, Bc and Br rows; slots 0 and 1 are
the DMA's ping-pong halves when K/V stream) and the resident mode's mask
tiles (two q-tile parities x ``config.kv_slots``).  ``sim_config`` shrinks the
simulated SRAM to the next power of two above the map (1 MiB at 32 x 32).

Per q tile t (region t % 2)::

  issuer:  Q_t ─► K_j,V_j (only kv tiles not yet resident) ─► masks ─┐ one q tile
  DMA:     ─Q_t─K/V(first q tile of a KV head)─ ... ─O_{t-1} chunks─┘ ahead of the core
  loader:  Q_t (after the core freed Q) ─► K_0 ─► V_0 ─► K_1 ...   2 words / request
  core:    INIT ─ S_0 SM PV_0 ─ S_1 ... ─ FINAL ─ OUT ─► O writer (C FP32 lanes / request)
                                                           └─► O_t chunks ─DMA─► DRAM

Design trade-offs
-----------------
* **K/V resident in SRAM.**  When every kv tile of a KV head has a slot
  (ceil(min(seq_kv, kv_valid_len) / Bc) <= ``config.kv_slots``), the first q tile
  that needs kv tile j (of the first query head of the GQA group) DMAs it,
  whole, into slot j; every later q tile and every other query head of the
  group has the loader read it straight from SRAM.  At 512 tokens, d = 128
  that removes 8 x 32 KiB of K/V per q tile from the one-word-per-cycle DMA,
  which would otherwise bound it (304 KiB per q tile against 8 192 MAC cycles).  The
  slots of a KV head are rewritten for the next KV head only after the
  loader has finished the previous q tile.  Longer sequences stream K/V
  through slots 0 and 1 as ping-pong halves for every q tile (the DMA itself
  refuses to overwrite a half before the loader released it).  The cost:
  ``config.kv_slots`` x 36 KiB (K, V and mask tile) of the 4 MiB SRAM at the default
  configuration (the whole map: 800 KiB).
* **Two Q and two O regions, one q tile of issue-ahead.**  The controller
  hands q tile t to the core (its command waits in the core's command slot)
  and to the loader (one pending q tile) while t-1 computes, and queues its
  Q (and K/V) descriptors; the loader moves Q_t into the core as soon as the
  core released Q after its last S phase, so the next q tile starts one
  cycle after the read-out.  The O write-back of q tile t runs during t+1,
  in chunks of ``o_chunk`` rows as the O writer finishes them; a region is
  reused only after the write-back of q tile t-2 completed.  What stays in
  series: the first q tile's wait for Q and K_0 and the last q tile's O
  write-back.
* **Loader between SRAM and the core.**  The core takes one whole FP16 row
  per beat; the loader reads ``loader_lanes`` = 2 bus words per request (a
  wide SRAM port: two banks at once), so a K+V tile pair (2*Bc*2*d bytes)
  moves in half the ~2*Bc*d/C cycles the pair computes and the next q tile's
  Q and K_0 load during the last P.V and the read-out.  Only the valid rows
  of a partial tile are loaded (``last`` on the final one); the other rows
  keep stale data, which the core masks (case A5).
* **O row assembly.**  The core streams O in its natural layout (beat
  (row, n) carries O[row, od*c + n] in lane c); the writer permutes one row
  (od beats) into row-major FP32 in a register (one static permutation per
  possible od) and writes it to the SRAM O region ``o_lanes`` words per
  request (C FP32 lanes, 4 words at 32 x 32): a row's writes take no more
  cycles than its od beats, so the read-out never waits.  The SRAM grants
  its wide ports first, the widest first, so the O writer is not throttled
  by the loader it overtakes.
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
loads each Q tile twice), ``QUEUE_OVERFLOW`` a DMA completion with
``QUEUE_FULL`` (injectable: ``debug.no_queue_limit``), ``WATCHDOG`` a DMA
with descriptors outstanding that makes no progress for ``watchdog`` cycles,
``DMA`` any other DMA completion error (code in ``status.dma_code``),
``REG_UNWRITTEN`` a PE register read before it was written in its lifetime
(S/P and alpha: the kv tile; m_i, l_i, O_acc: the q tile, from INIT), checked
by the core on every control word, first offending read in ``reg_check``
(injectable: ``debug.inject_skip_init``, ``debug.inject_drop_s_write``).

TSV fault injection (tests): ``tsv_fault_rd`` / ``tsv_fault_wr`` hold stuck-at
faults on up to 16 consecutive physical lanes of a link (spares included).
After the host's self-test the repair map covers up to ``tsv_spare_lanes``
failed data lanes (data still bit-exact, no cycle lost); with more, the link
is not OK and a started job is rejected with ``LINK_DOWN``.
"""

from __future__ import annotations

import enum

from amaranth import Array, Cat, Const, Module, Mux, Signal, Value
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from flashnpu.config import NPUConfig

from .core import BufSel, Core
from .csr import CSRBank, Field, Register, RegisterMap
from .dma import DMAError, Direction, MemorySystem, descriptor_layout
from .dram import DRAMBackendSignature
from .mem_common import addr_bits_for, word_bytes

__all__ = ["NPUError", "Tag", "COUNTERS", "register_map", "sram_map", "loader_lanes", "o_lanes",
           "o_chunk",
           "sim_config", "NPU",
           "NPU_MODULE", "npu_verilog"]

NPU_MODULE = "flashnpu_npu"
QUEUE_DEPTH = 4


def o_chunk(config: NPUConfig) -> int:
    """Rows per O write-back descriptor (Br / 4): the write-back of a q tile
    starts while the core still streams its later rows."""
    return max(1, config.br // 4)
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
    REG_UNWRITTEN = 13    #: a PE register was read before it was written (see ``reg_check``)


class CtrlState(enum.IntEnum):
    """Controller (descriptor issuer) state (``status.state``)."""
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
    O = 4           #: the last (or only) O write-back descriptor of a q tile
    OP = 5          #: an earlier O write-back chunk (``O_CHUNK`` rows)


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
                                    Field("no_queue_limit", 1, 1, "ignore the descriptor credit (tests)"),
                                    Field("inject_skip_init", 1, 2,
                                          "the core's INIT program issues NOPs: m_i, l_i, O_acc unwritten (tests)"),
                                    Field("inject_drop_s_write", 1, 3,
                                          "kv tile 1's first S step issues a NOP: S(0, 0) unwritten (tests)")]))
    rm.add(Register("reg_check", "ro", [Field("reg", 12, 0, "PE register index (core.register_name)"),
                                        Field("phase", 4, 12, "core Phase of the reading step"),
                                        Field("tile", 16, 16, "kv tile of the reading step")],
                    doc="the first PE register read before it was written (error REG_UNWRITTEN)"))
    rm.add(Register("tsv_ctl", "w1p", [Field("bist_rd", 1, 0), Field("bist_wr", 1, 1),
                                       Field("repair_we", 1, 2, "write tsv_repair into a map")]))
    rm.add(Register("tsv_repair", "rw", [Field("idx", 8, 0), Field("lane", 16, 8), Field("valid", 1, 24),
                                         Field("link", 1, 25, "0 = read link, 1 = write link")]))
    lb = _tsv_lane_bits(config)
    for link in ("rd", "wr"):
        rm.add(Register(f"tsv_fault_{link}", "rw",
                        [Field("lanes", 16, 0, "bit i: physical lane base + i is faulty"),
                         Field("base", lb, 16, "first physical lane (spare s = tsv_data_lanes + s)"),
                         Field("stuck", 1, 16 + lb, "value the faulty lanes are stuck at")],
                        doc=f"test-only stuck-at faults on the TSV {link} link (run its self-test after)"))
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


def _tsv_lane_bits(config: NPUConfig) -> int:
    """Width of a physical TSV lane index (data + spare lanes) in ``tsv_fault_*``."""
    nl = config.tsv_data_lanes + config.tsv_spare_lanes
    lb = max(1, (nl - 1).bit_length())
    if 16 + lb + 1 > 32:
        raise ValueError(f"tsv_fault_* cannot address {nl} TSV lanes in one register")
    return lb


def loader_lanes(config: NPUConfig) -> int:
    """Bus words per SRAM request of the tile loader (2: the core takes a
    K and a V tile, 2*Bc*2*head_dim bytes, per ~2*Bc*head_dim/C cycles,
    just under one word per cycle at d = 128 on 32 x 32)."""
    return min(2, config.sram_banks)


def o_lanes(config: NPUConfig) -> int:
    """Bus words per SRAM write of the O writer: C FP32 lanes per core beat
    (4 words at 32 x 32), rounded up to a power of two, at most the bank count."""
    need = -(-4 * config.array_cols // word_bytes(config))
    return min(config.sram_banks, 1 << ceil_log2(max(1, need)))


def sram_map(config: NPUConfig) -> dict:
    """SRAM regions in bytes.

    Returns a dict: ``W`` (bus word), ``LW`` / ``OW`` (the loader's / the O
    writer's request width), ``row_bytes`` (one FP16 tile row), ``orow_bytes``
    (one FP32 O row), ``mrow_bytes`` (one mask row), ``q`` and ``q_half``
    (two Q regions at ``q`` and ``q + q_half``), ``o`` and ``o_half`` (two O
    regions), ``kv`` (``slots`` = ``config.kv_slots`` K/V slots of ``slot`` bytes,
    each [K tile | V tile | mask tile] at offsets 0, ``slot_v``, ``slot_m``;
    slots 0 and 1 are the DMA's ping-pong halves when K/V stream), ``mres``
    and ``mres_half`` (the resident mode's masks: two q-tile parities x
    ``slots`` mask tiles), ``pp``/``pp_half``/``pp_v``/``pp_m`` (the
    ping-pong window, = slots 0 and 1) and ``end`` (bytes used).
    """
    W = word_bytes(config)
    LW = loader_lanes(config) * W
    OW = o_lanes(config) * W
    A = max(LW, OW)
    rup = lambda n, a: -(-n // a) * a
    rowb = rup(2 * config.max_head_dim, LW)
    orowb = rup(4 * config.max_head_dim, OW)
    mrow = LW
    q = 0
    q_half = rup(config.br * rowb, A)
    o = 2 * q_half
    o_half = rup(config.br * orowb, A)
    kv = o + 2 * o_half
    slot = rup(2 * config.bc * rowb + config.br * mrow, A)
    mres = kv + config.kv_slots * slot
    mres_half = config.kv_slots * config.br * mrow
    return dict(W=W, LW=LW, OW=OW, row_bytes=rowb, orow_bytes=orowb, mrow_bytes=mrow,
                q=q, q_half=q_half, o=o, o_half=o_half, kv=kv, slot=slot, slots=config.kv_slots,
                slot_v=config.bc * rowb, slot_m=2 * config.bc * rowb, mres=mres, mres_half=mres_half,
                pp=kv, pp_half=slot, pp_v=config.bc * rowb, pp_m=2 * config.bc * rowb,
                end=mres + 2 * mres_half)


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
        Br, Bc, C = cfg.br, cfg.bc, cfg.array_cols
        mhd = cfg.max_head_dim
        odm = cfg.o_cols_per_pe(mhd)

        m.submodules.csr = csr = CSRBank(self.regmap)
        m.submodules.mem = mem = MemorySystem(cfg, n_consumers=2, queue_depth=QUEUE_DEPTH,
                                                consumer_lanes=(loader_lanes(cfg), o_lanes(cfg)))
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
        # test-only stuck-at faults: ``lanes`` shifted to ``base``, stuck at ``stuck``
        lb = _tsv_lane_bits(cfg)
        nl = cfg.tsv_data_lanes + cfg.tsv_spare_lanes
        for name, link in (("rd", mem.tsv_rd), ("wr", mem.tsv_wr)):
            fr = reg(f"tsv_fault_{name}")
            lanes = Signal(nl, name=f"tsv_fault_{name}_lanes")
            m.d.comb += [lanes.eq(fr[0:16] << fr[16:16 + lb]),
                         link.fault_stuck0.eq(Mux(fr[16 + lb], 0, lanes)),
                         link.fault_stuck1.eq(Mux(fr[16 + lb], lanes, 0))]
        m.d.comb += csr.port("tsv_status", "status").eq(
            Cat(_zx(mem.tsv_rd.status, 4), _zx(mem.tsv_wr.status, 4),
                mem.tsv_rd.ok, mem.tsv_wr.ok))
        link_ok = mem.tsv_rd.ok & mem.tsv_wr.ok

        # ------------------------------------------------------------ memory system set-up
        resident = Signal()                  # job: the kv tiles of a KV head stay in their slots
        m.d.comb += [mem.dram_lo.eq(0), mem.dram_hi.eq(cfg.dram_bytes),
                     mem.sram_lo.eq(0), mem.sram_hi.eq(cfg.sram_bytes),
                     mem.pp_base.eq(mp["pp"]), mem.pp_half_bytes.eq(Mux(resident, 0, mp["pp_half"]))]

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
        LW, OW = mp["LW"], mp["OW"]
        lwb, owb = exact_log2(LW), exact_log2(OW)
        wql = Signal(range(2 * mhd // LW + 2))     # loader requests per FP16 row
        wol = Signal(range(4 * mhd // OW + 2))     # O writer requests per FP32 row
        m.d.comb += [wql.eq((2 * hd + LW - 1) >> lwb), wol.eq((4 * hd + OW - 1) >> owb)]
        slot_bits = max(1, ceil_log2(cfg.kv_slots))

        # loop indices and per-tile values (issuer)
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
        kvo = Signal(17)                     # first key of kv tile j
        j = Signal(16)                       # kv tile being issued
        item = Signal(2)                     # 0 K, 1 V, 2 M within a tile
        q_issued = Signal()
        t_iss = Signal(32)                   # q tiles handed over so far (this one's index)
        tb = t_iss[0]                        # its Q / O / resident-mask region
        kv_loaded = Signal(17)               # resident: kv tiles of this KV head issued
        new_head = Signal()                  # resident: first K/V of a KV head not yet issued
        kv_gcnt = Signal(32)                 # K/V tile pairs issued in the job
        head_base = Signal(32)               # kv_gcnt at this KV head's tile 0
        m_gcnt = Signal(32)                  # mask tiles issued in the job

        # ---------------------------------------------------------- DMA interface
        desc = Signal(descriptor_layout)
        desc_valid = Signal()
        outstanding = Signal(range(64))
        sub = mem.desc.valid & mem.desc.ready
        comp = mem.done.valid
        m.d.comb += [mem.desc.valid.eq(desc_valid), mem.desc.payload.eq(desc), mem.done.ready.eq(1)]
        m.d.sync += outstanding.eq(outstanding + sub - comp)
        credit = (outstanding < QUEUE_DEPTH) | dbg[1]
        fail = Signal()
        fail_code = Signal(NPUError)
        # completions per tag (the DMA completes in submission order)
        done_cnt = {t: Signal(32, name=f"done_{t.name.lower()}") for t in Tag}
        with m.If(comp):
            with m.If(mem.done.payload.code == DMAError.QUEUE_FULL):
                m.d.comb += [fail.eq(1), fail_code.eq(NPUError.QUEUE_OVERFLOW)]
            with m.Elif(mem.done.payload.code != DMAError.OK):
                m.d.comb += [fail.eq(1), fail_code.eq(NPUError.DMA)]
                m.d.sync += dma_code.eq(mem.done.payload.code)
            for t, c in done_cnt.items():
                with m.If(mem.done.payload.tag == t):
                    m.d.sync += c.eq(c + 1)

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
        cur_nkv = Signal(16)                 # n_kv of the q tile the core runs
        with m.If(core.cmd.valid & core.cmd.ready):
            m.d.sync += [cmd_valid.eq(0), cur_nkv.eq(ccmd.n_kv)]

        # ---------------------------------------------------------- hand-over to the loader
        # one q tile's parameters, taken by the loader when it is idle
        lp_valid = Signal()
        lp_b = Signal()
        lp_nq = Signal.like(nq)
        lp_nkv = Signal(16)
        lp_end = Signal(17)
        lp_kbase = Signal(32)
        lp_mbase = Signal(32)
        lp_qseq = Signal(32)
        ld_busy = Signal()
        # O entries (q tile t at t % 4): rows and DRAM destination of its O
        oe_nq = Array(Signal.like(nq, name=f"oe_nq{i}") for i in range(4))
        oe_dst = Array(Signal(48, name=f"oe_dst{i}") for i in range(4))
        oe_str = Array(Signal(32, name=f"oe_str{i}") for i in range(4))
        ob_t = Signal(32)                    # q tiles whose O beats the core has streamed
        ow_t = Signal(32)                    # q tiles whose O rows are all in SRAM
        owb_iss = Signal(32)                 # q tiles whose O write-back is issued
        ow_row = Signal(range(Br + 1))       # rows of q tile ow_t in SRAM
        owb_rows = Signal(range(Br + 1))     # rows of q tile owb_iss written back
        OCH = o_chunk(cfg)
        o_tile_in = ow_t != owb_iss          # the whole q tile is in SRAM
        o_chunk_in = ~o_tile_in & (ow_row >= owb_rows + OCH)
        o_wb_want = Signal()
        m.d.comb += o_wb_want.eq((o_tile_in | o_chunk_in) & (state != State.IDLE) & (state != State.FAIL))

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
        n_kv_need = Signal(17)               # kv tiles any q tile of the job can see
        m.d.comb += n_kv_need.eq(_div_const(kvl + Bc - 1, Bc))
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
                         cnt["kv_tiles"].eq(cnt["kv_tiles"] + cur_nkv)]

        # ---------------------------------------------------------- controller FSM
        with m.Switch(state):
            with m.Case(State.IDLE):
                with m.If(start):
                    m.d.sync += [state.eq(State.DIV), err.eq(NPUError.OK), dma_code.eq(0),
                                 done_flag.eq(0), G.eq(0), rem.eq(heads),
                                 snap["sram"].eq(cur_sram), snap["tsv"].eq(cur_tsv),
                                 snap["dram"].eq(cur_dram),
                                 t_iss.eq(0), kv_gcnt.eq(0), m_gcnt.eq(0), ob_t.eq(0), ow_t.eq(0),
                                 owb_iss.eq(0), lp_valid.eq(0), ow_row.eq(0), owb_rows.eq(0)]
                    m.d.sync += [c.eq(0) for c in cnt.values()]
                    m.d.sync += [c.eq(0) for c in done_cnt.values()]
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
                                 od.eq((hd + C - 1) >> exact_log2(C)),
                                 resident.eq(n_kv_need <= cfg.kv_slots),
                                 kv_loaded.eq(0), new_head.eq(1), head_base.eq(0)]
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
                    kv_end.eq(e0), kv_left.eq(e0), kvo.eq(0), n_kv.eq(Mux(nk_all == 0, 1, nk_all)),
                    q_src.eq(R_["q_base"] + h * R_["q_head_stride"] + q0 * R_["q_row_stride"]),
                    q_str.eq(Mux(stacked, R_["q_head_stride"], R_["q_row_stride"])),
                    o_dst.eq(R_["o_base"] + h * R_["o_head_stride"] + q0 * R_["o_row_stride"]),
                    o_str.eq(Mux(stacked, R_["o_head_stride"], R_["o_row_stride"])),
                    m_src.eq(R_["mask_base"] + h * R_["mask_head_stride"] + q0 * W),
                    m_str.eq(Mux(stacked, R_["mask_head_stride"], W)),
                    k_src.eq(R_["k_base"] + kvh * R_["k_head_stride"]),
                    v_src.eq(R_["v_base"] + kvh * R_["v_head_stride"]),
                    j.eq(0), item.eq(0), q_issued.eq(0), state.eq(State.CMD),
                ]
            with m.Case(State.CMD):
                # the core holds at most one pending command, the loader one
                # pending q tile, and at most 4 q tiles wait for their O write-back
                with m.If(~cmd_valid & ~lp_valid & (t_iss - owb_iss < 4)):
                    m.d.sync += [ccmd.head_dim.eq(hd), ccmd.n_kv.eq(n_kv), ccmd.c.eq(reg("scale_c")),
                                 ccmd.causal.eq(causal & ~stacked), ccmd.q_row0.eq(Mux(stacked, 0, q0)),
                                 ccmd.seq_q.eq(Mux(stacked, nq, seq_q)), ccmd.seq_kv.eq(seq_kv),
                                 ccmd.kv_valid_len.eq(kvl), ccmd.mask_en.eq(mask_en), ccmd.pause.eq(0),
                                 cmd_valid.eq(1), state.eq(State.ISSUE),
                                 lp_valid.eq(1), lp_b.eq(tb), lp_nq.eq(nq), lp_nkv.eq(n_kv),
                                 lp_end.eq(kv_end), lp_kbase.eq(head_base), lp_mbase.eq(m_gcnt),
                                 lp_qseq.eq(t_iss),
                                 oe_nq[t_iss[:2]].eq(nq), oe_dst[t_iss[:2]].eq(o_dst),
                                 oe_str[t_iss[:2]].eq(o_str)]
            with m.Case(State.ISSUE):
                nk = Signal(17)
                m.d.comb += nk.eq(Mux(kv_left >= Bc, Bc, Mux(kv_left == 0, 1, kv_left)))
                # resident tiles are loaded whole (up to kv_valid_len): a later q
                # tile of the head may see more of them than this one
                nk_res = Signal(17)
                m.d.comb += nk_res.eq(Mux(kvl - kvo >= Bc, Bc, Mux(kvl <= kvo, 1, kvl - kvo)))
                half = j[0]
                hb = mp["pp"] + Mux(half, mp["pp_half"], 0)
                sb = Signal(32)
                m.d.comb += sb.eq(Mux(resident, mp["kv"] + j[:slot_bits] * mp["slot"], hb))
                need_kv = ~resident | (j >= kv_loaded)
                # a new KV head overwrites the slots only after the loader has
                # finished the previous q tile (it took this one's parameters)
                kv_block = resident & new_head & lp_valid
                with m.If(new_head & ~lp_valid):
                    m.d.sync += new_head.eq(0)

                def next_j():
                    m.d.sync += [item.eq(0), j.eq(j + 1), kv_left.eq(kv_left - nk), kvo.eq(kvo + Bc),
                                 k_src.eq(k_src + Bc * R_["k_row_stride"]),
                                 v_src.eq(v_src + Bc * R_["v_row_stride"]),
                                 m_src.eq(m_src + R_["mask_tile_stride"])]

                with m.If(~desc_valid & credit & ~o_wb_want):
                    with m.If(~q_issued):
                        put_desc(q_src, mp["q"] + Mux(tb, mp["q_half"], 0), nq, 2 * hd, q_str,
                                 mp["row_bytes"], Direction.DRAM_TO_SRAM, Tag.Q)
                        m.d.sync += q_issued.eq(1)
                    with m.Elif(j == n_kv):
                        pass
                    with m.Elif(item == 0):
                        with m.If(~need_kv):
                            with m.If(mask_en):
                                m.d.sync += item.eq(2)
                            with m.Else():
                                next_j()
                        with m.Elif(~kv_block):
                            put_desc(k_src, sb, Mux(resident, nk_res, nk), 2 * hd, R_["k_row_stride"],
                                     mp["row_bytes"], Direction.DRAM_TO_SRAM, Tag.K, pp=~resident, half=half)
                            m.d.sync += item.eq(1)
                    with m.Elif(item == 1):
                        put_desc(v_src, sb + mp["slot_v"], Mux(resident, nk_res, nk), 2 * hd,
                                 R_["v_row_stride"], mp["row_bytes"], Direction.DRAM_TO_SRAM, Tag.V,
                                 pp=~resident, half=half, commit=~resident & ~mask_en)
                        m.d.sync += [kv_gcnt.eq(kv_gcnt + 1), kv_loaded.eq(j + 1)]
                        with m.If(mask_en):
                            m.d.sync += item.eq(2)
                        with m.Else():
                            next_j()
                    with m.Else():
                        mdst = Signal(32)
                        m.d.comb += mdst.eq(Mux(resident, mp["mres"] + Mux(tb, mp["mres_half"], 0)
                                                + j[:slot_bits] * (Br * mp["mrow_bytes"]),
                                                hb + mp["pp_m"]))
                        put_desc(m_src, mdst, nq, W, m_str, mp["mrow_bytes"],
                                 Direction.DRAM_TO_SRAM, Tag.M, pp=~resident, half=half, commit=~resident)
                        m.d.sync += m_gcnt.eq(m_gcnt + 1)
                        next_j()
                with m.If(q_issued & (j == n_kv) & ~desc_valid):
                    m.d.sync += state.eq(State.NEXT)
            with m.Case(State.NEXT):
                # advance (q0, hg, kvh); stacked: hg steps by Br over the group
                m.d.sync += t_iss.eq(t_iss + 1)
                new_kvh = Signal()
                with m.If(stacked):
                    with m.If(hg + Br < G):
                        m.d.sync += [hg.eq(hg + Br), state.eq(State.SETUP)]
                    with m.Elif(kvh + 1 < kv_heads):
                        m.d.sync += [hg.eq(0), kvh.eq(kvh + 1), state.eq(State.SETUP)]
                        m.d.comb += new_kvh.eq(1)
                    with m.Else():
                        m.d.sync += state.eq(State.DRAIN)
                with m.Else():
                    with m.If(q0 + Br < seq_q):
                        m.d.sync += [q0.eq(q0 + Br), state.eq(State.SETUP)]
                    with m.Elif(hg + 1 < G):
                        m.d.sync += [q0.eq(0), hg.eq(hg + 1), state.eq(State.SETUP)]
                    with m.Elif(kvh + 1 < kv_heads):
                        m.d.sync += [q0.eq(0), hg.eq(0), kvh.eq(kvh + 1), state.eq(State.SETUP)]
                        m.d.comb += new_kvh.eq(1)
                    with m.Else():
                        m.d.sync += state.eq(State.DRAIN)
                with m.If(new_kvh):
                    m.d.sync += [kv_loaded.eq(0), new_head.eq(1), head_base.eq(kv_gcnt)]
            with m.Case(State.DRAIN):
                with m.If(~desc_valid & (outstanding == 0) & (done_cnt[Tag.O] == t_iss) & ~lp_valid
                          & ~ld_busy & ~cmd_valid & ~core.busy):
                    m.d.sync += state.eq(State.DONE)
            with m.Case(State.DONE):
                m.d.sync += [state.eq(State.IDLE), done_flag.eq(1)]
                m.d.comb += irq_set.eq(Cat(Const(1, 1), err != NPUError.OK))
            with m.Case(State.FAIL):
                # stays here until reset: the datapath may hold a half-done tile
                pass

        # O write-back: a descriptor per O_CHUNK rows once they are in SRAM,
        # the rest of the q tile (tag O) once all its rows are; it goes before
        # the issuer's next descriptor
        with m.If(o_wb_want & ~desc_valid & credit):
            oi = owb_iss[:2]
            put_desc(mp["o"] + Mux(owb_iss[0], mp["o_half"], 0) + owb_rows * mp["orow_bytes"],
                     oe_dst[oi] + owb_rows * oe_str[oi], Mux(o_tile_in, oe_nq[oi] - owb_rows, OCH),
                     4 * hd, mp["orow_bytes"], oe_str[oi], Direction.SRAM_TO_DRAM,
                     Mux(o_tile_in, Tag.O, Tag.OP))
            with m.If(o_tile_in):
                m.d.sync += [owb_iss.eq(owb_iss + 1), owb_rows.eq(0)]
            with m.Else():
                m.d.sync += owb_rows.eq(owb_rows + OCH)
        with m.If(core.err & (state != State.IDLE)):
            m.d.comb += [fail.eq(1), fail_code.eq(NPUError.CORE_REJECT)]
        # simulation-time check in the core: a PE register read before it was written
        m.d.comb += [core.inject.eq(dbg[2:4]),
                     csr.port("reg_check", "status").eq(
                         Cat(_zx(core.reg_err_addr, 12), _zx(core.reg_err_phase, 4), core.reg_err_tile))]
        with m.If(core.reg_err & (state != State.IDLE)):
            m.d.comb += [fail.eq(1), fail_code.eq(NPUError.REG_UNWRITTEN)]
        ld_fail = Signal()
        with m.If(ld_fail):
            m.d.comb += [fail.eq(1), fail_code.eq(NPUError.BUF_OVERWRITE)]
        with m.If(fail & (state != State.FAIL) & (state != State.IDLE)):
            m.d.sync += [state.eq(State.FAIL), err.eq(fail_code), done_flag.eq(1)]
            m.d.comb += irq_set.eq(0b11)

        # ---------------------------------------------------------- tile loader
        # SRAM port 1, ``LW`` bytes (loader_lanes words) per request
        sp = mem.sram_ports[0]
        nslot = max(1, -(-2 * mhd // LW))
        row_reg = Signal(nslot * 8 * LW)
        L = LoaderState
        ls = Signal(L)
        lj = Signal(16)
        lhalf = lj[0]
        l_b = Signal()
        l_nq = Signal.like(nq)
        l_nkv = Signal(16)
        l_kbase = Signal(32)
        l_mbase = Signal(32)
        l_qseq = Signal(32)
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
            a = base // LW if isinstance(base, int) else base >> lwb
            m.d.sync += [seg_sel.eq(sel), seg_rows.eq(rows), seg_wpr.eq(wpr), seg_rstride.eq(rstride),
                         rq_row.eq(0), rq_w.eq(0), rq_addr.eq(a), rq_rowaddr.eq(a),
                         rq_on.eq(1), rs_row.eq(0), rs_w.eq(0), seg_on.eq(1)]

        rowW = mp["row_bytes"] // LW
        lslot = Signal(32)                   # K/V source of kv tile lj: its slot or ping-pong half
        m.d.comb += lslot.eq(Mux(resident, mp["kv"] + lj[:slot_bits] * mp["slot"],
                                 mp["pp"] + Mux(lhalf, mp["pp_half"], 0)))
        lmask = Signal(32)
        m.d.comb += lmask.eq(Mux(resident, mp["mres"] + Mux(l_b, mp["mres_half"], 0)
                                 + lj[:slot_bits] * (Br * mp["mrow_bytes"]), lslot + mp["pp_m"]))
        kfree = ~core.full.bit_select(Mux(lhalf, BufSel.K1, BufSel.K0), 1)
        vfree = ~core.full.bit_select(Mux(lhalf, BufSel.V1, BufSel.V0), 1)
        mfree = ~core.full[BufSel.MASK]
        # K_j / V_j / mask_j in SRAM: resident, the DMA completed them (in
        # issue order); streaming, the DMA committed the ping-pong half
        k_in = Mux(resident, done_cnt[Tag.K] > l_kbase + lj, mem.pp_full.bit_select(lhalf, 1))
        v_in = Mux(resident, done_cnt[Tag.V] > l_kbase + lj, 1)
        m_in = Mux(resident, done_cnt[Tag.M] > l_mbase + lj, 1)
        pp_rel = Signal(2)
        m.d.comb += mem.pp_release.eq(pp_rel)
        with m.Switch(ls):
            with m.Case(L.IDLE):
                with m.If(lp_valid & running):
                    m.d.sync += [ls.eq(L.WQ), lj.eq(0), twice.eq(dbg[0]), lp_valid.eq(0),
                                 l_b.eq(lp_b), l_nq.eq(lp_nq), l_nkv.eq(lp_nkv), ld_left.eq(lp_end),
                                 l_kbase.eq(lp_kbase), l_mbase.eq(lp_mbase), l_qseq.eq(lp_qseq)]
            with m.Case(L.WQ):
                with m.If((done_cnt[Tag.Q] > l_qseq) & (~core.full[BufSel.Q] | redo) & ~seg_on):
                    seg(BufSel.Q, mp["q"] + Mux(l_b, mp["q_half"], 0), l_nq, wql, rowW)
                    m.d.sync += [ls.eq(L.Q), redo.eq(0)]
            with m.Case(L.Q):
                with m.If(seg_done):
                    with m.If(twice):        # injected fault: load the Q tile again
                        m.d.sync += [ls.eq(L.WQ), twice.eq(0), redo.eq(1)]
                    with m.Else():
                        m.d.sync += ls.eq(L.WK)
            with m.Case(L.WK):
                with m.If(k_in & kfree & ~seg_on):
                    seg(Mux(lhalf, BufSel.K1, BufSel.K0), lslot, ld_nk, wql, rowW)
                    m.d.sync += ls.eq(L.K)
            with m.Case(L.K):
                with m.If(seg_done):
                    m.d.sync += ls.eq(L.WV)
            with m.Case(L.WV):
                with m.If(v_in & vfree & ~seg_on):
                    seg(Mux(lhalf, BufSel.V1, BufSel.V0), lslot + mp["slot_v"], ld_nk, wql, rowW)
                    m.d.sync += ls.eq(L.V)
            with m.Case(L.V):
                with m.If(seg_done):
                    m.d.sync += ls.eq(Mux(mask_en, L.WM, L.REL))
            with m.Case(L.WM):
                with m.If(m_in & mfree & ~seg_on):
                    seg(BufSel.MASK, lmask, l_nq, 1, 1)
                    m.d.sync += ls.eq(L.M)
            with m.Case(L.M):
                with m.If(seg_done):
                    m.d.sync += ls.eq(L.REL)
            with m.Case(L.REL):
                with m.If(~seg_on):       # the last row write has gone out
                    m.d.comb += pp_rel.eq(Mux(resident, 0, Mux(lhalf, 0b10, 0b01)))
                    m.d.sync += [lj.eq(lj + 1), ld_left.eq(ld_left - ld_nk)]
                    with m.If(lj + 1 == l_nkv):
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
                    m.d.sync += row_reg[s * 8 * LW:(s + 1) * 8 * LW].eq(sp.rdata.payload)
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
        # SRAM port 2, ``OW`` bytes (o_lanes words) per write: one row of
        # ``wol`` writes per od core beats, so the read-out runs at full rate
        op = mem.sram_ports[1]
        asm = Signal(32 * mhd)
        asm_full = Signal()
        asm_row = Signal(range(Br))
        asm_last = Signal()                  # the q tile's last valid row
        asm_reg = Signal()                   # its O region
        owords = max(1, -(-4 * mhd // OW))
        wbuf = Signal(owords * 8 * OW)
        w_on = Signal()
        w_word = Signal(range(owords + 1))
        w_addr = Signal(32)
        w_last = Signal()
        beat = core.o.payload
        ob_nq = oe_nq[ob_t[:2]]
        # O region ob_t % 2 is free once the write-back of q tile ob_t - 2 completed
        o_free = ob_t - done_cnt[Tag.O] < 2
        tail = Signal(range(OW + 1))
        m.d.comb += tail.eq((4 * hd) & (OW - 1))
        last_word = w_word + 1 == wol
        w_fire = op.req.valid & op.req.ready
        w_free = ~w_on | (w_fire & last_word)
        m.d.comb += [op.req.valid.eq(w_on), op.req.payload.addr.eq(w_addr + w_word),
                     op.req.payload.write.eq(1),
                     op.req.payload.wdata.eq(wbuf.word_select(w_word, 8 * OW)),
                     op.req.payload.wmask.eq(Mux(last_word & (tail != 0),
                                                 (Const(1, OW + 1) << tail) - 1, (1 << OW) - 1)),
                     op.rdata.ready.eq(1)]
        with m.If(w_fire):
            m.d.sync += w_word.eq(w_word + 1)
            with m.If(last_word):
                m.d.sync += [w_on.eq(0), ow_row.eq(ow_row + 1)]
                with m.If(w_last):
                    m.d.sync += [ow_t.eq(ow_t + 1), ow_row.eq(0)]
        with m.If(asm_full & w_free):
            m.d.sync += [wbuf.eq(asm), w_on.eq(1), w_word.eq(0), w_last.eq(asm_last), asm_full.eq(0),
                         w_addr.eq(((mp["o"] + Mux(asm_reg, mp["o_half"], 0)) >> owb)
                                   + asm_row * (mp["orow_bytes"] // OW))]
        m.d.comb += core.o.ready.eq((~asm_full | w_free) & o_free)
        with m.If(core.o.valid & core.o.ready):
            with m.Switch(od):
                for v in range(1, odm + 1):
                    with m.Case(v):
                        for e in range(min(mhd, v * C)):
                            with m.If(beat.n == e % v):
                                m.d.sync += asm[32 * e:32 * (e + 1)].eq(beat.data[e // v])
            with m.If(beat.n == od - 1):
                with m.If(beat.row < ob_nq):
                    m.d.sync += [asm_full.eq(1), asm_row.eq(beat.row), asm_last.eq(beat.row == ob_nq - 1),
                                 asm_reg.eq(ob_t[0])]
                with m.If(beat.row == Br - 1):
                    m.d.sync += ob_t.eq(ob_t + 1)
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
