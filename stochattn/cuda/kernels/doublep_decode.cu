// Double-P decode and fixed top-k clusters on the GPU, over the index of
// stochattn/cuda/doublep_index.py. Five launches per call (plus one for diagnostics):
//
// 1. doublep_cluster_logits  grid (cluster blocks, Hkv, B): the pseudo-logits of every
//    cluster for the G heads of a group, in the log2 domain,
//    xb = log2(e) scale q.C_i + log2(s_i) (-inf for empty clusters), into scratch
//    (B Hq, C) float32. One warp per centroid row (float32, D / 32 features per lane),
//    kLogitRows rows in flight, the G dot products summed by one reduce-scatter.
//    doublep_cluster_logits_sub (mass="sub", issue 31) replaces it with the sub-centroid
//    mass: xb = log2 sum_a 2^(log2(e) scale q.c_ia + log2(s_ia)) over the NSUB
//    sub-centroids c_ia of size s_ia > 0 (-inf for an empty cluster, or one whose parts
//    are all empty), one warp per cluster, its NSUB rows in flight. Everything after it
//    reads xb alone, so stages 1 and 2 and the centroid pseudo-token logits follow (the
//    reference's mass="sub", value="mean": the pseudo-token's value stays the value mean).
// 2. doublep_select_sorted (C <= P, the usual case) or doublep_select, grid (B Hq): stage 1
//    and stage 2 of one query head. Clusters are ordered by the 64-bit key (orderable bits
//    of xb) << 32 | (2^32 - 1 - i), descending: by estimated mass, ties to the lower index,
//    the reference's order. Weights exp2(xb - max) in fixed point (2^40 per unit), so
//    prefix masses are exact integers and order-independent; the selection is the
//    shortest prefix whose mass reaches ceil(p * total). The sorted kernel finds the
//    logit bin where each prefix ends from an exact mass histogram, sorts only the keys of
//    that bin in shared memory (bitonic) and scans them; doublep_select finds the same
//    boundary key by a radix select over 8-bit digits on the mass-weighted histogram
//    (no sort, any C). Both write one code byte per (cluster, head) into (B, Hkv, C, 8):
//    0 dropped, 1 approximated (C_approx), 2 exact (C_exact); with `counts` (top-k
//    clusters) the weights are 1 and the target is the count.
// 3. doublep_rows            grid (slices, Hkv, B): the row list, i.e. the tokens that some
//    head of the group computes exactly (sinks and window: all heads; a middle token: the
//    heads whose code for its cluster is 2) with their head masks, compacted per slice of
//    kSliceTokens tokens in position order.
// 4. doublep_attend          grid (token chunks + cluster chunks, Hkv, B), kThreads:
//    - a token CTA takes an equal share of its (b, kv head)'s row list and streams those K
//      and V rows through the cp.async pipeline of exact decode (the union over the group
//      is read once; a head's logit is -inf on rows it does not need);
//    - a cluster CTA (centroid mode) adds the C_approx clusters as pseudo-tokens:
//      logit xb, value value_sums / size, one warp per cluster row.
//    Every CTA writes a normalised partial and its (max, sum) per head.
// 5. exact_decode_merge (merge.cuh) combines the partials.
//
// Lengths: the index's (seq_lens and window_start on the device, int64), clamped to the
// cache and label axes. The logits, weights and sums are float32 (the reference: float64),
// so a cluster whose cumulative mass lies within float32 rounding of p1 or p2 may be
// selected differently (documented near-ties).
//
// K and V: a contiguous cache (B, Hkv, N, D) or a paged one in FlashInfer's layout, read in
// place through the page table (kv_rows.cuh). The kernels that read K or V (doublep_attend,
// doublep_true_mass) and doublep_rows, which makes every row id they read, take the seven
// page-table arguments. With a paged cache a sequence's length is also clamped to the
// length its page table gives (`paged_length`), so an index longer than the table (a user
// error: the index must describe the cache) can never make a kernel read past the pages
// the sequence owns; doublep_rows writes each listed row's byte offset in the pool next to
// its id (row_offs), and doublep_attend stages those with the list, so its pipeline never
// touches the page table (and keeps the registers of the contiguous path). For a
// contiguous cache the addresses are those computed before, behind a uniform branch.
#include "decode_common.cuh"
#include "merge.cuh"
#include "group_state.cuh"

using namespace stochattn;

namespace {

constexpr int kLogitThreads = 256;
constexpr int kLogitWarps = kLogitThreads / 32;
constexpr int kLogitRows = 4;  // centroid rows per warp in flight
constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr float kFixedOne = 1099511627776.0f;  // 2^40: fixed-point unit of the weights
constexpr int kScanTokens = 8;  // tokens per thread of the row-list scan
constexpr int kRowThreads = 256;
constexpr int kSliceTokens = kRowThreads * kScanTokens;  // tokens per doublep_rows CTA
constexpr int kSortThreads = 512;
constexpr int kSortMaxClusters = 8192;  // largest C of doublep_select_sorted
constexpr int kSortPer = kSortMaxClusters / kSortThreads;  // logits per thread
constexpr int kBins = 2048;  // logit bins of the sorted selection (a multiple of kSortThreads)
constexpr float kBinsPerLog2 = 64.f;  // bins per log2 unit: the last bin starts ~32 below
constexpr int kListCap = 1024;  // row-list entries an attention CTA stages in shared memory

__device__ __forceinline__ long long clamp_len(const long long* __restrict__ lens, int b,
                                               long long cap) {
  const long long len = lens[b];
  return len < 0 ? 0 : (len > cap ? cap : len);
}

// The index's length `len` of sequence b (already clamped to [0, cap]) clamped again to the
// length its page table gives when the cache is paged; unchanged for a contiguous cache
// (stream_length with no seq_lens returns its bound there).
__device__ __forceinline__ long long paged_length(const PageTable& t, int b, long long len) {
  return stream_length(nullptr, t, b, len);
}

// Byte offset of row t of sequence b in a paged pool of 16-bit elements, from its KV head's
// base (kv_rows.cuh's row(t) less its base; 32-bit division: t < 2**31).
__device__ __forceinline__ long long paged_row_offset(const PageTable& t, int b, long long row) {
  const int r = (int)row;
  const int p = r / t.page_size;
  const int page = __ldg(t.indices + __ldg(t.indptr + b) + p);
  return 2 * ((long long)page * t.page_stride + (long long)(r - p * t.page_size) * t.row_stride);
}

// Eight code bytes of a cluster (one per head of the group; bytes >= G are never written).
__device__ __forceinline__ unsigned long long codes_of(const unsigned char* __restrict__ codes,
                                                       long long pair, int C, int c) {
  return *reinterpret_cast<const unsigned long long*>(codes + ((pair * C + c) << 3));
}

// Bit g set where head g's code byte (0, 1 or 2) equals `want`, for g < G. Bit 0 of each
// byte of `bits` says whether that byte matches; one multiply gathers the eight bits (byte
// i's bit lands at bit 56 + i, every other partial product above bit 63 or below bit 56,
// none overlapping), instead of a loop over the heads.
template <int GMAX>
__device__ __forceinline__ unsigned heads_with(unsigned long long word, int G, unsigned want) {
  static_assert(GMAX <= 8, "one code byte per head in a 64-bit word");
  const unsigned long long bits =
      want == 2u ? (word >> 1) : (want == 1u ? (word & ~(word >> 1)) : ~(word | (word >> 1)));
  const unsigned long long gathered =
      ((bits & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56;
  return (unsigned)gathered & ((1u << G) - 1u);
}

// PER consecutive 16-bit elements (PER even, 4-byte aligned) -> floats.
template <typename T, int PER>
__device__ __forceinline__ void load_elems(const T* __restrict__ p, float (&f)[PER]) {
  const unsigned* w = reinterpret_cast<const unsigned*>(p);
#pragma unroll
  for (int i = 0; i < PER / 2; ++i) {
    const float2 two = Elem<T>::pair(w[i]);
    f[2 * i] = two.x;
    f[2 * i + 1] = two.y;
  }
}

// The G queries of one KV head's group in the one-warp-per-row layout (lane holds elements
// [lane PER, lane PER + PER) of each, PER = D / 32), scaled by scale_log2; rows G .. GMAX-1
// are zeros. (decode_common.cuh's load_group_queries: the 8-features-per-thread layout.)
template <typename T, int D, int GMAX>
__device__ __forceinline__ void load_lane_queries(const T* __restrict__ q, long long head0,
                                                  int G, int lane, float scale_log2,
                                                  float (&qf)[GMAX][D / 32]) {
  constexpr int PER = D / 32;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
      load_elems<T, PER>(q + (head0 + g) * D + lane * PER, qf[g]);
#pragma unroll
      for (int e = 0; e < PER; ++e) qf[g][e] *= scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < PER; ++e) qf[g][e] = 0.f;
    }
  }
}

