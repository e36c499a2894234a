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

``scale`` must lie in ``flashnpu.golden.numerics.scale_range(head_dim)``
(about 8.15e-39 .. 4.29e26 at head_dim 128): outside it the score constant
is not a binary32 normal or the scores can overflow.  A case whose working
memory (``case_bytes``) exceeds ``flashnpu.resources.memory_limit()`` is
refused before anything of that size is allocated.

Output ``.npz``: ``o`` float32 [heads, seq_q, head_dim] plus the run
statistics as scalars (``stats_json`` holds all of them as one JSON string).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashnpu.config import NPUConfig
from flashnpu.errors import UsageError
from flashnpu.golden import numerics as nx
from flashnpu.golden.compare import tolerance_check
from flashnpu.golden.reference import check_shapes, plain_fp16_attention, reference_attention, visible_mask
from flashnpu.paths import atomic_write, input_file
from flashnpu.resources import check_memory

__all__ = ["AttentionCase", "CaseError", "load_case", "random_case", "save_result", "case_bytes",
           "check_case_size", "first_nonfinite"]

#: Working bytes per (head, query, key) score of ``flashnpu sim``: the dense
#: visibility masks and the float64 / float32 score, probability and
#: exponent arrays of the reference checks.
BYTES_PER_SCORE = 48
#: Working bytes per element of q, k, v and O (their float16/32/64 copies).
BYTES_PER_OPERAND = 32


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

    def float_rule(self, o):
        """``golden.tolerance_check`` of output ``o`` against this case's
        float64 reference and plain FP16 attention: (ok, message, stats,
        plain stats).

        Raises
        ------
        flashnpu.golden.ComparisonError
            when ``o`` holds NaN or Inf, or has the wrong shape.
        """
        kw = self.kwargs()
        return tolerance_check(o, plain_fp16_attention(self.q, self.k, self.v, **kw),
                               reference_attention(self.q, self.k, self.v, **kw))

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
            try:
                nx.scale_log2e(float(self.scale), d)
            except ValueError as e:
                raise CaseError(str(e)) from None
        check_case_size(h, kvh, sq, skv, d, config)
        vis = visible_mask(h, sq, skv, self.causal, self.mask, self.kv_valid_len)
        group = h // kvh
        q_used = vis.any(-1)                                    # [h, sq]
        kv_used = vis.any(1).reshape(kvh, group, skv).any(1)    # [kvh, skv]
        bad = first_nonfinite((("q", self.q, q_used), ("k", self.k, kv_used), ("v", self.v, kv_used)))
        if bad:
            raise CaseError(bad)
        return self


def first_nonfinite(arrays) -> str | None:
    """The first NaN or Inf at a used position, as a message, or None.

    ``arrays``: (name, array [..., n, head_dim], used bool [..., n]) triples.
    """
    for name, a, used in arrays:
        bad = ~np.isfinite(a) & np.asarray(used)[..., None]
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            kind = "NaN" if np.isnan(a[idx]) else "Inf"
            return f"{name} holds {kind} at visible position {idx}"
    return None


def case_bytes(heads, kv_heads, seq_q, seq_kv, head_dim, config: NPUConfig) -> int:
    """Estimated peak working memory of checking one case (``flashnpu sim``)."""
    skv_pad = -(-seq_kv // config.bc) * config.bc
    return (heads * seq_q * skv_pad * BYTES_PER_SCORE
            + (heads * (seq_q + 2 * skv_pad) + kv_heads * 2 * seq_kv) * head_dim * BYTES_PER_OPERAND)


def check_case_size(heads, kv_heads, seq_q, seq_kv, head_dim, config: NPUConfig) -> None:
    """Raise ``CaseError`` when a case of these sizes needs more memory than
    ``flashnpu.resources.memory_limit()`` allows."""
    try:
        check_memory(case_bytes(heads, kv_heads, seq_q, seq_kv, head_dim, config),
                     f"a case of heads={heads}, seq_q={seq_q}, seq_kv={seq_kv}, head_dim={head_dim}")
    except ValueError as e:
        raise CaseError(str(e)) from None


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
    if not p.exists():
        raise CaseError(f"input file {str(p)!r} does not exist")
    try:
        input_file(p, "input file", kind="npz")
    except UsageError as e:
        raise CaseError(str(e)) from None
    try:
        z = np.load(p, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a usage error
        raise CaseError(f"cannot read {str(p)!r} as .npz: {e}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise CaseError(f"{str(p)!r} is not an .npz archive")
    with z:
        keys = set(z.files)
        for need in ("q", "k", "v"):
            if need not in keys:
                raise CaseError(f"{str(p)!r} has no array {need!r} (it has {sorted(keys)})")
        unknown = keys - {"q", "k", "v", "causal", "mask", "kv_valid_len", "scale"}
        if unknown:
            raise CaseError(f"{str(p)!r} has unknown keys {sorted(unknown)}")
        arrays = {}
        for key in sorted(keys):
            try:
                arrays[key] = z[key]
            except ValueError as e:
                if "allow_pickle" in str(e):
                    raise CaseError(f"{str(p)!r}: array {key!r} holds Python objects (dtype object); "
                                    "a case holds only numeric and bool arrays") from None
                raise CaseError(f"cannot read array {key!r} of {str(p)!r}: {e}") from None
            except Exception as e:  # noqa: BLE001 - a damaged member is a usage error
                raise CaseError(f"cannot read array {key!r} of {str(p)!r}: {type(e).__name__}: {e}") from None
    case = AttentionCase(
        q=arrays["q"], k=arrays["k"], v=arrays["v"],
        causal=_scalar(arrays, "causal", bool) if "causal" in keys else False,
        mask=arrays.get("mask"),
        kv_valid_len=_scalar(arrays, "kv_valid_len", int) if "kv_valid_len" in keys else None,
        scale=_scalar(arrays, "scale", float) if "scale" in keys else None,
    )
    return case.validate(config)


def random_case(heads=2, kv_heads=None, seq_q=256, seq_kv=None, head_dim=128, causal=True,
                seed=0, config: NPUConfig | None = None) -> AttentionCase:
    """A seeded random case: q, k, v ~ N(0, 1) rounded to float16.

    Raises
    ------
    CaseError
        a size that is not a positive int, a negative seed, or (with
        ``config``) a case larger than the memory limit -- before anything
        is allocated.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    seq_kv = seq_q if seq_kv is None else seq_kv
    for name, val in (("heads", heads), ("kv_heads", kv_heads), ("seq_q", seq_q), ("seq_kv", seq_kv),
                      ("head_dim", head_dim)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val <= 0:
            raise CaseError(f"{name} must be a positive int, not {val!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise CaseError(f"seed must be an int >= 0, not {seed!r}")
    if heads % kv_heads:
        raise CaseError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if config is not None:
        if head_dim > config.max_head_dim:
            raise CaseError(f"head_dim={head_dim} is above the hardware maximum {config.max_head_dim}")
        check_case_size(heads, kv_heads, seq_q, seq_kv, head_dim, config)
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
    """Write ``o`` and ``stats`` to ``path`` whole (``flashnpu.paths.atomic_write``:
    temp file + rename, mode from the umask)."""
    p = Path(path)
    arrays = {"o": np.asarray(o, np.float32), "stats_json": np.array(json.dumps(stats))}
    for key, val in stats.items():
        if isinstance(val, (int, float, bool)) and not isinstance(val, bool):
            arrays[key] = np.array(val)
    with atomic_write(p, "wb", make_parent=True) as f:
        np.savez(f, **arrays)
