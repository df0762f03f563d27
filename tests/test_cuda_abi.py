"""The CUDA backend's structure without a GPU: each kernel's declaration is parsed from its
source and is the only source of the name expressions and launch arguments
(stochattn.cuda.kernels.abi); no .cu file includes another; the tuning config
(stochattn.cuda.config) per device; importing stochattn.cuda loads no CuPy or Numba."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from stochattn.cuda import config, kernels
from stochattn.cuda.kernels import abi
from stochattn.cuda.runtime import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("family", sorted(kernels.FAMILIES))
def test_every_name_expression_instantiates_a_declared_kernel(family):
    decls = abi.kernels(family)
    names = kernels.name_expressions(family)
    assert len(names) == len(set(names)) >= 3
    for name in names:
        base, _, params = name.partition("<")
        decl = decls[base]
        n_params = len([p for p in params.rstrip(">").split(",") if p.strip()]) if params else 0
        assert n_params == len(decl.template), name
        for arg in decl.args:  # every argument has a launch type
            assert arg.scalar in (np.int32, np.uint32, np.int64, np.uint64, np.float32, np.float64)


def test_declaration_of_a_kernel():
    k = abi.kernel("exact_decode", "exact_decode_chunk")
    assert [kind for kind, _ in k.template] == ["typename", "int", "int"]
    assert k.arg_names[:15] == launch.SPLIT_KV_VARIABLE  # inputs, page table, out, partials
    assert k.expr(T="stochattn::f16", D=128, GMAX=4) == "exact_decode_chunk<stochattn::f16, 128, 4>"
    assert abi.kernel("santa_prop", "santa_prop_logits").expr(
        T="stochattn::bf16", D=64, GMAX=8, QHAT=True) == "santa_prop_logits<stochattn::bf16, 64, 8, true>"
    # a plain kernel compiled on demand: one defaulted template parameter, filled in
    tiles = abi.kernel("santa_prop", "santa_prop_tiles")
    assert tiles.template == (("int", "kOnDemand"),) and tiles.defaults == (("kOnDemand", 0),)
    assert tiles.expr() == "santa_prop_tiles<0>" == tiles.expr(kOnDemand=0)
    with pytest.raises(TypeError, match="template parameters"):
        k.expr(T="stochattn::f16", D=128)
    with pytest.raises(TypeError, match="must be an integer"):
        k.expr(T="stochattn::f16", D=128, GMAX=True)
    with pytest.raises(KeyError, match="no __global__ kernel"):
        abi.kernel("exact_decode", "nonexistent")


def test_bind_types_every_argument_and_names_the_per_call_ones():
    k = abi.kernel("exact_decode", "exact_decode_merge")
    bound = k.bind(("part_o", "out"), part_ml=2**40, num_chunks=3, D=128, lse=0)
    assert bound.variable == (0, 2)
    assert [type(a) for a in bound.args] == [np.uint64, np.uint64, np.uint64, np.int32, np.int32,
                                             np.uint64]
    assert [int(a) for a in bound.args] == [0, 2**40, 0, 3, 128, 0]
    assert k.args_of(part_o=1, part_ml=2, out=3, num_chunks=4, D=64, lse=0)[3].dtype == np.int32
    with pytest.raises(TypeError, match=r"missing \['D'\]"):
        k.bind(("part_o", "part_ml", "out", "lse"), num_chunks=3)
    with pytest.raises(TypeError, match=r"unknown \['dim'\]"):
        k.bind(("part_o", "part_ml", "out"), num_chunks=3, D=64, dim=1)
    with pytest.raises(TypeError, match="both fixed and variable"):
        k.bind(("part_o", "part_ml", "out"), out=0, num_chunks=3, D=64)


def test_constants_and_enums_come_from_the_sources():
    assert abi.constant("doublep_decode", "kSliceTokens") == (
        abi.constant("doublep_decode", "kRowThreads") * abi.constant("doublep_decode", "kScanTokens"))
    sampler = abi.enum("santa_prop", "Sampler")
    assert sorted(sampler.values()) == [0, 1, 2]
    with pytest.raises(KeyError, match="constexpr"):
        abi.constant("santa_prop", "kNoSuchConstant")


def test_no_cu_file_includes_another_cu_file():
    include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
    for name in os.listdir(kernels.SOURCE_DIR):
        if name.endswith((".cu", ".cuh")):
            text = open(os.path.join(kernels.SOURCE_DIR, name)).read()
            assert not [i for i in include.findall(text) if i.endswith(".cu")], name


def test_config_per_device_and_restored():
    config.reset_config()
    try:
        base = config.get_config()
        assert base.merge_in_kernel and base.tc_tiling == config.TC_TILINGS[0]
        with config.using_config(pdl=True, stages=4) as cfg:
            assert cfg.pdl and cfg.tiling.stages == 4 and config.get_config(3) is cfg
        assert config.get_config() == base
        prev = config.set_config(1, tc_tiling=config.TC_TILINGS[1])
        assert prev == base and config.get_config(1).tc_tiling == config.TC_TILINGS[1]
        assert config.get_config(0) == base
        with pytest.raises(ValueError, match="compiled"):
            config.set_config(tc_tiling=config.TcTiling(2, 16, 2))
        with pytest.raises(TypeError, match="unknown GPU config fields"):
            config.set_config(merge=False)
        assert hash(config.GpuConfig()) == hash(config.GpuConfig())
    finally:
        config.reset_config()


def test_environment_seeds_the_default(monkeypatch):
    monkeypatch.setenv("STOCHATTN_TILE_CONFIG", "16384,3,256,scatter")
    monkeypatch.setenv("STOCHATTN_PDL", "1")
    monkeypatch.setenv("STOCHATTN_LINEINFO", "1")
    config.reset_config()
    try:
        cfg = config.get_config()
        assert (cfg.tiling.stage_bytes, cfg.tiling.threads, cfg.pdl, cfg.lineinfo) == (16384, 256, True,
                                                                                        True)
        assert "-lineinfo" in cfg.tiling.options() and "-DSTOCHATTN_PDL=1" in cfg.tiling.options()
    finally:
        monkeypatch.undo()
        config.reset_config()


def test_import_of_the_backend_loads_no_cupy_or_numba():
    code = ("import sys, stochattn.cuda as c; from stochattn.cuda import config, kernels, build_check, "
            "runtime, kmeans, exact, santa, flash, doublep, doublep_index, bernoulli; "
            "from stochattn.cuda.runtime import launch, inputs, arrays, pdl; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'numba')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_defaulted_template_parameter():
    """``template <int kOnDemand = 0>`` (a plain kernel made a template so that NVRTC emits
    it only into the module that names it): the default may be left out of expr()."""
    template, defaults = abi._parse_template("int kOnDemand = 0")
    assert template == (("int", "kOnDemand"),) and defaults == (("kOnDemand", 0),)
    k = abi.Kernel("plain", template, (), defaults)
    assert k.expr() == "plain<0>" == k.expr(kOnDemand=0)
    assert k.expr(kOnDemand=1) == "plain<1>"
    assert abi._parse_template("typename T, int D") == ((("typename", "T"), ("int", "D")), ())
    with pytest.raises(TypeError, match="template parameters"):
        k.expr(other=1)


@pytest.mark.parametrize("family", sorted(kernels.FAMILIES))
def test_every_kernel_is_compiled_on_demand(family):
    """NVRTC emits every plain (non-template) __global__ function into every module, and
    the runtime compiles one module per instantiation: a plain kernel would be compiled
    again with each of its family's kernels (decode_common.cuh, "Kernels compiled on
    demand"). Every kernel is a template, and a defaulted parameter is an int literal."""
    for name, decl in abi.kernels(family).items():
        assert decl.template, f"{family}: {name} is not a template"
        for n, value in decl.defaults:
            assert isinstance(value, int) and n in dict((b, a) for a, b in decl.template), name
