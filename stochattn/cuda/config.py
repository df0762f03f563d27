"""Tuning of the GPU backend: one :class:`GpuConfig` per device.

Every knob of the CUDA kernels lives in one frozen object: the CUDA-core pipeline
(:class:`TileConfig`), the tensor-core tilings of exact decode, S²ANTA-prop and S²ANTA-flash
(:class:`TcTiling`, one of the compiled ones), the in-kernel split-KV merge, programmatic
dependent launch, line tables, and the element types a module compiles. A call reads the
config of its inputs' device once, and the config is part of every plan and module cache
key, so changing it never reuses a plan or a binary made under another.

    >>> from stochattn.cuda import config
    >>> config.get_config().merge_in_kernel
    True
    >>> with config.using_config(pdl=True, stages=4):   # the process default, restored after
    ...     ...
    >>> config.set_config(1, tc_tiling=config.TC_TILINGS[1])  # GPU 1 only; returns the old one

``device=None`` names the process default, which every GPU without its own config follows;
an integer names one GPU, whose own config starts as a copy of the default when first set.
The default is created on first use from the environment:

- ``STOCHATTN_TILE_CONFIG="stage_bytes,stages,threads,reduce"`` (e.g. ``16384,3,256,scatter``)
  replaces the CUDA-core pipeline of :data:`DEFAULT_TILE_CONFIG`;
- ``STOCHATTN_PDL=1`` turns on programmatic dependent launch;
- ``STOCHATTN_LINEINFO=1`` compiles with line tables (Nsight Compute per-line counters).

Nothing here imports CuPy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass, field, replace

from .kernels import HEAD_DIMS

__all__ = ["GpuConfig", "get_config", "set_config", "using_config", "reset_config", "TileConfig",
           "TcTiling", "DEFAULT_TILE_CONFIG", "TC_TILINGS", "PROP_TC_TILINGS", "FLASH_TC_TILINGS",
           "flash_tc_smem_bytes", "smem_limit"]


_REDUCE_CODES = {"butterfly": 0, "scatter": 1}
_SMEM_LIMIT = 227 * 1024  # sm_90: dynamic shared memory per CTA


@dataclass(frozen=True)
class TileConfig:
    """Compile-time configuration of the kernels: the tiling of the streaming kernels (exact
    decode, S²ANTA-prop pass 1, S²ANTA-flash, Double-P), the one place of truth for the
    ``STOCHATTN_*`` macros of ``decode_common.cuh`` and the host-side quantities derived
    from them (tile rows, threads, shared memory), plus the two compile switches.

    ``stage_bytes``: bytes of K (and as much of V) per cp.async stage; ``stages``: pipeline
    depth; ``threads``: threads per CTA; ``reduce``: "butterfly" (all-reduce every partial
    dot product) or "scatter" (reduce-scatter, then one broadcast per logit).

    ``pdl``: programmatic dependent launch (sm_90). Every kernel is compiled with
    ``-DSTOCHATTN_PDL=1`` (its entry waits for the grid before it, then lets the next one
    launch: ``STOCHATTN_PDL_ENTRY`` in ``decode_common.cuh``), and the second and later
    kernels of one call are launched with the programmatic-serialization attribute
    (``Packed(..., pdl=True)``), so that each launch overlaps the tail of the kernel
    before it. ``lineinfo``: compile with ``-lineinfo`` (line tables for profilers).
    """

    stage_bytes: int = 4096
    stages: int = 4
    threads: int = 128
    reduce: str = "butterfly"
    pdl: bool = False
    lineinfo: bool = False

    def __post_init__(self):
        if self.reduce not in _REDUCE_CODES:
            raise ValueError(f"`reduce` must be one of {tuple(_REDUCE_CODES)}, got {self.reduce!r}")
        if self.threads not in (64, 128, 256, 512) or not 2 <= self.stages <= 8:
            raise ValueError(f"unsupported threads/stages: {self}")
        for name in ("pdl", "lineinfo"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        for d in HEAD_DIMS:  # every head dim must tile: a power of two of rows per thread
            rpt = self.rows_per_thread(d)
            if rpt < 1 or rpt & (rpt - 1) or self.tile_rows(d) * 2 * d != self.stage_bytes \
                    or self.tile_rows(d) > 256:
                raise ValueError(f"stage_bytes {self.stage_bytes} does not tile head_dim {d} with "
                                 f"{self.threads} threads")
        # flash_tile.cuh's per-warp pipeline: stages of stage_bytes / warps, 1 to 32 rows of
        # head dim 64 (a whole number of rows per lane for both head dims).
        if not 512 <= self.warp_stage_bytes() <= 4096:
            raise ValueError(f"stage_bytes / warps must be in [512, 4096], got {self}")

    def options(self) -> tuple:
        """NVRTC / nvcc options: the language standard, line tables if asked, the tiling
        macros and the PDL switch."""
        return ("-std=c++17",) + (("-lineinfo",) if self.lineinfo else ()) + (
            f"-DSTOCHATTN_STAGE_BYTES={self.stage_bytes}", f"-DSTOCHATTN_STAGES={self.stages}",
            f"-DSTOCHATTN_THREADS={self.threads}",
            f"-DSTOCHATTN_REDUCE={_REDUCE_CODES[self.reduce]}") + (
                ("-DSTOCHATTN_PDL=1",) if self.pdl else ())

    def tile_rows(self, head_dim: int) -> int:
        """Rows per pipeline stage (decode_common.cuh: Tiling::kTileRows)."""
        return self.stage_bytes // (2 * head_dim)

    def rows_per_thread(self, head_dim: int) -> int:
        return self.tile_rows(head_dim) // (self.threads // (head_dim // 8))

    def warp_stage_bytes(self) -> int:
        """Bytes of one stage of a warp's own K pipeline (flash_tile.cuh: WarpTiling)."""
        return self.stage_bytes // (self.threads // 32)

    def smem_bytes(self, family: str, head_dim: int, gmax: int, tile_size: int = 0) -> int:
        """Dynamic shared memory of the family's streaming kernel (static arrays excluded);
        ``tile_size``: the sampling tile of santa_flash (its per-warp buffers)."""
        if family == "exact_decode":  # K+V stages, reused by the cross-warp merge
            merge = (2 + head_dim) * (self.threads // 32) * gmax * 4
            return max(self.stages * 2 * self.stage_bytes, merge)
        if family == "santa_prop":  # K stages
            return self.stages * self.stage_bytes
        if family == "doublep_decode":  # K+V stages, reused by the merge; the row list follows
            merge = (2 + head_dim) * (self.threads // 32) * gmax * 4
            return max(self.stages * 2 * self.stage_bytes, merge)
        if family == "santa_flash":  # per warp: K stages, logits, counts, row list; then merge
            if tile_size <= 0:
                raise ValueError("santa_flash's shared memory depends on `tile_size`")
            warps = self.threads // 32
            per_warp = (_flash_warp_stages() * self.warp_stage_bytes()
                        + tile_size * (8 * gmax + 4))
            return max(warps * per_warp, (2 + head_dim) * warps * gmax * 4)
        raise KeyError(family)

    def label(self) -> str:
        return (f"{self.stage_bytes // 1024}K x{self.stages} t{self.threads} {self.reduce}"
                + (" pdl" if self.pdl else "") + (" lineinfo" if self.lineinfo else ""))


def _flash_warp_stages() -> int:
    """Depth of a warp's K pipeline of S²ANTA-flash (flash_tile.cuh: kFlashStages)."""
    from .kernels import abi

    return abi.constant("santa_flash", "kFlashStages")


# The CUDA-core pipeline by default. To change it, edit this line (tests and benchmarks
# follow); STOCHATTN_TILE_CONFIG overrides it for one process.
DEFAULT_TILE_CONFIG = TileConfig(stage_bytes=8192, stages=3, threads=128, reduce="scatter")


@dataclass(frozen=True)
class TcTiling:
    """Tiling of a tensor-core decode kernel (template parameters, independent of
    :class:`TileConfig`): ``warps`` per CTA, each streaming its own tiles of ``rows`` keys (a
    multiple of 16) through ``stages`` cp.async buffers of ``matrices`` matrices (2: K and V,
    ``exact_decode_tc.cu``; 1: K alone, ``santa_prop_logits_tc``)."""

    warps: int = 8
    rows: int = 16
    stages: int = 3
    matrices: int = 2

    def __post_init__(self):
        if self.warps not in (2, 4, 8) or self.rows not in (16, 32, 64) \
                or not 2 <= self.stages <= 8 or self.matrices not in (1, 2):
            raise ValueError(f"unsupported tensor-core tiling: {self}")
        if self.smem_bytes(max(HEAD_DIMS)) > _SMEM_LIMIT:
            raise ValueError(f"tensor-core tiling {self} needs {self.smem_bytes(max(HEAD_DIMS))} "
                             f"bytes of shared memory at head_dim {max(HEAD_DIMS)}, the limit is "
                             f"{_SMEM_LIMIT}")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int) -> int:
        """Per-warp rings; with K and V, reused by the cross-warp merge ((2 + D) floats per
        warp and head, 8 heads)."""
        rings = self.warps * self.stages * self.matrices * self.rows * head_dim * 2
        if self.matrices == 1:
            return rings
        return max(rings, (2 + head_dim) * self.warps * 8 * 4)

    def align(self) -> int:
        """Chunk lengths are multiples of this: one tile per warp."""
        return self.warps * self.rows

    def template_args(self) -> str:
        return f"{self.warps}, {self.rows}, {self.stages}"

    def params(self) -> dict:
        """The kernels' template parameters of this tiling, by name."""
        return dict(WARPS=self.warps, ROWS=self.rows, STAGES=self.stages)

    def label(self) -> str:
        return f"tc w{self.warps} r{self.rows} s{self.stages}" + (" K" if self.matrices == 1 else "")


# Every tensor-core tiling that is compiled (one instantiation per dtype and head dim
# each); the first is the default. tools/tune_exact_tc.py compares them. H200, Hq 32 / Hkv 8
# / D 128, three runs (2026-12-04): all four within ~2% of each other at batch 8 and 32
# (103-110% of the 4.25 TB/s K+V floor); w8 r16 s3 is the fastest at batch 1 (CUDA-graph
# replay at 32k: 36 us against 38 us for the others), the shape furthest from the floor,
# and gives up ~1.5% at batch 32 / 128k against w4 r32 s2.
TC_TILINGS = (TcTiling(8, 16, 3), TcTiling(4, 16, 3), TcTiling(4, 16, 4), TcTiling(4, 32, 2))

# The compiled tilings of S²ANTA-prop's tensor-core pass 1 (santa_prop_logits_tc: K rings
# only, rows 16 or 32); the first is the default. tools/prop_breakdown.py, H200, fp16,
# S = 256 (2026-12-04, benchmarks/results/prop_breakdown_2026-12-04b.json): w4 r32 s4 is the
# fastest at every shape measured (batch 8 / 32k 170 us against 176 and 181; batch 8 / 128k
# 588 against 613 and 617; batch 32 / 32k 611 against 630 and 626; batch 1 / 128k 107
# against 110 and 111).
PROP_TC_TILINGS = (TcTiling(4, 32, 4, 1), TcTiling(8, 16, 3, 1), TcTiling(8, 16, 6, 1))

# The compiled tilings of S²ANTA-flash's tensor-core kernel (santa_flash_tc_chunk: K rings
# only, plus per-warp sampling buffers, flash_tc_smem_bytes); the first is the default. Not
# yet timed (2026-12-05): w4 r16 s4 fits 3 CTAs (12 warps) per SM at tile 64, like the
# CUDA-core kernel, with 12 KB of K in flight per warp; w4 r32 s4 is prop's fastest ring
# (one CTA per SM); w8 r16 s2: 8 warps with 4 KB in flight each, but its registers
# (157-213 at D = 128) allow one CTA per SM, and at D = 64 / GMAX 4 ptxas caps it at 128
# and spills 88 bytes (nvcc 13, 2026-12-05).
FLASH_TC_TILINGS = (TcTiling(4, 16, 4, 1), TcTiling(4, 32, 4, 1), TcTiling(8, 16, 2, 1))


def flash_tc_smem_bytes(tiling: TcTiling, head_dim: int, gmax: int, tile_size: int) -> int:
    """Dynamic shared memory of ``santa_flash_tc_chunk`` (santa_flash_tc.cu): per warp the K
    ring, the padded logits [gmax][tile_size + 8] fp32, the counts [gmax][tile_size] and the
    row list [tile_size] int32; reused by the cross-warp merge ((2 + D) floats per warp and
    head)."""
    per_warp = (tiling.stages * tiling.rows * head_dim * 2 + tile_size * (8 * gmax + 4)
                + 32 * gmax)
    return max(tiling.warps * per_warp, (2 + head_dim) * tiling.warps * gmax * 4)


def smem_limit() -> int:
    """Dynamic shared memory one CTA may use on sm_90 (bytes)."""
    return _SMEM_LIMIT


_TILE_FIELDS = tuple(f.name for f in dataclasses.fields(TileConfig))
_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class GpuConfig:
    """Every tuning knob of the GPU backend on one device (frozen; change it with
    :func:`set_config` or :func:`using_config`).

    Attributes
    ----------
    tiling : TileConfig
        The CUDA-core kernels' pipeline (``stage_bytes``, ``stages``, ``threads``,
        ``reduce``) and the compile switches ``pdl`` and ``lineinfo``; :func:`set_config`
        takes each of these fields by name too. Default :data:`DEFAULT_TILE_CONFIG`.
    tc_tiling : TcTiling
        ``exact_decode(..., kernel="tc")``'s tiling, one of :data:`TC_TILINGS` (default:
        the first).
    prop_tc_tiling : TcTiling
        S²ANTA-prop's tensor-core pass 1, one of :data:`PROP_TC_TILINGS`.
    flash_tc_tiling : TcTiling
        ``santa_flash(..., kernel="tc")``'s tiling, one of :data:`FLASH_TC_TILINGS`.
    merge_in_kernel : bool
        With several chunks, the last CTA of each (sequence, KV head) merges the chunk
        partials inside the chunk launch of exact decode and S²ANTA-flash (one launch per
        call); False: a separate merge launch (same bits). Default True.
    dtypes : tuple of str or None
        Element types to instantiate in modules compiled from now on (e.g.
        ``("float16",)``: a tuning run compiles a third of the kernels); None: all.

    ``pdl`` and ``lineinfo`` read through to ``tiling``.
    """

    tiling: TileConfig = DEFAULT_TILE_CONFIG
    tc_tiling: TcTiling = TC_TILINGS[0]
    prop_tc_tiling: TcTiling = PROP_TC_TILINGS[0]
    flash_tc_tiling: TcTiling = FLASH_TC_TILINGS[0]
    merge_in_kernel: bool = True
    dtypes: tuple | None = field(default=None)

    def __post_init__(self):
        if not isinstance(self.tiling, TileConfig):
            raise TypeError(f"`tiling` must be a TileConfig, got {type(self.tiling).__name__}")
        for name, compiled in (("tc_tiling", TC_TILINGS), ("prop_tc_tiling", PROP_TC_TILINGS),
                               ("flash_tc_tiling", FLASH_TC_TILINGS)):
            if getattr(self, name) not in compiled:
                raise ValueError(f"`{name}` must be one of the compiled {compiled}, got "
                                 f"{getattr(self, name)!r}")
        if not isinstance(self.merge_in_kernel, bool):
            raise TypeError(f"`merge_in_kernel` must be a bool, got "
                            f"{type(self.merge_in_kernel).__name__}")
        if self.dtypes is not None:
            dtypes = tuple(sorted(self.dtypes))
            if not dtypes or any(d not in _DTYPES for d in dtypes):
                raise ValueError(f"`dtypes` must be None or element types from {_DTYPES}, got "
                                 f"{self.dtypes!r}")
            object.__setattr__(self, "dtypes", dtypes)
        # Hashed once: a call hashes its config as part of the plan key.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name)
                                                     for f in dataclasses.fields(self))))

    def __hash__(self):
        return self._hash

    @property
    def pdl(self) -> bool:
        return self.tiling.pdl

    @property
    def lineinfo(self) -> bool:
        return self.tiling.lineinfo

    def replace(self, **changes) -> "GpuConfig":
        """A copy with ``changes``: any field of this class or of :class:`TileConfig`."""
        unknown = set(changes) - set(_TILE_FIELDS) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown GPU config fields {sorted(unknown)}; valid: "
                            f"{sorted({f.name for f in dataclasses.fields(self)})} and the "
                            f"TileConfig fields {list(_TILE_FIELDS)}")
        tile = {k: changes.pop(k) for k in _TILE_FIELDS if k in changes}
        base = replace(self, **changes)
        return replace(base, tiling=replace(base.tiling, **tile)) if tile else base


