"""The compute core: tile buffers and operand feeders, the tile sequencer,
the PE array, the O read-out stream, debug access and counters.

Design trade-off
----------------
One control word per cycle drives all PEs (S = Q.K^T, softmax, O += P.V).
The MAC phases cost head_dim*wr*wc and keys*wr*od cycles (512 + 512 at
head_dim 128 on the default 32 x 32 array), where keys runs to the tile's
last key that a valid row of the q tile can see (Bc for a full tile; the
keys after it are masked for every row, so the P.V rounds stop there); the
PE's MAC is pipelined (``pe.OP_TIMING``), so each k round must touch at
least ``MAC_RECURRENCE`` (4) accumulators and a round with fewer (wr*od < 4
at small head_dim) is followed by bubbles (``gap_s``, ``gap_pv_cycles``).
The softmax is a statically scheduled micro-program (``softmax_program``,
88 cycles at 32 x 32: two trips through the 20-cycle pipelined row tree
dominate, and only 24 of its slots issue an op) because every PE only owns
a 2 x 2 block of the score tile.  Masking is computed per PE from row and
column indices, so causal and padded tiles cost no extra cycles; buffers
are ping-ponged so the next K/V tile loads while this one computes.

Softmax overlap (``config.softmax_overlap``): each PE has a second S block
(kv tile j uses block j % 2), and the Q.K^T loop of kv tile j+1 issues its
MACs in the softmax program's free slots of tile j (``mac_ok``: a NOP slot
whose MAC write stage and MAC-unit entry no op of the program uses,
``schedule.mac_slots``) once K_{j+1} is in.  The loop keeps its counters
across the P.V of tile j and finishes after it; a tile whose Q.K^T ran
ahead completely goes straight to its softmax.  At 32 x 32, head_dim 128,
58 of the 88 slots are free, so a tile pair takes 1,054 cycles instead of
1,112::

   issue slots  | S_0 ....... | SM_0 + S_1 (58 slots) | PV_0 ... | S_1 rest | SM_1 + S_2 | PV_1 ...

The S and S_RAW pause points (which stop between Q.K^T and the softmax)
turn the overlap off for their command.

Reciprocals ahead: l_i is final once the q tile's last softmax ends, so
that softmax (its ``last`` variant, 90 instead of 88 cycles at 32 x 32)
loads each row's l_i into T and starts the row's divider (one per query
row, ``array.PeRow``); the divisions (27 cycles) run during the last P.V
and FINAL only scales O_acc (16 cycles instead of 70)::

   issue slots  | SM_last + 1/l starts | PV_last (1/l arrives) | FINAL | OUT

Read-out overlap (early accept): the O read-out runs on its own once FINAL
ends (``out_on``), and in its first cycle the core takes the next q tile's
command if one is waiting without pause bits.  That tile's first Q.K^T
writes only S block 0, which the read-out does not touch, so it streams
beside the read-out (it reads O_acc through the synchronous port; the MACs
use ports A and B); its INIT, which rewrites O_acc, m_i and l_i, follows
once both have ended, and then its softmax::

   q tile i    | ... PV_last | FINAL | OUT (rows * od beats) |
   q tile i+1                        | S_0 ..................... | INIT | SM_0 + S_1 | PV_0 ...

Between two q tiles this costs max(2 + S_0, read-out) + INIT instead of
read-out + IDLE + INIT + WAIT_K + S_0.  At 32 x 32, head_dim 128 the
257-cycle read-out of a full q tile hides completely behind the 512-cycle
S_0.  The core's own counters then cover both commands (they clear only
when a command is taken in IDLE); the NPU's job counters count the core's
events (``ev``) as they happen.

::

   wr stream ──► Q buffers (one per PE row) ──┐ lane k        (sync reads =
   (sel,row,   ► K0/K1 (one per PE column) ───┤ lane k         the operand
    FP16 row)  ► V0/V1 (one, all columns) ────┤ lane od*c+n    register)
               ► mask (one per PE row) ───────┤ bit wc*c+b
                                              ▼
   cmd ──► sequencer ── issue (ctl, a, b, k, n) ─┬─► feeder addresses, PE sa
            │  S loop / ROM programs / PV loop   └─► ctl register ─► PeArray
            │                                         ▲ vis (row/col compare)
            └─► counters, status, pause            rd_data ─► o stream / dbg

Where each box is built (``Core.elaborate`` composes them in this order):

* buffers and ``full`` flags: ``tilebuf.TileBuffers`` (a component);
* ROM programs: ``Core._rom`` (contents from ``init_program``,
  ``softmax_program``, ``final_program``);
* sequencer: ``Core._sequencer`` (registers, status, return-register
  scoreboard, test-only faults) and ``Core._phase_fsm`` (one case per
  ``Phase``: S loop, programs, PV loop, waits, pauses);
* feeder addresses, ctl register, operand buses and vis:
  ``Core._operands``;
* PE ``sa`` port, o stream and dbg: ``Core._readout``;
* register check: ``Core._register_check``; counters: ``Core._counters``;
* PeArray: ``array.PeArray``.

Pipeline: the sequencer *issues* a step in cycle t (tile-buffer and PE
read addresses); the operands come out of synchronous reads in cycle t+1,
when the control word is registered once and the lane selects put the
operands on the array's buses; every PE row registers word, operands and
visibility bits once more (``array.PeRow``'s operand stage), so they reach
the PEs (their stage E0) in cycle t+2::

   cycle   t           t+1                        t+2           t+3 ..
           issue       ctl_d, buffer data,        row flops     E1 .. E16
           (addresses)  lane select -> buses       = PE E0       (pe.OP_TIMING)
           sa (P, O)   sd -> psel mux -> a16_e0

The synchronous port's address ``sa`` is not delayed: a P operand is read
in cycle t and crosses the row's psel mux into ``a16_e0`` in t+1, with the
rest of its word.  The row reports tree and reciprocal results one cycle
ahead, so the return-register scoreboard keeps its timing against the
issue stage, and the programs and loops are cycle for cycle what they were
with one operand register.
The programs come in one variant per O-column count od (1..od_max), each
scheduled for the PE pipeline, so a program never skips words at run time.
A pause takes effect (``paused``) once the PEs' pipelines have drained and
the ROM has read the word to resume at (two cycles, ``Core._rom``).

Command / status protocol (``CoreCmd``): the core waits for the Q buffer
and, per kv tile j, for K/V half j % 2 (and the mask buffer when
``mask_en``); it releases K after the S phase, the mask after the softmax,
V after P.V and Q after the last S phase, so a loader can refill a half
while the other computes.  A buffer becomes full with the ``last`` row
write; writes never stall.  After the last tile O is normalised and
streamed out as ``rows * od`` beats (``CoreOut``), where rows = min(Br,
seq_q - q_row0) are the q tile's valid rows: the read-out stops after the
last one, so a partial q tile, or a decode tile of a few stacked query
heads, costs only its rows.  Beat (row, n) carries O[row, od*c + n] in
lane c for every PE column c.  That is the array's
natural layout (each PE column supplies one lane per cycle); a row-major
max_head_dim-lane beat would need an od-deep reassembly buffer and a
run-time lane permutation, and a DMA with a 2-D descriptor (stride od)
scatters these beats directly.

Register check (simulation-time, no cycle cost): the PEs are SIMD, so one
written-mask over the register indices covers the whole array.  Every
control word's register-file reads (``ra``/``rb`` of the ops that use them,
the P operand and O read-out of the synchronous port) must hit a register
written since it was last cleared: the whole mask at command accept (a new
q tile), the per-kv-tile registers (S/P and alpha, ``tile_registers``) at the
start of every kv tile.  m_i, l_i and O_acc carry across the kv tiles of a q
tile and are written by the INIT program.  A violation stops the core (back
to IDLE, no ``done``) and latches ``reg_err`` with the register, phase and
kv tile; the debug port's reads are not checked.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

from amaranth.back import verilog
from amaranth.hdl import Array, Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .array import PeArray, module_texts, sum_or
from .fpu import Recip
from .pe import MAC_RECURRENCE, OP_TIMING, PIPE_DEPTH, RF_READ_STAGE, PeOp, RegMap, TreeOp, _bits, ctl_layout
from .reduce import tree_latency
from .schedule import Inject as Injection
from .schedule import Op, mac_slots, schedule
from .tilebuf import BufSel, TileBuffers, _onehot, write_layout

__all__ = ["BufSel", "Phase", "PausePoint", "Inject", "cmd_layout", "write_layout", "out_layout", "event_layout",
           "rom_layout", "init_program", "softmax_program", "final_program", "Core",
           "core_verilog", "CORE_MODULE", "LEN_BITS", "RF_USE", "tile_registers", "register_name",
           "gap_s", "gap_pv_cycles"]

CORE_MODULE = "flashnpu_core"

#: Width of the command's lengths, positions and counts (``head_dim``,
#: ``n_kv``, ``q_row0``, ``seq_q``, ``seq_kv``, ``kv_valid_len``): the 16-bit
#: fields of the NPU's job registers.  The kv tile index and the visibility
#: arithmetic derive from it.
LEN_BITS = 16


class Phase(enum.IntEnum):
    """Sequencer state (visible on the ``phase`` port)."""
    IDLE = 0
    INIT = 1
    WAIT_K = 2
    S = 3
    WAIT_M = 4
    SM = 5
    WAIT_V = 6
    PV = 7
    FINAL = 8
    OUT = 9
    PAUSED = 10


class PausePoint(enum.IntEnum):
    """Bits of the command's ``pause`` mask (and values of ``pause_at``)."""
    S_RAW = 0     # after the S phase: S registers hold S_raw
    S = 1         # after scaling/masking: S registers hold S (golden ``S``)
    TILE = 2      # after P.V: P, m_i, l_i, alpha, O_acc of the tile


#: Cycles by which ``Inject.LATE_RET`` delays the scoreboard's return arrivals.
RET_DELAY = 2


