"""stochattn.integrations.transformers: the registered attention inside transformers models.

Every test runs on the CPU (the NumPy reference through copies) and, marked ``gpu``, on a
CUDA GPU (the kernels, zero copy); the whole file needs PyTorch and transformers.

- a decode call returns exactly (bit for bit) what a direct call of the estimator on the
  same tensors returns, with the documented random offset ``step * n_layers + layer``;
- with exact settings (estimator "exact", SANTA with a budget above the cache length, i.e.
  the exact fallback; Double-P with p1 = p2 = 1) greedy generation gives the
  tokens of transformers' SDPA attention (a tiny random Llama whose greedy choices have
  margins far above the rounding differences between the two attention kernels);
- on the GPU the kernels read the cache tensors in place: the pointers they get are the
  data pointers of the DynamicCache / StaticCache tensors;
- lengths come from the mask (StaticCache: the filled prefix), left padding is rejected,
  Double-P's index is built at prefill and grows with each token (on the GPU too, with
  either approximation of C_approx).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import stochattn  # noqa: E402
from stochattn.integrations import transformers as integ  # noqa: E402
from stochattn.integrations._config import rng_offset  # noqa: E402
from stochattn.integrations.transformers import register, registered  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NAME = "stochattn_test"


class _Attention(torch.nn.Module):
    """What transformers' attention functions read from their module."""

    def __init__(self, layer_idx=2, n_layers=4, groups=4, sliding_window=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.config = SimpleNamespace(num_hidden_layers=n_layers)
        self.num_key_value_groups = groups
        self.is_causal = True
        self.sliding_window = sliding_window


def _qkv(device, dtype, B=2, Hq=8, Hkv=2, N=300, D=64, Lq=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g) * 2
    k = torch.randn(B, Hkv, N, D, generator=g)
    v = torch.randn(B, Hkv, N, D, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _host(t):
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _direct(fn, q, k, v, lens, **kw):
    """``fn`` on the same tensors, as a user would call it: torch CUDA tensors as they are,
    CPU tensors as NumPy (bfloat16 through float32, as the integration does)."""
    if q.is_cuda:
        return fn(q, k, v, lens, **kw)
    out = fn(_host(q), _host(k), _host(v), None if lens is None else lens.numpy(), **kw)
    return torch.from_numpy(np.ascontiguousarray(out)).to(q.dtype)


def _prefix_mask(lens, n, device, B):
    m = torch.arange(n)[None, :] < torch.as_tensor(lens)[:, None]
    return m.view(B, 1, 1, n).to(device)


# ---- one decode call against a direct estimator call ---------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("estimator, params", [
    ("exact", {}),
    ("santa", dict(budget=32, exact_fallback=False)),
    ("santa", dict(budget=16, sampler="stratified", tile_size=32, exact_fallback=False)),
])
@pytest.mark.parametrize("lens", [None, [300, 123]])
def test_decode_call_equals_a_direct_estimator_call(device, dtype, estimator, params, lens):
    dt = getattr(torch, dtype)
    attn = register(NAME, estimator=estimator, seed=11, **params)
    module = _Attention(layer_idx=2, n_layers=4)
    q, k, v = _qkv(device, dt)
    mask = None if lens is None else _prefix_mask(lens, 300, device, 2)
    seq_lens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=device)
    fn = stochattn.exact_attention if estimator == "exact" else stochattn.santa_attention
    kw = {} if estimator == "exact" else dict(
        budget=params["budget"], sampler=params.get("sampler", "systematic"), schedule="prop",
        tile_size=params.get("tile_size", 64), seed=11)
    for step in range(3):
        out, weights = attn(module, q, k, v, mask, scaling=0.125)
        assert weights is None
        assert out.shape == (2, 1, 8, 64) and out.dtype == dt and out.device == q.device
        if estimator == "santa":
            kw["offset"] = rng_offset(step, 4, 2)
        direct = _direct(fn, q[:, :, 0], k, v, seq_lens, softmax_scale=0.125, **kw)
        assert torch.equal(out[:, 0], direct), f"step {step}"
        assert attn.decode_step(module) == step + 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_call_is_transformers_sdpa_and_resets_the_step(device):
    attn = register(NAME, estimator="santa", budget=8, exact_fallback=False)
    module = _Attention()
    q1, k, v = _qkv(device, torch.float16)
    attn(module, q1, k, v, None, scaling=0.125)
    assert attn.decode_step(module) == 1
    q, k, v = _qkv(device, torch.float16, Lq=300, N=300)
    out, _ = attn(module, q, k, v, None, scaling=0.125)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)
    assert torch.equal(out, ref)
    assert attn.decode_step(module) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_sliding_window_layers_stay_on_sdpa(device, monkeypatch):
    attn = register(NAME, estimator="santa", budget=8, exact_fallback=False)
    called = []
    monkeypatch.setattr(integ, "santa_attention", lambda *a, **k: called.append(1))
    module = _Attention(sliding_window=16)
    q, k, v = _qkv(device, torch.float16)
    out, _ = attn(module, q, k, v, None, scaling=0.125)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)
    assert torch.equal(out, ref) and not called


