"""The host's control of the channels' TSV bundles through CSRs: self-test
starts, repair-map writes and read-back, link status, and the test-only
stuck-at fault injection (``tsv_fault_rd`` / ``tsv_fault_wr`` on the channels
of ``tsv_fault_channels``).

Every DRAM channel has its own read and write bundle (``MemorySystem``).
``tsv_ctl`` starts the self-test of every channel's bundles at once;
``tsv_repair`` writes one map entry of one channel; ``tsv_sel`` picks the
channel whose status and repair maps the host reads; ``tsv_status`` also says
whether every link is OK, and ``tsv_fail`` which channels' links are not.

A fault register holds up to 16 consecutive faulty physical lanes
(``lanes`` shifted to ``base``; spares included) stuck at ``stuck``.  After
the host's self-test each bundle's repair map covers up to
``tsv_spare_lanes`` failed data lanes (data still bit-exact, no cycle lost);
with more in any bundle, the links are not OK and a started job is rejected
with ``LINK_DOWN``.
"""

from __future__ import annotations

from amaranth import Array, Cat, Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from flashnpu.config import NPUConfig

from .csr import RegisterMap
from .npu_map import tsv_map_regs
from .tsv import TSVControlSignature

__all__ = ["TSVControl"]

LINKS = ("rd", "wr")


class TSVControl(wiring.Component):
    """CSRs <-> the read and write TSV links of every channel.

    Ports
    -----
    ctl : In(tsv_ctl shape)            ``bist_rd`` / ``bist_wr`` / ``repair_we`` pulses.
    repair : In(tsv_repair shape)      the map entry ``repair_we`` writes.
    sel : In(tsv_sel shape)            the channel read back.
    fault_rd, fault_wr : In(tsv_fault_* shape); fault_channels : In(tsv_fault_channels shape)
    rd[c], wr[c] : Out(TSVControlSignature)  to channel c's links.
    status : Out(tsv_status shape); fail : Out(tsv_fail shape)
    rd_map, wr_map : Out(ArrayLayout(tsv_<link>_map shape, tsv_map_regs))
        the ``tsv_<link>_map<i>`` words of channel ``sel`` (absent without spare lanes).
    ok : Out(1)                        every link is up.
    """

    def __init__(self, config: NPUConfig, regmap: RegisterMap):
        self.config = config
        self.regmap = regmap
        n, s = config.tsv_data_lanes, config.tsv_spare_lanes
        C = config.dram_channels
        members = {"ctl": In(regmap["tsv_ctl"].shape), "repair": In(regmap["tsv_repair"].shape),
                   "sel": In(regmap["tsv_sel"].shape), "fault_channels": In(regmap["tsv_fault_channels"].shape),
                   "status": Out(regmap["tsv_status"].shape), "fail": Out(regmap["tsv_fail"].shape),
                   "ok": Out(1)}
        for link in LINKS:
            members[f"fault_{link}"] = In(regmap[f"tsv_fault_{link}"].shape)
            members[link] = Out(TSVControlSignature(n, s)).array(C)
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
            links = getattr(self, name)
            # test-only stuck-at faults: ``lanes`` shifted to ``base``, stuck at ``stuck``
            fr = getattr(self, f"fault_{name}")
            lanes = Signal(nl, name=f"tsv_fault_{name}_lanes")
            m.d.comb += lanes.eq(fr.lanes << fr.base)
            for c, link in enumerate(links):
                hit = Mux(self.fault_channels.mask[c], lanes, 0)
                m.d.comb += [link.bist_start.eq((self.ctl.bist_rd, self.ctl.bist_wr)[i]),
                             link.repair_we.eq(self.ctl.repair_we & (self.repair.link == i)
                                               & (self.repair.channel == c)),
                             link.repair_idx.eq(self.repair.idx), link.repair_lane.eq(self.repair.lane),
                             link.repair_valid.eq(self.repair.valid),
                             link.fault_stuck0.eq(Mux(fr.stuck, 0, hit)),
                             link.fault_stuck1.eq(Mux(fr.stuck, hit, 0))]
                with m.If(self.sel.channel == c):
                    for k in range(tsv_map_regs(cfg)):
                        word = getattr(self, f"{name}_map")[k]
                        for e, (lane, valid) in enumerate(((word.e0_lane, word.e0_valid),
                                                           (word.e1_lane, word.e1_valid))):
                            if 2 * k + e < S:        # the last word's second entry may be past the spares
                                ent = link.repair_map[2 * k + e]
                                m.d.comb += [lane.eq(ent.lane), valid.eq(ent.valid)]
            sel_status = Array(link.status for link in links)[self.sel.channel]
            m.d.comb += getattr(self.status, f"{name}_status").eq(sel_status)
            fail = Cat(*(~link.ok for link in links))
            m.d.comb += [getattr(self.fail, name).eq(fail), getattr(self.status, f"{name}_ok").eq(~fail.any())]
        m.d.comb += self.ok.eq(self.status.rd_ok & self.status.wr_ok)
        return m