template <int PER>
__device__ __forceinline__ void load_floats(const float* __restrict__ p, float (&f)[PER]) {
  if constexpr (PER == 4) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    f[0] = u.x; f[1] = u.y; f[2] = u.z; f[3] = u.w;
  } else {
    static_assert(PER == 2, "D / 32 features per lane: 2 or 4");
    const float2 u = *reinterpret_cast<const float2*>(p);
    f[0] = u.x; f[1] = u.y;
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Sums over the warp of GMAX values at once (a reduce-scatter: GMAX - 1 + log2(32 / GMAX)
// shuffles instead of 5 GMAX): returns the total of part[reduced_head(lane)], which every
// lane with that head holds; `part` is clobbered.
template <int GMAX>
__device__ __forceinline__ float warp_reduce_scatter(float (&part)[GMAX], int lane) {
  static_assert(GMAX == 4 || GMAX == 8, "GMAX");
  int off = 16;
#pragma unroll
  for (int half = GMAX / 2; half >= 1; half /= 2, off /= 2) {
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int j = 0; j < half; ++j) {
      const float send = upper ? part[j] : part[j + half];
      const float keep = upper ? part[j + half] : part[j];
      part[j] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
  }
#pragma unroll
  for (int o = 32 / GMAX / 2; o > 0; o >>= 1) part[0] += __shfl_xor_sync(0xffffffffu, part[0], o);
  return part[0];
}

// The head whose sum warp_reduce_scatter leaves in `lane`.
template <int GMAX>
__device__ __forceinline__ int reduced_head(int lane) {
  int head = 0, off = 16;
#pragma unroll
  for (int half = GMAX / 2; half >= 1; half /= 2, off /= 2) head += (lane & off) ? half : 0;
  return head;
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Block-wide sum or max of kSelectThreads values (all threads get the result). `red` holds
// kSelectWarps entries; the trailing barrier lets the caller reuse it at once.
__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long x,
                                                            unsigned long long* red) {
  x = warp_sum_u64(x);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  unsigned long long total = 0;
#pragma unroll
  for (int w = 0; w < kSelectWarps; ++w) total += red[w];
  __syncthreads();
  return total;
}

// Block-wide max over W warps (all threads get it); `red` holds W entries.
template <int W>
__device__ __forceinline__ float block_max_n(float x, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  float m = STOCHATTN_NEG_INF;
#pragma unroll
  for (int w = 0; w < W; ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  return m;
}

// Total order of floats as unsigned integers (larger float, larger key).
__device__ __forceinline__ unsigned orderable(float x) {
  const unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace

// ---- 1. cluster logits ---------------------------------------------------------------

template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kLogitThreads)
doublep_cluster_logits(const T* __restrict__ q, const float* __restrict__ centroids,
                       const long long* __restrict__ sizes, float* __restrict__ xb, int Hkv,
                       int G, int C, int per_cta, float scale_log2) {
  STOCHATTN_PDL_ENTRY();
  constexpr int PER = D / 32;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long head0 = (long long)b * Hkv * G + (long long)kvh * G;
  const long long pair = (long long)b * Hkv + kvh;

  float qf[GMAX][PER];
  load_lane_queries<T, D, GMAX>(q, head0, G, lane, scale_log2, qf);
  const float* cbase = centroids + pair * C * D;
  const long long* sz = sizes + pair * C;
  const int c0 = blockIdx.x * per_cta;
  const int c1 = min(C, c0 + per_cta);
  const int head = reduced_head<GMAX>(lane);
  // kLogitRows rows per warp iteration: all loads in flight before the reductions, the
  // cluster sizes with them (a size loaded after the dot product would add a second
  // memory round trip to every iteration).
  for (int c = c0 + warp; c < c1; c += kLogitRows * kLogitWarps) {
    float cf[kLogitRows][PER];
    long long size[kLogitRows];
#pragma unroll
    for (int r = 0; r < kLogitRows; ++r) {
      const int cr = c + r * kLogitWarps;
      if (cr < c1) {
        load_floats<PER>(cbase + (long long)cr * D + lane * PER, cf[r]);
        size[r] = sz[cr];
      } else {
#pragma unroll
        for (int e = 0; e < PER; ++e) cf[r][e] = 0.f;
        size[r] = 0;
      }
    }
#pragma unroll
    for (int r = 0; r < kLogitRows; ++r) {
      const int cr = c + r * kLogitWarps;
      float part[GMAX];
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < PER; ++e) acc = fmaf(qf[g][e], cf[r][e], acc);
        part[g] = acc;
      }
      const float dot = warp_reduce_scatter<GMAX>(part, lane);  // head `head`'s logit
      if (cr < c1 && head < G && (lane & (32 / GMAX - 1)) == 0)
        xb[(head0 + head) * C + cr] =
            size[r] > 0 ? dot + log2f((float)size[r]) : STOCHATTN_NEG_INF;
    }
  }
}

// Grid and block as doublep_cluster_logits; sub_centroids (B, Hkv, C, NSUB, D) float32,
// sub_sizes (B, Hkv, C, NSUB) int32, sizes (B, Hkv, C) int64 (a cluster of size 0 is -inf,
// as in doublep_cluster_logits).
template <typename T, int D, int GMAX, int NSUB>
__global__ void __launch_bounds__(kLogitThreads)
doublep_cluster_logits_sub(const T* __restrict__ q, const float* __restrict__ sub_centroids,
                           const int* __restrict__ sub_sizes,
                           const long long* __restrict__ sizes, float* __restrict__ xb,
                           int Hkv, int G, int C, int per_cta, float scale_log2) {
  STOCHATTN_PDL_ENTRY();
  static_assert(NSUB >= 1 && NSUB <= 8, "NSUB sub-centroids per cluster");
  constexpr int PER = D / 32;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long head0 = (long long)b * Hkv * G + (long long)kvh * G;
  const long long pair = (long long)b * Hkv + kvh;

  float qf[GMAX][PER];
  load_lane_queries<T, D, GMAX>(q, head0, G, lane, scale_log2, qf);
  const float* sbase = sub_centroids + pair * C * NSUB * D;
  const int* ssz = sub_sizes + pair * C * NSUB;
  const long long* sz = sizes + pair * C;
  const int c0 = blockIdx.x * per_cta;
  const int c1 = min(C, c0 + per_cta);
  const int head = reduced_head<GMAX>(lane);
  for (int c = c0 + warp; c < c1; c += kLogitWarps) {
    // The cluster's NSUB rows and sizes, all loads in flight before the reductions.
    float cf[NSUB][PER];
    int ts[NSUB];
#pragma unroll
    for (int a = 0; a < NSUB; ++a) {
      load_floats<PER>(sbase + ((long long)c * NSUB + a) * D + lane * PER, cf[a]);
      ts[a] = ssz[(long long)c * NSUB + a];
    }
    const long long size = sz[c];
    float x[NSUB];
    float mx = STOCHATTN_NEG_INF;
#pragma unroll
    for (int a = 0; a < NSUB; ++a) {
      float part[GMAX];
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < PER; ++e) acc = fmaf(qf[g][e], cf[a][e], acc);
        part[g] = acc;
      }
      const float dot = warp_reduce_scatter<GMAX>(part, lane);  // head `head`'s dot
      x[a] = ts[a] > 0 ? dot + log2f((float)ts[a]) : STOCHATTN_NEG_INF;
      mx = fmaxf(mx, x[a]);
    }
    float sum = 0.f;
#pragma unroll
    for (int a = 0; a < NSUB; ++a) sum += exp2f(x[a] - mx);  // 0 for an empty part
    if (head < G && (lane & (32 / GMAX - 1)) == 0)
      xb[(head0 + head) * C + c] =
          (size > 0 && mx != STOCHATTN_NEG_INF) ? mx + log2f(sum) : STOCHATTN_NEG_INF;
  }
}

// ---- 2. selection (stage 1 and stage 2) ----------------------------------------------

