// Exact decode attention, split-KV ("flash decoding").
//
// Grid (num_chunks, Hkv, B); one CTA per (sequence b, KV head, chunk of tokens) computes
// all G query heads of the GQA group, so every K and V row is read from HBM once per
// group. K and V rows stream through a kStages-deep cp.async pipeline of kStageBytes
// tiles (16-byte copies, zero-filled past the sequence; decode_common.cuh: the tiling
// macros). Each thread copies the pieces it reads, so the loop needs no CTA barrier. The
// online-softmax max shift is updated once per stage (over this thread's rows of it). Logits, softmax and the weighted V sum
// are fp32, in the log2 domain (q is pre-scaled by scale * log2(e), so exp2f replaces
// expf). With one chunk the CTA writes the output; otherwise it writes its normalised
// partial output and (max, sum) and exact_decode_merge combines the chunks.
//
// Template parameters: element type (stochattn::f16, stochattn::bf16: 16-bit storage), head dim D (64, 128), GMAX
// (4 or 8): the register arrays are sized for GMAX heads and the actual group size
// G <= GMAX is a run-time argument.
#include "decode_common.cuh"

using namespace stochattn;

template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads)
exact_decode_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const int* __restrict__ seq_lens, T* __restrict__ out,
                   float* __restrict__ part_o, float* __restrict__ part_ml, int Hkv, int G,
                   long long N, long long chunk_len, int num_chunks, float scale_log2) {
  using Tl = Tiling<D>;
  constexpr int LPR = Tl::kLanesPerRow;
  constexpr int RPT = Tl::kRowsPerThread;
  constexpr int ROWS = Tl::kTileRows;
  constexpr int RG = Tl::kRowGroups;

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int Hq = Hkv * G;
  const int tid = threadIdx.x;
  const int lr = tid % LPR;   // lane inside the row group: features [8 lr, 8 lr + 8)
  const int rg = tid / LPR;   // row group
  const int warp = tid / 32, lane = tid % 32;

  const long long len = sequence_length(seq_lens, b, N);
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, len);
  const long long head0 = (long long)b * Hq + (long long)kvh * G;  // first query head row

  // Pipeline stages (K then V per stage), dynamic shared memory of
  // max(kStages * 2 * kStageBytes, merge buffers) bytes; reused for the cross-warp merge.
  unsigned char* smem = dynamic_smem();

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

  // The G query vectors, this thread's 8 features each, pre-scaled.
  float qf[GMAX][8];
  load_group_queries<T, D, GMAX>(q, head0, G, lr, scale_log2, qf);

  const long long stream_off = ((long long)b * Hkv + kvh) * N * D;  // 64-bit element offset
  const unsigned char* kbase = reinterpret_cast<const unsigned char*>(k + stream_off);
  const unsigned char* vbase = reinterpret_cast<const unsigned char*>(v + stream_off);
  const long long ntiles = (end - start + ROWS - 1) / ROWS;

  // Prologue: the first kStages - 1 tiles in flight (an empty group keeps the count uniform).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) {
      unsigned char* st = smem + s * 2 * kStageBytes;
      load_tile_async<D>(st, kbase, start + (long long)s * ROWS, end);
      load_tile_async<D>(st + kStageBytes, vbase, start + (long long)s * ROWS, end);
    }
    cp_async_commit();
  }

  // Online softmax state per head (log2 domain); every lane of a row group holds the same
  // m and l, and acc for its own 8 features.
  float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = STOCHATTN_NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  int rd = 0, wr = kStages - 1;  // stage buffers read and refilled this iteration
  for (long long it = 0; it < ntiles; ++it) {
    // Tile `it` has landed: this thread's own copies are all it reads (no CTA barrier).
    // The buffer refilled next held tile it-1, which this thread finished reading (its
    // values were consumed in the previous iteration).
    cp_async_wait<kStages - 2>();
    {
      const long long nx = it + kStages - 1;
      if (nx < ntiles) {
        unsigned char* st = smem + wr * 2 * kStageBytes;
        load_tile_async<D>(st, kbase, start + nx * ROWS, end);
        load_tile_async<D>(st + kStageBytes, vbase, start + nx * ROWS, end);
      }
      cp_async_commit();
    }
    const unsigned char* sk = smem + rd * 2 * kStageBytes;
    rd = rd + 1 == kStages ? 0 : rd + 1;
    wr = wr + 1 == kStages ? 0 : wr + 1;
    const unsigned char* sv = sk + kStageBytes;
    const long long row0 = start + it * ROWS;

    // Partial dot products of this thread's 8 features, x[p * GMAX + g], then the
    // row-group sums (decode_common.cuh: row_group_sums).
    float x[RPT * GMAX];
    group_partial_dots<T, D, GMAX>(sk, rg, lr, G, qf, x);
    row_group_sums<LPR>(x, lr);

    // Online softmax, one max shift per head per stage. Masked rows (past `end`) get
    // weight 0; until a head has seen a valid row its max stays -inf and the shift is
    // taken as 0 so no inf - inf arises (exp2(-inf) = 0 then).
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
        float xm = STOCHATTN_NEG_INF;
#pragma unroll
        for (int p = 0; p < RPT; ++p) {
          const bool valid = row0 + rg + p * RG < end;
          x[p * GMAX + g] = valid ? x[p * GMAX + g] : STOCHATTN_NEG_INF;
          xm = fmaxf(xm, x[p * GMAX + g]);
        }
        const float mn = fmaxf(m[g], xm);
        const float shift = mn == STOCHATTN_NEG_INF ? 0.f : mn;
        // Max shift (flash attention): rescale the running sums to the new max.
        const float corr = exp2f(m[g] - shift);
        l[g] *= corr;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] *= corr;
