// S²ANTA-prop: unbiased sampled attention in two passes (SPEC section 1, "prop").
//
// Pass 1 (santa_prop_pass1): grid (num_chunks, Hkv, B) as in exact_decode.cu; a CTA reads
// the K rows of its chunk once for all G heads of the group (cp.async pipeline), computes
// the logits x = scale * q.k in fp32 and, per sampling tile of `tile_size` tokens and per
// query head, the tile max m_t, the tile-local inclusive cumsum of exp(x - m_t) (fp32,
// written to `cum`) and l_t = its last entry. V is not touched.
//
//   Stash choice: pass 2 needs, for a sampled tile, the tile-local CDF. Stashing that CDF
//   (4 bytes per token and query head, the same size as the logits) instead of the logits
//   saves pass 2 an exp and a scan per sampled tile and turns its row search into a binary
//   search; recomputing from K instead would re-read 2*D bytes per token of every sampled
//   tile. The stash costs 4*G bytes per token against 2*D bytes of K: 6% at G=4, D=128.
//
// Pass 2 (santa_prop_sample): one CTA per (b, query head):
//   1. m* = max_t m_t; W_t = exp(m_t - m*) l_t and the prefix C_t in float64 (segmented
//      scan), Z = C_{T-1}; t_last = last tile with W_t > 0.
//   2. The S global points of the reference sampler (row = b*Hq + h, stream 0), float64:
//      systematic and stratified point m is computed on demand; iid writes its S + 1
//      exponential spacings and their prefix sums to a scratch buffer.
//   3. Tile t holds the points with C_{t-1} <= T_m Z < C_t (exactly the reference's
//      searchsorted, compared in the same float64 arithmetic), i.e. the index range
//      [n(C_{t-1}), n(C_t)) with n(c) = #{m : T_m Z < c}; the last tile with mass takes
//      every point up to S. n(c) has a closed form for systematic (ceil(S c/Z - u)) and
//      stratified (floor(S c/Z)) that is then corrected by at most a step or two so that it
//      agrees with the float64 comparison; iid binary-searches its sorted points. Each
//      non-empty tile marks its first point and a max-scan over m gives every point its
//      tile (balanced even when one tile holds all points).
//   4. Each point becomes a row of its tile: the first row whose local cumsum exceeds
//      (T_m Z - C_{t-1}) / exp(m_t - m*), clipped to the row where the cumsum reaches l_t
//      (the last positive-weight row), by binary search in the stashed CDF.
//   5. Gather-and-add: out = (1/S) sum_m v[J_m] in fp32, in a fixed order (deterministic);
//      tiles without points read no V.
#include "decode_common.cuh"
#include "philox.cuh"

using namespace stochattn;

constexpr int kMaxTile = 256;  // largest tile_size (a power of two in [32, 256])