// The query head of a selection CTA (row = b * Hq + h), its group and length; zeroes the
// group's two rows_read counters (once, from head 0; 2 B Hkv entries) for doublep_rows.
struct SelectRow {
  int row, b, g;
  long long pair, L;
  __device__ SelectRow(int row_, int Hkv, int G, const long long* __restrict__ lens,
                       long long cap, unsigned long long* __restrict__ rows_read)
      : row(row_) {
    const int Hq = Hkv * G;
    const int h = row % Hq;
    b = row / Hq;
    g = h % G;
    pair = (long long)b * Hkv + h / G;
    L = clamp_len(lens, b, cap);
    if (rows_read && g == 0 && threadIdx.x == 0) {
      rows_read[pair] = 0;
      rows_read[gridDim.x / G + pair] = 0;  // the sampled variant's exact rows (B Hkv more)
    }
  }
};

// Grid (B * Hq), block kSelectThreads. Row r = b * Hq + h. `p[0]`, `p[1]`: p1, p2 (top-p) or
// `count` clusters (counts != 0: only selection 0, every selected cluster exact).
// stats (optional, (B Hq, 4) float64): |C_p|, |C_exact|, exact tokens (sinks + window +
// tokens of C_exact), estimated mass of C_p (0 for an empty sequence, 1 without clusters).
// rows_read (optional, 2 B Hkv): zeroed here for doublep_rows to count into.
template <int kOnDemand = 0>  // compiled on demand (decode_common.cuh)
__global__ void __launch_bounds__(kSelectThreads)
doublep_select(const float* __restrict__ xb, const long long* __restrict__ sizes,
               const long long* __restrict__ lens, const long long* __restrict__ window_start,
               unsigned char* __restrict__ codes, double* __restrict__ stats,
               unsigned long long* __restrict__ rows_read, int Hkv, int G, int C, long long cap,
               int n_sink, double p1, double p2, int counts, int count) {
  STOCHATTN_PDL_ENTRY();
  __shared__ unsigned long long hist[2][256];
  __shared__ unsigned cnt[2][256];
  __shared__ unsigned long long red[kSelectWarps];
  __shared__ float redf[kSelectWarps];
  __shared__ unsigned long long prefix[2], pmask[2], above[2], target[2];
  __shared__ int done[2];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const SelectRow r(blockIdx.x, Hkv, G, lens, cap, rows_read);
  const int row = r.row, b = r.b, g = r.g;
  const long long pair = r.pair, L = r.L;
  const float* x = xb + (long long)row * C;
  const long long* sz = sizes + pair * C;

  // Max over the non-empty clusters (empty ones hold -inf).
  float mx = STOCHATTN_NEG_INF;
  for (int c = tid; c < C; c += kSelectThreads) mx = fmaxf(mx, x[c]);
  mx = block_max_n<kSelectWarps>(mx, redf);

  const bool none = mx == STOCHATTN_NEG_INF || L == 0;
  unsigned long long total_w = 0, n_live = 0;
  if (!none) {
    for (int c = tid; c < C; c += kSelectThreads) {
      const float xc = x[c];
      if (xc != STOCHATTN_NEG_INF) {
        total_w += __float2ull_rn(exp2f(xc - mx) * kFixedOne);
        n_live += 1;
      }
    }
  }
  total_w = block_sum_u64(total_w, red);
  n_live = block_sum_u64(n_live, red);

  if (tid == 0) {
    const int nsel = counts ? 1 : 2;
    for (int s = 0; s < 2; ++s) {
      prefix[s] = 0;
      pmask[s] = 0;
      above[s] = 0;
      const double p = s == 0 ? p1 : p2;
      if (none || s >= nsel) {
        done[s] = 1;
        target[s] = 0;
      } else if (counts) {
        target[s] = (unsigned long long)count < n_live ? (unsigned long long)count : n_live;
        done[s] = target[s] >= n_live;  // all of them: threshold key 0
      } else {
        // The first prefix whose mass reaches p * total: integer masses reach p * total
        // exactly when they reach its ceiling.
        target[s] = (unsigned long long)ceil(p * (double)total_w);
        done[s] = p >= 1.0;  // p == 1 keeps every non-empty cluster (weights that underflow too)
      }
    }
  }
  __syncthreads();

  // Radix select, most significant digit first.
  for (int shift = 56; shift >= 0; shift -= 8) {
    if (done[0] && done[1]) break;  // shared, read after a barrier: uniform
    for (int i = tid; i < 2 * 256; i += kSelectThreads) {
      hist[i / 256][i % 256] = 0;
      cnt[i / 256][i % 256] = 0;
    }
    __syncthreads();
    for (int base = 0; base < C; base += kSelectThreads) {
      const int c = base + tid;
      const float xc = c < C ? x[c] : STOCHATTN_NEG_INF;
      const bool live = xc != STOCHATTN_NEG_INF;
      const unsigned long long key =
          ((unsigned long long)orderable(xc) << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)c);
      const unsigned long long w = counts ? 1ull : (live ? __float2ull_rn(exp2f(xc - mx) * kFixedOne) : 0ull);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        if (done[s]) continue;  // uniform
        const bool in = live && (key & pmask[s]) == prefix[s];
        const unsigned digit = (unsigned)(key >> shift) & 0xFFu;
        // Warp-aggregated histogram add: one atomic per distinct digit of the warp.
        unsigned todo = __ballot_sync(0xffffffffu, in);
        while (todo) {
          const int leader = __ffs(todo) - 1;
          const unsigned d0 = __shfl_sync(0xffffffffu, digit, leader);
          const bool mine = in && digit == d0;
          const unsigned group = __ballot_sync(0xffffffffu, mine);
          const unsigned long long sum = warp_sum_u64(mine ? w : 0ull);
          if (lane == leader) {
            atomicAdd(&hist[s][d0], sum);
            atomicAdd(&cnt[s][d0], (unsigned)__popc(group));
          }
          todo &= ~group;
        }
      }
    }
    __syncthreads();
    // Warp s scans selection s's bins from the top: lane j owns bins 255 - 8j ... 248 - 8j.
    if (warp < 2 && !done[warp]) {
      const int s = warp;
      unsigned long long part = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) part += hist[s][255 - 8 * lane - i];
      unsigned long long incl = part;  // inclusive scan over lanes (top bins first)
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const unsigned long long y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
      }
      const unsigned long long base_mass = above[s];
      const unsigned hit = __ballot_sync(0xffffffffu, base_mass + incl >= target[s]);
      const int first = __ffs(hit) - 1;  // exists: the candidates' mass reaches the target
      if (lane == first) {
        unsigned long long run = base_mass + incl - part;
        int chosen = 255 - 8 * lane - 7;
        for (int i = 0; i < 8; ++i) {
          const int d = 255 - 8 * lane - i;
          if (run + hist[s][d] >= target[s]) {
            chosen = d;
            break;
          }
          run += hist[s][d];
        }
        above[s] = run;  // mass of the keys above the chosen digit's range
        prefix[s] |= (unsigned long long)chosen << shift;
        pmask[s] |= 0xFFull << shift;
        // One candidate left (or every digit fixed): {key >= prefix} is the selection.
        if (cnt[s][chosen] == 1 || shift == 0) done[s] = 1;
      }
    }
    __syncthreads();
  }

  // Thresholds: C_p = {key >= tp}; C_exact = {key >= te}, te >= tp (C_exact within C_p).
  const unsigned long long tp = prefix[0];
  const unsigned long long te = counts ? tp : (prefix[1] > tp ? prefix[1] : tp);
  unsigned long long n_p = 0, n_e = 0, tok_e = 0, mass_p = 0;
  for (int c = tid; c < C; c += kSelectThreads) {
    const float xc = x[c];
    unsigned char code = 0;
    if (!none && xc != STOCHATTN_NEG_INF) {
      const unsigned long long key =
          ((unsigned long long)orderable(xc) << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)c);
      if (key >= tp) {
        code = key >= te ? 2 : 1;
        n_p += 1;
        mass_p += __float2ull_rn(exp2f(xc - mx) * kFixedOne);
        if (code == 2) {
          n_e += 1;
          tok_e += (unsigned long long)sz[c];
        }
      }
    }
    codes[((pair * C + c) << 3) + g] = code;
  }
  if (stats) {
    n_p = block_sum_u64(n_p, red);
    n_e = block_sum_u64(n_e, red);
    tok_e = block_sum_u64(tok_e, red);
    mass_p = block_sum_u64(mass_p, red);
    if (tid == 0) {
      double* st = stats + (long long)row * 4;
      const long long ws = window_start[b];
      const long long sinks = L < n_sink ? L : n_sink;
      const long long window = L > ws ? L - ws : 0;
      st[0] = (double)n_p;
      st[1] = (double)n_e;
      st[2] = L == 0 ? 0.0 : (double)(sinks + window + (long long)tok_e);
      st[3] = L == 0 ? 0.0 : (mx == STOCHATTN_NEG_INF ? 1.0 : (double)mass_p / (double)total_w);
    }
  }
}


