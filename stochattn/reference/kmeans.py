"""k-means index of Double-P (docs/estimators.md), NumPy reference in float64.

Token ranges of a sequence of length L, with ``window_start = max(n_sink, L - window)``::

    sinks   [0, min(n_sink, L))           always exact, never clustered
    middle  [n_sink, window_start)         clustered (empty when L <= n_sink + window)
    window  [window_start, L)              always exact, never clustered

One k-means per (sequence b, KV head) over the keys of its M middle tokens:

- **Initialisation.** Middle token j gets the random key
  ``random_words(seed, 0, PURPOSE_KMEANS_INIT, row=b * Hkv + kvh, stream=0, draw=j)``
  (j the absolute position). Tokens are ordered by (key, position) and the first
  ``min(C, M)`` of that order become the centroids of clusters ``0 .. min(C, M) - 1``, in
  that order: a uniformly random subset of distinct tokens, reproducible on the GPU.
  These clusters are *live*; clusters ``min(C, M) .. C - 1`` are not (centroid 0, size 0)
  and never take a token at build time.
- **Distance.** Token k and centroid c are compared by ``|c|^2 - 2 k.c`` in float64:
  the squared Euclidean distance ``|k - c|^2`` minus ``|k|^2``, a term common to every
  cluster of one token, so dropping it changes no decision and avoids adding a large
  constant that would round small differences away. ``|c|^2`` is ``sum(c * c)`` over D.
- **Assignment.** Each token goes to the live cluster of smallest distance; ties go to the
  lowest cluster index (``argmin``). Live clusters that are momentarily empty still take
  part (they keep their previous centroid), non-live clusters never do.
- **Update.** Each live cluster moves to the mean of its members; a cluster left empty
  keeps its previous centroid. At most ``iterations`` rounds of assignment + update.
- **Early stop.** Per (sequence, KV head): let ``changed`` be the number of middle tokens
  whose cluster differs from the previous round's (all ``M`` of them in round 1). A round
  with ``changed == 0`` skips its update (it would reproduce the same centroids bit for
  bit); after a round with ``changed <= floor(tol * M)`` (float64 product) the
  centroids stop moving. ``tol = 0`` is plain Lloyd that stops at a fixed point; the
  default ``tol = DEFAULT_TOL = 0.05`` stops once at most 5% of the tokens change cluster
  in a round, which on keys with LLM-like statistics (``bench/calibrated.py``, 8k-128k
  tokens, N/32 and N/16 clusters) happens after 3-5 rounds, with a mean squared distance
  within about 1% of ten rounds' (``bench/bench_kmeans.py`` reports it) at about half
  their cost.
- **Final assignment.** One more assignment with the final centroids; sizes, value sums
  and labels come from it. The stored labels are therefore nearest-centroid for the
  stored centroids (among live clusters); the centroids need not be the means of the
  stored members.

Append (decode growth): when the sequence grows from L to L', the tokens in
``[window_start, window_start')`` leave the window and are absorbed one at a time in
position order. While a (b, KV head) has non-live clusters (``n_initialized < C``, which
happens only when the prompt had fewer middle tokens than clusters) the token seeds the
next one (centroid = its key, size 1); otherwise it joins its nearest live centroid (same
distance and tie rule) and the centroids do not move. Sizes and value sums are updated.
Each token is processed with the same arithmetic whether it arrives alone or in a batch,
so appending one token at a time gives the same index, bit for bit, as appending many.
"""

from __future__ import annotations

import numpy as np

from ..spec import DEFAULT_TOL, PURPOSE_KMEANS_INIT, check_tol
from .rng import random_words

__all__ = [
    "DEFAULT_TOL",
    "check_tol",
    "window_starts",
    "init_order",
    "assignment_scores",
    "nearest_centroid",
    "kmeans",
    "build_index",
    "append_tokens",
    "cluster_csr",
]

# DEFAULT_TOL and check_tol (re-exported) are defined in stochattn.spec, which the CUDA
# backend reads too; see the module docstring for what the tolerance does.


def window_starts(lens: np.ndarray, n_sink: int, window: int) -> np.ndarray:
    """First window position of each sequence, ``max(n_sink, L - window)``, int64 (B,)."""
    return np.maximum(n_sink, np.asarray(lens, dtype=np.int64) - window).astype(np.int64)


def init_order(seed: int, row, positions) -> np.ndarray:
    """Order of the middle tokens for the k-means seeding, per row.

    Parameters
    ----------
    seed : int
        The index seed.
    row : array_like of int, shape (H, 1)
        ``b * Hkv + kvh`` of each KV head.
    positions : ndarray of int, shape (M,)
        Absolute positions of the middle tokens, ascending.

    Returns
    -------
    ndarray of int64, shape (H, M)
        Indices into ``positions``, sorted by (random key, position).
    """
    keys = random_words(seed, 0, PURPOSE_KMEANS_INIT, row=row, stream=0, draw=positions[None, :])
    # Stable sort on the key alone: equal keys keep ascending position order.
    return np.argsort(keys, axis=-1, kind="stable")


