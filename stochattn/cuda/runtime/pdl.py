"""Kernel launches with programmatic stream serialization (``cuLaunchKernelEx``, sm_90):
the launched grid may be scheduled before the grid before it in the stream has finished,
and waits for it inside the kernel (``STOCHATTN_PDL_ENTRY`` in ``decode_common.cuh``).

CuPy exposes only ``cuLaunchKernel``, so the call goes to the driver library through
ctypes. The structures mirror ``cuda.h`` (CUDA 12 and 13):

- ``CUlaunchAttribute``: ``CUlaunchAttributeID id`` (4 bytes), 4 bytes of padding, then
  the 64-byte ``CUlaunchAttributeValue`` union (8-byte aligned) at offset 8; 72 bytes.
- ``CUlaunchConfig``: grid x, y, z, block x, y, z and dynamic shared memory (seven
  unsigned ints), ``CUstream hStream`` at offset 32, ``CUlaunchAttribute* attrs`` at 40,
  ``unsigned numAttrs`` at 48; 56 bytes.

``tests/test_packed_launch.py`` pins these offsets (and checks them against ``cuda.h``
where a CUDA toolkit is installed).
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["LaunchAttribute", "LaunchConfig", "ATTR_PROGRAMMATIC_STREAM_SERIALIZATION",
           "launch_ex", "PdlLaunch"]

# cuda.h: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int64 * 8)]  # the 64-byte union, 8-byte aligned


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


# Programmatic edges in CUDA graphs (stream capture of such launches) came with CUDA 12.3.
MIN_DRIVER_VERSION = 12030

_lib_lock = threading.Lock()
_entry = [None, False]  # [the ctypes function or None, looked up]
_errors = [None]  # cuGetErrorName, once the library is loaded


def launch_ex():
    """``cuLaunchKernelEx`` of the driver library, or None where it cannot be used: no
    libcuda, or a driver older than :data:`MIN_DRIVER_VERSION` (no PDL edges under graph
    capture). Launches then stay ordinary ones, which is correct: a kernel's entry wait is
    a no-op when it was not launched as a dependent."""
    if not _entry[1]:
        with _lib_lock:
            if not _entry[1]:
                fn = None
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                    version = ctypes.c_int(0)
                    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 \
                            and version.value >= MIN_DRIVER_VERSION:
                        fn = lib.cuLaunchKernelEx
                        fn.argtypes = (ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p)
                        fn.restype = ctypes.c_int
                        _errors[0] = lib.cuGetErrorName
                except (OSError, AttributeError):
                    fn = None
                _entry[0], _entry[1] = fn, True
    return _entry[0]


def _error_name(err: int) -> str:
    name = ctypes.c_char_p()
    if _errors[0] is not None and _errors[0](err, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {err}"


class PdlLaunch:
    """One launch configuration with the programmatic-serialization attribute set: the
    configuration structure is built once, and each call sets the stream and launches.
    The caller serialises calls (``launch.Packed`` holds its lock around them)."""

    __slots__ = ("fn", "config", "attr", "fptr", "params")

    def __init__(self, fn, fptr: int, grid, block, smem: int, params: int):
        self.fn, self.fptr, self.params = fn, ctypes.c_void_p(fptr), ctypes.c_void_p(params)
        self.attr = LaunchAttribute()
        self.attr.id = ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self.attr.value[0] = 1  # programmaticStreamSerializationAllowed (an int at offset 0)
        c = self.config = LaunchConfig()
        c.gridDimX, c.gridDimY, c.gridDimZ = (int(x) for x in grid)
        c.blockDimX, c.blockDimY, c.blockDimZ = (int(x) for x in block)
        c.sharedMemBytes = int(smem)
        c.attrs = ctypes.pointer(self.attr)
        c.numAttrs = 1

    def __call__(self, stream_ptr: int):
        self.config.hStream = stream_ptr or None
        err = self.fn(ctypes.byref(self.config), self.fptr, self.params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch) failed: "
                               f"{_error_name(err)}")
