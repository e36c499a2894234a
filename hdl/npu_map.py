"""What the NPU's blocks share: the host's CSR memory map, the SRAM map, the
job error codes, the DMA descriptor tags, and the layouts of the streams
between the blocks that ``hdl/npu.py`` composes.

Every number here is defined once; the RTL blocks, the host testbench, the
driver and the performance model read it from this file (or from
``NPUConfig``), never retype it.
"""

from __future__ import annotations

import enum

from amaranth.lib import data
from amaranth.utils import ceil_log2

from flashnpu.config import NPUConfig

from .core import LEN_BITS, cmd_layout
from .csr import Field, Register, RegisterMap, Window
from .dma import descriptor_layout
from .mem_common import word_bytes

__all__ = ["NPU_MODULE", "QUEUE_DEPTH", "WATCHDOG_DEFAULT", "KV_STALE_DEFAULT", "O_TILES", "COUNT_BITS", "LEN_BITS",
           "NPUError", "Tag", "COUNTERS", "DESC_REGS", "JOB_REGS", "CQ_ENTRIES", "CQ_ENTRY_WORDS", "CQ_DESC",
           "CQ_FLAGS", "CQ_CPL", "register_map", "tsv_lane_bits",
           "loader_lanes", "o_lanes", "o_chunk", "sram_map", "sim_config",
           "job_layout", "qtile_layout", "otile_layout"]

NPU_MODULE = "flashnpu_npu"
#: DMA descriptor queue depth: the controller keeps at most this many
#: descriptors outstanding (its credit), so the DMA never answers QUEUE_FULL
QUEUE_DEPTH = 4
#: reset value of the ``watchdog`` register (cycles without DMA progress)
WATCHDOG_DEFAULT = 1 << 20
#: reset value of ``kv_stale_limit``: cycles a K/V tile may wait in the core's
#: buffers; a tile waits at most about two tile pairs in a normal job
#: (2 x ~1,050 cycles at 32 x 32, head_dim 128), so this only fires on a tile
#: that is never consumed (or under heavy injected stalls)
KV_STALE_DEFAULT = 1 << 16
#: q tiles handed to the core whose O write-back has not been issued yet
#: (entries of the O writer's destination table)
O_TILES = 4
#: width of the job-wide counts of q tiles, descriptors and completions
COUNT_BITS = 32
# LEN_BITS (from the core's command): width of the job's head counts,
# sequence lengths, head_dim and kv_valid_len in the CSRs


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
    KV_STALE = 14         #: a K/V tile sat in the core's buffers unconsumed too long (see ``kv_check``)


class Tag(enum.IntEnum):
    """DMA descriptor tags used by the controller and the O writer."""
    Q = 0
    K = 1
    V = 2
    M = 3
    O = 4           #: the last (or only) O write-back descriptor of a q tile
    OP = 5          #: an earlier O write-back chunk (``o_chunk`` rows)


#: performance counters, 64 bit each (``cnt_<name>_lo`` / ``_hi``), names of
#: ``scripts.perf_model.Counters``
COUNTERS = ("total_cycles", "mac_busy_cycles", "softmax_cycles", "dma_stall_cycles",
            "reg_bytes", "sram_bytes", "tsv_bytes", "dram_bytes",
            "mac_ops", "exp2_ops", "recip_ops", "q_tiles", "kv_tiles", "mac_masked")

#: DRAM byte addresses and strides of a job's tensors
DESC_REGS = ("q_base", "k_base", "v_base", "o_base", "mask_base",
             "q_head_stride", "q_row_stride", "k_head_stride", "k_row_stride",
             "v_head_stride", "v_row_stride", "o_head_stride", "o_row_stride",
             "mask_head_stride", "mask_tile_stride")

#: the registers that describe a job (the controller's inputs)
JOB_REGS = ("heads", "seq", "head_dim", "flags", "kv_valid_len", "scale_c", "debug", "kv_stale_limit") + DESC_REGS


#: entries of the command ring (``hdl/cmdq.py``) and words per entry (a
#: descriptor in ``cq_ring``, a completion record in ``cq_cpl``)
CQ_ENTRIES = 8
CQ_ENTRY_WORDS = 32
#: a command-ring descriptor: word i holds the value of register CQ_DESC[i]
#: (the job registers, then ``cq_flags``)
CQ_DESC = JOB_REGS + ("cq_flags",)
#: the descriptor's last word (not a CSR: ``CQ_FLAGS.pack(irq=1, tag=7)``)
CQ_FLAGS = Register("cq_flags", "rw", [Field("irq", 1, 0, "raise irq.done when this job completes"),
                                       Field("tag", 16, 16, "echoed in the completion record")])
