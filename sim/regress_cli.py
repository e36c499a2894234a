"""flashnpu regress: constrained-random regression of the NPU's RTL.

N random jobs from one base seed (job i's seed from
``SeedSequence(seed).spawn(N)``), legal ones checked bit for bit against
the golden model and against the float rule, illegal ones for their exact
error code and for nothing written.  Each failure prints the one-line
command that reproduces it (``--replay SEED``).  Functional coverage
(cocotb-coverage) lists the bins never hit.  Reports: regress.json and
regress.md in --out.

Workers: 1 runs in this process; more start a local Dask cluster for the
run (nothing to set up); --address tcp://HOST:8786 uses the workers of a
running Dask scheduler instead.  Every worker keeps one simulator session.

Exit status: 0 every job passed, 1 a job failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time

from flashnpu.argtypes import int_in
from flashnpu.config import DEFAULT
from flashnpu.errors import UsageError
from flashnpu.paths import output_dir

from . import regress as rg
from .cli import array_config
from .regress_coverage import coverage_of


def register(sub):
    p = sub.add_parser("regress", help="constrained-random regression of the NPU RTL with coverage",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=100, metavar="N", help="random jobs (default 100)")
    p.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    p.add_argument("--rows", type=int, default=DEFAULT.array_rows, help="PE array rows")
    p.add_argument("--cols", type=int, default=DEFAULT.array_cols, help="PE array columns")
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: the CPU count; 1 runs in this process; "
                   "with --address every worker of the cluster is used)")
    p.add_argument("--address", metavar="ADDR", help="Dask scheduler of a cluster, e.g. tcp://host:8786")
    p.add_argument("--sim", choices=["verilator", "icarus"], default="verilator")
    p.add_argument("--x-seed", type=int_in(1), default=None, metavar="S",
                   help="Verilator: every register and memory word powers up random from seed S "
                   "(a separate build); results must equal a run without it")
    p.add_argument("--replay", type=int, action="append", metavar="JOB_SEED",
                   help="run only the job with this seed (from a report or a repro line); repeatable")
    p.add_argument("--only", type=int, action="append", metavar="JOB_ID",
                   help="run only job JOB_ID of the base seed's sequence; repeatable")
    p.add_argument("--illegal-fraction", type=float, default=rg.DEFAULT_ILLEGAL,
                   help=f"share of deliberately illegal jobs (default {rg.DEFAULT_ILLEGAL})")
    p.add_argument("--inject-fraction", type=float, default=rg.DEFAULT_INJECT,
                   help=f"share of jobs with an injected simulation-time fault (default {rg.DEFAULT_INJECT})")
    p.add_argument("--out", default="results", metavar="DIR", help="report folder (default results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {args.jobs}")
    for name in ("illegal_fraction", "inject_fraction"):
        v = getattr(args, name)
        if not 0 <= v <= 1:
            raise UsageError(f"--{name.replace('_', '-')} must be within 0..1, not {v}")
    if args.illegal_fraction + args.inject_fraction > 1:
        raise UsageError("--illegal-fraction plus --inject-fraction must not exceed 1")
    if args.only and any(not 0 <= i < args.jobs for i in args.only):
        raise UsageError(f"--only takes job ids 0..{args.jobs - 1} (of --jobs {args.jobs})")
    if args.replay and any(s < 0 for s in args.replay):
        raise UsageError("--replay takes the non-negative job seed of a report")
    output_dir(args.out, "--out")
    workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, not {workers}")
    config = array_config(args.rows, args.cols)
    kw = dict(illegal=args.illegal_fraction, inject=args.inject_fraction)
    if args.replay:
        specs = [rg.generate_job(s, config, **kw) for s in args.replay]
    else:
        specs = rg.generate_jobs(args.seed, args.jobs, config, only=args.only, **kw)
    workers = min(workers, len(specs)) if not args.address else workers
    t0 = time.time()
    records, info = rg.run_regression(specs, config, workers=workers, address=args.address, sim=args.sim,
                                      base_seed=args.seed, progress=not args.no_progress, rows_cols=(
                                          args.rows, args.cols), x_seed=args.x_seed, **kw)
    cov = coverage_of(config, specs, records)
    meta = dict(command=_command(args, workers),
                array=f"{args.rows}x{args.cols}", base_seed=args.seed, jobs_requested=args.jobs,
                replay=args.replay, only=args.only, sim=args.sim, config=config.to_dict(),
                illegal_fraction=args.illegal_fraction, inject_fraction=args.inject_fraction,
                started=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)), **info)
    jp, mp = rg.write_reports(args.out, meta, records, cov)
    summ = rg.summarize(records)
    for r in records:
        if not r["passed"]:
            print(f"FAIL job {r['id']} seed {r['seed']} ({r['kind']}"
                  + (f", {r['fault']}" if r.get("fault") else "") + f"): {r['failures'][0]}")
            print(f"  reproduce: {r['repro']}")
    print(f"flashnpu regress {args.rows}x{args.cols}: {summ['jobs']} jobs, {summ['passed']} passed, "
          f"{summ['failed']} failed; coverage {cov['percent']:.1f} % of {cov['bins']} bins "
          f"({len(cov['holes'])} holes); {info['engine']} x {info['workers']}, wall {info['wall_s']} s")
    print(f"  reports: {jp} {mp}")
    return 0 if summ["failed"] == 0 else 1



def _command(args, workers: int) -> str:
    """The command line of this run, with every default spelled out."""
    parts = ["flashnpu", "regress", "--rows", str(args.rows), "--cols", str(args.cols)]
    if args.replay:
        parts += [x for s in args.replay for x in ("--replay", str(s))]
    else:
        parts += ["--jobs", str(args.jobs), "--seed", str(args.seed)]
        parts += [x for i in (args.only or []) for x in ("--only", str(i))]
    parts += ["--address", args.address] if args.address else ["--workers", str(workers)]
    if args.sim != "verilator":
        parts += ["--sim", args.sim]
    if args.x_seed is not None:
        parts += ["--x-seed", str(args.x_seed)]
    if args.illegal_fraction != rg.DEFAULT_ILLEGAL:
        parts += ["--illegal-fraction", f"{args.illegal_fraction:g}"]
    if args.inject_fraction != rg.DEFAULT_INJECT:
        parts += ["--inject-fraction", f"{args.inject_fraction:g}"]
    return " ".join(shlex.quote(p) for p in parts)
