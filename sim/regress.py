"""Constrained-random regression of the whole NPU: job generation from seeds,
the checks of every job, the workers that run them and the reports.

::

   base seed ─► SeedSequence(base).spawn(N) ─► job seed i ─► generate_job: a plain JSON spec
                                                               │ (shape, masks, garbage, DRAM delay,
                                                               │  TSV faults, overrides, expectation)
       run_regression ─► workers (in-process, or Dask workers) ◄┘
            │               RegressWorker: make_job(spec) ─► NPUSession (one simulator per worker)
            │                              check(spec, case, result) ─► record (JSON)
            ▼
       records ─► RegressCoverage (sim/regress_coverage.py) ─► write_reports: regress.json, regress.md

Seeds.  Job i of a regression from base seed B has the seed
``job_seed(B, i)``, the state of ``SeedSequence(B).spawn(N)[i]``: it does
not depend on N, on the number of workers or on which worker runs the job.
Everything about a job -- its spec, its data, its DRAM model's delays --
follows from that one integer, and every job starts from reset in its
worker's simulator, so ``flashnpu regress --replay SEED`` runs the same job
alone and reproduces its output and counters bit for bit.  Each worker's own
simulator session gets a seed from another branch of the same sequence
(``worker_seeds``); no job result depends on it.

Legality comes from the hardware's documented limits (``Limits``, read from
``NPUConfig`` and ``hdl/npu_map.py``): head_dim in 1..max_head_dim,
heads % kv_heads == 0, lengths in 1..2**LEN_BITS - 1, TSV faults on at most
as many lanes as there are working spares, DRAM answers within the modelled
latency.  A fraction of the jobs is made illegal on purpose (one rule broken
through a register override or too many TSV faults, each with the
``NPUError`` the controller must answer) and a fraction injects a
simulation-time fault through the debug or watchdog register.

Checks.  A legal job must finish with no error, equal ``flash_attention_hw``
bit for bit, pass the float rule (``golden.tolerance_check`` against the
float64 reference and the plain FP16/FP32 attention) and report the TSV
repair map its faults call for.  An illegal job must stop with its exact
error code with the O region untouched, no DRAM traffic and no MAC; an
injected fault must stop the job with its code.  Every failure carries a
one-line command that reproduces it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass

import numpy as np

from flashnpu.config import NPUConfig
from flashnpu.golden import ComparisonError, assert_bit_exact, flash_attention_hw, visible_mask
from flashnpu.hdl.mem_common import word_bytes
from flashnpu.hdl.npu import NPUError, register_map, sim_config
from flashnpu.hdl.npu_map import LEN_BITS

from .case import AttentionCase
from .rtl_backend import NPUSession, plan_job, stats_from_counters

__all__ = ["Limits", "job_seed", "job_seeds", "worker_seeds", "generate_job", "generate_jobs", "make_job",
           "expected_tsv", "check", "repro_command", "RegressWorker", "run_regression", "summarize",
           "write_reports", "o_digest", "DEFAULT_ILLEGAL", "DEFAULT_INJECT"]

#: default fractions of deliberately illegal jobs and of injected faults
DEFAULT_ILLEGAL = 0.15
DEFAULT_INJECT = 0.05
#: spawn-key branch of the workers' session seeds (job seeds use keys (i,))
_WORKER_BRANCH = 2**32 - 1

ILLEGAL_KINDS = ("head_dim", "zero_length", "heads", "misaligned", "stride", "range", "tsv")
INJECT_KINDS = ("watchdog", "skip_init", "drop_s_write", "double_q", "queue", "kv_extra")
HIDDEN_KINDS = ("none", "finite", "nan", "inf")


# ------------------------------------------------------------------ seeds
def job_seed(base: int, index: int) -> int:
    """Seed of job ``index`` of a regression from ``base``: the 64-bit state of
    ``SeedSequence(base).spawn(n)[index]`` (for any n > index)."""
    ss = np.random.SeedSequence(int(base), spawn_key=(int(index),))
    return int(ss.generate_state(1, np.uint64)[0])


def job_seeds(base: int, n: int) -> list[int]:
    """The seeds of jobs 0..n-1 (``SeedSequence(base).spawn(n)``)."""
    return [int(c.generate_state(1, np.uint64)[0]) for c in np.random.SeedSequence(int(base)).spawn(n)]


def worker_seeds(base: int, n: int) -> list[int]:
    """One seed per worker (its simulator session), from a branch of ``base``'s
    sequence that no job seed uses."""
    root = np.random.SeedSequence(int(base), spawn_key=(_WORKER_BRANCH,))
    return [int(c.generate_state(1, np.uint64)[0]) for c in root.spawn(n)]


# ------------------------------------------------------------------ limits
@dataclass(frozen=True)
class Limits:
    """What the hardware allows (``NPUConfig``, ``hdl/npu_map.py``) and the
    generator's size budget (bounded so that one job simulates in seconds)."""

    br: int
    bc: int
    rows: int
    cols: int
    max_head_dim: int
    kv_slots: int
    word: int                   # bus word in bytes (alignment of bases and strides)
    dram_bytes: int
    dram_latency: int
    tsv_data: int
    tsv_spares: int
    max_len: int                # 2**LEN_BITS - 1: heads, seq_q, seq_kv, head_dim fields

    @classmethod
    def of(cls, config: NPUConfig) -> "Limits":
        return cls(br=config.br, bc=config.bc, rows=config.array_rows, cols=config.array_cols,
                   max_head_dim=config.max_head_dim,
                   kv_slots=config.kv_slots, word=word_bytes(config), dram_bytes=config.dram_bytes,
                   dram_latency=config.dram_latency_cycles, tsv_data=config.tsv_data_lanes,
                   tsv_spares=config.tsv_spare_lanes, max_len=(1 << LEN_BITS) - 1)

    @property
    def max_dram_delay(self) -> int:
        """Largest extra read delay of the DRAM model that still answers within
        the modelled latency (``sim/dram_model.py``: 2 + delay < latency)."""
        return max(0, self.dram_latency - 3)


