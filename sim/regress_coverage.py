"""Functional coverage of the regression (``cocotb-coverage``: ``CoverPoint``,
``CoverCross``, ``coverage_db``), sampled on the host side from each job's
spec and result.

The bins come from the hardware's documented cases:

==================  ==========================================================
cover point         bins
==================  ==========================================================
shape.path          decode (seq_q = 1: heads stacked on PE rows) / prefill
shape.kv_mode       resident (every kv tile has an SRAM slot) / streaming
shape.q_tiles       1 / 2-3 / 4+ q tiles per head (or per KV group in decode)
shape.kv_tiles      1 / 2-3 / 4+ kv tiles per KV head
shape.gqa           heads per KV head: 1 / 2 / 3-4 / 5+
shape.head_dim      below C / multiple of C / partial (not a multiple of C) /
                    max_head_dim
edge.seq_q          seq_q % Br: 0 / 1 / Br-1 ("tile-1") / other (prefill)
edge.seq_kv         seq_kv % Bc: 0 / 1 / Bc-1 ("tile-1") / other
mask.kind           none / causal / arbitrary / kv_valid_len / combined
mask.layout         shared [seq_q, seq_kv] / per head
mask.empty_rows     some query rows see no key / every row sees one
data.hidden         what hidden positions hold: none / finite garbage / NaN /
                    Inf
data.scale          default 1/sqrt(d) / explicit
error.code          every ``NPUError`` the job ended with (DMA and
                    CORE_REJECT are internal consistency checks that no host
                    program reaches: they stay holes until a debug injection
                    exists for them)
tsv.rd, tsv.wr      spares in use after the self-test: 0 .. S, and TOO_MANY
dma.stall           dma_stall_cycles / total_cycles of a legal job: <= 10 %
                    (compute-bound) / 10-30 % / > 30 % (memory-bound); no bin
                    for 0: the first Q and K/V loads are always waited for
dram.delay          extra read delay of the DRAM model: 0 / 1-8 / 9 and more
stress.sram_stall   random SRAM stalls (legal jobs): off / on
stress.host_idle    random idle cycles before host bus accesses: off / on
check.s_tile        the S-tile check compared every tile (legal jobs): off / on
cross.path_mask     shape.path x mask.kind
cross.edges         edge.seq_q x edge.seq_kv (prefill)
==================  ==========================================================

A job counts only when its checks passed.  Points sample ``None`` when they
do not apply (no mask: no layout; decode: no seq_q edge), which matches no
bin.  The coverage database of cocotb-coverage is one per process; each
``RegressCoverage`` files its items under a name of its own and removes them
on ``close``.
"""

from __future__ import annotations

import itertools

from cocotb_coverage.coverage import CoverCross, CoverPoint, coverage_db, coverage_section

from flashnpu.config import NPUConfig
from flashnpu.hdl.npu import NPUError

__all__ = ["RegressCoverage", "features", "coverage_of"]

_count = itertools.count()


def _bucket(n: int, edges) -> str:
    """'1', '2-3', '4+' style label of ``n`` for the lower bounds ``edges``."""
    for i, lo in enumerate(edges):
        hi = edges[i + 1] - 1 if i + 1 < len(edges) else None
        if hi is None or n <= hi:
            if n >= lo:
                return str(lo) if hi == lo else (f"{lo}+" if hi is None else f"{lo}-{hi}")
    return "other"


