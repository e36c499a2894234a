"""Struct payloads as integers: a ``data.StructLayout`` payload reaches
Verilog (and cocotb) as one flat port, and amaranth.sim sets it as one value.

Shared by the cocotb testbenches, the core driver and the unit tests.
"""

from __future__ import annotations

__all__ = ["pack", "unpack"]


def pack(layout, values: dict) -> int:
    """Integer value of a struct payload: ``values`` maps field names to ints
    (or, for a nested struct field, to a dict); unnamed fields are 0.

    Raises
    ------
    KeyError naming fields that ``layout`` does not have.
    """
    names = {name for name, _ in layout}
    unknown = sorted(set(values) - names)
    if unknown:
        raise KeyError(f"unknown fields {unknown!r}")
    out = 0
    for name, fld in layout:
        v = values.get(name, 0)
        if isinstance(v, dict):
            v = pack(fld.shape, v)
        out |= (int(v) & ((1 << fld.width) - 1)) << fld.offset
    return out


def unpack(layout, value: int) -> dict:
    """Fields of a struct payload as a dict of ints (nested structs flat)."""
    value = int(value)
    return {name: (value >> fld.offset) & ((1 << fld.width) - 1) for name, fld in layout}