def _default_from_env() -> GpuConfig:
    """The process default: :class:`GpuConfig` with the environment's overrides."""
    tiling = DEFAULT_TILE_CONFIG
    text = os.environ.get("STOCHATTN_TILE_CONFIG", "").strip()
    if text:
        sb, st, th, red = (x.strip() for x in text.split(","))
        tiling = replace(tiling, stage_bytes=int(sb), stages=int(st), threads=int(th), reduce=red)
    tiling = replace(tiling, pdl=os.environ.get("STOCHATTN_PDL") == "1",
                     lineinfo=os.environ.get("STOCHATTN_LINEINFO") == "1")
    return GpuConfig(tiling=tiling)


_lock = threading.Lock()
_default: list = [None]  # the process default, created on first use
_devices: dict = {}  # device id -> its own GpuConfig


def _check_device(device):
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)
                               or device < 0):
        raise TypeError(f"`device` must be None (the default) or a GPU index, got {device!r}")


def get_config(device: int | None = None) -> GpuConfig:
    """The config of GPU ``device`` (its own, else the process default); ``device=None``:
    the process default."""
    cfg = _devices.get(device) if device is not None else None
    if cfg is not None:
        return cfg
    default = _default[0]
    if default is None:
        with _lock:
            if _default[0] is None:
                _default[0] = _default_from_env()
            default = _default[0]
    return default


