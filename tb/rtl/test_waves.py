"""Windowed, scoped waveform capture (``sim/runner.py`` + ``sim/waves.py``)
and the ``flashnpu waves`` reader, on a small hierarchical design under
every installed simulator.

The design mimics the NPU's hierarchy names (ctrl, dma, pe_R_C, tree) so the
GTKWave groups can be checked, has a three-level chain top -> mid -> leaf
for depth, and registers an FP32 input so decoding can be checked against
the values the bench drove.
"""

import argparse
import json

import pytest
from amaranth import Cat, Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from flashnpu import cli
from flashnpu.sim import runner
from flashnpu.sim.waves import WaveOptions, Waves, add_window_arguments, fp16, fp32, options_from_args
from flashnpu.tb.rtl.cocotb_waves import f2u, fp_ramp

TOP = "waves_top"
PERIOD = 10                     # ns; the bench's first rising edge is at time 0
PS = PERIOD * 1000


class Leaf(wiring.Component):
    x: In(8)
    y: Out(8)

    def elaborate(self, platform):
        m = Module()
        deep = Signal(8)
        m.d.comb += deep.eq(self.x ^ 0x5A)
        m.d.sync += self.y.eq(deep)
        return m


class Mid(wiring.Component):
    x: In(8)
    y: Out(8)

    def elaborate(self, platform):
        m = Module()
        m.submodules.leaf = leaf = Leaf()
        midreg = Signal(8)
        m.d.sync += midreg.eq(self.x + 1)
        m.d.comb += [leaf.x.eq(midreg), self.y.eq(leaf.y)]
        return m


class Acc(wiring.Component):
    """A PE, the DMA address counter and the controller's phase: x += step."""
    en: In(1)
    acc: Out(16)

    def __init__(self, step):
        self.step = step
        super().__init__()

    def elaborate(self, platform):
        m = Module()
        with m.If(self.en):
            m.d.sync += self.acc.eq(self.acc + self.step)
        return m


class Tree(wiring.Component):
    a: In(16)
    b: In(16)
    total: Out(17)

    def elaborate(self, platform):
        m = Module()
        m.d.comb += self.total.eq(self.a + self.b)
        return m


class WaveTop(wiring.Component):
    en: In(1)
    fp_in: In(32)
    count: Out(16)
    out: Out(8)
    lanes: Out(64)

    def elaborate(self, platform):
        m = Module()
        m.submodules.mid = mid = Mid()
        m.submodules.ctrl = ctrl = Acc(1)
        m.submodules.dma = dma = Acc(4)
        pes = {}
        for r in range(2):
            for c in range(2):
                pes[r, c] = m.submodules[f"pe_{r}_{c}"] = Acc(1 + r * 2 + c)
                m.d.comb += pes[r, c].en.eq(self.en)
        m.submodules.tree = tree = Tree()
        fp_reg = Signal(32)
        m.d.sync += fp_reg.eq(self.fp_in)
        with m.If(self.en):
            m.d.sync += self.count.eq(self.count + 1)
        m.d.comb += [mid.x.eq(self.count[:8]), self.out.eq(mid.y),
                     ctrl.en.eq(self.en), dma.en.eq(self.en),
                     tree.a.eq(pes[0, 0].acc), tree.b.eq(pes[0, 1].acc),
                     self.lanes.eq(Cat(fp_reg, fp_reg ^ 0x8000_0000))]
        return m


SIMS = [s for s in ("verilator", "icarus") if runner.have_simulator(s)]


def _run(handle, opts, tmp_path, tag):
    samples = tmp_path / f"{tag}.json"
    runner.run_cocotb(handle, "flashnpu.tb.rtl.cocotb_waves", waves=opts,
                      extra_env={"WAVES_PERIOD_NS": PERIOD, "WAVES_SAMPLES": samples},
                      test_dir=tmp_path / f"run-{tag}")
    return json.loads(samples.read_text())


