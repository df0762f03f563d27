// Double-P decode growth: the tokens that leave the window join the index.
//
// The tokens [window_start[b], max(n_sink, L' - window)) leave the window of sequence b;
// they join the index of each KV head h in position order, exactly as the reference's
// append_tokens:
//
// - while clusters without a centroid remain (n_initialized < C), a token seeds the next
//   one: centroid = its key, widened exactly to float32;
// - otherwise it joins the centroid with the smallest |c|^2 - 2 k.c in float32, ties to
//   the lowest cluster index (a minimum over packed (ordered score bits, cluster) 64-bit
//   keys; -0 counts as +0, as a float compare would);
// - the chosen cluster's size, float32 value sum (one thread per coordinate, so each sum
//   stays the sequential float32 sum of its members in position order) and the token's
//   label are updated before the next token.
//
// Seeding never depends on a score, and a join never moves a centroid, so the scores of
// every joining token are known from the start. Two kernels:
//
// 1. doublep_append_score, grid (B * Hkv, S): block s scores its slice of the centroids
//    for the first kFastTokens joining tokens of (b, h) (a decode step has one) and writes
//    its smallest key per token. A centroid seeded in this same append is read from the
//    seeding token's key (the value it gets, bit for bit).
// 2. doublep_append, one block per (b, h): walks the leaving tokens, seeds, takes each of
//    the first kFastTokens joins from the S partial minima, scores any later join itself
//    (a bulk append), and updates sizes, value sums and labels; the block of head 0 writes
//    the new lengths, max(L', L), and window starts into fresh arrays.
//
// With sub-centroids (an index built with mass="sub"; sub_centroids non-null), kernel 2
// also adds each token to the nearest sub-centroid of its cluster (join_sub), the rule of
// the reference's cluster_mass.append_sub_tokens: smallest |k - c_a|^2 in float32 (the
// reference: float64) among the parts of size > 0, ties to the lowest part; a cluster with
// none takes it in part 0, whose sub-centroid becomes the cluster's centroid. Sub-centroids
// never move, so one token at a time again gives the same index as a bulk append.
//
// Every score is computed by the same code (score_vec4 / score_scalar) whichever kernel
// runs it, so appending one token at a time gives the same index, bit for bit, as one
// bulk append. Cost per joining token: the C * D float32 centroids of (b, h) read once,
// spread over S blocks.
//
// In place and graph-safe: kernel 1 reads the index's lengths and window starts and writes
// each sequence's token range (start, stop, new window start, new length) to `staging`;
// kernel 2 reads only `staging` and its block of head 0 writes the new length and window
// start over the index's own arrays. So the index's arrays keep their addresses (a CUDA
// graph that captured an append and a decode replays both correctly), and no block reads
// a value another block of the same grid rewrites. `partial` and `staging` are scratch
// (a workspace the index keeps).
//
// The cache: contiguous (B, Hkv, N, D) with element strides (sb, sh, st), or paged in
// FlashInfer's layout (kv_rows.cuh's page table; strides in elements of T; the new lengths
// then come from the page table and `new_lens` is null). Rows are read element by
// element, so only element alignment is needed; a contiguous cache may be float16,
// bfloat16 or float32, a paged one 16-bit (the float32 instantiations compile the
// contiguous path only: the host refuses float32 pages). The index keeps token positions,
// never addresses: pages may move between calls.
#include "decode_common.cuh"

