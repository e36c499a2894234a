"""Float reference attention: the statement of intent.

``reference_attention`` is float64 softmax(Q Kᵀ · scale + mask) V over the
visible keys, for grouped-query shapes.  ``plain_fp16_attention`` is the
ordinary FP16-input / FP32-accumulate implementation that the tolerance rule
of the bit-exact model is measured against.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["visible_mask", "reference_attention", "plain_fp16_attention", "check_shapes"]


def check_shapes(q, k, v, mask=None, kv_valid_len=None, max_head_dim=None):
    """Validate attention operands; return (heads, kv_heads, seq_q, seq_kv, head_dim).

    Raises
    ------
    ValueError
        naming the bad array or value: wrong rank, shape mismatch, heads not a
        multiple of kv_heads, zero lengths, head_dim 0 or above
        ``max_head_dim``, a mask of the wrong shape or dtype, a negative
        kv_valid_len.
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        if np.ndim(a) != 3:
            raise ValueError(f"{name} must have 3 dimensions [heads, seq, head_dim], not shape {np.shape(a)}")
    heads, seq_q, head_dim = np.shape(q)
    kv_heads, seq_kv, dk = np.shape(k)
    if np.shape(v) != np.shape(k):
        raise ValueError(f"v shape {np.shape(v)} differs from k shape {np.shape(k)}")
    if dk != head_dim:
        raise ValueError(f"k head_dim {dk} differs from q head_dim {head_dim}")
    if heads == 0 or kv_heads == 0:
        raise ValueError(f"heads={heads} and kv_heads={kv_heads} must be positive")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if seq_q == 0 or seq_kv == 0:
        raise ValueError(f"seq_q={seq_q} and seq_kv={seq_kv} must be positive")
    if head_dim == 0:
        raise ValueError("head_dim=0: a head needs at least one dimension")
    if max_head_dim is not None and head_dim > max_head_dim:
        raise ValueError(f"head_dim={head_dim} is above the hardware maximum {max_head_dim}")
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise ValueError(f"mask must be bool (True = may attend), not {m.dtype}")
        if m.shape not in ((seq_q, seq_kv), (heads, seq_q, seq_kv)):
            raise ValueError(f"mask shape {m.shape} is neither ({seq_q}, {seq_kv}) nor ({heads}, {seq_q}, {seq_kv})")
    if kv_valid_len is not None:
        kvl = int(kv_valid_len)
        if kvl != kv_valid_len or kvl < 0:
            raise ValueError(f"kv_valid_len must be a non-negative int, not {kv_valid_len!r}")
    return heads, kv_heads, seq_q, seq_kv, head_dim


def visible_mask(heads, seq_q, seq_kv, causal=False, mask=None, kv_valid_len=None) -> np.ndarray:
    """Boolean [heads, seq_q, seq_kv]: True where query i may attend key j.

    Causal alignment is bottom-right: key j is visible to query i iff
    j <= i + seq_kv - seq_q.  ``mask`` (True = may attend) and
    ``kv_valid_len`` (keys j >= kv_valid_len are invisible) are combined with
    a logical and.
    """
    vis = np.ones((heads, seq_q, seq_kv), dtype=bool)
    j = np.arange(seq_kv)[None, :]
    i = np.arange(seq_q)[:, None]
    if causal:
        vis &= (j <= i + (seq_kv - seq_q))[None]
    if kv_valid_len is not None:
        vis &= (j < int(kv_valid_len))[None]
    if mask is not None:
        m = np.asarray(mask, bool)
        vis &= m if m.ndim == 3 else m[None]
    return vis


def _expand_kv(k, heads):
    group = heads // k.shape[0]
    return np.repeat(k, group, axis=0)          # head h uses kv head h // group


