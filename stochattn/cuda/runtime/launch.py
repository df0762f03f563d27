"""One ``cupy.RawModule`` per kernel instantiation, compiled on first use, cached per device.

``import stochattn.cuda`` compiles nothing; the first call that needs a kernel compiles
that one template instantiation (one of ``kernels.name_expressions``) once per device,
process and configuration (a :class:`.config.GpuConfig`: its compile options and element
types are part of the cache key; CuPy also caches the binary on disk, keyed on the source
text and options).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from .. import config as _config
from .. import kernels
from ..kernels import abi

__all__ = ["get_kernel", "prefetch", "Launcher", "Packed", "ctas_per_sm", "num_sms", "choose_chunks",
           "split_tokens", "split_kv"]

_lock = threading.Lock()
_modules: dict = {}  # (family, name, device id, options, dtypes) -> cupy.RawModule
_smem_lock = threading.Lock()
_occupancy: dict = {}  # (family, name, device id, threads, options, dtypes, smem) -> CTAs per SM


def gpu_config(config=None) -> "_config.GpuConfig":
    """``config`` as a :class:`.config.GpuConfig`: None gives the process default, a bare
    :class:`.config.TileConfig` the default with that tiling (tuning tools)."""
    if config is None:
        return _config.get_config()
    if isinstance(config, _config.TileConfig):
        return _config.get_config().replace(tiling=config)
    return config


def _module(family: str, name: str, config=None):
    import cupy

    config = gpu_config(config)
    dev = cupy.cuda.Device().id
    options = config.tiling.options()
    key = (family, name, dev, options, config.dtypes)
    mod = _modules.get(key)
    if mod is None:
        if name not in kernels.name_expressions(family, config.dtypes):
            raise KeyError(f"{name!r} is not an instantiation of the {family!r} kernels under "
                           f"this configuration (dtypes {config.dtypes})")
        # One instantiation per module: a first call compiles only what it launches (a
        # family has up to a few dozen instantiations; compiling them all took 5-30 s per
        # family). Built outside the lock so that different configurations compile in
        # parallel threads (tuning); two threads racing on one key both compile, one is kept.
        mod = cupy.RawModule(code=kernels.source_text(family), options=options,
                             name_expressions=[name])
        with _lock:
            mod = _modules.setdefault(key, mod)
    return mod


def prefetch(family: str, names, config=None) -> None:
    """Compile the instantiations ``names`` of ``family`` that are not compiled yet, in
    parallel threads (NVRTC runs without the GIL), so a plan that launches several kernels
    waits for the slowest compile instead of their sum on its first use."""
    import cupy

    names = list(dict.fromkeys(names))
    dev = cupy.cuda.Device().id

    def compile_one(name):  # get_function: CuPy may compile a module lazily
        with cupy.cuda.Device(dev):
            _module(family, name, config).get_function(name)

    if len(names) < 2:
        for n in names:
            compile_one(n)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
        list(pool.map(compile_one, names))


def get_kernel(family: str, name: str, config=None):
    """The compiled kernel ``name`` (one of the family's name expressions) on the current
    device, under ``config`` (a :class:`.config.GpuConfig`; default: the process default).
    Each instantiation is its own module, compiled on its first use (CuPy keeps the binary
    on disk, keyed on the source text, options and name, for later processes)."""
    return _module(family, name, config).get_function(name)


class Launcher:
    """Launch one compiled kernel with the least host work: the ``cupy.cuda.Function`` of
    the current device is resolved once (at plan time) and called with an explicit stream,
    so no ``with stream:`` context and no per-call kernel lookup. Falls back to the public
    ``RawKernel`` call inside ``with stream:`` if this CuPy's ``Function`` call differs."""

    __slots__ = ("raw", "fn", "smem")

    def __init__(self, raw, smem: int = 0):
        self.raw = raw
        self.smem = int(smem)  # dynamic shared memory bytes per launch
        # Opt in where dynamic plus static shared memory exceeds the default 48 KB limit.
        # The attribute belongs to the function, which every launcher of this kernel shares:
        # only ever raise it, or a smaller plan would break a larger one's launches
        # (CUDA_ERROR_INVALID_VALUE).
        if self.smem and self.smem + raw.shared_size_bytes > 48 * 1024:
            with _smem_lock:
                if raw.max_dynamic_shared_size_bytes < self.smem:
                    raw.max_dynamic_shared_size_bytes = self.smem
        try:
            self.fn = raw.kernel  # cupy.cuda.Function for the current device
        except Exception:  # noqa: BLE001 - any API difference: use the public call
            self.fn = None

    def __call__(self, grid, block, args, stream=None):
        """``stream``: a CuPy stream object, or None for CuPy's current stream."""
        fn = self.fn
        if fn is not None:
            try:
                fn(grid, block, args, shared_mem=self.smem, stream=stream)
                return
            except TypeError:  # signature mismatch (raised before any launch): fall back
                self.fn = None
        if stream is None:
            self.raw(grid, block, args, shared_mem=self.smem)
        else:
            with stream:
                self.raw(grid, block, args, shared_mem=self.smem)


class Packed:
    """One launch configuration of a kernel with its argument buffer packed once.

    ``args`` are the kernel's arguments as NumPy scalars of the exact C types, normally a
    :class:`..kernels.abi.Bound` from the kernel's declaration (``kernel.bind(variable_names,
    **fixed_values)``), which carries the positions of the per-call arguments; the
    arguments at positions ``variable`` change per call (pointers, seeds, thresholds) and are
    passed to :meth:`__call__` in that order (integers as they are, floating-point values
    converted to the argument's type). Every argument lives in an
    8-byte slot of one uint64 buffer (the driver copies each argument's size from the
    start of its slot: the value in the low bytes, little-endian), and the launch goes
    straight to ``cuLaunchKernel`` through ``cupy.cuda.driver.launchKernel`` with a
    prebuilt array of slot addresses: no per-argument conversion, about half the host cost
    of CuPy's ``Function`` call (``tools/host_overhead.py``). Where that entry point is
    missing, the same values go through :class:`Launcher`. A lock guards the buffer from
    the write to the launch (the driver has copied the arguments when the call returns),
    so concurrent calls from several threads are safe.

    ``pdl=True`` (for the second and later kernels of one call, and only when the plan's
    ``TileConfig.pdl`` is on): the launch goes through ``cuLaunchKernelEx`` with the
    programmatic-serialization attribute (:mod:`.pdl`), so the kernel may be scheduled
    while the one before it finishes; its ``STOCHATTN_PDL_ENTRY`` waits for that one.
    Where the driver entry point is missing (or older than CUDA 12.3), or the machine
    code is older than sm_90, the launch is an ordinary one (the entry's wait is then a
    no-op, or compiled out)."""

    __slots__ = ("launcher", "grid", "block", "variable", "args", "vals", "_ptrs", "params",
                 "fptr", "_lock", "_float", "_pdl")

    def __init__(self, launcher: Launcher, grid, block, args, variable=(), pdl: bool = False):
        if isinstance(args, abi.Bound):
            if variable:
                raise TypeError("a Bound carries its variable positions: pass no `variable`")
            args, variable = args
        self.launcher = launcher
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self.variable = tuple(variable)
        self.args = list(args)  # typed values, for the fallback call
        self.vals = np.zeros(max(1, len(args)), dtype=np.uint64)
        for i, a in enumerate(args):
            if not isinstance(a, np.generic) or a.nbytes not in (4, 8):
                raise TypeError(f"kernel argument {i} must be a 4- or 8-byte NumPy scalar, got "
                                f"{type(a).__name__}")
            self.vals[i] = _bits(a)
        # Floating-point variable arguments are written as their bits (the type's dtype).
        self._float = tuple(args[i].dtype if args[i].dtype.kind == "f" else None
                            for i in self.variable)
        base = self.vals.ctypes.data
        self._ptrs = np.array([base + 8 * i for i in range(len(self.vals))], dtype=np.uint64)
        self.params = int(self._ptrs.ctypes.data)
        fn = launcher.fn
        self.fptr = int(fn.ptr) if fn is not None and _launch_kernel() is not None else None
        self._lock = threading.Lock()
        self._pdl = None
        # Only for machine code built for sm_90 or newer: below it the kernel's entry wait
        # is compiled out, and a dependent launch would race with the kernel before it.
        if pdl and self.fptr is not None and _binary_version(launcher) >= 90:
            from . import pdl as _pdl

            ex = _pdl.launch_ex()
            if ex is not None:
                self._pdl = _pdl.PdlLaunch(ex, self.fptr, self.grid, self.block, launcher.smem,
                                           self.params)

    def __call__(self, stream, *values):
        """Launch with ``values`` at the variable positions; ``stream``: a CuPy stream
        object, or None for CuPy's current stream."""
        fptr = self.fptr
        if fptr is None:
            args = self.args
            for i, x, f in zip(self.variable, values, self._float):
                args[i] = x if f is None else f.type(x)
            self.launcher(self.grid, self.block, tuple(args), stream)
            return
        sptr = stream.ptr if stream is not None else _current_stream_ptr()
        g, b = self.grid, self.block
        with self._lock:
            vals = self.vals
            for i, x, f in zip(self.variable, values, self._float):
                vals[i] = x if f is None else _bits(f.type(x))
            if self._pdl is not None:
                self._pdl(sptr)
            else:
                _launch[0](fptr, g[0], g[1], g[2], b[0], b[1], b[2], self.launcher.smem, sptr,
                           self.params, 0)


def _bits(a) -> int:
    """The bits of a 4- or 8-byte NumPy scalar as an unsigned integer."""
    return int(np.asarray(a).view(np.uint32 if a.nbytes == 4 else np.uint64))


def _binary_version(launcher) -> int:
    """The architecture the launcher's machine code was built for (90 for sm_90), 0 if
    unknown."""
    try:
        return int(launcher.raw.attributes["binary_version"])
    except Exception:  # noqa: BLE001 - no attributes: treat as unknown
        return 0


_launch = [None, False]  # [cupy.cuda.driver.launchKernel or None, looked up]


def _launch_kernel():
    if not _launch[1]:
        try:
            from cupy.cuda import driver

            _launch[0] = getattr(driver, "launchKernel", None)
        except Exception:  # noqa: BLE001 - no driver API: the fallback call
            _launch[0] = None
        _launch[1] = True
    return _launch[0]


class StreamCounters:
    """``n`` int32 counters that start at zero and that the kernel itself sets back to zero
    after each launch (the arrival counts of exact decode's in-kernel merge), one array per
    stream: launches on one stream run in order and share its array, launches on two
    streams never share one. The arrays come from the inputs' framework (zeroed on the
    launch stream, so a first call inside CUDA-graph capture records the fill too) and live
    as long as the plan; at most :attr:`MAX_STREAMS` streams are remembered."""

    MAX_STREAMS = 64

    def __init__(self, n: int):
        self.n = n
        self._arrays: dict = {}
        self._lock = threading.Lock()

    def pointer(self, ops, like, stream) -> int:
        """Device pointer of the counters of ``stream`` (a CuPy stream object, or None for
        CuPy's current stream), allocated and zeroed on first use."""
        sptr = stream.ptr if stream is not None else _current_stream_ptr()
        a = self._arrays.get(sptr)
        if a is None:
            with self._lock:
                if len(self._arrays) >= self.MAX_STREAMS:
                    # Freed through the framework's stream-ordered allocator: safe while a
                    # launch that uses an array is still in flight on its stream.
                    self._arrays.clear()
                a = self._arrays[sptr] = ops.zeros(like, (self.n,), "int32")
        return ops.ptr(a)


class ChunkMerge:
    """The chunk partials of a split-KV launch (exact decode, S²ANTA-flash) and how they
    are combined. One scratch buffer per call holds the partial outputs (fp32, ``rows x
    chunks x head_dim``) and then their (max, sum) pairs. ``in_kernel``: the chunk kernel's
    last CTA of each of the ``groups`` (sequence, KV head) pairs merges them
    (group_state.cuh: merge_if_last_chunk; arrival counters per stream,
    :class:`StreamCounters`); otherwise an ``exact_decode_merge`` launch of ``family`` does,
    with the same arithmetic."""

    def __init__(self, family: str, ctype: str, config, rows: int, chunks: int, head_dim: int,
                 groups: int, in_kernel: bool):
        self.ml_offset = align(4 * rows * chunks * head_dim)
        self.scratch_bytes = self.ml_offset + 8 * rows * chunks
        self.counters = StreamCounters(groups) if in_kernel else None
        self.merge = None
        if not in_kernel:
            merge = abi.kernel(family, "exact_decode_merge")
            self.merge = Packed(launcher(family, merge.expr(T=ctype), 0, config),
                                (rows,), (head_dim,),
                                merge.bind(("part_o", "part_ml", "out", "lse"),
                                           num_chunks=chunks, D=head_dim),
                                pdl=config.pdl)

    def partials(self, ops, like, stream, workspace=None, device=None):
        """``(scratch, partial outputs, (max, sum) pairs, counters)``: the buffer to keep
        alive until the launches are queued, and the three pointers the chunk kernel takes
        (counters 0 when a merge launch follows). ``workspace``: where the partials live
        (:func:`.workspace.scratch`; None allocates)."""
        from .workspace import scratch as take

        po, scratch = take(ops, like, self.scratch_bytes, workspace, device)
        cnt = self.counters.pointer(ops, like, stream) if self.counters is not None else 0
        return scratch, po, po + self.ml_offset, cnt

    def finish(self, stream, po: int, pml: int, outp: int, lsep: int = 0) -> None:
        """The merge launch, when the chunk kernel does not merge; ``lsep``: the device
        pointer of the rows' log-sum-exp output (exact decode's ``return_lse``), 0 for none."""
        if self.merge is not None:
            self.merge(stream, po, pml, outp, lsep)


def split_kv(family: str, name: str, smem: int, config, shape, ctype: str, align: int,
             num_chunks, threads: int, in_kernel: bool):
    """A split-KV chunk kernel over the (sequence, KV head) groups of ``shape`` (an
    ``inputs`` shape): ``(launcher, chunks, chunk_len, merge)``, the :class:`ChunkMerge` of
    its partials being None when one chunk writes the output itself."""
    chunk = launcher(family, name, smem, config)
    groups = shape.batch * shape.kv_heads
    chunks, chunk_len = split_tokens(family, name, smem, config, groups, shape.tokens, align,
                                     num_chunks, threads=threads)
    merge = ChunkMerge(family, ctype, config, shape.batch * shape.q_heads, chunks, shape.head_dim,
                       groups, in_kernel) if chunks > 1 else None
    return chunk, chunks, chunk_len, merge


# The per-call arguments every split-KV chunk kernel takes first, in this order: the
# inputs, the page table (kernels/kv_rows.cuh; zeros for contiguous caches), the output and
# the partials.
SPLIT_KV_VARIABLE = ("q", "k", "v", "seq_lens", "kv_indptr", "kv_indices", "kv_last_page_len",
                     "page_size", "page_stride", "row_stride", "head_stride", "out", "part_o",
                     "part_ml", "counters")


class SplitKVPlan:
    """How a split-KV plan (exact decode, S²ANTA-flash) runs one call. A subclass sets
    ``chunk`` (the :class:`Packed` chunk launch, whose per-call arguments start with
    :data:`SPLIT_KV_VARIABLE`), ``split`` (its :class:`ChunkMerge`, None when one chunk
    writes the output itself), ``shape``, ``device`` and ``out_shape``."""

    def launch(self, inp, seq_lens, check_seq_lens, outputs=None, out=None, workspace=None,
               merge_lse=False):
        """Queue one call on the caller's stream; returns ``(out, results)``.

        ``outputs(ops, like)``: the call's other outputs, allocated on the inputs' device,
        as ``(results, the chunk kernel's remaining per-call arguments)``. ``out`` and
        ``workspace``: see :mod:`.workspace` (None: allocated). ``merge_lse``: the last of
        those arguments is also the merge launch's ``lse`` pointer (exact decode)."""
        from . import inputs
        from .pages import page_args
        from .workspace import output

        ops = inp.ops
        with inputs.device_scope(self.device):
            qp, kp, vp, lens, _keep, stream = inputs.launch_args(inp, seq_lens, check_seq_lens,
                                                                 self.shape, self.device)
            pages = page_args(inp)
            out = output(ops, inp.q, self.out_shape, None, out, self.device)
            outp = ops.ptr(out)
            results, tail = outputs(ops, inp.q) if outputs is not None else ((), ())
            if self.split is None:  # one chunk: the kernel writes `out`, no partials
                self.chunk(stream, qp, kp, vp, lens, *pages, outp, 0, 0, 0, *tail)
            else:
                _scratch, po, pml, cnt = self.split.partials(ops, inp.q, stream, workspace,
                                                             self.device)
                self.chunk(stream, qp, kp, vp, lens, *pages, outp, po, pml, cnt, *tail)
                self.split.finish(stream, po, pml, outp, tail[-1] if merge_lse else 0)
        return out, results

    @property
    def scratch_bytes(self) -> int:
        """Workspace bytes of one call (the chunk partials; 0 with one chunk)."""
        return 0 if self.split is None else self.split.scratch_bytes


def align(nbytes: int, to: int = 256) -> int:
    """``nbytes`` rounded up to a multiple of ``to`` (scratch buffer pieces)."""
    return -(-nbytes // to) * to


def layout(sizes, to: int = 256):
    """``(offsets, total)`` of consecutive pieces of ``sizes`` bytes in one scratch buffer,
    each starting at a multiple of ``to``."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += align(size, to)
    return tuple(offsets), total


def _current_stream_ptr() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def launcher(family: str, name: str, smem: int = 0, config=None) -> Launcher:
    """A :class:`Launcher` for kernel ``name`` of ``family`` on the current device, with
    ``smem`` bytes of dynamic shared memory."""
    return Launcher(get_kernel(family, name, config), smem)


def num_sms() -> int:
    import cupy

    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def ctas_per_sm(family: str, name: str, threads: int, dyn_smem: int = 0, config=None) -> int:
    """Resident CTAs per SM of a kernel, from its registers and static plus ``dyn_smem``
    dynamic shared memory (sm_90 limits: 64K registers, 228 KB shared memory with 1 KB
    reserved per CTA, 64 warps)."""
    import cupy

    config = gpu_config(config)
    dev = cupy.cuda.Device().id
    key = (family, name, dev, threads, config.tiling.options(), config.dtypes, dyn_smem)
    if key not in _occupancy:
        k = get_kernel(family, name, config)
        try:
            regs = max(1, int(k.num_regs))
            smem = int(k.shared_size_bytes) + int(dyn_smem)
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


def split_tokens(family: str, name: str, smem: int, config, units: int, tokens: int, align: int,
                 num_chunks=None, threads=None):
    """``(num_chunks, chunk_len)`` of a split-KV launch of kernel ``name``.

    Default: :func:`choose_chunks` for the kernel's occupancy on this device (``threads``
    per CTA, default the tiling's); an explicit ``num_chunks`` (tests, tuning) is
    honoured with ``chunk_len`` rounded up to ``align``.
    """
    if num_chunks is None:
        threads = gpu_config(config).tiling.threads if threads is None else threads
        slots = num_sms() * ctas_per_sm(family, name, threads, smem, config)
        return choose_chunks(units, tokens, align, slots)
    chunk_len = math.ceil(math.ceil(tokens / num_chunks) / align) * align
    return math.ceil(tokens / chunk_len), chunk_len