namespace stochattn {

__device__ __forceinline__ float widen(f16 x) { return Elem<f16>::to_float(x.bits); }
__device__ __forceinline__ float widen(bf16 x) { return Elem<bf16>::to_float(x.bits); }
__device__ __forceinline__ float widen(float x) { return x; }

// A float's bits mapped so that unsigned order is float order (no NaNs here).
__device__ __forceinline__ unsigned ordered_bits(float x) {
  unsigned u = __float_as_uint(x + 0.0f);  // -0 + 0 = +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The rows of the tokens of one (sequence, KV head) stream of a cache of T: contiguous (row
// t at base + t * st) or paged (page kv_indices[indptr[b] + t / page_size], slot
// t % page_size). Strides in elements of T.
template <typename T>
struct TokenRows {
  const T* base;       // contiguous: row 0 of the stream; paged: pool + head offset
  const int* pages;    // null: contiguous; else this sequence's page numbers
  long long page_stride;
  long long st;        // token stride (inside a page when paged)
  int page_size;
  __device__ __forceinline__ const T* row(long long t) const {
    if (sizeof(T) != 2 || !pages) return base + t * st;  // paged pools are 16-bit
    // Fewer than 2**31 tokens (the host checks it): 32-bit division is exact and cheaper.
    const int r = (int)t;
    const int p = r / page_size;
    return base + (long long)__ldg(pages + p) * page_stride + (long long)(r - p * page_size) * st;
  }
};

template <typename T>
__device__ __forceinline__ TokenRows<T> token_rows(const T* cache, const PageTable& pt, int b,
                                                   int h, long long sb, long long sh,
                                                   long long st) {
  TokenRows<T> r;
  if (sizeof(T) != 2 || !pt.paged()) {  // float32 caches are contiguous (the host checks)
    r.base = cache + b * sb + h * sh;
    r.pages = nullptr;
    r.page_stride = 0;
    r.st = st;
    r.page_size = 1;
  } else {
    r.base = cache + (long long)h * pt.head_stride;
    r.pages = pt.indices + __ldg(pt.indptr + b);
    r.page_stride = pt.page_stride;
    r.st = pt.row_stride;
    r.page_size = pt.page_size;
  }
  return r;
}

__device__ __forceinline__ unsigned long long score_key(float nrm, float dot, int c) {
  return ((unsigned long long)ordered_bits(nrm - 2.f * dot) << 32) | (unsigned)c;
}

constexpr int kAppendUnroll = 8;  // centroids in flight per lane group
constexpr int kFastTokens = 4;    // joins per append scored by the split kernel

// Lanes per centroid of the float4 path: D / 4 when that is a power of two <= 32, else 0
// (the scalar path: one warp per centroid, lanes strided over D).
__device__ __forceinline__ int lanes_per_centroid(int D) {
  const int q4 = D >> 2;
  return ((D & 3) == 0 && q4 <= 32 && (q4 & (q4 - 1)) == 0) ? q4 : 0;
}

// Where the scored centroids come from: the index's float32 rows, except that clusters
// [live0, live0 + seeded) were seeded in this append by the tokens first_seed, ... (rows
// of the cache, widened exactly). The seeding kernel writes those same values.
template <typename T>
struct CentroidRows {
  const float* cent;
  TokenRows<T> keys;  // the cache's keys; token first_seed seeds cluster live0
  long long first_seed;
  long long live0;
  int D;
  __device__ __forceinline__ float4 vec4(int c, int j) const {
    if (c < live0) return reinterpret_cast<const float4*>(cent + (long long)c * D)[j];
    const T* row = keys.row(first_seed + (c - live0)) + 4 * j;
    return make_float4(widen(row[0]), widen(row[1]), widen(row[2]), widen(row[3]));
  }
  __device__ __forceinline__ float at(int c, int d) const {
    return c < live0 ? cent[(long long)c * D + d] : widen(keys.row(first_seed + (c - live0))[d]);
  }
};

// Smallest key over centroids [lo, hi) of this block's warps (float4 path); every lane of
// every warp returns its warp's minimum.
template <typename Rows>
__device__ __forceinline__ unsigned long long score_vec4(const Rows& rows, const float* skey,
                                                         int lo, int hi, int lpc, int warp,
                                                         int warps, int lane) {
  const int per_warp = 32 / lpc;
  const int sub = lane / lpc;
  const int j = lane - sub * lpc;
  const float4 k4 = reinterpret_cast<const float4*>(skey)[j];
  unsigned long long best = ~0ull;
  const int step = warps * per_warp * kAppendUnroll;
  for (int base = lo + warp * per_warp * kAppendUnroll; base < hi; base += step) {
    float4 x[kAppendUnroll];
#pragma unroll
    for (int u = 0; u < kAppendUnroll; ++u) {
      const int cc = base + u * per_warp + sub;
      x[u] = cc < hi ? rows.vec4(cc, j) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kAppendUnroll; ++u) {
      float nrm = x[u].x * x[u].x;
      nrm = fmaf(x[u].y, x[u].y, nrm);
      nrm = fmaf(x[u].z, x[u].z, nrm);
      nrm = fmaf(x[u].w, x[u].w, nrm);
      float dot = k4.x * x[u].x;
      dot = fmaf(k4.y, x[u].y, dot);
      dot = fmaf(k4.z, x[u].z, dot);
      dot = fmaf(k4.w, x[u].w, dot);
      for (int o = lpc >> 1; o > 0; o >>= 1) {  // within the lane group: a fixed order
        nrm += __shfl_xor_sync(0xffffffffu, nrm, o);
        dot += __shfl_xor_sync(0xffffffffu, dot, o);
      }
      const int cc = base + u * per_warp + sub;
      if (j == 0 && cc < hi) best = min(best, score_key(nrm, dot, cc));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, o));
  return best;
}

// Any D: one warp per centroid, lanes strided over D, a fixed butterfly order.
template <typename Rows>
__device__ __forceinline__ unsigned long long score_scalar(const Rows& rows, const float* skey,
                                                           int lo, int hi, int D, int warp,
                                                           int warps, int lane) {
  unsigned long long best = ~0ull;
  for (int cc = lo + warp; cc < hi; cc += warps) {
    float nrm = 0.f, dot = 0.f;
    for (int d = lane; d < D; d += 32) {
      const float x = rows.at(cc, d);
      nrm = fmaf(x, x, nrm);
      dot = fmaf(skey[d], x, dot);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      nrm += __shfl_xor_sync(0xffffffffu, nrm, o);
      dot += __shfl_xor_sync(0xffffffffu, dot, o);
    }
    best = min(best, score_key(nrm, dot, cc));
  }
  return best;
}

// The block's smallest key over [lo, hi) for the key in skey (synchronises the block; the
// result is valid in every thread). red: 32 words of shared memory.
template <typename Rows>
__device__ unsigned long long block_best(const Rows& rows, const float* skey, int lo, int hi,
                                         int D, unsigned long long* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int lpc = lanes_per_centroid(D);
  unsigned long long best = lpc ? score_vec4(rows, skey, lo, hi, lpc, warp, warps, lane)
                                : score_scalar(rows, skey, lo, hi, D, warp, warps, lane);
  if (lane == 0) red[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = lane < warps ? red[lane] : ~0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (lane == 0) red[0] = best;
  }
  __syncthreads();
  best = red[0];
  __syncthreads();  // red may be rewritten next
  return best;
}

// The part of cluster c nearest the key kt among the n_sub sub-centroids (float32 rows
// `sub`, sizes `ssize`, both of cluster c) of size > 0, ties to the lowest part; -1 when
// none has members. Warp 0 computes it, the result goes through `pick` to the block
// (synchronises the block twice).
template <typename T>
__device__ int nearest_sub(const T* __restrict__ kt, const float* __restrict__ sub,
                           const int* __restrict__ ssize, int n_sub, int D, int* pick) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int best = -1;
    float best_d = 0.f;
    for (int a = 0; a < n_sub; ++a) {
      if (ssize[a] <= 0) continue;  // uniform over the warp
      float acc = 0.f;
      for (int d = lane; d < D; d += 32) {
        const float x = widen(kt[d]) - sub[(long long)a * D + d];
        acc = fmaf(x, x, acc);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (best < 0 || acc < best_d) {
        best = a;
        best_d = acc;
      }
    }
    if (lane == 0) *pick = best;
  }
  __syncthreads();
  const int a = *pick;
  __syncthreads();  // pick may be rewritten by the next token
  return a;
}

// The leaving tokens of sequence b: [start, stop), stop clamped to the cache (its rows, or
// the pages the sequence owns) and the labels. The requested length: the page table's
// when paged, else new_lens[b] (int64 when lens64, else int32; null: n_cache) clamped to
// [0, n_cache].
struct Leaving {
  long long L, start, stop, ws_new;
  __device__ Leaving(const void* new_lens, int lens64, const PageTable& pt,
                     const long long* old_lens, const long long* window_start, int b,
                     long long n_cache, long long NL, long long n_sink, long long window) {
    long long want, limit = n_cache;
    if (pt.paged()) {
      want = limit = stream_length(nullptr, pt, b, n_cache);
    } else if (!new_lens) {
      want = n_cache;
    } else {
      want = lens64 ? reinterpret_cast<const long long*>(new_lens)[b]
                    : (long long)reinterpret_cast<const int*>(new_lens)[b];
      want = want < 0 ? 0 : (want > n_cache ? n_cache : want);
    }
    L = max(want, old_lens[b]);  // a sequence never shrinks
    start = window_start[b];
    const long long s = max(L - window, n_sink);
    ws_new = max(start, s);
    stop = min(s, min(limit, NL));
  }
};

// staging[4 b + i]: start, stop, new window start, new length of sequence b (kernel 1 ->
// kernel 2).
struct Staged {
  long long start, stop, ws_new, L;
};

}  // namespace stochattn

