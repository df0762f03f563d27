"""Shared front half of every CUDA entry point: classify the inputs, find (or build and
cache) the launch plan of their configuration, and hand over the seq_lens pointer.

Per call, on a plan-cache hit, the host does attribute reads only: framework, dtype, shape
and device of q, k, v (the cache key), contiguity and 16-byte alignment of each, the data
pointers, torch's current stream. Everything else (validation of shapes, dtypes, head dim,
GQA group, scale, budgets; kernel lookup; occupancy; grid and chunk choice; typed scalar
arguments) is done once per configuration and kept in the plan. Nothing on the hot path
reads GPU data or synchronises with the device:

- ``seq_lens=None`` passes a null pointer (the kernels then use N);
- host ``seq_lens`` (NumPy, list, CPU tensor) are checked on the host, then copied to the
  device asynchronously;
- GPU ``seq_lens`` have their shape, dtype and device checked (attributes only); their
  values are trusted unless the caller passes ``check_seq_lens=True`` (one device-to-host
  copy of B integers and a synchronisation). A GPU value outside [0, N] is undefined
  behaviour without the check (the kernels would read past the sequence).

For CUDA-graph capture (torch inputs), pass ``seq_lens`` as a GPU tensor or None: a host
array would be copied to the device inside the graph once, at capture time.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from ... import _validation as val
from ..kernels import HEAD_DIMS, MAX_GROUP
from .arrays import (CUPY, TORCH, ArrayMeta, host_values, launch_stream, ops_for, to_cupy,
                     to_host)

__all__ = ["GPU_KERNEL_DTYPES", "Inputs", "gather", "cached_plan", "base_plan", "StreamArgs",
           "HOST_STREAMS", "check_stream_words", "stream_args", "advance_offset",
           "seq_lens_pointer", "launch_args", "check_gpu_budget", "clear_plan_cache",
           "plan_cache_size", "device_scope"]

GPU_KERNEL_DTYPES = ("float16", "bfloat16")
NULL = np.uint64(0)

_MAX_PLANS = 512
_plans: dict = {}
_plans_lock = threading.Lock()


class Inputs:
    """One call's q, k, v (contiguous and aligned) with their framework and the cache key."""

    __slots__ = ("ops", "q", "k", "v", "key")

    def __init__(self, ops, q, k, v, key):
        self.ops, self.q, self.k, self.v, self.key = ops, q, k, v, key

    @property
    def device(self) -> int:
        """The device of ``q`` (-1 on the host), from the key (no attribute reads)."""
        return self.key[1][2]

    def pointers(self):
        """(q, k, v) device pointers as typed kernel arguments; copies inputs that are not
        C-contiguous or not 16-byte aligned (kept alive on ``self``)."""
        ops = self.ops
        self.q = ops.contiguous("q", self.q)
        self.k = ops.contiguous("k", self.k)
        self.v = ops.contiguous("v", self.v)
        return np.uint64(ops.ptr(self.q)), np.uint64(ops.ptr(self.k)), np.uint64(ops.ptr(self.v))


def gather(q, k, v) -> Inputs:
    """Classify ``q, k, v`` and build the plan-cache key (attribute reads only). ``k`` may
    be a paged cache (then ``v`` is None): :class:`.pages.PagedInputs`, read in place."""
    if type(k).__name__ == "PagedKV" and type(k).__module__ == "stochattn.paged":
        if v is not None:
            raise TypeError("with a paged cache (`k` a PagedKV) pass no `v`: the cache holds it")
        from .pages import paged_inputs

        return paged_inputs(q, k)
    ops, ops_k, ops_v = ops_for("q", q), ops_for("k", k), ops_for("v", v)
    if not (ops == ops_k == ops_v) and any(o is TORCH or o is CUPY for o in (ops, ops_k, ops_v)):
        raise TypeError("`q`, `k` and `v` must come from one framework (all PyTorch tensors or "
                        f"all CuPy arrays), got {_tname(q)}, {_tname(k)} and {_tname(v)}")
    if ops is not TORCH and ops is not CUPY:  # other DLPack producers: through CuPy
        q, k, v = to_cupy("q", q), to_cupy("k", k), to_cupy("v", v)
        ops = CUPY
    return Inputs(ops, q, k, v, (ops.name, ops.meta(q), ops.meta(k), ops.meta(v)))


