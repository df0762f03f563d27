"""The k-means kernels' raw entries on a real GPU (stochattn/cuda/kmeans/raw.py, rawplan.py):
fresh processes building Double-P indexes through the public API on CuPy arrays, with
NUMBA_CACHE_DIR in a temporary directory.

- A first ("cold") process builds through Numba and writes a raw entry per kernel
  specialization it launches.
- A second ("warm") process builds the same indexes from those entries: its plans are raw
  (rawplan.counts), it never imports Numba, and every index equals the cold one bit for bit.
- A process with ``STOCHATTN_KMEANS_RAW=0`` builds through Numba (loaded from the disk
  cache), imports Numba, and gives the same bits.
- A paged prefix (gathered into a contiguous temporary) takes the raw path too.
- A process whose kernels module holds a tuned value (ROW_TILE) never uses the raw entries.

Each process builds: float16 keys without seq_lens, float32 keys with GPU seq_lens, and (on
request) a paged prefix; ``tools/first_use.py`` times the first build of a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = ("labels", "sizes", "centroids", "value_sums", "n_initialized", "window_start")

_BUILD = """
    import json, sys, time
    import numpy as np
    import cupy as cp
    import stochattn
    from stochattn.cuda.kmeans import rawplan

    opts = json.loads(sys.argv[1])
    if opts.get("geometry"):  # a tuned value, set before the first build
        from stochattn.cuda.kmeans import kernels
        for name, value in opts["geometry"].items():
            setattr(kernels, name, value)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 4, 1024, 128)).astype(np.float32)
    v = rng.standard_normal((2, 4, 1024, 128)).astype(np.float32)
    k16, v16 = cp.asarray(k.astype(np.float16)), cp.asarray(v.astype(np.float16))
    k32, v32 = cp.asarray(k), cp.asarray(v)
    lens = cp.asarray(np.array([1000, 613], dtype=np.int64))
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    ix = stochattn.build_doublep_index(k16, v16, n_clusters=32, seed=5)
    cp.cuda.Device().synchronize()
    first = time.perf_counter() - t
    out = {"f16." + n: cp.asnumpy(getattr(ix, n)) for n in %(fields)r}
    ix = stochattn.build_doublep_index(k32, v32, lens, n_clusters=24, seed=2**63 + 1,
                                       iterations=4)
    out.update({"f32." + n: cp.asnumpy(getattr(ix, n)) for n in %(fields)r})
    if opts.get("paged"):
        from stochattn.paged import from_contiguous, paged_kv
        host = from_contiguous(k, v, np.array([700, 1024]), page_size=16, shuffle_seed=3)
        cache = paged_kv(cp.asarray(np.asarray(host.k_pages).astype(np.float16)),
                         cp.asarray(np.asarray(host.v_pages).astype(np.float16)),
                         kv_indptr=cp.asarray(np.asarray(host.kv_indptr)),
                         kv_indices=cp.asarray(np.asarray(host.kv_indices)),
                         kv_last_page_len=cp.asarray(np.asarray(host.kv_last_page_len)),
                         layout=host.layout, max_tokens=host.max_tokens)
        ix = stochattn.build_doublep_index(cache, n_clusters=16, seed=9)
        out.update({"paged." + n: cp.asnumpy(getattr(ix, n)) for n in %(fields)r})
    np.savez(sys.argv[2], **out)
    report = (sys.modules["stochattn.cuda.kmeans.raw"].export_report()
              if "stochattn.cuda.kmeans.raw" in sys.modules else None)
    print(json.dumps(dict(first_s=first, raw=rawplan.counts(), numba="numba" in sys.modules,
                          export=report)))
""" % {"fields": FIELDS}


def _build(tmp_path, tag, opts=None, **env):
    full = {k: v for k, v in os.environ.items()
            if k not in ("STOCHATTN_KMEANS_CACHE", "STOCHATTN_KMEANS_RAW", "NUMBA_ENABLE_CUDASIM")}
    full.update(PYTHONPATH=ROOT, NUMBA_CACHE_DIR=str(tmp_path / "cache"), **env)
    out_file = str(tmp_path / f"{tag}.npz")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_BUILD), json.dumps(opts or {}),
                           out_file], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    with np.load(out_file) as z:
        info["index"] = {name: z[name] for name in z.files}
    print(tag, {k: v for k, v in info.items() if k != "index"})
    return info


def _same(a, b):
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _raw_files(tmp_path):
    root = tmp_path / "cache" / "stochattn-kmeans" / "raw"
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(base, name))
            out[os.path.relpath(os.path.join(base, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_warm_process_builds_from_raw_entries_without_numba(tmp_path):
    opts = {"paged": True}
    cold = _build(tmp_path, "cold", opts)
    # The cold process compiles through Numba and exports; its later plans whose entries
    # it has written by then may already launch them (3 plans: fp16, fp32, paged).
    assert cold["numba"] and cold["raw"]["plans"] < 3, cold
    files = _raw_files(tmp_path)
    cubins = [p for p in files if p.endswith(".cubin")]
    assert len(cubins) >= 15, (sorted(files), cold["export"])  # every kernel, both key dtypes
    assert len([p for p in files if p.endswith(".json") and not p.endswith("key.json")]) \
        == len(cubins)

    warm = _build(tmp_path, "warm", opts)
    assert not warm["numba"], "the warm process imported numba"
    assert warm["raw"]["plans"] == 3 and warm["raw"]["launches"] >= 30
    _same(warm["index"], cold["index"])
    assert _raw_files(tmp_path) == files, "the warm process wrote raw entries"

    # The Numba path alone (raw entries off): the same bits, Numba imported.
    numba = _build(tmp_path, "numba", opts, STOCHATTN_KMEANS_RAW="0")
    assert numba["numba"] and numba["raw"]["plans"] == 0
    _same(numba["index"], cold["index"])
    assert _raw_files(tmp_path) == files

    # The whole disk cache off: compiles, writes nothing, same bits.
    off = _build(tmp_path, "off", STOCHATTN_KMEANS_CACHE="0")
    assert off["numba"] and off["raw"]["plans"] == 0
    _same(off["index"], {k: v for k, v in cold["index"].items() if not k.startswith("paged.")})
    assert _raw_files(tmp_path) == files


def test_tuned_values_never_use_the_raw_entries(tmp_path):
    base = _build(tmp_path, "cold")
    tuned = _build(tmp_path, "row_tile_2", {"geometry": {"ROW_TILE": 2}})
    assert tuned["raw"]["plans"] == 0 and tuned["numba"]
    _same(tuned["index"], base["index"])  # (the labels do not depend on the geometry)
    warm = _build(tmp_path, "warm")  # the tuned process wrote nothing under the source's key
    assert warm["raw"]["plans"] == 2 and not warm["numba"], (warm, base["export"])
    _same(warm["index"], base["index"])
