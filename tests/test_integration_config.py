"""Argument handling of the framework integrations (stochattn.integrations._config).

No PyTorch or transformers needed: this is what CI checks. The model-level tests, which
need both, are in tests/gpu/test_transformers_integration.py (CPU and GPU variants).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import subprocess
import sys
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stochattn import DoublePPlan
from stochattn.integrations import ESTIMATORS, DecodeAttentionConfig, make_config
from stochattn.integrations._config import check_name, default_clusters, rng_offset


def test_defaults_per_estimator():
    assert make_config("exact").parameters == {"estimator": "exact", "seed": 0, "check_mask": True}
    santa = make_config("santa", budget=256)
    assert santa.parameters == {"estimator": "santa", "seed": 0, "check_mask": True, "budget": 256,
                                "sampler": "systematic", "schedule": "prop", "tile_size": 64,
                                "exact_fallback": True}
    dp = make_config("doublep")
    assert (dp.p1, dp.p2, dp.approx, dp.budget, dp.n_clusters) == (0.95, 0.7, "centroid", None, None)
    assert (dp.iterations, dp.n_sink, dp.window, dp.tokens_per_cluster) == (10, 4, 64, 32)


def test_values_are_kept_and_the_config_is_frozen():
    c = make_config("santa", budget=8, sampler="iid", schedule="flash", tile_size=128,
                    exact_fallback=False, seed=2**64 - 1, check_mask=False)
    assert (c.budget, c.sampler, c.schedule, c.tile_size) == (8, "iid", "flash", 128)
    assert (c.exact_fallback, c.seed, c.check_mask) == (False, 2**64 - 1, False)
    assert isinstance(c, DecodeAttentionConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.budget = 9
    d = make_config("doublep", p1=1, p2=0.5, approx="sample", budget=64, sampler="stratified",
                    n_clusters=100, iterations=0, n_sink=0, window=0, tokens_per_cluster=16)
    assert (d.p1, d.p2, d.approx, d.budget, d.sampler) == (1.0, 0.5, "sample", 64, "stratified")
    assert (d.n_clusters, d.iterations, d.n_sink, d.window, d.tokens_per_cluster) == (100, 0, 0, 0, 16)


@pytest.mark.parametrize("estimator, params, error, message", [
    ("flashattn", {}, ValueError,
     r"`estimator` must be one of 'exact', 'santa', 'doublep', got 'flashattn'"),
    ("santa", {}, ValueError, r"`budget` is required with estimator='santa'"),
    ("santa", dict(budget=None), ValueError, r"`budget` is required with estimator='santa'"),
    ("santa", dict(budget=0), ValueError, r"`budget` must be >= 1, got 0"),
    ("santa", dict(budget=8.0), TypeError, r"`budget` must be an integer, got float"),
    ("santa", dict(budget=True), TypeError, r"`budget` must be an integer, got bool"),
    ("santa", dict(budget=8, sampler="sobol"), ValueError, r"`sampler` must be one of .*'sobol'"),
    ("santa", dict(budget=8, schedule="tiles"), ValueError, r"`schedule` must be one of .*'tiles'"),
    ("santa", dict(budget=8, tile_size=0), ValueError, r"`tile_size` must be >= 1, got 0"),
    ("santa", dict(budget=8, exact_fallback=1), TypeError, r"`exact_fallback` must be a bool, got int"),
    ("santa", dict(budget=8, p1=0.9), TypeError,
     r"`p1` is not a parameter of estimator='santa' \(a parameter of 'doublep'\); it takes "
     r"seed, check_mask, budget, sampler, schedule, tile_size, exact_fallback"),
    ("exact", dict(budget=8), TypeError,
     r"`budget` is not a parameter of estimator='exact' \(a parameter of 'santa', 'doublep'\)"),
    ("exact", dict(temperature=1.0), TypeError,
     r"`temperature` is not a parameter of estimator='exact'; it takes seed, check_mask"),
    ("exact", dict(seed=-1), ValueError, r"`seed` must lie in \[0, 2\*\*64\), got -1"),
    ("exact", dict(seed=2**64), ValueError, r"`seed` must lie in \[0, 2\*\*64\)"),
    ("exact", dict(seed=1.5), TypeError, r"`seed` must be an integer, got float"),
    ("exact", dict(check_mask="yes"), TypeError, r"`check_mask` must be a bool, got str"),
    ("doublep", dict(p1=0.0), ValueError, r"`p1` must lie in \(0, 1\], got 0.0"),
    ("doublep", dict(p2=1.5), ValueError, r"`p2` must lie in \(0, 1\], got 1.5"),
    ("doublep", dict(p1="0.9"), TypeError, r"`p1` must be a real number, got str"),
    # p1 and p2 each checked on its own, the other one valid (issue 33).
    ("doublep", dict(p1=math.nan), ValueError, r"`p1` must lie in \(0, 1\], got nan"),
    ("doublep", dict(p2=math.nan), ValueError, r"`p2` must lie in \(0, 1\], got nan"),
    ("doublep", dict(p1=math.inf, p2=0.5), ValueError, r"`p1` must lie in \(0, 1\], got inf"),
    ("doublep", dict(p2=-0.5), ValueError, r"`p2` must lie in \(0, 1\], got -0.5"),
    ("doublep", dict(p2=0), ValueError, r"`p2` must lie in \(0, 1\], got 0.0"),
    ("doublep", dict(p1=1.0000001), ValueError, r"`p1` must lie in \(0, 1\], got 1.0000001"),
    ("doublep", dict(p1=None), TypeError, r"`p1` must be a real number, got NoneType"),
    ("doublep", dict(p2="0.5"), TypeError, r"`p2` must be a real number, got str"),
    ("doublep", dict(p2=True), TypeError, r"`p2` must be a real number, got bool"),
    ("doublep", dict(p1=0.9, p2=[0.5]), TypeError, r"`p2` must be a real number, got list"),
    ("doublep", dict(approx="median"), ValueError, r"`approx` must be one of 'centroid', 'sample'"),
    ("doublep", dict(approx="sample"), ValueError, r"`budget` is required with approx='sample'"),
    ("doublep", dict(budget=16), ValueError, r"`budget` must be None with approx='centroid', got 16"),
    ("doublep", dict(n_clusters=0), ValueError, r"`n_clusters` must be >= 1, got 0"),
    ("doublep", dict(tokens_per_cluster=0), ValueError, r"`tokens_per_cluster` must be >= 1, got 0"),
    ("doublep", dict(iterations=-1), ValueError, r"`iterations` must be >= 0, got -1"),
    ("doublep", dict(n_sink=-1), ValueError, r"`n_sink` must be >= 0, got -1"),
    ("doublep", dict(window=2.5), TypeError, r"`window` must be an integer, got float"),
    ("doublep", dict(exact_fallback=True), TypeError,
     r"`exact_fallback` is not a parameter of estimator='doublep' \(a parameter of 'santa'\)"),
])
def test_bad_arguments_name_themselves(estimator, params, error, message):
    with pytest.raises(error, match=message):
        make_config(estimator, **params)


def test_p2_above_p1_is_clamped_with_a_warning_as_the_plan_does():
    """The library's rule (DoublePPlan, docs/plans.md): p2 in (p1, 1) cannot be reached
    (stage 2 picks clusters inside C_p), so it is clamped to p1 with a UserWarning naming
    `p2`; p2 = 1 ("every cluster of C_p exact") and p2 <= p1 are kept, silently. The
    config then runs its plan without a second warning."""
    with pytest.warns(UserWarning, match=r"`p2` \(0.9\) above p1 \(0.8\) cannot be reached.*"
                                         r"clamped to p1"):
        c = make_config("doublep", p1=0.8, p2=0.9)
    assert (c.p1, c.p2) == (0.8, 0.8) and c.parameters["p2"] == 0.8
    with pytest.warns(UserWarning, match=r"`p2` \(0.5\) above p1 \(0.25\)"):
        s = make_config("doublep", p1=0.25, p2=0.5, approx="sample", budget=8)
    assert (s.p1, s.p2, s.approx, s.budget) == (0.25, 0.25, "sample", 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for p1, p2 in ((0.8, 1.0), (0.8, 0.8), (0.8, 0.3), (1.0, 0.3), (1, 1), (1e-9, 1.0)):
            kept = make_config("doublep", p1=p1, p2=p2)
            assert (kept.p1, kept.p2) == (float(p1), float(p2))
        for config in (c, s):
            DoublePPlan(p1=config.p1, p2=config.p2, approx=config.approx, budget=config.budget)


@given(p1=st.floats(1e-6, 1.0), p2=st.floats(1e-6, 1.0))
def test_thresholds_are_those_the_decode_plan_uses(p1, p2):
    """Any (p1, p2) in (0, 1]: make_config keeps what DoublePPlan keeps, and warns exactly
    when the plan does (p1 < p2 < 1)."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = make_config("doublep", p1=p1, p2=p2)
    with warnings.catch_warnings(record=True) as want:
        warnings.simplefilter("always")
        plan = DoublePPlan(p1=p1, p2=p2)
    assert (c.p1, c.p2) == (plan.p1, plan.p2)
    assert c.p2 == (p1 if p1 < p2 < 1 else p2)
    assert [str(w.message) for w in got] == [str(w.message) for w in want]
    assert len(got) == (1 if p1 < p2 < 1 else 0)
    assert all(w.category is UserWarning and "`p2`" in str(w.message) for w in got)


