// S²ANTA-prop: unbiased sampled attention in three launches (docs/estimators.md, schedule "prop").
//
// K and V are contiguous (B, Hkv, N, D) or paged (FlashInfer's layout, read in place): every
// launch takes the page table after seq_lens (kv_rows.cuh; kv_indptr null: contiguous),
// reads the lengths through stream_length and the rows through KvRows (pass 1 the K rows
// of its chunk, pass 3 the V rows at the drawn indices, `row(J)`). The stash and the tile
// arrays are indexed by token position, not address, so a paged call draws the indices
// of the contiguous call with the same tokens and N, bit for bit.
//
// 1. santa_prop_logits, grid (num_chunks, Hkv, B) as exact_decode.cu: a CTA streams the K
//    rows of its chunk once for all G heads of the group through the cp.async pipeline and
//    writes the logits x = scale * q.k (fp32) to a stash `logits` (rows b * Hq + h, n_pad
//    columns). Nothing else: no shared-memory buffer and no CTA barrier (tile statistics
//    computed here cost a barrier per tile: measured 45% slower), so the loop is exact
//    decode's without V. The stash costs 4 G bytes per token against 2 D bytes of K (6% at
//    G = 4, D = 128) of traffic, and 4 B Hq n_pad bytes of workspace (537 MB at B = 32,
//    Hq = 32, N = 128k): step d walks the fp32 logits of the tiles that hold points, and
//    a narrower copy (or a recomputation in another reduction order) would move draws.
// 2. santa_prop_tiles: m_t = max x and l_t = sum exp(x - m_t) per sampling tile of
//    `tile_size` tokens and query head (fp32), 16-byte loads, a tile per lane segment.
// 3. santa_prop_sample, one CTA per (b, query head):
//    a. m* = max_t m_t; W_t = exp(m_t - m*) l_t and the prefix C_t in float64, Z = C_{T-1};
//       t_last = last tile with W_t > 0.
//    b. The S global points of the reference sampler (row = b*Hq + h, stream 0), float64:
//       systematic and stratified point m is computed on demand; iid writes its S + 1
//       exponential spacings and their prefix sums to a scratch buffer.
//    c. Tile t holds the points with C_{t-1} <= T_m Z < C_t (the reference's searchsorted,
//       compared in the same float64 arithmetic), i.e. the index range
//       [n(C_{t-1}), n(C_t)) with n(c) = #{m : T_m Z < c}; the last tile with mass takes
//       every point up to S. Each non-empty tile marks its first point and a max-scan over
//       m gives every point its tile (balanced even when one tile holds all points).
//    d. Each point becomes a row of its tile: one thread walks the tile's stashed logits
//       to the first row whose cumsum of exp(x - m_t) (float64) exceeds
//       (T_m Z - C_{t-1}) / exp(m_t - m*), or the last positive-weight row if none does.
//    e. Gather-and-add: out = (1/S) sum_m v[J_m] in fp32, in a fixed order
//       (deterministic); tiles without points read no V.
// Non-finite input (decode_common.cuh): pass 1 stashes a NaN for a non-finite logit of a
// row in the sequence (inf_to_nan; santa_prop_logits_tc makes the tile's l_t NaN), the
// tile maxima keep NaNs (nan_max), so a head that read a NaN or an infinity (in its query
// or a key) has a NaN Z, and step a writes its row NaN without drawing (indices -1).
// Rounding: l_t (fp32, a warp tree) and the cumsum of step d (float64, row order) differ
// in the last bits, and the float64 block scans do not promise a prefix that is
// non-decreasing to the last bit across thread segments. Either can move only a point
// lying within rounding of a tile or row boundary (the tests bound such index
// differences); every point still gets a tile <= t_last and a positive-weight row in it.
#include "decode_common.cuh"
#include "philox.cuh"
#include "bernoulli.cuh"
#include "tc_common.cuh"
#include "split_rules.cuh"

using namespace stochattn;

// ---- 1. logits ----------------------------------------------------------------------
// QHAT = false: q (B, Hq, D) of type T, times `scale`. QHAT = true (the Bernoulli score
// stage, bernoulli.cuh): q is bernoulli_qhat's fp32 q_hat, already scaled, and the 16-byte
// pieces of K whose features no head of the group keeps are not read (zero-filled).
template <typename T, int D, int GMAX, bool QHAT>
__global__ void __launch_bounds__(kThreads)
santa_prop_logits(const void* __restrict__ qv, const T* __restrict__ k,
                  const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
                  const int* __restrict__ kv_last_page_len, int page_size,
                  long long page_stride, int row_stride, int head_stride,
                  float* __restrict__ logits,
                  int Hkv, int G, long long N, long long chunk_len, long long n_pad,
                  float scale) {
  STOCHATTN_PDL_ENTRY();
  using Tl = Tiling<D>;
  constexpr int LPR = Tl::kLanesPerRow;
  constexpr int RPT = Tl::kRowsPerThread;
  constexpr int ROWS = Tl::kTileRows;
  constexpr int RG = Tl::kRowGroups;

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int Hq = Hkv * G;
  const int tid = threadIdx.x;
  const int lr = tid % LPR, rg = tid / LPR;

  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const long long len = stream_length(seq_lens, table, b, N);
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, len);
  if (start >= end) return;  // logits past the sequence are never read
  const long long head0 = (long long)b * Hq + (long long)kvh * G;
  float* xout = logits + head0 * n_pad;  // row g of the group at xout + g * n_pad

  unsigned char* smem = dynamic_smem();  // kStages * kStageBytes of K stages
  float qf[GMAX][8];
  bool need = true;  // this thread's 8 features of K are read
  if constexpr (QHAT) {
    load_group_queries_f32<D, GMAX>(static_cast<const float*>(qv), head0, G, lr, qf);
    need = false;
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) need = need || qf[g][e] != 0.f;
  } else {
    load_group_queries<T, D, GMAX>(static_cast<const T*>(qv), head0, G, lr, scale, qf);
  }

  const KvRows<D> krows = kv_rows<D>(k, table, b, kvh, Hkv, N);
  const long long ntiles = (end - start + ROWS - 1) / ROWS;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles)
      load_tile_async<D>(smem + s * kStageBytes, krows, start + (long long)s * ROWS, end, need);
    cp_async_commit();
  }

  int rd = 0, wr = kStages - 1;  // stage buffers read and refilled this iteration
  for (long long it = 0; it < ntiles; ++it) {
    // Each thread reads only the pieces it copied (decode_common.cuh): its own wait
    // suffices, and no CTA barrier is needed anywhere in this kernel.
    cp_async_wait<kStages - 2>();
    {
      const long long nx = it + kStages - 1;
      if (nx < ntiles) load_tile_async<D>(smem + wr * kStageBytes, krows, start + nx * ROWS, end, need);
      cp_async_commit();
    }
    const unsigned char* sk = smem + rd * kStageBytes;
    rd = rd + 1 == kStages ? 0 : rd + 1;
    wr = wr + 1 == kStages ? 0 : wr + 1;
    const long long row0 = start + it * ROWS;

    float x[RPT * GMAX];
    group_partial_dots<T, D, GMAX>(sk, rg, lr, G, qf, x);
    if constexpr (kReduce == 0) {
      // Butterfly: every lane holds every sum; lane j % LPR writes value j.
#pragma unroll
      for (int j = 0; j < RPT * GMAX; ++j) x[j] = row_group_sum<LPR>(x[j]);
#pragma unroll
      for (int j = 0; j < RPT * GMAX; ++j) {
        const int p = j / GMAX, g = j % GMAX;
        const int r = rg + p * RG;
        if (j % LPR == lr && g < G && row0 + r < end)
          xout[g * n_pad + row0 + r] = inf_to_nan(x[j]);
      }
    } else {
      // Reduce-scatter; each finished logit is written by the first of its owner lanes.
      using L = ScatterLayout<LPR, RPT * GMAX>;
      Scatter<LPR / 2, RPT * GMAX>::run(x, lr);
      if (lr % L::kSpan == 0) {
#pragma unroll
        for (int i = 0; i < L::kPer; ++i) {
          const int j = L::index(i, lr);
          const int p = j / GMAX, g = j % GMAX;
          const int r = rg + p * RG;
          if (g < G && row0 + r < end) xout[g * n_pad + row0 + r] = inf_to_nan(x[i]);
        }
      }
    }
  }
  cp_async_wait<0>();
}

