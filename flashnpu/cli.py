"""The ``flashnpu`` command line: one entry point, one sub-command per user task.

Each sub-command lives beside the code it drives and registers itself through
``register(subparsers)``; its handler returns the exit status.  Exit status 2
means bad input (one clear line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flashnpu.errors import UsageError

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

# sub-command name -> module that defines register(subparsers)
COMMANDS = {
    "sim": "flashnpu.sim.cli",
    "waves": "flashnpu.sim.waves",
    "decode": "flashnpu.driver.cli",
    "verilog": "flashnpu.sim.verilog_cli",
    "fpga": "flashnpu.scripts.fpga",
    "depth": "flashnpu.scripts.depth",
    "bench": "flashnpu.scripts.bench",
    "regress": "flashnpu.sim.regress_cli",
}


class _ArgumentError(Exception):
    """A value argparse rejected: reported like a ``UsageError``."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, but a rejected value is one line (no usage block) and
    ``main`` returns 2 instead of exiting."""

    def error(self, message):
        raise _ArgumentError(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flashnpu",
        description="flashnpu: RTL model of a register-level, 3D-stacked NPU running FlashAttention.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ArgumentError as e:
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"flashnpu {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
