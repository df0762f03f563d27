"""stochattn.cuda._module.Packed without a GPU: the argument buffer (8-byte slots, each
value's bits in the low bytes) and the fallback call through the Launcher."""

from __future__ import annotations

import numpy as np
import pytest

from stochattn.cuda._module import Packed


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
    from stochattn.cuda import _module

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