// ---- 1 + 2 on the tensor cores: logits and tile statistics in one pass -------------------
// The exact-scores pass 1 as exact_decode_tc_chunk's S^T = Q K^T (tc_common.cuh: the
// group's heads as the mma's M rows, fp32 accumulate, then times `scale`), with the tile
// statistics of santa_prop_tiles computed on the way, so launch 2 is not needed. Grid
// (num_chunks, Hkv, B); chunk_len is a multiple of tile_size, so no sampling tile crosses
// a chunk. Each warp owns whole sampling tiles (spans w, w + WARPS, ... of the chunk) and
// streams their ROWS-row pieces through its own STAGES-deep cp.async ring of K (no CTA
// barrier); lane (grp, tig) writes the logits of head grp, keys 8 t + 2 tig + {0, 1}, and
// keeps that head's running tile max m and its partial sum of exp(x - m), rescaled when m
// grows (the quad's partial sums are added at the end of the tile). Rows past the sequence
// are not written and count as -inf. m_t and l_t equal santa_prop_tiles' up to the rounding
// of the fp32 sums (l_t >= 1: the max row adds exp(0)).
template <typename T, int D, int WARPS, int ROWS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, 1)
santa_prop_logits_tc(const T* __restrict__ q, const T* __restrict__ k,
                     const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                     const int* __restrict__ kv_indices,
                     const int* __restrict__ kv_last_page_len, int page_size,
                     long long page_stride, int row_stride, int head_stride,
                     float* __restrict__ logits,
                     float* __restrict__ tile_m, float* __restrict__ tile_l, int Hkv, int G,
                     long long N, long long chunk_len, long long n_pad, long long n_tiles,
                     int tile_size, float scale) {
  STOCHATTN_PDL_ENTRY();
  using Shape = tc::KPieces<D, ROWS, STAGES>;
  constexpr int NT = Shape::kNT;  // n8 tiles of keys per piece
  constexpr int kTileBytes = Shape::kTileBytes;

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int Hq = Hkv * G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane >> 2, tig = lane & 3;

  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const long long len = stream_length(seq_lens, table, b, N);
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, len);
  if (start >= end) return;  // logits and tiles past the sequence are never read
  const long long head0 = (long long)b * Hq + (long long)kvh * G;

  unsigned qa[D / 16][2];
  tc::load_query_frags<T, D>(qa, q, head0, G, grp, tig);
  const long long row_h = grp < G ? head0 + grp : head0;  // a valid row for the address
  float* xout = logits + row_h * n_pad;
  float* tm = tile_m + row_h * n_tiles;
  float* tl = tile_l + row_h * n_tiles;

  const KvRows<D> krows = kv_rows<D>(k, table, b, kvh, Hkv, N);
  const int per_span = tile_size / ROWS;  // pieces per sampling tile
  const long long nspans = (end - start + tile_size - 1) / tile_size;
  const long long my_spans = nspans > warp ? (nspans - warp + WARPS - 1) / WARPS : 0;
  const long long my_pieces = my_spans * per_span;  // pieces wholly past `end` read nothing
  auto piece_row0 = [&](long long i) {
    return start + ((i / per_span) * WARPS + warp) * tile_size + (i % per_span) * ROWS;
  };
  unsigned char* ring = dynamic_smem() + warp * (STAGES * kTileBytes);
  const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(ring));

  tc::Ahead<ROWS> ahead;  // page numbers one load ahead (paged caches)
  auto load = [&](int slot, long long i) {
    tc::load_rows_ahead<D, ROWS>(ring + slot * kTileBytes, krows, i, piece_row0, end, lane,
                                 ahead);
  };
  tc::ring_prologue<STAGES>(my_pieces, load);

  float m = STOCHATTN_NEG_INF, l = 0.f;  // head grp's running statistics of the tile
  tc::RingSlots<STAGES> slots;
  for (long long i = 0; i < my_pieces; ++i) {
    const unsigned sk = ring_s + tc::ring_step<STAGES>(i, my_pieces, slots, load) * kTileBytes;
    const long long row0 = piece_row0(i);

    float x[NT][2];
    tc::tile_logits<T, D, ROWS>(x, sk, qa, lane);
    // Non-finite input: 0, or NaN once a logit of head grp is not finite (added to l below;
    // a -inf would weigh 0). Rows past the end are zeros: 0.
    float pz = 0.f;
#pragma unroll
    for (int t = 0; t < NT; ++t) pz = fmaf(x[t][0], 0.f, fmaf(x[t][1], 0.f, pz));
    const float xm = tc::scale_mask_max<NT>(x, row0, end, tig, scale);
    if (grp < G) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const long long r = row0 + 8 * t + 2 * tig;  // even: the pair is 8-byte aligned
        if (r + 1 < end)
          *reinterpret_cast<float2*>(xout + r) = make_float2(x[t][0], x[t][1]);
        else if (r < end)
          xout[r] = x[t][0];
      }
    }
    const int sub = (int)(i % per_span);  // uniform over the warp
    if (sub == 0) {
      m = STOCHATTN_NEG_INF;
      l = 0.f;
    }
    const float mn = fmaxf(m, xm);  // finite: a piece that starts a tile has a row < end
    l = fmaf(l, expf(m - mn), pz);  // exp(-inf) = 0 on a tile's first piece; pz: NaN or 0
#pragma unroll
    for (int t = 0; t < NT; ++t) l += expf(x[t][0] - mn) + expf(x[t][1] - mn);
    m = mn;
    if (sub == per_span - 1) {
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (grp < G && tig == 0) {
        const long long t = (row0 - (per_span - 1) * ROWS) / tile_size;
        tm[t] = m;
        tl[t] = l;
      }
    }
  }
  cp_async_wait<0>();
}

// ---- 2. tile statistics -------------------------------------------------------------
constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / 32;
constexpr int kTileChunks = 4;  // 256-logit chunks per warp, all loads issued first
constexpr int kChunkLogits = 32 * 8;  // a lane reads 8 consecutive logits (two 16-byte loads)

// Max (xor-butterfly) and sum over aligned segments of W lanes (W a power of two <= 32).
__device__ __forceinline__ float segment_max(float x, int W) {  // NaN-aware (nan_max)
  for (int off = W / 2; off > 0; off >>= 1) x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float segment_sum(float x, int W) {
  for (int off = W / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// m_t = max x and l_t = sum exp(x - m_t) (fp32) of every tile of the sequence. A warp
// covers kTileChunks chunks of 256 consecutive logits: lane `lane` reads logits
// [8 lane, 8 lane + 8) of each (16-byte loads, all issued before any is used), a tile is
// an aligned segment of tile_size / 8 lanes, reduced by xor shuffles inside the segment.
// Logits at or past the sequence length count as -inf; a tile whose logits are all -inf
// (Double-P's sampled variant stashes -inf for the tokens a head does not sample) gets
// m = -inf, l = 0; a tile with a NaN logit gets m = l = NaN (nan_max). Grid (rows,
// ceil(n_pad / (kTileWarps * kTileChunks * 256))).
template <int kOnDemand = 0>  // compiled on demand (decode_common.cuh)
__global__ void __launch_bounds__(kTileThreads)
santa_prop_tiles(const float* __restrict__ logits, const int* __restrict__ seq_lens,
                 const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
                 const int* __restrict__ kv_last_page_len, int page_size,
                 long long page_stride, int row_stride, int head_stride,
                 float* __restrict__ tile_m, float* __restrict__ tile_l, int Hq, long long N,
                 long long n_pad, long long n_tiles, int tile_size) {
  STOCHATTN_PDL_ENTRY();
  const long long row = blockIdx.x;  // b * Hq + h
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = (int)(row / Hq);
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const long long len = stream_length(seq_lens, table, b, N);  // tiles past it are never read
  const long long x0 = ((long long)blockIdx.y * kTileWarps + warp) * kTileChunks * kChunkLogits;
  const float* xrow = logits + row * n_pad;
  float xr[kTileChunks][8];
#pragma unroll
  for (int c = 0; c < kTileChunks; ++c) {
    const long long at = x0 + c * kChunkLogits + lane * 8;  // a multiple of 8: whole float4s
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long a = at + 4 * h;
      // n_pad is a multiple of tile_size >= 32: a float4 is wholly inside the row or not.
      const float4 u = a < len ? *reinterpret_cast<const float4*>(xrow + a)
                               : make_float4(0.f, 0.f, 0.f, 0.f);
      xr[c][4 * h] = u.x; xr[c][4 * h + 1] = u.y; xr[c][4 * h + 2] = u.z; xr[c][4 * h + 3] = u.w;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (at + e >= len) xr[c][e] = STOCHATTN_NEG_INF;
  }
  const int W = tile_size / 8;  // lanes per tile: 4 .. 32
#pragma unroll
  for (int c = 0; c < kTileChunks; ++c) {
    const long long c0 = x0 + c * kChunkLogits;
    if (c0 >= len) break;  // uniform over the warp
    float m = STOCHATTN_NEG_INF;
#pragma unroll
    for (int e = 0; e < 8; ++e) m = nan_max(m, xr[c][e]);
    m = segment_max(m, W);
    const float mm = m == STOCHATTN_NEG_INF ? 0.f : m;  // all -inf: l = 0, not NaN
    float l = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) l += expf(xr[c][e] - mm);  // exp(-inf) = 0; each <= 1
    l = segment_sum(l, W);
    const long long tok0 = c0 + (long long)(lane / W) * tile_size;
    if (lane % W == 0 && tok0 < len) {
      const long long t = tok0 / tile_size;
      tile_m[row * n_tiles + t] = m;
      tile_l[row * n_tiles + t] = l;  // >= 1 (the max row contributes exp(0)) or 0
    }
  }
}

// ---- 3. sampling and gather ---------------------------------------------------------
constexpr int kSampleThreads = 256;
constexpr int kSampleWarps = kSampleThreads / 32;

// Block-wide inclusive scan (Op = sum or max) over one value per thread; `sm` holds
// kSampleWarps + 1 values. Contains __syncthreads: call from every thread.
template <typename V, typename Op>
__device__ V block_inclusive_scan(V x, V identity, Op op, V* sm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const V y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x = op(y, x);
  }
  if (lane == 31) sm[warp] = x;
  __syncthreads();
  if (warp == 0) {
    V w = lane < kSampleWarps ? sm[lane] : identity;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const V y = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w = op(y, w);
    }
    if (lane < kSampleWarps) sm[lane] = w;
  }
  __syncthreads();
  const V r = warp > 0 ? op(sm[warp - 1], x) : x;
  __syncthreads();  // sm is free again
  return r;
}

struct MaxI {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};
struct MaxF {  // keeps NaN (nan_max)
  __device__ float operator()(float a, float b) const { return nan_max(a, b); }
};

// Exclusive prefix of one float64 value per thread, in thread order (`sm`: kSampleWarps
// values). Contains __syncthreads: call from every thread.
__device__ double block_exclusive_sum(double x, double* sm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double inc = x;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += y;
  }
  double exc = __shfl_up_sync(0xffffffffu, inc, 1);
  if (lane == 0) exc = 0.0;
  if (lane == 31) sm[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    double w = lane < kSampleWarps ? sm[lane] : 0.0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += y;
    }
    if (lane < kSampleWarps) sm[lane] = w;
  }
  __syncthreads();
  const double r = warp > 0 ? sm[warp - 1] + exc : exc;
  __syncthreads();  // sm is free again
  return r;
}

