// The parts of S²ANTA-flash shared by its two chunk kernels (santa_flash.cu on the CUDA
// cores, santa_flash_tc.cu on the tensor cores): the warp's K pipeline tiling, steps 2-4
// of one sampling tile (flash_tile_epilogue), the chunk's token range and the outputs it
// writes before reading a key. santa_flash.cu's header says what each step computes.
#pragma once
#include "decode_common.cuh"
#include "group_state.cuh"
#include "philox.cuh"
#include "flash_sampling.cuh"

// The flash kernels' helpers below use the stochattn names unqualified, as the kernels do.
using namespace stochattn;

constexpr int kFlashMaxTile = 256;     // largest tile_size
constexpr int kFlashStages = 8;        // depth of a warp's K pipeline (the host reads it)
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
// rows of the stream `vrows` (contiguous or paged, kv_rows.cuh; lane lr = lane % (D / 8)
// owns features [8 lr, 8 lr + 8) of row group lane / (D / 8)).
// t: the tile's global index (its Philox stream); tok0: its first token; end: the chunk's
// end (rows at or past it have -inf logits and are never drawn).
template <typename T, int D, int GMAX>
__device__ __forceinline__ void flash_tile_epilogue(
    float* xs, int XS, int* cnt, int* list, int TS, int G, long long tok0, long long end,
    long long t,
    long long head0, long long n_tiles, float* __restrict__ tile_m_out,
    float* __restrict__ tile_l_out, long long* __restrict__ idx_out, long long idx_stride, int St,
    int sampler, unsigned long long seed, unsigned offset, const KvRows<D>& vrows, int lane,
    float (&M)[GMAX], float (&L)[GMAX], float (&acc)[GMAX][8]) {
  constexpr int LPR = D / 8;
  constexpr int RG = 32 / LPR;
  constexpr int U = kFlashGatherUnroll;
  const int lr = lane % LPR, rg = lane / LPR;
  // Paged caches: the tile's page numbers, loaded now and first used by the gather of
  // step 4, so that their latency hides behind steps 2-3.
  const TilePages tp = TilePages::load(vrows, tok0, end, TS, lane);
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
  // A head whose tile read a NaN or +inf logit has l_t = NaN (its CDF is NaN from that row
  // on): its L turns NaN (a NaN output row, finish_group_state) and it draws nothing (a
  // NaN CDF could select a row past the sequence); its index slots get -1. Uniform.
  float wdraw[GMAX];  // exp2(m_t - M) l_t / S_t
  unsigned skip = 0;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    wdraw[g] = 0.f;
    if (g < G) {
      if (tl[g] != tl[g]) skip |= 1u << g;
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
      if ((skip >> g) & 1u) {  // uniform
        if (ir)
          for (int i = lane; i < St; i += 32) ir[i] = -1;
        continue;
      }
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
        if ((skip >> g) & 1u) {
          if (idx_out) idx_out[(head0 + g) * idx_stride + t * St + m] = -1;
        } else {
          const RngStream rs = RngStream::make(seed, offset, PURPOSE_VALUE_SAMPLER, (unsigned)(head0 + g));
          const int r = flash_local_row(xs + g * XS, TS, flash_point(rs, sampler, stream, m, St, u0));
          atomicAdd(cnt + g * TS + r, 1);
          if (idx_out) idx_out[(head0 + g) * idx_stride + t * St + m] = tok0 + r;
        }
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
  for (int p0 = 0; p0 < nused; p0 += U * RG) {
    uint4 raw[U];
    int rows[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = p0 + u * RG + rg;
      rows[u] = i < nused ? list[i] : -1;
      // A drawn row lies in the sequence (weight > 0), so the load (and, paged, the page
      // number it may look up) is in bounds.
      const long long off = tp.offset(vrows, tok0 + rows[u], rows[u] >= 0);
      raw[u] = rows[u] >= 0
                   ? __ldg(reinterpret_cast<const uint4*>(vrows.base + off + lr * 16))
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
// sequence b (its length from seq_lens or the page table: kv_rows.cuh, stream_length), the
// first query head row of its group, T_L and S_t = ceil(S / T_L) (the draws of every tile
// of the sequence, 0 when empty).
struct FlashChunk {
  long long start, end, head0, seq_tiles;
  int St;
};

__device__ __forceinline__ FlashChunk flash_chunk(const int* __restrict__ seq_lens,
                                                  const PageTable& table, int Hkv, int G,
                                                  long long N, long long chunk_len, int TS, int S) {
  FlashChunk fc;
  const long long len = stream_length(seq_lens, table, blockIdx.z, N);
  fc.start = (long long)blockIdx.x * chunk_len;
  fc.end = min(fc.start + chunk_len, len);
  fc.head0 = ((long long)blockIdx.z * Hkv + blockIdx.y) * G;
  fc.seq_tiles = (len + TS - 1) / TS;  // T_L
  fc.St = fc.seq_tiles > 0 ? (int)(((long long)S + fc.seq_tiles - 1) / fc.seq_tiles) : 0;
  return fc;
}

// What a flash chunk CTA writes before it reads a key: S_t per sequence, -1 in the index
// slots past T_L * S_t, and (m, l) = (-inf, 0) for the tiles of its range past the
// sequence; a chunk with nothing to read (past the sequence's length, or it is empty) also
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
