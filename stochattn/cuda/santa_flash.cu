// S²ANTA-flash: sampled attention in one streaming pass, no global sync (SPEC section 1,
// "flash"; reference: stochattn/reference/santa.py, flash_estimate).
//
// Per (sequence b, query head h) with L tokens, T_L = ceil(L / tile_size) tiles and
// S_t = ceil(S / T_L): tile t draws S_t points from its OWN local distribution
// exp(x - m_t) (Philox row b * Hq + h, stream t, purpose value sampler: the reference's
// sample_points(sampler, S_t, row, stream=t)), maps each through the tile-local CDF to a
// row, and forms the mean mu_t of those S_t V rows. The output is
//     o_hat = sum_t (W_t / Z) mu_t,   W_t = exp(m_t - m*) l_t,  l_t = sum exp(x - m_t),
// unbiased because E[mu_t] is the tile's exact local attention output.
//
// Kernel santa_flash_chunk: grid (num_chunks, Hkv, B), as exact_decode_chunk. A CTA streams
// the K rows of its chunk once for all G heads of the GQA group through the cp.async
// pipeline (decode_common.cuh), computes the logits x = scale * q.k in fp32 (natural-log
// domain, like santa_prop_pass1, so the draws match the reference) into a shared buffer of
// BUF = max(tile_size, stage rows) rows per head. chunk_len is a multiple of BUF, so a
// buffer holds whole sampling tiles and a tile never straddles two chunks. When a buffer is
// complete, three barrier-separated phases:
//   A. tile statistics, one warp per (head g, tile): m_t, the tile-local inclusive cumsum
//      of exp(x - m_t) in fp32 (written over the logits, in place) and l_t = its last
//      entry, so the weight l_t and the CDF that is inverted always agree;
//   B. thread g < G folds the buffer's tiles into head g's running state (M, L) (the
//      flash-decoding rescaling: M = max m_t, L = sum_t exp(m_t - M) l_t) and writes each
//      tile's per-draw weight exp(m_t - M) l_t / S_t; one warp per (head, tile) makes the
//      S_t points (float64, bit for bit the reference's for systematic and stratified;
//      iid sums its spacings in NumPy's sequential order), inverts each (the first row
//      whose cumsum exceeds T * l_t, clipped to the first row that reaches l_t, i.e. the
//      last positive-weight row, as invert_cdf) and counts the draws per row (shared
//      atomics: integer, order-free);
//   C. every thread rescales its accumulators by exp(M_old - M_new) and the row groups
//      gather the V rows of the buffer that hold at least one draw of some head (one
//      16-byte load per lane, each row read once for the whole group, duplicates counted
//      instead of re-read), adding weight * count * v to the head's accumulator.
// Rows past the sequence have weight 0 and are never drawn; nothing past `end` is read.
// At the end the row groups' accumulators are summed (fixed order: deterministic) and the
// CTA writes out = A / L (one chunk) or the chunk partial (M log2(e), L, A / L), which
// exact_decode_merge (exact_decode.cu, included and reused unchanged: it works in the log2
// domain, hence the factor) combines over chunks.
//
// Optional outputs (null pointers skip them):
//   idx_out  (B * Hq, idx_stride) int64, idx_stride = S + T - 1 >= T_L * S_t: the draws of
//            tile t at [t * S_t, (t + 1) * S_t), global token indices (sorted: tiles in
//            order, points sorted in a tile); slots past T_L * S_t (every slot of an empty
//            sequence) hold -1.
//   tile_m_out, tile_l_out  (B * Hq, T) fp32: m_t (natural-log units) and l_t; -inf and 0
//            for tiles past the sequence. Both or neither.
//   samples_out  (B,) int32: S_t of each sequence (0 when empty).
//
// Template parameters as exact_decode_chunk: element type, head dim D (64, 128), GMAX (4, 8).
#include "decode_common.cuh"
#include "philox.cuh"
// exact_decode_merge (the flash partials have its form); its chunk kernel is not instantiated.
#include "exact_decode.cu"

using namespace stochattn;

constexpr int kFlashMaxTile = 256;                       // largest tile_size and stage rows
constexpr int kFlashTilesPerBuf = kFlashMaxTile / 32;    // BUF / tile_size <= 256 / 32
constexpr int kFlashGatherUnroll = 4;                    // V loads in flight per row group

