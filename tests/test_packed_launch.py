"""stochattn.cuda.runtime.launch.Packed without a GPU: the argument buffer (8-byte slots, each
value's bits in the low bytes), the fallback call through the Launcher, and the
programmatic-dependent-launch path (stochattn.cuda.runtime.pdl: the driver structures' layout and
what cuLaunchKernelEx is handed)."""

from __future__ import annotations

import numpy as np
import pytest

from stochattn.cuda.runtime.launch import Packed


class _FakeLauncher:
    """A Launcher without a driver function: Packed falls back to calling it."""

    fn = None
    smem = 0

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, stream=None):
        self.calls.append((grid, block, args, stream))


def test_slots_hold_each_value_in_its_low_bytes():
    args = (np.uint64(2**63 + 5), np.int32(-2), np.float32(1.5), np.int64(-3), np.uint32(7),
            np.float64(0.25))
    p = Packed(_FakeLauncher(), (3,), (128,), args)
    raw = p.vals
    assert raw[0] == 2**63 + 5
    assert raw[1] == np.uint32(np.int32(-2).view(np.uint32))  # two's complement, upper bytes 0
    assert np.array([raw[2]], dtype=np.uint64).view(np.float32)[0] == np.float32(1.5)
    assert np.array([raw[3]], dtype=np.uint64).view(np.int64)[0] == -3
    assert raw[4] == 7
    assert np.array([raw[5]], dtype=np.uint64).view(np.float64)[0] == 0.25
    # the parameter array points at consecutive 8-byte slots of the buffer
    ptrs = np.frombuffer(np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint64 * len(args)).from_address(p.params)), dtype=np.uint64)
    assert list(ptrs) == [p.vals.ctypes.data + 8 * i for i in range(len(args))]
    assert p.grid == (3, 1, 1) and p.block == (128, 1, 1)


def test_fallback_call_gets_typed_args_with_the_variable_ones_replaced():
    fake = _FakeLauncher()
    args = (np.uint64(0), np.uint64(0), np.int32(4), np.uint64(0), np.float32(0.5))
    p = Packed(fake, (2, 3), (64,), args, variable=(0, 1, 3))
    p("stream", np.uint64(11), 22, np.uint64(33))
    (grid, block, got, stream), = fake.calls
    assert grid == (2, 3, 1) and block == (64, 1, 1) and stream == "stream"
    assert [int(a) for a in got[:4]] == [11, 22, 4, 33] and got[4] == np.float32(0.5)
    assert got[2].dtype == np.int32 and got[4].dtype == np.float32


def test_rejects_untyped_and_non_integer_variable_arguments():
    with pytest.raises(TypeError, match="argument 1 must be a 4- or 8-byte NumPy scalar"):
        Packed(_FakeLauncher(), (1,), (1,), (np.uint64(0), 3))
    with pytest.raises(TypeError, match="argument 0 must be a 4- or 8-byte NumPy scalar"):
        Packed(_FakeLauncher(), (1,), (1,), (np.int16(1),))


def test_float_variable_arguments_are_written_as_their_type():
    fake = _FakeLauncher()
    p = Packed(fake, (1,), (1,), (np.uint64(0), np.float64(0.0), np.float32(0.0)),
               variable=(1, 2))
    p(None, 0.95, 0.7)
    got = fake.calls[0][2]
    assert got[1] == np.float64(0.95) and got[1].dtype == np.float64
    assert got[2] == np.float32(0.7) and got[2].dtype == np.float32


