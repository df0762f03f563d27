"""The row addresses of the error-targeted budget kernels, without a GPU: santa_prop.cu's
``budget_rows`` (the rows santa_prop_budgets and value_sqnorms_rows read: V with D known
at run time, the float32 norms, float32 V) goes through kv_rows.cuh's KvRows, the one home
of the paged addressing rule. A host build of the two (the device intrinsics shimmed)
gives, for random page tables, strides and element sizes, the byte address of every row
the formula of the pools' layout gives: contiguous (B, Hkv, N, width) and paged
pool[page, slot, head] with slot and head strides of "NHD" or "HND" pools."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from stochattn.cuda import kernels

_HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <strings.h>
#define __ldg(p) (*(p))
#define __ffs(x) ffs(x)
#define __shfl_sync(mask, v, lane) (v)
#include "kv_rows.cuh"
namespace stochattn {
%s
}  // namespace stochattn
using namespace stochattn;
// stdin: B, indptr (B + 1), nnz, indices (nnz); then per query: elem_bytes paged b kvh Hkv
// N width page_size page_stride row_stride head_stride n. Prints row n's byte offset.
int main() {
  int B, nnz;
  if (scanf("%%d", &B) != 1) return 1;
  static int indptr[1024], indices[1 << 16];
  for (int i = 0; i <= B; ++i) scanf("%%d", &indptr[i]);
  scanf("%%d", &nnz);
  for (int i = 0; i < nnz; ++i) scanf("%%d", &indices[i]);
  const unsigned char* base = reinterpret_cast<const unsigned char*>(uintptr_t(1) << 44);
  int eb, paged, b, kvh, Hkv, P, rs, hs;
  long long N, width, ps, n;
  while (scanf("%%d %%d %%d %%d %%d %%lld %%lld %%d %%lld %%d %%d %%lld", &eb, &paged, &b, &kvh,
               &Hkv, &N, &width, &P, &ps, &rs, &hs, &n) == 12) {
    const PageTable t = page_table(paged ? indptr : nullptr, indices, nullptr, P, ps, rs, hs);
    const BudgetRows r = budget_rows(base, eb, t, b, kvh, Hkv, N, width);
    printf("%%lld\n", (long long)(r.row_of<unsigned char>(n) - base));
  }
  return 0;
}
"""


def _budget_rows_source() -> str:
    """santa_prop.cu's BudgetRows and budget_rows, as written there."""
    text = (kernels.SOURCE_DIR / "santa_prop.cu").read_text()
    m = re.search(r"struct BudgetRows \{.*?\n\};\n.*?BudgetRows budget_rows\(.*?\n\}\n", text,
                  re.S)
    assert m, "BudgetRows / budget_rows not found in santa_prop.cu"
    return m.group(0)


@pytest.fixture(scope="module")
def rows_host(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++, c++ or clang++)")
    d = tmp_path_factory.mktemp("budget_rows")
    (d / "harness.cpp").write_text(_HARNESS % _budget_rows_source())
    exe = d / "harness"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{kernels.SOURCE_DIR}", "-D__host__=",
                    "-D__device__=", "-D__forceinline__=inline", str(d / "harness.cpp"), "-o",
                    str(exe)], check=True, capture_output=True)
    return str(exe)


@pytest.mark.parametrize("page_size", [1, 16, 7, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_budget_rows_follow_the_pool_layout(rows_host, page_size, layout, elem_bytes):
    rng = np.random.default_rng(page_size * 10 + elem_bytes + (layout == "HND"))
    B, Hkv, D, num_pages = 3, 4, 72, 50
    counts = rng.integers(0, 9, size=B)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    indices = rng.permutation(num_pages)[:indptr[-1]]
    # A pool (num_pages, [2,] slot/head, head/slot, width): the combined K/V form gives a
    # page stride larger than the page; `width` D for V, 1 for the norms.
    queries, want = [], []
    for width in (D, 1):
        inner = (page_size, Hkv) if layout == "NHD" else (Hkv, page_size)
        page_stride = 2 * inner[0] * inner[1] * width
        a1, a2 = inner[1] * width, width  # strides of the two inner axes
        row_stride, head_stride = (a1, a2) if layout == "NHD" else (a2, a1)
        N = 9 * page_size
        for b in range(B):
            for kvh in range(Hkv):
                for n in rng.integers(0, max(counts[b] * page_size, 1), size=5):
                    n = int(n)
                    if counts[b]:  # paged: the old hand arithmetic of the budget kernels
                        page = indices[indptr[b] + n // page_size]
                        at = page * page_stride + (n % page_size) * row_stride + kvh * head_stride
                        queries.append((elem_bytes, 1, b, kvh, Hkv, N, width, page_size,
                                        page_stride, row_stride, head_stride, n))
                        want.append(at * elem_bytes)
                    # contiguous (B, Hkv, N, width)
                    queries.append((elem_bytes, 0, b, kvh, Hkv, N, width, page_size, 0, 0, 0, n))
                    want.append((((b * Hkv + kvh) * N) + n) * width * elem_bytes)
    stdin = " ".join(map(str, [B, *indptr, len(indices), *indices])) + "\n"
    stdin += "".join(" ".join(map(str, q)) + "\n" for q in queries)
    out = subprocess.run([rows_host], input=stdin, capture_output=True, text=True, check=True)
    got = np.array(out.stdout.split(), dtype=np.int64)
    np.testing.assert_array_equal(got, np.array(want, dtype=np.int64))