# ---- masks -------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_float_masks_and_check_mask(device):
    q, k, v = _qkv(device, torch.float16)
    module = _Attention()
    neg = torch.finfo(torch.float16).min
    prefix = torch.zeros(2, 1, 1, 300, dtype=torch.float16, device=device)
    prefix[1, ..., 200:] = neg
    attn = register(NAME, estimator="exact")
    out, _ = attn(module, q, k, v, prefix, scaling=0.125)
    lens = torch.tensor([300, 200], dtype=torch.int32, device=device)
    assert torch.equal(out[:, 0], _direct(stochattn.exact_attention, q[:, :, 0], k, v, lens,
                                          softmax_scale=0.125))
    left = torch.zeros_like(prefix)
    left[1, ..., :100] = neg  # left padding: keys 100 .. 299 of sequence 1
    with pytest.raises(ValueError, match=r"`attention_mask` must keep a prefix .*left padding"):
        attn(module, q, k, v, left, scaling=0.125)
    bias = torch.zeros_like(prefix)
    bias[0, ..., 5] = 1.5  # an additive bias is not a mask the estimators can honour
    with pytest.raises(ValueError, match=r"`attention_mask` must keep a prefix"):
        attn(module, q, k, v, bias, scaling=0.125)
    # check_mask=False trusts the mask: lengths are the count of attended keys.
    trusting = register(NAME, estimator="exact", check_mask=False)
    out, _ = trusting(module, q, k, v, left, scaling=0.125)
    lens = torch.tensor([300, 200], dtype=torch.int32, device=device)
    assert torch.equal(out[:, 0], _direct(stochattn.exact_attention, q[:, :, 0], k, v, lens,
                                          softmax_scale=0.125))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    attn = register(NAME, estimator="exact")
    q, k, v = _qkv(device, torch.float16)
    with pytest.raises(ValueError, match=r"`dropout` must be 0"):
        attn(_Attention(), q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"`softcap` is not supported"):
        attn(_Attention(), q, k, v, None, softcap=30.0)
    no_layer = _Attention()
    no_layer.layer_idx = None
    with pytest.raises(ValueError, match=r"`module` must have a `layer_idx`"):
        attn(no_layer, q, k, v, None)
    with pytest.raises(ValueError, match=r"`attention_mask` must have shape \(2, heads, q_len, 300\)"):
        attn(_Attention(), q, k, v, torch.ones(2, 1, 1, 299, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match=r"`attention_mask` must be bool or floating point"):
        attn(_Attention(), q, k, v, torch.ones(2, 1, 1, 300, dtype=torch.int32, device=device))


def test_register_and_registered():
    a = register(NAME, estimator="exact")
    assert registered(NAME) is a and a.name == NAME and a.config.estimator == "exact"
    b = register(NAME, estimator="santa", budget=4)
    assert registered(NAME) is b
    with pytest.raises(ValueError, match=r"`name` must not be one of transformers' own"):
        register("sdpa", estimator="exact")
    with pytest.raises(ValueError, match=r"`name` must be a name registered with register\(\)"):
        registered("never_registered")
    with pytest.raises(TypeError, match=r"`p1` is not a parameter of estimator='santa'"):
        register(NAME, estimator="santa", budget=4, p1=0.9)


# ---- a tiny model end to end ---------------------------------------------------------------

def _tiny(device, dtype, batch=1, prompt=96):
    """A 2-layer random Llama (Hq 4, Hkv 2, D 64, vocab 64) and a prompt. Seed 37: its greedy
    top-1/top-2 logit margins over 16 new tokens are >= 0.17 (logit std 1.5) in float32, far
    above the differences between two correct attention kernels in float16."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=1024, initializer_range=0.1, bos_token_id=0,
                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(37)
    model = LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)
    ids = torch.randint(1, 64, (1, prompt), generator=torch.Generator().manual_seed(37))
    return model, ids.repeat(batch, 1).to(device)


def _generate(model, ids, impl, new=16, **kw):
    """Greedy tokens and scores. Eager unless ``disable_compile=False`` is passed: with a
    StaticCache on a GPU, generate would otherwise compile the decode forward by itself."""
    model.set_attn_implementation(impl)
    kw.setdefault("disable_compile", True)
    with torch.no_grad():
        o = model.generate(ids, max_new_tokens=new, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, **kw)
    return o.sequences[:, ids.shape[1]:], torch.stack(o.scores, 1).float()


def _margins(scores):
    top = scores.topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]).min().item()


EXACT_SETTINGS = [
    ("exact", {}),
    ("santa", dict(budget=4096)),  # more points than keys: the exact fallback
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("estimator, params", EXACT_SETTINGS + [
    pytest.param("doublep", dict(p1=1.0, p2=1.0, n_clusters=8, window=16), id="doublep-p1=p2=1"),
])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_exact_settings_generate_the_tokens_of_sdpa(device, estimator, params, cache):
    dtype = torch.float32 if device == "cpu" else torch.float16
    model, ids = _tiny(device, dtype)
    kw = {} if cache == "dynamic" else dict(cache_implementation="static")
    ref, ref_scores = _generate(model, ids, "sdpa", **kw)
    register(NAME, estimator=estimator, **params)
    got, scores = _generate(model, ids, NAME, **kw)
    margin = _margins(ref_scores)
    assert torch.equal(got, ref), (
        f"tokens differ from SDPA: {got.tolist()} vs {ref.tolist()} (smallest greedy margin "
        f"{margin:.3g}, largest logit difference {(scores - ref_scores).abs().max().item():.3g})")
    assert margin > 0.05, "the test model lost its greedy margins: choose another seed"


@pytest.mark.gpu
def test_generate_compiles_around_the_estimator_with_a_static_cache():
    """generate's own torch.compile of the decode forward (StaticCache on a GPU; inductor,
    CUDA graphs) leaves the stochattn call out of the graph: it runs at every step and the
    tokens are SDPA's."""
    model, ids = _tiny("cuda", torch.float16)
    ref, _ = _generate(model, ids, "sdpa", cache_implementation="static")
    attn = register(NAME, estimator="exact")
    compiled, _ = _generate(model, ids, NAME, cache_implementation="static", disable_compile=False)
    assert torch.equal(compiled, ref)
    # 16 new tokens: 15 decode steps, each through the estimator (not traced away)
    assert [attn.decode_step(layer.self_attn) for layer in model.model.layers] == [15, 15]


