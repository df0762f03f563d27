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
// Kernel santa_flash_chunk: grid (num_chunks, Hkv, B), as exact_decode_chunk; chunk_len is
// a multiple of tile_size, so no sampling tile straddles two chunks. Inside a CTA every
// WARP owns whole sampling tiles (tiles warp, warp + kWarps, ... of the chunk) and carries
// its own state, so the streaming loop has no CTA barrier at all:
//   1. the warp streams the tile's K rows through its own cp.async pipeline (kFlashStages
//      stages of kStageBytes / kWarps bytes, deep enough that the loads of the next tile
//      run during this tile's statistics, draws and gather; each lane copies exactly the
//      16-byte pieces it reads)
//      and writes the fp32 logits x = scale * q.k of the G heads (natural-log domain, so
//      the draws match the reference) into its shared buffer xs[g][row];
//   2. per head (several heads at once, on lane segments), the tile statistics: m_t, the tile-local inclusive cumsum of exp(x - m_t)
//      in fp32 (written over the logits in place) and l_t = its last entry, so the weight
//      l_t and the CDF that is inverted always agree;
//   3. per head, the running state (M, L) in log2 units (the flash-decoding rescaling) and
//      the weight of one draw exp(m_t - M) l_t / S_t; the G S_t points (spread over the
//      lanes, all heads at once; float64, bit for bit
//      the reference's for systematic and stratified; iid sums its spacings in NumPy's
//      sequential order) are inverted through the CDF (the first row whose cumsum exceeds
//      T * l_t, clipped to the first row that reaches l_t, i.e. the last positive-weight
//      row, as invert_cdf) and counted per row (shared atomics: integer, order-free);
//   4. the rows drawn by some head are listed (ballots), and the warp's row groups gather
//      them (one 16-byte load per lane, each row read once for the whole group,
//      duplicates counted instead of re-read), adding weight * count * v to each head.
// Rows past the sequence have weight 0 and are never drawn; nothing past `end` is read. At
// the end the warps' states are merged (group_state.cuh: finish_group_state, fixed order,
// deterministic) into out = A / L (one chunk) or the chunk partial, which the last CTA of
// the group to finish combines (counters non-null: group_state.cuh, merge_if_last_chunk)
// or else exact_decode_merge (exact_decode.cu, included and reused unchanged).
//
// Shared memory per warp (dynamic; the host mirrors it in TileConfig.smem_bytes):
// kFlashStages K stages of kStageBytes / kWarps bytes, xs [GMAX][tile_size] fp32,
// cnt [GMAX][tile_size] int32 (kept zero between tiles), list [tile_size] int32.
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
#include "group_state.cuh"
#include "philox.cuh"
#include "flash_sampling.cuh"
// exact_decode_merge (the flash partials have its form); its chunk kernel is not instantiated.
#include "exact_decode.cu"

using namespace stochattn;

constexpr int kFlashMaxTile = 256;     // largest tile_size
constexpr int kFlashStages = 8;        // depth of a warp's K pipeline (_sources mirrors it)
constexpr int kFlashGatherUnroll = 4;  // V loads in flight per row group
constexpr float kLog2e = 1.4426950408889634f;

// The K pipeline of one warp: D/8 lanes per row, 32 / (D/8) row groups, stages of
// kStageBytes / kWarps bytes (the CTA's K pipeline of exact decode, split over its warps).
template <int D>
struct WarpTiling {
  static constexpr int kLanesPerRow = D / 8;
  static constexpr int kRowGroups = 32 / kLanesPerRow;
  static constexpr int kStageBytes = stochattn::kStageBytes / kWarps;
  static constexpr int kStageRows = kStageBytes / (D * 2);
  static constexpr int kRowsPerThread = kStageRows / kRowGroups;
  static_assert(kRowsPerThread >= 1 && kRowsPerThread * kRowGroups == kStageRows,
                "a warp stage must hold a whole number of rows per lane");
  static_assert(kStageRows <= 32, "a warp stage must fit in the smallest sampling tile");
};

