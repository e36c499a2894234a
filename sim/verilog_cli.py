"""``flashnpu verilog``: write synthesizable Verilog of the NPU or one block.

The command line of ``flashnpu.sim.verilog`` (which builds the text)::

    flashnpu verilog [--rows R --cols C --FIELD N ...] [--top TOP] [--name NAME]
                     [-o FILE.v] [--lint]

writes ``FILE.v`` and its JSON sidecar ``FILE.json``; ``--lint`` then runs
``verilator --lint-only -Wall`` with the project's one waiver list
(``flashnpu.sim.runner.VERILATOR_WAIVERS``) and ``iverilog -g2012`` parse
(``flashnpu.sim.runner.lint``); any remaining warning fails (exit 1).

A bad configuration is one line on stderr and exit status 2, and no file is
written: everything is generated in memory and validated first.  This module
also holds the configuration options shared with ``flashnpu fpga``
(``add_config_arguments``, ``config_from_args``, ``make_config``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from flashnpu.argtypes import float_in, nonneg_int, positive_int
from flashnpu.config import NPUConfig
from flashnpu.errors import UsageError
from flashnpu.paths import output_file
from flashnpu.sim.runner import lint

__all__ = ["TOPS", "DEFAULT_TOP", "make_config", "config_args", "add_config_arguments",
           "config_from_args", "register", "main"]

#: Named tops of ``--top`` (see ``flashnpu.sim.verilog.NAMED_TOPS``).
TOPS = ("npu", "core", "array", "pe")
DEFAULT_TOP = "npu"

# NPUConfig fields with short aliases on the command line.
_ALIASES = {"array_rows": "--rows", "array_cols": "--cols"}


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


def config_args(config: NPUConfig) -> str:
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


def _field_int(name: str):
    """argparse type of an int NPUConfig field: >= 1 (``tsv_spare_lanes`` >= 0)."""
    return nonneg_int if name == "tsv_spare_lanes" else positive_int


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--rows``/``--cols`` and one ``--field-name`` option per NPUConfig field."""
    g = parser.add_argument_group("configuration (NPUConfig fields)")
    g.add_argument("--rows", dest="array_rows", type=positive_int, default=32, metavar="R",
                   help="PE array rows (power of 2; default 32)")
    g.add_argument("--cols", dest="array_cols", type=positive_int, default=32, metavar="C",
                   help="PE array columns (power of 2, >= 2; default 32)")
    for f in dataclasses.fields(NPUConfig):
        if f.name in _ALIASES:
            continue
        helptext = {"br": "query rows per q tile (default 2R)",
                    "bc": "keys per kv tile (default 2C)",
                    "max_head_dim": "largest head_dim (default 128, or the largest multiple of 8 "
                                    "the PE register file holds)"}.get(f.name, f"default {f.default!r}")
        g.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name,
                       type=float_in(0.0, lo_open=True) if f.type in ("float", float) else _field_int(f.name),
                       default=None, metavar="N", help=helptext)


def config_from_args(args) -> NPUConfig:
    """NPUConfig from parsed arguments; bad values raise ``UsageError``."""
    changes = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(NPUConfig)
               if f.name not in _ALIASES}
    try:
        return make_config(args.array_rows, args.array_cols, **changes)
    except ValueError as e:
        raise UsageError(f"bad configuration: {e}") from None


# ------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verilog", help="write synthesizable Verilog of the NPU or one block",
        description="Write synthesizable Verilog of the NPU (or one block) for a configuration, "
                    "with a JSON sidecar (configuration, ports, register map).")
    add_config_arguments(p)
    p.add_argument("--top", default=None,
                   help=f"block to generate: {'|'.join(TOPS)} or MODULE:CLASS (default: {DEFAULT_TOP})")
    p.add_argument("--name", default=None, help="Verilog name of the top module (default flashnpu[_TOP])")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="Verilog file to write (default build/verilog/flashnpu_RxC.v for the NPU, "
                   "build/verilog/flashnpu_TOP_RxC.v for another top); "
                        "the sidecar goes beside it with .json")
    p.add_argument("--lint", action="store_true",
                   help="then run verilator --lint-only -Wall and iverilog -g2012; "
                        "exit 1 on any non-waived warning or error")
    p.set_defaults(func=main)


def output_paths(output, top: str, config: NPUConfig) -> Path:
    """The Verilog file of ``-o`` (or the default under ``build/verilog``),
    checked with its ``.json`` sidecar before anything is generated."""
    # deferred, as in main
    from flashnpu.sim.verilog import default_module_name

    if output is None:
        out = Path("build/verilog") / f"{default_module_name(top)}_{config.array_rows}x{config.array_cols}.v"
        output_file(out, "-o", suffixes=(".v", ".sv"), make_parent=True)
    else:
        out = output_file(output, "-o", suffixes=(".v", ".sv"))
    output_file(out.with_suffix(".json"), "sidecar", make_parent=output is None)
    return out


def main(args) -> int:
    # deferred: the generator imports amaranth and every HDL block, which
    # `flashnpu --help` does not need
    from flashnpu.sim.verilog import generate, resolve_top, write

    config = config_from_args(args)
    top = args.top or DEFAULT_TOP
    try:
        resolve_top(top)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = output_paths(args.output, top, config)
    try:
        gen = generate(config, top, args.name)
    except ValueError as e:
        raise UsageError(str(e)) from None
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
