"""The one place where user input is checked.

Every public function calls these before it touches data. ``ValueError`` for shapes and
values, ``TypeError`` for types and dtypes; every message names the argument in backticks
and says what was expected and what was given. Checks that read array data (finiteness)
are opt-in because on a GPU they force a synchronisation.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

__all__ = [
    "AttentionShape",
    "check_attention_inputs",
    "check_bool",
    "check_budget",
    "check_choice",
    "check_finite",
    "check_kv_inputs",
    "check_positive_int",
    "check_nonnegative_int",
    "check_probability",
    "check_score_inputs",
    "check_per_sequence",
    "check_seed_offset",
    "check_scale",
]

# dtypes accepted per backend. The reference computes in float64 whatever comes in.
REFERENCE_DTYPES = ("float16", "float32", "float64")
GPU_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one decode call: q (B, Hq, D); k, v (B, Hkv, N, D)."""

    batch: int
    q_heads: int
    kv_heads: int
    tokens: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per KV head, G = Hq / Hkv."""
        return self.q_heads // self.kv_heads


def _dtype_name(a) -> str:
    return str(getattr(a, "dtype", type(a).__name__))


def _shape(a) -> tuple:
    return tuple(int(s) for s in a.shape)


def check_attention_inputs(q, k, v, seq_lens=None, *, dtypes=REFERENCE_DTYPES) -> AttentionShape:
    """Check q (B, Hq, D), k and v (B, Hkv, N, D), seq_lens (B,) and return the sizes.

    ``seq_lens`` values are checked against [0, N] here; call this with host values.
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"`{name}` must be an array, got {type(a).__name__}")
    if q.ndim != 3:
        raise ValueError(
            f"`q` must have 3 dimensions (batch, q_heads, head_dim), got shape {_shape(q)}"
        )
    for name, a in (("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(
                f"`{name}` must have 4 dimensions (batch, kv_heads, seq, head_dim), "
                f"got shape {_shape(a)}"
            )
    B, Hq, D = _shape(q)
    Bk, Hkv, N, Dk = _shape(k)
    if _shape(v) != _shape(k):
        raise ValueError(f"`v` must have the shape of `k` {_shape(k)}, got {_shape(v)}")
    if Bk != B:
        raise ValueError(f"`k` must have batch {B} (from `q`), got {Bk}")
    if Dk != D:
        raise ValueError(f"`k` must have head_dim {D} (from `q`), got {Dk}")
    if B < 1 or Hq < 1 or D < 1 or Hkv < 1:
        raise ValueError(f"`q` and `k` must have non-zero batch, heads and head_dim, got "
                         f"q {_shape(q)} and k {_shape(k)}")
    if Hq % Hkv != 0:
        raise ValueError(
            f"`q` heads must be a multiple of `k` heads (GQA), got Hq={Hq} and Hkv={Hkv}"
        )
    if N < 1:
        raise ValueError(f"`k` must hold at least one token (seq axis 2), got shape {_shape(k)}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if _dtype_name(a) not in dtypes:
            raise TypeError(f"`{name}` dtype must be one of {', '.join(dtypes)}, got {_dtype_name(a)}")
    if not (_dtype_name(q) == _dtype_name(k) == _dtype_name(v)):
        raise TypeError(
            "`q`, `k` and `v` must share one dtype, got "
            f"{_dtype_name(q)}, {_dtype_name(k)} and {_dtype_name(v)}"
        )
    if seq_lens is not None:
        check_seq_lens(seq_lens, B, N)
    return AttentionShape(B, Hq, Hkv, N, D)


def check_score_inputs(q, k, seq_lens=None, *, dtypes=REFERENCE_DTYPES) -> AttentionShape:
    """The checks of :func:`check_attention_inputs` for functions that take no ``v``.

    A dtype mismatch is reported as between `q` and `k` (the caller passed no `v`).
    """
    if (hasattr(q, "dtype") and hasattr(k, "dtype") and _dtype_name(q) in dtypes
            and _dtype_name(k) in dtypes and _dtype_name(q) != _dtype_name(k)):
        raise TypeError(f"`q` and `k` must share one dtype, got {_dtype_name(q)} and {_dtype_name(k)}")
    return check_attention_inputs(q, k, k, seq_lens, dtypes=dtypes)


def check_seq_lens(seq_lens, batch: int, tokens: int) -> None:
    """``seq_lens`` must be an integer array of shape (batch,) with values in [0, tokens]."""
    if not hasattr(seq_lens, "shape") or not hasattr(seq_lens, "dtype"):
        raise TypeError(f"`seq_lens` must be an integer array, got {type(seq_lens).__name__}")
    if _shape(seq_lens) != (batch,):
        raise ValueError(f"`seq_lens` must have shape ({batch},), got {_shape(seq_lens)}")
    if np.dtype(str(seq_lens.dtype)).kind not in "iu":
        raise TypeError(f"`seq_lens` must have an integer dtype, got {seq_lens.dtype}")
    values = np.asarray(seq_lens)
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi > tokens:
        raise ValueError(
            f"`seq_lens` values must lie in [0, {tokens}] (the seq axis of `k`), "
            f"got min {lo} and max {hi}"
        )


def _is_int(value) -> bool:
    # type(...) is int first: the ABC check costs ~1 us per call on the decode hot path.
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, bool))