def test_driver_path_writes_the_slots_and_launches_once(monkeypatch):
    """The cuLaunchKernel path with a stand-in driver entry: the variable slots hold the new
    values (floats as their bits), the rest keep theirs."""
    from stochattn.cuda.runtime import launch as _module

    seen = []

    def fake_launch(fptr, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        seen.append((fptr, (gx, gy, gz), (bx, by, bz), smem, stream, params, extra))

    class _Stream:
        ptr = 1234

    monkeypatch.setattr(_module, "_launch", [fake_launch, True])
    p = Packed(_FakeLauncher(), (4, 2), (256,),
               (np.uint64(0), np.int32(5), np.float64(0.0), np.uint32(0)), variable=(0, 2, 3))
    p.fptr = 99
    p(_Stream(), 2**40 + 3, 0.25, np.uint32(9))
    assert seen == [(99, (4, 2, 1), (256, 1, 1), 0, 1234, p.params, 0)]
    assert p.vals[0] == 2**40 + 3 and p.vals[1] == 5 and p.vals[3] == 9
    assert np.array([p.vals[2]], dtype=np.uint64).view(np.float64)[0] == 0.25


# ---- programmatic dependent launch (stochattn.cuda.runtime.pdl) ----

def test_pdl_structures_have_the_layout_of_cuda_h():
    """Offsets and sizes of CUlaunchAttribute and CUlaunchConfig (cuda.h, CUDA 12 and 13):
    a mismatch would hand the driver garbage."""
    import ctypes

    from stochattn.cuda.runtime import pdl as _pdl

    A, C = _pdl.LaunchAttribute, _pdl.LaunchConfig
    assert (ctypes.sizeof(A), A.value.offset, ctypes.alignment(A)) == (72, 8, 8)
    assert ctypes.sizeof(C) == 56
    assert [getattr(C, f).offset for f in ("gridDimX", "blockDimX", "sharedMemBytes", "hStream",
                                           "attrs", "numAttrs")] == [0, 12, 24, 32, 40, 48]
    assert _pdl.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION == 6


def _cuda_h():
    import glob
    import os

    for base in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + sorted(
            glob.glob("/usr/local/cuda-*")):
        if base and os.path.isfile(os.path.join(base, "include", "cuda.h")):
            return os.path.join(base, "include")
    return None


@pytest.mark.skipif(_cuda_h() is None, reason="no CUDA toolkit headers (cuda.h)")
def test_pdl_structures_match_the_installed_cuda_h(tmp_path):
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "layout.c"
    src.write_text("""#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchAttribute),
         offsetof(CUlaunchAttribute, value), sizeof(CUlaunchConfig),
         offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
         offsetof(CUlaunchConfig, numAttrs), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}
""")
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{_cuda_h()}", str(src), "-o", str(exe)], check=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert [int(x) for x in got] == [72, 8, 56, 32, 40, 48, 6]


class _FakeFunction:
    ptr = 777


class _Raw:
    def __init__(self, binary_version):
        self.attributes = {"binary_version": binary_version}


class _DriverLauncher(_FakeLauncher):
    fn = _FakeFunction()
    smem = 4096

    def __init__(self, binary_version=90):
        super().__init__()
        self.raw = _Raw(binary_version)


def test_pdl_launch_sets_the_attribute_and_the_stream(monkeypatch):
    """pdl=True with a driver entry point: cuLaunchKernelEx gets the packed arguments, the
    grid, block, shared memory and stream, and one attribute, programmatic stream
    serialization = 1; the ordinary cuLaunchKernel is not called."""
    import ctypes

    from stochattn.cuda.runtime import launch as _module, pdl as _pdl

    plain, ex = [], []

    def fake_launch(*args):
        plain.append(args)

    def fake_ex(cfg_ref, fptr, params, extra):
        c = cfg_ref._obj
        a = c.attrs[0]
        ex.append(((c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ),
                   c.sharedMemBytes, c.hStream, c.numAttrs, a.id, a.value[0] & 0xFFFFFFFF,
                   fptr.value, params.value, extra))
        return 0

    class _Stream:
        ptr = 4321

    monkeypatch.setattr(_module, "_launch", [fake_launch, True])
    monkeypatch.setattr(_pdl, "_entry", [fake_ex, True])
    p = Packed(_DriverLauncher(), (5, 8, 2), (256,), (np.uint64(0), np.int32(3)), variable=(0,),
               pdl=True)
    p(_Stream(), 2**33 + 1)
    assert plain == []
    assert ex == [((5, 8, 2), (256, 1, 1), 4096, 4321, 1, 6, 1, 777, p.params, None)]
    assert p.vals[0] == 2**33 + 1 and p.vals[1] == 3
    # without pdl the same launcher goes through cuLaunchKernel
    q = Packed(_DriverLauncher(), (1,), (32,), (np.uint64(0),), variable=(0,))
    q(_Stream(), 5)
    assert len(plain) == 1 and len(ex) == 1
    assert ctypes.sizeof(p._pdl.config) == 56


def test_pdl_without_the_driver_entry_point_launches_normally(monkeypatch):
    """An old driver (no cuLaunchKernelEx): the launch is an ordinary one, which is correct
    since the kernels' entry wait is then a no-op."""
    from stochattn.cuda.runtime import launch as _module, pdl as _pdl

    plain = []
    monkeypatch.setattr(_module, "_launch", [lambda *a: plain.append(a), True])
    monkeypatch.setattr(_pdl, "_entry", [None, True])

    class _Stream:
        ptr = 1

    p = Packed(_DriverLauncher(), (2,), (64,), (np.uint64(0),), variable=(0,), pdl=True)
    assert p._pdl is None
    p(_Stream(), 9)
    assert len(plain) == 1 and plain[0][8] == 1


def test_pdl_only_for_sm90_machine_code(monkeypatch):
    """Machine code built below sm_90 has its entry wait compiled out: its launches must
    stay ordinary ones (a dependent launch would race with the kernel before it)."""
    from stochattn.cuda.runtime import launch as _module, pdl as _pdl

    monkeypatch.setattr(_module, "_launch", [lambda *a: None, True])
    monkeypatch.setattr(_pdl, "_entry", [lambda *a: 0, True])
    args = ((4,), (32,), (np.uint64(0),), (0,))
    assert Packed(_DriverLauncher(80), *args, pdl=True)._pdl is None
    assert Packed(_DriverLauncher(90), *args, pdl=True)._pdl is not None
    assert Packed(_DriverLauncher(100), *args, pdl=True)._pdl is not None
    assert Packed(_DriverLauncher(90), *args)._pdl is None  # not asked for


def test_pdl_launch_error_names_the_driver_error(monkeypatch):
    from stochattn.cuda.runtime import launch as _module, pdl as _pdl

    monkeypatch.setattr(_module, "_launch", [lambda *a: None, True])
    monkeypatch.setattr(_pdl, "_entry", [lambda *a: 1, True])  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(_pdl, "_errors", [None])

    class _Stream:
        ptr = 5

    p = Packed(_DriverLauncher(), (1,), (32,), (np.uint64(0),), variable=(0,), pdl=True)
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx .* failed: CUresult 1"):
        p(_Stream(), 3)


class _FakeRaw:
    """A RawKernel's shared-memory attributes (the driver keeps one per function)."""

    shared_size_bytes = 1024
    kernel = None

    def __init__(self):
        self.max_dynamic_shared_size_bytes = 48 * 1024 - 1024


def test_launchers_of_one_kernel_only_ever_raise_its_shared_memory_limit():
    from stochattn.cuda.runtime.launch import Launcher

    raw = _FakeRaw()
    Launcher(raw, 100_000)
    assert raw.max_dynamic_shared_size_bytes == 100_000
    # A later plan of the same kernel that needs less must not lower the limit under the
    # first plan's launches (CUDA_ERROR_INVALID_VALUE on its next call).
    Launcher(raw, 60_000)
    assert raw.max_dynamic_shared_size_bytes == 100_000
    Launcher(raw, 8_000)  # under the default: the attribute is not touched
    assert raw.max_dynamic_shared_size_bytes == 100_000
    Launcher(raw, 150_000)
    assert raw.max_dynamic_shared_size_bytes == 150_000