// A partial of no mass for exact_decode_merge (zero output, max -inf, sum 0), and no draws
// (indices -1). Called by the whole block.
__device__ __forceinline__ void write_empty_part(float* __restrict__ part_o,
                                                 float* __restrict__ part_ml, long long row,
                                                 int num_parts, int part, int D, int S,
                                                 long long* __restrict__ idx_out, long long ld) {
  const long long at = row * num_parts + part;
  for (int d = threadIdx.x; d < D; d += blockDim.x) part_o[at * D + d] = 0.f;
  if (threadIdx.x == 0) {
    part_ml[at * 2] = STOCHATTN_NEG_INF;
    part_ml[at * 2 + 1] = 0.f;
  }
  if (idx_out)
    for (int m = threadIdx.x; m < S; m += blockDim.x) idx_out[row * ld + m] = -1;
}

// A row that read a NaN or an infinity (Z or m* not finite; decode_common.cuh): a NaN
// output row, or a NaN partial (o, max and sum NaN, so exact_decode_merge's row is NaN),
// and no draws (indices -1). Called by the whole block.
template <typename T>
__device__ __forceinline__ void write_nan_row(T* __restrict__ orow, float* __restrict__ part_o,
                                              float* __restrict__ part_ml, long long row,
                                              int num_parts, int part, int D, int S,
                                              long long* __restrict__ idx_out, long long ld) {
  const long long at = row * num_parts + part;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    if (part_o)
      part_o[at * D + d] = STOCHATTN_NAN;
    else
      orow[d] = Elem<T>::from_float(STOCHATTN_NAN);
  }
  if (part_o && threadIdx.x == 0) {
    part_ml[at * 2] = STOCHATTN_NAN;
    part_ml[at * 2 + 1] = STOCHATTN_NAN;
  }
  if (idx_out)
    for (int m = threadIdx.x; m < S; m += blockDim.x) idx_out[row * ld + m] = -1;
}

