"""Sub-centroids of a GPU Double-P index (``build_doublep_index(..., mass="sub")``, issue 31).

Each cluster's members (its CSR, :func:`stochattn.cuda.doublep_index.csr_gpu`) are split
recursively by the sign of their projection on the part's top principal direction into
``n_sub`` parts, as :func:`stochattn.reference.cluster_mass.index_sub_stats`; the parts'
key means and sizes are the index's ``sub_centroids`` (float32) and ``sub_sizes`` (int32).
The arithmetic is :func:`stochattn.eval.mass_batched.sub_stats` on CuPy arrays, in float64,
with each split direction from 20 squarings of the part's covariance instead of an SVD
(tests/test_doublep_sub.py compares the two on the host: equal sizes, means within 1e-9 of
each other relative to the keys' scale, unless a key lies on a split hyperplane within
rounding). Torch indexes go through DLPack (zero copy); a bfloat16 cache is widened to a
float32 copy first (CuPy has no bfloat16).

The build synchronises: the chunking of the clusters reads their sizes on the host. An
index's sub-centroids never move afterwards; appends add each token to the nearest one
(doublep_append.cu, the reference's :func:`~stochattn.reference.cluster_mass.append_sub_tokens`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["sub_stats_gpu", "SQUARINGS"]

#: Squarings of each part's covariance per split direction (mass_batched.sub_stats).
SQUARINGS = 20


def _as_xp(api, a):
    """(xp module, ``a`` as an array of it): NumPy (the simulator's index), else CuPy (a torch
    tensor through DLPack, zero copy)."""
    if api.name == "numpy":
        return np, np.asarray(a)
    import cupy

    if api.name == "torch":
        from .runtime.arrays import to_cupy

        return cupy, to_cupy("k", a)
    return cupy, a


def _back(api, like, a):
    """``a`` (an xp array) in the framework of ``like`` (the index's)."""
    if api.name == "torch":
        import torch

        return torch.from_dlpack(a)
    return a


def sub_stats_gpu(index, k, n_sub):
    """``(sub_centroids (B, Hkv, C, n_sub, D) float32, sub_sizes (B, Hkv, C, n_sub) int32)``
    of a GPU index built from the cache ``k`` (a GPU array (B, Hkv, N, D), or a GPU PagedKV,
    gathered into a contiguous temporary), in the index's framework and on its device."""
    from ..eval.mass_batched import sub_stats
    from . import doublep_index as dx

    api = dx._api_of_array("index", index.centroids)
    if dx._is_paged(k):
        k = dx.gather_prefix(k)[0]
    with api.scope(api.device(index.centroids)):
        if api.name == "torch" and str(k.dtype) == "torch.bfloat16":
            k = k.float()
        elif api.name == "cupy" and api.dtype_name(k) == "bfloat16":
            k = api.widen_bf16(k)
        offsets, token_ids = dx.csr_gpu(index)
        xp, K = _as_xp(api, k)
        _, off = _as_xp(api, offsets)
        _, tok = _as_xp(api, token_ids)
        B, Hkv, C = (int(s) for s in index.sizes.shape)
        N, D = int(K.shape[2]), int(K.shape[3])
        M = int(tok.shape[-1])
        pairs = B * Hkv
        starts = (off[..., :-1] + (xp.arange(pairs, dtype=xp.int64) * M).reshape(B, Hkv, 1)).ravel()
        sizes = off[..., 1:] - off[..., :-1]
        src = np.repeat(np.arange(pairs), C)
        sz, means = sub_stats(xp, K.reshape(pairs, N, D), src, starts, sizes.ravel(),
                              xp.maximum(tok, 0).reshape(-1), n_sub=n_sub, squarings=SQUARINGS)
        sub_centroids = means.astype(xp.float32).reshape(B, Hkv, C, n_sub, D)
        sub_sizes = sz.astype(xp.int32).reshape(B, Hkv, C, n_sub)
    return _back(api, index.centroids, sub_centroids), _back(api, index.centroids, sub_sizes)
