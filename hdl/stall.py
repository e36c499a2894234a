"""Test-only backpressure: random stalls on the NPU's SRAM ports.

The host sets ``stall.rate`` (0 = off) and ``stall.seed``; every cycle of a
job, each of the ``n`` ports is refused its SRAM grant with probability
``rate / 16``, from a 32-bit maximal-length Galois LFSR (taps 32, 22, 2, 1;
Xilinx XAPP052) loaded with the seed when the job starts, so a stall
pattern is reproducible from its seed.  The SRAM counts a stalled request as
a conflict cycle; the data path must give the same result as without stalls,
only later.
"""

from __future__ import annotations

from amaranth import Cat, Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .csr import RegisterMap

__all__ = ["StallInjector", "LFSR_TAPS"]

#: feedback mask of the 32-bit Galois LFSR (x^32 + x^22 + x^2 + x + 1)
LFSR_TAPS = 0x80200003
#: bits of the LFSR compared with ``rate`` per port
RATE_BITS = 4


class StallInjector(wiring.Component):
    """Random per-port stall bits.

    Parameters
    ----------
    n : int
        Ports (at most ``32 // RATE_BITS``).
    regmap : RegisterMap
        The NPU's map: ``ctl`` takes the shape of its ``stall`` register.

    Ports
    -----
    ctl : In(stall shape)   ``rate`` (stall probability rate / 16), ``seed``.
    start : In(1)           a job starts: the LFSR loads ``seed`` (never 0).
    run : In(1)             the job runs: the LFSR steps and stalls are given.
    stall : Out(n)
    """

    def __init__(self, n: int, regmap: RegisterMap):
        if not 1 <= n <= 32 // RATE_BITS:
            raise ValueError(f"n must be 1..{32 // RATE_BITS}, not {n!r}")
        self.n = n
        super().__init__({"ctl": In(regmap["stall"].shape), "start": In(1), "run": In(1), "stall": Out(n)})

    def elaborate(self, platform):
        m = Module()
        lfsr = Signal(32, init=1)
        with m.If(self.start):
            m.d.sync += lfsr.eq(Cat(self.ctl.seed, 1))          # bit 16 set: never the all-zero state
        with m.Elif(self.run):
            m.d.sync += lfsr.eq((lfsr >> 1) ^ (lfsr[0].replicate(32) & LFSR_TAPS))
        rate = self.ctl.rate
        m.d.comb += self.stall.eq(Cat(*[self.run & (rate != 0) & (lfsr[RATE_BITS * p:RATE_BITS * (p + 1)] < rate)
                                        for p in range(self.n)]))
        return m