// The work of one santa_prop_sample CTA on row `row` (= b * Hq + h) with S points;
// `ld` is the row stride of idx32 (and ld + 1 of iid_points): S for the fixed-budget
// kernel, the plan's max_budget for santa_prop_sample_budgets (per-row S); `idx_ld` that
// of idx_out. `rng_stream`: the Philox stream of the points (philox.cuh's Points; 0 for
// the estimator and the pilot, 1 and 2 for the studentised pilot's two sets).
// The points of a row depend only on its own S (docs/rng.md), so a row with S draws
// exactly what a fixed-S call draws. Called by the whole block after the PDL entry.
template <typename T, int D>
__device__ __forceinline__ void prop_sample_row(
    const long long row, const T* __restrict__ v, const int* __restrict__ seq_lens,
    const PageTable& table, const float* __restrict__ logits,
    const float* __restrict__ tile_m, const float* __restrict__ tile_l, double* __restrict__ C,
    double* __restrict__ iid_points, int* __restrict__ idx32, long long* __restrict__ idx_out,
    T* __restrict__ out, int Hq, int G, long long N, long long n_pad, long long n_tiles,
    int tile_size, int S, long long ld, long long idx_ld, unsigned rng_stream, int sampler,
    unsigned long long seed, unsigned offset,
    const void* __restrict__ seed_ptr, const void* __restrict__ offset_ptr, unsigned streams,
    unsigned purpose, float* __restrict__ part_o, float* __restrict__ part_ml, int num_parts,
    int part) {
  __shared__ double sm_d[kSampleWarps + 1];
  __shared__ int sm_i[kSampleWarps + 1];
  __shared__ float sm_f[kSampleWarps + 1];
  __shared__ int sm_seg[kSampleThreads];
  __shared__ float red[kSampleThreads * 8];  // gather partial sums: (threads / (D/8)) x D

  const int tid = threadIdx.x;
  const int b = (int)(row / Hq), h = (int)(row % Hq);
  const int Hkv = Hq / G, kvh = h / G;
  seed = stream_seed(seed, seed_ptr, streams, b);
  offset = stream_offset(offset, offset_ptr, streams, b);
  const long long len = stream_length(seq_lens, table, b, N);
  T* orow = out + row * D;
  int* ids = idx32 + row * ld;

  if (len == 0) {  // empty sequence: zero output; indices 0 as the reference
    if (part_o) {
      write_empty_part(part_o, part_ml, row, num_parts, part, D, S, idx_out, idx_ld);
    } else {
      for (int d = tid; d < D; d += kSampleThreads) orow[d] = Elem<T>::from_float(0.f);
      if (idx_out)
        for (int m = tid; m < S; m += kSampleThreads) idx_out[row * idx_ld + m] = 0;
    }
    return;
  }
  const int T_b = (int)((len + tile_size - 1) / tile_size);
  const float* tm = tile_m + row * n_tiles;
  const float* tl = tile_l + row * n_tiles;
  double* Cr = C + row * n_tiles;

  // a. m* and the tile prefix C_t in float64; thread tid owns a contiguous segment.
  float mxl = STOCHATTN_NEG_INF;
  for (int t = tid; t < T_b; t += kSampleThreads) mxl = nan_max(mxl, tm[t]);
  mxl = block_inclusive_scan(mxl, STOCHATTN_NEG_INF, MaxF(), sm_f);
  if (tid == kSampleThreads - 1) sm_f[kSampleWarps] = mxl;
  __syncthreads();
  const double mstar = (double)sm_f[kSampleWarps];
  if (sm_f[kSampleWarps] == STOCHATTN_NEG_INF) {  // every row masked out: no mass
    if (part_o)  // Double-P's sampled variant: no token of the row is sampled
      write_empty_part(part_o, part_ml, row, num_parts, part, D, S, idx_out, idx_ld);
    else  // a row of the sequence has a logit: only non-finite ones give -inf everywhere
      write_nan_row<T>(orow, part_o, part_ml, row, num_parts, part, D, S, idx_out, idx_ld);
    return;
  }

  const int seg = (T_b + kSampleThreads - 1) / kSampleThreads;
  const int t0 = min(tid * seg, T_b), t1 = min(t0 + seg, T_b);
  double run = 0.0;
  int lastpos = -1;
  for (int t = t0; t < t1; ++t) {
    // W_t = exp(m_t - m*) l_t <= l_t: the flash-decoding rescaling, never overflows.
    const double w = exp((double)tm[t] - mstar) * (double)tl[t];
    run += w;
    Cr[t] = run;
    if (w > 0.0) lastpos = t;
  }
  const double exc = block_exclusive_sum(run, sm_d);
  for (int t = t0; t < t1; ++t) Cr[t] = exc + Cr[t];
  const int tlast = block_inclusive_scan(lastpos, -1, MaxI(), sm_i);
  if (tid == kSampleThreads - 1) sm_i[kSampleWarps] = tlast;
  __syncthreads();  // also publishes Cr to the block
  const int t_last = max(sm_i[kSampleWarps], 0);  // the max tile has W = l_t >= 1 > 0
  const double Z = Cr[T_b - 1];
  if (Z != Z) {  // a NaN m_t or l_t: the row read a non-finite logit (uniform over the block)
    write_nan_row<T>(orow, part_o, part_ml, row, num_parts, part, D, S, idx_out, idx_ld);
    return;
  }

  // b. Sample points.
  Points P;
  P.stream = rng_stream;
  P.sampler = sampler;
  P.S = S;
  P.rs = RngStream::make(seed, offset, purpose, (unsigned)row);
  P.u = (double)P.rs.uniform(rng_stream, 0u);
  P.iid = iid_points + row * (ld + 1);
  if (sampler == SAMPLER_IID) {
    // E_i = -log(u_i), i = 0..S; prefix sums in float64; T_m = c_m / c_S. Every spacing is
    // >= 2^-25 (u < 1 - 2^-25), far above the rounding of the prefix, so the points stay
    // sorted whatever the scan's association.
    double* pr = iid_points + row * (ld + 1);
    const int n = S + 1;
    const int sg = (n + kSampleThreads - 1) / kSampleThreads;
    const int i0 = min(tid * sg, n), i1 = min(i0 + sg, n);
    double r = 0.0;
    for (int i = i0; i < i1; ++i) {
      r += iid_spacing(P.rs, i, rng_stream);
      pr[i] = r;
    }
    const double ec = block_exclusive_sum(r, sm_d);
    for (int i = i0; i < i1; ++i) pr[i] = ec + pr[i];
    __syncthreads();
    const double total = pr[S];  // never overwritten: the loop below stops at S - 1
    for (int i = i0; i < min(i1, S); ++i) pr[i] = pr[i] / total;
    __syncthreads();
  }

  // c. Tile of every point: mark each non-empty tile's first point, then max-scan.
  for (int m = tid; m < S; m += kSampleThreads) ids[m] = -1;
  __syncthreads();
  for (int t = tid; t <= t_last; t += kSampleThreads) {
    const int lo = t == 0 ? 0 : P.count_below(Cr[t - 1], Z);
    const int hi = t == t_last ? S : P.count_below(Cr[t], Z);
    if (hi > lo) ids[lo] = t;
  }
  __syncthreads();
  const int sgm = (S + kSampleThreads - 1) / kSampleThreads;
  const int m0 = min(tid * sgm, S), m1 = min(m0 + sgm, S);
  {
    int mk = -1;
    for (int m = m0; m < m1; ++m) mk = max(mk, ids[m]);
    const int incm = block_inclusive_scan(mk, -1, MaxI(), sm_i);
    sm_seg[tid] = incm;
    __syncthreads();
    int cur = tid > 0 ? sm_seg[tid - 1] : -1;  // exclusive max: the previous thread's
    for (int m = m0; m < m1; ++m) {
      cur = max(cur, ids[m]);
      ids[m] = max(cur, 0);  // tile of point m (point 0 always starts a tile)
    }
  }
  __syncthreads();
  // d. Row of every point inside its tile: one thread walks the tile's stashed logits.
  const float* xrow = logits + row * n_pad;
  for (int m = tid; m < S; m += kSampleThreads) {
    const int t = ids[m];
    const double before = t > 0 ? Cr[t - 1] : 0.0;
    const float mt = tm[t];
    // Mass left of the point inside the tile, in the tile's units exp(x - m_t):
    // T Z - C_{t-1} = exp(m_t - m*) * (local mass) (NaN from 0/0 in a zero-mass tile, only
    // reachable through rounding, becomes 0 via fmax).
    const double target = fmax((P(m) * Z - before) / exp((double)mt - mstar), 0.0);
    const long long tok0 = (long long)t * tile_size;
    const int n = (int)min((long long)tile_size, len - tok0);
    const float* x = xrow + tok0;
    // First row whose cumsum exceeds the target; a target at or past the tile's mass
    // (rounding: l_t is an fp32 sum) takes the last positive-weight row, as the reference.
    // The logits come kAhead at a time (16-byte loads, all issued before any is used: the
    // walk is a chain of memory latencies otherwise); the additions stay in row order.
    // Rows j >= n are read (the stash is padded to whole tiles) but never used.
    constexpr int kAhead = 32;  // divides every tile size
    int r = -1, lastp = -1;
    double cum = 0.0;
    for (int j0 = 0; j0 < n && r < 0; j0 += kAhead) {
      float xs[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; u += 4) {
        const float4 f = *reinterpret_cast<const float4*>(x + j0 + u);
        xs[u] = f.x; xs[u + 1] = f.y; xs[u + 2] = f.z; xs[u + 3] = f.w;
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (r < 0 && j0 + u < n) {
          const float w = expf(xs[u] - mt);  // <= 1: x <= m_t
          if (w > 0.f) lastp = j0 + u;
          cum += (double)w;
          if (cum > target) r = j0 + u;
        }
      }
    }
    const int J = (int)tok0 + (r >= 0 ? r : max(lastp, 0));
    ids[m] = J;
    if (idx_out) idx_out[row * idx_ld + m] = J;
  }
  __syncthreads();

  // e. Gather-and-add of the S value rows, 16 bytes per thread per row.
  constexpr int LPR = D / 8;
  constexpr int GROUPS = kSampleThreads / LPR;
  const int lr = tid % LPR, grp = tid / LPR;
  const KvRows<D> vrows = kv_rows<D>(v, table, b, kvh, Hkv, N);  // row J: vrows.row(J)
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  constexpr int U = 8;  // independent loads in flight per thread
  for (int mb = grp; mb < S; mb += U * GROUPS) {
    uint4 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int m = mb + u * GROUPS;
      raw[u] = m < S ? __ldg(reinterpret_cast<const uint4*>(vrows.row(ids[m]) + lr * 16))
                     : make_uint4(0u, 0u, 0u, 0u);  // zero bits are +0.0 in both types
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float f[8];
      unpack8<T>(raw[u], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += f[e];
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) red[grp * D + lr * 8 + e] = acc[e];
  __syncthreads();
  for (int d = tid; d < D; d += kSampleThreads) {
    float s = 0.f;
    for (int g2 = 0; g2 < GROUPS; ++g2) s += red[g2 * D + d];  // fixed order
    if (part_o)
      part_o[(row * num_parts + part) * D + d] = s / (float)S;
    else
      orow[d] = Elem<T>::from_float(s / (float)S);
  }
  if (part_o && tid == 0) {  // (max, sum) in exact_decode_merge's log2 domain
    part_ml[(row * num_parts + part) * 2] = (float)(mstar * 1.4426950408889634);
    part_ml[(row * num_parts + part) * 2 + 1] = (float)Z;
  }
}

// One CTA per (b, query head) row. With `part_o` null: writes out[row] = (1/S) sum v[J].
// With `part_o` (Double-P's sampled variant, logits of unsampled tokens -inf): writes the
// mean and (m* log2 e, Z) as partial `part` of `num_parts` for exact_decode_merge, and a
// row without mass gets an empty partial and indices -1. `purpose`: the random stream's
// purpose (philox.cuh). (The error-targeted budgets' pilot, docs/budgets.md, is this
// kernel with purpose PURPOSE_BUDGET_PILOT, the stratified sampler and a partial: the
// fp32 mean of the pilot's rows.)
template <typename T, int D>
__global__ void __launch_bounds__(kSampleThreads)
santa_prop_sample(const T* __restrict__ v, const int* __restrict__ seq_lens,
                  const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
                  const int* __restrict__ kv_last_page_len, int page_size,
                  long long page_stride, int row_stride, int head_stride,
                  const float* __restrict__ logits, const float* __restrict__ tile_m,
                  const float* __restrict__ tile_l, double* __restrict__ C,
                  double* __restrict__ iid_points, int* __restrict__ idx32,
                  long long* __restrict__ idx_out,
                  T* __restrict__ out, int Hq, int G, long long N, long long n_pad,
                  long long n_tiles, int tile_size, int S, int sampler,
                  unsigned long long seed, unsigned offset, const void* __restrict__ seed_ptr,
                  const void* __restrict__ offset_ptr, unsigned streams, unsigned purpose,
                  float* __restrict__ part_o, float* __restrict__ part_ml, int num_parts,
                  int part) {
  STOCHATTN_PDL_ENTRY();
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  prop_sample_row<T, D>(blockIdx.x, v, seq_lens, table, logits, tile_m, tile_l, C, iid_points,
                        idx32, idx_out, out, Hq, G, N, n_pad, n_tiles, tile_size, S,
                        (long long)S, (long long)S, 0u, sampler, seed, offset, seed_ptr,
                        offset_ptr, streams, purpose, part_o, part_ml, num_parts, part);
}

// ---- error-targeted budgets (docs/budgets.md, stochattn/reference/budgets.py) ----------
//
// santa_prop_sample_budgets: santa_prop_sample with a per-row S read from `budgets`
// (B * Hq int32, written on the device by santa_prop_budgets just before: no host sync,
// graph-safe); idx32 and iid_points have the plan's `max_budget` columns (max_budget + 1
// for iid_points), idx_out `idx_ld`, and a row's columns of idx_out in [S, idx_ld) are -1.
// With `budgets` null every row has S = max_budget: a fixed-S launch on Philox stream
// `rng_stream` (the budgets' pilot sets). With `part_o` the fp32 mean and (m*, Z) go to
// partial `part` of `num_parts`, as santa_prop_sample's, instead of `out` (the pilots: 1
// and 0; Double-P's targeted main draws: the last of its merge's partials). With
// `skip_zero` a row whose budget is 0 draws nothing and writes nothing but its -1 indices
// (Double-P's pilot under norm "auto", rows that take no pilot); without it such a row of a
// non-empty sequence draws one point (a guard: santa_prop_budgets gives S >= 1).
template <typename T, int D>
__global__ void __launch_bounds__(kSampleThreads)
santa_prop_sample_budgets(const T* __restrict__ v, const int* __restrict__ seq_lens,
                          const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
                          const int* __restrict__ kv_last_page_len, int page_size,
                          long long page_stride, int row_stride, int head_stride,
                          const float* __restrict__ logits, const float* __restrict__ tile_m,
                          const float* __restrict__ tile_l, double* __restrict__ C,
                          double* __restrict__ iid_points, int* __restrict__ idx32,
                          long long* __restrict__ idx_out,
                          T* __restrict__ out, int Hq, int G, long long N, long long n_pad,
                          long long n_tiles, int tile_size, const int* __restrict__ budgets,
                          int max_budget, long long idx_ld, unsigned rng_stream, int sampler,
                          unsigned long long seed, unsigned offset,
                          const void* __restrict__ seed_ptr, const void* __restrict__ offset_ptr,
                          unsigned streams, unsigned purpose, float* __restrict__ part_o,
                          float* __restrict__ part_ml, int num_parts, int part,
                          int skip_zero) {
  STOCHATTN_PDL_ENTRY();
  const long long row = blockIdx.x;
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  int S = max_budget;
  if (budgets) {
    S = budgets[row];
    S = S < 0 ? 0 : (S > max_budget ? max_budget : S);
    // santa_prop_budgets gives S >= 1 to every non-empty row; kept safe whatever the
    // buffer holds (S = 0 would divide by zero below).
    if (S == 0 && !skip_zero && stream_length(seq_lens, table, (int)(row / Hq), N) > 0) S = 1;
    if (idx_out)
      for (long long m = S + threadIdx.x; m < idx_ld; m += kSampleThreads)
        idx_out[row * idx_ld + m] = -1;
    if (S == 0 && skip_zero) return;  // uniform over the block
  }
  prop_sample_row<T, D>(row, v, seq_lens, table, logits, tile_m, tile_l, C, iid_points, idx32,
                        idx_out, out, Hq, G, N, n_pad, n_tiles, tile_size, S,
                        (long long)max_budget, idx_ld, rng_stream, sampler, seed, offset,
                        seed_ptr, offset_ptr, streams, purpose, part_o, part_ml,
                        part_o ? num_parts : 0, part);
}

// Rows of the streams the budget kernels read that kv_rows<D> does not name as they are:
// V with D known only at run time (santa_prop_budgets), the float32 norms beside the
// cache, and V of float32 (value_sqnorms_rows). In a paged pool a row's address does not
// involve its length, so KvRows (kv_rows.cuh, the one home of the paged addressing rule:
// page_index, offset) gives it for elements of any even size once the pool's strides are
// counted in 16-bit units (elem_bytes / 2 per element); its D, the contiguous row length,
// is then unused: KvRows<1>. A contiguous stream (B, Hkv, N, width) is a plain array:
// row n at `contig` + n * row_bytes.
struct BudgetRows {
  KvRows<1> paged;              // paged.pages null: contiguous
  const unsigned char* contig;  // row 0 of a contiguous stream
  long long row_bytes;          // of a contiguous row

  template <typename T>
  __device__ __forceinline__ const T* row_of(long long n) const {
    return paged.pages ? paged.template row_of<T>(n)
                       : reinterpret_cast<const T*>(contig + n * row_bytes);
  }
};

// The rows of stream (b, kvh) of `cache`, elements of `elem_bytes` (2 or 4) bytes: `width`
// per row of a contiguous (B, Hkv, N, width) cache, or the pool through `t` (its strides
// in elements of the cache).
__device__ __forceinline__ BudgetRows budget_rows(const void* cache, int elem_bytes,
                                                  const PageTable& t, int b, int kvh, int Hkv,
                                                  long long N, long long width) {
  const int units = elem_bytes / 2;
  PageTable u = t;
  u.page_stride *= units;
  u.row_stride *= units;
  u.head_stride *= units;
  BudgetRows r;
  r.paged = kv_rows<1>(cache, u, b, kvh, Hkv, N);
  r.row_bytes = width * elem_bytes;
  r.contig = static_cast<const unsigned char*>(cache)
             + ((long long)b * Hkv + kvh) * N * r.row_bytes;
  return r;
}

// Reduction of one value per thread over the block, every thread getting the result: an
// xor butterfly in each warp, then the kSampleWarps warp results folded in warp order, so
// a float64 sum is deterministic. `sm`: kSampleWarps values. Contains __syncthreads.
template <typename V, typename Op>
__device__ V block_reduce(V x, Op op, V* sm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
  if (lane == 0) sm[warp] = x;
  __syncthreads();
  V t = sm[0];
  for (int w = 1; w < kSampleWarps; ++w) t = op(t, sm[w]);
  __syncthreads();  // sm is free again
  return t;
}

struct SumD {
  __device__ double operator()(double a, double b) const { return a + b; }
};
struct MaxD {  // fmax: a NaN gives way to the other operand
  __device__ double operator()(double a, double b) const { return fmax(a, b); }
};

// The projections p_m = u . v_J (J = pilot_b[m], m < S_B; u = o_A / ||o_A||, float64; v
// read as 16-bit elements, dtype 0 float16, 1 bfloat16, at row J of `vrows`) summed in one
// pass: sums[0] = sum (p_m - c) and sums[1] = sum (p_m - c)^2 about the shift
// sums[2] = c = p_0 (every warp computes p_0 itself), so t_B = c + sums[0] / S_B and the centred sum of
// squares is sums[1] - sums[0]^2 / S_B without the cancellation of raw moments. A warp
// takes kStudentAhead draws at a time with all their loads issued before any is used
// (the gathers are random rows: one at a time they were a chain of memory latencies,
// twice over in the earlier two-pass form). Every thread gets both sums. Contains
// __syncthreads.
constexpr int kStudentAhead = 4;

__device__ __forceinline__ float v_elem(const unsigned short* vj, int d, int dtype) {
  const unsigned short h = __ldg(vj + d);
  return dtype == 0 ? Elem<f16>::to_float(h) : Elem<bf16>::to_float(h);
}

__device__ void student_sums(const BudgetRows& vrows, int dtype, const float* __restrict__ oa,
                             double na, const int* __restrict__ draws, int S_B, int D,
                             double* sm, double (&sums)[3]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double c = 0.0;
  {
    const unsigned short* v0 = vrows.row_of<unsigned short>(__ldg(draws));
    for (int d = lane; d < D; d += 32) c += ((double)oa[d] / na) * (double)v_elem(v0, d, dtype);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) c += __shfl_xor_sync(0xffffffffu, c, off);
  }
  double a1 = 0.0, a2 = 0.0;
  for (int m0 = warp * kStudentAhead; m0 < S_B; m0 += kSampleWarps * kStudentAhead) {
    const unsigned short* vj[kStudentAhead];
#pragma unroll
    for (int u = 0; u < kStudentAhead; ++u)
      vj[u] = vrows.row_of<unsigned short>(__ldg(draws + min(m0 + u, S_B - 1)));
    double proj[kStudentAhead];
#pragma unroll
    for (int u = 0; u < kStudentAhead; ++u) proj[u] = 0.0;
    for (int d = lane; d < D; d += 32) {
      float x[kStudentAhead];
#pragma unroll
      for (int u = 0; u < kStudentAhead; ++u) x[u] = v_elem(vj[u], d, dtype);
      const double ud = (double)oa[d] / na;
#pragma unroll
      for (int u = 0; u < kStudentAhead; ++u) proj[u] += ud * (double)x[u];
    }
#pragma unroll
    for (int u = 0; u < kStudentAhead; ++u) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        proj[u] += __shfl_xor_sync(0xffffffffu, proj[u], off);
      if (m0 + u < S_B) {
        const double p = proj[u] - c;
        a1 += p;
        a2 += p * p;
      }
    }
  }
  // every lane holds the warp's sums: lane 0's go into the block total
  sums[0] = block_reduce(lane == 0 ? a1 : 0.0, SumD(), sm);
  sums[1] = block_reduce(lane == 0 ? a2 : 0.0, SumD(), sm);
  sums[2] = c;
}

