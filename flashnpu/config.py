"""The one configuration object shared by the RTL, the golden model, the
testbenches, the driver and the performance model.

It imports neither amaranth nor cocotb, so every layer can use it.  It reaches
cocotb testbenches as JSON in the runner's environment (``FLASHNPU_CONFIG``),
because Amaranth's Verilog has no parameters.

Defaults and where they come from
---------------------------------
=====================  ==========  =============================================
field                  default     source / status
=====================  ==========  =============================================
array_rows/cols        32 x 32     design point of this project
pe_registers           64          design point (64 x 32-bit register file)
br, bc                 64, 64      FlashAttention-2 tile sizes (Dao, 2023) that
                                   give each PE a 2 x 2 block of the score tile
max_head_dim           128         largest head_dim of common LLMs
clock_hz               1.5 GHz     design point (assumption)
sram_bytes             4 MiB       design point
sram_banks             16          assumption
sram_bank_bytes        32          assumption: 256-bit bank port
dram_dies              8           HBM-class stack height (JEDEC JESD235, 8-high)
dram_channels          8           assumption: one pseudo-channel group per die
dram_channel_bytes     32          bytes per NPU cycle per channel (assumption:
                                   8 x 32 B x 1.5 GHz = 384 GB/s, the order of one
                                   HBM2E stack, 410 GB/s per JESD235C)
dram_latency_cycles    64          assumption: column command to data, ~43 ns at
                                   1.5 GHz (CL 14 ns + controller, PHY and TSV
                                   return path); row opening is timed apart
dram_banks             16          HBM2 8Gb, 4 bank groups x 4 banks per channel
                                   (DRAMsim3 configs/HBM2_8Gb_x128.ini)
dram_row_bytes         1024        page of one channel: 64 columns x 128 bit
                                   (same source)
dram_t*_ns             see below   HBM2 8Gb timing of the same source (tCK 1 ns):
                                   tRCD 14, tRP 14, tRAS 34, tRRD_L 6, tFAW 30,
                                   tREFI 3900, tRFC 260 ns; converted to NPU
                                   cycles by ``dram_timing_cycles`` (rounded up)
dram_bytes             64 MiB      simulated DRAM window (assumption, not a limit
                                   of the design)
tsv_data_lanes         256         = 8 x dram_channel_bytes: one lane per bit
tsv_spare_lanes        8           assumption: a few spares per bundle, as HBM
                                   stacks carry redundant TSVs
kv_slots               16          design point: K/V tile slots of the SRAM map;
                                   a KV head whose kv tiles all fit stays
                                   resident in SRAM (seq_kv <= kv_slots x Bc)
softmax_overlap        None        design point: a second S buffer per PE lets
                                   Q.K^T of kv tile j+1 run in the softmax's
                                   free issue slots of kv tile j (``hdl/core.py``);
                                   None: wherever the registers allow
=====================  ==========  =============================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

__all__ = ["NPUConfig", "DEFAULT", "small_config"]


def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class NPUConfig:
    """Frozen NPU configuration.

    Every field is validated in ``__post_init__``; a bad value raises
    ``ValueError`` naming the field and the value.  Derived quantities are
    properties, never stored.

    Attributes
    ----------
    array_rows, array_cols : int
        PE array size R x C (powers of two; the row-reduction tree has
        log2(C) levels).
    pe_registers : int
        Entries of the per-PE register file (each 32 bit).
    br, bc : int
        FlashAttention tile sizes: query rows per q tile, keys per kv tile.
        Each is a multiple of the array size on its axis.
    max_head_dim : int
        Largest head_dim a job may use (bounded by the PE register budget).
    clock_hz : float
        Clock frequency in Hz (used for FLOP/s and bandwidth in GB/s).
    sram_bytes, sram_banks, sram_bank_bytes : int
        Stacked SRAM capacity (bytes), bank count, bank port width (bytes).
    dram_dies, dram_channels, dram_channel_bytes, dram_latency_cycles : int
        Stacked DRAM: dies, channels (each with its own TSV bundle), bytes per
        cycle per channel, column-command-to-data latency in cycles.
    dram_banks, dram_row_bytes : int
        Banks per channel and the row (page) size of one channel in bytes.
    dram_trcd_ns, dram_trp_ns, dram_tras_ns, dram_trrd_ns, dram_tfaw_ns, dram_trefi_ns, dram_trfc_ns : int
        DRAM timing in ns (``dram_timing_cycles`` gives cycles).
    dram_bytes : int
        Size of the simulated DRAM address space (bytes).
    tsv_data_lanes, tsv_spare_lanes : int
        Data lanes and spare lanes of one TSV bundle.
    kv_slots : int
        K/V tile slots in the NPU's SRAM map (a power of 2, at least 2): a KV
        head with at most ``kv_slots`` kv tiles keeps them resident in SRAM;
        longer ones stream K/V through slots 0 and 1 (ping-pong halves).
    softmax_overlap : bool or None
        True: give each PE a second S/P buffer and issue the next kv tile's
        Q.K^T MACs in the free slots of this tile's softmax program (an error
        when the registers cannot hold it); False: the phases run strictly
        one after the other, one S buffer; None (default): True where the
        second buffer fits in ``pe_registers``.  ``overlaps_softmax`` is the
        resolved value.
    """

    array_rows: int = 32
    array_cols: int = 32
    pe_registers: int = 64
    br: int = 64
    bc: int = 64
    max_head_dim: int = 128
    clock_hz: float = 1.5e9
    sram_bytes: int = 4 * 1024 * 1024
    sram_banks: int = 16
    sram_bank_bytes: int = 32
    dram_dies: int = 8
    dram_channels: int = 8
    dram_channel_bytes: int = 32
    dram_latency_cycles: int = 64
    dram_banks: int = 16
    dram_row_bytes: int = 1024
    dram_trcd_ns: int = 14
    dram_trp_ns: int = 14
    dram_tras_ns: int = 34
    dram_trrd_ns: int = 6
    dram_tfaw_ns: int = 30
    dram_trefi_ns: int = 3900
    dram_trfc_ns: int = 260
    dram_bytes: int = 64 * 1024 * 1024
    tsv_data_lanes: int = 256
    tsv_spare_lanes: int = 8
    kv_slots: int = 16
    softmax_overlap: bool | None = None

    # ------------------------------------------------------------------ checks
    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "clock_hz":
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                    raise ValueError(f"clock_hz must be a positive finite number, not {v!r}")
                continue
            if f.name == "softmax_overlap":
                if v is not None and not isinstance(v, bool):
                    raise ValueError(f"softmax_overlap must be True, False or None, not {v!r}")
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{f.name} must be an int, not {v!r}")
            if v <= 0 and f.name != "tsv_spare_lanes":
                raise ValueError(f"{f.name} must be positive, not {v!r}")
        if self.tsv_spare_lanes < 0:
            raise ValueError(f"tsv_spare_lanes must be >= 0, not {self.tsv_spare_lanes!r}")
        for name in ("array_rows", "array_cols", "sram_banks", "sram_bank_bytes",
                     "dram_channels", "dram_channel_bytes", "dram_banks", "dram_row_bytes", "kv_slots"):
            if not _is_pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of 2, not {getattr(self, name)!r}")
        if self.kv_slots < 2:
            raise ValueError(f"kv_slots must be at least 2 (the ping-pong halves), not {self.kv_slots!r}")
        if self.array_cols < 2:
            raise ValueError(f"array_cols must be at least 2, not {self.array_cols!r}")
        if self.br % self.array_rows:
            raise ValueError(f"br must be a multiple of array_rows={self.array_rows}, not {self.br!r}")
        if self.bc % self.array_cols:
            raise ValueError(f"bc must be a multiple of array_cols={self.array_cols}, not {self.bc!r}")
        if self.max_head_dim % 8:
            raise ValueError(f"max_head_dim must be a multiple of 8, not {self.max_head_dim!r}")
        if self.pe_registers != 64 and not _is_pow2(self.pe_registers):
            raise ValueError(f"pe_registers must be a power of 2, not {self.pe_registers!r}")
        need = self.registers_needed(self.max_head_dim)
        if need > self.pe_registers:
            raise ValueError(
                f"max_head_dim={self.max_head_dim} needs {need} registers per PE "
                f"(br={self.br}, bc={self.bc}, array {self.array_rows}x{self.array_cols}) "
                f"but pe_registers={self.pe_registers}")
        if self.sram_bytes % (self.sram_banks * self.sram_bank_bytes):
            raise ValueError(f"sram_bytes={self.sram_bytes} is not a multiple of "
                             f"sram_banks*sram_bank_bytes={self.sram_banks * self.sram_bank_bytes}")
        if self.tsv_data_lanes != 8 * self.dram_channel_bytes:
            raise ValueError(f"tsv_data_lanes must equal 8*dram_channel_bytes="
                             f"{8 * self.dram_channel_bytes}, not {self.tsv_data_lanes!r}")
        if self.dram_bytes % 4096:
            raise ValueError(f"dram_bytes must be a multiple of 4096, not {self.dram_bytes!r}")
        if self.dram_row_bytes < self.dram_channel_bytes:
            raise ValueError(f"dram_row_bytes must be at least dram_channel_bytes={self.dram_channel_bytes}, "
                             f"not {self.dram_row_bytes!r}")
        t = self.dram_timing_cycles()
        if t["trefi"] <= t["trfc"] + t["trp"]:
            raise ValueError(f"dram_trefi_ns={self.dram_trefi_ns} leaves no time between refreshes "
                             f"(tRFC {self.dram_trfc_ns} ns + tRP {self.dram_trp_ns} ns)")

    # --------------------------------------------------------------- derived
    @property
    def rows_per_pe(self) -> int:
        """Score-tile rows held by one PE (Br / R)."""
        return self.br // self.array_rows

    @property
    def cols_per_pe(self) -> int:
        """Score-tile columns held by one PE (Bc / C)."""
        return self.bc // self.array_cols

    def o_cols_per_pe(self, head_dim: int) -> int:
        """O_acc columns held by one PE for ``head_dim`` (ceil(head_dim / C))."""
        return -(-head_dim // self.array_cols)

    def registers_needed(self, head_dim: int) -> int:
        """Register-file entries one PE needs for ``head_dim``.

        S/P block (rows_per_pe x cols_per_pe) + O_acc block
        (rows_per_pe x ceil(head_dim / C)) + m_i, l_i and alpha per row, and
        with ``softmax_overlap`` a second S/P block at the next multiple of
        its power-of-two size (``s1_base``).
        """
        rp = self.rows_per_pe
        n = rp * self.cols_per_pe + rp * self.o_cols_per_pe(head_dim) + 3 * rp
        return self.s1_base(head_dim) + rp * self.cols_per_pe if self.overlaps_softmax else n

    @property
    def overlaps_softmax(self) -> bool:
        """``softmax_overlap`` resolved: None means where the second S/P
        block fits in ``pe_registers`` at ``max_head_dim``."""
        if self.softmax_overlap is not None:
            return self.softmax_overlap
        blk = self.rows_per_pe * self.cols_per_pe
        return self.s1_base(self.max_head_dim) + blk <= self.pe_registers

    def s1_base(self, head_dim: int) -> int:
        """First register of the second S/P block (``softmax_overlap``): the
        first multiple of the block's power-of-two size after the other
        registers, so its addresses are base | (a * cols_per_pe + b)."""
        rp, blk = self.rows_per_pe, self.rows_per_pe * self.cols_per_pe
        n = blk + rp * self.o_cols_per_pe(head_dim) + 3 * rp
        size = 1 << (blk - 1).bit_length()
        return -(-n // size) * size

    @property
    def tree_levels(self) -> int:
        """Levels of the row-reduction tree (log2 C)."""
        return self.array_cols.bit_length() - 1

    @property
    def macs_per_cycle(self) -> int:
        """Peak MACs per cycle (R x C)."""
        return self.array_rows * self.array_cols

    @property
    def peak_flops(self) -> float:
        """Peak FLOP/s (2 FLOP per MAC) at ``clock_hz``."""
        return 2.0 * self.macs_per_cycle * self.clock_hz

    @property
    def dram_bytes_per_cycle(self) -> int:
        """Aggregate DRAM bandwidth in bytes per cycle."""
        return self.dram_channels * self.dram_channel_bytes

    def dram_timing_cycles(self) -> dict:
        """The DRAM timing parameters in NPU cycles: ``ceil(ns * clock_hz / 1e9)``.

        Keys ``trcd, trp, tras, trrd, tfaw, trefi, trfc`` (cycles, int >= 1).
        The nanosecond values are the ``dram_t*_ns`` fields (HBM2 8Gb, DRAMsim3
        ``configs/HBM2_8Gb_x128.ini``; tRRD is its tRRD_L, the same-bank-group
        spacing, applied to every pair of activates).
        """
        out = {}
        for k in ("trcd", "trp", "tras", "trrd", "tfaw", "trefi", "trfc"):
            ns = getattr(self, f"dram_{k}_ns")
            out[k] = max(1, math.ceil(round(ns * self.clock_hz / 1e9, 6)))
        return out

    def check_head_dim(self, head_dim) -> None:
        """Raise ``ValueError`` unless ``1 <= head_dim <= max_head_dim``."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, (int,)) and not hasattr(head_dim, "__index__"):
            raise ValueError(f"head_dim must be an int, not {head_dim!r}")
        head_dim = int(head_dim)
        if not 1 <= head_dim <= self.max_head_dim:
            raise ValueError(f"head_dim={head_dim} is outside the hardware range 1..{self.max_head_dim}")

    # ---------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "NPUConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown configuration fields: {sorted(unknown)!r}")
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "NPUConfig":
        return cls.from_dict(json.loads(s))

    @property
    def digest(self) -> str:
        """Short hash of the configuration: names build directories."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]

    def replace(self, **changes) -> "NPUConfig":
        return dataclasses.replace(self, **changes)


DEFAULT = NPUConfig()


def small_config(rows: int = 4, cols: int = 4, **changes) -> NPUConfig:
    """A small configuration for fast tests: Br = 2R, Bc = 2C, head_dim <= 64."""
    base = dict(array_rows=rows, array_cols=cols, br=2 * rows, bc=2 * cols, max_head_dim=64)
    base.update(changes)
    return NPUConfig(**base)