def assignment_scores(keys: np.ndarray, centroids: np.ndarray, live) -> np.ndarray:
    """``|c|^2 - 2 k.c`` per (token, cluster); +inf for non-live clusters.

    Parameters
    ----------
    keys : ndarray of float64, shape (H, T, D)
    centroids : ndarray of float64, shape (H, C, D)
    live : array_like of int, shape (H,)
        Clusters ``0 .. live - 1`` are live.

    Returns
    -------
    ndarray of float64, shape (H, T, C)
    """
    C = centroids.shape[1]
    norms = np.sum(centroids * centroids, axis=-1)  # |c|^2, (H, C)
    dots = np.matmul(keys, np.swapaxes(centroids, 1, 2))  # k.c, (H, T, C)
    scores = norms[:, None, :] - 2.0 * dots
    is_live = np.arange(C)[None, None, :] < np.asarray(live)[:, None, None]
    return np.where(is_live, scores, np.inf)


def nearest_centroid(keys: np.ndarray, centroids: np.ndarray, live) -> np.ndarray:
    """Nearest live centroid of each key, ties to the lowest index: int64 (H, T)."""
    return np.argmin(assignment_scores(keys, centroids, live), axis=-1)


def _member_sums(labels: np.ndarray, rows: np.ndarray, n_clusters: int):
    """Per-cluster sums of ``rows`` (H, T, D) and counts, for labels (H, T).

    ``np.add.at`` is unbuffered and adds in index order, so each sum accumulates its
    members in ascending position order.
    """
    H, T, D = rows.shape
    flat = (labels + n_clusters * np.arange(H)[:, None]).ravel()
    sums = np.zeros((H * n_clusters, D))
    np.add.at(sums, flat, rows.reshape(H * T, D))
    counts = np.bincount(flat, minlength=H * n_clusters)
    return sums.reshape(H, n_clusters, D), counts.reshape(H, n_clusters).astype(np.int64)


def kmeans(keys: np.ndarray, n_clusters: int, iterations: int, order: np.ndarray,
           tol: float = DEFAULT_TOL):
    """Lloyd's k-means on (H, M, D) float64 keys with the seeding order of :func:`init_order`
    and the early stop of the module docstring (each of the H rows stops on its own).

    Returns
    -------
    centroids : ndarray of float64, shape (H, C, D)
    labels : ndarray of int64, shape (H, M)
        Final assignment (nearest live centroid of the returned centroids).
    live : ndarray of int64, shape (H,)
        ``min(C, M)``: clusters that hold a centroid.
    """
    H, M, D = keys.shape
    C = n_clusters
    n_live = min(C, M)
    live = np.full(H, n_live, dtype=np.int64)
    centroids = np.zeros((H, C, D))
    if n_live:
        first = order[:, :n_live]  # (H, n_live) token indices, in seeding order
        centroids[:, :n_live] = np.take_along_axis(keys, first[:, :, None], axis=1)
    if M == 0:
        return centroids, np.zeros((H, 0), dtype=np.int64), live
    threshold = np.floor(float(tol) * float(M))  # rounds with changed <= threshold stop
    stopped = np.zeros(H, dtype=bool)
    previous = None
    for _ in range(iterations):
        labels = nearest_centroid(keys, centroids, live)
        changed = (np.full(H, M) if previous is None
                   else np.count_nonzero(labels != previous, axis=1))
        moving = ~stopped & (changed > 0)  # changed == 0: the update is the identity
        if moving.any():
            sums, counts = _member_sums(labels, keys, C)
            filled = (counts > 0) & moving[:, None]
            # Mean of the members; a cluster left empty keeps its previous centroid.
            centroids = np.where(filled[:, :, None], sums / np.maximum(counts, 1)[:, :, None],
                                 centroids)
        stopped |= changed <= threshold
        if stopped.all():
            break
        previous = labels
    return centroids, nearest_centroid(keys, centroids, live), live


def check_finite_keys(k, lens) -> None:
    """An index is never built over non-finite keys (a NaN centroid would poison every
    decode that reads it): a ``ValueError`` naming the first bad (sequence, head, token).
    Keys past ``seq_lens`` are not read and do not count."""
    k = np.asarray(k)
    bad = ~np.isfinite(k).all(axis=-1) & (np.arange(k.shape[2])[None, None, :]
                                          < np.asarray(lens)[:, None, None])
    if bad.any():
        b, h, t = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"`k` holds a non-finite key (NaN or inf) at sequence {b}, head {h}, "
                         f"token {t}: an index cannot cluster it")


