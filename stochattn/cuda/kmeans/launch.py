"""Numba kernel launches with their arguments prepared once (the k-means prefill launches
the same kernels with the same arrays every round, and, through its plan cache, every
build of one configuration).

A plain launch (``kernel[grid, block, stream](*args)``) resolves the overload from the
arguments' types and flattens every array into its ABI fields (meminfo, parent, size,
itemsize, pointer, shape, strides) through the driver's context lookups: 70-100 us of host
time per launch of a kernel with a dozen array arguments (numba-cuda 0.30 on the H200
machine, tools/timeline_kmeans.py), more than many of those kernels run. :class:`Bound`
does that work once and then hands the prepared argument list straight to the launch
call numba itself makes (``cuda.core.launch``); scalar arguments named ``mutable`` (the
round number, a seed) are ctypes values that a call overwrites in place, and array
arguments named ``rebind`` have only their data pointer replaced (the other fields are
those of an array of the same dtype, shape and strides). Anything this Numba does not
offer the way this module expects (another launch API, another array ABI, the simulator,
arguments that need a copy back) makes :class:`Bound` fall back to the plain launch, with
the same result.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Bound", "array_layout"]

# Numba's flattened array argument (CUDAKernel._prepare_args): meminfo, parent, nitems,
# itemsize, data pointer, shape[ndim], strides[ndim].
_DATA_FIELD = 4


def array_layout(a):
    """``(dtype str, shape, strides in bytes)`` of a device array (Numba's, the simulator's,
    or anything with ``__cuda_array_interface__``)."""
    strides = getattr(a, "strides", None)
    if isinstance(strides, tuple):  # Numba device arrays (also simulated), CuPy
        return np.dtype(a.dtype).str, tuple(int(s) for s in a.shape), tuple(int(s) for s in strides)
    cai = a.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(int(s) for s in cai["shape"])
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides, step = [], dtype.itemsize
        for s in reversed(shape):
            strides.append(step)
            step *= s
        strides = strides[::-1]
    return dtype.str, shape, tuple(int(s) for s in strides)


def _pointer(a) -> int:
    ptr = getattr(a, "device_ctypes_pointer", None)  # Numba device arrays
    if ptr is not None:
        return int(ptr.value or 0)
    return int(a.__cuda_array_interface__["data"][0])


class Bound:
    """``kernel[grid, block, stream](*args)``, prepared once, launched by :meth:`__call__`.

    ``mutable``: positions in ``args`` of integer scalars that a call may replace:
    ``bound(value)`` sets each of them to ``value`` before launching, ``bound()`` launches
    with the last values, :meth:`set` replaces one of them.

    ``rebind``: positions in ``args`` of device arrays that :meth:`rebind` may replace by
    another array of the same dtype, shape and strides (a prepared launch then swaps only
    the data pointer).
    """

    __slots__ = ("_plain", "_launch", "_stream", "_config", "_kernel", "_args", "_mut",
                 "_values", "_at", "_layouts")

    def __init__(self, kernel, grid, block, stream, args, mutable=(), rebind=()):
        args = list(args)
        self._values = args
        self._mut = tuple(mutable)
        self._layouts = {i: array_layout(args[i]) for i in rebind}
        self._at = {}  # argument position -> index of its field in the prepared list
        self._plain = (kernel, grid, block, stream)
        self._launch = None
        try:
            self._prepare(kernel, grid, block, stream, args)
        except Exception:  # noqa: BLE001 - any API difference: plain launches
            self._launch = None
        if self._launch is not None:
            # The prepared list holds plain integers and ctypes scalars only: drop the
            # arrays, which a cache of Bound objects would otherwise keep alive.
            self._values = None

    def _prepare(self, kernel, grid, block, stream, args):
        from numba import config

        if config.ENABLE_CUDASIM:
            return
        from cuda.core import LaunchConfig, launch

        from numba.cuda._compat import CUDA_CORE_GE_1_0
        from numba.cuda.cudadrv import driver

        stream = driver._to_core_stream(stream)  # what a plain launch configuration holds
        argtypes = tuple(kernel.typeof_pyval(a) for a in args)
        compiled = kernel.compile(argtypes)
        if compiled.cooperative or compiled.debug or compiled.extensions:
            return
        flat, retr, at = [], [], {}
        for i, (ty, val) in enumerate(zip(compiled.argument_types, args)):
            start = len(flat)
            compiled._prepare_args(ty, val, stream, retr, flat)
            if i in self._mut:
                if len(flat) != start + 1 or not hasattr(flat[start], "value"):
                    return  # not a single ctypes scalar: keep plain launches
                at[i] = start
            elif i in self._layouts:
                ndim = len(self._layouts[i][1])
                if (len(flat) != start + _DATA_FIELD + 1 + 2 * ndim
                        or flat[start + _DATA_FIELD] != _pointer(val)):
                    return  # not the array ABI this module knows: keep plain launches
                at[i] = start + _DATA_FIELD
        if retr:  # arguments that need a copy back after the launch
            return
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        if CUDA_CORE_GE_1_0:
            cfg = LaunchConfig(grid=grid, block=block, shmem_size=0, is_cooperative=False)
        else:
            cfg = LaunchConfig(grid=grid, block=block, shmem_size=0, cooperative_launch=False)
        self._config = cfg
        self._kernel = compiled._codelibrary.get_cufunc().kernel
        self._args = flat
        self._stream = stream
        self._at = at
        self._launch = launch

    @property
    def prepared(self) -> bool:
        """Whether calls skip Numba's argument handling (False: plain launches)."""
        return self._launch is not None

    def set(self, i: int, value) -> None:
        """Replace the mutable scalar at position ``i`` of ``args`` for the next launches."""
        if i not in self._mut:
            raise ValueError(f"`i` must be a mutable position {self._mut}, got {i}")
        if self._launch is None:
            self._values[i] = type(self._values[i])(value)
        else:
            self._args[self._at[i]].value = value

    def rebind(self, i: int, array=None, ptr=None) -> None:
        """Replace the array at position ``i`` of ``args`` (one of ``rebind``).

        ``array``: a device array of the prepared dtype, shape and strides (checked);
        ``ptr``: its data pointer, trusted without a check (a prepared launch then needs
        nothing else; a plain launch needs ``array``).
        """
        layout = self._layouts.get(i)
        if layout is None:
            raise ValueError(f"`i` must be a rebind position {tuple(self._layouts)}, got {i}")
        if self._launch is not None and ptr is not None:
            self._args[self._at[i]] = int(ptr)
            return
        if array is None:
            raise ValueError("`array` is required for a plain (unprepared) launch, got only "
                             "`ptr`")
        got = array_layout(array)
        if got != layout:
            raise ValueError(f"`array` must have (dtype, shape, strides) {layout} (argument "
                             f"{i}), got {got}")
        if self._launch is None:
            self._values[i] = array
        else:
            self._args[self._at[i]] = _pointer(array)

    def release(self) -> None:
        """Drop the references a plain launch holds to the rebound arrays (rebind them
        again before the next call); a prepared launch holds none."""
        if self._launch is None:
            for i in self._layouts:
                self._values[i] = None

    def __call__(self, value=None):
        """Launch; ``value`` (when given) replaces every mutable scalar first."""
        if self._launch is None:
            kernel, grid, block, stream = self._plain
            if value is not None:
                for i in self._mut:
                    self._values[i] = type(self._values[i])(value)
            kernel[grid, block, stream](*self._values)
            return
        if value is not None:
            for i in self._mut:
                self._args[self._at[i]].value = value
        self._launch(self._stream, self._config, self._kernel, *self._args)