class Inject(enum.IntEnum):
    """Bits of the core's ``inject`` port (test-only faults: the first three
    for the register check, where cycle counts stay those of a normal run
    until the check fires; ``LATE_RET`` for the ROM hold)."""
    SKIP_INIT = 0      # the INIT program's words issue as NOPs: m_i, l_i, O_acc unwritten
    DROP_S_WRITE = 1   # kv tile 1's first S step (k = a = b = 0) issues as a NOP: S(0, 0) unwritten
    NO_GAP = 2         # the S loop issues no bubbles between k rounds: with fewer than
                       # MAC_RECURRENCE accumulators a MAC reads a pending write
    LATE_RET = 3       # the return-register scoreboard sees each tree and reciprocal result
                       # RET_DELAY cycles late: the words that wait for one stall (``rom_hold``)
                       # and the job stays bit-exact, only longer (no check fires)


#: Register-file use of each opcode: (reads ra, reads rb, writes wa).  MAC is
#: special: it reads ra unless ``first`` and its write is conditional when
#: ``skipz`` (so then it does not count as a write).
RF_USE = {
    PeOp.NOP: (0, 0, 0), PeOp.MAC: (1, 0, 1), PeOp.SCALE: (1, 0, 1), PeOp.MALPHA: (1, 0, 1),
    PeOp.PEXP: (1, 0, 1), PeOp.MSET: (0, 0, 1), PeOp.LADD: (1, 0, 1), PeOp.RESC: (1, 1, 1),
    PeOp.LOADT: (1, 0, 0), PeOp.FINAL: (1, 1, 1), PeOp.SETZ: (0, 0, 1), PeOp.SETNI: (0, 0, 1),
}


def tile_registers(config: NPUConfig) -> list:
    """Register indices that live for one kv tile (S/P of both S blocks and
    alpha): the register check forgets a tile's S block when its Q.K^T
    starts and alpha when its softmax starts.  The others (m_i, l_i, O_acc)
    live for the q tile."""
    g = RegMap(config)
    return [i for p in g.blocks for i in g.s_block(p)] + [g.ALPHA(a) for a in range(g.wr)]


def register_name(config: NPUConfig, index: int) -> str:
    """Readable name of PE register ``index`` (e.g. ``"m_i(a=0)"``) for error messages.

    Raises
    ------
    ValueError
        If ``index`` is outside 0..pe_registers-1.
    """
    if not 0 <= index < config.pe_registers:
        raise ValueError(f"register index must be in 0..{config.pe_registers - 1}, not {index!r}")
    g = RegMap(config)
    if index < g.o_base:
        return f"S(a={index // g.wc}, b={index % g.wc})"
    if index < g.m_base:
        return f"O_acc(a={(index - g.o_base) // g.od}, n={(index - g.o_base) % g.od})"
    for name, base in (("m_i", g.m_base), ("l_i", g.l_base), ("alpha", g.alpha_base)):
        if index < base + g.wr:
            return f"{name}(a={index - base})"
    if g.overlap and g.s1_base <= index < g.s1_base + g.wr * g.wc:
        i = index - g.s1_base
        return f"S(a={i // g.wc}, b={i % g.wc}, block 1)"
    return f"unused({index})"


def cmd_layout(config: NPUConfig) -> data.StructLayout:
    """Fields of a q-tile command.

    head_dim (1..max_head_dim), n_kv (kv tiles, >= 1), c (binary32 score
    constant), causal, q_row0 (absolute index of the tile's first query),
    seq_q, seq_kv, kv_valid_len (keys >= it are invisible; give seq_kv for
    none), mask_en (AND the mask buffer into visibility, one mask per kv
    tile), pause (PausePoint bit mask: stop there until ``resume``).
    """
    return data.StructLayout({
        "head_dim": LEN_BITS, "n_kv": LEN_BITS, "c": 32, "causal": 1, "q_row0": LEN_BITS,
        "seq_q": LEN_BITS, "seq_kv": LEN_BITS, "kv_valid_len": LEN_BITS, "mask_en": 1,
        "pause": len(PausePoint),
    })


def event_layout(config: NPUConfig) -> data.StructLayout:
    """The core's per-cycle events (``Core.ev``), which its own and the NPU's
    counters count: ``mac`` (a MAC control word reaches the PEs), ``exp2``
    (PEXP or MALPHA), ``recip`` (reciprocal starts, one per PE row),
    ``masked`` (MAC slots the array skipped at masked positions),
    ``softmax`` (a cycle in the softmax program), ``stall`` (waiting for a
    tile buffer), ``kv_tile`` (a kv tile's P.V ends)."""
    return data.StructLayout({
        "mac": 1, "exp2": 1, "recip": 1, "masked": range(config.array_rows * config.array_cols + 1),
        "softmax": 1, "stall": 1, "kv_tile": 1,
    })


def out_layout(config: NPUConfig) -> data.StructLayout:
    """O beat: ``row`` (0..Br-1), ``n`` (0..od-1), ``data`` lane c =
    O[row, od * c + n] (binary32)."""
    od = config.o_cols_per_pe(config.max_head_dim)
    return data.StructLayout({
        "row": range(config.br), "n": range(od), "data": data.ArrayLayout(32, config.array_cols),
    })


def rom_layout(config: NPUConfig) -> data.StructLayout:
    """A micro-program word: PE control, the (a, b) of SCALE ops (for the
    visibility bits), ``wait`` (stall until the return register
    ``ctl.ret_sel`` holds a fresh result; a scheduled program never
    stalls), ``pause`` (S pause point), ``mac_ok`` (the next kv tile's
    Q.K^T may issue a MAC in this slot, ``schedule.mac_slots``) and
    ``last``."""
    return data.StructLayout({
        "ctl": ctl_layout(config), "a": range(config.rows_per_pe), "b": range(config.cols_per_pe),
        "wait": 1, "pause": 1, "mac_ok": 1, "last": 1,
    })


def _schedule(config: NPUConfig, items, arrived=()) -> list:
    return schedule(items, tree_latency(config.array_cols), Recip.LATENCY, arrived)


def _od(config: NPUConfig, od):
    odm = config.o_cols_per_pe(config.max_head_dim)
    od = odm if od is None else od
    if not 1 <= od <= odm:
        raise ValueError(f"od (O columns per PE) must be in 1..{odm}, not {od!r}")
    return od


def init_program(config: NPUConfig, od: int | None = None) -> list:
    """m_i = -inf, l_i = 0, O_acc = 0 for every row of the PE (``od`` O
    columns, default the most), scheduled (``hdl/schedule.py``)."""
    g = RegMap(config)
    od = _od(config, od)
    items = [Op(PeOp.SETNI, wa=g.M(a)) for a in range(g.wr)]
    items += [Op(PeOp.SETZ, wa=g.L(a)) for a in range(g.wr)]
    items += [Op(PeOp.SETZ, wa=g.O(a, n)) for a in range(g.wr) for n in range(od)]
    return _schedule(config, items)


def softmax_program(config: NPUConfig, od: int | None = None, block: int = 0, last: bool = False) -> list:
    """The softmax of one kv tile as a scheduled micro-program, on S block
    ``block`` (0, or 1 with ``softmax_overlap``: kv tile j uses block j % 2);
    ``last``: the variant for the q tile's last kv tile.

    Program order (the scheduler moves ops earlier where the pipeline
    allows): SCALE (+mask, +max fold into T) per row, each row's max
    injected into the tree after its fold; per row: MALPHA (m_new, alpha;
    reads the row max), PEXP per column (P in place, sum fold into T), MSET
    (m_i = m_new) and the row sum's injection; RESC (O_acc *= alpha) for
    each of the ``od`` O columns; per row l_i = alpha * l_i (RESC) and
    l_i += row sum (LADD).  The injection of the last row max carries the S
    pause point.  With ``softmax_overlap`` each word's ``mac_ok`` marks the
    slots where the next kv tile's Q.K^T MACs may issue
    (``schedule.mac_slots``).

    The last kv tile's l_i is final once its softmax ends (P.V does not
    touch it), so the ``last`` variant also starts the reciprocals: per row
    T = l_i (LOADT) and a start on that row's divider.  The divisions
    (``Recip.LATENCY``, 27 cycles) then run during the tile's P.V instead of
    inside FINAL (``final_program``).
    """
    g = RegMap(config)
    od = _od(config, od)
    S = lambda a, b: g.S(a, b, block)          # noqa: E731
    items = []
    for a in range(g.wr):
        for b in range(g.wc):
            items.append(Op(PeOp.SCALE, ra=S(a, b), wa=S(a, b), first=int(b == 0), a=a, b=b))
        items.append(Injection(g.tag_max(a), tree=TreeOp.MAX, pause=int(a == g.wr - 1)))
    for a in range(g.wr):
        items.append(Op(PeOp.MALPHA, ra=g.M(a), wa=g.ALPHA(a), ret_sel=g.tag_max(a)))
        for b in range(g.wc):
            items.append(Op(PeOp.PEXP, ra=S(a, b), wa=S(a, b), first=int(b == 0)))
        items.append(Op(PeOp.MSET, wa=g.M(a)))
        items.append(Injection(g.tag_sum(a), tree=TreeOp.SUM))
    for a in range(g.wr):
        for n in range(od):
            items.append(Op(PeOp.RESC, ra=g.ALPHA(a), rb=g.O(a, n), wa=g.O(a, n)))
    for a in range(g.wr):
        items.append(Op(PeOp.RESC, ra=g.ALPHA(a), rb=g.L(a), wa=g.L(a)))
        items.append(Op(PeOp.LADD, ra=g.L(a), wa=g.L(a), ret_sel=g.tag_sum(a)))
    if last:
        for a in range(g.wr):
            items.append(Op(PeOp.LOADT, ra=g.L(a)))
            items.append(Injection(g.tag_rcp(a), rcp=1))
    words = _schedule(config, items)
    if config.overlaps_softmax:
        for w, ok in zip(words, mac_slots(words)):
            w["mac_ok"] = int(ok)
    return words