#: a completion record: ``status`` (the ``status`` register's word at
#: completion), ``tag`` (tag 0..15, ring index 16..31), ``t_start`` /
#: ``t_done`` (cycle stamps of the start pulse and of done, free-running
#: 32-bit count since reset), then every counter as ``<name>_lo``, ``<name>_hi``
CQ_CPL = ("status", "tag", "t_start", "t_done") + tuple(f"{n}_{h}" for n in COUNTERS for h in ("lo", "hi"))
assert len(CQ_DESC) <= CQ_ENTRY_WORDS and len(CQ_CPL) <= CQ_ENTRY_WORDS


def register_map(config: NPUConfig) -> RegisterMap:
    """The NPU's memory map (one source for the RTL bank and the host driver).

    Each register's fields become its hardware shape (``Register.shape``),
    so the RTL reads them by name.
    """
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
    L = LEN_BITS
    rm.add(Register("heads", "rw", [Field("heads", L, 0), Field("kv_heads", L, 16)]))
    rm.add(Register("seq", "rw", [Field("seq_q", L, 0), Field("seq_kv", L, 16)]))
    rm.add(Register("head_dim", "rw", [Field("head_dim", L, 0)]))
    rm.add(Register("flags", "rw", [Field("causal", 1, 0), Field("mask_en", 1, 1)]))
    rm.add(Register("kv_valid_len", "rw", [Field("kv_valid_len", L, 0, "keys >= it are invisible")],
                    reset=(1 << L) - 1))
    rm.add(Register("scale_c", "rw", doc="binary32 bits of numerics.scale_log2e(scale)"))
    rm.add(Register("watchdog", "rw", doc="DMA no-progress limit in cycles", reset=WATCHDOG_DEFAULT))
    rm.add(Register("debug", "rw", [Field("inject_double_q", 1, 0, "load the Q tile twice (tests)"),
                                    Field("no_queue_limit", 1, 1, "ignore the descriptor credit (tests)"),
                                    Field("inject_skip_init", 1, 2,
                                          "the core's INIT program issues NOPs: m_i, l_i, O_acc unwritten (tests)"),
                                    Field("inject_drop_s_write", 1, 3,
                                          "kv tile 1's first S step issues a NOP: S(0, 0) unwritten (tests)"),
                                    Field("inject_kv_extra", 1, 4,
                                          "the loader delivers one kv tile more than the core runs (tests)")]))
    rm.add(Register("reg_check", "ro", [Field("reg", 12, 0, "PE register index (core.register_name)"),
                                        Field("phase", 4, 12, "core Phase of the reading step"),
                                        Field("tile", 16, 16, "kv tile of the reading step")],
                    doc="the first PE register read before it was written (error REG_UNWRITTEN)"))
    rm.add(Register("s_check", "rw", [Field("en", 1, 0, "queue per-kv-tile counts of non-zero P")],
                    doc="S-tile check: the host compares each count with the golden model's (hdl/s_check.py)"))
    rm.add(Register("s_tile", "ro", [Field("valid", 1, 0, "an entry is queued"),
                                     Field("overflow", 1, 1, "entries were dropped (the host fell behind)"),
                                     Field("q_tile", 15, 2, "q tile of the job"),
                                     Field("kv_tile", 15, 17, "kv tile of the q tile")],
                    doc="head entry of the S-tile check queue"))
    rm.add(Register("s_count", "ro", doc="non-zero P entries of the head entry's tile"))
    rm.add(Register("s_tile_pop", "w1p", [Field("pop", 1, 0, "drop the head entry")]))
    rm.add(Register("stall", "rw", [Field("rate", 4, 0, "SRAM ports stall with probability rate/16 (0: off)"),
                                    Field("seed", 16, 16, "LFSR seed, loaded at job start")],
                    doc="test-only random backpressure on the SRAM ports (hdl/stall.py)"))
    rm.add(Register("kv_stale_limit", "rw", doc="cycles a delivered K/V tile may wait unconsumed "
                    "in the core's buffers (error KV_STALE)", reset=KV_STALE_DEFAULT))
    rm.add(Register("kv_check", "ro", [Field("buf", 3, 0, "core buffer (core.BufSel: K0, V0, K1, V1)"),
                                       Field("tile", LEN_BITS, 8, "kv tile index within its q tile"),
                                       Field("q_tile", 8, 24, "q tile of the job (low 8 bits)")],
                    doc="the K/V tile that went stale (error KV_STALE)"))
    C = config.dram_channels
    cb = max(1, (C - 1).bit_length())
    rm.add(Register("tsv_ctl", "w1p", [Field("bist_rd", 1, 0, "self-test of every channel's read bundle"),
                                       Field("bist_wr", 1, 1, "self-test of every channel's write bundle"),
                                       Field("repair_we", 1, 2, "write tsv_repair into a map")]))
    rm.add(Register("tsv_repair", "rw", [Field("idx", 8, 0), Field("lane", 16, 8), Field("valid", 1, 24),
                                         Field("link", 1, 25, "0 = read link, 1 = write link"),
                                         Field("channel", cb, 26, "the channel whose map is written")]))
    rm.add(Register("tsv_sel", "rw", [Field("channel", cb, 0)],
                    doc="the channel whose link status (tsv_status) and repair maps (tsv_*_map*) are read"))
    lb = tsv_lane_bits(config)
    for link in ("rd", "wr"):
        rm.add(Register(f"tsv_fault_{link}", "rw",
                        [Field("lanes", 16, 0, "bit i: physical lane base + i is faulty"),
                         Field("base", lb, 16, "first physical lane (spare s = tsv_data_lanes + s)"),
                         Field("stuck", 1, 16 + lb, "value the faulty lanes are stuck at")],
                        doc=f"test-only stuck-at faults on the TSV {link} links of the channels in "
                            f"tsv_fault_channels (run the self-test after)"))
    rm.add(Register("tsv_fault_channels", "rw", [Field("mask", C, 0, "bit c: channel c has the faults")],
                    reset=1, doc="test-only: the channels tsv_fault_rd / tsv_fault_wr apply to"))
    rm.add(Register("tsv_status", "ro", [Field("rd_status", 4, 0, "read link of channel tsv_sel"),
                                         Field("wr_status", 4, 4, "write link of channel tsv_sel"),
                                         Field("rd_ok", 1, 8, "every read link is OK"),
                                         Field("wr_ok", 1, 9, "every write link is OK")]))
    rm.add(Register("tsv_fail", "ro", [Field("rd", C, 0, "bit c: channel c's read link is not OK"),
                                       Field("wr", C, 16, "bit c: channel c's write link is not OK")]))
    for link in ("rd", "wr"):
        for i in range(tsv_map_regs(config)):
            rm.add(Register(f"tsv_{link}_map{i}", "ro",
                            [Field("e0_lane", 15, 0), Field("e0_valid", 1, 15),
                             Field("e1_lane", 15, 16), Field("e1_valid", 1, 31)],
                            doc="repair-map entries 2i and 2i+1 of channel tsv_sel"))
    for name in COUNTERS:
        rm.add(Register(f"cnt_{name}_lo", "ro"))
        rm.add(Register(f"cnt_{name}_hi", "ro"))
    rm.add(Register("cq_doorbell", "w1p", [Field("tail", 16, 0, "queue index after the last submitted entry"),
                                           Field("ring", 1, 31, "1: take tail")],
                    doc="command-ring doorbell (hdl/cmdq.py): entries head..tail-1 are queued"))
    rm.add(Register("cq_ctl", "w1p", [Field("reset", 1, 0, "head = tail = 0, clears halted and overrun "
                                                          "(after the running entry completes)")]))
    rm.add(Register("cq_ptr", "ro", [Field("head", 16, 0, "entries completed"),
                                     Field("tail", 16, 16, "entries submitted")]))
    rm.add(Register("cq_status", "ro", [Field("busy", 1, 0, "an entry is queued or runs"),
                                        Field("halted", 1, 1, "an entry completed with an error: "
                                                              "the queue stops until cq_ctl.reset"),
                                        Field("overrun", 1, 2, "a doorbell queued more than CQ_ENTRIES "
                                                               "(refused)"),
                                        Field("state", 3, 4, "cmdq.CQState")]))
    rm.add_window(Window("cq_ring", CQ_ENTRIES * CQ_ENTRY_WORDS, "rw",
                         doc="descriptors: entry e at words 32*e.. (CQ_DESC order)"))
    rm.add_window(Window("cq_cpl", CQ_ENTRIES * CQ_ENTRY_WORDS, "ro",
                         doc="completion records: entry e at words 32*e.. (CQ_CPL order)"))
    return rm


