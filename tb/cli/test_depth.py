"""``flashnpu depth``: the floating-point units meet the per-stage gate-level
budget at the latency the design uses, the measurement sees the difference
pipelining makes, and bad input is rejected before Yosys runs."""

import json

from flashnpu.cli import main as cli_main
from flashnpu.hdl import fpu
from flashnpu.scripts import depth


def test_units_meet_the_budget_at_their_design_latency(tmp_path):
    out = tmp_path / "out"
    assert cli_main(["depth", "--units-only", "--out", str(out), "--build", str(tmp_path / "b")]) == 0
    rec = json.loads((out / "depth.json").read_text())
    rows = {(r["block"], r["latency"]): r for r in rec["units"]}
    assert {r["block"] for r in rec["units"]} == {c.__name__ for c in fpu.DESIGN_LATENCY}
    for cls, lat in fpu.DESIGN_LATENCY.items():
        r = rows[(cls.__name__, lat)]
        assert r["design"] and 0 < r["levels"] <= depth.TARGET_LEVELS, r
        if lat:
            # the combinational unit is over budget: the budget binds, and the
            # measurement sees what the registers take off
            assert rows[(cls.__name__, 0)]["levels"] > depth.TARGET_LEVELS >= r["levels"]
            assert r["flops"] > rows[(cls.__name__, 0)]["flops"]
    assert "| Fp16Mac | 5 | yes |" in (out / "depth.md").read_text()


def test_bad_size_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli_main(["depth", "--rows", "3", "--cols", "5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3" in err[0], err
    assert not (tmp_path / "depth.json").exists()
