// Where the K or V rows of one (sequence b, KV head h) stream live: a contiguous cache
// (B, Hkv, N, D) or a paged cache in FlashInfer's layout (docs/paged.md), read in place.
//
// Every kernel that reads K or V takes, after its cache pointers, the page table:
//
//   const int* kv_indptr        (B + 1,) or null: null means contiguous caches;
//   const int* kv_indices       (nnz_pages,) physical page numbers, in token order;
//   const int* kv_last_page_len (B,) tokens in each sequence's last page (0: no pages);
//   int page_size               tokens per page (1 .. 128);
//   long long page_stride       elements from one page to the next in the pool;
//   int row_stride              elements from one token to the next inside a page
//                               (Hkv * D for "NHD", D for "HND");
//   int head_stride             elements from one KV head to the next inside a page
//                               (D for "NHD", page_size * D for "HND").
//
// The host checks that the pools are 16-byte aligned with D contiguous elements per row
// and every stride a multiple of 8 elements, so a row is read with 16-byte copies as in
// the contiguous case. K and V pools share the strides (the host checks it).
//
// A stream's row n is at `row(n)`: for a contiguous cache base + n * D elements (the
// address the kernels always computed), for a paged one the pool + page(n) * page_stride
// + (n % page_size) * row_stride + h * head_stride. Sequence lengths come from the page
// table (`stream_length`); the host passes seq_lens = null with a paged cache.
#pragma once

namespace stochattn {

// The page table as the kernels receive it (the host packs the seven arguments above).
struct PageTable {
  const int* indptr;
  const int* indices;
  const int* last_page_len;
  int page_size;
  long long page_stride;
  int row_stride;
  int head_stride;

  __device__ __forceinline__ bool paged() const { return indptr != nullptr; }
};

__device__ __forceinline__ PageTable page_table(const int* indptr, const int* indices,
                                                const int* last_page_len, int page_size,
                                                long long page_stride, int row_stride,
                                                int head_stride) {
  PageTable t;
  t.indptr = indptr;
  t.indices = indices;
  t.last_page_len = last_page_len;
  t.page_size = page_size;
  t.page_stride = page_stride;
  t.row_stride = row_stride;
  t.head_stride = head_stride;
  return t;
}

// The rows of one stream of 16-bit elements, D per row, as byte addresses.
template <int D>
struct KvRows {
  const unsigned char* base;  // contiguous: row 0 of the stream; paged: pool + head offset
  const int* pages;           // null: contiguous; else this sequence's page numbers
  long long page_bytes;       // bytes from one page to the next
  int row_bytes;              // bytes from one token to the next inside a page
  int page_size;
  int page_shift;             // log2(page_size) for a power of two, else -1

  // Paged: the index into `pages` of the page holding row r (r - page_index(r) *
  // page_size is its slot).
  __device__ __forceinline__ int page_index(int r) const {
    return page_shift >= 0 ? r >> page_shift : r / page_size;
  }

  // Byte offset of row n from `base`. Paged: one page-number load; rows number fewer than
  // 2**31 (the host checks it), so the division is 32-bit, and a shift for power-of-two
  // page sizes (every size FlashInfer's engines use).
  __device__ __forceinline__ long long offset(long long n) const {
    if (!pages) return n * (D * 2);
    const int r = (int)n;
    const int p = page_index(r);
    const int slot = r - p * page_size;
    return (long long)__ldg(pages + p) * page_bytes + (long long)slot * row_bytes;
  }

  __device__ __forceinline__ const unsigned char* row(long long n) const {
    return base + offset(n);
  }

  // Element pointer of row n (for kernels that index elements, not bytes).
  template <typename T>
  __device__ __forceinline__ const T* row_of(long long n) const {
    return reinterpret_cast<const T*>(row(n));
  }
};

// The page numbers of a warp's tile of rows [tok0, min(tok0 + nrows, end)) of a paged
// stream, loaded once, one page per lane, ahead of a gather of some of those rows: the
// gather then finds a row's page with a shuffle (`TilePages::offset`) instead of a
// dependent page-number load per row. `on` (uniform over the warp) is false for a
// contiguous stream, an empty tile, or a tile over more than 32 pages (pages of fewer than
// nrows / 31 tokens); `offset` then computes the address as KvRows::offset does.
struct TilePages {
  long long page_off;  // this lane's page: (its page number) * page_bytes
  int first;           // index into KvRows::pages of the tile's first page
  bool on;