// Steps 2-4 of one sampling tile of a warp (the kernel comment above), after the warp
// wrote the tile's logits into xs (head g at xs[g * XS + row], -inf past `end`; XS >= TS,
// padded by the tensor-core kernel against bank conflicts): tile statistics and local CDFs
// (in place of the logits), the running state (M, L, acc) of each head, the draws counted
// per row in cnt ([GMAX][TS], zero on entry and on return), and the gather of the drawn V
// rows (lane lr = lane % (D / 8) owns features [8 lr, 8 lr + 8) of row group lane / (D / 8)).
// t: the tile's global index (its Philox stream); tok0: its first token.
template <typename T, int D, int GMAX>
__device__ __forceinline__ void flash_tile_epilogue(
    float* xs, int XS, int* cnt, int* list, int TS, int G, long long tok0, long long t,
    long long head0, long long n_tiles, float* __restrict__ tile_m_out,
    float* __restrict__ tile_l_out, long long* __restrict__ idx_out, long long idx_stride, int St,
    int sampler, unsigned long long seed, unsigned offset, const T* __restrict__ vstream,
    int lane, float (&M)[GMAX], float (&L)[GMAX], float (&acc)[GMAX][8]) {
  constexpr int LPR = D / 8;
  constexpr int RG = 32 / LPR;
  constexpr int U = kFlashGatherUnroll;
  const int lr = lane % LPR, rg = lane / LPR;
  // ---- 2. tile statistics and local CDFs, several heads at once ----
  // Heads go in batches of HPB = min(GMAX, 256 / TS); head g of a batch owns a segment
  // of W = 32 / HPB lanes, lane sl of it the rpl = TS / W (<= 8) consecutive rows
  // [sl rpl, sl rpl + rpl). Lanes of heads >= G compute on -inf and are ignored.
  const int hpb = min(GMAX, kFlashMaxTile / TS);
  const int W = 32 / hpb;
  const int rpl = TS / W;
  const int sl = lane % W;
  float tm[GMAX], tl[GMAX];  // m_t, l_t of every head, on every lane
  for (int hb0 = 0; hb0 < G; hb0 += hpb) {
    const int g = hb0 + lane / W;
    const bool live = g < G;
    float* xv = xs + (live ? g : 0) * XS;
    float xr[8];
    float mx = STOCHATTN_NEG_INF;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xr[i] = STOCHATTN_NEG_INF;
      if (i < rpl && live) {
        xr[i] = xv[sl * rpl + i];
        mx = fmaxf(mx, xr[i]);
      }
    }
    for (int off = W / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    // mx is finite for a live head (the tile's first row is in the sequence). Max shift:
    // exp(x - m_t) <= 1; rows at -inf give exactly 0, so the CDF is flat past the sequence.
    const float shift = live ? mx : 0.f;
    float run = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (i < rpl) {
        run += expf(xr[i] - shift);
        xr[i] = run;  // lane-local inclusive prefix
      }
    }
    float inc = run;  // segment inclusive scan of the lane totals
    for (int off = 1; off < W; off <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, inc, off, W);
      if (sl >= off) inc += y;
    }
    float exc = __shfl_up_sync(0xffffffffu, inc, 1, W);
    if (sl == 0) exc = 0.f;
    float last = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (i < rpl) {
        last = exc + xr[i];
        if (live) xv[sl * rpl + i] = last;  // each lane overwrites only the rows it read
      }
    }
    // l_t is the CDF's last entry: weight and inverted CDF agree.
    const float lt = __shfl_sync(0xffffffffu, last, W - 1, W);
    if (tile_m_out && live && sl == 0) {
      tile_m_out[(head0 + g) * n_tiles + t] = mx;
      tile_l_out[(head0 + g) * n_tiles + t] = lt;
    }
