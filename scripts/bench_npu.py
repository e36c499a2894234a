"""Benchmark of the whole NPU in RTL (Verilator): prefill MAC utilization and
decode against the bandwidth roofline; writes ``results/npu.md`` and
``results/npu.json`` and prints the table.

Jobs (the issue's targets):

* prefill: heads 1, seq_q = seq_kv = 512, head_dim 128, non-causal, 32 x 32
  array: MAC utilization = MAC-busy cycles / total cycles (target >= 90 %).
* decode: seq_q 1, 9 query heads over 3 KV heads, head_dim 64, kv_len 256:
  the job is bandwidth-bound; reported as the fraction of the DRAM roof
  the RTL's path has (``perf_model.roofs``: channels x bytes per channel per
  cycle, every channel with its own DMA lane and TSV bundle): DRAM bytes /
  (roof x cycles).

Both jobs run in one cocotb session on one cached build, bit-exact checked
against ``flash_attention_hw``.  Usage: ``python -m flashnpu.scripts.bench_npu
[--rows 32 --cols 32] [--quick]`` (``--quick``: seq 128 prefill).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from flashnpu.config import DEFAULT, NPUConfig
from flashnpu.golden import flash_attention_hw
from flashnpu.scripts.perf_model import roofs
from flashnpu.sim.case import random_case
from flashnpu.sim.rtl_backend import run_jobs, stats_from_counters

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=DEFAULT.array_rows)
    ap.add_argument("--cols", type=int, default=DEFAULT.array_cols)
    ap.add_argument("--quick", action="store_true", help="prefill with seq 128 instead of 512")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    cfg = DEFAULT if (args.rows, args.cols) == (DEFAULT.array_rows, DEFAULT.array_cols) else \
        NPUConfig(array_rows=args.rows, array_cols=args.cols, br=2 * args.rows, bc=2 * args.cols)
    seq = 128 if args.quick else 512
    prefill = random_case(1, 1, seq, seq, 128, False, 1, cfg)
    decode = random_case(9, 3, 1, 256, 64, False, 2, cfg)
    check = random_case(1, 1, 80, 100, 128, True, 21, cfg)      # tb/rtl/test_npu_rtl.py's 32x32 job
    t0 = time.time()
    res = run_jobs([dict(case=prefill, name="prefill"), dict(case=decode, name="decode"),
                    dict(case=check, name="causal_check")], cfg, seed=3)
    wall = time.time() - t0
    rows = []
    out = dict(config=cfg.to_dict(), wall_s=round(wall, 1), build=res[0]["build"], jobs={})
    for name, case, r in (("prefill", prefill, res[0]), ("decode", decode, res[1]),
                          ("causal_check", check, res[2])):
        g = flash_attention_hw(case.q, case.k, case.v, config=cfg, **case.kwargs()).o
        exact = bool(np.array_equal(g.view(np.uint32), r["o"].view(np.uint32))) and r["error"] == 0
        st = stats_from_counters(r["counters"], cfg, case)
        cyc = st["cycles"]
        dram_roof = r["counters"]["dram_bytes"] / roofs(cfg)["dram_bytes_per_cycle"]
        job = dict(shape=case.shape, causal=case.causal, bit_exact=exact, cycles=cyc,
                   mac_utilization=st["mac_utilization"], mac_slot_utilization=st["mac_slot_utilization"],
                   useful_utilization=st["useful_utilization"],
                   issued_tflops=st["issued_flops"] / 1e12, useful_tflops=st["useful_flops"] / 1e12,
                   peak_tflops=cfg.peak_flops / 1e12,
                   dram_roofline_fraction=dram_roof / cyc,
                   sim_wall_s=r["wall_s"], sim_cycles_per_s=round(cyc / max(r["wall_s"], 1e-9)),
                   counters=r["counters"])
        out["jobs"][name] = job
        rows.append((name, job))
    od = Path(args.out)
    od.mkdir(parents=True, exist_ok=True)
    (od / "npu.json").write_text(json.dumps(out, indent=1, default=float))
    lines = [f"# NPU RTL benchmark ({cfg.array_rows}x{cfg.array_cols}, Verilator)", "",
             f"Command: `python -m flashnpu.scripts.bench_npu{' --quick' if args.quick else ''}`; "
             f"build: Verilog generation {out['build']['generate_s']} s, Verilator build "
             f"{out['build']['build_s']} s (cached afterwards); SRAM shrunk to the NPU's map "
             f"for simulation ({res[0]['sram_bytes_sim']} bytes, no effect on results).", "",
             "| job | shape | bit-exact | cycles | MAC util | useful util | useful / peak TFLOP/s | "
             "fraction of the DRAM roof | DRAM bytes | masked MAC slots skipped | sim cycles/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, j in rows:
        sh = j["shape"]
        lines.append(f"| {name} | h{sh['heads']}/kv{sh['kv_heads']} q{sh['seq_q']} kv{sh['seq_kv']} "
                     f"d{sh['head_dim']} | {'yes' if j['bit_exact'] else 'NO'} | {j['cycles']} | "
                     f"{100 * j['mac_utilization']:.1f} % | {100 * j['useful_utilization']:.1f} % | "
                     f"{j['useful_tflops']:.2f} / {j['peak_tflops']:.2f} | "
                     f"{100 * j['dram_roofline_fraction']:.1f} % | "
                     f"{j['counters']['dram_bytes']} | "
                     f"{100 * j['counters']['mac_masked'] / max(1, j['counters']['mac_ops']):.1f} % | "
                     f"{j['sim_cycles_per_s']} |")
    lines += ["", "MAC util = MAC-issuing cycles / total cycles (the array issues R x C MACs per such "
              "cycle): issued slots. Useful util = 2 x visible query-key pairs x head_dim / (R x C x cycles): "
              f"the MACs the job needs. TFLOP/s at the assumed {cfg.clock_hz / 1e9:g} GHz clock (no timing "
              "evidence for it: README, \"Verilog and FPGA\"). Fraction of the DRAM roof = DRAM bytes / "
              "(channels x bytes per channel per cycle x cycles), the path the RTL has. Masked MAC slots "
              "skipped = the NPU's mac_masked counter / mac_ops: slots at padding or causally masked "
              "positions, which neither write nor feed their multiplier data (the energy model "
              "charges only the others)."]
    text = "\n".join(lines) + "\n"
    (od / "npu.md").write_text(text)
    print(text)
    return 0 if all(j["bit_exact"] for _, j in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
