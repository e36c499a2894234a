"""Windowed, scoped waveform capture, and the ``flashnpu waves`` reader.

A full dump of a long job is huge (Verilator VCD of the whole 8x8 core,
about 60 k signals: 90-150 KB per cycle), so a dump is a *window* of
simulated time over a *scope* of the hierarchy, chosen at run time::

    cocotb test --(plusargs)--> simulator --(window, scope, depth)--> FILE.vcd
                                                                         |
      flashnpu waves FILE --list / --signals --from --to / --at / --gtkw <-+

Capture (``WaveOptions``, used by ``sim/runner.py``)
----------------------------------------------------
One mechanism per simulator, because Verilator 5.048 parses ``$dumpvars``
but ignores its depth and scope arguments and ignores ``$dumpon`` /
``$dumpoff`` entirely (checked in the generated C++), while Icarus honours
them all:

* **Verilator**: the model is built with ``--trace`` (``--trace-fst`` for
  FST) and linked with cocotb's own ``verilator.cpp`` main loop, patched in
  three places (``VL_PATCHES``, applied by ``runner.build``): when ``+flashnpu_waves_file=`` is
  given, it opens the trace with ``dumpvars(depth, scope)`` filters for each
  scope, calls ``dump()`` only for time steps inside ``[start, end]`` and
  closes the file once time passes ``end``.  Window, depth *and* scope are
  run-time plusargs: one build serves every window.
* **Icarus**: a second root module ``flashnpu_waves``
  (:func:`icarus_hook`, built with ``-s flashnpu_waves`` like cocotb's own
  dump module) waits ``#start``, calls ``$dumpvars(depth, scopes...)``, waits
  until ``end`` and calls ``$dumpoff`` (Icarus then writes every signal as
  ``x`` at ``end``: the value *at* ``end`` is "not recorded").  Window and
  depth are run-time plusargs; the scopes are Verilog hierarchical names,
  so they are part of the (fast, 0.1 s) Icarus build.

Two Verilator limits, measured on the 8x8 core: a ``--hierarchical`` build
traces only the top model (``hier_block`` modules such as the core's PE rows
come out as empty scopes; the runner warns), so build flat or use Icarus to
see inside them; and the scope filter only decides what is *written* -- the
trace code still checks every traced signal at every dumped time step, so a
narrow scope shrinks the file far more than the run time.

The window resolves to whole simulation time steps: the dump starts at the
first time step at or after ``start`` (with every signal's value) and stops
at the last one at or before ``end``.  ``unit="cycle"`` converts cycles to
time with ``clock_period_ns`` from time 0 (the project's benches start
their clock at time 0).  Depth follows ``$dumpvars``: 1 = the scope's own
signals, 2 = also its children, 0 = everything below.

Format: VCD by default (nothing extra needed).  FST (``.fst``, 10-15x
smaller) works in Icarus as is; Verilator needs the lz4 headers
(``apt-get install liblz4-dev``).  ``flashnpu waves`` reads VCD only
(vcdvcd); open FST in GTKWave.

Reading (``flashnpu waves FILE``)
---------------------------------
vcdvcd parses the whole file in Python (loading everything: about 0.5 s for
8 MB, 4 s and 0.5 GB for 86 MB): fine for windowed dumps, which is what
capture makes.  ``--list`` and ``--gtkw`` parse only the header (2.6 s for
the 60 k-signal header of the 8x8 core); value queries store only the chosen
signals and stop parsing after ``--to``/``--at`` (a 282 MB dump: 4.5 s near
its start, 26 s at its end, 65 MB of memory either way).  Names are matched
exactly, without the bit range, or by a dotted suffix (``mid.x`` matches
``top.mid.x[7:0]``); ``*``/``?`` are wildcards.  Times take a unit suffix
(``ps``, ``ns``, ``us``; default ns), or ``c`` for cycles with ``--period``.  Signals whose name starts with ``$``
are the generator's intermediates; ``--all`` shows them.

pywellen (a Rust reader of VCD and FST) was tried as a replacement: on a
synthetic 84 MB VCD (5,125 signals) a value query took 0.6 s against
vcdvcd's 2.3 s, and it reads FST.  But it merges one-bit wires whose names look like bits (``vis[0]`` ..
``vis[15]``, which Yosys writes beside the vector ``vis[15:0]``; the 32x32
NPU has 2,048 of them) into vectors with misleading names and ranges, so a
query could show the wrong bits under a plausible name: the reader stays
vcdvcd, and FST files open in GTKWave.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import fnmatch
import math
import re
import signal
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from flashnpu.argtypes import float_in, nonneg_int, positive_float
from flashnpu.errors import UsageError
from flashnpu.paths import output_file, write_text

__all__ = ["WaveOptions", "hierarchy_scopes", "check_scopes", "icarus_hook", "VL_PATCHES",
           "fst_supported", "add_window_arguments", "options_from_args", "Waves", "write_gtkw",
           "DEFAULT_GROUPS", "register"]

PS_PER_NS = 1000          # the runner builds every model with timescale 1ns/1ps
HOOK_MODULE = "flashnpu_waves"
_FOREVER = (1 << 63) - 1


# =========================================================================
# capture
# =========================================================================

@dataclass(frozen=True)
class WaveOptions:
    """What to dump: a file, a time window and a hierarchy scope.

    Parameters
    ----------
    path : str or Path
        Output file; ``.vcd`` (default format) or ``.fst``.  Made absolute
        (relative to the current directory) because cocotb runs elsewhere.
    start, end : int or float or None
        Window, in ``unit``; ``None`` = from time 0 / to the end of the run.
    depth : int
        ``$dumpvars`` depth below each scope: 0 = all levels, 1 = the scope's
        own signals only, 2 = plus its children, ...
    scope : str or sequence of str
        Instance paths to dump, relative to the top (``"core.ctrl"``) or
        starting with the top's name; empty = the whole design.
    unit : 'ns' or 'cycle'
    clock_period_ns : float
        Needed for ``unit='cycle'``: cycle k starts at k * period.

    Raises
    ------
    ValueError
        A negative, reversed or non-finite window, a negative depth, an
        unknown unit or format, ``unit='cycle'`` without a period.
    """

    path: str | Path
    start: float | None = None
    end: float | None = None
    depth: int = 0
    scope: str | tuple[str, ...] = ()
    unit: str = "ns"
    clock_period_ns: float | None = None

    def __post_init__(self):
        path = Path(self.path).expanduser().absolute()
        if path.suffix not in (".vcd", ".fst"):
            raise ValueError(f"waveform file must end in .vcd or .fst, not {str(self.path)!r}")
        object.__setattr__(self, "path", path)
        scope = (self.scope,) if isinstance(self.scope, str) else tuple(self.scope)
        for s in scope:
            if not isinstance(s, str) or not s.strip(". ") or " " in s:
                raise ValueError(f"bad scope {s!r}: use a dotted instance path such as 'core.ctrl'")
        object.__setattr__(self, "scope", tuple(s.strip(".") for s in scope))
        if self.unit not in ("ns", "cycle"):
            raise ValueError(f"window unit must be 'ns' or 'cycle', not {self.unit!r}")
        if self.unit == "cycle":
            p = self.clock_period_ns
            if p is None or not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
                raise ValueError(f"unit='cycle' needs a positive clock_period_ns, not {p!r}")
        for name in ("start", "end"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):
                raise ValueError(f"window {name} must be a non-negative number or None, not {v!r}")
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise ValueError(f"window end {self.end!r} must be after start {self.start!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 0:
            raise ValueError(f"depth must be an integer >= 0 (0 = all levels), not {self.depth!r}")

    @property
    def fmt(self) -> str:
        """'vcd' or 'fst', from the file suffix."""
        return self.path.suffix[1:]

    def _ps(self, v) -> int | None:
        if v is None:
            return None
        ns = v * self.clock_period_ns if self.unit == "cycle" else v
        return int(round(ns * PS_PER_NS))

    @property
    def start_ps(self) -> int:
        return self._ps(self.start) or 0

    @property
    def end_ps(self) -> int | None:
        return self._ps(self.end)

    def replace(self, **changes) -> "WaveOptions":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def full_scopes(self, toplevel: str) -> tuple[str, ...]:
        """Scopes as full dotted paths starting with ``toplevel``."""
        if not self.scope:
            return (toplevel,)
        return tuple(s if s == toplevel or s.startswith(toplevel + ".") else f"{toplevel}.{s}"
                     for s in self.scope)

    def build_key(self, sim: str) -> str:
        """What of these options shapes the build (the rest is run time)."""
        if sim == "verilator":
            return f"waves-verilator-{self.fmt}"
        return "waves-icarus-" + ",".join(self.scope)

    def plusargs(self, toplevel: str) -> list[str]:
        """Run-time plusargs read by the Verilator main / the Icarus hook."""
        args = [f"+flashnpu_waves_file={self.path}",
                f"+flashnpu_waves_start={self.start_ps}",
                f"+flashnpu_waves_end={self.end_ps if self.end_ps is not None else _FOREVER}",
                f"+flashnpu_waves_depth={self.depth}"]
        args += [f"+flashnpu_waves_scope={s}" for s in self.full_scopes(toplevel)]
        return args

    def describe(self) -> str:
        u = "cycles" if self.unit == "cycle" else "ns"
        win = f"{self.start or 0}..{'end' if self.end is None else self.end} {u}"
        return (f"{self.path} ({self.fmt}, window {win}, depth {self.depth or 'all'}, "
                f"scope {', '.join(self.scope) or 'all'})")


def fst_supported(sim: str) -> bool:
    """True when ``sim`` can write FST here (Verilator needs liblz4-dev)."""
    if sim == "icarus":
        return True
    return any(Path(d, "lz4.h").exists() for d in ("/usr/include", "/usr/local/include"))


# ---- hierarchy of the generated Verilog ---------------------------------

_IDENT = r"(?:\\\S+|[A-Za-z_][\w$]*)"
_MODULE_RE = re.compile(rf"^\s*module\s+({_IDENT})", re.M)
_INST_RE = re.compile(rf"^\s*({_IDENT})\s*(?:#\s*\((?:[^()]|\([^()]*\))*\)\s*)?({_IDENT})\s*\(", re.M)


def _unescape(name: str) -> str:
    return name[1:] if name.startswith("\\") else name


def hierarchy_scopes(verilog_text: str, toplevel: str) -> list[str]:
    """All instance paths (``top``, ``top.core``, ...) of ``toplevel`` in
    ``verilog_text`` (parsed from module declarations and instantiations)."""
    bodies: dict[str, str] = {}
    starts = [(m.start(), _unescape(m.group(1))) for m in _MODULE_RE.finditer(verilog_text)]
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(verilog_text)
        bodies[name] = verilog_text[pos:end]
    children: dict[str, list[tuple[str, str]]] = {}
    for name, body in bodies.items():
        body = body[body.find(";") + 1:]          # skip the port list
        children[name] = [(_unescape(m.group(1)), _unescape(m.group(2)))
                          for m in _INST_RE.finditer(body) if _unescape(m.group(1)) in bodies]
    out, stack = [], [(toplevel, toplevel)]
    while stack:
        path, mod = stack.pop()
        out.append(path)
        for cmod, inst in reversed(children.get(mod, [])):
            stack.append((f"{path}.{inst}", cmod))
    return out


def check_scopes(opts: WaveOptions, verilog_text: str, toplevel: str) -> None:
    """Raise ValueError naming a scope that is not an instance path."""
    known = set(hierarchy_scopes(verilog_text, toplevel))
    for s in opts.full_scopes(toplevel):
        if s not in known:
            near = difflib.get_close_matches(s, sorted(known), n=3)
            raise ValueError(f"scope {s!r} is not an instance of {toplevel}"
                             + (f"; did you mean {', '.join(map(repr, near))}?" if near else ""))


# ---- Icarus: a second root module ---------------------------------------

def _vlog_path(path: str) -> str:
    return ".".join(p if re.fullmatch(r"[A-Za-z_][\w$]*", p) else f"\\{p} " for p in path.split("."))


def icarus_hook(opts: WaveOptions, toplevel: str) -> str:
    """Verilog of the ``flashnpu_waves`` root module for Icarus.

    Dumps nothing unless ``+flashnpu_waves_file=`` is given; window and
    depth are plusargs, the scopes are compiled in.
    """
    scopes = ", ".join(_vlog_path(s) for s in opts.full_scopes(toplevel))
    return f"""