#pragma unroll
    for (int h = 0; h < GMAX; ++h) {
      if (h >= hb0 && h < hb0 + hpb) {  // uniform over the warp
        tm[h] = __shfl_sync(0xffffffffu, mx, (h - hb0) * W);
        tl[h] = __shfl_sync(0xffffffffu, lt, (h - hb0) * W);
      }
    }
  }

  // ---- 3. running state per head and the weight of one draw ----
  float wdraw[GMAX];  // exp2(m_t - M) l_t / S_t
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    wdraw[g] = 0.f;
    if (g < G) {
      const float m2 = tm[g] * kLog2e;
      const float mn = fmaxf(M[g], m2);      // finite
      const float corr = exp2f(M[g] - mn);   // 0 on the warp's first tile (M = -inf)
      const float wt = exp2f(m2 - mn) * tl[g];  // W_t relative to exp2(M)
      L[g] = L[g] * corr + wt;
      M[g] = mn;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= corr;
      wdraw[g] = wt / (float)St;  // each of the S_t draws carries W_t / S_t
    }
  }
  __syncwarp();  // the CDFs are visible to every lane

  // ---- draws: S_t points per head, counted per row ----
  const unsigned stream = (unsigned)t;
  if (sampler == SAMPLER_IID) {
#pragma unroll 1
    for (int g = 0; g < G; ++g) {
      const float* cr = xs + g * XS;
      int* cn = cnt + g * TS;
      long long* ir = idx_out ? idx_out + (head0 + g) * idx_stride + t * St : nullptr;
      const RngStream rs = RngStream::make(seed, offset, PURPOSE_VALUE_SAMPLER, (unsigned)(head0 + g));
      // T_m = c_m / c_{S_t}, c_i = E_0 + ... + E_i, E_i = -log(u_i) (draws 0..S_t). The
      // prefix is summed in index order like NumPy's cumsum: per 32 spacings, every lane
      // adds the broadcast values one by one. Sweep 1 finds c_{S_t}; sweep 2 repeats the
      // same additions (so c_m is bit-identical) and places point m on lane m % 32.
      double total = 0.0;
      for (int base = 0; base <= St; base += 32) {
        const int i = base + lane;
        const double e = i <= St ? -log((double)rs.uniform(stream, (unsigned)i)) : 0.0;
        const int n = min(32, St + 1 - base);  // uniform over the warp
        for (int jj = 0; jj < n; ++jj) total += __shfl_sync(0xffffffffu, e, jj);
      }
      double c = 0.0;
      for (int base = 0; base < St; base += 32) {
        const int i = base + lane;
        const double e = i < St ? -log((double)rs.uniform(stream, (unsigned)i)) : 0.0;
        const int n = min(32, St - base);
        double mine = 0.0;
        for (int jj = 0; jj < n; ++jj) {
          c += __shfl_sync(0xffffffffu, e, jj);
          if (jj == lane) mine = c;
        }
        if (i < St) {
          const int r = flash_local_row(cr, TS, mine / total);
          atomicAdd(cn + r, 1);
          if (ir) ir[i] = tok0 + r;
        }
      }
    }
  } else {
    // The G * S_t points of all heads spread over the lanes: point m of head g is item
    // g * S_t + m. The systematic uniform of head g is drawn once, by lane g.
    const double u_mine = sampler == SAMPLER_SYSTEMATIC && lane < G
        ? (double)RngStream::make(seed, offset, PURPOSE_VALUE_SAMPLER, (unsigned)(head0 + lane))
              .uniform(stream, 0u)
        : 0.0;
    const int items = G * St;
    for (int base = 0; base < items; base += 32) {
      const int i = base + lane;
      const int g = i < items ? i / St : 0;
      const double u0 = __shfl_sync(0xffffffffu, u_mine, g);
      if (i < items) {
        const int m = i - g * St;
        const RngStream rs = RngStream::make(seed, offset, PURPOSE_VALUE_SAMPLER, (unsigned)(head0 + g));
        const int r = flash_local_row(xs + g * XS, TS, flash_point(rs, sampler, stream, m, St, u0));
        atomicAdd(cnt + g * TS + r, 1);
        if (idx_out) idx_out[(head0 + g) * idx_stride + t * St + m] = tok0 + r;
      }
    }
  }
  __syncwarp();  // the counts are complete

  // ---- 4. list the drawn rows, gather them once for the group ----
  int nused = 0;
  for (int c0 = 0; c0 < TS; c0 += 32) {
    const int r = c0 + lane;
    bool drawn = false;
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
      if (g < G) drawn |= cnt[g * TS + r] > 0;
    const unsigned mask = __ballot_sync(0xffffffffu, drawn);
    if (drawn) list[nused + __popc(mask & ((1u << lane) - 1u))] = r;
    nused += __popc(mask);
  }
  __syncwarp();
  const T* vtile = vstream + tok0 * D + lr * 8;
  for (int p0 = 0; p0 < nused; p0 += U * RG) {
    uint4 raw[U];
    int rows[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = p0 + u * RG + rg;
      rows[u] = i < nused ? list[i] : -1;
      // A drawn row lies in the sequence (weight > 0), so the load is in bounds.
      raw[u] = rows[u] >= 0 ? __ldg(reinterpret_cast<const uint4*>(vtile + (long long)rows[u] * D))
                            : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (rows[u] >= 0) {
        float vf[8];
        unpack8<T>(raw[u], vf);
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          if (g < G) {
            const int c = cnt[g * TS + rows[u]];
            if (c > 0) {
              const float w = wdraw[g] * (float)c;
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
            }
          }
        }
      }
    }
  }
  __syncwarp();  // every lane has read the counts
  for (int i = lane; i < nused; i += 32) {
    const int r = list[i];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
      if (g < G) cnt[g * TS + r] = 0;
  }
  __syncwarp();  // counts zero and list free before the next tile's draws
}

