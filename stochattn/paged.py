"""Paged KV caches in FlashInfer's layout (docs/paged.md), so an engine passes its cache as is.

A paged cache is a pool of fixed-size pages plus a page table in CSR form:

- pages ``(num_pages, page_size, Hkv, D)`` (layout ``"NHD"``) or
  ``(num_pages, Hkv, page_size, D)`` (``"HND"``), K and V as two arrays or as one
  ``(num_pages, 2, ...)`` array (``[:, 0]`` is K, ``[:, 1]`` is V);
- ``kv_indptr`` (B+1,): sequence b owns the pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``,
  in token order;
- ``kv_indices`` (nnz_pages,): physical page numbers, in [0, num_pages);
- ``kv_last_page_len`` (B,): tokens in the last page of each sequence.

Token t of sequence b lives in page ``kv_indices[kv_indptr[b] + t // page_size]``, slot
``t % page_size``; the length of sequence b is ``(n_b - 1) * page_size + kv_last_page_len[b]``
with ``n_b = kv_indptr[b+1] - kv_indptr[b]`` pages, and 0 when ``n_b == 0``. See
docs/paged.md.

:func:`paged_kv` checks a cache once and returns a :class:`PagedKV`; :func:`gather` turns
it into the contiguous (B, Hkv, N, D) view the NumPy reference reads, so every estimator
runs unchanged on paged input; :func:`from_contiguous` builds a paged cache from a
contiguous one (tests and benchmarks). The GPU kernels will read the pages in place (no
gather) once they exist; today they read contiguous caches only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _validation as val
from ._backend import backend_of

__all__ = ["LAYOUTS", "PAGE_DTYPES", "PagedKV", "contiguous", "from_contiguous", "gather",
           "paged_kv"]

LAYOUTS = ("NHD", "HND")
# Dtypes a page pool may hold: the union of what the two backends take (each estimator
# checks its own backend's list on the arrays it is given).
PAGE_DTYPES = ("float16", "bfloat16", "float32", "float64")

_AXES = {"NHD": "(num_pages, page_size, kv_heads, head_dim)",
         "HND": "(num_pages, kv_heads, page_size, head_dim)"}
_COMBINED_AXES = {"NHD": "(num_pages, 2, page_size, kv_heads, head_dim)",
                  "HND": "(num_pages, 2, kv_heads, page_size, head_dim)"}


def _shape(a) -> tuple:
    return tuple(int(s) for s in a.shape)


def _dtype_name(a) -> str:
    name = str(a.dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def _to_int64(x):
    """An integer array as int64, in its own framework (NumPy, CuPy, JAX: ``astype``;
    PyTorch: ``long``); no copy to the host."""
    return x.astype("int64") if hasattr(x, "astype") else x.long()


@dataclass(frozen=True, eq=False)
class PagedKV:
    """A paged KV cache and its page table, checked once (make it with :func:`paged_kv`).

    Attributes
    ----------
    k_pages, v_pages : array, shape (num_pages, page_size, Hkv, D) ("NHD") or
        (num_pages, Hkv, page_size, D) ("HND")
        The page pools, one dtype. When made from one combined ``(num_pages, 2, ...)``
        array they are its views ``[:, 0]`` and ``[:, 1]`` (no copy; strided).
    kv_indptr : integer array, shape (B + 1,)
        Sequence b owns ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``; starts at 0, ends at
        ``len(kv_indices)``, non-decreasing.
    kv_indices : integer array, shape (nnz_pages,)
        Physical page numbers in [0, num_pages), in token order per sequence. A page may
        appear in several sequences (a shared prefix).
    kv_last_page_len : integer array, shape (B,)
        Tokens in the last page of each sequence: in [1, page_size] for a sequence with
        pages, 0 for one without.
    layout : {"NHD", "HND"}
    max_tokens : int or None
        An upper bound of every sequence's length, known on the host without reading the
        page table (the static context limit of an engine). The GPU kernels size their
        launches and workspace by it (:attr:`token_bound`).

    The arrays are held as given (no copy), so an engine's buffers pass through to a GPU
    backend unchanged. Host (NumPy) arrays have their values checked when the object is
    made; GPU arrays only their shapes and dtypes (reading values would synchronise), unless
    :func:`paged_kv` is given ``check_values=True``. Comparison is by identity.
    """

    k_pages: object
    v_pages: object
    kv_indptr: object
    kv_indices: object
    kv_last_page_len: object
    layout: str = "NHD"
    max_tokens: int | None = None
    _device: str = field(init=False, repr=False)

    def __post_init__(self):
        _check_structure(self)
        if self._device == "cpu":
            _check_values(self)

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def device(self) -> str:
        """``"cpu"`` (NumPy arrays: the reference) or ``"cuda"`` (GPU arrays), as the plans'
        ``device`` option names them."""
        return self._device

    @property
    def batch(self) -> int:
        """B, the number of sequences."""
        return int(self.kv_indptr.shape[0]) - 1

    @property
    def num_pages(self) -> int:
        """Pages in the pool (used or not)."""
        return int(self.k_pages.shape[0])

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return int(self.k_pages.shape[1 if self.layout == "NHD" else 2])

    @property
    def kv_heads(self) -> int:
        """Hkv."""
        return int(self.k_pages.shape[2 if self.layout == "NHD" else 1])

    @property
    def head_dim(self) -> int:
        """D."""
        return int(self.k_pages.shape[3])

    @property
    def dtype(self):
        """The dtype of the pages."""
        return self.k_pages.dtype

    @property
    def seq_lens(self):
        """Sequence lengths, int64 (B,), in the framework of the page table (a NumPy array on
        the host for NumPy input; computed on the device, without a synchronisation, for GPU
        input): ``(n_b - 1) * page_size + kv_last_page_len[b]``, 0 for ``n_b == 0`` pages."""
        indptr = _to_int64(self.kv_indptr)
        pages = indptr[1:] - indptr[:-1]
        # With no pages the first term is -page_size and kv_last_page_len is 0 (checked), so
        # adding page_size where pages == 0 gives 0, with operators every framework has.
        return ((pages - 1) * self.page_size + _to_int64(self.kv_last_page_len)
                + (pages == 0) * self.page_size)

    @property
    def token_bound(self) -> int:
        """An upper bound of the sequence lengths known without reading the page table:
        ``max_tokens`` when given, else ``nnz_pages * page_size`` (no sequence owns more
        pages than the table holds), at least 1. The GPU kernels plan for this many tokens
        (grid and workspace), so an engine passes ``max_tokens``: the default grows with
        the batch."""
        if self.max_tokens is not None:
            return self.max_tokens
        return max(int(self.kv_indices.shape[0]) * self.page_size, 1)

    @property
    def max_len(self) -> int:
        """The longest sequence (0 for a batch of empty sequences). Reads the values: on a GPU
        this is a synchronisation."""
        return int(self.seq_lens.max())

    def __repr__(self) -> str:
        return (f"PagedKV(batch={self.batch}, num_pages={self.num_pages}, page_size="
                f"{self.page_size}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"dtype={_dtype_name(self.k_pages)}, layout={self.layout!r}, "
                f"nnz_pages={int(self.kv_indices.shape[0])}, device={self.device!r})")


def paged_kv(k_pages, v_pages=None, *, kv_indptr, kv_indices, kv_last_page_len, layout="NHD",
             max_tokens=None, check_values=False) -> PagedKV:
    """Check a paged KV cache (FlashInfer's layout) once and hold it.

    Parameters
    ----------
    k_pages : array, shape (num_pages, page_size, Hkv, D) ("NHD") or (num_pages, Hkv,
        page_size, D) ("HND"); or, with ``v_pages=None``, the combined cache of shape
        (num_pages, 2, page_size, Hkv, D) ("NHD") or (num_pages, 2, Hkv, page_size, D) ("HND")
        whose ``[:, 0]`` is K and ``[:, 1]`` is V.
        float16, bfloat16, float32 or float64 (each backend then takes its own dtypes).
    v_pages : array, shape of ``k_pages``, dtype of ``k_pages``; optional
        The value pages, or None when ``k_pages`` is the combined cache.
    kv_indptr : integer array, shape (B + 1,)
        Page ranges of the sequences: 0 first, ``len(kv_indices)`` last, non-decreasing.
    kv_indices : integer array, shape (nnz_pages,)
        Physical page numbers, each in [0, num_pages).
    kv_last_page_len : integer array, shape (B,)
        Tokens in each sequence's last page: in [1, page_size] if it has pages, 0 if not.
    layout : {"NHD", "HND"}
        Axis order inside a page, as FlashInfer's ``kv_layout``.
    max_tokens : int, optional
        An upper bound of every sequence's length (an engine's context limit): what the GPU
        kernels plan their launches and workspace for (:attr:`PagedKV.token_bound`). A
        longer sequence is a ``ValueError`` when the values are checked; unchecked on a GPU,
        the kernels read only its first ``max_tokens`` tokens.
    check_values : bool
        For GPU index arrays, also check their values (copies them to the host: a
        synchronisation). Host (NumPy) index arrays are always checked.

    The index arrays may have any integer dtype on the reference; FlashInfer (and the GPU
    kernels to come) take int32.

    Returns
    -------
    PagedKV

    Raises
    ------
    ValueError
        A wrong number of dimensions, mismatched shapes, an unknown layout, or index
        values out of their ranges (the message names the argument, what was expected, and
        the first bad position).
    TypeError
        A non-array argument, a page dtype outside the list, K and V of different dtypes,
        non-integer index arrays, or arrays on different devices.

    Examples
    --------
    >>> import numpy as np
    >>> from stochattn.paged import paged_kv, gather
    >>> pages = np.zeros((4, 2, 16, 1, 8))           # 4 pages of 16 tokens, combined K/V, NHD
    >>> cache = paged_kv(pages, kv_indptr=np.array([0, 3, 3, 4], dtype=np.int32),
    ...                  kv_indices=np.array([2, 0, 1, 3], dtype=np.int32),
    ...                  kv_last_page_len=np.array([5, 0, 16], dtype=np.int32))
    >>> cache.seq_lens, cache.max_len
    (array([37,  0, 16]), 37)
    >>> k, v, seq_lens = gather(cache)
    >>> k.shape
    (3, 1, 37, 8)
    """
    val.check_choice("layout", layout, LAYOUTS)
    check_values = val.check_bool("check_values", check_values)
    if not hasattr(k_pages, "shape") or not hasattr(k_pages, "dtype"):
        raise TypeError(f"`k_pages` must be an array, got {type(k_pages).__name__}")
    if v_pages is None:
        if k_pages.ndim != 5 or int(k_pages.shape[1]) != 2:
            hint = (" (pass `v_pages` too for separate K and V pages)" if k_pages.ndim == 4
                    else "")
            raise ValueError(
                f"`k_pages` without `v_pages` must be the combined cache {_COMBINED_AXES[layout]} "
                f"with 2 on axis 1 (layout {layout!r}), got shape {_shape(k_pages)}{hint}")
        k_pages, v_pages = k_pages[:, 0], k_pages[:, 1]
    if max_tokens is not None:
        max_tokens = val.check_positive_int("max_tokens", max_tokens)
    cache = PagedKV(k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, layout,
                    max_tokens)
    if check_values and cache.device != "cpu":
        _check_values(cache)
    return cache


# ---- checks -----------------------------------------------------------------------------------

def _check_structure(c: PagedKV) -> None:
    """Shapes, dtypes and devices: attributes only, no values."""
    val.check_choice("layout", c.layout, LAYOUTS)
    for name in ("k_pages", "v_pages", "kv_indptr", "kv_indices", "kv_last_page_len"):
        a = getattr(c, name)
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"`{name}` must be an array, got {type(a).__name__}")
    for name in ("k_pages", "v_pages"):
        a = getattr(c, name)
        if a.ndim != 4:
            raise ValueError(f"`{name}` must have 4 dimensions {_AXES[c.layout]} (layout "
                             f"{c.layout!r}), got shape {_shape(a)}")
    if _shape(c.v_pages) != _shape(c.k_pages):
        raise ValueError(f"`v_pages` must have the shape of `k_pages` {_shape(c.k_pages)}, got "
                         f"{_shape(c.v_pages)}")
    sizes = dict(zip(_AXES[c.layout][1:-1].split(", "), _shape(c.k_pages)))
    empty = [n for n in ("page_size", "kv_heads", "head_dim") if sizes[n] < 1]
    if empty:
        raise ValueError(f"`k_pages` must have non-zero {', '.join(empty)} {_AXES[c.layout]}, "
                         f"got shape {_shape(c.k_pages)}")
    for name in ("k_pages", "v_pages"):
        if _dtype_name(getattr(c, name)) not in PAGE_DTYPES:
            raise TypeError(f"`{name}` dtype must be one of {', '.join(PAGE_DTYPES)}, got "
                            f"{_dtype_name(getattr(c, name))}")
    if _dtype_name(c.k_pages) != _dtype_name(c.v_pages):
        raise TypeError(f"`k_pages` and `v_pages` must share one dtype, got "
                        f"{_dtype_name(c.k_pages)} and {_dtype_name(c.v_pages)}")
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len"):
        a = getattr(c, name)
        if a.ndim != 1:
            raise ValueError(f"`{name}` must have 1 dimension, got shape {_shape(a)}")
        if not _is_integer_dtype(a):
            raise TypeError(f"`{name}` must have an integer dtype, got {_dtype_name(a)}")
    n = int(c.kv_indptr.shape[0])
    if n < 2:
        raise ValueError(f"`kv_indptr` must have shape (batch + 1,) with batch >= 1, got shape "
                         f"{_shape(c.kv_indptr)}")
    if _shape(c.kv_last_page_len) != (n - 1,):
        raise ValueError(f"`kv_last_page_len` must have shape ({n - 1},) (batch, from "
                         f"`kv_indptr`), got {_shape(c.kv_last_page_len)}")
    backend = backend_of(k_pages=c.k_pages, v_pages=c.v_pages, kv_indptr=c.kv_indptr,
                         kv_indices=c.kv_indices, kv_last_page_len=c.kv_last_page_len)
    object.__setattr__(c, "_device", "cpu" if backend == "numpy" else "cuda")


def _is_integer_dtype(a) -> bool:
    try:
        return np.dtype(_dtype_name(a)).kind in "iu"
    except TypeError:  # a dtype NumPy does not know (bfloat16, ...): not an integer
        return False


def _host(a) -> np.ndarray:
    if hasattr(a, "get"):  # CuPy
        a = a.get()
    elif hasattr(a, "cpu"):  # PyTorch
        a = a.cpu()
    return np.asarray(a).astype(np.int64)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _check_values(c: PagedKV) -> None:
    """The page table's values (host copies of device arrays; NumPy arrays as they are)."""
    indptr, indices, last = _host(c.kv_indptr), _host(c.kv_indices), _host(c.kv_last_page_len)
    nnz, num_pages, page_size = int(indices.shape[0]), c.num_pages, c.page_size
    if indptr[0] != 0:
        raise ValueError(f"`kv_indptr` must start at 0, got {int(indptr[0])}")
    step = np.diff(indptr)
    if (step < 0).any():
        i = _first(step < 0) + 1
        raise ValueError(f"`kv_indptr` must be non-decreasing, got {int(indptr[i])} after "
                         f"{int(indptr[i - 1])} at position {i}")
    if indptr[-1] != nnz:
        raise ValueError(f"`kv_indptr` must end at {nnz} (the length of `kv_indices`), got "
                         f"{int(indptr[-1])}")
    out = (indices < 0) | (indices >= num_pages)
    if out.any():
        i = _first(out)
        raise ValueError(f"`kv_indices` values must lie in [0, {num_pages}) (the pages of "
                         f"`k_pages`), got {int(indices[i])} at position {i}")
    has_pages = step > 0
    bad = has_pages & ((last < 1) | (last > page_size))
    if bad.any():
        b = _first(bad)
        raise ValueError(f"`kv_last_page_len` must lie in [1, {page_size}] (page_size) for a "
                         f"sequence with pages, got {int(last[b])} for sequence {b}")
    bad = ~has_pages & (last != 0)
    if bad.any():
        b = _first(bad)
        raise ValueError(f"`kv_last_page_len` must be 0 for a sequence with no pages, got "
                         f"{int(last[b])} for sequence {b}")
    if c.max_tokens is not None:
        lens = np.where(has_pages, (step - 1) * page_size + last, 0)
        if (lens > c.max_tokens).any():
            b = _first(lens > c.max_tokens)
            raise ValueError(f"`max_tokens` ({c.max_tokens}) must bound every sequence's length, "
                             f"got {int(lens[b])} tokens in sequence {b}")