template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads)
santa_prop_pass1(const T* __restrict__ q, const T* __restrict__ k,
                 const int* __restrict__ seq_lens, float* __restrict__ cum,
                 float* __restrict__ tile_m, float* __restrict__ tile_l, int Hkv, int G,
                 long long N, long long chunk_len, int tile_size, long long n_pad,
                 long long n_tiles, float scale) {
  using Tl = Tiling<D>;
  constexpr int LPR = Tl::kLanesPerRow;
  constexpr int RPT = Tl::kRowsPerThread;
  constexpr int ROWS = Tl::kTileRows;
  constexpr int RG = Tl::kRowGroups;
  static_assert(ROWS <= kMaxTile, "a stage must fit in the logit buffer");

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int Hq = Hkv * G;
  const int tid = threadIdx.x;
  const int lr = tid % LPR, rg = tid / LPR;
  const int warp = tid / 32, lane = tid % 32;

  const long long len = sequence_length(seq_lens, b, N);
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, len);
  if (start >= end) return;  // tiles past the sequence are never read by pass 2
  const long long head0 = (long long)b * Hq + (long long)kvh * G;

  unsigned char* smem = dynamic_smem();  // kStages * kStageBytes of K stages
  __shared__ float xs[GMAX * kMaxTile];  // logits of the current buffer of rows, per head
  // The logit buffer spans BUF rows: a whole sampling tile, or a whole load tile when the
  // load tile is longer. chunk_len is a multiple of BUF (host side).
  const int BUF = tile_size > ROWS ? tile_size : ROWS;

  float qf[GMAX][8];
  load_group_queries<T, D, GMAX>(q, head0, G, lr, scale, qf);

  const unsigned char* kbase =
      reinterpret_cast<const unsigned char*>(k + ((long long)b * Hkv + kvh) * N * D);
  const long long ntiles = (end - start + ROWS - 1) / ROWS;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) load_tile_async<D>(smem + s * kStageBytes, kbase, start + (long long)s * ROWS, end);
    cp_async_commit();
  }

  const int rpl = tile_size / 32;  // rows per lane in the tile statistics (1..8)

  int rd = 0, wr = kStages - 1;  // stage buffers read and refilled this iteration
  for (long long it = 0; it < ntiles; ++it) {
    // Each thread reads only the pieces it copied (decode_common.cuh): its own wait
    // suffices, no CTA barrier here. The xs buffer is guarded by the barriers around the
    // tile statistics below.
    cp_async_wait<kStages - 2>();
    {
      const long long nx = it + kStages - 1;
      if (nx < ntiles) load_tile_async<D>(smem + wr * kStageBytes, kbase, start + nx * ROWS, end);
      cp_async_commit();
    }
    const unsigned char* sk = smem + rd * kStageBytes;
    rd = rd + 1 == kStages ? 0 : rd + 1;
    wr = wr + 1 == kStages ? 0 : wr + 1;
    const long long row0 = start + it * ROWS;
    const int pos0 = (int)((it * ROWS) % BUF);  // where this load tile sits in the buffer

    float x[RPT * GMAX];  // partial dot products x[p * GMAX + g]
#pragma unroll
    for (int p = 0; p < RPT; ++p) {
      const int r = rg + p * RG;
      float kf[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(sk + r * (D * 2) + lr * 16), kf);
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float s = 0.f;
        if (g < G) {
#pragma unroll
          for (int e = 0; e < 8; ++e) s = fmaf(qf[g][e], kf[e], s);
        }
        x[p * GMAX + g] = s;
      }
    }
    if constexpr (kReduce == 0) {
#pragma unroll
      for (int j = 0; j < RPT * GMAX; ++j) x[j] = row_group_sum<LPR>(x[j]);
      if (lr == 0) {
#pragma unroll
        for (int p = 0; p < RPT; ++p) {
          const int r = rg + p * RG;
          const bool valid = row0 + r < end;
#pragma unroll
          for (int g = 0; g < GMAX; ++g)
            if (g < G) xs[g * kMaxTile + pos0 + r] = valid ? x[p * GMAX + g] : STOCHATTN_NEG_INF;
        }
      }
    } else {
      // Reduce-scatter; each finished logit is written by its first owner lane (no
      // broadcast needed: the statistics read the logits from shared memory).
      using L = ScatterLayout<LPR, RPT * GMAX>;
      Scatter<LPR / 2, RPT * GMAX>::run(x, lr);
      if (lr % L::kSpan == 0) {
#pragma unroll
        for (int i = 0; i < L::kPer; ++i) {
          const int j = L::index(i, lr);
          const int p = j / GMAX, g = j % GMAX;
          const int r = rg + p * RG;
          if (g < G) xs[g * kMaxTile + pos0 + r] = row0 + r < end ? x[i] : STOCHATTN_NEG_INF;
        }
      }
    }

    // Buffer complete (or chunk done): tile statistics, one warp per (head, sampling tile).
    const bool full = ((it + 1) * ROWS) % BUF == 0 || it == ntiles - 1;
    if (full) {
      __syncthreads();
      const long long buf_tok0 = start + ((it * ROWS) / BUF) * BUF;
      const long long remaining = end - buf_tok0;  // > 0
      const int tiles_in_buf = BUF / tile_size;
      const int tiles_here = (int)min((long long)tiles_in_buf, (remaining + tile_size - 1) / tile_size);
      for (int item = warp; item < G * tiles_here; item += kWarps) {
        const int g = item / tiles_here, tt = item % tiles_here;
        const long long tok0 = buf_tok0 + (long long)tt * tile_size;
        const float* xv = xs + g * kMaxTile + tt * tile_size;
        // Lane `lane` owns rows [lane * rpl, lane * rpl + rpl) of the tile. Rows past the
        // sequence (or never loaded, in a last partial buffer) count as -inf.
        float xr[8];
        float mx = STOCHATTN_NEG_INF;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          xr[i] = STOCHATTN_NEG_INF;
          if (i < rpl) {
            const int j = lane * rpl + i;
            if (tok0 + j < end) xr[i] = xv[j];
            mx = fmaxf(mx, xr[i]);
          }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        // mx is finite: the tile's first row is in the sequence. Max shift: exp(x - m_t)
        // <= 1, so logits of any magnitude are safe; rows at -inf give exactly 0.
        float run = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (i < rpl) {
            run += expf(xr[i] - mx);
            xr[i] = run;  // lane-local inclusive prefix
          }
        }
        // Warp inclusive scan of the lane totals; exclusive prefix = previous lane's.
        float inc = run;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const float y = __shfl_up_sync(0xffffffffu, inc, off);
          if (lane >= off) inc += y;
        }
        float exc = __shfl_up_sync(0xffffffffu, inc, 1);
        if (lane == 0) exc = 0.f;
        const long long hrow = head0 + g;
        float* dst = cum + hrow * n_pad + tok0 + lane * rpl;
        float last = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (i < rpl) {
            last = exc + xr[i];
            dst[i] = last;
          }
        }
        if (lane == 31) {  // l_t is the stored CDF's last entry, so the two always agree
          const long long t = tok0 / tile_size;
          tile_m[hrow * n_tiles + t] = mx;
          tile_l[hrow * n_tiles + t] = last;
        }
      }
      __syncthreads();  // xs is read: the next stages may overwrite it
    }
  }
  cp_async_wait<0>();
}