// flashnpu waves hook (sim/waves.py): windowed, scoped $dumpvars for Icarus.
`timescale 1ps/1ps
module {HOOK_MODULE};
  string file;
  longint start_ps, end_ps;
  integer depth;
  initial begin
    if ($value$plusargs("flashnpu_waves_file=%s", file)) begin
      if (!$value$plusargs("flashnpu_waves_start=%d", start_ps)) start_ps = 0;
      if (!$value$plusargs("flashnpu_waves_end=%d", end_ps)) end_ps = 64'h{_FOREVER:x};
      if (!$value$plusargs("flashnpu_waves_depth=%d", depth)) depth = 0;
      $dumpfile(file);
      #(start_ps);
      $dumpvars(depth, {scopes});
      if (end_ps != 64'h{_FOREVER:x}) begin
        #(end_ps - start_ps);
        $dumpoff;
        $dumpflush;
      end
    end
  end
endmodule
"""


# ---- Verilator: cocotb's main, patched ----------------------------------

_VL_HELPERS = r"""
// ---- flashnpu waves (sim/waves.py): windowed, scoped tracing ----------
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
static const char *fw_file = nullptr;
static uint64_t fw_start = 0, fw_end = ~0ULL;
static int fw_depth = 0;
static std::vector<std::string> fw_scopes;
static bool fw_closed = false;
static bool fw_setup(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strncmp(a, "+flashnpu_waves_file=", 21)) fw_file = a + 21;
        else if (!strncmp(a, "+flashnpu_waves_start=", 22)) fw_start = strtoull(a + 22, nullptr, 10);
        else if (!strncmp(a, "+flashnpu_waves_end=", 20)) fw_end = strtoull(a + 20, nullptr, 10);
        else if (!strncmp(a, "+flashnpu_waves_depth=", 22)) fw_depth = atoi(a + 22);
        else if (!strncmp(a, "+flashnpu_waves_scope=", 22)) fw_scopes.push_back(a + 22);
    }
    return fw_file != nullptr;
}
static void fw_filter(verilated_trace_t *t) {
    // $dumpvars semantics: depth 1 = the scope's own signals; 0 = all levels
    for (const auto &s : fw_scopes) t->dumpvars(fw_depth ? fw_depth : 1 << 20, s);
}
static bool fw_in_window(verilated_trace_t *t, uint64_t now) {
    if (!fw_file) return true;
    if (fw_closed || now < fw_start) return false;
    if (now > fw_end) { t->close(); fw_closed = true; return false; }
    return true;
}
// ------------------------------------------------------------------------
"""

#: Where cocotb's Verilator main is patched for windowed, scoped tracing
#: (applied by ``runner.build`` with its other patches).
VL_PATCHES = [
    ("static verilated_trace_t *tfp;\n", "static verilated_trace_t *tfp;\n" + _VL_HELPERS),
    ("    if (traceOn) {\n        tfp = new verilated_trace_t;\n        top->trace(tfp, 99);\n"
     "        tfp->open(traceFile);\n",
     "    if (fw_setup(argc, argv) || traceOn) {\n        tfp = new verilated_trace_t;\n"
     "        top->trace(tfp, 99);\n        fw_filter(tfp);\n"
     "        tfp->open(fw_file ? fw_file : traceFile);\n"),
    ("        if (tfp) {\n            tfp->dump(main_time);\n",
     "        if (tfp && fw_in_window(tfp, main_time)) {\n            tfp->dump(main_time);\n"),
]


# ---- command-line knobs for simulation commands -------------------------

def add_window_arguments(parser) -> None:
    """Add ``--waves-from/--waves-to`` (cycles), ``--waves-depth`` and
    ``--waves-scope`` to a simulation command that has ``--waves FILE``."""
    parser.add_argument("--waves-from", type=float_in(0.0), metavar="CYCLE",
                        help="first clock cycle to dump (default 0)")
    parser.add_argument("--waves-to", type=float_in(0.0), metavar="CYCLE",
                        help="last clock cycle to dump (default: the end of the run)")
    parser.add_argument("--waves-depth", type=nonneg_int, default=0, metavar="N",
                        help="hierarchy levels below each scope (0 = all, 1 = the scope only)")
    parser.add_argument("--waves-scope", metavar="A,B,...", default="",
                        help="instance paths to dump, e.g. core.ctrl,core.array.row0 "
                             "(default: everything)")


def options_from_args(args, clock_period_ns: float) -> WaveOptions | None:
    """``WaveOptions`` from ``--waves FILE`` and the window arguments, or
    None without ``--waves``; a bad value raises ``flashnpu.errors.UsageError``."""
    if not getattr(args, "waves", None):
        return None
    try:
        return WaveOptions(args.waves, start=getattr(args, "waves_from", None),
                           end=getattr(args, "waves_to", None),
                           depth=getattr(args, "waves_depth", 0) or 0,
                           scope=_split(getattr(args, "waves_scope", "")),
                           unit="cycle", clock_period_ns=clock_period_ns)
    except ValueError as e:
        raise UsageError(f"--waves: {e}") from None


# =========================================================================
# reading
# =========================================================================

class WavesError(Exception):
    """Bad waveform file or query (reported as one line, exit 2)."""


_TIME_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*(fs|ps|ns|us|ms|s|c)?\s*$")
_UNIT_S = {"fs": 1e-15, "ps": 1e-12, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_RANGE_RE = re.compile(r"\[\d+(?::\d+)?\]$")
_REAL_TYPES = ("real", "realtime", "shortreal")


def _base(name: str) -> str:
    """Signal name without its bit range and with Icarus' escapes removed."""
    return _RANGE_RE.sub("", name).replace("\\", "")


def _glob(pattern: str) -> str:
    """A user pattern as an fnmatch pattern: only ``*`` and ``?`` are
    wildcards, a ``[`` is itself (signal names hold brackets)."""
    return pattern.replace("[", "[[]")


def _internal(name: str) -> bool:
    """A generator intermediate (``$1``, ``$auto$...``; their names may hold
    dots) or Verilator's ``$rootio`` copy of the top ports."""
    return re.search(r"(?:^|\.)\\?\$", name) is not None


def _import_vcdvcd():
    """vcdvcd, imported without its side effect: its import sets SIGPIPE to
    the default action process-wide, after which a write to a closed pipe
    kills the process instead of raising (e.g. a simulator session's
    request FIFO when the simulator has died).  The handler is put back."""
    # deferred: only reading a waveform needs vcdvcd (keeps `flashnpu --help` fast)
    before = signal.getsignal(signal.SIGPIPE)
    try:
        import vcdvcd
    finally:
        if before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGPIPE, before)
    return vcdvcd


class Waves:
    """A VCD file read with vcdvcd.

    Parameters
    ----------
    path : file name
    signals : names (as listed) whose values to load; None = header only
    to_time : stop parsing after this time (file units)
    """

    def __init__(self, path, signals: list[str] | None = None, to_time: int | None = None):
        vcdvcd = _import_vcdvcd()
        self.path = Path(path)
        if not self.path.is_file():
            raise WavesError(f"no such waveform file: {path}")
        if self.path.suffix == ".fst":
            raise WavesError(f"{path} is FST, which vcdvcd cannot read: open it in GTKWave, "
                             "or dump .vcd")
        try:
            if signals is None:
                self.vcd = vcdvcd.VCDVCD(str(self.path), only_sigs=True)
            else:
                self.vcd = vcdvcd.VCDVCD(str(self.path), signals=list(signals), to_time=to_time)
        except Exception as e:          # vcdvcd raises bare errors on malformed files
            raise WavesError(f"cannot read {path} as VCD: {type(e).__name__}: {e}") from None
        if not self.vcd.timescale:
            raise WavesError(f"{path} has no $timescale: not a VCD file?")
        self.unit_s = float(self.vcd.timescale["timescale"])

    @property
    def names(self) -> list[str]:
        return list(self.vcd.signals)

    def width(self, name: str) -> int:
        return int(self.vcd.data[self.vcd.references_to_ids[name]].size)

    def is_real(self, name: str) -> bool:
        """A ``real`` variable: its values are decimal numbers, not bits."""
        return self.vcd.data[self.vcd.references_to_ids[name]].var_type in _REAL_TYPES

    # ---- times
    def parse_time(self, text: str, period_ns: float | None = None) -> int:
        """'120', '120ns', '3.5us', or '60c' (cycles, with ``period_ns``)
        -> file time units."""
        m = _TIME_RE.match(str(text))
        if not m or (m.group(2) == "c" and not period_ns):
            raise WavesError(f"bad time {text!r}: use a number with an optional unit "
                             "(ps, ns, us; c = cycles with --period), default ns")
        if m.group(2) == "c":
            sec = float(m.group(1)) * period_ns * 1e-9
        else:
            sec = float(m.group(1)) * _UNIT_S[m.group(2) or "ns"]
        t = sec / self.unit_s
        if not math.isfinite(t) or t > _FOREVER:
            raise WavesError(f"bad time {text!r}: past the largest VCD time "
                             f"({self.fmt_time(_FOREVER)} ns in {self.path.name})")
        return int(round(t))

    def fmt_time(self, t: int) -> str:
        return f"{t * self.unit_s / 1e-9:.12g}"

    # ---- names
    def resolve(self, query: str, include_internal: bool = True) -> list[str]:
        """Listed names matching ``query`` (exact, without range, dotted
        suffix, or wildcard pattern); [] when none."""
        names = self.names
        if query in names:
            return [query]
        q = query.replace("\\", "")
        if any(c in q for c in "*?"):
            pats = [_glob(q.lower()), "*." + _glob(q.lower())]   # anchored, or a dotted suffix
            hits = [n for n in names if any(fnmatch.fnmatchcase(_base(n).lower(), p)
                                            or fnmatch.fnmatchcase(n.replace("\\", "").lower(), p)
                                            for p in pats)]
        else:
            # the query as given first (``acc[3]`` is an element of an array
            # of vectors, listed as ``acc[3][31:0]``), then without a bit range
            hits = []
            for qb in dict.fromkeys([q, _base(q)]):
                hits = [n for n in names if _base(n) == qb or n.replace("\\", "") == qb]
                if not hits:
                    hits = [n for n in names if _base(n).endswith("." + qb)
                            or n.replace("\\", "").endswith("." + qb)]
                if hits:
                    break
        if not include_internal:
            hits = [n for n in hits if not _internal(n)]
        return hits

    def resolve_one(self, query: str) -> str:
        hits = self.resolve(query)
        if not hits:
            near = difflib.get_close_matches(query, [_base(n) for n in self.names], n=3)
            raise WavesError(f"unknown signal {query!r} in {self.path}"
                             + (f"; did you mean {', '.join(near)}?" if near else
                                " (try --list)"))
        if len(hits) > 1:
            # aliases of one net (a port seen from both sides) are one signal
            ids = {self.vcd.references_to_ids[h] for h in hits}
            if len(ids) > 1:
                raise WavesError(f"signal {query!r} is ambiguous: "
                                 + ", ".join(hits[:5]) + (" ..." if len(hits) > 5 else ""))
        return hits[0]

    # ---- values
    def tv(self, name: str) -> list[tuple[int, str]]:
        return self.vcd.data[self.vcd.references_to_ids[name]].tv

    def value_at(self, name: str, t: int) -> str | None:
        """Binary value string at time t (None before the first record)."""
        tv = self.tv(name)
        i = bisect.bisect_right(tv, (t, "\uffff")) - 1
        return tv[i][1] if i >= 0 else None

    def change_times(self, names: list[str], t0: int, t1: int) -> list[int]:
        times = {t0}
        for n in names:
            times.update(t for t, _ in self.tv(n) if t0 <= t <= t1)
        return sorted(times)


# ---- value formatting ----------------------------------------------------

def _hex(bits: str | None, width: int) -> str:
    if bits is None:
        return "-"
    bits = bits.lower()
    if set(bits) <= {"x"} or set(bits) <= {"z"}:
        return bits[0]
    bits = bits.rjust(width, bits[0] if bits[0] in "xz" else "0")
    if width == 1:
        return bits
    bits = bits.rjust((width + 3) // 4 * 4, "0")
    out = []
    for i in range(0, len(bits), 4):
        nib = bits[i:i + 4]
        out.append(format(int(nib, 2), "x") if set(nib) <= {"0", "1"} else
                   ("x" if "x" in nib else "z"))
    return "".join(out)


def _real(value: str | None) -> str:
    """A ``real`` variable's value (VCD ``r<number>``) as a number."""
    if value is None:
        return "-"
    try:
        return repr(float(value))
    except ValueError:
        return value


def _lanes(bits: str | None, width: int, lane: int) -> list[int] | None:
    if bits is None or not set(bits.lower()) <= {"0", "1"}:
        return None
    v = int(bits, 2)
    n = max(1, width // lane)
    return [(v >> (lane * i)) & ((1 << lane) - 1) for i in range(n)]


def fp32(word: int) -> float:
    return struct.unpack("<f", struct.pack("<I", word & 0xFFFFFFFF))[0]


def fp16(word: int) -> float:
    return struct.unpack("<e", struct.pack("<H", word & 0xFFFF))[0]


def _fp_text(bits: str | None, width: int, kind: str) -> str:
    lane, dec = (32, fp32) if kind == "fp32" else (16, fp16)
    words = _lanes(bits, width, lane)
    if words is None:
        return _hex(bits, width)
    # deferred: numpy only for FP lanes (keeps `flashnpu --help` fast); its
    # str() is the shortest text that reads back to the same FP32/FP16 value
    import numpy as np
    kind_np = np.float32 if kind == "fp32" else np.float16
    vals = [str(kind_np(dec(w))) for w in words]
    return vals[0] if len(vals) == 1 else "[" + " ".join(vals) + "]"   # lane 0 first (LSBs)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    right = header[0].startswith("time")
    line = lambda r: "  ".join(c.rjust(w) if i == 0 and right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


# ---- GTKWave save file ---------------------------------------------------

#: Default signal groups of the GTKWave save file: name -> name patterns
#: (fnmatch, case-insensitive, on the dotted name without bit range).
#: ``{row}`` is replaced by the lowest PE row found in the hierarchy.
DEFAULT_GROUPS: dict[str, list[str]] = {
    "Controller": ["*ctrl*", "*seq*", "*phase*", "*fsm*"],
    "DMA": ["*dma*"],
    "PE row {row}": ["*pe_{row}_*", "*pe{row}_*", "*row{row}.*", "*row_{row}.*", "*rows.{row}.*"],
    "Reduction": ["*tree*", "*reduce*", "*reduction*"],
}

_PE_ROW_RE = re.compile(r"(?:^|\.)(?:pe_?(\d+)_\d+|row_?(\d+))(?:\.|$)", re.I)


def discover_pe_row(names: list[str]) -> int | None:
    """Lowest PE row index seen in scope names (``pe_R_C`` or ``rowR``)."""
    rows = []
    for n in names:
        for m in _PE_ROW_RE.finditer(_base(n)):
            rows.append(int(m.group(1) or m.group(2)))
    return min(rows) if rows else None


def group_signals(names: list[str], groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """name -> matching signals, internals excluded, each signal in the
    first group that matches."""
    row = discover_pe_row(names)
    out: dict[str, list[str]] = {}
    taken = set()
    for gname, pats in groups.items():
        if "{row}" in gname or any("{row}" in p for p in pats):
            if row is None:
                continue
            gname = gname.replace("{row}", str(row))
            pats = [p.replace("{row}", str(row)) for p in pats]
        pats = [p.lower() for p in pats]
        hits = [n for n in names if n not in taken and not _internal(n)
                and any(fnmatch.fnmatchcase(_base(n).lower(), p) for p in pats)]
        taken.update(hits)
        out[gname] = hits
    return out


def _alias(name: str) -> str:
    parts = _base(name).split(".")
    return ".".join(parts[1:]) if len(parts) > 1 else parts[0]


def write_gtkw(waves: Waves, out: Path, groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """Write a GTKWave save file with one collapsible group per block;
    returns the groups written (name -> signals)."""
    grouped = group_signals(waves.names, groups)
    lines = [f'[dumpfile] "{waves.path.resolve()}"', "[timestart] 0", "[size] 1600 900",
             "[sst_expanded] 1", "[signals_width] 320"]
    for gname, sigs in grouped.items():
        if not sigs:
            continue
        lines += ["@800200", f"-{gname}"]            # group begin (TR_GROUP_BEGIN|TR_BLANK)
        for s in sigs:
            w = waves.width(s)
            lines.append("@28" if w == 1 else "@22")  # binary / hex, right-justified
            lines.append(f"+{{{_alias(s)}}} {s.replace(chr(92), '')}")
        lines += ["@1000200", f"-{gname}"]           # group end
    write_text(out, "\n".join(lines) + "\n")
    return grouped


# ---- the command ---------------------------------------------------------

def _split(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def _parse_groups(specs: list[str] | None) -> dict[str, list[str]]:
    groups = dict(DEFAULT_GROUPS)
    for spec in specs or []:
        name, eq, pats = spec.partition("=")
        if not eq or not name.strip() or not _split(pats):
            raise UsageError(f"bad --group {spec!r}: use NAME=PATTERN[,PATTERN...]")
        groups[name.strip()] = _split(pats)
    return groups


def _run(args) -> int:
    try:
        return _run_inner(args)
    except WavesError as e:
        raise UsageError(str(e)) from None


def _run_inner(args) -> int:
    query = args.signals is not None or args.at is not None
    if args.at is not None and (args.start is not None or args.stop is not None):
        raise UsageError("--at cannot be combined with --from/--to")
    if (args.start is not None or args.stop is not None) and args.signals is None:
        raise UsageError("--from/--to need --signals")
    if args.gtkw is not None:
        output_file(args.gtkw, "--gtkw", suffixes=(".gtkw", ".sav"), inputs=[("waveform", args.file)])
    head = Waves(args.file)                       # header only: names, widths, timescale
    out = sys.stdout

    if args.list is not None or not (query or args.gtkw):
        pat = args.list or "*"
        names = head.resolve(pat if any(c in pat for c in "*?") else f"*{pat}*",
                             include_internal=args.all)     # brackets are plain characters
        rows = [[n.replace("\\", ""), str(head.width(n))] for n in names]
        print(_table(["signal", "width"], rows) if rows else f"no signal matches {pat!r}", file=out)
        if args.list is None:
            print(f"{len(rows)} signals ({'with' if args.all else 'without'} generator "
                  f"intermediates); timescale {head.vcd.timescale['magnitude']}"
                  f"{head.vcd.timescale['unit']}", file=out)

    if args.gtkw:
        grouped = write_gtkw(head, Path(args.gtkw), _parse_groups(args.group))
        summary = ", ".join(f"{g} ({len(s)})" for g, s in grouped.items())
        print(f"wrote {args.gtkw}: groups {summary}", file=out)

    if query:
        wanted = _split(args.signals)
        if not wanted:
            raise UsageError("--signals needs at least one name")
        names = []
        for q in wanted:                # a wildcard selects every match, a name one signal
            if any(c in q for c in "*?"):
                hits = head.resolve(q, include_internal=args.all)
                if not hits:
                    raise UsageError(f"no signal matches {q!r} in {args.file}")
            else:
                hits = [head.resolve_one(q)]
            names += [n for n in hits if n not in names]
        fp = {}
        for kind in ("fp32", "fp16"):
            for q in _split(getattr(args, kind)):
                hits = [n for n in names if n in head.resolve(q)]
                if not hits:
                    raise UsageError(f"--{kind} {q!r} is not one of the --signals")
                for n in hits:
                    if head.is_real(n):
                        raise UsageError(f"--{kind} {q!r}: {n} is a real variable, printed as a number already")
                for n in hits:
                    fp[n] = kind
        if args.period is not None and not args.period > 0:
            raise UsageError(f"--period must be positive, not {args.period!r}")
        pt = lambda text: head.parse_time(text, args.period)
        if args.at is not None:
            t0 = t1 = pt(args.at)
        else:
            t0 = pt(args.start) if args.start is not None else 0
            t1 = pt(args.stop) if args.stop is not None else None
            if t1 is not None and t1 < t0:
                raise UsageError(f"--to {args.stop!r} is before --from {args.start!r}")
        w = Waves(args.file, signals=sorted(set(names)), to_time=t1)
        if t1 is None:
            t1 = w.vcd.endtime
        times = [t0] if args.at is not None else w.change_times(names, t0, t1)
        header = (["time_ns"] + (["cycle"] if args.period else [])
                  + [_alias(n) + (f" ({fp[n]})" if n in fp else "") for n in names])
        rows = []
        for t in times:
            row = [w.fmt_time(t)]
            if args.period:
                row.append(f"{t * w.unit_s / 1e-9 / args.period:.12g}")
            for n in names:
                bits, width = w.value_at(n, t), w.width(n)
                row.append(_real(bits) if w.is_real(n) else
                           _fp_text(bits, width, fp[n]) if n in fp else _hex(bits, width))
            rows.append(row)
        print(_table(header, rows), file=out)
    return 0


def register(subparsers) -> None:
    """Add ``flashnpu waves`` to the CLI."""
    p = subparsers.add_parser(
        "waves", help="list, query and group the signals of a VCD waveform",
        description="Read a VCD dump (e.g. of `make sim WAVES=1`): list signals, print values "
                    "over a time range or at one time (hex, FP32/FP16 decoding), write a "
                    "GTKWave save file grouping controller, DMA, one PE row and the reduction "
                    "network. Times are in ns unless suffixed (ps, ns, us). Without an action, "
                    "lists every signal.")
    p.add_argument("file", help="VCD file")
    p.add_argument("--list", nargs="?", const="*", metavar="PATTERN",
                   help="list signals (name, width) matching PATTERN (wildcards, or a substring)")
    p.add_argument("--all", action="store_true",
                   help="include the generator's intermediate signals (names starting with $)")
    p.add_argument("--signals", metavar="A,B,...",
                   help="signals to print (full name, name without range, dotted suffix, wildcard)")
    p.add_argument("--from", dest="start", metavar="T0", help="start of the time range")
    p.add_argument("--to", dest="stop", metavar="T1", help="end of the time range")
    p.add_argument("--at", metavar="T", help="print the values at one time")
    p.add_argument("--period", type=positive_float, metavar="NS",
                   help="clock period: adds a cycle column (time / period) and allows times "
                        "such as 120c (cycles)")
    p.add_argument("--fp32", metavar="A,B,...",
                   help="decode these --signals as FP32 (32-bit lanes, lane 0 = LSBs)")
    p.add_argument("--fp16", metavar="A,B,...",
                   help="decode these --signals as FP16 (16-bit lanes, lane 0 = LSBs)")
    p.add_argument("--gtkw", metavar="OUT.gtkw", help="write a GTKWave save file with signal groups")
    p.add_argument("--group", action="append", metavar="NAME=PAT,...",
                   help="add or replace a --gtkw group (fnmatch patterns on dotted names; "
                        "'{row}' = lowest PE row found); defaults: "
                        + "; ".join(f"{k}={','.join(v)}" for k, v in DEFAULT_GROUPS.items()))
    p.set_defaults(func=_run)