@pytest.fixture(scope="module", params=SIMS)
def dumps(request, tmp_path_factory):
    """Per simulator: a window of mid (depth 1), the whole design, and the top only."""
    sim = request.param
    d = tmp_path_factory.mktemp(f"waves-{sim}")
    window = WaveOptions(d / "window.vcd", start=10, end=20, unit="cycle", clock_period_ns=PERIOD,
                         scope="mid", depth=1)
    h = runner.build(WaveTop, None, TOP, sim=sim, waves=window)
    out = dict(sim=sim, window=window)
    out["samples"] = _run(h, window, d, "window")
    full = WaveOptions(d / "full.vcd")
    top1 = WaveOptions(d / "top1.vcd", depth=1, start=50, end=150)
    if sim == "icarus":                 # Icarus compiles the scope in: one build each
        _run(runner.build(WaveTop, None, TOP, sim=sim, waves=full), None, d, "full")
        _run(runner.build(WaveTop, None, TOP, sim=sim, waves=top1), None, d, "top1")
    else:                               # Verilator: scope, depth and window at run time
        _run(h, full, d, "full")
        _run(h, top1, d, "top1")
    out.update(full=full, top1=top1, dir=d)
    return out


def _at(w, name, t):
    return int(w.value_at(w.resolve_one(name), t), 2)


@pytest.mark.rtl
def test_window_and_scope_are_respected(dumps):
    w = Waves(dumps["window"].path, signals=None)
    names = [n.replace("\\", "") for n in w.names]
    assert names and all(n.startswith(f"{TOP}.mid.") for n in names), names
    assert not any(n.startswith(f"{TOP}.mid.leaf.") for n in names), names   # depth 1
    assert f"{TOP}.mid.midreg[7:0]" in names
    wv = Waves(dumps["window"].path, signals=w.names)
    assert (wv.vcd.begintime, wv.vcd.endtime) == (10 * PS, 20 * PS)


@pytest.mark.rtl
def test_window_values_match_the_design(dumps):
    s = dumps["samples"]
    count = [x["count"] for x in s]
    assert count[-1] - count[-2] == 1 and count[5] == 4      # counting after reset
    w = Waves(dumps["window"].path, signals=Waves(dumps["window"].path).names)
    for k in range(10, 20):                 # midreg holds count+1 of the cycle before
        assert _at(w, "mid.midreg", s[k]["t_ps"]) == (count[k - 1] + 1) & 0xFF, k


@pytest.mark.rtl
def test_depth_one_of_the_top_holds_only_top_signals(dumps):
    w = Waves(dumps["top1"].path)
    names = [n.replace("\\", "") for n in w.names]
    assert f"{TOP}.count[15:0]" in names
    subs = ("mid", "ctrl", "dma", "pe_0_0", "pe_0_1", "pe_1_0", "pe_1_1", "tree")
    deeper = [n for n in names if any(n.startswith(f"{TOP}.{i}.") for i in subs)]
    assert not deeper, deeper


@pytest.mark.rtl
def test_full_dump_values_match_the_bench(dumps):
    s = dumps["samples"]
    path = dumps["full"].path
    w = Waves(path, signals=Waves(path).names)
    assert w.vcd.begintime == 0
    for x in s[2:]:
        t = x["t_ps"]
        assert _at(w, "count", t) == x["count"]
        assert _at(w, f"{TOP}.out", t) == x["out"]
        assert _at(w, "leaf.deep", t) == _at(w, "mid.midreg", t) ^ 0x5A      # two levels down
        assert _at(w, "tree.total", t) == _at(w, "pe_0_0.acc", t) + _at(w, "pe_0_1.acc", t)


def _cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.rtl
def test_cli_lists_signals(dumps, capsys):
    rc, out, _ = _cli(capsys, "waves", dumps["full"].path, "--list", "pe_0_1")
    assert rc == 0
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [f"{TOP}.pe_0_1.acc[15:0]", "16"] in rows
    assert all("pe_0_1" in r[0] and not r[0].rsplit(".", 1)[1].startswith("$") for r in rows)
    rc, out, _ = _cli(capsys, "waves", dumps["window"].path)            # no action: list all
    assert rc == 0 and "midreg" in out and "count" not in out


