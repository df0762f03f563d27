"""The CUDA sources compile for sm_90 with every template instantiation the wrappers use,
and the host-compilable part (Philox stream, sample points, tile counts) matches the NumPy
reference bit for bit. No GPU needed: nvcc when on PATH, else NVRTC from the
``nvidia-cuda-nvrtc`` wheel; the host check needs a C++ compiler.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stochattn.cuda import build_check, config, kernels
from stochattn.cuda.kernels import abi
from stochattn.reference.rng import random_words, uniforms
from stochattn.reference.samplers import invert_cdf, sample_points

_BACKENDS = [name for name, path in build_check.available_backends().items() if path]
_NO_COMPILER = "neither nvcc on PATH nor libnvrtc (pip install nvidia-cuda-nvrtc) is available"


def _backend_params():
    if not _BACKENDS:
        return [pytest.param(None, marks=pytest.mark.skip(reason=_NO_COMPILER))]
    return _BACKENDS


def _runtime_backend_params():
    """NVRTC, the compiler the runtime uses (through CuPy), else nvcc: every family once.
    ``STOCHATTN_COMPILE_ALL_BACKENDS=1`` compiles them with both (twice the time: the
    families' full compiles were half of CI's 16 minutes on two cores, 2026-12-07; the
    other-tiling and PDL checks below still go through nvcc where it is on PATH)."""
    if not _BACKENDS or os.environ.get("STOCHATTN_COMPILE_ALL_BACKENDS", "") not in ("", "0"):
        return _backend_params()
    return ["nvrtc" if "nvrtc" in _BACKENDS else _BACKENDS[0]]


@pytest.mark.parametrize("backend", _runtime_backend_params())
@pytest.mark.parametrize("family", sorted(kernels.FAMILIES))
def test_family_compiles_for_sm90(family, backend):
    names = kernels.name_expressions(family)
    assert len(names) == len(set(names)) >= 3
    result = build_check.compile_check(kernels.source_text(family), names, backend=backend)
    assert result.ok, f"{family} failed to compile with {backend}:\n{result.log}"


# A non-default configuration: bigger stages, more threads, the reduce-scatter reduction
# (the kernels' static_asserts check that it tiles both head dims), and programmatic
# dependent launch (every kernel's STOCHATTN_PDL_ENTRY compiled in).
_OTHER_CONFIG = config.TileConfig(stage_bytes=16384, stages=3, threads=256, reduce="scatter",
                                  pdl=True)


@pytest.mark.parametrize("backend", _BACKENDS[:1] or _backend_params())
@pytest.mark.parametrize("family", sorted(kernels.FAMILIES))
def test_family_compiles_with_other_tiling(family, backend):
    names = kernels.name_expressions(family)
    result = build_check.compile_check(kernels.source_text(family), names, backend=backend,
                                       config=_OTHER_CONFIG)
    assert result.ok, f"{family} with {_OTHER_CONFIG} failed with {backend}:\n{result.log}"


@pytest.mark.parametrize("backend", _BACKENDS[:1] or _backend_params())
def test_untileable_macros_fail(backend):
    """The static_asserts bite: 3 rows per thread is not a power of two (6 KB stages at
    D = 128 with 128 threads), so the macros alone, bypassing TileConfig, fail to compile."""
    code = "#define STOCHATTN_STAGE_BYTES 6144\n" + kernels.source_text("exact_decode")
    result = build_check.compile_check(code, ["exact_decode_chunk<stochattn::f16, 128, 4>"],
                                       backend=backend)
    assert not result.ok


def test_tile_config_options_and_validation():
    cfg = _OTHER_CONFIG
    assert cfg.options() == ("-std=c++17", "-DSTOCHATTN_STAGE_BYTES=16384", "-DSTOCHATTN_STAGES=3",
                             "-DSTOCHATTN_THREADS=256", "-DSTOCHATTN_REDUCE=1",
                             "-DSTOCHATTN_PDL=1")
    assert "-DSTOCHATTN_PDL=1" not in config.TileConfig().options()
    with pytest.raises(TypeError, match="`pdl` must be a bool"):
        config.TileConfig(pdl=1)
    assert (cfg.tile_rows(128), cfg.rows_per_thread(128), cfg.tile_rows(64), cfg.rows_per_thread(64)) \
        == (64, 4, 128, 4)
    assert cfg.smem_bytes("exact_decode", 128, 4) == 3 * 2 * 16384
    assert cfg.smem_bytes("santa_prop", 128, 4) == 3 * 16384
    # the merge buffers dominate small pipelines: (2 + D) floats per warp and head
    assert config.TileConfig(4096, 2, 256).smem_bytes("exact_decode", 128, 8) == 130 * 8 * 8 * 4
    # santa_flash: per warp, FLASH_WARP_STAGES stages of stage_bytes / warps, then logits,
    # counts ([GMAX][tile] each, 4 bytes) and the row list ([tile], 4 bytes)
    warps = 256 // 32
    per_warp = abi.constant("santa_flash", "kFlashStages") * 16384 // warps + 64 * (8 * 4 + 4)
    assert cfg.smem_bytes("santa_flash", 128, 4, 64) == warps * per_warp
    with pytest.raises(ValueError, match="tile_size"):
        cfg.smem_bytes("santa_flash", 128, 4)
    with pytest.raises(ValueError, match="warps"):
        config.TileConfig(stage_bytes=32768, threads=128)  # 8 KB warp stages: 64 rows at D 64
    with pytest.raises(ValueError, match="reduce"):
        config.TileConfig(reduce="tree")
    with pytest.raises(ValueError, match="does not tile"):
        config.TileConfig(stage_bytes=6144)
    with pytest.raises(ValueError, match="does not tile"):
        config.TileConfig(stage_bytes=2048, threads=256)  # half a row per thread at D = 128


def test_tc_tiling_sizes_and_validation():
    """exact_decode_tc.cu's tilings: per-warp K+V rings (reused by the 8-head merge), one
    tile per warp as the chunk alignment, and every compiled tiling instantiated."""
    t = config.TcTiling(warps=8, rows=16, stages=3)
    assert (t.threads, t.align(), t.smem_bytes(128), t.smem_bytes(64)) == (256, 128, 196608, 98304)
    # the merge buffers dominate tiny rings: (2 + D) floats per warp and head, 8 heads
    assert config.TcTiling(2, 16, 2).smem_bytes(128) == max(2 * 2 * 2 * 16 * 256, 130 * 2 * 8 * 4)
    names = kernels.name_expressions("exact_decode_tc")
    for tl in config.TC_TILINGS:
        assert f"exact_decode_tc_chunk<stochattn::bf16, 64, {tl.template_args()}>" in names
    assert "exact_decode_merge<stochattn::f16>" in names
    with pytest.raises(ValueError, match="shared memory"):
        config.TcTiling(warps=8, rows=32, stages=3)
    with pytest.raises(ValueError, match="unsupported"):
        config.TcTiling(rows=24)
    with pytest.raises(ValueError, match="compiled"):
        config.set_config(tc_tiling=config.TcTiling(2, 16, 2))
    prev = config.set_config(tc_tiling=config.TC_TILINGS[-1])
    try:
        assert config.get_config().tc_tiling == config.TC_TILINGS[-1]
    finally:
        config.set_config(config=prev)


def test_header_defaults_match_tile_config_defaults():
    """decode_common.cuh's fallback macros equal TileConfig's field defaults (today's tiling),
    so a compile without options and the Python side agree."""
    import re

    text = (kernels.SOURCE_DIR / "decode_common.cuh").read_text()
    got = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define STOCHATTN_(\w+) (\d+)", text)}
    d = config.TileConfig()
    assert got == {"THREADS": d.threads, "STAGE_BYTES": d.stage_bytes, "STAGES": d.stages,
                   "REDUCE": {"butterfly": 0, "scatter": 1}[d.reduce]}


def test_set_config_round_trip():
    prev = config.set_config(tiling=_OTHER_CONFIG)
    try:
        assert config.get_config().tiling is _OTHER_CONFIG
    finally:
        config.set_config(config=prev)
    assert config.get_config() is prev
    with pytest.raises(TypeError, match="TileConfig"):
        config.set_config(tiling=(16384, 3, 256, "scatter"))


@pytest.mark.parametrize("backend", _backend_params())
def test_syntax_error_fails(backend):
    """The check is not vacuous: a broken kernel (missing semicolon) fails the same helper."""
    code = kernels.source_text("exact_decode") + (
        "\ntemplate <typename T> __global__ void broken(T* x) { x[0] = T() }\n"
    )
    result = build_check.compile_check(code, ["broken<float>"], backend=backend)
    assert not result.ok
    assert "error" in result.log.lower()


@pytest.mark.parametrize("backend", _backend_params())
def test_missing_instantiation_fails(backend):
    """A name expression the source cannot instantiate (head_dim 96) is an error."""
    result = build_check.compile_check(kernels.source_text("exact_decode"),
                                       ["exact_decode_chunk<stochattn::f16, 96, 4>"], backend=backend)
    assert not result.ok


def test_group_max():
    assert [kernels.group_max(g) for g in range(1, 9)] == [4, 4, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="<= 8"):
        kernels.group_max(9)


def test_sources_need_no_cuda_headers():
    """Only local headers are included, so a bare NVRTC compiles them."""
    for family in kernels.FAMILIES:
        text = kernels.source_text(family)
        assert "#include" not in text, family


# ---- host build of philox.cuh: the Philox stream and the sample points -------------------

_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define STOCHATTN_HD inline
#include "philox.cuh"
using namespace stochattn;
// argv: seed offset row S sampler ; stdin: prefix values c (Z = 1), one per line.
int main(int argc, char** argv) {
  unsigned long long seed = strtoull(argv[1], 0, 10);
  unsigned offset = (unsigned)strtoul(argv[2], 0, 10);
  unsigned row = (unsigned)strtoul(argv[3], 0, 10);
  int S = atoi(argv[4]);
  int sampler = atoi(argv[5]);
  RngStream rs = RngStream::make(seed, offset, PURPOSE_VALUE_SAMPLER, row);
  for (int i = 0; i <= S; ++i) printf("w %u %a\n", rs.word(0u, (unsigned)i), (double)rs.uniform(0u, (unsigned)i));
  std::vector<double> pts(S + 1);
  double run = 0.0;  // iid: sequential prefix, as NumPy's cumsum
  for (int i = 0; i <= S; ++i) { run += iid_spacing(rs, i); pts[i] = run; }
  for (int i = 0; i < S; ++i) pts[i] /= pts[S];
  Points P;
  P.sampler = sampler; P.S = S; P.rs = rs; P.u = (double)rs.uniform(0u, 0u); P.iid = pts.data();
  for (int m = 0; m < S; ++m) printf("p %a\n", P(m));
  double c;
  while (scanf("%la", &c) == 1) printf("n %d\n", P.count_below(c, 1.0));
  return 0;
}
"""


def _host_build(tmp_path_factory, name, source):
    """Build a host harness of the package's host-and-device headers (no CUDA needed)."""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip(f"no host C++ compiler (g++, c++ or clang++) for the host build of {name}")
    d = tmp_path_factory.mktemp(name)
    (d / "harness.cpp").write_text(source)
    exe = d / "harness"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{kernels.SOURCE_DIR}", "-DSTOCHATTN_HD=inline",
                    "-D__host__=", "-D__device__=", "-D__forceinline__=",
                    str(d / "harness.cpp"), "-o", str(exe)], check=True, capture_output=True)
    return str(exe)


