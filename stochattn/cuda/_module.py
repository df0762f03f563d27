"""One ``cupy.RawModule`` per kernel family, compiled on first use and cached per device.

``import stochattn.cuda`` compiles nothing; the first call that needs a family compiles
all of its template instantiations (``_sources.name_expressions``) once per device and
process (CuPy also caches the binary on disk, keyed on the source text).
"""

from __future__ import annotations

import math
import threading

from . import _sources

__all__ = ["get_kernel", "Launcher", "ctas_per_sm", "num_sms", "choose_chunks"]

_lock = threading.Lock()
_modules: dict = {}  # (family, device id) -> cupy.RawModule
_occupancy: dict = {}  # (family, name, device id, threads) -> resident CTAs per SM


def _module(family: str):
    import cupy

    dev = cupy.cuda.Device().id
    key = (family, dev)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = cupy.RawModule(code=_sources.source_text(family), options=("-std=c++17",),
                                     name_expressions=_sources.name_expressions(family))
                _modules[key] = mod
    return mod


def get_kernel(family: str, name: str):
    """The compiled kernel ``name`` (one of the family's name expressions) on the current device."""
    return _module(family).get_function(name)


class Launcher:
    """Launch one compiled kernel with the least host work: the ``cupy.cuda.Function`` of
    the current device is resolved once (at plan time) and called with an explicit stream,
    so no ``with stream:`` context and no per-call kernel lookup. Falls back to the public
    ``RawKernel`` call inside ``with stream:`` if this CuPy's ``Function`` call differs."""

    __slots__ = ("raw", "fn")

    def __init__(self, raw):
        self.raw = raw
        try:
            self.fn = raw.kernel  # cupy.cuda.Function for the current device
        except Exception:  # noqa: BLE001 - any API difference: use the public call
            self.fn = None

    def __call__(self, grid, block, args, stream=None):
        """``stream``: a CuPy stream object, or None for CuPy's current stream."""
        fn = self.fn
        if fn is not None:
            try:
                fn(grid, block, args, shared_mem=0, stream=stream)
                return
            except TypeError:  # signature mismatch (raised before any launch): fall back
                self.fn = None
        if stream is None:
            self.raw(grid, block, args)
        else:
            with stream:
                self.raw(grid, block, args)


def launcher(family: str, name: str) -> Launcher:
    """A :class:`Launcher` for kernel ``name`` of ``family`` on the current device."""
    return Launcher(get_kernel(family, name))


def num_sms() -> int:
    import cupy

    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def ctas_per_sm(family: str, name: str, threads: int) -> int:
    """Resident CTAs per SM of a kernel, from its registers and static shared memory
    (sm_90 limits: 64K registers, 228 KB shared memory with 1 KB reserved per CTA, 64 warps)."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (family, name, dev, threads)
    if key not in _occupancy:
        k = get_kernel(family, name)
        try:
            regs = max(1, int(k.num_regs))
            smem = int(k.shared_size_bytes)
            per_warp_regs = math.ceil(regs * 32 / 256) * 256  # allocation granularity
            by_regs = 65536 // (per_warp_regs * (threads // 32))
            by_smem = (233472 // (smem + 1024)) if smem else 32
            by_warps = 64 // (threads // 32)
            _occupancy[key] = max(1, min(by_regs, by_smem, by_warps, 32))
        except Exception:  # attributes unavailable: a safe guess
            _occupancy[key] = 2
    return _occupancy[key]


def choose_chunks(units: int, tokens: int, align: int, slots: int, min_chunk: int = 256):
    """Split each of ``units`` (b, kv head) streams of ``tokens`` into chunks so the grid
    fills ``slots`` resident CTAs in whole waves.

    Returns ``(num_chunks, chunk_len)`` with ``chunk_len`` a multiple of ``align`` and at
    least ``min_chunk`` (rounded to ``align``) unless the stream is shorter. The smallest
    chunk count within 4% of the best wave efficiency wins (fewer chunks, cheaper merge).
    """
    min_len = max(align, math.ceil(min_chunk / align) * align)
    max_chunks = max(1, math.ceil(tokens / min_len))
    limit = min(max_chunks, max(1, (4 * slots) // max(units, 1) + 1))
    effs = []
    for c in range(1, limit + 1):
        length = math.ceil(math.ceil(tokens / c) / align) * align
        ctas = units * math.ceil(tokens / length)
        effs.append(ctas / (math.ceil(ctas / slots) * slots))
    best = 1 + next(i for i, e in enumerate(effs) if e >= max(effs) - 0.04)
    length = math.ceil(math.ceil(tokens / best) / align) * align
    return math.ceil(tokens / length), length
