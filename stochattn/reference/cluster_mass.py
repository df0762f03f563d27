"""Cluster mass estimators for Double-P (issue 31), NumPy reference in float64.

Double-P scores a cluster i of the k-means index (size s_i, centroid C_i) by an estimate
of its softmax mass ``Z_i = sum_{j in i} exp(x_j)``, ``x_j = scale * q.k_j``. The paper's
estimate ``s_i exp(scale q.C_i)`` is exp of the mean logit (when C_i is the members' mean),
which by Jensen's inequality is a *lower* bound of Z_i: spread clusters are underestimated,
which biases both the top-p selection and the centroid summary of the approximated
clusters (docs/accuracy.md).

This module holds

- **per-cluster statistics** computable at index build from the keys, values and labels
  (:func:`member_stats` for one (sequence, KV head), :func:`index_stats` for a whole
  :class:`stochattn.doublep.DoublePIndex`), each O(C * D) or O(C * r * D) per (b, KV head):
  the members' key mean ``mu_i`` and per-dimension variance, the top-r principal
  directions of the members' keys with their variances and the isotropic remainder, the
  radius of the members about ``mu_i`` (and about the principal subspace), m sub-centroids
  from recursive principal splits (with their sizes and value means), and the rank-r
  key-value cross-covariance;
- **mass estimators**, pure functions of a query and those statistics returning log Zhat_i
  (:func:`log_mass_paper`, :func:`log_mass_mean`, :func:`log_mass_diag_var`,
  :func:`log_mass_pca`, :func:`log_mass_clipped`, :func:`log_mass_bennett`,
  :func:`log_mass_subcentroid`, :func:`log_mass_exact`; :func:`log_mass` dispatches by
  name, :data:`MASS_ESTIMATORS`);
- **value estimates** for a cluster summarised as one pseudo-token
  (:func:`value_tilt`, :func:`value_sub`).

Notation in the docstrings: for cluster i with members j (keys k_j, values v_j),
``d_j = scale * q.(k_j - mu_i)`` (the logits' deviations from their mean, mean 0),
``Sigma_i`` the members' key covariance (population, ``1 / s_i``), so that
``Var_j d_j = scale^2 q^T Sigma_i q`` and ``log Z_i = log s_i + scale q.mu_i + log mean_j
exp(d_j)``; the last term, the *Jensen gap*, is >= 0, and at most ``max_j d_j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MASS_ESTIMATORS", "VALUE_ESTIMATES", "ClusterStats", "member_stats", "index_stats",
           "cluster_member_stats", "stats_at", "log_mass", "log_mass_paper", "log_mass_mean", "log_mass_diag_var",
           "log_mass_pca", "log_mass_clipped", "log_mass_bennett", "log_mass_subcentroid",
           "log_mass_exact", "value_tilt", "value_sub", "summary_vectors", "refined_mask",
           "log_mass_refined", "index_sub_stats", "sub_only_stats", "append_sub_tokens"]

#: Names accepted by :func:`log_mass` (and by the reference Double-P's ``mass=``).
MASS_ESTIMATORS = ("paper", "mean", "diag-var", "pca", "pca-clip", "bennett", "sub", "exact",
                   "sub-near")
#: The default margin (nats) of "sub-near" (:func:`refined_mask`).
REFINE_MARGIN = 3.0
#: Names accepted by the reference Double-P's ``value=`` (centroid variant).
VALUE_ESTIMATES = ("mean", "tilt", "sub")


@dataclass
class ClusterStats:
    """Per-cluster statistics of the members' keys and values (leading dims ``...``:
    none for one (b, KV head), (B, Hkv) from :func:`index_stats`). Empty clusters hold 0.

    Attributes
    ----------
    mean : (..., C, D)
        ``mu_i``, the members' key mean.
    var : (..., C, D)
        Per-dimension variance of the members' keys (population).
    basis : (..., C, r, D)
        Orthonormal top-r principal directions ``u_ia`` of the members' keys (rows);
        zero rows where the cluster has fewer than r + 1 distinct directions.
    eig : (..., C, r)
        Variances ``lambda_ia`` along them (population).
    rest : (..., C)
        Isotropic remainder: ``(trace Sigma_i - sum_a lambda_ia) / (D - r)``.
    radius : (..., C)
        ``max_j |k_j - mu_i|``.
    proj_max : (..., C, r)
        ``max_j |u_ia.(k_j - mu_i)|``.
    perp_radius : (..., C)
        ``max_j |P_perp (k_j - mu_i)|``, P_perp the projector off the r directions.
    sub_means, sub_values : (..., C, m, D)
        Key and value means of m sub-clusters (recursive splits by the sign of the
        projection on the part's top principal direction; m a power of two).
    sub_sizes : (..., C, m)
        Their sizes (0 for an empty part: a cluster with fewer than m distinct keys).
    cross : (..., C, r, D)
        ``Cov_j(u_ia.k_j, v_j)`` (population): the key-value cross-covariance along the
        principal directions.
    """

    mean: np.ndarray
    var: np.ndarray
    basis: np.ndarray
    eig: np.ndarray
    rest: np.ndarray
    radius: np.ndarray
    proj_max: np.ndarray
    perp_radius: np.ndarray
    sub_means: np.ndarray
    sub_values: np.ndarray
    sub_sizes: np.ndarray
    cross: np.ndarray

    @property
    def rank(self) -> int:
        return self.basis.shape[-2]

    @property
    def n_sub(self) -> int:
        return self.sub_sizes.shape[-1]

    def floats_per_cluster(self, with_sub=True) -> int:
        """Stored floats per cluster (what an index would carry; D the head dim)."""
        D, r, m = self.mean.shape[-1], self.rank, self.n_sub
        n = D + D + r * D + r + 1 + 1 + r + 1 + r * D  # mean var basis eig rest radius proj perp cross
        return n + (2 * m * D + m if with_sub else 0)


def _split(X, idx, m):
    """Recursive principal split of the rows ``idx`` of X into m parts (m a power of 2)."""
    if m == 1:
        return [idx]
    if idx.size <= 1:
        return [idx] + [idx[:0]] * (m - 1)
    Y = X[idx] - X[idx].mean(axis=0)
    # Top right-singular vector of the centred part: its principal direction.
    _, _, vt = np.linalg.svd(Y, full_matrices=False)
    p = Y @ vt[0]
    left, right = idx[p < 0], idx[p >= 0]
    if left.size == 0 or right.size == 0:  # all keys equal along it: no split
        return [idx] + [idx[:0]] * (m - 1)
    return _split(X, left, m // 2) + _split(X, right, m // 2)


def member_stats(K, V, offsets, token_ids, n_clusters, *, rank=4, n_sub=4) -> ClusterStats:
    """:class:`ClusterStats` of one (sequence, KV head).

    Parameters
    ----------
    K, V : ndarray (L, D)
        The cache's keys and values (float64 is used).
    offsets, token_ids : ndarray
        Cluster c holds positions ``token_ids[offsets[c]:offsets[c + 1]]`` (the CSR of
        :func:`stochattn.reference.kmeans.cluster_csr` for this (b, KV head)).
    n_clusters : int
        C.
    rank, n_sub : int
        r principal directions (r < D) and m sub-clusters (a power of two, >= 1).
    """
    if n_sub < 1 or n_sub & (n_sub - 1):
        raise ValueError(f"`n_sub`: expected a power of two >= 1, got {n_sub}")
    K = np.asarray(K, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    C, D, r, m = n_clusters, K.shape[1], rank, n_sub
    if not 0 <= r < D:
        raise ValueError(f"`rank`: expected in [0, {D}), got {r}")
    z = np.zeros
    st = ClusterStats(mean=z((C, D)), var=z((C, D)), basis=z((C, r, D)), eig=z((C, r)),
                      rest=z(C), radius=z(C), proj_max=z((C, r)), perp_radius=z(C),
                      sub_means=z((C, m, D)), sub_values=z((C, m, D)), sub_sizes=z((C, m)),
                      cross=z((C, r, D)))
    for c in range(C):
        tok = token_ids[offsets[c]:offsets[c + 1]]
        if tok.size:
            one = cluster_member_stats(K[tok], V[tok], rank=r, n_sub=m)
            for f, val in one.items():
                getattr(st, f)[c] = val
    return st


def cluster_member_stats(X, W, *, rank, n_sub) -> dict:
    """The :class:`ClusterStats` fields of one non-empty cluster (keys X, values W, (s, D)
    float64), as a dict of arrays without the cluster axis."""
    s, D = X.shape
    r, m = rank, n_sub
    mu = X.mean(axis=0)
    Y = X - mu
    out = dict(mean=mu, var=(Y * Y).mean(axis=0), radius=np.sqrt((Y * Y).sum(axis=1).max()),
               basis=np.zeros((r, D)), eig=np.zeros(r), proj_max=np.zeros(r),
               perp_radius=0.0, cross=np.zeros((r, D)), sub_means=np.zeros((m, D)),
               sub_values=np.zeros((m, D)), sub_sizes=np.zeros(m))
    if r:
        _, sv, vt = np.linalg.svd(Y, full_matrices=False)  # Y = U diag(sv) vt
        k = min(r, vt.shape[0])
        out["basis"][:k] = vt[:k]
        out["eig"][:k] = sv[:k] ** 2 / s
        proj = Y @ out["basis"].T  # (s, r)
        out["proj_max"] = np.abs(proj).max(axis=0)
        perp = Y - proj @ out["basis"]
        out["perp_radius"] = np.sqrt((perp * perp).sum(axis=1).max())
        out["cross"] = proj.T @ (W - W.mean(axis=0)) / s
    out["rest"] = max(out["var"].sum() - out["eig"].sum(), 0.0) / (D - r)
    for a, part in enumerate(_split(X, np.arange(s), m)):
        if part.size:
            out["sub_sizes"][a] = part.size
            out["sub_means"][a] = X[part].mean(axis=0)
            out["sub_values"][a] = W[part].mean(axis=0)
    return out


def index_stats(k, v, seq_lens, index, *, rank=4, n_sub=4) -> ClusterStats:
    """:class:`ClusterStats` with leading (B, Hkv) for every (sequence, KV head) of a
    Double-P index (``index``: any object with ``labels``, ``sizes``, ``window_start``,
    ``n_sink``, as :class:`stochattn.doublep.DoublePIndex`), from the cache ``k, v``
    (B, Hkv, N, D) and lengths ``seq_lens`` (B,). What the index would carry."""
    from .kmeans import cluster_csr

    B, Hkv, C = index.sizes.shape
    offsets, token_ids = cluster_csr(index.labels, index.sizes, index.window_start, index.n_sink)
    per = []
    for b in range(B):
        L = int(seq_lens[b])
        for h in range(Hkv):
            per.append(member_stats(k[b, h, :L], v[b, h, :L], offsets[b, h], token_ids[b, h], C,
                                    rank=rank, n_sub=n_sub))
    fields = ClusterStats.__dataclass_fields__
    return ClusterStats(**{f: np.stack([getattr(p, f) for p in per]).reshape(
        (B, Hkv) + getattr(per[0], f).shape) for f in fields})


def index_sub_stats(k, seq_lens, index, *, n_sub=4):
    """Only the sub-centroids of :func:`index_stats` (the same split, :func:`_split`):
    ``(sub_means (B, Hkv, C, m, D) float64, sub_sizes (B, Hkv, C, m) int64)`` of every
    (sequence, KV head) of a Double-P index, from the keys ``k`` (B, Hkv, N, D). What
    ``build_doublep_index(..., mass="sub")`` stores (the index's ``sub_centroids`` and
    ``sub_sizes``); 0 for empty parts and clusters."""
    from .kmeans import cluster_csr

    if n_sub < 1 or n_sub & (n_sub - 1):
        raise ValueError(f"`n_sub`: expected a power of two >= 1, got {n_sub}")
    B, Hkv, C = index.sizes.shape
    D = k.shape[-1]
    means = np.zeros((B, Hkv, C, n_sub, D))
    sizes = np.zeros((B, Hkv, C, n_sub), dtype=np.int64)
    offsets, token_ids = cluster_csr(index.labels, index.sizes, index.window_start, index.n_sink)
    for b in range(B):
        L = int(seq_lens[b])
        for h in range(Hkv):
            K = np.asarray(k[b, h, :L], dtype=np.float64)
            for c in range(C):
                tok = token_ids[b, h, offsets[b, h, c]:offsets[b, h, c + 1]]
                if tok.size == 0:
                    continue
                X = K[tok]
                for a, part in enumerate(_split(X, np.arange(tok.size), n_sub)):
                    if part.size:
                        sizes[b, h, c, a] = part.size
                        means[b, h, c, a] = X[part].mean(axis=0)
    return means, sizes


def sub_only_stats(sub_means, sub_sizes) -> ClusterStats:
    """A :class:`ClusterStats` holding only the sub-centroids (``sub_means`` (..., C, m, D),
    ``sub_sizes`` (..., C, m), e.g. a Double-P index's ``sub_centroids`` and ``sub_sizes``),
    float64, for ``mass="sub"`` with ``value="mean"`` (the estimators that read nothing
    else). Rank 0; every other field is NaN (``sub_values`` included), so an estimator that
    needs them gives NaN rather than a quiet wrong answer."""
    sm = np.asarray(sub_means, dtype=np.float64)
    ss = np.asarray(sub_sizes, dtype=np.float64)
    if sm.shape[:-1] != ss.shape:
        raise ValueError(f"`sub_sizes` must have shape {sm.shape[:-1]} (sub_means' less the "
                         f"last axis), got {ss.shape}")
    lead, D = sm.shape[:-2], sm.shape[-1]
    nan = lambda *shape: np.full(lead + shape, np.nan)  # noqa: E731
    return ClusterStats(mean=nan(D), var=nan(D), basis=nan(0, D), eig=nan(0), rest=nan(),
                        radius=nan(), proj_max=nan(0), perp_radius=nan(),
                        sub_means=sm, sub_values=np.full(sm.shape, np.nan), sub_sizes=ss,
                        cross=nan(0, D))


def append_sub_tokens(sub_means, sub_sizes, centroids, k, labels, start, stop):
    """The sub-centroids' part of an append (:meth:`stochattn.doublep.DoublePIndex.append`),
    in place, after the tokens ``[start[b], stop[b])`` of each sequence got their cluster
    (``labels``): in position order, a token of cluster c joins the sub-centroid of c
    nearest its key (smallest ``|k - c_a|^2``, ties to the lowest part) among the parts of
    size > 0, and that part's size grows by one; sub-centroids never move (as the
    centroids). A cluster with no part of size > 0 (seeded by an append, or left empty by
    the k-means) takes the token in part 0, whose sub-centroid becomes the cluster's
    centroid (for a seeded cluster, the seeding key). So the parts' sizes keep summing to
    the cluster's size, and one token at a time gives the same arrays as many at once.

    Arrays: ``sub_means`` (B, Hkv, C, m, D), ``sub_sizes`` (B, Hkv, C, m), ``centroids``
    (B, Hkv, C, D), ``k`` (B, Hkv, N, D), ``labels`` (B, Hkv, N); ``start``, ``stop`` (B,).
    """
    B, Hkv = sub_sizes.shape[:2]
    for b in range(B):
        for t in range(int(start[b]), int(stop[b])):
            for h in range(Hkv):
                c = int(labels[b, h, t])
                if c < 0:
                    continue
                live = np.flatnonzero(sub_sizes[b, h, c] > 0)
                if live.size == 0:
                    sub_means[b, h, c, 0] = centroids[b, h, c]
                    a = 0
                else:
                    d = np.asarray(k[b, h, t], dtype=np.float64) - sub_means[b, h, c, live]
                    a = int(live[np.argmin((d * d).sum(axis=-1))])  # first minimum: lowest
                sub_sizes[b, h, c, a] += 1


def stats_at(stats: ClusterStats, *idx) -> ClusterStats:
    """The statistics indexed by ``idx`` on every field (e.g. ``stats_at(st, b, kvh)``, then
    ``stats_at(st_bh, ids)`` for a subset of clusters)."""
    return ClusterStats(**{f: getattr(stats, f)[idx] for f in ClusterStats.__dataclass_fields__})


# ----------------------------------------------------------------------------- estimators
# Each returns log Zhat_i, shape (C',), for the clusters whose statistics are given (the
# caller passes non-empty clusters only: log s_i = -inf otherwise).

def log_mass_paper(q, centroids, sizes, scale):
    """The paper's estimate (docs/estimators.md): ``log s_i + scale q.C_i``.

    With C_i the members' mean this is the Jensen lower bound of log Z_i; the index's
    centroids are the k-means centroids of the prompt, fixed while tokens are appended, so
    C_i need not be the mean and the bound need not hold."""
    return (np.asarray(centroids, dtype=np.float64) @ q) * scale + np.log(np.asarray(sizes, dtype=np.float64))


def log_mass_mean(q, st, sizes, scale):
    """Jensen's lower bound with the members' mean: ``log s_i + scale q.mu_i`` <= log Z_i."""
    return (st.mean @ q) * scale + np.log(np.asarray(sizes, dtype=np.float64))


def _var_diag(q, st, scale):
    """``scale^2 sum_d q_d^2 sigma^2_id``: Var d_j with the off-diagonal covariance dropped."""
    return scale * scale * (st.var @ (q * q))


def _var_pca(q, st, scale):
    """``scale^2 q^T Sigma_i q`` with Sigma_i of rank r plus isotropic remainder:
    ``scale^2 (sum_a lambda_ia (u_ia.q)^2 + rest_i (|q|^2 - sum_a (u_ia.q)^2))``."""
    pq = st.basis @ q  # (C', r)
    along = (pq * pq * st.eig).sum(axis=-1)
    perp = np.maximum(q @ q - (pq * pq).sum(axis=-1), 0.0)
    return scale * scale * (along + st.rest * perp)


def _dev_bound(q, st, scale):
    """An upper bound b_i >= max_j d_j from the stored radii:
    ``scale * min(|q| R_i, sum_a |u_ia.q| P_ia + |P_perp q| R_perp,i)`` (Cauchy-Schwarz on
    the whole deviation, or per principal direction plus the orthogonal remainder)."""
    pq = st.basis @ q
    perp_q = np.sqrt(np.maximum(q @ q - (pq * pq).sum(axis=-1), 0.0))
    box = (np.abs(pq) * st.proj_max).sum(axis=-1) + perp_q * st.perp_radius
    return scale * np.minimum(np.sqrt(q @ q) * st.radius, box)


def log_mass_diag_var(q, st, sizes, scale, alpha=1.0):
    """Second-order cumulant (lognormal) with a diagonal covariance:
    ``log s_i + scale q.mu_i + alpha * scale^2 / 2 * sum_d q_d^2 sigma^2_id``.

    Exact for Gaussian-distributed member logits when alpha = 1 and Sigma_i is diagonal;
    it overshoots for heavy-tailed clusters (the correction grows without bound while the
    true gap is at most max_j d_j). ``alpha`` shrinks the correction."""
    return log_mass_mean(q, st, sizes, scale) + 0.5 * alpha * _var_diag(q, st, scale)


def log_mass_pca(q, st, sizes, scale, alpha=1.0):
    """Second-order cumulant with a rank-r covariance plus isotropic remainder:
    ``log s_i + scale q.mu_i + alpha * scale^2 / 2 * q^T Sigma_i q`` (:func:`_var_pca`)."""
    return log_mass_mean(q, st, sizes, scale) + 0.5 * alpha * _var_pca(q, st, scale)


def log_mass_clipped(q, st, sizes, scale, alpha=1.0):
    """:func:`log_mass_pca` with the correction capped at the deviation bound b_i
    (:func:`_dev_bound`): ``log s_i + scale q.mu_i + min(alpha scale^2 q^T Sigma_i q / 2,
    b_i)``. Since the true Jensen gap is <= max_j d_j <= b_i, the cap removes only
    corrections that are certainly too large (Zhat_i <= s_i exp(scale q.mu_i + b_i), the
    cluster's max-logit upper bound)."""
    corr = np.minimum(0.5 * alpha * _var_pca(q, st, scale), _dev_bound(q, st, scale))
    return log_mass_mean(q, st, sizes, scale) + corr


def log_mass_bennett(q, st, sizes, scale):
    """Bennett's bound on the Jensen gap: for mean-zero d_j <= b with variance v,
    ``mean_j exp(d_j) <= 1 + v / b^2 (e^b - 1 - b)``, so
    ``log Z_i <= log s_i + scale q.mu_i + log1p(v_i / b_i^2 (expm1(b_i) - b_i))`` with
    v_i = scale^2 q^T Sigma_i q (rank r) and b_i the deviation bound (:func:`_dev_bound`);
    the correction is also capped at b_i. An upper bound (for the exact Sigma_i and a
    valid b_i) that behaves as v_i / 2 for small b_i and stays <= b_i."""
    v = _var_pca(q, st, scale)
    b = _dev_bound(q, st, scale)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        g = np.where(b > 1e-6, (np.expm1(b) - b) / (b * b), 0.5)
        corr = np.log1p(v * g)
    corr = np.minimum(np.where(np.isfinite(corr), corr, b), b)
    return log_mass_mean(q, st, sizes, scale) + corr


def log_mass_subcentroid(q, st, scale):
    """Sub-centroid estimate: ``log sum_a t_ia exp(scale q.c_ia)`` over the m sub-clusters
    (sizes t_ia, key means c_ia). By Jensen within each part it lies between
    :func:`log_mass_mean` and log Z_i: it never overshoots, and is exact when every part
    holds identical keys."""
    t = st.sub_sizes
    with np.errstate(divide="ignore"):
        lx = np.where(t > 0, (st.sub_means @ q) * scale + np.log(np.maximum(t, 1)), -np.inf)
    mx = lx.max(axis=-1)
    return mx + np.log(np.exp(lx - mx[..., None]).sum(axis=-1))


def log_mass_exact(x, offsets, token_ids, ids):
    """The true ``log Z_i = logsumexp_{j in i} x_j`` (an oracle: reads every member key).
    ``ids``: non-empty clusters of the CSR (``offsets``, ``token_ids``)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return np.zeros(0)
    starts, stops = offsets[ids], offsets[ids + 1]
    seg = np.repeat(np.arange(ids.size), stops - starts)
    # Member positions, cluster after cluster: starts[seg] + rank inside the cluster.
    first = np.concatenate([[0], np.cumsum(stops - starts)[:-1]])  # first slot of each cluster
    pos = token_ids[np.repeat(starts - first, stops - starts) + np.arange(seg.size)]
    xs = x[pos]
    mx = np.full(ids.size, -np.inf)
    np.maximum.at(mx, seg, xs)
    return mx + np.log(np.bincount(seg, weights=np.exp(xs - mx[seg]), minlength=ids.size))


def refined_mask(paper, p1, margin=REFINE_MARGIN):
    """The clusters "sub-near" refines: stage 1 on the paper scores ``paper`` (1-D, the
    non-empty clusters) gives C_p; t is the smallest paper score in it; the clusters whose
    paper score is at least ``t - margin`` are refined (all of C_p and the near misses)."""
    from .doublep import select_clusters  # doublep imports this module inside functions only

    paper = np.asarray(paper, dtype=np.float64)
    if paper.size == 0:
        return np.zeros(0, dtype=bool)
    order, n_p, _, _ = select_clusters(paper, p1, p1)
    t = paper[order[:n_p]].min()
    return paper >= t - margin


def log_mass_refined(paper, sub, refined):
    """"sub-near": the sub-centroid estimate ``sub`` where ``refined``; elsewhere the paper
    score shifted by the mean gap ``sub - paper`` of the refined clusters (the Jensen gap
    that paper leaves on the clusters it does not read again). Only the refined clusters'
    sub-centroids are read: ``refined.sum() * n_sub`` vectors on top of the centroids."""
    paper, sub = np.asarray(paper, dtype=np.float64), np.asarray(sub, dtype=np.float64)
    gap = float((sub - paper)[refined].mean()) if refined.any() else 0.0
    return np.where(refined, sub, paper + gap)


def log_mass(name, q, *, scale, centroids, sizes, stats=None, alpha=1.0, x=None,
             offsets=None, token_ids=None, ids=None, p1=None, margin=REFINE_MARGIN):
    """log Zhat of the clusters given (non-empty ones) by estimator ``name``
    (:data:`MASS_ESTIMATORS`): "paper" needs ``centroids``; "exact" needs the exact logits
    ``x`` and the CSR (``offsets``, ``token_ids``) with the cluster ``ids``; the others
    need ``stats`` (a :class:`ClusterStats` over the same clusters); "sub-near" needs
    ``centroids``, ``stats``, stage 1's ``p1`` and ``margin`` (:func:`refined_mask`).
    ``alpha`` scales the quadratic correction of "diag-var", "pca" and "pca-clip"."""
    if name == "paper":
        return log_mass_paper(q, centroids, sizes, scale)
    if name == "exact":
        return log_mass_exact(x, offsets, token_ids, ids)
    if name == "mean":
        return log_mass_mean(q, stats, sizes, scale)
    if name == "diag-var":
        return log_mass_diag_var(q, stats, sizes, scale, alpha)
    if name == "pca":
        return log_mass_pca(q, stats, sizes, scale, alpha)
    if name == "pca-clip":
        return log_mass_clipped(q, stats, sizes, scale, alpha)
    if name == "bennett":
        return log_mass_bennett(q, stats, sizes, scale)
    if name == "sub":
        return log_mass_subcentroid(q, stats, scale)
    if name == "sub-near":
        paper = log_mass_paper(q, centroids, sizes, scale)
        return log_mass_refined(paper, log_mass_subcentroid(q, stats, scale),
                                refined_mask(paper, p1, margin))
    raise ValueError(f"`mass`: expected one of {MASS_ESTIMATORS}, got {name!r}")


def summary_vectors(mass, value, *, rank=4, n_sub=4):
    """D-vectors of the index a decode step reads for one cluster, per KV head, as
    ``(k_every, k_approx, v_approx)``: ``k_every`` for every non-empty cluster (to score
    it: the centroid for "paper", the mean and variance for "diag-var", the mean and ``rank``
    principal directions for the rank-r estimators, ``n_sub`` sub-centroids for "sub",
    none for "exact", which reads the keys of C_approx's tokens instead); ``k_approx`` and
    ``v_approx`` for each cluster summarised as a pseudo-token (its value summary: the
    value mean; with "tilt" also ``rank`` cross-covariance rows and, unless the mass
    already read them, ``rank`` principal directions; with "sub" ``n_sub`` value means and,
    unless the mass read them, the ``n_sub`` sub-centroids that weight them). Scalars
    (sizes, eigenvalues, radii) are not counted. This is the read-cost rule of the cluster
    mass study: a cluster of s tokens read exactly costs s K rows and s V rows."""
    if mass not in MASS_ESTIMATORS:
        raise ValueError(f"`mass`: expected one of {MASS_ESTIMATORS}, got {mass!r}")
    if value not in VALUE_ESTIMATES:
        raise ValueError(f"`value`: expected one of {VALUE_ESTIMATES}, got {value!r}")
    # "sub-near": the centroid of every cluster here; ``n_sub`` more per refined cluster are
    # the callers' (they know how many were refined).
    k_every = {"paper": 1, "mean": 1, "diag-var": 2, "pca": 1 + rank, "pca-clip": 1 + rank,
               "bennett": 1, "sub": n_sub, "exact": 0, "sub-near": 1}[mass]
    has_basis = mass in ("pca", "pca-clip")
    if value == "mean":
        return k_every, 0, 1
    if value == "tilt":
        return k_every, 0 if has_basis else rank, 1 + rank
    return k_every, 0 if mass == "sub" else n_sub, n_sub


def value_tilt(q, value_means, st, scale, alpha=1.0):
    """First-order tilted value mean of each cluster:
    ``vbar_i + alpha * scale * sum_a Cov(u_ia.k, v) (u_ia.q)``, i.e. ``E_w[v] ~= vbar_i +
    scale Cov_i(v, k) q`` (exact for jointly Gaussian keys and values, w_j ~ exp(x_j)) with
    the key-value cross-covariance restricted to the r principal directions."""
    return value_means + alpha * scale * np.einsum("cr,crd->cd", st.basis @ q, st.cross)


def value_sub(q, st, scale):
    """Value of each cluster as the sub-clusters' value means weighted by their estimated
    masses ``t_ia exp(scale q.c_ia)`` (the value companion of :func:`log_mass_subcentroid`)."""
    t = st.sub_sizes
    with np.errstate(divide="ignore"):
        lx = np.where(t > 0, (st.sub_means @ q) * scale + np.log(np.maximum(t, 1)), -np.inf)
    w = np.exp(lx - lx.max(axis=-1, keepdims=True))
    return np.einsum("cm,cmd->cd", w, st.sub_values) / w.sum(axis=-1)[:, None]
