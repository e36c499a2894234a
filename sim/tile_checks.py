"""Host side of the S-tile check: the golden model's count of non-zero P
per (q tile, kv tile) in the order the NPU's controller runs them, and the
DRAM address of a mask bit (for fault injection).

The NPU queues, per kv tile it computes, the number of non-zero P entries
its PEs wrote (``hdl/s_check.py``); ``sim/cocotb_npu.py`` compares each with
``expected_p_counts`` and stops the job past a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashnpu.config import NPUConfig
from flashnpu.golden import flash_attention_hw
from flashnpu.hdl.mem_common import word_bytes

__all__ = ["TileCount", "expected_p_counts", "mask_bit_address"]


@dataclass(frozen=True)
class TileCount:
    """Golden count of non-zero P of one tile: ``head`` (the q tile's first
    query head), ``q_tile`` (index of its first row / Br; 0 in decode, where
    the heads of a KV group are stacked on the rows), ``kv_tile``, ``count``."""

    head: int
    q_tile: int
    kv_tile: int
    count: int


def expected_p_counts(case, config: NPUConfig) -> dict:
    """{(q tile of the job, kv tile): TileCount} for every tile pair, in the
    controller's order: KV head, query head of its group, q tile (decode:
    KV head, then groups of Br query heads on the rows of one q tile).

    Raises ValueError for a case the golden model rejects.
    """
    g = flash_attention_hw(case.q, case.k, case.v, config=config, checkpoints=True, **case.kwargs())
    heads, seq_q, _ = case.q.shape
    kv_heads = case.k.shape[0]
    group = heads // kv_heads
    br = config.br
    nz = [np.count_nonzero(cp.P.view(np.uint16) & 0x7FFF, axis=2) for cp in g.checkpoints]   # [h, seq_q]
    out = {}
    t = 0
    for kvh in range(kv_heads):
        if seq_q == 1:
            tiles = [(kvh * group + hg, list(range(kvh * group + hg, kvh * group + min(hg + br, group))),
                      slice(0, 1), 0) for hg in range(0, group, br)]
        else:
            tiles = [(h, [h], slice(q0, q0 + br), q0 // br)
                     for h in range(kvh * group, (kvh + 1) * group) for q0 in range(0, seq_q, br)]
        for head, hs, rows, qt in tiles:
            for j, n in enumerate(nz):
                out[(t, j)] = TileCount(head, qt, j, int(n[hs, rows].sum()))
            t += 1
    return out


def mask_bit_address(regs: dict, config: NPUConfig, head: int, row: int, key: int) -> tuple:
    """(byte address, bit) of mask[head, row, key] in DRAM, from a planned
    job's registers (``plan_job(...)["regs"]``; the mask layout of
    ``plan_job``: one bus word per row and kv tile, bit key % Bc)."""
    W = word_bytes(config)
    kt, kb = divmod(key, config.bc)
    addr = (regs["mask_base"] + head * regs["mask_head_stride"] + kt * regs["mask_tile_stride"]
            + row * W + kb // 8)
    return addr, kb % 8
