"""stochattn.cuda.kmeans.raw and .rawplan without a GPU: the raw key needs no Numba (and the
modules on the raw path import none), the entries' round trip and what makes the reader
reject one, the ``ast`` walk of the module constants against the imported modules, the
flattened argument layout (Numba's ``_prepare_args``, the data field that launch.Bound
rebinds), Numba's layout letter, and the packed launch of RawBound with a stand-in
``cuLaunchKernel``.

What needs a GPU (a cold process writing the entries, a warm one launching them without
Numba, bit for bit) is in tests/gpu/test_kmeans_raw.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from stochattn.cuda.kmeans import launch as kl
from stochattn.cuda.kmeans import raw
from stochattn.cuda.kmeans.rawplan import RawBound

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = "stochattn.cuda.kmeans.kernels"


class FakeArray:
    """A device array seen through ``__cuda_array_interface__`` only."""

    def __init__(self, shape, dtype, ptr, strides=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": np.dtype(dtype).str, "data": (ptr, False),
            "strides": None if strides is None else tuple(strides), "version": 3}


def _python(code, **env):
    full = dict(os.environ, PYTHONPATH=ROOT, **env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


# ---- the key and the Numba-free imports ------------------------------------------------------


_KEY = """
    import json, sys
    from stochattn.cuda.kmeans import raw, rawplan, host, build  # the raw path's modules
    import stochattn.cuda.doublep_index  # noqa: F401
    keys = {cc: raw.raw_key(cc) for cc in ("90", "80")}
    texts = raw.frozen_texts()
    rawplan.ops_for(0)  # (None without CuPy or a GPU; never imports Numba either way)
    print(json.dumps(dict(keys=keys, numba="numba" in sys.modules, n=len(texts))))