def check_positive_int(name: str, value) -> int:
    """An integer >= 1."""
    if not _is_int(value):
        raise TypeError(f"`{name}` must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1, got {value}")
    return int(value)


def check_nonnegative_int(name: str, value) -> int:
    """An integer >= 0."""
    if not _is_int(value):
        raise TypeError(f"`{name}` must be an integer, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {value}")
    return int(value)


def check_budget(name: str, value) -> int:
    """A sample or token budget: an integer >= 1."""
    return check_positive_int(name, value)


def check_probability(name: str, value) -> float:
    """A top-p threshold in (0, 1]."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}")
    value = float(value)
    if not (0.0 < value <= 1.0):
        raise ValueError(f"`{name}` must lie in (0, 1], got {value}")
    return value


def check_choice(name: str, value, choices) -> str:
    """One of a fixed set of strings."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_seed_offset(seed, offset, *, arrays: bool = False):
    """``seed`` in [0, 2**64) and ``offset`` in [0, 2**32): integers, or with ``arrays=True``
    also integer arrays of shape () or (B,) (one per sequence; the form a captured CUDA
    graph reads at run time, docs/rng.md). Host arrays are checked here (values and dtype);
    the batch size of a (B,) array is checked by :func:`check_per_sequence` once B is
    known. Device arrays are checked by their backend (attributes only, no values)."""
    return (_check_stream_word("seed", seed, 64, arrays),
            _check_stream_word("offset", offset, 32, arrays))


def _check_stream_word(name: str, value, bits: int, arrays: bool):
    if not arrays and not _is_int(value):
        raise TypeError(f"`{name}` must be an integer, got {type(value).__name__}")
    if _is_int(value):
        if not 0 <= value < 2**bits:
            raise ValueError(f"`{name}` must lie in [0, 2**{bits}), got {value}")
        return int(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"`{name}` must be an integer, or an integer array, got an array "
                            f"of {value.dtype}")
        if value.ndim > 1:
            raise ValueError(f"`{name}` must be an integer, or an array of shape () or (batch,), "
                             f"got shape {value.shape}")
        if value.size and (int(value.min()) < 0 or int(value.max()) >= 2**bits):
            raise ValueError(f"`{name}` values must lie in [0, 2**{bits}), got min "
                             f"{int(value.min())} and max {int(value.max())}")
        return value
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a device array: its backend checks
        return value
    raise TypeError(f"`{name}` must be an integer, got {type(value).__name__} (an integer array "
                    "of shape () or (batch,) is accepted too)")


# The most host memory one reference call may ask for; the reference is for checking and
# studies, and an accidental budget of 10**7 once asked for 19 GiB and was OOM-killed.
REFERENCE_MEMORY_LIMIT = 4 * 2**30