// Common arguments: keys/values (B, Hkv, N, D) with element strides (sb, sh, st) and unit
// stride along D, or the page pools with the page table (kv_rows.cuh; paged: the strides
// (sb, sh, st) are unused, new_lens is null); old_lens, window_start (B,) the index's;
// n_init (B, Hkv); centroids, value_sums (B, Hkv, C, D) float32; sizes (B, Hkv, C) int64;
// labels (B, Hkv, NL) int32; partial (B * Hkv, kFastTokens, S) uint64; staging (B, 4)
// int64 (Staged); kernel 2 only: sub_centroids (B, Hkv, C, n_sub, D) float32 and
// sub_sizes (B, Hkv, C, n_sub) int32, or null pointers (an index without sub-centroids). Dynamic shared memory: D floats (a key). Blocks of up to 1024 threads, a
// multiple of 32.

// Kernel 1: grid (B * Hkv, S); block s scores centroids [s * C / S, (s + 1) * C / S).
// Block (b, head 0, s = 0) writes sequence b's Staged range for kernel 2.
template <typename T>
__global__ void __launch_bounds__(1024) doublep_append_score(
    const T* __restrict__ keys, const int* __restrict__ kv_indptr,
    const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len, int page_size,
    long long page_stride, int row_stride, int head_stride, long long sb, long long sh,
    long long st, long long n_cache, const void* __restrict__ new_lens, int lens64,
    const long long* __restrict__ old_lens, const long long* __restrict__ window_start,
    const long long* __restrict__ n_init, const float* __restrict__ centroids,
    unsigned long long* __restrict__ partial, long long* __restrict__ staging, int Hkv, int C,
    int D, long long NL, long long n_sink, long long window) {
  STOCHATTN_PDL_ENTRY();
  using namespace stochattn;
  extern __shared__ float skey[];
  __shared__ unsigned long long red[32];
  const int bh = blockIdx.x, b = bh / Hkv, h = bh - b * Hkv;
  const int S = gridDim.y, s = blockIdx.y;
  const PageTable pt = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                  page_stride, row_stride, head_stride);
  const Leaving lv(new_lens, lens64, pt, old_lens, window_start, b, n_cache, NL, n_sink,
                   window);
  if (h == 0 && s == 0 && threadIdx.x == 0) {
    Staged* out = reinterpret_cast<Staged*>(staging) + b;
    out->start = lv.start;
    out->stop = lv.stop;
    out->ws_new = lv.ws_new;
    out->L = lv.L;
  }
  const long long live0 = n_init[bh];
  const long long first = lv.start + max(0ll, (long long)C - live0);  // first joining token
  const TokenRows<T> krows = token_rows(keys, pt, b, h, sb, sh, st);
  const CentroidRows<T> rows{centroids + (long long)bh * C * D, krows, lv.start, live0, D};
  const int lo = (int)((long long)C * s / S), hi = (int)((long long)C * (s + 1) / S);
  for (int f = 0; f < kFastTokens; ++f) {
    const long long t = first + f;
    unsigned long long best = ~0ull;
    if (t < lv.stop) {  // uniform over the block
      const T* kt = krows.row(t);
      for (int d = threadIdx.x; d < D; d += blockDim.x) skey[d] = widen(kt[d]);
      __syncthreads();
      best = block_best(rows, skey, lo, hi, D, red);
    }
    if (threadIdx.x == 0) partial[((long long)bh * kFastTokens + f) * S + s] = best;
  }
}

