"""Context-parallel decode over torch.distributed (Gloo, CPU processes): R processes give
the output of one process simulating R ranks, bit for bit, for exact, S²ANTA-prop (both
exchanges), S²ANTA-flash and Double-P (centroid, sampled, sampled after appends)
(docs/context_parallel.md). Needs PyTorch; skipped
without it. The NCCL run is ``torchrun -m stochattn.context_parallel.check`` on a GPU host.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed without Gloo", allow_module_level=True)

from stochattn.context_parallel import check  # noqa: E402
from stochattn.context_parallel.dist import TorchCollectives  # noqa: E402


class ReversedSum(TorchCollectives):
    """A planted bug: the sum over ranks in reverse rank order (NCCL's ring order, say)."""

    def all_reduce(self, values, op="sum"):
        if op != "sum":
            return super().all_reduce(values, op)
        t, home = self._tensor(values)
        stacked = self._gather(t)
        acc = stacked[-1].clone()
        for r in range(self.world_size - 2, -1, -1):
            acc += stacked[r]
        return [self._back(acc, home)]


CFG = check.default_config(tokens=300, tile=16, budget=24, clusters=4, window=16, grow=30)


def _spawn(world, tmp_path, collectives=TorchCollectives):
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/rendezvous"
    mp.start_processes(check.run_rank,
                       args=(world, init, "gloo", str(tmp_path), CFG, collectives),
                       nprocs=world, start_method="spawn", join=True)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_processes_equal_the_simulation_bit_for_bit(world, tmp_path):
    reports = _spawn(world, tmp_path)
    for rank, rep in enumerate(reports):
        assert set(rep) == set(check.ALGORITHMS)
        for name, r in rep.items():
            assert r["bitwise"], (world, rank, name, r)
    assert check.summary_ok(reports)
    # every rank computed some of Double-P's exact tokens: the split did split the work
    for name in ("doublep", "doublep-sample", "doublep-append"):
        assert all(np.sum(rep[name]["tokens_exact_local"]) > 0 for rep in reports)


def test_the_check_catches_a_sum_in_another_order(tmp_path):
    """prop's all-reduce is the one float sum (sampled Double-P all-gathers instead):
    summed in reverse rank order its bits change at 4 ranks (by rounding only), and the
    check says so for both exchanges."""
    reports = _spawn(4, tmp_path, ReversedSum)
    for rep in reports:
        for name in ("prop-tiles", "prop-totals"):
            assert not rep[name]["bitwise"]
            assert 0 < rep[name]["max_abs_diff"] < 1e-12
        for name in ("exact", "flash", "doublep", "doublep-sample", "doublep-append"):
            assert rep[name]["bitwise"]


def _one_rank_group(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0,
                                world_size=1)


def test_one_rank_in_process_types_and_errors(tmp_path):
    _one_rank_group(tmp_path)
    try:
        comm = TorchCollectives()
        assert comm.world_size == 1 and comm.local_ranks == (0,)
        x = np.arange(6, dtype=np.float64).reshape(2, 3)
        (g,) = comm.all_gather([x])
        assert isinstance(g, np.ndarray) and g.shape == (1, 2, 3)
        np.testing.assert_array_equal(g[0], x)
        u = np.array([1, 0, 3], dtype=np.uint8)
        (m,) = comm.all_reduce([u], "max")
        np.testing.assert_array_equal(m, u)
        t = torch.ones(4, dtype=torch.float32)
        (s,) = comm.all_reduce([t], "sum")
        assert isinstance(s, torch.Tensor) and torch.equal(s, t)
        (m,) = comm.all_reduce([x], "max")
        assert m is not x  # the caller's array is never written
        assert comm.log == [("all_gather", 48), ("all_reduce_max", 3), ("all_reduce_sum", 16),
                            ("all_reduce_max", 48)]
        with pytest.raises(ValueError, match="one value"):
            comm.all_gather([x, x])
        with pytest.raises(ValueError, match="`op`"):
            comm.all_reduce([x], "min")
        with pytest.raises(TypeError, match="uint8"):
            comm.all_gather([np.ones(3, dtype=bool)])
    finally:
        dist.destroy_process_group()


def test_refuses_an_uninitialised_group():
    if dist.is_initialized():  # pragma: no cover - another test left one
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchCollectives()
