"""Static scheduler of the core's micro-programs on the pipelined PE.

Design trade-off
----------------
The PE issues one control word per cycle and has no interlocks: every op
reads and writes the register file, the temporaries T and U and its
pipelined units in fixed stages after it arrives (``pe.OP_TIMING``).  The
INIT, softmax and FINAL programs are therefore scheduled here, once, when
the core is built: ops are placed in program order, each in the earliest
cycle ("slot") that respects

* read-after-write, write-after-read and write-after-write on every
  register, on T and on U, with the register file's transparent reads;
* one op per slot, one register-file write per cycle, one entry per cycle
  into each pipelined unit;
* the row tree and the reciprocals: an injection reads T in its own slot,
  its result can be read ``RowReduce.LATENCY`` (``Recip.LATENCY``) + 1
  slots later; the row has one divider per query row (return tag), and a
  division runs alone on its divider (a new start with the same tag
  abandons it);
* the S pause point: its slot comes after all earlier activity and before
  every later op, so a pause cannot reorder anything;
* entry: the MACs of the phase before may still write any register in
  slots 0..``MAC write stage - 1``;
* exit: the program ends when all its activity has ended, so the phase
  after it may issue anything.

An op may land before ops that come earlier in the program (list
scheduling); empty slots become NOP words.  Hardware interlocks would do
the same at run time with a scoreboard in every PE; a static schedule keeps
the PE free of them, and the core's register check (``Core``) verifies in
every simulation that no read ever meets a pending write.  The run-time
return-register wait stays as a guard and never stalls a scheduled program
(``tb/unit/test_array.py::test_programs_are_complete_and_never_wait``).
"""

from __future__ import annotations

from .pe import OP_TIMING, RF_READ_STAGE, PeOp, TreeOp

__all__ = ["Op", "Inject", "schedule", "mac_slots", "ENTRY_WRITES"]

#: Slots 0..ENTRY_WRITES-1 may still see register-file writes of the MACs
#: issued before the program (the MAC writes in stage 5).
ENTRY_WRITES = OP_TIMING[PeOp.MAC].write


class Op:
    """An op of a micro-program: the ROM word's PE fields plus ``a``/``b``
    (SCALE's visibility indices) and ``wait`` (reads a return register)."""

    def __init__(self, op, ra=0, rb=0, wa=0, first=0, ret_sel=0, a=0, b=0):
        self.op, self.ra, self.rb, self.wa, self.first = PeOp(op), ra, rb, wa, first
        self.ret_sel, self.a, self.b = ret_sel, a, b

    def reads(self):
        """Registers read through ports A and B."""
        use = {PeOp.MAC: (not self.first, False), PeOp.SCALE: (True, False),
               PeOp.MALPHA: (True, False), PeOp.PEXP: (True, False),
               PeOp.LADD: (True, False), PeOp.RESC: (True, True), PeOp.LOADT: (True, False),
               PeOp.FINAL: (True, True)}.get(self.op, (False, False))
        return [r for r, u in zip((self.ra, self.rb), use) if u]


class Inject:
    """A row-tree (``tree`` MAX/SUM) or reciprocal (``rcp``) start with its
    return tag; ``pause`` marks the S pause point."""

    def __init__(self, tag, tree=TreeOp.NONE, rcp=0, pause=0):
        self.tag, self.tree, self.rcp, self.pause = tag, TreeOp(tree), rcp, pause