"""


def test_raw_key_and_raw_path_modules_import_no_numba():
    one = json.loads(_python(_KEY, NUMBA_ENABLE_CUDASIM="0"))
    assert not one["numba"], "the raw key or the raw path's modules imported numba"
    assert one["n"] > 20  # every frozen value of kernels.py and spec.py
    two = json.loads(_python(_KEY, NUMBA_ENABLE_CUDASIM="0"))
    assert two["keys"] == one["keys"]  # stable across processes
    assert one["keys"]["90"] != one["keys"]["80"]  # the compute capability is in the key
    other = json.loads(_python(_KEY, NUMBA_ENABLE_CUDASIM="0", NUMBA_OPT="1"))
    assert other["keys"]["90"] != one["keys"]["90"]  # code-generation settings are in it


def test_key_material_names_the_kernels_sources(monkeypatch):
    material = raw.key_material("90")
    assert set(material["sources"]) == set(raw.SOURCES)
    assert material["format"] == raw.FORMAT and material["cc"] == "90"
    assert "numba-cuda" in material["packages"]
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere/else")  # where, not what: same key
    assert raw.key_material("90") == material


def test_switches(monkeypatch):
    monkeypatch.delenv("STOCHATTN_KMEANS_CACHE", raising=False)
    monkeypatch.setenv(raw.ENV_SWITCH, "0")
    assert not raw.enabled()
    monkeypatch.setenv(raw.ENV_SWITCH, "1")
    assert raw.enabled()
    monkeypatch.setenv("STOCHATTN_KMEANS_CACHE", "0")  # the disk cache's switch turns both off
    assert not raw.enabled()


def test_no_raw_backend_under_the_simulator(monkeypatch):
    from stochattn.cuda.kmeans import rawplan

    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    if "numba" in sys.modules:
        monkeypatch.setattr(sys.modules["numba"].config, "ENABLE_CUDASIM", 1, raising=False)
    assert raw.simulator()
    assert rawplan.ops_for(0) is None


# ---- entries --------------------------------------------------------------------------------


SIG = (("array", "<f2", 4, "C"), ("array", "<i4", 2, "A"), ("scalar", "<i8"),
       ("scalar", "<u8"), ("scalar", "<f4"))


def _write(tmp_path, key="k" * 32, values=None, cubin=b"\x7fELF fake cubin"):
    values = raw.frozen_texts() if values is None else values
    return raw.write_entry(str(tmp_path), key, "mean", SIG, "_Z4meanPf", cubin, values,
                           {"cc": "90"})


def test_entry_round_trip(tmp_path):
    path = _write(tmp_path)
    assert path == os.path.join(str(tmp_path), raw.entry_name("mean", SIG) + ".json")
    assert sorted(os.listdir(tmp_path)) == sorted(
        [raw.entry_name("mean", SIG) + ".json", raw.entry_name("mean", SIG) + ".cubin",
         "key.json"])  # nothing temporary left
    got = raw.read_entry(str(tmp_path), "k" * 32, "mean", SIG)
    assert got["entry"] == "_Z4meanPf"
    with open(got["cubin"], "rb") as f:
        assert f.read() == b"\x7fELF fake cubin"
    doc = json.loads(open(path).read())
    assert doc["abi"] == [list(f) for f in raw.flat_abi(SIG)]
    assert json.loads(open(tmp_path / "key.json").read()) == {"cc": "90", "key": "k" * 32}


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(raw.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path)
    assert not any(name.endswith((".json", ".cubin")) for name in os.listdir(tmp_path))
    with pytest.raises(raw.RawMiss, match="no raw entry"):
        raw.read_entry(str(tmp_path), "k" * 32, "mean", SIG)


def test_reader_rejects_changed_values(tmp_path):
    values = raw.frozen_texts()
    _write(tmp_path, values=values)
    changed = dict(values)
    changed[f"{KERNELS}.ROW_TILE"] = "int:2"  # written under a tuned value
    with pytest.raises(raw.RawMiss, match="other module values"):
        raw.read_entry(str(tmp_path), "k" * 32, "mean", SIG, values=changed)
    # ... and the other way round: an entry written under other values, read with the source's
    _write(tmp_path, values=changed)
    with pytest.raises(raw.RawMiss, match="other module values"):
        raw.read_entry(str(tmp_path), "k" * 32, "mean", SIG)


def test_reader_rejects_another_key_format_signature_or_cubin(tmp_path):
    path = _write(tmp_path)
    # another key (a changed source hash, package, setting or device gives another key)
    with pytest.raises(raw.RawMiss, match="`key`"):
        raw.read_entry(str(tmp_path), "j" * 32, "mean", SIG)
    doc = json.loads(open(path).read())
    for field, value in (("format", raw.FORMAT + 1), ("kernel", "rank"),
                         ("abi", doc["abi"][:-1])):
        bad = dict(doc, **{field: value})
        with open(path, "w") as f:
            json.dump(bad, f)
        with pytest.raises(raw.RawMiss, match=f"`{field}`"):
            raw.read_entry(str(tmp_path), "k" * 32, "mean", SIG)
    with open(path, "w") as f:
        json.dump(dict(doc, cubin="../elsewhere.cubin"), f)
    with pytest.raises(raw.RawMiss, match="outside"):
        raw.read_entry(str(tmp_path), "k" * 32, "mean", SIG)
    with open(path, "w") as f:
        json.dump(doc, f)
    with open(os.path.join(str(tmp_path), doc["cubin"]), "wb") as f:
        f.write(b"truncated")
    with pytest.raises(raw.RawMiss, match="SHA-256"):
        raw.read_entry(str(tmp_path), "k" * 32, "mean", SIG)
    with pytest.raises(raw.RawMiss, match="no raw entry"):  # another signature: no file
        raw.read_entry(str(tmp_path), "k" * 32, "mean", SIG[:-1])


# ---- the source's values --------------------------------------------------------------------


def test_ast_values_equal_the_imported_modules():
    """Under the simulator the kernels module computes its geometry with SIM True: parsed
    with that preset, every value Numba would freeze equals the imported one, in both
    modules; the GPU values (SIM False) differ only where the source says ``if SIM``."""
    pytest.importorskip("numba.cuda")
    from stochattn import spec
    from stochattn.cuda.kmeans import kernels as kk

    sim = bool(kk.SIM)
    for module, presets in ((kk, {"SIM": sim}), (spec, None)):
        values, _ = raw._parse(module.__name__, presets)
        texts = {f"{module.__name__}.{n}": raw._diskcache._value(v) for n, v in values.items()
                 if raw._diskcache._value(v) is not None and not n.startswith("__")}
        assert texts == raw.runtime_texts({module.__name__: module})
    assert raw.runtime_matches({spec.__name__: spec})
    gpu = raw.frozen_texts()
    assert gpu[f"{KERNELS}.SIM"] == "bool:False"
    for name in ("ROW_TILE", "LANES", "TPB", "VEC", "KH_SHARED", "_WORD2_PURPOSE"):
        assert f"{KERNELS}.{name}" in gpu
    if sim:
        assert not raw.runtime_matches({kk.__name__: kk})


def test_runtime_change_is_seen(monkeypatch):
    from stochattn import spec

    assert raw.runtime_matches({spec.__name__: spec})
    monkeypatch.setattr(spec, "PHILOX_ROUNDS", 7)
    assert not raw.runtime_matches({spec.__name__: spec})
    monkeypatch.undo()
    monkeypatch.setattr(spec, "EXTRA_CONSTANT", 3, raising=False)  # a value the source lacks
    assert not raw.runtime_matches({spec.__name__: spec})


def test_ast_walk_evaluates_literals_only(tmp_path, monkeypatch):
    src = tmp_path / "fake.py"
    src.write_text(textwrap.dedent("""
        import numpy as np
        from numba import cuda
        SIM = bool(cuda.simulator)
        A = 3
        B = A << 2
        C = np.uint64(B + 1)
        D = np.float32(np.inf)
        E = (1, "x", 2.5)
        F = 2 if SIM else 5
        G = cuda.jit(A)
        H = len("abc")
        if A:
            I = 1
        J = 1
        J += 1
        K = -A // 2

        def kernel():
            return A
    """))
    monkeypatch.setattr(raw, "source_path", lambda module: str(src))
    values, unknown = raw._parse("fake", {"SIM": True})
    assert values["A"] == 3 and values["B"] == 12 and values["K"] == -2
    assert type(values["C"]) is np.uint64 and values["C"] == 13
    assert type(values["D"]) is np.float32 and np.isinf(values["D"])
    assert values["E"] == (1, "x", 2.5) and values["F"] == 2 and values["SIM"] is True
    assert {"cuda", "G", "H", "I", "J"} <= unknown
    assert "kernel" not in values and "kernel" not in unknown


# ---- the flattened arguments ----------------------------------------------------------------


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_flattened_array_layout_is_launch_bounds(ndim):
    shape = (5, 3, 7)[:ndim]
    a = FakeArray(shape, np.float32, 0x7000_0000_1000)
    sig = raw.signature_of(0, a)
    assert sig == ("array", "<f4", ndim, "C")
    abi = raw.flat_abi((sig,))
    assert len(abi) == raw.DATA_FIELD + 1 + 2 * ndim  # what launch.Bound checks
    assert raw.DATA_FIELD == kl._DATA_FIELD
    assert abi[raw.DATA_FIELD] == ("0.data", "<u8")
    values, first = raw.flatten((sig,), (a,))
    assert first == [0]
    assert [type(x) for x in values[:5]] == [np.uint64, np.uint64, np.int64, np.int64, np.uint64]
    assert int(values[2]) == int(np.prod(shape)) and int(values[3]) == 4
    assert int(values[raw.DATA_FIELD]) == 0x7000_0000_1000
    assert tuple(int(x) for x in values[5:5 + ndim]) == shape
    c_strides = tuple(int(s) for s in np.empty(shape, np.float32).strides)
    assert tuple(int(x) for x in values[5 + ndim:]) == c_strides
    assert kl.array_layout(a) == ("<f4", shape, c_strides)


def test_flattened_mixed_arguments_and_strided_arrays():
    a = FakeArray((4, 6), np.int32, 4096, strides=(48, 4))  # every other row: layout A
    b = FakeArray((3,), np.uint64, 8192)
    args = (a, np.int64(-3), b, np.float32(0.5), np.uint64(2**63 + 1), np.int32(7),
            np.float64(0.25))
    sig = tuple(raw.signature_of(i, x) for i, x in enumerate(args))
    assert sig == (("array", "<i4", 2, "A"), ("scalar", "<i8"), ("array", "<u8", 1, "C"),
                   ("scalar", "<f4"), ("scalar", "<u8"), ("scalar", "<i4"), ("scalar", "<f8"))
    values, first = raw.flatten(sig, args)
    assert first == [0, 9, 10, 17, 18, 19, 20] and len(values) == 21
    assert [int(x) for x in values[5:9]] == [4, 6, 48, 4]
    assert values[9] == np.int64(-3) and values[9].dtype == np.int64
    assert values[17].dtype == np.float32 and values[19].dtype == np.int32
    with pytest.raises(TypeError, match="kernel argument 1 must be a device array or"):
        raw.signature_of(1, 3)  # a Python int: Numba would choose its type, we do not
    with pytest.raises(ValueError, match="kernel argument 0 must be an array of <f4"):
        raw.flatten((("array", "<f4", 2, "A"),), (a,))


def _real_dummyarray():
    """numba-cuda's dummyarray module itself (under the simulator ``numba.cuda.cudadrv`` is the
    simulator's, whose dummyarray is a stub): it imports only the standard library and NumPy."""
    import importlib.util

    spec = importlib.util.find_spec("numba_cuda")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("numba-cuda is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "numba", "cuda", "cudadrv",
                        "dummyarray.py")
    if not os.path.exists(path):
        pytest.skip(f"no {path}")
    loader = importlib.util.spec_from_file_location("_numba_cuda_dummyarray", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_layout_letter_is_numbas():
    """raw.numba_layout against Numba's own: the contiguity flags of its dummyarray and the
    rule of DeviceNDArray._numba_type_ (C before F, broadcast arrays A)."""
    dummyarray = _real_dummyarray()
    rng = np.random.default_rng(0)
    cases = [((5,), (4,)), ((5,), (8,)), ((1, 5), (99, 4)), ((5, 1), (4, 77)), ((2, 3), (4, 8)),
             ((2, 3), (12, 4)), ((3, 0), (4, 4)), ((2, 3), (0, 4)), ((1,), (0,)), ((4, 1, 3),
                                                                               (12, 5, 4))]
    for _ in range(200):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(x) for x in rng.integers(0, 4, ndim))
        strides = tuple(int(x) * 4 for x in rng.integers(0, 13, ndim))
        cases.append((shape, strides))
    for shape, strides in cases:
        arr = dummyarray.Array.from_desc(0, shape, strides, 4)
        flags = arr.flags
        broadcast = 0 in strides and int(np.prod(shape)) != 0
        want = ("C" if flags["C_CONTIGUOUS"] and not broadcast else
                "F" if flags["F_CONTIGUOUS"] and not broadcast else "A")
        assert raw.numba_layout(shape, strides, 4) == want, (shape, strides)