def build_index(k, v, lens, n_clusters, iterations, n_sink, window, seed, tol=DEFAULT_TOL):
    """Arrays of a Double-P index (see the module docstring; ``tol`` is the early-stop
    tolerance, checked by :func:`check_tol`).

    Returns
    -------
    dict with centroids (B, Hkv, C, D) float64, sizes (B, Hkv, C) int64, value_sums
    (B, Hkv, C, D) float64, labels (B, Hkv, N) int32, window_start (B,) int64 and
    n_initialized (B, Hkv) int64.
    """
    B, Hkv, N, D = k.shape
    C = n_clusters
    tol = check_tol(tol)
    check_finite_keys(k, lens)
    lens = np.asarray(lens, dtype=np.int64)
    ws = window_starts(lens, n_sink, window)
    centroids = np.zeros((B, Hkv, C, D))
    sizes = np.zeros((B, Hkv, C), dtype=np.int64)
    value_sums = np.zeros((B, Hkv, C, D))
    labels = np.full((B, Hkv, N), -1, dtype=np.int32)
    n_init = np.zeros((B, Hkv), dtype=np.int64)
    for b in range(B):
        M = int(ws[b]) - n_sink
        if M <= 0:
            continue  # no middle tokens: every cluster stays empty and non-live
        positions = np.arange(n_sink, ws[b], dtype=np.int64)
        keys = np.asarray(k[b, :, n_sink:ws[b]], dtype=np.float64)
        values = np.asarray(v[b, :, n_sink:ws[b]], dtype=np.float64)
        order = init_order(seed, b * Hkv + np.arange(Hkv)[:, None], positions)
        cent, lab, live = kmeans(keys, C, iterations, order, tol)
        sums, counts = _member_sums(lab, values, C)
        centroids[b], sizes[b], value_sums[b] = cent, counts, sums
        labels[b, :, n_sink:ws[b]] = lab
        n_init[b] = live
    return dict(centroids=centroids, sizes=sizes, value_sums=value_sums, labels=labels,
                window_start=ws, n_initialized=n_init)


def append_tokens(centroids, sizes, value_sums, labels, window_start, n_initialized,
                  k, v, new_lens, n_sink, window) -> None:
    """Absorb the tokens that left the window, in place (see the module docstring).

    ``labels`` must already cover the new positions; ``window_start`` is updated.
    """
    B, Hkv, C, _ = centroids.shape
    new_ws = window_starts(new_lens, n_sink, window)
    for b in range(B):
        start, stop = int(window_start[b]), int(new_ws[b])
        for h in range(Hkv):
            cent = centroids[b, h]
            for t in range(start, stop):
                key = np.asarray(k[b, h, t], dtype=np.float64)
                if n_initialized[b, h] < C:
                    # A cluster without a centroid is left: the token seeds it.
                    c = int(n_initialized[b, h])
                    cent[c] = key
                    n_initialized[b, h] += 1
                else:
                    # Same score as assignment_scores, one token at a time so that a
                    # bulk append does exactly the arithmetic of single appends.
                    scores = np.sum(cent * cent, axis=-1) - 2.0 * (cent @ key)
                    c = int(np.argmin(scores))
                labels[b, h, t] = c
                sizes[b, h, c] += 1
                value_sums[b, h, c] += np.asarray(v[b, h, t], dtype=np.float64)
        window_start[b] = max(start, stop)


def cluster_csr(labels, sizes, window_start, n_sink):
    """Tokens grouped by cluster: CSR offsets and token ids.

    Returns
    -------
    offsets : ndarray of int64, shape (B, Hkv, C + 1)
        Cluster c of (b, kvh) holds ``token_ids[b, kvh, offsets[c]:offsets[c + 1]]``.
    token_ids : ndarray of int64, shape (B, Hkv, M)
        Positions, grouped by cluster and ascending inside a cluster; M is the largest
        middle-token count over the batch; padded with -1.
    """
    B, Hkv, C = sizes.shape
    counts = np.maximum(np.asarray(window_start, dtype=np.int64) - n_sink, 0)
    M = int(counts.max()) if B else 0
    offsets = np.zeros((B, Hkv, C + 1), dtype=np.int64)
    offsets[:, :, 1:] = np.cumsum(sizes, axis=-1)  # prefix sums of the cluster sizes
    token_ids = np.full((B, Hkv, M), -1, dtype=np.int64)
    for b in range(B):
        m = int(counts[b])
        if m == 0:
            continue
        middle = labels[b, :, n_sink:n_sink + m]  # (Hkv, m)
        # Stable sort by label: positions stay ascending inside each cluster.
        token_ids[b, :, :m] = n_sink + np.argsort(middle, axis=-1, kind="stable")
    return offsets, token_ids