@pytest.mark.parametrize("device", DEVICES)
def test_santa_generates_reproducibly_and_differs_from_exact(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    model, ids = _tiny(device, dtype, batch=2)
    exact, _ = _generate(model, ids, "sdpa")
    register(NAME, estimator="santa", budget=4, seed=3, exact_fallback=False)
    a, _ = _generate(model, ids, NAME)
    register(NAME, estimator="santa", budget=4, seed=3, exact_fallback=False)
    b, _ = _generate(model, ids, NAME)
    assert torch.equal(a, b)  # same seed, same offsets: same tokens
    # S = 4 points over ~100 keys in both layers of both rows: the estimator is in the loop.
    assert not torch.equal(a, exact)


@pytest.mark.parametrize("device", DEVICES)
def test_left_padded_batches_are_rejected(device):
    model, ids = _tiny(device, torch.float32 if device == "cpu" else torch.float16, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    register(NAME, estimator="exact")
    model.set_attn_implementation(NAME)
    with torch.no_grad(), pytest.raises(ValueError, match=r"left padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)


def _cache_kw(model):
    sig = inspect.signature(model.model.forward).parameters
    return "cache" if "cache" in sig else "past_key_values"


def test_doublep_index_is_built_at_prefill_and_grows():
    model, ids = _tiny("cpu", torch.float32)
    attn = register(NAME, estimator="doublep", n_clusters=8, window=16)
    model.set_attn_implementation(NAME)
    layers = [layer.self_attn for layer in model.model.layers]
    with torch.no_grad():
        model(ids)  # prefill only
        assert [attn.index(m).seq_lens.tolist() for m in layers] == [[96], [96]]
        assert all(attn.index(m).n_clusters == 8 for m in layers)
        new, _ = _generate(model, ids, NAME, new=5)
    # prefill of 96 + 4 decode steps (the 5th token needs no attention call)
    assert [attn.index(m).seq_lens.tolist() for m in layers] == [[100], [100]]
    assert [attn.decode_step(m) for m in layers] == [4, 4]
    assert new.shape == (1, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("approx", [dict(approx="centroid"), dict(approx="sample", budget=16)])
def test_doublep_on_cuda_generates_and_grows_its_gpu_index(approx):
    model, ids = _tiny("cuda", torch.float16)
    attn = register(NAME, estimator="doublep", p1=0.95, p2=0.7, n_clusters=8, window=16,
                    **approx)
    model.set_attn_implementation(NAME)
    layers = [layer.self_attn for layer in model.model.layers]
    new, _ = _generate(model, ids, NAME, new=5)
    assert new.shape == (1, 5)
    index = attn.index(layers[0])
    assert index.centroids.is_cuda  # built and grown on the GPU
    assert [attn.index(m).seq_lens.tolist() for m in layers] == [[100], [100]]


# ---- zero copy on the GPU ------------------------------------------------------------------

@pytest.fixture
def kernel_pointers(monkeypatch):
    """(q, k, v) device pointers every CUDA kernel launch gets, recorded."""
    from stochattn.cuda.runtime import inputs as _inputs

    seen = []
    original = _inputs.Inputs.pointers

    def spy(self):
        ptrs = original(self)
        seen.append(tuple(int(p) for p in ptrs))
        return ptrs

    monkeypatch.setattr(_inputs.Inputs, "pointers", spy)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("estimator, params", [
    ("exact", {}), ("santa", dict(budget=16, exact_fallback=False))])
def test_kernels_read_the_cache_tensors_in_place(kernel_pointers, estimator, params):
    attn = register(NAME, estimator=estimator, **params)
    q, k, v = _qkv("cuda", torch.bfloat16)
    attn(_Attention(), q, k, v, None)
    assert kernel_pointers == [(q.data_ptr(), k.data_ptr(), v.data_ptr())]


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_model_decode_step_reads_the_cache_in_place(kernel_pointers, cache):
    from transformers import DynamicCache

    model, ids = _tiny("cuda", torch.bfloat16, batch=2)
    register(NAME, estimator="santa", budget=16, exact_fallback=False)
    model.set_attn_implementation(NAME)
    kv = DynamicCache(config=model.config) if cache == "dynamic" else \
        StaticCache(config=model.config, max_cache_len=128)
    key = _cache_kw(model)
    with torch.no_grad():
        logits = model(ids, **{key: kv}).logits  # prefill: SDPA, no stochattn kernel
        assert kernel_pointers == []
        nxt = logits[:, -1:].argmax(-1)
        model(nxt, **{key: kv})
    layers = kv.layers
    expected = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in layers]
    assert [p[1:] for p in kernel_pointers] == expected
    for layer in layers:
        assert layer.keys.is_contiguous() and layer.values.is_contiguous()