# ---- the reference's view ------------------------------------------------------------------

def gather(paged: PagedKV, *, tokens=None):
    """The contiguous cache of a paged one: what the NumPy reference reads.

    Every estimator runs unchanged on the result: ``exact_attention(q, *gather(paged))``.
    The GPU kernels will read the pages in place (no gather) once they exist.

    Parameters
    ----------
    paged : PagedKV
        A cache of NumPy arrays.
    tokens : int, optional
        The length N of the seq axis, at least ``paged.max_len``; default
        ``max(paged.max_len, 1)`` (one zero column for a batch of empty sequences, since a
        cache of N = 0 tokens is an error of the estimators).

    Returns
    -------
    k, v : ndarray, shape (B, Hkv, N, D), dtype of the pages
        ``k[b, h, t] = K page kv_indices[kv_indptr[b] + t // page_size], slot t % page_size,
        head h`` for t < seq_lens[b]; zero past each length (page slots past
        ``kv_last_page_len`` and unused pages are never read).
    seq_lens : ndarray of int64, shape (B,)

    Raises
    ------
    TypeError
        ``paged`` is not a :class:`PagedKV`, or holds GPU arrays.
    ValueError
        ``tokens`` below ``paged.max_len``.
    """
    if not isinstance(paged, PagedKV):
        raise TypeError(f"`paged` must be a PagedKV (see `paged_kv`), got {type(paged).__name__}")
    if paged.device != "cpu":
        raise TypeError("`gather` builds the reference's contiguous cache from NumPy pages, got "
                        "GPU arrays (the GPU kernels will read pages in place)")
    lens = paged.seq_lens
    max_len = paged.max_len
    if tokens is None:
        tokens = max(max_len, 1)
    tokens = val.check_positive_int("tokens", tokens)
    if tokens < max_len:
        raise ValueError(f"`tokens` must be >= {max_len} (the longest sequence), got {tokens}")
    B, H, D, P = paged.batch, paged.kv_heads, paged.head_dim, paged.page_size
    indptr = np.asarray(paged.kv_indptr).astype(np.int64)
    indices = np.asarray(paged.kv_indices).astype(np.int64)
    # Every stored token as (sequence b, position t): t runs 0..len_b-1 within each b.
    b_of = np.repeat(np.arange(B), lens)
    t_of = np.arange(b_of.size) - np.repeat(np.cumsum(lens) - lens, lens)
    page = indices[indptr[b_of] + t_of // P]
    slot = t_of % P
    out = []
    for pages in (paged.k_pages, paged.v_pages):
        pages = np.asarray(pages)
        # rows[i] = the (H, D) block of token i, read from its page and slot.
        rows = pages[page, slot] if paged.layout == "NHD" else pages[page, :, slot]
        dense = np.zeros((B, tokens, H, D), dtype=pages.dtype)
        dense[b_of, t_of] = rows
        out.append(np.ascontiguousarray(dense.transpose(0, 2, 1, 3)))
    return out[0], out[1], lens


def contiguous(k, v=None, seq_lens=None):
    """``(k, v, seq_lens)`` as the reference reads them: arrays as they are, or, for ``k`` a
    :class:`PagedKV` (then ``v`` and ``seq_lens`` must be None: the cache holds them), its
    :func:`gather`. The one line a plan or function needs to take paged caches on the
    reference.

    Raises
    ------
    TypeError
        ``k`` a PagedKV together with ``v`` or ``seq_lens``.
    NotImplementedError
        ``k`` a PagedKV of GPU arrays: the GPU kernels read contiguous caches for now.
    """
    if not isinstance(k, PagedKV):
        return k, v, seq_lens
    given = [f"`{n}`" for n, x in (("v", v), ("seq_lens", seq_lens)) if x is not None]
    if given:
        raise TypeError(f"with a paged cache (`k` a PagedKV) pass no {' and no '.join(given)}: "
                        "the page table holds the values and the lengths")
    if k.device != "cpu":
        raise NotImplementedError("paged caches on the GPU: the kernels read contiguous caches "
                                  "for now; pass NumPy pages to run the reference")
    return gather(k)


# ---- a paged cache from a contiguous one ------------------------------------------------------

def from_contiguous(k, v, seq_lens=None, *, page_size, layout="NHD", shuffle_seed=None,
                    extra_pages=0, combined=False) -> PagedKV:
    """A paged cache holding what a contiguous one holds (for tests and benchmarks).

    Sequence b gets ``ceil(seq_lens[b] / page_size)`` pages (none when empty), numbered in
    order, or in a random physical order with ``shuffle_seed``; ``extra_pages`` unused pages
    are added to the pool. Unused pages and the slots past each sequence's last token are
    NaN, so a read of a wrong page or slot shows in the output.

    Parameters
    ----------
    k, v : ndarray, shape (B, Hkv, N, D)
    seq_lens : integer array, shape (B,), optional
        Default: all N tokens.
    page_size : int
        Tokens per page, >= 1 (the GPU kernels will take 1 to 128).
    layout : {"NHD", "HND"}
    shuffle_seed : int, optional
        Seed of a random permutation of the physical pages; None keeps them in order.
    extra_pages : int
        Unused pages added to the pool, >= 0.
    combined : bool
        One ``(num_pages, 2, ...)`` array for K and V (its views become ``k_pages`` and
        ``v_pages``) instead of two arrays.

    Returns
    -------
    PagedKV
        int32 index arrays; pages of the dtype of ``k``; ``max_tokens`` N.
    """
    B, H, N, D = val.check_kv_inputs(k, v, seq_lens, dtypes=PAGE_DTYPES)
    page_size = val.check_positive_int("page_size", page_size)
    val.check_choice("layout", layout, LAYOUTS)
    extra_pages = val.check_nonnegative_int("extra_pages", extra_pages)
    combined = val.check_bool("combined", combined)
    if shuffle_seed is not None:
        shuffle_seed = val.check_nonnegative_int("shuffle_seed", shuffle_seed)
    lens = (np.full(B, N, dtype=np.int64) if seq_lens is None
            else np.asarray(seq_lens).astype(np.int64))
    pages_of = -(-lens // page_size)  # ceil
    indptr = np.concatenate([[0], np.cumsum(pages_of)])
    nnz = int(indptr[-1])
    num_pages = nnz + extra_pages
    order = (np.arange(num_pages) if shuffle_seed is None
             else np.random.default_rng(shuffle_seed).permutation(num_pages))
    indices = order[:nnz]  # logical page i of the batch lives in physical page order[i]
    last = np.where(pages_of > 0, lens - (pages_of - 1) * page_size, 0)
    # NHD pool first; HND is its transpose.
    pool = np.full((num_pages, 2, page_size, H, D), np.nan, dtype=k.dtype)
    b_of = np.repeat(np.arange(B), lens)
    t_of = np.arange(b_of.size) - np.repeat(np.cumsum(lens) - lens, lens)
    page, slot = indices[indptr[b_of] + t_of // page_size], t_of % page_size
    pool[page, 0, slot] = np.asarray(k)[b_of, :, t_of]
    pool[page, 1, slot] = np.asarray(v)[b_of, :, t_of]
    if layout == "HND":
        pool = np.ascontiguousarray(pool.transpose(0, 1, 3, 2, 4))
    table = dict(kv_indptr=indptr.astype(np.int32), kv_indices=indices.astype(np.int32),
                 kv_last_page_len=last.astype(np.int32), layout=layout, max_tokens=N)
    if combined:
        return paged_kv(pool, **table)
    return paged_kv(np.ascontiguousarray(pool[:, 0]), np.ascontiguousarray(pool[:, 1]), **table)