def tsv_lane_bits(config: NPUConfig) -> int:
    """Width of a physical TSV lane index (data + spare lanes) in ``tsv_fault_*``.

    Raises ``ValueError`` when the fields do not fit one 32-bit register.
    """
    nl = config.tsv_data_lanes + config.tsv_spare_lanes
    lb = max(1, (nl - 1).bit_length())
    if 16 + lb + 1 > 32:
        raise ValueError(f"tsv_fault_* cannot address {nl} TSV lanes in one register")
    return lb


def tsv_map_regs(config: NPUConfig) -> int:
    """``tsv_<link>_map<i>`` registers per link: two repair-map entries each."""
    return (config.tsv_spare_lanes + 1) // 2


def loader_lanes(config: NPUConfig) -> int:
    """Bus words per SRAM request of the tile loader (4, as the O writer's
    port, at most the bank count).  In steady state the core takes a K and
    a V tile, 2*Bc*2*head_dim bytes, per ~2*Bc*head_dim/C cycles, just
    under one word per cycle at d = 128 on 32 x 32, so two words would do;
    but the first q tile's Q and K_0 load in series before anything
    computes, and at 32 x 32, d = 128, four words instead of two cut that
    wait from 654 to about 400 cycles (``dma_stall_cycles`` in
    ``results/npu.json``)."""
    return min(4, config.sram_banks)


