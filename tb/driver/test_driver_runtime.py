"""Host-driver logic on a tiny random Llama model: KV cache, masks, positions,
chunked prefill (cases D1-D3 of shared/cases), generate variants, stops, job
grouping and the backend registry.

The model here has random weights and the NPU a small configuration (Bc = 8),
so windows cross several kv tiles and every run takes milliseconds.  The
forward pass this file checks the driver against (``reference_logits``) is
written here from the Llama equations, recomputes the whole sequence each
time and shares no code with the driver's cache logic; the SmolLM2 tests
import it too.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashnpu.config import small_config
from flashnpu.driver import transport as transport_mod
from flashnpu.driver.model import LayerWeights, LlamaHParams, LlamaModel
from flashnpu.driver.runtime import BatchDecoder, CacheConfig, CacheFullError, Decoder, StopReason
from flashnpu.driver.transport import (
    AttentionJob,
    BackendUnavailable,
    GoldenTransport,
    JobResult,
    backend_names,
    job_bytes,
    make_transport,
    pack_query_groups,
    register_backend,
)
from flashnpu.golden import flash_attention_hw
from flashnpu.sim import runner

NPU = small_config()          # 4x4 array, Br = Bc = 8


# ------------------------------------------------------------ reference model
def reference_logits(model: LlamaModel, ids) -> np.ndarray:
    """Logits float32 [vocab] after the last of ``ids``, by a full recompute.

    float32 numpy for norms, projections and the MLP; RoPE through complex
    rotation of adjacent pairs; attention in float64 over q, k, v rounded to
    float16 (what the NPU's DRAM holds), causal softmax over the whole
    sequence, query head h reading kv head h // group.  No KV cache, no
    chunks, no masks over slots.
    """
    hp = model.hparams
    ids = np.asarray(ids)
    n = len(ids)
    f32 = np.float32

    def norm(x, w):
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + f32(hp.rms_eps))).astype(f32) * w

    pos = np.arange(n, dtype=np.float64)
    theta = hp.rope_base ** (-np.arange(0, hp.n_rot, 2, dtype=np.float64) / hp.n_rot)
    rot = np.exp(1j * pos[:, None, None] * theta[None, None, :])        # [n, 1, n_rot/2]

    def rope(x):                                                           # x [n, heads, d]
        z = (x[..., 0:hp.n_rot:2].astype(np.float64) + 1j * x[..., 1:hp.n_rot:2]) * rot
        y = x.copy()
        y[..., 0:hp.n_rot:2] = z.real
        y[..., 1:hp.n_rot:2] = z.imag
        return y

    causal = np.tril(np.ones((n, n), bool))
    x = model.tok_embd[ids].astype(f32)
    for lw in model.layers:
        h = norm(x, lw.attn_norm)
        q = rope((h @ lw.wq.T).reshape(n, hp.n_heads, hp.head_dim))
        k = rope((h @ lw.wk.T).reshape(n, hp.n_kv_heads, hp.head_dim))
        v = (h @ lw.wv.T).reshape(n, hp.n_kv_heads, hp.head_dim)
        q, k, v = (a.astype(np.float16).astype(np.float64) for a in (q, k, v))
        out = np.empty((n, hp.n_heads, hp.head_dim))
        for head in range(hp.n_heads):
            g = head // (hp.n_heads // hp.n_kv_heads)
            s = q[:, head] @ k[:, g].T / np.sqrt(hp.head_dim)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
        x = x + out.reshape(n, -1).astype(f32) @ lw.wo.T
        h = norm(x, lw.ffn_norm)
        gate = h @ lw.w_gate.T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ lw.w_up.T)) @ lw.w_down.T
    out_w = model.tok_embd if model.output is None else model.output
    return (norm(x[-1:], model.output_norm) @ out_w.T)[0].astype(f32)


def assert_logits_close(actual, desired, rel=1e-4):
    """|actual - desired| <= rel * max|desired| elementwise.

    Chunked and unchunked prefill differ only in the batch size of the host's
    matmuls, which accumulate in float64 and round once (``LlamaModel._linear``),
    so they are almost always bit-identical: a float64 blocking difference
    changes a float32 result only when it sits within ~1e-16 of a rounding
    boundary, and the FP16 KV cache can carry that last bit on.  A wrong
    position, mask or slot moves logits by O(1).
    """
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.shape == desired.shape
    assert np.isfinite(actual).all() and np.isfinite(desired).all()
    np.testing.assert_allclose(actual, desired, rtol=0, atol=rel * float(np.abs(desired).max()))


def reference_greedy(model, prompt_ids, steps) -> list:
    ids = list(prompt_ids)
    for _ in range(steps):
        ids.append(int(np.argmax(reference_logits(model, ids))))
    return ids[len(prompt_ids):]


# ------------------------------------------------------------ tiny model
def tiny_model(seed=0, n_layers=2, d_model=32, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=48, vocab=97):
    rng = np.random.default_rng(seed)
    hp = LlamaHParams(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, d_ff=d_ff, vocab_size=vocab, rms_eps=1e-5, rope_base=10000.0)

    def w(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def nw():
        return (1 + 0.1 * rng.standard_normal(d_model)).astype(np.float32)

    layers = [LayerWeights(attn_norm=nw(), wq=w(n_heads * head_dim, d_model, 2.0),
                           wk=w(n_kv_heads * head_dim, d_model, 2.0), wv=w(n_kv_heads * head_dim, d_model),
                           wo=w(d_model, n_heads * head_dim), ffn_norm=nw(), w_gate=w(d_ff, d_model),
                           w_up=w(d_ff, d_model), w_down=w(d_model, d_ff))
              for _ in range(n_layers)]
    return LlamaModel(hp, w(vocab, d_model, np.sqrt(d_model)), layers, nw())


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


class RecordingTransport(GoldenTransport):
    """Golden backend that keeps a copy of every job the driver gave it
    (before ``pack_query_groups``)."""

    def __init__(self, config=NPU):
        super().__init__(config)
        self.jobs = []

    def _keep(self, job):
        self.jobs.append(AttentionJob(job.layer, job.q.copy(), job.k.copy(), job.v.copy(), job.mask.copy(),
                                      job.scale, job.q_offset, job.kv_valid_len))

    def run(self, job):
        self._keep(job)
        return super().run(job)

    def run_many(self, jobs):
        for job in jobs:
            self._keep(job)
        return super().run_many(jobs)


def decoder(model, max_prompt_len=16, min_response_len=8, chunk=64, variants=None, transport=None, **kw):
    cache = CacheConfig(max_prompt_len=max_prompt_len, min_response_len=min_response_len,
                        prefill_chunk_size=chunk, variants=variants)
    return Decoder(model, transport or GoldenTransport(NPU), cache, **kw)


def prompt(n, seed=1, vocab=97):
    return [int(i) for i in np.random.default_rng(seed).integers(0, vocab, n)]


# ------------------------------------------------------------ the reference itself
def test_reference_rope_matches_real_rotation_of_adjacent_pairs(tiny):
    """The driver's RoPE rotates (x[2i], x[2i+1]) by pos * base^(-2i/d): check one pair by hand."""
    x = np.zeros((1, 2, tiny.hparams.head_dim), np.float32)
    x[0, :, 2], x[0, :, 3] = 1.0, 0.0                         # pair i = 1
    y = tiny.rope(x, np.array([0, 5]))
    ang = 5 * 10000.0 ** (-2 / tiny.hparams.head_dim)
    np.testing.assert_allclose(y[0, 1, 2:4], [np.cos(ang), np.sin(ang)], rtol=1e-6)
    np.testing.assert_array_equal(y[0, 0], x[0, 0])           # position 0: no rotation
    assert np.all(y[0, 1, 4:] == 0) and np.all(y[0, 1, :2] == 0)


def test_driver_matches_reference_forward(tiny):
    d = decoder(tiny, max_prompt_len=20, min_response_len=12, chunk=7)
    p = prompt(13)
    res = d.generate(p, 10, stop_ids=())
    assert res.tokens == reference_greedy(tiny, p, 10)
    ids = p + res.tokens
    for s in (0, 4, 9):
        np.testing.assert_allclose(res.logits[s], reference_logits(tiny, ids[:len(p) + s]), rtol=0, atol=2e-2)


# ------------------------------------------------------------ D1 / D2 chunked prefill
def test_d1_chunked_prefill_positions_150_tokens(tiny):
    """D1: 150 tokens, chunk 64 -> positions 0-63, 64-127, 128-149; next logits as unchunked; next token at 150."""
    p = prompt(150, seed=2)
    chunked = decoder(tiny, max_prompt_len=150, min_response_len=4, chunk=64)
    res = chunked.generate(p, 2, stop_ids=())
    pre = [r for r in res.trace if r.kind == "prefill"]
    assert [r.positions.tolist() for r in pre] == [list(range(0, 64)), list(range(64, 128)), list(range(128, 150))]
    assert [r.slot_start for r in pre] == [0, 64, 128]
    gen = [r for r in res.trace if r.kind == "generate"]
    assert gen[0].positions.tolist() == [150] and gen[0].slot_start == 150
    whole = decoder(tiny, max_prompt_len=150, min_response_len=4, chunk=150)
    res1 = whole.generate(p, 2, stop_ids=())
    assert len([r for r in res1.trace if r.kind == "prefill"]) == 1
    assert_logits_close(res.logits, res1.logits)
    assert res.tokens == res1.tokens
    np.testing.assert_allclose(res.logits[0], reference_logits(tiny, p), atol=2e-2)


@pytest.mark.parametrize("n, last_chunk", [(64, 64), (128, 64), (129, 1)])
def test_d2_exact_multiple_of_chunk(tiny, n, last_chunk):
    p = prompt(n, seed=n)
    d = decoder(tiny, max_prompt_len=129, min_response_len=3, chunk=64)
    logits = d.prefill(p)
    sizes = [len(r.ids) for r in d.trace]
    assert sizes[-1] == last_chunk and sum(sizes) == n and all(s == 64 for s in sizes[:-1])
    # every slot 0..n-1 written exactly once in every layer, nothing beyond
    assert np.all(d.cache.writes[:, :n] == 1) and np.all(d.cache.writes[:, n:] == 0)
    assert d.cache.length == n and d.cache.valid[:n].all()
    whole = decoder(tiny, max_prompt_len=129, min_response_len=3, chunk=129)
    assert_logits_close(logits, whole.prefill(p))


def test_prefill_chunk_masks_are_causal_over_slots(tiny):
    t = RecordingTransport()
    d = decoder(tiny, max_prompt_len=20, min_response_len=4, chunk=8, transport=t)
    d.generate(prompt(19), 3, stop_ids=())
    assert {j.q.dtype for j in t.jobs} == {np.dtype(np.float16)}
    for job in t.jobs:
        i = np.arange(job.seq_q)[:, None]
        j = np.arange(job.window)[None, :]
        np.testing.assert_array_equal(job.mask, (j < job.kv_valid_len) & (j <= job.q_offset + i))
        assert job.heads == tiny.hparams.n_heads and job.kv_heads == tiny.hparams.n_kv_heads
    # prefill chunks of 8, 8, 3 rows, then one row per generate step, one job per layer each
    assert [j.seq_q for j in t.jobs[::tiny.hparams.n_layers]] == [8, 8, 3, 1, 1]
    assert [j.q_offset for j in t.jobs[::tiny.hparams.n_layers]] == [0, 8, 16, 19, 20]


# ------------------------------------------------------------ D3 capacity and stops
def test_d3_prompt_over_capacity_raises_naming_limits(tiny):
    d = decoder(tiny, max_prompt_len=16, min_response_len=8)
    with pytest.raises(ValueError, match=r"17 tokens.*max_prompt_len is 16.*capacity 24"):
        d.generate(prompt(17), 4)
    with pytest.raises(ValueError, match="empty"):
        d.prefill([])
    assert d.cache.writes.sum() == 0                 # nothing ran


def test_d3_generation_stops_when_cache_full_and_never_writes_slot_capacity(tiny):
    d = decoder(tiny, max_prompt_len=16, min_response_len=8)
    cap = d.capacity
    assert cap == 24
    written = []
    orig = d.cache.write
    d.cache.write = lambda layer, start, k, v: (written.append((start, k.shape[1])), orig(layer, start, k, v))
    res = d.generate(prompt(16), 1000, stop_ids=())
    assert res.stop_reason is StopReason.CACHE_FULL
    assert len(res.tokens) == cap - 16 + 1           # the last token comes from slot cap-1's logits
    assert max(s + n for s, n in written) == cap     # slots 0..cap-1 only
    assert np.all(d.cache.writes == 1) and d.cache.length == cap
    with pytest.raises(CacheFullError):
        d.step(res.tokens[-1])
    assert np.all(d.cache.writes == 1)


def test_stops_on_max_new_tokens_and_eos(tiny):
    d = decoder(tiny)
    p = prompt(5)
    res = d.generate(p, 4, stop_ids=())
    assert res.stop_reason is StopReason.MAX_NEW_TOKENS and len(res.tokens) == 4
    assert res.logits.shape == (4, tiny.hparams.vocab_size) and res.logits.dtype == np.float32
    eos = res.tokens[2]
    res2 = d.generate(p, 10, stop_ids=[eos])
    first = res.tokens.index(eos)
    assert res2.stop_reason is StopReason.EOS and res2.tokens == res.tokens[:first + 1]
    with pytest.raises(ValueError, match="max_new_tokens"):
        d.generate(p, 0)


# ------------------------------------------------------------ variants, garbage, grouping
def test_generate_variants_equal_largest_only(tiny):
    p = prompt(5, seed=7)
    small = decoder(tiny, max_prompt_len=16, min_response_len=12)          # variants 8, 16, 24, 28
    assert small.variants == (8, 16, 24, 28)
    big = decoder(tiny, max_prompt_len=16, min_response_len=12, variants=(28,))
    a = small.generate(p, 30, stop_ids=())
    b = big.generate(p, 30, stop_ids=())
    assert a.tokens == b.tokens and a.stop_reason is b.stop_reason is StopReason.CACHE_FULL
    np.testing.assert_array_equal(a.logits, b.logits)                       # bit-identical
    windows = [r.window for r in a.trace]
    assert windows == sorted(windows) and set(windows) == {8, 16, 24, 28}  # switched up as the cache filled
    assert all(r.window >= r.slot_start + len(r.ids) for r in a.trace)     # smallest that fits ...
    assert all(r.window == 8 or r.window - 8 < r.slot_start + len(r.ids) for r in a.trace if r.window != 28)
    assert a.stats["variant_switches"] == 3 and {r.window for r in b.trace} == {28}
    # the NPU is given kv_valid_len and reads only the valid slots, whatever the window
    assert a.stats["kv_read_bytes"] == b.stats["kv_read_bytes"]


def test_custom_variants_validated(tiny):
    d = decoder(tiny, max_prompt_len=16, min_response_len=8, variants=(12, 5))
    assert d.variants == (5, 12, 24)
    with pytest.raises(ValueError, match="exceeds the KV capacity 24"):
        CacheConfig(max_prompt_len=16, min_response_len=8, variants=(30,))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError):
            CacheConfig(max_prompt_len=bad)


