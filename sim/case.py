"""Attention cases: the public ``.npz`` file contract, its validation, and
seeded random cases.

File contract (stable)
----------------------
Input ``.npz``:

==============  =========================================  ========
key             meaning                                    required
==============  =========================================  ========
q               float16 [heads, seq_q, head_dim]            yes
k, v            float16 [kv_heads, seq_kv, head_dim]        yes
causal          bool scalar, bottom-right aligned           no
mask            bool [seq_q, seq_kv] or [heads, seq_q,      no
                seq_kv], True = may attend
kv_valid_len    int scalar, keys at or past it are hidden   no
scale           float scalar, default 1/sqrt(head_dim)      no
==============  =========================================  ========

Output ``.npz``: ``o`` float32 [heads, seq_q, head_dim] plus the run
statistics as scalars (``stats_json`` holds all of them as one JSON string).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashnpu.config import NPUConfig
from flashnpu.golden.reference import check_shapes, visible_mask

__all__ = ["AttentionCase", "CaseError", "load_case", "random_case", "save_result"]


class CaseError(ValueError):
    """A malformed case; the message names the problem."""


@dataclass
class AttentionCase:
    """One attention job: operands and options (see the module docstring)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool = False
    mask: np.ndarray | None = None
    kv_valid_len: int | None = None
    scale: float | None = None

    @property
    def shape(self) -> dict:
        h, sq, d = self.q.shape
        kvh, skv, _ = self.k.shape
        return dict(heads=h, kv_heads=kvh, seq_q=sq, seq_kv=skv, head_dim=d)

    def kwargs(self) -> dict:
        """Keyword arguments for ``reference_attention`` / ``flash_attention_hw``."""
        return dict(causal=self.causal, mask=self.mask, kv_valid_len=self.kv_valid_len, scale=self.scale)

    def validate(self, config: NPUConfig) -> "AttentionCase":
        """Check dtypes, shapes, hardware limits and finiteness of visible data.

        Raises
        ------
        CaseError naming the bad array or value.
        """
        for name in ("q", "k", "v"):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray):
                raise CaseError(f"{name} must be an array, not {type(a).__name__}")
            if a.dtype != np.float16:
                raise CaseError(f"{name} must be float16, not {a.dtype}")
        try:
            h, kvh, sq, skv, d = check_shapes(self.q, self.k, self.v, self.mask, self.kv_valid_len,
                                              config.max_head_dim)
        except ValueError as e:
            raise CaseError(str(e)) from None
        if self.scale is not None:
            s = float(self.scale)
            if not np.isfinite(s) or s <= 0:
                raise CaseError(f"scale must be a positive finite number, not {self.scale!r}")
        vis = visible_mask(h, sq, skv, self.causal, self.mask, self.kv_valid_len)
        group = h // kvh
        q_used = vis.any(-1)                                    # [h, sq]
        kv_used = vis.any(1).reshape(kvh, group, skv).any(1)    # [kvh, skv]
        for name, a, used in (("q", self.q, q_used), ("k", self.k, kv_used), ("v", self.v, kv_used)):
            bad = ~np.isfinite(a) & used[..., None]
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                kind = "NaN" if np.isnan(a[idx]) else "Inf"
                raise CaseError(f"{name} holds {kind} at visible position {idx}")
        return self


def _scalar(z, key, kind):
    a = np.asarray(z[key])
    if a.ndim != 0:
        raise CaseError(f"{key} must be a scalar, not shape {a.shape}")
    if kind is bool:
        if a.dtype != np.bool_ and not (np.issubdtype(a.dtype, np.integer) and int(a) in (0, 1)):
            raise CaseError(f"causal must be bool, not {a.dtype} {a!r}")
        return bool(a)
    if kind is int:
        if not np.issubdtype(a.dtype, np.integer):
            raise CaseError(f"kv_valid_len must be an integer, not {a.dtype}")
        if int(a) < 0:
            raise CaseError(f"kv_valid_len must be >= 0, not {int(a)}")
        return int(a)
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise CaseError(f"{key} must be a number, not {a.dtype}")
    return float(a)


def load_case(path, config: NPUConfig) -> AttentionCase:
    """Read and validate an input ``.npz``.

    Raises
    ------
    CaseError for a missing file or array, unknown keys, or anything
    ``AttentionCase.validate`` rejects.
    """
    p = Path(path)
    if not p.is_file():
        raise CaseError(f"input file {str(p)!r} does not exist")
    try:
        z = np.load(p, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a usage error
        raise CaseError(f"cannot read {str(p)!r} as .npz: {e}") from None
    with z:
        keys = set(z.files)
        for need in ("q", "k", "v"):
            if need not in keys:
                raise CaseError(f"{str(p)!r} has no array {need!r} (it has {sorted(keys)})")
        unknown = keys - {"q", "k", "v", "causal", "mask", "kv_valid_len", "scale"}
        if unknown:
            raise CaseError(f"{str(p)!r} has unknown keys {sorted(unknown)}")
        case = AttentionCase(
            q=z["q"], k=z["k"], v=z["v"],
            causal=_scalar(z, "causal", bool) if "causal" in keys else False,
            mask=z["mask"] if "mask" in keys else None,
            kv_valid_len=_scalar(z, "kv_valid_len", int) if "kv_valid_len" in keys else None,
            scale=_scalar(z, "scale", float) if "scale" in keys else None,
        )
    return case.validate(config)


def random_case(heads=2, kv_heads=None, seq_q=256, seq_kv=None, head_dim=128, causal=True,
                seed=0, config: NPUConfig | None = None) -> AttentionCase:
    """A seeded random case: q, k, v ~ N(0, 1) rounded to float16."""
    kv_heads = heads if kv_heads is None else kv_heads
    seq_kv = seq_q if seq_kv is None else seq_kv
    rng = np.random.default_rng(seed)
    case = AttentionCase(
        q=rng.standard_normal((heads, seq_q, head_dim)).astype(np.float16),
        k=rng.standard_normal((kv_heads, seq_kv, head_dim)).astype(np.float16),
        v=rng.standard_normal((kv_heads, seq_kv, head_dim)).astype(np.float16),
        causal=causal)
    if config is not None:
        case.validate(config)
    return case


def save_result(path, o: np.ndarray, stats: dict) -> None:
    """Write ``o`` and ``stats`` to ``path`` atomically (temp file + rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"o": np.asarray(o, np.float32), "stats_json": np.array(json.dumps(stats))}
    for key, val in stats.items():
        if isinstance(val, (int, float, bool)) and not isinstance(val, bool):
            arrays[key] = np.array(val)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
