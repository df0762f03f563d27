"""CPU checks of the graph-captured decode loop (stochattn/eval/llm/decode_loop.py).

Without torch: the module imports without it; the Llama-3.1-8B shape, its parameter count
and the KV-cache arithmetic the benchmark plans its cases with; token agreement.
With torch (CPU build; skipped otherwise): the static-cache step with the "sdpa" backend
on a small random Llama against the NumPy forward (stochattn/eval/llm/forward.py), float32:
the prefill logits and four decode steps, which checks the interleaved RoPE from the
device positions, the GQA grouping, the cache writes at the position and the
post-prefill reset. The GPU backends and the graph capture are in
tests/gpu/test_decode_loop.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from stochattn.eval.llm import decode_loop as dl
from stochattn.eval.llm.model import LlamaConfig, LlamaWeights


def test_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "import stochattn.eval.llm.decode_loop as d; "
            "print(d.DecodeConfig.llama31_8b().kv_heads)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8"


def test_llama_8b_shape_and_sizes():
    cfg = dl.DecodeConfig.llama31_8b()
    assert (cfg.n_layers, cfg.hidden, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn) == \
        (32, 4096, 32, 8, 128, 14336)
    assert cfg.group == 4 and not cfg.tied
    assert cfg.param_count() == 8_030_261_248          # Llama-3.1-8B's published count
    gib = 2**30
    # 2 * layers * Hkv * N * D * 2 bytes per sequence
    assert cfg.kv_cache_bytes(131072) == 2 * 32 * 8 * 131072 * 128 * 2 == 16 * gib
    assert cfg.kv_cache_bytes(32768, batch=8) == 32 * gib
    assert dl.kv_cache_bytes(32, 8, 128, 32768) == 4 * gib
    h100 = 80 * 10**9
    assert cfg.fits(131072 + 256, 1, h100)              # 15 GB weights + 16 GiB
    assert cfg.fits(32768 + 256, 8, h100)               # + 32 GiB
    assert not cfg.fits(131072, 8, h100)                # 128 GiB of cache
    assert dl.DecodeConfig.llama31_8b(n_layers=2).n_layers == 2


def test_config_checks():
    with pytest.raises(ValueError, match="multiple"):
        dl.DecodeConfig(n_layers=1, hidden=8, ffn=8, q_heads=3, kv_heads=2, head_dim=4,
                        vocab_size=4)
    with pytest.raises(ValueError, match="pairing"):
        dl.DecodeConfig(n_layers=1, hidden=8, ffn=8, q_heads=2, kv_heads=1, head_dim=4,
                        vocab_size=4, pairing="odd")
    with pytest.raises(ValueError, match="backend"):
        dl.make_backend("flashinfer")
    assert dl.round_up(1, 256) == 256 and dl.round_up(512, 256) == 512


def test_agreement():
    a = np.array([[1], [2], [3], [4]])
    assert dl.agreement(a, a) == dict(identical_fraction=1.0, first_divergence=None)
    b = np.array([[1], [2], [9], [4]])
    assert dl.agreement(b, a) == dict(identical_fraction=0.75, first_divergence=2)
    c = np.array([[1, 1], [2, 5], [3, 3]])
    assert dl.agreement(c, np.array([[1, 1], [2, 2], [3, 3]]))["first_divergence"] == 1


def _random_llama(n_layers=2, hidden=96, ffn=160, vocab=300, seed=0):
    """A small float32 Llama with SmolLM2's heads (9 query, 3 KV, head dim 64 = hidden 576
    in SmolLM2; here the heads project from a smaller hidden)."""
    rng = np.random.default_rng(seed)
    cfg = LlamaConfig(n_layers=n_layers, hidden=hidden, ffn=ffn, q_heads=9, kv_heads=3,
                      head_dim=64, context_length=4096, rope_theta=1e4, rms_eps=1e-5,
                      vocab_size=vocab, bos_token_id=0, eos_token_id=0)

    def w(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    layers = [dict(attn_norm=1 + 0.1 * w(hidden), attn_q=w(9 * 64, hidden, scale=2),
                   attn_k=w(3 * 64, hidden, scale=2), attn_v=w(3 * 64, hidden),
                   attn_output=w(hidden, 9 * 64), ffn_norm=1 + 0.1 * w(hidden),
                   ffn_gate=w(ffn, hidden), ffn_up=w(ffn, hidden), ffn_down=w(hidden, ffn))
              for _ in range(n_layers)]
    return LlamaWeights(cfg, w(vocab, hidden, scale=np.sqrt(hidden)),
                        np.ones(hidden, np.float32), layers)


def test_static_cache_step_matches_the_numpy_forward():
    torch = pytest.importorskip("torch")
    from stochattn.eval.llm.forward import final_logits, forward

    weights = _random_llama()
    model = dl.DecodeModel.from_weights(weights, dtype="float32", device="cpu")
    prompt = np.random.default_rng(1).integers(0, 300, 90)
    sess = dl.DecodeSession(model, 1, len(prompt) + 8)
    assert sess.max_tokens == 256
    pre = sess.prefill(prompt)
    be = dl.make_backend("sdpa")
    be.bind(sess)
    sess.out_tokens = torch.zeros((8, 1), dtype=torch.int64)
    toks, logits = [int(sess.tokens[0])], []
    for _ in range(4):
        sess.step(be)
        logits.append(sess.logits[0].double().numpy())
        toks.append(int(sess.next_tokens[0]))
    assert sess.pos.tolist() == [len(prompt) + 4]
    assert sess.out_tokens[:4, 0].tolist() == toks[1:]
    ref = final_logits(weights, forward(weights, np.concatenate([prompt, toks[:-1]])).hidden)
    T = len(prompt)
    np.testing.assert_allclose(pre[0].double().numpy(), ref[T - 1], atol=1e-3)
    for i in range(4):
        np.testing.assert_allclose(logits[i], ref[T + i], atol=1e-3)
    # reset() returns to the post-prefill state: the same steps again
    sess.reset()
    for i in range(4):
        sess.step(be)
        assert int(sess.next_tokens[0]) == toks[i + 1]