@pytest.mark.parametrize("name", ["stochattn", "santa_256", "S2ANTA", "doublep_p95_p70"])
def test_good_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name, error, message", [
    (None, TypeError, r"`name` must be a str, got NoneType"),
    ("", ValueError, r"`name` must be letters, digits and underscores"),
    ("org/kernel", ValueError, r"a name with '/' or '\|' means something else"),
    ("paged|sdpa", ValueError, r"`name` must be letters, digits and underscores"),
    ("2santa", ValueError, r"starting with a letter"),
    ("santa-256", ValueError, r"`name` must be letters, digits and underscores"),
    ("sdpa", ValueError, r"`name` must not be one of transformers' own attention implementations"),
    ("flash_attention_2", ValueError, r"must not contain 'flash'"),
    ("santa_Flash_2048", ValueError, r"must not contain 'flash': transformers takes any such"),
])
def test_bad_names(name, error, message):
    with pytest.raises(error, match=message):
        check_name(name)


@given(wanted=st.none() | st.integers(1, 10_000), per=st.integers(1, 512),
       longest=st.integers(0, 200_000), extra=st.integers(0, 1000))
def test_default_clusters_stay_in_the_builders_range(wanted, per, longest, extra):
    """The cluster count lies in [1, tokens] (build_doublep_index's bound); it is the
    requested count when that fits, else one cluster per ``per`` tokens of the longest."""
    tokens = max(longest, 1) + extra
    c = make_config("doublep", n_clusters=wanted, tokens_per_cluster=per)
    got = default_clusters(c, longest, tokens)
    assert 1 <= got <= tokens
    expected = math.ceil(max(longest, 1) / per) if wanted is None else wanted
    assert got == min(expected, tokens)