def _tname(a) -> str:
    return f"{type(a).__module__}.{type(a).__name__}"


def cached_plan(key, build):
    """The plan of ``key``, built by ``build()`` on a miss (which validates everything the
    key fixes). An unhashable key (a bad argument type) always builds, and ``build`` raises."""
    try:
        plan = _plans.get(key)
    except TypeError:
        return build()
    if plan is None:
        plan = build()
        with _plans_lock:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    return plan


def clear_plan_cache() -> None:
    """Forget every cached launch plan (they are rebuilt on the next call)."""
    with _plans_lock:
        _plans.clear()


def plan_cache_size() -> int:
    return len(_plans)


class device_scope:
    """``with device_scope(d):`` makes GPU ``d`` current only if it is not already (entering
    a ``cupy.cuda.Device`` context costs more than checking)."""

    __slots__ = ("device", "ctx")

    def __init__(self, device: int):
        self.device, self.ctx = device, None

    def __enter__(self):
        import cupy

        if cupy.cuda.runtime.getDevice() != self.device:
            self.ctx = cupy.cuda.Device(self.device)
            self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
            self.ctx = None
        return False


def base_plan(inp: Inputs, softmax_scale):
    """Validate one configuration (on a plan-cache miss): devices, shapes, dtypes, kernel
    limits, scale. Returns ``(shape, scale, device, dtype_name)``."""
    ops = inp.ops
    metas = {}
    devices = []
    given = getattr(inp, "metas", None)  # paged inputs: the virtual (B, Hkv, N, D) of k, v
    for name, a in (("q", inp.q), ("k", inp.k), ("v", inp.v)):
        dtype, shape, dev = given[name] if given else ops.meta(a)
        if dev < 0:
            raise ops.device_error(name, a)
        devices.append(dev)
        metas[name] = ArrayMeta(shape, ops.dtype_name(dtype))
    if len(set(devices)) != 1:
        raise ValueError(f"`q`, `k` and `v` must be on one GPU, got devices {devices[0]}, "
                         f"{devices[1]} and {devices[2]}")
    shape = val.check_attention_inputs(metas["q"], metas["k"], metas["v"], None,
                                       dtypes=GPU_KERNEL_DTYPES)
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"`q` head_dim must be one of {HEAD_DIMS} on the GPU, got {shape.head_dim}")
    if shape.group > MAX_GROUP:
        raise ValueError(f"`q` heads per `k` head (GQA group) must be <= {MAX_GROUP} on the "
                         f"GPU, got {shape.group}")
    if shape.tokens >= 2**31:
        raise ValueError(f"`k` must hold fewer than 2**31 tokens, got {shape.tokens}")
    scale = val.check_scale(softmax_scale, shape.head_dim)
    return shape, scale, devices[0], metas["q"].dtype


def check_gpu_budget(budget, limit: int = 2**30) -> int:
    """A sample budget S for a GPU kernel: an integer in [1, limit]. The kernels count draws
    in int32 with room for loop strides (2**30); S²ANTA-flash spreads the G * S_t draws of a
    tile's heads over one counter, hence its lower limit (2**27, G <= 8)."""
    S = val.check_budget("budget", budget)
    if S > limit:
        raise ValueError(f"`budget` must be at most 2**{limit.bit_length() - 1} on the GPU, "
                         f"got {S}")
    return S


def check_num_chunks(num_chunks):
    return None if num_chunks is None else val.check_positive_int("num_chunks", num_chunks)