  template <int D>
  __device__ __forceinline__ static TilePages load(const KvRows<D>& rows, long long tok0,
                                                   long long end, int nrows, int lane) {
    TilePages tp;
    tp.page_off = 0;
    tp.first = 0;
    tp.on = false;
    const long long last_row = (tok0 + nrows < end ? tok0 + nrows : end) - 1;
    if (!rows.pages || last_row < tok0) return tp;
    tp.first = rows.page_index((int)tok0);
    const int last = rows.page_index((int)last_row);
    if (last - tp.first >= 32) return tp;
    tp.on = true;
    // Only the tile's own pages: every one lies in the sequence (rows < end <= length).
    if (tp.first + lane <= last)
      tp.page_off = (long long)__ldg(rows.pages + tp.first + lane) * rows.page_bytes;
    return tp;
  }

  // Byte offset of row n (in [tok0, end) when `live`) from rows.base. Every lane of the
  // warp calls it together (the shuffle); a lane whose row is not live gets an unused
  // value and loads nothing.
  template <int D>
  __device__ __forceinline__ long long offset(const KvRows<D>& rows, long long n,
                                              bool live) const {
    if (on) {
      const int r = live ? (int)n : 0;
      const int p = live ? rows.page_index(r) : first;
      const long long po = __shfl_sync(0xffffffffu, page_off, p - first);
      return po + (long long)(r - p * rows.page_size) * rows.row_bytes;
    }
    return live ? rows.offset(n) : 0;
  }
};

// The rows of stream (b, kvh) of `cache` (16-bit elements): contiguous (B, Hkv, N, D)
// when the table is not paged, else the pool read through the page table.
template <int D>
__device__ __forceinline__ KvRows<D> kv_rows(const void* cache, const PageTable& t, int b,
                                             int kvh, int Hkv, long long N) {
  KvRows<D> r;
  const unsigned char* c = reinterpret_cast<const unsigned char*>(cache);
  if (!t.paged()) {
    r.base = c + ((long long)b * Hkv + kvh) * N * D * 2;
    r.pages = nullptr;
    r.page_bytes = 0;
    r.row_bytes = D * 2;
    r.page_size = 1;
    r.page_shift = 0;
  } else {
    r.base = c + (long long)kvh * t.head_stride * 2;
    r.pages = t.indices + __ldg(t.indptr + b);
    r.page_bytes = t.page_stride * 2;
    r.row_bytes = t.row_stride * 2;
    r.page_size = t.page_size;
    r.page_shift = (t.page_size & (t.page_size - 1)) == 0 ? __ffs(t.page_size) - 1 : -1;
  }
  return r;
}

// Length of sequence b, clamped to [0, N]: from the page table when paged ((pages - 1) *
// page_size + last_page_len, 0 without pages), else from seq_lens (null: N). An
// out-of-range value on the device (unchecked unless the caller asks: checking needs a
// host sync) can never make a kernel read past the N rows the host planned for, nor past
// the pages a sequence owns. (Page numbers themselves are trusted: `paged_kv(...,
// check_values=True)` checks them.)
__device__ __forceinline__ long long stream_length(const int* __restrict__ seq_lens,
                                                   const PageTable& t, int b, long long N) {
  long long len;
  if (t.paged()) {
    const long long pages = (long long)__ldg(t.indptr + b + 1) - __ldg(t.indptr + b);
    len = pages > 0 ? (pages - 1) * t.page_size + __ldg(t.last_page_len + b) : 0;
    len = len > pages * t.page_size ? pages * t.page_size : len;  // never past its pages
  } else {
    if (!seq_lens) return N;
    len = seq_lens[b];
  }
  return len < 0 ? 0 : (len > N ? N : len);
}

}  // namespace stochattn
