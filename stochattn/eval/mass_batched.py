"""Batched Double-P decode with the cluster mass estimators of issue 31, NumPy or CuPy.

The reference :func:`stochattn.reference.doublep.doublep_attention` (``mass=``,
``value=``) loops over (sequence, query head) in Python, which is what kept the mass study
(:mod:`stochattn.eval.mass_study`) at 2k tokens on the CPU. This module computes the same
decode (centroid variant) for every (row, query head) at once, written against an array
module ``xp`` (``numpy`` or ``cupy``), in float64:

- **selection** (:func:`select_batched`): per query head, the non-empty clusters ordered by
  their estimated mass ``w_i = exp(log Zhat_i - max)`` descending, ties to the lower
  cluster index (a stable sort), cumulative sums in that order, C_p the shortest prefix
  with ``cs >= p1 * total`` (every non-empty cluster when ``p1 >= 1``), C_exact the
  shortest with ``cs >= p2 * total`` capped at |C_p| (all of C_p when ``p2 >= 1``): the
  reference's :func:`~stochattn.reference.doublep.select_clusters`, with ``searchsorted``
  written as a count of ``cs < target``;
- **output** (:func:`decode_core`): sinks ``[0, min(n_sink, L))``, window
  ``[window_start, L)`` and the tokens of C_exact exact, each C_approx cluster one
  pseudo-token of logit ``log Zhat_i`` and value the chosen value summary, one softmax
  over both shifted by their common max; the reference's diagnostics (clusters selected
  and exact, exact tokens, estimated and true mass, K/V rows read per KV head, and with
  ``mass_diagnostics`` the true mass of C_p and the log-error of C_approx's total mass);
- **mass estimators** (:func:`log_mass_batched`): every name of
  :data:`stochattn.reference.cluster_mass.MASS_ESTIMATORS` ("exact" from the logits by a
  per-cluster logsumexp, :func:`exact_log_mass`), values "mean", "sub" and "tilt";
- **per-cluster statistics** (:func:`state_stats`): the fields of
  :class:`~stochattn.reference.cluster_mass.ClusterStats` for any list of member sets,
  chunked and padded, with the principal directions from repeated squaring of the
  covariance (``squarings`` times: the power ``2**squarings``) and deflation instead of an
  SVD per cluster (batched 64 x 64 eigensolvers are slow on GPUs), and the recursive
  principal splits of the sub-centroids level by level;
- **the decode-faithful index of the harness** (:func:`decode_index_batched`): the prompt's
  k-means as the reference's (same seeding, Lloyd rounds, early stop and final
  assignment), every later token's nearest centroid at once (centroids never move after
  the prefill, :meth:`stochattn.doublep.DoublePIndex.append`), and the statistics of every
  *state* a cluster passes through as the rows grow (a cluster's members at a row are the
  first members of its position-ordered list), so that each (row, KV head, cluster) points
  at one row of a shared statistics table (:class:`LayerIndex`).

:func:`doublep_batched` is the reference's signature on a
:class:`~stochattn.doublep.DoublePIndex` (what ``tests/test_mass_batched.py`` compares);
:func:`run_play_batched` is :func:`stochattn.eval.mass_study.run_play` on this path
(``python -m stochattn.eval.mass_study --batched [--xp cupy]``).

Differences from the reference are rounding only: dot products, sums and cumulative sums
in another order (CuPy's scans are parallel), the principal directions from squaring
instead of LAPACK (their signs are arbitrary in both and no result depends on them, but a
key exactly on a split hyperplane, ``p == 0``, goes right in both only for the same sign),
the exact mass shifted by the row's largest clustered logit rather than each cluster's
own. So a cluster whose cumulative mass lies within rounding of ``p1 * total`` or
``p2 * total``, or a token equidistant from two centroids within rounding, may be decided
differently; the tests check that on random and planted inputs nothing is.
"""

from __future__ import annotations

import math
import time

import numpy as np

from stochattn.reference import cluster_mass as cm

__all__ = ["STAT_FIELDS", "LayerIndex", "decode_core", "decode_index_batched", "doublep_batched",
           "exact_log_mass", "index_stats_batched", "log_mass_batched", "run_play_batched",
           "select_batched", "state_stats", "sub_stats", "value_batched"]

#: Fields of the statistics table (those of ClusterStats plus the members' value mean).
STAT_FIELDS = tuple(cm.ClusterStats.__dataclass_fields__) + ("vmean",)


def _argsort_stable(xp, a):
    """Stable argsort along the last axis (CuPy's sort is always stable)."""
    if xp is np:
        return np.argsort(a, axis=-1, kind="stable")
    return xp.argsort(a, axis=-1)


def _errstate(xp):
    return np.errstate(divide="ignore", invalid="ignore", over="ignore") if xp is np else \
        _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


# ----------------------------------------------------------------------------- statistics

def _trace(xp, M):
    return xp.diagonal(M, axis1=1, axis2=2).sum(-1)


def _top_vec(xp, M, squarings):
    """Unit top eigenvector of each symmetric PSD matrix of M (n, D, D) by repeated
    squaring (``M^(2^squarings)``, normalised by its trace after each squaring, tends to
    the projector on the top eigenvector); 0 for a zero matrix."""
    tr = _trace(xp, M)
    A = M / xp.where(tr > 0, tr, 1.0)[:, None, None]
    for _ in range(squarings):
        A = xp.matmul(A, A)
        t = _trace(xp, A)
        A = A / xp.where(t > 0, t, 1.0)[:, None, None]
    d = xp.diagonal(A, axis1=1, axis2=2)              # (n, D)
    j = xp.argmax(d, axis=-1)
    ar = xp.arange(A.shape[0])
    dj = d[ar, j]
    col = A[ar, :, j]                                  # (n, D): column j of each
    u = col / xp.sqrt(xp.where(dj > 0, dj, 1.0))[:, None]
    u = xp.where((dj > 0)[:, None], u, 0.0)
    # One power step with the matrix itself, then unit length (removes squaring's rounding).
    u2 = xp.matmul(M, u[:, :, None])[..., 0]
    nrm = xp.sqrt((u2 * u2).sum(-1))
    return xp.where((nrm > 0)[:, None], u2 / xp.where(nrm > 0, nrm, 1.0)[:, None], u)


def _top_eigs(xp, cov, r, squarings, rel=1e-12):
    """Top-r eigenvectors (rows) and eigenvalues of each covariance by deflation; a
    direction whose remaining variance is at most ``rel`` of the trace is left 0."""
    n, D = cov.shape[0], cov.shape[-1]
    basis = xp.zeros((n, r, D))
    eig = xp.zeros((n, r))
    tr0 = _trace(xp, cov)
    M = cov
    for a in range(r):
        small = _trace(xp, M) <= rel * tr0
        u = xp.where(small[:, None], 0.0, _top_vec(xp, M, squarings))
        lam = (u * xp.matmul(cov, u[:, :, None])[..., 0]).sum(-1)
        basis[:, a] = u
        eig[:, a] = xp.where(small, 0.0, lam)
        if a + 1 < r:  # M <- P M P, P = I - u u^T
            Mu = xp.matmul(M, u[:, :, None])[..., 0]
            uMu = (u * Mu).sum(-1)
            M = (M - Mu[:, :, None] * u[:, None, :] - u[:, :, None] * Mu[:, None, :]
                 + uMu[:, None, None] * (u[:, :, None] * u[:, None, :]))
    return basis, eig


