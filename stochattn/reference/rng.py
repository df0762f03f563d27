"""Counter-based random numbers shared by the NumPy reference and the CUDA kernels.

Generator: Philox-4x32-10 (Salmon et al., SC'11), the same generator as cuRAND's
``curand_Philox4x32_10`` and Random123's ``philox4x32``. A draw is a pure function of a
64-bit key and a 128-bit counter, so any thread (or NumPy vector lane) computes any draw
without a shared state, and the GPU reproduces the reference bit for bit.

Stream layout (written once; ``docs/rng.md`` repeats it for kernel authors)::

    key     = (seed & 0xFFFFFFFF, seed >> 32)                     seed: 0 <= seed < 2**64
    counter = (draw, stream, (purpose << 28) | row, offset)        four uint32 words
        draw    index of the draw inside its stream (stratum m, feature j, ...)
        stream  tile, cluster or other sub-stream index (0 when unused)
        row     b * H + h: the (sequence, head) pair the draw belongs to, H the number of
                heads that own independent draws (query heads, or KV heads for draws
                shared by a GQA group); row < 2**28
        purpose which random quantity this is (constants below), < 16
        offset  the per-call counter chosen by the caller (decode step, layer), < 2**32

Only the first output word x0 of each Philox block is used. It becomes a uniform on the
open interval (0, 1) as ``u = (2 * (x0 >> 9) + 1) * 2**-24``: an odd multiple of 2**-24,
exactly representable in float32 and float64, never 0 (so ``log(u)`` is finite) and never
1. CUDA computes the same value with ``((x0 >> 9) * 2u + 1u) * 0x1p-24f``.

The constants and the Philox block function live in :mod:`stochattn.spec`, which the CUDA
backend reads too; this module re-exports the ``PURPOSE_*`` constants.
"""

from __future__ import annotations

import numpy as np

from ..spec import (
    PURPOSE_BERNOULLI,
    PURPOSE_CLUSTER_SAMPLER,
    PURPOSE_KMEANS_INIT,
    PURPOSE_SHIFT,
    PURPOSE_VALUE_SAMPLER,
    ROW_LIMIT,
    UNIFORM_SCALE,
    UNIFORM_SHIFT,
    philox4x32_10,
)

__all__ = [
    "PURPOSE_VALUE_SAMPLER",
    "PURPOSE_BERNOULLI",
    "PURPOSE_KMEANS_INIT",
    "PURPOSE_CLUSTER_SAMPLER",
    "philox4x32",
    "random_words",
    "uniforms",
]

def philox4x32(counter, key):
    """Philox-4x32-10 block function, vectorised over the leading axes.

    A NumPy front end of :func:`stochattn.spec.philox4x32_10` (the block function the Numba
    k-means kernels compile too).

    Parameters
    ----------
    counter : sequence of 4 array_like of uint32
        The four counter words (broadcast together).
    key : sequence of 2 int
        The two key words.

    Returns
    -------
    tuple of 4 ndarray of uint32
        The four output words.
    """
    c = [np.asarray(w, dtype=np.uint64) for w in np.broadcast_arrays(*counter)]
    k0 = np.uint64(int(key[0]) & 0xFFFFFFFF)
    k1 = np.uint64(int(key[1]) & 0xFFFFFFFF)
    out = philox4x32_10(c[0], c[1], c[2], c[3], k0, k1)
    return tuple(w.astype(np.uint32) for w in out)


def _per_row(name: str, value, row: np.ndarray, heads):
    """``value`` (an int, or an integer array of shape () or (B,): one per sequence) as
    uint64 words broadcastable against ``row``; sequence ``b = row // heads``."""
    value = np.asarray(value)
    if value.ndim == 0:
        return np.uint64(int(value))
    if heads is None:
        raise ValueError(f"a per-sequence `{name}` needs the heads per sequence (`heads`) to "
                         "find each row's sequence")
    return value.astype(np.uint64)[row // np.uint64(heads)]


def random_words(seed, offset, purpose: int, row, stream, draw, *, heads=None):
    """First Philox output word for each (row, stream, draw), broadcast together.

    Parameters
    ----------
    seed : int or integer ndarray of shape (B,)
        64-bit seed, ``0 <= seed < 2**64``; an array gives sequence ``b`` the seed
        ``seed[b]``.
    offset : int or integer ndarray of shape (B,)
        Per-call counter, ``0 <= offset < 2**32``; an array gives sequence ``b`` its own.
    purpose : int
        One of the ``PURPOSE_*`` constants.
    row, stream, draw : array_like of int
        Counter fields of the layout above (broadcast together).
    heads : int, optional
        Rows per sequence (``row = b * heads + h``); needed with per-sequence seeds or
        offsets.

    Returns
    -------
    ndarray of uint32
    """
    row = np.asarray(row, dtype=np.uint64)
    if row.size and int(row.max()) >= ROW_LIMIT:
        raise ValueError(f"row index must be below 2**28, got {int(row.max())}")
    word2 = (np.uint64(purpose) << np.uint64(PURPOSE_SHIFT)) | row
    seeds = _per_row("seed", seed, row, heads)
    words = _per_row("offset", offset, row, heads) & np.uint64(0xFFFFFFFF)
    mask = np.uint64(0xFFFFFFFF)
    out = philox4x32_10(np.asarray(draw, dtype=np.uint64), np.asarray(stream, dtype=np.uint64),
                        word2, words, seeds & mask, (seeds >> np.uint64(32)) & mask)
    return np.asarray(out[0]).astype(np.uint32)


def uniforms(seed, offset, purpose: int, row, stream, draw, *, heads=None) -> np.ndarray:
    """Uniforms on (0, 1) for each (row, stream, draw) of the layout, as float64
    (``seed``, ``offset``, ``heads`` as in :func:`random_words`).

    The value is ``(2 * (x0 >> 9) + 1) * 2**-24``, exactly representable in float32.
    """
    x0 = random_words(seed, offset, purpose, row, stream, draw, heads=heads).astype(np.uint64)
    return ((x0 >> np.uint64(UNIFORM_SHIFT)) * np.uint64(2) + np.uint64(1)).astype(np.float64) * UNIFORM_SCALE
