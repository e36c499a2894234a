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
    "CacheConfig", "KVCache", "CacheFullError", "StopReason", "ForwardRecord", "GenerationResult",
    "Decoder", "JOB_GROUPINGS",
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
        Longest prompt in tokens that prefill accepts (default 64).
    min_response_len : int
        Slots reserved for the response (default 16); every accepted prompt
        can generate at least ``min_response_len + 1`` tokens.
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

    max_prompt_len: int = 64
    min_response_len: int = 16
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
    """

    def __init__(self, n_layers: int, kv_heads: int, capacity: int, head_dim: int):
        self.capacity = _pos_int("capacity", capacity)
        self.n_layers = _pos_int("n_layers", n_layers)
        shape = (n_layers, _pos_int("kv_heads", kv_heads), capacity, _pos_int("head_dim", head_dim))
        check_memory(2 * FP16_BYTES * n_layers * kv_heads * capacity * head_dim + 9 * n_layers * capacity,
                     f"a KV cache of capacity {capacity} ({n_layers} layers x {kv_heads} kv heads x "
                     f"head_dim {head_dim})")
        self.k = np.zeros(shape, np.float16)
        self.v = np.zeros(shape, np.float16)
        self.valid = np.zeros(capacity, bool)
        self.writes = np.zeros((n_layers, capacity), np.int64)
        self.write_bytes = 0

    @property
    def length(self) -> int:
        """Valid slots."""
        return int(self.valid.sum())

    def reset(self) -> None:
        """Forget every token (the buffer keeps its stale contents, as DRAM does)."""
        self.valid[:] = False
        self.writes[:] = 0
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
        bit-identical).
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
                 job_grouping: str = "layer", blas_threads: int | None = 1):
        if not isinstance(model, LlamaModel):
            raise TypeError(f"model must be a LlamaModel, not {type(model).__name__}")
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a Transport, not {type(transport).__name__}")
        cache = CacheConfig() if cache is None else cache
        if not isinstance(cache, CacheConfig):
            raise TypeError(f"cache must be a CacheConfig, not {cache!r}")
        if job_grouping not in JOB_GROUPINGS:
            raise ValueError(f"job_grouping must be one of {JOB_GROUPINGS}, not {job_grouping!r}")
        transport.config.check_head_dim(model.hparams.head_dim)
        if cache.capacity > model.hparams.context_length:
            raise ValueError(f"KV capacity {cache.capacity} (max_prompt_len {cache.max_prompt_len} + "
                             f"min_response_len {cache.min_response_len}) is above the model's context length "
                             f"{model.hparams.context_length}")
        self.model = model
        self.transport = transport
        self.config = cache
        self.job_grouping = job_grouping
        self.blas_threads = None if blas_threads is None else _pos_int("blas_threads", blas_threads)
        hp = model.hparams
        self.cache = KVCache(hp.n_layers, hp.n_kv_heads, cache.capacity, hp.head_dim)
        #: the cache lives in the NPU's memory (the transport keeps its own copy)
        self.resident = transport.bind_cache(self.cache)
        self.variants = cache.variant_capacities(transport.config.bc)
        self.scale = 1.0 / math.sqrt(hp.head_dim)
        self.trace: list = []

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

    def reset(self) -> None:
        """Start a new sequence: no valid slot, empty trace, counters at zero."""
        self.cache.reset()
        self.trace = []
        self.transport.reset_counters()

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
            job = AttentionJob(layer, q16, k, v, mask, self.scale, q_offset, kv_valid_len, self.resident)
            return self.transport.run(job).o
        group = self.model.hparams.group        # per-head jobs carry their kv head's window
        outs = []
        for h in range(q16.shape[0]):
            g = h // group
            job = AttentionJob(layer, q16[h:h + 1], k[g:g + 1], v[g:g + 1], mask, self.scale, q_offset, kv_valid_len)
            outs.append(self.transport.run(job).o)
        return np.concatenate(outs, axis=0)

    def _forward(self, ids, kind: str) -> np.ndarray:
        """Run ids through every layer, appending them to the cache; return the last row's logits."""
        ids = np.asarray(ids, np.int64)
        n = ids.shape[0]
        cache = self.cache
        start = cache.length
        if start + n > cache.capacity:
            raise CacheFullError(f"{n} more tokens after {start} would pass the KV capacity {cache.capacity}")
        valid_after = cache.valid.copy()
        valid_after[start:start + n] = True
        slot_pos = np.cumsum(valid_after) - 1                    # position id held by each valid slot
        positions = int(cache.valid.sum()) + np.arange(n, dtype=np.int64)
        window = self.select_variant(start + n)
        mask = valid_after[None, :window] & (slot_pos[None, :window] <= positions[:, None])
        jobs_before = self.transport.counters.jobs

        x = self.model.embed(ids)
        for layer in range(self.model.hparams.n_layers):
            q, k, v = self.model.qkv(layer, x, positions)
            k16, v16 = k.astype(np.float16), v.astype(np.float16)
            cache.write(layer, start, k16, v16)
            self.transport.write_kv(layer, start, k16, v16)
            o = self._attention(layer, q.astype(np.float16), window, mask, int(positions[0]), start + n)
            x = self.model.finish_layer(layer, x, o)
        cache.commit(start, n)
        self.trace.append(ForwardRecord(kind, start, ids, positions, window,
                                        self.transport.counters.jobs - jobs_before))
        return self.model.logits(x[-1:])[0]

    def prefill(self, prompt_ids) -> np.ndarray:
        """Reset, then run the prompt in chunks of ``prefill_chunk_size``.

        Returns
        -------
        float32 [vocab] logits after the last prompt token.

        Raises
        ------
        ValueError
            empty prompt, or more than ``max_prompt_len`` tokens (the message
            names the limits).
        """
        ids = np.asarray(list(prompt_ids), np.int64)
        self.check_prompt(ids.shape[0])
        self.reset()
        chunk = self.config.prefill_chunk_size
        logits = None
        with self._blas_limit():
            for s in range(0, ids.shape[0], chunk):
                logits = self._forward(ids[s:s + chunk], "prefill")
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
        GenerationResult whose ``stats`` holds: prompt_tokens, new_tokens,
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
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, not {max_new_tokens!r}")
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