def _sub_split(xp, X, W, msk, m, u0, squarings):
    """Sub-clusters of the reference's recursive principal splits (``cluster_mass._split``),
    level by level (``W`` None: no value means): a part splits by the sign of its members' projection on its top
    principal direction (``p < 0`` left, else right, left parts first); a part of at most
    one member, or whose split leaves a side empty, stays whole in the first slot of its
    block and never splits again. Returns sizes (n, m), key and value means (n, m, D)."""
    n, smax, D = X.shape
    slot = xp.zeros((n, smax), dtype=xp.int64)
    frozen = xp.zeros((n, m), dtype=bool)
    mf = msk.astype(X.dtype)
    width = m
    level = 0
    rows = xp.arange(n)[:, None]
    while width > 1:
        nparts = m // width
        pid = slot // width                                   # (n, smax)
        oh = ((pid[..., None] == xp.arange(nparts)) & msk[..., None]).astype(X.dtype)
        cnt = oh.sum(1)                                       # (n, nparts)
        means = xp.matmul(oh.transpose(0, 2, 1), X) / xp.maximum(cnt, 1.0)[..., None]
        Y = (X - means[rows, pid]) * mf[..., None]
        if level == 0 and u0 is not None:
            direc = u0[:, None, :]
        else:
            covs = xp.stack([xp.matmul((Y * oh[..., p:p + 1]).transpose(0, 2, 1), Y)
                             for p in range(nparts)], axis=1)  # (n, nparts, D, D)
            direc = _top_vec(xp, covs.reshape(n * nparts, D, D), squarings).reshape(n, nparts, D)
        pv = (Y * direc[rows, pid]).sum(-1)                    # (n, smax)
        left = (pv < 0) & msk
        nleft = xp.matmul(oh.transpose(0, 2, 1), left.astype(X.dtype)[..., None])[..., 0]
        fz = frozen[:, ::width][:, :nparts]                    # the parts' first slots
        can = (cnt > 1) & (nleft > 0) & (cnt - nleft > 0) & ~fz
        right = msk & ~left & xp.take_along_axis(can, pid, axis=1)
        slot = xp.where(right, slot + width // 2, slot)
        frozen[:, ::width] = ~can
        width //= 2
        level += 1
    oh = ((slot[..., None] == xp.arange(m)) & msk[..., None]).astype(X.dtype)
    sizes = oh.sum(1)
    ohT = oh.transpose(0, 2, 1)
    den = xp.maximum(sizes, 1.0)[..., None]
    return sizes, xp.matmul(ohT, X) / den, None if W is None else xp.matmul(ohT, W) / den


def _chunk_stats(xp, X, W, msk, s, r, m, squarings):
    """Statistics of n member sets padded to (n, smax, D) (``msk`` marks real members)."""
    D = X.shape[-1]
    mf = msk.astype(X.dtype)[..., None]
    sf = s.astype(X.dtype)[:, None]
    mu = (X * mf).sum(1) / sf
    Y = (X - mu[:, None]) * mf
    out = dict(mean=mu, var=(Y * Y).sum(1) / sf, radius=xp.sqrt((Y * Y).sum(-1).max(-1)))
    wmean = (W * mf).sum(1) / sf
    out["vmean"] = wmean
    if r:
        cov = xp.matmul(Y.transpose(0, 2, 1), Y) / sf[:, :, None]
        basis, eig = _top_eigs(xp, cov, r, squarings)
        proj = xp.matmul(Y, basis.transpose(0, 2, 1))                  # (n, smax, r)
        perp = Y - xp.matmul(proj, basis)
        out.update(basis=basis, eig=eig, proj_max=xp.abs(proj).max(1),
                   perp_radius=xp.sqrt((perp * perp).sum(-1).max(-1)),
                   cross=xp.matmul(proj.transpose(0, 2, 1), (W - wmean[:, None]) * mf) / sf[:, :, None])
    else:
        n = X.shape[0]
        out.update(basis=xp.zeros((n, 0, D)), eig=xp.zeros((n, 0)), proj_max=xp.zeros((n, 0)),
                   perp_radius=xp.zeros(n), cross=xp.zeros((n, 0, D)))
    out["rest"] = xp.maximum(out["var"].sum(-1) - out["eig"].sum(-1), 0.0) / (D - r)
    u0 = out["basis"][:, 0] if r else None
    out["sub_sizes"], out["sub_means"], out["sub_values"] = _sub_split(xp, X, W, msk, m, u0,
                                                                       squarings)
    return out


def state_stats(xp, K, V, src, starts, sizes, tok, *, rank=4, n_sub=4, budget=1 << 22,
                squarings=20):
    """Statistics of S member sets: set j holds the rows ``tok[starts[j]:starts[j] +
    sizes[j]]`` of ``K[src[j]]`` / ``V[src[j]]``.

    Parameters
    ----------
    K, V : xp arrays (R, T, D) float64
    src, starts, sizes : int arrays (S,) (host or xp)
    tok : xp int array, flat
    rank, n_sub : as :func:`stochattn.reference.cluster_mass.member_stats`
    budget : int
        Padded member elements (sets x longest set x D) per chunk.
    squarings : int
        Squarings of each covariance per principal direction.

    Returns
    -------
    dict of xp arrays with leading (S,), :data:`STAT_FIELDS`; 0 for empty sets.
    """
    if n_sub < 1 or n_sub & (n_sub - 1):
        raise ValueError(f"`n_sub`: expected a power of two >= 1, got {n_sub}")
    D = K.shape[-1]
    r, m = rank, n_sub
    if not 0 <= r < D:
        raise ValueError(f"`rank`: expected in [0, {D}), got {r}")
    sz_h = _host(sizes).astype(np.int64)
    S = sz_h.size
    z = xp.zeros
    out = dict(mean=z((S, D)), var=z((S, D)), basis=z((S, r, D)), eig=z((S, r)), rest=z(S),
               radius=z(S), proj_max=z((S, r)), perp_radius=z(S), sub_means=z((S, m, D)),
               sub_values=z((S, m, D)), sub_sizes=z((S, m)), cross=z((S, r, D)),
               vmean=z((S, D)))
    for js, sj, pos, msk, s in _member_chunks(xp, src, starts, sz_h, tok, D, budget):
        X = K[sj, pos].astype(xp.float64)
        W = V[sj, pos].astype(xp.float64)
        res = _chunk_stats(xp, X, W, msk, s, r, m, squarings)
        for f, val in res.items():
            out[f][js] = val
    return out


def _member_chunks(xp, src, starts, sz_h, tok, D, budget):
    """The non-empty member sets, by size, in chunks of at most ``budget`` padded elements:
    per chunk the sets' ids ``js``, sources ``sj`` (n, 1), member positions ``pos`` (n,
    smax) (padded with the set's first), the mask of real members and the sizes."""
    order = np.argsort(sz_h, kind="stable")
    order = order[sz_h[order] > 0]
    src_x = xp.asarray(_host(src).astype(np.int64))
    st_x = xp.asarray(_host(starts).astype(np.int64))
    sz_x = xp.asarray(sz_h)
    a = 0
    while a < order.size:
        b = a + 1
        while b < order.size and (b + 1 - a) * max(int(sz_h[order[b]]), D) * D <= budget:
            b += 1
        js = xp.asarray(order[a:b])
        smax = int(sz_h[order[b - 1]])
        s = sz_x[js]
        ar = xp.arange(smax)
        msk = ar[None, :] < s[:, None]
        idx = xp.where(msk, st_x[js][:, None] + ar[None, :], st_x[js][:, None])
        yield js, src_x[js][:, None], tok[idx], msk, s
        a = b


def sub_stats(xp, K, src, starts, sizes, tok, *, n_sub=4, budget=1 << 22, squarings=20):
    """Only the sub-centroids of :func:`state_stats` (the same recursive principal splits,
    :func:`_sub_split`, every level's direction by ``squarings`` squarings of the part's
    covariance): ``(sub_sizes (S, m), sub_means (S, m, D))`` float64 xp arrays, 0 for empty
    sets and parts. ``K`` (R, T, D) in any float dtype (each chunk's members are widened to
    float64); the other arguments as :func:`state_stats`. What the GPU index build of
    ``mass="sub"`` runs (:func:`stochattn.cuda.doublep_sub.sub_stats_gpu`)."""
    if n_sub < 1 or n_sub & (n_sub - 1):
        raise ValueError(f"`n_sub`: expected a power of two >= 1, got {n_sub}")
    D = K.shape[-1]
    sz_h = _host(sizes).astype(np.int64)
    S = sz_h.size
    out_sizes, out_means = xp.zeros((S, n_sub)), xp.zeros((S, n_sub, D))
    for js, sj, pos, msk, s in _member_chunks(xp, src, starts, sz_h, tok, D, budget):
        X = K[sj, pos].astype(xp.float64)
        out_sizes[js], out_means[js], _ = _sub_split(xp, X, None, msk, n_sub, None, squarings)
    return out_sizes, out_means


def _as_cluster_stats(d):
    return cm.ClusterStats(**{f: d[f] for f in cm.ClusterStats.__dataclass_fields__})


def index_stats_batched(xp, k, v, lens, index, *, rank=4, n_sub=4, squarings=20):
    """:func:`stochattn.reference.cluster_mass.index_stats` by :func:`state_stats`: a dict of
    xp arrays with leading (B, Hkv, C), plus ``vmean``."""
    from stochattn.reference.kmeans import cluster_csr

    B, Hkv, C = index.sizes.shape
    N, D = k.shape[2], k.shape[3]
    offsets, token_ids = cluster_csr(index.labels, index.sizes, index.window_start, index.n_sink)
    M = token_ids.shape[-1]
    src = np.repeat(np.arange(B * Hkv), C)
    starts = (offsets[..., :-1] + (np.arange(B * Hkv) * M).reshape(B, Hkv, 1)).ravel()
    tok = xp.asarray(np.maximum(token_ids, 0).reshape(-1))
    K = xp.asarray(k).reshape(B * Hkv, N, D).astype(xp.float64)
    V = xp.asarray(v).reshape(B * Hkv, N, D).astype(xp.float64)
    st = state_stats(xp, K, V, src, starts, np.asarray(index.sizes).ravel(), tok, rank=rank,
                     n_sub=n_sub, squarings=squarings)
    return {f: a.reshape((B, Hkv, C) + a.shape[1:]) for f, a in st.items()}


# ----------------------------------------------------------------------------- estimators

def _qdot(xp, A, qg):
    """``A @ q`` per query head: A (B, Hkv, C, ..., D), qg (B, Hkv, G, D) ->
    (B, Hkv, G, C, ...)."""
    B, Hkv, C = A.shape[:3]
    mid, D, G = A.shape[3:-1], A.shape[-1], qg.shape[2]
    r = xp.matmul(A.reshape(B, Hkv, -1, D), qg.transpose(0, 1, 3, 2))   # (B, Hkv, C*mid, G)
    return r.transpose(0, 1, 3, 2).reshape((B, Hkv, G, C) + tuple(mid))


def _stat(st, f):
    return st[f] if isinstance(st, dict) else getattr(st, f)


def _var_pca(xp, qg, st, scale):
    pq = _qdot(xp, _stat(st, "basis"), qg)                          # (B, Hkv, G, C, r)
    qq = (qg * qg).sum(-1)[..., None]                              # (B, Hkv, G, 1)
    along = (pq * pq * _stat(st, "eig")[:, :, None]).sum(-1)
    perp = xp.maximum(qq - (pq * pq).sum(-1), 0.0)
    return scale * scale * (along + _stat(st, "rest")[:, :, None] * perp), pq, qq


def _dev_bound(xp, pq, qq, st, scale):
    perp_q = xp.sqrt(xp.maximum(qq - (pq * pq).sum(-1), 0.0))
    box = (xp.abs(pq) * _stat(st, "proj_max")[:, :, None]).sum(-1) \
        + perp_q * _stat(st, "perp_radius")[:, :, None]
    return scale * xp.minimum(xp.sqrt(qq) * _stat(st, "radius")[:, :, None], box)


def _sub_logits(xp, qg, st, scale):
    t = _stat(st, "sub_sizes")[:, :, None]                          # (B, Hkv, 1, C, m)
    with _errstate(xp):
        return xp.where(t > 0, _qdot(xp, _stat(st, "sub_means"), qg) * scale
                        + xp.log(xp.maximum(t, 1)), -xp.inf)


def refined_batched(xp, paper, nonempty, p1, margin):
    """:func:`~stochattn.reference.cluster_mass.refined_mask` for every (b, query head):
    paper (B, Hq, C) the paper scores, nonempty (B, Hq, C) -> (B, Hq, C) bool."""
    code = select_batched(xp, paper, nonempty, p1, p1)[0]
    with _errstate(xp):
        t = xp.where(code > 0, paper, xp.inf).min(-1, keepdims=True)
    return nonempty & (paper >= t - margin)


def sub_near_batched(xp, q, *, scale, sizes, centroids, stats, p1, margin):
    """"sub-near" (:func:`~stochattn.reference.cluster_mass.log_mass_refined`) for every
    (b, query head): ``(log Zhat, refined)``, both (B, Hq, C)."""
    B, Hq, _ = q.shape
    Hkv, C = sizes.shape[1], sizes.shape[-1]
    paper = log_mass_batched(xp, "paper", q, scale=scale, sizes=sizes, centroids=centroids)
    sub = log_mass_batched(xp, "sub", q, scale=scale, sizes=sizes, stats=stats)
    ne = xp.broadcast_to((sizes > 0)[:, :, None], (B, Hkv, Hq // Hkv, C)).reshape(B, Hq, C)
    ref = refined_batched(xp, paper, ne, p1, margin)
    n_ref = ref.sum(-1, keepdims=True)
    gap = xp.where(ref, sub - paper, 0.0).sum(-1, keepdims=True) / xp.maximum(n_ref, 1)
    return xp.where(ref, sub, paper + gap), ref


def _scores(xp, mass, q, **kw):
    """The decode paths' cluster scores and, for "sub-near", its refined clusters (what
    :func:`index_reads` counts; None for the other estimators)."""
    if mass == "sub-near":
        kw.pop("alpha"), kw.pop("lz")
        return sub_near_batched(xp, q, **kw)
    return log_mass_batched(xp, mass, q, **kw), None


def log_mass_batched(xp, name, q, *, scale, sizes, centroids=None, stats=None, alpha=1.0,
                     lz=None, p1=None, margin=cm.REFINE_MARGIN):
    """log Zhat (B, Hq, C) by estimator ``name`` for every cluster (meaningless where
    ``sizes == 0``): q (B, Hq, D); sizes (B, Hkv, C); centroids (B, Hkv, C, D) for
    "paper"; ``stats`` (fields with leading (B, Hkv, C)) for the others; ``lz`` (the
    exact log masses, :func:`exact_log_mass`) for "exact". Formulas:
    :mod:`stochattn.reference.cluster_mass`."""
    B, Hq, D = q.shape
    Hkv = sizes.shape[1]
    G = Hq // Hkv
    if name == "exact":
        return lz
    if name == "sub-near":
        return sub_near_batched(xp, q, scale=scale, sizes=sizes, centroids=centroids,
                                stats=stats, p1=p1, margin=margin)[0]
    qg = q.reshape(B, Hkv, G, D)
    with _errstate(xp):
        logs = xp.log(sizes.astype(xp.float64))[:, :, None]        # (B, Hkv, 1, C)
    if name == "paper":
        out = _qdot(xp, centroids, qg) * scale + logs
    elif name == "sub":
        lx = _sub_logits(xp, qg, stats, scale)
        with _errstate(xp):
            mx = lx.max(-1)
            out = mx + xp.log(xp.exp(lx - mx[..., None]).sum(-1))
    else:
        mean = _qdot(xp, _stat(stats, "mean"), qg) * scale + logs
        if name == "mean":
            out = mean
        elif name == "diag-var":
            out = mean + 0.5 * alpha * (scale * scale * _qdot(xp, _stat(stats, "var"), qg * qg))
        elif name in ("pca", "pca-clip", "bennett"):
            v, pq, qq = _var_pca(xp, qg, stats, scale)
            if name == "pca":
                out = mean + 0.5 * alpha * v
            elif name == "pca-clip":
                out = mean + xp.minimum(0.5 * alpha * v, _dev_bound(xp, pq, qq, stats, scale))
            else:
                b = _dev_bound(xp, pq, qq, stats, scale)
                with _errstate(xp):
                    g = xp.where(b > 1e-6, (xp.expm1(b) - b) / (b * b), 0.5)
                    corr = xp.log1p(v * g)
                corr = xp.minimum(xp.where(xp.isfinite(corr), corr, b), b)
                out = mean + corr
        else:
            raise ValueError(f"`mass`: expected one of {cm.MASS_ESTIMATORS}, got {name!r}")
    return out.reshape(B, Hq, -1)


def value_batched(xp, name, q, *, scale, value_means, stats=None, alpha=1.0):
    """Pseudo-token values (B, Hkv, G or 1, C, D): "mean" the value means (B, Hkv, C, D),
    "sub" :func:`~stochattn.reference.cluster_mass.value_sub`, "tilt"
    :func:`~stochattn.reference.cluster_mass.value_tilt`."""
    B, Hq, D = q.shape
    Hkv = value_means.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    if name == "mean":
        return value_means[:, :, None]
    if name == "sub":
        lx = _sub_logits(xp, qg, stats, scale)                      # (B, Hkv, G, C, m)
        with _errstate(xp):
            w = xp.exp(lx - lx.max(-1, keepdims=True))
            w = xp.where(xp.isnan(w), 0.0, w)
        sv = _stat(stats, "sub_values")[:, :, None]                 # (B, Hkv, 1, C, m, D)
        num = xp.matmul(w[..., None, :], sv)[..., 0, :]            # (B, Hkv, G, C, D)
        den = w.sum(-1)[..., None]
        return num / xp.where(den > 0, den, 1.0)
    if name == "tilt":
        pq = _qdot(xp, _stat(stats, "basis"), qg)                   # (B, Hkv, G, C, r)
        cross = _stat(stats, "cross")[:, :, None]                   # (B, Hkv, 1, C, r, D)
        return value_means[:, :, None] + alpha * scale * xp.matmul(pq[..., None, :], cross)[..., 0, :]
    raise ValueError(f"`value`: expected one of {cm.VALUE_ESTIMATES}, got {name!r}")


# ----------------------------------------------------------------------------- decode

def exact_log_mass(xp, x, lab, C):
    """True ``log Z_i`` (B, Hq, C) of every cluster from logits x (B, Hq, N) and labels lab
    (B, Hkv, N) (-1: not clustered); -inf for empty clusters. Shifted by each row's
    largest clustered logit (the reference shifts by each cluster's own)."""
    B, Hq, N = x.shape
    Hkv = lab.shape[1]
    G = Hq // Hkv
    lab4 = xp.broadcast_to(lab[:, :, None, :], (B, Hkv, G, N)).reshape(B, Hq, N)
    inc = lab4 >= 0
    mrow = xp.where(inc, x, -xp.inf).max(-1)
    mrow = xp.where(xp.isfinite(mrow), mrow, 0.0)
    e = xp.where(inc, xp.exp(xp.where(inc, x, 0.0) - mrow[..., None]), 0.0)
    ids = (xp.arange(B * Hq).reshape(B, Hq, 1) * C + xp.maximum(lab4, 0)).ravel()
    Z = xp.bincount(ids, weights=e.ravel(), minlength=B * Hq * C).reshape(B, Hq, C)
    with _errstate(xp):
        return mrow[..., None] + xp.log(Z)


def select_batched(xp, lzhat, nonempty, p1, p2):
    """Stage 1 and 2 for every query head: lzhat (B, Hq, C), nonempty (B, Hq, C) bool.

    Returns code (B, Hq, C) int8 (0 dropped or empty, 1 C_exact, 2 C_approx), n_p, n_e
    (B, Hq) and the estimated mass of C_p (1 where there is no cluster)."""
    with _errstate(xp):
        mx = xp.where(nonempty, lzhat, -xp.inf).max(-1, keepdims=True)
        w = xp.where(nonempty, xp.exp(xp.where(nonempty, lzhat, 0.0) - mx), 0.0)
    order = _argsort_stable(xp, xp.where(nonempty, -w, 1.0))      # empties last
    cs = xp.cumsum(xp.take_along_axis(w, order, axis=-1), axis=-1)
    total = cs[..., -1:]
    cnt = nonempty.sum(-1)
    n_p = cnt if p1 >= 1.0 else xp.minimum((cs < p1 * total).sum(-1) + 1, cnt)
    n_e = n_p if p2 >= 1.0 else xp.minimum((cs < p2 * total).sum(-1) + 1, n_p)
    C = lzhat.shape[-1]
    rank = xp.empty_like(order)
    B_, H_ = order.shape[:2]
    rank[xp.arange(B_)[:, None, None], xp.arange(H_)[None, :, None], order] = \
        xp.arange(C)[None, None, :]
    code = xp.where(rank < n_e[..., None], 1, xp.where(rank < n_p[..., None], 2, 0)).astype(xp.int8)
    at = xp.take_along_axis(cs, xp.maximum(n_p - 1, 0)[..., None], axis=-1)[..., 0]
    with _errstate(xp):
        est = xp.where(n_p > 0, at / total[..., 0], 1.0)
    return code, n_p, n_e, est


def decode_core(xp, x, lab, lens, ws, n_sink, lzhat, nonempty, vpseudo, mix, p1, p2, *,
                lz=None, mass_diagnostics=False, approx_weight="estimate"):
    """The centroid-variant output and diagnostics of every (row, query head).

    Parameters
    ----------
    x : (B, Hq, N) float64 logits (scaled); only ``t < lens[b]`` is read.
    lab : (B, Hkv, N) int, the cluster of each clustered token of the row (positions in
        ``[n_sink, ws[b])``), -1 elsewhere.
    lens, ws : (B,) int, lengths and window starts; n_sink : int.
    lzhat : (B, Hq, C) estimated log masses; nonempty : (B, Hkv, C) bool.
    vpseudo : (B, Hkv, G or 1, C, D) pseudo-token values.
    mix : callable, ``mix(w)`` for token weights w (B, Hq, N) -> (B, Hq, D) ``sum_t w_t v_t``.
    lz : (B, Hq, C), the exact log masses (needed with ``mass_diagnostics`` and with
        ``approx_weight="exact"``: the pseudo-tokens' logits, the reference's option).

    Returns
    -------
    out (B, Hq, D) float64, diagnostics dict (the reference's keys; ``code`` the
    selection, :func:`select_batched`).
    """
    B, Hq, N = x.shape
    Hkv, C = lab.shape[1], lzhat.shape[-1]
    G = Hq // Hkv
    ne = xp.broadcast_to(nonempty[:, :, None], (B, Hkv, G, C)).reshape(B, Hq, C)
    code, n_p, n_e, est = select_batched(xp, lzhat, ne, p1, p2)
    t = xp.arange(N)
    L = lens.reshape(B, 1, 1)
    valid = t < L
    base = ((t < xp.minimum(n_sink, L)) | ((t >= ws.reshape(B, 1, 1)) & valid))   # (B, 1, N)
    lab4 = xp.broadcast_to(lab[:, :, None, :], (B, Hkv, G, N)).reshape(B, Hq, N)
    tcode = xp.where(lab4 >= 0, xp.take_along_axis(code, xp.maximum(lab4, 0), axis=-1), 0)
    exact = base | (tcode == 1)
    approx = code == 2
    lw = lz if approx_weight == "exact" else lzhat   # the pseudo-tokens' logits
    with _errstate(xp):
        me = xp.where(exact, x, -xp.inf).max(-1)
        ma = xp.where(approx, lw, -xp.inf).max(-1)
        m = xp.maximum(me, ma)
        m = xp.where(xp.isfinite(m), m, 0.0)[..., None]
        we = xp.where(exact, xp.exp(xp.where(exact, x, 0.0) - m), 0.0)
        wa = xp.where(approx, xp.exp(xp.where(approx, lw, 0.0) - m), 0.0)
    wa4 = wa.reshape(B, Hkv, G, 1, C)
    num = mix(we) + xp.matmul(wa4, vpseudo)[..., 0, :].reshape(B, Hq, -1)
    den = (we.sum(-1) + wa.sum(-1))[..., None]
    live = (lens > 0).reshape(B, 1, 1)
    out = xp.where(live, num / xp.where(den > 0, den, 1.0), 0.0)
    with _errstate(xp):
        mall = xp.where(valid, x, -xp.inf).max(-1, keepdims=True)
        wall = xp.where(valid, xp.exp(xp.where(valid, x, 0.0) - xp.where(xp.isfinite(mall), mall, 0.0)), 0.0)
    covered = exact | (tcode == 2)
    true_mass = xp.where(lens[:, None] > 0, (wall * covered).sum(-1)
                         / xp.where(wall.sum(-1) > 0, wall.sum(-1), 1.0), 0.0)
    read = exact.reshape(B, Hkv, G, N).any(2).sum(-1)
    k_read = read if approx_weight != "exact" else \
        (exact | (tcode == 2)).reshape(B, Hkv, G, N).any(2).sum(-1)
    lz0 = lens[:, None] > 0
    diag = dict(clusters_selected=n_p, clusters_exact=n_e, tokens_exact=exact.sum(-1),
                estimated_mass=xp.where(lz0, est, 0.0), true_mass=true_mass,
                k_rows_read=k_read, v_rows_read=read, code=code)
    if mass_diagnostics:
        with _errstate(xp):
            mz = xp.where(ne, lz, -xp.inf).max(-1, keepdims=True)
            wz = xp.where(ne, xp.exp(xp.where(ne, lz, 0.0) - xp.where(xp.isfinite(mz), mz, 0.0)), 0.0)
            diag["cluster_true_mass"] = xp.where(n_p > 0, (wz * (code > 0)).sum(-1)
                                                 / xp.where(wz.sum(-1) > 0, wz.sum(-1), 1.0), 1.0)
            diag["approx_log_mass_error"] = xp.where(
                approx.any(-1), _lse(xp, lzhat, approx) - _lse(xp, lz, approx), 0.0)
    return out, diag


def _lse(xp, a, sel):
    with _errstate(xp):
        m = xp.where(sel, a, -xp.inf).max(-1, keepdims=True)
        m = xp.where(xp.isfinite(m), m, 0.0)
        return m[..., 0] + xp.log(xp.where(sel, xp.exp(xp.where(sel, a, 0.0) - m), 0.0).sum(-1))


def _row_labels(xp, labels, ws, n_sink):
    """labels (B or 1, Hkv, N) -> (B, Hkv, N) with -1 outside ``[n_sink, ws[b])``."""
    N = labels.shape[-1]
    t = xp.arange(N)
    keep = (t >= n_sink) & (t < ws.reshape(-1, 1, 1))
    return xp.where(keep, labels, -1).astype(xp.int64)


def doublep_batched(q, k, v, lens, index, *, p1, p2, scale, mass="paper", value="mean",
                    mass_alpha=1.0, mass_stats=None, mass_rank=4, mass_sub=4,
                    mass_diagnostics=False, squarings=20, xp=np, approx_weight="estimate",
                    mass_margin=None):
    """The reference :func:`stochattn.reference.doublep.doublep_attention` (centroid
    variant, ``mass=``, ``value=``) for every (b, query head) at once.

    ``index`` a host :class:`~stochattn.doublep.DoublePIndex`; ``mass_stats`` a
    :class:`~stochattn.reference.cluster_mass.ClusterStats` (leading (B, Hkv)) or a dict
    from :func:`index_stats_batched`, or None: computed here by
    :func:`index_stats_batched` when the estimator needs it. Returns out (B, Hq, D) float64
    (an ``xp`` array) and a dict of diagnostics as the reference's (``k_rows_read``,
    ``v_rows_read`` per KV head), plus ``code`` (B, Hq, C): 1 for C_exact, 2 for C_approx.
    """
    if mass not in cm.MASS_ESTIMATORS:
        raise ValueError(f"`mass`: expected one of {cm.MASS_ESTIMATORS}, got {mass!r}")
    if value not in cm.VALUE_ESTIMATES:
        raise ValueError(f"`value`: expected one of {cm.VALUE_ESTIMATES}, got {value!r}")
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    C = index.sizes.shape[-1]
    margin = cm.REFINE_MARGIN if mass_margin is None else float(mass_margin)
    needs_stats = mass not in ("paper", "exact") or value != "mean"
    if needs_stats and mass_stats is None:
        mass_stats = index_stats_batched(xp, k, v, lens, index, rank=mass_rank, n_sub=mass_sub,
                                         squarings=squarings)
    elif needs_stats and not isinstance(mass_stats, dict):
        mass_stats = {f: xp.asarray(getattr(mass_stats, f)) for f in cm.ClusterStats.__dataclass_fields__}
    q64 = xp.asarray(q).astype(xp.float64)
    k64 = xp.asarray(k).astype(xp.float64)
    v64 = xp.asarray(v).astype(xp.float64)
    lens_x = xp.asarray(np.asarray(_host(lens)).astype(np.int64))
    ws = xp.asarray(np.asarray(index.window_start).astype(np.int64))
    x = xp.matmul(k64, q64.reshape(B, Hkv, G, D).transpose(0, 1, 3, 2))   # (B, Hkv, N, G)
    x = x.transpose(0, 1, 3, 2).reshape(B, Hq, N) * scale
    lab = _row_labels(xp, xp.asarray(index.labels), ws, index.n_sink)
    sizes = xp.asarray(index.sizes)
    need_lz = mass == "exact" or mass_diagnostics or approx_weight == "exact"
    lz = exact_log_mass(xp, x, lab, C) if need_lz else None
    cent = xp.asarray(index.centroids).astype(xp.float64)
    lzhat, refined = _scores(xp, mass, q64, scale=scale, sizes=sizes, centroids=cent,
                             stats=mass_stats, alpha=mass_alpha, lz=lz, p1=p1, margin=margin)
    vmeans = xp.asarray(np.asarray(index.value_means))
    vp = value_batched(xp, value, q64, scale=scale, value_means=vmeans, stats=mass_stats,
                       alpha=mass_alpha)

    def mix(w):
        return xp.matmul(w.reshape(B, Hkv, G, N), v64).reshape(B, Hq, D)

    out, d = decode_core(xp, x, lab, lens_x, ws, index.n_sink, lzhat, sizes > 0, vp, mix, p1,
                         p2, lz=lz, mass_diagnostics=mass_diagnostics,
                         approx_weight=approx_weight)
    rank = mass_stats.rank if isinstance(mass_stats, cm.ClusterStats) else mass_rank
    n_sub = mass_stats.n_sub if isinstance(mass_stats, cm.ClusterStats) else mass_sub
    return out, index_reads(xp, d, sizes, lens_x, mass, value, rank=rank, n_sub=n_sub,
                            refined=refined)


def index_reads(xp, d, sizes, lens, mass, value, *, rank, n_sub, refined=None):
    """Add the reference's ``k_index_rows`` / ``v_index_rows`` (B, Hkv) to the diagnostics
    ``d`` of :func:`decode_core` (``sizes`` (B, Hkv, C) the cluster sizes, ``lens`` (B,)):
    :func:`~stochattn.reference.cluster_mass.summary_vectors` per non-empty cluster and per
    cluster some query head of the group approximates; every key for ``mass="exact"``."""
    k_every, k_approx, v_approx = cm.summary_vectors(mass, value, rank=rank, n_sub=n_sub)
    B, Hkv, C = sizes.shape
    n_approx = (d["code"] == 2).reshape(B, Hkv, -1, C).any(2).sum(-1)
    d["k_index_rows"] = (sizes > 0).sum(-1) * k_every + n_approx * k_approx
    if refined is not None:  # "sub-near": the refined clusters' sub-centroids
        d["k_index_rows"] = d["k_index_rows"] + refined.reshape(B, Hkv, -1, C).any(2).sum(-1) * n_sub
    d["v_index_rows"] = n_approx * v_approx
    if mass == "exact":
        d["k_index_rows"] = lens.reshape(B, 1) - d["k_rows_read"]
    return d


# ----------------------------------------------------------------------------- the study

def _kmeans_xp(xp, keys, C, iterations, order, tol):
    """:func:`stochattn.reference.kmeans.kmeans` in ``xp`` (keys (H, M, D) float64,
    ``order`` the host seeding order)."""
    H, M, D = keys.shape
    n_live = min(C, M)
    live = xp.arange(C)[None, None, :] < n_live
    cent = xp.zeros((H, C, D))
    if n_live:
        first = xp.asarray(order[:, :n_live])
        cent[:, :n_live] = xp.take_along_axis(keys, first[:, :, None], axis=1)

    def nearest(c):
        sc = (c * c).sum(-1)[:, None, :] - 2.0 * xp.matmul(keys, c.transpose(0, 2, 1))
        return xp.argmin(xp.where(live, sc, xp.inf), axis=-1)

    threshold = math.floor(float(tol) * float(M))
    stopped = xp.zeros(H, dtype=bool)
    previous = None
    for _ in range(iterations):
        labels = nearest(cent)
        changed = (xp.full(H, M) if previous is None else (labels != previous).sum(-1))
        moving = ~stopped & (changed > 0)
        oh = (labels[..., None] == xp.arange(C)).astype(xp.float64)       # (H, M, C)
        counts = oh.sum(1)
        sums = xp.matmul(oh.transpose(0, 2, 1), keys)
        filled = (counts > 0) & moving[:, None]
        cent = xp.where(filled[..., None], sums / xp.maximum(counts, 1.0)[..., None], cent)
        stopped = stopped | (changed <= threshold)
        if bool(stopped.all()):
            break
        previous = labels
    return cent, nearest(cent), n_live


class LayerIndex:
    """The decode-faithful index of one layer for P rows (:func:`decode_index_batched`).

    Attributes
    ----------
    centroids : (Hkv, C, D) float64, fixed after the prefill.
    labels : (Hkv, N) int64, the cluster of every token in ``[n_sink, ws[-1])``, -1 elsewhere.
    ws : (P,) int64 window starts; sizes : (P, Hkv, C) int64.
    state : (P, Hkv, C) int64, the row of ``stats`` describing that cluster at that row.
    stats : dict of (S, ...) arrays, :data:`STAT_FIELDS` (None until :meth:`add_stats`).
    """

    def __init__(self, xp, K, V, centroids, labels, ws, sizes, n_sink, prompt_ws):
        self.xp, self.K, self.V = xp, K, V
        self.centroids, self.labels, self.ws, self.sizes = centroids, labels, ws, sizes
        self.n_sink, self.prompt_ws = n_sink, prompt_ws
        self.stats = None
        self.rank, self.n_sub = 4, 4  # what add_stats computes (the read-cost rule needs them)
        Hkv, C = centroids.shape[:2]
        N = labels.shape[-1]
        # Each cluster's members in ascending position (the CSR of the last row), flat
        # over KV heads with N slots each; the state of size s is its first s members.
        key = xp.where(labels >= 0, labels, C)
        self.tok = (_argsort_stable(xp, key) + xp.arange(Hkv)[:, None] * N).reshape(-1)
        first = _host(sizes[0]).astype(np.int64)                     # (Hkv, C)
        last = _host(sizes[-1]).astype(np.int64)
        off = np.cumsum(last, axis=-1) - last + np.arange(Hkv)[:, None] * N
        n_states = (last - first + 1).ravel()                         # sizes first..last
        base = np.cumsum(n_states) - n_states
        self.state = xp.asarray(base.reshape(1, Hkv, C)) + sizes - xp.asarray(first)[None]
        S = int(n_states.sum())
        cl = np.repeat(np.arange(Hkv * C), n_states)
        within = np.arange(S) - np.repeat(base, n_states)
        self._src = cl // C
        self._starts = off.ravel()[cl]
        self._sizes = first.ravel()[cl] + within
        self.n_states = S

    def add_stats(self, rank=4, n_sub=4, squarings=20, budget=None):
        self.rank, self.n_sub = rank, n_sub
        xp = self.xp
        budget = budget or (1 << 22 if xp is np else 1 << 25)  # GPU: fewer, larger chunks
        N = self.labels.shape[-1]
        K = self.K[:, :N].reshape(-1, self.K.shape[-1])[None]        # (1, Hkv N, D)
        V = self.V[:, :N].reshape(-1, self.V.shape[-1])[None]
        self.stats = state_stats(xp, K, V, np.zeros_like(self._src), self._starts, self._sizes,
                                 self.tok, rank=rank, n_sub=n_sub, squarings=squarings,
                                 budget=budget)
        return self

    def rows(self, a, b, fields):
        """Per-row arrays of rows [a, b): sizes, value means, labels and the statistics
        ``fields`` with leading (b - a, Hkv, C)."""
        sid = self.state[a:b]
        st = {f: self.stats[f][sid] for f in set(fields) | {"vmean"}}
        return st


def decode_index_batched(xp, K, V, lens, *, prefill, n_clusters, iterations=10, n_sink=4,
                         window=64, seed=0, tol=None):
    """The index :func:`stochattn.eval.llm.evaluate.decode_index` builds, for rows of
    lengths ``lens`` (non-decreasing, > prefill) over one exact cache K, V (Hkv, T, D)
    float64: the reference k-means of ``[0, prefill)`` (batch 1, row 0's seeding), then
    every token that leaves the window by row P - 1 joins its nearest centroid (or seeds a
    cluster while some have none). Returns a :class:`LayerIndex` (no statistics yet)."""
    from stochattn.reference.kmeans import DEFAULT_TOL, init_order, window_starts

    tol = DEFAULT_TOL if tol is None else tol
    Hkv, T, D = K.shape
    C = n_clusters
    lens_h = np.asarray(_host(lens)).astype(np.int64)
    if np.any(np.diff(lens_h) < 0) or lens_h[0] <= prefill:
        raise ValueError(f"`lens`: expected non-decreasing and > prefill {prefill}")
    ws0 = int(window_starts(np.array([prefill]), n_sink, window)[0])
    ws_rows = window_starts(lens_h, n_sink, window)
    N = int(lens_h[-1])
    labels = xp.full((Hkv, N), -1, dtype=xp.int64)
    M = ws0 - n_sink
    cent = xp.zeros((Hkv, C, D))
    n_live = 0
    if M > 0:
        order = init_order(seed, np.arange(Hkv)[:, None], np.arange(n_sink, ws0, dtype=np.int64))
        cent, lab, n_live = _kmeans_xp(xp, K[:, n_sink:ws0], C, iterations, order, tol)
        labels[:, n_sink:ws0] = lab
    a, b = max(ws0, n_sink), int(ws_rows[-1])
    if b > a:
        new = K[:, a:b]
        n_seed = min(C - n_live, b - a)
        if n_seed > 0:  # clusters without a centroid: the next tokens seed them, in order
            cent[:, n_live:n_live + n_seed] = new[:, :n_seed]
            labels[:, a:a + n_seed] = xp.arange(n_live, n_live + n_seed)[None]
        if b - a > n_seed:
            rest = new[:, n_seed:]
            sc = (cent * cent).sum(-1)[:, None, :] - 2.0 * xp.matmul(rest, cent.transpose(0, 2, 1))
            labels[:, a + n_seed:b] = xp.argmin(sc, axis=-1)
    # sizes per row: counts of labels among [n_sink, ws_row)
    ws_x = xp.asarray(ws_rows)
    P = lens_h.size
    t = xp.arange(N)
    lab_ok = labels >= 0
    row_of = xp.searchsorted(ws_x, t, side="right")              # first row whose ws > t
    ids = (row_of[None, :] * Hkv + xp.arange(Hkv)[:, None]) * C + xp.maximum(labels, 0)
    cnt = xp.bincount(ids[lab_ok & (row_of[None, :] < P)], minlength=P * Hkv * C)
    sizes = xp.cumsum(cnt.reshape(P, Hkv, C), axis=0)
    return LayerIndex(xp, K, V, cent, labels, ws_x, sizes, n_sink, ws0)


def _needed_fields(mass, value):
    f = set()
    if mass in ("mean", "diag-var", "pca", "pca-clip", "bennett"):
        f |= {"mean", "var", "basis", "eig", "rest", "radius", "proj_max", "perp_radius"}
    if mass in ("sub", "sub-near") or value == "sub":
        f |= {"sub_sizes", "sub_means"}
    if value == "sub":
        f.add("sub_values")
    if value == "tilt":
        f |= {"basis", "cross"}
    return f


def decode_rows(xp, li, q, k_own, v_own, pos, a, b, *, mass, value, alpha, p1, p2, scale,
                mass_diagnostics=True, error_acc=None, error_estimators=(),
                approx_weight="estimate", margin=cm.REFINE_MARGIN):
    """Double-P with ``mass`` / ``value`` for rows [a, b) of a :class:`LayerIndex`: row i's
    query q[i] (Hq, D) attends over the exact cache below pos[i] and its own key / value
    k_own[i], v_own[i] (Hkv, D) at pos[i]. Returns out (b - a, Hq, D) and diagnostics;
    with ``error_acc`` (a dict) the per-cluster log-mass errors of ``error_estimators``
    (name, alpha) are accumulated as :func:`stochattn.eval.mass_study._mass_errors` does."""
    K, V = li.K, li.V
    Hkv, _, D = K.shape
    Bn, Hq = b - a, q.shape[1]
    G = Hq // Hkv
    ps = pos[a:b]
    n = int(_host(ps[-1:])[0]) + 1
    lens = ps + 1
    ws = li.ws[a:b]
    qg = q.reshape(Bn, Hkv, G, D)
    # logits over the shared exact cache, then each row's own key at its position
    x = xp.matmul(qg.transpose(1, 0, 2, 3).reshape(Hkv, Bn * G, D), K[:, :n].transpose(0, 2, 1))
    x = x.reshape(Hkv, Bn, G, n).transpose(1, 0, 2, 3)
    rows = xp.arange(Bn)
    own = (qg * k_own[:, :, None, :]).sum(-1)                      # (Bn, Hkv, G)
    x[rows, :, :, ps] = own
    x = x.reshape(Bn, Hq, n) * scale
    lab = _row_labels(xp, li.labels[None, :, :n], ws, li.n_sink)
    lab = xp.broadcast_to(lab, (Bn, Hkv, n))
    sizes = li.sizes[a:b]
    C = sizes.shape[-1]
    fields = _needed_fields(mass, value)
    for name, _ in error_estimators:
        fields |= _needed_fields(name, "mean")
    st = li.rows(a, b, fields)
    need_lz = (mass == "exact" or mass_diagnostics or error_acc is not None
               or approx_weight == "exact")
    lz = exact_log_mass(xp, x, lab, C) if need_lz else None
    cent = xp.broadcast_to(li.centroids[None], (Bn,) + li.centroids.shape)
    lzhat, refined = _scores(xp, mass, q, scale=scale, sizes=sizes, centroids=cent, stats=st,
                             alpha=alpha, lz=lz, p1=p1, margin=margin)
    vp = value_batched(xp, value, q, scale=scale, value_means=st["vmean"], stats=st, alpha=alpha)
    Vn = V[:, :n]

    def mix(w):
        w4 = w.reshape(Bn, Hkv, G, n)
        o = xp.matmul(w4.transpose(1, 0, 2, 3).reshape(Hkv, Bn * G, n), Vn)
        o = o.reshape(Hkv, Bn, G, D).transpose(1, 0, 2, 3)
        wp = w4[rows, :, :, ps]                                    # (Bn, Hkv, G)
        o = o + wp[..., None] * (v_own - Vn[:, ps].transpose(1, 0, 2))[:, :, None, :]
        return o.reshape(Bn, Hq, D)

    out, d = decode_core(xp, x, lab, lens, ws, li.n_sink, lzhat, sizes > 0, vp, mix, p1, p2,
                         lz=lz, mass_diagnostics=mass_diagnostics, approx_weight=approx_weight)
    d = index_reads(xp, d, sizes, lens, mass, value, rank=li.rank, n_sub=li.n_sub,
                    refined=refined)
    if error_acc is not None:
        ne = xp.broadcast_to((sizes > 0)[:, :, None], (Bn, Hkv, G, C)).reshape(Bn, Hq, C)
        has = ne.any(-1)
        with _errstate(xp):
            mz = xp.where(ne, lz, -xp.inf).max(-1, keepdims=True)
            w = xp.where(ne, xp.exp(xp.where(ne, lz, 0.0) - xp.where(xp.isfinite(mz), mz, 0.0)), 0.0)
            w = w / xp.where(w.sum(-1, keepdims=True) > 0, w.sum(-1, keepdims=True), 1.0)
            nc = xp.maximum(ne.sum(-1), 1)
            for name, al in error_estimators:
                e = log_mass_batched(xp, name, q, scale=scale, sizes=sizes, centroids=cent,
                                     stats=st, alpha=al) - lz
                e = xp.where(ne, e, 0.0)
                key = name + ("" if al == 1.0 else f"-a{al:g}")
                acc = error_acc.setdefault(key, dict(weighted=0.0, weighted_abs=0.0, mean=0.0, n=0))
                acc["weighted"] += float(((w * e).sum(-1) * has).sum())
                acc["weighted_abs"] += float(((w * xp.abs(e)).sum(-1) * has).sum())
                acc["mean"] += float(((e.sum(-1) / nc) * has).sum())
                acc["n"] += int(has.sum())
    return out, d


def run_play_batched(play, *, n_tokens=8192, stride=4, first=None, configs, seeds=(0,), rank=4,
                     n_sub=4, cluster_ratio=16, weights=None, xp=np, row_bytes=256 << 20,
                     error_estimators=None, squarings=20, log=print):
    """:func:`stochattn.eval.mass_study.run_play` on the batched path, NumPy or CuPy.

    The same protocol (exact prefix, every ``stride``-th position of the second half, the
    decode-faithful index with prompt / ``cluster_ratio`` clusters, every configuration
    with its own residual stream) with the index's k-means seed ``seeds`` (one result per
    seed, ``seed`` in each). ``row_bytes`` bounds one chunk's (rows x Hq x N) float64
    logits. Returns a list of per-play results (one per seed), as run_play's.
    """
    from stochattn.eval.llm.evaluate import evaluated_positions, load_tokens
    from stochattn.eval.llm.forward import forward, mlp, qkv, rope_tables, token_losses
    from stochattn.eval.llm.model import load_model
    from stochattn.eval.mass_study import ERROR_ESTIMATORS

    error_estimators = ERROR_ESTIMATORS if error_estimators is None else error_estimators
    weights = weights if weights is not None else load_model()
    if xp is not np and isinstance(weights.token_embd, np.ndarray):
        weights = weights.to(xp)
    cfg = weights.config
    tokens = load_tokens(play, n_tokens)
    first = n_tokens // 2 if first is None else first
    pos = evaluated_positions(n_tokens, first=first, stride=stride)
    t0 = time.perf_counter()
    prefix = forward(weights, tokens[:pos[-1] + 1], keep_kv=True, xp=xp)
    pos_x = xp.asarray(pos)
    tok_x = xp.asarray(tokens)
    exact_losses = _host(token_losses(weights, prefix.hidden[pos_x], tok_x[pos_x + 1], xp=xp))
    t_prefix = time.perf_counter() - t0
    log(f"{play}: exact prefix {t_prefix:.1f} s, {pos.size} positions")
    P, Hq, D = pos.size, cfg.q_heads, cfg.head_dim
    scale = 1.0 / math.sqrt(D)
    cos, sin = rope_tables(pos, D, cfg.rope_theta, xp)
    # a configuration's "cluster_ratio" (default ``cluster_ratio``): prompt / ratio clusters;
    # one index per ratio and layer, shared by that ratio's configurations
    ratio_of = {c["label"]: c.get("cluster_ratio", cluster_ratio) for c in configs}
    ratios = sorted(set(ratio_of.values()))
    n_clusters = max(1, first // cluster_ratio)
    step = max(1, int(row_bytes // (Hq * (int(pos[-1]) + 1) * 8)))
    paper_label = next((c["label"] for c in configs if c["mass"] == "paper"
                        and ratio_of[c["label"]] == cluster_ratio), configs[0]["label"])
    results = []
    for seed in seeds:
        ts = time.perf_counter()
        y0 = xp.take(weights.token_embd, tok_x[pos_x], axis=0)
        ys = {c["label"]: y0.copy() for c in configs}
        keys = ("k_read", "v_read", "k_read_all", "v_read_all", "estimated_mass",
                "cluster_true_mass", "true_mass", "approx_log_mass_error", "clusters_selected",
                "clusters_exact")
        diag = {c["label"]: {k: [] for k in keys} for c in configs}
        err_acc = {}
        t_index = t_est = 0.0
        for li, layer in enumerate(weights.layers):
            t1 = time.perf_counter()
            K = xp.ascontiguousarray(xp.transpose(prefix.k[li], (1, 0, 2)).astype(xp.float64))
            V = xp.ascontiguousarray(xp.transpose(prefix.v[li], (1, 0, 2)).astype(xp.float64))
            lidxs = {r: decode_index_batched(xp, K, V, pos + 1, prefill=first,
                                             n_clusters=max(1, first // r), iterations=10,
                                             seed=seed).add_stats(rank, n_sub, squarings)
                     for r in ratios}
            if xp is not np:
                xp.cuda.Device().synchronize()
            t_index += time.perf_counter() - t1
            t1 = time.perf_counter()
            for c in configs:
                lab_ = c["label"]
                lidx = lidxs[ratio_of[lab_]]
                q, k_own, v_own = qkv(layer, ys[lab_], cos, sin, cfg, "interleaved", xp)
                q = q.astype(xp.float64)
                k_own = k_own.astype(xp.float64)
                v_own = v_own.astype(xp.float64)
                out = xp.empty((P, Hq, D), dtype=xp.float32)
                sums = {k: xp.zeros(()) for k in keys}
                for a in range(0, P, step):
                    b = min(P, a + step)
                    o, d = decode_rows(
                        xp, lidx, q[a:b], k_own[a:b], v_own[a:b], pos_x, a, b, mass=c["mass"],
                        value=c["value"], alpha=c["alpha"], p1=c["p1"], p2=c["p2"], scale=scale,
                        approx_weight=c.get("approx_weight", "estimate"),
                        margin=c.get("margin", cm.REFINE_MARGIN),
                        error_acc=err_acc if lab_ == paper_label else None,
                        error_estimators=error_estimators if lab_ == paper_label else ())
                    out[a:b] = o.astype(xp.float32)
                    lens = (pos_x[a:b] + 1).astype(xp.float64)[:, None]
                    sums["k_read"] += (d["k_rows_read"] / lens).mean() * (b - a)
                    sums["v_read"] += (d["v_rows_read"] / lens).mean() * (b - a)
                    sums["k_read_all"] += ((d["k_rows_read"] + d["k_index_rows"])
                                           / lens).mean() * (b - a)
                    sums["v_read_all"] += ((d["v_rows_read"] + d["v_index_rows"])
                                           / lens).mean() * (b - a)
                    for k in keys[4:]:
                        sums[k] += d[k].astype(xp.float64).mean() * (b - a)
                for k in keys:
                    diag[lab_][k].append(float(sums[k]) / P)
                y = ys[lab_]
                y = y + out.reshape(P, -1) @ layer["attn_output"].T
                ys[lab_] = y + mlp(layer, y, cfg, xp)
            if xp is not np:
                xp.cuda.Device().synchronize()
            t_est += time.perf_counter() - t1
            log(f"{play} seed {seed}: layer {li} done (index+stats {t_index:.1f} s, "
                f"{sum(x.n_states for x in lidxs.values())} states; estimators {t_est:.1f} s)")
        res = dict(play=play, seed=seed, n_tokens=n_tokens, stride=stride, first=first,
                   positions=pos.tolist(), n_clusters=n_clusters, rank=rank, n_sub=n_sub,
                   loss_exact=[float(x) for x in exact_losses], seconds_prefix=t_prefix,
                   seconds_index=t_index, seconds_estimators=t_est,
                   seconds=time.perf_counter() - ts, path="batched", xp=xp.__name__,
                   configs={})
        for c in configs:
            lab_ = c["label"]
            losses = _host(token_losses(weights, ys[lab_], tok_x[pos_x + 1], xp=xp))
            dd = {k: float(np.mean(v)) for k, v in diag[lab_].items()}
            res["configs"][lab_] = dict(c, losses=[float(x) for x in losses], diagnostics=dd,
                                        n_clusters=max(1, first // ratio_of[lab_]))
        res["mass_error"] = {name: dict(weighted=a_["weighted"] / a_["n"],
                                        weighted_abs=a_["weighted_abs"] / a_["n"],
                                        mean=a_["mean"] / a_["n"], heads=a_["n"])
                             for name, a_ in err_acc.items()}
        results.append(res)
    return results
