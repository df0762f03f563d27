"""Double-P decode and fixed top-k clusters (docs/estimators.md), float64.

Per query head h (KV head h // G) of sequence b, with scale s and the index of
:mod:`.kmeans`:

- Cluster scores over the non-empty clusters: ``xbar_i = s * q.C_i + log s_i``, the
  log of the centroid estimate ``Zhat_i = s_i exp(s * q.C_i)`` of the cluster's mass.
- Stage 1: ``w_i = exp(xbar_i - max xbar)`` (max shift: the largest weight is 1 and
  none overflows), clusters ordered by w descending, ties to the lower cluster index;
  ``cs`` the cumulative sums in that order and ``total = cs[-1]``. C_p is the shortest
  prefix with ``cs >= p1 * total``; p1 == 1 takes every non-empty cluster (a tail of
  weights that underflow to 0 would otherwise be cut).
- Stage 2: C_exact is the shortest prefix of the same order with ``cs >= p2 * total``,
  capped at |C_p| (p2 == 1: all of C_p); C_approx is the rest of C_p.
- Exact tokens E: sinks ``[0, min(n_sink, L))``, window ``[window_start, L)`` and the
  tokens of C_exact.
- ``approx="centroid"``: each C_approx cluster enters as one pseudo-token of logit
  ``xbar_i`` and value ``Vbar_i``; the output is the softmax mix over E and those
  pseudo-tokens, shifted by their common max.
- ``approx="sample"``: the tokens of C_approx, in ascending position, get exact logits;
  ``budget`` points of the chosen sampler (purpose PURPOSE_CLUSTER_SAMPLER, row
  b * Hq + h, stream 0) pick rows J by inverse CDF over their weights in that order, and
  ``Z_A * mean(v_J)`` replaces ``sum_A e^x v``. The denominator is exact, so the estimate
  is unbiased for the attention restricted to sinks + window + all tokens of C_p (the
  p2 = 1 output), whatever the budget. Position order (not cluster order) is the order
  the GPU walks the cache in (the keys are not regrouped by cluster there); any fixed
  order is unbiased, and the stratified and systematic samplers then stratify along the
  sequence, as SANTA does.
"""

from __future__ import annotations

import numpy as np

from .common import union_rows_per_kv_head
from .kmeans import cluster_csr
from .rng import PURPOSE_CLUSTER_SAMPLER
from .samplers import invert_cdf, sample_points

__all__ = ["cluster_scores", "select_clusters", "tokens_of", "doublep_attention",
           "cluster_topk_attention"]


def cluster_scores(q_h: np.ndarray, centroids: np.ndarray, sizes: np.ndarray, scale: float):
    """Non-empty clusters of one (b, KV head) and their scores for one query.

    Parameters
    ----------
    q_h : ndarray of float64, shape (D,)
    centroids : ndarray, shape (C, D)
    sizes : ndarray of int, shape (C,)
    scale : float

    Returns
    -------
    ids : ndarray of int64, shape (C',)
        Non-empty clusters, ascending.
    xbar : ndarray of float64, shape (C',)
        ``scale * q.C_i + log s_i``.
    """
    ids = np.flatnonzero(sizes > 0)
    cent = np.asarray(centroids[ids], dtype=np.float64)
    xbar = (cent @ q_h) * scale + np.log(sizes[ids].astype(np.float64))
    return ids, xbar


