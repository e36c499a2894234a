"""TSV link with spare lanes, a repair map, fault injection and a built-in self-test.

A TSV bundle between the DRAM stack and the logic die carries N data lanes
plus S spare lanes.  Failed TSVs (open or shorted vias behave as stuck-at-0 or
stuck-at-1 lanes) are routed around with a **repair map**: entry s says which
data lane spare s replaces.  The transmitter copies data lane ``lane[s]`` onto
physical lane N+s; the receiver takes that data lane from N+s instead of from
its own (failed) TSV.  A map (S entries x (valid, lane index)) costs S
N-to-1 muxes at the transmitter and one S-to-1 mux per lane at the receiver;
a shift-based repair would need fewer wires to program but repairs only
neighbouring lanes and changes every lane's mux when one fails.

Dataflow::

            TX (logic or DRAM side)          physical lanes            RX
    i ──► data[0..N-1] ──────────────────► lane 0..N-1 ──┐   (fault    ┌──► data lane i = lane N+s
          data[map[s].lane] ─────────────► lane N+s    ──┴── injection)┘    if map[s] = (1, i), else lane i ──► o
          (BIST pattern on every lane while BIST runs)           │
                                                        compare with pattern ─► failed_lanes ─► allocator ─► map

Self-test (``bist_start``): all-0 (finds stuck-at-1), all-1 (finds stuck-at-0),
then walking-1 and walking-0 over all N+S lanes (would find lane-to-lane
shorts; with the stuck-at faults modelled here they re-confirm the first two
steps).  Failed lanes are collected in ``failed_lanes``; then the allocator
walks the data lanes and assigns the next *working* spare to each failed data
lane.  Cycles: 2 + 2(N+S) patterns (2 without walking) + N + S allocation.

Status and the no-corruption rule: the link delivers data only while
``status == OK``: trained (a BIST has run since reset), no BIST running, every
failed data lane covered by a valid map entry whose spare is not itself
failed, and no valid entry pointing at a failed spare.  Otherwise
``i.ready`` and ``o.valid`` are held low: nothing is delivered, nothing is
corrupted.  A host may also program the map itself (``repair_we``); the same
coverage check then applies to its map.

Limits (stated, not hidden): faults that appear *after* the last BIST are not
seen until the next BIST (a stuck lane gives no signal while its data happens
to match).  The fault-injection inputs stand for physical defects and exist
for tests only; the NPU drives them from its ``tsv_fault_rd`` /
``tsv_fault_wr`` registers (``hdl/npu.py``).

Timing: the data path is combinational (a TSV is a wire); ``o`` mirrors ``i``
in the same cycle when the link is OK.
"""

from __future__ import annotations

import enum

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["LinkStatus", "TSVControlSignature", "TSVLink", "repair_entry_layout"]


class LinkStatus(enum.IntEnum):
    """TSV link status codes (``TSVLink.ctl.status``)."""
    UNTRAINED = 0     #: no BIST since reset: nothing is delivered
    OK = 1            #: every failed lane is repaired: data flows
    BIST = 2          #: self-test running
    UNCOVERED = 3     #: a failed data lane has no working spare in the map (or the map uses a failed spare)
    TOO_MANY = 4      #: the last BIST found more failed data lanes than working spares


def repair_entry_layout(n_data: int) -> data.StructLayout:
    """One repair-map entry: ``valid`` and the data ``lane`` the spare replaces."""
    return data.StructLayout({"valid": 1, "lane": range(n_data)})


class TSVControlSignature(wiring.Signature):
    """Host/test control of one TSV link, written from the host's side
    (the link uses ``In(...)``).

    Members (Out = driven by the host or test, In = status from the link)
    ---------------------------------------------------------------------
    repair_we, repair_idx, repair_valid, repair_lane : Out
        Write map entry ``repair_idx`` with (valid, lane) in one cycle
        (ignored while BIST runs).
    fault_stuck0, fault_stuck1 : Out(N+S)
        Test-only physical faults: a set bit forces that physical lane to 0 / 1
        (stuck-at-1 wins when both are set).
    bist_start : Out(1)
        Pulse: run the self-test and rebuild the map.
    status : In(LinkStatus)
    ok : In(1)
        ``status == OK``.
    failed_lanes : In(N+S)
        Lanes the last BIST found failed (bit N+s = spare s).
    repair_map : In(ArrayLayout(entry, S))
        The current map.
    """

    def __init__(self, n_data: int, n_spare: int):
        self.n_data = n_data
        self.n_spare = n_spare
        nl = n_data + n_spare
        members = {
            "repair_we": Out(1),
            "repair_idx": Out(range(max(n_spare, 1))),
            "repair_valid": Out(1),
            "repair_lane": Out(range(n_data)),
            "fault_stuck0": Out(nl),
            "fault_stuck1": Out(nl),
            "bist_start": Out(1),
            "status": In(LinkStatus),
            "ok": In(1),
            "failed_lanes": In(nl),
        }
        if n_spare:
            members["repair_map"] = In(data.ArrayLayout(repair_entry_layout(n_data), n_spare))
        super().__init__(members)