def test_garbage_in_invalid_slots_never_reaches_the_result(tiny):
    p = prompt(9, seed=3)
    clean = decoder(tiny).generate(p, 6, stop_ids=())
    for garbage in (np.nan, 65504.0, -42.0):
        d = decoder(tiny)
        d.cache.k[:] = garbage                    # stale DRAM contents
        d.cache.v[:] = garbage
        res = d.generate(p, 6, stop_ids=())
        np.testing.assert_array_equal(res.logits, clean.logits)
    # a second run over the same buffer (stale slots of the first run) gives the same again
    d = decoder(tiny)
    d.generate(prompt(14, seed=9), 5, stop_ids=())
    np.testing.assert_array_equal(d.generate(p, 6, stop_ids=()).logits, clean.logits)


def test_gqa_one_job_per_layer_equals_one_job_per_head(tiny):
    p = prompt(6, seed=4)
    t1, t2 = RecordingTransport(), RecordingTransport()
    a = decoder(tiny, transport=t1).generate(p, 3, stop_ids=())
    b = decoder(tiny, transport=t2, job_grouping="head").generate(p, 3, stop_ids=())
    np.testing.assert_array_equal(a.logits, b.logits)
    L, H = tiny.hparams.n_layers, tiny.hparams.n_heads
    assert a.stats["jobs"] == 3 * L and b.stats["jobs"] == 3 * L * H        # prefill + 2 steps
    assert a.stats["jobs_per_token"] == L and b.stats["jobs_per_token"] == L * H
    assert all(j.heads == H for j in t1.jobs) and all(j.heads == 1 for j in t2.jobs)
    assert a.stats["kv_read_bytes"] < b.stats["kv_read_bytes"]


