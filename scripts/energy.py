"""Energy model: per-access and per-op energies, each with its source.

Energy of a job = Σ (counter × energy per unit) over the memory levels and the
arithmetic ops that the performance counters (or the analytical model in
``flashnpu.scripts.perf_model``) report::

    counters ──► bytes per level ──× pJ/bit ──┐
                 (reg, SRAM, TSV, DRAM,        ├──► EnergyBreakdown (pJ per term)
                  off-chip DRAM)               │
    op detail ─► MAC, FP32 mul/add, exp2, ──× pJ/op
                 reciprocal

Where the figures come from
---------------------------
Every figure below is a *dynamic* energy at the 45 nm node unless stated; the
memory-level figures come from different technologies and are mixed on
purpose, as the public literature offers them (ASSUMPTION: they are
comparable to within the factor of about two that separates 45 nm logic from a
modern DRAM stack).  Leakage and clock-tree energy are excluded by default
(``leakage_pj_per_cycle = 0``, ASSUMPTION), so a design that takes more
cycles is not charged for them; ``flashnpu bench`` prices them as a fraction
of the register-level design's dynamic power (``LEAKAGE_FRACTIONS``) and
shows how the comparison moves.

=======================  =============  =====================================
item                     default        source
=======================  =============  =====================================
FP16 multiply            1.1 pJ/op      Horowitz, "Computing's energy problem
                                        (and what we can do about it)",
                                        ISSCC 2014, 45 nm: 16-bit FP mult
FP32 add                 0.9 pJ/op      Horowitz ISSCC 2014: 32-bit FP add
FP32 multiply            3.7 pJ/op      Horowitz ISSCC 2014: 32-bit FP mult
SRAM, 64-bit read        10 / 20 / 100  Horowitz ISSCC 2014: 8 KB, 32 KB,
                         pJ             1 MB cache; other sizes interpolated
                                        on log-log axes (``sram_pj_per_64b``)
register file (64 x 32)  0.028 pJ/bit   ASSUMPTION: Horowitz's 8 KB point
                                        extrapolated down to 256 B along the
                                        sqrt(size) slope of his 8 KB -> 32 KB
                                        points: 1.77 pJ per 64 bit.  Cross-
                                        check: Eyeriss (Chen et al., ISCA
                                        2016) puts a register-file access at
                                        about 1x a MAC, and 32 bits here cost
                                        0.89 pJ ~ one FP32 add.
stacked SRAM             per bank size  the SRAM curve at the bank size
                                        (sram_bytes / sram_banks = 256 KB:
                                        0.82 pJ/bit)
stacked DRAM             3.9 pJ/bit     O'Connor et al., "Fine-Grained DRAM:
                                        Energy-Efficient DRAM for Extreme
                                        Bandwidth Systems", MICRO 2017: HBM2
                                        access energy ~3.9 pJ/bit
TSV (die-to-die)         0.05 pJ/bit    ASSUMPTION (no good public figure):
                                        C*V^2 with C ~ 50 fF per TSV incl.
                                        driver and V = 1 V; swept 0.01..1
                                        pJ/bit by ``flashnpu bench``
off-chip DRAM            20.3 pJ/bit    Horowitz ISSCC 2014: DRAM 1.3-2.6 nJ
                                        per 64 bit; the low end (1.3 nJ / 64),
                                        which is the conservative end for a
                                        design that avoids DRAM traffic
exp2 (FP32)              13.8 pJ/op     ASSUMPTION: range reduction plus a
                                        degree-3 polynomial = 3 FP32 mul + 3
                                        FP32 add (Horowitz figures)
reciprocal (FP32)        16.6 pJ/op     ASSUMPTION: seed table plus two
                                        Newton-Raphson steps = 4 FP32 mul + 2
                                        FP32 add (Horowitz figures)
compare / subtract       0.9 pJ/op      ASSUMPTION: priced as an FP32 add
array operand movement   0.028 pJ/bit   ASSUMPTION: one PE hop of an FP16
                         per PE hop     operand (K/V down a column, Q/P along
                                        a row) costs a register access
=======================  =============  =====================================

Other ASSUMPTIONs: a write costs what a read costs at every level (Horowitz
gives reads); operand movement inside the array (``operand``) is charged per
PE hop at the register figure.  The SRAM die's crossing to the logic die is
not charged by default: the RTL models the SRAM's ports with no link between
them and the logic (no bandwidth limit, no spares beyond the banks'), so the
energy model does not invent one; ``sram_crosses_tsv=True`` charges every
SRAM byte one TSV crossing for a sensitivity sweep.  The TSV term charges
the DRAM channels' bundles, which the RTL does model (``tsv_bytes``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from flashnpu.config import DEFAULT, NPUConfig

__all__ = ["HOROWITZ_SRAM_64B", "sram_pj_per_64b", "sram_pj_per_bit", "EnergyTable",
           "EnergyBreakdown", "energy_of", "SOURCES", "MemoryClass", "MEMORY_CLASSES",
           "LEAKAGE_FRACTIONS"]

# (capacity in bytes, pJ per 64-bit read): Horowitz, ISSCC 2014, 45 nm.
HOROWITZ_SRAM_64B = ((8 * 1024, 10.0), (32 * 1024, 20.0), (1024 * 1024, 100.0))

#: Register-file capacity the per-PE figure is taken at: 64 x 32 bit = 256 bytes.
REGISTER_FILE_BYTES = 64 * 4

SOURCES = {
    "fp16_mul_pj": "Horowitz, ISSCC 2014, 45 nm: 16-bit FP mult 1.1 pJ",
    "fp32_add_pj": "Horowitz, ISSCC 2014, 45 nm: 32-bit FP add 0.9 pJ",
    "fp32_mul_pj": "Horowitz, ISSCC 2014, 45 nm: 32-bit FP mult 3.7 pJ",
    "exp2_pj": "ASSUMPTION: 3 FP32 mul + 3 FP32 add (Horowitz figures)",
    "recip_pj": "ASSUMPTION: 4 FP32 mul + 2 FP32 add (Horowitz figures)",
    "cmp_pj": "ASSUMPTION: priced as one FP32 add (Horowitz)",
    "operand_pj_per_bit": "ASSUMPTION: one PE hop of an operand bit = one register-file bit access",
    "reg_pj_per_bit": "ASSUMPTION: Horowitz 8 KB SRAM point extrapolated to 256 B along sqrt(size)",
    "sram_pj_per_bit": "Horowitz, ISSCC 2014: 8 KB 10 pJ, 32 KB 20 pJ, 1 MB 100 pJ per 64 bit, "
                       "log-log interpolated at the bank size",
    "dram_pj_per_bit": "O'Connor et al., MICRO 2017 (Fine-Grained DRAM): HBM2 ~3.9 pJ/bit",
    "tsv_pj_per_bit": "ASSUMPTION: C*V^2, C ~ 50 fF, V = 1 V (swept in the report)",
    "offchip_pj_per_bit": "Horowitz, ISSCC 2014: DRAM 1.3-2.6 nJ per 64 bit, low end",
    "leakage_pj_per_cycle": "ASSUMPTION: excluded (0); the report sweeps LEAKAGE_FRACTIONS",
}


@dataclass(frozen=True)
class MemoryClass:
    """A DRAM an S/P spill could go to: its energy paired with its bandwidth.

    Attributes
    ----------
    name : str
    pj_per_bit : float
        Access energy, pJ per bit (device plus interface).
    gb_per_s : float
        Peak bandwidth of the interface, GB/s (1e9 bytes per second).
    source : str
        Where both figures come from.
    """

    name: str
    pj_per_bit: float
    gb_per_s: float
    source: str

    def bytes_per_cycle(self, clock_hz: float) -> float:
        """Bandwidth in bytes per NPU cycle at ``clock_hz``."""
        return self.gb_per_s * 1e9 / clock_hz


#: From HBM-class to off-chip DRAM, each energy with the bandwidth of the same
#: part, for the spill baseline's sweep in ``flashnpu bench``.
MEMORY_CLASSES = (
    MemoryClass("HBM2 stack", 3.9, 256.0,
                "O'Connor et al., MICRO 2017: HBM2 ~3.9 pJ/bit; JESD235: 1024 bits x 2 Gb/s"),
    MemoryClass("HBM2E stack", 6.0, 410.0,
                "Micron, ultra-bandwidth solutions table: HBM2E 6.0 pJ/bit average device power, "
                "410 GB/s per placement (JESD235C: 1024 bits x 3.2 Gb/s)"),
    MemoryClass("GDDR6 device", 7.5, 56.0,
                "Micron, ultra-bandwidth solutions table: GDDR6 7.5 pJ/bit, x32 at 14 Gb/s = 56 GB/s"),
    MemoryClass("GDDR5 device", 1e12 / (10.5e9 * 8), 28.0,
                "AMD HBM introduction (2015): GDDR5 10.5 GB/s per W (11.9 pJ/bit), x32 at 7 Gb/s = 28 GB/s"),
    MemoryClass("DDR3-1600 channel", 1300.0 / 64.0, 12.8,
                "Horowitz, ISSCC 2014: DRAM 1.3 nJ per 64 bit; JESD79-3: DDR3-1600 x64 = 12.8 GB/s"),
)

#: Leakage (and clock tree) priced as these fractions of the register-level
#: design's dynamic power on the same job.  ASSUMPTION: there is no public
#: figure for this design, so the sweep shows how far the comparison moves.
LEAKAGE_FRACTIONS = (0.0, 0.1, 0.3)


def sram_pj_per_64b(capacity_bytes: float) -> float:
    """Energy of one 64-bit SRAM read for an array of ``capacity_bytes``.

    Piecewise-linear on log-log axes through Horowitz's three points (8 KB,
    32 KB, 1 MB); outside them the nearest segment's slope is extended
    (ASSUMPTION: below 8 KB the sqrt(size) slope of the 8 KB -> 32 KB segment,
    above 1 MB the slope of the 32 KB -> 1 MB segment, 0.46).

    Parameters
    ----------
    capacity_bytes : float
        Capacity of the array that one access activates (bytes), > 0.

    Returns
    -------
    float
        pJ per 64-bit access.
    """
    if not capacity_bytes > 0:
        raise ValueError(f"SRAM capacity must be positive, not {capacity_bytes!r}")
    pts = HOROWITZ_SRAM_64B
    x = math.log(capacity_bytes)
    if capacity_bytes <= pts[1][0]:
        (c0, e0), (c1, e1) = pts[0], pts[1]
    else:
        (c0, e0), (c1, e1) = pts[1], pts[2]
    slope = (math.log(e1) - math.log(e0)) / (math.log(c1) - math.log(c0))
    return math.exp(math.log(e0) + slope * (x - math.log(c0)))


def sram_pj_per_bit(capacity_bytes: float) -> float:
    """pJ per bit of an SRAM access (``sram_pj_per_64b / 64``)."""
    return sram_pj_per_64b(capacity_bytes) / 64.0


_REG_PJ_PER_BIT = sram_pj_per_bit(REGISTER_FILE_BYTES)
_SRAM_PJ_PER_BIT = sram_pj_per_bit(DEFAULT.sram_bytes // DEFAULT.sram_banks)


@dataclass(frozen=True)
class EnergyTable:
    """Energies per bit (memory levels) and per op (arithmetic), in pJ.

    Build it with ``EnergyTable.for_config(config)`` so the SRAM figure follows
    the configured bank size; override any field with keyword arguments.
    ``SOURCES`` names the source of each default.

    Attributes
    ----------
    reg_pj_per_bit, sram_pj_per_bit, tsv_pj_per_bit, dram_pj_per_bit, offchip_pj_per_bit : float
        pJ per bit moved at the register file, the stacked SRAM (one bank),
        one die-to-die TSV crossing, the stacked DRAM and off-chip DRAM.
    fp16_mul_pj, fp32_add_pj, fp32_mul_pj, exp2_pj, recip_pj, cmp_pj : float
        pJ per operation.
    operand_pj_per_bit : float
        pJ per bit per PE hop of an operand moving across the array.
    sram_crosses_tsv : bool
        Charge every SRAM byte one TSV crossing as well (default False: the
        RTL has no link between SRAM and logic, see the module docstring).
    leakage_pj_per_cycle : float
        Static (leakage and clock-tree) energy per NPU cycle, pJ; charged on
        ``total_cycles``.  Default 0: excluded (ASSUMPTION).
    """

    reg_pj_per_bit: float = _REG_PJ_PER_BIT
    sram_pj_per_bit: float = _SRAM_PJ_PER_BIT
    tsv_pj_per_bit: float = 0.05
    dram_pj_per_bit: float = 3.9
    offchip_pj_per_bit: float = 1300.0 / 64.0
    fp16_mul_pj: float = 1.1
    fp32_add_pj: float = 0.9
    fp32_mul_pj: float = 3.7
    exp2_pj: float = 3 * 3.7 + 3 * 0.9
    recip_pj: float = 4 * 3.7 + 2 * 0.9
    cmp_pj: float = 0.9
    operand_pj_per_bit: float = _REG_PJ_PER_BIT
    sram_crosses_tsv: bool = False
    leakage_pj_per_cycle: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "sram_crosses_tsv":
                if not isinstance(v, bool):
                    raise ValueError(f"sram_crosses_tsv must be a bool, not {v!r}")
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, not {v!r}")

    @classmethod
    def for_config(cls, config: NPUConfig = DEFAULT, **overrides) -> "EnergyTable":
        """The default table with the SRAM figure taken at ``config``'s bank size."""
        base = dict(sram_pj_per_bit=sram_pj_per_bit(config.sram_bytes / config.sram_banks))
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "EnergyTable":
        return dataclasses.replace(self, **changes)

    @property
    def mac_pj(self) -> float:
        """One FP16 x FP16 -> FP32 MAC: an FP16 multiply plus an FP32 add (pJ)."""
        return self.fp16_mul_pj + self.fp32_add_pj


