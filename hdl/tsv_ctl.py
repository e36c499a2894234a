"""The host's control of the two TSV links through CSRs: self-test starts,
repair-map writes and read-back, link status, and the test-only stuck-at
fault injection (``tsv_fault_rd`` / ``tsv_fault_wr``).

A fault register holds up to 16 consecutive faulty physical lanes
(``lanes`` shifted to ``base``; spares included) stuck at ``stuck``.  After
the host's self-test the repair map covers up to ``tsv_spare_lanes`` failed
data lanes (data still bit-exact, no cycle lost); with more, the link is not
OK and a started job is rejected with ``LINK_DOWN``.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .csr import RegisterMap
from .npu_map import tsv_map_regs
from .tsv import TSVControlSignature

__all__ = ["TSVControl"]

LINKS = ("rd", "wr")


class TSVControl(wiring.Component):
    """CSRs <-> the read and write TSV links.

    Ports
    -----
    ctl : In(tsv_ctl shape)            ``bist_rd`` / ``bist_wr`` / ``repair_we`` pulses.
    repair : In(tsv_repair shape)      the map entry ``repair_we`` writes.
    fault_rd, fault_wr : In(tsv_fault_* shape)
    rd, wr : Out(TSVControlSignature)  to the links.
    status : Out(tsv_status shape)
    rd_map, wr_map : Out(ArrayLayout(tsv_<link>_map shape, tsv_map_regs))
        the ``tsv_<link>_map<i>`` words (absent without spare lanes).
    ok : Out(1)                        both links are up.
    """

    def __init__(self, config: NPUConfig, regmap: RegisterMap):
        self.config = config
        self.regmap = regmap
        n, s = config.tsv_data_lanes, config.tsv_spare_lanes
        members = {"ctl": In(regmap["tsv_ctl"].shape), "repair": In(regmap["tsv_repair"].shape),
                   "status": Out(regmap["tsv_status"].shape), "ok": Out(1)}
        for link in LINKS:
            members[f"fault_{link}"] = In(regmap[f"tsv_fault_{link}"].shape)
            members[link] = Out(TSVControlSignature(n, s))
            if tsv_map_regs(config):
                members[f"{link}_map"] = Out(data.ArrayLayout(regmap[f"tsv_{link}_map0"].shape,
                                                              tsv_map_regs(config)))
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        cfg = self.config
        S = cfg.tsv_spare_lanes
        nl = cfg.tsv_data_lanes + cfg.tsv_spare_lanes
        for i, name in enumerate(LINKS):
            link = getattr(self, name)
            m.d.comb += [link.bist_start.eq((self.ctl.bist_rd, self.ctl.bist_wr)[i]),
                         link.repair_we.eq(self.ctl.repair_we & (self.repair.link == i)),
                         link.repair_idx.eq(self.repair.idx), link.repair_lane.eq(self.repair.lane),
                         link.repair_valid.eq(self.repair.valid)]
            for k in range(tsv_map_regs(cfg)):
                word = getattr(self, f"{name}_map")[k]
                for e, (lane, valid) in enumerate(((word.e0_lane, word.e0_valid), (word.e1_lane, word.e1_valid))):
                    if 2 * k + e < S:            # the last word's second entry may be past the spares
                        ent = link.repair_map[2 * k + e]
                        m.d.comb += [lane.eq(ent.lane), valid.eq(ent.valid)]
            # test-only stuck-at faults: ``lanes`` shifted to ``base``, stuck at ``stuck``
            fr = getattr(self, f"fault_{name}")
            lanes = Signal(nl, name=f"tsv_fault_{name}_lanes")
            m.d.comb += [lanes.eq(fr.lanes << fr.base),
                         link.fault_stuck0.eq(Mux(fr.stuck, 0, lanes)),
                         link.fault_stuck1.eq(Mux(fr.stuck, lanes, 0))]
        m.d.comb += [self.status.rd_status.eq(self.rd.status), self.status.wr_status.eq(self.wr.status),
                     self.status.rd_ok.eq(self.rd.ok), self.status.wr_ok.eq(self.wr.ok),
                     self.ok.eq(self.rd.ok & self.wr.ok)]
        return m