# ------------------------------------------------------------ prefix reuse
def test_prefix_reuse_runs_only_the_chunks_after_the_shared_ones(tiny):
    """A prompt that starts with the previous prompt's whole chunks keeps their
    slots: only the later chunks run, and every job, token and logit is
    bit-identical to a fresh decoder's run of that prompt."""
    a = prompt(19, seed=5)                                   # chunks of 8: 8, 8, 3
    b = a[:16] + prompt(6, seed=6)                           # shares 2 whole chunks, then 6 new tokens
    t = RecordingTransport()
    d = decoder(tiny, max_prompt_len=24, min_response_len=8, chunk=8, transport=t)
    d.generate(a, 4, stop_ids=())
    assert d.shared_chunks(b) == 2 and d.shared_chunks(a) == 2
    t.jobs.clear()
    res = d.generate(b, 4, stop_ids=())
    t_fresh = RecordingTransport()
    fresh = decoder(tiny, max_prompt_len=24, min_response_len=8, chunk=8, transport=t_fresh).generate(b, 4, stop_ids=())
    assert res.tokens == fresh.tokens
    np.testing.assert_array_equal(res.logits, fresh.logits)
    assert res.stats["prefix_reused_tokens"] == 16 and fresh.stats["prefix_reused_tokens"] == 0
    pre = [r for r in res.trace if r.kind == "prefill"]
    assert [(r.slot_start, len(r.ids)) for r in pre] == [(16, 6)] and res.stats["prefill_chunks"] == 1
    L = tiny.hparams.n_layers
    skipped = t_fresh.jobs[2 * L:]                           # the fresh run's jobs after its first two chunks
    assert len(t.jobs) == len(skipped)
    for j, f in zip(t.jobs, skipped):                        # the same jobs, bit for bit
        for name in ("q", "mask"):
            np.testing.assert_array_equal(getattr(j, name), getattr(f, name))
        np.testing.assert_array_equal(j.k[:, :j.kv_valid_len], f.k[:, :f.kv_valid_len])
        assert (j.q_offset, j.kv_valid_len, j.window) == (f.q_offset, f.kv_valid_len, f.window)
    assert np.all(d.cache.writes[:, :16] == 1)               # the kept slots were not written again
    assert res.stats["kv_write_bytes"] < fresh.stats["kv_write_bytes"]