// m* = max_t m_t of a row (NaN if a tile maximum is NaN), every thread getting it: the
// same operations in santa_prop_second_moment and santa_prop_budgets, so both see one m*.
__device__ __forceinline__ float row_max(const float* __restrict__ tm, int T_b, float* sm) {
  float mxl = STOCHATTN_NEG_INF;
  for (int t = threadIdx.x; t < T_b; t += kSampleThreads) mxl = nan_max(mxl, tm[t]);
  return block_reduce(mxl, MaxF(), sm);
}

// Tokens per CTA of santa_prop_second_moment: a multiple of kMomentStep, the tokens one
// pass of the block covers (kMomentAhead per thread, all loads issued before any is used).
constexpr int kMomentAhead = 8;
constexpr int kMomentStep = kSampleThreads * kMomentAhead;
constexpr int kMomentChunk = 2 * kMomentStep;
// Fields per (row, chunk) of santa_prop_second_moment's `parts` (float64): num, den, vmax2
// and the count of tokens of positive weight (n_A of Double-P's norm "auto").
constexpr int kMomentFields = 4;

// Pass 1's moments of a row, split over the sequence: CTA row * n_chunks + c sums over tokens
// [c kMomentChunk, (c + 1) kMomentChunk) of the row's stream
//   den = sum_j exp(x_j - m*),  num = sum_j exp(x_j - m*) ||v_j||^2  (float64 sums of the
//   float32 weights), vmax2 = max ||v_j||^2 over the tokens of positive weight, and the
// number of those tokens (exact in float64), and writes them to
// parts[(row * n_chunks + c) * kMomentFields + {0, 1, 2, 3}]; santa_prop_budgets folds
// a row's chunks (strided per thread, then a fixed tree: deterministic). One CTA per row walking the whole
// sequence was a chain of memory latencies (a row of 32k tokens took ~60 us at batch 1);
// this grid keeps the reads in flight across the sequence. Chunks past the row's length,
// and rows whose m* is not finite (santa_prop_budgets handles them alone), write nothing.
template <int kOnDemand = 0>  // compiled on demand (decode_common.cuh)
__global__ void __launch_bounds__(kSampleThreads)
santa_prop_second_moment(const float* __restrict__ logits, const float* __restrict__ tile_m,
                         const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                         const int* __restrict__ kv_indices,
                         const int* __restrict__ kv_last_page_len, int page_size,
                         long long page_stride, int row_stride, int head_stride,
                         const float* __restrict__ sqnorms, long long sq_page_stride,
                         int sq_row_stride, int sq_head_stride, double* __restrict__ parts,
                         int Hq, int G, long long N, long long n_pad, long long n_tiles,
                         int tile_size, int n_chunks) {
  STOCHATTN_PDL_ENTRY();
  __shared__ float sm_f[kSampleWarps];
  __shared__ double sm_d[kSampleWarps];
  const long long row = blockIdx.x / n_chunks;  // b * Hq + h
  const int chunk = (int)(blockIdx.x % n_chunks);
  const long long j_begin = (long long)chunk * kMomentChunk;
  const int b = (int)(row / Hq), h = (int)(row % Hq);
  const int Hkv = Hq / G, kvh = h / G;
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const long long len = stream_length(seq_lens, table, b, N);
  if (j_begin >= len) return;  // uniform over the block
  const int T_b = (int)((len + tile_size - 1) / tile_size);
  const float mstar = row_max(tile_m + row * n_tiles, T_b, sm_f);
  if (mstar != mstar || mstar == STOCHATTN_NEG_INF) return;
  const float* xrow = logits + row * n_pad;
  const BudgetRows sq = budget_rows(
      sqnorms, 4,
      page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, sq_page_stride,
                 sq_row_stride, sq_head_stride),
      b, kvh, Hkv, N, 1);
  const long long j_end = min(len, j_begin + kMomentChunk);
  double num = 0.0, den = 0.0, vmax2 = 0.0, cnt = 0.0;
  // Thread tid takes tokens j0 + 4 (tid + u kSampleThreads) .. + 3 of each step: 16-byte
  // loads of the stash (its rows are padded to whole tiles, n_pad a multiple of 4), the
  // norms one by one (a contiguous stream's rows need not be 16-byte aligned).
  for (long long j0 = j_begin; j0 < j_end; j0 += kMomentStep) {
    float x[kMomentAhead], nv[kMomentAhead];
#pragma unroll
    for (int u = 0; u < kMomentAhead / 4; ++u) {
      const long long j = j0 + 4 * ((long long)threadIdx.x + (long long)u * kSampleThreads);
      const float4 f = j < j_end ? __ldg(reinterpret_cast<const float4*>(xrow + j))
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
      x[4 * u] = f.x; x[4 * u + 1] = f.y; x[4 * u + 2] = f.z; x[4 * u + 3] = f.w;
#pragma unroll
      for (int e = 0; e < 4; ++e) nv[4 * u + e] = j + e < j_end ? __ldg(sq.row_of<float>(j + e)) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kMomentAhead; ++u) {
      const long long j = j0 + 4 * ((long long)threadIdx.x + (long long)(u / 4) * kSampleThreads)
                          + u % 4;
      if (j < j_end) {
        const double w = (double)expf(x[u] - mstar);  // <= 1
        const double sqv = (double)nv[u];
        den += w;
        num += w * sqv;
        // "positive weight" as the reference decides it, in float64: expf underflows
        // below x - m* ~ -103, exp in float64 only below ~ -745 (checked only then);
        // the count is n_A of Double-P's norm "auto" (the reference's wa > 0)
        if (w > 0.0 || exp((double)x[u] - (double)mstar) > 0.0) {
          vmax2 = fmax(vmax2, sqv);
          cnt += 1.0;
        }
      }
    }
  }
  num = block_reduce(num, SumD(), sm_d);
  den = block_reduce(den, SumD(), sm_d);
  vmax2 = block_reduce(vmax2, MaxD(), sm_d);
  cnt = block_reduce(cnt, SumD(), sm_d);
  if (threadIdx.x == 0) {
    double* p = parts + (long long)blockIdx.x * kMomentFields;  // row * n_chunks + chunk
    p[0] = num;
    p[1] = den;
    p[2] = vmax2;
    p[3] = cnt;
  }
}

