"""``flashnpu sim``: the public file contract and the rejection of malformed input."""

import json
import subprocess
import sys

import numpy as np
import pytest

from flashnpu.cli import main
from flashnpu.golden import assert_bit_exact, flash_attention_hw
from flashnpu.sim.cli import array_config


def f16(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def write(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_round_trip_of_the_file_contract(tmp_path):
    q, k, v = f16(1, 4, 30, 64), f16(2, 2, 70, 64), f16(3, 2, 70, 64)
    mask = np.random.default_rng(4).random((4, 30, 70)) < 0.8
    inp = write(tmp_path / "case.npz", q=q, k=k, v=v, causal=np.bool_(True), mask=mask,
                kv_valid_len=np.int64(66), scale=np.float64(0.1))
    out = tmp_path / "result.npz"
    assert main(["sim", "--inputs", inp, "--out", str(out), "--backend", "golden"]) == 0
    with np.load(out) as z:
        o = z["o"]
        stats = json.loads(str(z["stats_json"]))
        assert o.dtype == np.float32 and o.shape == (4, 30, 64)
        assert int(z["tile_pairs"]) == stats["tile_pairs"] == 4 * 1 * 2
    want = flash_attention_hw(q, k, v, causal=True, mask=mask, kv_valid_len=66, scale=0.1).o
    assert_bit_exact(o, want, "o")
    assert stats["passed"] is True


def test_random_case_summary_and_json(capsys):
    assert main(["sim", "--heads", "2", "--seq-q", "64", "--head-dim", "32", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["passed"] and s["shape"] == dict(heads=2, kv_heads=2, seq_q=64, seq_kv=64, head_dim=32)
    assert s["checks"]["reference"]["max_rel_err"] < 1e-3


def _bad_cases():
    q, k, v = f16(5, 2, 8, 16), f16(6, 1, 8, 16), f16(7, 1, 8, 16)
    qn = q.copy()
    qn[1, 3, 2] = np.nan
    kn = k.copy()
    kn[0, 7, 0] = np.nan
    return {
        "missing array": (dict(q=q, k=k), "has no array 'v'"),
        "wrong dtype": (dict(q=q.astype(np.float32), k=k, v=v), "q must be float16, not float32"),
        "shape mismatch": (dict(q=q, k=k, v=v[:, :5]), "v shape (1, 5, 16) differs from k shape (1, 8, 16)"),
        "heads not multiple": (dict(q=f16(8, 3, 8, 16), k=f16(9, 2, 8, 16), v=f16(9, 2, 8, 16)),
                               "heads=3 is not a multiple of kv_heads=2"),
        "head_dim too large": (dict(q=f16(1, 1, 4, 136), k=f16(1, 1, 4, 136), v=f16(1, 1, 4, 136)),
                               "head_dim=136 is above the hardware maximum 128"),
        "head_dim zero": (dict(q=np.zeros((1, 4, 0), np.float16), k=np.zeros((1, 4, 0), np.float16),
                               v=np.zeros((1, 4, 0), np.float16)), "head_dim=0"),
        "nan visible q": (dict(q=qn, k=k, v=v), "q holds NaN at visible position (1, 3, 2)"),
        "nan visible k (causal)": (dict(q=q, k=kn, v=v, causal=np.bool_(True)),
                                   "k holds NaN at visible position (0, 7, 0)"),
        "bad mask dtype": (dict(q=q, k=k, v=v, mask=np.ones((8, 8), np.int8)), "mask must be bool"),
        "bad mask shape": (dict(q=q, k=k, v=v, mask=np.ones((3, 8), bool)), "mask shape (3, 8)"),
        "negative kv_valid_len": (dict(q=q, k=k, v=v, kv_valid_len=np.int64(-1)), "kv_valid_len must be >= 0, not -1"),
        "unknown key": (dict(q=q, k=k, v=v, extra=np.zeros(1)), "unknown keys ['extra']"),
    }


@pytest.mark.parametrize("name", list(_bad_cases()))
def test_malformed_input_exits_2_and_writes_nothing(name, tmp_path, capsys):
    arrays, words = _bad_cases()[name]
    inp = write(tmp_path / "bad.npz", **arrays)
    out = tmp_path / "out.npz"
    assert main(["sim", "--inputs", inp, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "bad.npz"]


def test_nan_in_an_invisible_position_is_accepted(tmp_path):
    q, k, v = f16(10, 1, 4, 16), f16(11, 1, 8, 16), f16(12, 1, 8, 16)
    k[0, 6:] = np.nan                          # hidden by kv_valid_len
    v[0, 6:] = np.nan
    inp = write(tmp_path / "case.npz", q=q, k=k, v=v, kv_valid_len=np.int64(6))
    assert main(["sim", "--inputs", inp, "--out", str(tmp_path / "o.npz")]) == 0


def test_missing_file_and_console_script(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flashnpu", "sim", "--inputs", str(tmp_path / "nope.npz")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr and r.stdout == ""


def test_small_array_sizes(capsys):
    # 4x4: Br = Bc = 8, max_head_dim cut to what 64 registers per PE hold
    # with the softmax overlap's second S block (96)
    assert array_config(4, 4).overlaps_softmax
    assert main(["sim", "--rows", "4", "--cols", "4", "--heads", "1", "--seq-q", "20",
                 "--head-dim", "96", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["array"] == "4x4"
    assert main(["sim", "--rows", "4", "--cols", "4", "--head-dim", "104"]) == 2
    assert "head_dim=104 is above the hardware maximum 96" in capsys.readouterr().err
    assert main(["sim", "--rows", "3"]) == 2
    assert "array_rows must be a power of 2, not 3" in capsys.readouterr().err