// Float of an orderable() key (its inverse).
__device__ __forceinline__ float from_orderable(unsigned u) {
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u);
}

// Fixed-point estimated mass of a live cluster from its key (the weight doublep_select
// computes from the same float).
__device__ __forceinline__ unsigned long long weight_of_key(unsigned long long key, float mx) {
  return __float2ull_rn(exp2f(from_orderable((unsigned)(key >> 32)) - mx) * kFixedOne);
}

// Histogram bin of a live cluster's logit: floor(kBinsPerLog2 (mx - x)), at most kBins - 1
// (the last bin catches every logit more than (kBins - 1) / kBinsPerLog2 below the max).
// Monotone: a larger logit never gets a larger bin, so bins split the key order into runs.
__device__ __forceinline__ int bin_of(float x, float mx) {
  const float d = (mx - x) * kBinsPerLog2;
  return d < (float)(kBins - 1) ? (int)d : kBins - 1;
}

// Block-wide exclusive scan of one 64-bit value per thread (kSortThreads threads); also
// returns the total. `red` holds kSortThreads / 32 entries.
__device__ __forceinline__ unsigned long long block_exclusive_scan_u64(unsigned long long x,
                                                                       unsigned long long* red,
                                                                       unsigned long long* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned long long incl = x;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == 31) red[warp] = incl;
  __syncthreads();
  unsigned long long before = 0, all = 0;
  for (int w = 0; w < kSortThreads / 32; ++w) {
    before += w < warp ? red[w] : 0ull;
    all += red[w];
  }
  __syncthreads();
  *total = all;
  return before + incl - x;
}

// The same selection as doublep_select (identical codes and stats: both pick the shortest
// prefix, in the same key order, whose integer mass reaches the same target), for
// C <= min(P, kSortMaxClusters) (dynamic shared memory: P keys, P a power of two >=
// 2 kSortThreads). An exact histogram of the selection weights over fine logit bins
// (1/64 of a log2 unit) finds, for each selection, the bin where its prefix ends and the
// mass of the bins above it. Every cluster above that bin is in, every one below is out;
// only the clusters of the (at most two) boundary bins are bitonic-sorted in shared memory
// and scanned, usually a few dozen keys. Grid (B * Hq), block kSortThreads.
template <int kOnDemand = 0>  // compiled on demand (decode_common.cuh)
__global__ void __launch_bounds__(kSortThreads)
doublep_select_sorted(const float* __restrict__ xb, const long long* __restrict__ sizes,
                      const long long* __restrict__ lens,
                      const long long* __restrict__ window_start, unsigned char* __restrict__ codes,
                      double* __restrict__ stats, unsigned long long* __restrict__ rows_read,
                      int Hkv, int G, int C, long long cap, int n_sink, double p1, double p2,
                      int counts, int count, int P) {
  STOCHATTN_PDL_ENTRY();
  constexpr int W = kSortThreads / 32;
  constexpr int kOwn = kBins / kSortThreads;  // bins per thread in the boundary search
  static_assert(kBins % kSortThreads == 0, "kBins");
  unsigned long long* keys = reinterpret_cast<unsigned long long*>(dynamic_smem());
  __shared__ unsigned long long red[W];
  __shared__ float redf[W];
  __shared__ unsigned long long hist[kBins];
  __shared__ unsigned long long lane_w[kSortThreads];
  __shared__ unsigned long long s_above[2];
  __shared__ int s_bin[2], s_cut[2], s_nk, s_n1;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const SelectRow r(blockIdx.x, Hkv, G, lens, cap, rows_read);
  const int row = r.row, b = r.b, g = r.g;
  const long long pair = r.pair, L = r.L;
  const float* x = xb + (long long)row * C;
  const long long* sz = sizes + pair * C;
  unsigned char* code_of = codes + pair * C * 8 + g;  // code of cluster c: code_of[8 c]

  // Pass 1: the largest logit, then the totals (selection weights, estimated masses, live
  // clusters) and the selection weight of every bin, summed exactly in integers.
  // The thread's logits stay in registers for both passes (all loads in flight at once).
  float xr[kSortPer];
#pragma unroll
  for (int j = 0; j < kSortPer; ++j) {
    const int c = j * kSortThreads + tid;
    xr[j] = c < C ? x[c] : STOCHATTN_NEG_INF;
  }
  float mx = STOCHATTN_NEG_INF;
#pragma unroll
  for (int j = 0; j < kSortPer; ++j) mx = fmaxf(mx, xr[j]);
  const float mxall = block_max_n<W>(mx, redf);
  const bool none = mxall == STOCHATTN_NEG_INF || L == 0;
  for (int i = tid; i < kBins; i += kSortThreads) hist[i] = 0;
  if (tid == 0) {
    s_nk = 0;
    s_n1 = 0;
  }
  __syncthreads();
  unsigned long long sel_w = 0, real_w = 0, live_n = 0, tail_w = 0;
#pragma unroll
  for (int j = 0; j < kSortPer; ++j) {
    if (j * kSortThreads >= C) break;  // uniform
    const int c = j * kSortThreads + tid;
    const float xc = xr[j];
    const bool live = !none && xc != STOCHATTN_NEG_INF;
    unsigned long long ws = 0;
    if (live) {
      const unsigned long long w = __float2ull_rn(exp2f(xc - mxall) * kFixedOne);
      ws = counts ? 1ull : w;
      real_w += w;
      sel_w += ws;
      live_n += 1;
    }
    // One shared atomic per distinct bin of the warp: the lanes of a bin leave their
    // weights in `lane_w`, the lowest of them adds the sum. The catch-all last bin (often
    // most of the clusters, far below the max) is summed in registers instead.
    int bin = live ? bin_of(xc, mxall) : -1;
    if (bin == kBins - 1) {
      tail_w += ws;
      bin = -1;
    }
    lane_w[tid] = ws;
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    __syncwarp();
    if (bin >= 0 && lane == __ffs(peers) - 1) {
      unsigned long long sum = 0;
      for (unsigned m = peers; m; m &= m - 1) sum += lane_w[warp * 32 + __ffs(m) - 1];
      atomicAdd(&hist[bin], sum);
    }
    __syncwarp();
  }
  unsigned long long total_w, n_live, total_real, total_tail;
  block_exclusive_scan_u64(tail_w, red, &total_tail);
  if (tid == 0) hist[kBins - 1] = total_tail;  // read after the barriers of the next scans
  block_exclusive_scan_u64(sel_w, red, &total_w);
  block_exclusive_scan_u64(live_n, red, &n_live);
  block_exclusive_scan_u64(real_w, red, &total_real);

  // Selection 0 is C_p, selection 1 C_exact. A selection is "every live cluster" for p >= 1
  // (or top-k with count >= live), else the shortest prefix whose mass reaches its target
  // (>= 1: p > 0 and count > 0). C_exact is C_p itself for top-k, for p2 >= 1, and when its
  // target is not below C_p's (the reference keeps C_exact within C_p).
  const unsigned long long target0 =
      counts ? (unsigned long long)count : (unsigned long long)ceil(p1 * (double)total_w);
  const unsigned long long target1 = (unsigned long long)ceil(p2 * (double)total_w);
  const bool active0 = counts ? (unsigned long long)count < n_live : p1 < 1.0;
  const bool follow = counts || !(p2 < 1.0) || (active0 && target1 >= target0);

  // Boundary bins: thread t owns bins [kOwn t, kOwn t + kOwn); the bin where a selection's
  // running mass first reaches its target is its boundary (kBins: no boundary, all in).
  unsigned long long part = 0;
#pragma unroll
  for (int i = 0; i < kOwn; ++i) part += hist[kOwn * tid + i];
  unsigned long long hist_total;
  const unsigned long long before = block_exclusive_scan_u64(part, red, &hist_total);
  if (tid < 2) {
    s_bin[tid] = kBins;
    s_above[tid] = 0;
  }
  __syncthreads();
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const bool act = s == 0 ? active0 : !follow;
    const unsigned long long t = s == 0 ? target0 : target1;
    if (!none && act && before < t && before + part >= t) {
      unsigned long long run = before;
#pragma unroll
      for (int i = 0; i < kOwn; ++i) {
        const unsigned long long h = hist[kOwn * tid + i];
        if (run + h >= t) {
          s_bin[s] = kOwn * tid + i;
          s_above[s] = run;
          break;
        }
        run += h;
      }
    }
  }
  __syncthreads();
  const int bin_p = s_bin[0];                    // C_p: bins < bin_p, and a prefix of bin_p
  const int bin_e = follow ? bin_p : s_bin[1];  // C_exact likewise (bin_e <= bin_p)
  const bool two = !follow && bin_e != bin_p;    // two boundary bins: bin_e's keys first
  const bool seg_e = !follow && bin_e < kBins, seg_p = bin_p < kBins;

  // Pass 2: every cluster off the boundary bins gets its code; the keys of the boundary
  // bins go to shared memory (any order: they are sorted next).
  unsigned long long n_p = 0, n_e = 0, tok_e = 0, mass_p = 0;