// One row's outcome without a budget from the rule, written by thread 0: an empty row
// (S 0, not capped, every field 0) or a row that read a NaN or an infinity (S 1, capped,
// every field NaN; the sampling writes its NaN output row).
__device__ __forceinline__ void write_budget_row_outcome(long long row, bool nonfinite,
                                                         int* budgets, int* capped,
                                                         double* error_bound,
                                                         double* norm_sq_lower,
                                                         double* second_moment) {
  if (threadIdx.x != 0) return;
  const double fill = nonfinite ? (double)STOCHATTN_NAN : 0.0;
  budgets[row] = nonfinite ? 1 : 0;
  capped[row] = nonfinite ? 1 : 0;
  error_bound[row] = fill;
  norm_sq_lower[row] = fill;
  second_moment[row] = fill;
}

// One CTA per (b, query head) row: the budget S of choose_budgets (norm "pilot", or
// "student" with `student` = 1) on the device, between pass 1 and the sampling.
//   m2 = sum_j exp(x_j - m*) ||v_j||^2 / sum_j exp(x_j - m*) over the sequence (m* =
//        max_t m_t), from santa_prop_second_moment's `parts` (n_chunks per row, folded
//        in a fixed order); ||v_j||^2 the float32 norms kept beside the cache: (B, Hkv, N)
//        contiguous, or the V pool's shape without D for a paged cache (strides sq_*;
//        pages through the page table; the studentised bound reads V's rows here);
//   pilot: y = ||o_p||, o_p the pilot's fp32 mean (`pilot_o`: santa_prop_sample_budgets
//        on purpose PURPOSE_BUDGET_PILOT, stratified, stream 0), and
//        L = pilot_norm_lower(y, m2, k_pilot) (the closed-form smaller root);
//   student: o_A = `pilot_o` (set A, stream 1), u = o_A / ||o_A||; over set B's S_B
//        draws (`pilot_b`, stream 2) t_B = mean u . v_J and s_B^2 = sum (u . v_J - t_B)^2
//        / (S_B - 1) (centred); vmax = max ||v_j|| over the tokens of positive weight;
//        L = min(sqrt(m2), max(0, t_B - max(z s_B / sqrt(S_B), 2 vmax / S_B)))
//        (reference/budgets.py student_norm_lower; 0 without a direction or with S_B < 2);
//   S  = min(max_budget, max(1, ceil(c_main (m2 - L^2) / (eps^2 L^2)))), compared in
//        float64 before any int conversion, in the reference's order of operations.
// Writes budgets (int32), capped (int32 0/1), error_bound, norm_sq_lower (L^2) and
// second_moment (m2), float64. Empty rows: S = 0, bound 0. Rows that read a NaN or an
// infinity (m* not finite): S = 1 (the sampling writes their NaN row), capped, NaN bound.
template <int kOnDemand = 0>  // compiled on demand (decode_common.cuh)
__global__ void __launch_bounds__(kSampleThreads)
santa_prop_budgets(const float* __restrict__ tile_m,
                   const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                   const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len,
                   int page_size, long long page_stride, int row_stride, int head_stride,
                   const double* __restrict__ parts, int n_chunks,
                   const float* __restrict__ pilot_o,
                   const void* __restrict__ v, const int* __restrict__ pilot_b,
                   int* __restrict__ budgets, int* __restrict__ capped,
                   double* __restrict__ error_bound, double* __restrict__ norm_sq_lower,
                   double* __restrict__ second_moment, int Hq, int G, long long N,
                   long long n_tiles, int tile_size, int D, double eps,
                   double c_main, double k_pilot, int max_budget, int student, int dtype,
                   int S_B, double z) {
  STOCHATTN_PDL_ENTRY();
  __shared__ float sm_f[kSampleWarps];
  __shared__ double sm_d[kSampleWarps];
  const long long row = blockIdx.x;  // b * Hq + h
  const int tid = threadIdx.x;
  const int b = (int)(row / Hq), h = (int)(row % Hq);
  const int Hkv = Hq / G, kvh = h / G;
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const long long len = stream_length(seq_lens, table, b, N);
  if (len == 0) {
    write_budget_row_outcome(row, false, budgets, capped, error_bound, norm_sq_lower,
                             second_moment);
    return;
  }
  const int T_b = (int)((len + tile_size - 1) / tile_size);
  const float mstar_f = row_max(tile_m + row * n_tiles, T_b, sm_f);
  if (mstar_f != mstar_f || mstar_f == STOCHATTN_NEG_INF) {  // uniform over the block
    write_budget_row_outcome(row, true, budgets, capped, error_bound, norm_sq_lower,
                             second_moment);
    return;
  }
  // The row's chunks of santa_prop_second_moment, those that hold tokens.
  const int chunks = (int)((len + kMomentChunk - 1) / kMomentChunk);
  const double* prow = parts + row * n_chunks * kMomentFields;
  double num = 0.0, den = 0.0, vmax2 = 0.0;
  for (int c = tid; c < chunks; c += kSampleThreads) {
    num += prow[kMomentFields * c];
    den += prow[kMomentFields * c + 1];
    vmax2 = fmax(vmax2, prow[kMomentFields * c + 2]);
  }
  const float* orow_p = pilot_o + row * D;
  double y2 = 0.0;
  for (int d = tid; d < D; d += kSampleThreads) {
    const double o = (double)orow_p[d];
    y2 += o * o;
  }
  num = block_reduce(num, SumD(), sm_d);
  den = block_reduce(den, SumD(), sm_d);
  y2 = block_reduce(y2, SumD(), sm_d);
  // A NaN logit that the tile maxima did not carry (the tensor-core pass 1 takes them
  // with fmaxf) shows here: den >= 1 for every finite row (its max token adds exp(0)).
  if (!(den >= 1.0) || num != num) {  // uniform over the block
    write_budget_row_outcome(row, true, budgets, capped, error_bound, norm_sq_lower,
                             second_moment);
    return;
  }
  // The formula in the reference's operations and order, each rounded once: the _rn
  // intrinsics keep the compiler from contracting a * b + c into an FMA, so S, capped
  // and the bound are the bits NumPy computes from the same m2 and L^2
  // (tests/gpu/test_cuda_santa_budgets.py recomputes them).
  const double m2 = __ddiv_rn(num, den);
  double L = 0.0;
  if (student) {
    vmax2 = block_reduce(vmax2, MaxD(), sm_d);
    const double na = __dsqrt_rn(y2);  // ||o_A||
    if (na > 0.0 && S_B > 1) {  // uniform over the block
      const BudgetRows vrows = budget_rows(v, 2, table, b, kvh, Hkv, N, D);
      const int* draws = pilot_b + row * S_B;
      const double sb = (double)S_B;
      double sums[3];
      student_sums(vrows, dtype, orow_p, na, draws, S_B, D, sm_d, sums);
      const double t = __dadd_rn(sums[2], __ddiv_rn(sums[0], sb));
      const double s2 = __ddiv_rn(
          fmax(__dsub_rn(sums[1], __ddiv_rn(__dmul_rn(sums[0], sums[0]), sb)), 0.0), sb - 1.0);
      const double width = fmax(__dmul_rn(z, __dsqrt_rn(__ddiv_rn(s2, sb))),
                                __ddiv_rn(__dmul_rn(2.0, __dsqrt_rn(vmax2)), sb));
      L = fmin(fmax(__dsub_rn(t, width), 0.0), __dsqrt_rn(m2));
    }
  }
  if (tid != 0) return;
  if (!student) L = pilot_norm_lower(__dsqrt_rn(y2), m2, k_pilot);
  const double L2 = __dmul_rn(L, L);
  const RowBudget r = budget_from_variance(fmax(__dsub_rn(m2, L2), 0.0), L2, c_main, eps,
                                           max_budget);
  budgets[row] = r.S;
  capped[row] = r.capped ? 1 : 0;
  error_bound[row] = r.bound;
  norm_sq_lower[row] = L2;
  second_moment[row] = m2;
}

// ---- Double-P's sampled variant with error-targeted budgets (docs/budgets.md, -------------
// stochattn/reference/split_budgets.py) ------------------------------------------------------
// The row's output is o = w_E o_E + w_A o_A: the exact part (sinks, window, C_exact; the
// doublep_attend CTAs' partials) and C_approx's part, estimated from draws (the logit stash
// of doublep_rows: C_approx's logits, -inf elsewhere). Launches, after doublep_attend and
// santa_prop_tiles over the stash, all on the caller's stream:
//   santa_prop_second_moment over the stash (its -inf logits weigh 0): m2_A's sums and n_A;
//   doublep_split_prep: w_A, m2_A, G = ||w_E o_E|| and, under norm "auto", the way and the
//     pilot size S0 of every row (auto_pilot_plan);
//   santa_prop_sample_budgets: the pilot (stratified, purpose PURPOSE_BUDGET_PILOT, stream
//     0; fixed S = pilot under norm "pilot", S0 per row under "auto", skip_zero);
//   doublep_split_budgets: L and the variance bound by the row's way, then S;
//   santa_prop_sample_budgets: the main draws with the row's S, written as the last partial
//     of the decode's merge (exact_decode_merge, as a fixed-budget call: a row with S gives
//     the output of a fixed-budget call with S, bit for bit).