@pytest.mark.parametrize("second, shared", [
    ("same", 1),          # the same 16 tokens: the last chunk runs again for its logits
    ("longer", 2),        # the 19-token prompt after the 16-token one
    ("differs", 1),       # one token changed in chunk 1
    ("partial", 0),       # the earlier prompt's partial chunk is not a whole chunk
])
def test_prefix_reuse_takes_whole_shared_chunks_only(tiny, second, shared):
    a = prompt(16, seed=7)
    b = {"same": a, "longer": a + prompt(3, seed=8), "differs": a[:8] + [(a[8] + 1) % 97] + a[9:],
         "partial": None}[second]
    d = decoder(tiny, max_prompt_len=24, min_response_len=8, chunk=8)
    if second == "partial":
        a, b = a[:5], a[:5] + prompt(7, seed=9)              # 5 tokens: no whole chunk to reuse
    d.generate(a, 3, stop_ids=())
    assert d.shared_chunks(b) == shared
    res = d.generate(b, 3, stop_ids=())
    fresh = decoder(tiny, max_prompt_len=24, min_response_len=8, chunk=8).generate(b, 3, stop_ids=())
    np.testing.assert_array_equal(res.logits, fresh.logits)
    assert res.stats["prefix_reused_tokens"] == 8 * shared


