"""Shared pieces of the memory system: bus words, request layouts, arbitration.

Every memory-side block (``StackedSRAM``, ``StackedDRAM``, ``TSVLink``,
``DMA``) moves data in **bus words** of ``word_bytes(config)`` bytes.  One bus
word is at the same time

* one SRAM bank port (``sram_bank_bytes``),
* what one DRAM channel delivers per cycle (``dram_channel_bytes``),
* what one TSV bundle carries per cycle (``tsv_data_lanes`` / 8),

so that a word crosses every level without reshaping; the DMA moves one word
per channel per cycle, ``dram_channels`` words into as many SRAM banks::

    DRAM channel c (32 B/cycle) --its TSV bundle (256 lanes + spares)--> DMA lane --> SRAM bank (32 B)

Addresses on the block ports are **word addresses** (byte address >> log2 W);
byte addresses only appear in DMA descriptors.  Writes carry a byte mask
(one bit per byte, bit 0 = lowest byte = lowest address: little-endian), so
rows whose length is not a word multiple can be written exactly.

The round-robin arbiter here serves the SRAM banks: each bank takes one
access per cycle, requesters that lose wait (their stream ``ready`` stays
low).  The generator output helper
``strip_zero_memory_init`` removes the all-zero initialisers Yosys writes for
every large ``Memory`` (a 4 MiB SRAM would otherwise emit ~11 MB of ``initial``
statements); the storage then powers up undefined in simulation, as a real
SRAM macro does.  Small memories (FIFO storage, < 256 words) keep theirs so
that an X-propagating simulator never sees an undefined FIFO entry.
"""

from __future__ import annotations

import re

from amaranth import Cat, Const, Module, Signal
from amaranth.lib import data, stream
from amaranth.utils import ceil_log2

__all__ = ["word_bytes", "sram_req_layout", "dram_cmd_layout", "word_signature",
           "RoundRobin", "round_robin", "strip_zero_memory_init", "verilog_text"]


def word_bytes(config) -> int:
    """Bus word size W in bytes (= sram_bank_bytes = dram_channel_bytes = tsv_data_lanes/8).

    Raises
    ------
    ValueError
        When the three widths of the configuration disagree.
    """
    w = config.sram_bank_bytes
    if config.dram_channel_bytes != w:
        raise ValueError(f"dram_channel_bytes={config.dram_channel_bytes} must equal "
                         f"sram_bank_bytes={w}: one bus word crosses every level unchanged")
    if config.tsv_data_lanes != 8 * w:
        raise ValueError(f"tsv_data_lanes={config.tsv_data_lanes} must equal 8*sram_bank_bytes={8 * w}")
    return w


def sram_req_layout(addr_bits: int, wbytes: int) -> data.StructLayout:
    """SRAM request payload: word address, write flag, write data and byte mask.

    ``wdata``/``wmask`` are ignored for reads.  Shapes: addr ``addr_bits``,
    wdata ``8*wbytes``, wmask ``wbytes`` (bit i enables byte i).
    """
    return data.StructLayout({
        "addr": addr_bits,
        "write": 1,
        "wmask": wbytes,
        "wdata": 8 * wbytes,
    })


def dram_cmd_layout(addr_bits: int, wbytes: int) -> data.StructLayout:
    """DRAM command payload (the write data travels separately, over the TSV data lanes)."""
    return data.StructLayout({
        "addr": addr_bits,
        "write": 1,
        "wmask": wbytes,
    })


def word_signature(wbytes: int) -> stream.Signature:
    """A stream of bus words (``8*wbytes`` bits)."""
    return stream.Signature(8 * wbytes)


class RoundRobin:
    """Combinational round-robin grant among ``n`` requesters for one resource.

    ``grant[i]`` is high for at most one requester per cycle: the first
    requesting index at or after ``last + 1`` (wrapping).  Call ``advance(m)``
    once, it updates ``last`` whenever a grant is given (a granted access always
    completes in the same cycle in this memory system).  A requester listed in
    ``low`` (e.g. a debug backdoor) is only granted when no other requests.
    """

    def __init__(self, m: Module, requests, low=(), name="rr"):
        self.requests = list(requests)
        n = len(self.requests)
        if n == 0:
            raise ValueError("RoundRobin needs at least one requester, not 0")
        self.n = n
        self.low = set(low)
        self.grant = [Signal(name=f"{name}_g{i}") for i in range(n)]
        self.any = Signal(name=f"{name}_any")
        normal = [i for i in range(n) if i not in self.low]
        self.last = Signal(range(max(len(normal), 2)), name=f"{name}_last")
        self._normal = normal
        self._name = name
        other = Const(0, 1)
        for i in normal:
            other = other | self.requests[i]
        if len(normal) == 1:
            m.d.comb += self.grant[normal[0]].eq(self.requests[normal[0]])
        elif len(normal) > 1:
            with m.Switch(self.last):
                for p in range(len(normal)):
                    with m.Case(p):
                        order = [normal[(p + 1 + k) % len(normal)] for k in range(len(normal))]
                        taken = Const(0, 1)
                        for i in order:
                            m.d.comb += self.grant[i].eq(self.requests[i] & ~taken)
                            taken = taken | self.requests[i]
        taken = other
        for i in sorted(self.low):
            m.d.comb += self.grant[i].eq(self.requests[i] & ~taken)
            taken = taken | self.requests[i]
        m.d.comb += self.any.eq(Cat(*self.grant).any())
        # pointer update
        if len(normal) > 1:
            for k, i in enumerate(normal):
                with m.If(self.grant[i]):
                    m.d.sync += self.last.eq(k)


def round_robin(m: Module, requests, low=(), name="rr") -> RoundRobin:
    """Build a :class:`RoundRobin` inside ``m`` and return it."""
    return RoundRobin(m, requests, low=low, name=name)


_INIT_BLOCK = re.compile(r"\n(\s*)initial begin\n((?:\s*\\?[\w.$]+\s*\[\d+\] = \d+'h0+;\n)+)\s*end\n")


def strip_zero_memory_init(text: str, min_words: int = 256) -> str:
    """Remove Yosys ``initial`` blocks that only zero-fill large memories.

    Parameters
    ----------
    text : str
        Verilog produced by ``amaranth.back.verilog.convert``.
    min_words : int
        Only initialisers of at least this many words are removed.  Small
        memories (FIFO storage) keep theirs, so that X-propagating simulators
        (Icarus) never see an undefined FIFO entry leak into control logic.

    Returns
    -------
    str
        The same Verilog without the all-zero initialisers of large memories
        (the SRAM banks then power up undefined, as real SRAM macros do).
        Initialisers with any non-zero word are kept.
    """
    def repl(mo):
        return "\n" if mo.group(2).count("\n") >= min_words else mo.group(0)
    return _INIT_BLOCK.sub(repl, text)


def verilog_text(component, name: str) -> str:
    """Verilog of ``component`` with zero memory initialisers stripped.

    Use as ``runner.build(..., verilog_text=lambda c: verilog_text(c, name))``.
    """
    from amaranth.back import verilog
    return strip_zero_memory_init(verilog.convert(component, name=name, emit_src=False))


def addr_bits_for(nbytes: int, wbytes: int) -> int:
    """Word-address width for a memory of ``nbytes`` bytes in ``wbytes``-byte words."""
    return max(1, ceil_log2(nbytes // wbytes))