def check_reference_memory(name: str, value, nbytes: int, formula: str) -> None:
    """Refuse a reference call whose arrays would need more than REFERENCE_MEMORY_LIMIT
    bytes, naming the argument that drives the size (``formula`` says how it counts)."""
    if nbytes > REFERENCE_MEMORY_LIMIT:
        raise ValueError(
            f"`{name}` = {value} would need about {nbytes / 2**30:.1f} GiB of host memory in the "
            f"reference ({formula}), above its limit of "
            f"{REFERENCE_MEMORY_LIMIT / 2**30:.0f} GiB per call: use a smaller `{name}`")


def check_per_sequence(name: str, value, batch: int) -> None:
    """A per-call array (``seed``, ``offset``) must have shape () or (batch,)."""
    shape = tuple(int(s) for s in getattr(value, "shape", ()))
    if shape not in ((), (batch,)):
        raise ValueError(f"`{name}` must have shape () or ({batch},) (one per sequence), got {shape}")


def check_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale``: None for 1/sqrt(head_dim), else a finite positive number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
        raise TypeError(f"`softmax_scale` must be a real number, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"`softmax_scale` must be finite and > 0, got {softmax_scale}")
    return float(softmax_scale)


def check_finite(**arrays) -> None:
    """Opt-in data check: every named array holds only finite values."""
    for name, a in arrays.items():
        if a is None:
            continue
        xp_isfinite = getattr(type(a), "__module__", "").split(".")[0]
        if xp_isfinite == "numpy":
            ok = bool(np.isfinite(a).all())
        else:  # CuPy and friends: same call, on their namespace.
            import importlib

            ok = bool(importlib.import_module(xp_isfinite).isfinite(a).all())
        if not ok:
            raise ValueError(f"`{name}` must hold only finite values (check_finite=True), got NaN or inf")


def check_kv_inputs(k, v, seq_lens=None, *, dtypes=REFERENCE_DTYPES) -> tuple[int, int, int, int]:
    """Check a KV cache on its own (no query): k and v (B, Hkv, N, D), seq_lens (B,).

    For functions that index or update the cache (prefill, append). Returns (B, Hkv, N, D).
    """
    for name, a in (("k", k), ("v", v)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"`{name}` must be an array, got {type(a).__name__}")
        if a.ndim != 4:
            raise ValueError(
                f"`{name}` must have 4 dimensions (batch, kv_heads, seq, head_dim), "
                f"got shape {_shape(a)}"
            )
    if _shape(v) != _shape(k):
        raise ValueError(f"`v` must have the shape of `k` {_shape(k)}, got {_shape(v)}")
    B, Hkv, N, D = _shape(k)
    if B < 1 or Hkv < 1 or D < 1:
        raise ValueError(f"`k` must have non-zero batch, heads and head_dim, got shape {_shape(k)}")
    if N < 1:
        raise ValueError(f"`k` must hold at least one token (seq axis 2), got shape {_shape(k)}")
    for name, a in (("k", k), ("v", v)):
        if _dtype_name(a) not in dtypes:
            raise TypeError(f"`{name}` dtype must be one of {', '.join(dtypes)}, got {_dtype_name(a)}")
    if _dtype_name(k) != _dtype_name(v):
        raise TypeError(f"`k` and `v` must share one dtype, got {_dtype_name(k)} and {_dtype_name(v)}")
    if seq_lens is not None:
        check_seq_lens(seq_lens, B, N)
    return B, Hkv, N, D


def check_bool(name: str, value) -> bool:
    """A flag: ``True`` or ``False`` (Python or NumPy bool, not 0/1)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}")
    return bool(value)


def check_index_options(n_clusters, tokens: int, iterations, n_sink, window, seed):
    """The k-means index options of ``build_doublep_index`` (both backends): returns
    ``(n_clusters, iterations, n_sink, window, seed)`` as checked ints."""
    n_clusters = check_positive_int("n_clusters", n_clusters)
    if n_clusters > tokens:
        raise ValueError(
            f"`n_clusters` must be <= {tokens} (the seq axis of `k`): more clusters than tokens, "
            f"got {n_clusters}"
        )
    iterations = check_nonnegative_int("iterations", iterations)
    n_sink = check_nonnegative_int("n_sink", n_sink)
    window = check_nonnegative_int("window", window)
    seed, _ = check_seed_offset(seed, 0)
    return n_clusters, iterations, n_sink, window, seed