def reference_attention(q, k, v, causal=False, mask=None, kv_valid_len=None, scale=None) -> np.ndarray:
    """float64 attention over the visible keys.

    Parameters
    ----------
    q : array [heads, seq_q, head_dim] (any float dtype; taken exactly)
    k, v : array [kv_heads, seq_kv, head_dim]; heads % kv_heads == 0, query
        head h reads kv head h // (heads // kv_heads).
    causal : bool
        bottom-right causal alignment (see ``visible_mask``).
    mask : bool [seq_q, seq_kv] or [heads, seq_q, seq_kv], optional
    kv_valid_len : int, optional
    scale : float, optional (default 1/sqrt(head_dim))

    Returns
    -------
    ndarray float64 [heads, seq_q, head_dim]; rows with no visible key are 0.
    Invisible positions never reach the result, whatever they hold.
    """
    heads, kv_heads, seq_q, seq_kv, d = check_shapes(q, k, v, mask, kv_valid_len)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    vis = visible_mask(heads, seq_q, seq_kv, causal, mask, kv_valid_len)
    q64 = np.asarray(q, np.float64)
    k64 = _expand_kv(np.asarray(k, np.float64), heads)
    v64 = _expand_kv(np.asarray(v, np.float64), heads)
    # Zero invisible operands so that garbage (NaN, Inf) cannot leak through 0 * x.
    qz = np.where(vis.any(-1)[..., None], q64, 0.0)
    kz = np.where(vis.any(1)[..., None], k64, 0.0)
    vz = np.where(vis.any(1)[..., None], v64, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.einsum("hqd,hkd->hqk", qz, kz) * scale
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis, np.exp(s - m), 0.0)
    l = p.sum(-1, keepdims=True)
    o = np.einsum("hqk,hkd->hqd", p, vz)
    return np.where(l > 0, o / np.where(l > 0, l, 1.0), 0.0)


def plain_fp16_attention(q, k, v, causal=False, mask=None, kv_valid_len=None, scale=None) -> np.ndarray:
    """The ordinary FP16-input / FP32-accumulate attention, for the tolerance rule.

    S = Q Kᵀ in float32 from float16 inputs, softmax in float32, the
    normalized P rounded to float16, O = P V accumulated in float32 and
    returned as float16, as a PyTorch fp16 ``softmax(QKᵀ)V`` does.  This is
    the baseline ``out_pt`` of FlashAttention's own accuracy test
    (flash-attention ``tests/test_flash_attn.py``: error at most 2x that of
    ``out_pt``), except that S stays in float32 here where PyTorch rounds it
    to float16, which makes this baseline the stricter one.  Returns float32
    [heads, seq_q, head_dim] holding binary16 values; rows with no visible
    key are 0.
    """
    heads, kv_heads, seq_q, seq_kv, d = check_shapes(q, k, v, mask, kv_valid_len)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    vis = visible_mask(heads, seq_q, seq_kv, causal, mask, kv_valid_len)
    q32 = np.asarray(q, np.float16).astype(np.float32)
    k32 = _expand_kv(np.asarray(k, np.float16).astype(np.float32), heads)
    v32 = _expand_kv(np.asarray(v, np.float16).astype(np.float32), heads)
    q32 = np.where(vis.any(-1)[..., None], q32, 0)
    k32 = np.where(vis.any(1)[..., None], k32, 0)
    v32 = np.where(vis.any(1)[..., None], v32, 0)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.matmul(q32, np.swapaxes(k32, -1, -2)) * np.float32(scale)
    s = np.where(vis, s, -np.inf).astype(np.float32)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(np.float32)
    with np.errstate(over="ignore"):
        # at the largest legal scales s - m can overflow to -inf, whose exp is the right 0
        p = np.where(vis, np.exp(s - m), 0).astype(np.float32)
    l = p.sum(-1, keepdims=True, dtype=np.float32)
    p16 = (p / np.where(l > 0, l, 1)).astype(np.float16)
    o = np.matmul(p16.astype(np.float32), v32)
    return np.where(l > 0, o, 0).astype(np.float16).astype(np.float32)
