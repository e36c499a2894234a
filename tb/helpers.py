"""Shared helpers of the amaranth.sim unit tests.

* ``stream_put`` / ``stream_get``: one beat on an ``amaranth.lib.stream``
  interface with random idle and back-pressure (async testbenches,
  ``ctx.set / ctx.tick / ctx.get``), as Glasgow's ``gateware/stream.py``.
* ``raises_quietly``: ``pytest.raises`` for a rejected component constructor.
* ``tiny_mem_config``: the small memory configuration of the unit tests.

Packing of struct payloads is ``flashnpu.sim.packing.pack`` / ``unpack``
(shared with the cocotb testbenches).
"""

from __future__ import annotations

import gc
import random
import warnings

import pytest

from flashnpu.config import small_config

__all__ = ["tiny_mem_config", "stream_put", "stream_get", "raises_quietly"]


def tiny_mem_config(**changes):
    """4-byte bus words, 32+2 TSV lanes, 4 banks/channels: fast amaranth.sim unit tests."""
    base = dict(sram_bytes=2048, sram_banks=4, sram_bank_bytes=4, dram_channel_bytes=4,
                dram_channels=4, tsv_data_lanes=32, tsv_spare_lanes=2, dram_bytes=65536,
                dram_latency_cycles=8)
    base.update(changes)
    return small_config(**base)


async def stream_put(ctx, s, payload, rng: random.Random | None = None, idle: float = 0.0):
    """Send one beat on stream ``s`` (after random idle cycles with probability ``idle``)."""
    if rng is not None:
        while rng.random() < idle:
            await ctx.tick()
    ctx.set(s.payload, payload)
    ctx.set(s.valid, 1)
    await ctx.tick().until(s.ready)
    ctx.set(s.valid, 0)


async def stream_get(ctx, s, rng: random.Random | None = None, backpressure: float = 0.0):
    """Receive one beat from stream ``s`` (holding ``ready`` low at random)."""
    while True:
        ready = not (rng is not None and rng.random() < backpressure)
        ctx.set(s.ready, int(ready))
        _, _, valid, payload = await ctx.tick().sample(s.valid, s.payload)
        if ready and valid:
            ctx.set(s.ready, 0)
            return payload


def raises_quietly(exc, match, fn):
    """``pytest.raises`` for a component constructor that rejects its
    parameters, without Amaranth's "created but never used" warning for the
    half-built object."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(exc, match=match):
            fn()
        gc.collect()
