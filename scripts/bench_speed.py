"""Simulator speed and LLM decode speed, for the ``flashnpu bench`` report.

Writes ``results/sim_speed.json`` (simulated NPU cycles per second of wall
time, from the start command to done, per simulation path and array size,
one attention job each: ``sim_speed``) and
``results/decode.json`` (tokens per second of ``flashnpu decode`` on the
golden backend at the default 32x32 array, and on the rtl backend -- every
attention call of the 30 layers simulated in one Verilator session -- for a
short run on a small array).  Wall-clock figures depend on the machine and
its load; the JSON records the load average at the start.

Usage::

    python -m flashnpu.scripts.bench_speed [--full [--flat] [--x-unique]] [--only sim|decode] [--out results]
        [--tokens 16] [--rtl-tokens 2] [--rtl-array 8x8]
    python -m flashnpu.scripts.bench_speed --profile [--out results]

``--full`` adds the 32x32 NPU (three Verilator builds of a minute or two the
first time: replay with 1 and 2 threads, cocotb; and Icarus on a small job,
~1 min build, ~3-8 min of simulation); ``--flat`` adds a fully flat 32x32
replay build; ``--x-unique`` a 32x32 replay build with Verilator's
``unique`` X handling; ``--profile`` writes ``results/sim_profile.txt`` (``perf``
profile of the 32x32 model) and nothing else; ``--only`` rewrites one of the two files;
``--rtl-tokens 0`` leaves
out the rtl decode.  Each decode row runs ``flashnpu decode --json`` in a
subprocess: ``wall_s`` is that whole command (model load, NPU build check
and simulator start-up included), ``tokens_per_s`` the decoder's own figure
(prefill and generate steps).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashnpu.config import DEFAULT, small_config
from flashnpu.sim import replay
from flashnpu.sim.case import random_case
from flashnpu.sim.rtl_backend import run_jobs

PROMPT = "Once upon a time"


def _cocotb_row(label, config, sim, case, job):
    res = run_jobs([dict(case=case)], config, sim=sim)[0]
    cycles = int(res["counters"]["total_cycles"])
    wall = float(res["wall_s"])
    return dict(path=f"cocotb + {sim}", array=label, job=job, cycles=cycles, wall_s=round(wall, 3),
                cycles_per_s=round(cycles / wall, 1), build_s=(res.get("build") or {}).get("build_s"),
                build_peak_mib=None)


def _replay_row(label, config, case, job, threads, workdir, hierarchical=True, x_unique=False):
    folder = Path(workdir) / f"{label}-t{threads}-{'hier' if hierarchical else 'flat'}-x{int(x_unique)}"
    plan = replay.record_job(case, config, folder)
    build = replay.build_replay(config, threads=threads, hierarchical=hierarchical, x_unique=x_unique)
    res = replay.run_replay(build, folder, plan)
    what = ("" if hierarchical else ", flat build") + (", X unique" if x_unique else "")
    return dict(path=f"C++ replay, {threads} thread{'s' if threads > 1 else ''}{what}", array=label, job=job,
                cycles=res["cycles"], wall_s=round(res["wall_s"], 3), cycles_per_s=round(res["cycles_per_s"], 1),
                build_s=build.build_s, build_peak_mib=build.build_peak_mib)


#: (array, configuration, job of every path, Icarus' shorter job or None = the same)
SPEED_POINTS = [
    ("4x4", small_config(4, 4), dict(heads=1, seq_q=32, seq_kv=64, head_dim=16, causal=False), None),
    ("8x8", small_config(8, 8, max_head_dim=128), dict(heads=1, seq_q=32, seq_kv=64, head_dim=32, causal=False),
     None),
    ("32x32", DEFAULT, dict(heads=1, seq_q=64, seq_kv=128, head_dim=128, causal=False),
     dict(heads=1, seq_q=32, seq_kv=64, head_dim=32, causal=False)),
]


def sim_speed(full: bool, flat: bool = False, x_unique: bool = False) -> list:
    """Simulated cycles per second of every path on one job per array size,
    one after another in one run (so machine load affects them alike): the
    C++ replay harness with 1 and 2 Verilator threads (the limit), the cocotb
    testbench under Verilator, and under Icarus (at 32x32 on a shorter job:
    Icarus runs a few cycles per second there).  32x32 only with ``full``;
    ``flat`` adds the replay of a fully flat 32x32 build with 2 threads (a
    build of about 15 minutes); ``x_unique`` the 32x32 replay (1 thread) of a
    build with ``--x-assign unique --x-initial unique`` (the X handling of
    every testbench build) beside the replay's default ``fast``."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashnpu-speed-") as tmp:
        for label, config, job_kw, icarus_kw in SPEED_POINTS:
            if label == "32x32" and not full:
                continue
            case = random_case(config=config, seed=1, **job_kw)
            job = " ".join(f"{k}={v}" for k, v in job_kw.items())
            rows += [_replay_row(label, config, case, job, t, tmp) for t in (1, 2)]
            if flat and label == "32x32":
                rows.append(_replay_row(label, config, case, job, 2, tmp, hierarchical=False))
            if x_unique and label == "32x32":
                rows.append(_replay_row(label, config, case, job, 1, tmp, x_unique=True))
            rows.append(_cocotb_row(label, config, "verilator", case, job))
            if icarus_kw:
                rows.append(_cocotb_row(label, config, "icarus", random_case(config=config, seed=1, **icarus_kw),
                                        " ".join(f"{k}={v}" for k, v in icarus_kw.items())))
            else:
                rows.append(_cocotb_row(label, config, "icarus", case, job))
    return rows


