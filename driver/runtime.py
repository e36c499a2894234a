"""The host runtime of LLM decode on the NPU: static KV cache, masks, positions,
prefill, generate steps and generate variants.

An NPU runs fixed shapes, so the runtime, not the model, owns everything that
depends on how far a conversation has got:

* **KV cache** — one preallocated buffer per layer in the NPU's DRAM, FP16
  ``[kv_heads, capacity, head_dim]`` for K and for V, with
  ``capacity = max_prompt_len + min_response_len``.  Slot i holds the token
  at position i; nothing is ever written at or beyond ``capacity``.
* **attention mask** — one bit per slot (1 = valid).  A job's mask is
  ``valid[j] and pos(j) <= pos(query)``; whatever an invalid slot holds
  (stale data of an earlier run, garbage) cannot reach the output.
* **position ids** — count valid tokens: a new token's position is the
  number of valid slots before it, absolute across prefill chunks.
* **prefill** — the prompt goes through in chunks of ``prefill_chunk_size``
  tokens (the prefill variant's static q length).  A 150-token prompt with
  chunk 64 runs positions 0-63, 64-127, 128-149; a 128-token prompt runs two
  full chunks.  Queries of a chunk attend causally to every slot written
  so far, including their own chunk.
* **generate** — one token per step; the 9 query heads of a layer
  (SmolLM2-135M) go to the NPU as ONE job (grouped-query heads stacked on
  the PE rows), i.e. one job per layer per token.
* **generate variants** — several static KV windows (default: multiples of
  the NPU's kv tile Bc below the capacity, and the capacity itself) over the
  SAME buffer.  Each job uses the smallest window that holds every valid
  slot, switching up as the cache fills.  Slots beyond the window are
  invisible anyway, and the NPU leaves a row's state unchanged bit for bit
  over masked keys, so results are identical to always using the largest
  window while short contexts move fewer bytes.
* **stops** — EOS (any end-of-generation token), ``max_new_tokens``, or a
  full cache (``cache_full``: the next token would need slot ``capacity``).
* **prefix reuse** — a prompt that starts with the previous prompt's whole
  prefill chunks keeps their slots and runs only the chunks after them
  (``Decoder.shared_chunks``); the output is bit-identical to a fresh run.
* **batches** — ``BatchDecoder``: several sequences, each with its own
  slots, positions and mask, in one buffer (``BatchKV``); every generate
  step is one job per layer for all of them (per-head masks).

Dataflow of one forward call (a prefill chunk or a generate step)::

   ids[n] ─► model.embed ─► for each layer:
                │   model.qkv(x, positions) ─► q f32 [H,n,d], k,v f32 [G,n,d]
                │   k,v ──fp16──► KV cache slots [start, start+n)   (DRAM write)
                │   AttentionJob(q fp16, cache[:, :window], mask [n, window])
                │        └──► Transport.run ─► o f32 [H,n,d]
                │   model.finish_layer(x, o)
             ─► commit slots valid ─► model.logits(last row)
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
from dataclasses import dataclass, field

import numpy as np

from flashnpu.resources import check_memory

from .model import LlamaModel
from .transport import FP16_BYTES, AttentionJob, Transport

__all__ = [
    "CacheConfig", "KVCache", "BatchKV", "CacheFullError", "StopReason", "ForwardRecord", "GenerationResult",
    "Decoder", "BatchDecoder", "BatchResult", "JOB_GROUPINGS",
]

#: How query heads are packed into NPU jobs: "layer" = all heads of a layer in
#: one job (grouped-query mapping); "head" = one job per query head.
JOB_GROUPINGS = ("layer", "head")


def _pos_int(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{name} must be a positive int, not {v!r}")
    return int(v)


def _int_in(name, v, lo, hi):
    """``v`` as an int in lo..hi, else ValueError naming it."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, not {v!r}")
    return int(v)


