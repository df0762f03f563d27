"""Plan cache of :func:`stochattn.cuda.kmeans.kmeans_gpu`: one
:class:`~stochattn.cuda.kmeans.build.BuildPlan` per configuration, lent to one build at a
time (its ``in_use`` attribute, read and written under this module's lock).

A plan holds prepared launches whose argument lists a build rewrites (data pointers, the
seed, the round number) and small scratch that a build overwrites: two builds must never
share one. :func:`acquire` marks the plan it returns as in use; a build that finds the
plan of its configuration in use (another thread, same configuration and stream) builds
an uncached plan instead, and :func:`release` hands the plan back. The key holds the
stream, so builds on different streams never share scratch either.

The cache holds at most ``limit`` plans (the least recently used goes first); each keeps
O(B Hkv C) bytes of device scratch (the large buffers are allocated by every build), the
prepared launches, a cuBLAS wrapper and two events. :func:`clear` drops them all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["acquire", "offer", "release", "clear", "size"]

_plans: OrderedDict = OrderedDict()
_lock = threading.Lock()


def acquire(key):
    """The cached plan of ``key``, now marked in use, or None (no plan, or it is in use)."""
    with _lock:
        plan = _plans.get(key)
        if plan is None or plan.in_use:
            return None
        _plans.move_to_end(key)
        plan.in_use = True
        return plan


def offer(key, plan, limit: int) -> bool:
    """Cache ``plan`` (new, in use by the caller) under ``key`` unless the key already has
    one or ``limit`` is 0; True when cached (then :func:`release` it after the build)."""
    if limit <= 0:
        return False
    with _lock:
        if key in _plans:
            return False
        while len(_plans) >= limit:
            _plans.popitem(last=False)
        _plans[key] = plan
        plan.in_use = True
        return True


def release(plan) -> None:
    """Hand back a plan from :func:`acquire` or a cached :func:`offer`."""
    with _lock:
        plan.in_use = False


def clear() -> None:
    """Forget every cached plan (plans in use finish their build first)."""
    with _lock:
        _plans.clear()


def size() -> int:
    """Number of cached plans."""
    return len(_plans)
