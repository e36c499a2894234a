"""Simulator speed and LLM decode speed, for the ``flashnpu bench`` report.

Writes ``results/sim_speed.json`` (simulated NPU cycles per second of wall
time, per simulator and array size, one attention job each) and
``results/decode.json`` (tokens per second of ``flashnpu decode`` with the
golden backend; the rtl backend simulates every attention call of the 30
layers and takes minutes per token, so it is not part of this script).  Wall-clock figures depend on
the machine and its load; the JSON records the load average at the start.

Usage::

    python -m flashnpu.scripts.bench_speed [--full] [--out results]

``--full`` adds the 32x32 NPU under Verilator (a ~6 min build the first time).
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


def _sim_row(label, config, sim, case_kw):
    from flashnpu.sim.case import random_case
    from flashnpu.sim.rtl_backend import run_jobs

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
        points.insert(0, ("32x32", DEFAULT, "verilator",
                          dict(heads=1, seq_q=64, seq_kv=128, head_dim=128, causal=False)))
    return [_sim_row(*p) for p in points]


def decode_speed(backend: str, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "flashnpu", "decode", "--prompt", "Once upon a time",
           "--max-new-tokens", str(tokens), "--backend", backend, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    st = json.loads(out[out.index("{"):])["stats"]
    return dict(backend=backend, new_tokens=st["new_tokens"],
                tokens_per_s=round(st["tokens_per_second"], 3),
                decode_tokens_per_s=round(st["decode_tokens_per_second"], 3),
                jobs_per_token=st["jobs_per_token"],
                npu_cycles_per_token=st["npu_cycles_per_token"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results")
    p.add_argument("--full", action="store_true", help="also the 32x32 NPU under Verilator")
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = round(os.getloadavg()[0], 1)
    rows = sim_speed(args.full)
    (out / "sim_speed.json").write_text(json.dumps(
        dict(command="python -m flashnpu.scripts.bench_speed" + (" --full" if args.full else ""),
             load_average=load, rows=rows), indent=1))
    drows = [decode_speed("golden", args.tokens)]
    (out / "decode.json").write_text(json.dumps(
        dict(command="python -m flashnpu.scripts.bench_speed", load_average=load,
             prompt="Once upon a time", rows=drows), indent=1))
    for r in rows + drows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