@pytest.mark.rtl
def test_cli_at_and_range(dumps, capsys):
    s = dumps["samples"]
    x = s[30]
    rc, out, _ = _cli(capsys, "waves", dumps["full"].path, "--signals", "count,mid.midreg",
                      "--at", f"{x['t_ps']}ps")
    assert rc == 0
    row = out.splitlines()[2].split()
    assert float(row[0]) == x["t_ps"] / 1000
    assert int(row[1], 16) == x["count"] and int(row[2], 16) == (s[29]["count"] + 1) & 0xFF
    t0, t1 = s[20]["t_ps"], s[24]["t_ps"]
    rc, out, _ = _cli(capsys, "waves", dumps["full"].path, "--signals", "count",
                      "--from", t0 / 1000, "--to", f"{t1 / 1000}ns")
    rows = [r.split() for r in out.splitlines()[2:]]
    assert rc == 0 and float(rows[0][0]) == t0 / 1000
    assert [int(r[1], 16) for r in rows] == list(range(s[20]["count"], s[24]["count"] + 1))
    assert [float(r[0]) for r in rows[1:]] == [k * PERIOD for k in range(21, 25)]
    rc, out, _ = _cli(capsys, "waves", dumps["full"].path, "--signals", "pe_0_*.acc", "--at",
                      f"{x['t_ps']}ps")
    header = out.splitlines()[0].split()
    assert rc == 0 and header[1:] == ["pe_0_0.acc", "pe_0_1.acc"]
    rc, out, _ = _cli(capsys, "waves", dumps["full"].path, "--signals", "count", "--period",
                      PERIOD, "--at", "30.5c")
    assert rc == 0 and out.splitlines()[2].split() == ["305", "30.5", f"{x['count']:04x}"]


@pytest.mark.rtl
def test_cli_decodes_fp32(dumps, capsys):
    s = dumps["samples"]
    t = s[26]["t_ps"]                  # fp_reg holds what the bench drove in cycle 25
    rc, out, _ = _cli(capsys, "waves", dumps["full"].path, "--signals", "fp_reg,lanes",
                      "--fp32", "lanes,fp_reg", "--at", f"{t}ps")
    assert rc == 0
    header, _, row = out.splitlines()
    assert "(fp32)" in header
    v = fp_ramp(24 + 1)                 # 4.375: exact in FP32, printed shortest
    cells = row.split(None, 1)[1]
    assert cells.split()[0] == "4.375"
    assert "[4.375 -4.375]" in cells          # lane 0 = the LSBs, lane 1 negated
    rc, out, _ = _cli(capsys, "waves", dumps["full"].path, "--signals", "fp_reg", "--at",
                      f"{t}ps")
    assert int(out.splitlines()[2].split()[1], 16) == f2u(v) == 0x408C0000


def test_fp_decoders():
    assert fp32(0x3F800000) == 1.0 and fp32(0xC0A00000) == -5.0
    assert fp16(0x3C00) == 1.0 and fp16(0xC500) == -5.0


@pytest.mark.rtl
def test_cli_writes_gtkw_groups(dumps, capsys, tmp_path):
    out_file = tmp_path / "view.gtkw"
    rc, out, _ = _cli(capsys, "waves", dumps["full"].path, "--gtkw", out_file,
                      "--group", "Mid=*mid.leaf*")
    assert rc == 0, out
    groups, cur = {}, None
    lines = out_file.read_text().splitlines()
    assert lines[0] == f'[dumpfile] "{dumps["full"].path}"'
    for prev, line in zip(lines, lines[1:]):
        if prev == "@800200":
            cur = line[1:]
            groups[cur] = []
        elif prev == "@1000200":
            cur = None
        elif line.startswith("+{") and cur:
            alias, full = line[2:].split("} ")
            assert full.startswith(TOP + ".") and alias == full[len(TOP) + 1:].split("[")[0]
            groups[cur].append(full)
    assert set(groups) == {"Controller", "DMA", "PE row 0", "Reduction", "Mid"}
    prefixes = {"Controller": ".ctrl.", "DMA": ".dma.", "Reduction": ".tree.",
                "Mid": ".mid.leaf."}
    for g, p in prefixes.items():
        assert groups[g] and all(p in n for n in groups[g]), (g, groups[g])
    row0 = groups["PE row 0"]
    assert {n.split(".")[1] for n in row0} == {"pe_0_0", "pe_0_1"}
    assert f"{TOP}.pe_0_1.acc[15:0]" in row0
    assert not any("$" in n for g in groups.values() for n in g)