@dataclass(frozen=True)
class CacheConfig:
    """Static shapes of the runtime (names as in NPU LLM runtimes).

    Attributes
    ----------
    max_prompt_len : int
        Longest prompt in tokens that prefill accepts (default 1024, as the
        OpenVINO GenAI NPU pipeline's ``MAX_PROMPT_LEN``: docs.openvino.ai, "OpenVINO
        GenAI on NPU").
    min_response_len : int
        Slots reserved for the response (default 128, as its
        ``MIN_RESPONSE_LEN``); every accepted prompt can generate at least
        ``min_response_len + 1`` tokens.
    prefill_chunk_size : int
        Query rows of one prefill job (default 64 = one q tile).
    variants : tuple of int or None
        KV windows of the generate variants.  None: multiples of the NPU's
        kv tile Bc below ``capacity``, then ``capacity``.  ``capacity`` is
        always added as the largest variant.  ``(capacity,)`` disables
        switching (every job sees the whole buffer).

    Raises
    ------
    ValueError
        a non-positive size, or a variant outside 1..capacity.
    """

    max_prompt_len: int = 1024
    min_response_len: int = 128
    prefill_chunk_size: int = 64
    variants: tuple | None = None

    def __post_init__(self):
        for name in ("max_prompt_len", "min_response_len", "prefill_chunk_size"):
            object.__setattr__(self, name, _pos_int(name, getattr(self, name)))
        if self.variants is not None:
            vs = tuple(sorted({_pos_int("variant capacity", v) for v in self.variants} | {self.capacity}))
            if vs[-1] > self.capacity:
                raise ValueError(f"variant capacity {vs[-1]} exceeds the KV capacity {self.capacity} "
                                 f"(max_prompt_len {self.max_prompt_len} + min_response_len {self.min_response_len})")
            object.__setattr__(self, "variants", vs)

    @property
    def capacity(self) -> int:
        """KV slots per layer: max_prompt_len + min_response_len."""
        return self.max_prompt_len + self.min_response_len

    def variant_capacities(self, bc: int) -> tuple:
        """The generate variants' KV windows, ascending, the last = capacity."""
        if self.variants is not None:
            return self.variants
        return tuple(range(bc, self.capacity, bc)) + (self.capacity,)


class CacheFullError(ValueError):
    """A forward call would write at or beyond slot ``capacity``."""


class KVCache:
    """The preallocated per-layer KV cache in NPU DRAM, and its slot mask.

    Attributes
    ----------
    k, v : float16 [n_layers, kv_heads, capacity, head_dim]
        One buffer shared by every generate variant.
    valid : bool [capacity]
        The attention mask over slots (True = holds a token of this run).
    writes : int64 [n_layers, capacity]
        How many times each slot was written since the last ``reset``.
    write_bytes : int
        Bytes written into the buffers since the last ``reset``.

    ``buffers`` (optional): (k, v) arrays of that shape to use instead of new
    ones -- views of a ``BatchKV`` buffer, whose memory it has checked.
    """

    def __init__(self, n_layers: int, kv_heads: int, capacity: int, head_dim: int, buffers=None):
        self.capacity = _pos_int("capacity", capacity)
        self.n_layers = _pos_int("n_layers", n_layers)
        shape = (n_layers, _pos_int("kv_heads", kv_heads), capacity, _pos_int("head_dim", head_dim))
        if buffers is None:
            check_memory(2 * FP16_BYTES * n_layers * kv_heads * capacity * head_dim + 9 * n_layers * capacity,
                         f"a KV cache of capacity {capacity} ({n_layers} layers x {kv_heads} kv heads x "
                         f"head_dim {head_dim})")
            self.k = np.zeros(shape, np.float16)
            self.v = np.zeros(shape, np.float16)
        else:                               # views of a larger buffer (``BatchKV``)
            self.k, self.v = buffers
            assert self.k.shape == self.v.shape == shape and self.k.dtype == np.float16
        self.valid = np.zeros(capacity, bool)
        self.writes = np.zeros((n_layers, capacity), np.int64)
        self.write_bytes = 0

    @property
    def length(self) -> int:
        """Valid slots."""
        return int(self.valid.sum())

    def reset(self, keep: int = 0) -> None:
        """Forget every token from slot ``keep`` on (default: all of them); the
        buffer keeps its stale contents, as DRAM does.  ``write_bytes`` starts
        again from 0; ``writes`` keeps its counts below ``keep``.

        Raises
        ------
        ValueError
            ``keep`` not an int in 0..length (nothing is changed).
        """
        keep = _int_in("keep", keep, 0, self.length)
        self.valid[keep:] = False
        self.writes[:, keep:] = 0
        self.write_bytes = 0

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v (float16 [kv_heads, n, head_dim]) in slots start..start+n-1 of ``layer``.

        Raises
        ------
        CacheFullError
            if start + n > capacity (nothing is written).
        ValueError
            a layer outside 0..n_layers-1, a negative start, or k, v of
            another shape than [kv_heads, n, head_dim] (nothing is written).
        """
        layer = _int_in("layer", layer, 0, self.n_layers - 1)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"start slot must be an int >= 0, not {start!r}")
        want = (self.k.shape[1], None, self.k.shape[3])
        for name, a in (("k", k), ("v", v)):
            if np.ndim(a) != 3 or a.shape[0] != want[0] or a.shape[2] != want[2] or a.shape != k.shape:
                raise ValueError(f"{name} must be [kv_heads={want[0]}, n, head_dim={want[2]}] like k, "
                                 f"not shape {np.shape(a)}")
        n = k.shape[1]
        if start + n > self.capacity:
            raise CacheFullError(f"writing slots {start}..{start + n - 1} would pass the KV capacity {self.capacity}")
        self.k[layer, :, start:start + n] = k
        self.v[layer, :, start:start + n] = v
        self.writes[layer, start:start + n] += 1
        self.write_bytes += k.nbytes + v.nbytes

    def commit(self, start: int, n: int) -> None:
        """Mark slots start..start+n-1 valid (after every layer wrote them).

        Raises
        ------
        ValueError
            a start or count that is not an int >= 0, or a slot at or past
            ``capacity`` (nothing is marked).
        """
        start = _int_in("start slot", start, 0, self.capacity)
        n = _int_in("slot count", n, 0, self.capacity)
        if start + n > self.capacity:
            raise CacheFullError(f"slots {start}..{start + n - 1} pass the KV capacity {self.capacity}")
        self.valid[start:start + n] = True


class BatchKV:
    """The KV buffer of a batch of sequences, as the NPU's DRAM holds it.

    FP16 ``k``, ``v`` [n_layers, batch * kv_heads, capacity, head_dim]:
    sequence b owns kv heads b*kv_heads..(b+1)*kv_heads-1, so a generate
    step's job reads every sequence's window with one head stride.
    ``seqs[b]`` is sequence b's ``KVCache`` over views of these buffers
    (its own slot mask and write counts); ``writes`` [n_layers, capacity]
    counts, per slot, the most writes any sequence made (what a backend
    that mirrors the buffer must store again).
    """

    def __init__(self, n_layers: int, kv_heads: int, capacity: int, head_dim: int, batch: int):
        batch = _pos_int("batch", batch)
        G = _pos_int("kv_heads", kv_heads)
        check_memory(2 * FP16_BYTES * n_layers * batch * G * capacity * head_dim + 9 * batch * n_layers * capacity,
                     f"a batch of {batch} KV caches of capacity {capacity} ({n_layers} layers x {G} kv heads x "
                     f"head_dim {head_dim})")
        shape = (n_layers, batch * G, capacity, head_dim)
        self.k = np.zeros(shape, np.float16)
        self.v = np.zeros(shape, np.float16)
        self.seqs = [KVCache(n_layers, G, capacity, head_dim,
                             buffers=(self.k[:, b * G:(b + 1) * G], self.v[:, b * G:(b + 1) * G]))
                     for b in range(batch)]

    @property
    def writes(self) -> np.ndarray:
        return np.max([c.writes for c in self.seqs], axis=0)


class StopReason(str, enum.Enum):
    """Why ``Decoder.generate`` stopped."""

    EOS = "eos"
    MAX_NEW_TOKENS = "max_new_tokens"
    CACHE_FULL = "cache_full"


@dataclass
class ForwardRecord:
    """One forward call of the runtime (a prefill chunk or a generate step).

    kind : "prefill" or "generate"; slot_start : first slot written; ids :
    int64 [n] token ids; positions : int64 [n] position ids; window : KV
    window (variant capacity) of its jobs; jobs : NPU jobs it ran.
    """

    kind: str
    slot_start: int
    ids: np.ndarray
    positions: np.ndarray
    window: int
    jobs: int


@dataclass
class GenerationResult:
    """Output of ``Decoder.generate``.

    Attributes
    ----------
    prompt_ids : list of int
    tokens : list of int
        Generated ids, in order (an EOS that stopped the run is included).
    logits : float32 [len(tokens), vocab]
        Row s = the logits token s was chosen from (row 0 comes from prefill).
    stop_reason : StopReason
    stats : dict
        See ``Decoder.generate``.
    trace : list of ForwardRecord
    """

    prompt_ids: list
    tokens: list
    logits: np.ndarray
    stop_reason: StopReason
    stats: dict
    trace: list = field(default_factory=list)


def _check_decoder(model, transport, cache, blas_threads):
    """The checks of ``Decoder`` and ``BatchDecoder``; returns (cache config, blas_threads)."""
    if not isinstance(model, LlamaModel):
        raise TypeError(f"model must be a LlamaModel, not {type(model).__name__}")
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be a Transport, not {type(transport).__name__}")
    cache = CacheConfig() if cache is None else cache
    if not isinstance(cache, CacheConfig):
        raise TypeError(f"cache must be a CacheConfig, not {cache!r}")
    transport.config.check_head_dim(model.hparams.head_dim)
    if cache.capacity > model.hparams.context_length:
        raise ValueError(f"KV capacity {cache.capacity} (max_prompt_len {cache.max_prompt_len} + "
                         f"min_response_len {cache.min_response_len}) is above the model's context length "
                         f"{model.hparams.context_length}")
    return cache, (None if blas_threads is None else _pos_int("blas_threads", blas_threads))


def _check_max_new_tokens(v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"max_new_tokens must be a positive int, not {v!r}")
    return int(v)


class Decoder:
    """Greedy decode of a ``LlamaModel`` with every attention call on a ``Transport``.

    Parameters
    ----------
    model : LlamaModel
    transport : Transport
        Its ``config.bc`` sets the default variant windows.
    cache : CacheConfig, optional
    job_grouping : "layer" or "head"
        "layer" (default): all query heads of a layer in one job; "head": one
        job per query head (for measuring the mapping; results are
        bit-identical), the layer's jobs sent together (``run_many``: queued
        sweeps on the rtl backend).
    prefix_reuse : bool
        True (default): a prompt that starts with the whole prefill chunks of
        the previous prompt keeps their KV slots and runs only the chunks
        after them (never its last chunk, whose logits it returns).  A chunk
        is reused only when its ids, its slots and its neighbours are those
        of the earlier run, so every later job is the job the earlier run
        would have sent: the output is bit-identical to a run without reuse.
    blas_threads : int or None
        BLAS threads for the host's matmuls while the decoder runs (default
        1; None leaves the library's setting).  The host matmuls are small
        (576 x 1536 at most per token); measured on a loaded 2-core machine,
        a decode step took 0.2 s with one OpenBLAS thread and 0.7-1.0 s with
        two, which spin against each other and against the NPU model.

    Raises
    ------
    ValueError
        unknown ``job_grouping``, a head_dim the NPU cannot take, a KV
        capacity above the model's context length, or a KV cache larger than
        the memory limit (``flashnpu.resources``), before it is allocated.
    TypeError
        wrong model / transport / cache types.
    """

    def __init__(self, model: LlamaModel, transport: Transport, cache: CacheConfig | None = None,
                 job_grouping: str = "layer", prefix_reuse: bool = True, blas_threads: int | None = 1):
        if job_grouping not in JOB_GROUPINGS:
            raise ValueError(f"job_grouping must be one of {JOB_GROUPINGS}, not {job_grouping!r}")
        cache, blas_threads = _check_decoder(model, transport, cache, blas_threads)
        hp = model.hparams
        kv = KVCache(hp.n_layers, hp.n_kv_heads, cache.capacity, hp.head_dim)
        self._init(model, transport, cache, job_grouping, prefix_reuse, blas_threads, kv, 0,
                   transport.bind_cache(kv), True)

    def _init(self, model, transport, cache, job_grouping, prefix_reuse, blas_threads, kv, kv_head0, resident,
              owns_counters):
        """State of a checked decoder (``BatchDecoder`` makes its sequences here)."""
        self.model = model
        self.transport = transport
        self.config = cache
        self.job_grouping = job_grouping
        self.prefix_reuse = bool(prefix_reuse)
        self.blas_threads = blas_threads
        hp = model.hparams
        self.cache = kv
        #: the kv head of the transport's bound cache that this sequence's kv head 0 is
        self.kv_head0 = kv_head0
        #: the cache lives in the NPU's memory (the transport keeps its own copy)
        self.resident = resident
        #: ``reset`` also zeroes the transport's counters (a batch's sequences share them)
        self._owns_counters = owns_counters
        self.variants = cache.variant_capacities(transport.config.bc)
        self.scale = 1.0 / math.sqrt(hp.head_dim)
        self.trace: list = []
        #: ids of the whole prefill chunks the cache holds from slot 0 (the last prefill's)
        self._chunks: list = []
        #: prompt tokens whose KV the last prefill took from the previous prompt
        self.reused_tokens = 0

    # ---------------------------------------------------------------- helpers
    def _blas_limit(self):
        if self.blas_threads is None:
            return contextlib.nullcontext()
        # deferred: threadpoolctl only when a BLAS thread limit is asked for
        from threadpoolctl import threadpool_limits

        return threadpool_limits(limits=self.blas_threads, user_api="blas")

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def reset(self, keep: int = 0) -> None:
        """Start a new sequence: no valid slot from ``keep`` on (default: none
        at all), empty trace, counters at zero."""
        self.cache.reset(keep)
        self.trace = []
        if self._owns_counters:
            self.transport.reset_counters()
        if keep == 0:
            self._chunks = []

    def shared_chunks(self, prompt_ids) -> int:
        """Whole prefill chunks at the start of ``prompt_ids`` (a sequence of
        ints) that equal the previous prompt's and can be reused: all but the
        prompt's last chunk, 0 with ``prefix_reuse`` off."""
        if not self.prefix_reuse:
            return 0
        ids = [int(i) for i in prompt_ids]
        c = self.config.prefill_chunk_size
        n = 0
        while (n < len(self._chunks) and (n + 1) * c < len(ids) and (n + 1) * c <= self.cache.length
               and tuple(ids[n * c:(n + 1) * c]) == self._chunks[n]):
            n += 1
        return n

    def select_variant(self, slots_needed: int) -> int:
        """Smallest variant window holding ``slots_needed`` slots.

        Raises
        ------
        CacheFullError
            if no variant (not even the capacity) is large enough.
        """
        for w in self.variants:
            if w >= slots_needed:
                return w
        raise CacheFullError(f"{slots_needed} slots needed but the KV capacity is {self.capacity}")

    def check_prompt(self, n_tokens: int) -> None:
        """Raise ``ValueError`` naming the limits unless prefill can take ``n_tokens``."""
        c = self.config
        if n_tokens == 0:
            raise ValueError("the prompt is empty: prefill needs at least one token")
        if n_tokens > c.max_prompt_len:
            raise ValueError(
                f"the prompt has {n_tokens} tokens but max_prompt_len is {c.max_prompt_len} "
                f"(KV capacity {c.capacity} = max_prompt_len {c.max_prompt_len} + min_response_len "
                f"{c.min_response_len}); shorten the prompt or raise max_prompt_len")

    # ---------------------------------------------------------------- forward
    def _attention(self, layer: int, q16, window: int, mask, q_offset: int, kv_valid_len: int) -> np.ndarray:
        k = self.cache.k[layer, :, :window]
        v = self.cache.v[layer, :, :window]
        k.flags.writeable = False                 # views of the DRAM buffer: backends only read them
        v.flags.writeable = False
        if self.job_grouping == "layer":
            job = AttentionJob(layer, q16, k, v, mask, self.scale, q_offset, kv_valid_len, self.resident,
                               self.kv_head0)
            return self.transport.run(job).o
        group = self.model.hparams.group        # per-head jobs carry their kv head's window
        jobs = [AttentionJob(layer, q16[h:h + 1], k[h // group:h // group + 1], v[h // group:h // group + 1],
                             mask, self.scale, q_offset, kv_valid_len) for h in range(q16.shape[0])]
        return np.concatenate([r.o for r in self.transport.run_many(jobs)], axis=0)

    def _slots(self, n: int, window: int | None = None):
        """Where the next ``n`` tokens go: (first slot, int64 [n] position ids,
        KV window -- the smallest variant unless given --, bool [n, window]
        mask).  Raises CacheFullError when they pass the capacity."""
        cache = self.cache
        start = cache.length
        if start + n > cache.capacity:
            raise CacheFullError(f"{n} more tokens after {start} would pass the KV capacity {cache.capacity}")
        valid_after = cache.valid.copy()
        valid_after[start:start + n] = True
        slot_pos = np.cumsum(valid_after) - 1                    # position id held by each valid slot
        positions = int(cache.valid.sum()) + np.arange(n, dtype=np.int64)
        window = self.select_variant(start + n) if window is None else window
        mask = valid_after[None, :window] & (slot_pos[None, :window] <= positions[:, None])
        return start, positions, window, mask

    def _qkv(self, layer: int, x, start: int, positions) -> np.ndarray:
        """Layer ``layer``'s projections of ``x``: K/V stored in their slots
        (and in the NPU's copy), Q returned as float16 [heads, n, head_dim]."""
        q, k, v = self.model.qkv(layer, x, positions)
        k16, v16 = k.astype(np.float16), v.astype(np.float16)
        self.cache.write(layer, start, k16, v16)
        self.transport.write_kv(layer, start, k16, v16, self.kv_head0)
        return q.astype(np.float16)

    def _commit(self, kind: str, ids, start: int, positions, window: int, jobs: int, x) -> np.ndarray:
        """Mark the slots valid, trace the call; the last row's float32 [vocab] logits."""
        self.cache.commit(start, ids.shape[0])
        self.trace.append(ForwardRecord(kind, start, ids, positions, window, jobs))
        return self.model.logits(x[-1:])[0]

    def _forward(self, ids, kind: str) -> np.ndarray:
        """Run ids through every layer, appending them to the cache; return the last row's logits."""
        ids = np.asarray(ids, np.int64)
        n = ids.shape[0]
        start, positions, window, mask = self._slots(n)
        jobs_before = self.transport.counters.jobs
        x = self.model.embed(ids)
        for layer in range(self.model.hparams.n_layers):
            q16 = self._qkv(layer, x, start, positions)
            o = self._attention(layer, q16, window, mask, int(positions[0]), start + n)
            x = self.model.finish_layer(layer, x, o)
        return self._commit(kind, ids, start, positions, window, self.transport.counters.jobs - jobs_before, x)

    def prefill(self, prompt_ids) -> np.ndarray:
        """Reset, then run the prompt in chunks of ``prefill_chunk_size``.

        Returns
        -------
        float32 [vocab] logits after the last prompt token.

        With ``prefix_reuse`` the whole chunks shared with the previous
        prompt (``shared_chunks``) are not run again (``reused_tokens``).

        Raises
        ------
        ValueError
            empty prompt, or more than ``max_prompt_len`` tokens (the message
            names the limits).
        """
        ids = np.asarray(list(prompt_ids), np.int64)
        self.check_prompt(ids.shape[0])
        chunk = self.config.prefill_chunk_size
        kept = self.shared_chunks(ids)
        self.reset(kept * chunk)
        self._chunks = self._chunks[:kept]
        self.reused_tokens = kept * chunk
        logits = None
        with self._blas_limit():
            for s in range(kept * chunk, ids.shape[0], chunk):
                part = ids[s:s + chunk]
                logits = self._forward(part, "prefill")
                if part.shape[0] == chunk:
                    self._chunks.append(tuple(int(i) for i in part))
        return logits

    def step(self, token_id: int) -> np.ndarray:
        """Append one token at the next slot; return float32 [vocab] logits.

        Raises
        ------
        CacheFullError
            if every slot is valid (slot ``capacity`` is never written).
        """
        with self._blas_limit():
            return self._forward([int(token_id)], "generate")

    # ---------------------------------------------------------------- generate
    def generate(self, prompt_ids, max_new_tokens: int, stop_ids=None, on_token=None) -> GenerationResult:
        """Greedy decode: prefill, then one token per step until a stop.

        Parameters
        ----------
        prompt_ids : sequence of int
        max_new_tokens : int (>= 1)
        stop_ids : iterable of int, optional
            End-of-generation ids; default ``model.eog_token_ids``.
        on_token : callable(int), optional
            Called with each new token as soon as it is chosen (streaming).

        Returns
        -------
        GenerationResult whose ``stats`` holds: prompt_tokens,
        prefix_reused_tokens (prompt tokens whose KV came from the previous
        prompt), new_tokens,
        prefill_chunks, prefill_seconds, decode_seconds, total_seconds,
        tokens_per_second (new tokens / total wall time), decode_tokens_per_second
        (tokens after the first / decode time, None if there were none),
        jobs, jobs_per_token (generate steps), npu_cycles and
        npu_cycles_per_token (None without a clock), kv_read_bytes,
        kv_write_bytes, kv_bytes_moved, q_bytes, o_bytes, variant_steps
        ({window: forward calls}), variant_switches, backend, job_grouping,
        capacity, slots_used.

        Raises
        ------
        ValueError
            bad ``max_new_tokens`` or a prompt that does not fit.
        """
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        stop = frozenset(self.model.eog_token_ids if stop_ids is None else (int(s) for s in stop_ids))
        prompt_ids = [int(i) for i in prompt_ids]
        self.check_prompt(len(prompt_ids))
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        t1 = time.perf_counter()
        tokens, rows = [], []
        with self._blas_limit():
            while True:
                rows.append(logits)
                tok = int(np.argmax(logits))
                tokens.append(tok)
                if on_token is not None:
                    on_token(tok)
                if tok in stop:
                    reason = StopReason.EOS
                    break
                if len(tokens) >= max_new_tokens:
                    reason = StopReason.MAX_NEW_TOKENS
                    break
                if self.cache.length >= self.capacity:
                    reason = StopReason.CACHE_FULL
                    break
                logits = self._forward([tok], "generate")
        t2 = time.perf_counter()
        stats = self._stats(len(prompt_ids), len(tokens), t1 - t0, t2 - t1)
        return GenerationResult(prompt_ids, tokens, np.stack(rows).astype(np.float32), reason, stats, list(self.trace))

    def _stats(self, n_prompt, n_new, t_prefill, t_decode) -> dict:
        c = self.transport.counters
        steps = [r for r in self.trace if r.kind == "generate"]
        variant_steps = {}
        for r in self.trace:
            variant_steps[r.window] = variant_steps.get(r.window, 0) + 1
        windows = [r.window for r in self.trace]
        total = t_prefill + t_decode
        return dict(
            backend=self.transport.name,
            job_grouping=self.job_grouping,
            capacity=self.capacity,
            slots_used=self.cache.length,
            prompt_tokens=n_prompt,
            prefix_reused_tokens=self.reused_tokens,
            new_tokens=n_new,
            prefill_chunks=sum(r.kind == "prefill" for r in self.trace),
            prefill_seconds=t_prefill,
            decode_seconds=t_decode,
            total_seconds=total,
            tokens_per_second=n_new / total if total > 0 else None,
            decode_tokens_per_second=len(steps) / t_decode if steps and t_decode > 0 else None,
            jobs=c.jobs,
            jobs_per_token=(sum(r.jobs for r in steps) / len(steps)) if steps else None,
            npu_cycles=c.cycles,
            npu_cycles_per_token=(c.cycles / n_new) if c.cycles is not None and n_new else None,
            kv_read_bytes=c.kv_bytes,
            kv_write_bytes=self.cache.write_bytes,
            kv_bytes_moved=c.kv_bytes + self.cache.write_bytes,
            q_bytes=c.q_bytes,
            o_bytes=c.o_bytes,
            variant_steps=variant_steps,
            variant_switches=sum(a != b for a, b in zip(windows, windows[1:])),
        )


@dataclass
class BatchResult:
    """Output of ``BatchDecoder.generate``.

    results : list of GenerationResult, one per prompt (its ``stats``: the
    sequence's prompt_tokens, prefix_reused_tokens, new_tokens, slots_used,
    capacity); stats : dict of the batch (see ``BatchDecoder.generate``).
    """

    results: list
    stats: dict


class BatchDecoder:
    """Greedy decode of several sequences together on one ``Transport``.

    Every sequence has its own prompt, KV slots, position ids and mask:
    ``seqs[b]`` is a ``Decoder`` over its share of one ``BatchKV`` buffer
    (kv heads b*kv_heads..(b+1)*kv_heads-1 of every layer), bound to the
    transport as one cache.  Prompts are prefilled one sequence at a time
    (their own chunked prefill jobs, with prefix reuse per sequence); then
    each generate step sends the next token of every running sequence as ONE
    NPU job per layer::

       q     f16 [n*heads, 1, d]       sequences lo..hi of the batch that run
       k, v  f16 [n*kv_heads, W, d]    their kv heads, W = the largest window
                                       any of them needs (a generate variant)
       mask  bool [n*heads, 1, W]      sequence b's heads see only its slots

    A stopped sequence between two running ones rides along with a zero
    query and an all-false mask (its rows come back as zeros and are
    dropped).  The host side (embedding, projections, MLP) runs per
    sequence with the calls ``Decoder.step`` makes, and the NPU leaves a row
    unchanged bit for bit over masked keys, so every sequence's tokens and
    logits are bit-identical to decoding it alone with a ``Decoder``.

    Parameters
    ----------
    model, transport, cache, prefix_reuse, blas_threads : as ``Decoder``
    batch : int
        Sequences the buffer holds (>= 1).

    Raises
    ------
    ValueError
        as ``Decoder``; a batch < 1; a buffer of ``batch`` caches above the
        memory limit or, on a transport that keeps the cache in NPU memory,
        above that memory.
    TypeError
        wrong model / transport / cache types.
    """

    def __init__(self, model: LlamaModel, transport: Transport, batch: int, cache: CacheConfig | None = None,
                 prefix_reuse: bool = True, blas_threads: int | None = 1):
        cache, blas_threads = _check_decoder(model, transport, cache, blas_threads)
        hp = model.hparams
        self.batch = _pos_int("batch", batch)
        self.model = model
        self.transport = transport
        self.config = cache
        self.kv = BatchKV(hp.n_layers, hp.n_kv_heads, cache.capacity, hp.head_dim, self.batch)
        self.resident = transport.bind_cache(self.kv)
        self.seqs = []
        for b in range(self.batch):
            d = Decoder.__new__(Decoder)
            d._init(model, transport, cache, "layer", prefix_reuse, blas_threads, self.kv.seqs[b],
                    b * hp.n_kv_heads, self.resident, False)
            self.seqs.append(d)

    def check_prompts(self, prompts) -> None:
        """Raise ``ValueError`` unless ``prompts`` (token-id sequences) fit:
        1..batch of them, each one ``Decoder.check_prompt`` accepts (the
        message names its index)."""
        if not 1 <= len(prompts) <= self.batch:
            raise ValueError(f"{len(prompts)} prompts do not fit a batch of {self.batch} sequences")
        for b, p in enumerate(prompts):
            try:
                self.seqs[b].check_prompt(len(p))
            except ValueError as e:
                raise ValueError(f"prompt {b}: {e}") from None

    def _step(self, tokens: dict) -> dict:
        """One generate step of the sequences in ``tokens`` ({b: token id}):
        one job per layer; returns {b: float32 [vocab] logits}."""
        hp, seqs = self.model.hparams, self.seqs
        H, G, d = hp.n_heads, hp.n_kv_heads, hp.head_dim
        lo, hi = min(tokens), max(tokens) + 1
        window = max(seqs[b].select_variant(seqs[b].cache.length + 1) for b in tokens)
        plan = {b: seqs[b]._slots(1, window) for b in tokens}
        xs = {b: self.model.embed([t]) for b, t in tokens.items()}
        jobs_before = self.transport.counters.jobs
        scale = seqs[lo].scale
        for layer in range(hp.n_layers):
            q = np.zeros(((hi - lo) * H, 1, d), np.float16)
            mask = np.zeros(((hi - lo) * H, 1, window), bool)
            for b, (start, pos, _, m) in plan.items():
                r = (b - lo) * H
                q[r:r + H] = seqs[b]._qkv(layer, xs[b], start, pos)
                mask[r:r + H] = m
            k = self.kv.k[layer, lo * G:hi * G, :window]
            v = self.kv.v[layer, lo * G:hi * G, :window]
            k.flags.writeable = False
            v.flags.writeable = False
            job = AttentionJob(layer, q, k, v, mask, scale, min(int(p[1][0]) for p in plan.values()),
                               max(p[0] for p in plan.values()) + 1, self.resident, lo * G)
            o = self.transport.run(job).o
            for b in tokens:
                r = (b - lo) * H
                xs[b] = self.model.finish_layer(layer, xs[b], o[r:r + H])
        jobs = self.transport.counters.jobs - jobs_before
        return {b: seqs[b]._commit("generate", np.array([t], np.int64), plan[b][0], plan[b][1], window, jobs, xs[b])
                for b, t in tokens.items()}

    def generate(self, prompts, max_new_tokens: int, stop_ids=None, on_token=None) -> BatchResult:
        """Greedy decode of ``prompts`` (a list of at most ``batch`` token-id
        sequences; prompt b runs in sequence b), each until its own stop.

        Parameters
        ----------
        prompts : list of sequences of int
        max_new_tokens, stop_ids : as ``Decoder.generate``
        on_token : callable(b, token id), optional

        Returns
        -------
        BatchResult whose ``stats`` holds: batch, sequences, prompt_tokens
        and new_tokens (totals), prefill_seconds, decode_seconds,
        total_seconds, tokens_per_second (new tokens of all sequences / total
        wall time), jobs, generate_steps, jobs_per_step, npu_cycles and
        npu_cycles_per_token (None without a clock), kv_read_bytes, backend.

        Raises
        ------
        ValueError
            more prompts than ``batch`` or none (before any work), a prompt
            that does not fit (the message names its index), bad
            ``max_new_tokens``.
        """
        prompts = [[int(i) for i in p] for p in prompts]
        self.check_prompts(prompts)
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        stop = frozenset(self.model.eog_token_ids if stop_ids is None else (int(s) for s in stop_ids))
        self.transport.reset_counters()
        t0 = time.perf_counter()
        logits = {b: self.seqs[b].prefill(p) for b, p in enumerate(prompts)}
        t1 = time.perf_counter()
        prefill_jobs = self.transport.counters.jobs
        tokens = [[] for _ in prompts]
        rows = [[] for _ in prompts]
        reasons = [None] * len(prompts)
        steps = 0
        with self.seqs[0]._blas_limit():
            while logits:
                nxt = {}
                for b, lg in logits.items():
                    rows[b].append(lg)
                    tok = int(np.argmax(lg))
                    tokens[b].append(tok)
                    if on_token is not None:
                        on_token(b, tok)
                    if tok in stop:
                        reasons[b] = StopReason.EOS
                    elif len(tokens[b]) >= max_new_tokens:
                        reasons[b] = StopReason.MAX_NEW_TOKENS
                    elif self.seqs[b].cache.length >= self.config.capacity:
                        reasons[b] = StopReason.CACHE_FULL
                    else:
                        nxt[b] = tok
                logits = self._step(nxt) if nxt else {}
                steps += bool(nxt)
        t2 = time.perf_counter()
        results = []
        for b, p in enumerate(prompts):
            seq = self.seqs[b]
            st = dict(prompt_tokens=len(p), prefix_reused_tokens=seq.reused_tokens, new_tokens=len(tokens[b]),
                      slots_used=seq.cache.length, capacity=self.config.capacity)
            results.append(GenerationResult(p, tokens[b], np.stack(rows[b]).astype(np.float32), reasons[b], st,
                                            list(seq.trace)))
        c = self.transport.counters
        n_new = sum(len(t) for t in tokens)
        total = t2 - t0
        stats = dict(backend=self.transport.name, batch=self.batch, sequences=len(prompts),
                     prompt_tokens=sum(len(p) for p in prompts), new_tokens=n_new,
                     prefill_seconds=t1 - t0, decode_seconds=t2 - t1, total_seconds=total,
                     tokens_per_second=n_new / total if total > 0 else None,
                     jobs=c.jobs, generate_steps=steps,
                     jobs_per_step=((c.jobs - prefill_jobs) / steps) if steps else None,
                     npu_cycles=c.cycles,
                     npu_cycles_per_token=(c.cycles / n_new) if c.cycles is not None and n_new else None,
                     kv_read_bytes=c.kv_bytes)
        return BatchResult(results, stats)