// A row's status: C_approx has mass; it is empty (nothing to draw: S = 0); or the row read
// a NaN or an infinity (S = 1, capped, NaN bound, as santa_prop_budgets).
enum SplitStatus { SPLIT_OK = 0, SPLIT_EMPTY = 1, SPLIT_NONFINITE = 2 };
// Fields of a row's split state (float64): w_E, w_A, m2_A, G = ||w_E o_E||, n_A, the way,
// the pilot's size (value rows read before the main draws: 0, n_A or S0), the status.
constexpr int kSplitFields = 8;

struct SumI {
  __device__ int operator()(int a, int b) const { return a + b; }
};

// One CTA per (b, query head) row, after santa_prop_second_moment over the stash.
//   the exact part: the first n_exact of the row's num_parts partials (doublep_attend's,
//     log2 domain) folded in float64: M_E = max m_c, Z_E = sum l_c 2^(m_c - M_E),
//     o_E = sum l_c 2^(m_c - M_E) o_c / Z_E;
//   C_approx: m* = max_t m_t of the stash's tiles (row_max, as the moment kernel), and from
//     the moment kernel's chunks (folded in chunk order, as santa_prop_budgets)
//     Z_A = sum exp(x_j - m*), m2_A = sum exp(x_j - m*) ||v_j||^2 / Z_A and n_A;
//   w_E = Z_E / (Z_E + Z_A) (common max), w_A = 1 - w_E (the reference's order);
//   exact_o[row] = w_E o_E (float64, D), G = ||w_E o_E||;
//   norm "auto": auto_pilot_choice, and pilot_budgets[row] = S0 for the sampled way, else 0.
// Writes state[row] (kSplitFields float64, above) and pilot_budgets[row].
template <int kOnDemand = 0>  // compiled on demand (decode_common.cuh)
__global__ void __launch_bounds__(kSampleThreads)
doublep_split_prep(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                   int num_parts, int n_exact, const float* __restrict__ tile_m,
                   const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                   const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len,
                   int page_size, long long page_stride, int row_stride, int head_stride,
                   const double* __restrict__ parts, int n_chunks, double* __restrict__ state,
                   double* __restrict__ exact_o, int* __restrict__ pilot_budgets, int Hq,
                   long long N, long long n_tiles, int tile_size, int D, int norm, double eps,
                   double c_main, double c_full, double inv_dp, int pilot) {
  STOCHATTN_PDL_ENTRY();
  __shared__ float sm_f[kSampleWarps];
  __shared__ double sm_d[kSampleWarps];
  const long long row = blockIdx.x;  // b * Hq + h
  const int tid = threadIdx.x;
  const int b = (int)(row / Hq);
  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const long long len = stream_length(seq_lens, table, b, N);
  double* st = state + row * kSplitFields;
  double* e = exact_o + row * D;
  // The exact part's (max, sum); every thread folds the few partials itself.
  const float* ml = part_ml + row * num_parts * 2;
  double M = (double)STOCHATTN_NEG_INF;
  bool bad = false;
  for (int c = 0; c < n_exact; ++c) {
    const double m = (double)ml[2 * c];
    if (m != m) bad = true; else M = fmax(M, m);
  }
  double LE = 0.0;
  if (M != (double)STOCHATTN_NEG_INF)
    for (int c = 0; c < n_exact; ++c) LE += (double)ml[2 * c + 1] * exp2((double)ml[2 * c] - M);
  if (LE != LE) bad = true;
  int status = SPLIT_OK;
  float mstar_f = STOCHATTN_NEG_INF;
  if (len > 0) mstar_f = row_max(tile_m + row * n_tiles,
                                 (int)((len + tile_size - 1) / tile_size), sm_f);
  if (mstar_f == STOCHATTN_NEG_INF) status = SPLIT_EMPTY;  // no C_approx token
  else if (mstar_f != mstar_f || bad) status = SPLIT_NONFINITE;
  if (status != SPLIT_OK) {  // uniform over the block
    for (int d = tid; d < D; d += kSampleThreads) e[d] = 0.0;
    if (tid == 0) {
      for (int f = 0; f < kSplitFields; ++f) st[f] = 0.0;
      st[7] = (double)status;
      pilot_budgets[row] = 0;
    }
    return;
  }
  const int chunks = (int)((len + kMomentChunk - 1) / kMomentChunk);
  const double* prow = parts + row * n_chunks * kMomentFields;
  double num = 0.0, den = 0.0, cnt = 0.0;
  for (int c = tid; c < chunks; c += kSampleThreads) {
    num += prow[kMomentFields * c];
    den += prow[kMomentFields * c + 1];
    cnt += prow[kMomentFields * c + 3];
  }
  num = block_reduce(num, SumD(), sm_d);
  den = block_reduce(den, SumD(), sm_d);
  cnt = block_reduce(cnt, SumD(), sm_d);
  const double m2 = den > 0.0 ? __ddiv_rn(num, den) : 0.0;
  // Both masses on the log2 scale of the partials: Z_E = LE 2^M, Z_A = den 2^(m* log2 e).
  const double mA = (double)mstar_f * 1.4426950408889634;
  const double Mx = fmax(M, mA);
  const double zE = M == (double)STOCHATTN_NEG_INF ? 0.0 : LE * exp2(M - Mx);
  const double zA = den * exp2(mA - Mx);
  const double we = __ddiv_rn(zE, __dadd_rn(zE, zA));
  const double wA = __dsub_rn(1.0, we);
  double g2 = 0.0;
  for (int d = tid; d < D; d += kSampleThreads) {
    double o = 0.0;
    if (LE > 0.0) {
      for (int c = 0; c < n_exact; ++c) {
        const double w = (double)ml[2 * c + 1] * exp2((double)ml[2 * c] - M);
        o += w * (double)part_o[(row * num_parts + c) * D + d];
      }
      o /= LE;
    }
    const double ed = __dmul_rn(we, o);
    e[d] = ed;
    g2 += ed * ed;
  }
  g2 = block_reduce(g2, SumD(), sm_d);
  if (tid != 0) return;
  const double G = __dsqrt_rn(g2);
  AutoChoice ch;
  ch.way = norm == SPLIT_NORM_PILOT ? SPLIT_WAY_SAMPLED : SPLIT_WAY_BOUND;
  ch.size = norm == SPLIT_NORM_PILOT ? pilot : 0;
  if (norm == SPLIT_NORM_AUTO)
    ch = auto_pilot_choice(wA, m2, G, (long long)cnt, eps, c_main, c_full, inv_dp, pilot);
  st[0] = we;
  st[1] = wA;
  st[2] = m2;
  st[3] = G;
  st[4] = cnt;
  st[5] = (double)ch.way;
  st[6] = (double)ch.size;
  st[7] = (double)SPLIT_OK;
  pilot_budgets[row] = norm == SPLIT_NORM_AUTO && ch.way == SPLIT_WAY_SAMPLED ? (int)ch.size : 0;
}

// Tokens of the stash one thread tests per step of doublep_split_budgets' exact read (16-byte
// loads, all issued before any is used; divides every tile size).
constexpr int kReadAhead = 16;