#pragma unroll
  for (int j = 0; j < kSortPer; ++j) {
    if (j * kSortThreads >= C) break;  // uniform
    const int c = j * kSortThreads + tid;
    const float xc = xr[j];
    const bool live = !none && xc != STOCHATTN_NEG_INF;
    const int bin = live ? bin_of(xc, mxall) : kBins;
    const bool at_e = live && seg_e && bin == bin_e;
    const bool in = at_e || (live && seg_p && bin == bin_p);
    const unsigned ballot = __ballot_sync(0xffffffffu, in);
    if (ballot) {  // uniform
      const unsigned ballot_e = __ballot_sync(0xffffffffu, at_e && two);
      int at = 0;
      if (lane == 0) {
        at = atomicAdd(&s_nk, __popc(ballot));
        if (ballot_e) atomicAdd(&s_n1, __popc(ballot_e));
      }
      at = __shfl_sync(0xffffffffu, at, 0) + __popc(ballot & ((1u << lane) - 1u));
      if (in)
        keys[at] = ((unsigned long long)orderable(xc) << 32) |
                   (unsigned long long)(0xFFFFFFFFu - (unsigned)c);
    }
    if (c < C && !in) {
      const unsigned char code = !live ? 0 : (bin < bin_e ? 2 : (bin < bin_p ? 1 : 0));
      code_of[8 * (long long)c] = code;
      if (code) {
        n_p += 1;
        mass_p += __float2ull_rn(exp2f(xc - mxall) * kFixedOne);
        if (code == 2) {
          n_e += 1;
          tok_e += (unsigned long long)sz[c];
        }
      }
    }
  }
  if (tid < 2) s_cut[tid] = 0;
  __syncthreads();
  const int nk = s_nk;
  const int n1 = two ? s_n1 : 0;  // sorted positions [0, n1): bin_e's keys (when two)
  int Q = 2;
  while (Q < nk) Q <<= 1;
  for (int i = nk + tid; i < Q; i += kSortThreads) keys[i] = 0ull;  // padding sorts last

  // Bitonic sort of the boundary keys, descending.
  if (nk > 1) {  // uniform
    for (int k = 2; k <= Q; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        __syncthreads();
        for (int t = tid; t < Q / 2; t += kSortThreads) {
          const int i = 2 * t - (t & (j - 1));
          const int o = i + j;
          const unsigned long long a = keys[i], c = keys[o];
          const bool desc = (i & k) == 0;
          if (desc ? a < c : a > c) {
            keys[i] = c;
            keys[o] = a;
          }
        }
      }
    }
  }
  __syncthreads();

  // Thread tid owns sorted positions [tid E, tid E + E): the exclusive prefix of the
  // selection weights, less bin_e's total in bin_p's run, plus the mass of the bins above,
  // is the running mass of the full key order; each selection ends where it reaches its
  // target (exactly one position of its boundary bin).
  const int E = (Q + kSortThreads - 1) / kSortThreads;
  unsigned long long mine = 0;
  for (int e = 0; e < E; ++e) {
    const int i = tid * E + e;
    if (i < nk) mine += counts ? 1ull : weight_of_key(keys[i], mxall);
  }
  unsigned long long k_total;
  const unsigned long long excl = block_exclusive_scan_u64(mine, red, &k_total);
  unsigned long long run = excl;
  for (int e = 0; e < E; ++e) {
    const int i = tid * E + e;
    if (i >= nk) break;
    const unsigned long long w = counts ? 1ull : weight_of_key(keys[i], mxall);
    const bool first_run = i < n1 || !two;  // bin_e's keys, or the single boundary bin
    const unsigned long long within = first_run ? run : run - hist[bin_e];
    if (!follow && (two ? i < n1 : true)) {  // selection 1 ends in bin_e
      const unsigned long long m = s_above[1] + within;
      if (m < target1 && m + w >= target1) s_cut[1] = i + 1;
    }
    if (seg_p && (two ? i >= n1 : true)) {  // selection 0 ends in bin_p
      const unsigned long long m = s_above[0] + within;
      if (m < target0 && m + w >= target0) s_cut[0] = i + 1;
    }
    run += w;
  }
  __syncthreads();
  const int cut0 = s_cut[0], cut1 = s_cut[1];

  // Codes of the boundary keys, and the statistics of C_p and C_exact.
  for (int i = tid; i < nk; i += kSortThreads) {
    const unsigned long long key = keys[i];
    const int c = (int)(0xFFFFFFFFu - (unsigned)(key & 0xFFFFFFFFull));
    unsigned char code;
    if (follow) {
      code = i < cut0 ? 2 : 0;
    } else if (two) {
      code = i < n1 ? (i < cut1 ? 2 : 1) : (i < cut0 ? 1 : 0);
    } else {
      code = i < cut1 ? 2 : (i < cut0 ? 1 : 0);
    }
    code_of[8 * (long long)c] = code;
    if (code) {
      n_p += 1;
      mass_p += weight_of_key(key, mxall);
      if (code == 2) {
        n_e += 1;
        tok_e += (unsigned long long)sz[c];
      }
    }
  }
  if (stats) {
    block_exclusive_scan_u64(n_p, red, &n_p);
    block_exclusive_scan_u64(n_e, red, &n_e);
    block_exclusive_scan_u64(mass_p, red, &mass_p);
    block_exclusive_scan_u64(tok_e, red, &tok_e);
    if (tid == 0) {
      double* st = stats + (long long)row * 4;
      const long long ws = window_start[b];
      const long long sinks = L < n_sink ? L : n_sink;
      const long long window = L > ws ? L - ws : 0;
      st[0] = (double)n_p;
      st[1] = (double)n_e;
      st[2] = L == 0 ? 0.0 : (double)(sinks + window + (long long)tok_e);
      st[3] = L == 0 ? 0.0 : (mxall == STOCHATTN_NEG_INF ? 1.0 : (double)mass_p / (double)total_real);
    }
  }
}

// ---- 3. attention over exact tokens and approximated clusters ------------------------

// cp.async copies of this thread's pieces of list entries [i0, i0 + kTileRows) of one
// (b, kv head) stream from `base`: row `rows[i]` at base + rows[i] * D * 2 (contiguous,
// `offs` null), or, paged, at base + offs[i] (the row's byte offset in the pool, which
// doublep_rows found through the page table), so the pipeline never touches the page
// table and keeps the registers of the contiguous path. Entries at or past `count`, and entries whose `need`
// byte is 0, are zero-filled and read nothing (the same thread/piece layout as
// load_tile_async, so no CTA barrier is needed). Named apart from decode_common.cuh's
// load_rows_async (rows by range, not by list).
template <int D>
__device__ __forceinline__ void load_list_rows_async(unsigned char* stage,
                                                     const unsigned char* base,
                                                     const int* __restrict__ rows,
                                                     const long long* offs, int i0, int count,
                                                     const unsigned char* need = nullptr) {
  using Tl = Tiling<D>;
  constexpr int kRowBytes = D * 2;
  const int lr = threadIdx.x % Tl::kLanesPerRow, rg = threadIdx.x / Tl::kLanesPerRow;
#pragma unroll
  for (int p = 0; p < Tl::kRowsPerThread; ++p) {
    const int i = i0 + rg + p * Tl::kRowGroups;
    // `need` (optional, shared memory): entries whose byte is 0 are zero-filled, unread.
    const bool valid = i < count && (need == nullptr || need[i] != 0);
    const long long at = offs ? offs[i] : (long long)rows[i] * kRowBytes;  // uniform branch
    // A zero-filled copy still needs a legal address: the stream's base.
    const unsigned char* src = valid ? base + at + lr * 16 : base;
    cp_async16(stage + (rg + p * Tl::kRowGroups) * kRowBytes + lr * 16, src, valid);
  }
}