@pytest.mark.rtl
@pytest.mark.parametrize("argv, message", [
    (["missing.vcd", "--list"], "no such waveform file"),
    (["{full}", "--signals", "nonesuch"], "unknown signal 'nonesuch'"),
    (["{full}", "--signals", "count", "--at", "soon"], "bad time 'soon'"),
    (["{full}", "--signals", "count", "--fp32", "out"], "--fp32 'out' is not one of the --signals"),
    (["{full}", "--from", "5"], "--from/--to need --signals"),
    (["{fst}"], "FST"),
])
@pytest.mark.rtl
def test_cli_errors_exit_2(dumps, capsys, tmp_path, argv, message):
    fst = tmp_path / "x.fst"
    fst.write_bytes(b"\0")
    argv = [a.format(full=dumps["full"].path, fst=fst) for a in argv]
    rc, out, err = _cli(capsys, "waves", *argv)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("kwargs, message", [
    (dict(start=20, end=10), "window end 10"),
    (dict(start=-1), "window start must be"),
    (dict(end=float("nan")), "window end must be"),
    (dict(unit="cycle", start=3), "clock_period_ns"),
    (dict(unit="ms"), "'ms'"),
    (dict(depth=-2), "depth must be"),
    (dict(scope="a b"), "bad scope 'a b'"),
])
def test_bad_options_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WaveOptions("x.vcd", **kwargs)
    with pytest.raises(ValueError, match="x.txt"):
        WaveOptions("x.txt")


@pytest.mark.rtl
@pytest.mark.parametrize("sim", SIMS)
def test_unknown_scope_is_rejected(sim, tmp_path):
    with pytest.raises(ValueError, match=f"'{TOP}.mid.lef'.*did you mean '{TOP}.mid.leaf'"):
        runner.build(WaveTop, None, TOP, sim=sim, waves=WaveOptions(tmp_path / "x.vcd",
                                                                    scope="mid.lef"))


def test_run_time_override_needs_a_windowed_build(tmp_path):
    h = runner.BuildHandle(sim="verilator", toplevel=TOP, build_dir=tmp_path, verilog=tmp_path,
                           config_json="{}", waves=False)
    with pytest.raises(ValueError, match="not built for windowed waves"):
        runner.run_cocotb(h, "flashnpu.tb.rtl.cocotb_waves", waves=WaveOptions(tmp_path / "x.vcd"))


def test_simulation_knobs_make_options():
    p = argparse.ArgumentParser()
    p.add_argument("--waves")
    add_window_arguments(p)
    assert options_from_args(p.parse_args([]), 2.0) is None
    o = options_from_args(p.parse_args(["--waves", "w.vcd", "--waves-from", "100", "--waves-to",
                                        "150", "--waves-depth", "2", "--waves-scope",
                                        "core.ctrl,dma"]), 2.0)
    assert (o.start_ps, o.end_ps, o.depth, o.scope) == (200_000, 300_000, 2, ("core.ctrl", "dma"))
    with pytest.raises(cli.UsageError, match="--waves: window end 5"):
        options_from_args(p.parse_args(["--waves", "w.vcd", "--waves-from", "9",
                                        "--waves-to", "5"]), 2.0)


def test_reading_a_vcd_leaves_sigpipe_ignored(tmp_path):
    """vcdvcd's import sets SIGPIPE to its default action, after which a write
    to a dead simulator's FIFO kills the process instead of raising; reading a
    VCD puts the handler back (checked in a fresh interpreter, where the
    import really runs)."""
    import subprocess
    import sys
    f = tmp_path / "t.vcd"
    f.write_text("$timescale 1ns $end\n$scope module top $end\n$var wire 1 ! clk $end\n$upscope $end\n"
                 "$enddefinitions $end\n#0\n0!\n#1\n1!\n")
    code = ("import signal, sys; from flashnpu.sim.waves import Waves; w = Waves(sys.argv[1]); "
            "print(signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN, 'vcdvcd' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr
