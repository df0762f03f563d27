"""Plan objects: the one home of an estimator's rules.

A plan is made from an estimator's options, the device it will run on and, optionally, the
sizes and dtype of the arrays it will see. Making it checks every option once, with one set
of rules for both backends, then asks the chosen backend whether it can run the plan; a
backend that cannot says why (every reason, in one error: xformers' dispatch idea). A plan
is then called with the arrays: :meth:`Plan.run` returns the output, :meth:`Plan.diagnose`
the output and a :class:`~stochattn.Diagnostics` (one return type each, whatever the
options).

The functions (``santa_attention(...)`` and friends) are thin wrappers: they pick the
backend from the arrays, look the plan of their options up in a small per-process cache
(:func:`cached_plan`) and call it.

Backends: ``"reference"`` (NumPy arrays, ``device="cpu"``) and ``"cuda"`` (CuPy arrays and
GPU arrays with ``__dlpack__``, ``device="cuda"``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from . import _validation as val
from ._backend import backend_of, cuda_not_implemented

__all__ = ["AttentionPlan", "Plan", "PlanShape", "cached_plan", "clear_plan_cache", "device_of",
           "fill_out",
           "no_call_arguments", "plan_cache_size", "renamed", "take_seed_offset",
           "check_stream_arrays", "advance"]

DEVICES = {"cpu": "reference", "reference": "reference", "numpy": "reference",
           "cuda": "cuda", "gpu": "cuda"}
_ARRAY_BACKEND = {"numpy": "reference", "cuda": "cuda"}  # backend_of's names -> plan backends


def _gpu_kernel_limits():
    """What every CUDA kernel takes: (dtypes, head dims, max GQA group). Read from the CUDA
    backend's own declarations (importing them imports no CuPy)."""
    from .cuda import kernels
    from .cuda.runtime import inputs

    return inputs.GPU_KERNEL_DTYPES, kernels.HEAD_DIMS, kernels.MAX_GROUP