def set_config(device: int | None = None, config: GpuConfig | None = None, **changes) -> GpuConfig:
    """Replace the config of GPU ``device`` (None: the process default) by ``config``, or
    by its current one with ``changes`` (fields of :class:`GpuConfig` or of
    :class:`TileConfig`); returns the previous one (for a device without its own config,
    the default it followed). Calls made from then on use it."""
    _check_device(device)
    prev = get_config(device)
    if config is None:
        config = prev.replace(**changes)
    elif changes:
        raise TypeError("pass either `config` or field changes, not both")
    elif not isinstance(config, GpuConfig):
        raise TypeError(f"`config` must be a GpuConfig, got {type(config).__name__}")
    with _lock:
        if device is None:
            _default[0] = config
        else:
            _devices[device] = config
    return prev


def reset_config(device: int | None = None) -> None:
    """Forget GPU ``device``'s own config (it follows the default again); ``None``: forget
    every device's and recreate the default from the environment on next use."""
    _check_device(device)
    with _lock:
        if device is None:
            _devices.clear()
            _default[0] = None
        else:
            _devices.pop(device, None)


@contextlib.contextmanager
def using_config(device: int | None = None, **changes):
    """``with using_config(pdl=True):`` the config of ``device`` (None: the default) with
    ``changes`` inside the block, the previous one restored after. Process-wide, not per
    thread: do not change it while other threads launch."""
    _check_device(device)
    had_own = device is not None and device in _devices
    prev = set_config(device, **changes)
    try:
        yield get_config(device)
    finally:
        if device is None or had_own:
            set_config(device, prev)
        else:
            reset_config(device)