def _edge_len(rng, tile: int, tiles_max: int) -> int:
    """A length that hits the tile edges often: n*tile, n*tile + 1, n*tile - 1 or any."""
    n = int(rng.integers(1, tiles_max + 1))
    pick = rng.choice(["exact", "plus1", "minus1", "any"], p=[0.25, 0.25, 0.25, 0.25])
    if pick == "exact":
        return n * tile
    if pick == "plus1":
        return (n - 1) * tile + 1
    if pick == "minus1":
        return max(1, n * tile - 1)
    return int(rng.integers(1, n * tile + 1))


def _head_dim(rng, lim: Limits, small: bool = False) -> int:
    top = min(lim.max_head_dim, 32) if small else lim.max_head_dim
    common = [d for d in (8, 16, 32, 64, 80, 96, 128) if d <= top]
    pick = rng.choice(["common", "max", "below_cols", "any"], p=[0.4, 0.15, 0.15, 0.3])
    if pick == "common" and common:
        return int(rng.choice(common))
    if pick == "max":
        return top
    if pick == "below_cols" and lim.cols > 1:
        return int(rng.integers(1, lim.cols))
    return int(rng.integers(1, top + 1))


def _tsv_faults(rng, lim: Limits, link: str, too_many: bool) -> dict:
    """Stuck-at faults on one link inside one 16-lane window (the reach of
    ``tsv_fault_*``): ``d`` data lanes and ``s`` spares, ``d <= S - s``
    (all repaired) unless ``too_many`` (then ``d = S - s + 1``)."""
    N, S = lim.tsv_data, lim.tsv_spares
    window = 16
    if too_many:
        s_bad = int(rng.integers(0, min(S, 4) + 1))
        d = S - s_bad + 1
    else:
        s_bad = int(rng.integers(1, min(S, 3) + 1)) if S and rng.random() < 0.3 else 0
        d = int(rng.integers(0, S - s_bad + 1))
    if s_bad:
        a = int(rng.integers(d, window - s_bad + 1))       # data lanes in the window, then spares
        base = N - a
        spares = [N + i for i in range(min(window - a, S))]
        bad = sorted(int(x) for x in rng.choice(spares, size=s_bad, replace=False))
    else:
        base = int(rng.integers(0, N - window + 1))
        bad = []
    data_slots = [base + i for i in range(window) if base + i < N]
    data = sorted(int(x) for x in rng.choice(data_slots, size=d, replace=False)) if d else []
    return dict(link=link, base=base, lanes=[x - base for x in sorted(data + bad)], stuck=int(rng.integers(0, 2)))


def expected_tsv(fault: dict | None, lim: Limits) -> dict:
    """The repair a link's self-test must reach for ``fault`` (``_tsv_faults``'
    description): ``status`` 'OK' or 'TOO_MANY' and, when OK, ``map`` (per
    spare: the data lane it replaces, or None); the allocator walks the failed
    data lanes in order and gives each the next working spare."""
    N, S = lim.tsv_data, lim.tsv_spares
    if not fault:
        return dict(status="OK", map=[None] * S, used=0)
    phys = [fault["base"] + i for i in fault["lanes"]]
    data = sorted(p for p in phys if p < N)
    bad_spares = {p - N for p in phys if p >= N}
    working = [s for s in range(S) if s not in bad_spares]
    if len(data) > len(working):
        return dict(status="TOO_MANY", map=None, used=None)
    m = [None] * S
    for lane, s in zip(data, working):
        m[s] = lane
    return dict(status="OK", map=m, used=len(data))


def _tsv_register(config: NPUConfig, fault: dict) -> dict:
    rm = register_map(sim_config(config))
    name = f"tsv_fault_{fault['link']}"
    return {name: rm[name].pack(lanes=sum(1 << i for i in fault["lanes"]), base=fault["base"],
                                stuck=fault["stuck"])}


