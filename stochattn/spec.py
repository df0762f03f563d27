"""The one specification both backends read: random-stream layout, names, defaults, Philox.

``stochattn.reference`` (NumPy) and ``stochattn.cuda`` (CuPy / Numba-CUDA) both import
from this module and never from each other. It imports NumPy only. ``docs/rng.md`` is the
prose version of the random-stream part, written for kernel authors.

Random streams (Philox-4x32-10, Salmon et al., SC'11; cuRAND's ``curand_Philox4x32_10``,
Random123's ``philox4x32``)::

    key     = (seed & 0xFFFFFFFF, seed >> 32)                     seed: 0 <= seed < 2**64
    counter = (draw, stream, (purpose << PURPOSE_SHIFT) | row, offset)   four uint32 words
        draw    index of the draw inside its stream (stratum m, feature j, token, ...)
        stream  tile, cluster or other sub-stream index (0 when unused)
        row     b * H + h, the (sequence, head) pair; row < ROW_LIMIT = 2**28
        purpose which random quantity (PURPOSE_*), < PURPOSE_LIMIT = 16
        offset  the caller's per-call counter (decode step, layer), < 2**32

Only the first output word ``x0`` is used; it becomes the uniform
``u = (2 * (x0 >> UNIFORM_SHIFT) + 1) * UNIFORM_SCALE`` on (0, 1), an odd multiple of
2**-24 (exact in float32, never 0 nor 1).

Constants
---------
PURPOSE_VALUE_SAMPLER (0)
    SANTA value stage: strata / systematic offset / iid spacings (per tile for flash).
PURPOSE_BERNOULLI (1)
    Bernoulli qK^T feature masks.
PURPOSE_KMEANS_INIT (2)
    Double-P k-means seeding (the random keys of a permutation of the middle tokens).
PURPOSE_CLUSTER_SAMPLER (3)
    Double-P with SANTA draws inside approximate clusters.
PURPOSE_BUDGET_PILOT (4)
    Pilot draws of error-targeted budgets (a lower bound of ||o||, docs/budgets.md).
    Purposes are never renumbered (that changes every draw); new ones take new values.
SAMPLERS
    Sample-point samplers of the value stage: ``iid``, ``stratified``, ``systematic``.
SCHEDULES
    SANTA schedules: ``global``, ``prop``, ``flash``.
SCORES
    Score stages (how the softmax weights are formed): ``exact``, ``bernoulli``.
DEFAULT_TOL
    Default k-means early-stop tolerance (0.05): the centroids stop moving after a round in
    which at most ``floor(tol * M)`` of the M middle tokens changed cluster
    (``stochattn/reference/kmeans.py`` says more); :func:`check_tol` validates a tolerance.

Philox
------
:func:`philox4x32_10` is the only Python Philox. Its body uses nothing but uint64 ``*``,
``+``, ``>>``, ``&`` and ``^`` on values below 2**64 (no product or sum overflows), so the
same function runs vectorised on NumPy uint64 arrays (``stochattn.reference.rng``) and,
compiled with ``numba.cuda.jit(device=True)``, inside the k-means kernels
(``stochattn.cuda.kmeans.kernels``). The CUDA C++ kernels use
``stochattn/cuda/kernels/philox.cuh``.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = [
    "PURPOSE_VALUE_SAMPLER",
    "PURPOSE_BERNOULLI",
    "PURPOSE_KMEANS_INIT",
    "PURPOSE_CLUSTER_SAMPLER",
    "PURPOSE_BUDGET_PILOT",
    "PURPOSE_SHIFT",
    "PURPOSE_LIMIT",
    "ROW_LIMIT",
    "UNIFORM_SHIFT",
    "UNIFORM_SCALE",
    "SAMPLERS",
    "SCHEDULES",
    "SCORES",
    "DEFAULT_TOL",
    "check_tol",
    "PHILOX_ROUNDS",
    "philox4x32_10",
]

# ---- random streams (docs/rng.md) ------------------------------------------------------

# Purposes: which random quantity a stream feeds. Never renumber (it changes every draw).
PURPOSE_VALUE_SAMPLER = 0  # SANTA value stage: strata / systematic offset / iid points
PURPOSE_BERNOULLI = 1  # Bernoulli qK^T feature masks
PURPOSE_KMEANS_INIT = 2  # Double-P k-means seeding (random keys of a permutation)
PURPOSE_CLUSTER_SAMPLER = 3  # Double-P with SANTA draws inside approximate clusters
PURPOSE_BUDGET_PILOT = 4  # pilot draws of error-targeted budgets

PURPOSE_SHIFT = 28  # counter word 2 = (purpose << PURPOSE_SHIFT) | row
PURPOSE_LIMIT = 1 << (32 - PURPOSE_SHIFT)  # purposes are < 16
ROW_LIMIT = 1 << PURPOSE_SHIFT  # rows are < 2**28

UNIFORM_SHIFT = 9  # u = (2 * (x0 >> 9) + 1) * 2**-24
UNIFORM_SCALE = 2.0**-24

# ---- names -----------------------------------------------------------------------------

SAMPLERS = ("iid", "stratified", "systematic")
SCHEDULES = ("global", "prop", "flash")
SCORES = ("exact", "bernoulli")

# ---- k-means defaults -------------------------------------------------------------------

#: Default early-stop tolerance of the k-means (fraction of middle tokens that change
#: cluster in a round, at or below which the centroids stop moving).
DEFAULT_TOL = 0.05


def check_tol(tol) -> float:
    """``tol``: a real number in [0, 1] (the k-means early-stop tolerance)."""
    if not isinstance(tol, numbers.Real) or isinstance(tol, (bool, np.bool_)):
        raise TypeError(f"`tol` must be a real number, got {type(tol).__name__}")
    tol = float(tol)
    if not 0.0 <= tol <= 1.0:  # also rejects NaN
        raise ValueError(f"`tol` must lie in [0, 1], got {tol}")
    return tol


# ---- Philox-4x32-10 ---------------------------------------------------------------------

PHILOX_ROUNDS = 10
# Module globals as np.uint64: NumPy keeps uint64 arithmetic in uint64 (a Python int
# operand could promote to float64 under NumPy < 2) and Numba freezes them as constants.
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 block function: the four output words of counter (c0..c3), key (k0, k1).

    Every argument is a uint32 value held as ``np.uint64`` (a NumPy uint64 scalar or array,
    or a uint64 in Numba); arrays broadcast. The results are uint32 values held in uint64.
    The 32x32 -> 64-bit products are exact in uint64, and the Weyl key bumps and the words
    are masked back to 32 bits. Written for both NumPy (vectorised) and
    ``numba.cuda.jit(device=True)``: keep it to uint64 operators on these globals.
    """
    for r in range(PHILOX_ROUNDS):
        if r > 0:  # key schedule: Weyl bump before every round but the first
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        p0 = _M0 * c0
        p1 = _M1 * c2
        n0 = (p1 >> _S32) ^ c1 ^ k0
        c1 = p1 & _MASK32
        c2 = (p0 >> _S32) ^ c3 ^ k1
        c3 = p0 & _MASK32
        c0 = n0
    return c0, c1, c2, c3
