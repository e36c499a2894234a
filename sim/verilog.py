"""Synthesizable Verilog of the NPU or one of its blocks, in memory.

Flow::

    NPUConfig (validated) ─► top component (npu | core | array | pe | MODULE:CLASS)
        ─► Verilog text (the block's own generator when it has one, so a PE can
           be ONE module instantiated R x C times; else amaranth.back.verilog)
        ─► FILE.v   : header comment (flashnpu version, top, configuration,
                      the command that regenerates it) + the Verilog
        ─► FILE.json: configuration, top, module names, port list, and for the
                      NPU top its register map

The ``flashnpu verilog`` command line is ``flashnpu.sim.verilog_cli``; the
parsing of generated Verilog and the lint are ``flashnpu.sim.runner``'s.

Tops
----
``npu``    ``flashnpu.hdl.npu.NPU`` (``npu_verilog``; register map from
           ``flashnpu.hdl.npu.register_map``): CSR map, controller, DMA, SRAM
           and the compute core.
``core``   ``flashnpu.hdl.core.Core`` (``core_verilog``): PE array + reduction
           tree + tile buffers + sequencer.
``array``  ``flashnpu.hdl.array.PeArray``: the R x C PE mesh, PEs as instances
           of the modules of ``flashnpu.hdl.array.module_texts``.
``pe``     ``flashnpu.hdl.pe.Pe``: one processing element.
``MODULE:CLASS``  any component of ``flashnpu.hdl`` (e.g. ``fpu:Fp16Mac``),
           built with the configuration when its constructor has a ``config``
           parameter; when MODULE offers ``module_texts(config)`` and CLASS a
           ``pe_as_instance`` flag, it is built in instance mode.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import importlib
import inspect
import json
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import amaranth
from amaranth.back import verilog
from amaranth.hdl import UnusedElaboratable

import flashnpu
from flashnpu.config import NPUConfig
from flashnpu.hdl import array, core, npu, pe
from flashnpu.paths import write_text
from flashnpu.sim.runner import instance_counts, module_names, parse_ports
from flashnpu.sim.verilog_cli import DEFAULT_TOP, TOPS, config_args

__all__ = ["TOPS", "DEFAULT_TOP", "Top", "NAMED_TOPS", "Generated", "resolve_top",
           "default_module_name", "generate", "write"]


@dataclass(frozen=True)
class Top:
    """How one named top is built.

    Attributes
    ----------
    component : the Amaranth component class (its constructor takes the config)
    generator : ``f(config, name=...) -> str``, the block's own Verilog
        generator (the PE as one module instantiated R x C times), or None
    module_texts : ``f(config) -> str``, the shared modules when the
        component is built with ``pe_as_instance=True``, or None
    register_map : ``f(config)``, the register map for the sidecar, or None
    """

    component: type
    generator: Callable[..., str] | None = None
    module_texts: Callable[[NPUConfig], str] | None = None
    register_map: Callable[[NPUConfig], object] | None = None


NAMED_TOPS = {
    "npu": Top(npu.NPU, generator=npu.npu_verilog, register_map=npu.register_map),
    "core": Top(core.Core, generator=core.core_verilog),
    "array": Top(array.PeArray, module_texts=array.module_texts),
    "pe": Top(pe.Pe),
}


def _params(cls) -> list:
    try:
        return [p for p in inspect.signature(cls).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        return []


def _construct(cls, config: NPUConfig, **extra):
    """``cls(config, **extra)`` when the constructor has a ``config``
    parameter, ``cls(**extra)`` when it needs nothing."""
    params = _params(cls)
    if params and params[0].name == "config" and params[0].kind != params[0].KEYWORD_ONLY:
        return cls(config, **extra)
    if any(p.name == "config" for p in params):
        return cls(config=config, **extra)
    required = [p for p in params if p.default is p.empty]
    if not required:
        return cls(**extra)
    raise ValueError(f"cannot build {cls.__module__}.{cls.__qualname__}: its constructor needs "
                     f"{[p.name for p in required]!r}, not an NPUConfig")


def resolve_top(top: str) -> Top:
    """The ``Top`` of a top name or of ``MODULE:CLASS``.

    Raises
    ------
    ValueError for an unknown top, module or class.
    """
    if ":" not in top:
        if top not in NAMED_TOPS:
            raise ValueError(f"top must be one of {', '.join(TOPS)} or MODULE:CLASS, not {top!r}")
        return NAMED_TOPS[top]
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
    texts = getattr(mod, "module_texts", None)
    shared = callable(texts) and any(p.name == "pe_as_instance" for p in _params(cls))
    return Top(cls, module_texts=texts if shared else None)


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
        return dict(
            generator=f"flashnpu {flashnpu.__version__}",
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
    lines = [f"// flashnpu {flashnpu.__version__}: Verilog of top '{top}' (module {module}),",
             f"// PE array {config.array_rows}x{config.array_cols}, Br={config.br}, Bc={config.bc}, "
             f"max_head_dim={config.max_head_dim}, {config.pe_registers} x 32-bit PE registers.",
             f"// configuration (digest {config.digest}): {cfg}",
             f"// regenerate with: {command}",
             "// Generated code: edit the Amaranth sources, not this file.", ""]
    return "\n".join(lines)


def default_module_name(top: str) -> str:
    """Verilog name of a top's module: ``flashnpu`` for the NPU, else ``flashnpu_<class>``."""
    if top == "npu":
        return "flashnpu"
    base = top.split(":")[-1]
    return "flashnpu_" + re.sub(r"[^A-Za-z0-9_]", "_", base).lower()