# ---- RawBound -------------------------------------------------------------------------------


class FakeLaunch:
    def __init__(self):
        self.calls = []

    def __call__(self, fptr, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        n = self.n
        ptrs = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * n).from_address(params))
        slots = [int(np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint64 * 1).from_address(int(p)))[0]) for p in ptrs]
        self.calls.append(dict(fptr=fptr, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                               stream=stream, slots=slots, extra=extra))


def test_raw_bound_packs_sets_rebinds_and_launches():
    a = FakeArray((2, 3), np.float32, 1000)
    args = (a, np.int64(1), np.uint64(0), np.float32(1.5))
    sig = tuple(raw.signature_of(i, x) for i, x in enumerate(args))
    fake = FakeLaunch()
    fake.n = len(raw.flat_abi(sig))
    b = RawBound(0xABC, (4, 2), 64, 77, sig, args, mutable=(1, 2), rebind=(0,), launch=fake)
    assert b.prepared
    b()
    call = fake.calls[-1]
    assert call["fptr"] == 0xABC and call["grid"] == (4, 2, 1) and call["block"] == (64, 1, 1)
    assert call["stream"] == 77 and call["smem"] == 0 and call["extra"] == 0
    assert call["slots"][:9] == [0, 0, 6, 4, 1000, 2, 3, 12, 4]
    assert call["slots"][9:11] == [1, 0]
    assert call["slots"][11] == int(np.float32(1.5).view(np.uint32))
    b(5)  # a call's value replaces every mutable scalar
    assert fake.calls[-1]["slots"][9:11] == [5, 5]
    b.set(2, 2**64 - 1)
    b.rebind(0, ptr=5000)
    b()
    assert fake.calls[-1]["slots"][4] == 5000 and fake.calls[-1]["slots"][9:11] == [5, 2**64 - 1]
    b.rebind(0, FakeArray((2, 3), np.float32, 6000))
    b()
    assert fake.calls[-1]["slots"][4] == 6000
    with pytest.raises(ValueError, match=r"`array` must have \(dtype, shape, strides\)"):
        b.rebind(0, FakeArray((3, 2), np.float32, 7000))
    with pytest.raises(ValueError, match="`i` must be a rebind position"):
        b.rebind(1, ptr=1)
    with pytest.raises(ValueError, match="`i` must be a mutable position"):
        b.set(3, 1)
    with pytest.raises(ValueError, match="`mutable` position 0 must be an integer scalar"):
        RawBound(1, 1, 1, 0, sig, args, mutable=(0,), launch=fake)
    with pytest.raises(ValueError, match="`rebind` position 1 must be an array"):
        RawBound(1, 1, 1, 0, sig, args, rebind=(1,), launch=fake)


