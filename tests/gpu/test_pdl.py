"""Programmatic dependent launch (``TileConfig.pdl``): the kernel chains of S²ANTA-prop,
Double-P and the split-KV merge launch give, bit for bit, what they give without it.

PDL changes only when a kernel is scheduled, never what it computes (each dependent
kernel waits for the one before it in its STOCHATTN_PDL_ENTRY), so the assertions are
exact: equal outputs and indices, over many back-to-back calls (a missing wait would show
as a call that reads a buffer before its producer has written it), and under CUDA-graph
capture with torch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn.cuda import _module, _sources  # noqa: E402
from stochattn.cuda.doublep import doublep_decode  # noqa: E402
from stochattn.cuda.exact import exact_decode  # noqa: E402
from stochattn.cuda.santa import santa_prop  # noqa: E402
from stochattn.doublep import build_doublep_index  # noqa: E402

from gpu_helpers import peaked_inputs, to_device, to_host  # noqa: E402

pytestmark = pytest.mark.gpu

REPEATS = 20


@pytest.fixture
def pdl_config():
    """Yields a function that runs its argument with PDL off, then on, and returns both."""
    base = _sources.get_config()

    def both(fn):
        res = []
        for pdl in (False, True):
            prev = _sources.set_config(dataclasses.replace(base, pdl=pdl))
            try:
                res.append(fn())
            finally:
                _sources.set_config(prev)
        return res

    return both


def _host(x):
    return [to_host(a) for a in x] if isinstance(x, tuple) else [to_host(x)]


def _inputs(B=3, Hkv=2, G=4, N=5000, D=128, dtype="float16", seed=0):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed)
    lens = np.asarray([N, 1234, 1][:B], dtype=np.int32)
    return tuple(to_device(a, dtype) for a in (q, k, v)) + (cupy.asarray(lens),)


def _repeat(fn):
    """REPEATS back-to-back calls without synchronising between them; every result kept."""
    outs = [fn() for _ in range(REPEATS)]
    cupy.cuda.get_current_stream().synchronize()
    return [_host(o) for o in outs]


def _assert_all_equal(off, on):
    for a in off + on:
        for x, y in zip(off[0], a):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kernel", ["tc", "simt"])
@pytest.mark.parametrize("sampler", ["systematic", "iid"])
def test_prop_chain_is_unchanged_by_pdl(pdl_config, kernel, sampler):
    q, k, v, lens = _inputs()
    off, on = pdl_config(lambda: _repeat(lambda: santa_prop(
        q, k, v, lens, budget=256, sampler=sampler, seed=3, return_indices=True, kernel=kernel)))
    _assert_all_equal(off, on)


def test_prop_bernoulli_chain_is_unchanged_by_pdl(pdl_config):
    q, k, v, lens = _inputs()
    off, on = pdl_config(lambda: _repeat(lambda: santa_prop(
        q, k, v, lens, budget=128, seed=5, return_indices=True, kernel="simt",
        scores="bernoulli", bernoulli_draws=2)))
    _assert_all_equal(off, on)


def test_exact_merge_launch_is_unchanged_by_pdl(pdl_config, monkeypatch):
    monkeypatch.setattr(_module, "MERGE_IN_KERNEL", False)
    q, k, v, lens = _inputs(G=3)
    off, on = pdl_config(lambda: _repeat(lambda: exact_decode(q, k, v, lens, num_chunks=7)))
    _assert_all_equal(off, on)


@pytest.mark.parametrize("budget", [None, 64])
def test_doublep_chain_is_unchanged_by_pdl(pdl_config, budget):
    q, k, v, lens = _inputs(N=6000)
    index = build_doublep_index(k, v, lens, n_clusters=64, iterations=3, seed=1)
    off, on = pdl_config(lambda: _repeat(lambda: doublep_decode(
        q, k, v, index, p1=0.95, p2=0.7, budget=budget, seed=2,
        return_indices=budget is not None)))
    _assert_all_equal(off, on)


def test_prop_with_pdl_under_cuda_graph_capture(pdl_config):
    """Captured with PDL on (programmatic edges in the graph), replayed: the result of an
    eager call with PDL off."""
    torch = pytest.importorskip("torch")
    qn, kn, vn = peaked_inputs(2, 2, 4, 4096, 128, seed=9)
    q, k, v = (torch.as_tensor(a, device="cuda").half() for a in (qn, kn, vn))

    def run():
        if not _sources.get_config().pdl:
            return santa_prop(q, k, v, budget=256, seed=4).cpu()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            santa_prop(q, k, v, budget=256, seed=4)  # plan and compile outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = santa_prop(q, k, v, budget=256, seed=4)
        outs = []
        for _ in range(5):
            g.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        return torch.stack(outs).cpu()

    eager, graphed = pdl_config(run)
    for o in graphed:
        assert torch.equal(o, eager)