# ------------------------------------------------------------------ generation
def _legal_shape(rng, lim: Limits) -> dict:
    """Shape of a legal job: decode or prefill, grouped-query ratios, partial
    tiles; now and then a KV head longer than the SRAM's resident slots."""
    kv_heads = int(rng.choice([1, 1, 2, 3]))
    group = int(rng.choice([1, 1, 2, 3, 4, 8]))
    heads = kv_heads * group
    decode = rng.random() < 0.2
    stream = rng.random() < 0.08
    if stream:
        # more kv tiles than SRAM slots: K/V stream through two slots (kept
        # small otherwise, for simulation time)
        kv_heads, heads = 1, int(rng.choice([1, 2]))
        seq_kv = lim.kv_slots * lim.bc + int(rng.integers(1, 2 * lim.bc + 1))
        seq_q = 1 if decode else _edge_len(rng, lim.br, 1)
        head_dim = _head_dim(rng, lim, small=True)
    else:
        seq_kv = _edge_len(rng, lim.bc, 4)
        seq_q = 1 if decode else _edge_len(rng, lim.br, 4)
        head_dim = _head_dim(rng, lim)
    return dict(heads=heads, kv_heads=kv_heads, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim)


def _visibility(rng, shape: dict, lim: Limits) -> dict:
    out = dict(causal=bool(rng.random() < 0.4), mask=None, kv_valid_len=None)
    if rng.random() < 0.35:
        out["mask"] = dict(per_head=bool(rng.random() < 0.5), density=float(rng.choice([0.3, 0.7, 0.95])),
                           empty_rows=bool(rng.random() < 0.3))
    if rng.random() < 0.35:
        skv = shape["seq_kv"]
        pick = rng.choice(["zero", "one", "tile", "full", "any"], p=[0.05, 0.1, 0.25, 0.1, 0.5])
        kvl = {"zero": 0, "one": 1, "tile": min(skv, lim.bc * int(rng.integers(1, 3))), "full": skv,
               "any": int(rng.integers(1, skv + 1))}[str(pick)]
        out["kv_valid_len"] = int(kvl)
    return out


def generate_job(seed: int, config: NPUConfig, index: int | None = None,
                 illegal: float = DEFAULT_ILLEGAL, inject: float = DEFAULT_INJECT) -> dict:
    """The plain, JSON-serialisable spec of the job with ``seed``.

    The spec names the shape, the visibility options (causal, mask
    parameters, kv_valid_len), the data (scale of N(0, s) inputs, what hidden
    positions hold), the DRAM model's extra read delay, TSV faults, register
    overrides or debug injections, and the expectation (``expect``: the
    ``NPUError`` name and the TSV repair).  The arrays follow from ``seed``
    (``make_job``).  ``illegal`` / ``inject``: fractions of deliberately
    illegal jobs and of injected simulation-time faults.
    """
    lim = Limits.of(config)
    spec_ss, _ = np.random.SeedSequence(int(seed)).spawn(2)
    rng = np.random.default_rng(spec_ss)
    u = rng.random()
    kind = "illegal" if u < illegal else ("inject" if u < illegal + inject else "legal")
    shape = _legal_shape(rng, lim)
    spec = dict(id=index, seed=int(seed), kind=kind, **shape)
    spec.update(_visibility(rng, shape, lim))
    spec.update(scale=None if rng.random() < 0.8 else float(rng.choice([0.05, 0.3, 1.0])),
                data_scale=float(rng.choice([0.25, 1.0, 3.0])),
                hidden=str(rng.choice(HIDDEN_KINDS, p=[0.25, 0.25, 0.3, 0.2])),
                dram_delay=int(rng.choice([0, int(rng.integers(1, 9)), int(rng.integers(0, lim.max_dram_delay + 1))])),
                tsv=[], overrides={}, debug=0, watchdog=None, fault=None)
    for link in ("rd", "wr"):
        if rng.random() < 0.3:
            spec["tsv"].append(_tsv_faults(rng, lim, link, too_many=False))
    expect = "OK"
    if kind == "illegal":
        expect = _make_illegal(rng, spec, config, lim)
    elif kind == "inject":
        expect = _make_inject(rng, spec, lim)
    # random backpressure (SRAM stalls, host idle cycles) and the S-tile
    # check on legal jobs; drawn last, so the fields above do not depend on them
    legal = kind == "legal"
    spec.update(sram_stall=int(rng.integers(1, 7)) if legal and rng.random() < 0.4 else 0,
                host_idle=int(rng.integers(1, 5)) if rng.random() < 0.3 else 0,
                s_check=bool(legal and rng.random() < 0.5))
    spec["expect"] = dict(error=expect, tsv={f["link"]: expected_tsv(f, lim) for f in spec["tsv"]})
    return spec