def select_clusters(xbar: np.ndarray, p1: float, p2: float):
    """Stage 1 and stage 2 selection over cluster scores.

    Returns
    -------
    order : ndarray of int64
        Indices into ``xbar`` by estimated mass, descending, ties to the lower index.
    n_p, n_exact : int
        |C_p| and |C_exact|: C_p is ``order[:n_p]``, C_exact ``order[:n_exact]``.
    cs : ndarray of float64
        Cumulative max-shifted weights in ``order``; the estimated mass of the first n
        clusters is ``cs[n - 1] / cs[-1]``.
    """
    C = xbar.size
    if C == 0:
        return np.zeros(0, dtype=np.int64), 0, 0, np.zeros(0)
    w = np.exp(xbar - xbar.max())  # max shift: weights in (0, 1], the top one exactly 1
    order = np.argsort(-w, kind="stable")  # descending; stable keeps lower index first
    cs = np.cumsum(w[order])  # running estimated mass, non-decreasing
    total = cs[-1]
    # searchsorted(side="left") finds the first prefix whose mass reaches the target.
    n_p = C if p1 >= 1.0 else min(int(np.searchsorted(cs, p1 * total, side="left")) + 1, C)
    n_e = n_p if p2 >= 1.0 else min(int(np.searchsorted(cs, p2 * total, side="left")) + 1, n_p)
    return order.astype(np.int64), n_p, n_e, cs


def tokens_of(clusters, offsets, token_ids) -> np.ndarray:
    """Token positions of the given clusters, concatenated in the given order."""
    if len(clusters) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([token_ids[offsets[c]:offsets[c + 1]] for c in clusters]).astype(np.int64)


def _mass(x: np.ndarray, covered: np.ndarray) -> float:
    """Softmax mass of the ``covered`` positions among all logits ``x`` (max-shifted)."""
    w = np.exp(x - x.max())
    return float(w[covered].sum() / w.sum())


def _new_diagnostics(B, Hq, N):
    return dict(
        clusters_selected=np.zeros((B, Hq), dtype=np.int64),
        clusters_exact=np.zeros((B, Hq), dtype=np.int64),
        tokens_exact=np.zeros((B, Hq), dtype=np.int64),
        estimated_mass=np.zeros((B, Hq)),
        true_mass=np.zeros((B, Hq)),
        k_read=np.zeros((B, Hq, N), dtype=bool),
        v_read=np.zeros((B, Hq, N), dtype=bool),
    )


def _finish_diagnostics(d, Hkv):
    d["k_rows_read"] = union_rows_per_kv_head(d.pop("k_read"), Hkv)
    d["v_rows_read"] = union_rows_per_kv_head(d.pop("v_read"), Hkv)
    return d


def _heads(q, k, v, lens, index):
    """Yield per (b, kvh): b, kvh, L, base tokens, K, V (float64, first L rows), csr slices."""
    B, Hkv = k.shape[0], k.shape[1]
    offsets, token_ids = cluster_csr(index.labels, index.sizes, index.window_start, index.n_sink)
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue  # zero output row, nothing read
        ws = int(index.window_start[b])
        base = np.concatenate([np.arange(min(index.n_sink, L)), np.arange(ws, L)]).astype(np.int64)
        for kvh in range(Hkv):
            K = np.asarray(k[b, kvh, :L], dtype=np.float64)
            V = np.asarray(v[b, kvh, :L], dtype=np.float64)
            yield b, kvh, L, base, K, V, offsets[b, kvh], token_ids[b, kvh]