@pytest.fixture(scope="module")
def philox_host(tmp_path_factory):
    return _host_build(tmp_path_factory, "philox", _HARNESS)


_SAMPLER_CODE = {"systematic": 0, "stratified": 1, "iid": 2}


def _run(exe, seed, offset, row, S, sampler, cs):
    stdin = "".join(f"{float(c).hex()}\n" for c in cs)
    out = subprocess.run([exe, str(seed), str(offset), str(row), str(S), str(_SAMPLER_CODE[sampler])],
                         input=stdin, capture_output=True, text=True, check=True).stdout.split("\n")
    words = [l.split() for l in out if l.startswith("w ")]
    pts = np.array([float.fromhex(l.split()[1]) for l in out if l.startswith("p ")])
    counts = np.array([int(l.split()[1]) for l in out if l.startswith("n ")], dtype=np.int64)
    return (np.array([int(w[1]) for w in words], dtype=np.uint64),
            np.array([float.fromhex(w[2]) for w in words]), pts, counts)


@settings(max_examples=15)
@given(seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**32 - 1), row=st.integers(0, 2**28 - 1),
       S=st.integers(1, 300), sampler=st.sampled_from(sorted(_SAMPLER_CODE)), data=st.data())
def test_host_philox_and_points_match_reference(philox_host, seed, offset, row, S, sampler, data):
    """Bit-exact words, uniforms, systematic/stratified points; iid points to 4 ulp (the
    host harness sums sequentially like NumPy, but libm's log may differ by an ulp); the
    tile counts n(c) equal the reference's searchsorted count #{m : T_m < c} exactly."""
    cs = data.draw(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20))
    ref_pts = sample_points(sampler, S, seed=seed, offset=offset, row=row)
    cs = list(cs) + [float(p) for p in ref_pts[:: max(1, S // 5)]]  # points exactly on boundaries
    words, unif, pts, counts = _run(philox_host, seed, offset, row, S, sampler, cs)
    draws = np.arange(S + 1)
    np.testing.assert_array_equal(words, random_words(seed, offset, 0, row, 0, draws).astype(np.uint64))
    np.testing.assert_array_equal(unif, uniforms(seed, offset, 0, row, 0, draws))
    if sampler == "iid":
        np.testing.assert_allclose(pts, ref_pts, rtol=4 * np.finfo(float).eps, atol=0)
        ref_counts = np.searchsorted(pts, np.array(cs), side="left")
    else:
        np.testing.assert_array_equal(pts, ref_pts)
        ref_counts = np.searchsorted(ref_pts, np.array(cs), side="left")
    np.testing.assert_array_equal(counts, ref_counts)


def test_host_philox_known_answer(philox_host):
    """Philox-4x32-10 known-answer: counter 0, key 0 gives x0 = 0x6627e8d5 (Random123 KAT)."""
    words, _, _, _ = _run(philox_host, 0, 0, 0, 1, "systematic", [])
    assert int(words[0]) == 0x6627E8D5


# ---- host build of flash_sampling.cuh: a flash tile's points and their rows --------------

_FLASH_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "flash_sampling.cuh"
using namespace stochattn;
// argv: seed offset row t n sampler; stdin: TS, the TS fp32 CDF values, then points (hex).
int main(int argc, char** argv) {
  unsigned long long seed = strtoull(argv[1], 0, 10);
  unsigned offset = (unsigned)strtoul(argv[2], 0, 10);
  unsigned row = (unsigned)strtoul(argv[3], 0, 10);
  unsigned t = (unsigned)strtoul(argv[4], 0, 10);
  int n = atoi(argv[5]);
  int sampler = atoi(argv[6]);
  RngStream rs = RngStream::make(seed, offset, PURPOSE_VALUE_SAMPLER, row);
  const double u0 = (double)rs.uniform(t, 0u);  // the systematic uniform (the kernel's u_mine)
  for (int m = 0; m < n; ++m) printf("p %a\n", flash_point(rs, sampler, t, m, n, u0));
  int TS = 0;
  if (scanf("%d", &TS) != 1) return 0;
  std::vector<float> cr(TS);
  for (int i = 0; i < TS; ++i) { double c; if (scanf("%la", &c) != 1) return 1; cr[i] = (float)c; }
  double x;
  while (scanf("%la", &x) == 1) printf("r %d\n", flash_local_row(cr.data(), TS, x));
  return 0;
}
"""


@pytest.fixture(scope="module")
def flash_host(tmp_path_factory):
    return _host_build(tmp_path_factory, "flash_sampling", _FLASH_HARNESS)


@settings(max_examples=25)
@given(seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**32 - 1), row=st.integers(0, 2**28 - 1),
       t=st.integers(0, 2**24), n=st.integers(1, 64), sampler=st.sampled_from(["systematic", "stratified"]),
       TS=st.sampled_from([32, 64, 128, 256]), data=st.data())
def test_host_flash_points_and_rows_match_reference(flash_host, seed, offset, row, t, n, sampler, TS,
                                                    data):
    """The flash kernels' tile draws on the host: flash_point equals
    samplers.sample_points(stream = tile) bit for bit, and flash_local_row through an fp32
    tile CDF (zero-weight rows inside it and a flat tail past the sequence included) equals
    samplers.invert_cdf on the weights of that CDF, for the reference's points and for
    points exactly on, just below and just above every CDF boundary."""
    w32 = np.asarray(data.draw(st.lists(st.floats(0.0, 1.0, width=32), min_size=TS, max_size=TS)),
                     dtype=np.float32)
    w32[0] = max(w32[0], np.float32(1e-3))  # the tile's first row is in the sequence
    past = data.draw(st.integers(0, TS - 1))  # rows past the sequence: weight 0
    if past:
        w32[TS - past:] = 0.0
    cr = np.cumsum(w32, dtype=np.float32)  # the kernel's sequential fp32 inclusive scan
    w64 = np.diff(cr.astype(np.float64), prepend=0.0)  # float64 cumsum of these is cr, exactly
    assert np.array_equal(np.cumsum(w64), cr.astype(np.float64))
    ref_pts = sample_points(sampler, n, seed=seed, offset=offset, row=row, stream=t)
    edges = cr.astype(np.float64) / float(cr[-1])
    probe = np.concatenate([ref_pts, [0.0, np.nextafter(1.0, 0.0)], edges[:-1],
                            np.nextafter(edges[:-1], 0.0), np.nextafter(edges[:-1], 1.0)])
    probe = probe[(probe >= 0.0) & (probe < 1.0)]
    stdin = f"{TS}\n" + "".join(f"{float(c).hex()}\n" for c in cr) + \
        "".join(f"{float(x).hex()}\n" for x in probe)
    out = subprocess.run([flash_host, str(seed), str(offset), str(row), str(t), str(n),
                          str(_SAMPLER_CODE[sampler])], input=stdin, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    pts = np.array([float.fromhex(l.split()[1]) for l in out if l.startswith("p ")])
    rows = np.array([int(l.split()[1]) for l in out if l.startswith("r ")], dtype=np.int64)
    np.testing.assert_array_equal(pts, ref_pts)
    np.testing.assert_array_equal(rows, invert_cdf(w64, probe))


@pytest.mark.parametrize("backend", _backend_params())
def test_compile_check_returns_the_cubin(backend):
    """``cubin=True`` hands back the machine code (an ELF image) with exactly the options
    given; a failed compile hands back none."""
    names = ["exact_decode_merge<stochattn::f16>"]
    opts = config.get_config().tiling.options() + ("-Xptxas=-v",)
    result = build_check.compile_check(kernels.source_text("exact_decode"), names,
                                       backend=backend, options=opts, cubin=True)
    assert result.ok, result.log
    assert result.cubin[:4] == b"\x7fELF"
    assert "registers" in result.log  # the -Xptxas=-v given reached ptxas
    bad = build_check.compile_check("__global__ void k() { x; }", ["k"], backend=backend, cubin=True)
    assert not bad.ok and bad.cubin is None


@pytest.mark.parametrize("backend", _BACKENDS[:1] or _backend_params())
def test_bench_read_floor_kernel_compiles(backend):
    """tools/read_floor.py's read-only kernel compiles for sm_90 (it runs only on the GPU)."""
    from tools.read_floor import _SOURCE

    result = build_check.compile_check(_SOURCE, ["read_only"], backend=backend, options=("-std=c++17",))
    assert result.ok, result.log


_GLOBAL = re.compile(r"__global__[^{;]*?\)\s*\{", re.S)


def test_every_kernel_starts_with_the_pdl_entry():
    """With programmatic dependent launch on, a kernel launched as a dependent may start
    before the kernel before it has finished: it must wait (STOCHATTN_PDL_ENTRY) before it
    reads or writes anything. So every kernel's body starts with the entry."""
    found = 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(kernels.__file__), "*.cu*"))):
        text = open(path).read()
        for m in _GLOBAL.finditer(text):
            body = text[m.end():].lstrip()
            assert body.startswith("STOCHATTN_PDL_ENTRY();"), \
                f"{os.path.basename(path)}: a kernel ({m.group(0)[:80]!r}...) does not start " \
                f"with STOCHATTN_PDL_ENTRY()"
            found += 1
    assert found >= 19


