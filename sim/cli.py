"""flashnpu sim: run one attention job on a backend and check it.

Backends
--------
golden   the bit-exact model (flashnpu.golden.flash_attention_hw)
rtl      the generated Verilog under Verilator or Icarus through cocotb
         (flashnpu.sim.rtl_backend); its O must equal the golden O bit
         for bit

Every backend's O is also compared with the float64 reference under the
tolerance rule of flashnpu.golden.tolerance_check.  Exit status: 0 pass,
1 a comparison failed, 2 bad input (nothing written).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

from flashnpu.argtypes import nonneg_int, positive_int
from flashnpu.config import DEFAULT, NPUConfig
from flashnpu.errors import UsageError
from flashnpu.golden import ComparisonError, assert_bit_exact, flash_attention_hw
from flashnpu.paths import output_file

from .case import CaseError, load_case, random_case, save_result

# backend name -> module with run(case, config, args) -> (o, stats)
BACKENDS = {"golden": "flashnpu.sim.cli", "rtl": "flashnpu.sim.rtl_backend"}


def run(case, config, args):
    """The golden backend: bit-exact model, op counts as statistics."""
    res = flash_attention_hw(case.q, case.k, case.v, config=config, **case.kwargs())
    return res.o, dict(res.stats)


def register(sub):
    p = sub.add_parser("sim", help="run an attention job on the NPU model and check it",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", metavar="CASE.npz", help="input case (see the file contract); "
                   "without it a seeded random case is made")
    p.add_argument("--out", metavar="RESULT.npz", help="write o and the run statistics here")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="golden")
    p.add_argument("--sim", choices=["verilator", "icarus"], default="verilator",
                   help="simulator for the rtl backend")
    p.add_argument("--heads", type=positive_int, default=2)
    p.add_argument("--kv-heads", type=positive_int, default=None, help="default: --heads")
    p.add_argument("--seq-q", type=positive_int, default=256)
    p.add_argument("--seq-kv", type=positive_int, default=None, help="default: --seq-q")
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--rows", type=positive_int, default=DEFAULT.array_rows, help="PE array rows")
    p.add_argument("--cols", type=positive_int, default=DEFAULT.array_cols, help="PE array columns")
    p.add_argument("--waves", metavar="FILE.vcd", help="rtl backend: dump a waveform")
    p.add_argument("--wave-window", metavar="START:END", help="rtl backend: dump only these cycles")
    p.add_argument("--wave-depth", type=nonneg_int, default=None, help="rtl backend: hierarchy depth")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=main)


def array_config(rows: int, cols: int) -> NPUConfig:
    """The NPU configuration of ``flashnpu sim --rows --cols`` (and of
    ``flashnpu decode``): the default configuration at its own size.

    Raises
    ------
    flashnpu.errors.UsageError
        a size the configuration rejects (the message names the value).
    """
    if (rows, cols) == (DEFAULT.array_rows, DEFAULT.array_cols):
        return DEFAULT
    try:
        # Br = 2R, Bc = 2C; max_head_dim: the largest multiple of 8 up to the
        # default that fits the PE register budget of this array size with
        # the design point's softmax overlap, i.e. its second S block (4 x 4:
        # 96, where one S block alone would hold 104)
        cfg = NPUConfig(array_rows=rows, array_cols=cols, br=2 * rows,
                        bc=2 * cols, max_head_dim=8, softmax_overlap=True)
        fits = [d for d in range(8, DEFAULT.max_head_dim + 1, 8)
                if cfg.registers_needed(d) <= cfg.pe_registers]
        return cfg.replace(max_head_dim=fits[-1], softmax_overlap=None)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_outputs(args) -> None:
    """The files ``flashnpu sim`` writes, checked before any work (``flashnpu.paths``)."""
    inputs = [("--inputs", args.inputs)] if args.inputs else []
    if args.out is not None:
        output_file(args.out, "--out", suffixes=(".npz",), inputs=inputs,
                    outputs=[("--waves", args.waves)] if args.waves else [])
    if args.waves is not None:
        if args.backend != "rtl":
            raise UsageError(f"--waves {args.waves!r} needs --backend rtl (the {args.backend} backend has no waveform)")
        output_file(args.waves, "--waves", suffixes=(".vcd", ".fst"), inputs=inputs, make_parent=True)
    elif args.wave_window is not None or args.wave_depth is not None:
        raise UsageError("--wave-window and --wave-depth need --waves FILE.vcd")


def main(args) -> int:
    config = array_config(args.rows, args.cols)
    check_outputs(args)
    try:
        if args.inputs:
            case = load_case(args.inputs, config)
        else:
            case = random_case(args.heads, args.kv_heads, args.seq_q, args.seq_kv, args.head_dim,
                               args.causal, args.seed, config)
    except CaseError as e:
        raise UsageError(str(e)) from None

    backend = importlib.import_module(BACKENDS[args.backend])
    if hasattr(backend, "wave_options"):
        backend.wave_options(args)                  # a bad window: before the build
    t0 = time.time()
    o, stats = backend.run(case, config, args)
    wall = time.time() - t0

    ok = True
    checks = {}
    try:
        tol_ok, tol_msg, s, _ = case.float_rule(o)
        checks["reference"] = dict(ok=tol_ok, detail=tol_msg, max_abs_err=s.max_abs, max_rel_err=s.max_rel)
        ok &= tol_ok
    except ComparisonError as e:
        checks["reference"] = dict(ok=False, detail=str(e))
        ok = False
    if args.backend != "golden":
        gold = flash_attention_hw(case.q, case.k, case.v, config=config, **case.kwargs()).o
        try:
            assert_bit_exact(o, gold, "O")
            checks["bit_exact_golden"] = dict(ok=True, detail="O equals the bit-exact golden model")
        except ComparisonError as e:
            checks["bit_exact_golden"] = dict(ok=False, detail=str(e))
            ok = False
    summary = dict(backend=args.backend, shape=case.shape, causal=case.causal,
                   masked=case.mask is not None, kv_valid_len=case.kv_valid_len,
                   array=f"{config.array_rows}x{config.array_cols}", wall_s=round(wall, 3),
                   stats=stats, checks=checks, passed=bool(ok))
    if args.out:
        save_result(args.out, o, dict(stats, passed=bool(ok), wall_s=round(wall, 3)))
    if args.json:
        print(json.dumps(summary, indent=1, default=float))
    else:
        _print_summary(summary)
    return 0 if ok else 1


def _print_summary(s):
    sh = s["shape"]
    print(f"flashnpu sim [{s['backend']}] array {s['array']}: heads {sh['heads']} (kv_heads {sh['kv_heads']}), "
          f"seq_q {sh['seq_q']}, seq_kv {sh['seq_kv']}, head_dim {sh['head_dim']}, "
          f"causal {s['causal']}, mask {s['masked']}, kv_valid_len {s['kv_valid_len']}")
    st = s["stats"]
    if "cycles" in st:
        print(f"  cycles {st['cycles']}: MAC-issuing {100 * st['mac_utilization']:.1f} % of cycles, "
              f"useful work {100 * st['useful_utilization']:.1f} % of the array's MAC slots "
              f"(2 x visible query-key pairs x head_dim)")
        print(f"  at an assumed {st['clock_hz'] / 1e9:g} GHz: issued {st['issued_flops'] / 1e12:.3f}, "
              f"useful {st['useful_flops'] / 1e12:.3f} of peak {st['peak_flops'] / 1e12:.3f} TFLOP/s")
        if "mac_masked" in st:
            print(f"  MAC slots skipped at masked positions: {st['mac_masked']} of {st['mac_ops']} "
                  f"({100 * st['mac_masked'] / max(1, st['mac_ops']):.1f} %)")
        for k, v in st.items():
            if k.startswith("bytes_"):
                print(f"  {k[6:]:>10} bytes {v}")
        if "sim_cycles_per_s" in st:
            print(f"  simulated {st['cycles']} cycles in {st['sim_wall_s']:.2f} s of wall time: "
                  f"{st['sim_cycles_per_s']:,} cycles/s (start command to done)")
        if "waves" in st:
            print(f"  waves: {st['waves']}")
    else:
        print(f"  tile pairs {st.get('tile_pairs')}, MACs {st.get('macs')}, exp2 {st.get('exp2')}, "
              f"recip {st.get('recip')} (no cycle counts: the golden backend is not timed)")
    for name, c in s["checks"].items():
        print(f"  {'PASS' if c['ok'] else 'FAIL'} {name}: {c['detail']}")
    print(f"  wall {s['wall_s']} s -> {'PASS' if s['passed'] else 'FAIL'}")