def doublep_attention(q, k, v, lens, index, *, p1, p2, approx, budget, sampler, seed, offset,
                      scale, sample_order="position", mass="paper", value="mean",
                      mass_alpha=1.0, mass_stats=None, mass_rank=4, mass_sub=4,
                      mass_diagnostics=False, eps=None, delta=None, max_budget=None,
                      budget_rule="chebyshev", budget_norm="pilot", pilot=64,
                      pilot_share=0.25, v_sqnorms=None, token_sets=False,
                      approx_weight="estimate", mass_margin=None):
    """Double-P decode output (B, Hq, D) float64 and a dict of diagnostics arrays.

    ``index`` is a :class:`stochattn.doublep.DoublePIndex` (only its arrays are read).
    ``sample_order`` (studies only; the library and the GPU use "position"): the order of
    C_approx's tokens under the draws' CDF, "position" (ascending) or "cluster" (clusters
    in selection order, positions ascending inside a cluster; the order before 2026-12-03).

    Cluster mass estimators (issue 31; studies on the reference; ``mass="sub"`` with
    ``value="mean"`` also runs on the GPU, from an index built with ``mass="sub"``, whose
    sub-centroids :func:`~.cluster_mass.sub_only_stats` turns into ``mass_stats``):

    - ``mass``: how log Zhat_i, the cluster scores ``xbar`` of both stages and the
      pseudo-token logits of the centroid variant, are computed; one of
      :data:`stochattn.reference.cluster_mass.MASS_ESTIMATORS`. ``"paper"`` (default) is
      the paper's ``scale q.C_i + log s_i`` and the code path above, unchanged bit for bit;
      ``"exact"`` is an oracle (the members' logsumexp, reading every key); the others use
      per-cluster statistics of the members (:mod:`.cluster_mass`), taken from
      ``mass_stats`` (a :class:`~.cluster_mass.ClusterStats` with leading (B, Hkv), as
      :func:`~.cluster_mass.index_stats` returns; what an index would carry) or computed
      here from the keys and the index's labels with ``mass_rank`` principal directions
      and ``mass_sub`` sub-clusters. ``mass_alpha`` scales the quadratic corrections.
    - ``value`` (centroid variant): the pseudo-token's value, ``"mean"`` (the index's
      value means, default), ``"tilt"`` (:func:`~.cluster_mass.value_tilt`) or ``"sub"``
      (:func:`~.cluster_mass.value_sub`).
    - ``mass="sub-near"``: sub-centroids only for the clusters near stage 1's cut
      (:func:`~.cluster_mass.refined_mask`, ``mass_margin`` nats, default
      :data:`~.cluster_mass.REFINE_MARGIN`), the rest shifted by their mean gap; the
      refined clusters' sub-centroids count in ``k_index_rows``.
    - ``approx_weight`` (centroid variant): the pseudo-token's logit, ``"estimate"`` (the
      selection's log Zhat_i, default) or ``"exact"`` (the cluster's true log Z_i: its keys
      are read, K only, and counted in ``k_rows_read``); the selection is ``mass``'s either
      way. The middle road between an estimated mass and the sampled variant, which reads
      the same keys.
    - Read cost: the diagnostics' ``k_index_rows`` / ``v_index_rows`` (B, Hkv) count the
      index's D-vectors read per KV head (:func:`~.cluster_mass.summary_vectors`: the
      scoring summary of every non-empty cluster, the pseudo-token summary of each cluster
      some query head of the group approximates); with ``mass="exact"`` (an oracle that
      reads every key) ``k_index_rows`` is the keys not already in ``k_rows_read``.
    - Error-targeted budgets (sampled variant, ``budget=None``): ``eps``, ``delta``,
      ``max_budget``, ``budget_rule``, ``budget_norm``, ``pilot``, ``pilot_share`` as
      S²ANTA's; each head draws the S that :func:`.split_budgets.choose_split_budgets`
      chooses for its C_approx (the exact part's output and weight known, the pilot drawn
      from C_approx), the same points as a fixed-budget call with that S. ``v_sqnorms``
      (B, Hkv, N): the per-token ||v_j||^2 kept beside the cache (computed from ``v`` when
      None). Diagnostics ``budget``, ``budget_capped``, ``error_bound``, ``budget_pilot``
      (B, Hq).
    - ``token_sets``: add ``token_set`` (B, Hq, N) int8 to the diagnostics: 1 for the
      tokens computed exactly (sinks, window, C_exact), 2 for C_approx's, 0 elsewhere.
    - ``mass_diagnostics``: add per query head ``cluster_true_mass`` (the true mass of
      C_p's tokens among all clustered tokens, comparable with ``estimated_mass``) and
      ``approx_log_mass_error`` (``log sum_{C_approx} Zhat_i - log sum_{C_approx} Z_i``;
      0 when C_approx is empty).
    """
    if sample_order not in ("position", "cluster"):
        raise ValueError(f"`sample_order` must be 'position' or 'cluster', got {sample_order!r}")
    from . import cluster_mass as _cm

    if mass not in _cm.MASS_ESTIMATORS:
        raise ValueError(f"`mass`: expected one of {_cm.MASS_ESTIMATORS}, got {mass!r}")
    if value not in _cm.VALUE_ESTIMATES:
        raise ValueError(f"`value`: expected one of {_cm.VALUE_ESTIMATES}, got {value!r}")
    if approx_weight not in ("estimate", "exact"):
        raise ValueError(f"`approx_weight` must be 'estimate' or 'exact', got {approx_weight!r}")
    margin = _cm.REFINE_MARGIN if mass_margin is None else float(mass_margin)
    needs_stats = mass not in ("paper", "exact") or value != "mean"
    if needs_stats and mass_stats is None:
        mass_stats = _cm.index_stats(k, v, lens, index, rank=mass_rank, n_sub=mass_sub)
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q64 = np.asarray(q, dtype=np.float64)
    out = np.zeros((B, Hq, D))
    diag = _new_diagnostics(B, Hq, N)
    targeted = eps is not None
    if targeted:
        if approx != "sample" or budget is not None:
            raise ValueError("`eps`: error-targeted budgets need approx='sample' and budget=None")
        if delta is None or max_budget is None:
            raise ValueError("`eps` needs `delta` and `max_budget`")
        from ..budget_rules import SPLIT_NORMS, check_options
        check_options(eps, delta, max_budget, budget_rule, budget_norm, pilot, pilot_share,
                      SPLIT_NORMS)
        from .budgets import value_sqnorms
        from .split_budgets import choose_split_budgets
        sqn = value_sqnorms(v) if v_sqnorms is None else np.asarray(v_sqnorms, dtype=np.float64)
        for key, dt in (("budget", np.int64), ("budget_capped", bool), ("error_bound", float),
                        ("budget_pilot", np.int64)):
            diag[key] = np.zeros((B, Hq), dtype=dt)
        picks_of = {}
    elif approx == "sample":
        rows = np.arange(B * Hq, dtype=np.int64).reshape(B, Hq)  # row = b * Hq + h
        points = sample_points(sampler, budget, seed=seed, offset=offset, row=rows, stream=0,
                               purpose=PURPOSE_CLUSTER_SAMPLER, heads=Hq)  # (B, Hq, budget)
        diag["sample_indices"] = np.full((B, Hq, budget), -1, dtype=np.int64)  # -1: no draw
    if token_sets:
        diag["token_set"] = np.zeros((B, Hq, N), dtype=np.int8)
    value_means = index.value_means  # VS_i / s_i, 0 for empty clusters
    if mass_diagnostics:
        diag["cluster_true_mass"] = np.zeros((B, Hq))
        diag["approx_log_mass_error"] = np.zeros((B, Hq))
    rank = mass_stats.rank if mass_stats is not None else mass_rank
    n_sub = mass_stats.n_sub if mass_stats is not None else mass_sub
    k_every, k_approx, v_approx = _cm.summary_vectors(mass, value if approx == "centroid" else "mean",
                                                      rank=rank, n_sub=n_sub)
    if approx != "centroid":
        k_approx = v_approx = 0  # C_approx is sampled: its rows are in k_read / v_read
    diag["k_index_rows"] = np.zeros((B, Hkv), dtype=np.int64)
    diag["v_index_rows"] = np.zeros((B, Hkv), dtype=np.int64)
    for b, kvh, L, base, K, V, offsets, token_ids in _heads(q, k, v, lens, index):
        sizes = index.sizes[b, kvh]
        means = value_means[b, kvh]
        approx_any = np.zeros(sizes.shape[0], dtype=bool)  # approximated by a head of the group
        refined_any = np.zeros(sizes.shape[0], dtype=bool)  # "sub-near": refined by one
        for g in range(G):
            h = kvh * G + g
            x = (K @ q64[b, h]) * scale  # exact logits of the whole sequence, (L,)
            ids, xbar = cluster_scores(q64[b, h], index.centroids[b, kvh], sizes, scale)
            st = _cm.stats_at(mass_stats, b, kvh, ids) if needs_stats else None
            if mass == "sub-near":
                refined = _cm.refined_mask(xbar, p1, margin)
                refined_any[ids[refined]] = True
                xbar = _cm.log_mass_refined(xbar, _cm.log_mass_subcentroid(q64[b, h], st, scale),
                                            refined)
            elif mass != "paper":
                xbar = _cm.log_mass(mass, q64[b, h], scale=scale, centroids=None,
                                    sizes=sizes[ids], stats=st, alpha=mass_alpha, x=x,
                                    offsets=offsets, token_ids=token_ids, ids=ids)
            order, n_p, n_e, cs = select_clusters(xbar, p1, p2)
            if mass_diagnostics:
                lz = _cm.log_mass_exact(x, offsets, token_ids, ids)
                wz = np.exp(lz - lz.max()) if lz.size else lz
                diag["cluster_true_mass"][b, h] = (wz[order[:n_p]].sum() / wz.sum()
                                                   if n_p else 1.0)
                sel = order[n_e:n_p]
                if sel.size:
                    diag["approx_log_mass_error"][b, h] = (np.logaddexp.reduce(xbar[sel])
                                                           - np.logaddexp.reduce(lz[sel]))
            exact = np.concatenate([base, tokens_of(ids[order[:n_e]], offsets, token_ids)])
            approx_ids = ids[order[n_e:n_p]]
            approx_any[approx_ids] = True
            if token_sets:
                diag["token_set"][b, h, exact] = 1
                diag["token_set"][b, h, tokens_of(approx_ids, offsets, token_ids)] = 2
            xe = x[exact]
            if approx == "centroid":
                xa = xbar[order[n_e:n_p]]  # pseudo-token logits log Zhat_i
                if approx_weight == "exact":  # the true log Z_i from the members' keys
                    xa = _cm.log_mass_exact(x, offsets, token_ids, approx_ids)
                m = max(xe.max(initial=-np.inf), xa.max(initial=-np.inf))  # common max shift
                we, wa = np.exp(xe - m), np.exp(xa - m)
                if value == "mean":
                    va = means[approx_ids]
                else:
                    sa = _cm.stats_at(st, order[n_e:n_p])
                    va = (_cm.value_tilt(q64[b, h], means[approx_ids], sa, scale, mass_alpha)
                          if value == "tilt" else _cm.value_sub(q64[b, h], sa, scale))
                num = we @ V[exact] + wa @ va
                den = we.sum() + wa.sum()
                approx_tokens = tokens_of(approx_ids, offsets, token_ids)
                v_extra = np.zeros(0, dtype=np.int64)
                k_extra = approx_tokens if approx_weight == "exact" else v_extra
            else:
                approx_tokens = tokens_of(approx_ids, offsets, token_ids)
                if sample_order == "position":
                    approx_tokens = np.sort(approx_tokens)
                xa = x[approx_tokens]
                m = max(xe.max(initial=-np.inf), xa.max(initial=-np.inf))
                we, wa = np.exp(xe - m), np.exp(xa - m)
                num = we @ V[exact]
                den = we.sum()
                k_extra = approx_tokens
                v_extra = np.zeros(0, dtype=np.int64)
                if approx_tokens.size:
                    z_a = wa.sum()  # exact mass of C_approx (shifted by m)
                    if targeted:  # this head's S for its C_approx, then that many points
                        den_e = we.sum()
                        ch = choose_split_budgets(
                            wa[None], V[approx_tokens][None], sqn[b, kvh, approx_tokens][None],
                            np.array([den_e / (den_e + z_a)]),
                            (num / den_e if den_e > 0 else np.zeros(D))[None], eps=eps,
                            delta=delta, max_budget=max_budget, rule=budget_rule,
                            norm=budget_norm, pilot=pilot, pilot_share=pilot_share, seed=seed,
                            offset=offset, rows=np.array([b * Hq + h]), heads=Hq)
                        diag["budget"][b, h] = ch.budget[0]
                        diag["budget_capped"][b, h] = ch.capped[0]
                        diag["error_bound"][b, h] = ch.error_bound[0]
                        diag["budget_pilot"][b, h] = np.broadcast_to(ch.pilot,
                                                                     ch.budget.shape)[0]
                        pts = sample_points(sampler, int(ch.budget[0]), seed=seed,
                                            offset=offset, row=b * Hq + h, stream=0,
                                            purpose=PURPOSE_CLUSTER_SAMPLER, heads=Hq)
                    else:
                        pts = points[b, h]
                    picks = approx_tokens[invert_cdf(wa, pts)]
                    if targeted:
                        picks_of[b, h] = picks
                    else:
                        diag["sample_indices"][b, h] = picks
                    # Unbiased: E[mean v_J] = sum_A (w_j / Z_A) v_j; the denominator is exact.
                    num = num + z_a * V[picks].mean(axis=0)
                    den = den + z_a
                    v_extra = picks
            out[b, h] = num / den
            diag["clusters_selected"][b, h] = n_p
            diag["clusters_exact"][b, h] = n_e
            diag["tokens_exact"][b, h] = exact.size
            diag["estimated_mass"][b, h] = cs[n_p - 1] / cs[-1] if n_p else 1.0
            diag["true_mass"][b, h] = _mass(x, np.concatenate([exact, approx_tokens]))
            diag["k_read"][b, h, exact] = True
            diag["k_read"][b, h, k_extra] = True
            diag["v_read"][b, h, exact] = True
            diag["v_read"][b, h, v_extra] = True
        n_approx = int(approx_any.sum())
        diag["k_index_rows"][b, kvh] = (int((sizes > 0).sum()) * k_every + n_approx * k_approx
                                        + int(refined_any.sum()) * n_sub)
        diag["v_index_rows"][b, kvh] = n_approx * v_approx
    if targeted:  # (B, Hq, max S), -1 after a head's S draws
        width = max([p.size for p in picks_of.values()], default=0)
        diag["sample_indices"] = np.full((B, Hq, width), -1, dtype=np.int64)
        for (b, h), p in picks_of.items():
            diag["sample_indices"][b, h, :p.size] = p
    diag = _finish_diagnostics(diag, Hkv)
    if mass == "exact":  # the oracle's masses read every key of the sequence
        diag["k_index_rows"] = np.asarray(lens, dtype=np.int64)[:, None] - diag["k_rows_read"]
    return out, diag