_MEM_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|ldu|st|atom|red|prefetch|cp\.async)((?:\.\w+)*)",
                     re.M)
_NOT_GLOBAL = {"param", "shared", "local", "const"}


def first_memory_access_before_wait(ptx: str) -> list:
    """Kernels (PTX entries) in which an access that may touch global memory (ld, st, atom,
    red, prefetch, cp.async, except to param, shared, local and const space) comes before
    ``griddepcontrol.wait``: with programmatic dependent launch such an access could see
    the previous kernel's data half written."""
    bad = []
    for entry in re.split(r"(?=\.entry\s)", ptx)[1:]:
        name = re.match(r"\.entry\s+(\w+)", entry).group(1)
        wait = entry.find("griddepcontrol.wait")
        for m in _MEM_OP.finditer(entry):
            quals = set(m.group(2).split(".")[1:])
            if m.group(1) != "cp.async" and quals & _NOT_GLOBAL:
                continue
            if wait < 0 or m.start() < wait:
                bad.append(f"{name}: {m.group(0).strip()}")
            break
    return bad


def test_pdl_wait_check_finds_an_early_load():
    ptx = (".entry k1(\n.param .u64 a\n)\n{\nld.param.u64 %rd1, [a];\n"
           "griddepcontrol.wait;\nld.global.nc.f32 %f1, [%rd1];\n}\n"
           ".entry k2(\n.param .u64 a\n)\n{\nld.param.u64 %rd1, [a];\n"
           "@%p1 ld.global.f32 %f1, [%rd1];\ngriddepcontrol.wait;\n}\n"
           ".entry k3()\n{\ncp.async.cg.shared.global [%r1], [%rd2], 16;\n}\n")
    assert first_memory_access_before_wait(ptx) == [
        "k2: @%p1 ld.global.f32", "k3: cp.async.cg.shared.global"]


@pytest.mark.parametrize("backend", _BACKENDS[:1] or _backend_params())
@pytest.mark.parametrize("family", sorted(kernels.FAMILIES))
def test_pdl_wait_precedes_every_global_access(family, backend):
    """In the PTX of every kernel built with PDL, griddepcontrol.wait comes before any
    access that may touch global memory (the compiler does not hoist loads above it; the
    machine code was checked the same way by hand, 2026-12-05: ACQBULK first)."""
    import dataclasses

    cfg = dataclasses.replace(config.get_config().tiling, pdl=True)
    result = build_check.compile_check(kernels.source_text(family), kernels.name_expressions(family),
                                       backend=backend, config=cfg, ptx=True)
    assert result.ok, result.log
    assert result.ptx.count(".entry") >= 1
    assert first_memory_access_before_wait(result.ptx) == []