// The token range of a flash chunk CTA (grid (num_chunks, Hkv, B)): [start, end) of
// sequence b, the first query head row of its group, T_L and S_t = ceil(S / T_L) (the draws
// of every tile of the sequence, 0 when empty).
struct FlashChunk {
  long long start, end, head0, seq_tiles;
  int St;
};

__device__ __forceinline__ FlashChunk flash_chunk(const int* __restrict__ seq_lens, int Hkv, int G,
                                                  long long N, long long chunk_len, int TS, int S) {
  FlashChunk fc;
  const long long len = sequence_length(seq_lens, blockIdx.z, N);
  fc.start = (long long)blockIdx.x * chunk_len;
  fc.end = min(fc.start + chunk_len, len);
  fc.head0 = ((long long)blockIdx.z * Hkv + blockIdx.y) * G;
  fc.seq_tiles = (len + TS - 1) / TS;  // T_L
  fc.St = fc.seq_tiles > 0 ? (int)(((long long)S + fc.seq_tiles - 1) / fc.seq_tiles) : 0;
  return fc;
}

// What a flash chunk CTA writes before it reads a key: S_t per sequence, -1 in the index
// slots past T_L * S_t, and (m, l) = (-inf, 0) for the tiles of its range past the
// sequence; a chunk with nothing to read (past seq_lens[b], or an empty sequence) also
// writes its empty partial, takes part in the in-kernel merge and returns true (the caller
// returns).
template <typename T, int D, int THREADS>
__device__ __forceinline__ bool flash_chunk_outputs(
    const FlashChunk& fc, T* __restrict__ out, float* __restrict__ part_o,
    float* __restrict__ part_ml, int* __restrict__ counters, long long* __restrict__ idx_out,
    float* __restrict__ tile_m_out, float* __restrict__ tile_l_out, int* __restrict__ samples_out,
    int Hkv, int G, long long chunk_len, int num_chunks, int TS, long long n_tiles,
    long long idx_stride) {
  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  if (samples_out && chunk == 0 && kvh == 0 && tid == 0) samples_out[b] = fc.St;
  if (idx_out && chunk == 0) {  // unused slots: T_L * S_t <= S + T_L - 1 <= idx_stride
    const long long used = fc.seq_tiles * (long long)fc.St;
    for (int g = 0; g < G; ++g)
      for (long long i = used + tid; i < idx_stride; i += THREADS)
        idx_out[(fc.head0 + g) * idx_stride + i] = -1;
  }
  if (tile_m_out) {  // tiles of this chunk's range that lie past the sequence
    const long long t_lo = max(fc.start / TS, fc.seq_tiles);
    const long long t_hi = min((fc.start + chunk_len) / TS, n_tiles);
    for (int g = 0; g < G; ++g)
      for (long long t = t_lo + tid; t < t_hi; t += THREADS) {
        tile_m_out[(fc.head0 + g) * n_tiles + t] = STOCHATTN_NEG_INF;
        tile_l_out[(fc.head0 + g) * n_tiles + t] = 0.f;
      }
  }
  if (fc.start < fc.end) return false;
  write_empty_group<T, D, THREADS>(G, fc.head0, out, part_o, part_ml, num_chunks, chunk);
  if (counters)
    merge_if_last_chunk<T, D, THREADS>(counters, (long long)b * Hkv + kvh, G, fc.head0, part_o,
                                       part_ml, out, num_chunks);
  return true;
}

