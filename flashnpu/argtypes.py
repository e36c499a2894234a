"""``argparse`` types for numbers with a range.

``type=int_in(1)`` accepts an integer >= 1 and rejects anything else with a
message naming the value (argparse prefixes the option): ``argument --heads:
must be an integer >= 1, not '-3'``.  Floats are always finite: ``nan``,
``inf`` and values that overflow (``1e400``) are rejected too.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["int_in", "float_in", "positive_int", "nonneg_int", "positive_float"]


def _range_text(lo, hi, lo_open=False) -> str:
    if lo is not None and hi is not None:
        return f"in {lo}..{hi}" if not lo_open else f"in ({lo}, {hi}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"<= {hi}"
    return ""


def int_in(lo: int | None = None, hi: int | None = None):
    """An argparse type: an integer in ``lo..hi`` (either end may be open)."""
    want = ("an integer " + _range_text(lo, hi)).strip()

    def parse(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, not {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, not {text!r}")
        return v

    parse.__name__ = "integer"
    return parse


def float_in(lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    """An argparse type: a finite number in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``)."""
    want = ("a finite number " + _range_text(lo, hi, lo_open)).strip()

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, not {text!r}") from None
        if (not math.isfinite(v) or (lo is not None and (v < lo or (lo_open and v == lo)))
                or (hi is not None and v > hi)):
            raise argparse.ArgumentTypeError(f"must be {want}, not {text!r}")
        return v

    parse.__name__ = "number"
    return parse


positive_int = int_in(1)
nonneg_int = int_in(0)
positive_float = float_in(0.0, lo_open=True)