def seq_lens_pointer(inp: Inputs, seq_lens, batch: int, tokens: int, device: int, check: bool):
    """``(pointer, keep_alive)`` of an int32 (B,) device array of sequence lengths, enqueued
    on the launch stream; the null pointer for ``seq_lens=None``. See the module docstring
    for what is checked when."""
    if seq_lens is None:
        return NULL, None
    ops = inp.ops
    host = host_values("seq_lens", seq_lens)
    if host is not None:
        val.check_seq_lens(host, batch, tokens)  # host data: checking costs nothing
        host32 = np.ascontiguousarray(host, dtype=np.int32)
        if ops is TORCH:
            import torch

            # Pageable source: CUDA stages it at once, so the copy needs no host sync and
            # the NumPy buffer may go away; ordered on torch's current stream.
            dev = torch.from_numpy(host32).to(inp.q.device, non_blocking=True)
        else:
            import cupy

            dev = cupy.asarray(host32)
        return np.uint64(ops.ptr(dev)), dev
    # On a GPU: attribute checks only, values on request.
    if ops_for("seq_lens", seq_lens) is not ops:
        seq_lens = to_cupy("seq_lens", seq_lens)
        if ops is TORCH:
            import torch

            seq_lens = torch.from_dlpack(seq_lens)
    dtype, shape, dev_id = ops.meta(seq_lens)
    if tuple(shape) != (batch,):
        raise ValueError(f"`seq_lens` must have shape ({batch},), got {tuple(int(s) for s in shape)}")
    dname = ops.dtype_name(dtype)
    if dname not in _NUMPY_INTS:
        raise TypeError(f"`seq_lens` must have an integer dtype, got {dname}")
    if dev_id != device:
        raise ValueError(f"`seq_lens` must be on the GPU of `q` ({device}), got device {dev_id}")
    if check:
        vals = to_host(seq_lens)
        val.check_seq_lens(vals, batch, tokens)
    if dname != "int32":
        seq_lens = seq_lens.to(_torch_int32()) if ops is TORCH else seq_lens.astype(np.int32)
    seq_lens = ops.contiguous("seq_lens", seq_lens)
    return np.uint64(ops.ptr(seq_lens)), seq_lens


_NUMPY_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _torch_int32():
    import torch

    return torch.int32


class StreamArgs(NamedTuple):
    """The random-stream arguments of a drawing kernel (kernels/philox.cuh, StreamFlags):
    host values, device pointers (0 when unused) and the flags saying which to read."""

    seed: int
    offset: int
    seed_ptr: int
    offset_ptr: int
    streams: int


HOST_STREAMS = StreamArgs(0, 0, 0, 0, 0)
_STREAM_FLAGS = {}  # StreamFlags of kernels/philox.cuh, read once from the source
_WIDTHS = {"int32": False, "uint32": False, "int64": True, "uint64": True}


def _stream_flags() -> dict:
    if not _STREAM_FLAGS:
        from ..kernels import abi

        _STREAM_FLAGS.update(abi.enum("santa_prop", "StreamFlags"))
    return _STREAM_FLAGS


def check_stream_words(seed, offset):
    """``seed`` and ``offset`` of a GPU call: ints in range, or arrays (docs/rng.md:
    read by the kernels at run time). A NumPy array of shape () is taken as its int; a NumPy
    array of shape (B,) is refused (it would need a copy to the device on every call)."""
    seed, offset = val.check_seed_offset(seed, offset, arrays=True)
    out = []
    for name, x in (("seed", seed), ("offset", offset)):
        if isinstance(x, np.ndarray):
            if x.ndim:
                raise TypeError(f"`{name}` as a per-sequence array must live on the GPU (a CuPy "
                                "array or a CUDA tensor), got a NumPy array")
            x = int(x)
        out.append(x)
    return tuple(out)


