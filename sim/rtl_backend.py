"""The ``rtl`` backend of ``flashnpu sim``: the whole NPU's generated Verilog
under Verilator (or Icarus) through cocotb, driven like a host would.

::

   run(case) ─► plan_job: DRAM placement + CSR values ─► job .npz + jobs.json (temp dir)
        │                                                    │ FLASHNPU_NPU_JOBS
        ▼                                                    ▼
   build_npu (runner cache, once per configuration)   sim/cocotb_npu.py: reset, TSV self-test
        │                                             via CSRs, Q/K/V/mask into the DRAM model,
        └──────────── run_cocotb ───────────────────► program, start, poll status, read O
                                                      and the counters ─► result .npz
   run() ◄── o, stats ◄──────────────────────────────────────────────────────┘

That is the batch mode (``run_jobs``: every job known up front, one cocotb
run).  ``NPUSession`` is the server mode for callers that make jobs one at a
time (the driver's ``rtl`` backend): one cocotb run stays alive and takes
job specs through a FIFO, running each exactly as the batch mode does.

DRAM layout chosen by the host side (``plan_job``): every tensor row is
padded to a multiple of the bus word W (the DMA moves whole words from
word-aligned rows), Q/O as [heads, seq_q, row], K/V as [kv_heads, seq_kv,
row], the mask as [mask_heads, kv_tiles, seq_q] rows of one word each (bit t
of a row = key t of the tile).  The simulation uses ``sim_config(config)``:
the SRAM shrunk to the NPU's SRAM map (results do not depend on it).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import math
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from flashnpu.config import NPUConfig
from flashnpu.errors import UsageError
from flashnpu.golden import numerics as nx
from flashnpu.golden import visible_mask
from flashnpu.hdl.array import flat_row
from flashnpu.hdl.mem_common import word_bytes
from flashnpu.hdl.npu import NPU, NPU_MODULE, NPUError, npu_verilog, register_map, sim_config
from flashnpu.hdl.npu_map import CQ_ENTRIES, JOB_REGS
from flashnpu.sim import runner
from flashnpu.sim.waves import WaveOptions

__all__ = ["plan_job", "build_npu", "run_jobs", "NPUSession", "run", "O_SENTINEL"]

O_SENTINEL = 0xA5          # byte pattern the host writes over the O region before a job
DEFAULT_WAVE_CYCLES = 4000     # --waves without --wave-window dumps cycles [0, 4000)
WAVE_ROW = 0                   # the PE row a Verilator model with waves keeps flat (traced)
DEFAULT_WAVE_DEPTH = 2         # --waves without --wave-depth: the top and its children


def _rup(n: int, w: int) -> int:
    return -(-n // w) * w


def row_bytes(config: NPUConfig, head_dim: int) -> int:
    """Bytes of one FP16 row of Q, K or V in NPU DRAM (head_dim values,
    padded to the bus word), as ``plan_job`` lays them out."""
    return _rup(2 * max(int(head_dim), 1), word_bytes(config))


def fp16_rows(x: np.ndarray, config: NPUConfig) -> np.ndarray:
    """uint8 [heads, n, row_bytes]: ``x`` (float16 [heads, n, head_dim]) as its
    rows lie in NPU DRAM, each zero-padded to ``row_bytes(config, head_dim)``."""
    h, n, d = x.shape
    buf = np.zeros((h, n, row_bytes(config, d)), np.uint8)
    buf[:, :, :2 * d] = np.ascontiguousarray(x, np.float16).view(np.uint8).reshape(h, n, 2 * d)
    return buf


def plan_job(case, config: NPUConfig, base: int = 0x1000, overrides: dict | None = None,
             kv_region: dict | None = None) -> dict:
    """Place a case in DRAM and compute the CSR values of its job.

    ``kv_region`` (a KV cache resident in NPU DRAM, ``RTLTransport``): dict
    ``k_base``, ``v_base``, ``head_stride`` (bytes between kv heads); K and V
    are then not placed (``case.k``/``case.v`` give only the shapes) and the
    job reads them where they already are, rows of ``row_bytes(config,
    head_dim)`` bytes.  ``base`` must then lie above the region.

    Returns a dict: ``regs`` (register name -> 32-bit value, in writing
    order), ``writes`` (list of (byte address, bytes) for the DRAM model),
    ``o`` (dict base, head_stride, row_stride, heads, seq_q, head_dim) and
    ``o_extent`` (byte range of the O tensor).  ``overrides`` replaces
    register values after planning (rejection tests).
    """
    W = word_bytes(config)
    q, k, v = case.q, case.k, case.v
    heads, seq_q, hd = q.shape
    kvh, seq_kv, _ = k.shape
    hd_eff = max(hd, 1)
    rs = row_bytes(config, hd)
    ors = _rup(4 * hd_eff, W)
    addr = _rup(base, 4096)
    writes = []

    def place(x):
        nonlocal addr
        buf = fp16_rows(x, config)
        a = addr
        writes.append((a, buf.tobytes()))
        addr = _rup(a + buf.size + 1, 4096)
        return a, x.shape[1] * rs, rs

    qa, qhs, qrs = place(q)
    if kv_region is None:
        ka, khs, krs = place(k)
        va, vhs, vrs = place(v)
    else:
        ka, va = int(kv_region["k_base"]), int(kv_region["v_base"])
        khs = vhs = int(kv_region["head_stride"])
        krs = vrs = rs
    oa = addr
    ohs, ors_ = seq_q * ors, ors
    o_bytes = heads * seq_q * ors
    addr = _rup(oa + o_bytes + 1, 4096)
    writes.append((oa, bytes([O_SENTINEL]) * o_bytes))
    n_kv = -(-seq_kv // config.bc)
    mask_base = mhs = mts = 0
    mask_en = case.mask is not None
    if mask_en:
        mk = np.asarray(case.mask, bool)
        if mk.ndim == 2:
            mk = mk[None]
        mh = mk.shape[0]
        pad = n_kv * config.bc - seq_kv
        mk = np.concatenate([mk, np.zeros((mh, seq_q, pad), bool)], axis=2)
        tiles = mk.reshape(mh, seq_q, n_kv, config.bc).transpose(0, 2, 1, 3)   # [mh, j, sq, bc]
        bits = np.packbits(tiles, axis=-1, bitorder="little")                   # [mh, j, sq, bc/8]
        buf = np.zeros((mh, n_kv, seq_q, W), np.uint8)
        buf[..., :bits.shape[-1]] = bits
        mask_base = addr
        writes.append((mask_base, buf.tobytes()))
        mts = seq_q * W
        mhs = n_kv * seq_q * W if mh > 1 else 0
        addr = _rup(mask_base + buf.size + 1, 4096)
    scale = 1.0 / math.sqrt(hd_eff) if case.scale is None else float(case.scale)
    c_bits = int(np.float32(nx.scale_log2e(scale, hd_eff)).view(np.uint32))
    kvl = seq_kv if case.kv_valid_len is None else min(int(case.kv_valid_len), seq_kv)
    regs = dict(q_base=qa, k_base=ka, v_base=va, o_base=oa, mask_base=mask_base,
                q_head_stride=qhs, q_row_stride=qrs, k_head_stride=khs, k_row_stride=krs,
                v_head_stride=vhs, v_row_stride=vrs, o_head_stride=ohs, o_row_stride=ors_,
                mask_head_stride=mhs, mask_tile_stride=mts,
                heads=heads | (kvh << 16), seq=seq_q | (seq_kv << 16), head_dim=hd,
                flags=int(bool(case.causal)) | (int(mask_en) << 1), kv_valid_len=kvl,
                scale_c=c_bits)
    for kk, vv in (overrides or {}).items():
        regs[kk] = int(vv) & 0xFFFFFFFF
    return dict(regs=regs, writes=writes, end=addr,
                o=dict(base=oa, head_stride=ohs, row_stride=ors_, heads=heads, seq_q=seq_q, head_dim=hd),
                o_extent=(oa, oa + o_bytes))


def job_registers(plan: dict, config: NPUConfig, debug: int = 0) -> dict:
    """Every job register's value (``JOB_REGS``, in that order): the plan's,
    ``debug``, and the reset value of the rest.  A queued descriptor carries
    them all and a direct job writes them all, so no job inherits a value an
    earlier one left."""
    rmap = register_map(config)
    regs = {n: rmap[n].reset for n in JOB_REGS}
    regs.update(plan["regs"])
    regs["debug"] = int(debug)
    return regs


#: arrays of at least this many PEs get a two-thread Verilator model when a
#: second core is free (measured on the 32 x 32 replay, idle 2-core machine:
#: 1,239 -> 2,069 cycles/s); the small ones stay single-threaded
THREADED_PES = 256

#: environment variable that fixes the Verilator thread count (``sim_threads``)
THREADS_ENV = "FLASHNPU_SIM_THREADS"


def sim_threads(config: NPUConfig) -> int:
    """Verilator ``--threads`` for the NPU at ``config``'s size: 2 from
    ``THREADED_PES`` PEs up when this process may use two cores and no
    sibling simulation shares them (pytest-xdist workers, the local workers
    of ``flashnpu regress``), else 1.  A multi-threaded Verilator model waits
    for its threads by spinning, so on shared cores it collapses (32 x 32
    under load: 647 cycles/s with 2 threads against 1,724 with 1; README,
    "Simulator speed").  ``FLASHNPU_SIM_THREADS=N`` overrides the choice.
    Each thread count is its own cached build; results do not depend on it
    (case S1).

    Raises
    ------
    UsageError
        when ``FLASHNPU_SIM_THREADS`` is not a whole number from 1 to 64.
    """
    env = os.environ.get(THREADS_ENV)
    if env is not None:
        if not env.strip().isdigit() or not 1 <= int(env) <= 64:
            raise UsageError(f"{THREADS_ENV}={env!r}: expected a whole number of threads from 1 to 64")
        return int(env)
    if config.array_rows * config.array_cols < THREADED_PES or len(os.sched_getaffinity(0)) < 2:
        return 1
    return 1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2


@contextlib.contextmanager
def fixed_threads(n: int):
    """``FLASHNPU_SIM_THREADS=n`` inside the block (processes started there
    inherit it), unless the variable is already set; restored afterwards."""
    if THREADS_ENV in os.environ:
        yield
        return
    os.environ[THREADS_ENV] = str(int(n))
    try:
        yield
    finally:
        os.environ.pop(THREADS_ENV, None)


def verilator_args(config: NPUConfig, hierarchical: bool = True) -> list[str]:
    """The NPU's Verilator build choices at ``config``'s size: the PE row
    as a hierarchical block (compiled once, its PEs and tree nodes inside), ``-O2`` instead of
    Verilator's default ``-Os`` for the C++ (+6 % at 32 x 32), and
    ``sim_threads`` threads.  Measurements: README, "Simulator speed"."""
    return ((["--hierarchical"] if hierarchical else []) + ["--threads", str(sim_threads(config))]
            + ["-CFLAGS", "-O2"])


def build_npu(config: NPUConfig, sim: str = "verilator", waves=False, quiet: bool = False,
              hierarchical: bool = True):
    """Build (or reuse) the NPU model for ``sim_config(config)``; returns the runner's handle.
    ``quiet``: the simulator build's output goes to ``build.log`` in the build folder;
    ``hierarchical``: Verilator builds the PE row as a hierarchical block
    (default; a model with waves keeps PE row ``WAVE_ROW`` out of it) or,
    False, everything flat (the 32 x 32 NPU: over half an hour and an
    8.4 GiB Verilator against about 2 minutes; README, "Simulator speed")."""
    scfg = sim_config(config)
    # Verilator traces only the top model of a --hierarchical build: a model
    # with waves keeps PE row WAVE_ROW out of the hierarchical blocks, so the
    # waves see inside one full row (register files, MACs, softmax, tree)
    hier = hierarchical and sim == "verilator"
    flat = bool(waves) and hier

    def text(top):
        v = npu_verilog(scfg, top=top)
        return flat_row(v, WAVE_ROW) if flat else v
    return runner.build(lambda: NPU(scfg, pe_as_instance=True), scfg, NPU_MODULE, sim=sim,
                        waves=waves, key=f"npu-flat-row{WAVE_ROW}" if flat else "npu", verilog_text=text,
                        meta={"regmap": register_map(scfg).to_dict()},
                        build_args=verilator_args(scfg, hier) if sim == "verilator" else None, quiet=quiet,
                        dram_word=word_bytes(scfg), dram_channels=scfg.dram_channels,
                        traced=f"the top model and PE row {WAVE_ROW}" if flat else None)


def _timeout(case, config: NPUConfig) -> int:
    """A generous cycle limit for one job (4x a serial estimate: every kv tile's
    load, both MAC phases and every q tile's Q load and O write-back one after
    another), so a hung job fails in bounded time."""
    heads, seq_q, hd = case.q.shape
    W = word_bytes(config)
    q_tiles = heads * -(-seq_q // config.br)
    kv_tiles = -(-case.k.shape[1] // config.bc)
    words = -(-2 * max(hd, 1) // W)
    per_kv = 2 * config.bc * words + 2 * config.br * config.bc * max(hd, 1) // config.macs_per_cycle + 200
    per_q = config.br * (3 * words + 4) + 2 * config.dram_latency_cycles
    return 4 * (q_tiles * (kv_tiles * per_kv + per_q)) + 200_000


def _save_case(path, case):
    d = dict(q=case.q, k=case.k, v=case.v, causal=np.array(bool(case.causal)))
    if case.mask is not None:
        d["mask"] = np.asarray(case.mask, bool)
    if case.kv_valid_len is not None:
        d["kv_valid_len"] = np.array(int(case.kv_valid_len))
    if case.scale is not None:
        d["scale"] = np.array(float(case.scale))
    np.savez(path, **d)


def _job_spec(job: dict, tag: str, folder: Path, config: NPUConfig, seed: int) -> dict:
    """Write ``job``'s case into ``folder`` and return the testbench's job spec
    (the contract of ``sim/cocotb_npu.py``, batch and server mode alike)."""
    if "group" in job:
        if not 1 <= len(job["group"]) <= CQ_ENTRIES:
            raise ValueError(f"a queued group holds 1 to {CQ_ENTRIES} jobs (the command ring), "
                             f"not {len(job['group'])}")
        members = [_job_spec(mj, f"{tag}_{k}", folder, config, seed + k) for k, mj in enumerate(job["group"])]
        return dict(group=members, name=job.get("name", f"group{tag}"), ring_reset=bool(job.get("ring_reset")),
                    keep_state=bool(job.get("keep_state")), records=bool(job.get("records")))
    cp = folder / f"job{tag}.npz"
    _save_case(cp, job["case"])
    resident = None
    if job.get("resident") is not None:
        r = job["resident"]
        wp = folder / f"writes{tag}.npz"
        ws = r.get("writes") or []
        np.savez(wp, addr=np.array([a for a, _ in ws], np.int64),
                 **{f"d{i}": np.frombuffer(b, np.uint8) for i, (_, b) in enumerate(ws)})
        resident = dict(kv=r["kv"], base=int(r["base"]), writes=str(wp))
    return dict(inputs=str(cp), out=str(folder / f"res{tag}.npz"), resident=resident,
                overrides=job.get("overrides", {}), debug=int(job.get("debug", 0)),
                watchdog=job.get("watchdog"), timeout=job.get("timeout") or _timeout(job["case"], config),
                name=job.get("name", f"job{tag}"), seed=int(job.get("seed", seed)),
                tsv_fault=job.get("tsv_fault") or {}, stress=job.get("stress") or {},
                s_check=job.get("s_check"), submit=job.get("submit", "queue"))


def _build_info(h) -> dict:
    bj = json.loads((Path(h.build_dir).parent / "build.json").read_text())
    return dict(generate_s=bj.get("generate_s"), build_s=bj.get("build_s"),
                verilog_bytes=bj.get("verilog_bytes"))


def _load_result(spec: dict, build_info: dict) -> "dict | list":
    if "group" in spec:
        return [_load_result(ms, build_info) for ms in spec["group"]]
    with np.load(spec["out"], allow_pickle=False) as z:
        r = json.loads(str(z["meta_json"]))
        r["o"] = z["o"].copy()
    r["build"] = dict(build_info)
    return r


def _log_tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_jobs(jobs, config: NPUConfig, sim: str = "verilator", waves=None, seed: int = 0,
             workdir=None, quiet: bool = True, x_seed: int | None = None, hierarchical: bool = True) -> list:
    """Run several jobs in one cocotb session on one NPU build (batch mode).

    ``jobs``: list of dicts with ``case`` (AttentionCase) and optional
    ``overrides`` (register values, e.g. a bad head_dim), ``debug`` (value
    of the debug register), ``watchdog``, ``timeout`` (cycles), ``tsv_fault``
    (``{"tsv_fault_rd"|"tsv_fault_wr": value}``, written before the TSV
    self-test), ``seed`` (of the job's DRAM model; default ``seed`` + the
    job's index), ``stress`` (``{"dram_delay", "host_idle", "sram_stall"}``:
    random DRAM response delay within the modelled latency, host idle
    cycles, SRAM stall rate / 16; see ``sim/cocotb_npu.py``), ``s_check``
    (``{"threshold", "flip_mask"}``: the S-tile check, see
    ``sim/cocotb_npu.py``), ``submit`` (``"queue"``, the default: one
    descriptor in the command ring and a doorbell; ``"csr"``: the job
    registers and ``ctrl.start``).  A job ``{"group": [job, ...]}`` queues
    its members behind one doorbell (``ring_reset``: reset the ring first;
    ``keep_state``: no power-up, the NPU as the previous job left it;
    ``records``: read every ring entry's completion record); its result is
    the list of its members' results, each with ``queue`` (index,
    ``t_start``, ``t_done``) and ``group`` (``irq_edges``, ``cq_ptr``,
    ``cq_status``, with ``records`` every entry's completion record).  Returns one
    dict per job: ``o`` (float32 [heads, seq_q, head_dim]), ``error``
    (NPUError int), ``dma_code``, ``o_untouched`` (bool: the O region still
    holds the sentinel), ``counters`` (dict), ``wall_s`` (seconds from the start command to
    done), ``build`` info,
    ``tsv`` (links' status and repair maps, jobs with ``tsv_fault`` only) and
    ``reg_check`` (the offending register read, error REG_UNWRITTEN only)
    ``kv_check`` (the stale K/V tile, error KV_STALE only) and ``s_check``
    (jobs with the S-tile check: ``stopped``, ``tiles`` compared and, when
    it stopped, ``head``, ``q_tile``, ``kv_tile``, ``count``, ``expected``).
    ``quiet``: cocotb's output goes to ``cocotb.log`` in the work folder
    (its tail is shown when a run fails).  ``x_seed`` (Verilator): every
    register and memory word powers up random from this seed instead of 0
    (the same build); results must not change.  ``hierarchical``: see
    ``build_npu``.  Every job is known up front; a
    caller that makes jobs one at a time (the driver) uses ``NPUSession``.

    Raises
    ------
    AssertionError
        when the cocotb run failed (a job timed out, the simulator stopped);
        the message ends with the tail of the log.
    """
    wopts = waves if isinstance(waves, WaveOptions) else bool(waves)
    h = build_npu(config, sim=sim, waves=wopts, hierarchical=hierarchical)
    tmp = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="flashnpu-npu-"))
    tmp.mkdir(parents=True, exist_ok=True)
    specs = [_job_spec(job, str(i), tmp, config, seed + i) for i, job in enumerate(jobs)]
    jf = tmp / "jobs.json"
    jf.write_text(json.dumps(specs))
    log = tmp / "cocotb.log"
    try:
        runner.run_cocotb(h, "flashnpu.sim.cocotb_npu", testcase="npu_jobs", seed=seed, x_seed=x_seed,
                          log_file=log if quiet else None,
                          extra_env={"FLASHNPU_NPU_JOBS": str(jf), "FLASHNPU_SEED": seed})
    except AssertionError as e:
        tail = _log_tail(log) if quiet else ""
        raise AssertionError(f"{e}\n--- end of {log} ---\n{tail}") from None
    info = _build_info(h)
    return [_load_result(s, info) for s in specs]


class NPUSession:
    """One simulator run of the NPU build that stays alive and serves jobs one
    at a time (server mode of ``sim/cocotb_npu.py``).

    ::

       NPUSession.run(job) ── spec line ──► req.fifo ──► npu_server (cocotb, in the simulator)
             ▲                 job .npz                     │ run_job: the batch mode's steps
             └──── result .npz ◄── "ok" line ◄── rsp.fifo ◄─┘ (reset, TSV self-test, program, poll)

    The simulator starts once (build cached per configuration, then model
    load and cocotb start-up); every job then costs only its simulated
    cycles.  Each job runs exactly as in ``run_jobs`` (reset, TSV self-test,
    DRAM writes, CSR programming, polling), so outputs and counters are the
    same as a batch run of that job -- except a job with ``resident``
    (dict ``kv``: the ``kv_region`` of ``plan_job``, ``base``: first byte
    address for its Q, mask and O, ``writes``: list of (byte address,
    bytes) stored into NPU DRAM before it, e.g. the new K/V slots): it runs
    on the NPU as the previous job left it, with no reset and no TSV
    self-test (those run at power-up: the first resident job, and the one
    after a job that stopped with an error), and DRAM keeps what earlier
    jobs and writes left there.  Its result has ``powered_up`` (bool: this
    job ran the reset and self-test).  The cocotb run lives in a background
    thread; the simulator blocks on the request FIFO between jobs.

    Parameters
    ----------
    config : NPUConfig
    sim : 'verilator' (default) or 'icarus'
    seed : int
        Seed of the DRAM model of every job without a ``seed`` of its own
        (the batch mode of one job uses the same).
    x_seed : int, optional
        Verilator: random power-up values from this seed (see ``run_jobs``).
    workdir : path, optional
        Folder for the FIFOs, job files and ``cocotb.log`` (default: a new
        temporary folder, removed by a clean ``close``).
    start_timeout_s : float
        Wall-clock limit in seconds from starting the simulator (after the
        build) to the testbench opening the request channel.
    job_timeout_s : float
        Wall-clock limit in seconds for one job's answer; on expiry the
        simulator is killed.  (The testbench also stops a job that does not
        finish within its cycle limit.)

    Attributes
    ----------
    log_file : Path of cocotb's output
    pid : process id of the simulator (None until it started)
    jobs_done : int
    startup_s : float, seconds from the call to the simulator being ready
        (including the build, or the check of its cache)

    Raises
    ------
    RuntimeError
        (from the constructor or ``run``) when the simulator does not start,
        exits, or does not answer in time; the message names the log file
        and shows its tail.  ``run`` after ``close`` raises it too.
    """

    def __init__(self, config: NPUConfig, sim: str = "verilator", seed: int = 0, workdir=None,
                 start_timeout_s: float = 600.0, job_timeout_s: float = 3600.0, x_seed: int | None = None):
        if not isinstance(config, NPUConfig):
            raise TypeError(f"config must be an NPUConfig, not {config!r}")
        for name, v in (("start_timeout_s", start_timeout_s), ("job_timeout_s", job_timeout_s)):
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {v!r}")
        t0 = time.time()
        self.config = config
        self.sim = sim
        self.seed = int(seed)
        self.x_seed = x_seed
        self.job_timeout_s = float(job_timeout_s)
        self.jobs_done = 0
        self.pid = None
        self._req = self._rsp = None
        self._error: str | None = None
        self._thread_exc: BaseException | None = None
        self._closed = False
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="flashnpu-npu-session-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_file = self.dir / "cocotb.log"
        self._handle = build_npu(config, sim=sim, quiet=True)
        self._build_info = _build_info(self._handle)
        for name in ("req.fifo", "rsp.fifo"):
            (self.dir / name).unlink(missing_ok=True)
            os.mkfifo(self.dir / name)
        # the reply end first, non-blocking: the simulator's open for writing
        # then never waits, and an exited simulator reads as end-of-file
        self._rsp = os.open(self.dir / "rsp.fifo", os.O_RDONLY | os.O_NONBLOCK)
        self._buf = b""
        self._thread = threading.Thread(target=self._serve, name=f"flashnpu-npu-session-{id(self):x}",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)
        deadline = time.time() + float(start_timeout_s)
        while True:                         # the request end opens once the testbench reads it
            try:
                fd = os.open(self.dir / "req.fifo", os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
            if not self._thread.is_alive():
                self._fail("the simulator exited before it opened the request channel")
            if time.time() > deadline:
                self._kill()
                self._fail(f"the simulator did not start within {start_timeout_s:g} s")
            time.sleep(0.05)
        os.set_blocking(fd, True)
        self._req = fd
        pidf = self.dir / "sim.pid"
        self.pid = int(pidf.read_text()) if pidf.exists() else None
        self.startup_s = time.time() - t0

    # ------------------------------------------------------------ internals
    def _serve(self):
        try:
            runner.run_cocotb(self._handle, "flashnpu.sim.cocotb_npu", testcase="npu_server", seed=self.seed,
                              log_file=self.log_file, x_seed=self.x_seed,
                              extra_env={"FLASHNPU_NPU_SERVER": str(self.dir), "FLASHNPU_SEED": self.seed})
        except BaseException as e:          # also SystemExit, which cocotb's runner raises under pytest
            self._thread_exc = e

    def _fail(self, what: str):
        """Mark the session dead and raise a RuntimeError naming the log."""
        if self._error is None:
            self._error = what
        self._close_fds()
        tail = _log_tail(self.log_file)
        exc = self._thread_exc
        if exc is not None and not self._thread.is_alive():
            what += f" (cocotb run: {type(exc).__name__}: {exc})"
        raise RuntimeError(f"NPU simulator session ({self.sim}, {self.config.array_rows}x"
                           f"{self.config.array_cols}): {what}; log: {self.log_file}"
                           + (f"\n--- end of {self.log_file} ---\n{tail}" if tail else ""))

    def _close_fds(self):
        for attr in ("_req", "_rsp"):
            fd = getattr(self, attr)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, attr, None)

    def _kill(self):
        pid = self.pid
        if pid is None:
            pidf = self.dir / "sim.pid"
            pid = int(pidf.read_text()) if pidf.exists() else None
        if pid is not None and pid != os.getpid():      # never this process (a stale or foreign pid file)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._thread.join(timeout=30)

    def _read_line(self, timeout_s: float) -> str:
        """The next answer line; waits at most ``timeout_s`` seconds, and
        fails as soon as the simulator is gone."""
        deadline = time.time() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.time()
            if left <= 0:
                self._kill()
                self._fail(f"no answer within {timeout_s:g} s (job_timeout_s); the simulator was killed")
            r, _, _ = select.select([self._rsp], [], [], min(1.0, left))
            if r:
                chunk = os.read(self._rsp, 65536)
                if not chunk:               # every writer closed: the simulator is gone
                    self._thread.join(timeout=30)
                    self._fail(f"the simulator exited before answering job {self.jobs_done}")
                self._buf += chunk
            elif not self._thread.is_alive():
                self._fail(f"the simulator exited before answering job {self.jobs_done}")
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    # ------------------------------------------------------------ public
    @property
    def alive(self) -> bool:
        """True while the session can take jobs."""
        return self._error is None and not self._closed and self._thread.is_alive()

    def run(self, job: dict) -> dict:
        """Run one job (the dict of ``run_jobs``) and return its result dict
        (as ``run_jobs``).  Raises RuntimeError as described in the class."""
        if self._closed:
            raise RuntimeError(f"NPU simulator session is closed; log: {self.log_file}")
        if self._error is not None:
            raise RuntimeError(f"NPU simulator session ended earlier ({self._error}); log: {self.log_file}")
        tag = str(self.jobs_done)
        spec = _job_spec(job, tag, self.dir, self.config, self.seed)
        try:
            os.write(self._req, (json.dumps(spec) + "\n").encode())
        except (BrokenPipeError, OSError):
            self._thread.join(timeout=30)
            self._fail("the simulator is gone (its request channel is closed)")
        ans = json.loads(self._read_line(self.job_timeout_s))
        if not ans.get("ok"):
            self._thread.join(timeout=60)
            self._fail(f"job {spec['name']} failed in the testbench: {ans.get('error')}")
        res = _load_result(spec, self._build_info)
        for sp in spec.get("group", [spec]):
            for p in (sp["inputs"], sp["out"], (sp["resident"] or {}).get("writes")):
                if p:
                    Path(p).unlink(missing_ok=True)
        self.jobs_done += 1
        return res

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask the testbench to stop and wait for the simulator (killed after
        ``timeout_s`` seconds).  Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._req is not None:
            try:
                os.write(self._req, b'{"quit": true}\n')
            except OSError:
                pass
        self._close_fds()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            self._kill()
        clean = self._error is None and self._thread_exc is None
        if clean and self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def stats_from_counters(cnt: dict, config: NPUConfig, case) -> dict:
    """The ``flashnpu sim`` statistics of one job from its NPU counters.

    Two kinds of work (FLOP = 2 per MAC; rates at ``config.clock_hz``, an
    assumed clock: README, "Verilog and FPGA"):

    * issued: ``mac_utilization`` = MAC-issuing cycles / cycles;
      ``mac_slot_utilization`` = MAC slots issued (``mac_ops``, masked ones
      included) / (R x C x cycles); ``issued_flops`` = 2 ``mac_ops`` per
      cycle;
    * useful: ``useful_macs`` = 2 x visible (query, key) pairs x head_dim
      (Q.K^T and P.V; visibility from ``golden.visible_mask``: causal,
      mask, kv_valid_len); ``useful_utilization`` = useful_macs / (R x C x
      cycles); ``useful_flops`` = 2 useful_macs per cycle, never above
      ``peak_flops``.
    """
    cyc = max(1, int(cnt["total_cycles"]))
    macs = config.macs_per_cycle
    heads, seq_q, hd = case.q.shape
    seq_kv = case.k.shape[1]
    pairs = int(visible_mask(heads, seq_q, seq_kv, causal=bool(case.causal), mask=case.mask,
                             kv_valid_len=case.kv_valid_len).sum())
    useful = 2 * pairs * hd
    st = dict(cycles=cyc,
              mac_utilization=int(cnt["mac_busy_cycles"]) / cyc,
              mac_slot_utilization=int(cnt["mac_ops"]) / (cyc * macs),
              issued_flops=2.0 * int(cnt["mac_ops"]) / cyc * config.clock_hz,
              visible_pairs=pairs, useful_macs=useful,
              useful_utilization=useful / (cyc * macs),
              useful_flops=2.0 * useful / cyc * config.clock_hz,
              peak_flops=config.peak_flops, clock_hz=config.clock_hz,
              bytes_register=int(cnt["reg_bytes"]), bytes_sram=int(cnt["sram_bytes"]),
              bytes_tsv=int(cnt["tsv_bytes"]), bytes_dram=int(cnt["dram_bytes"]))
    st.update({k: int(v) for k, v in cnt.items()})
    return st


def wave_options(args) -> WaveOptions | None:
    """``WaveOptions`` of ``flashnpu sim --waves --wave-window --wave-depth``,
    or None without ``--waves``.

    Raises
    ------
    flashnpu.errors.UsageError
        a window that is not ``START:END`` with finite cycles, a bad file
        name or depth (the message names the value).
    """
    wfile = getattr(args, "waves", None)
    win = getattr(args, "wave_window", None)
    depth = getattr(args, "wave_depth", None)
    if not wfile:
        if win or depth is not None:
            raise UsageError("--wave-window and --wave-depth need --waves FILE.vcd")
        return None
    # defaults: the first DEFAULT_WAVE_CYCLES cycles, the top level and its
    # children (controller, loader and O writer live in the top module; core
    # and memory-system ports one level down), and PE row WAVE_ROW with its
    # PEs and tree nodes (register files, MAC and softmax operands, T, the
    # row's reductions) -- a full-depth dump of the 32 x 32 array costs
    # hundreds of KB per cycle
    start, end = 0, DEFAULT_WAVE_CYCLES
    scope = () if depth is not None else (NPU_MODULE, f"core.array.row{WAVE_ROW}")
    if win:
        a, colon, b = str(win).partition(":")
        try:
            start = float(a) if a.strip() else None
            end = float(b) if b.strip() else None
        except ValueError:
            start = end = float("nan")
        if not colon or any(v is not None and not math.isfinite(v) for v in (start, end)):
            raise UsageError(f"--wave-window must be START:END in cycles (either may be empty), not {win!r}")
    try:
        return WaveOptions(wfile, start=start, end=end, depth=DEFAULT_WAVE_DEPTH if depth is None else depth,
                           scope=scope, unit="cycle", clock_period_ns=1.0)
    except ValueError as e:
        raise UsageError(f"--waves: {e}") from None


def run(case, config: NPUConfig, args):
    """``flashnpu sim`` backend entry: (o float32 [heads, seq_q, head_dim], stats)."""
    waves = wave_options(args)
    sim = getattr(args, "sim", "verilator") or "verilator"
    res = run_jobs([dict(case=case)], config, sim=sim, waves=waves, seed=getattr(args, "seed", 0) or 0)[0]
    if res["error"]:
        rc = res.get("reg_check")
        where = (f"; PE register {rc['reg']} ({rc['reg_name']}) was read before it was written "
                 f"or while a write to it was in flight "
                 f"(core phase {rc['phase']}, kv tile {rc['tile']})") if rc else ""
        raise RuntimeError(f"the NPU rejected or aborted the job: {NPUError(res['error']).name}"
                           f" (dma code {res['dma_code']}){where}")
    stats = stats_from_counters(res["counters"], config, case)
    stats["sim_wall_s"] = res["wall_s"]
    stats["sim_cycles_per_s"] = round(res["counters"]["total_cycles"] / max(res["wall_s"], 1e-9))
    stats["sram_bytes_sim"] = res["sram_bytes_sim"]
    if waves is not None:
        stats["waves"] = waves.describe() if hasattr(waves, "describe") else str(waves.path)
    return res["o"], stats
