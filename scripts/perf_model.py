"""Fast analytical (transaction-level) performance model of the NPU.

It produces, for any attention job, the same counter set as the RTL NPU's
performance counters (``Counters``), for the register-level design and for
the SRAM-spill baseline, in milliseconds of host time even at 32k tokens.

Dataflow that is counted (one q tile x one kv tile, R x C array, each PE
holding a wr x wc block of S and a wr x od block of O_acc, od = ceil(d / C))::

    DRAM ──TSV──► SRAM ──Q tile (once per q tile)──► Q buffer ──rows──┐
      ▲            │ ──K tile, V tile (once per pair)──── columns ──► PE array
      │            ▼                                                  │ S, m, l,
      └──TSV── SRAM ◄── O (once per q tile) ◄───────────────────────── O_acc in
                                                                         registers
    per q tile : init (m, l, O_acc)                                 [core INIT]
    per pair   : S phase d·wr·wc + softmax program + PV keys·wr·od  [S, SM, PV]
                 (keys: up to the tile's last key a valid row sees, <= Bc)
    per q tile : the last softmax's reciprocal starts (1/l runs during the
                 last P·V), final (O = O_acc/l) + read-out rows·od+1 [FINAL, OUT]
                 (rows: the q tile's valid rows, <= Br)
    plus the cycles the core waits for a tile buffer (DMA stall)    [WAIT_*]

    baseline ("ordinary NPU"): after Q·Kᵀ the S tile (FP32) is drained to
    ``spill_level`` and read back for the softmax, P (FP16) written back and
    read again for P·V; everything else is identical.

The counters follow the definitions of the RTL core (``hdl/core.py``): MAC
slots = R·C per MAC cycle, exp2 = R·C per PEXP/MALPHA cycle, reciprocals =
R per start, softmax cycles = cycles in the softmax program.  Two of them
therefore differ from ``golden.op_counts`` on purpose: exp2 counts the alpha
that every PE of a row evaluates for itself (br·C instead of br per pair),
and MAC slots count the idle O columns when head_dim is not a multiple of C.
Phase lengths come from the RTL's own micro-programs when they can be read
(``rtl_program_cycles``), else from formulas; ``Timing`` holds every figure
and ``calibrate_timing`` fits it to the RTL counters.

Design trade-off of the model itself: every pair of one q tile costs the same
except the last (partial) kv tile, so the model is closed-form per q tile;
only the K/V waits between pairs walk the kv tiles of a q tile (memoised, so
a 32k-token sweep still takes seconds).  Nothing is simulated cycle by
cycle; the RTL validation test (``tb/model/test_perf_model.py``, every counter
exact on 8x8 jobs) is what keeps the formulas honest.

Every ASSUMPTION is marked where it is made.  The main ones:

* the phases of a pair run back to back (the core does; the architecture's
  target of hiding the softmax is ``Timing.overlap_softmax``);
* a q tile costs a full tile of MAC and softmax cycles, however few of its
  rows are valid (decode: 3 valid rows of 64 still take a full tile); only
  its read-out stops after the last valid row;
* padding keys and rows are neither fetched from DRAM nor read from SRAM
  (masked keys never touch the result), but their Q·Kᵀ MAC and exp2 slots
  are executed and counted; P·V stops after the tile's last key that a
  valid row sees (the core's rule), so its slots run only up to there;
* O is written back as FP32 (the core streams binary32 O);
* the NPU's schedule (``hdl/npu.py``): K/V resident in SRAM slots when
  ceil(seq_kv / Bc) <= ``config.kv_slots`` (each kv tile fetched once per KV head,
  whole), else streamed through two ping-pong halves for every q tile; two
  Q and two O regions, so the core takes the next q tile's command as the
  read-out of the last one starts (``Timing.early_accept``); one DMA engine at one bus word per cycle, a loader at
  four words per request, an O writer at C FP32 lanes per request; the O
  write-back in chunks of Br/4 rows.  In series stay the first q tile's
  wait for Q and K_0 (and for V_0 when the DMA's two-descriptor write side
  makes V_0 pay a second DRAM latency) and the last q tile's O write-back;
  the K/V waits between pairs come from a walk of the hand-shakes
  (``_pair_stalls``).  Constants fitted on the RTL (every counter exact
  on the 12 validation jobs at 8x8 and at 4x4): the start
  (``Timing.first_tile_fixed_cycles``, ``first_v_fixed_cycles``,
  ``start_conflict_rows``: SRAM bank conflicts between the loader's Q reads
  and the DMA's K writes), the O tail (``o_*_cycles``) and the controller
  set-up (``qtile_ctrl_cycles``).  Not modelled: bank conflicts elsewhere
  and the waits at a new KV head (32x32 decode: 5.9 % low);
* ``reg_bytes`` counts what the RTL counter counts (8 bytes per MAC slot and
  per exp2); the rest of the register traffic is ``OpDetail.reg_extra_bytes``;
* byte counters count whole bus words (``sram_bank_bytes``) per tile row;
* register traffic: 4 bytes per 32-bit register access, one access per
  operand read or result write of each control word.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import math
from dataclasses import dataclass, field

import numpy as np

from flashnpu.config import DEFAULT, NPUConfig
from flashnpu.sim.case import random_case

__all__ = ["Job", "Timing", "rtl_program_cycles", "Counters", "OpDetail", "ModelResult", "model", "RTL_COUNTER_FIELDS",
           "rtl_counters", "rtl_counters_many", "rtl_core_counters", "RTLUnavailable", "counters_from_stats",
           "calibrate_timing", "kv_tile_intensity",
           "roofs", "useful_flops", "SPILL_LEVELS", "DESIGNS", "compare"]

DESIGNS = ("register", "baseline")
#: where the baseline keeps its S/P tile.  ``unfused``: the ordinary NPU that
#: keeps the whole S row block (Br x seq_kv, FP32 S and FP16 P) in the stacked
#: SRAM while it fits next to the K/V buffers, and spills it to
#: ``overflow_level`` when it does not.
SPILL_LEVELS = ("sram", "stacked_dram", "offchip", "unfused")

#: Counters the RTL NPU exposes; the validation test compares exactly these.
RTL_COUNTER_FIELDS = ("total_cycles", "mac_busy_cycles", "softmax_cycles", "dma_stall_cycles",
                      "reg_bytes", "sram_bytes", "tsv_bytes", "dram_bytes",
                      "mac_ops", "exp2_ops", "recip_ops", "mac_masked")

FP16, FP32 = 2, 4          # bytes per element
REG_BYTES = 4              # one 32-bit register access


@dataclass(frozen=True)
class Job:
    """One attention job.

    Parameters
    ----------
    heads, kv_heads : int
        Query heads and K/V heads (grouped-query: heads % kv_heads == 0;
        ``kv_heads=None`` means heads).
    seq_q, seq_kv : int
        Query rows and keys per head.
    head_dim : int
        d, 1 .. config.max_head_dim.
    causal : bool
        Bottom-right aligned causal mask: key j visible to query i when
        j <= i + (seq_kv - seq_q).
    """

    heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    kv_heads: int | None = None
    causal: bool = False

    def __post_init__(self):
        for name in ("heads", "seq_q", "seq_kv", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, not {v!r}")
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if not isinstance(kv, int) or kv <= 0 or self.heads % kv:
            raise ValueError(f"kv_heads must be a positive divisor of heads={self.heads}, not {kv!r}")
        object.__setattr__(self, "kv_heads", kv)

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.heads // self.kv_heads

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=256)
def rtl_program_cycles(config: NPUConfig, head_dim: int) -> dict | None:
    """Run-time lengths (cycles) of the core's micro-programs, read from the RTL.

    ``flashnpu.hdl.core`` builds the init, softmax and final programs as
    scheduled lists of control words, one variant per O-column count
    ``od = ceil(head_dim / C)``; this walks that variant the way the core's
    sequencer does: one word per cycle, and a word that waits for a return
    register stalls until it has arrived, ``RowReduce.LATENCY`` (tree) or
    ``Recip.LATENCY`` cycles + 1 after the word that started it.  A
    scheduled program never stalls (``tb/unit/test_array.py``), so this is
    its length; the walk keeps the model honest if that ever changes.

    Returns
    -------
    dict or None
        ``init``, ``softmax``, ``softmax_last`` (the q tile's last kv tile,
        which also starts the reciprocals), ``final`` (cycles, its
        reciprocals arrived), ``final_ready`` (per reciprocal: the FINAL
        slot of its first reader and its arrival, counted from the start of
        ``softmax_last``: FINAL waits ``final_wait`` cycles when the P·V
        between them is short) and ``softmax_slots`` (the softmax
        program's slots, as offsets from its start, where the next kv
        tile's Q·Kᵀ may issue: ``mac_ok``, empty without
        ``softmax_overlap``), or None when the RTL core cannot be imported
        or its programs do not have the expected form.
    """
    try:
        # deferred: the RTL imports amaranth, which `flashnpu --help` (through
        # `flashnpu bench`) does not need
        from flashnpu.hdl.core import final_program, init_program, softmax_program
        from flashnpu.hdl.fpu import Recip
        from flashnpu.hdl.pe import TreeOp
        from flashnpu.hdl.reduce import tree_latency
        tree_lat = tree_latency(config.array_cols)
        od = config.o_cols_per_pe(head_dim)

        def run(prog, ready=None):
            t, ready = 0, dict(ready or {})
            for w in prog:
                ctl = w["ctl"]
                if w.get("wait") and ctl["ret_sel"] in ready:
                    t = max(t, ready[ctl["ret_sel"]])
                if ctl.get("rcp"):
                    ready[ctl["tag"]] = t + 1 + Recip.LATENCY
                if ctl.get("tree", TreeOp.NONE) != TreeOp.NONE:
                    ready[ctl["tag"]] = t + 1 + tree_lat
                t += 1
                if w.get("last"):
                    break
            return t, ready

        sm = softmax_program(config, od)
        sm_last, rcp = run(softmax_program(config, od, last=True))
        final = final_program(config, od)
        first_read = {}
        for c, w in enumerate(final):
            if w.get("wait"):
                first_read.setdefault(w["ctl"]["ret_sel"], c)
        return dict(init=run(init_program(config, od))[0], softmax=run(sm)[0], softmax_last=sm_last,
                    final=run(final, {tag: 0 for tag in first_read})[0],
                    final_ready=tuple((c, rcp[tag]) for tag, c in sorted(first_read.items())),
                    softmax_slots=tuple(c for c, w in enumerate(sm) if w.get("mac_ok")))
    except Exception:            # no RTL yet, or a program of another form: use the formulas
        return None


@dataclass(frozen=True)
class Timing:
    """Cycle costs that the RTL fixes.

    Each phase length is taken, in this order, from an ``*_override`` (a
    figure calibrated from the RTL counters, see ``calibrate_timing``), from
    the RTL core's own micro-programs (``rtl_program_cycles``) when
    ``use_rtl_programs`` and ``flashnpu.hdl.core`` imports, or from a formula
    (ASSUMPTION) otherwise.

    Attributes
    ----------
    softmax_override, init_override, final_override : int or None
        Softmax phase of one pair; m/l/O_acc initialisation and O = O_acc/l
        normalisation of one q tile (cycles).
    use_rtl_programs : bool
        Read the phase lengths from ``flashnpu.hdl.core`` when possible.
    elem_cycles, tree_level_cycles, exp2_latency : int
        Formula fallback: cycles per S element per pass in one PE, per
        reduction-tree level, and exp2 pipeline latency.
    recip_cycles : int
        Latency of one reciprocal (27 cycles, the RTL's ``Recip.LATENCY``).
    mac_recurrence : int
        Issue distance between two MACs on one accumulator (4 cycles, the
        RTL's ``pe.MAC_RECURRENCE``): a k round of the S or P.V loop with
        fewer accumulators per PE waits out the difference.
    qtile_gap_cycles : int
        Cycles per q tile outside the micro-programs and the MAC phases: the
        core passes through WAIT_K for one cycle after INIT even when K is
        there (1, measured on the RTL core; not a stall).
    first_tile_fixed_cycles : int or None
        Fixed part of the first q tile's wait for Q and K_0, counted from
        INIT (None: DRAM latency + 11).  The wait is this + the DMA's Q words
        + max(the loader's Q requests - 1, the DMA's K_0 words + Q rows //
        ``start_conflict_rows``) + the loader's K_0 requests.  Fitted on the
        RTL NPU (8x8 and 4x4).
    start_conflict_rows : int
        One cycle of SRAM bank conflict (the loader reading Q while the DMA
        writes K_0) per this many Q rows (8, fitted).
    first_v_fixed_cycles : int or None
        When V_0 is in for P·V_0, counted from INIT (None: 2 x DRAM latency
        + 9, + the DMA's Q and K_0 words + the loader's V_0 requests): the
        DMA's write side holds two descriptors, so short Q and K_0 tiles
        make V_0 pay a second latency.  Fitted (8x8, head_dim 16).
    qtile_ctrl_cycles : int
        Controller cycles before the core takes the first command (SETUP,
        SETUP2, CMD): 3.
    o_row_cycles, o_early_cycles, o_issue_cycles, o_chunk_gap_cycles, o_done_cycles, o_tail_min_cycles : int
        The last q tile's O tail: row r of the read-out is in SRAM
        (r + 1)·max(od, wol) + wol + ``o_row_cycles`` cycles after OUT starts
        (``o_early_cycles`` earlier when the writer needs fewer requests than
        beats per row); each chunk of Br/4 rows starts on the DMA
        ``o_issue_cycles`` after its last row, or ``o_chunk_gap_cycles``
        after the previous chunk, and moves wo words per row; the job ends
        ``o_done_cycles`` after the last word, at least
        ``o_tail_min_cycles`` after the read-out.  Fitted (8x8 and 4x4;
        ``o_done_cycles`` refitted to the median of the 12 validation jobs
        on the DRAM with bank timing: the write-back completes once the
        channels have issued its writes, after an activate (tRCD) when the
        O rows' bank was closed, which the model does not track).
    readout_bytes_per_cycle : int or None
        O read-out: one FP32 per PE column per cycle (C x 4 bytes), one beat
        per (row, O column) of the PE, rows·od beats + 1 priming cycle.
    early_accept : bool
        The core takes the next q tile's command when the read-out starts
        and runs that tile's first Q·Kᵀ while O goes out; its INIT follows
        once both have ended (``hdl/core.py``).  Between two q tiles this
        replaces read-out + idle cycle + INIT + WAIT_K + S_0 with
        max(2 + S_0, read-out) + INIT.  False: the read-out, then the next
        command (the core before the overlap).
    overlap_softmax : bool
        What-if: hide the whole softmax phase behind the MAC stream.  The
        RTL core (``config.softmax_overlap``) hides part of it instead: the
        next kv tile's Q·Kᵀ issues in the softmax program's free slots
        (``softmax_slots``), which the model follows without this flag.
    spill_bytes_per_cycle : int or None
        Baseline: bytes per cycle the array can drain to / load from the spill
        level (default C x 4, one FP32 per PE column per cycle).  ASSUMPTION.
    offchip_bytes_per_cycle : float
        Off-chip DRAM bandwidth for the baseline's spills (64 B/cycle = 96
        GB/s at 1.5 GHz, an LPDDR5X-class x64 interface).  ASSUMPTION;
        ``flashnpu bench`` pairs it with each memory class's pJ/bit
        (``energy.MEMORY_CLASSES``).
    offchip_latency_cycles : int
        Off-chip DRAM read latency (150 cycles = 100 ns).  ASSUMPTION.
    """

    softmax_override: int | None = None
    init_override: int | None = None
    final_override: int | None = None
    use_rtl_programs: bool = True
    elem_cycles: int = 1
    tree_level_cycles: int = 4
    exp2_latency: int = 4
    recip_cycles: int = 27
    mac_recurrence: int = 4
    qtile_gap_cycles: int = 1
    early_accept: bool = True
    first_tile_fixed_cycles: int | None = None
    start_conflict_rows: int = 8
    qtile_ctrl_cycles: int = 3
    first_v_fixed_cycles: int | None = None
    o_row_cycles: int = 0
    o_early_cycles: int = 3
    o_issue_cycles: int = 3
    o_chunk_gap_cycles: int = 1
    o_done_cycles: int = 22
    o_tail_min_cycles: int = 2
    readout_bytes_per_cycle: int | None = None
    overlap_softmax: bool = False
    spill_bytes_per_cycle: int | None = None
    offchip_bytes_per_cycle: float = 64
    offchip_latency_cycles: int = 150

    def mac_gap(self, accumulators: int) -> int:
        """Bubble cycles after a MAC round over ``accumulators`` registers."""
        return max(0, self.mac_recurrence - accumulators)

    def _rtl(self, config, head_dim):
        return rtl_program_cycles(config, head_dim) if self.use_rtl_programs else None

    def source(self, config: NPUConfig, head_dim: int) -> str:
        """Where the softmax-phase length comes from: override, rtl or formula."""
        if self.softmax_override is not None:
            return "calibrated"
        return "rtl micro-program" if self._rtl(config, head_dim) else "formula (ASSUMPTION)"

    def softmax_slots(self, config: NPUConfig, head_dim: int) -> tuple:
        """Offsets in the softmax phase where the next kv tile's Q·Kᵀ may
        issue: the RTL program's ``mac_ok`` slots, within a calibrated
        softmax's length; none with the what-if ``overlap_softmax`` or
        without the RTL's programs."""
        rtl = self._rtl(config, head_dim)
        if self.overlap_softmax or not rtl:
            return ()
        n = self.softmax_cycles(config, head_dim)
        return tuple(o for o in rtl["softmax_slots"] if o < n)

    def softmax_cycles(self, config: NPUConfig, head_dim: int) -> int:
        """Length of the softmax phase of one pair (cycles).

        Formula fallback: scale+mask, local max (wr·wc each), max tree (L),
        m_new and alpha (wr + exp2 latency + wr), P = exp2 (wr·wc + exp2
        latency), local sum (wr·wc), sum tree (L), l update (wr), O_acc
        rescale (wr·od).
        """
        if self.softmax_override is not None:
            return int(self.softmax_override)
        rtl = self._rtl(config, head_dim)
        if rtl:
            return rtl["softmax"]
        wr, wc, od = config.rows_per_pe, config.cols_per_pe, config.o_cols_per_pe(head_dim)
        L, e = config.tree_levels, self.elem_cycles
        return (2 * wr * wc * e + L * self.tree_level_cycles       # scale+mask, local max, tree
                + wr + self.exp2_latency + wr                       # m_new, alpha = exp2(.)
                + wr * wc * e + self.exp2_latency                   # P = exp2(S - m), fp16 round
                + wr * wc * e + L * self.tree_level_cycles          # local sum, tree
                + wr + wr * od)                                     # l update, O_acc rescale

    def softmax_last_extra(self, config: NPUConfig, head_dim: int) -> int:
        """Cycles the q tile's last softmax takes beyond ``softmax_cycles``:
        it also loads l_i into T and starts each row's reciprocal
        (formula fallback: 2 per row)."""
        rtl = self._rtl(config, head_dim)
        if rtl:
            return rtl["softmax_last"] - rtl["softmax"]
        return 2 * config.rows_per_pe

    def final_wait(self, config: NPUConfig, head_dim: int, pv_last: int) -> int:
        """Cycles FINAL waits for its reciprocals when the last kv tile's
        P·V (``pv_last`` cycles) is shorter than the divisions that the
        last softmax started (0 at the design point; formula fallback: a
        division started at the softmax's end, read in FINAL's first op
        slot)."""
        rtl = self._rtl(config, head_dim)
        if rtl:
            n = self.softmax_cycles(config, head_dim) + self.softmax_last_extra(config, head_dim)
            return max([0] + [ready - (n + pv_last + c) for c, ready in rtl["final_ready"]])
        return max(0, self.recip_cycles + 1 - pv_last - 3)

    def init_cycles(self, config: NPUConfig, head_dim: int) -> int:
        """m = -inf, l = 0, O_acc = 0 per q tile: 2·wr + wr·od words (cycles)."""
        if self.init_override is not None:
            return int(self.init_override)
        rtl = self._rtl(config, head_dim)
        if rtl:
            return rtl["init"]
        wr, od = config.rows_per_pe, config.o_cols_per_pe(head_dim)
        return 2 * wr + wr * od

    def final_cycles(self, config: NPUConfig, head_dim: int) -> int:
        """O = O_acc · (1/l) per q tile, its reciprocals arrived (the last
        softmax started them): wr·od FINAL ops after the MACs' last writes
        (cycles; formula fallback: 3 entry slots, the ops, the 5-stage
        write)."""
        if self.final_override is not None:
            return int(self.final_override)
        rtl = self._rtl(config, head_dim)
        if rtl:
            return rtl["final"]
        wr, od = config.rows_per_pe, config.o_cols_per_pe(head_dim)
        return 3 + wr * od + 5

    def out_cycles(self, config: NPUConfig, head_dim: int, rows: int | None = None) -> int:
        """O read-out of one q tile with ``rows`` valid rows (default Br): rows·od
        beats of C FP32 lanes, + 1 priming cycle (the core stops after the
        last valid row)."""
        od = config.o_cols_per_pe(head_dim)
        rows = config.br if rows is None else rows
        bw = self.readout_bytes_per_cycle or config.array_cols * FP32
        return -(-rows * od * config.array_cols * FP32 // bw) + 1

    def replace(self, **changes) -> "Timing":
        return dataclasses.replace(self, **changes)


@dataclass
class Counters:
    """The NPU's performance-counter set (``RTL_COUNTER_FIELDS``) plus two
    model-only fields that the RTL does not have and that are 0 for the
    register-level design.

    Attributes
    ----------
    total_cycles : int
        Cycles from start to done.
    mac_busy_cycles : int
        Cycles in which the array issues MACs (S and PV phases).
    softmax_cycles : int
        Softmax / reduction phase cycles plus the per-q-tile reciprocal and
        O = O_acc / l scaling.
    dma_stall_cycles : int
        Cycles the array waits for DMA (job start, prefetch shortfall, final
        O write-back).
    reg_bytes, sram_bytes, tsv_bytes, dram_bytes : int
        Bytes read + written at the PE register files, the stacked SRAM, the
        TSV link between DRAM and logic, and the stacked DRAM.
    mac_ops, exp2_ops, recip_ops : int
        MAC slots issued (incl. padding rows/keys of a tile), exp2 ops (P and
        alpha), reciprocals.
    mac_masked : int
        Of the MAC slots, those at masked positions (causal, padding rows
        and keys): skipped by the PEs, no write, multiplier operands held
        (``hdl/pe.py``); the energy model charges ``mac_ops - mac_masked``.
    spill_cycles : int
        Model only: baseline cycles spent moving S/P to and from the spill
        level, not hidden behind compute.
    offchip_bytes : int
        Model only: baseline bytes spilled to off-chip DRAM.
    """

    total_cycles: int = 0
    mac_busy_cycles: int = 0
    softmax_cycles: int = 0
    dma_stall_cycles: int = 0
    reg_bytes: int = 0
    sram_bytes: int = 0
    tsv_bytes: int = 0
    dram_bytes: int = 0
    mac_ops: int = 0
    exp2_ops: int = 0
    recip_ops: int = 0
    mac_masked: int = 0
    spill_cycles: int = 0
    offchip_bytes: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rtl_view(self) -> dict:
        """Only the fields the RTL counters have."""
        return {k: getattr(self, k) for k in RTL_COUNTER_FIELDS}


@dataclass
class OpDetail:
    """Arithmetic outside the MAC array's MACs, for the energy model (ops).

    fp32_mul : score scaling, alpha·l, alpha·O_acc, O·(1/l)
    fp32_add : compares (max), subtracts (S - m, m_old - m_new), sums
    operand_bytes : FP16 operand movement across the array, in bytes x PE
        hops: K and V down the R PEs of a column, Q and P along the C PEs of
        a row (ASSUMPTION: a broadcast wire spanning C PEs costs about what C
        pipeline-register hops cost).  No RTL counter; energy only.
    reg_extra_bytes : register-file bytes the RTL's ``reg_bytes`` counter
        does not count (it counts only MAC accumulators and exp2 operands):
        the rest of the softmax program, the P operand of P·V, init, final,
        read-out and the baseline's S/P drain and reload.  Energy only.
    """

    fp32_mul: int = 0
    fp32_add: int = 0
    operand_bytes: int = 0
    reg_extra_bytes: int = 0


@dataclass
class ModelResult:
    """Output of ``model``: counters, op detail and the tile bookkeeping.

    Attributes
    ----------
    counters : Counters
    ops : OpDetail
    job : Job
    design : str
    spill_level : str or None
        Where the baseline put S/P (``None`` for the register-level design;
        for ``unfused`` the level actually used).
    q_tiles, kv_tiles, tile_pairs : int
        q tiles of the job, kv tiles per head, pairs actually computed.
    useful_flops : int
        2 FLOP per MAC of visible (query, key) pairs: 4·d per visible pair.
    bytes_detail : dict
        Bytes per level split by what moved them (for the report).
    config : NPUConfig
    """

    counters: Counters
    ops: OpDetail
    job: Job
    design: str
    spill_level: str | None
    q_tiles: int
    kv_tiles: int
    tile_pairs: int
    useful_flops: int
    bytes_detail: dict = field(default_factory=dict)
    config: NPUConfig = DEFAULT

    @property
    def seconds(self) -> float:
        return self.counters.total_cycles / self.config.clock_hz

    @property
    def mac_utilization(self) -> float:
        """MAC slots issued / (total cycles x R·C)."""
        c = self.counters
        return c.mac_ops / max(1, c.total_cycles * self.config.macs_per_cycle)

    @property
    def useful_utilization(self) -> float:
        """Useful MACs (2 x visible query-key pairs x head_dim) / (total cycles x R·C)."""
        return self.useful_flops / (2 * max(1, self.counters.total_cycles * self.config.macs_per_cycle))

    @property
    def achieved_flops(self) -> float:
        """Useful FLOP/s at ``config.clock_hz``."""
        return self.useful_flops / self.seconds if self.seconds else 0.0


def useful_flops(job: Job) -> int:
    """4·d FLOP per visible (query, key) pair, summed over heads."""
    if not job.causal:
        vis = job.seq_q * job.seq_kv
    else:
        i = np.arange(job.seq_q, dtype=np.int64)
        vis = int(np.clip(i + (job.seq_kv - job.seq_q) + 1, 0, job.seq_kv).sum())
    return 4 * job.head_dim * job.heads * int(vis)


def _mapping(job: Job, config: NPUConfig, stack_decode: bool):
    """Units that share K/V and the query rows each unit puts on the array.

    Decode (seq_q == 1) with grouped-query heads stacks the ``group`` query
    heads of one K/V head on PE rows (one unit per K/V head); otherwise each
    query head is its own unit.  Returns (units, rows, stacked).
    """
    if stack_decode and job.seq_q == 1 and job.group > 1:
        return job.kv_heads, job.group * job.seq_q, True
    return job.heads, job.seq_q, False


@functools.lru_cache(maxsize=4096)
def _pair_stalls(n_kv: int, keys: int, bc: int, gq: int, wql: int, s_cyc: int, sm_cyc: int, pv_cyc: tuple,
                 latency: int, dma_rows: tuple = (), pingpong: bool = True, slots: tuple = ()) -> tuple:
    """Core waits (WAIT_K / WAIT_V) of one q tile after its first S phase
    and the Q·Kᵀ cycles hidden in the softmax: (cycles the core is delayed,
    number of waits, hidden cycles); the core's stall counter counts one
    cycle less per wait (the cycle it leaves the wait state).

    A transaction-level walk of the three resources the NPU chains (time 0 =
    the first S phase starts, kv tile 0 is in the core's K buffer):

    * DMA: ``dma_rows[j]`` rows of K_j and of V_j (0: resident in SRAM
      already) follow each other at one SRAM group per cycle (``gq`` cycles
      per row), K_0 ending when the loader starts moving it; with ``pingpong``
      tile j (j >= 2) also waits until the loader released its half (tile
      j-2 fully loaded), paying the DRAM latency again, and the loader waits
      for the half's commit (after V).
    * loader: K_j after V_{j-1}, the DMA's K_j and the core's release of K
      buffer j%2 (end of S_{j-2}); V_j after K_j and the release of V buffer
      j%2 (end of P·V_{j-2}); ``wql`` requests per row, one per cycle.
    * core: S_j after P·V_{j-1} and K_j; P·V_j after its softmax and V_j,
      ``pv_cyc[j]`` cycles.  S_j runs ahead in the ``slots`` of the
      softmax of tile j-1 (offsets from its start) that come once K_j is
      in, one S cycle (MAC or bubble) per slot; the rest of it follows
      P·V_{j-1}.

    ASSUMPTION: the event rules are read from ``hdl/npu.py`` and
    ``hdl/dma.py``, not fitted; bank conflicts are not modelled.  The RTL at
    4x4 and 8x8 never waits here (compute per pair exceeds a tile's DMA),
    so only the 32x32 runs test it.
    """
    if n_kv <= 1:
        return 0, 0, 0
    nks = [min(bc, keys - j * bc) if keys > j * bc else 1 for j in range(n_kv)]
    rows = list(dma_rows) + [0] * (n_kv - len(dma_rows))
    never = -10 ** 9
    dma_k, dma_v, ld_k_end, ld_v_end, s_end, pv_end = {}, {}, {}, {}, {}, {}
    # K_0's last word arrived just before the loader moved it (nks[0]*wql
    # cycles before S_0); V_0 follows it
    dma_v[0] = rows[0] * gq - nks[0] * wql if rows[0] else never
    ld_k_end[0] = 0
    ld_v_end[0] = max(0, dma_v[0]) + nks[0] * wql
    s_end[0] = s_cyc
    pv_end[0] = max(s_cyc + sm_cyc, ld_v_end[0]) + pv_cyc[0]
    stall = pv_end[0] - (s_cyc + sm_cyc + pv_cyc[0])
    waits = int(stall > 0)
    hidden = 0
    last_dma = dma_v[0]
    for j in range(1, n_kv):
        words = rows[j] * gq
        if words:
            start = last_dma
            if pingpong and j >= 2 and ld_v_end[j - 2] > start:
                start = ld_v_end[j - 2] + latency
            dma_k[j] = start + words
            dma_v[j] = dma_k[j] + words
            last_dma = dma_v[j]
        else:
            dma_k[j] = dma_v[j] = never
        k_in = dma_v[j] if pingpong else dma_k[j]
        k_start = max(ld_v_end[j - 1], k_in, s_end.get(j - 2, never))
        ld_k_end[j] = k_start + nks[j] * wql
        v_start = max(ld_k_end[j], dma_v[j], pv_end.get(j - 2, never))
        ld_v_end[j] = v_start + nks[j] * wql
        ahead = min(s_cyc, sum(1 for o in slots if s_end[j - 1] + o >= ld_k_end[j]))
        hidden += ahead
        s_start = max(pv_end[j - 1], ld_k_end[j]) if ahead < s_cyc else pv_end[j - 1]
        s_end[j] = s_start + s_cyc - ahead
        pv_start = max(s_end[j] + sm_cyc, ld_v_end[j])
        pv_end[j] = pv_start + pv_cyc[j]
        stall += (s_start - pv_end[j - 1]) + (pv_start - s_end[j] - sm_cyc)
        waits += int(s_start > pv_end[j - 1]) + int(pv_start > s_end[j] + sm_cyc)
    return int(stall), waits, hidden


def model(job: Job, config: NPUConfig = DEFAULT, design: str = "register", *,
          spill_level: str = "sram", overflow_level: str = "offchip", causal_skip: bool = True,
          stack_decode: bool = True, kv_reuse: bool | None = None,
          timing: Timing | None = None) -> ModelResult:
    """Counters of one job on the register-level design or the baseline.

    Parameters
    ----------
    job : Job
    config : NPUConfig
    design : {"register", "baseline"}
    spill_level : {"sram", "stacked_dram", "offchip", "unfused"}
        Baseline only: where S (FP32) and P (FP16) go between the phases.
    overflow_level : {"stacked_dram", "offchip"}
        ``unfused`` only: the level used when the S row block does not fit.
    causal_skip : bool
        Skip kv tiles that hide every key of every row of the q tile.
    stack_decode : bool
        Stack the query heads of a K/V group on PE rows when seq_q == 1.
    kv_reuse : bool or None
        None (default): as the RTL, each kv tile of a KV head is fetched
        once and stays in its SRAM slot when all of them fit
        (ceil(seq_kv / Bc) <= ``config.kv_slots``), else K/V stream through the
        ping-pong halves for every q tile.  True: resident whenever K and V
        of one head fit half the SRAM; False: always streamed.
    timing : Timing, optional

    Returns
    -------
    ModelResult

    Raises
    ------
    ValueError
        for an unknown design or spill level, or a head_dim the hardware
        cannot take.
    """
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, not {design!r}")
    if spill_level not in SPILL_LEVELS:
        raise ValueError(f"spill_level must be one of {SPILL_LEVELS}, not {spill_level!r}")
    if overflow_level not in ("stacked_dram", "offchip"):
        raise ValueError(f"overflow_level must be 'stacked_dram' or 'offchip', not {overflow_level!r}")
    config.check_head_dim(job.head_dim)
    t = timing if timing is not None else Timing()
    d, br, bc = job.head_dim, config.br, config.bc
    R, C = config.array_rows, config.array_cols
    wr, wc, od = config.rows_per_pe, config.cols_per_pe, config.o_cols_per_pe(d)

    units, rows, stacked = _mapping(job, config, stack_decode)
    nq = -(-rows // br)
    nkv = -(-job.seq_kv // bc)

    # --- per q tile (vectorised over the q tiles of one unit) ---------------
    qt = np.arange(nq, dtype=np.int64)
    valid_rows = np.minimum(br, rows - qt * br)
    if stacked:
        max_pos = np.full(nq, job.seq_q - 1, dtype=np.int64)
    else:
        max_pos = qt * br + valid_rows - 1
    # keys the q tile can see (the controller's kv end): causal limit of its
    # last row, else seq_kv.  The controller skips the kv tiles after it but
    # always runs at least one tile (a q tile without a visible key yields
    # zeros), and the DMA fetches exactly the keys before the end (the last
    # tile partially), at least one row.
    if job.causal and not stacked:
        vis_end = np.clip(max_pos + 1 + (job.seq_kv - job.seq_q), 0, job.seq_kv)
    else:
        vis_end = np.full(nq, job.seq_kv, dtype=np.int64)
    kv_end = vis_end if causal_skip else np.full(nq, job.seq_kv, dtype=np.int64)
    n_pairs = np.maximum(1, -(-kv_end // bc))
    keys_fetched = np.maximum(1, kv_end)                                     # keys per q tile

    pairs_unit = int(n_pairs.sum())
    pairs = units * pairs_unit
    q_tiles = units * nq

    # --- cycles ---------------------------------------------------------------
    # one MAC per PE per cycle; a k round with fewer accumulators than the
    # MAC's recurrence waits out the rest (``core.gap_s``, ``gap_pv_cycles``)
    # P·V of kv tile j runs the keys up to the last one a valid row of the
    # q tile sees (hdl/core.py), at least one: pv_keys(i, j)
    s_mac = d * wr * wc
    s_cyc = s_mac + (d - 1) * t.mac_gap(wr * wc)

    def pv_cycles(keys):
        return keys * wr * od + (keys - 1) * t.mac_gap(wr * od)
    pv_cyc = pv_cycles(bc)                          # a full tile

    def pv_keys(i):
        """P·V keys of each kv tile of q tile i."""
        return np.clip(vis_end[i] - bc * np.arange(n_pairs[i]), 1, bc)
    pv_key_sum = np.array([pv_keys(i).sum() for i in range(nq)], dtype=np.int64)    # per q tile
    pv_keys_unit = int(pv_key_sum.sum())
    pv_cyc_total = units * (pv_keys_unit * wr * od + (pv_keys_unit - pairs_unit) * t.mac_gap(wr * od))

    def pv_tiles(i):
        return tuple(pv_cycles(int(keys)) for keys in pv_keys(i))
    sm_cyc = t.softmax_cycles(config, d)
    sm_exposed = 0 if t.overlap_softmax else sm_cyc
    # the q tile's last softmax also starts the reciprocals (hdl/core.py)
    sm_last_extra = t.softmax_last_extra(config, d)
    # the next kv tile's Q·Kᵀ in the softmax's free slots (hdl/core.py;
    # the baseline spills S between the phases, so nothing runs ahead)
    sm_slots = t.softmax_slots(config, d) if design == "register" else ()
    pair_cyc = s_cyc - min(s_cyc, len(sm_slots)) + sm_exposed + pv_cyc   # a pair in steady state
    init_cyc = t.init_cycles(config, d)
    final_cyc = t.final_cycles(config, d)
    # FINAL waits for 1/l only when the last tile's P·V is shorter than the division
    final_wait = sum(t.final_wait(config, d, pv_tiles(i)[-1]) for i in range(nq))
    out_cyc = np.array([t.out_cycles(config, d, int(r)) for r in valid_rows], dtype=np.int64)
    qtile_cyc = init_cyc + final_cyc + t.qtile_gap_cycles   # per q tile, outside pairs and read-out

    # Byte counters count bus words (ASSUMPTION, as the SRAM's counters do:
    # a partial word moves a whole word), and every tile row starts on a word.
    W = config.sram_bank_bytes

    def rowb(nbytes):
        return -(-nbytes // W) * W

    # --- baseline S/P spill -----------------------------------------------------
    level = None
    s_bytes = br * rowb(bc * FP32)                # one S tile
    p_bytes = br * rowb(bc * FP16)
    spill_w = spill_r = s_bytes + p_bytes       # each written once and read once
    spill_cyc_pair = 0
    if design == "baseline":
        level = spill_level
        if level == "unfused":
            row_block = br * job.seq_kv * (FP32 + FP16)
            budget = config.sram_bytes - 2 * 2 * bc * d * FP16 - br * d * FP16
            level = "sram" if row_block <= budget else overflow_level
        egress = t.spill_bytes_per_cycle or C * FP32
        lvl_bw = {"sram": config.sram_banks * config.sram_bank_bytes,
                  "stacked_dram": config.dram_bytes_per_cycle,
                  "offchip": t.offchip_bytes_per_cycle}[level]
        lat = {"sram": 0, "stacked_dram": config.dram_latency_cycles,
               "offchip": t.offchip_latency_cycles}[level]
        bw = min(egress, lvl_bw)
        # S drained after Q·Kᵀ and reloaded for the softmax, P drained after
        # it and reloaded for P·V, each reload paying the level's read
        # latency.  ASSUMPTION: none of it overlaps the MAC stream.
        spill_cyc_pair = 2 * math.ceil(s_bytes / bw) + 2 * math.ceil(p_bytes / bw) + 2 * lat

    # --- DMA (DRAM -> TSV -> SRAM, and O back) ------------------------------------
    # Bus words: the DMA moves W bytes per cycle, the tile loader reads LW =
    # 4 words per request, the O writer writes OW = C FP32 lanes (rounded up
    # to a power-of-two number of words) per request (hdl/npu.py
    # ``loader_lanes``, ``o_lanes``).
    LW = min(4, config.sram_banks) * W
    OW = min(config.sram_banks, 1 << max(0, (-(-4 * C // W) - 1).bit_length())) * W
    wq = -(-d * FP16 // W)                        # DMA words per FP16 row
    wo = -(-d * FP32 // W)                        # DMA words per FP32 O row
    # the DMA moves one SRAM group of dram_channels words per cycle, a row at
    # a time (the SRAM map's rows are group-aligned or fit in a group)
    CH = config.dram_channels
    gq = -(-wq // CH)                             # DMA cycles per FP16 row
    go = -(-wo // CH)                             # DMA cycles per FP32 O row
    wql = -(-d * FP16 // LW)                      # loader requests per FP16 row
    wol = -(-d * FP32 // OW)                      # O writer requests per FP32 row
    kv_row = 2 * wq * W                           # one K row and one V row, in DRAM words
    kv_unit_bytes = job.seq_kv * kv_row
    n_need = -(-job.seq_kv // bc)
    if kv_reuse is None:                          # as the RTL: resident when every kv tile has a slot
        reuse = n_need <= config.kv_slots
    else:
        reuse = bool(kv_reuse) and kv_unit_bytes <= config.sram_bytes // 2
    q_dma = valid_rows * wq * W                   # per q tile
    if reuse:
        # each kv tile of a KV head is fetched once, whole (up to seq_kv),
        # by the first q tile that needs it; the other q tiles and the other
        # query heads of the group read it from its SRAM slot
        n_max = int(n_pairs.max())
        head_keys = sum(min(bc, job.seq_kv - j * bc) if job.seq_kv > j * bc else 1 for j in range(n_max))
        kv_dma_total = job.kv_heads * head_keys * kv_row
    else:
        kv_dma_total = units * int(keys_fetched.sum()) * kv_row
    o_dma = valid_rows * wo * W
    dram_total = units * int(q_dma.sum() + o_dma.sum()) + kv_dma_total

    # --- NPU timing (hdl/npu.py) ---------------------------------------------------
    # The controller hands q tile t to the core and the loader while q tile
    # t-1 computes (two Q and two O regions), so a q tile's command waits
    # for the core's read-out of the last one; the DMA fetches Q (and K/V that
    # is not resident yet) ahead, and the O write-back of a q tile runs
    # during the next one.  What is left in series: the first q tile's wait
    # for Q and K_0, waits between pairs when the DMA or the loader falls
    # behind, and the last q tile's O write-back.
    # a stream's first word: the bank is activated (tRCD), then the column
    # command's read latency
    lat = config.dram_latency_cycles + config.dram_timing_cycles()["trcd"]
    nq0 = int(valid_rows[0])
    nk0 = int(min(bc, keys_fetched[0]))
    first_fixed = t.first_tile_fixed_cycles if t.first_tile_fixed_cycles is not None else lat + 11
    # the core waits (WAIT_K) after INIT until Q_0 and K_0 are in: Q then K_0
    # stream from DRAM (one word per cycle after one DRAM latency); the loader
    # moves Q once it is in, then K_0 once both are (ASSUMPTION, fitted on the
    # 8x8 RTL: fixed part and a 2-cycle term for bank conflicts between the
    # loader's Q reads and the DMA's K writes when the Q load is long)
    conflict = nq0 // t.start_conflict_rows
    # resident: K_0 fetched whole; streamed: K_0 and V_0 (one commit)
    nk0_dma = min(bc, job.seq_kv) if reuse else 2 * nk0
    start_wait = (first_fixed + gq * nq0 + max(wql * nq0 - 1, gq * nk0_dma + conflict) + wql * nk0)
    start_stall = max(0, start_wait - init_cyc)
    # V_0: the DMA's write side holds two descriptors, so V_0's reads start
    # only once Q has been written: a second DRAM latency when Q and K_0 are
    # short; the core then waits before P.V_0 (fitted on the 8x8 RTL:
    # 2 latencies + 9 + the words of Q, K_0 and V_0's loader requests)
    v_fixed = t.first_v_fixed_cycles if t.first_v_fixed_cycles is not None else 2 * lat + 9
    v0_ready = v_fixed + gq * (nq0 + (min(bc, job.seq_kv) if reuse else nk0)) + wql * nk0
    v_stall = max(0, v0_ready - (max(start_wait, init_cyc) + s_cyc + sm_exposed + spill_cyc_pair))
    start_stall += v_stall
    # a wait inside a q tile (WAIT_V / WAIT_K with the buffer arriving) costs
    # one cycle more than the core's stall counter counts: the cycle it
    # leaves the wait state
    wait_exits = int(v_stall > 0)
    # pairs: the first q tile of a KV head streams its K/V at the DMA's rate
    # (resident: into their slots; streaming: every q tile, through the
    # ping-pong halves); the loader moves LW bytes per cycle
    def walk(rows_of, pingpong):
        d_sum = e_sum = h_sum = 0
        for i in range(nq):
            dl, ep, hd = _pair_stalls(int(n_pairs[i]), int(keys_fetched[i]), bc, gq, wql, s_cyc,
                                      sm_exposed + spill_cyc_pair, pv_tiles(i), lat, rows_of(i),
                                      pingpong, sm_slots)
            d_sum += dl
            e_sum += ep
            h_sum += hd
        return d_sum, e_sum, h_sum

    def tile_rows(keys, j):
        return min(bc, keys - j * bc) if keys > j * bc else 1

    if reuse:
        # rows the DMA brings in during q tile i (whole tiles, first use only)
        fetched = []
        loaded = 0
        for i in range(nq):
            need = int(n_pairs[i])
            fetched.append(tuple(tile_rows(job.seq_kv, j) if loaded <= j else 0 for j in range(need)))
            loaded = max(loaded, need)
        first = walk(lambda i: fetched[i], False)
    else:
        first = walk(lambda i: tuple(tile_rows(int(keys_fetched[i]), j) for j in range(int(n_pairs[i]))), True)
    if reuse and units > job.kv_heads:
        # only the first query head of a KV group fetches K/V
        rest = walk(lambda i: (), False)
        n_first = job.kv_heads
    else:
        rest, n_first = (0, 0, 0), units
    pair_delay = n_first * first[0] + (units - n_first) * rest[0]
    pair_exits = n_first * first[1] + (units - n_first) * rest[1]
    hidden_s = n_first * first[2] + (units - n_first) * rest[2]
    pair_stall_total = pair_delay - pair_exits
    wait_exits += pair_exits
    # O read-out: the writer takes a row every od beats and writes it in wol
    # requests; it holds the core only when wol > od
    out_bp = valid_rows * max(0, wol - od)
    # the next q tile's command is taken as the read-out starts (``early_accept``):
    # accept, WAIT_K and its first Q·Kᵀ (s_cyc) run beside the read-out, then
    # its INIT: read-out + INIT + WAIT_K + s_cyc become max(2 + s_cyc,
    # read-out) + INIT after every q tile but the job's last, and the core is
    # never idle between q tiles
    if t.early_accept:
        ov_q = np.minimum(out_cyc + out_bp, 2 + s_cyc) - 1
        overlap_out = units * int(ov_q.sum()) - int(ov_q[-1])
    else:
        overlap_out = 0
    # the last q tile: its O rows go back in chunks of o_chunk rows (one word
    # per cycle) as the writer finishes them; the job ends when the last
    # chunk has completed (ASSUMPTION: fitted constants, Timing.o_tail_*)
    och = max(1, br // 4)
    nql = int(valid_rows[-1])
    row_done = lambda r: ((r + 1) * max(od, wol) + wol + t.o_row_cycles    # after OUT starts
                          - (t.o_early_cycles if wol < od else 0))
    dma_t = -10 ** 9
    for c0 in range(0, nql, och):
        rows_c = min(och, nql - c0)
        ready = row_done(c0 + rows_c - 1)
        dma_t = max(ready + t.o_issue_cycles, dma_t + t.o_chunk_gap_cycles) + rows_c * go
    out_total = int(out_cyc[-1]) + int(valid_rows[-1] * max(0, wol - od))
    tail = max(t.o_tail_min_cycles, dma_t + t.o_done_cycles - out_total)
    dma_stall = units * 0 + start_stall + pair_stall_total
    q_all = units * nq
    idle_between = 0 if t.early_accept else q_all - 1      # the core's IDLE cycle between q tiles
    drain_cycles = t.qtile_ctrl_cycles + idle_between + tail + units * int(out_bp.sum()) + wait_exits
    job_cycles = job.group + 2                    # DIV (heads / kv_heads) and CHECK

    # --- counters ----------------------------------------------------------------
    mac_busy = pairs * s_mac + units * pv_keys_unit * wr * od
    mac_ops = mac_busy * R * C                    # every PE issues a MAC slot per MAC cycle
    # masked slots (hdl/core.py ``ops_masked``): a position of a computed
    # Br x Bc tile that is a padding row or key, or causally invisible,
    # skips its head_dim Q.K slots and its od x C P.V slots.  Keys row i
    # sees: L(i) = i + 1 + seq_kv - seq_q (causal, clipped to 0..seq_kv),
    # else seq_kv; the q tile's kv tiles cover them all.
    q_abs = qt[:, None] * br + np.arange(br)[None, :]
    if job.causal and not stacked:
        keys_seen = np.clip(q_abs + 1 + job.seq_kv - job.seq_q, 0, job.seq_kv)
    else:
        keys_seen = np.full(q_abs.shape, job.seq_kv, dtype=np.int64)
    keys_seen = np.where(np.arange(br)[None, :] < valid_rows[:, None], keys_seen, 0)
    seen = keys_seen.sum(axis=1)
    masked_s = units * int((n_pairs * br * bc - seen).sum())
    masked_pv = units * int((pv_key_sum * br - seen).sum())      # among the keys P·V runs
    mac_masked = masked_s * d + masked_pv * od * C
    # one PEXP cycle per S element of a PE and one MALPHA cycle per row, on
    # every PE: each PE of a row evaluates the row's alpha itself
    exp2_ops = pairs * (wr * wc + wr) * R * C
    recip_ops = q_tiles * br
    softmax_cycles = pairs * sm_cyc + q_tiles * sm_last_extra
    spill_cycles = pairs * spill_cyc_pair
    total = (pairs * s_cyc - hidden_s + pv_cyc_total + pairs * sm_exposed + q_tiles * qtile_cyc
             + (0 if t.overlap_softmax else q_tiles * sm_last_extra) + units * final_wait
             + units * int(out_cyc.sum()) - overlap_out + dma_stall + spill_cycles + drain_cycles
             + job_cycles)

    # Register-file accesses (4 bytes each), from the core's control words:
    # a MAC slot reads and writes its accumulator; P·V reads the P operand
    # once per PV cycle in each PE row; the softmax program per PE:
    # SCALE, PEXP (r+w per S element), MALPHA (r m, w alpha), MSET (w m),
    # RESC (r alpha, r+w O_acc and l), LADD (r+w l); per q tile: init
    # (w m, l, O_acc), final (r l; r O, r l, w O per O column) and read-out
    # (r O).  ASSUMPTION: operand buffers (Q, K, V) are not register files.
    RC = R * C
    reg_mac = 2 * REG_BYTES * mac_ops
    reg_p_operand = pv_cyc_total * R * REG_BYTES
    reg_softmax = pairs * (4 * wr * wc + 6 * wr + 3 * wr * od) * RC * REG_BYTES
    # (the read-out reads one PE row's O registers per beat, valid rows only)
    reg_epilogue = (q_tiles * ((2 * wr + wr * od) + (wr + 3 * wr * od)) * RC
                    + units * int(valid_rows.sum()) * od * C) * REG_BYTES
    reg_spill = 0
    if design == "baseline":
        # S drained from and reloaded into the registers, P likewise.
        reg_spill = pairs * 4 * br * bc * REG_BYTES
    reg_all = reg_mac + reg_p_operand + reg_softmax + reg_epilogue + reg_spill
    # The RTL's reg_bytes counter (hdl/npu.py) counts 8 bytes per MAC slot
    # (accumulator read + write) and 8 per exp2 (S read, P or alpha write)
    # and nothing else; the counter follows it, and the accesses it leaves
    # out (softmax program, P operand, init/final/read-out, baseline spill)
    # go to ``OpDetail.reg_extra_bytes``, which the energy model adds.
    reg_bytes = 2 * REG_BYTES * (mac_ops + exp2_ops)
    reg_extra = reg_all - reg_bytes

    # SRAM: DMA writes in (Q, K, V), the array reads Q and K/V, the array
    # writes O and the DMA reads it out.
    # (the loader reads LW bytes per request, the O writer writes OW)
    sram_kv_read = units * int(keys_fetched.sum()) * 2 * wql * LW
    sram_q = units * int(q_dma.sum() + valid_rows.sum() * wql * LW)
    # the DMA reads O in whole SRAM groups of dram_channels words
    sram_o = units * int(valid_rows.sum() * (go * CH * W + wol * OW))
    sram_kv_in = kv_dma_total
    spill_total = pairs * (spill_w + spill_r) if design == "baseline" else 0
    sram_bytes = sram_kv_read + sram_q + sram_o + sram_kv_in
    dram_bytes = dram_total
    offchip = 0
    if design == "baseline":
        if level == "sram":
            sram_bytes += spill_total
        elif level == "stacked_dram":
            dram_bytes += spill_total
        else:
            offchip = spill_total
    tsv_bytes = dram_bytes

    # non-MAC arithmetic for the energy model
    fp32_mul = pairs * (br * bc + br + br * d) + q_tiles * br * d
    fp32_add = pairs * (3 * br * bc + 2 * br)
    # K and Q per pair, V and P per P·V key
    operand_bytes = FP16 * (pairs * (bc * d * R + br * d * C) + units * pv_keys_unit * (d * R + br * C))

    counters = Counters(total_cycles=int(total), mac_busy_cycles=int(mac_busy),
                        softmax_cycles=int(softmax_cycles), dma_stall_cycles=int(dma_stall),
                        reg_bytes=int(reg_bytes), sram_bytes=int(sram_bytes),
                        tsv_bytes=int(tsv_bytes), dram_bytes=int(dram_bytes),
                        mac_ops=int(mac_ops), exp2_ops=int(exp2_ops), recip_ops=int(recip_ops),
                        mac_masked=int(mac_masked),
                        spill_cycles=int(spill_cycles), offchip_bytes=int(offchip))
    detail = dict(reg_mac=reg_mac, reg_p_operand=reg_p_operand,
                  reg_softmax=reg_softmax, reg_epilogue=reg_epilogue, reg_spill=reg_spill,
                  sram_kv_read=sram_kv_read, sram_kv_dma_in=sram_kv_in, sram_q=sram_q, sram_o=sram_o,
                  spill_bytes=spill_total, dram_q=units * int(q_dma.sum()),
                  dram_kv=kv_dma_total, dram_o=units * int(o_dma.sum()),
                  softmax_phase_cycles=sm_cyc, pair_cycles=pair_cyc, drain_cycles=drain_cycles,
                  job_cycles=job_cycles, start_stall_cycles=int(start_stall),
                  pair_stall_cycles=int(pair_stall_total), tail_cycles=int(tail), wait_exits=int(wait_exits),
                  hidden_s_cycles=int(hidden_s),
                  qtile_cycles=qtile_cyc, out_cycles=int(units * out_cyc.sum()),
                  overlapped_out_cycles=overlap_out,
                  spill_cycles_per_pair=spill_cyc_pair,
                  kv_reused=bool(reuse), stacked_decode=bool(stacked))
    return ModelResult(counters=counters, ops=OpDetail(fp32_mul=int(fp32_mul), fp32_add=int(fp32_add),
                                                      operand_bytes=int(operand_bytes),
                                                      reg_extra_bytes=int(reg_extra)),
                       job=job, design=design, spill_level=level, q_tiles=q_tiles, kv_tiles=nkv,
                       tile_pairs=pairs, useful_flops=useful_flops(job), bytes_detail=detail,
                       config=config)


def compare(job: Job, config: NPUConfig = DEFAULT, spill_level: str = "sram", **kw):
    """(register-level result, baseline result) for the same job and options."""
    return (model(job, config, "register", **kw),
            model(job, config, "baseline", spill_level=spill_level, **kw))


def roofs(config: NPUConfig = DEFAULT) -> dict:
    """Roofline ceilings of a configuration.

    Returns a dict: ``compute_flops`` (FLOP/s, 2 per MAC at R·C MAC/cycle),
    ``sram_bw``, ``tsv_bw``, ``dram_bw`` (bytes/s), and the same per cycle.
    """
    f = config.clock_hz
    sram = config.sram_banks * config.sram_bank_bytes
    tsv = config.dram_channels * config.tsv_data_lanes // 8
    dram = config.dram_bytes_per_cycle
    return dict(compute_flops=config.peak_flops, macs_per_cycle=config.macs_per_cycle,
                sram_bw=sram * f, tsv_bw=tsv * f, dram_bw=dram * f,
                sram_bytes_per_cycle=sram, tsv_bytes_per_cycle=tsv, dram_bytes_per_cycle=dram)


def kv_tile_intensity(config: NPUConfig = DEFAULT, head_dim: int = 128) -> dict:
    """Arithmetic intensity of one (q tile, kv tile) pair.

    FLOP = 2 · 2·Br·Bc·d (Q·Kᵀ and P·V); operands fetched per pair = K and V
    tiles, 2·Bc·d FP16 elements.  Returns FLOP per element and per byte of
    SRAM traffic (and per DRAM byte when K/V come from DRAM once per pair).
    """
    flop = 4 * config.br * config.bc * head_dim
    elems = 2 * config.bc * head_dim
    return dict(flop=flop, elements=elems, flop_per_element=flop / elems,
                flop_per_byte=flop / (elems * FP16))


# ---------------------------------------------------------------------------
# RTL counters: the hook the validation uses
# ---------------------------------------------------------------------------

class RTLUnavailable(RuntimeError):
    """The RTL NPU (``flashnpu.hdl.npu``) or its simulator backend is not there yet."""


#: Names the RTL backend's statistics may use for each counter, first match wins.
RTL_STAT_ALIASES = {
    "total_cycles": ("total_cycles", "cycles"),
    "mac_busy_cycles": ("mac_busy_cycles", "mac_busy"),
    "softmax_cycles": ("softmax_cycles", "softmax_reduction_cycles", "reduction_cycles"),
    "dma_stall_cycles": ("dma_stall_cycles", "dma_stall"),
    "reg_bytes": ("reg_bytes", "register_bytes", "bytes_register", "bytes_reg", "bytes_rf"),
    "sram_bytes": ("sram_bytes", "bytes_sram"),
    "tsv_bytes": ("tsv_bytes", "bytes_tsv"),
    "dram_bytes": ("dram_bytes", "bytes_dram"),
    "mac_ops": ("mac_ops", "macs", "mac_count"),
    "exp2_ops": ("exp2_ops", "exp2", "exp2_count"),
    "recip_ops": ("recip_ops", "recip", "recip_count"),
    "mac_masked": ("mac_masked",),
}


def counters_from_stats(stats: dict) -> Counters:
    """Map the RTL backend's statistics dict onto ``Counters``.

    Looks in ``stats["counters"]`` when present, else in ``stats`` itself.

    Raises
    ------
    KeyError
        naming every counter the statistics lack and the keys they have.
    """
    src = stats.get("counters", stats) if isinstance(stats, dict) else {}
    vals, missing = {}, []
    for name, aliases in RTL_STAT_ALIASES.items():
        key = next((a for a in aliases if a in src), None)
        if key is None:
            missing.append(name)
        else:
            vals[name] = int(src[key])
    if missing:
        raise KeyError(f"RTL statistics lack counters {missing}; they have {sorted(src)}")
    return Counters(**vals)


def rtl_counters(job: Job, config: NPUConfig = DEFAULT, sim: str = "verilator", seed: int = 0) -> Counters:
    """Run ``job`` on the RTL NPU (random seeded data) and return its counters.

    Raises
    ------
    RTLUnavailable
        when ``flashnpu.hdl.npu`` or ``flashnpu.sim.rtl_backend`` cannot be
        imported (the RTL NPU is not built yet).
    KeyError
        when the RTL runs but does not report every counter.
    """
    for mod in ("flashnpu.hdl.npu", "flashnpu.sim.rtl_backend"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            raise RTLUnavailable(f"{mod} is not importable yet ({e})") from None
    backend = importlib.import_module("flashnpu.sim.rtl_backend")
    case = random_case(job.heads, job.kv_heads, job.seq_q, job.seq_kv, job.head_dim, job.causal,
                       seed, config)
    args = argparse.Namespace(sim=sim, waves=None, wave_window=None, wave_depth=None, json=False,
                              seed=seed, rows=config.array_rows, cols=config.array_cols)
    _, stats = backend.run(case, config, args)
    return counters_from_stats(stats)


def rtl_counters_many(jobs, config: NPUConfig = DEFAULT, sim: str = "verilator", seed: int = 0) -> list:
    """Run several jobs on the RTL NPU in one simulator session (one build,
    one cocotb start); returns one dict per job: ``counters`` (Counters),
    ``error`` (NPUError int) and ``wall_s`` (host seconds of the job).

    Raises
    ------
    RTLUnavailable
        when ``flashnpu.hdl.npu`` or ``flashnpu.sim.rtl_backend`` cannot be imported.
    """
    for mod in ("flashnpu.hdl.npu", "flashnpu.sim.rtl_backend"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            raise RTLUnavailable(f"{mod} is not importable yet ({e})") from None
    # deferred: the RTL backend imports amaranth and the NPU, which `flashnpu
    # --help` (through `flashnpu bench`) does not need
    from flashnpu.sim.rtl_backend import run_jobs
    specs = [dict(case=random_case(j.heads, j.kv_heads, j.seq_q, j.seq_kv, j.head_dim, j.causal, seed + i, config),
                  name=f"val{i}") for i, j in enumerate(jobs)]
    out = []
    for r in run_jobs(specs, config, sim=sim, seed=seed):
        out.append(dict(counters=counters_from_stats(r["counters"]), error=int(r["error"]),
                        wall_s=float(r["wall_s"]), total_cycles=int(r["counters"]["total_cycles"])))
    return out


def rtl_core_counters(config: NPUConfig, head_dim: int, n_kv: int, seed: int = 0) -> dict:
    """Run one q tile on the RTL compute core (``flashnpu.hdl.core.Core``) in
    Amaranth's simulator and return its counters.

    The testbench fills the Q buffer and both K/V halves before the command
    and refills a half as soon as the core releases it (one row per cycle),
    with O always accepted, so the core never waits for data once started.
    Slow (tens of cycles per second of host time): small configurations only.

    Returns
    -------
    dict
        ``cnt_total``, ``cnt_mac``, ``cnt_softmax``, ``cnt_stall``, ``ops_mac``,
        ``ops_exp2``, ``ops_recip`` as the core reports them.

    Raises
    ------
    RTLUnavailable
        when ``flashnpu.hdl.core`` cannot be imported.
    """
    try:
        # deferred: amaranth and the RTL core, which `flashnpu --help`
        # (through `flashnpu bench`) does not need
        from amaranth.sim import Simulator

        from flashnpu.hdl.core import BufSel, Core
    except ImportError as e:
        raise RTLUnavailable(f"flashnpu.hdl.core is not importable ({e})") from None
    dut = Core(config)
    names = ("cnt_total", "cnt_mac", "cnt_softmax", "cnt_stall", "ops_mac", "ops_exp2", "ops_recip")
    res = {}
    rng = np.random.default_rng(seed)
    bc, br = config.bc, config.br

    async def bench(ctx):
        async def write(sel, nrows):
            for r in range(nrows):
                v = rng.standard_normal(config.max_head_dim).astype(np.float16).view(np.uint16)
                ctx.set(dut.wr.valid, 1)
                ctx.set(dut.wr.payload.sel, sel)
                ctx.set(dut.wr.payload.row, r)
                ctx.set(dut.wr.payload.last, int(r == nrows - 1))
                ctx.set(dut.wr.payload.data, [int(x) for x in v])
                await ctx.tick()
            ctx.set(dut.wr.valid, 0)

        halves = ((BufSel.K0, BufSel.V0), (BufSel.K1, BufSel.V1))
        await write(BufSel.Q, br)
        loaded = 0
        for j in range(min(2, n_kv)):
            await write(halves[j][0], bc)
            await write(halves[j][1], bc)
            loaded += 1
        ctx.set(dut.o.ready, 1)
        p = dut.cmd.payload
        ctx.set(p.head_dim, head_dim)
        ctx.set(p.n_kv, n_kv)
        ctx.set(p.c, 0x3F800000)                      # binary32 1.0
        ctx.set(p.seq_q, br)
        ctx.set(p.seq_kv, n_kv * bc)
        ctx.set(p.kv_valid_len, n_kv * bc)
        ctx.set(dut.cmd.valid, 1)
        await ctx.tick()
        ctx.set(dut.cmd.valid, 0)
        for _ in range(1_000_000):
            if ctx.get(dut.done):
                break
            full = ctx.get(dut.full)
            ks, vs = halves[loaded % 2]
            if loaded < n_kv and not (full >> ks) & 1 and not (full >> vs) & 1:
                await write(ks, bc)
                await write(vs, bc)
                loaded += 1
                continue
            await ctx.tick()
        else:
            raise RuntimeError("the RTL core never signalled done")
        for n in names:
            res[n] = int(ctx.get(getattr(dut, n)))

    sim = Simulator(dut)
    sim.add_clock(1e-9)
    sim.add_testbench(bench)
    sim.run()
    return res


def calibrate_timing(job: Job, measured: Counters, config: NPUConfig = DEFAULT,
                     timing: Timing | None = None, **model_kw) -> Timing:
    """Timing fitted to one job's RTL counters.

    * softmax phase: the RTL's softmax counter is pairs · softmax_phase +
      q_tiles · (the last softmax's extra cycles), so softmax_phase follows
      from it (must divide exactly);
    * per-q-tile phases: what the total leaves after the MAC, softmax and
      stall cycles, the read-out and the last O write-back is q_tiles ·
      (init + final); init is kept, final takes the rest (rounded).

    Raises
    ------
    ValueError
        when the job computes no pair, or the softmax counter is not a whole
        multiple of the pairs (the RTL's counter then means something else
        than the model assumes: say so rather than fit it).
    """
    t = timing if timing is not None else Timing()
    r = model(job, config, "register", timing=t, **model_kw)
    if r.tile_pairs == 0:
        raise ValueError(f"{job} computes no tile pair: nothing to calibrate on")
    sm_pairs = measured.softmax_cycles - r.q_tiles * t.softmax_last_extra(config, job.head_dim)
    if sm_pairs % r.tile_pairs:
        raise ValueError(f"RTL softmax_cycles={measured.softmax_cycles} less the last softmaxes' "
                         f"extra cycles is not a multiple of pairs={r.tile_pairs}")
    sm = sm_pairs // r.tile_pairs
    # the rest is read with that softmax length (and the Q·Kᵀ it hides)
    r = model(job, config, "register", timing=t.replace(softmax_override=sm), **model_kw)
    c = r.counters
    other = c.total_cycles - c.mac_busy_cycles - c.softmax_cycles - c.dma_stall_cycles
    per_q_model = t.init_cycles(config, job.head_dim) + t.final_cycles(config, job.head_dim)
    rest = other - r.q_tiles * per_q_model          # read-out, gaps and the last write-back
    m_other = (measured.total_cycles - measured.mac_busy_cycles - measured.softmax_cycles
               - measured.dma_stall_cycles - rest)
    per_q = round(m_other / r.q_tiles)
    init = t.init_cycles(config, job.head_dim)
    return t.replace(softmax_override=sm, init_override=init, final_override=max(0, per_q - init))