# ---- the export's gates ---------------------------------------------------------------------


def test_flattened_comparison_against_numbas_list():
    """The export writes an entry only when this module's flattened arguments equal the list
    Numba's _prepare_args made (Python ints for the array fields, ctypes scalars)."""
    import ctypes

    a = FakeArray((2, 3), np.float32, 4096)
    args = (a, np.int64(-3), np.float32(0.5), np.uint64(2**64 - 1))
    sig = tuple(raw.signature_of(i, x) for i, x in enumerate(args))
    ours, _ = raw.flatten(sig, args)
    numba_list = [0, 0, 6, 4, 4096, 2, 3, 12, 4, ctypes.c_int64(-3), ctypes.c_float(0.5),
                  ctypes.c_uint64(2**64 - 1)]
    assert raw._same_flat(ours, numba_list)
    for i, other in ((4, 8192), (7, 16), (9, ctypes.c_int64(3)), (10, ctypes.c_float(0.25))):
        changed = list(numba_list)
        changed[i] = other
        assert not raw._same_flat(ours, changed), i
    assert not raw._same_flat(ours, numba_list[:-1])


def test_export_writes_nothing_under_the_simulator(tmp_path, monkeypatch):
    pytest.importorskip("numba.cuda")
    from stochattn.cuda.kmeans import kernels as kk

    if not kk.SIM:
        pytest.skip("the simulator is off in this process")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert raw.export(kk, [(kk.mean, ())], None) == 0
    assert not (tmp_path / "stochattn-kmeans" / "raw").exists()
    assert raw.export_report()["reason"] == "the CUDA simulator"


def test_export_report_says_why_nothing_was_written(monkeypatch):
    """Every early exit of the export leaves its reason (a GPU run that writes no entry
    prints it), and a new export clears the last reason."""
    raw._reset_for_tests()
    sim = type("Kernels", (), {"SIM": True})
    assert raw.export(sim, [], None) == 0
    assert raw.export_report() == {"exports": 1, "reason": "the CUDA simulator", "kernels": {}}
    monkeypatch.setenv("STOCHATTN_KMEANS_RAW", "0")
    assert raw.export(type("Kernels", (), {"SIM": False}), [], None) == 0
    report = raw.export_report()
    assert report["exports"] == 2 and "STOCHATTN_KMEANS_RAW=0" in report["reason"]
    monkeypatch.delenv("STOCHATTN_KMEANS_RAW")
    monkeypatch.setitem(raw._diskcache._state, "off", "a test")
    assert raw.export(type("Kernels", (), {"SIM": False}), [], None) == 0
    assert "disk cache" in raw.export_report()["reason"]
    report["kernels"]["x"] = "changed"  # a copy: the module's report is not changed
    assert raw.export_report()["kernels"] == {}
    raw._reset_for_tests()
    assert raw.export_report() == {"exports": 0, "reason": None, "kernels": {}}