def schedule(items, tree_latency: int, recip_latency: int, arrived=()) -> list:
    """Place ``items`` (``Op`` and ``Inject``, in program order) into slots.

    Parameters
    ----------
    items : list of Op / Inject
    tree_latency, recip_latency : int
        Cycles from an injection (its slot) to the result's arrival in the
        row's return registers (``RowReduce.LATENCY``, ``Recip.LATENCY``).
    arrived : iterable of int
        Return tags injected before the program (by the program before
        it) and assumed to have arrived by its first slot; should one be
        late at run time, the reading word waits for it (``Core``).

    Returns
    -------
    list of dict
        One ROM word per slot (``core.rom_layout`` fields), NOP words in
        the empty slots, ``last`` on the final one.

    Raises
    ------
    ValueError
        If an op reads a return tag that no earlier item injects.
    """
    ops, injs = {}, {}
    rf_w, rf_r = {}, {}                # register -> cycles of writes / read addresses
    res = {"T": ([], []), "U": ([], [])}   # (writes, reads) of the temporaries
    busy = {"write": set(range(ENTRY_WRITES))}
    ready, active, min_slot = {tag: 0 for tag in arrived}, [ENTRY_WRITES - 1], 0
    rcp_free = {}                      # tag -> first slot its divider is free
    entry_write = ENTRY_WRITES - 1     # any register may be written up to here

    def free(name, cycle):
        return cycle not in busy.setdefault(name, set())

    for it in items:
        if isinstance(it, Inject):
            c = max(min_slot, max(res["T"][0], default=-1) + 1)
            if it.pause:
                c = max(c, max(active) + 1)
            if it.rcp:
                c = max(c, rcp_free.get(it.tag, 0))
            while c in injs:
                c += 1
            injs[c] = it
            res["T"][1].append(c)
            lat = recip_latency if it.rcp else tree_latency
            ready[it.tag] = c + lat + 1
            if it.rcp:
                rcp_free[it.tag] = c + recip_latency
            active.append(c)
            if it.pause:
                min_slot = c + 1
            continue
        t = OP_TIMING[it.op]
        reads = it.reads()
        c = min_slot
        if reads:
            c = max(c, entry_write - RF_READ_STAGE)
        if t.ret:
            if it.ret_sel not in ready:
                raise ValueError(f"{it.op.name} reads return tag {it.ret_sel} that nothing injects")
            c = max(c, ready[it.ret_sel])
        t_reads = () if it.first else t.t_read

        def ok(c):
            if c in ops:
                return False
            ra = c + RF_READ_STAGE
            if any(w > ra for r in reads for w in rf_w.get(r, ())):
                return False
            if t.write is not None:
                w = c + t.write
                if w <= entry_write or not free("write", w):
                    return False
                if any(x >= w for x in rf_w.get(it.wa, []) + rf_r.get(it.wa, [])):
                    return False
            for name, rd, wr in (("T", t_reads, t.t_write), ("U", t.u_read, t.u_write)):
                writes, rds = res[name]
                if any(c + s <= x for s in rd for x in writes):
                    return False
                if wr is not None and any(c + wr <= x for x in writes) or \
                        wr is not None and any(c + wr < x for x in rds):
                    return False
            return all(free(u, c + s) for u, s in t.units.items())

        while not ok(c):
            c += 1
        ops[c] = it
        for r in reads:
            rf_r.setdefault(r, []).append(c + RF_READ_STAGE)
        if t.write is not None:
            rf_w.setdefault(it.wa, []).append(c + t.write)
            busy["write"].add(c + t.write)
        for name, rd, wr in (("T", t_reads, t.t_write), ("U", t.u_read, t.u_write)):
            res[name][1].extend(c + s for s in rd)
            if wr is not None:
                res[name][0].append(c + wr)
        for u, s in t.units.items():
            busy[u].add(c + s)
        active.append(c + t.last_stage(bool(it.first)))

    length = max(active + list(ops) + list(injs)) + 1
    words = []
    for c in range(length):
        o = ops.get(c, Op(PeOp.NOP))
        j = injs.get(c)
        words.append(dict(
            ctl=dict(op=o.op, ra=o.ra, rb=o.rb, wa=o.wa, first=o.first, skipz=0, pv=0,
                     ret_sel=o.ret_sel, tree=j.tree if j else TreeOp.NONE, tag=j.tag if j else 0,
                     rcp=j.rcp if j else 0),
            a=o.a, b=o.b, wait=int(OP_TIMING[o.op].ret), pause=j.pause if j else 0, mac_ok=0,
            last=0))
    words[-1]["last"] = 1
    return words


def mac_slots(words) -> list:
    """Slots of a scheduled program where a MAC of another loop may issue
    instead of the NOP: the slot's op is a NOP (a row-tree or reciprocal
    start may ride on it), no op of the program writes the register file in
    the MAC's write stage, and none enters the MAC unit in that cycle (PEXP's
    row-sum fold).  The MAC must touch only registers the program does not
    (the core's second S block).  Returns one bool per word."""
    mac = OP_TIMING[PeOp.MAC]
    writes, units = set(), set()
    for c, w in enumerate(words):
        t = OP_TIMING[PeOp(w["ctl"]["op"])]
        if t.write is not None:
            writes.add(c + t.write)
        if "mac" in t.units:
            units.add(c + t.units["mac"])
    return [PeOp(w["ctl"]["op"]) == PeOp.NOP and c + mac.write not in writes and c not in units
            for c, w in enumerate(words)]
