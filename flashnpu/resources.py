"""Memory a job may take: checked from its sizes before anything is allocated.

``check_memory(need, what)`` compares an estimate with ``memory_limit()``:
the memory the system reports available (``MemAvailable`` of
``/proc/meminfo``), or, where that is unknown, half the physical memory, or
4 GiB.  ``FLASHNPU_MEMORY_LIMIT`` (bytes, or with a K/M/G suffix) sets the
limit instead.  The estimates are the callers' (``flashnpu.sim.case``:
attention cases; ``flashnpu.driver.runtime``: the KV cache); they aim at
the peak within a factor of two, so a job refused here would not have run.
"""

from __future__ import annotations

import os
import re

__all__ = ["memory_limit", "check_memory", "fmt_bytes"]

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def memory_limit() -> int:
    """Bytes a job may allocate (see the module docstring)."""
    env = os.environ.get("FLASHNPU_MEMORY_LIMIT", "")
    if env.strip():
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", env, re.I)
        if not m:
            raise ValueError(f"FLASHNPU_MEMORY_LIMIT must be a number of bytes such as 8G, not {env!r}")
        return int(float(m.group(1)) * _SUFFIX[m.group(2).upper()])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def check_memory(need: int, what: str) -> None:
    """Raise ``ValueError`` when ``need`` bytes exceed ``memory_limit()``;
    the message starts with ``what`` (which names the sizes)."""
    limit = memory_limit()
    if need > limit:
        raise ValueError(f"{what} needs about {fmt_bytes(need)} of memory, more than the "
                         f"{fmt_bytes(limit)} available; make it smaller")