// Kernel 2: one block per (b, h); S the split of kernel 1. Reads the token range from
// `staging` (kernel 1's), never the index's lengths, which the block of head 0 rewrites in
// place (lens, window_start).
template <typename T>
__global__ void __launch_bounds__(1024) doublep_append(
    const T* __restrict__ keys, const T* __restrict__ values, const int* __restrict__ kv_indptr,
    const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len, int page_size,
    long long page_stride, int row_stride, int head_stride, long long sb, long long sh,
    long long st, const long long* __restrict__ staging, long long* __restrict__ lens,
    long long* __restrict__ window_start, long long* __restrict__ n_init,
    float* __restrict__ centroids, long long* __restrict__ sizes,
    float* __restrict__ value_sums, int* __restrict__ labels,
    const unsigned long long* __restrict__ partial, int S, int Hkv, int C, int D, long long NL,
    float* __restrict__ sub_centroids, int* __restrict__ sub_sizes, int n_sub) {
  STOCHATTN_PDL_ENTRY();
  using namespace stochattn;
  extern __shared__ float skey[];
  __shared__ unsigned long long red[32];
  __shared__ int sub_pick;
  const int bh = blockIdx.x, b = bh / Hkv, h = bh - b * Hkv;
  const int tid = threadIdx.x;
  const Staged lv = reinterpret_cast<const Staged*>(staging)[b];
  if (h == 0 && tid == 0) {
    lens[b] = lv.L;
    window_start[b] = lv.ws_new;
  }
  const PageTable pt = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                  page_stride, row_stride, head_stride);
  const TokenRows<T> krows = token_rows(keys, pt, b, h, sb, sh, st);
  const TokenRows<T> vrows = token_rows(values, pt, b, h, sb, sh, st);
  float* cent = centroids + (long long)bh * C * D;
  float* vsum = value_sums + (long long)bh * C * D;
  long long* size = sizes + (long long)bh * C;
  int* lab = labels + (long long)bh * NL;
  const unsigned long long* part = partial + (long long)bh * kFastTokens * S;
  const long long live0 = n_init[bh];  // the same value in every thread
  long long live = live0;
  __syncthreads();  // every thread has read n_init before thread 0 may rewrite it
  // All seeded by then: the keys are never read (live0 = C).
  const CentroidRows<float> rows{cent, TokenRows<float>{nullptr, nullptr, 0, 0, 1}, 0,
                                 (long long)C, D};
  int joined = 0;

  for (long long t = lv.start; t < lv.stop; ++t) {
    const T* kt = krows.row(t);
    int c;
    if (live < C) {  // a cluster without a centroid is left: the token seeds it
      c = (int)live;
      for (int d = tid; d < D; d += blockDim.x) cent[(long long)c * D + d] = widen(kt[d]);
      ++live;
    } else if (joined < kFastTokens) {  // scored by kernel 1
      if (tid < 32) {
        unsigned long long best = ~0ull;
        for (int i = tid; i < S; i += 32) best = min(best, part[joined * S + i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, o));
        if (tid == 0) red[0] = best;
      }
      __syncthreads();
      c = (int)(red[0] & 0xffffffffull);
      ++joined;
    } else {  // a bulk append's later joins: the block scores them itself
      for (int d = tid; d < D; d += blockDim.x) skey[d] = widen(kt[d]);
      __syncthreads();
      c = (int)(block_best(rows, skey, 0, C, D, red) & 0xffffffffull);
    }
    const T* vt = vrows.row(t);
    for (int d = tid; d < D; d += blockDim.x) vsum[(long long)c * D + d] += widen(vt[d]);
    if (sub_centroids) {  // mass="sub" (uniform): the nearest sub-centroid of cluster c
      __syncthreads();  // a centroid seeded by this token is visible to warp 0
      const long long sc = ((long long)bh * C + c) * n_sub;
      float* sub = sub_centroids + sc * D;
      int a = nearest_sub(kt, sub, sub_sizes + sc, n_sub, D, &sub_pick);
      if (a < 0) {  // no part has members: part 0 takes the cluster's centroid
        a = 0;
        for (int d = tid; d < D; d += blockDim.x) sub[d] = cent[(long long)c * D + d];
      }
      if (tid == 0) sub_sizes[sc + a] += 1;
    }
    if (tid == 0) {
      size[c] += 1;
      lab[t] = c;
    }
    // Every thread has read red[0] and skey, and a seeded centroid is visible to every
    // thread, before the next token.
    __syncthreads();
  }
  if (tid == 0) n_init[bh] = live;
}