def final_program(config: NPUConfig, od: int | None = None) -> list:
    """O = O_acc * (1/l) per row: FINAL on each of the ``od`` O columns
    (l == 0 gives +0), scheduled.  The reciprocals were started by the last
    kv tile's softmax (``softmax_program(last=True)``) and have normally
    arrived during its P.V; a FINAL word whose 1/l is still on its way
    (a P.V shorter than the division) waits for it."""
    g = RegMap(config)
    od = _od(config, od)
    items = [Op(PeOp.FINAL, ra=g.O(a, n), rb=g.L(a), wa=g.O(a, n), ret_sel=g.tag_rcp(a))
             for a in range(g.wr) for n in range(od)]
    return _schedule(config, items, arrived=[g.tag_rcp(a) for a in range(g.wr)])


def gap_s(config: NPUConfig) -> int:
    """Bubble cycles between two k rounds of the S phase: each round
    updates the wr*wc S accumulators once, and a MAC must issue
    ``MAC_RECURRENCE`` cycles after the last one on its accumulator."""
    return max(0, MAC_RECURRENCE - config.rows_per_pe * config.cols_per_pe)


def gap_pv_cycles(config: NPUConfig, od: int) -> int:
    """Bubble cycles between two k rounds of P.V (wr*od O_acc accumulators
    per round; see ``gap_s``)."""
    return max(0, MAC_RECURRENCE - config.rows_per_pe * od) if od else 0


