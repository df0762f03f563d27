"""Random streams read on the device (docs/rng.md, issue "Serving-grade decode" item 1).

``seed`` and ``offset`` as GPU arrays of shape () or (B,) are read by the kernels at run
time, so a captured CUDA graph draws fresh numbers on every replay when the plan advances
the offset on the device. All assertions are exact (same draws, bit for bit):

- a device scalar draws what the same host int draws;
- a (B,) device vector gives sequence b what the host ints seed[b], offset[b] give it;
- ``advance_offset=True``: N eager calls draw what offsets o, o+1, ..., o+N-1 draw, and the
  device offset ends at o+N (mod 2**32);
- a torch CUDA graph of one such call, replayed N times, draws what N eager calls with
  offsets o..o+N-1 draw (the bug this fixes: every replay returned the same output).
"""

from __future__ import annotations

import numpy as np
import pytest

import stochattn
from gpu_helpers import peaked_inputs

pytestmark = pytest.mark.gpu

B, HKV, G, N, D = 3, 2, 4, 700, 128

# (name, plan maker, needs an index): every stochastic estimator with a GPU kernel.
PLANS = [
    ("prop tc", lambda **o: stochattn.SantaPlan(budget=64, device="cuda", **o), False),
    ("prop simt stratified", lambda **o: stochattn.SantaPlan(budget=64, sampler="stratified",
                                                            device="cuda", **o), False),
    ("prop bernoulli", lambda **o: stochattn.SantaPlan(budget=64, scores="bernoulli",
                                                      device="cuda", **o), False),
    ("flash iid", lambda **o: stochattn.SantaPlan(budget=256, schedule="flash", sampler="iid",
                                                  device="cuda", **o), False),
    ("double-p sampled", lambda **o: stochattn.DoublePPlan(approx="sample", budget=32,
                                                           device="cuda", **o), True),
]


@pytest.fixture(scope="module")
def inputs():
    torch = pytest.importorskip("torch")
    qn, kn, vn = peaked_inputs(B, HKV, G, N, D, seed=21)
    q, k, v = (torch.as_tensor(a, device="cuda").half() for a in (qn, kn, vn))
    lens = torch.tensor([N, 333, 1], dtype=torch.int32, device="cuda")
    index = stochattn.build_doublep_index(k, v, lens, n_clusters=16)
    return q, k, v, lens, index


def _call(plan, inputs, needs_index, **stream):
    q, k, v, lens, index = inputs
    extra = dict(index=index) if needs_index else {}
    return plan.run(q, k, v, None if needs_index else lens, **extra, **stream)


@pytest.mark.parametrize("name, make, needs_index", PLANS, ids=[p[0] for p in PLANS])
def test_device_scalars_and_vectors_draw_what_host_ints_draw(inputs, name, make, needs_index):
    import torch

    plan = make()
    want = _call(plan, inputs, needs_index, seed=11, offset=7)
    for dtype in (torch.int64, torch.int32):
        got = _call(plan, inputs, needs_index, seed=torch.tensor(11, device="cuda"),
                    offset=torch.tensor(7, dtype=dtype, device="cuda"))
        assert torch.equal(got, want), (name, dtype)
    seeds, offsets = [11, 2**40 + 3, 5], [7, 2**32 - 1, 0]
    got = _call(plan, inputs, needs_index, seed=torch.tensor(seeds, device="cuda"),
                offset=torch.tensor(offsets, device="cuda"))
    for b in range(B):
        one = _call(plan, inputs, needs_index, seed=seeds[b], offset=offsets[b])
        assert torch.equal(got[b], one[b]), (name, b)


@pytest.mark.parametrize("name, make, needs_index", PLANS, ids=[p[0] for p in PLANS])
def test_advance_offset_on_the_device_under_eager_calls_and_graph_replays(inputs, name, make,
                                                                          needs_index):
    import torch

    fixed = make()
    want = [_call(fixed, inputs, needs_index, seed=3, offset=o) for o in (9, 10, 11, 12)]
    assert not torch.equal(want[0], want[1]), name  # fresh draws per offset
    plan = make(advance_offset=True)
    offset = torch.tensor(9, dtype=torch.int64, device="cuda")
    for i in range(2):
        assert torch.equal(_call(plan, inputs, needs_index, seed=3, offset=offset), want[i])
    assert int(offset) == 11
    s = torch.cuda.Stream()  # warm-up (plans, compiles) outside the capture
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _call(plan, inputs, needs_index, seed=3, offset=torch.tensor(0, device="cuda"))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _call(plan, inputs, needs_index, seed=3, offset=offset)
    assert int(offset) == 11  # capturing runs nothing
    for i in (2, 3):
        g.replay()
        assert torch.equal(out, want[i]), (name, i)
    assert int(offset) == 13


def test_the_offset_wraps_at_2_to_the_32():
    import torch

    q = torch.zeros((1, 4, 128), dtype=torch.float16, device="cuda")
    k = torch.zeros((1, 1, 64, 128), dtype=torch.float16, device="cuda")
    plan = stochattn.SantaPlan(budget=8, device="cuda", advance_offset=True)
    offset = torch.tensor([2**32 - 1], dtype=torch.int64, device="cuda")
    plan.run(q, k, k, seed=0, offset=offset)
    assert int(offset[0]) == 0