// Row of a tile for the point T in [0, 1): the first row whose cumsum exceeds T * l_t
// (searchsorted side="right", compared in float64 like invert_cdf), with the target clipped
// to just below l_t = cr[tile_size - 1] so a target that rounding pushes to l_t selects the
// first row reaching l_t (the last row of positive fp32 weight), never a zero-weight row.
STOCHATTN_HD int flash_local_row(const float* cr, int tile_size, double point) {
  const double cl = (double)cr[tile_size - 1];
  const double target = fmin(fmax(point * cl, 0.0), nextafter(cl, 0.0));
  int lo = 0, hi = tile_size - 1;  // cr[hi] = cl > target: the answer lies in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if ((double)cr[mid] > target) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Point m of the systematic (one uniform, draw 0) or stratified (draw m) sampler of tile
// stream t with n points: samplers.sample_points(..., stream=t), bit for bit.
STOCHATTN_HD double flash_point(const RngStream& rs, int sampler, unsigned t, int m, int n, double u0) {
  const double u = sampler == SAMPLER_SYSTEMATIC ? u0 : (double)rs.uniform(t, (unsigned)m);
  return ((double)m + u) / (double)n;
}

template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads)
santa_flash_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const int* __restrict__ seq_lens, T* __restrict__ out,
                  float* __restrict__ part_o, float* __restrict__ part_ml,
                  long long* __restrict__ idx_out, float* __restrict__ tile_m_out,
                  float* __restrict__ tile_l_out, int* __restrict__ samples_out, int Hkv, int G,
                  long long N, long long chunk_len, int num_chunks, int tile_size,
                  long long n_tiles, long long idx_stride, int S, int sampler, float scale,
                  unsigned long long seed, unsigned offset) {
  using Tl = Tiling<D>;
  constexpr int LPR = Tl::kLanesPerRow;
  constexpr int RPT = Tl::kRowsPerThread;
  constexpr int ROWS = Tl::kTileRows;
  constexpr int RG = Tl::kRowGroups;
  constexpr int MT = kFlashMaxTile;
  constexpr int TPB = kFlashTilesPerBuf;
  static_assert(ROWS <= kFlashMaxTile, "a stage must fit in the logit buffer");

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int Hq = Hkv * G;
  const int tid = threadIdx.x;
  const int lr = tid % LPR, rg = tid / LPR;
  const int warp = tid / 32, lane = tid % 32;

  const long long len = sequence_length(seq_lens, b, N);
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, len);
  const long long head0 = (long long)b * Hq + (long long)kvh * G;  // first query head row
  const long long seq_tiles = (len + tile_size - 1) / tile_size;     // T_L
  // S_t = ceil(S / T_L) <= S: the draws of every tile of this sequence (0 when empty).
  const int St = seq_tiles > 0 ? (int)(((long long)S + seq_tiles - 1) / seq_tiles) : 0;

  // ---- bookkeeping outputs (before any early return) ----
  if (samples_out && chunk == 0 && kvh == 0 && tid == 0) samples_out[b] = St;
  if (idx_out && chunk == 0) {  // unused slots: T_L * S_t <= S + T_L - 1 <= idx_stride
    const long long used = seq_tiles * (long long)St;
    for (int g = 0; g < G; ++g)
      for (long long i = used + tid; i < idx_stride; i += kThreads)
        idx_out[(head0 + g) * idx_stride + i] = -1;
  }
  if (tile_m_out) {  // tiles of this chunk's range that lie past the sequence
    const long long t_lo = max(start / tile_size, seq_tiles);
    const long long t_hi = min((start + chunk_len) / tile_size, n_tiles);
    for (int g = 0; g < G; ++g)
      for (long long t = t_lo + tid; t < t_hi; t += kThreads) {
        tile_m_out[(head0 + g) * n_tiles + t] = STOCHATTN_NEG_INF;
        tile_l_out[(head0 + g) * n_tiles + t] = 0.f;
      }
  }

  if (start >= end) {  // nothing in this chunk (past seq_lens[b], or an empty sequence)
    for (int i = tid; i < G * D; i += kThreads) {
      const int g = i / D, d = i % D;
      const long long hrow = head0 + g;
      if (num_chunks == 1) {
        out[hrow * D + d] = Elem<T>::from_float(0.f);
      } else {
        part_o[(hrow * num_chunks + chunk) * D + d] = 0.f;
        if (d == 0) {
          part_ml[(hrow * num_chunks + chunk) * 2 + 0] = STOCHATTN_NEG_INF;
          part_ml[(hrow * num_chunks + chunk) * 2 + 1] = 0.f;
        }
      }
    }
    return;
  }

  unsigned char* smem = dynamic_smem();  // kStages * kStageBytes of K; then the final merge
  __shared__ float xs[GMAX * MT];        // logits of the buffer per head, then the local CDFs
  __shared__ int cnt[GMAX * MT];         // draws per row of the buffer, per head
  __shared__ float sm_tm[GMAX * TPB], sm_tl[GMAX * TPB];  // m_t, l_t of the buffer's tiles
  __shared__ float sm_w[GMAX * TPB];     // weight of one draw: exp(m_t - M) l_t / S_t
  __shared__ float sm_M[GMAX], sm_L[GMAX], sm_corr[GMAX];  // running state per head
  if (tid < GMAX) {  // published by the first phase-A barrier, read after it
    sm_M[tid] = STOCHATTN_NEG_INF;
    sm_L[tid] = 0.f;
  }
  const int BUF = tile_size > ROWS ? tile_size : ROWS;  // chunk_len is a multiple (host side)
  const int tiles_per_buf = BUF / tile_size;             // 1 .. TPB
  const int rpl = tile_size / 32;                        // rows per lane in phase A (1..8)

  float qf[GMAX][8];
  load_group_queries<T, D, GMAX>(q, head0, G, lr, scale, qf);

  const long long stream_off = ((long long)b * Hkv + kvh) * N * D;  // 64-bit element offset
  const unsigned char* kbase = reinterpret_cast<const unsigned char*>(k + stream_off);
  const T* vstream = v + stream_off;
  const long long ntiles = (end - start + ROWS - 1) / ROWS;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) load_tile_async<D>(smem + s * kStageBytes, kbase, start + (long long)s * ROWS, end);
    cp_async_commit();
  }

  // Unnormalised output of each head, this thread's 8 features, relative to exp(sm_M[g]).
  float acc[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;

  int rd = 0, wr = kStages - 1;  // stage buffers read and refilled this iteration
  for (long long it = 0; it < ntiles; ++it) {
    // Each thread reads only the K pieces it copied (decode_common.cuh): its own wait
    // suffices. xs is free: the previous buffer's phase B ended at a barrier (C) before
    // any thread got here.
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

    // Logits of this stage's rows: partial dot products of this thread's 8 features,
    // row-group sums, written to xs (-inf past `end`).
    float x[RPT * GMAX];
    group_partial_dots<T, D, GMAX>(sk, rg, lr, G, qf, x);
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
            if (g < G) xs[g * MT + pos0 + r] = valid ? x[p * GMAX + g] : STOCHATTN_NEG_INF;
        }
      }
    } else {
      // Reduce-scatter; each finished logit is written by its first owner lane.
      using L = ScatterLayout<LPR, RPT * GMAX>;
      Scatter<LPR / 2, RPT * GMAX>::run(x, lr);
      if (lr % L::kSpan == 0) {
#pragma unroll
        for (int i = 0; i < L::kPer; ++i) {
          const int j = L::index(i, lr);
          const int p = j / GMAX, g = j % GMAX;
          const int r = rg + p * RG;
          if (g < G) xs[g * MT + pos0 + r] = row0 + r < end ? x[i] : STOCHATTN_NEG_INF;
        }
      }
    }

    const bool full = ((it + 1) * ROWS) % BUF == 0 || it == ntiles - 1;
    if (!full) continue;  // uniform over the CTA

    // ======== phase A: tile statistics and local CDFs ========
    __syncthreads();  // the buffer's logits are in xs; every thread finished the last phase C
    const long long buf_tok0 = start + ((it * ROWS) / BUF) * BUF;  // first token of the buffer
    const long long remaining = end - buf_tok0;                   // > 0
    const int tiles_here = (int)min((long long)tiles_per_buf, (remaining + tile_size - 1) / tile_size);
    const int items = G * tiles_here;
    for (int i = tid; i < G * MT; i += kThreads) cnt[i] = 0;  // heads >= G are never used
    for (int item = warp; item < items; item += kWarps) {
      const int g = item / tiles_here, tt = item % tiles_here;
      const long long tok0 = buf_tok0 + (long long)tt * tile_size;
      float* xv = xs + g * MT + tt * tile_size;
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
      // mx is finite (the tile's first row is in the sequence). Max shift: exp(x - m_t) <= 1;
      // rows at -inf give exactly 0, so the CDF is flat past the sequence.
      float run = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (i < rpl) {
          run += expf(xr[i] - mx);
          xr[i] = run;  // lane-local inclusive prefix
        }
      }
      float inc = run;  // warp inclusive scan of the lane totals
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, inc, off);
        if (lane >= off) inc += y;
      }
      float exc = __shfl_up_sync(0xffffffffu, inc, 1);
      if (lane == 0) exc = 0.f;
      float last = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (i < rpl) {
          last = exc + xr[i];
          xv[lane * rpl + i] = last;  // each lane overwrites only the rows it read
        }
      }
      if (lane == 31) {  // l_t is the CDF's last entry: weight and inverted CDF agree
        sm_tm[g * TPB + tt] = mx;
        sm_tl[g * TPB + tt] = last;
        if (tile_m_out) {
          const long long t = tok0 / tile_size;
          tile_m_out[(head0 + g) * n_tiles + t] = mx;
          tile_l_out[(head0 + g) * n_tiles + t] = last;
        }
      }
    }
    __syncthreads();  // CDFs, m_t, l_t and the zeroed counts are visible

    // ======== phase B: running state, draws, counts ========
    if (tid < G) {
      const int g = tid;
      float mb = STOCHATTN_NEG_INF;
      for (int tt = 0; tt < tiles_here; ++tt) mb = fmaxf(mb, sm_tm[g * TPB + tt]);
      const float m_old = sm_M[g];
      const float m_new = fmaxf(m_old, mb);     // finite: every tile here holds a token
      const float corr = expf(m_old - m_new);   // 0 on the first buffer (m_old = -inf)
      float l_new = sm_L[g] * corr;
      for (int tt = 0; tt < tiles_here; ++tt) {
        const float w = expf(sm_tm[g * TPB + tt] - m_new) * sm_tl[g * TPB + tt];  // W_t rel. exp(M)
        l_new += w;
        sm_w[g * TPB + tt] = w / (float)St;  // each of the S_t draws carries W_t / S_t
      }
      sm_M[g] = m_new;
      sm_L[g] = l_new;
      sm_corr[g] = corr;
    }
    for (int item = warp; item < items; item += kWarps) {
      const int g = item / tiles_here, tt = item % tiles_here;
      const long long tok0 = buf_tok0 + (long long)tt * tile_size;
      const long long t = tok0 / tile_size;  // global tile index: the Philox stream
      const unsigned stream = (unsigned)t;
      const float* cr = xs + g * MT + tt * tile_size;
      int* cn = cnt + g * MT + tt * tile_size;
      long long* ir = idx_out ? idx_out + (head0 + g) * idx_stride + t * St : nullptr;
      const RngStream rs = RngStream::make(seed, offset, PURPOSE_VALUE_SAMPLER, (unsigned)(head0 + g));
      if (sampler == SAMPLER_IID) {
        // T_m = c_m / c_{S_t}, c_i = E_0 + ... + E_i, E_i = -log(u_i) (draws 0..S_t). The
        // prefix is summed in index order like NumPy's cumsum: per 32 spacings, every lane
        // adds the broadcast values one by one. Sweep 1 finds c_{S_t}; sweep 2 repeats the
        // same additions (so c_m is bit-identical) and places point m on lane m % 32.
        double total = 0.0;
        for (int base = 0; base <= St; base += 32) {
          const int i = base + lane;
          const double e = i <= St ? -log((double)rs.uniform(stream, (unsigned)i)) : 0.0;
          const int n = min(32, St + 1 - base);  // uniform over the warp
          for (int j = 0; j < n; ++j) total += __shfl_sync(0xffffffffu, e, j);
        }
        double c = 0.0;
        for (int base = 0; base < St; base += 32) {
          const int i = base + lane;
          const double e = i < St ? -log((double)rs.uniform(stream, (unsigned)i)) : 0.0;
          const int n = min(32, St - base);
          double mine = 0.0;
          for (int j = 0; j < n; ++j) {
            c += __shfl_sync(0xffffffffu, e, j);
            if (j == lane) mine = c;
          }
          if (i < St) {
            const int r = flash_local_row(cr, tile_size, mine / total);
            atomicAdd(cn + r, 1);
            if (ir) ir[i] = tok0 + r;
          }
        }
      } else {
        const double u0 = sampler == SAMPLER_SYSTEMATIC ? (double)rs.uniform(stream, 0u) : 0.0;
        for (int m = lane; m < St; m += 32) {
          const int r = flash_local_row(cr, tile_size, flash_point(rs, sampler, stream, m, St, u0));
          atomicAdd(cn + r, 1);
          if (ir) ir[m] = tok0 + r;
        }
      }
    }
    __syncthreads();  // counts, weights and the new running state are visible

    // ======== phase C: rescale, gather-and-add of the drawn V rows ========
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
        const float corr = sm_corr[g];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] *= corr;
      }
    }
    const int nbuf = tiles_here * tile_size;  // rows of the buffer that can hold draws
    const T* vbuf = vstream + buf_tok0 * D + lr * 8;
    for (int p0 = rg; p0 < nbuf; p0 += kFlashGatherUnroll * RG) {
      uint4 raw[kFlashGatherUnroll];
      bool use[kFlashGatherUnroll];
#pragma unroll
      for (int u = 0; u < kFlashGatherUnroll; ++u) {
        const int pos = p0 + u * RG;
        use[u] = false;
        if (pos < nbuf) {
#pragma unroll
          for (int g = 0; g < GMAX; ++g)
            if (g < G && cnt[g * MT + pos] > 0) use[u] = true;
        }
        // A drawn row lies in the sequence (weight > 0), so the load is in bounds.
        raw[u] = use[u] ? __ldg(reinterpret_cast<const uint4*>(vbuf + (long long)pos * D))
                        : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < kFlashGatherUnroll; ++u) {
        if (use[u]) {
          const int pos = p0 + u * RG;
          const int tt = pos / tile_size;
          float vf[8];
          unpack8<T>(raw[u], vf);
#pragma unroll
          for (int g = 0; g < GMAX; ++g) {
            if (g < G) {
              const int c = cnt[g * MT + pos];
              if (c > 0) {
                const float w = sm_w[g * TPB + tt] * (float)c;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
              }
            }
          }
        }
      }
    }
    // The next phase A barrier separates this phase's reads of cnt, sm_w and sm_corr from
    // their next writes; xs is not read here, so the next stages may write it at once.
  }
  cp_async_wait<0>();
  __syncthreads();  // every thread left the loop: the stage buffers become merge buffers

  // Sum the row groups' accumulators: inside a warp by shuffles (partners share lr), then
  // over warps through shared memory, in a fixed order. Every thread holds the same
  // running max sm_M[g], so no rescaling is needed here.
#pragma unroll
  for (int off = LPR; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
      }
    }
  }
  float* sm_acc = reinterpret_cast<float*>(smem);  // [kWarps][GMAX][D]: host-sized
  if (lane < LPR) {  // row group 0 of each warp holds the warp's sums (lr == lane)
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sm_acc[(warp * GMAX + g) * D + lr * 8 + e] = acc[g][e];
      }
    }
  }
  __syncthreads();

  for (int i = tid; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a += sm_acc[(w * GMAX + g) * D + d];
    const float Lg = sm_L[g];  // >= 1 * exp(m_t - M) of the max tile: > 0
    const float res = Lg > 0.f ? a / Lg : 0.f;
    const long long hrow = head0 + g;
    if (num_chunks == 1) {
      out[hrow * D + d] = Elem<T>::from_float(res);
    } else {
      part_o[(hrow * num_chunks + chunk) * D + d] = res;
      if (d == 0) {
        // exact_decode_merge weighs chunk c by L_c * 2^(M2_c - max M2): M in log2 units.
        part_ml[(hrow * num_chunks + chunk) * 2 + 0] = sm_M[g] * 1.4426950408889634f;
        part_ml[(hrow * num_chunks + chunk) * 2 + 1] = Lg;
      }
    }
  }
}