def cluster_topk_attention(q, k, v, lens, index, *, clusters, scale):
    """Fixed top-k clusters (RetroInfer-like): output (B, Hq, D) float64 and diagnostics.

    The ``clusters`` non-empty clusters of largest ``xbar`` (ties to the lower index) are
    computed exactly with the sinks and the window, renormalised over them.
    """
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q64 = np.asarray(q, dtype=np.float64)
    out = np.zeros((B, Hq, D))
    diag = _new_diagnostics(B, Hq, N)
    for b, kvh, L, base, K, V, offsets, token_ids in _heads(q, k, v, lens, index):
        for g in range(G):
            h = kvh * G + g
            x = (K @ q64[b, h]) * scale
            ids, xbar = cluster_scores(q64[b, h], index.centroids[b, kvh], index.sizes[b, kvh], scale)
            top = np.argsort(-xbar, kind="stable")[:clusters]  # descending, ties to lower index
            exact = np.concatenate([base, tokens_of(ids[top], offsets, token_ids)])
            xe = x[exact]
            we = np.exp(xe - xe.max())  # max shift
            out[b, h] = (we @ V[exact]) / we.sum()
            diag["clusters_selected"][b, h] = top.size
            diag["clusters_exact"][b, h] = top.size
            diag["tokens_exact"][b, h] = exact.size
            if xbar.size:
                w = np.exp(xbar - xbar.max())
                diag["estimated_mass"][b, h] = w[top].sum() / w.sum()
            else:
                diag["estimated_mass"][b, h] = 1.0
            diag["true_mass"][b, h] = _mass(x, exact)
            diag["k_read"][b, h, exact] = True
            diag["v_read"][b, h, exact] = True
    return out, _finish_diagnostics(diag, Hkv)