@dataclass(frozen=True)
class PlanShape:
    """The sizes and dtype a plan is made for: q (B, q_heads, head_dim), k and v
    (B, kv_heads, N, head_dim). Batch and tokens stay free per call."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def _dtype_name(dtype) -> str:
    name = str(getattr(dtype, "name", dtype))
    return name[len("torch."):] if name.startswith("torch.") else name


def _check_shape(q_heads, kv_heads, head_dim, dtype) -> PlanShape | None:
    given = [x is not None for x in (q_heads, kv_heads, head_dim, dtype)]
    if not any(given):
        return None
    if not all(given):
        missing = [n for n, g in zip(("q_heads", "kv_heads", "head_dim", "dtype"), given) if not g]
        raise ValueError("a plan's sizes come together: pass `q_heads`, `kv_heads`, `head_dim` "
                         f"and `dtype`, or none of them; missing {', '.join(f'`{m}`' for m in missing)}")
    q_heads = val.check_positive_int("q_heads", q_heads)
    kv_heads = val.check_positive_int("kv_heads", kv_heads)
    head_dim = val.check_positive_int("head_dim", head_dim)
    if q_heads % kv_heads:
        raise ValueError(f"`q_heads` must be a multiple of `kv_heads` (GQA), got {q_heads} and "
                         f"{kv_heads}")
    return PlanShape(q_heads, kv_heads, head_dim, _dtype_name(dtype))


class Plan:
    """Base of every estimator's plan (see the module docstring).

    Subclasses check their options in ``__init__`` and then call ``super().__init__``;
    they implement ``_run(backend, arrays, diagnose, call)`` and may add
    ``_cuda_missing()`` (features the GPU does not have: the reasons of a refusal) and
    ``_check_cuda_limits()`` (values the GPU kernels cannot take: a ``ValueError``).
    """

    function = "plan"  # the functional API's name, for messages
    needs_v = True     # False for estimators of the score stage (q and k only)
    # A plan made by the user keeps its GPU scratch between calls (:attr:`workspace`); the
    # functions' cached plans do not (their callers may be on any stream).
    keeps_workspace = True
    _workspace = None

    def __init__(self, *, device="cpu", q_heads=None, kv_heads=None, head_dim=None, dtype=None):
        if not isinstance(device, str) or device.split(":")[0].lower() not in DEVICES:
            raise ValueError(f"`device` must be one of 'cpu', 'cuda', got {device!r}")
        self.backend = DEVICES[device.split(":")[0].lower()]
        self.shape = _check_shape(q_heads, kv_heads, head_dim, dtype)
        reasons = self.not_supported_reasons(self.backend)
        if reasons:
            if self.backend == "cuda" and self._cuda_missing():
                raise cuda_not_implemented(self.function, "; ".join(reasons))
            where = "the GPU" if self.backend == "cuda" else "the reference"
            raise NotImplementedError(f"`{self.function}` cannot run this plan on {where}: "
                                      + "; ".join(reasons))
        if self.backend == "cuda":
            self._check_cuda_limits()

    # ---- what a backend can run --------------------------------------------------------

    def not_supported_reasons(self, backend: str) -> list[str]:
        """Why ``backend`` (``"reference"`` or ``"cuda"``) cannot run this plan; empty if it can."""
        reasons = []
        s = self.shape
        if backend == "reference":
            if s is not None and s.dtype not in val.REFERENCE_DTYPES:
                reasons.append(f"dtype {s.dtype} (the reference takes {', '.join(val.REFERENCE_DTYPES)})")
            return reasons
        reasons.extend(self._cuda_missing())
        if s is not None:
            dtypes, head_dims, max_group = _gpu_kernel_limits()
            if s.dtype not in dtypes:
                reasons.append(f"dtype {s.dtype} (the GPU kernels take {', '.join(dtypes)})")
            if s.head_dim not in head_dims:
                reasons.append(f"head_dim {s.head_dim} (the GPU kernels take {head_dims})")
            if s.group > max_group:
                reasons.append(f"GQA group {s.group} (the GPU kernels take at most {max_group})")
        return reasons

    def _cuda_missing(self) -> list[str]:
        return []

    def _streams(self, backend: str, q, call: dict) -> tuple:
        """``(seed, offset)`` of a call of a stochastic plan (one with ``advance_offset``),
        checked against the batch of ``q`` (see :func:`check_stream_arrays`)."""
        seed, offset = take_seed_offset(call)
        shape = getattr(q, "shape", ())  # a bad q is reported by the input checks that follow
        check_stream_arrays(backend, seed, offset, int(shape[0]) if len(shape) else None,
                            self.advance_offset)
        return seed, offset

    def _check_cuda_limits(self) -> None:
        return None

    # ---- calls ----------------------------------------------------------------------------

    @property
    def workspace(self):
        """The GPU scratch this plan keeps between calls
        (:class:`stochattn.cuda.runtime.workspace.Workspace`): allocated by the first call
        that needs more than it holds, reused after, so a warmed-up plan called with ``out=``
        allocates nothing (call it once eagerly before capturing a CUDA graph). One stream
        at a time: a call may instead pass its own ``workspace=`` (a uint8 GPU array)."""
        if self._workspace is None:
            from .cuda.runtime.workspace import Workspace

            self._workspace = Workspace()
        return self._workspace

    def _buffers(self, call: dict) -> tuple:
        """``(out, workspace)`` of a call, taken out of ``call``: ``out`` as given (None:
        the call allocates its output), the ``workspace`` given, else the plan's own (None
        for the functions' cached plans: each call allocates). On the reference ``out`` is
        handled by :meth:`dispatch` (the result copied into a NumPy ``out``), so this gives
        None for it, and a workspace is refused."""
        out, ws = call.pop("out", None), call.pop("workspace", None)
        if self.backend == "reference":  # `out` was taken by `dispatch`, which fills it
            if ws is not None:
                raise TypeError("`workspace` is GPU scratch; the reference takes none")
            return None, None
        if ws is None and self.keeps_workspace:
            ws = self.workspace
        return out, ws

    def run(self, q, k, v=None, seq_lens=None, **call):
        """The estimator's output for these arrays (see the plan class for ``call``)."""
        return self._call(q, k, v, seq_lens, False, call)

    def diagnose(self, q, k, v=None, seq_lens=None, **call):
        """``(output, Diagnostics)`` for these arrays: :meth:`run` plus what the call read."""
        return self._call(q, k, v, seq_lens, True, call)

    def _call(self, q, k, v, seq_lens, diagnose, call):
        if is_paged(k):
            if k.device != ("cpu" if self.backend == "reference" else "cuda"):
                raise TypeError(f"this plan runs on the {self.backend} backend, got a paged cache "
                                f"of {'NumPy' if k.device == 'cpu' else 'GPU'} arrays")
            return self.dispatch(q, k, v, seq_lens, diagnose, call)
        arrays = dict(q=q, k=k, v=v) if self.needs_v else dict(q=q, k=k)
        if self.needs_v and v is None:
            raise TypeError(f"`{self.function}` needs `v`, got None")
        got = _ARRAY_BACKEND[backend_of(**arrays)]
        if got != self.backend:
            where = "NumPy arrays" if got == "reference" else "GPU arrays"
            raise TypeError(f"this plan runs on the {self.backend} backend (device="
                            f"{'cpu' if self.backend == 'reference' else 'cuda'!r}), got {where}")
        return self.dispatch(q, k, v, seq_lens, diagnose, call)

    def dispatch(self, q, k, v, seq_lens, diagnose: bool, call: dict):
        """The call, for arrays already known to be of this plan's backend (the functions
        use it after choosing the plan by the arrays' backend)."""
        if is_paged(k) and self.backend == "reference":  # a contiguous copy
            from .paged import contiguous

            k, v, seq_lens = contiguous(k, v if self.needs_v else None, seq_lens)
            if not self.needs_v:
                v = None
        elif is_paged(k):  # the GPU kernels read the pages in place
            given = [f"`{n}`" for n, x in (("v", v), ("seq_lens", seq_lens)) if x is not None]
            if given:
                raise TypeError(f"with a paged cache (`k` a PagedKV) pass no "
                                f"{' and no '.join(given)}: the page table holds the values and "
                                "the lengths")
            reasons = self._paged_cuda_missing()
            if reasons:
                raise NotImplementedError(f"`{self.function}` cannot read a paged cache on the "
                                          "GPU: " + "; ".join(reasons))
        if self.shape is not None:
            self._check_planned_shape(q, k)
        out = call.pop("out", None) if self.backend == "reference" else None
        if out is not None and not isinstance(out, np.ndarray):
            raise TypeError(f"`out` must be a NumPy array on the reference, got "
                            f"{type(out).__name__}")
        result = self._run(self.backend, q, k, v, seq_lens, diagnose, call)
        if out is None:  # the GPU kernels write a given `out` themselves
            return result
        if isinstance(result, tuple):  # (out, diagnostics) or (out, lse[, diagnostics])
            return (fill_out(out, result[0]),) + tuple(result[1:])
        return fill_out(out, result)

    def _paged_cuda_missing(self) -> list[str]:
        """Why this plan's GPU kernels cannot read a paged cache in place (empty: they can)."""
        return ["its GPU kernels read contiguous caches only (pass NumPy pages to run the "
                "reference)"]

    def _check_planned_shape(self, q, k) -> None:
        s = self.shape
        qs = tuple(q.shape)
        ks = ((k.batch, k.kv_heads, k.token_bound, k.head_dim) if is_paged(k)
              else tuple(k.shape))
        got = (qs[1] if len(qs) == 3 else None, ks[1] if len(ks) == 4 else None,
               qs[-1] if qs else None, _dtype_name(q.dtype))
        for name, want, have in zip(("q_heads", "kv_heads", "head_dim", "dtype"),
                                    (s.q_heads, s.kv_heads, s.head_dim, s.dtype), got):
            if want != have:
                raise ValueError(f"`q`/`k` do not match the plan: planned {name}={want!r}, got "
                                 f"{have!r} (q shape {qs}, k shape {ks}, dtype {_dtype_name(q.dtype)})")

    def _run(self, backend, q, k, v, seq_lens, diagnose, call):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        shape = "" if self.shape is None else (
            f", q_heads={self.shape.q_heads}, kv_heads={self.shape.kv_heads}, "
            f"head_dim={self.shape.head_dim}, dtype={self.shape.dtype!r}")
        return f"{type(self).__name__}({opts}, device={'cpu' if self.backend == 'reference' else 'cuda'!r}{shape})"

    def options(self) -> dict:
        """The plan's checked options, by their public names."""
        return {}