def _tensor_extents(spec: dict, config: NPUConfig) -> dict:
    """DRAM bytes from each base to the end of its tensor, as the controller's
    range check computes them, for the layout ``plan_job`` chooses."""
    case = _shape_only_case(spec)
    plan = plan_job(case, config)
    r = plan["regs"]
    h, kvh, sq, skv, hd = (spec[k] for k in ("heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    ext = {}
    for t, nh, ns, eb in (("q", h, sq, 2), ("k", kvh, skv, 2), ("v", kvh, skv, 2), ("o", h, sq, 4)):
        ext[t] = (nh - 1) * r[f"{t}_head_stride"] + (ns - 1) * r[f"{t}_row_stride"] + eb * hd
    return ext


def _shape_only_case(spec: dict) -> AttentionCase:
    z = lambda n, s: np.zeros((n, s, spec["head_dim"]), np.float16)
    mask = None
    if spec.get("mask"):
        shp = (spec["heads"], spec["seq_q"], spec["seq_kv"]) if spec["mask"]["per_head"] else \
            (spec["seq_q"], spec["seq_kv"])
        mask = np.ones(shp, bool)
    return AttentionCase(z(spec["heads"], spec["seq_q"]), z(spec["kv_heads"], spec["seq_kv"]),
                         z(spec["kv_heads"], spec["seq_kv"]), causal=spec["causal"], mask=mask,
                         kv_valid_len=spec["kv_valid_len"], scale=spec["scale"])


def _make_illegal(rng, spec: dict, config: NPUConfig, lim: Limits) -> str:
    """Break one rule (a register override, or TSV faults beyond the spares);
    returns the ``NPUError`` name the controller must answer."""
    W = lim.word
    choices = list(ILLEGAL_KINDS)
    if spec["seq_q"] == 1 and spec["heads"] == 1:
        choices.remove("stride")                # no O stride is checked for one row of one head
    what = str(rng.choice(choices))
    spec["fault"] = what
    ov = spec["overrides"]
    h, kvh, sq, skv = spec["heads"], spec["kv_heads"], spec["seq_q"], spec["seq_kv"]
    if what == "head_dim":
        ov["head_dim"] = int(rng.choice([0, int(rng.integers(lim.max_head_dim + 1, lim.max_len + 1))]))
        return NPUError.BAD_HEAD_DIM.name
    if what == "zero_length":
        which = str(rng.choice(["heads", "kv_heads", "seq_q", "seq_kv"]))
        hh, kk, qq, vv = h, kvh, sq, skv
        if which == "heads":
            hh = 0
        elif which == "kv_heads":
            kk = 0
        elif which == "seq_q":
            qq = 0
        else:
            vv = 0
        ov["heads"] = hh | (kk << 16)
        ov["seq"] = qq | (vv << 16)
        return NPUError.ZERO_LENGTH.name
    if what == "heads":
        kk = int(rng.integers(2, 9))
        hh = kk * int(rng.integers(0, 4)) + int(rng.integers(1, kk))
        ov["heads"] = hh | (kk << 16)
        return NPUError.BAD_HEADS.name
    if what == "misaligned":
        regs = ["q_base", "k_base", "v_base", "o_base", "q_head_stride", "q_row_stride", "k_head_stride",
                "k_row_stride", "v_head_stride", "v_row_stride", "o_head_stride", "o_row_stride"]
        if spec["mask"]:
            regs += ["mask_base", "mask_head_stride", "mask_tile_stride"]
        spec["fault_reg"] = reg = str(rng.choice(regs))
        ov[reg] = ["+", int(rng.integers(1, W))]       # added to the planned value in make_job
        return NPUError.MISALIGNED.name
    if what == "stride":
        reg = "o_row_stride" if sq > 1 else "o_head_stride"
        ov[reg] = W * int(rng.integers(0, -(-4 * spec["head_dim"] // W)))    # aligned, below 4*head_dim
        return NPUError.BAD_STRIDE.name
    if what == "range":
        t = str(rng.choice(["q", "k", "v", "o"]))
        ext = _tensor_extents(spec, config)[t]
        base = lim.dram_bytes - ext + 1 + int(rng.integers(0, 64 * W))
        ov[f"{t}_base"] = -(-base // W) * W
        spec["fault_reg"] = f"{t}_base"
        return NPUError.RANGE.name
    # tsv: one link gets one faulty lane more than its working spares
    link = str(rng.choice(["rd", "wr"]))
    spec["tsv"] = [f for f in spec["tsv"] if f["link"] != link] + [_tsv_faults(rng, lim, link, too_many=True)]
    return NPUError.LINK_DOWN.name


def _make_inject(rng, spec: dict, lim: Limits) -> str:
    """A simulation-time fault through the debug or watchdog register, on a
    shape that reaches it (plain visibility, several kv tiles)."""
    what = str(rng.choice(INJECT_KINDS))
    spec["fault"] = what
    spec.update(causal=False, mask=None, kv_valid_len=None, hidden="none", tsv=[])
    if what == "kv_extra":
        # one kv tile too many into K0/V0 (n_kv even) before a second q tile:
        # the core takes it as that q tile's K_0, the real K_0 waits forever
        spec.update(heads=1, kv_heads=1, seq_q=2 * lim.br, seq_kv=2 * lim.bc,
                    head_dim=int(rng.integers(1, lim.max_head_dim + 1)))
        spec["debug"] = 1 << 4
        # 4x a tile pair at max_head_dim (2 * Br * Bc * d / (R * C) cycles)
        spec["overrides"]["kv_stale_limit"] = 8 * lim.br * lim.bc * lim.max_head_dim // (lim.rows * lim.cols)
        return NPUError.KV_STALE.name
    if what in ("double_q", "queue"):
        # the shape of the fixed tests (tb/rtl/test_npu_rtl.py: inj_overwrite, inj_queue)
        spec.update(heads=1, kv_heads=1, seq_q=int(rng.integers(lim.br // 2, lim.br + 1)),
                    seq_kv=lim.bc * int(rng.integers(5, 8)),
                    head_dim=int(rng.integers(min(4 * lim.cols, lim.max_head_dim), lim.max_head_dim + 1)))
    else:
        spec["seq_kv"] = max(spec["seq_kv"], lim.bc + 1)
    if what == "watchdog":
        spec["watchdog"] = int(rng.integers(4, min(40, lim.dram_latency // 2) + 1))
        return NPUError.WATCHDOG.name
    bit = {"double_q": 0, "queue": 1, "skip_init": 2, "drop_s_write": 3}[what]
    spec["debug"] = 1 << bit
    return (NPUError.BUF_OVERWRITE if what == "double_q" else NPUError.QUEUE_OVERFLOW if what == "queue"
            else NPUError.REG_UNWRITTEN).name


def generate_jobs(base: int, n: int, config: NPUConfig, illegal: float = DEFAULT_ILLEGAL,
                  inject: float = DEFAULT_INJECT, only=None) -> list[dict]:
    """Specs of jobs 0..n-1 from ``base`` (or of the indices in ``only``)."""
    idx = range(n) if only is None else sorted(set(int(i) for i in only))
    return [generate_job(job_seed(base, i), config, index=i, illegal=illegal, inject=inject) for i in idx]


# ------------------------------------------------------------------ materialise
def make_job(spec: dict, config: NPUConfig) -> dict:
    """The job dict of ``rtl_backend`` (``case``, ``overrides``, ``debug``,
    ``watchdog``, ``tsv_fault``, ``seed``, ``stress``) for ``spec``; the
    data come from the spec's seed.  Hidden positions (query rows that see
    no key, keys no query of their group sees) hold what ``spec['hidden']``
    says; a legal job's case passes ``AttentionCase.validate``."""
    _, data_ss = np.random.SeedSequence(int(spec["seed"])).spawn(2)
    rng = np.random.default_rng(data_ss)
    h, kvh, sq, skv, hd = (spec[k] for k in ("heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    s = spec["data_scale"]
    f16 = lambda *shape: (rng.standard_normal(shape) * s).astype(np.float16)
    q, k, v = f16(h, sq, hd), f16(kvh, skv, hd), f16(kvh, skv, hd)
    mask = None
    m = spec.get("mask")
    if m:
        shp = (h, sq, skv) if m["per_head"] else (sq, skv)
        mask = rng.random(shp) < m["density"]
        if m["empty_rows"]:
            rows = rng.random(shp[:-1]) < 0.25
            mask[rows] = False
    case = AttentionCase(q, k, v, causal=bool(spec["causal"]), mask=mask,
                         kv_valid_len=spec["kv_valid_len"], scale=spec["scale"])
    hidden = spec.get("hidden", "none")
    if hidden != "none":
        vis = visible_mask(h, sq, skv, case.causal, mask, case.kv_valid_len)
        q_unused = ~vis.any(-1)                                         # [h, sq]
        kv_unused = ~vis.any(1).reshape(kvh, h // kvh, skv).any(1)       # [kvh, skv]
        fill = {"finite": lambda n: rng.choice(np.array([65504, -65504, -42.0, 1e4], np.float16), n),
                "nan": lambda n: np.full(n, np.nan, np.float16),
                "inf": lambda n: rng.choice(np.array([np.inf, -np.inf], np.float16), n)}[hidden]
        for a, used in ((q, q_unused), (k, kv_unused), (v, kv_unused)):
            a[used] = fill((int(used.sum()), hd))
    if spec["kind"] == "legal":
        case.validate(config)
    overrides = {}
    planned = None
    for reg, val in spec.get("overrides", {}).items():
        if isinstance(val, (list, tuple)):                 # ("+", offset): relative to the plan
            if planned is None:
                planned = plan_job(case, config)["regs"]
            overrides[reg] = planned[reg] + int(val[1])
        else:
            overrides[reg] = int(val)
    tsv_fault = {}
    for f in spec.get("tsv", []):
        tsv_fault.update(_tsv_register(config, f))
    return dict(case=case, name=f"job{spec['id']}" if spec.get("id") is not None else f"seed{spec['seed']}",
                overrides=overrides, debug=int(spec.get("debug", 0)), watchdog=spec.get("watchdog"),
                tsv_fault=tsv_fault, seed=int(spec["seed"]) & 0x7FFFFFFF,
                stress=dict(dram_delay=int(spec["dram_delay"]), host_idle=int(spec.get("host_idle", 0)),
                            sram_stall=int(spec.get("sram_stall", 0))),
                s_check=dict(threshold=0) if spec.get("s_check") else None)


# ------------------------------------------------------------------ checks
def o_digest(o: np.ndarray) -> str:
    """SHA-256 of O's bits (float32, C order): bit-for-bit identity across processes."""
    return hashlib.sha256(np.ascontiguousarray(o, np.float32).tobytes()).hexdigest()


def repro_command(spec: dict, rows: int, cols: int, sim: str = "verilator", illegal: float = DEFAULT_ILLEGAL,
                  inject: float = DEFAULT_INJECT, x_seed: int | None = None) -> str:
    """The one-line command that runs ``spec``'s job alone."""
    cmd = f"flashnpu regress --rows {rows} --cols {cols} --replay {spec['seed']}"
    if sim != "verilator":
        cmd += f" --sim {sim}"
    if x_seed is not None:
        cmd += f" --x-seed {x_seed}"
    if illegal != DEFAULT_ILLEGAL:
        cmd += f" --illegal-fraction {illegal:g}"
    if inject != DEFAULT_INJECT:
        cmd += f" --inject-fraction {inject:g}"
    return cmd


def check(spec: dict, case: AttentionCase, res: dict, config: NPUConfig, golden_o=None) -> list[str]:
    """Every failed expectation of one job's result ``res`` (``run_jobs`` /
    ``NPUSession.run`` dict); empty when the job passed.  ``golden_o``
    replaces the bit-exact model's output (tests of the checker)."""
    fails = []
    want = spec["expect"]["error"]
    got = res.get("error_name") or str(res.get("error"))
    if got != want:
        fails.append(f"error code: expected {want}, got {got} (dma_code {res.get('dma_code')})")
    cnt = res.get("counters") or {}
    if spec["kind"] == "illegal":
        if not res.get("o_untouched"):
            fails.append("rejected job wrote into its O region")
        if cnt.get("dram_bytes") or cnt.get("mac_ops"):
            fails.append(f"rejected job moved data: dram_bytes {cnt.get('dram_bytes')}, "
                         f"mac_ops {cnt.get('mac_ops')}")
        if res.get("irq") != 0b11:
            fails.append(f"irq {res.get('irq')}: expected done and error (0b11)")
    elif spec["kind"] == "inject":
        if spec.get("fault") in ("skip_init", "drop_s_write") and not res.get("o_untouched"):
            fails.append("a job stopped by the register check wrote into its O region")
    else:
        if got == "OK":
            gold = golden_o if golden_o is not None else \
                flash_attention_hw(case.q, case.k, case.v, config=config, **case.kwargs()).o
            try:
                assert_bit_exact(res["o"], gold, "O")
            except ComparisonError as e:
                fails.append(f"bit-exact vs golden: {e}")
            try:
                ok, msg, _, _ = case.float_rule(res["o"])
                if not ok:
                    fails.append(f"float rule: {msg}")
            except ComparisonError as e:
                fails.append(f"float rule: {e}")
        if cnt and int(cnt.get("total_cycles", 0)) <= 0:
            fails.append("total_cycles counter is 0")
        elif cnt and got == "OK":
            # useful MACs (visible pairs) <= MACs run (issued - masked), and issued <=
            # the array's slots: useful FLOP/s never exceeds the peak
            st = stats_from_counters(cnt, config, case)
            issued = int(cnt["mac_ops"])
            ran = issued - int(cnt["mac_masked"])
            slots = config.macs_per_cycle * st["cycles"]
            if not (st["useful_macs"] <= ran and issued <= slots):
                fails.append(f"MAC counts: useful {st['useful_macs']} <= run {ran}, issued {issued} "
                             f"<= slots {slots} does not hold")
        sc = res.get("s_check")
        if spec.get("s_check") and sc is None:
            fails.append("S-tile check: no result")
        elif sc and sc["stopped"]:
            fails.append(f"S-tile check: head {sc['head']} q tile {sc['q_tile']} kv tile {sc['kv_tile']}: "
                         f"{sc['count']} non-zero P, golden {sc['expected']}")
        elif sc and got == "OK" and sc["tiles"] != int(cnt.get("kv_tiles", -1)):
            fails.append(f"S-tile check: {sc['tiles']} tiles compared, kv_tiles counter {cnt.get('kv_tiles')}")
    lim = Limits.of(config)
    tsv = res.get("tsv")
    for f in spec.get("tsv", []):
        exp = expected_tsv(f, lim)
        link = f["link"]
        if tsv is None:
            fails.append(f"TSV {link}: no link status read back")
            continue
        if tsv.get(f"{link}_status") != exp["status"]:
            fails.append(f"TSV {link}: status {tsv.get(f'{link}_status')}, expected {exp['status']}")
        elif exp["map"] is not None and tsv.get(f"{link}_map") != exp["map"]:
            fails.append(f"TSV {link}: repair map {tsv.get(f'{link}_map')}, expected {exp['map']}")
    return fails


# ------------------------------------------------------------------ workers
class RegressWorker:
    """Runs job specs on one simulator session (``NPUSession``: built once per
    configuration in the runner's cache, started once per worker) and checks
    them (``checker``, default ``check``).  A session that dies (a hung job)
    is reported in that job's record and started again for the next job."""

    def __init__(self, config: NPUConfig, sim: str = "verilator", seed: int = 0, name: str | None = None,
                 job_timeout_s: float = 1800.0, checker=None, x_seed: int | None = None):
        self.checker = checker or check       # check(spec, case, result, config) -> failures
        self.config = config
        self.sim = sim
        self.seed = int(seed) & 0x7FFFFFFF
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.job_timeout_s = job_timeout_s
        self.x_seed = x_seed
        self.session = None
        self.startups = 0
        self.startup_s = 0.0

    def _session(self) -> NPUSession:
        if self.session is None or not self.session.alive:
            if self.session is not None:
                self.session.close()
            self.session = NPUSession(self.config, sim=self.sim, seed=self.seed, job_timeout_s=self.job_timeout_s,
                                      x_seed=self.x_seed)
            self.startups += 1
            self.startup_s += self.session.startup_s
        return self.session

    def run(self, spec: dict, rows_cols=None, illegal=DEFAULT_ILLEGAL, inject=DEFAULT_INJECT) -> dict:
        """The record of one job (JSON-serialisable)."""
        t0 = time.time()
        rows, cols = rows_cols or (self.config.array_rows, self.config.array_cols)
        rec = dict(id=spec.get("id"), seed=spec["seed"], kind=spec["kind"], fault=spec.get("fault"),
                   expect=spec["expect"]["error"], worker=self.name,
                   repro=repro_command(spec, rows, cols, self.sim, illegal, inject, self.x_seed))
        try:
            job = make_job(spec, self.config)
        except Exception as e:  # noqa: BLE001 - a generator bug is a failed job, not a crash
            rec.update(passed=False, failures=[f"job generation: {type(e).__name__}: {e}"], wall_s=0.0)
            return rec
        try:
            res = self._session().run(job)
        except RuntimeError as e:
            rec.update(passed=False, failures=[f"simulator: {str(e).splitlines()[0]}"],
                       wall_s=round(time.time() - t0, 3))
            return rec
        fails = self.checker(spec, job["case"], res, self.config)
        rec.update(passed=not fails, failures=fails, error=res.get("error_name"), dma_code=res.get("dma_code"),
                   counters=res.get("counters"), tsv=res.get("tsv"), o_untouched=res.get("o_untouched"),
                   o_sha256=o_digest(res["o"]), sim_wall_s=res.get("wall_s"), wall_s=round(time.time() - t0, 3))
        return rec

    def info(self) -> dict:
        return dict(worker=self.name, startups=self.startups, startup_s=round(self.startup_s, 2),
                    jobs=self.session.jobs_done if self.session else 0)

    def close(self) -> dict:
        info = self.info()
        if self.session is not None:
            self.session.close()
            self.session = None
        return info


# one RegressWorker per (configuration, simulator) in each Dask worker process
_PROCESS_WORKERS: dict = {}


def _dask_run(spec: dict, config_json: str, sim: str, seeds: dict, rows_cols, illegal, inject,
              x_seed=None) -> dict:
    """Task body on a Dask worker: the process's own RegressWorker runs ``spec``."""
    from distributed import get_worker

    me = get_worker()
    key = (config_json, sim, x_seed)
    w = _PROCESS_WORKERS.get(key)
    if w is None:
        w = _PROCESS_WORKERS[key] = RegressWorker(
            NPUConfig.from_json(config_json), sim=sim, seed=seeds.get(me.address, 0),
            name=f"{me.name}@{socket.gethostname()}:{os.getpid()}", x_seed=x_seed)
    return w.run(spec, rows_cols, illegal, inject)


def _dask_close() -> list:
    """On every Dask worker: stop this process's simulator sessions."""
    out = [w.close() for w in _PROCESS_WORKERS.values()]
    _PROCESS_WORKERS.clear()
    return out


def run_regression(specs: list[dict], config: NPUConfig, workers: int = 1, address: str | None = None,
                   sim: str = "verilator", base_seed: int = 0, progress: bool = True, illegal=DEFAULT_ILLEGAL,
                   inject=DEFAULT_INJECT, rows_cols=None, x_seed: int | None = None) -> tuple[list[dict], dict]:
    """Run ``specs`` and return (records in spec order, run info).

    ``x_seed`` (Verilator): every worker's model powers up with random
    register and memory values from this seed (``run_jobs``); a design
    whose results depend on power-up values fails here.

    ``workers == 1`` without ``address``: one worker in this process.
    Otherwise Dask: a local cluster of ``workers`` single-threaded worker
    processes that lives for this call (nothing to set up), or every worker
    of the scheduler at ``address`` (``tcp://host:8786``).  Each worker
    process keeps its own simulator session (``RegressWorker``) for all the
    jobs it gets; jobs go to whichever worker is free.  The model is built
    (or found in the runner's cache) here first, so local workers only load
    it; on a cluster each node builds its own under the runner's
    per-configuration lock.
    """
    from tqdm import tqdm

    from .rtl_backend import build_npu, fixed_threads

    t0 = time.time()
    rows_cols = rows_cols or (config.array_rows, config.array_cols)
    # local workers share this machine's cores: single-threaded models (rtl_backend.sim_threads)
    with fixed_threads(1) if workers > 1 and address is None else contextlib.nullcontext():
        build_npu(config, sim=sim, quiet=True)
    info = dict(engine="in-process", workers=1, address=None, build_s=round(time.time() - t0, 2), x_seed=x_seed)
    records: list[dict | None] = [None] * len(specs)
    bar = tqdm(total=len(specs), desc="regress", unit="job", disable=not progress, dynamic_ncols=True)
    fails = 0

    def done(i, rec):
        nonlocal fails
        records[i] = rec
        fails += not rec["passed"]
        bar.update(1)
        bar.set_postfix(fail=fails)

    try:
        if workers <= 1 and address is None:
            w = RegressWorker(config, sim=sim, seed=worker_seeds(base_seed, 1)[0], name="w0", x_seed=x_seed)
            try:
                for i, s in enumerate(specs):
                    done(i, w.run(s, rows_cols, illegal, inject))
            finally:
                info["worker_info"] = [w.close()]
        else:
            info.update(_run_dask(specs, config, workers, address, sim, base_seed, rows_cols, illegal, inject,
                                  done, x_seed))
    finally:
        bar.close()
    info["wall_s"] = round(time.time() - t0, 2)
    return [r for r in records if r is not None], info


def _run_dask(specs, config, workers, address, sim, base_seed, rows_cols, illegal, inject, done,
              x_seed=None) -> dict:
    from distributed import Client, LocalCluster, as_completed

    from .rtl_backend import fixed_threads

    t1 = time.time()
    cluster = None
    if address:
        client = Client(address)
    else:
        with fixed_threads(1):                   # the worker processes inherit it
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                   dashboard_address=None, silence_logs=40)
        client = Client(cluster)
    info = dict(engine="dask", address=address or "local", engine_start_s=round(time.time() - t1, 2))
    try:
        addrs = sorted(client.scheduler_info()["workers"])
        if not addrs:
            raise RuntimeError(f"the Dask scheduler at {address} has no workers")
        seeds = dict(zip(addrs, worker_seeds(base_seed, len(addrs))))
        cj = config.to_json()
        futs = {client.submit(_dask_run, s, cj, sim, seeds, rows_cols, illegal, inject, x_seed, pure=False,
                              key=f"regress-{i}-{s['seed']}"): i for i, s in enumerate(specs)}
        for fut in as_completed(futs):
            done(futs[fut], fut.result())
        closed = client.run(_dask_close)
        info.update(workers=len(addrs), worker_info=[x for v in closed.values() for x in v])
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return info


# ------------------------------------------------------------------ reports
def summarize(records: list[dict]) -> dict:
    by_kind: dict = {}
    for r in records:
        k = by_kind.setdefault(r["kind"], dict(jobs=0, passed=0, failed=0))
        k["jobs"] += 1
        k["passed" if r["passed"] else "failed"] += 1
    failed = [r for r in records if not r["passed"]]
    per_worker: dict = {}
    for r in records:
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
    return dict(jobs=len(records), passed=len(records) - len(failed), failed=len(failed), by_kind=by_kind,
                jobs_per_worker=per_worker,
                sim_cycles=int(sum((r.get("counters") or {}).get("total_cycles", 0) for r in records)))


def write_reports(out_dir, meta: dict, records: list[dict], coverage: dict) -> tuple:
    """``regress.json`` and ``regress.md`` in ``out_dir``; returns their paths."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summ = summarize(records)
    doc = dict(meta=meta, summary=summ, coverage=coverage,
               failures=[r for r in records if not r["passed"]], jobs=records)
    jp, mp = out / "regress.json", out / "regress.md"
    jp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    mp.write_text(_markdown(meta, summ, coverage, records))
    return jp, mp


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def _markdown(meta, summ, cov, records) -> str:
    L = [f"# NPU regression: {meta['array']} array, base seed {meta['base_seed']}", ""]
    L.append(f"`{meta['command']}`")
    L.append("")
    L.append(f"- jobs: {summ['jobs']}, passed {summ['passed']}, **failed {summ['failed']}**")
    L.append(f"- engine: {meta['engine']} ({meta['workers']} worker(s)"
             + (f", address {meta['address']}" if meta.get("address") else "") + f"), simulator {meta['sim']}")
    L.append(f"- wall time: {meta['wall_s']} s (model build or cache check {meta.get('build_s')} s); "
             f"simulated cycles: {summ['sim_cycles']}")
    L.append(f"- functional coverage: **{cov['percent']:.1f} %** of {cov['bins']} bins "
             f"({cov['covered']} covered, {len(cov['holes'])} holes)")
    L += ["", "| kind | jobs | passed | failed |", "| --- | ---: | ---: | ---: |"]
    for k, v in sorted(summ["by_kind"].items()):
        L.append(f"| {k} | {v['jobs']} | {v['passed']} | {v['failed']} |")
    L += ["", "| worker | jobs |", "| --- | ---: |"]
    for w, n in sorted(summ["jobs_per_worker"].items()):
        L.append(f"| {w} | {n} |")
    failed = [r for r in records if not r["passed"]]
    L += ["", "## Failures", ""]
    if not failed:
        L.append("None.")
    for r in failed:
        L.append(f"- job {r['id']} (seed {r['seed']}, {r['kind']}"
                 + (f", {r['fault']}" if r.get("fault") else "") + f"): {'; '.join(r['failures'])}")
        L.append(f"  - reproduce: `{r['repro']}`")
    L += ["", "## Coverage", "", "| cover point | covered | bins (hits) |", "| --- | ---: | --- |"]
    for name, p in cov["points"].items():
        bins = ", ".join(f"{b}: {n}" for b, n in p["bins"].items())
        L.append(f"| {name} | {p['covered']}/{p['size']} | {bins} |")
    L += ["", "### Holes", ""]
    L += [f"- {h}" for h in cov["holes"]] or ["None."]
    L.append("")
    return "\n".join(L)
