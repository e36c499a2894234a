"""The NPU top level: it only composes the blocks below and wires them.

Dataflow, and which file holds which box
----------------------------------------
::

  host ─CSR bus─► CSRBank ──job registers──► Controller ──cmd───────────────────────────► Core
  (csr.py)          ▲ status, irq,           (controller.py)                              (core.py)
                    │ reg_check,               │ qtile ──► TileLoader (loader.py) ──wr──►  │
                    │ counters, TSV            │ otile ──► OWriter (owriter.py) ◄───o──────┘
                    │                          │ desc        │ wb    ▲            ▲
                    │                          ▼             ▼       │ SRAM port 2 │ SRAM port 1
                    │                  DMAPort (dma_port.py)         │            │ (loader)
                    │                          │ desc  ▲ done        │            │
                    │                          ▼       │             │            │
                    │        MemorySystem (dma.py): DMA (SRAM port 0, one word per channel
                    │        per cycle), SRAM (sram.py), per channel a TSV bundle pair (tsv.py)
                    │        and DRAM timing (dram.py) ──bk[c]──► DRAM storage (sim/dram_model.py)
                    ├── CommandQueue (cmdq.py): descriptor ring and completion records (CSR
                    │   windows), doorbell; while it runs a job it drives the controller's
                    │   job registers and start, and takes its done, status and the counters
                    ├── PerfCounters (counters.py): cycles, bytes per level, ops
                    ├── TSVControl (tsv_ctl.py): self-test, repair map, fault injection
                    ├── StallInjector (stall.py): test-only random SRAM backpressure
                    └── STileMonitor (s_check.py): per-kv-tile counts of non-zero P

Shared definitions (register map, SRAM map, error codes, DMA tags, the
layouts of the streams between the blocks) are in ``npu_map.py`` and
re-exported here.  Each block owns its state and clears it on the
controller's ``job_start``.

SRAM map (bytes, ``sram_map``): two Q regions (Br rows of ``row_bytes``),
two O regions (Br rows of ``orow_bytes``, FP32), ``config.kv_slots`` K/V
slots, each [K tile | V tile | mask tile] (Bc, Bc and Br rows; slots 0 and 1
are the DMA's ping-pong halves when K/V stream) and the resident mode's mask
tiles (two q-tile parities x ``config.kv_slots``).  ``sim_config`` shrinks the
simulated SRAM to the next power of two above the map (1 MiB at 32 x 32).

Per q tile t (region t % 2)::

  controller: Q_t ─► K_j,V_j (only kv tiles not yet resident) ─► masks ─┐ one q tile
  DMA:        ─Q_t─K/V(first q tile of a KV head)─ ... ─O_{t-1} chunks─┘ ahead of the core
  loader:     Q_t (after the core freed Q) ─► K_0 ─► V_0 ─► K_1 ...   2 words / request
  core:       INIT ─ S_0 SM PV_0 ─ S_1 ... ─ FINAL ─ OUT ─► O writer (C FP32 lanes / request)
                                                              └─► O_t chunks ─DMA─► DRAM

Design trade-offs
-----------------
* **K/V resident in SRAM.**  When every kv tile of a KV head has a slot
  (ceil(min(seq_kv, kv_valid_len) / Bc) <= ``config.kv_slots``), the first q tile
  that needs kv tile j (of the first query head of the GQA group) DMAs it,
  whole, into slot j; every later q tile and every other query head of the
  group has the loader read it straight from SRAM.  At 512 tokens, d = 128
  that removes 8 x 32 KiB of K/V per q tile from the DMA and the DRAM
  channels (the SRAM has the room; the DRAM's 256 B/cycle would carry it
  in about 1 200 of the q tile's 8 192 MAC cycles, the energy is what it saves).  The
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
* **Loader between SRAM and the core** (two bus words per request), **O
  row assembly** (C FP32 lanes per SRAM write, so the read-out never waits)
  and **skipping masked kv tiles**: argued in ``loader.py``, ``owriter.py``
  and ``controller.py``.
* **Command ring behind the CSRs** (``cmdq.py``): the host queues whole
  sweeps of jobs with one doorbell and reads a completion record per job
  instead of programming and polling each; the ring lives in a small
  on-chip memory rather than in DRAM, so fetching a descriptor needs no
  DMA and no SRAM port (25 cycles), at the cost of the host writing it
  over the CSR bus.
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
or while a write to it was still in the PE pipeline
(S/P and alpha: the kv tile; m_i, l_i, O_acc: the q tile, from INIT), checked
by the core on every control word, first offending read in ``reg_check``
(injectable: ``debug.inject_skip_init``, ``debug.inject_drop_s_write``).

TSV fault injection (tests, ``tsv_ctl.py``): ``tsv_fault_rd`` / ``tsv_fault_wr`` hold stuck-at
faults on up to 16 consecutive physical lanes of a link (spares included).
After the host's self-test the repair map covers up to ``tsv_spare_lanes``
failed data lanes (data still bit-exact, no cycle lost); with more, the link
is not OK and a started job is rejected with ``LINK_DOWN``.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Value
from amaranth.back import verilog
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .array import module_texts
from .cmdq import CommandQueue
from .controller import Controller, CtrlState
from .core import Core
from .counters import PerfCounters
from .csr import CSRBank
from .dma import MemorySystem
from .dma_port import DMAPort
from .dram import DRAMBackendSignature
from .loader import LoaderState, TileLoader
from .mem_common import addr_bits_for, strip_zero_memory_init
from .npu_map import (
    COUNTERS,
    JOB_REGS,
    NPU_MODULE,
    QUEUE_DEPTH,
    NPUError,
    Tag,
    loader_lanes,
    o_chunk,
    o_lanes,
    register_map,
    sim_config,
    sram_map,
    tsv_map_regs,
)
from .owriter import OWriter
from .s_check import STileMonitor
from .stall import StallInjector
from .tsv_ctl import TSVControl

__all__ = ["NPUError", "Tag", "COUNTERS", "CtrlState", "LoaderState", "register_map", "sram_map",
           "loader_lanes", "o_lanes", "o_chunk", "sim_config", "NPU", "NPU_MODULE", "npu_verilog"]


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
    bk[c] : Out(DRAMBackendSignature)   DRAM channel c to the storage model (outside the RTL)

    Raises
    ------
    ValueError
        ``sram_bytes`` below the SRAM map, or ``bc`` wider than a mask row.
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
        super().__init__({
            "csr_addr": In(self.regmap.addr_width), "csr_w_en": In(1), "csr_w_data": In(32),
            "csr_r_en": In(1), "csr_r_data": Out(32), "irq": Out(1),
            "bk": Out(DRAMBackendSignature(addr_bits_for(config.dram_bytes, W), W)).array(config.dram_channels),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        m.submodules.csr = csr = CSRBank(self.regmap)
        m.submodules.cmdq = cq = CommandQueue(self.regmap)
        m.submodules.ctrl = ctrl = Controller(cfg, self.regmap)
        m.submodules.dma_port = port = DMAPort()
        m.submodules.loader = loader = TileLoader(cfg)
        m.submodules.o_writer = ow = OWriter(cfg)
        m.submodules.core = core = Core(cfg, self.pe_as_instance)
        m.submodules.mem = mem = MemorySystem(cfg, n_consumers=2, queue_depth=QUEUE_DEPTH,
                                              consumer_lanes=(loader_lanes(cfg), o_lanes(cfg)))
        m.submodules.counters = cnt = PerfCounters(cfg)
        m.submodules.tsv_ctl = tsv = TSVControl(cfg, self.regmap)
        m.submodules.stall = stall = StallInjector(3, self.regmap)   # DMA, loader, O writer SRAM ports
        m.submodules.s_check = s_mon = STileMonitor(cfg, self.regmap)

        # streams between the blocks
        wiring.connect(m, controller=ctrl.cmd, core=core.cmd)
        wiring.connect(m, controller=ctrl.qtile, loader=loader.qtile)
        wiring.connect(m, controller=ctrl.otile, o_writer=ow.otile)
        wiring.connect(m, controller=ctrl.desc, dma_port=port.iss)
        wiring.connect(m, o_writer=ow.wb, dma_port=port.wb)
        wiring.connect(m, dma_port=port.desc, memory=mem.desc)
        wiring.connect(m, memory=mem.done, dma_port=port.done)
        wiring.connect(m, loader=loader.wr, core=core.wr)
        wiring.connect(m, core=core.o, o_writer=ow.o)
        wiring.connect(m, loader=loader.sram, memory=mem.sram_ports[0])
        wiring.connect(m, o_writer=ow.sram, memory=mem.sram_ports[1])
        for c in range(cfg.dram_channels):
            wiring.connect(m, tsv_ctl=tsv.rd[c], memory=mem.tsv_rd[c])
            wiring.connect(m, tsv_ctl=tsv.wr[c], memory=mem.tsv_wr[c])
            wiring.connect(m, memory=mem.bk[c], npu=wiring.flipped(self.bk[c]))

        self._wire_csrs(m, csr, ctrl, port, core, cnt, tsv, loader, cq)
        # status and job flow between the blocks
        m.d.comb += [
            ctrl.link_ok.eq(tsv.ok),
            ctrl.core_busy.eq(core.busy), ctrl.core_err.eq(core.err), ctrl.reg_err.eq(core.reg_err),
            ctrl.ld_busy.eq(loader.busy), ctrl.ld_fail.eq(loader.fail), ctrl.ld_fail_code.eq(loader.fail_code),
            ctrl.dma_fail.eq(port.fail), ctrl.dma_fail_code.eq(port.fail_code), ctrl.dma_code.eq(port.dma_code),
            ctrl.dma_pending.eq(port.pending), ctrl.dma_idle.eq(port.idle), ctrl.o_idle.eq(ow.idle),
            port.beats.eq(mem.dma_beats), port.armed.eq(ctrl.running), port.clear.eq(ctrl.job_start),
            loader.run.eq(ctrl.running), loader.job.eq(ctrl.job), loader.done_count.eq(port.done_count),
            loader.core_full.eq(core.full), loader.pp_full.eq(mem.pp_full),
            ow.job.eq(ctrl.job), ow.clear.eq(ctrl.job_start), ow.active.eq(ctrl.active),
            ow.done_o.eq(port.done_count[Tag.O]),
            # the memory system's regions: all of DRAM and SRAM; K/V ping-pong in slots 0 and 1
            mem.dram_lo.eq(0), mem.dram_hi.eq(cfg.dram_bytes), mem.sram_lo.eq(0), mem.sram_hi.eq(cfg.sram_bytes),
            mem.pp_base.eq(self.map["pp"]), mem.pp_half_bytes.eq(ctrl.pp_half_bytes),
            mem.pp_release.eq(loader.pp_release),
            stall.ctl.eq(csr.port("stall", "value")), stall.start.eq(ctrl.job_start), stall.run.eq(ctrl.running),
            mem.sram_stall.eq(stall.stall),
            s_mon.pnz.eq(core.pnz), s_mon.phase.eq(core.phase), s_mon.tile.eq(core.tile),
            s_mon.core_done.eq(core.done), s_mon.clear.eq(ctrl.job_start),
            s_mon.en.eq(csr.port("s_check", "value").en), s_mon.pop.eq(csr.port("s_tile_pop", "pulse").pop),
            csr.port("s_tile", "status").eq(s_mon.head), csr.port("s_count", "status").eq(s_mon.count),
            cnt.clear.eq(ctrl.job_start), cnt.running.eq(ctrl.running), cnt.core_done.eq(core.done),
            cnt.ev.eq(core.ev),
        ]
        m.d.comb += [getattr(cnt, n).eq(getattr(mem, n)) for n in ("sram_rd_bytes", "sram_wr_bytes",
                                                                   "dram_rd_bytes", "dram_wr_bytes",
                                                                   "tsv_rd_words", "tsv_wr_words")]
        return m

    def _wire_csrs(self, m, csr, ctrl, port, core, cnt, tsv, loader, cq):
        """The host's CSRs to and from the blocks, field by field; the job
        registers and the start pulse come from the command queue while it
        runs a job (``hdl/cmdq.py``), and the controller's irq bits are then
        the queue's to raise."""
        m.d.comb += [csr.addr.eq(self.csr_addr), csr.w_en.eq(self.csr_w_en),
                     csr.w_data.eq(self.csr_w_data), csr.r_en.eq(self.csr_r_en),
                     self.csr_r_data.eq(csr.r_data)]
        m.d.comb += [getattr(ctrl, name).eq(Mux(cq.active, getattr(cq.job, name),
                                                Value.cast(csr.port(name, "value"))))
                     for name in JOB_REGS]
        for win, side in (("cq_ring", "ring"), ("cq_cpl", "cpl")):
            kinds = ("addr", "r_en") + (("w_en", "w_data") if self.regmap.window(win).access == "rw" else ())
            m.d.comb += [getattr(cq, f"{side}__{k}").eq(csr.window_port(win, k)) for k in kinds]
            m.d.comb += csr.window_port(win, "r_data").eq(getattr(cq, f"{side}__r_data"))
        m.d.comb += [cq.doorbell.eq(csr.port("cq_doorbell", "pulse")), cq.ctl.eq(csr.port("cq_ctl", "pulse")),
                     csr.port("cq_ptr", "status").eq(cq.ptr), csr.port("cq_status", "status").eq(cq.status),
                     cq.ctrl_busy.eq(ctrl.status.busy), cq.ctrl_done.eq(ctrl.irq.done),
                     cq.ctrl_status.eq(Value.cast(ctrl.status)), cq.counters.eq(cnt.counters)]
        debug = ctrl.debug                  # the running job's (the queue's or the host's)
        irq = csr.port("irq", "value")
        reg_check = csr.port("reg_check", "status")
        m.d.comb += [
            ctrl.start.eq(Mux(cq.active, cq.start, csr.port("ctrl", "pulse").start)),
            csr.port("status", "status").eq(ctrl.status),
            csr.port("irq", "set").eq(Mux(cq.active, 0, Value.cast(ctrl.irq)) | Value.cast(cq.irq)),
            self.irq.eq(Value.cast(irq).any()),
            port.limit.eq(csr.port("watchdog", "value")), port.no_limit.eq(debug.no_queue_limit),
            core.inject.eq(Cat(debug.inject_skip_init, debug.inject_drop_s_write)),
            reg_check.reg.eq(core.reg_err_addr), reg_check.phase.eq(core.reg_err_phase),
            reg_check.tile.eq(core.reg_err_tile),
            csr.port("kv_check", "status").buf.eq(loader.stale.buf),
            csr.port("kv_check", "status").tile.eq(loader.stale.tile),
            csr.port("kv_check", "status").q_tile.eq(loader.stale.q_tile),
            tsv.ctl.eq(csr.port("tsv_ctl", "pulse")), tsv.repair.eq(csr.port("tsv_repair", "value")),
            tsv.sel.eq(csr.port("tsv_sel", "value")),
            tsv.fault_channels.eq(csr.port("tsv_fault_channels", "value")),
            csr.port("tsv_status", "status").eq(tsv.status), csr.port("tsv_fail", "status").eq(tsv.fail),
        ]
        for link in ("rd", "wr"):
            m.d.comb += getattr(tsv, f"fault_{link}").eq(csr.port(f"tsv_fault_{link}", "value"))
            for i in range(tsv_map_regs(self.config)):
                m.d.comb += csr.port(f"tsv_{link}_map{i}", "status").eq(getattr(tsv, f"{link}_map")[i])
        for name in COUNTERS:
            value = Value.cast(cnt.counters[name])
            m.d.comb += [csr.port(f"cnt_{name}_lo", "status").eq(value[0:32]),
                         csr.port(f"cnt_{name}_hi", "status").eq(value[32:64])]


def npu_verilog(config: NPUConfig, top: "NPU | None" = None, name: str = NPU_MODULE) -> str:
    """Verilog of the NPU (zero memory initialisers stripped) with the PE,
    PE-row, tree-node and reciprocal modules appended once."""
    if top is None:
        top = NPU(config, pe_as_instance=True)
    text = strip_zero_memory_init(verilog.convert(top, name=name, emit_src=False))
    return text + "\n" + module_texts(config)