class AttentionPlan(Plan):
    """A plan whose options include the two every attention estimator has: ``softmax_scale``
    (None for 1/sqrt(D)) and ``check_finite``."""

    def __init__(self, *, softmax_scale=None, check_finite=False, device="cpu", q_heads=None,
                 kv_heads=None, head_dim=None, dtype=None):
        if softmax_scale is not None:
            val.check_scale(softmax_scale, 1)
        self.softmax_scale = softmax_scale
        self.check_finite = val.check_bool("check_finite", check_finite)
        super().__init__(device=device, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                         dtype=dtype)

    def options(self) -> dict:
        return dict(softmax_scale=self.softmax_scale, check_finite=self.check_finite)


# ---- the functional API's plan cache --------------------------------------------------------

_MAX_PLANS = 256
_plans: dict = {}
_lock = threading.Lock()


def cached_plan(cls, device: str, **options) -> Plan:
    """The plan ``cls(device=device, **options)``, from a bounded per-process cache (what
    the functions use; the oldest plan goes first when it is full). Options that cannot be a key (unhashable values) build a
    fresh plan, which then reports what is wrong with them."""
    key = (cls, device, tuple((name, type(value), value) for name, value in options.items()))
    try:
        plan = _plans.get(key)
    except TypeError:
        return cls(device=device, **options)
    if plan is not None:
        return plan
    plan = cls(device=device, **options)
    plan.keeps_workspace = False
    with _lock:
        _plans[key] = plan
        while len(_plans) > _MAX_PLANS:
            del _plans[next(iter(_plans))]
    return plan