// One CTA per row, after the pilot: choose_split_budgets' L and variance bound V_A by the
// row's way, then S (budget_from_variance, the rule's one home):
//   bound:   L = max(0, G - w_A sqrt(m2_A)), V_A = m2_A, c = c(delta);
//   sampled: y = ||o_p|| (the pilot's fp32 mean, `pilot_o`), k = k_pilot (norm "pilot") or
//            (1 / delta_pilot) / S0 (norm "auto": Markov's factor), L_A =
//            pilot_norm_lower(y, m2_A, k), V_A = m2_A - L_A^2, L = ||w_E o_E + w_A o_p|| -
//            w_A sqrt(k max(V_A, 0)), under "auto" at least the bound's L; c = c(delta_main);
//   exact (norm "auto", n_A <= pilot): C_approx's tokens of positive weight listed in
//            position order into `list` (the row's `pilot` columns of the pilot's index
//            scratch, unused by this row), then o_A = sum_j w_j v_j / sum_j w_j (a warp per
//            token, float64, warps folded in order), V_A = m2_A - ||o_A||^2,
//            L^2 = ||w_E o_E + w_A o_A||^2; c = c(delta).
// Then var = w_A^2 max(V_A, 0) and S from (var, L^2). Writes budget, capped, error_bound,
// norm_sq_lower (L^2), second_moment (m2_A) and variance (var). Empty C_approx: S = 0,
// bound 0; a non-finite row: S = 1, capped, NaN bound.
template <int kOnDemand = 0>  // compiled on demand (decode_common.cuh)
__global__ void __launch_bounds__(kSampleThreads)
doublep_split_budgets(const double* __restrict__ state, const double* __restrict__ exact_o,
                      const float* __restrict__ pilot_o, const float* __restrict__ logits,
                      const float* __restrict__ tile_m, const void* __restrict__ v,
                      const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                      const int* __restrict__ kv_indices,
                      const int* __restrict__ kv_last_page_len, int page_size,
                      long long page_stride, int row_stride, int head_stride,
                      int* __restrict__ list, int* __restrict__ budget,
                      int* __restrict__ capped, double* __restrict__ error_bound,
                      double* __restrict__ norm_sq_lower, double* __restrict__ second_moment,
                      double* __restrict__ variance, int Hq, int G, long long N,
                      long long n_pad, long long n_tiles, int tile_size, int D, int dtype,
                      int norm, double eps, double c_main, double c_full, double k_pilot,
                      double inv_dp, int max_budget, int pilot) {
  STOCHATTN_PDL_ENTRY();
  __shared__ float sm_f[kSampleWarps];
  __shared__ double sm_d[kSampleWarps];
  __shared__ int sm_i[kSampleWarps + 1];
  __shared__ double red[kSampleWarps * 128];  // the exact read's per-warp sums (D <= 128)
  const long long row = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const double* st = state + row * kSplitFields;
  const int status = (int)st[7];
  if (status != SPLIT_OK) {  // uniform over the block
    if (tid == 0) {
      const bool nf = status == SPLIT_NONFINITE;
      const double nan = (double)STOCHATTN_NAN;
      budget[row] = nf ? 1 : 0;
      capped[row] = nf ? 1 : 0;
      error_bound[row] = nf ? nan : 0.0;
      norm_sq_lower[row] = nf ? nan : 0.0;
      second_moment[row] = nf ? nan : 0.0;
      variance[row] = nf ? nan : 0.0;
    }
    return;
  }
  const double wA = st[1], m2 = st[2], Gn = st[3];
  const int way = (int)st[5];
  const long long size = (long long)st[6];
  const double* e = exact_o + row * D;
  // The squared norms split_bound takes (float64, over d; block_reduce's fixed order).
  double y2 = 0.0, q2 = 0.0, a2 = 0.0, l2 = 0.0;
  if (way == SPLIT_WAY_SAMPLED) {  // uniform over the block
    const float* op = pilot_o + row * D;
    for (int d = tid; d < D; d += kSampleThreads) {
      const double o = (double)op[d];
      const double s = __dadd_rn(e[d], __dmul_rn(wA, o));
      y2 += o * o;
      q2 += s * s;
    }
    y2 = block_reduce(y2, SumD(), sm_d);
    q2 = block_reduce(q2, SumD(), sm_d);
  } else if (way == SPLIT_WAY_EXACT) {
    const int b = (int)(row / Hq), h = (int)(row % Hq);
    const int Hkv = Hq / G, kvh = h / G;
    const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                       page_stride, row_stride, head_stride);
    const long long len = stream_length(seq_lens, table, b, N);
    const float mstar = row_max(tile_m + row * n_tiles,
                                (int)((len + tile_size - 1) / tile_size), sm_f);
    const float* xrow = logits + row * n_pad;
    int* lst = list + row * pilot;
    // 1. The positive-weight tokens (the moment kernel's test: expf(x - m*) > 0, or exp in
    //    float64 where expf underflows, so there are n_A <= pilot of them; those that
    //    underflow weigh 0 in the float32 sums below) in position order: kReadAhead tokens
    //    per thread per step.
    int base = 0;
    for (long long j0 = 0; j0 < len; j0 += (long long)kSampleThreads * kReadAhead) {
      const long long j = j0 + (long long)tid * kReadAhead;
      float xs[kReadAhead];
#pragma unroll
      for (int u = 0; u < kReadAhead; u += 4) {
        const float4 f = j < len ? __ldg(reinterpret_cast<const float4*>(xrow + j + u))
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
        xs[u] = f.x; xs[u + 1] = f.y; xs[u + 2] = f.z; xs[u + 3] = f.w;
      }
      unsigned mask = 0u;
#pragma unroll
      for (int u = 0; u < kReadAhead; ++u)
        if (j + u < len && (expf(xs[u] - mstar) > 0.f || exp((double)xs[u] - (double)mstar) > 0.0))
          mask |= 1u << u;
      const int n = __popc(mask);
      const int inc = block_inclusive_scan(n, 0, SumI(), sm_i);
      int at = base + inc - n;
      for (int u = 0; u < kReadAhead; ++u)
        if ((mask >> u) & 1u) {
          if (at < pilot) lst[at] = (int)(j + u);
          ++at;
        }
      if (tid == kSampleThreads - 1) sm_i[kSampleWarps] = inc;
      __syncthreads();
      base += sm_i[kSampleWarps];
      __syncthreads();
    }
    __syncthreads();  // the list is written
    const int n_list = base < pilot ? base : pilot;
    // 2. o_A, a warp per listed token, lanes over d, float64; warps folded in order.
    const BudgetRows vrows = budget_rows(v, 2, table, b, kvh, Hkv, N, D);
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    double ws = 0.0;
    for (int m = warp; m < n_list; m += kSampleWarps) {
      const int J = lst[m];
      const double w = (double)expf(__ldg(xrow + J) - mstar);
      const unsigned short* vj = vrows.row_of<unsigned short>(J);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int d = lane + 32 * i;
        if (d < D) {
          const unsigned short hv = __ldg(vj + d);
          const float x = dtype == 0 ? Elem<f16>::to_float(hv) : Elem<bf16>::to_float(hv);
          acc[i] += w * (double)x;
        }
      }
      ws += w;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (lane + 32 * i < D) red[warp * 128 + lane + 32 * i] = acc[i];
    const double wsum = block_reduce(lane == 0 ? ws : 0.0, SumD(), sm_d);  // syncs: red ready
    for (int d = tid; d < D; d += kSampleThreads) {
      double s = 0.0;
      for (int w = 0; w < kSampleWarps; ++w) s += red[w * 128 + d];  // fixed order
      const double oa = s / wsum;
      const double q = __dadd_rn(e[d], __dmul_rn(wA, oa));
      a2 += oa * oa;
      l2 += q * q;
    }
    a2 = block_reduce(a2, SumD(), sm_d);
    l2 = block_reduce(l2, SumD(), sm_d);
  }
  if (tid != 0) return;
  const SplitBound sb = split_bound(norm, way, wA, m2, Gn, size, y2, q2, a2, l2, c_main, c_full,
                                    k_pilot, inv_dp);
  const RowBudget r = budget_from_variance(sb.var, sb.L2, sb.c, eps, max_budget);
  budget[row] = r.S;
  capped[row] = r.capped ? 1 : 0;
  error_bound[row] = r.bound;
  norm_sq_lower[row] = sb.L2;
  second_moment[row] = m2;
  variance[row] = sb.var;
}

// ---- ||v_j||^2 beside the cache (stochattn/value_norms.py) -----------------------------
// out[i0, i1, i2] = sum_d float(v[i0, i1, i2, d])^2, accumulated in float64 (one warp per
// row, a fixed xor tree: deterministic) and rounded once to float32. `dtype`: 0 float16,
// 1 bfloat16, 2 float32. v's leading axes have strides vs* (elements; d has stride 1),
// out's os*. Which rows:
//   mode 0: all s0 * s1 * s2 of them;
//   mode 1: append to a contiguous (B, H, N) cache: row r = (b, h, i) of B * H * count,
//           token start_b + i (rows outside [0, s2) skipped);
//   mode 2: append to a paged cache's pool (page, slot, h) ("NHD", hnd = 0) or
//           (page, h, slot) (hnd = 1): token start_b + i of sequence b through the page
//           table kv_indptr / kv_indices (kv_rows.cuh's rule, as budget_rows; tokens
//           outside the sequence's pages skipped).
// start_b: `start` (B,) read on the device, int32 or (start_int64 = 1) int64; with
// `start` null, `start0` for every sequence (no array to fill on the host).
constexpr int kNormThreads = 256;
template <int kOnDemand = 0>  // compiled on demand (decode_common.cuh)
__global__ void __launch_bounds__(kNormThreads)
value_sqnorms_rows(const void* __restrict__ v, int dtype, int D, long long rows, int mode,
                   long long s0, long long s1, long long s2, long long vs0, long long vs1,
                   long long vs2, float* __restrict__ out, long long os0, long long os1,
                   long long os2, const void* __restrict__ start, int start_int64,
                   long long start0, int count, const int* __restrict__ kv_indptr,
                   const int* __restrict__ kv_indices, int page_size, int hnd, int H) {
  STOCHATTN_PDL_ENTRY();
  const long long r = (long long)blockIdx.x * (kNormThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int eb = dtype == 2 ? 4 : 2;  // bytes per element of v
  long long i0 = 0, i1 = 0, i2 = 0;   // modes 0 and 1: the row's indices
  const unsigned char* vrow = nullptr;  // the row's first element
  float* orow = nullptr;                // its norm
  if (mode == 0) {
    i0 = r / (s1 * s2);
    i1 = (r / s2) % s1;
    i2 = r % s2;
  } else {
    const long long b = r / ((long long)H * count);
    const long long h = (r / count) % H;
    long long tok = start0;
    if (start)
      tok = start_int64 ? __ldg(static_cast<const long long*>(start) + b)
                        : (long long)__ldg(static_cast<const int*>(start) + b);
    tok += r % count;
    if (tok < 0) return;
    if (mode == 1) {
      if (tok >= s2) return;
      i0 = b; i1 = h; i2 = tok;
    } else {
      const long long pages = (long long)__ldg(kv_indptr + b + 1) - __ldg(kv_indptr + b);
      if (tok >= pages * page_size) return;  // past the sequence's pages
      // Slot and head strides of the pools, by layout (the host checks they fit in int).
      const int vrs = (int)(hnd ? vs2 : vs1), vhs = (int)(hnd ? vs1 : vs2);
      const int ors = (int)(hnd ? os2 : os1), ohs = (int)(hnd ? os1 : os2);
      vrow = budget_rows(v, eb, page_table(kv_indptr, kv_indices, nullptr, page_size, vs0, vrs,
                                           vhs),
                         (int)b, (int)h, H, 0, D).row_of<unsigned char>(tok);
      orow = const_cast<float*>(
          budget_rows(out, 4, page_table(kv_indptr, kv_indices, nullptr, page_size, os0, ors,
                                         ohs),
                      (int)b, (int)h, H, 0, 1).row_of<float>(tok));
    }
  }
  if (mode != 2) {
    vrow = static_cast<const unsigned char*>(v) + (i0 * vs0 + i1 * vs1 + i2 * vs2) * eb;
    orow = out + i0 * os0 + i1 * os1 + i2 * os2;
  }
  double acc = 0.0;
  for (int d = lane; d < D; d += 32) {
    float x;
    if (dtype == 0)
      x = Elem<f16>::to_float(reinterpret_cast<const unsigned short*>(vrow)[d]);
    else if (dtype == 1)
      x = Elem<bf16>::to_float(reinterpret_cast<const unsigned short*>(vrow)[d]);
    else
      x = reinterpret_cast<const float*>(vrow)[d];
    acc += (double)x * (double)x;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) *orow = (float)acc;
}