#: Order of the terms in an ``EnergyBreakdown`` (plots stack them in this order).
TERMS = ("mac", "softmax_ops", "register", "operand", "sram", "sram_tsv", "tsv", "dram", "offchip", "leakage")


@dataclass
class EnergyBreakdown:
    """Energy of one job per term, in pJ.

    Terms: ``mac`` (FP16 mul + FP32 add per MAC), ``softmax_ops`` (FP32 mul,
    add/compare, exp2, reciprocal outside the MACs), ``register``,
    ``operand`` (operand movement across the array), ``sram``,
    ``sram_tsv`` (die crossing of SRAM traffic), ``tsv`` (DRAM <-> logic
    crossings), ``dram`` (stacked), ``offchip`` (off-chip DRAM),
    ``leakage`` (static energy over the job's cycles).
    """

    terms: dict = field(default_factory=dict)

    @property
    def total_pj(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def total_j(self) -> float:
        return self.total_pj * 1e-12

    def __getitem__(self, k):
        return self.terms[k]

    def as_dict(self) -> dict:
        return dict(self.terms, total=self.total_pj)


def energy_of(counters, ops, table: EnergyTable | None = None) -> EnergyBreakdown:
    """Energy = counters x energies, per level and per op kind.

    Parameters
    ----------
    counters : perf_model.Counters (or any object with the same attributes)
        ``reg_bytes``, ``sram_bytes``, ``tsv_bytes``, ``dram_bytes``,
        ``offchip_bytes`` (bytes) and ``mac_ops``, ``exp2_ops``,
        ``recip_ops`` (ops); ``mac_masked`` (optional): MAC slots skipped at
        masked positions, not charged (only the MACs that ran cost energy);
        ``total_cycles`` (cycles), read only when the table charges leakage.
    ops : perf_model.OpDetail (or any object with ``fp32_mul``, ``fp32_add``
        and ``operand_bytes``)
        FP32 multiplies and adds/compares/subtracts outside the MACs (ops);
        operand bytes x PE hops inside the array; ``reg_extra_bytes``
        (optional): register-file bytes beyond the RTL's ``reg_bytes``
        counter, added to the register term.
    table : EnergyTable, optional
        Default ``EnergyTable.for_config()``.

    Returns
    -------
    EnergyBreakdown
        pJ per term.
    """
    t = table if table is not None else EnergyTable.for_config()
    c = counters
    sram_bits = 8 * c.sram_bytes
    terms = {
        "mac": (c.mac_ops - getattr(c, "mac_masked", 0)) * t.mac_pj,
        "softmax_ops": (ops.fp32_mul * t.fp32_mul_pj + ops.fp32_add * t.cmp_pj
                        + c.exp2_ops * t.exp2_pj + c.recip_ops * t.recip_pj),
        "register": 8 * (c.reg_bytes + getattr(ops, "reg_extra_bytes", 0)) * t.reg_pj_per_bit,
        "operand": 8 * getattr(ops, "operand_bytes", 0) * t.operand_pj_per_bit,
        "sram": sram_bits * t.sram_pj_per_bit,
        "sram_tsv": sram_bits * t.tsv_pj_per_bit if t.sram_crosses_tsv else 0.0,
        "tsv": 8 * c.tsv_bytes * t.tsv_pj_per_bit,
        "dram": 8 * c.dram_bytes * t.dram_pj_per_bit,
        "offchip": 8 * getattr(c, "offchip_bytes", 0) * t.offchip_pj_per_bit,
        "leakage": c.total_cycles * t.leakage_pj_per_cycle if t.leakage_pj_per_cycle else 0.0,
    }
    return EnergyBreakdown({k: float(terms[k]) for k in TERMS})