def clear_plan_cache() -> None:
    """Forget the functions' cached plans (they are made again on the next call)."""
    with _lock:
        _plans.clear()


def plan_cache_size() -> int:
    return len(_plans)


def fill_out(out, result):
    """The reference's ``out=``: ``result`` copied into ``out`` (same shape, dtype castable
    without loss of kind) and ``out`` returned; ``result`` itself when ``out`` is None."""
    if out is None:
        return result
    if out.shape != result.shape:
        raise ValueError(f"`out` must have shape {result.shape}, got {out.shape}")
    if out.dtype != result.dtype:
        raise TypeError(f"`out` must have dtype {result.dtype}, got {out.dtype}")
    out[...] = result
    return out


def no_call_arguments(call: dict) -> None:
    """A call of a plan takes the arrays only: any other argument is an option of the plan."""
    if call:
        raise TypeError(f"unexpected argument(s) {', '.join(f'`{n}`' for n in call)}; a call "
                        "takes the arrays only (the rest are the plan's options)")


def take_seed_offset(call: dict) -> tuple:
    """``(seed, offset)`` of a call of a stochastic plan, checked; nothing else is accepted.
    Each is an int or an integer array of shape () or (B,) (see :func:`check_stream_arrays`)."""
    seed, offset = call.pop("seed", 0), call.pop("offset", 0)
    if call:
        raise TypeError(f"unexpected argument(s) {', '.join(f'`{n}`' for n in call)}; a call "
                        "takes the arrays, `seed` and `offset` (the rest are the plan's options)")
    return val.check_seed_offset(seed, offset, arrays=True)


