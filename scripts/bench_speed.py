"""Simulator speed and LLM decode speed, for the ``flashnpu bench`` report.

Writes ``results/sim_speed.json`` (simulated NPU cycles per second of wall
time, per simulator and array size, one attention job each) and
``results/decode.json`` (tokens per second of ``flashnpu decode`` on the
golden backend at the default 32x32 array, and on the rtl backend -- every
attention call of the 30 layers simulated in one Verilator session -- for a
short run on a small array).  Wall-clock figures depend on the machine and
its load; the JSON records the load average at the start.

Usage::

    python -m flashnpu.scripts.bench_speed [--full] [--only sim|decode] [--out results]
        [--tokens 16] [--rtl-tokens 2] [--rtl-array 8x8]

``--full`` adds the 32x32 NPU under Verilator (a ~6 min build the first
time) and under Icarus (one small job: ~1 min build, ~3-8 min of simulation); ``--only`` rewrites one of the two files;
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
import subprocess
import sys
import time
from pathlib import Path

from flashnpu.config import DEFAULT, small_config
from flashnpu.sim.case import random_case
from flashnpu.sim.rtl_backend import run_jobs

PROMPT = "Once upon a time"


def _sim_row(label, config, sim, case_kw):

    case = random_case(config=config, **case_kw)
    t0 = time.time()
    res = run_jobs([dict(case=case)], config, sim=sim)[0]
    total = time.time() - t0
    cycles = int(res["counters"]["total_cycles"])
    wall = float(res.get("wall_s") or total)
    return dict(simulator=sim, array=label, job=" ".join(f"{k}={v}" for k, v in case_kw.items()),
                cycles=cycles, wall_s=round(wall, 2), cycles_per_s=round(cycles / wall, 1))


def sim_speed(full: bool) -> list:
    """One job per (simulator, array): returns table rows."""
    small_job = dict(heads=1, seq_q=32, seq_kv=64, head_dim=32, causal=False)
    points = [("8x8", small_config(8, 8, max_head_dim=128), "verilator", small_job),
              ("4x4", small_config(4, 4), "verilator", dict(small_job, head_dim=16)),
              ("4x4", small_config(4, 4), "icarus", dict(small_job, head_dim=16, seq_q=8, seq_kv=16))]
    if full:
        points[:0] = [("32x32", DEFAULT, "verilator",
                       dict(heads=1, seq_q=64, seq_kv=128, head_dim=128, causal=False)),
                      ("32x32", DEFAULT, "icarus", small_job)]
    return [_sim_row(*p) for p in points]


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
    rows = drows = []
    if args.only != "decode":
        rows = sim_speed(args.full)
        (out / "sim_speed.json").write_text(json.dumps(
            dict(command="python -m flashnpu.scripts.bench_speed" + (" --full" if args.full else "")
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
