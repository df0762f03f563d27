"""stochattn.cuda.kmeans.diskcache: the key of the k-means kernels' disk cache changes with
every value Numba freezes into their code (every module-level number of the kernels'
modules, their source files, the package versions) and is the same in two processes of one
configuration; the switch; where the files go; the simulator never touches the cache.

What needs a GPU (a kernel compiled, saved, and loaded by a second process) is in
tests/gpu/test_kmeans_disk_cache.py. Here, a subprocess without the simulator (numba-cuda
imports without a GPU) attaches the real numba-cuda cache classes to the real kernels and
saves and loads a stand-in payload through them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

import stochattn.cuda.kmeans  # noqa: E402,F401  (patches NumPy for numba-cuda first)
from stochattn import spec  # noqa: E402
from stochattn.cuda.kmeans import diskcache as dc  # noqa: E402
from stochattn.cuda.kmeans import kernels as kk  # noqa: E402
from stochattn.cuda.kmeans import kmeans_gpu  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _other(v):
    """A value of the same kind as ``v`` that differs from it."""
    if isinstance(v, (bool, np.bool_)):
        return type(v)(not v)
    if isinstance(v, (int, float, np.integer, np.floating)):
        w = type(v)(v + 1)
        return w if w != v else type(v)(0)  # (inf + 1 == inf)
    if isinstance(v, (str, bytes)):
        return v + v[:0] + (b"x" if isinstance(v, bytes) else "x")
    if isinstance(v, type):
        return np.float64 if v is not np.float64 else np.float32
    if isinstance(v, tuple):
        return v + (0,)
    if isinstance(v, np.ndarray):
        return v + 1
    raise AssertionError(f"no other value for {v!r}")


def test_key_changes_with_every_frozen_value(monkeypatch):
    material = dc.key_material(kk)
    base = dc.cache_key(kk)
    modules = {kk.__name__: kk, spec.__name__: spec}
    assert set(material["sources"]) >= set(modules)
    # The tuning values tests and tools/tune_kmeans.py change are among them.
    for name in ("ROW_TILE", "TILES_PER_BLOCK", "LANES", "VEC", "DIM_SHARED", "KH_SHARED",
                 "SCAN_TPB_MAX", "MU_SAMPLE", "SIM", "_WORD2_PURPOSE"):
        assert f"{kk.__name__}.{name}" in material["values"]
    assert f"{spec.__name__}.PHILOX_ROUNDS" in material["values"]
    for qualified in material["values"]:
        mod_name, name = qualified.rsplit(".", 1)
        mod = modules[mod_name]
        with monkeypatch.context() as m:
            m.setattr(mod, name, _other(getattr(mod, name)))
            assert dc.cache_key(kk) != base, qualified
        assert dc.cache_key(kk) == base, qualified


def test_key_covers_the_source_files_versions_and_settings(monkeypatch):
    material = dc.key_material(kk)
    for mod in (kk, spec):
        with open(mod.__file__, "rb") as f:
            assert material["sources"][mod.__name__] == hashlib.sha256(f.read()).hexdigest()
    assert material["packages"]["numba-cuda"] is not None
    assert material["packages"]["numba"] is not None
    assert "OPT" in material["numba"]
    base = dc.cache_key(kk)
    monkeypatch.setitem(dc._digests, spec.__file__, "0" * 64)  # spec.py edited
    assert dc.cache_key(kk) != base
    monkeypatch.setitem(dc._digests, spec.__file__, material["sources"][spec.__name__])
    monkeypatch.setitem(dc._versions, "numba-cuda", "0.0.0")
    assert dc.cache_key(kk) != base


def _python(code: str, **env):
    """Run ``code`` in a fresh interpreter from the repository root; its stdout."""
    full = dict(os.environ, PYTHONPATH=ROOT, **env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_key_is_the_same_in_two_processes():
    code = """
        import stochattn.cuda.kmeans
        from stochattn.cuda.kmeans import diskcache, kernels
        print(diskcache.cache_key(kernels))
    """
    sim = os.environ.get("NUMBA_ENABLE_CUDASIM", "0")
    keys = {_python(code, NUMBA_ENABLE_CUDASIM=sim).strip() for _ in range(2)}
    assert keys == {dc.cache_key(kk)}


def test_switch(monkeypatch):
    monkeypatch.setattr(dc, "ENABLED", None)
    monkeypatch.delenv(dc.ENV_SWITCH, raising=False)
    assert dc.enabled()
    for value, want in (("0", False), ("off", False), ("False", False), ("no", False),
                        ("1", True), ("on", True), ("", True)):
        monkeypatch.setenv(dc.ENV_SWITCH, value)
        assert dc.enabled() is want, value
    monkeypatch.setenv(dc.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="`STOCHATTN_KMEANS_CACHE` must be one of .*got 'maybe'"):
        dc.enabled()
    monkeypatch.setattr(dc, "ENABLED", False)  # the attribute wins
    assert not dc.enabled()
    monkeypatch.setenv(dc.ENV_SWITCH, "0")
    monkeypatch.setattr(dc, "ENABLED", True)
    assert dc.enabled()


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    assert dc.cache_root() == str(tmp_path / "numba" / "stochattn-kmeans")
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dc.cache_root() == str(tmp_path / "xdg" / "stochattn" / "kmeans")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dc.cache_root() == str(tmp_path / "home" / ".cache" / "stochattn" / "kmeans")


@pytest.mark.skipif(not kk.SIM, reason="the simulator's path")
def test_the_simulator_never_touches_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dc, "ENABLED", True)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 2, 24, 8)).astype(np.float32)
    kw = dict(n_clusters=3, iterations=2, n_sink=1, window=2, seed=3, method="scan")
    on = kmeans_gpu(k, k, **kw)
    assert dc.attach(kk) is None
    assert dc.counts(kk) == (0, 0)
    assert not any(tmp_path.iterdir())
    monkeypatch.setattr(dc, "ENABLED", False)
    off = kmeans_gpu(k, k, **kw)
    for name in on:
        np.testing.assert_array_equal(on[name], off[name], err_msg=name)


# Without the simulator: the real kernels get numba-cuda's cache in the key's directory.
_ATTACH = """
    import json, os, sys, warnings
    import stochattn.cuda.kmeans
    from stochattn.cuda.kmeans import diskcache as dc, kernels as kk
    if kk.SIM:
        print(json.dumps({"skip": "simulator"})); sys.exit(0)
    out = {}
    kernels = dc._kernels(kk)
    out["n_kernels"] = len(kernels)
    path = dc.attach(kk)
    out["path"] = path
    out["paths"] = sorted({k._cache.cache_path for k in kernels})
    with open(os.path.join(path, "key.json")) as f:
        out["key_json"] = json.load(f)["key"]
    out["key"] = dc.cache_key(kk)
    out["again"] = dc.attach(kk)
    dc.ENABLED = False
    out["off"] = dc.attach(kk)
    out["off_caches"] = sorted({type(k._cache).__name__ for k in kernels})
    dc.ENABLED = None
    out["on_again"] = dc.attach(kk)

    # Numba's cache through our locator: saved by one cache object, loaded by another of the
    # same key (a later process), not by one of another key.
    class Codegen:
        def magic_tuple(self):
            return ("runtime", (9, 0))
    class Ctx:
        def refresh(self):
            pass
        def codegen(self):
            return Codegen()
    class Payload:
        codegen = Codegen()
        def _reduce_states(self):
            return {"ptx": "stand-in"}
    def cache(path, stamp):
        c = dc._cache_class(path, stamp)(kk.prepare.py_func)
        c._impl.rebuild = lambda ctx, data: data
        return c
    sig = ("int64[::1]",)
    cache(path, out["key"]).save_overload(sig, Payload())
    out["files"] = sorted(os.listdir(path))
    out["loaded"] = cache(path, out["key"]).load_overload(sig, Ctx())
    out["other_stamp"] = cache(path, "x" * 32).load_overload(sig, Ctx())
    other = os.path.join(os.path.dirname(path), "y" * 32)
    out["other_dir"] = cache(other, out["key"]).load_overload(sig, Ctx())

    kk.ROW_TILE += 1  # nothing compiled yet: a new key, a new directory
    out["new_tile"] = dc.attach(kk)
    kk.prepare.overloads[("stand-in",)] = None  # as if compiled under this ROW_TILE
    kk.ROW_TILE -= 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["mixed"] = dc.attach(kk)
    out["mixed_warning"] = [str(w.message) for w in caught]
    out["mixed_caches"] = sorted({type(k._cache).__name__ for k in kernels})
    out["removed"] = dc.clear_disk_cache()
    out["root_left"] = os.path.exists(dc.cache_root())
    print(json.dumps(out))
"""


def test_attach_outside_the_simulator(tmp_path):
    env = dict(NUMBA_ENABLE_CUDASIM="0", NUMBA_CACHE_DIR=str(tmp_path))
    env.pop(dc.ENV_SWITCH, None)
    full = {k: v for k, v in os.environ.items() if k != dc.ENV_SWITCH}
    full.update(env, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_ATTACH)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    root = tmp_path / "stochattn-kmeans"
    path = str(root / out["key"])
    assert out["n_kernels"] >= 14
    assert out["path"] == path and out["paths"] == [path]
    assert out["key_json"] == out["key"]
    assert out["again"] == path
    assert out["off"] is None and out["off_caches"] == ["NullCache"]
    assert out["on_again"] == path
    assert "key.json" in out["files"] and any(f.endswith(".nbi") for f in out["files"])
    assert out["loaded"] == {"ptx": "stand-in"}
    assert out["other_stamp"] is None and out["other_dir"] is None
    assert out["new_tile"] not in (None, path)
    assert out["new_tile"].startswith(str(root))
    assert out["mixed"] is None and out["mixed_caches"] == ["NullCache"]
    assert any("compiled earlier" in w for w in out["mixed_warning"])
    assert out["removed"] >= 4 and not out["root_left"]
