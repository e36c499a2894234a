"""The driver API refuses malformed calls with a ValueError naming the value,
before anything is written to the KV cache or sent to the NPU."""

from __future__ import annotations

import numpy as np
import pytest

from flashnpu.config import small_config
from flashnpu.driver.runtime import CacheConfig, CacheFullError, Decoder, KVCache
from flashnpu.driver.transport import AttentionJob, GoldenTransport

from .test_driver_runtime import tiny_model

NPU = small_config()


def _job(**changes):
    q = np.zeros((2, 1, 8), np.float16)
    kv = np.ones((1, 6, 8), np.float16)
    args = dict(layer=0, q=q, k=kv, v=kv, mask=np.array([[True] * 4 + [False] * 2]), scale=0.35,
                q_offset=3, kv_valid_len=4)
    args.update(changes)
    return AttentionJob(**args)


@pytest.mark.parametrize("changes, words", [
    (dict(layer=-1), "job.layer must be an int >= 0, not -1"),
    (dict(q_offset=-2), "job.q_offset must be an int >= 0, not -2"),
    (dict(kv_valid_len=7), "job.kv_valid_len must be an int >= 0 and <= the window 6, not 7"),
    (dict(scale=1e28), "scale=1e+28 is above"),
    (dict(scale=float("nan")), "not nan"),
])
def test_job_fields(changes, words):
    with pytest.raises(ValueError) as e:
        _job(**changes)
    assert words in str(e.value)


def test_nan_in_visible_k_is_refused_and_in_hidden_k_accepted():
    k = np.ones((1, 6, 8), np.float16)
    k[0, 2, 5] = np.nan
    with pytest.raises(ValueError, match=r"job.k holds NaN at visible position \(0, 2, 5\)"):
        _job(k=k)
    v = np.ones((1, 6, 8), np.float16)
    v[0, 1, 0] = np.inf
    with pytest.raises(ValueError, match=r"job.v holds Inf at visible position \(0, 1, 0\)"):
        _job(v=v)
    hidden = np.ones((1, 6, 8), np.float16)
    hidden[0, 5] = np.nan                                  # slot 5 is masked
    res = GoldenTransport(NPU).run(_job(k=hidden, v=hidden))
    assert np.isfinite(res.o).all()


def test_kv_cache_layer_and_slots():
    c = KVCache(n_layers=2, kv_heads=1, capacity=8, head_dim=4)
    k = np.ones((1, 2, 4), np.float16)
    for layer in (-1, 2, 1.0):
        with pytest.raises(ValueError, match=f"layer must be an int in 0..1, not {layer!r}"):
            c.write(layer, 0, k, k)
    with pytest.raises(ValueError, match="start slot must be an int >= 0, not -1"):
        c.write(0, -1, k, k)
    with pytest.raises(CacheFullError, match="writing slots 7..8 would pass the KV capacity 8"):
        c.write(0, 7, k, k)
    with pytest.raises(ValueError, match=r"v must be \[kv_heads=1, n, head_dim=4\]"):
        c.write(0, 0, k, np.ones((1, 2, 5), np.float16))
    with pytest.raises(ValueError, match="start slot must be an int in 0..8, not 9"):
        c.commit(9, 1)
    with pytest.raises(CacheFullError, match="slots 6..8 pass the KV capacity 8"):
        c.commit(6, 3)
    assert c.write_bytes == 0 and not c.writes.any() and not c.k.any() and not c.valid.any()


def test_cache_beyond_context_or_memory(monkeypatch):
    m = tiny_model()
    cap = m.hparams.context_length
    with pytest.raises(ValueError, match=f"KV capacity {cap + 1} .* above the model's context length {cap}"):
        Decoder(m, GoldenTransport(NPU), CacheConfig(max_prompt_len=cap, min_response_len=1))
    monkeypatch.setenv("FLASHNPU_MEMORY_LIMIT", "1M")
    with pytest.raises(ValueError, match=r"a KV cache of capacity 100000 .* needs about .* more than the 1.0 MiB"):
        KVCache(n_layers=30, kv_heads=3, capacity=100_000, head_dim=64)