class TSVLink(wiring.Component):
    """One TSV bundle: N data lanes, S spares, repair map and BIST.

    Parameters
    ----------
    n_data : int
        Data lanes N (= payload bits of ``i``/``o``), >= 1.
    n_spare : int
        Spare lanes S, >= 0.
    walking : bool
        Include walking-1/walking-0 patterns in the BIST (2(N+S) more cycles).

    Ports
    -----
    i : In(stream(N)), o : Out(stream(N))
        Data in and out (combinational path, delivered only while OK).
    ctl : In(TSVControlSignature)
        Host/test control and status.
    words : Out(32)
        Words delivered (for the TSV byte counter: words * N / 8 bytes).

    Raises
    ------
    ValueError
        For n_data < 1 or n_spare < 0.
    """

    def __init__(self, n_data: int, n_spare: int, walking: bool = True):
        if not isinstance(n_data, int) or n_data < 1:
            raise ValueError(f"n_data must be a positive int, not {n_data!r}")
        if not isinstance(n_spare, int) or n_spare < 0:
            raise ValueError(f"n_spare must be a non-negative int, not {n_spare!r}")
        self.n_data = n_data
        self.n_spare = n_spare
        self.walking = walking
        super().__init__({
            "i": In(stream.Signature(n_data)),
            "o": Out(stream.Signature(n_data)),
            "ctl": In(TSVControlSignature(n_data, n_spare)),
            "words": Out(32),
        })

    @classmethod
    def from_config(cls, config, walking: bool = True) -> "TSVLink":
        """A link sized by ``config.tsv_data_lanes`` and ``config.tsv_spare_lanes``."""
        return cls(config.tsv_data_lanes, config.tsv_spare_lanes, walking=walking)

    def bist_cycles(self) -> int:
        """Cycles from ``bist_start`` to the end of the self-test (upper bound)."""
        nl = self.n_data + self.n_spare
        return 2 + (2 * nl if self.walking else 0) + self.n_data + self.n_spare + 4

    def elaborate(self, platform):
        m = Module()
        N, S = self.n_data, self.n_spare
        NL = N + S
        ctl = self.ctl

        valid_s = [Signal(name=f"map{s}_valid") for s in range(S)]
        lane_s = [Signal(range(N), name=f"map{s}_lane") for s in range(S)]
        for s in range(S):
            m.d.comb += [ctl.repair_map[s].valid.eq(valid_s[s]), ctl.repair_map[s].lane.eq(lane_s[s])]

        trained = Signal()
        too_many = Signal()
        failed = Signal(NL)
        m.d.comb += ctl.failed_lanes.eq(failed)

        # ---------------- transmitter
        tx = Signal(NL)
        bist_on = Signal()
        pattern = Signal(NL)
        tx_data = Signal(N)
        m.d.comb += tx_data.eq(self.i.payload)
        spare_tx = []
        for s in range(S):
            v = Signal(name=f"spare_tx{s}")
            m.d.comb += v.eq(Mux(valid_s[s], tx_data.bit_select(lane_s[s], 1), 0))
            spare_tx.append(v)
        m.d.comb += tx.eq(Mux(bist_on, pattern, Cat(tx_data, *spare_tx)))

        # ---------------- physical lanes with injected faults
        rx = Signal(NL)
        m.d.comb += rx.eq((tx & ~ctl.fault_stuck0) | ctl.fault_stuck1)

        # ---------------- receiver
        rx_data = Signal(N)
        covered = Signal(N)
        # each map entry decoded to a one-hot lane vector: the receive mux and
        # the coverage check become N-bit vector operations
        onehot = [Signal(N, name=f"map{s}_onehot") for s in range(S)]
        any_hit = Const(0, N)
        from_spares = Const(0, N)
        cov = Const(0, N)
        spare_bad = Const(0, 1)
        for s in range(S):
            m.d.comb += onehot[s].eq(Mux(valid_s[s], Const(1, N) << lane_s[s], 0))
            any_hit = any_hit | onehot[s]
            from_spares = from_spares | (onehot[s] & rx[N + s].replicate(N))
            cov = cov | (onehot[s] & (~failed[N + s]).replicate(N))
            spare_bad = spare_bad | (valid_s[s] & failed[N + s])
        m.d.comb += [
            rx_data.eq((rx[:N] & ~any_hit) | from_spares),
            covered.eq(cov),
        ]
        uncovered = Signal()
        m.d.comb += uncovered.eq(((failed[:N] & ~covered) != 0) | spare_bad)

        with m.If(bist_on):
            m.d.comb += ctl.status.eq(LinkStatus.BIST)
        with m.Elif(~trained):
            m.d.comb += ctl.status.eq(LinkStatus.UNTRAINED)
        with m.Elif(too_many):
            m.d.comb += ctl.status.eq(LinkStatus.TOO_MANY)
        with m.Elif(uncovered):
            m.d.comb += ctl.status.eq(LinkStatus.UNCOVERED)
        with m.Else():
            m.d.comb += ctl.status.eq(LinkStatus.OK)
        m.d.comb += ctl.ok.eq(ctl.status == LinkStatus.OK)

        m.d.comb += [
            self.o.payload.eq(rx_data),
            self.o.valid.eq(self.i.valid & ctl.ok),
            self.i.ready.eq(self.o.ready & ctl.ok),
        ]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.words.eq(self.words + 1)

        # ---------------- BIST
        walk = Signal(NL)
        step = Signal(range(NL + 1))
        ai = Signal(range(N + 1))              # allocator: data lane
        asp = Signal(range(S + 1))             # allocator: spare
        with m.FSM(name="bist"):
            with m.State("IDLE"):
                with m.If(ctl.bist_start):
                    m.d.sync += [failed.eq(0), too_many.eq(0)]
                    m.d.sync += [v.eq(0) for v in valid_s]
                    m.next = "ZERO"
                with m.Elif(ctl.repair_we & (S > 0)):
                    for s in range(S):
                        with m.If(ctl.repair_idx == s):
                            m.d.sync += [valid_s[s].eq(ctl.repair_valid), lane_s[s].eq(ctl.repair_lane)]
            with m.State("ZERO"):
                m.d.comb += [bist_on.eq(1), pattern.eq(0)]
                m.d.sync += failed.eq(failed | rx)
                m.next = "ONE"
            with m.State("ONE"):
                m.d.comb += [bist_on.eq(1), pattern.eq(Const(-1, NL))]
                m.d.sync += failed.eq(failed | ~rx)
                m.d.sync += [walk.eq(1), step.eq(0)]
                m.next = "WALK1" if self.walking else "ALLOC"
                if not self.walking:
                    m.d.sync += [ai.eq(0), asp.eq(0)]
            if self.walking:
                with m.State("WALK1"):
                    m.d.comb += [bist_on.eq(1), pattern.eq(walk)]
                    m.d.sync += [failed.eq(failed | (rx ^ walk)), walk.eq(Cat(walk[-1], walk[:-1])),
                                 step.eq(step + 1)]
                    with m.If(step == NL - 1):
                        m.d.sync += [walk.eq(1), step.eq(0)]
                        m.next = "WALK0"
                with m.State("WALK0"):
                    m.d.comb += [bist_on.eq(1), pattern.eq(~walk)]
                    m.d.sync += [failed.eq(failed | (rx ^ ~walk)), walk.eq(Cat(walk[-1], walk[:-1])),
                                 step.eq(step + 1)]
                    with m.If(step == NL - 1):
                        m.d.sync += [ai.eq(0), asp.eq(0)]
                        m.next = "ALLOC"
            with m.State("ALLOC"):
                m.d.comb += bist_on.eq(1)
                fail_i = failed.bit_select(ai, 1)
                spare_ok = Signal()
                spare_failed = Signal()
                if S:
                    m.d.comb += spare_failed.eq(failed[N:].bit_select(asp, 1))
                m.d.comb += spare_ok.eq(asp < S)
                with m.If(ai == N):
                    m.d.sync += trained.eq(1)
                    m.next = "IDLE"
                with m.Elif(~fail_i):
                    m.d.sync += ai.eq(ai + 1)
                with m.Elif(~spare_ok):
                    m.d.sync += [too_many.eq(1), ai.eq(ai + 1)]
                with m.Elif(spare_failed):
                    m.d.sync += asp.eq(asp + 1)
                with m.Else():
                    for s in range(S):
                        with m.If(asp == s):
                            m.d.sync += [valid_s[s].eq(1), lane_s[s].eq(ai)]
                    m.d.sync += [asp.eq(asp + 1), ai.eq(ai + 1)]
        return m