// Grid (slices, Hkv, B), kRowThreads. Length: the index's, clamped to the page table's
// when paged (every row id of the list, hence every K/V row doublep_attend reads, lies in
// the sequence's pages); paged, each listed row's byte offset in the pool (from its KV
// head's base: the same for K and V) goes to row_offs, next to its id, so that
// doublep_attend reads rows without touching the page table. The tokens of slice [slice kSliceTokens, + kSliceTokens)
// of (b, kv head) that some head of the group computes exactly, in position order, with
// the bit mask of those heads (sinks and window: every head; a middle token: the heads
// whose code for its cluster is 2): row ids into rows[(pair * slices + slice) *
// kSliceTokens + i], masks likewise, their number into counts[pair * slices + slice].
// rows_read (optional, zeroed by the selection): the union's rows per (b, kv head).
// SAMPLE (the sampled variant): the list also holds the middle tokens that some head
// samples (code 1), with those heads' bits in amasks (hmasks keeps the exact heads); every
// (head, token) of the sequence gets -inf in the logit stash (rows b * Hq + h, n_pad
// columns; doublep_attend then writes the sampled ones); lens32[b] gets
// the clamped length; rows_read[pairs + pair] (optional) counts the rows some head computes
// exactly (rows_read[pair] all listed rows).
// The minimum CTAs per SM hold the registers where they were before the page table came
// (ptxas gave 32 and 40 without it: 8 and 6 CTAs of 256 threads), so the contiguous path
// keeps its occupancy.
template <int GMAX, bool SAMPLE>
__global__ void __launch_bounds__(kRowThreads, SAMPLE ? 6 : 8)
doublep_rows(const long long* __restrict__ lens, const long long* __restrict__ window_start,
             const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
             const int* __restrict__ kv_last_page_len, int page_size, long long page_stride,
             int row_stride, int head_stride, const int* __restrict__ labels,
             const unsigned char* __restrict__ codes, int* __restrict__ rows,
             long long* __restrict__ row_offs, unsigned char* __restrict__ hmasks,
             int* __restrict__ counts,
             unsigned long long* __restrict__ rows_read, int Hkv, int G, long long cap,
             long long NL, int C, int n_sink, int slices, unsigned char* __restrict__ amasks,
             float* __restrict__ stash, long long n_pad, int* __restrict__ lens32) {
  STOCHATTN_PDL_ENTRY();
  constexpr int W = kRowThreads / 32;
  __shared__ int warp_counts[W];
  const int slice = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const long long pair = (long long)b * Hkv + kvh;
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  // The page table's length (cap when contiguous) and the index's clamped to it.
  const long long Lt = stream_length(nullptr, table, b, cap);
  const long long Li = clamp_len(lens, b, cap);
  const long long L = Li < Lt ? Li : Lt;
  const long long ws = window_start[b];
  const long long sinks = n_sink < L ? n_sink : L;
  const unsigned all = (1u << G) - 1u;
  const int* lab = labels + pair * NL;
  const long long t0 = (long long)slice * kSliceTokens + (long long)tid * kScanTokens;
  // All label and code loads issued before any is used (the scan is latency-bound); the
  // labels as two 16-byte loads where the rows are 16-byte aligned (NL % 4 == 0).
  int c[kScanTokens];
  static_assert(kScanTokens == 8, "two int4 label loads");
  if ((NL & 3) == 0 && t0 + kScanTokens <= NL && t0 < L) {
    const int4 lo = reinterpret_cast<const int4*>(lab + t0)[0];
    const int4 hi = reinterpret_cast<const int4*>(lab + t0)[1];
    c[0] = lo.x; c[1] = lo.y; c[2] = lo.z; c[3] = lo.w;
    c[4] = hi.x; c[5] = hi.y; c[6] = hi.z; c[7] = hi.w;
  } else {
#pragma unroll
    for (int j = 0; j < kScanTokens; ++j) c[j] = t0 + j < L ? lab[t0 + j] : -1;  // L <= NL
  }
#pragma unroll
  for (int j = 0; j < kScanTokens; ++j) {
    const long long t = t0 + j;
    if (!(t < L && t >= sinks && t < ws)) c[j] = -1;
  }
  unsigned long long word[kScanTokens];
#pragma unroll
  for (int j = 0; j < kScanTokens; ++j)
    word[j] = (c[j] >= 0 && c[j] < C) ? codes_of(codes, pair, C, c[j]) : 0ull;
  unsigned char masks[kScanTokens], amask[kScanTokens];
  int mine = 0, mine_exact = 0;
  unsigned listed = 0;  // bit j: token t0 + j is listed
#pragma unroll
  for (int j = 0; j < kScanTokens; ++j) {
    const long long t = t0 + j;
    const bool middle = t < L && t >= sinks && t < ws;
    const unsigned m = t >= L ? 0u : (middle ? heads_with<GMAX>(word[j], G, 2u) : all);
    const unsigned a = SAMPLE && middle ? heads_with<GMAX>(word[j], G, 1u) : 0u;
    masks[j] = (unsigned char)m;
    amask[j] = (unsigned char)a;
    mine += (m | a) != 0;
    mine_exact += m != 0;
    listed |= (m | a) ? 1u << j : 0u;
  }
  if constexpr (SAMPLE) {
    // -inf for every (head, token) of the sequence: doublep_attend, which runs next,
    // overwrites the sampled ones. 32-byte aligned float4 stores (t0 is a multiple of 8,
    // n_pad of 64). Paged: up to the page table's length (at least L), which
    // santa_prop_tiles / santa_prop_sample take as the length, so a token the index does
    // not cover yet has zero weight.
    static_assert(kScanTokens == 8, "two float4 stores per head");
    const long long Lfill = table.paged() ? Lt : L;
    const long long head0 = (long long)b * Hkv * G + (long long)kvh * G;
    const float4 ninf = make_float4(STOCHATTN_NEG_INF, STOCHATTN_NEG_INF, STOCHATTN_NEG_INF,
                                    STOCHATTN_NEG_INF);
    for (int g = 0; g < G; ++g) {
      float* xs = stash + (head0 + g) * n_pad + t0;
      if (t0 + kScanTokens <= Lfill) {
        reinterpret_cast<float4*>(xs)[0] = ninf;
        reinterpret_cast<float4*>(xs)[1] = ninf;
      } else {
        for (int j = 0; j < kScanTokens && t0 + j < Lfill; ++j) xs[j] = STOCHATTN_NEG_INF;
      }
    }
    if (slice == 0 && kvh == 0 && tid == 0) lens32[b] = (int)L;
  }
  int incl = mine;  // inclusive warp scan of the per-thread counts
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == 31) warp_counts[warp] = incl;
  __syncthreads();
  int at = incl - mine, total = 0;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    at += w < warp ? warp_counts[w] : 0;
    total += warp_counts[w];
  }
  const long long base = (pair * slices + slice) * (long long)kSliceTokens;
  if (table.paged()) {  // the listed rows' byte offsets, one at a time (few registers)
    int i = at;
#pragma unroll 1
    for (unsigned bits = listed; bits; bits &= bits - 1)
      row_offs[base + i++] = paged_row_offset(table, b, t0 + __ffs(bits) - 1);
  }
#pragma unroll
  for (int j = 0; j < kScanTokens; ++j) {
    if (masks[j] | amask[j]) {
      rows[base + at] = (int)(t0 + j);
      hmasks[base + at] = masks[j];
      if constexpr (SAMPLE) amasks[base + at] = amask[j];
      ++at;
    }
  }
  if (tid == 0) {
    counts[pair * slices + slice] = total;
    if (rows_read && total) atomicAdd(rows_read + pair, (unsigned long long)total);
  }
  if constexpr (SAMPLE) {
    if (rows_read) {  // rows some head computes exactly (V rows read besides the draws)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        mine_exact += __shfl_xor_sync(0xffffffffu, mine_exact, off);
      if (lane == 0 && mine_exact)
        atomicAdd(rows_read + (long long)gridDim.z * Hkv + pair, (unsigned long long)mine_exact);
    }
  }
}