def generate(config: NPUConfig, top: str | None = None, name: str | None = None) -> Generated:
    """Generate the Verilog of ``top`` (default ``DEFAULT_TOP``) for ``config`` in memory.

    Raises
    ------
    ValueError when the top does not exist or cannot be built.
    """
    top = top or DEFAULT_TOP
    name = name or default_module_name(top)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"module name must be a plain Verilog identifier, not {name!r}")
    spec = resolve_top(top)
    t0 = time.time()
    with warnings.catch_warnings():
        # In instance mode the blocks' Python objects only carry the port
        # signals of the Instances; Amaranth warns that they are never
        # elaborated (UnusedElaboratable), which is the point.
        if spec.generator is not None or spec.module_texts is not None:
            warnings.simplefilter("ignore", UnusedElaboratable)
        if spec.generator is not None:
            # the block's own generator (e.g. shared PE module + R x C instances)
            text = spec.generator(config, name=name)
        elif spec.module_texts is not None:
            # PEs (and other repeated blocks) as Instances of modules
            # generated once by the block's ``module_texts(config)``
            component = _construct(spec.component, config, pe_as_instance=True)
            text = (verilog.convert(component, name=name, emit_src=False) + "\n"
                    + spec.module_texts(config))
        else:
            component = _construct(spec.component, config)
            text = verilog.convert(component, name=name, emit_src=False)
        gc.collect()
    dt = time.time() - t0
    command = f"flashnpu verilog {config_args(config)} --top {top}"
    if name != default_module_name(top):
        command += f" --name {name}"
    regmap = _jsonable(spec.register_map(config)) if spec.register_map is not None else None
    return Generated(top=top, module=name, config=config,
                     text=_header(top, name, config, command) + text,
                     ports=parse_ports(text, name), modules=module_names(text),
                     register_map=regmap, generate_s=round(dt, 2), command=command)


def write(gen: Generated, path: Path) -> tuple[Path, Path]:
    """Write ``gen`` to ``path`` and its sidecar to ``path`` with ``.json``,
    each whole (``flashnpu.paths.atomic_write``); a missing folder is created."""
    path = Path(path)
    side = path.with_suffix(".json")
    sidecar = json.dumps(gen.sidecar(path), indent=1) + "\n"
    write_text(path, gen.text, make_parent=True)
    write_text(side, sidecar)
    return path, side