class Core(wiring.Component):
    """FlashAttention compute core for one q tile at a time.

    Parameters
    ----------
    config : NPUConfig
    pe_as_instance : bool
        See ``PeArray``: True for Verilog builds (``core_verilog``).

    Ports
    -----
    cmd : In(stream.Signature(cmd_layout))
        Start a q tile (accepted in IDLE, or in OUT when it has no pause
        bits: see "Read-out overlap").  A command with head_dim outside
        1..max_head_dim or n_kv == 0 is rejected in IDLE: ``err`` = 1,
        nothing runs.
    wr : In(stream.Signature(write_layout))
        Tile-buffer row writes, one row per cycle, always ready.
    full : Out(len(BufSel))
        Buffer full flags, bit ``BufSel``.
    o : Out(stream.Signature(out_layout))
        Normalised O, ``rows * od`` beats (rows = min(Br, seq_q - q_row0),
        row-major, n fastest), valid/ready.
    phase : Out(Phase); busy, paused, done (1-cycle pulse at the end), err : Out(1)
    pause_at : Out(PausePoint); tile : Out(LEN_BITS) (current kv tile)
    resume : In(1)
        Leave a pause (sampled while ``paused``).
    dbg_addr : In(log2 regs); dbg_row : In(range(R))
    dbg_data : Out(ArrayLayout(32, C))
        Register ``dbg_addr`` of every PE of row ``dbg_row``, one cycle after
        the address (valid while IDLE, paused or waiting for a buffer).
    cnt_total, cnt_mac, cnt_softmax, cnt_stall, cnt_tile_last, cnt_tile_sum : Out(32)
        Cycles since the last command taken in IDLE (so a command taken
        early, during a read-out, adds to its predecessor's; pauses
        excluded): all, with a
        MAC control word in the array, in the softmax program, waiting for a
        buffer, of the last kv tile (from the end of the previous tile's
        P.V, or the first tile's first S step, to the end of its P.V), and
        summed over the kv tiles.
    ops_mac, ops_exp2, ops_recip : Out(48)
        MAC slots (R*C per MAC cycle, skipped MACs included), exp2
        evaluations (R*C per PEXP/MALPHA cycle), reciprocals (R per start).
    ops_masked : Out(48)
        MAC slots at masked positions, counted from the PEs' own skip bits
        (``Pe.msk``): none of them wrote or fed its multiplier the bus
        operands.  Masked: the position (Q.K: the S element's; P.V: the P on
        the row bus) is invisible by the causal, padding or kv_valid_len
        rules.  The attention mask's bits arrive for the softmax (after
        Q.K), so they mask SCALE only; a P they mask is 0 and its P.V MACs
        skip their writes (``skipz``) without being counted.
    inject : In(len(Inject))
        Test-only faults, bits ``Inject`` (0 in normal use).
    reg_err : Out(1)
        A PE register was read before it was written, or while an earlier
        op's write to it was still in the pipeline (see ``_register_check``);
        the core stopped (IDLE, no ``done``, no O beats; the buffers
        keep their state, so reset it before the next command).  Sticky until
        the next accepted command.
    reg_err_addr : Out(log2 regs); reg_err_phase : Out(Phase); reg_err_tile : Out(LEN_BITS)
        The first such read: register index (``register_name``), the phase
        and kv tile of the step that read it.
    pnz : Out(range(R * C + 1))
        Non-zero P entries the array's PEXP ops wrote, 4 cycles after the ops
        (``PeArray.pnz``): summed per kv tile by the S-tile check.
    ev : Out(event_layout)
        This cycle's events, which the counters above and the NPU's job
        counters count.
    """

    def __init__(self, config: NPUConfig, pe_as_instance: bool = False):
        self.config = config
        self.pe_as_instance = bool(pe_as_instance)
        self.regs = RegMap(config)
        R, C = config.array_rows, config.array_cols
        ab = _bits(config.pe_registers)
        odm = self.regs.od
        #: each program in one variant per O-column count od (1..odm)
        self.programs = {name: {od: f(config, od) for od in range(1, odm + 1)}
                         for name, f in (("init", init_program), ("sm", softmax_program),
                                         ("final", final_program))}
        self.programs["sm_last"] = {od: softmax_program(config, od, last=True) for od in range(1, odm + 1)}
        if config.overlaps_softmax:
            self.programs["sm1"] = {od: softmax_program(config, od, 1) for od in range(1, odm + 1)}
            self.programs["sm1_last"] = {od: softmax_program(config, od, 1, True) for od in range(1, odm + 1)}
        super().__init__({
            "cmd": In(stream.Signature(cmd_layout(config))),
            "wr": In(stream.Signature(write_layout(config))),
            "full": Out(len(BufSel)),
            "o": Out(stream.Signature(out_layout(config))),
            "phase": Out(Phase), "busy": Out(1), "paused": Out(1), "done": Out(1), "err": Out(1),
            "pause_at": Out(PausePoint), "tile": Out(LEN_BITS), "resume": In(1),
            "dbg_addr": In(ab), "dbg_row": In(range(R)), "dbg_data": Out(data.ArrayLayout(32, C)),
            "cnt_total": Out(32), "cnt_mac": Out(32), "cnt_softmax": Out(32), "cnt_stall": Out(32),
            "cnt_tile_last": Out(32), "cnt_tile_sum": Out(32),
            "ops_mac": Out(48), "ops_exp2": Out(48), "ops_recip": Out(48), "ops_masked": Out(48),
            "ev": Out(event_layout(config)),
            "inject": In(len(Inject)), "reg_err": Out(1), "reg_err_addr": Out(ab),
            "reg_err_phase": Out(Phase), "reg_err_tile": Out(LEN_BITS),
            "pnz": Out(range(R * C + 1)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        m.submodules.array = arr = PeArray(cfg, self.pe_as_instance)
        m.d.comb += self.pnz.eq(arr.pnz)

        # ------------------------------------------------------------ command
        cmd = Signal(cmd_layout(cfg))
        od = Signal(range(self.regs.od + 1))   # O columns per PE for this head_dim
        release = Signal(len(BufSel))
        m.submodules.bufs = bufs = TileBuffers(cfg)
        wiring.connect(m, wiring.flipped(self.wr), bufs.wr)
        full = bufs.full
        m.d.comb += [self.full.eq(full), bufs.release.eq(release)]

        s = self._sequencer(m, arr, cmd, od, full, release, self._rom(m, od))
        in_out = self._readout(m, s, arr)
        ctl_d = self._operands(m, s, arr, bufs)
        # the word in the PEs' stage E0: the PE rows register the control
        # word once more (``PeRow``: the row's operand stage)
        ctl_e0 = Signal(ctl_layout(cfg))
        m.d.sync += ctl_e0.eq(ctl_d)
        m.d.comb += s.ctl_op_row.eq(ctl_d.op)
        self._register_check(m, s, arr, ctl_e0, in_out)
        self._counters(m, s, ctl_d, arr)
        return m

    # ------------------------------------------------------------ ROM programs
    def _rom(self, m, od):
        """The INIT, softmax and FINAL micro-programs (a variant per O-column
        count) in one ROM.  Returns a namespace: ``pc`` (the program
        counter, a register), ``pc_set`` (the next value it takes,
        combinational, ``pc`` unless the sequencer drives it), ``word`` (a
        register holding the word at ``pc``), ``base(name, od)`` and
        ``first(name, od)`` (each program's first address and first word
        for the command's ``od``, values), ``hold`` (a waiting word holds
        ``pc`` and ``word``), ``step`` (``pc_set`` is pc + 1) and
        ``jump``/``jump_word`` (``pc_set`` is a program's first address and
        this its word), ``load`` (PAUSED: read the word at ``pc_set``).

        The ROM's output feeds only ``word``, never the issue logic: the
        ROM is read one word ahead, at pc_set + 1, so its output holds the
        word after ``pc`` and a step takes it into ``word``; a jump takes
        the program's first word from a table of constants (one word per
        program variant) and reads the second.  ``word`` therefore holds
        the word at ``pc`` in the same cycle as ``pc`` itself, as a read at
        pc_set would, and no cycle changes; but the EBR's clock-to-output
        time (about 5.6 ns on the ECP5) now ends at a flop instead of
        leading into the issue and visibility logic (on the 2 x 2 core it
        was on the critical path, ``results/fpga.md``).  A resume goes to
        an arbitrary address: PAUSED reads the ROM at ``resume_pc`` itself
        (``load``), and ``paused`` waits until that word is in (two cycles,
        ``rom_primed``).  A word that waits for a return value holds the ROM
        and the pc (``hold``), so the wait lies on the path to neither
        the ROM's address nor ``word``: ``_run_rom`` sets ``pc_set``
        whether or not the word issues."""
        layout = rom_layout(self.config)
        progs = self.programs
        starts = {}
        words = []
        for name in progs:
            starts[name] = []
            for k in sorted(progs[name]):
                starts[name].append(len(words))
                words += progs[name][k]
        # one NOP word past the end: the read ahead of the last word
        m.submodules.rom = rom_mem = Memory(shape=layout, depth=len(words) + 1, init=words)
        rom = rom_mem.read_port(domain="sync")
        pc = Signal(range(len(words)))
        r = SimpleNamespace(pc=pc, pc_set=Signal.like(pc), hold=Signal(), step=Signal(), jump=Signal(),
                            load=Signal(), jump_word=Signal(layout), word=Signal(layout, init=words[0]))
        m.d.comb += [r.pc_set.eq(pc), rom.addr.eq(Mux(r.load, r.pc_set, r.pc_set + 1)), rom.en.eq(~r.hold)]
        with m.If(~r.hold):
            m.d.sync += pc.eq(r.pc_set)
            with m.If(r.step | r.load):
                m.d.sync += r.word.eq(rom.data)
            with m.Elif(r.jump):
                m.d.sync += r.word.eq(r.jump_word)
        # INIT reads no return register, so it runs without the wait logic
        # (``_run_rom(waits=False)``)
        assert not any(w["wait"] for k in progs["init"] for w in progs["init"][k])

        def base(name, od_value=od):
            return Array([Const(x, pc.shape()) for x in starts[name]])[od_value - 1]

        def first(name, od_value=od):
            return Array([Const.cast(layout.const(words[x])) for x in starts[name]])[od_value - 1]
        r.base, r.first = base, first
        return r

    # --------------------------------------------------------------- sequencer
    def _sequencer(self, m, arr, cmd, od, full, release, rom):
        """The tile sequencer: its registers, the status ports, the
        return-register scoreboard and the phase FSM (``_phase_fsm``).

        Returns a namespace of the signals the other blocks share: the phase
        and kv tile, the step counters, the issue-stage step (``iss``
        control word, ``iss_a/b/k/n/kc``, the P operand address ``sa_pv`` and
        ``use_pv_sa``), the O read-out indices, the buffer conditions
        ``k_ok/m_ok/v_ok`` and ``half``, and the strobes ``accept`` (a
        command is taken), ``enter_s`` (an S phase starts) and ``release``.
        """
        cfg = self.config
        g = self.regs
        R, C, Bc = cfg.array_rows, cfg.array_cols, cfg.bc
        wr, wc, odm, mhd = g.wr, g.wc, g.od, cfg.max_head_dim
        phase = Signal(Phase)
        resume_to = Signal(Phase)
        word = rom.word
        resume_pc = Signal.like(rom.pc)
        pause_at = Signal(PausePoint)
        tile = Signal(LEN_BITS)                # kv tile, 0..n_kv
        # tile + 1 == n_kv and tile + 2 == n_kv, kept as flops: the after-tile
        # decision and the softmax variant then need no comparator
        tile_last, tile_next_last = Signal(), Signal()
        # visibility terms of the kv tile (see ``_operands``)
        vis_d = Signal(signed(LEN_BITS + 3))   # kv0 + seq_q - q_row0 - seq_kv
        vis_e = Signal(signed(LEN_BITS + 3))   # min(seq_kv, kv_valid_len) - kv0
        vis_f = Signal(signed(LEN_BITS + 2))   # seq_q - q_row0
        k = Signal(range(max(mhd, Bc) + 1))
        kc = Signal(range(C))                 # k // wc (P.V)
        kb = Signal(range(wc))                # k % wc (P.V)
        a = Signal(range(wr))
        n = Signal(range(odm))
        # the Q.K^T loop's own counters (k, row a, column b of the S block):
        # with ``softmax_overlap`` it runs ahead into the next kv tile during
        # this tile's softmax and keeps its place across the P.V between
        sk = Signal(range(mhd + 1))
        sa = Signal(range(wr))
        sb = Signal(range(wc))
        gap_sl = Signal(range(MAC_RECURRENCE + 1))
        ov = Signal()                          # overlap on for this command
        ahead_done = Signal()                  # Q.K^T of tile + 1 is complete
        ins = Signal()                         # an S step of tile + 1 issues now
        s_par = Signal()                       # its S block
        s_first = Signal()                     # it is the first step of its tile
        enter_sm = Signal()                    # a softmax program starts
        release_s = Signal(len(BufSel))        # K (and Q) released by the S loop
        release_o = Signal(len(BufSel))
        m.d.comb += release.eq(release_s | release_o)
        vis_dn = Signal.like(vis_d)            # D and E of kv tile + 1
        vis_en = Signal.like(vis_e)
        # The PEs' pipelines are empty (``s_quiet``) when no op issued so far
        # is still active: ``paused`` waits for it (the MACs of the S loop or
        # of P.V may still be writing when a pause begins).  A new command
        # (also after a core that stopped on a register-check error) waits
        # for ``s_ready``, the same count one cycle ahead: measured from the
        # word in the rows' operand stage, as if it were in E0.  Its first op
        # reaches E0 two cycles after the accept at the earliest, so it
        # follows the last op of the previous command at the same distance
        # as with one operand register, and a q tile's epilogue costs no
        # cycle for the row's operand stage; only the last op's final write
        # may land in the accept cycle (the register check keeps it).
        s_ready = Signal()
        s_quiet = Signal()
        rom_primed = Signal(range(3))             # cycles in PAUSED, up to 2: the ROM's word is in
        m.d.sync += rom_primed.eq(Mux(phase == Phase.PAUSED, Mux(rom_primed == 2, 2, rom_primed + 1), 0))
        left = Signal(range(PIPE_DEPTH + 1))      # cycles of activity left after this one
        ctl_op_row = Signal(PeOp)                 # op of the word in the rows' operand stage
        op_left = Signal.like(left)
        m.d.comb += op_left.eq(Array([Const(OP_TIMING[op].last_stage(), left.shape())
                                      for op in PeOp])[ctl_op_row])
        m.d.sync += left.eq(Mux(op_left > left, op_left, Mux(left == 0, 0, left - 1)))
        ready_d = Signal()
        m.d.comb += s_ready.eq((left == 0) & (ctl_op_row == PeOp.NOP))
        m.d.sync += ready_d.eq(s_ready)
        m.d.comb += s_quiet.eq(s_ready & ready_d)
        m.d.comb += [self.phase.eq(phase), self.pause_at.eq(pause_at), self.tile.eq(tile),
                     self.paused.eq((phase == Phase.PAUSED) & s_quiet & (rom_primed == 2)),
                     self.busy.eq(phase != Phase.IDLE)]
        m.d.sync += self.done.eq(0)
        half = tile[0]
        k_sel = Mux(half, 1 << BufSel.K1, 1 << BufSel.K0)
        v_sel = Mux(half, 1 << BufSel.V1, 1 << BufSel.V0)
        k_ok = ((full & k_sel) != 0) & full[BufSel.Q]
        kn_sel = Mux(half, 1 << BufSel.K0, 1 << BufSel.K1)     # K half of tile + 1
        kn_ok = ((full & kn_sel) != 0) & full[BufSel.Q]
        par = ov & half                        # S block of this tile
        par_n = ov & ~half                     # S block of tile + 1
        v_ok = (full & v_sel) != 0
        m_ok = ~cmd.mask_en | full[BufSel.MASK]

        # issue-stage step
        iss = Signal(ctl_layout(cfg))
        iss_a = Signal(range(wr))
        iss_b = Signal(range(wc))
        iss_k = Signal.like(k)
        iss_n = Signal(range(odm))
        iss_kc = Signal(range(C))
        sa_pv = Signal(range(cfg.pe_registers))
        use_pv_sa = Signal()

        # O read-out indices
        o_r = Signal(range(R))
        o_a = Signal(range(wr))
        o_n = Signal(range(odm))
        primed = Signal()
        # the read-out runs on its own once FINAL ends (``out_on``), with the
        # O-column count and last valid row of its q tile, so the next q
        # tile's command can be taken meanwhile (``init_after_s``: that q
        # tile's INIT follows its first Q.K^T, once the read-out has ended)
        out_on = Signal()
        o_od = Signal.like(od)
        o_last = Signal(range(cfg.br))
        init_after_s = Signal()
        out_end = Signal()                     # the read-out's last beat goes out

        enter_s = Signal()
        accept = Signal()                      # a q-tile command is taken this cycle
        gap = Signal(range(MAC_RECURRENCE + 1))   # bubbles left before the next MAC round
        gap_pv = Signal.like(gap)
        m.d.comb += gap_pv.eq(Array([Const(gap_pv_cycles(cfg, o), gap.shape())
                                     for o in range(odm + 1)])[od])
        # P.V stops after the tile's last key that a valid row of the q tile
        # can see: min(Bc, E), under causal also min(F, Br) - D (the last
        # valid row's limit), at least one key.  Every later key has P = 0 on
        # every row, so its rounds could not change a bit.  Two
        # register stages from D, E and F, which stay put through the S phase
        # and the softmax before every P.V.
        pv_e = Signal(signed(LEN_BITS + 4))
        pv_c = Signal(signed(LEN_BITS + 4))
        m.d.sync += [pv_e.eq(Mux(vis_e < Bc, vis_e, Bc)),
                     pv_c.eq(Mux(vis_f < cfg.br, vis_f, cfg.br) - vis_d)]
        pv_n = Signal(signed(LEN_BITS + 4))
        m.d.comb += pv_n.eq(Mux(cmd.causal & (pv_c < pv_e), pv_c, pv_e))
        pv_last = Signal(range(Bc))             # the last P.V key of this tile
        m.d.sync += pv_last.eq(Mux(pv_n < 1, 0, pv_n - 1))

        # return-register scoreboard: a word with ``wait`` stalls until the
        # result it reads (tag ``ret_sel``) has arrived.  A result that is
        # written this cycle counts, because the word executes one cycle later.
        ready = Signal(3 * wr)
        arrive = Signal(3 * wr)
        m.d.comb += arrive.eq(Mux(arr.ev_tree, _onehot(arr.ev_tree_tag, 3 * wr), 0)
                              | Mux(arr.ev_rcp, _onehot(arr.ev_rcp_tag, 3 * wr), 0))
        clear = Signal(3 * wr)
        arrive_late = Signal.like(arrive)         # Inject.LATE_RET: the arrivals RET_DELAY cycles later
        late = [arrive]
        for i in range(RET_DELAY):
            late.append(Signal.like(arrive, name=f"arrive_d{i + 1}"))
            m.d.sync += late[-1].eq(late[-2])
        m.d.comb += arrive_late.eq(Mux(self.inject[Inject.LATE_RET], late[-1], arrive))
        arrive = arrive_late
        m.d.sync += ready.eq((ready | arrive) & ~clear)
        ready_now = ready | arrive
        rom_stall = word.wait & ~ready_now.bit_select(word.ctl.ret_sel, 1)

        s = SimpleNamespace(
            cmd=cmd, od=od, full=full, release=release_o, release_s=release_s, rom=rom, pc=rom.pc,
            pc_set=rom.pc_set, rom_hold=rom.hold, word=word, base=rom.base, first=rom.first, phase=phase,
            resume_to=resume_to, resume_pc=resume_pc, pause_at=pause_at,
            tile=tile, tile_last=tile_last, tile_next_last=tile_next_last,
            vis_d=vis_d, vis_e=vis_e, vis_f=vis_f, vis_dn=vis_dn, vis_en=vis_en,
            k=k, kc=kc, kb=kb, a=a, n=n, sk=sk, sa=sa, sb=sb, gap_sl=gap_sl, ov=ov,
            ahead_done=ahead_done, ins=ins, s_par=s_par, s_first=s_first,
            enter_sm=enter_sm, kn_sel=kn_sel, kn_ok=kn_ok, par=par, par_n=par_n,
            half=half, k_sel=k_sel, v_sel=v_sel, k_ok=k_ok, v_ok=v_ok, m_ok=m_ok,
            iss=iss, iss_a=iss_a, iss_b=iss_b, iss_k=iss_k, iss_n=iss_n, iss_kc=iss_kc,
            sa_pv=sa_pv, use_pv_sa=use_pv_sa, o_r=o_r, o_a=o_a, o_n=o_n, primed=primed,
            out_on=out_on, o_od=o_od, o_last=o_last, init_after_s=init_after_s, out_end=out_end,
            enter_s=enter_s, accept=accept, rom_stall=rom_stall, clear=clear, gap=gap, gap_pv=gap_pv,
            pv_last=pv_last,
            quiet=s_quiet, ready=s_ready, ctl_op_row=ctl_op_row)
        self._phase_fsm(m, s)

        # test-only faults for the register check (override the issued word)
        with m.If(self.inject[Inject.SKIP_INIT] & (phase == Phase.INIT)):
            m.d.comb += iss.op.eq(PeOp.NOP)
        with m.If(self.inject[Inject.DROP_S_WRITE] & s_first & (tile + ins == 1)):
            m.d.comb += iss.op.eq(PeOp.NOP)
        return s

    # The FSM's actions shared by several phases.
    def _start_s(self, m, s):
        m.d.comb += s.enter_s.eq(1)
        m.d.sync += s.phase.eq(Phase.S)

    def _sm_base(self, s, par, last, of=None):
        """First ROM address (``of=s.first``: first word) of the softmax
        program on S block ``par``, the variant for the q tile's last kv
        tile when ``last``."""
        of = of or s.base
        b0 = Mux(last, of("sm_last"), of("sm"))
        if not self.config.overlaps_softmax:
            return b0
        return Mux(par, Mux(last, of("sm1_last"), of("sm1")), b0)

    @staticmethod
    def _goto(m, s, addr, word):
        """Jump: the next word is ``word``, the one at ROM address ``addr``
        (a program's first word, from ``s.first``)."""
        m.d.comb += [s.pc_set.eq(addr), s.rom.jump_word.eq(word), s.rom.jump.eq(1), s.rom.step.eq(0)]

    def _enter_sm(self, m, s, par, last):
        """Go to the softmax of the tile whose S block is ``par`` (``last``:
        the q tile's last kv tile; WAIT_M first when its mask is not in)."""
        self._goto(m, s, self._sm_base(s, par, last), self._sm_base(s, par, last, s.first))
        with m.If(s.m_ok):
            m.d.comb += s.enter_sm.eq(1)
            m.d.sync += s.phase.eq(Phase.SM)
        with m.Else():
            m.d.sync += s.phase.eq(Phase.WAIT_M)

    def _s_step(self, m, s, ahead: bool):
        """One cycle of the Q.K^T loop (counters ``sk``/``sa``/``sb``, bubbles
        ``gap_sl``) for kv tile ``tile`` (phase S) or, ``ahead``, tile + 1 in
        a free slot of this tile's softmax (``mac_ok``).  A round (one k)
        touches the wr*wc accumulators once; fewer than MAC_RECURRENCE of
        them leave bubbles between rounds.  The last step releases the
        tile's K half (and Q after the q tile's last tile)."""
        cfg, g = self.config, self.regs
        wr, wc = g.wr, g.wc
        iss, cmd = s.iss, s.cmd
        sk, sa, sb = s.sk, s.sa, s.sb
        with m.If(s.gap_sl != 0):
            m.d.sync += s.gap_sl.eq(s.gap_sl - 1)
        with m.Else():
            par = s.par_n if ahead else s.par
            reg = Mux(par, g.s1_base, 0) | (sa * wc + sb)
            m.d.comb += [iss.op.eq(PeOp.MAC), iss.ra.eq(reg), iss.wa.eq(reg), iss.first.eq(sk == 0),
                         s.iss_a.eq(sa), s.iss_b.eq(sb), s.iss_k.eq(sk), s.s_par.eq(par),
                         s.s_first.eq((sk == 0) & (sa == 0) & (sb == 0))]
            if ahead:
                m.d.comb += s.ins.eq(1)
            last_b = sb == wc - 1
            last_a = sa == wr - 1
            last_k = sk == cmd.head_dim - 1
            m.d.sync += sb.eq(Mux(last_b, 0, sb + 1))
            with m.If(last_b):
                m.d.sync += sa.eq(Mux(last_a, 0, sa + 1))
                with m.If(last_a):
                    m.d.sync += sk.eq(Mux(last_k, 0, sk + 1))
                    if gap_s(cfg):
                        with m.If(~last_k & ~self.inject[Inject.NO_GAP]):
                            m.d.sync += s.gap_sl.eq(gap_s(cfg))
            with m.If(last_b & last_a & last_k):
                t_last = s.tile_next_last if ahead else s.tile_last
                k_rel = s.kn_sel if ahead else s.k_sel
                m.d.comb += s.release_s.eq(k_rel | Mux(t_last, 1 << BufSel.Q, 0))
                if ahead:
                    m.d.sync += s.ahead_done.eq(1)
                else:
                    with m.If(cmd.pause[PausePoint.S_RAW]):
                        m.d.sync += [s.phase.eq(Phase.PAUSED), s.resume_to.eq(Phase.WAIT_M),
                                     s.pause_at.eq(PausePoint.S_RAW),
                                     s.resume_pc.eq(self._sm_base(s, par, t_last))]
                    with m.Elif(s.init_after_s):
                        m.d.sync += s.phase.eq(Phase.INIT)
                        self._goto(m, s, s.base("init"), s.first("init"))
                    with m.Else():
                        self._enter_sm(m, s, par, t_last)

    def _start_pv(self, m, s):
        m.d.sync += [s.k.eq(0), s.kc.eq(0), s.kb.eq(0), s.a.eq(0), s.n.eq(0)]

    def _after_tile(self, m, s):
        """Decide what follows the P.V of a tile (tile not yet counted): the
        FINAL program after the last tile; else the next tile's softmax when
        its Q.K^T already ran ahead, the rest of its Q.K^T when it started,
        or its Q.K^T (once its K half is in)."""
        cmd, phase = s.cmd, s.phase
        last_tile, next_last = s.tile_last, s.tile_next_last
        s_mid = (s.sk != 0) | (s.sa != 0) | (s.sb != 0)
        nxt = Signal(Phase, name="after_tile")
        nxt_pc = Signal.like(s.pc, name="after_tile_pc")
        nxt_word = Signal.like(s.word, name="after_tile_word")
        m.d.comb += [nxt_pc.eq(s.base("final")), nxt_word.eq(s.first("final"))]
        with m.If(last_tile):
            m.d.comb += nxt.eq(Phase.FINAL)
        with m.Elif(s.ahead_done):
            m.d.comb += [nxt.eq(Phase.WAIT_M), nxt_pc.eq(self._sm_base(s, s.par_n, next_last)),
                         nxt_word.eq(self._sm_base(s, s.par_n, next_last, s.first))]
        with m.Elif(s_mid):
            m.d.comb += nxt.eq(Phase.S)
        with m.Else():
            m.d.comb += nxt.eq(Phase.WAIT_K)
        with m.If(cmd.pause[PausePoint.TILE]):
            m.d.sync += [phase.eq(Phase.PAUSED), s.resume_to.eq(nxt),
                         s.pause_at.eq(PausePoint.TILE), s.resume_pc.eq(nxt_pc)]
        with m.Elif(~last_tile & s.ahead_done):
            self._enter_sm(m, s, s.par_n, next_last)
        with m.Elif(~last_tile & ~s_mid & s.kn_ok):
            self._start_s(m, s)                # back-to-back tiles: no bubble
        with m.Else():
            m.d.sync += phase.eq(nxt)
            self._goto(m, s, nxt_pc, nxt_word)

    def _run_rom(self, m, s, on_last, waits: bool = True):
        """Issue the ROM word at ``pc`` unless it waits for a return value
        (``waits``: the program has such words; then a waiting word holds
        the ROM and the pc, ``rom_hold``, and ``pc_set`` is pc + 1 either
        way, which ``on_last`` must not change); ``on_last`` adds the
        actions of the program's last word."""
        word, pc = s.word, s.pc
        pc_next = pc + 1
        stall = s.rom_stall if waits else Const(0)
        m.d.comb += [s.pc_set.eq(pc_next), s.rom.step.eq(1)]
        if waits:
            m.d.comb += s.rom_hold.eq(s.rom_stall)
        with m.If(~stall):
            m.d.comb += [s.iss.eq(word.ctl), s.iss_a.eq(word.a), s.iss_b.eq(word.b)]
            with m.If((word.ctl.tree != TreeOp.NONE) | word.ctl.rcp):
                m.d.comb += s.clear.eq(_onehot(word.ctl.tag, 3 * self.regs.wr))
            with m.If(word.last):
                on_last()
            with m.Elif(word.pause & s.cmd.pause[PausePoint.S]):
                m.d.sync += [s.phase.eq(Phase.PAUSED), s.resume_to.eq(s.phase),
                             s.pause_at.eq(PausePoint.S), s.resume_pc.eq(pc_next)]

    def _phase_fsm(self, m, s):
        """One case per ``Phase``: accept a command, run the INIT / softmax /
        FINAL programs, step the S and P.V loops, wait for buffers, pause."""
        cfg = self.config
        g = self.regs
        C, Bc = cfg.array_cols, cfg.bc
        wr, wc, odm, mhd = g.wr, g.wc, g.od, cfg.max_head_dim
        cmd, phase, base, iss, release = s.cmd, s.phase, s.base, s.iss, s.release
        k, a, n, kc, kb, tile = s.k, s.a, s.n, s.kc, s.kb, s.tile
        p = self.cmd.payload
        bad = (p.head_dim == 0) | (p.head_dim > mhd) | (p.n_kv == 0)
        od_new = Signal.like(s.od)
        m.d.comb += od_new.eq((p.head_dim + C - 1) >> (C.bit_length() - 1))

        def accept(early):
            m.d.comb += s.accept.eq(1)
            vis_e0 = Mux(p.seq_kv < p.kv_valid_len, p.seq_kv, p.kv_valid_len)
            m.d.sync += [cmd.eq(p), tile.eq(0), s.od.eq(od_new),
                         s.tile_last.eq(p.n_kv == 1), s.tile_next_last.eq(p.n_kv == 2),
                         s.vis_d.eq(p.seq_q - p.q_row0 - p.seq_kv),
                         s.vis_e.eq(vis_e0),
                         s.vis_dn.eq(p.seq_q - p.q_row0 - p.seq_kv + Bc),
                         s.vis_en.eq(vis_e0 - Bc),
                         s.vis_f.eq(p.seq_q - p.q_row0),
                         s.sk.eq(0), s.sa.eq(0), s.sb.eq(0), s.gap_sl.eq(0),
                         s.ahead_done.eq(0), s.init_after_s.eq(early),
                         s.ov.eq(int(cfg.overlaps_softmax) & ~p.pause[PausePoint.S_RAW]
                                 & ~p.pause[PausePoint.S])]
            if early:
                m.d.sync += phase.eq(Phase.WAIT_K)
            else:
                m.d.sync += phase.eq(Phase.INIT)
                self._goto(m, s, base("init", od_new), s.first("init", od_new))

        with m.Switch(phase):
            with m.Case(Phase.IDLE):
                m.d.comb += self.cmd.ready.eq(s.ready)
                with m.If(self.cmd.valid & s.ready):
                    m.d.sync += self.err.eq(bad)
                    with m.If(~bad):
                        accept(early=False)
            with m.Case(Phase.INIT):
                def init_last():
                    with m.If(s.init_after_s):
                        m.d.sync += s.init_after_s.eq(0)
                        self._enter_sm(m, s, s.par, s.tile_last)
                    with m.Else():
                        m.d.sync += phase.eq(Phase.WAIT_K)
                with m.If(~s.out_on):               # after an early accept: once O is out
                    self._run_rom(m, s, init_last, waits=False)
            with m.Case(Phase.WAIT_K):
                with m.If(s.k_ok):
                    self._start_s(m, s)
            with m.Case(Phase.S):
                self._s_step(m, s, ahead=False)
            with m.Case(Phase.WAIT_M):
                with m.If(s.m_ok):
                    m.d.comb += s.enter_sm.eq(1)
                    m.d.sync += phase.eq(Phase.SM)
            with m.Case(Phase.SM):
                def sm_last():
                    m.d.comb += release.eq(Mux(cmd.mask_en, 1 << BufSel.MASK, 0))
                    with m.If(s.v_ok):
                        m.d.sync += phase.eq(Phase.PV)
                        self._start_pv(m, s)
                    with m.Else():
                        m.d.sync += phase.eq(Phase.WAIT_V)
                self._run_rom(m, s, sm_last)
                # the next tile's Q.K^T in the program's free slots
                with m.If(s.ov & s.word.mac_ok & ~s.rom_stall & ~s.tile_last
                          & ~s.ahead_done & s.kn_ok):
                    self._s_step(m, s, ahead=True)
            with m.Case(Phase.WAIT_V):
                with m.If(s.v_ok):
                    m.d.sync += phase.eq(Phase.PV)
                    self._start_pv(m, s)
            with m.Case(Phase.PV):
                with m.If(s.gap != 0):
                    m.d.sync += s.gap.eq(s.gap - 1)
                with m.Else():
                    m.d.comb += [iss.op.eq(PeOp.MAC), iss.ra.eq(g.o_base + a * odm + n),
                                 iss.wa.eq(g.o_base + a * odm + n), iss.skipz.eq(1), iss.pv.eq(1),
                                 s.iss_a.eq(a), s.iss_k.eq(k), s.iss_n.eq(n), s.iss_kc.eq(kc),
                                 s.sa_pv.eq(Mux(s.par, g.s1_base, 0) | (a * wc + kb)),
                                 s.use_pv_sa.eq(1)]
                    last_n = n == s.od - 1
                    last_a = a == wr - 1
                    last_k = k == s.pv_last
                    m.d.sync += n.eq(Mux(last_n, 0, n + 1))
                    with m.If(last_n):
                        m.d.sync += a.eq(Mux(last_a, 0, a + 1))
                        with m.If(last_a):
                            m.d.sync += [k.eq(k + 1), kb.eq(Mux(kb == wc - 1, 0, kb + 1))]
                            with m.If(kb == wc - 1):
                                m.d.sync += kc.eq(kc + 1)
                            with m.If(~last_k):
                                m.d.sync += s.gap.eq(s.gap_pv)
                    with m.If(last_n & last_a & last_k):
                        m.d.comb += release.eq(s.v_sel)
                        self._after_tile(m, s)
                        m.d.sync += [tile.eq(tile + 1), s.tile_last.eq(s.tile_next_last),
                                     s.tile_next_last.eq(tile + 3 == cmd.n_kv), s.vis_d.eq(s.vis_d + Bc),
                                     s.vis_e.eq(s.vis_e - Bc), s.vis_dn.eq(s.vis_dn + Bc),
                                     s.vis_en.eq(s.vis_en - Bc), s.ahead_done.eq(0)]
            with m.Case(Phase.FINAL):
                def final_last():
                    # the read-out stops after the q tile's last valid row
                    # (seq_q - q_row0, at most Br, at least one)
                    f = s.vis_f
                    m.d.sync += [phase.eq(Phase.OUT), s.o_r.eq(0), s.o_a.eq(0), s.o_n.eq(0),
                                 s.primed.eq(0), s.out_on.eq(1), s.o_od.eq(s.od),
                                 s.o_last.eq(Mux(f >= cfg.br, cfg.br - 1, Mux(f < 1, 0, f - 1)))]
                self._run_rom(m, s, final_last)
            with m.Case(Phase.OUT):
                # the read-out (``_readout``) runs on its own: the next q
                # tile's command is taken now unless it pauses, and its first
                # Q.K^T streams while O goes out (early accept)
                early = self.cmd.valid & s.ready & ~bad & (p.pause == 0)
                m.d.comb += self.cmd.ready.eq(early)
                with m.If(early):
                    m.d.sync += self.err.eq(0)
                    accept(early=True)
            with m.Case(Phase.PAUSED):
                # read the word at resume_pc (``_rom``: ``paused`` waits for it)
                m.d.comb += [s.pc_set.eq(s.resume_pc), s.rom.load.eq(1)]
                with m.If(self.resume & self.paused):
                    m.d.sync += phase.eq(s.resume_to)
                    m.d.comb += s.rom.load.eq(0)

    # --------------------------------------------------------------- O read-out
    def _readout(self, m, s, arr):
        """The ``o`` stream (phase OUT) and the PEs' synchronous read port:
        P operand (P.V), O read-out or debug.  Returns ``in_out``."""
        R = self.config.array_rows
        g = self.regs
        wr, odm = g.wr, g.od
        od, o_r, o_a, o_n, primed, phase = s.o_od, s.o_r, s.o_a, s.o_n, s.primed, s.phase
        fire = self.o.valid & self.o.ready

        def step(a, n):
            """(a, n) of the beat after beat (a, n) within a PE row."""
            end = n == od - 1
            return Mux(end, Mux(a == wr - 1, 0, a + 1), a), Mux(end, 0, n + 1)

        def addr(a, n):
            return g.o_base + a * odm + n

        nx_n = Signal.like(o_n)
        nx_a = Signal.like(o_a)
        nx_r = Signal.like(o_r)
        last_beat = (o_n == od - 1) & (o_r * wr + o_a == s.o_last)
        nx_a_v, nx_n_v = step(o_a, o_n)
        m.d.comb += [
            nx_a.eq(nx_a_v), nx_n.eq(nx_n_v),
            nx_r.eq(Mux((o_n == od - 1) & (o_a == wr - 1), o_r + 1, o_r)),
        ]
        use_r = Mux(fire, nx_r, o_r)
        # the O_acc addresses of this beat and the next in registers (beat 0
        # and 1 outside a read-out: the indices rest at 0), so only the
        # ``fire`` mux lies between them and the PEs' read port
        sa_cur = Signal(range(self.config.pe_registers), name="o_sa")
        sa_nxt = Signal.like(sa_cur, name="o_sa_next")
        nx2_a, nx2_n = step(nx_a, nx_n)
        m.d.sync += [sa_cur.eq(addr(Mux(fire, nx_a, o_a), Mux(fire, nx_n, o_n))),
                     sa_nxt.eq(addr(Mux(fire, nx2_a, nx_a), Mux(fire, nx2_n, nx_n)))]
        in_out = s.out_on
        m.d.comb += [
            self.o.valid.eq(in_out & primed),
            self.o.payload.row.eq(o_r * wr + o_a),
            self.o.payload.n.eq(o_n),
            self.o.payload.data.eq(arr.rd_data),
            self.dbg_data.eq(arr.rd_data),
        ]
        with m.If(in_out):
            m.d.sync += primed.eq(1)
            with m.If(fire):
                m.d.sync += [o_r.eq(nx_r), o_a.eq(nx_a), o_n.eq(nx_n)]
                with m.If(last_beat):
                    # back to beat 0, which ``sa_cur`` then follows
                    m.d.comb += s.out_end.eq(1)
                    m.d.sync += [s.out_on.eq(0), self.done.eq(1), primed.eq(0),
                                 o_r.eq(0), o_a.eq(0), o_n.eq(0)]
                    with m.If((phase == Phase.OUT) & ~s.accept):
                        m.d.sync += phase.eq(Phase.IDLE)

        # PE synchronous read port: P operand (P.V), O read-out, or debug
        rd_row_d = Signal(range(R))
        with m.If(s.use_pv_sa):
            m.d.comb += arr.sa.eq(s.sa_pv)
        with m.Elif(in_out):
            m.d.comb += arr.sa.eq(Mux(fire, sa_nxt, sa_cur))
            m.d.sync += rd_row_d.eq(use_r)
        with m.Else():
            m.d.comb += arr.sa.eq(self.dbg_addr)
            m.d.sync += rd_row_d.eq(self.dbg_row)
        m.d.comb += arr.rd_row.eq(rd_row_d)
        return in_out

    # ----------------------------------------------------------------- operands
    def _operands(self, m, s, arr, bufs):
        """Operand fetch (``bufs`` read addresses of the issued step), the
        operand stage one cycle later (control word register, Q/K/V lanes
        onto the array's buses) and the visibility bits.  Returns ``ctl_d``,
        the control word on the array's ``ctl`` input this cycle (the PEs
        execute it in the next, after the rows' operand stage)."""
        cfg = self.config
        R, C = cfg.array_rows, cfg.array_cols
        wr, wc, odm = self.regs.wr, self.regs.wc, self.regs.od
        cmd, od = s.cmd, s.od
        iss, iss_a, iss_b, iss_k, iss_n, iss_kc = s.iss, s.iss_a, s.iss_b, s.iss_k, s.iss_n, s.iss_kc
        # --------------------------------------------- operand fetch (issue)
        # The addresses come straight from the loops' own registers (S: sa,
        # sb and the K half, which is tile + 1's in the softmax, where only
        # the run-ahead S steps read K; P.V: k) and, for the mask, from the
        # ROM word: each is valid whether or not its step issues, so no
        # issue decision (ROM stall, free slot) lies on the path from the
        # sequencer to a buffer's read port.
        m.d.comb += [bufs.half.eq(s.half ^ (s.phase == Phase.SM)), bufs.q_row.eq(s.sa),
                     bufs.k_row.eq(s.sb), bufs.m_row.eq(s.word.a), bufs.v_row.eq(s.k)]

        # ------------------------------------- operand stage (issue + 1 cycle)
        # One register stage for the control word and the step indices, so
        # they meet the synchronous tile-buffer reads in the same cycle.
        ctl_d = Signal(ctl_layout(cfg))
        k_d = Signal.like(iss_k)
        n_d = Signal.like(iss_n)
        b_d = Signal.like(iss_b)
        kc_d = Signal.like(iss_kc)
        m.d.sync += [ctl_d.eq(iss), k_d.eq(iss_k), n_d.eq(iss_n), b_d.eq(iss_b),
                     kc_d.eq(iss_kc)]
        m.d.comb += [arr.ctl.eq(ctl_d), arr.psel.eq(kc_d), arr.cst.eq(cmd.c)]
        for r in range(R):
            m.d.comb += arr.row_a16[r].eq(bufs.q_data[r].word_select(k_d, 16))
        hd = cmd.head_dim
        for c in range(C):
            # the V lane of PE column c (od*c + n) and whether it is within
            # head_dim, computed in the issue cycle and registered, so only
            # the lane mux sits between the V buffer and the column bus
            lane = Signal(range(odm * C + 1), name=f"vlane{c}")
            lane_ok = Signal(name=f"vlane_ok{c}")
            m.d.sync += [lane.eq(od * c + iss_n), lane_ok.eq(od * c + iss_n < hd)]
            vval = Mux(lane_ok, bufs.v_data.word_select(lane, 16), 0)
            m.d.comb += arr.col_b16[c].eq(Mux(ctl_d.pv, vval, bufs.k_data[c].word_select(k_d, 16)))
        # visibility of each PE's position, computed in the issue cycle and
        # registered (so it reaches the PEs as a flop at E0, where it gates
        # the MAC's operands), then ANDed with the mask bit read in the
        # operand stage (SCALE).  With i = q_row0 + wr r + a the query row
        # and j the key (Q.K and SCALE: kv0 + wc c + b; P.V: kv0 + k, the
        # key of the P on row r's bus):
        #   row valid  i < seq_q                   <=>  wr r + a < F
        #   key valid  j < min(seq_kv, kv_valid_len) <=>  wc c + b < E  (P.V: k < E)
        #   causal     j + seq_q <= i + seq_kv      <=>  D <= wr r + a - wc c - b
        #                                               (P.V: D + k - a <= wr r)
        # with the registers F = seq_q - q_row0, E = min(seq_kv,
        # kv_valid_len) - kv0 and D = kv0 + seq_q - q_row0 - seq_kv (set when
        # a command is accepted, stepped by Bc per kv tile).  Every compare
        # is a register against a constant, off the path of the step's
        # indices, which only select among them.
        not_causal = Signal()
        m.d.comb += not_causal.eq(~cmd.causal)
        D, E, F = s.vis_d, s.vis_e, s.vis_f
        row_ok = [[Signal(name=f"qok{r}_{a}") for a in range(wr)] for r in range(R)]
        for r in range(R):
            for a in range(wr):
                m.d.comb += row_ok[r][a].eq(wr * r + a < F)
        us = sorted({wr * r + a - wc * c - b for r in range(R) for a in range(wr)
                     for c in range(C) for b in range(wc)})

        def key_terms(D, E, sfx):
            """The S-phase compares against one kv tile's D and E: key valid
            per (c, b), causal limit per offset u."""
            col_ok = [[Signal(name=f"kok{sfx}{c}_{b}") for b in range(wc)] for c in range(C)]
            for c in range(C):
                for b in range(wc):
                    m.d.comb += col_ok[c][b].eq(wc * c + b < E)
            causal_le = {}                              # u -> (D <= u)
            for u in us:
                causal_le[u] = Signal(name=f"dle{sfx}{u}".replace("-", "m"))
                m.d.comb += causal_le[u].eq(not_causal | (D <= u))
            return col_ok, causal_le
        col_ok, causal_le = key_terms(D, E, "")
        # the Q.K^T steps that run ahead (``ins``) are of kv tile + 1: the
        # same compares on its D and E (registers too), chosen per PE last
        nxt = key_terms(s.vis_dn, s.vis_en, "n") if cfg.overlaps_softmax else None
        ab = Signal(range(wr * wc), name="vis_ab")
        m.d.comb += ab.eq(iss_a * wc + iss_b)
        # P.V: the loop's own a and k registers (iss_a == a there)
        z = Signal(signed(len(D) + 1), name="vis_pv_z")
        key_pv = Signal(name="vis_pv_key")
        m.d.comb += [z.eq(D + s.k - s.a), key_pv.eq(s.k < E)]
        geo = Signal(R * C, name="vis_geo")            # registered: operand stage
        for r in range(R):
            row_a = Array(row_ok[r])
            pv_ok = row_a[s.a] & key_pv & (not_causal | (z <= wr * r))
            for c in range(C):
                def s_ok_of(col_ok, causal_le):
                    ca = Array([causal_le[wr * r + a - wc * c - b] for a in range(wr) for b in range(wc)])
                    return row_a[iss_a] & Array(col_ok[c])[iss_b] & ca[ab]
                s_ok = s_ok_of(col_ok, causal_le)
                if nxt is not None:
                    s_ok = Mux(s.ins, s_ok_of(*nxt), s_ok)
                m.d.sync += geo[r * C + c].eq(Mux(iss.pv, pv_ok, s_ok))
        for r in range(R):
            # mask bits of this step (column b_d of every PE) for SCALE, all
            # ones when off and for MACs (the mask buffer is loaded for the
            # softmax: WAIT_M)
            mrow = Signal(C, name=f"mrow{r}")
            by_b = Array([Cat(*[bufs.m_data[r][c * wc + bb] for c in range(C)]) for bb in range(wc)])
            m.d.comb += mrow.eq(by_b[b_d] | Mux(cmd.mask_en & (ctl_d.op == PeOp.SCALE), 0, (1 << C) - 1))
            for c in range(C):
                m.d.comb += arr.vis[r * C + c].eq(geo[r * C + c] & mrow[c])
        return ctl_d

    # ------------------------------------------------ register check (simulation)
    def _register_check(self, m, s, arr, ctl_d, in_out):
        """One written-mask for all PEs (SIMD), kept at the PEs' true timing:
        the op pipeline of a PE is mirrored here (stage records of op and
        ``wa``), a register counts as written in the cycle its write lands,
        and the A/B reads of the op in stage ``RF_READ_STAGE`` and the
        synchronous port's read (issued this cycle) are checked.  A read
        fails when the register was not written since it was last cleared,
        or when an earlier op's write to it is still in flight (the
        scheduler's and the loops' promise).  A violation stops the core and
        latches ``reg_err*``."""
        cfg = self.config
        phase, tile = s.phase, s.tile
        NR = cfg.pe_registers
        written = Signal(NR)
        g = self.regs
        block_mask = [sum(1 << i for i in g.s_block(p)) for p in g.blocks]
        alpha_mask = sum(1 << g.ALPHA(a) for a in range(g.wr))
        wstage = {op: t.write for op, t in OP_TIMING.items() if t.write is not None}
        n_st = max(wstage.values()) + 1
        rec = data.StructLayout({"op": PeOp, "wa": ctl_d.wa.shape(), "first": 1, "skipz": 1})
        st = [Signal(rec, name=f"chk_st{i}") for i in range(n_st)]
        m.d.comb += [st[0].op.eq(ctl_d.op), st[0].wa.eq(ctl_d.wa), st[0].first.eq(ctl_d.first),
                     st[0].skipz.eq(ctl_d.skipz)]
        ra1 = Signal.like(ctl_d.ra, name="chk_ra1")
        rb1 = Signal.like(ctl_d.rb, name="chk_rb1")
        m.d.sync += [ra1.eq(ctl_d.ra), rb1.eq(ctl_d.rb)]
        for i in range(1, n_st):
            m.d.sync += st[i].eq(st[i - 1])
        # writes landing now, and writes still to land (per stage of the writer)
        wr_now = 0
        pend = [0] * n_st
        for op, w in wstage.items():
            for i in range(n_st):
                hit = st[i].op == op
                if i == w:
                    cond = hit & ~st[i].skipz if op == PeOp.MAC else hit
                    wr_now = wr_now | Mux(cond, _onehot(st[i].wa, NR), 0)
                elif i < w:
                    pend[i] = pend[i] | Mux(hit, _onehot(st[i].wa, NR), 0)
        wr_now_s = Signal(NR)
        pend_ab = Signal(NR)                   # in flight for the reader in stage 1
        pend_s = Signal(NR)                    # in flight for the sync port's read now
        m.d.comb += [wr_now_s.eq(wr_now), pend_ab.eq(sum_or(pend[RF_READ_STAGE + 1:])),
                     pend_s.eq(sum_or(pend))]
        rd = st[RF_READ_STAGE]
        rd_a, rd_b = Signal(name="chk_rd_a"), Signal(name="chk_rd_b")
        with m.Switch(rd.op):
            for op, (ua, ub, _uw) in RF_USE.items():
                with m.Case(op):
                    if op == PeOp.MAC:
                        m.d.comb += rd_a.eq(~rd.first)
                    else:
                        m.d.comb += [rd_a.eq(ua), rd_b.eq(ub)]
        # a tile's S block is forgotten when its first Q.K^T step issues,
        # alpha when its softmax starts
        forget = Signal(NR)
        blk = Const(block_mask[0], NR) if len(block_mask) == 1 else \
            Mux(s.s_par, Const(block_mask[1], NR), Const(block_mask[0], NR))
        m.d.comb += forget.eq(Mux(s.s_first, blk, 0) | Mux(s.enter_sm, Const(alpha_mask, NR), 0))
        # O_acc stays written while the read-out of the previous q tile
        # reads it after an early accept, and is forgotten when it ends
        o_mask = Const(sum(1 << g.O(a, n) for a in range(g.wr) for n in range(g.od)), NR)
        with m.If(s.accept):
            m.d.sync += written.eq(Mux(s.out_on & ~s.out_end, (written | wr_now_s) & o_mask, 0))
        with m.Else():
            m.d.sync += written.eq((written & ~forget & ~Mux(s.out_end, o_mask, 0)) | wr_now_s)
        # phase and kv tile of the word in the rows' operand stage, E0 and E1
        # (a Q.K^T step that runs ahead counts as phase S of tile + 1)
        phase_d = [Signal(Phase, name=f"chk_phase{i}") for i in range(3)]
        tile_d = [Signal.like(tile, name=f"chk_tile{i}") for i in range(3)]
        m.d.sync += [phase_d[0].eq(Mux(s.ins, Phase.S, phase)), tile_d[0].eq(tile + s.ins)]
        m.d.sync += [phase_d[i].eq(phase_d[i - 1]) for i in range(1, 3)]
        m.d.sync += [tile_d[i].eq(tile_d[i - 1]) for i in range(1, 3)]
        seen = written | wr_now_s

        def bad(addr, pending):
            return ~seen.bit_select(addr, 1) | pending.bit_select(addr, 1)
        bad_a = rd_a & bad(ra1, pend_ab)
        bad_b = rd_b & bad(rb1, pend_ab)
        bad_s = (s.use_pv_sa | in_out) & bad(arr.sa, pend_s)
        viol = Signal()
        m.d.comb += viol.eq((phase != Phase.IDLE) & (bad_a | bad_b | bad_s))
        with m.If(s.accept):
            m.d.sync += self.reg_err.eq(0)
        with m.If(viol):
            m.d.sync += [self.reg_err.eq(1), phase.eq(Phase.IDLE), self.done.eq(0)]
            with m.If(bad_a):
                m.d.sync += [self.reg_err_addr.eq(ra1), self.reg_err_phase.eq(phase_d[2]),
                             self.reg_err_tile.eq(tile_d[2])]
            with m.Elif(bad_b):
                m.d.sync += [self.reg_err_addr.eq(rb1), self.reg_err_phase.eq(phase_d[2]),
                             self.reg_err_tile.eq(tile_d[2])]
            with m.Else():
                m.d.sync += [self.reg_err_addr.eq(arr.sa), self.reg_err_phase.eq(phase),
                             self.reg_err_tile.eq(tile)]

    # ------------------------------------------------------------------ counters
    def _counters(self, m, s, ctl_d, arr):
        """Cycle and operation counters of the current/last command (see the
        class docstring), cleared when a command arrives in IDLE (a command
        taken early, during the read-out, adds to them), and the per-cycle
        events they count (``ev``: the NPU's job counters count the same)."""
        R, C = self.config.array_rows, self.config.array_cols
        phase, ev = s.phase, self.ev
        counting = (phase != Phase.IDLE) & (phase != Phase.PAUSED)
        m.d.comb += [
            ev.mac.eq(ctl_d.op == PeOp.MAC),
            ev.exp2.eq((ctl_d.op == PeOp.PEXP) | (ctl_d.op == PeOp.MALPHA)),
            ev.recip.eq(ctl_d.rcp),
            # the array's count of masked MACs (4 cycles after the ops; the
            # pipeline is quiet before a command is accepted)
            ev.masked.eq(arr.msk),
            ev.softmax.eq(phase == Phase.SM),
            ev.stall.eq(((phase == Phase.WAIT_K) & ~s.k_ok) | ((phase == Phase.WAIT_M) & ~s.m_ok)
                        | ((phase == Phase.WAIT_V) & ~s.v_ok)),
            ev.kv_tile.eq((phase == Phase.PV) & (s.release != 0)),   # a kv tile's P.V ends
        ]
        tile_cyc = Signal(32)
        with m.If((phase == Phase.IDLE) & self.cmd.valid):
            m.d.sync += [x.eq(0) for x in (self.cnt_total, self.cnt_mac, self.cnt_softmax,
                                            self.cnt_stall, self.cnt_tile_last,
                                            self.cnt_tile_sum, self.ops_mac, self.ops_exp2,
                                            self.ops_recip, self.ops_masked, tile_cyc)]
        with m.Else():
            with m.If(counting):
                m.d.sync += self.cnt_total.eq(self.cnt_total + 1)
            m.d.sync += [self.cnt_mac.eq(self.cnt_mac + ev.mac),
                         self.ops_mac.eq(self.ops_mac + Mux(ev.mac, R * C, 0)),
                         self.ops_exp2.eq(self.ops_exp2 + Mux(ev.exp2, R * C, 0)),
                         self.ops_recip.eq(self.ops_recip + Mux(ev.recip, R, 0)),
                         self.ops_masked.eq(self.ops_masked + ev.masked),
                         self.cnt_softmax.eq(self.cnt_softmax + ev.softmax),
                         self.cnt_stall.eq(self.cnt_stall + ev.stall)]
            # tile cycles: from the first S step of the q tile's first tile,
            # or from the end of the previous tile's P.V (with the overlap the
            # tiles' phases interleave), to the end of its P.V
            with m.If(s.enter_s | ev.kv_tile):
                m.d.sync += tile_cyc.eq(0)
            with m.Elif(counting):
                m.d.sync += tile_cyc.eq(tile_cyc + 1)
            with m.If(ev.kv_tile):
                m.d.sync += [self.cnt_tile_last.eq(tile_cyc + 1),
                             self.cnt_tile_sum.eq(self.cnt_tile_sum + tile_cyc + 1)]


def core_verilog(config: NPUConfig, name: str = CORE_MODULE, top: "Core | None" = None) -> str:
    """Verilog of the core with the PE, tree node and reciprocal modules
    generated once and instantiated.

    ``top`` (optional) is the ``Core(config, pe_as_instance=True)`` to
    convert; one is made when omitted."""
    if top is None:
        top = Core(config, pe_as_instance=True)
    if not top.pe_as_instance:
        raise ValueError("core_verilog needs a Core built with pe_as_instance=True")
    text = verilog.convert(top, name=name, emit_src=False)
    return text + "\n" + module_texts(config)