def test_prefix_reuse_can_be_turned_off_and_forgets_on_reset(tiny):
    a = prompt(17, seed=10)
    off = decoder(tiny, max_prompt_len=24, min_response_len=8, chunk=8, prefix_reuse=False)
    off.generate(a, 2, stop_ids=())
    assert off.shared_chunks(a) == 0 and off.generate(a, 2, stop_ids=()).stats["prefix_reused_tokens"] == 0
    on = decoder(tiny, max_prompt_len=24, min_response_len=8, chunk=8)
    on.generate(a, 2, stop_ids=())
    assert on.shared_chunks(a) == 2
    on.reset()
    assert on.shared_chunks(a) == 0 and on.cache.length == 0


def test_cache_defaults_are_runtime_sized():
    c = CacheConfig()
    assert (c.max_prompt_len, c.min_response_len, c.capacity) == (1024, 128, 1152)


# ------------------------------------------------------------ batches
def test_batch_decode_equals_decoding_each_sequence_alone(tiny):
    """Three sequences of their own lengths in one buffer, one job per layer
    per step: every sequence's tokens and logits are bit-identical to a
    Decoder's; the long middle one stops on a full cache first and rides
    along masked, the last one's stop shrinks the job."""
    cache = CacheConfig(max_prompt_len=16, min_response_len=8, prefill_chunk_size=8)
    prompts = [prompt(5, seed=21), prompt(16, seed=22), prompt(11, seed=23)]
    t = RecordingTransport()
    bd = BatchDecoder(tiny, t, 3, cache)
    out = bd.generate(prompts, 10, stop_ids=())
    L, H = tiny.hparams.n_layers, tiny.hparams.n_heads
    for p, r in zip(prompts, out.results):
        alone = Decoder(tiny, GoldenTransport(NPU), cache).generate(p, 10, stop_ids=())
        assert r.tokens == alone.tokens and r.stop_reason is alone.stop_reason
        np.testing.assert_array_equal(r.logits, alone.logits)
    assert [r.stop_reason for r in out.results] == [StopReason.MAX_NEW_TOKENS, StopReason.CACHE_FULL,
                                                    StopReason.MAX_NEW_TOKENS]
    assert [len(r.tokens) for r in out.results] == [10, 9, 10]
    st = out.stats
    assert st["generate_steps"] == 9 and st["jobs_per_step"] == L and st["new_tokens"] == 29
    steps = [j for j in t.jobs if j.seq_q == 1]
    assert len(steps) == 9 * L and all(j.mask.shape == (j.heads, 1, j.window) for j in steps)
    assert {j.heads for j in steps} == {3 * H}
    # after sequence 1 stopped (its 9th token), its heads see nothing
    last = steps[-L:]
    assert all(not j.mask[H:2 * H].any() and j.mask[:H].any() and j.mask[2 * H:].any() for j in last)
    assert all(np.all(j.q[H:2 * H] == 0) for j in last)


