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

Split-K (``kv_splits = G``, the decode dataflow of ``docs/npu.md``): the kv
tiles are cut into G contiguous ranges of ceil(n_kv / G) tiles (trailing
ranges may be empty); each range runs the loop above from the empty state
(m = -inf, l = 0, O_acc = 0) into a :class:`Partial`, and the partials are
merged left to right, split 0 first (``merge_partials``)::

    m     = max32(m_a, m_b)                       -inf: both empty -> (0, -inf, 0)
    a_x   = exp2(m_x - m)                         0 for an empty x
    l     = add32(mul32(a_a, l_a), mul32(a_b, l_b))
    O_acc = add32(mul32(a_a, O_a), mul32(a_b, O_b))

before the one normalisation O = mul32(O_acc, recip32(l)).  The merge
order is part of the specification: a split job is bit-exact against this
model.  Against the unsplit model it differs by rounding only (each split
rounds its P to FP16 against its own running max), not bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from flashnpu.config import DEFAULT, NPUConfig

from . import numerics as nx
from .reference import _expand_kv, check_shapes, visible_mask

__all__ = ["TileCheckpoint", "GoldenResult", "Partial", "merge_partials", "flash_attention_hw", "op_counts"]


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
class Partial:
    """Unnormalised attention state of query rows over some of the keys:
    m [heads, seq_q] float32 running max (log2 units of the scaled scores,
    -inf: no visible key yet), l [heads, seq_q] float32 running sum,
    o_acc [heads, seq_q, head_dim] float32.  ``Partial.empty`` is the state
    before any key."""

    m: np.ndarray
    l: np.ndarray
    o_acc: np.ndarray

    @classmethod
    def empty(cls, heads: int, seq_q: int, head_dim: int) -> "Partial":
        return cls(np.full((heads, seq_q), -np.inf, np.float32), np.zeros((heads, seq_q), np.float32),
                   np.zeros((heads, seq_q, head_dim), np.float32))

    def output(self) -> np.ndarray:
        """O = mul32(O_acc, recip32(l)), 0 where l = 0: float32 [heads, seq_q, head_dim]."""
        r = nx.recip32(self.l)
        with np.errstate(invalid="ignore"):
            return np.where((self.l == 0)[..., None], np.float32(0),
                            nx.mul32(self.o_acc, r[..., None])).astype(np.float32)

    def lse(self) -> np.ndarray:
        """Natural-log log-sum-exp of the rows' visible scaled scores,
        float64 [heads, seq_q]: m ln 2 + ln l; -inf for a row with no
        visible key (never +inf or NaN)."""
        m = self.m.astype(np.float64)
        l64 = self.l.astype(np.float64)
        out = np.full(m.shape, -np.inf)
        ok = l64 > 0
        out[ok] = m[ok] * math.log(2.0) + np.log(l64[ok])
        return out


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Merge two partials over disjoint key ranges (module docstring), in
    the FP32 arithmetic of ``numerics``.  Two empty rows merge to exactly
    (O_acc = 0, m = -inf, l = 0); an empty side contributes exactly 0, so
    merging with an empty partial leaves m and l bit for bit.

    Raises ValueError when the shapes differ."""
    if a.o_acc.shape != b.o_acc.shape or a.m.shape != b.m.shape:
        raise ValueError(f"partials of different shapes: {a.o_acc.shape} and {b.o_acc.shape}")
    m = nx.max32(a.m, b.m)
    empty = np.isneginf(m)

    def weight(mx):
        with np.errstate(invalid="ignore"):
            return np.where(np.isneginf(mx), np.float32(0), nx.exp2(nx.sub32(mx, m))).astype(np.float32)
    wa, wb = weight(a.m), weight(b.m)
    l_new = nx.add32(nx.mul32(wa, a.l), nx.mul32(wb, b.l))
    o_new = nx.add32(nx.mul32(wa[..., None], a.o_acc), nx.mul32(wb[..., None], b.o_acc))
    return Partial(np.where(empty, np.float32(-np.inf), m).astype(np.float32),
                   np.where(empty, np.float32(0), l_new).astype(np.float32),
                   np.where(empty[..., None], np.float32(0), o_new).astype(np.float32))


@dataclass
class GoldenResult:
    """Output of ``flash_attention_hw``.

    o : float32 [heads, seq_q, head_dim]
    m_i, l_i : float32 [heads, seq_q] final running max (log2 domain) and sum
    checkpoints : list of TileCheckpoint, one per kv tile (empty unless asked)
    stats : dict of op counts (see ``op_counts``)
    partials : list of Partial, one per kv split (empty for an unsplit job)
    """

    o: np.ndarray
    m_i: np.ndarray
    l_i: np.ndarray
    checkpoints: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    partials: list = field(default_factory=list)

    def lse(self) -> np.ndarray:
        """Natural-log log-sum-exp per row, float64 [heads, seq_q] (``Partial.lse``)."""
        return Partial(self.m_i, self.l_i, np.zeros(self.m_i.shape + (0,), np.float32)).lse()


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
                       config: NPUConfig = DEFAULT, checkpoints=False, kv_splits: int = 1) -> GoldenResult:
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
    checkpoints : bool; keep a ``TileCheckpoint`` per kv tile (within a
        split, the split's own running state)
    kv_splits : int >= 1; split-K over this many contiguous kv-tile ranges,
        merged left to right (module docstring)

    Returns
    -------
    GoldenResult

    Raises
    ------
    ValueError
        for inputs that are not float16, bad shapes, head_dim outside
        1..max_head_dim, a scale outside ``numerics.scale_range(head_dim)``,
        or kv_splits < 1.
    """
    if isinstance(kv_splits, bool) or not isinstance(kv_splits, (int, np.integer)) or kv_splits < 1:
        raise ValueError(f"kv_splits must be an int >= 1, not {kv_splits!r}")
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

    cps = []
    q32 = q16.astype(np.float32)
    per = -(-n_kv // kv_splits)
    parts = [_tile_loop(q32, kx, vx, vis, c, cols, bc, range(s * per, min((s + 1) * per, n_kv)),
                        cps if checkpoints else None) for s in range(kv_splits)]
    total = parts[0]
    for p in parts[1:]:
        total = merge_partials(total, p)
    stats = op_counts(heads, seq_q, seq_kv, d, config)
    return GoldenResult(o=total.output(), m_i=total.m, l_i=total.l, checkpoints=cps, stats=stats,
                        partials=parts if kv_splits > 1 else [])


def _tile_loop(q32, kx, vx, vis, c, cols, bc, tiles, cps) -> Partial:
    """The tile loop of the module docstring over kv tiles ``tiles`` from the
    empty state; appends a TileCheckpoint per tile to ``cps`` unless None."""
    heads, seq_q, d = q32.shape
    m_i = np.full((heads, seq_q), -np.inf, np.float32)
    l_i = np.zeros((heads, seq_q), np.float32)
    o_acc = np.zeros((heads, seq_q, d), np.float32)
    for j in tiles:
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
        if cps is not None:
            cps.append(TileCheckpoint(j, s_raw, s, p16, m_i.copy(), l_i.copy(), o_acc.copy()))
    return Partial(m_i, l_i, o_acc)