// Centroid pseudo-tokens of the C_approx clusters in [c0, c1) for the G heads: one warp
// per cluster row, lane owning D / 32 features; then the warps' states are combined.
template <typename T, int D, int GMAX>
__device__ __forceinline__ void attend_approx_clusters(
    const float* __restrict__ xb, const long long* __restrict__ sizes,
    const float* __restrict__ value_sums, const unsigned char* __restrict__ codes,
    unsigned char* smem, long long pair, long long head0, int G, int C, int c0, int c1,
    float* __restrict__ part_o, float* __restrict__ part_ml, int num_chunks, int chunk) {
  constexpr int PER = D / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float m[GMAX], l[GMAX], acc[GMAX][PER];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = STOCHATTN_NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < PER; ++e) acc[g][e] = 0.f;
  }
  // A warp takes 32 clusters per round, lane i reading cluster i's codes, size and logits
  // (independent loads); then the approximated ones are added two at a time, both value
  // rows in flight together.
  for (int base = c0 + warp * 32; base < c1; base += kWarps * 32) {
    const int c = base + lane;
    const unsigned amask = c < c1 ? heads_with<GMAX>(codes_of(codes, pair, C, c), G, 1u) : 0u;
    float inv = 0.f, xl[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) xl[g] = STOCHATTN_NEG_INF;
    if (amask) {
      inv = 1.f / (float)sizes[pair * C + c];  // an approximated cluster is non-empty
#pragma unroll
      for (int g = 0; g < GMAX; ++g)
        if ((amask >> g) & 1u) xl[g] = xb[(head0 + g) * C + c];
    }
    unsigned todo = __ballot_sync(0xffffffffu, amask != 0);
    while (todo) {  // uniform over the warp
      int src[2];
      src[0] = __ffs(todo) - 1;
      todo &= todo - 1;
      src[1] = todo ? __ffs(todo) - 1 : -1;
      if (todo) todo &= todo - 1;
      float vf[2][PER];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (src[r] >= 0) {
          load_floats<PER>(value_sums + (pair * C + base + src[r]) * D + lane * PER, vf[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (src[r] < 0) break;
        const float rinv = __shfl_sync(0xffffffffu, inv, src[r]);
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          const float xg = __shfl_sync(0xffffffffu, xl[g], src[r]);
          if (g < G && xg != STOCHATTN_NEG_INF) {  // head g approximates this cluster
            const float mn = fmaxf(m[g], xg);
            const float corr = exp2f(m[g] - mn);  // 0 on the first cluster (m = -inf)
            const float w = exp2f(xg - mn);
            l[g] = l[g] * corr + w;
#pragma unroll
            for (int e = 0; e < PER; ++e) acc[g][e] = acc[g][e] * corr + w * (vf[r][e] * rinv);
            m[g] = mn;
          }
        }
      }
    }
  }
  float* sm_m = reinterpret_cast<float*>(smem);
  float* sm_l = sm_m + kWarps * GMAX;
  float* sm_acc = sm_l + kWarps * GMAX;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
#pragma unroll
      for (int e = 0; e < PER; ++e) sm_acc[(warp * GMAX + g) * D + lane * PER + e] = acc[g][e];
      if (lane == 0) {
        sm_m[warp * GMAX + g] = m[g];
        sm_l[warp * GMAX + g] = l[g];
      }
    }
  }
  __syncthreads();
  combine_warps_and_write<T, D, GMAX>(smem, G, head0, nullptr, part_o, part_ml, num_chunks,
                                      chunk);
}

// Copy entries [b0, b0 + n) of the (b, kv head)'s row list (the slices of doublep_rows,
// concatenated) into list / hmask (and amask, when amasks is not null) in shared memory,
// and, for a paged cache (offs not null), the rows' byte offsets (row_offs, doublep_rows').
// Every warp walks the slice counts (32 at a time, warp scan) and, for each slice that
// overlaps, the whole CTA copies the overlap; the caller synchronises afterwards.
__device__ __forceinline__ void stage_row_list(const int* __restrict__ rows,
                                               const unsigned char* __restrict__ hmasks,
                                               const int* __restrict__ counts, long long pair,
                                               int slices, int b0, int n, int* list,
                                               unsigned char* hmask,
                                               const unsigned char* __restrict__ amasks,
                                               unsigned char* amask,
                                               const long long* __restrict__ row_offs,
                                               long long* offs) {
  const int lane = threadIdx.x % 32;
  int pre = 0;  // entries in the slices before this group of 32
  for (int s0 = 0; s0 < slices && pre < b0 + n; s0 += 32) {
    const int cnt = s0 + lane < slices ? counts[pair * slices + s0 + lane] : 0;
    int incl = cnt;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    const int first = pre + incl - cnt;
    const int lo = max(first, b0), hi = min(first + cnt, b0 + n);
    unsigned overlap = __ballot_sync(0xffffffffu, hi > lo);
    while (overlap) {
      const int src = __ffs(overlap) - 1;
      overlap &= overlap - 1;
      const int slo = __shfl_sync(0xffffffffu, lo, src);
      const int shi = __shfl_sync(0xffffffffu, hi, src);
      const int sfirst = __shfl_sync(0xffffffffu, first, src);
      const long long base = (pair * slices + s0 + src) * (long long)kSliceTokens + (slo - sfirst);
      for (int i = threadIdx.x; i < shi - slo; i += kThreads) {
        list[slo - b0 + i] = rows[base + i];
        hmask[slo - b0 + i] = hmasks[base + i];
        if (amasks) amask[slo - b0 + i] = amasks[base + i];
      }
      if (offs) {  // a loop of its own: fused, the copies' registers grew (ptxas -v)
        for (int i = threadIdx.x; i < shi - slo; i += kThreads)
          offs[slo - b0 + i] = row_offs[base + i];
      }
    }
    pre += __shfl_sync(0xffffffffu, incl, 31);
  }
}

