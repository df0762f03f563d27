"""Programmatic dependent launch (``TileConfig.pdl``): the kernel chains of S²ANTA-prop,
Double-P and the split-KV merge launch give, bit for bit, what they give without it.

PDL changes only when a kernel is scheduled, never what it computes (each dependent
kernel waits for the one before it in its STOCHATTN_PDL_ENTRY), so the assertions are
exact: equal outputs and indices over many back-to-back calls, and under CUDA-graph
capture with torch. The calls alternate between two different inputs, so that a kernel
that read a scratch buffer before its producer wrote it would find the other input's
values there (the allocator hands the same block to the next call) and the comparison
would fail; and each test checks that the dependent launches really went through
cuLaunchKernelEx, so that it cannot pass with PDL silently off.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from stochattn.cuda import config  # noqa: E402
from stochattn.cuda.runtime import pdl as _pdl  # noqa: E402
from stochattn.cuda.doublep import doublep_decode  # noqa: E402
from stochattn.cuda.exact import exact_decode  # noqa: E402
from stochattn.cuda.flash import santa_flash  # noqa: E402
from stochattn.cuda.santa import santa_prop  # noqa: E402
from stochattn.doublep import build_doublep_index  # noqa: E402

from gpu_helpers import peaked_inputs, to_device, to_host  # noqa: E402

pytestmark = pytest.mark.gpu

REPEATS = 20


@pytest.fixture
def pdl_config(monkeypatch):
    """Yields a function that runs its argument with PDL off, then on, and returns both
    results; with PDL on at least ``min_dependent`` launches must have been dependent
    ones (cuLaunchKernelEx with the attribute), with it off none."""
    count = [0]
    call = _pdl.PdlLaunch.__call__

    def counted(self, stream_ptr):
        count[0] += 1
        return call(self, stream_ptr)

    monkeypatch.setattr(_pdl.PdlLaunch, "__call__", counted)

    def both(fn, min_dependent=1):
        res = []
        for pdl in (False, True):
            prev = config.set_config(pdl=pdl)
            count[0] = 0
            try:
                res.append(fn())
            finally:
                config.set_config(config=prev)
            if pdl:
                assert count[0] >= min_dependent, "PDL was asked for but no launch used it"
            else:
                assert count[0] == 0
        return res

    return both


def _host(x):
    return [to_host(a) for a in x] if isinstance(x, tuple) else [to_host(x)]


def _inputs(B=3, Hkv=2, G=4, N=5000, D=128, dtype="float16", seed=0):
    q, k, v = peaked_inputs(B, Hkv, G, N, D, seed=seed)
    lens = np.asarray([N, 1234, 1][:B], dtype=np.int32)
    return tuple(to_device(a, dtype) for a in (q, k, v)) + (cupy.asarray(lens),)


def _two_inputs(**kw):
    return _inputs(seed=0, **kw), _inputs(seed=1, **kw)


def _repeat(fn, inputs):
    """REPEATS back-to-back calls, alternating between the input sets, without
    synchronising between them; every result kept."""
    outs = [fn(*inputs[i % len(inputs)]) for i in range(REPEATS)]
    cupy.cuda.get_current_stream().synchronize()
    return [_host(o) for o in outs]


def _assert_all_equal(off, on):
    """Call i with PDL equals call i without; calls on the same input agree."""
    assert len(off) == len(on) == REPEATS
    for i, (a, b) in enumerate(zip(off, on)):
        for x, y, z in zip(a, b, off[i % 2]):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(x, z)


@pytest.mark.parametrize("kernel", ["tc", "simt"])
@pytest.mark.parametrize("sampler", ["systematic", "iid"])
def test_prop_chain_is_unchanged_by_pdl(pdl_config, kernel, sampler):
    inputs = _two_inputs()
    off, on = pdl_config(lambda: _repeat(lambda q, k, v, lens: santa_prop(
        q, k, v, lens, budget=256, sampler=sampler, seed=3, return_indices=True, kernel=kernel),
        inputs), min_dependent=REPEATS)
    _assert_all_equal(off, on)


def test_prop_bernoulli_chain_is_unchanged_by_pdl(pdl_config):
    inputs = _two_inputs()
    off, on = pdl_config(lambda: _repeat(lambda q, k, v, lens: santa_prop(
        q, k, v, lens, budget=128, seed=5, return_indices=True, kernel="simt",
        scores="bernoulli", bernoulli_draws=2), inputs), min_dependent=3 * REPEATS)
    _assert_all_equal(off, on)


@pytest.mark.parametrize("fn", [exact_decode, lambda *a, **kw: santa_flash(*a, budget=300, **kw)],
                         ids=["exact", "flash"])
def test_merge_launch_is_unchanged_by_pdl(pdl_config, monkeypatch, fn):
    inputs = _two_inputs(G=3)
    with config.using_config(merge_in_kernel=False):
        off, on = pdl_config(lambda: _repeat(lambda q, k, v, lens: fn(q, k, v, lens, num_chunks=7),
                                             inputs), min_dependent=REPEATS)
    _assert_all_equal(off, on)


@pytest.mark.parametrize("budget", [None, 64])
def test_doublep_chain_is_unchanged_by_pdl(pdl_config, budget):
    inputs = []
    for q, k, v, lens in _two_inputs(N=6000):
        index = build_doublep_index(k, v, lens, n_clusters=64, iterations=3, seed=1)
        inputs.append((q, k, v, index))
    # a fixed token split, so that both builds merge the same partials in the same order
    off, on = pdl_config(lambda: _repeat(lambda q, k, v, index: doublep_decode(
        q, k, v, index, p1=0.95, p2=0.7, budget=budget, seed=2, num_chunks=4,
        return_indices=budget is not None), inputs), min_dependent=4 * REPEATS)
    _assert_all_equal(off, on)


def test_prop_with_pdl_under_cuda_graph_capture(pdl_config):
    """Captured with PDL on (programmatic edges in the graph), replayed: the result of an
    eager call with PDL off."""
    torch = pytest.importorskip("torch")
    qn, kn, vn = peaked_inputs(2, 2, 4, 4096, 128, seed=9)
    q, k, v = (torch.as_tensor(a, device="cuda").half() for a in (qn, kn, vn))

    def run():
        if not config.get_config().pdl:
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

    eager, graphed = pdl_config(run, min_dependent=2)  # the warm-up and the capture
    for o in graphed:
        assert torch.equal(o, eager)
