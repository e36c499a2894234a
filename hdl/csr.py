"""Control/status registers: named registers with typed fields and access
modes, collected into a memory map, and the bus-facing register bank.

In the spirit of amaranth-soc's ``csr.Register`` / ``csr.Builder`` /
``MemoryMap`` (amaranth-soc is not on the package index, so the project keeps
this small block of its own).  The memory map is the one source of truth: the
RTL bank is elaborated from it and the host driver reads its addresses from
the same object (``RegisterMap.to_dict()`` is also written beside generated
Verilog), so no address is typed twice.

Bus (one 32-bit word per register address, byte address = 4 x word)::

    host ──addr/w_en/w_data──►┌──────────┐──reg.value──► hardware   (rw)
         ◄──r_data (1 cycle)──│ CSRBank  │◄─reg.status── hardware   (ro)
                              └──────────┘──reg.pulse──► hardware   (w1p: one-cycle strobe)

Access modes
------------
``rw``   host reads and writes; hardware sees the stored value.
``ro``   host reads what hardware drives; writes are ignored.
``w1p``  writing 1 to a bit gives hardware a one-cycle pulse; reads as 0.
``w1c``  hardware sets bits (``set`` input); host writes 1 to clear; reads
         the sticky value.

Windows (``Window``): a block of ``words`` consecutive word addresses,
aligned to its size, that the bank forwards to a memory inside a hardware
block (for example the command ring): ``rw`` windows take the host's
writes and reads, ``ro`` windows only its reads.  A window read has the
register read's latency (``r_data`` one cycle after ``r_en``), so the block
answers from a synchronous read port.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from amaranth import Module, Mux, Shape, Signal, Value, unsigned
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["Field", "Register", "Window", "RegisterMap", "CSRBank", "ACCESS_MODES", "WINDOW_MODES"]

ACCESS_MODES = ("rw", "ro", "w1p", "w1c")
WINDOW_MODES = ("rw", "ro")


@dataclass(frozen=True)
class Field:
    """A named bit field of a register (``offset`` in bits from the LSB)."""

    name: str
    width: int
    offset: int = 0
    doc: str = ""


@dataclass
class Register:
    """A 32-bit register.

    Parameters
    ----------
    name : str, an identifier
    access : one of ``ACCESS_MODES``
    fields : list of Field (default: one field ``value`` of 32 bits)
    doc : str
    reset : int, reset value of ``rw`` registers

    Raises
    ------
    ValueError for an unknown access mode, overlapping fields or fields that
    do not fit in 32 bits.
    """

    name: str
    access: str
    fields: list = field(default_factory=list)
    doc: str = ""
    reset: int = 0
    address: int | None = None      # word address, set by RegisterMap

    def __post_init__(self):
        if self.access not in ACCESS_MODES:
            raise ValueError(f"register {self.name!r}: access must be one of {ACCESS_MODES}, not {self.access!r}")
        if not self.fields:
            self.fields = [Field("value", 32)]
        used = 0
        for f in self.fields:
            if f.width <= 0 or f.offset < 0 or f.offset + f.width > 32:
                raise ValueError(f"register {self.name!r}: field {f.name!r} does not fit in 32 bits")
            bits = ((1 << f.width) - 1) << f.offset
            if used & bits:
                raise ValueError(f"register {self.name!r}: field {f.name!r} overlaps another field")
            used |= bits

    def field(self, name) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"register {self.name!r} has no field {name!r}")

    def pack(self, **values) -> int:
        """Word value with the named fields set (ValueError if one does not fit)."""
        word = 0
        for k, v in values.items():
            f = self.field(k)
            if not 0 <= int(v) < (1 << f.width):
                raise ValueError(f"{self.name}.{k}={v!r} does not fit in {f.width} bits")
            word |= int(v) << f.offset
        return word

    def unpack(self, word: int) -> dict:
        return {f.name: (word >> f.offset) & ((1 << f.width) - 1) for f in self.fields}

    @property
    def shape(self) -> "Shape | data.FlexibleLayout":
        """Hardware shape of the register: ``unsigned(32)`` for a register
        with the one implicit ``value`` field, otherwise a 32-bit
        ``data.FlexibleLayout`` with one member per field at its offset, so
        the RTL reads ``reg.field_name`` and never slices bits by hand."""
        if [f.name for f in self.fields] == ["value"]:
            return unsigned(32)
        return data.FlexibleLayout(32, {f.name: data.Field(unsigned(f.width), f.offset) for f in self.fields})

    @property
    def init(self) -> "int | dict":
        """Reset value in the form ``Signal(self.shape, init=...)`` takes."""
        return self.reset if isinstance(self.shape, Shape) else self.unpack(self.reset)


@dataclass
class Window:
    """A block of ``words`` 32-bit words (a power of two) backed by a memory
    in a hardware block; ``access`` one of ``WINDOW_MODES``.

    Raises
    ------
    ValueError for an unknown access mode or a size that is not a power of two.
    """

    name: str
    words: int
    access: str = "rw"
    doc: str = ""
    address: int | None = None      # first word address, set by RegisterMap

    def __post_init__(self):
        if self.access not in WINDOW_MODES:
            raise ValueError(f"window {self.name!r}: access must be one of {WINDOW_MODES}, not {self.access!r}")
        if self.words < 1 or self.words & (self.words - 1):
            raise ValueError(f"window {self.name!r}: words={self.words} is not a power of two")

    @property
    def index_bits(self) -> int:
        return max(1, (self.words - 1).bit_length())


class RegisterMap:
    """An ordered collection of registers with word addresses, and windows.

    ``add`` places a register at the next free word (or at ``address``);
    ``add_window`` places a window after everything else, aligned to its
    size; ``to_dict`` gives the memory map as plain data (name -> byte
    address, access, fields; windows with their size) for the driver and the
    Verilog sidecar.
    """

    def __init__(self, name: str = "csr"):
        self.name = name
        self._regs: dict[str, Register] = {}
        self._windows: dict[str, Window] = {}
        self._next = 0

    def add(self, reg: Register, address: int | None = None) -> Register:
        if reg.name in self._regs or reg.name in self._windows:
            raise ValueError(f"register name {reg.name!r} is used twice")
        if self._windows:
            raise ValueError(f"register {reg.name!r}: add registers before the windows")
        addr = self._next if address is None else address
        if any(r.address == addr for r in self._regs.values()):
            raise ValueError(f"register {reg.name!r}: word address {addr} is taken")
        reg.address = addr
        self._regs[reg.name] = reg
        self._next = max(self._next, addr + 1)
        return reg

    def add_window(self, win: Window) -> Window:
        if win.name in self._regs or win.name in self._windows:
            raise ValueError(f"window name {win.name!r} is used twice")
        win.address = -(-self._next // win.words) * win.words
        self._windows[win.name] = win
        self._next = win.address + win.words
        return win

    def window(self, name) -> Window:
        try:
            return self._windows[name]
        except KeyError:
            raise KeyError(f"no window named {name!r} in {self.name}") from None

    @property
    def windows(self) -> list:
        return sorted(self._windows.values(), key=lambda w: w.address)

    def __getitem__(self, name) -> Register:
        try:
            return self._regs[name]
        except KeyError:
            raise KeyError(f"no register named {name!r} in {self.name}") from None

    def __iter__(self):
        return iter(sorted(self._regs.values(), key=lambda r: r.address))

    def __len__(self):
        return len(self._regs)

    @property
    def addr_width(self) -> int:
        return max(1, (self._next - 1).bit_length())

    def to_dict(self) -> dict:
        return {
            "name": self.name, "word_bytes": 4,
            "registers": [
                dict(name=r.name, address=4 * r.address, access=r.access, doc=r.doc, reset=r.reset,
                     fields=[dict(name=f.name, offset=f.offset, width=f.width, doc=f.doc) for f in r.fields])
                for r in self],
            "windows": [dict(name=w.name, address=4 * w.address, words=w.words, access=w.access, doc=w.doc)
                        for w in self.windows],
        }


class CSRBank(wiring.Component):
    """The register bank elaborated from a ``RegisterMap``.

    Ports
    -----
    addr : In(addr_width)   word address
    w_en : In(1), w_data : In(32)   write strobe and data (takes effect at the clock edge)
    r_en : In(1)            read strobe; ``r_data`` is valid in the next cycle
    r_data : Out(32)

    Hardware side, per register (``bank.port(name, kind)``), each of the
    register's ``shape`` (its fields by name, see ``Register.shape``):
    ``rw``: ``value`` Out (the stored word); ``ro``: ``status`` In;
    ``w1p``: ``pulse`` Out (one cycle); ``w1c``: ``set`` In and ``value`` Out.

    Per window (``bank.window_port(name, kind)``): ``addr`` Out (word index
    in the window), ``w_en`` Out (``rw`` windows), ``w_data`` Out(32),
    ``r_en`` Out (a host read this cycle) and ``r_data`` In(32) (the block's
    answer, one cycle after ``r_en``).
    """

    def __init__(self, regmap: RegisterMap):
        self.regmap = regmap
        sig = {"addr": In(regmap.addr_width), "w_en": In(1), "w_data": In(32),
               "r_en": In(1), "r_data": Out(32)}
        for r in regmap:
            if r.access == "rw":
                sig[f"{r.name}__value"] = Out(r.shape, init=r.init)
            elif r.access == "ro":
                sig[f"{r.name}__status"] = In(r.shape)
            elif r.access == "w1p":
                sig[f"{r.name}__pulse"] = Out(r.shape)
            else:
                sig[f"{r.name}__set"] = In(r.shape)
                sig[f"{r.name}__value"] = Out(r.shape)
        for w in regmap.windows:
            sig.update({f"{w.name}__addr": Out(w.index_bits), f"{w.name}__w_en": Out(1),
                        f"{w.name}__w_data": Out(32), f"{w.name}__r_en": Out(1), f"{w.name}__r_data": In(32)})
        super().__init__(sig)

    def window_port(self, win: str, kind: str):
        """The signal ``kind`` ('addr', 'w_en', 'w_data', 'r_en', 'r_data') of window ``win``."""
        return getattr(self, f"{win}__{kind}")

    def port(self, reg: str, kind: str):
        """The hardware-side signal ``kind`` ('value', 'status', 'pulse', 'set')
        of ``reg``: a ``data.View`` of the register's fields, or a 32-bit
        ``Signal`` for a register without fields."""
        return getattr(self, f"{reg}__{kind}")

    def _word(self, reg: str, kind: str) -> Value:
        return Value.cast(self.port(reg, kind))

    def elaborate(self, platform):
        m = Module()
        hit = {r.name: (self.addr == r.address) for r in self.regmap}
        read_mux = 0
        for r in self.regmap:
            if r.access == "rw":
                v = self._word(r.name, "value")
                with m.If(self.w_en & hit[r.name]):
                    m.d.sync += v.eq(self.w_data)
                read_val = v
            elif r.access == "ro":
                read_val = self._word(r.name, "status")
            elif r.access == "w1p":
                p = self._word(r.name, "pulse")
                m.d.sync += p.eq(0)
                with m.If(self.w_en & hit[r.name]):
                    m.d.sync += p.eq(self.w_data)
                read_val = 0
            else:  # w1c
                v = self._word(r.name, "value")
                clear = Signal(32, name=f"{r.name}_clear")
                m.d.comb += clear.eq(0)
                with m.If(self.w_en & hit[r.name]):
                    m.d.comb += clear.eq(self.w_data)
                m.d.sync += v.eq((v & ~clear) | self._word(r.name, "set"))
                read_val = v
            read_mux = hit[r.name].replicate(32) & read_val | read_mux
        reg_data = Signal(32)
        with m.If(self.r_en):
            m.d.sync += reg_data.eq(read_mux)
        # a window read: the block's synchronous port answers in the next cycle
        r_data = reg_data
        for w in self.regmap.windows:
            w_hit = (self.addr >> w.index_bits) == (w.address >> w.index_bits)
            last = Signal(name=f"{w.name}_read")
            with m.If(self.r_en):
                m.d.sync += last.eq(w_hit)
            m.d.comb += [self.window_port(w.name, "addr").eq(self.addr[:w.index_bits]),
                         self.window_port(w.name, "w_data").eq(self.w_data),
                         self.window_port(w.name, "w_en").eq((self.w_en & w_hit) if w.access == "rw" else 0),
                         self.window_port(w.name, "r_en").eq(self.r_en & w_hit)]
            r_data = Mux(last, self.window_port(w.name, "r_data"), r_data)
        m.d.comb += self.r_data.eq(r_data)
        return m