// Occupancy (H200, tile 64): 3 CTAs of 4 warps per SM for GMAX = 4 (164 registers; forcing
// 4 CTAs with 128 registers spilled and measured 26% slower), 2 for GMAX = 8.
template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads)
santa_flash_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const int* __restrict__ seq_lens, T* __restrict__ out,
                  float* __restrict__ part_o, float* __restrict__ part_ml,
                  int* __restrict__ counters, long long* __restrict__ idx_out, float* __restrict__ tile_m_out,
                  float* __restrict__ tile_l_out, int* __restrict__ samples_out, int Hkv, int G,
                  long long N, long long chunk_len, int num_chunks, int tile_size,
                  long long n_tiles, long long idx_stride, int S, int sampler, float scale,
                  unsigned long long seed, unsigned offset) {
  STOCHATTN_PDL_ENTRY();
  using W = WarpTiling<D>;
  constexpr int LPR = W::kLanesPerRow;
  constexpr int RPT = W::kRowsPerThread;
  constexpr int RG = W::kRowGroups;
  constexpr int SR = W::kStageRows;
  constexpr int WSB = W::kStageBytes;

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int lr = lane % LPR, rg = lane / LPR;  // row group inside the warp
  const int TS = tile_size;
  const int tile_shift = __ffs(TS) - 1;  // TS is a power of two

  const FlashChunk fc = flash_chunk(seq_lens, Hkv, G, N, chunk_len, TS, S);
  const long long start = fc.start, end = fc.end, head0 = fc.head0;
  const int St = fc.St;
  if (flash_chunk_outputs<T, D, kThreads>(fc, out, part_o, part_ml, counters, idx_out, tile_m_out,
                                          tile_l_out, samples_out, Hkv, G, chunk_len, num_chunks,
                                          TS, n_tiles, idx_stride))
    return;  // nothing in this chunk: its empty partial is written

  // This warp's shared memory (layout above).
  unsigned char* smem = dynamic_smem();
  unsigned char* stages = smem + (long long)warp * (kFlashStages * WSB + TS * (8 * GMAX + 4));
  float* xs = reinterpret_cast<float*>(stages + kFlashStages * WSB);  // [GMAX][TS]
  int* cnt = reinterpret_cast<int*>(xs + GMAX * TS);              // [GMAX][TS]
  int* list = cnt + GMAX * TS;                                    // [TS]
  for (int i = lane; i < GMAX * TS; i += 32) cnt[i] = 0;

  float qf[GMAX][8];
  load_group_queries<T, D, GMAX>(q, head0, G, lr, scale, qf);

  const long long stream_off = ((long long)b * Hkv + kvh) * N * D;  // 64-bit element offset
  const unsigned char* kbase = reinterpret_cast<const unsigned char*>(k + stream_off);
  const T* vstream = v + stream_off;

  // The warp's tiles: chunk tiles warp, warp + kWarps, ... that start before `end`; each is
  // TS / SR pipeline stages, numbered s = j * SPT + ss over the warp's j-th tile.
  const long long chunk_tiles = (end - start + TS - 1) / TS;
  const int my_tiles = chunk_tiles > warp ? (int)((chunk_tiles - warp + kWarps - 1) / kWarps) : 0;
  const int SPT = TS / SR;
  const long long n_stages = (long long)my_tiles * SPT;
  // The next stage to load, as (first row of its tile, offset in the tile): advanced by
  // one stage per load, with no division in the loop.
  long long ld_tile = start + (long long)warp * TS;
  int ld_off = 0;
  const auto next_row = [&]() {
    const long long r = ld_tile + ld_off;
    ld_off += SR;
    if (ld_off == TS) {
      ld_off = 0;
      ld_tile += (long long)kWarps * TS;
    }
    return r;
  };

#pragma unroll
  for (int s = 0; s < kFlashStages - 1; ++s) {
    if (s < n_stages) load_rows_async<D, RPT, RG>(stages + s * WSB, kbase, next_row(), end, rg, lr);
    cp_async_commit();
  }

  // Running state per head (log2 units), equal on every lane; acc: this lane's 8 features of
  // the rows its row group gathered, relative to exp2(M).
  float M[GMAX], L[GMAX], acc[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    M[g] = STOCHATTN_NEG_INF;
    L[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  int rd = 0, wr = kFlashStages - 1;  // stage buffers read and refilled this iteration
  long long s = 0;
  for (int j = 0; j < my_tiles; ++j) {
    const long long tok0 = start + ((long long)j * kWarps + warp) * TS;  // < end

    // ---- 1. logits of the tile's rows into xs (-inf past `end`) ----
    for (int ss = 0; ss < SPT; ++ss, ++s) {
      // This lane reads only the K pieces it copied: its own wait suffices, and the buffer
      // refilled next held stage s - 1, which it finished reading.
      cp_async_wait<kFlashStages - 2>();
      {
        const long long nx = s + kFlashStages - 1;
        if (nx < n_stages) load_rows_async<D, RPT, RG>(stages + wr * WSB, kbase, next_row(), end, rg, lr);
        cp_async_commit();
      }
      const unsigned char* sk = stages + rd * WSB;
      rd = rd + 1 == kFlashStages ? 0 : rd + 1;
      wr = wr + 1 == kFlashStages ? 0 : wr + 1;
      const long long row0 = tok0 + ss * SR;
      float x[RPT * GMAX];
      partial_dots_rows<T, D, GMAX, RPT, RG>(sk, rg, lr, G, qf, x);
      if constexpr (kReduce == 0) {
#pragma unroll
        for (int i = 0; i < RPT * GMAX; ++i) x[i] = row_group_sum<LPR>(x[i]);
        if (lr == 0) {
#pragma unroll
          for (int p = 0; p < RPT; ++p) {
            const int r = rg + p * RG;
#pragma unroll
            for (int g = 0; g < GMAX; ++g)
              if (g < G) xs[g * TS + ss * SR + r] = row0 + r < end ? x[p * GMAX + g] : STOCHATTN_NEG_INF;
          }
        }
      } else {
        // Reduce-scatter; each finished logit is written by its first owner lane.
        using Lay = ScatterLayout<LPR, RPT * GMAX>;
        Scatter<LPR / 2, RPT * GMAX>::run(x, lr);
        if (lr % Lay::kSpan == 0) {
#pragma unroll
          for (int i = 0; i < Lay::kPer; ++i) {
            const int jj = Lay::index(i, lr);
            const int p = jj / GMAX, g = jj % GMAX;
            const int r = rg + p * RG;
            if (g < G) xs[g * TS + ss * SR + r] = row0 + r < end ? x[i] : STOCHATTN_NEG_INF;
          }
        }
      }
    }
    __syncwarp();

    const long long t = (start >> tile_shift) + (long long)j * kWarps + warp;  // the Philox stream
    flash_tile_epilogue<T, D, GMAX>(xs, TS, cnt, list, TS, G, tok0, t, head0, n_tiles, tile_m_out,
                                    tile_l_out, idx_out, idx_stride, St, sampler, seed, offset,
                                    vstream, lane, M, L, acc);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp left the loop: the shared memory becomes the merge buffer

  // finish_group_state merges the row groups by summing l: one row group carries the warp's L.
  float l[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) l[g] = rg == 0 ? L[g] : 0.f;
  finish_group_state<T, D, GMAX>(M, l, acc, G, smem, head0, out, part_o, part_ml, num_chunks,
                                 chunk);
  if (counters)
    merge_if_last_chunk<T, D>(counters, (long long)b * Hkv + kvh, G, head0, part_o, part_ml, out,
                              num_chunks);
}