def features(spec: dict, rec: dict, config: NPUConfig) -> dict:
    """The sampled values of one job (``None`` where a point does not apply)."""
    br, bc, C, S = config.br, config.bc, config.array_cols, config.tsv_spare_lanes
    h, kvh, sq, skv, hd = (spec[k] for k in ("heads", "kv_heads", "seq_q", "seq_kv", "head_dim"))
    decode = sq == 1
    kvl = spec.get("kv_valid_len")
    kv_end = skv if kvl is None else min(kvl, skv)
    kv_tiles = max(1, -(-kv_end // bc))
    group = h // kvh if kvh else 0
    q_tiles = -(-group // br) if decode else -(-sq // br)
    kinds = [k for k, on in (("causal", spec.get("causal")), ("arbitrary", spec.get("mask")),
                             ("kv_valid_len", kvl is not None)) if on]
    mask_kind = "none" if not kinds else kinds[0] if len(kinds) == 1 else "combined"

    def edge(n, t):
        r = n % t
        return "0" if r == 0 else "1" if r == 1 else "tile-1" if r == t - 1 else "other"

    if hd == config.max_head_dim:
        hd_bin = "max_head_dim"
    elif hd < C:
        hd_bin = "below_C"
    else:
        hd_bin = "multiple_C" if hd % C == 0 else "partial_C"
    cnt = rec.get("counters") or {}
    stall = None
    if cnt.get("total_cycles", 0) > 0 and spec["kind"] == "legal":
        f = cnt.get("dma_stall_cycles", 0) / cnt["total_cycles"]
        stall = "<=10%" if f <= 0.10 else "10-30%" if f <= 0.30 else ">30%"
    tsv = {}
    links = {f["link"] for f in spec.get("tsv", [])}
    for link in ("rd", "wr"):
        t = rec.get("tsv")
        if link not in links or t is None:
            tsv[link] = "0" if spec["kind"] == "legal" else None     # no fault: no spare in use
        elif t.get(f"{link}_status") == "TOO_MANY":
            tsv[link] = "TOO_MANY"
        elif t.get(f"{link}_status") == "OK":
            tsv[link] = str(sum(x is not None for x in t[f"{link}_map"]))
        else:
            tsv[link] = None
    delay = spec.get("dram_delay", 0)
    legal = spec["kind"] == "legal"
    return {
        "shape.path": "decode" if decode else "prefill",
        "shape.kv_mode": "resident" if kv_tiles <= config.kv_slots else "streaming",
        "shape.q_tiles": _bucket(q_tiles, (1, 2, 4)),
        "shape.kv_tiles": _bucket(kv_tiles, (1, 2, 4)),
        "shape.gqa": _bucket(group, (1, 2, 3, 5)),
        "shape.head_dim": hd_bin,
        "edge.seq_q": None if decode else edge(sq, br),
        "edge.seq_kv": edge(skv, bc),
        "mask.kind": mask_kind if legal else None,
        "mask.layout": None if not spec.get("mask") or not legal else
        ("per_head" if spec["mask"]["per_head"] else "shared"),
        "mask.empty_rows": None if not legal else _empty_rows(spec),
        "data.hidden": spec.get("hidden", "none") if legal else None,
        "data.scale": "default" if spec.get("scale") is None else "explicit",
        "error.code": rec.get("error"),
        "tsv.rd": tsv["rd"],
        "tsv.wr": tsv["wr"],
        "dma.stall": stall,
        "dram.delay": "0" if delay == 0 else "1-8" if delay <= 8 else "9+",
        "stress.sram_stall": ("on" if spec.get("sram_stall") else "off") if legal else None,
        "stress.host_idle": "on" if spec.get("host_idle") else "off",
        "check.s_tile": ("on" if spec.get("s_check") else "off") if legal else None,
        "_S": S,
    }


def _empty_rows(spec: dict) -> str:
    kvl = spec.get("kv_valid_len")
    m = spec.get("mask")
    empty = (kvl == 0) or bool(m and (m["empty_rows"] or m["density"] < 0.5)) or \
        (spec.get("causal") and spec["seq_q"] > spec["seq_kv"])
    return "some" if empty else "none"


class RegressCoverage:
    """The regression's cover points (see the module docstring) for ``config``."""

    def __init__(self, config: NPUConfig, name: str | None = None):
        self.config = config
        self.top = name or f"regress{next(_count)}"
        S = config.tsv_spare_lanes
        mask_kinds = ["none", "causal", "arbitrary", "kv_valid_len", "combined"]
        edges = ["0", "1", "tile-1", "other"]
        self.bins = {
            "shape.path": ["decode", "prefill"],
            "shape.kv_mode": ["resident", "streaming"],
            "shape.q_tiles": ["1", "2-3", "4+"],
            "shape.kv_tiles": ["1", "2-3", "4+"],
            "shape.gqa": ["1", "2", "3-4", "5+"],
            "shape.head_dim": ["below_C", "multiple_C", "partial_C", "max_head_dim"],
            "edge.seq_q": edges,
            "edge.seq_kv": edges,
            "mask.kind": mask_kinds,
            "mask.layout": ["shared", "per_head"],
            "mask.empty_rows": ["some", "none"],
            "data.hidden": ["none", "finite", "nan", "inf"],
            "data.scale": ["default", "explicit"],
            "error.code": [e.name for e in NPUError],
            "tsv.rd": [str(i) for i in range(S + 1)] + ["TOO_MANY"],
            "tsv.wr": [str(i) for i in range(S + 1)] + ["TOO_MANY"],
            "dma.stall": ["<=10%", "10-30%", ">30%"],
            "dram.delay": ["0", "1-8", "9+"],
            "stress.sram_stall": ["off", "on"],
            "stress.host_idle": ["off", "on"],
            "check.s_tile": ["off", "on"],
        }
        points = [CoverPoint(f"{self.top}.{n}", xf=(lambda f, n=n: f[n]), bins=list(b))
                  for n, b in self.bins.items()]
        crosses = [CoverCross(f"{self.top}.cross.path_mask",
                              items=[f"{self.top}.shape.path", f"{self.top}.mask.kind"]),
                   CoverCross(f"{self.top}.cross.edges",
                              items=[f"{self.top}.edge.seq_q", f"{self.top}.edge.seq_kv"])]
        self._names = [f"{self.top}.{n}" for n in self.bins] + \
            [f"{self.top}.cross.path_mask", f"{self.top}.cross.edges"]

        @coverage_section(*points, *crosses)
        def sample(f):
            return None
        self._sample = sample
        self.samples = 0

    def sample(self, spec: dict, rec: dict) -> None:
        """Count one job (only when it passed its checks)."""
        if rec.get("passed"):
            self._sample(features(spec, rec, self.config))
            self.samples += 1

    def report(self) -> dict:
        """``percent`` (covered / all bins, crosses included), ``bins``,
        ``covered``, ``points`` (per item: size, covered, hits per bin) and
        ``holes`` (one line per bin never hit)."""
        points, holes = {}, []
        size = covered = 0
        for full in self._names:
            item = coverage_db[full]
            name = full[len(self.top) + 1:]
            hits = {(" x ".join(map(str, b)) if isinstance(b, tuple) else str(b)): int(n)
                    for b, n in item.detailed_coverage.items()}
            points[name] = dict(size=int(item.size), covered=int(item.coverage), bins=hits)
            size += int(item.size)
            covered += int(item.coverage)
            holes += [f"{name}: {b}" for b, n in hits.items() if n == 0]
        return dict(percent=100.0 * covered / size if size else 0.0, bins=size, covered=covered,
                    samples=self.samples, points=points, holes=holes)

    def close(self) -> None:
        """Remove this instance's items from cocotb-coverage's process-wide database."""
        for k in [k for k in coverage_db if k == self.top or k.startswith(self.top + ".")]:
            del coverage_db[k]


def coverage_of(config: NPUConfig, specs: list[dict], records: list[dict]) -> dict:
    """The coverage report of a regression: every (spec, record) pair sampled
    into a fresh ``RegressCoverage``."""
    cov = RegressCoverage(config)
    try:
        for s, r in zip(specs, records):
            cov.sample(s, r)
        return cov.report()
    finally:
        cov.close()