// ---- pass 2 --------------------------------------------------------------------------
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

// Exclusive prefix of one float64 total per thread, summed sequentially in thread order.
// Thread k's segment then holds fl(offset_k + partial) and the last value of segment k-1,
// fl(offset_{k-1} + total_{k-1}), is exactly offset_k: the prefix stays non-decreasing
// across segments, which the tile assignment relies on (a tree scan does not promise it).
__device__ double block_exclusive_offsets(double total, double* sm /* [kSampleThreads] */) {
  sm[threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.x == 0) {
    double acc = 0.0;
    for (int i = 0; i < kSampleThreads; ++i) {
      const double t = sm[i];
      sm[i] = acc;
      acc += t;
    }
  }
  __syncthreads();
  const double r = sm[threadIdx.x];
  __syncthreads();
  return r;
}

struct MaxI {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};
struct MaxF {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename T, int D>
__global__ void __launch_bounds__(kSampleThreads)
santa_prop_sample(const T* __restrict__ v, const int* __restrict__ seq_lens,
                  const float* __restrict__ cum, const float* __restrict__ tile_m,
                  const float* __restrict__ tile_l, double* __restrict__ C,
                  double* __restrict__ iid_points, int* __restrict__ idx32,
                  long long* __restrict__ idx_out, T* __restrict__ out, int Hq, int G,
                  long long N, long long n_pad, long long n_tiles, int tile_size, int S,
                  int sampler, unsigned long long seed, unsigned offset) {
  __shared__ double sm_d[kSampleThreads];
  __shared__ int sm_i[kSampleWarps + 1];
  __shared__ float sm_f[kSampleWarps + 1];
  __shared__ float red[kSampleThreads * 8];  // gather partial sums: (threads / (D/8)) x D

  const int tid = threadIdx.x;
  const long long row = blockIdx.x;  // b * Hq + h: also the random-stream row
  const int b = (int)(row / Hq), h = (int)(row % Hq);
  const int Hkv = Hq / G, kvh = h / G;
  const long long len = sequence_length(seq_lens, b, N);
  T* orow = out + row * D;
  int* ids = idx32 + row * S;

  if (len == 0) {  // empty sequence: zero output; indices 0 as the reference
    for (int d = tid; d < D; d += kSampleThreads) orow[d] = Elem<T>::from_float(0.f);
    if (idx_out)
      for (int m = tid; m < S; m += kSampleThreads) idx_out[row * S + m] = 0;
    return;
  }
  const int T_b = (int)((len + tile_size - 1) / tile_size);
  const float* tm = tile_m + row * n_tiles;
  const float* tl = tile_l + row * n_tiles;
  double* Cr = C + row * n_tiles;

  // 1. m* and the tile prefix C_t in float64; thread tid owns a contiguous segment.
  float mxl = STOCHATTN_NEG_INF;
  for (int t = tid; t < T_b; t += kSampleThreads) mxl = fmaxf(mxl, tm[t]);
  mxl = block_inclusive_scan(mxl, STOCHATTN_NEG_INF, MaxF(), sm_f);
  if (tid == kSampleThreads - 1) sm_f[kSampleWarps] = mxl;
  __syncthreads();
  const double mstar = (double)sm_f[kSampleWarps];

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
  const double exc = block_exclusive_offsets(run, sm_d);
  for (int t = t0; t < t1; ++t) Cr[t] = exc + Cr[t];
  const int tlast = block_inclusive_scan(lastpos, -1, MaxI(), sm_i);
  if (tid == kSampleThreads - 1) sm_i[kSampleWarps] = tlast;
  __syncthreads();  // also publishes Cr to the block
  const int t_last = sm_i[kSampleWarps];
  const double Z = Cr[T_b - 1];

  // 2. Sample points.
  Points P;
  P.sampler = sampler;
  P.S = S;
  P.rs = RngStream::make(seed, offset, PURPOSE_VALUE_SAMPLER, (unsigned)row);
  P.u = (double)P.rs.uniform(0u, 0u);
  P.iid = iid_points + row * (long long)(S + 1);
  if (sampler == SAMPLER_IID) {
    // E_i = -log(u_i), i = 0..S; prefix sums in float64; T_m = c_m / c_S.
    double* pr = iid_points + row * (long long)(S + 1);
    const int n = S + 1;
    const int sg = (n + kSampleThreads - 1) / kSampleThreads;
    const int i0 = min(tid * sg, n), i1 = min(i0 + sg, n);
    double r = 0.0;
    for (int i = i0; i < i1; ++i) {
      r += iid_spacing(P.rs, i);
      pr[i] = r;
    }
    const double ec = block_exclusive_offsets(r, sm_d);
    for (int i = i0; i < i1; ++i) pr[i] = ec + pr[i];
    __syncthreads();
    const double total = pr[S];
    for (int i = i0; i < min(i1, S); ++i) pr[i] = pr[i] / total;
    __syncthreads();
  }

  // 3. Tile of every point: mark each non-empty tile's first point, then max-scan.
  for (int m = tid; m < S; m += kSampleThreads) ids[m] = -1;
  __syncthreads();
  for (int t = tid; t <= t_last; t += kSampleThreads) {
    const int lo = t == 0 ? 0 : P.count_below(Cr[t - 1], Z);
    const int hi = t == t_last ? S : P.count_below(Cr[t], Z);
    if (hi > lo) ids[lo] = t;
  }
  __syncthreads();
  {
    const int sg = (S + kSampleThreads - 1) / kSampleThreads;
    const int m0 = min(tid * sg, S), m1 = min(m0 + sg, S);
    int mk = -1;
    for (int m = m0; m < m1; ++m) mk = max(mk, ids[m]);
    const int incm = block_inclusive_scan(mk, -1, MaxI(), sm_i);
    // Exclusive max: the previous thread's inclusive value.
    __shared__ int sm_seg[kSampleThreads];
    sm_seg[tid] = incm;
    __syncthreads();
    int cur = tid > 0 ? sm_seg[tid - 1] : -1;
    for (int m = m0; m < m1; ++m) {
      cur = max(cur, ids[m]);
      ids[m] = cur;  // tile of point m (point 0 always starts a tile, so cur >= 0)
    }
  }
  __syncthreads();

  // 4. Row of every point inside its tile.
  for (int m = tid; m < S; m += kSampleThreads) {
    const int t = ids[m];
    const double before = t > 0 ? Cr[t - 1] : 0.0;
    // Mass left of the point inside the tile, in the tile's units exp(x - m_t):
    // T Z - C_{t-1} = exp(m_t - m*) * (local mass).
    double target = (P(m) * Z - before) / exp((double)tm[t] - mstar);
    const float* cr = cum + row * n_pad + (long long)t * tile_size;
    const double cl = (double)cr[tile_size - 1];  // l_t: the CDF is flat past the sequence
    // First row with cumsum > target, clipped to the first row reaching l_t (the last
    // positive-weight row): search with target in [0, the double just below l_t].
    target = fmin(fmax(target, 0.0), nextafter(cl, 0.0));
    int lo = 0, hi = tile_size - 1;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if ((double)cr[mid] > target) hi = mid; else lo = mid + 1;
    }
    const int J = t * tile_size + lo;
    ids[m] = J;
    if (idx_out) idx_out[row * S + m] = J;
  }
  __syncthreads();

  // 5. Gather-and-add of the S value rows, 16 bytes per thread per row.
  constexpr int LPR = D / 8;
  constexpr int GROUPS = kSampleThreads / LPR;
  const int lr = tid % LPR, grp = tid / LPR;
  const T* vb = v + (((long long)b * Hkv + kvh) * N) * D + lr * 8;
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  constexpr int U = 4;  // independent loads in flight per thread
  for (int m0 = grp; m0 < S; m0 += U * GROUPS) {
    uint4 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int m = m0 + u * GROUPS;
      raw[u] = m < S ? __ldg(reinterpret_cast<const uint4*>(vb + (long long)ids[m] * D))
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
    orow[d] = Elem<T>::from_float(s / (float)S);
  }
}