def check_stream_arrays(backend: str, seed, offset, batch, advance_offset: bool) -> None:
    """The per-call forms of ``seed`` and ``offset`` (docs/rng.md), once the batch is
    known: ints, or integer arrays of shape () or (B,) (sequence ``b`` draws with
    ``seed[b]``, ``offset[b]``). The reference takes NumPy arrays; the CUDA kernels take GPU
    arrays of the inputs' framework, which they read at run time (their attributes are
    checked by :func:`stochattn.cuda.runtime.inputs.stream_args`, no value is read). With
    ``advance_offset`` the offset must be such an array, which the call advances by 1 in
    place (on the device for the GPU) when it is done."""
    if advance_offset and (isinstance(offset, int)
                           or (backend == "cuda" and isinstance(offset, np.ndarray))):
        where = "a GPU integer array (advanced in place on the device)" if backend == "cuda" \
            else "an integer array (it is advanced in place)"
        raise TypeError(f"`advance_offset=True` needs `offset` as {where}, got "
                        f"{'an int' if isinstance(offset, int) else 'a NumPy array'}")
    for name, x in (("seed", seed), ("offset", offset)):
        if isinstance(x, np.ndarray) and batch is not None:  # batch None: q has no shape
            val.check_per_sequence(name, x, batch)


def advance(offset) -> None:
    """``offset += 1`` in place, modulo 2**32 (the plan option ``advance_offset``): on the
    host for a NumPy array, on the device (the caller's current stream, after the call's
    kernels, so a captured CUDA graph advances it on every replay) for a GPU array."""
    if isinstance(offset, np.ndarray):
        offset[...] = (offset.astype(np.uint64) + np.uint64(1)) % np.uint64(2**32)
        return
    from .cuda.runtime.inputs import advance_offset

    advance_offset(offset)


def renamed(function: str, deprecated: dict, renames: dict, values: dict,
            checks: dict | None = None) -> dict:
    """Old parameter names still accepted for one release, with a ``DeprecationWarning``:
    ``deprecated`` holds the call's leftover keyword arguments, ``renames`` maps old names
    to new ones and ``values`` the new names to what the call passed (``None``: left at its
    default); ``checks`` maps old names to ``check(name, value)`` functions, so that a bad
    value is reported under the name the caller used. Returns ``values`` with the old names'
    values moved in."""
    import warnings

    for old, value in deprecated.items():
        new = renames.get(old)
        if new is None:
            raise TypeError(f"{function}() got an unexpected keyword argument {old!r}")
        if values.get(new) is not None:
            raise TypeError(f"{function}() got both `{new}` and its old name `{old}`")
        if checks and old in checks:
            value = checks[old](old, value)
        warnings.warn(f"`{function}`: `{old}` is now called `{new}`", DeprecationWarning,
                      stacklevel=3)
        values[new] = value
    return values


def is_paged(k) -> bool:
    """Whether ``k`` is a paged cache (:class:`stochattn.paged.PagedKV`)."""
    return type(k).__name__ == "PagedKV" and type(k).__module__ == "stochattn.paged"


def device_of(q, k, v=None) -> str:
    """``"cpu"`` or ``"cuda"`` for a call's arrays (see :func:`~stochattn._backend.backend_of`);
    ``k`` may be a paged cache, whose device then decides along with ``q``'s."""
    if is_paged(k):
        kind = backend_of(q=q)
        if (kind == "numpy") != (k.device == "cpu"):
            raise TypeError(f"all arrays must live on one device, got `q` on "
                            f"{'host (NumPy)' if kind == 'numpy' else 'GPU'} and a paged `k` on "
                            f"{'host (NumPy)' if k.device == 'cpu' else 'GPU'}")
        return k.device
    arrays = dict(q=q, k=k) if v is None else dict(q=q, k=k, v=v)
    return "cpu" if backend_of(**arrays) == "numpy" else "cuda"