// Grid (tok_chunks + cl_chunks, Hkv, B), kThreads. Token CTA `chunk` of (b, kv head) takes
// an equal share of its row list (doublep_rows) and streams those K and V rows through the
// cp.async pipeline of exact decode, kListCap entries at a time (the union over the group
// is read once; a head's logit is -inf on rows it does not need); cluster CTAs add the
// C_approx clusters as pseudo-tokens. With a single chunk in all the CTA writes `out`
// directly; otherwise partials. Dynamic shared memory: `list_off` bytes for the pipeline
// (reused by the merge), then kListCap int32 row ids and kListCap head-mask bytes (and,
// SAMPLE, kListCap sampled-head bytes), padded to 16 bytes, and for a paged cache kListCap
// int64 row byte offsets at `list_offs` (row_offs staged: K and V share them, since their
// pools share the strides).
// SAMPLE (the sampled variant; no cluster CTAs): the list also holds rows that only some
// heads sample (amasks); V is read only for rows some head computes exactly, and the
// natural-log logit of every sampled (head, row) goes to the stash (rows b Hq + h, n_pad
// columns) for santa_prop_tiles / santa_prop_sample.
template <typename T, int D, int GMAX, bool SAMPLE>
__global__ void __launch_bounds__(kThreads)
doublep_attend(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
               const int* __restrict__ kv_last_page_len, int page_size, long long page_stride,
               int row_stride, int head_stride, const int* __restrict__ rows,
               const long long* __restrict__ row_offs, const unsigned char* __restrict__ hmasks,
               const int* __restrict__ counts, const unsigned char* __restrict__ codes,
               const float* __restrict__ xb, const long long* __restrict__ sizes,
               const float* __restrict__ value_sums, T* __restrict__ out,
               float* __restrict__ part_o, float* __restrict__ part_ml, int Hkv, int G,
               long long N, int C, int slices, int tok_chunks, int cl_per_chunk, int num_chunks,
               int list_off, int list_offs, float scale_log2,
               const unsigned char* __restrict__ amasks,
               float* __restrict__ stash, long long n_pad) {
  STOCHATTN_PDL_ENTRY();
  using Tl = Tiling<D>;
  constexpr int LPR = Tl::kLanesPerRow;
  constexpr int RPT = Tl::kRowsPerThread;
  constexpr int ROWS = Tl::kTileRows;
  constexpr int RG = Tl::kRowGroups;

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int lr = tid % LPR, rg = tid / LPR;
  const long long head0 = (long long)b * Hkv * G + (long long)kvh * G;
  const long long pair = (long long)b * Hkv + kvh;
  unsigned char* smem = dynamic_smem();

  if (!SAMPLE && chunk >= tok_chunks) {
    const int c0 = (chunk - tok_chunks) * cl_per_chunk;
    attend_approx_clusters<T, D, GMAX>(xb, sizes, value_sums, codes, smem, pair, head0, G, C, c0,
                                       min(C, c0 + cl_per_chunk), part_o, part_ml, num_chunks,
                                       chunk);
    return;
  }

  // This CTA's share [lo, hi) of the row list.
  __shared__ int s_total;
  if (warp == 0) {
    int t = 0;
    for (int s = lane; s < slices; s += 32) t += counts[pair * slices + s];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
    if (lane == 0) s_total = t;
  }
  __syncthreads();
  const int total = s_total;
  const int per = (total + tok_chunks - 1) / tok_chunks;
  const int lo = chunk * per, hi = min(total, lo + per);
  if (lo >= hi) {
    write_empty_group<T, D>(G, head0, out, part_o, part_ml, num_chunks, chunk);
    return;
  }

  int* list = reinterpret_cast<int*>(smem + list_off);
  unsigned char* hmask = reinterpret_cast<unsigned char*>(list + kListCap);
  unsigned char* amask = hmask + kListCap;  // SAMPLE only
  float qf[GMAX][8];
  load_group_queries<T, D, GMAX>(q, head0, G, lr, scale_log2, qf);
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const unsigned char* kbase = kv_rows<D>(k, table, b, kvh, Hkv, N).base;
  const unsigned char* vbase = kv_rows<D>(v, table, b, kvh, Hkv, N).base;
  long long* offs = table.paged() ? reinterpret_cast<long long*>(smem + list_offs) : nullptr;
  float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = STOCHATTN_NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }
  // Non-finite input (decode_common.cuh): a head with a bad query starts with l = NaN (its
  // partial is NaN even if this CTA holds no row it computes) and a zeroed query; below, an
  // infinite logit of a row a head computes or samples becomes NaN (inf_to_nan).
  {
    const unsigned qbad = query_faults<GMAX>(qf, G);
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
      if ((qbad >> g) & 1u) l[g] = STOCHATTN_NAN;
  }
  for (int b0 = lo; b0 < hi; b0 += kListCap) {
    const int count = min(kListCap, hi - b0);
    stage_row_list(rows, hmasks, counts, pair, slices, b0, count, list, hmask,
                   SAMPLE ? amasks : nullptr, amask, row_offs, offs);
    __syncthreads();
    const int ntiles = (count + ROWS - 1) / ROWS;
    const unsigned char* vneed = SAMPLE ? hmask : nullptr;  // V of the exact rows only
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < ntiles) {
        unsigned char* st = smem + s * 2 * kStageBytes;
        load_list_rows_async<D>(st, kbase, list, offs, s * ROWS, count);
        load_list_rows_async<D>(st + kStageBytes, vbase, list, offs, s * ROWS, count, vneed);
      }
      cp_async_commit();
    }
    int rd = 0, wr = kStages - 1;
    for (int it = 0; it < ntiles; ++it) {
      cp_async_wait<kStages - 2>();
      {
        const int nx = it + kStages - 1;
        if (nx < ntiles) {
          unsigned char* st = smem + wr * 2 * kStageBytes;
          load_list_rows_async<D>(st, kbase, list, offs, nx * ROWS, count);
          load_list_rows_async<D>(st + kStageBytes, vbase, list, offs, nx * ROWS, count, vneed);
        }
        cp_async_commit();
      }
      const unsigned char* sk = smem + rd * 2 * kStageBytes;
      rd = rd + 1 == kStages ? 0 : rd + 1;
      wr = wr + 1 == kStages ? 0 : wr + 1;
      const unsigned char* sv = sk + kStageBytes;

      float x[RPT * GMAX];
      group_partial_dots<T, D, GMAX>(sk, rg, lr, G, qf, x);
      row_group_sums<LPR>(x, lr);
      // A head sees only the rows it computes exactly; entries past `count` none. SAMPLE:
      // every lane of the row group holds every sum, and lane g % LPR first stashes head
      // g's natural-log logit of the rows it samples.
#pragma unroll
      for (int p = 0; p < RPT; ++p) {
        const int i = it * ROWS + rg + p * RG;
        const unsigned hm = i < count ? hmask[i] : 0u;
        const unsigned am = SAMPLE && i < count ? amask[i] : 0u;
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          const float xg = inf_to_nan(x[p * GMAX + g]);
          if (SAMPLE && ((am >> g) & 1u) && lr == g % LPR)
            stash[(head0 + g) * n_pad + list[i]] = xg * 0.69314718055994531f;
          x[p * GMAX + g] = ((hm >> g) & 1u) ? xg : STOCHATTN_NEG_INF;
        }
      }
      accumulate_stage<T, D, GMAX>(x, sv, rg, lr, G, m, l, acc);
    }
    cp_async_wait<0>();
    __syncthreads();  // the stages and the list are refilled next round / by the merge
  }
  finish_group_state<T, D, GMAX>(m, l, acc, G, smem, head0, out, part_o, part_ml, num_chunks,
                                 chunk);
}

// ---- diagnostics: the true softmax mass of what the selection covers ----------------

// Grid (chunks, Hkv, B), kLogitThreads. Per (head, chunk): (m, sum of all weights, sum of
// the covered weights), log2 domain, into part[(row * chunks + chunk) * 3]. Covered: sinks,
// window and the tokens of the clusters with a non-zero code (C_p). One warp per token.
template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kLogitThreads)
doublep_true_mass(const T* __restrict__ q, const T* __restrict__ k,
                  const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
                  const int* __restrict__ kv_last_page_len, int page_size,
                  long long page_stride, int row_stride, int head_stride,
                  const long long* __restrict__ lens, const long long* __restrict__ window_start,
                  const int* __restrict__ labels, const unsigned char* __restrict__ codes,
                  float* __restrict__ part, int Hkv, int G, long long N, long long NL, int C,
                  int n_sink, long long chunk_len, float scale_log2) {
  STOCHATTN_PDL_ENTRY();
  constexpr int PER = D / 32;
  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, chunks = gridDim.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long head0 = (long long)b * Hkv * G + (long long)kvh * G;
  const long long pair = (long long)b * Hkv + kvh;
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const KvRows<D> krows = kv_rows<D>(k, table, b, kvh, Hkv, N);
  const long long L = paged_length(table, b, clamp_len(lens, b, N < NL ? N : NL));
  const long long ws = window_start[b];
  const long long sinks = n_sink < L ? n_sink : L;
  float qf[GMAX][PER];
  load_lane_queries<T, D, GMAX>(q, head0, G, lane, scale_log2, qf);
  float m[GMAX], la[GMAX], lc[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = STOCHATTN_NEG_INF;
    la[g] = 0.f;
    lc[g] = 0.f;
  }
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, L);
  for (long long t = start + warp; t < end; t += kLogitWarps) {
    float kf[PER];
    load_elems<T, PER>(krows.template row_of<T>(t) + lane * PER, kf);
    unsigned covered = (1u << G) - 1u;
    if (t >= sinks && t < ws) {
      const int c = labels[pair * NL + t];
      covered = (c >= 0 && c < C) ? ((1u << G) - 1u) & ~heads_with<GMAX>(codes_of(codes, pair, C, c), G, 0u) : 0u;
    }
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < PER; ++e) s = fmaf(qf[g][e], kf[e], s);
        s = warp_sum(s);
        const float mn = fmaxf(m[g], s);
        const float corr = exp2f(m[g] - mn);
        const float w = exp2f(s - mn);
        la[g] = la[g] * corr + w;
        lc[g] = lc[g] * corr + (((covered >> g) & 1u) ? w : 0.f);
        m[g] = mn;
      }
    }
  }
  __shared__ float sm[kLogitWarps][GMAX][3];
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      sm[warp][g][0] = m[g];
      sm[warp][g][1] = la[g];
      sm[warp][g][2] = lc[g];
    }
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float M = STOCHATTN_NEG_INF;
    for (int w = 0; w < kLogitWarps; ++w) M = fmaxf(M, sm[w][g][0]);
    float A = 0.f, Cv = 0.f;
    if (M != STOCHATTN_NEG_INF) {
      for (int w = 0; w < kLogitWarps; ++w) {
        const float c = exp2f(sm[w][g][0] - M);
        A = fmaf(sm[w][g][1], c, A);
        Cv = fmaf(sm[w][g][2], c, Cv);
      }
    }
    float* out = part + ((head0 + g) * chunks + chunk) * 3;
    out[0] = M;
    out[1] = A;
    out[2] = Cv;
  }
}
