"""CPU checks of the graph-captured decode loop (stochattn/eval/llm/decode_loop.py).

Without torch: the module imports without it; the Llama-3.1-8B shape, its parameter count
and the KV-cache arithmetic the benchmark plans its cases with; token agreement; the paged
cache's arithmetic in NumPy (the page table made up front, the CSR arrays of given
lengths as the step computes them, page growth one token at a time, the page and slot of
each written token), checked against stochattn.paged's own rules (paged_kv's value checks,
seq_lens, gather); the benchmark's command line.
With torch (CPU build; skipped otherwise): the static-cache step with the "sdpa" backend
on a small random Llama against the NumPy forward (stochattn/eval/llm/forward.py), float32:
the prefill logits and four decode steps, which checks the interleaved RoPE from the
device positions, the GQA grouping, the cache writes at the position and the
post-prefill reset; the paged session (shuffled pages, NHD and HND, batch 2 with
different prompts, a NaN-filled pool) through a test backend that gathers its pages with
torch, against the static session, bit for bit; the device page table after the steps;
the benchmark's rows and comparisons with generate() run eagerly. The GPU backends and
the graph capture are in tests/gpu/test_decode_loop.py.
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
        dl.make_backend("flashattn")
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


# ---- paged cache arithmetic (NumPy) ------------------------------------------------------------


def test_page_table_made_up_front():
    assert dl.pages_per_sequence(512, 16) == 32 and dl.pages_per_sequence(513, 16) == 33
    assert dl.pages_per_sequence(256, 1) == 256 and dl.pages_per_sequence(256, 128) == 2
    table, num = dl.page_table(3, 512, 16, shuffle_seed=7, extra_pages=5)
    assert table.shape == (3, 32) and table.dtype == np.int64 and num == 3 * 32 + 5
    flat = table.ravel()
    assert len(set(flat.tolist())) == flat.size                  # no page shared
    assert flat.min() >= 0 and flat.max() < num
    assert not np.array_equal(flat, np.arange(flat.size))         # shuffled
    ordered, num = dl.page_table(2, 100, 16, shuffle_seed=None)
    assert num == 14 and np.array_equal(ordered, np.arange(14).reshape(2, 7))
    with pytest.raises(ValueError):
        dl.page_table(0, 100, 16)
    with pytest.raises(ValueError):
        dl.pages_per_sequence(100, 0)


def _csr(lens, table, P):
    lens = np.asarray(lens, dtype=np.int64)
    ends, indices, last = dl.csr_from_lengths(lens, table, P, np.arange(table.size))
    return np.concatenate([[0], ends]), indices, last


@pytest.mark.parametrize("P", [1, 3, 16, 128])
def test_csr_from_lengths_follows_the_paged_rules(P):
    from stochattn.paged import paged_kv

    rng = np.random.default_rng(P)
    max_tokens = 300
    table, num = dl.page_table(5, max_tokens, P, shuffle_seed=P, extra_pages=2)
    pps = table.shape[1]
    for lens in ([0, 1, P, P + 1, max_tokens], [max_tokens] * 5, [0] * 5,
                 rng.integers(0, max_tokens + 1, 5)):
        indptr, indices, last = _csr(lens, table, P)
        n = -(-np.asarray(lens) // P)
        assert np.array_equal(np.diff(indptr), n)
        for b in range(5):
            assert np.array_equal(indices[indptr[b]:indptr[b + 1]], table[b, :n[b]])
            if n[b]:
                assert 1 <= last[b] <= P and (n[b] - 1) * P + last[b] == lens[b]
            else:
                assert last[b] == 0
        assert indices.shape == (5 * pps,)
        # stochattn.paged checks the values of host tables and computes the same lengths
        pool = np.zeros((num, 2, P, 1, 8), dtype=np.float32)
        cache = paged_kv(pool, kv_indptr=indptr.astype(np.int32),
                         kv_indices=indices[:indptr[-1]].astype(np.int32),
                         kv_last_page_len=last.astype(np.int32), max_tokens=max_tokens)
        assert np.array_equal(cache.seq_lens, lens)


def test_page_growth_one_token_at_a_time():
    """The step's arithmetic as a sequence grows: the last page fills 1..P, a new page is
    taken at every multiple of P plus one, the other sequence's pages shift behind it."""
    P = 4
    table, _ = dl.page_table(2, 64, P, shuffle_seed=3)
    prev = None
    for L in range(5, 30):
        indptr, indices, last = _csr([L, L], table, P)
        n = -(-L // P)
        assert indptr.tolist() == [0, n, 2 * n]
        assert last.tolist() == [(L - 1) % P + 1] * 2
        assert indices[:n].tolist() == table[0, :n].tolist()
        assert indices[n:2 * n].tolist() == table[1, :n].tolist()
        if prev is not None:
            grew = prev[0][1] != n
            assert grew == ((L - 1) % P == 0)
        prev = (indptr, last)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_token_slots_write_what_gather_reads(layout):
    """Rows written at token_slots(pos) of a shuffled pool, one token at a time (as the
    decode step) or a whole prefix at once (as the prefill), read back by stochattn.paged's
    gather through the CSR of the lengths: the contiguous cache, exactly."""
    from stochattn.paged import gather, paged_kv

    rng = np.random.default_rng(0)
    B, H, D, P, max_tokens = 3, 2, 8, 16, 96
    lens = np.array([13, 96, 0])
    table, num = dl.page_table(B, max_tokens, P, shuffle_seed=11, extra_pages=3)
    k = rng.standard_normal((B, H, max_tokens, D)).astype(np.float32)
    v = rng.standard_normal((B, H, max_tokens, D)).astype(np.float32)
    inner = (P, H) if layout == "NHD" else (H, P)
    pool = np.full((num, 2) + inner + (D,), np.nan, dtype=np.float32)
    nhd = pool if layout == "NHD" else pool.transpose(0, 1, 3, 2, 4)   # a view
    seq_ids = np.arange(B)
    # prefix of 20 tokens at once (B, T), then one token per step
    T = 20
    pos = np.broadcast_to(np.arange(T), (B, T))
    page, slot = dl.token_slots(pos, table, P, seq_ids)
    for b in range(B):
        m = min(T, lens[b])
        nhd[page[b, :m], 0, slot[b, :m]] = k[b, :, :m].transpose(1, 0, 2)
        nhd[page[b, :m], 1, slot[b, :m]] = v[b, :, :m].transpose(1, 0, 2)
    for t in range(T, max_tokens):
        page, slot = dl.token_slots(np.full(B, t), table, P, seq_ids)
        for b in range(B):
            if t < lens[b]:
                nhd[page[b], 0, slot[b]] = k[b, :, t]
                nhd[page[b], 1, slot[b]] = v[b, :, t]
    indptr, indices, last = _csr(lens, table, P)
    cache = paged_kv(pool, kv_indptr=indptr.astype(np.int32),
                     kv_indices=indices[:indptr[-1]].astype(np.int32),
                     kv_last_page_len=last.astype(np.int32), layout=layout,
                     max_tokens=max_tokens)
    gk, gv, glens = gather(cache, tokens=max_tokens)
    assert np.array_equal(glens, lens)
    for b in range(B):
        assert np.array_equal(gk[b, :, :lens[b]], k[b, :, :lens[b]])
        assert np.array_equal(gv[b, :, :lens[b]], v[b, :, :lens[b]])


def test_session_options_are_checked_and_backends_name_their_caches():
    for name in dl.BACKENDS:
        be = dl.make_backend(name)       # nothing imported or allocated before bind
        assert set(be.caches) <= set(dl.CACHES) and be.caches
    assert dl.make_backend("sdpa").caches == ("static",)
    assert dl.make_backend("flashinfer").caches == ("paged",)
    assert dl.make_backend("flashinfer", backend="auto").fi_backend == "auto"


# ---- the benchmark's command line ---------------------------------------------------------------


def test_benchmark_command_line():
    from benchmarks import bench_decode_loop as bench

    assert bench.parse_size("32k") == 32768 and bench.parse_size("2048") == 2048
    assert bench.parse_cases("smollm2:2048,llama8b:128k") == [("smollm2", 2048),
                                                              ("llama8b", 131072)]
    with pytest.raises(ValueError):
        bench.parse_cases("gpt2:1024")
    with pytest.raises(ValueError):
        bench.parse_list("static,pagd", allowed=("static", "paged"))
    assert bench.card_name("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.card_name("NVIDIA H200") == "h200"
    assert bench.default_tag([("smollm2", 2048)], ["static"], [1]) == "smollm2"
    assert bench.default_tag([("smollm2", 2048), ("llama8b", 32768)], ["static", "paged"],
                             [1, 8]) == "smollm2-llama8b_static-paged_b1-8"

    # build_cases from an argparse namespace like main's
    import argparse

    ns = argparse.Namespace(cases="smollm2:1024,llama8b:32k", batch="1,8", big_batch8=False,
                            no_small=False, no_big=False, prompt_tokens=2048,
                            big_contexts="32768,131072", backends=None,
                            big_backends="exact,sdpa", big_doublep=True)
    assert bench.build_cases(ns) == [("smollm2", 1024, 1), ("smollm2", 1024, 8),
                                     ("llama8b", 32768, 1), ("llama8b", 32768, 8)]
    assert bench.default_backends("llama8b", ns) == ["exact", "sdpa", "doublep"]
    assert bench.default_backends("smollm2", ns) == list(bench.SMALL_BACKENDS)
    ns.cases, ns.batch, ns.no_small, ns.big_batch8 = None, "1", True, True
    assert bench.build_cases(ns) == [("llama8b", 32768, 1), ("llama8b", 131072, 1),
                                     ("llama8b", 32768, 8)]
    ns.backends = "exact,flashinfer"
    assert bench.default_backends("smollm2", ns) == ["exact", "flashinfer"]


# ---- the paged session on CPU torch -------------------------------------------------------------


class _GatherSDPA(dl._Backend):
    """A test backend for paged sessions on CPU torch: gathers every layer's pages through
    the session's page table (positions 0..max_tokens-1, zero past each length) and runs
    the "sdpa" computation on them, so its output equals the static "sdpa" backend's when
    the pages hold what the static cache holds. It reads the layer cache's CSR arrays
    (kv_indptr, kv_indices, kv_last_page_len) as the GPU kernels do."""

    name = "gather-sdpa"
    caches = ("paged",)

    def __call__(self, layer, q, kc, vc, seq_lens):
        torch = pytest.importorskip("torch")
        s = self.session
        assert vc is None and seq_lens is None and kc.max_tokens == s.max_tokens
        N, P = s.max_tokens, kc.page_size
        t = torch.arange(N).expand(s.batch, N)
        # what the kernels read: the CSR arrays (lengths, then pages through kv_indices)
        indptr = kc.kv_indptr.long()
        n = indptr[1:] - indptr[:-1]
        lens = (n - 1) * P + kc.kv_last_page_len.long() + (n == 0) * P
        valid = t < lens[:, None]
        entry = (indptr[:-1, None] + t // P).clamp(max=kc.kv_indices.numel() - 1)
        page, slot = kc.kv_indices.long()[entry], t % P
        nhd = s._nhd[layer]
        zero = torch.zeros((), dtype=q.dtype)
        k = torch.where(valid[..., None, None], nhd[page, 0, slot], zero).transpose(1, 2)
        v = torch.where(valid[..., None, None], nhd[page, 1, slot], zero).transpose(1, 2)
        B, Hq, D = q.shape
        Hkv = k.shape[1]
        mask = torch.where(valid, 0.0, float("-inf")).to(q.dtype)[:, None, None, :]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.view(B, Hkv, Hq // Hkv, D), k, v, attn_mask=mask)
        return o.reshape(B, Hq, D)


@pytest.mark.parametrize("layout,B,P", [("NHD", 1, 16), ("HND", 2, 16), ("NHD", 2, 7)])
def test_paged_session_equals_the_static_session(layout, B, P):
    torch = pytest.importorskip("torch")
    weights = _random_llama(n_layers=2)
    model = dl.DecodeModel.from_weights(weights, dtype="float32", device="cpu")
    prompt = np.random.default_rng(2).integers(0, 300, (B, 90))   # different rows
    st = dl.DecodeSession(model, B, 98)
    pg = dl.DecodeSession(model, B, 98, cache="paged", page_size=P, layout=layout,
                          shuffle_seed=5, extra_pages=3, pool_fill=float("nan"))
    assert pg.max_tokens == st.max_tokens == 256
    assert pg.pool.shape[:3] == (2, pg.num_pages, 2) and pg.num_pages == B * (-(-256 // P)) + 3
    assert torch.equal(st.prefill(prompt), pg.prefill(prompt))
    a = st.generate("sdpa", 6, graph=False)
    b = pg.generate(_GatherSDPA(), 6, graph=False)
    assert a.tokens.shape == b.tokens.shape == (6, B) and b.cache == "paged" and b.batch == B
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert torch.equal(a.last_logits, b.last_logits)      # bit for bit
    # the device page table describes the grown lengths (prefill + 6 steps)
    L = 90 + 6
    indptr, indices, last = _csr([L] * B, pg.page_table_host, P)
    assert pg.kv_indptr.tolist() == indptr.tolist()
    assert pg.kv_last_page_len.tolist() == last.tolist()
    assert pg.kv_indices.tolist() == indices.tolist()
    assert pg.seq_lens.tolist() == [L] * B
    # every written slot is finite, every other slot of the NaN-filled pool still NaN
    written = np.zeros(pg.num_pages * P, dtype=bool)
    for bb in range(B):
        pages, slots = dl.token_slots(np.arange(L), pg.page_table_host[bb:bb + 1].repeat(L, 0),
                                      P, np.zeros(L, dtype=np.int64))
        written[pages * P + slots] = True
    nhd = pg._nhd[0]
    finite = torch.isfinite(nhd[:, 0].reshape(pg.num_pages * P, -1)).all(-1).numpy()
    assert np.array_equal(finite, written)


def test_paged_session_refuses_static_backends():
    pytest.importorskip("torch")
    model = dl.DecodeModel.from_weights(_random_llama(n_layers=1), dtype="float32",
                                        device="cpu")
    pg = dl.DecodeSession(model, 1, 64, cache="paged")
    pg.prefill(np.arange(10))
    with pytest.raises(ValueError, match="static"):
        pg.backend("sdpa")
    st = dl.DecodeSession(model, 1, 64)
    st.prefill(np.arange(10))
    with pytest.raises(ValueError, match="paged"):
        st.backend("flashinfer")
    with pytest.raises(ValueError, match="cache"):
        dl.DecodeSession(model, 1, 64, cache="ring")
    with pytest.raises(ValueError, match="layout"):
        dl.DecodeSession(model, 1, 64, cache="paged", layout="NDH")


def test_fill_random_gives_both_caches_the_same_tokens():
    torch = pytest.importorskip("torch")
    model = dl.DecodeModel.from_weights(_random_llama(n_layers=2), dtype="float32",
                                        device="cpu")
    st = dl.DecodeSession(model, 2, 200)
    pg = dl.DecodeSession(model, 2, 200, cache="paged", page_size=16, shuffle_seed=1)
    st.fill_random(150, seed=3)
    pg.fill_random(150, seed=3)
    a = st.generate("sdpa", 3, graph=False)
    b = pg.generate(_GatherSDPA(), 3, graph=False)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert torch.equal(a.last_logits, b.last_logits)


def test_benchmark_rows_on_cpu(monkeypatch):
    """run_case's plumbing (eager/graph rows, graph == eager, paged against static,
    agreements, speedups, skipped backends) with generate()'s graph runs made eager."""
    pytest.importorskip("torch")
    import argparse

    from benchmarks import bench_decode_loop as bench

    real_make, real_generate = dl.make_backend, dl.DecodeSession.generate

    def make(name, **options):
        return _GatherSDPA() if name == "exact" else real_make(name, **options)

    def generate(self, backend, n_new, graph, **kw):
        res = real_generate(self, backend, n_new, False, **kw)
        res.graph = graph
        return res

    monkeypatch.setattr(dl, "make_backend", make)
    monkeypatch.setattr(dl.DecodeSession, "generate", generate)
    model = dl.DecodeModel.from_weights(_random_llama(n_layers=1), dtype="float32",
                                        device="cpu")
    prompt = np.random.default_rng(4).integers(0, 300, (2, 40))
    args = argparse.Namespace(eager_new=3, budget_prop=8, budget_flash=8, p1=0.9, p2=0.7,
                              tokens_per_cluster=32, iterations=2, flashinfer_backend="fa2",
                              save=None)
    static_results = {}
    rows = []
    for cache, backends in (("static", ["sdpa", "flashinfer"]), ("paged", ["exact", "sdpa"])):
        sess = dl.DecodeSession(model, 2, 60, cache=cache)
        sess.prefill(prompt)
        rows += bench.run_case(sess, backends, 5, args, "tiny", dict(cache=cache),
                               static_results)
    by = {(r["cache"], r["backend"]): r for r in rows}
    assert "reads a paged cache" in by["static", "flashinfer"]["skipped"]
    assert "reads a static cache" in by["paged", "sdpa"]["skipped"]
    s, p = by["static", "sdpa"], by["paged", "exact"]
    for r in (s, p):
        assert r["graph_equals_eager"] and r["graph_logits_equal_eager"], r
        assert r["eager_steps"] == 3 and r["graph_steps"] == 5
        assert r["graph_tokens_per_s"] > 0 and "error" not in r
    # the gather backend on pages computes what sdpa does on the static cache
    assert static_results.keys() == {"sdpa"}
    assert "paged_vs_static" not in p   # compared only backend by backend (exact != sdpa)
    static_results["exact"] = static_results["sdpa"]
    sess = dl.DecodeSession(model, 2, 60, cache="paged", page_size=4)
    sess.prefill(prompt)
    rows = bench.run_case(sess, ["exact"], 5, args, "tiny", dict(cache="paged"),
                          static_results)
    ps = rows[0]["paged_vs_static"]
    assert ps["tokens_equal"] and ps["last_logits_equal"], ps
    assert ps["last_logits_max_abs_diff"] == 0.0
    assert bench.table(rows).count("\n") == 2