def profile(out: Path, threads: int = 1, top: int = 25) -> Path:
    """Where the 32x32 model spends its time: ``perf record`` of the C++
    replay (the job of the 32x32 speed row) and the ``top`` symbols of
    ``perf report`` by own time, written to ``out/sim_profile.txt``.

    Raises
    ------
    RuntimeError
        when ``perf`` is not installed or fails.
    """
    if shutil.which("perf") is None:
        raise RuntimeError("perf is not installed (apt-get install linux-perf)")
    label, config, job_kw, _ = SPEED_POINTS[-1]
    case = random_case(config=config, seed=1, **job_kw)
    with tempfile.TemporaryDirectory(prefix="flashnpu-prof-") as tmp:
        folder = Path(tmp) / "job"
        replay.record_job(case, config, folder)
        build = replay.build_replay(config, threads=threads)
        data = Path(tmp) / "perf.data"
        subprocess.run(["perf", "record", "-q", "-o", str(data), str(build.exe), str(folder)],
                       check=True, capture_output=True)
        rep = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "symbol",
                              "--stdio", "-q"], check=True, capture_output=True, text=True).stdout
    lines = [ln.rstrip() for ln in rep.splitlines() if "%" in ln][:top]
    job = " ".join(f"{k}={v}" for k, v in job_kw.items())
    text = (f"# perf profile of the {label} NPU model (C++ replay, {threads} thread(s), {job})\n"
            f"# command: python -m flashnpu.scripts.bench_speed --profile\n"
            f"# own time per symbol, top {top}\n" + "\n".join(lines) + "\n")
    path = out / "sim_profile.txt"
    path.write_text(text)
    return path


def decode_speed(backend: str, tokens: int, rows: int | None = None, cols: int | None = None) -> dict:
    """One ``flashnpu decode --json`` run of ``tokens`` new tokens; returns a table row."""
    cmd = [sys.executable, "-m", "flashnpu", "decode", "--prompt", PROMPT,
           "--max-new-tokens", str(tokens), "--backend", backend, "--json"]
    if rows is not None:
        cmd += ["--rows", str(rows), "--cols", str(cols)]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    wall = time.time() - t0
    doc = json.loads(out[out.index("{"):])
    st = doc["stats"]
    dtps = st["decode_tokens_per_second"]
    return dict(backend=backend, array=st["array"], new_tokens=st["new_tokens"],
                tokens_per_s=round(st["tokens_per_second"], 4),
                decode_tokens_per_s=None if dtps is None else round(dtps, 4),
                jobs_per_token=st["jobs_per_token"],
                npu_cycles_per_token=st["npu_cycles_per_token"],
                token_ids=" ".join(map(str, doc["token_ids"])), wall_s=round(wall, 1))


def _array(text: str) -> tuple:
    r, sep, c = text.partition("x")
    if not sep or not r.isdigit() or not c.isdigit():
        raise argparse.ArgumentTypeError(f"array must look like 8x8, not {text!r}")
    return int(r), int(c)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results")
    p.add_argument("--full", action="store_true", help="also the 32x32 NPU under Verilator and Icarus")
    p.add_argument("--profile", action="store_true",
                   help="only: perf profile of the 32x32 model into sim_profile.txt")
    p.add_argument("--flat", action="store_true",
                   help="with --full: also a fully flat 32x32 replay build (about 15 min to build)")
    p.add_argument("--x-unique", action="store_true",
                   help="with --full: also a 32x32 replay build with --x-assign/--x-initial unique")
    p.add_argument("--only", choices=("sim", "decode"), default=None,
                   help="rewrite only sim_speed.json or only decode.json")
    p.add_argument("--tokens", type=int, default=16, help="new tokens of the golden decode (default 16)")
    p.add_argument("--rtl-tokens", type=int, default=2,
                   help="new tokens of the rtl decode (default 2; 0 leaves it out)")
    p.add_argument("--rtl-array", type=_array, default=(8, 8), metavar="RxC",
                   help="NPU array of the rtl decode (default 8x8)")
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error(f"--tokens must be at least 1, not {args.tokens}")
    if args.rtl_tokens < 0:
        p.error(f"--rtl-tokens must be 0 or more, not {args.rtl_tokens}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = round(os.getloadavg()[0], 1)
    if args.profile:
        print(profile(out).read_text())
        return 0
    rows = drows = []
    if args.only != "decode":
        rows = sim_speed(args.full, args.flat, args.x_unique)
        (out / "sim_speed.json").write_text(json.dumps(
            dict(command="python -m flashnpu.scripts.bench_speed" + (" --full" if args.full else "")
                 + (" --flat" if args.flat else "") + (" --x-unique" if args.x_unique else "")
                 + (" --only sim" if args.only else ""),
                 load_average=load, rows=rows), indent=1))
    if args.only != "sim":
        drows = [decode_speed("golden", args.tokens)]
        if args.rtl_tokens:
            drows.append(decode_speed("rtl", args.rtl_tokens, *args.rtl_array))
        cmd = ["python -m flashnpu.scripts.bench_speed", *(["--only decode"] if args.only else []),
               *([f"--tokens {args.tokens}"] if args.tokens != 16 else []),
               *([f"--rtl-tokens {args.rtl_tokens}"] if args.rtl_tokens != 2 else []),
               *([f"--rtl-array {args.rtl_array[0]}x{args.rtl_array[1]}"] if args.rtl_array != (8, 8) else [])]
        (out / "decode.json").write_text(json.dumps(
            dict(command=" ".join(cmd), load_average=load, prompt=PROMPT, rows=drows), indent=1))
    for r in rows + drows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
