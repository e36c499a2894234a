"""How the host driver hands attention jobs to the NPU: the ``Transport`` interface.

One ``AttentionJob`` is what the NPU's command queue takes for one layer
call: the query block, the layer's KV-cache window exactly as it sits in
the NPU's stacked DRAM (FP16), an explicit mask over cache slots, and the
softmax scale.  A backend runs it and returns the FP32 output and per-job
statistics::

     driver                              Transport backend
    ┌──────────────────────────┐  job   ┌──────────────────────────────────┐
    │ q      f16 [H, Lq, d]    │ ─────► │ golden: flash_attention_hw       │
    │ k, v   f16 [G, W, d]     │        │         (bit-exact NPU model)    │
    │ mask   bool [Lq, W]      │        │ rtl:    generated Verilog under  │
    │ scale, q_offset,         │ ◄───── │  Verilator (cocotb): one session │
    │ kv_valid_len             │ result │         serves every job         │
    └──────────────────────────┘        └──────────────────────────────────┘
                     o f32 [H, Lq, d], cycles, bytes

H query heads, G kv heads (query head h reads kv head h // (H / G)), Lq
query rows, W the slots of the selected KV window (a generate variant's
capacity), d = head_dim.

Grouped-query mapping: all H query heads of a layer travel in ONE job; the
heads that share a kv head are stacked on the PE rows of a q tile (decode,
seq_q = 1, by the NPU's controller; a short query block, by ``pack_query_groups``
before the job goes out), and a K/V tile held in the NPU's SRAM serves the
whole group.
``job_bytes`` states the traffic model that follows from it; the golden
backend reports that model (it has no clock), a hardware backend reports
what its counters measured.

Adding a backend: subclass ``Transport``, implement ``_run``, and
``register_backend("name", factory)``; the CLI lists every registered name.
A backend that cannot start raises ``BackendUnavailable`` with a message for
the user.  A transport that holds a simulator or a device releases it in
``close()``; every transport is a context manager that calls it.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

import numpy as np

from flashnpu.config import DEFAULT, NPUConfig
from flashnpu.golden import flash_attention_hw
from flashnpu.golden import numerics as nx
from flashnpu.sim import runner
from flashnpu.sim.case import AttentionCase, first_nonfinite

__all__ = [
    "AttentionJob", "JobResult", "TransportCounters", "Transport", "GoldenTransport",
    "BackendUnavailable", "register_backend", "make_transport", "backend_names", "job_bytes",
]

FP16_BYTES = 2
FP32_BYTES = 4


@dataclass
class AttentionJob:
    """One attention call of one layer, as the NPU receives it.

    Attributes
    ----------
    layer : int
        Block index (for tracing; the NPU does not need it).
    q : float16 [heads, seq_q, head_dim]
        Queries after RoPE.
    k, v : float16 [kv_heads, window, head_dim]
        The layer's KV cache, slots 0..window-1, as stored in NPU DRAM (a view
        of the driver's buffer; a backend must not write it).
    mask : bool [seq_q, window] or [heads, seq_q, window]
        True where query row i (of head h) may attend slot j.  Slots that are
        not valid are False whatever garbage they hold.  A per-head mask lets
        one job carry several sequences (``BatchDecoder``: sequence b's heads
        read its own kv heads and see its own slots).
    scale : float
        Softmax scale (1/sqrt(head_dim) for Llama).
    q_offset : int
        Position of query row 0; with contiguous valid slots the mask equals
        ``(j < kv_valid_len) & (j <= q_offset + i)`` (a controller may take
        these two numbers instead of the mask).  A batch's job (per-head
        mask) gives the smallest position and the largest valid length of
        its sequences; its mask alone decides what each head sees.
    kv_valid_len : int
        Valid slots in the window after this job's K/V were written.  The
        mask hides every slot at or beyond it (checked), and the backends
        pass it on: the NPU neither loads nor computes the kv tiles after
        it, and its P.V stops at it (a length of 0 passes no length).
    resident : bool
        The KV cache is resident in NPU DRAM (``Transport.bind_cache``): the
        backend already holds slots 0..window-1 of ``layer`` (the driver
        stored each new slot once with ``Transport.write_kv``), so ``k`` and
        ``v`` are not uploaded; they still give the shapes.
    kv_head0 : int
        With ``resident``: the bound cache's kv head that ``k[0]`` is (the
        job reads kv heads kv_head0..kv_head0+kv_heads-1 of ``layer``).
    """

    layer: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray
    scale: float
    q_offset: int
    kv_valid_len: int
    resident: bool = False
    kv_head0: int = 0

    def __post_init__(self):
        """Raises ValueError naming the value: wrong dtypes or shapes, a
        negative layer or q_offset, kv_valid_len outside 0..window, a scale
        outside ``numerics.scale_range(head_dim)``, NaN or Inf in q, k or v
        at a position the mask makes visible."""
        for name in ("q", "k", "v"):
            a = getattr(self, name)
            if a.dtype != np.float16 or a.ndim != 3:
                raise ValueError(f"job.{name} must be float16 with 3 dimensions, not {a.dtype} {a.shape}")
        heads, seq_q, d = self.q.shape
        kv_heads, window, dk = self.k.shape
        if self.v.shape != self.k.shape or dk != d:
            raise ValueError(f"job shapes disagree: q {self.q.shape}, k {self.k.shape}, v {self.v.shape}")
        if heads % kv_heads:
            raise ValueError(f"job heads={heads} is not a multiple of kv_heads={kv_heads}")
        if self.mask.dtype != np.bool_ or self.mask.shape not in ((seq_q, window), (heads, seq_q, window)):
            raise ValueError(f"job.mask must be bool [{seq_q}, {window}] or [{heads}, {seq_q}, {window}], "
                             f"not {self.mask.dtype} {self.mask.shape}")
        for name, lo, hi in (("layer", 0, None), ("q_offset", 0, None), ("kv_valid_len", 0, window),
                             ("kv_head0", 0, None)):
            val = getattr(self, name)
            if (isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo
                    or (hi is not None and val > hi)):
                raise ValueError(f"job.{name} must be an int >= {lo}" + (f" and <= the window {hi}" if hi is not None
                                                                          else "") + f", not {val!r}")
        try:
            nx.scale_log2e(self.scale, d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"job.scale: {e}") from None
        m = np.broadcast_to(self.mask, (heads, seq_q, window))
        beyond = np.flatnonzero(m[..., self.kv_valid_len:].any((0, 1)))
        if beyond.size:
            raise ValueError(f"job.mask lets a query see slot {self.kv_valid_len + int(beyond[0])}, at or beyond "
                             f"kv_valid_len={self.kv_valid_len}")
        kv_used = m.reshape(kv_heads, heads // kv_heads, seq_q, window).any((1, 2))
        bad = first_nonfinite((("job.q", self.q, m.any(2)), ("job.k", self.k, kv_used),
                               ("job.v", self.v, kv_used)))
        if bad:
            raise ValueError(bad)

    @property
    def heads(self) -> int:
        return self.q.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def seq_q(self) -> int:
        return self.q.shape[1]

    @property
    def window(self) -> int:
        return self.k.shape[1]

    @property
    def npu_kv_valid_len(self) -> int | None:
        """The length the backends give the NPU: kv_valid_len, None for 0."""
        return int(self.kv_valid_len) or None

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]


@dataclass
class JobResult:
    """What a backend returns for one job.

    Attributes
    ----------
    o : float32 [heads, seq_q, head_dim]
    cycles : int or None
        NPU cycles of the job (None when the backend has no clock).
    bytes : dict
        Bytes moved by the job per stream: ``q``, ``kv`` (K and V read from
        DRAM), ``o`` (output written).
    """

    o: np.ndarray
    cycles: int | None
    bytes: dict


@dataclass
class TransportCounters:
    """Running totals of a transport since its last ``reset_counters``.

    ``cycles`` is None as soon as one job came back without a cycle count.
    """

    jobs: int = 0
    q_bytes: int = 0
    kv_bytes: int = 0
    o_bytes: int = 0
    cycles: int | None = 0
    per_layer_jobs: dict = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return self.q_bytes + self.kv_bytes + self.o_bytes


def job_bytes(job: AttentionJob, config: NPUConfig = DEFAULT) -> dict:
    """DRAM traffic of ``job`` under the NPU's tile schedule (``hdl/npu.py``).

    Model (stated assumptions): for seq_q == 1 the ``heads // kv_heads``
    query heads that share a kv head are stacked on the rows of q tiles of
    ``config.br`` rows (``ceil(group / br)`` q tiles per kv head), otherwise
    each query head runs its own ``ceil(seq_q / br)`` q tiles.  K and V cover
    the first kv_valid_len slots of the job's window in FP16 (the NPU is
    given that length and fetches no key after it; the whole window when it
    is 0); they cross DRAM once per kv head when those slots' kv tiles fit
    the NPU's SRAM slots (``ceil(keys / bc) <= config.kv_slots``), else once
    per q tile.  Q is read once in FP16, O written once in FP32.

    Returns
    -------
    dict with integer byte counts ``q``, ``kv``, ``o``.
    """
    group = job.heads // job.kv_heads
    rows = group if job.seq_q == 1 else job.seq_q
    q_tiles = math.ceil(rows / config.br) * (1 if job.seq_q == 1 else group)
    keys = job.npu_kv_valid_len or job.window
    fetches = 1 if math.ceil(keys / config.bc) <= config.kv_slots else q_tiles
    return dict(
        q=job.q.size * FP16_BYTES,
        kv=2 * job.kv_heads * fetches * keys * job.head_dim * FP16_BYTES,
        o=job.heads * job.seq_q * job.head_dim * FP32_BYTES,
    )


def pack_query_groups(job: AttentionJob, config: NPUConfig = DEFAULT) -> AttentionJob | None:
    """The job with each kv head's query heads folded into its query rows,
    when that needs fewer q tiles; None when it does not.

    A q tile holds ``config.br`` query rows of ONE query head (the NPU's
    controller stacks the heads of a group only at seq_q == 1), so a prefill
    chunk of Lq < Br rows fills Lq of Br rows, G = H / kv_heads times per kv
    head.  As G * Lq rows of one kv head (rows ordered head, then query: the
    same memory order as ``q``), the job takes ceil(G * Lq / Br) q tiles per
    kv head instead of G * ceil(Lq / Br); e.g. SmolLM2's 4-token prompt: 1
    instead of 3 (grouped-query "packing", as FlashAttention-3's pack_gqa).

    Every query row keeps its own mask row, its kv head's keys and the same
    kv tiles (the NPU skips tiles by kv_valid_len alone, as the driver's jobs
    carry no causal flag, only the mask), and FlashAttention computes each
    row on its own, so the output is bit-identical
    (``tb/driver/test_driver_runtime.py``).  ``q_offset`` stays the
    first row's position; the mask alone decides what each row sees.

    Returns
    -------
    AttentionJob with q float16 [kv_heads, G * Lq, head_dim], mask bool
    [G * Lq, W] (shared mask, tiled per head) or [kv_heads, G * Lq, W]; its
    output float32 [kv_heads, G * Lq, head_dim] reshapes to the job's
    [H, Lq, head_dim] in memory order.  None for seq_q == 1 (the controller
    stacks those itself), G == 1, or no q tile saved.
    """
    g, n, br = job.heads // job.kv_heads, job.seq_q, config.br
    if n == 1 or g == 1 or math.ceil(g * n / br) >= g * math.ceil(n / br):
        return None
    kvh, w = job.kv_heads, job.window
    mask = (np.tile(job.mask, (g, 1)) if job.mask.ndim == 2 else job.mask.reshape(kvh, g * n, w))
    return AttentionJob(job.layer, job.q.reshape(kvh, g * n, job.head_dim), job.k, job.v, mask, job.scale,
                        job.q_offset, job.kv_valid_len, job.resident, job.kv_head0)


class Transport(abc.ABC):
    """The NPU as the driver sees it: run attention jobs, count what they cost.

    Subclasses implement ``_run``; ``run`` checks the result and keeps the
    counters.  ``name`` is the backend name; ``config`` the NPU configuration
    (the driver reads ``config.bc`` to round its KV windows to kv tiles).
    """

    name = "abstract"

    def __init__(self, config: NPUConfig = DEFAULT):
        if not isinstance(config, NPUConfig):
            raise TypeError(f"config must be an NPUConfig, not {config!r}")
        self.config = config
        self.counters = TransportCounters()

    @property
    def has_cycles(self) -> bool:
        """Whether jobs report NPU cycles."""
        return False

    def reset_counters(self) -> None:
        self.counters = TransportCounters()

    def bind_cache(self, cache) -> bool:
        """Offer the driver's ``KVCache`` to live in the NPU's own memory.
        True: the backend keeps a copy of every slot the driver stores with
        ``write_kv`` and jobs may say ``resident=True``; False (the default,
        e.g. the golden backend): every job carries its window."""
        return False

    def write_kv(self, layer: int, start: int, k: np.ndarray, v: np.ndarray,  # noqa: B027 -- a hook
                 head0: int = 0) -> None:
        """Store k, v (float16 [n_heads, n, head_dim]) in slots start..start+n-1
        of kv heads head0..head0+n_heads-1 of ``layer`` of a bound cache
        (no-op unless ``bind_cache`` returned True)."""

    def run(self, job: AttentionJob) -> JobResult:
        """Run one job (its query groups packed where that saves q tiles:
        ``pack_query_groups``) and add its cost to ``counters``.

        Raises
        ------
        ValueError
            if the head_dim is above the NPU's ``max_head_dim``, or the
            backend returns an output of the wrong shape or dtype.
        """
        self.config.check_head_dim(job.head_dim)
        packed = pack_query_groups(job, self.config)
        return self._unpack(job, packed, self._run(packed or job))

    def run_many(self, jobs: list) -> list:
        """Run independent jobs (no job reads another's output), e.g. the
        per-head jobs of one layer; results in order, each accounted as by
        ``run``.  A backend may submit them together (``RTLTransport``: one
        queued sweep behind one doorbell of the NPU's command ring).

        Raises
        ------
        ValueError as ``run``, before any job runs.
        """
        for job in jobs:
            self.config.check_head_dim(job.head_dim)
        packed = [pack_query_groups(job, self.config) for job in jobs]
        results = self._run_many([p or job for p, job in zip(packed, jobs)])
        return [self._unpack(job, p, res) for job, p, res in zip(jobs, packed, results, strict=True)]

    def _run_many(self, jobs: list) -> list:
        return [self._run(job) for job in jobs]

    def _unpack(self, job: AttentionJob, packed: AttentionJob | None, res: JobResult) -> JobResult:
        """``res`` of ``packed`` (``pack_query_groups``) as ``job``'s result, accounted."""
        if packed is not None and res.o.shape == (packed.heads, packed.seq_q, packed.head_dim):
            res = JobResult(res.o.reshape(job.heads, job.seq_q, job.head_dim), res.cycles, res.bytes)
        return self._account(job, res)

    def _account(self, job: AttentionJob, res: JobResult) -> JobResult:
        want = (job.heads, job.seq_q, job.head_dim)
        if res.o.shape != want or res.o.dtype != np.float32:
            raise ValueError(f"backend {self.name!r} returned o {res.o.dtype} {res.o.shape}, expected float32 {want}")
        c = self.counters
        c.jobs += 1
        c.per_layer_jobs[job.layer] = c.per_layer_jobs.get(job.layer, 0) + 1
        c.q_bytes += int(res.bytes.get("q", 0))
        c.kv_bytes += int(res.bytes.get("kv", 0))
        c.o_bytes += int(res.bytes.get("o", 0))
        c.cycles = None if (c.cycles is None or res.cycles is None) else c.cycles + int(res.cycles)
        return res

    @abc.abstractmethod
    def _run(self, job: AttentionJob) -> JobResult:
        """Backend-specific execution of one job."""

    def close(self) -> None:  # noqa: B027 -- a hook with a default, not abstract
        """Release simulator processes or devices (nothing by default)."""

    def backend_stats(self) -> dict:
        """Backend-specific figures for the decode statistics (JSON-able; empty by default)."""
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GoldenTransport(Transport):
    """Runs jobs on the bit-exact golden model ``flash_attention_hw``.

    The result is bit-identical to what the RTL must produce.  No clock:
    ``cycles`` is None; bytes follow ``job_bytes``.
    """

    name = "golden"

    def _run(self, job: AttentionJob) -> JobResult:

        res = flash_attention_hw(job.q, job.k, job.v, mask=job.mask, kv_valid_len=job.npu_kv_valid_len,
                                 scale=job.scale, config=self.config)
        return JobResult(o=res.o, cycles=None, bytes=job_bytes(job, self.config))


class BackendUnavailable(RuntimeError):
    """A registered backend cannot run here (missing hardware model, simulator...)."""


class RTLTransport(Transport):
    """Runs each job on the NPU's generated Verilog (``flashnpu.sim.rtl_backend``)
    through its CSR host interface.

    By default one simulator session (``NPUSession``) starts with the first
    job and serves every later one, so the model loads once per decode; it
    stops in ``close()`` (or at the end of a ``with`` block, or at interpreter
    exit).  ``session=False`` starts one cocotb run per job instead (the
    batch mode of ``flashnpu sim``; same results, seconds of start-up per
    job).

    With a bound cache (``bind_cache``, which ``Decoder`` calls) the KV
    cache lives in the session's NPU DRAM: each new slot is stored once
    (``write_kv``), resident jobs read their window where it lies, and the
    NPU is reset and its TSV links self-tested once at power-up instead of
    per job.  A session that had to be restarted gets the host's copy of the
    cache stored again before its first job.

    The job goes in as the driver's mask (``[seq_q, window]``, one mask row per
    query, shared by the heads, or one per head and query for a batch), so
    padded and future slots are hidden whatever
    they hold; ``cycles`` are the NPU's ``total_cycles`` counter and ``bytes``
    follow ``job_bytes`` (the RTL's own per-level bytes are in ``last_counters``).

    Parameters
    ----------
    config : NPUConfig
        The NPU to build and simulate (e.g. an 8 x 8 array for a fast run).
    sim : 'verilator' (default) or 'icarus'
    session : bool
        One persistent simulator session (default) or one run per job.
    job_timeout_s : float
        Wall-clock seconds one job may take before the session is killed.

    Attributes
    ----------
    last_counters : dict, the NPU counters of the last job
    sim_wall_s : float, seconds the testbench spent in jobs (simulated time)
    sessions_started : int
    startup_s : float, seconds spent starting sessions (build check, model
        load, cocotb start-up)

    Raises
    ------
    BackendUnavailable
        when the simulator is not installed.
    RuntimeError
        when the NPU stops a job with an error code, or the simulator
        session dies or does not answer (the message names its log file).
    """

    name = "rtl"
    #: first NPU DRAM byte of a bound KV cache
    KV_BASE = 0x1000
    #: NPU DRAM kept above a bound cache for one job's Q, O and mask (a
    #: 64-row prefill chunk of 9 heads at head_dim 128 needs about 0.25 MiB)
    JOB_SCRATCH_BYTES = 1 << 20

    def __init__(self, config: NPUConfig = DEFAULT, sim: str = "verilator", session: bool = True,
                 job_timeout_s: float = 3600.0, **_):
        super().__init__(config)
        if not runner.have_simulator(sim):
            raise BackendUnavailable(f"the rtl backend needs the simulator {sim!r}")
        self.sim = sim
        self.persistent = bool(session)
        self.job_timeout_s = job_timeout_s
        self.last_counters: dict = {}
        self.sim_wall_s = 0.0
        self.sessions_started = 0
        self.startup_s = 0.0
        self.kv_upload_bytes = 0
        self.power_ups = 0
        self._session = None
        self._cache = None                  # the bound KVCache and its NPU DRAM layout
        self._layout: dict = {}
        self._pending: list = []            # (byte address, bytes) not yet in NPU DRAM
        self._mirrored_by = None            # the session whose DRAM holds the mirror

    def bind_cache(self, cache) -> bool:
        """Keep ``cache`` (a ``driver.runtime.KVCache``) in NPU DRAM for the
        whole session (only with ``session=True``).  Layout: K of every layer,
        then V, each ``[n_layers, kv_heads, capacity]`` rows of
        ``rtl_backend.row_bytes`` bytes from byte ``KV_BASE``; each job's Q,
        mask and O go above it (``JOB_SCRATCH_BYTES``).

        Raises
        ------
        ValueError
            when the cache and a job's scratch do not fit the NPU's
            ``dram_bytes`` (the message names the capacity).
        """
        if not self.persistent:
            return False
        from flashnpu.sim.rtl_backend import row_bytes  # deferred, as in ``session``

        L, G, C, d = cache.k.shape
        row = row_bytes(self.config, d)
        hs = C * row
        size = L * G * hs
        end = self.KV_BASE + 2 * size
        if end + self.JOB_SCRATCH_BYTES > self.config.dram_bytes:
            raise ValueError(f"a KV cache of capacity {C} ({L} layers x {G} kv heads x {row} B rows, "
                             f"{2 * size} bytes) does not fit the NPU's {self.config.dram_bytes}-byte DRAM "
                             f"beside a job's scratch; lower max_prompt_len or min_response_len")
        self._cache = cache
        self._layout = dict(row=row, head_stride=hs, layer=G * hs, k=self.KV_BASE, v=self.KV_BASE + size,
                            base=end)
        self._pending = []
        self._mirrored_by = None
        return True

    def write_kv(self, layer: int, start: int, k: np.ndarray, v: np.ndarray, head0: int = 0) -> None:
        """Queue the new slots' DRAM writes (sent with the next resident job,
        then counted in ``kv_upload_bytes``)."""
        if self._cache is None:
            return
        from flashnpu.sim.rtl_backend import fp16_rows  # deferred, as in ``session``

        lay = self._layout
        for base, x in ((lay["k"], k), (lay["v"], v)):
            rows = fp16_rows(x, self.config)
            for g in range(rows.shape[0]):
                a = base + layer * lay["layer"] + (head0 + g) * lay["head_stride"] + int(start) * lay["row"]
                self._pending.append((a, rows[g].tobytes()))

    @property
    def has_cycles(self) -> bool:
        return True

    @property
    def session(self):
        """The live ``NPUSession`` (started on first use), or None with ``session=False``."""
        if not self.persistent:
            return None
        if self._session is None or not self._session.alive:
            # deferred: the RTL backend imports amaranth and the NPU, which the
            # golden backend (and `flashnpu --help`) does not need
            from flashnpu.sim.rtl_backend import NPUSession
            if self._session is not None:
                self._session.close()
            self._session = NPUSession(self.config, sim=self.sim, job_timeout_s=self.job_timeout_s)
            self.sessions_started += 1
            self.startup_s += self._session.startup_s
        return self._session

    def _spec(self, job: AttentionJob) -> dict:
        """The run_jobs job dict of ``job`` (a resident job: its cache region
        and the slots to store first)."""
        case = AttentionCase(q=np.ascontiguousarray(job.q), k=np.ascontiguousarray(job.k),
                             v=np.ascontiguousarray(job.v), mask=np.asarray(job.mask, bool),
                             kv_valid_len=job.npu_kv_valid_len, scale=float(job.scale))
        spec = dict(case=case, name=f"layer{job.layer}")
        session = self.session
        if job.resident:
            if self._cache is None or session is None:
                raise ValueError("job.resident needs a cache bound with bind_cache on a session transport")
            if self._mirrored_by is not session:
                # a new simulator session starts with empty DRAM: store every
                # slot the driver wrote so far again (the host's cache holds
                # what DRAM held)
                self._pending = []
                c = self._cache
                for layer in range(c.k.shape[0]):
                    n = int(np.flatnonzero(c.writes[layer]).max(initial=-1)) + 1
                    if n:
                        self.write_kv(layer, 0, c.k[layer, :, :n], c.v[layer, :, :n])
                self._mirrored_by = session
            lay = self._layout
            off = job.layer * lay["layer"] + job.kv_head0 * lay["head_stride"]
            spec["resident"] = dict(kv=dict(k_base=lay["k"] + off, v_base=lay["v"] + off,
                                            head_stride=lay["head_stride"]),
                                    base=lay["base"], writes=self._pending)
        return spec

    def _result(self, job: AttentionJob, r: dict) -> JobResult:
        from flashnpu.hdl.npu import NPUError

        self.power_ups += bool(r.get("powered_up"))
        if r["error"]:
            raise RuntimeError(f"the NPU stopped the job of layer {job.layer}: {NPUError(r['error']).name}")
        self.last_counters = r["counters"]
        self.sim_wall_s += r["wall_s"]
        return JobResult(o=r["o"], cycles=int(r["counters"]["total_cycles"]),
                         bytes=job_bytes(job, self.config))

    def _run(self, job: AttentionJob) -> JobResult:
        # deferred: the RTL backend imports amaranth and the NPU, which the
        # golden backend (and `flashnpu --help`) does not need
        from flashnpu.sim.rtl_backend import run_jobs

        spec = self._spec(job)
        session = self.session
        if session is not None:
            r = session.run(spec)
        else:
            r = run_jobs([spec], self.config, sim=self.sim)[0]
        if job.resident:
            self.kv_upload_bytes += sum(len(b) for _, b in self._pending)
            self._pending = []
        elif session is not None:
            self._mirrored_by = None        # a job from reset starts from empty DRAM
        return self._result(job, r)

    def _run_many(self, jobs: list) -> list:
        """Jobs without a resident cache go to the session as queued sweeps
        of up to ``CQ_ENTRIES`` (one power-up and one doorbell per sweep,
        each job's DRAM placed after the previous one's); others one by one."""
        from flashnpu.hdl.npu_map import CQ_ENTRIES

        if not self.persistent or any(j.resident for j in jobs):
            return [self._run(j) for j in jobs]
        out = []
        for i in range(0, len(jobs), CQ_ENTRIES):
            part = jobs[i:i + CQ_ENTRIES]
            rs = self.session.run(dict(group=[self._spec(j) for j in part], name=f"layer{part[0].layer}"))
            self._mirrored_by = None        # the sweep starts from reset: empty DRAM
            out += [self._result(j, r) for j, r in zip(part, rs)]
        return out

    def close(self) -> None:
        """Stop the simulator session, if one is running."""
        if self._session is not None:
            self._session.close()
            self._session = None

    def backend_stats(self) -> dict:
        """``simulator``, ``sim_sessions``, ``sim_startup_seconds``,
        ``sim_job_seconds`` (testbench time inside jobs), ``kv_resident``
        (a bound cache lives in NPU DRAM), ``kv_upload_bytes`` (K/V bytes
        stored into NPU DRAM by ``write_kv``, rows padded to the bus word) and
        ``npu_power_ups`` (jobs that ran the reset and TSV self-test)."""
        return dict(simulator=self.sim, sim_sessions=self.sessions_started if self.persistent else None,
                    sim_startup_seconds=round(self.startup_s, 3), sim_job_seconds=round(self.sim_wall_s, 3),
                    kv_resident=self._cache is not None, kv_upload_bytes=self.kv_upload_bytes,
                    npu_power_ups=self.power_ups)


_BACKENDS: dict = {"golden": GoldenTransport, "rtl": RTLTransport}


def register_backend(name: str, factory) -> None:
    """Register (or replace) backend ``name``; ``factory(config=..., **options)`` returns a Transport."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"backend name must be an identifier, not {name!r}")
    if not callable(factory):
        raise TypeError(f"backend factory must be callable, not {factory!r}")
    _BACKENDS[name] = factory


def backend_names() -> list:
    """Names of the registered backends."""
    return sorted(_BACKENDS)


def make_transport(name: str, config: NPUConfig = DEFAULT, **options) -> Transport:
    """Create the transport of backend ``name``.

    Raises
    ------
    ValueError
        unknown backend name (the message lists the known ones).
    BackendUnavailable
        the backend exists but cannot run here.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(backend_names())}")
    return _BACKENDS[name](config=config, **options)