@given(n_layers=st.integers(1, 512), data=st.data())
def test_rng_offsets_differ_across_steps_and_layers(n_layers, data):
    """Distinct (step, layer) pairs below the 2**32 wrap get distinct offsets, all in
    [0, 2**32)."""
    max_step = (2**32 - 1) // n_layers
    a = (data.draw(st.integers(0, max_step - 1)), data.draw(st.integers(0, n_layers - 1)))
    b = (data.draw(st.integers(0, max_step - 1)), data.draw(st.integers(0, n_layers - 1)))
    oa, ob = rng_offset(a[0], n_layers, a[1]), rng_offset(b[0], n_layers, b[1])
    assert 0 <= oa < 2**32 and 0 <= ob < 2**32
    assert (oa == ob) == (a == b)
    assert rng_offset(2**40, n_layers, 0) == (2**40 * n_layers) % 2**32


def test_estimators_listed():
    assert ESTIMATORS == ("exact", "santa", "doublep")


def _run(code: str) -> subprocess.CompletedProcess:
    root = pathlib.Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=root)


def test_import_stochattn_imports_no_torch_and_no_transformers():
    r = _run("import sys, stochattn, stochattn.integrations, stochattn.integrations._config\n"
             "import stochattn.integrations.transformers\n"
             "print(sorted(m for m in ('torch', 'transformers', 'cupy') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_transformers_module_imports_lazily_and_says_what_to_install():
    # sys.modules[name] = None makes `import name` fail, whether or not it is installed.
    r = _run("import sys\nsys.modules['transformers'] = None\n"
             "from stochattn.integrations.transformers import register\n"
             "print('IMPORTED', 'torch' in sys.modules)\n"
             "register('stochattn', estimator='exact')")
    assert "IMPORTED False" in r.stdout, r.stderr
    assert r.returncode != 0
    assert "ImportError: stochattn.integrations.transformers needs PyTorch and transformers" in r.stderr
    assert 'pip install "stochattn[integrations]"' in r.stderr


def test_bad_arguments_are_reported_before_the_missing_framework():
    r = _run("import sys\nsys.modules['transformers'] = None\n"
             "from stochattn.integrations.transformers import register\n"
             "register('stochattn', estimator='santa')")
    assert "ValueError: `budget` is required with estimator='santa'" in r.stderr