#pragma unroll
        for (int p = 0; p < RPT; ++p) {
          const float w = exp2f(x[p * GMAX + g] - shift);  // 0 for masked rows
          x[p * GMAX + g] = w;
          l[g] += w;
        }
        m[g] = mn;
      }
    }
#pragma unroll
    for (int p = 0; p < RPT; ++p) {
      float vf[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(sv + (rg + p * RG) * (D * 2) + lr * 16), vf);
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g < G) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(x[p * GMAX + g], vf[e], acc[g][e]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stage buffers become the merge buffers below

  // Merge the row groups of a warp (partners share lr: offsets are multiples of LPR).
#pragma unroll
  for (int off = LPR; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
        const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
        const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
        float ao[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) ao[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
        const float mn = fmaxf(m[g], mo);
        if (mn != STOCHATTN_NEG_INF) {
          const float c1 = exp2f(m[g] - mn), c2 = exp2f(mo - mn);
          l[g] = l[g] * c1 + lo * c2;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = acc[g][e] * c1 + ao[e] * c2;
          m[g] = mn;
        }
      }
    }
  }

  float* sm_m = reinterpret_cast<float*>(smem);   // [kWarps][GMAX]
  float* sm_l = sm_m + kWarps * GMAX;             // [kWarps][GMAX]
  float* sm_acc = sm_l + kWarps * GMAX;           // [kWarps][GMAX][D]
  // Merge buffers: (2 + D) * kWarps * GMAX floats; the host sizes the dynamic shared
  // memory as the larger of this and the pipeline (_sources.TileConfig.smem_bytes).
  if (lane < LPR) {  // row group 0 of each warp now holds the warp's merged state
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sm_acc[(warp * GMAX + g) * D + lr * 8 + e] = acc[g][e];
        if (lr == 0) {
          sm_m[warp * GMAX + g] = m[g];
          sm_l[warp * GMAX + g] = l[g];
        }
      }
    }
  }
  __syncthreads();

  for (int i = tid; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float M = STOCHATTN_NEG_INF;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w * GMAX + g]);
    float L = 0.f, o = 0.f;
    if (M != STOCHATTN_NEG_INF) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float c = exp2f(sm_m[w * GMAX + g] - M);  // warps that saw nothing: 0
        L = fmaf(sm_l[w * GMAX + g], c, L);
        o = fmaf(sm_acc[(w * GMAX + g) * D + d], c, o);
      }
    }
    const float res = L > 0.f ? o / L : 0.f;
    const long long hrow = head0 + g;
    if (num_chunks == 1) {
      out[hrow * D + d] = Elem<T>::from_float(res);
    } else {
      part_o[(hrow * num_chunks + chunk) * D + d] = res;
      if (d == 0) {
        part_ml[(hrow * num_chunks + chunk) * 2 + 0] = M;
        part_ml[(hrow * num_chunks + chunk) * 2 + 1] = L;
      }
    }
  }
}

// Combine the chunks of each (b, query head): out = sum_c w_c o_c / sum_c w_c with
// w_c = l_c * 2^(m_c - M), M the max over chunks (log2 domain, as written above). Chunks
// that saw no token have m_c = -inf, l_c = 0 and weigh nothing; a row with no token at
// all (seq_len 0) gets zeros. Grid (B * Hq), block (D). The order of the sums is fixed,
// so the result is deterministic.
template <typename T>
__global__ void exact_decode_merge(const float* __restrict__ part_o,
                                   const float* __restrict__ part_ml, T* __restrict__ out,
                                   int num_chunks, int D) {
  const long long row = blockIdx.x;
  const int d = threadIdx.x;
  const float* ml = part_ml + row * num_chunks * 2;
  float M = STOCHATTN_NEG_INF;
  for (int c = 0; c < num_chunks; ++c) M = fmaxf(M, ml[2 * c]);
  float L = 0.f, o = 0.f;
  if (M != STOCHATTN_NEG_INF) {
    for (int c = 0; c < num_chunks; ++c) {
      const float w = ml[2 * c + 1] * exp2f(ml[2 * c] - M);
      L += w;
      o = fmaf(w, part_o[(row * num_chunks + c) * D + d], o);
    }
  }
  out[row * D + d] = Elem<T>::from_float(L > 0.f ? o / L : 0.f);
}