def test_batch_job_covers_only_the_running_range(tiny):
    cache = CacheConfig(max_prompt_len=16, min_response_len=8, prefill_chunk_size=8)
    t = RecordingTransport()
    out = BatchDecoder(tiny, t, 2, cache).generate([prompt(4, seed=31), prompt(16, seed=32)], 12, stop_ids=())
    H, G = tiny.hparams.n_heads, tiny.hparams.n_kv_heads
    assert [len(r.tokens) for r in out.results] == [12, 9]
    steps = [j for j in t.jobs if j.seq_q == 1]
    assert [j.heads for j in steps[::tiny.hparams.n_layers]] == [2 * H] * 8 + [H] * 3
    assert {j.kv_heads for j in steps[-3:]} == {G}


def test_batch_that_does_not_fit_is_refused_before_any_job(tiny):
    cache = CacheConfig(max_prompt_len=16, min_response_len=8, prefill_chunk_size=8)
    t = RecordingTransport()
    bd = BatchDecoder(tiny, t, 2, cache)
    with pytest.raises(ValueError, match="3 prompts do not fit a batch of 2 sequences"):
        bd.generate([prompt(3)] * 3, 2)
    with pytest.raises(ValueError, match=r"prompt 1: the prompt has 17 tokens but max_prompt_len is 16"):
        bd.generate([prompt(3), prompt(17)], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        bd.generate([prompt(3)], 0)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        BatchDecoder(tiny, t, 0, cache)
    assert t.jobs == [] and bd.kv.writes.sum() == 0


# ------------------------------------------------------------ transport
def test_job_bytes_model():
    q = np.zeros((9, 1, 64), np.float16)
    kv = np.zeros((3, 80, 64), np.float16)
    job = AttentionJob(0, q, kv, kv, np.ones((1, 80), bool), 0.125, 79, 80)
    b = job_bytes(job)                                     # default Br = Bc = 64
    assert b == dict(q=9 * 64 * 2, kv=2 * 3 * 1 * 80 * 64 * 2, o=9 * 64 * 4)
    q = np.zeros((9, 64, 64), np.float16)                  # 3 heads x 64 rows per kv head = 3 q tiles
    job = AttentionJob(0, q, kv, kv, np.ones((64, 80), bool), 0.125, 0, 80)
    assert job_bytes(job)["kv"] == 2 * 3 * 1 * 80 * 64 * 2          # 2 kv tiles: resident, fetched once
    assert job_bytes(job, small_config())["kv"] == 2 * 3 * 1 * 80 * 64 * 2
    kv = np.zeros((3, 1100, 64), np.float16)               # 18 kv tiles > 16 SRAM slots: streamed
    job = AttentionJob(0, q, kv, kv, np.ones((64, 1100), bool), 0.125, 0, 1100)
    assert job_bytes(job)["kv"] == 2 * 3 * 3 * 1100 * 64 * 2        # once per q tile
    mask = np.zeros((64, 1100), bool)
    mask[:, :100] = True                                   # 100 valid slots of the window: 2 kv tiles
    job = AttentionJob(0, q, kv, kv, mask, 0.125, 0, 100)
    assert job_bytes(job)["kv"] == 2 * 3 * 1 * 100 * 64 * 2         # resident, only the valid slots


@pytest.mark.parametrize("heads, kv_heads, seq_q, per_head_mask", [(6, 2, 3, False), (6, 2, 3, True),
                                                                   (9, 3, 2, False), (4, 1, 5, True)])
def test_packed_query_groups_give_the_same_bits_in_fewer_q_tiles(heads, kv_heads, seq_q, per_head_mask):
    """A short query block with its group's heads folded into the rows: the
    golden model gives the unpacked job's output bit for bit, the NPU needs
    fewer q tiles (Br = 8 here), and the transport sends the packed job."""
    rng = np.random.default_rng(heads * 100 + seq_q)
    w, kvl, d = 21, 17, 8
    q = (rng.standard_normal((heads, seq_q, d)) * 2).astype(np.float16)
    k = (rng.standard_normal((kv_heads, w, d)) * 2).astype(np.float16)
    v = rng.standard_normal((kv_heads, w, d)).astype(np.float16)
    pos = kvl - seq_q + np.arange(seq_q)
    mask = np.arange(w)[None, :] <= pos[:, None]
    if per_head_mask:
        mask = np.broadcast_to(mask, (heads, seq_q, w)) & (rng.random((heads, seq_q, w)) < 0.8)
        mask[..., 0] = True
    job = AttentionJob(0, q, k, v, mask, 0.3, int(pos[0]), kvl)
    packed = pack_query_groups(job, NPU)
    g = heads // kv_heads
    assert packed.q.shape == (kv_heads, g * seq_q, d)
    assert -(-g * seq_q // NPU.br) < g * -(-seq_q // NPU.br)
    want = flash_attention_hw(q, k, v, mask=mask, kv_valid_len=kvl, scale=0.3, config=NPU).o
    got = flash_attention_hw(packed.q, k, v, mask=packed.mask, kv_valid_len=kvl, scale=0.3, config=NPU).o
    assert np.array_equal(got.reshape(want.shape).view(np.uint32), want.view(np.uint32))

    sent = []

    class Spy(GoldenTransport):
        def _run(self, job):
            sent.append(job.q.shape)
            return super()._run(job)

    res = Spy(NPU).run(job)
    assert sent == [packed.q.shape] and np.array_equal(res.o.view(np.uint32), want.view(np.uint32))


def test_query_groups_not_packed_where_no_q_tile_is_saved():
    kv = np.zeros((2, 16, 8), np.float16)
    for heads, seq_q in ((6, 1), (2, 3), (6, 8), (6, 16)):     # decode, no group, whole q tiles
        q = np.zeros((heads, seq_q, 8), np.float16)
        job = AttentionJob(0, q, kv, kv, np.ones((seq_q, 16), bool), 0.3, 0, 16)
        assert pack_query_groups(job, NPU) is None, (heads, seq_q)


def test_job_validation():
    q = np.zeros((9, 1, 64), np.float16)
    kv = np.zeros((3, 8, 64), np.float16)
    with pytest.raises(ValueError, match="float16"):
        AttentionJob(0, q.astype(np.float32), kv, kv, np.ones((1, 8), bool), 0.1, 0, 8)
    with pytest.raises(ValueError, match="mask"):
        AttentionJob(0, q, kv, kv, np.ones((1, 9), bool), 0.1, 0, 8)
    with pytest.raises(ValueError, match="slot 5, at or beyond kv_valid_len=5"):
        AttentionJob(0, q, kv, kv, np.ones((1, 8), bool), 0.1, 0, 5)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        AttentionJob(0, q[:8], kv, kv, np.ones((1, 8), bool), 0.1, 0, 8)


def test_backend_registry(monkeypatch):
    assert {"golden", "rtl"} <= set(backend_names())
    assert isinstance(make_transport("golden"), GoldenTransport)
    monkeypatch.setattr(runner, "have_simulator", lambda sim: False)
    with pytest.raises(BackendUnavailable, match="needs the simulator"):
        make_transport("rtl")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        make_transport("tpu")

    class Fake(GoldenTransport):
        name = "fake_test"

        def _run(self, job):
            return JobResult(super()._run(job).o, 7, {"kv": 1})

    monkeypatch.setattr(transport_mod, "_BACKENDS", dict(transport_mod._BACKENDS))
    register_backend("fake_test", lambda config, **kw: Fake(config))
    assert "fake_test" in backend_names()
    t = make_transport("fake_test", config=NPU)
    d = Decoder(tiny_model(), t, CacheConfig(max_prompt_len=8, min_response_len=4))
    res = d.generate(prompt(4), 2, stop_ids=())
    assert res.stats["npu_cycles"] == 7 * 2 * 2 and res.stats["npu_cycles_per_token"] == 14
    assert res.stats["kv_read_bytes"] == 4


def test_backend_output_shape_is_checked():
    class Broken(GoldenTransport):
        def _run(self, job):
            r = super()._run(job)
            r.o = r.o[:, :, :-1]
            return r

    d = Decoder(tiny_model(), Broken(NPU), CacheConfig(max_prompt_len=8, min_response_len=4))
    with pytest.raises(ValueError, match="returned o"):
        d.prefill(prompt(3))


def test_head_dim_above_npu_limit_rejected():
    m = tiny_model(head_dim=16, n_heads=2, n_kv_heads=1)
    with pytest.raises(ValueError, match="head_dim=16 is outside the hardware range 1..8"):
        Decoder(m, GoldenTransport(small_config(max_head_dim=8)))


def test_backends_cannot_write_the_kv_cache(tiny):
    class Vandal(GoldenTransport):
        def _run(self, job):
            job.k[0, 0, 0] = 1.0
            return super()._run(job)

    with pytest.raises(ValueError, match="read-only"):
        decoder(tiny, transport=Vandal(NPU)).prefill(prompt(3))
