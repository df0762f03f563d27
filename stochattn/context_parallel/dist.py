"""Collectives over ``torch.distributed``: one process per rank, NCCL between GPUs, Gloo
between CPU processes (docs/context_parallel.md, "Over torch.distributed").

The algorithms of this package are written as phases (a local phase for each rank the
process drives, then a collective), so the same code runs over
:class:`~stochattn.context_parallel.core.SimulatedCollectives` (every rank in one
process) and over :class:`TorchCollectives` (this process's rank only). Both give the same
bits: an all-gather stacks the ranks' values in rank order, a max is exact, and a sum is
formed as the simulation forms it (the gathered values added in rank order, not the
library's ring or tree order), so R processes give the output of one process simulating R
ranks, bit for bit. The sum's extra traffic is R - 1 copies of a (B, Hq, D) payload per
step (S²ANTA-prop's only all-reduce of floats): kilobytes.

Launch the ranks the usual way (``torchrun --nproc-per-node R ...``, or any launcher that
calls ``torch.distributed.init_process_group``); ``python -m
stochattn.context_parallel.check`` is such a program.
"""

from __future__ import annotations

import numpy as np

from .core import Collectives


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - the optional dependency
        raise ImportError("TorchCollectives needs PyTorch with torch.distributed") from e
    if not dist.is_available():  # pragma: no cover
        raise ImportError("this PyTorch build has no torch.distributed")
    return torch, dist


class TorchCollectives(Collectives):
    """:class:`Collectives` over an initialised ``torch.distributed`` process group.

    The process drives one rank, ``local_ranks == (rank,)``, its rank in ``group``; every
    method takes and returns a one-element list, as :class:`Collectives` specifies.
    Values are NumPy arrays (the reference's phases) or torch tensors; they travel as torch
    tensors on ``device`` (default: the current CUDA device under NCCL, else the CPU) and
    come back as the type they came in (NumPy on the host; a tensor on its own device).
    Every rank must pass the same shape and dtype, as with the library's collectives; a
    mismatch is the collective library's error (or a hang), not checked here, since the
    check would cost a collective of its own.

    ``log`` records ``(op, bytes per rank)`` as :class:`SimulatedCollectives` does (the
    operation asked for: a sum logs ``all_reduce_sum`` with the payload's bytes, though it
    moves R times that).
    """

    def __init__(self, group=None, device=None):
        torch, dist = _torch()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group first (torchrun does not "
                               "call it for you)")
        self._torch, self._dist, self.group = torch, dist, group
        self.world_size = dist.get_world_size(group)
        self.local_ranks = (dist.get_rank(group),)
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = (torch.device("cuda", torch.cuda.current_device()) if nccl
                      else torch.device("cpu"))
        self.device = torch.device(device)
        self.log: list[tuple[str, int]] = []

    def _tensor(self, values):
        if len(values) != 1:
            raise ValueError(f"expected one value (this process's rank {self.local_ranks[0]}), "
                             f"got {len(values)}")
        x = values[0]
        # a copy: the in-place all-reduce must not write into the caller's array
        if isinstance(x, self._torch.Tensor):
            return x.to(self.device, copy=True).contiguous(), x.device
        x = np.ascontiguousarray(x)
        if x.dtype == np.bool_:
            raise TypeError("boolean payloads are not sent: pass uint8")
        return self._torch.from_numpy(x).to(self.device, copy=True), None

    def _back(self, t, home):
        return t.to(home) if home is not None else t.cpu().numpy()

    def _gather(self, t):
        """(world_size, *t.shape), rank order: gathered flat (Gloo takes only the
        concatenated form), then viewed."""
        flat = t.reshape(-1)
        out = self._torch.empty(self.world_size * flat.numel(), dtype=t.dtype,
                                device=self.device)
        gather = (getattr(self._dist, "all_gather_single", None)  # torch >= 2.13
                  or self._dist.all_gather_into_tensor)
        gather(out, flat, group=self.group)
        return out.view((self.world_size,) + tuple(t.shape))

    def all_gather(self, values):
        t, home = self._tensor(values)
        self.log.append(("all_gather", t.numel() * t.element_size()))
        return [self._back(self._gather(t), home)]

    def all_reduce(self, values, op: str = "sum"):
        if op not in ("sum", "max"):
            raise ValueError(f"`op` must be 'sum' or 'max', got {op!r}")
        t, home = self._tensor(values)
        self.log.append((f"all_reduce_{op}", t.numel() * t.element_size()))
        if op == "max":
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
            return [self._back(t, home)]
        stacked = self._gather(t)  # rank order, then the simulation's sum order
        acc = stacked[0].clone()
        for r in range(1, self.world_size):
            acc += stacked[r]
        return [self._back(acc, home)]
