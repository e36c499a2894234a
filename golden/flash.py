"""Bit-exact model of the NPU's FlashAttention: the tile loop as the hardware
runs it, in the arithmetic of ``numerics``.

For every q tile (Br query rows) and every kv tile j (Bc keys, the last one
padded), each row does::

    S_raw  = Σ_k  q[k] · K_j[:, k]           MAC, k = 0..head_dim-1 in order
    S      = mul32(S_raw, c)  masked → -inf   c = fp32(scale · log2 e)
    m_new  = max32(m_i, rowmax(S))            PE fold + tree (max is exact)
    alpha  = exp2(m_i - m_new)                1 when the row is still empty
    P      = to_fp16(exp2(S - m_new))         0 when the row is still empty
    l_i    = add32(mul32(alpha, l_i), rowsum(P))      PE fold + pairwise tree
    O_acc  = mul32(alpha, O_acc)
    O_acc  = mac(O_acc, P[:, k], V_j[k, :])   k = 0..Bc-1 in order, skipped
                                              where P[:, k] == 0
    m_i    = m_new

and after the last kv tile O = mul32(O_acc, recip32(l_i)) (0 where l_i = 0).

Every step is row-local, so how query rows are grouped into q tiles (and
which heads share a tile in the decode mapping) cannot change a bit; only
the kv-tile boundaries (multiples of Bc from key 0) and the PE-column
grouping of the reductions matter.  A kv tile that hides every key of a row
leaves that row's (m_i, l_i, O_acc) unchanged bit for bit, so the
controller may skip fully masked tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from flashnpu.config import DEFAULT, NPUConfig

from . import numerics as nx
from .reference import _expand_kv, check_shapes, visible_mask

__all__ = ["TileCheckpoint", "GoldenResult", "flash_attention_hw", "op_counts"]


@dataclass
class TileCheckpoint:
    """State of every query row after kv tile ``kv_tile``.

    Arrays cover all heads and all query rows; ``rows(q_tile, br)`` slices one
    q tile.  Shapes: S_raw, S, P [heads, seq_q, Bc] (P is float16);
    m_i, l_i [heads, seq_q]; O_acc [heads, seq_q, head_dim] (float32).
    """

    kv_tile: int
    S_raw: np.ndarray
    S: np.ndarray
    P: np.ndarray
    m_i: np.ndarray
    l_i: np.ndarray
    O_acc: np.ndarray

    def rows(self, q_tile: int, br: int) -> "TileCheckpoint":
        sl = slice(q_tile * br, (q_tile + 1) * br)
        return TileCheckpoint(self.kv_tile, self.S_raw[:, sl], self.S[:, sl], self.P[:, sl],
                              self.m_i[:, sl], self.l_i[:, sl], self.O_acc[:, sl])


@dataclass
class GoldenResult:
    """Output of ``flash_attention_hw``.

    o : float32 [heads, seq_q, head_dim]
    m_i, l_i : float32 [heads, seq_q] final running max (log2 domain) and sum
    checkpoints : list of TileCheckpoint, one per kv tile (empty unless asked)
    stats : dict of op counts (see ``op_counts``)
    """

    o: np.ndarray
    m_i: np.ndarray
    l_i: np.ndarray
    checkpoints: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def op_counts(heads, seq_q, seq_kv, head_dim, config: NPUConfig = DEFAULT) -> dict:
    """Tile and op counts of a job when every tile pair is computed (no skipping).

    Returns a dict: q_tiles, kv_tiles, tile_pairs, macs (S and P·V MAC slots
    of full tiles, incl. padding), exp2 (P plus alpha), recip (one per row).
    """
    q_tiles = heads * -(-seq_q // config.br)
    kv_tiles = -(-seq_kv // config.bc)
    pairs = q_tiles * kv_tiles
    return dict(q_tiles=q_tiles, kv_tiles=kv_tiles, tile_pairs=pairs,
                macs=pairs * 2 * config.br * config.bc * head_dim,
                exp2=pairs * (config.br * config.bc + config.br),
                recip=q_tiles * config.br)


def flash_attention_hw(q, k, v, causal=False, mask=None, kv_valid_len=None, scale=None,
                       config: NPUConfig = DEFAULT, checkpoints=False) -> GoldenResult:
    """Run the bit-exact FlashAttention model.

    Parameters
    ----------
    q : float16 [heads, seq_q, head_dim]
    k, v : float16 [kv_heads, seq_kv, head_dim]; heads % kv_heads == 0
    causal : bool, bottom-right aligned
    mask : bool [seq_q, seq_kv] or [heads, seq_q, seq_kv], True = may attend
    kv_valid_len : int, optional; keys at or beyond it are invisible
    scale : float, optional, default 1/sqrt(head_dim)
    config : NPUConfig; uses ``bc``, ``array_cols`` and ``max_head_dim``
    checkpoints : bool; keep a ``TileCheckpoint`` per kv tile

    Returns
    -------
    GoldenResult

    Raises
    ------
    ValueError
        for inputs that are not float16, bad shapes, head_dim outside
        1..max_head_dim, or a scale outside ``numerics.scale_range(head_dim)``.
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        if np.asarray(a).dtype != np.float16:
            raise ValueError(f"{name} must be float16, not {np.asarray(a).dtype}")
    heads, kv_heads, seq_q, seq_kv, d = check_shapes(q, k, v, mask, kv_valid_len, config.max_head_dim)
    c = nx.scale_log2e(1.0 / math.sqrt(d) if scale is None else scale, d)
    vis = visible_mask(heads, seq_q, seq_kv, causal, mask, kv_valid_len)
    bc, cols = config.bc, config.array_cols
    n_kv = -(-seq_kv // bc)
    pad = n_kv * bc - seq_kv

    q16 = np.asarray(q, np.float16)
    kx = _expand_kv(np.asarray(k, np.float16), heads)
    vx = _expand_kv(np.asarray(v, np.float16), heads)
    # Padding keys hold zeros here; they are masked, and a masked key cannot
    # change a bit (its S becomes -inf, its P is 0 and its MAC is skipped).
    kx = np.concatenate([kx, np.zeros((heads, pad, d), np.float16)], axis=1)
    vx = np.concatenate([vx, np.zeros((heads, pad, d), np.float16)], axis=1)
    vis = np.concatenate([vis, np.zeros((heads, seq_q, pad), bool)], axis=2)

    m_i = np.full((heads, seq_q), -np.inf, np.float32)
    l_i = np.zeros((heads, seq_q), np.float32)
    o_acc = np.zeros((heads, seq_q, d), np.float32)
    cps = []
    q32 = q16.astype(np.float32)
    for j in range(n_kv):
        ks = slice(j * bc, (j + 1) * bc)
        kt = kx[:, ks].astype(np.float32)           # [h, Bc, d]
        vt = vx[:, ks]                              # [h, Bc, d] float16
        vt_vis = vis[:, :, ks]                      # [h, seq_q, Bc]
        # S = Q K^T, one MAC per k in order (FP16 products are exact in FP32).
        s_raw = np.zeros((heads, seq_q, bc), np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            for kk in range(d):
                s_raw = nx.add32(s_raw, q32[:, :, kk, None] * kt[:, None, :, kk])
        s = np.where(vt_vis, nx.mul32(s_raw, c), np.float32(-np.inf)).astype(np.float32)
        m_tile = nx.tree_reduce(s, cols, nx.max32)
        m_new = nx.max32(m_i, m_tile)
        empty = np.isneginf(m_new)
        alpha = np.where(empty, np.float32(1), nx.exp2(nx.sub32(m_i, m_new))).astype(np.float32)
        p32 = np.where(empty[..., None], np.float32(0), nx.exp2(nx.sub32(s, m_new[..., None])))
        p16 = nx.to_fp16(p32)
        l_tile = nx.tree_reduce(p16.astype(np.float32), cols, nx.add32)
        l_i = nx.add32(nx.mul32(alpha, l_i), l_tile)
        o_acc = nx.mul32(alpha[..., None], o_acc)
        for kk in range(bc):
            pk = p16[:, :, kk]
            upd = nx.mac(o_acc, pk[..., None], vt[:, None, kk, :])
            o_acc = np.where((pk != 0)[..., None], upd, o_acc)
        m_i = m_new
        if checkpoints:
            cps.append(TileCheckpoint(j, s_raw, s, p16, m_i.copy(), l_i.copy(), o_acc.copy()))

    r = nx.recip32(l_i)
    with np.errstate(invalid="ignore"):
        o = np.where((l_i == 0)[..., None], np.float32(0), nx.mul32(o_acc, r[..., None])).astype(np.float32)
    stats = op_counts(heads, seq_q, seq_kv, d, config)
    return GoldenResult(o=o, m_i=m_i, l_i=l_i, checkpoints=cps, stats=stats)