def o_lanes(config: NPUConfig) -> int:
    """Bus words per SRAM write of the O writer: C FP32 lanes per core beat
    (4 words at 32 x 32), rounded up to a power of two, at most the bank count."""
    need = -(-4 * config.array_cols // word_bytes(config))
    return min(config.sram_banks, 1 << ceil_log2(max(1, need)))


def o_chunk(config: NPUConfig) -> int:
    """Rows per O write-back descriptor (Br / 4): the write-back of a q tile
    starts while the core still streams its later rows."""
    return max(1, config.br // 4)


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

    def rup(n, a):
        return -(-n // a) * a

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


# ----------------------------------------------------------------- block interfaces
def job_layout(config: NPUConfig) -> data.StructLayout:
    """What the datapath blocks (tile loader, O writer) need to know about the
    running job, driven by the controller: ``head_dim`` and ``mask_en`` (from
    the CSRs), ``od`` (O columns per PE, ceil(head_dim / C)) and ``resident``
    (every kv tile of a KV head has an SRAM slot), both set when the job
    passes its checks, ``double_q`` and ``kv_extra`` (``debug.inject_double_q``,
    ``debug.inject_kv_extra``), and ``stale_limit`` (``kv_stale_limit``)."""
    return data.StructLayout({
        "head_dim": LEN_BITS, "mask_en": 1, "double_q": 1, "kv_extra": 1, "resident": 1,
        "od": range(config.o_cols_per_pe(config.max_head_dim) + 1), "stale_limit": 32,
    })


def qtile_layout(config: NPUConfig) -> data.StructLayout:
    """A q tile handed from the controller to the tile loader.

    ``region`` Q region (and resident-mask parity) of the tile (its index % 2),
    ``nq`` valid query rows, ``n_kv`` kv tiles the core runs, ``kv_end`` keys
    to load (the last visible key + 1), ``k_base`` / ``m_base`` K/V tile
    pairs / mask tiles issued before this tile's first one (the DMA
    completion counts its tiles wait for), ``seq`` q tiles handed over before
    it (the Q completion it waits for).
    """
    return data.StructLayout({
        "region": 1, "nq": range(config.br + 1), "n_kv": cmd_layout(config)["n_kv"].shape,
        "kv_end": LEN_BITS + 1, "k_base": COUNT_BITS, "m_base": COUNT_BITS, "seq": COUNT_BITS,
    })


def otile_layout(config: NPUConfig) -> data.StructLayout:
    """Where a q tile's O goes, handed from the controller to the O writer:
    ``nq`` valid rows, ``dst`` DRAM byte address of its first row, ``stride``
    bytes between its rows."""
    return data.StructLayout({
        "nq": range(config.br + 1), "dst": descriptor_layout["dst"].shape,
        "stride": descriptor_layout["dst_stride"].shape,
    })
