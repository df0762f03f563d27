"""Numba kernel launches with their arguments prepared once (the k-means prefill launches
the same kernels with the same arrays every round).

A plain launch (``kernel[grid, block, stream](*args)``) resolves the overload from the
arguments' types and flattens every array into its ABI fields (meminfo, parent, size,
itemsize, pointer, shape, strides) through the driver's context lookups: 70-100 us of host
time per launch of a kernel with a dozen array arguments (numba-cuda 0.30 on the H200
machine, bench/timeline_kmeans.py), more than many of those kernels run. :class:`Bound`
does that work once and then hands the prepared argument list straight to the launch
call numba itself makes (``cuda.core.launch``); scalar arguments named ``mutable`` (the
round number) are ctypes values that a call overwrites in place. Anything this Numba does
not offer the way this module expects (another launch API, the simulator, arguments that
need a copy back) makes :class:`Bound` fall back to the plain launch, with the same
result.
"""

from __future__ import annotations

__all__ = ["Bound"]


class Bound:
    """``kernel[grid, block, stream](*args)``, prepared once, launched by :meth:`__call__`.

    ``mutable``: positions in ``args`` of integer scalars that a call may replace:
    ``bound(value)`` sets each of them to ``value`` before launching, ``bound()`` launches
    with the last values.
    """

    __slots__ = ("_plain", "_launch", "_stream", "_config", "_kernel", "_args", "_mut",
                 "_values")

    def __init__(self, kernel, grid, block, stream, args, mutable=()):
        args = list(args)
        self._values = args
        self._mut = tuple(mutable)
        self._plain = (kernel, grid, block, stream)
        self._launch = None
        try:
            self._prepare(kernel, grid, block, stream, args)
        except Exception:  # noqa: BLE001 - any API difference: plain launches
            self._launch = None

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
        flat, retr, where = [], [], {}
        for i, (ty, val) in enumerate(zip(compiled.argument_types, args)):
            start = len(flat)
            compiled._prepare_args(ty, val, stream, retr, flat)
            if i in self._mut:
                if len(flat) != start + 1 or not hasattr(flat[start], "value"):
                    return  # not a single ctypes scalar: keep plain launches
                where[i] = start
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
        self._mut = tuple(where[i] for i in self._mut)
        self._launch = launch

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
                self._args[i].value = value
        self._launch(self._stream, self._config, self._kernel, *self._args)
