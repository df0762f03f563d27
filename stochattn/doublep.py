"""Double-P hierarchical top-p attention and fixed top-k clusters (docs/estimators.md).

Prefill builds a :class:`DoublePIndex` (k-means on the keys of the middle tokens, per
sequence and KV head) with :func:`build_doublep_index`; each decode step calls
:func:`doublep_attention` (or the baseline :func:`cluster_topk_attention`) with that index,
and :meth:`DoublePIndex.append` absorbs the tokens that leave the exact window as the
cache grows. The arithmetic is documented in :mod:`stochattn.reference.kmeans` and
:mod:`stochattn.reference.doublep`.

On GPU arrays (CuPy, PyTorch CUDA tensors) the index is built and grown on the device by
:mod:`stochattn.cuda.doublep_index`, and the decode functions run the kernels of
:mod:`stochattn.cuda.doublep` (``approx="centroid"`` and fixed top-k clusters; the sampled
variant ``approx="sample"`` too).

:class:`DoublePPlan` and :class:`ClusterTopKPlan` are the plans of the two decode functions:
options checked once, then ``plan.run(q, k, v, seq_lens, index=index)``.

Paged caches (:mod:`stochattn.paged`, docs/paged.md): every entry point takes a
:class:`~stochattn.paged.PagedKV` in place of ``k`` (``v`` and ``seq_lens`` left out). The
reference reads a contiguous copy; on the GPU the decode kernels and the index append read
the pages in place, and the index build gathers the paged prefix into a contiguous
temporary (prefill time: it allocates and synchronises) and builds from it. The index
keeps token positions, never addresses, so it serves the paged cache as is, and pages may
move between calls.

An index knows the cache it indexes: the build records a fingerprint (the key rows at
:data:`FINGERPRINT_ROWS` token positions of each sequence and KV head), and with
``check_finite=True`` every decode compares it with the cache it is given, so an index of
other keys of the same shape is a ``ValueError`` naming ``index`` instead of a quiet wrong
answer (:meth:`DoublePIndex.check_keys`; docs/conventions.md). The default path reads
nothing of it.

Serving on the GPU: ``plan.run(q, cache, index=index, out=out)`` with a plan made by the
user allocates nothing, copies nothing to the host and does not synchronise once a first
call has sized the plan's workspace (:attr:`~stochattn.Plan.workspace`; the size is in
:mod:`stochattn.cuda.doublep`), and ``index.append(cache)`` likewise once the index's own
workspace is sized (a first append): both can be captured in one CUDA graph.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from . import _validation as val
from ._backend import backend_of, in_callers_framework
from ._plan import AttentionPlan, advance, cached_plan, device_of, is_paged, renamed
from .diagnostics import Diagnostics
from .reference import doublep as _ref
from .reference import kmeans as _km
from .reference.common import finish, lengths
from .spec import SAMPLERS

__all__ = ["ClusterTopKPlan", "DoublePIndex", "DoublePPlan", "build_doublep_index",
           "cluster_topk_attention", "doublep_attention"]

APPROX = ("centroid", "sample")
#: Cluster mass estimators of an index (``build_doublep_index(mass=)``) and of the decode
#: (``doublep_attention(mass=)``): the paper's centroid mass, or the sub-centroid mass (issue 31).
INDEX_MASSES = ("paper", "sub")


@dataclass(eq=False)
class DoublePIndex:
    """Cluster index of a KV cache for Double-P.

    Built from NumPy arrays, the index holds NumPy arrays with the dtypes below (host
    memory). Built from GPU arrays, every array lives on the cache's device in the caller's
    framework (CuPy arrays, or torch tensors for torch input), with float32 ``centroids``
    and ``value_sums`` and otherwise the dtypes below; see :mod:`stochattn.cuda.doublep_index`.

    Token ranges of sequence b with length L: sinks ``[0, min(n_sink, L))``, middle
    ``[n_sink, window_start[b])`` (clustered), window ``[window_start[b], L)``, where
    ``window_start = max(n_sink, L - window)``.

    Attributes
    ----------
    centroids : ndarray of float64, shape (B, Hkv, C, D)
        Cluster centroids; 0 for clusters that never held a token.
    sizes : ndarray of int64, shape (B, Hkv, C)
        Tokens per cluster.
    value_sums : ndarray of float64, shape (B, Hkv, C, D)
        Sum of the value rows of each cluster's tokens.
    labels : ndarray of int32, shape (B, Hkv, N)
        Cluster of each middle token; -1 for sink, window and padding positions.
    seq_lens : ndarray of int64, shape (B,)
        Sequence lengths the index describes; attention calls must pass the same.
    window_start : ndarray of int64, shape (B,)
        First position of the exact window.
    n_initialized : ndarray of int64, shape (B, Hkv)
        Clusters ``0 .. n_initialized - 1`` hold a centroid ("live"); the others are empty
        and get seeded by the first tokens appended (only when the prompt had fewer
        middle tokens than clusters).
    n_sink, window, n_clusters : int
        Construction parameters.
    fingerprint_positions : ndarray of int64, shape (B, S), or None
        The fingerprint of the keys the index was built from (:meth:`check_keys`):
        ``S = FINGERPRINT_ROWS`` token positions per sequence, spread evenly over the built
        prefix ``[0, L_b)`` with the first and the last built token among them
        (``s * (L_b - 1) // (S - 1)``); -1 for a sequence built empty. Token positions,
        never page addresses, so pages may move. None (an index made by hand): no check.
    fingerprint_keys : ndarray, shape (B, Hkv, S, D), or None
        The key rows at those positions, exact copies: float64 (float32 on a GPU index,
        on its device); 0 where the position is -1. Appends never change a token's key,
        so the fingerprint stays valid as the index grows.
    sub_centroids : ndarray, shape (B, Hkv, C, m, D), or None
        With ``build_doublep_index(..., mass="sub")`` only (None otherwise: the paper
        index, unchanged): the key means of m sub-clusters of each cluster, from the
        recursive principal splits of
        :func:`stochattn.reference.cluster_mass.index_sub_stats` (issue 31); float64
        (float32 on a GPU index). Read by ``mass="sub"`` decodes.
    sub_sizes : ndarray, shape (B, Hkv, C, m), or None
        Their sizes, int64 (int32 on a GPU index), summing to ``sizes``: an append adds
        each token to the nearest sub-centroid of its cluster
        (:func:`~stochattn.reference.cluster_mass.append_sub_tokens`).
    """

    centroids: np.ndarray
    sizes: np.ndarray
    value_sums: np.ndarray
    labels: np.ndarray
    seq_lens: np.ndarray
    window_start: np.ndarray
    n_sink: int
    window: int
    n_clusters: int
    n_initialized: np.ndarray
    fingerprint_positions: np.ndarray | None = None
    fingerprint_keys: np.ndarray | None = None
    sub_centroids: np.ndarray | None = None
    sub_sizes: np.ndarray | None = None

    @property
    def mass(self) -> str:
        """``"sub"`` when the index carries sub-centroids (built with ``mass="sub"``), else
        ``"paper"``: the cluster mass estimators its decodes may use."""
        return "paper" if self.sub_centroids is None else "sub"

    @property
    def value_means(self) -> np.ndarray:
        """``value_sums / sizes`` (B, Hkv, C, D) float64 (float32 on a GPU index, on its
        device); 0 for empty clusters."""
        if self.on_gpu:
            return _gpu_index().value_means_gpu(self)
        s = self.sizes[..., None].astype(np.float64)
        return np.divide(self.value_sums, s, out=np.zeros_like(self.value_sums), where=s > 0)

    @classmethod
    def stack(cls, indexes) -> "DoublePIndex":
        """Concatenate indexes along the batch axis into a new, independent index.

        Replicating one index (``DoublePIndex.stack([index] * n)``) or stacking copies of a
        growing index gives a batch whose entries then evolve separately under
        :meth:`append`; ``DoublePIndex.stack([index])`` is a deep copy. The label arrays
        are padded with -1 to the longest cache.

        Parameters
        ----------
        indexes : sequence of DoublePIndex
            At least one; all with the same ``n_sink``, ``window``, ``n_clusters``, KV heads
            and head dim.

        Returns
        -------
        DoublePIndex
            Batch ``sum(index.batch)``, entries in order; every array is a new copy (on the
            GPU for GPU indexes, which must all come from one framework and one device).
            The fingerprints (:meth:`check_keys`) are stacked too when every index has
            one; otherwise the stack has none. Likewise the sub-centroids (``mass="sub"``),
            when every index has them with the same count.

        Raises
        ------
        TypeError
            An element that is not a DoublePIndex; host and GPU indexes, or CuPy and torch
            indexes, mixed.
        ValueError
            No index, or indexes with different construction parameters or shapes, or GPU
            indexes on different devices.

        Examples
        --------
        >>> import numpy as np
        >>> from stochattn.doublep import DoublePIndex, build_doublep_index
        >>> rng = np.random.default_rng(0)
        >>> k = rng.standard_normal((1, 2, 300, 16)); v = rng.standard_normal((1, 2, 300, 16))
        >>> index = build_doublep_index(k, v, n_clusters=16)
        >>> DoublePIndex.stack([index] * 3).centroids.shape
        (3, 2, 16, 16)
        """
        indexes = list(indexes)
        if not indexes:
            raise ValueError("`indexes` must hold at least one DoublePIndex, got none")
        for i, ix in enumerate(indexes):
            if not isinstance(ix, DoublePIndex):
                raise TypeError(f"`indexes[{i}]` must be a DoublePIndex, got {type(ix).__name__}")
        first = indexes[0]
        expected = (first.n_sink, first.window, first.n_clusters,
                    tuple(first.centroids.shape[1:]))
        for i, ix in enumerate(indexes):
            got = (ix.n_sink, ix.window, ix.n_clusters, tuple(ix.centroids.shape[1:]))
            if got != expected:
                raise ValueError(
                    f"`indexes[{i}]` must match indexes[0] (n_sink, window, n_clusters, "
                    f"(kv_heads, clusters, head_dim)) {expected}, got {got}"
                )
        if any(ix.on_gpu for ix in indexes):  # the GPU path reports a host/GPU mix
            return cls(n_sink=first.n_sink, window=first.window, n_clusters=first.n_clusters,
                       **_gpu_index().stack_gpu(indexes))
        N = max(ix.labels.shape[-1] for ix in indexes)
        labels = []
        for ix in indexes:  # pad every label array with -1 (no cluster) to the longest cache
            lab = np.full(ix.labels.shape[:2] + (N,), -1, dtype=ix.labels.dtype)
            lab[..., :ix.labels.shape[-1]] = ix.labels
            labels.append(lab)
        cat = lambda name: np.concatenate([getattr(ix, name) for ix in indexes], axis=0)
        return cls(centroids=cat("centroids"), sizes=cat("sizes"), value_sums=cat("value_sums"),
                   labels=np.concatenate(labels, axis=0), seq_lens=cat("seq_lens"),
                   window_start=cat("window_start"), n_sink=first.n_sink, window=first.window,
                   n_clusters=first.n_clusters, n_initialized=cat("n_initialized"),
                   **_stacked_fingerprints(indexes, cat), **_stacked_sub(indexes, cat))

    def csr(self):
        """Tokens grouped by cluster, the layout a GPU kernel reads contiguously.

        Returns
        -------
        offsets : ndarray of int64, shape (B, Hkv, C + 1)
            Cluster c of (b, kvh) holds ``token_ids[b, kvh, offsets[c]:offsets[c + 1]]``.
        token_ids : ndarray of int64, shape (B, Hkv, M)
            Token positions grouped by cluster, ascending inside a cluster; M is the
            largest middle-token count over the batch; padded with -1. On a GPU index both
            arrays are computed on the device and M is the label axis N (no device-to-host
            copy of the lengths); the first columns equal the host version's.
        """
        if self.on_gpu:
            return _gpu_index().csr_gpu(self)
        return _km.cluster_csr(self.labels, self.sizes, self.window_start, self.n_sink)

    def append(self, k, v=None, seq_lens=None, *, workspace=None) -> None:
        """Absorb the tokens that left the exact window, in place.

        Call after writing the new tokens into the cache. Tokens in
        ``[window_start, max(n_sink, L' - window))`` join their nearest centroid (sizes and
        value sums updated, centroids unchanged), in position order; while a (b, KV head)
        still has clusters without a centroid, a token seeds one instead. An index with
        sub-centroids (``mass="sub"``) adds each token to the nearest sub-centroid of its
        cluster (:func:`stochattn.reference.cluster_mass.append_sub_tokens`; sub-centroids
        unchanged, as the centroids). Appending one
        token at a time gives the same index, bit for bit, as appending many at once.

        On a GPU index, ``k`` and ``v`` must be arrays of the index's framework and device
        (float16, bfloat16 or float32); the append runs on the device, in float32, without
        a host synchronisation. GPU ``seq_lens`` are not read (clamped to [0, N']), and a
        length below the index's, host or GPU, is raised to it instead of raising, since
        the index's lengths live on the device (see :mod:`stochattn.cuda.doublep_index`).
        The GPU append updates the index's arrays in place (their addresses stay) and takes
        its scratch from a workspace the index keeps: after a first append it allocates
        nothing, so it can be captured in a CUDA graph with the decode that follows.

        Parameters
        ----------
        k, v : ndarray, shape (B, Hkv, N', D)
            The grown cache; N' may exceed the N the index was built with. Or ``k`` a
            :class:`~stochattn.paged.PagedKV` (``v`` and ``seq_lens`` None): the lengths
            come from its page table; on the GPU its pages are read in place.
        seq_lens : integer ndarray, shape (B,), or None
            New lengths (None: N' each), each at least the current ``self.seq_lens``.
        workspace : None, Workspace or 1-D uint8 GPU array
            GPU scratch of the append (None: the index's own, kept between appends); the
            reference takes none (``TypeError``).

        Raises
        ------
        ValueError
            Shapes that do not match the index, or a sequence that shrinks.
        TypeError
            GPU arrays for a host index, or arrays of another framework than a GPU index's.
        """
        if (self.on_gpu or (is_paged(k) and k.device == "cuda")
                or (not is_paged(k) and backend_of(k=k, v=v) == "cuda")):
            _gpu_index().append_gpu(self, k, v, seq_lens, workspace)
            return
        if workspace is not None:
            raise TypeError("`workspace` is GPU scratch; the reference takes none")
        k, v, seq_lens = _unpaged(k, v, seq_lens)
        backend_of(k=k, v=v, seq_lens=seq_lens)  # host seq_lens only, for the reference
        B, Hkv, N, D = val.check_kv_inputs(k, v, seq_lens)
        self.check_cache(B, Hkv, D)
        new = lengths(seq_lens, B, N)
        if np.any(new < self.seq_lens):
            raise ValueError(
                f"`seq_lens` must not shrink: expected each >= {self.seq_lens.tolist()}, "
                f"got {new.tolist()}"
            )
        if N > self.labels.shape[-1]:  # the cache grew: extend the labels with -1
            grown = np.full(self.labels.shape[:2] + (N,), -1, dtype=self.labels.dtype)
            grown[..., :self.labels.shape[-1]] = self.labels
            self.labels = grown
        start = self.window_start.copy()
        _km.append_tokens(self.centroids, self.sizes, self.value_sums, self.labels,
                          self.window_start, self.n_initialized, k, v, new,
                          self.n_sink, self.window)
        if self.sub_centroids is not None:
            from .reference.cluster_mass import append_sub_tokens

            append_sub_tokens(self.sub_centroids, self.sub_sizes, self.centroids, k, self.labels,
                              start, self.window_start)
        self.seq_lens = new

    @property
    def on_gpu(self) -> bool:
        """Whether the index's arrays live on a GPU (built from GPU arrays): the one test
        that sends a method to the reference or to :mod:`stochattn.cuda.doublep_index`."""
        return not isinstance(self.centroids, np.ndarray)

    def check_cache(self, B, Hkv, D) -> None:
        """A cache of batch ``B``, ``Hkv`` KV heads and head dim ``D`` must be the one the
        index was built from (``ValueError`` naming `k` otherwise); both backends call it."""
        expected = (self.centroids.shape[0], self.centroids.shape[1], self.centroids.shape[3])
        if (B, Hkv, D) != expected:
            raise ValueError(
                f"`k` must match the index (batch, kv_heads, head_dim) {expected}, "
                f"got {(B, Hkv, D)}"
            )

    _check_cache = check_cache  # the old name, still called by stochattn.cuda.doublep_index

    def check_keys(self, k) -> None:
        """The cache ``k`` must be the one the index was built from: its keys at the
        fingerprint positions must equal those recorded at build time, exactly
        (``ValueError`` naming `index` and the first differing sequence, head and token
        otherwise). The decode functions and plans call it when ``check_finite=True``;
        an index without a fingerprint (made by hand) passes.

        The check reads ``B * Hkv * S`` key rows (``S = FINGERPRINT_ROWS``), a sample: it
        catches an index used with another cache (another request's, another layer's), not
        a cache edited in place at a token it does not sample. Keys compare in the
        index's precision (float64 on the host, float32 on a GPU index), NaN equal to NaN,
        so the same keys in another dtype that holds them exactly pass. On a GPU index it
        gathers the rows on the device (through the page table for a paged cache) and
        copies them, the recorded rows and the positions to the host: allocations and a
        synchronisation, never on the default decode path.

        Parameters
        ----------
        k : array, shape (B, Hkv, N, D), or PagedKV
            The cache: NumPy for a host index; for a GPU index, a GPU array (CuPy, torch
            CUDA, other DLPack) or a GPU :class:`~stochattn.paged.PagedKV`.

        Raises
        ------
        ValueError
            A key that differs from the recorded one, a recorded token past the cache's
            length, or a cache whose (batch, kv_heads, head_dim) is not the index's.
        """
        if self.fingerprint_positions is None or self.fingerprint_keys is None:
            return
        if self.on_gpu:
            positions, recorded, got, available = _gpu_index().fingerprint_rows_gpu(self, k)
        else:
            positions, recorded, got, available = self._fingerprint_rows(k)
        _compare_fingerprint(positions, recorded, got, available)

    def _fingerprint_rows(self, k):
        """``(positions, recorded, rows, available)`` on the host for a host index: the
        rows of ``k`` at the fingerprint positions (B, Hkv, S, D) and the tokens each
        sequence of ``k`` holds (B,)."""
        if is_paged(k):
            if k.device != "cpu":
                raise TypeError("`k` must be a NumPy cache for a host index, got a GPU PagedKV")
            k, _, lens = _unpaged(k, None, None)
            available = np.asarray(lens, dtype=np.int64)
        else:
            k = np.asarray(k)
            if k.ndim != 4:
                raise ValueError(f"`k` must have 4 dimensions (batch, kv_heads, tokens, "
                                 f"head_dim), got shape {k.shape}")
            available = np.full(k.shape[0], k.shape[2], dtype=np.int64)
        B, Hkv, N, D = k.shape
        self.check_cache(B, Hkv, D)
        positions = np.asarray(self.fingerprint_positions, dtype=np.int64)
        t = np.clip(positions, 0, N - 1)
        rows = k[np.arange(B)[:, None], :, t]  # (B, S, Hkv, D)
        return positions, np.asarray(self.fingerprint_keys), rows.transpose(0, 2, 1, 3), available

    def __repr__(self) -> str:
        B, Hkv, C, D = self.centroids.shape
        # On a GPU index, tolist() copies the lengths to the host (a synchronisation).
        where = f", device={_gpu_index().device_label(self)!r}" if self.on_gpu else ""
        return (f"DoublePIndex(batch={B}, kv_heads={Hkv}, n_clusters={C}, head_dim={D}, "
                f"n_sink={self.n_sink}, window={self.window}, seq_lens={self.seq_lens.tolist()}"
                f"{where})")


FINGERPRINT_ROWS = 8
"""Key rows per (sequence, KV head) in an index's fingerprint (see
:meth:`DoublePIndex.check_keys`)."""


def _fingerprint_positions(lens) -> np.ndarray:
    """The fingerprint positions (B, S) int64 of sequences built at ``lens`` (host): ``S =
    FINGERPRINT_ROWS`` positions ``s * (L - 1) // (S - 1)``, from the first built token to
    the last, -1 for an empty sequence. The GPU index computes the same on the device."""
    lens = np.asarray(lens, dtype=np.int64)
    S = FINGERPRINT_ROWS
    pos = np.arange(S, dtype=np.int64)[None, :] * np.maximum(lens - 1, 0)[:, None] // (S - 1)
    return np.where(lens[:, None] > 0, pos, -1)


def _fingerprint(k, lens) -> dict:
    """The fingerprint fields of a host index built from ``k`` (B, Hkv, N, D) at ``lens``:
    positions and float64 copies of the key rows there (0 where the position is -1)."""
    positions = _fingerprint_positions(lens)
    B = positions.shape[0]
    rows = np.asarray(k)[np.arange(B)[:, None], :, np.maximum(positions, 0)]  # (B, S, Hkv, D)
    keys = np.where((positions >= 0)[:, None, :, None], rows.transpose(0, 2, 1, 3), 0.0)
    return dict(fingerprint_positions=positions,
                fingerprint_keys=np.ascontiguousarray(keys, dtype=np.float64))


def _compare_fingerprint(positions, recorded, got, available) -> None:
    """The one home of the fingerprint rule, for both backends (host arrays): ``got`` (B,
    Hkv, S, D), the cache's rows at ``positions`` (B, S), must equal ``recorded`` in its
    dtype, NaN equal to NaN, wherever the position is >= 0; a position at or past
    ``available[b]`` (the tokens sequence b of the cache holds) fails too."""
    positions = np.asarray(positions, dtype=np.int64)
    recorded = np.asarray(recorded)
    got = np.asarray(got).astype(recorded.dtype)  # exact for the dtypes a cache may hold
    same = ((got == recorded) | (np.isnan(got) & np.isnan(recorded))).all(axis=-1)
    inside = positions < np.asarray(available, dtype=np.int64)[:, None]  # (B, S)
    bad = (positions >= 0)[:, None, :] & ~(same & inside[:, None, :])  # (B, Hkv, S)
    if not bad.any():
        return
    b, h, s = (int(i) for i in np.argwhere(bad)[0])
    t = int(positions[b, s])
    what = (f"token {t} lies past the cache's {int(available[b])} tokens" if not inside[b, s]
            else f"the key of token {t} differs from the one recorded at build time")
    raise ValueError(
        f"`index` must be built from this cache (by build_doublep_index, then kept current by "
        f"index.append), got an index of other keys: at sequence {b}, head {h}, {what} "
        f"({int(bad.sum())} of {int((positions >= 0).sum()) * bad.shape[1]} recorded key rows "
        f"differ)"
    )


def _stacked_sub(indexes, cat) -> dict:
    """The stacked sub-centroids (``mass="sub"``) when every index has them with one count,
    else none."""
    if any(ix.sub_centroids is None for ix in indexes):
        return {}
    if len({int(ix.sub_sizes.shape[-1]) for ix in indexes}) != 1:
        return {}
    return dict(sub_centroids=cat("sub_centroids"), sub_sizes=cat("sub_sizes"))


def _stacked_fingerprints(indexes, cat) -> dict:
    """The fingerprint fields of a stack (``cat`` concatenates one field along the batch):
    stacked when every index has a fingerprint, none otherwise."""
    if any(ix.fingerprint_positions is None or ix.fingerprint_keys is None for ix in indexes):
        return {}
    return dict(fingerprint_positions=cat("fingerprint_positions"),
                fingerprint_keys=cat("fingerprint_keys"))


def _unpaged(k, v, seq_lens):
    """A paged cache (``k`` a :class:`~stochattn.paged.PagedKV`) as the reference reads it;
    arrays as they are. The index stores token positions, never pages, so pages may move
    between calls."""
    from ._plan import is_paged

    if not is_paged(k):
        return k, v, seq_lens
    from .paged import contiguous

    return contiguous(k, v, seq_lens)


def _gpu_index():
    """The GPU half of the index (imported on first use: it imports Numba)."""
    from .cuda import doublep_index

    return doublep_index


def build_doublep_index(k, v=None, seq_lens=None, *, n_clusters, iterations=10, n_sink=4, window=64,
                        seed=0, tol=_km.DEFAULT_TOL, check_finite=False, mass="paper",
                        n_sub=4) -> DoublePIndex:
    """Prefill: k-means index of the middle tokens of every (sequence, KV head).

    Parameters
    ----------
    k, v : ndarray, shape (B, Hkv, N, D)
        Key and value caches (float16, float32 or float64). CuPy arrays or PyTorch CUDA
        tensors (float16, bfloat16 or float32) build the index on the GPU, in float32, on
        the caller's current stream and without a host synchronisation; its arrays stay on
        the device, in the caller's framework (see :mod:`stochattn.cuda.doublep_index`).
        Or ``k`` a :class:`~stochattn.paged.PagedKV` (``v``, ``seq_lens`` None): on the GPU
        its tokens are first gathered into a contiguous temporary (prefill time: this reads
        the longest length, a synchronisation, and allocates the copy), and the labels
        span the cache's ``token_bound`` so that appends never grow them.
    seq_lens : integer ndarray, shape (B,), optional
        Sequence b uses ``k[b, :, :seq_lens[b]]``; default: all N tokens. With GPU caches,
        host lengths are checked and GPU lengths are clamped to [0, N] (read and checked
        only with ``check_finite``).
    n_clusters : int
        Clusters per (sequence, KV head), C, ``1 <= C <= N``. Sequences with fewer middle
        tokens M than C leave ``C - M`` clusters empty.
    iterations : int
        Lloyd iterations (>= 0) after the seeded initialisation, at most; a final
        assignment with the final centroids always follows.
    n_sink, window : int
        Tokens kept exact at the start and at the end of each sequence (>= 0). The middle
        tokens are ``[n_sink, max(n_sink, L - window))``; a sequence with
        ``L <= n_sink + window`` has none and is attended exactly.
    seed : int
        Seed of the initialisation (a random subset of middle tokens, drawn by the
        counter-based generator: see :mod:`stochattn.reference.kmeans`).
    tol : float in [0, 1]
        Early stop, per (sequence, KV head): the centroids stop moving after a round in
        which at most ``floor(tol * M)`` of the M middle tokens changed cluster (default
        0.05; 0: only at a fixed point). See :mod:`stochattn.reference.kmeans`.
    check_finite : bool
        Check that k and v hold no NaN or inf (reads the data; off by default; on the GPU
        a synchronisation).
    mass : {"paper", "sub"}
        The cluster mass estimators the index serves (issue 31). ``"paper"`` (default): the
        centroids and sizes only. ``"sub"``: also ``n_sub`` sub-centroids per cluster and
        their sizes (:attr:`DoublePIndex.sub_centroids`, ``sub_sizes``; the recursive
        principal splits of :func:`stochattn.reference.cluster_mass.index_sub_stats`), for
        ``doublep_attention(..., mass="sub")``. On the GPU they are computed in float64 by
        :func:`stochattn.eval.mass_batched.sub_stats` (the split directions by repeated
        squaring instead of an SVD) and the build then synchronises (it reads the cluster
        sizes on the host to chunk the clusters).
    n_sub : int
        Sub-centroids per cluster with ``mass="sub"``: a power of two; the GPU decode
        takes 2, 4 or 8.

    Returns
    -------
    DoublePIndex
        With the fingerprint of ``k`` (the key rows at ``FINGERPRINT_ROWS`` positions of
        each sequence, always recorded: a small gather, no synchronisation on the GPU),
        which the decode functions compare with their cache when ``check_finite=True``.

    Raises
    ------
    ValueError
        ``n_clusters`` outside [1, N], negative ``iterations``, ``n_sink`` or ``window``,
        bad shapes.

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.doublep import build_doublep_index
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((1, 2, 300, 16)); v = rng.standard_normal((1, 2, 300, 16))
    >>> index = build_doublep_index(k, v, n_clusters=16)
    >>> index.sizes.sum(axis=-1)  # middle tokens: 300 - 4 sinks - 64 window
    array([[232, 232]])
    """
    mass = val.check_choice("mass", mass, INDEX_MASSES)
    if mass == "sub":
        n_sub = val.check_positive_int("n_sub", n_sub)
        if n_sub & (n_sub - 1):
            raise ValueError(f"`n_sub` must be a power of two, got {n_sub}")
    if is_paged(k) and k.device == "cuda":  # gathered into a contiguous temporary on the GPU
        index = DoublePIndex(**_gpu_index().build_index_gpu(
            k, v, seq_lens, n_clusters=n_clusters, iterations=iterations, n_sink=n_sink,
            window=window, seed=seed, tol=tol, check_finite=check_finite))
        return _with_sub_gpu(index, k, mass, n_sub)
    k, v, seq_lens = _unpaged(k, v, seq_lens)
    if backend_of(k=k, v=v) == "cuda":
        index = DoublePIndex(**_gpu_index().build_index_gpu(
            k, v, seq_lens, n_clusters=n_clusters, iterations=iterations, n_sink=n_sink,
            window=window, seed=seed, tol=tol, check_finite=check_finite))
        return _with_sub_gpu(index, k, mass, n_sub)
    backend_of(k=k, v=v, seq_lens=seq_lens)  # host seq_lens only, for the reference
    B, Hkv, N, D = val.check_kv_inputs(k, v, seq_lens)
    n_clusters, iterations, n_sink, window, seed = val.check_index_options(
        n_clusters, N, iterations, n_sink, window, seed)
    if check_finite:
        val.check_finite(k=k, v=v)
    lens = lengths(seq_lens, B, N)
    arrays = _km.build_index(k, v, lens, n_clusters, iterations, n_sink, window, seed, tol)
    index = DoublePIndex(seq_lens=lens.copy(), n_sink=n_sink, window=window,
                         n_clusters=n_clusters, **arrays, **_fingerprint(k, lens))
    if mass == "sub":
        from .reference.cluster_mass import index_sub_stats

        index.sub_centroids, index.sub_sizes = index_sub_stats(k, lens, index, n_sub=n_sub)
    return index


def _with_sub_gpu(index, k, mass, n_sub):
    """A GPU index with its sub-centroids when ``mass == "sub"`` (stochattn.cuda.doublep_sub)."""
    if mass == "sub":
        from .cuda.doublep_sub import sub_stats_gpu

        index.sub_centroids, index.sub_sizes = sub_stats_gpu(index, k, n_sub)
    return index


def _check_index(index, shape, seq_lens):
    """The index must be a DoublePIndex of this cache at these lengths; returns lengths."""
    if not isinstance(index, DoublePIndex):
        raise TypeError(f"`index` must be a DoublePIndex (from build_doublep_index), "
                        f"got {type(index).__name__}")
    if index.on_gpu:
        raise TypeError("`index` must hold NumPy arrays to decode NumPy arrays (the reference), "
                        f"got a GPU index ({_gpu_index().device_label(index)}): build it from "
                        "NumPy arrays")
    index.check_cache(shape.batch, shape.kv_heads, shape.head_dim)
    lens = lengths(seq_lens, shape.batch, shape.tokens)
    if not np.array_equal(lens, index.seq_lens):
        raise ValueError(
            f"`seq_lens` must equal the index's seq_lens {index.seq_lens.tolist()} "
            f"(call index.append(k, v, seq_lens) after writing new tokens), got {lens.tolist()}"
        )
    return lens


@in_callers_framework(position=1)
def _decode_cuda(function, q, k, v, seq_lens, index, softmax_scale, check_finite,
                 return_diagnostics, out=None, workspace=None, **options):
    """The GPU path of both decode functions: a GPU index of this cache, then the kernels of
    :mod:`stochattn.cuda.doublep` (lengths: the index's, on the device)."""
    from ._backend import host_ints, require_cupy

    if not isinstance(index, DoublePIndex):
        raise TypeError(f"`index` must be a DoublePIndex (from build_doublep_index), "
                        f"got {type(index).__name__}")
    if not index.on_gpu:
        raise TypeError("`index` must be a GPU index to decode GPU arrays, got a host index: "
                        "build it with build_doublep_index from the GPU cache")
    if type(q).__module__.split(".")[0] != "torch":
        require_cupy(function)
    from .cuda import doublep as _cuda

    if check_finite:  # synchronises anyway: check the lengths and the data too
        if is_paged(k):  # the pools may hold anything in unused pages and slots: q only
            val.check_finite(q=q)
            seq_lens = k.seq_lens
        else:
            val.check_finite(q=q, k=k, v=v)
        if seq_lens is not None:
            got, want = host_ints(seq_lens), host_ints(index.seq_lens)
            if not np.array_equal(got, want):
                raise ValueError(f"`seq_lens` must equal the index's seq_lens {want.tolist()} "
                                 f"(call index.append(k, v, seq_lens) after writing new tokens), "
                                 f"got {got.tolist()}")
        index.check_keys(k)  # the index's fingerprint: a few rows gathered, read back
    res = _cuda.doublep_decode(q, k, v, index, softmax_scale=softmax_scale,
                               return_diagnostics=return_diagnostics, out=out,
                               workspace=workspace, **options)
    if not return_diagnostics:
        return res
    out, d = res
    return out, _diagnostics(host_ints(index.seq_lens), d)


def _diagnostics(lens, d) -> Diagnostics:
    return Diagnostics(seq_lens=lens, k_rows_read=d["k_rows_read"], v_rows_read=d["v_rows_read"],
                       clusters_selected=d["clusters_selected"], clusters_exact=d["clusters_exact"],
                       tokens_exact=d["tokens_exact"], estimated_mass=d["estimated_mass"],
                       true_mass=d["true_mass"], budget=d.get("budget"),
                       budget_capped=d.get("budget_capped"), error_bound=d.get("error_bound"),
                       budget_pilot=d.get("budget_pilot"))


def doublep_attention(q, k, v=None, seq_lens=None, *, index, p1=0.95, p2=0.7, approx="centroid",
                      budget=None, sampler="systematic", seed=0, offset=0, softmax_scale=None,
                      check_finite=False, return_diagnostics=False, eps=None, delta=None,
                      max_budget=None, budget_rule="chebyshev", pilot=64, pilot_share=0.25,
                      budget_norm="pilot", v_sqnorms=None, mass="paper"):
    """Double-P decode: cluster-level top-p, then exact tokens or approximations per cluster.

    Stage 1 keeps the shortest set C_p of clusters (by centroid-estimated mass
    ``s_i exp(scale q.C_i)``, descending) whose estimated mass reaches ``p1``; stage 2
    computes the first clusters of C_p, up to estimated mass ``p2``, token by token and
    approximates the rest (C_approx). Sinks and window are always exact; clusters outside
    C_p are dropped.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, D)
        One query per sequence and query head.
    k, v : ndarray, shape (B, Hkv, N, D)
        Key and value caches; query head h reads KV head ``h // (Hq // Hkv)``.
    seq_lens : integer ndarray, shape (B,), optional
        Must equal ``index.seq_lens`` (None means N for every sequence and must match too).
        A sequence of length 0 yields a zero output row. On GPU arrays the kernels read the
        index's lengths (on the device); ``seq_lens`` is compared with them only when
        ``check_finite`` (which synchronises anyway).
    index : DoublePIndex
        Built from this cache by :func:`build_doublep_index`, kept current with
        :meth:`DoublePIndex.append`. GPU arrays (CuPy, torch CUDA; float16 or bfloat16,
        head_dim 64 or 128, GQA group <= 8) need a GPU index and run the kernels of
        :mod:`stochattn.cuda.doublep`: selections as the reference's except where a
        cumulative mass lies within float32 rounding of p1 or p2, and with
        ``approx="sample"`` the reference's draws except within rounding of a CDF
        boundary.
    p1, p2 : float in (0, 1]
        Stage 1 and stage 2 thresholds (paper: 0.95/0.7 for Llama-3.1-8B, 0.99/0.8 for
        Qwen3-8B), with ``p2 <= p1``: stage 2 picks clusters inside C_p, so a larger p2
        cannot be reached and is clamped to p1 with a ``UserWarning`` naming `p2` (the
        output is that of ``p2 = p1``), except ``p2 = 1``, which means every cluster of
        C_p exact (the target of the sampled variant) and warns nothing. ``p1 = p2 = 1``
        gives exact attention.
    approx : {"centroid", "sample"}
        How C_approx enters: ``"centroid"`` (the paper) as one pseudo-token per cluster,
        logit ``log Zhat_i`` and value the cluster's mean value; ``"sample"`` by ``budget``
        SANTA draws over the exact weights of C_approx's tokens, which reads their keys and
        is unbiased for the p2 = 1 output.
    budget : int, optional
        Sample points per query head; required (>= 1) with ``approx="sample"``, must be
        None with ``approx="centroid"``.
    sampler : {"systematic", "stratified", "iid"}
        Sampler of ``approx="sample"``.
    eps, delta, max_budget, budget_rule, pilot, pilot_share, budget_norm : optional
        Error-targeted budgets of the sampled variant (``approx="sample"``, ``budget``
        None), as :func:`~stochattn.santa_attention`'s: each head draws the smallest S with
        P(|o_hat - o| > eps |o|) <= delta for its C_approx, ``o`` the attention over the
        selected tokens (the p2 = 1 output; :mod:`stochattn.reference.split_budgets`),
        capped at ``max_budget``; the pilot draws come from C_approx. ``budget_norm``
        also takes ``"bound"`` here: no pilot, ``|o|`` bounded from the exact part and the
        norms alone; and ``"auto"``: per head the cheapest of that bound, a pilot sized by
        C_approx's weight and reading C_approx's values, ``pilot`` then the most a head
        reads before its main draws (give a generous one, e.g. 4096: only what pays is
        drawn). On the GPU (docs/budgets.md: its cost against fixed S) with
        ``budget_norm`` "pilot", "bound" or "auto", the budgets chosen on the device;
        "student" is the reference's only (a GPU plan refuses it, naming it).
    v_sqnorms : array (B, Hkv, N), optional
        ||v_j||^2 per token (:func:`stochattn.value_sqnorms`), read with ``eps``; computed
        from ``v`` when left out on the reference, required on the GPU (float32, on the
        device; a paged cache's in the V pool's shape without D).
    mass : {"paper", "sub"}
        The clusters' estimated mass log Zhat_i (issue 31): ``"paper"`` (default)
        ``scale q.C_i + log s_i``; ``"sub"`` the logsumexp over the cluster's sub-centroids
        of ``scale q.c_ia + log s_ia`` (an index built with ``mass="sub"``; ``ValueError``
        naming `index` otherwise), a tighter estimate of the members' logsumexp (it never
        overshoots). It orders both stages and is the pseudo-token logit of the centroid
        variant (whose value stays the cluster's value mean), as the reference's
        ``mass="sub", value="mean"`` (:func:`stochattn.reference.doublep.doublep_attention`).
        On the GPU the cluster-logit kernel reads the m sub-centroids instead of the
        centroid (m times the stage-1 bytes: +120-132 us at B8/128k on an H100,
        docs/accuracy.md).
    seed, offset : int
        Random stream of ``approx="sample"`` (``0 <= seed < 2**64``, ``0 <= offset < 2**32``).
    softmax_scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    check_finite : bool
        Check that q, k, v hold no NaN or inf (reads the data; off by default), that
        ``seq_lens`` equal the index's, and that the index was built from this cache: its
        fingerprint, the keys at a few recorded tokens per sequence and head, must equal
        the cache's (:meth:`DoublePIndex.check_keys`; ``ValueError`` naming `index`). On
        the GPU a synchronisation; off, no check costs anything.
    return_diagnostics : bool
        Also return a :class:`~stochattn.Diagnostics` with clusters_selected (|C_p|),
        clusters_exact (|C_exact|), tokens_exact (sinks + window + tokens of C_exact),
        estimated_mass (centroid-estimated mass of C_p among the clusters; 1 when there is
        no cluster), true_mass (exact softmax mass of sinks + window + tokens of C_p; both
        masses are 0 for an empty sequence), and
        the K/V rows read per KV head (centroid: exact tokens; sample: K of exact and
        C_approx tokens, V of exact and sampled rows).

    Returns
    -------
    out : ndarray, shape (B, Hq, D), dtype of ``q``
    diagnostics : Diagnostics, only when ``return_diagnostics``

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.doublep import build_doublep_index, doublep_attention
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((1, 2, 300, 16)); v = rng.standard_normal((1, 2, 300, 16))
    >>> q = rng.standard_normal((1, 4, 16))
    >>> index = build_doublep_index(k, v, n_clusters=16)
    >>> doublep_attention(q, k, v, index=index).shape
    (1, 4, 16)
    >>> doublep_attention(q, k, v, index=index, approx="sample", budget=8, seed=1).shape
    (1, 4, 16)
    """
    plan = cached_plan(DoublePPlan, device_of(q=q, k=k, v=v), p1=p1, p2=p2, approx=approx,
                       budget=budget, sampler=sampler, softmax_scale=softmax_scale,
                       check_finite=check_finite, eps=eps, delta=delta, max_budget=max_budget,
                       budget_rule=budget_rule, pilot=pilot, pilot_share=pilot_share,
                       budget_norm=budget_norm, mass=mass)
    call = dict(index=index, seed=seed, offset=offset)
    if v_sqnorms is not None:
        call["v_sqnorms"] = v_sqnorms
    return plan.dispatch(q, k, v, seq_lens, val.check_bool("return_diagnostics", return_diagnostics),
                         call)


def cluster_topk_attention(q, k, v=None, seq_lens=None, *, index, k_clusters=None, softmax_scale=None,
                           check_finite=False, return_diagnostics=False, clusters=None):
    """Fixed top-k clusters (RetroInfer-like baseline) on a Double-P index.

    The ``k_clusters`` non-empty clusters of largest ``xbar_i = scale q.C_i + log s_i``
    (ties to the lower index; all of them if fewer are non-empty) are computed exactly
    together with the sinks and the window, and the softmax is renormalised over them.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, D)
    k, v : ndarray, shape (B, Hkv, N, D)
    seq_lens : integer ndarray, shape (B,), optional
        Must equal ``index.seq_lens`` (None means N and must match too).
    index : DoublePIndex
        GPU arrays need a GPU index and run :mod:`stochattn.cuda.doublep` (lengths: the
        index's, as in :func:`doublep_attention`).
    k_clusters : int
        Clusters kept per query head, >= 1. (Formerly ``clusters``, still accepted with a
        DeprecationWarning.)
    softmax_scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    check_finite : bool
        Check that q, k, v hold no NaN or inf, and the lengths and the index's fingerprint
        against the cache, as :func:`doublep_attention` (off by default).
    return_diagnostics : bool
        Also return a :class:`~stochattn.Diagnostics` (clusters_selected, tokens_exact,
        estimated_mass, true_mass, rows read).

    Returns
    -------
    out : ndarray, shape (B, Hq, D), dtype of ``q``
    diagnostics : Diagnostics, only when ``return_diagnostics``

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.doublep import build_doublep_index, cluster_topk_attention
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((1, 2, 300, 16)); v = rng.standard_normal((1, 2, 300, 16))
    >>> q = rng.standard_normal((1, 4, 16))
    >>> index = build_doublep_index(k, v, n_clusters=16)
    >>> cluster_topk_attention(q, k, v, index=index, k_clusters=4).shape
    (1, 4, 16)
    """
    if clusters is not None:  # the old name of `k_clusters`
        k_clusters = renamed("cluster_topk_attention", {"clusters": clusters},
                             {"clusters": "k_clusters"}, {"k_clusters": k_clusters},
                             {"clusters": val.check_positive_int})["k_clusters"]
    if k_clusters is None:
        raise TypeError("cluster_topk_attention() missing required keyword argument: 'k_clusters'")
    plan = cached_plan(ClusterTopKPlan, device_of(q=q, k=k, v=v), k_clusters=k_clusters,
                       softmax_scale=softmax_scale, check_finite=check_finite)
    return plan.dispatch(q, k, v, seq_lens, val.check_bool("return_diagnostics", return_diagnostics),
                         dict(index=index))


def _check_index_mass(index, mass) -> None:
    """A ``mass="sub"`` decode needs an index with sub-centroids (``ValueError`` naming
    `index`); a paper decode reads any index."""
    if mass == "sub" and isinstance(index, DoublePIndex) and index.sub_centroids is None:
        raise ValueError("`index` has no sub-centroids, which mass='sub' reads: build it with "
                         "build_doublep_index(..., mass='sub')")


class _DecodePlan(AttentionPlan):
    """What the two decode plans share: the index per call, its checks, the GPU path."""


    advance_offset = False
    eps = None  # error-targeted budgets (DoublePPlan's sampled variant only)

    def _run(self, backend, q, k, v, seq_lens, diagnose, call):
        out, workspace = self._buffers(call)
        if "index" not in call:
            raise TypeError(f"`{self.function}` needs `index` (a DoublePIndex) in every call")
        index = call.pop("index")
        v_sqnorms = call.pop("v_sqnorms", None)
        if v_sqnorms is not None and self.eps is None:
            raise TypeError("`v_sqnorms` is read only with error-targeted budgets (`eps`)")
        seed, offset = self._streams(backend, q, call)
        result = self._decode(backend, q, k, v, seq_lens, diagnose, index, seed, offset, out,
                              workspace, v_sqnorms)
        if self.advance_offset:
            advance(offset)
        return result

    def _paged_cuda_missing(self) -> list[str]:
        """The GPU kernels read paged caches in place (the sampled variant's V gather where
        the S²ANTA-prop kernel takes a page table)."""
        if getattr(self, "approx", None) == "sample":
            from .cuda.doublep import _sample_pages_missing

            return _sample_pages_missing()
        return []

    def _decode(self, backend, q, k, v, seq_lens, diagnose, index, seed, offset, out=None,
                workspace=None, v_sqnorms=None):
        _check_index_mass(index, getattr(self, "mass", "paper"))
        if backend == "cuda":
            options = self._kernel_options(seed, offset)
            if self.eps is not None:  # the norms beside the cache, required on the GPU
                options["v_sqnorms"] = v_sqnorms
            return _decode_cuda(self.function, q, k, v, seq_lens, index, self.softmax_scale,
                                self.check_finite, diagnose, out=out, workspace=workspace,
                                **options)
        backend_of(q=q, k=k, v=v, seq_lens=seq_lens)  # host seq_lens only, for the reference
        shape = val.check_attention_inputs(q, k, v, seq_lens)
        if getattr(self, "budget", None) is not None:
            val.check_reference_memory(
                "budget", self.budget,
                8 * shape.batch * shape.q_heads * self.budget * (shape.head_dim + 3),
                "8 B x batch x q_heads x budget x (head_dim + 3): points, indices, V rows")
        scale = val.check_scale(self.softmax_scale, shape.head_dim)
        lens = _check_index(index, shape, seq_lens)
        if self.check_finite:
            val.check_finite(q=q, k=k, v=v)
            index.check_keys(k)  # the index's fingerprint: the cache it was built from
        extra = {}
        if self.eps is not None:
            from .santa import _reference_sqnorms
            extra["v_sqnorms"] = _reference_sqnorms(v_sqnorms, shape)
        result, d = self._reference(q, k, v, lens, index, scale, seed, offset, **extra)
        result = finish(result, q.dtype)
        if not diagnose:
            return result
        return result, _diagnostics(lens, d)


class DoublePPlan(_DecodePlan):
    """A plan of :func:`doublep_attention` (``p1``, ``p2``, ``approx``, ``budget``,
    ``sampler``, ``softmax_scale``, ``check_finite`` as there; ``device`` and the sizes as
    in :class:`~stochattn.SantaPlan`).

    Calls: ``plan.run(q, k, v, seq_lens=None, *, index, seed=0, offset=0, out=None,
    workspace=None)`` returns the output (B, Hq, D); ``plan.diagnose(...)`` returns
    ``(output, Diagnostics)``. ``k`` may be a :class:`~stochattn.paged.PagedKV` (``v`` and
    ``seq_lens`` left out), read in place on the GPU. ``out``: where the output goes (a
    NumPy array on the reference, which the result is copied into; on the GPU an array of
    ``q``'s framework, dtype and shape). ``workspace`` (GPU only; ``TypeError`` on the
    reference): the call's scratch, by default the plan's own :attr:`workspace` (the
    functions' cached plans allocate per call); its size is documented in
    :mod:`stochattn.cuda.doublep` (:func:`stochattn.cuda.doublep.workspace_bytes`). With
    ``out`` and a warmed workspace a GPU ``run`` allocates nothing, copies nothing to the
    host and does not synchronise; ``diagnose`` may allocate and synchronises.
    """

    function = "doublep_attention"

    def __init__(self, *, p1=0.95, p2=0.7, approx="centroid", budget=None,
                 sampler="systematic", advance_offset=False, eps=None, delta=None,
                 max_budget=None, budget_rule="chebyshev", pilot=64, pilot_share=0.25,
                 budget_norm="pilot", mass="paper", **common):
        self.advance_offset = val.check_bool("advance_offset", advance_offset)
        self.mass = val.check_choice("mass", mass, INDEX_MASSES)
        self.p1 = val.check_probability("p1", p1)
        self.p2 = val.check_probability("p2", p2)
        if self.p1 < self.p2 < 1.0:  # stage 2 works inside C_p: its mass cannot pass p1
            # Clamped, not an error: callers (tests/test_doublep.py's property test of the
            # stages) draw p1 and p2 independently and rely on the cap.
            warnings.warn(f"`p2` ({self.p2}) above p1 ({self.p1}) cannot be reached: stage 2 "
                          f"picks clusters inside C_p, so p2 is clamped to p1 (pass p2 <= p1, "
                          f"or p2 = 1 for every cluster of C_p exact)", UserWarning,
                          stacklevel=2)
            self.p2 = self.p1
        self.approx = val.check_choice("approx", approx, APPROX)
        self.eps = self.delta = self.max_budget = None
        self.budget_rule, self.pilot, self.pilot_share = budget_rule, pilot, pilot_share
        self.budget_norm = budget_norm
        if eps is not None:
            if self.approx != "sample":
                raise ValueError("error-targeted budgets (`eps`) need approx='sample', got "
                                 f"{self.approx!r}")
            from . import budget_rules as _budgets

            self.eps, self.delta, self.max_budget = _budgets.check_plan_options(
                budget, eps, delta, max_budget, budget_rule, budget_norm, pilot, pilot_share,
                _budgets.SPLIT_NORMS)
            self.budget = None
        elif self.approx == "sample":
            if budget is None:
                raise ValueError("`budget` is required with approx='sample' (an integer >= 1), "
                                 "got None")
            budget = val.check_budget("budget", budget)
        elif budget is not None:
            raise ValueError(f"`budget` must be None with approx='centroid', got {budget!r}")
        self.budget = budget
        self.sampler = val.check_choice("sampler", sampler, SAMPLERS)
        super().__init__(**common)

    def options(self) -> dict:
        return dict(p1=self.p1, p2=self.p2, approx=self.approx, budget=self.budget,
                    sampler=self.sampler, advance_offset=self.advance_offset, eps=self.eps,
                    delta=self.delta, max_budget=self.max_budget, budget_rule=self.budget_rule,
                    pilot=self.pilot, pilot_share=self.pilot_share,
                    budget_norm=self.budget_norm, mass=self.mass, **super().options())

    def _cuda_missing(self) -> list[str]:
        missing = []
        if self.eps is not None:
            from .cuda.doublep import SPLIT_NORMS_MISSING

            if self.budget_norm in SPLIT_NORMS_MISSING:
                missing.append(SPLIT_NORMS_MISSING[self.budget_norm])
        return missing

    def _kernel_options(self, seed, offset) -> dict:
        if self.approx == "centroid":
            return dict(p1=self.p1, p2=self.p2, mass=self.mass)
        targeted = {} if self.eps is None else dict(
            eps=self.eps, delta=self.delta, max_budget=self.max_budget,
            budget_rule=self.budget_rule, budget_norm=self.budget_norm, pilot=self.pilot,
            pilot_share=self.pilot_share)
        return dict(p1=self.p1, p2=self.p2, budget=self.budget, sampler=self.sampler,
                    seed=seed, offset=offset, mass=self.mass, **targeted)

    def _reference(self, q, k, v, lens, index, scale, seed, offset, v_sqnorms=None):
        targeted = {} if self.eps is None else dict(
            eps=self.eps, delta=self.delta, max_budget=self.max_budget,
            budget_rule=self.budget_rule, budget_norm=self.budget_norm, pilot=self.pilot,
            pilot_share=self.pilot_share, v_sqnorms=v_sqnorms)
        if self.mass == "sub":  # the index's own sub-centroids, as the GPU reads them
            from .reference.cluster_mass import sub_only_stats

            targeted.update(mass="sub", mass_stats=sub_only_stats(index.sub_centroids,
                                                                  index.sub_sizes))
        return _ref.doublep_attention(q, k, v, lens, index, p1=self.p1, p2=self.p2,
                                      approx=self.approx, budget=self.budget,
                                      sampler=self.sampler, seed=seed, offset=offset, scale=scale,
                                      **targeted)


class ClusterTopKPlan(_DecodePlan):
    """A plan of :func:`cluster_topk_attention` (``k_clusters``, ``softmax_scale``,
    ``check_finite`` as there). Calls: ``plan.run(q, k, v, seq_lens=None, *, index,
    out=None, workspace=None)``, ``out``, ``workspace`` and paged caches as in
    :class:`DoublePPlan`."""

    function = "cluster_topk_attention"

    def __init__(self, *, k_clusters, **common):
        self.k_clusters = val.check_positive_int("k_clusters", k_clusters)
        super().__init__(**common)

    def options(self) -> dict:
        return dict(k_clusters=self.k_clusters, **super().options())

    def _kernel_options(self, seed, offset) -> dict:
        return dict(clusters=self.k_clusters)

    def _reference(self, q, k, v, lens, index, scale, seed, offset):
        return _ref.cluster_topk_attention(q, k, v, lens, index, clusters=self.k_clusters,
                                           scale=scale)