def stream_args(inp: Inputs, seed, offset, batch: int, device: int):
    """``(StreamArgs, keep_alive)`` of one call: ints go by value; device arrays (the
    framework of ``q``, integer dtype of 4 or 8 bytes, shape () or (batch,), contiguous,
    on ``q``'s GPU) by pointer, read by the kernels after their PDL entry. Attribute checks
    only: no value is read, nothing synchronises."""
    if type(seed) is int and type(offset) is int:
        return StreamArgs(seed, offset, 0, 0, 0), None
    flags = _stream_flags()
    words, ptrs, bits = [0, 0], [0, 0], 0
    for i, (name, x, kind) in enumerate((("seed", seed, "SEED"), ("offset", offset, "OFFSET"))):
        if type(x) is int:
            words[i] = x
            continue
        ops = ops_for(name, x)
        if ops is not inp.ops:
            raise TypeError(f"`{name}` must come from the framework of `q` ({inp.ops.name}), got "
                            f"{type(x).__module__}.{type(x).__name__}")
        dtype, shape, dev = ops.meta(x)
        shape = tuple(int(n) for n in shape)
        dname = ops.dtype_name(dtype)
        if dname not in _WIDTHS:
            raise TypeError(f"`{name}` must have dtype int32, uint32, int64 or uint64 on the GPU, "
                            f"got {dname}")
        if shape not in ((), (batch,)):
            raise ValueError(f"`{name}` must have shape () or ({batch},) (one per sequence), "
                             f"got {shape}")
        if dev != device:
            raise ValueError(f"`{name}` must be on the GPU of `q` ({device}), got device {dev}")
        contiguous = x.is_contiguous() if ops is TORCH else x.flags.c_contiguous
        if not contiguous:
            raise ValueError(f"`{name}` must be contiguous (the kernels read it, and an advanced "
                             "offset must be the caller's array)")
        ptrs[i] = ops.ptr(x)
        bits |= flags[f"STREAM_{kind}_DEVICE"]
        if shape:
            bits |= flags[f"STREAM_{kind}_PER_SEQ"]
        if _WIDTHS[dname]:
            bits |= flags[f"STREAM_{kind}_WIDE"]
    return StreamArgs(words[0], words[1], ptrs[0], ptrs[1], bits), (seed, offset)


def advance_offset(offset) -> None:
    """``offset += 1`` on the device, modulo 2**32, on the current stream of its framework
    (enqueued after the call's kernels; captured into a CUDA graph with them). 32-bit words
    wrap by themselves; 64-bit words are masked to their low 32 bits."""
    if type(offset) is int or isinstance(offset, np.ndarray):
        raise TypeError("`advance_offset=True` needs `offset` as a GPU integer array (it is "
                        "advanced in place on the device)")
    ops = ops_for("offset", offset)
    wide = _WIDTHS.get(ops.dtype_name(ops.meta(offset)[0]), False)
    if ops is TORCH:
        offset.add_(1)
        if wide:
            offset.bitwise_and_(0xFFFFFFFF)
    else:
        import cupy

        with cupy.cuda.Device(offset.data.device_id):
            offset += 1
            if wide:
                offset &= 0xFFFFFFFF


def stream_for(inp: Inputs, device: int):
    return launch_stream(inp.ops, device)


def launch_args(inp, seq_lens, check_seq_lens, shape, device):
    """The per-call front of every plan's ``run`` (call it inside ``device_scope(device)``):
    ``(q, k, v pointers, seq_lens pointer, the object keeping seq_lens alive, stream)``.
    With a paged cache ``k`` and ``v`` are the pools, seq_lens must be None (the page
    table holds the lengths) and the null pointer is passed; :func:`.pages.page_args` gives
    the table."""
    if seq_lens is not None and not isinstance(inp, Inputs):
        raise TypeError("with a paged cache (`k` a PagedKV) pass no `seq_lens`: the page table "
                        "holds the lengths")
    qp, kp, vp = inp.pointers()
    lens, keep = seq_lens_pointer(inp, seq_lens, shape.batch, shape.tokens, device, check_seq_lens)
    return qp, kp, vp, lens, keep, stream_for(inp, device)
