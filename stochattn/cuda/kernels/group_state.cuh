// The end of a split-KV streaming kernel that computes the G query heads of one GQA group
// (exact_decode_chunk, doublep_attend): combine every thread's online-softmax state and
// write the CTA's result, either the output rows (one chunk) or the normalised partial
// output and its (max, sum) for a merge kernel (exact_decode_merge). The log2 domain of
// the callers: weights are exp2(x - m).
//
// Thread layout (decode_common.cuh, Tiling<D>): a row group of D/8 lanes, lane lr owning
// features [8 lr, 8 lr + 8); every lane of a row group holds the same m and l.
#pragma once

#include "decode_common.cuh"

namespace stochattn {

// The natural-log log-sum-exp of a row's scaled logits from its log2-domain (max, sum):
// ln(sum_j e^(s_j)) = ln 2 * (M + log2 L) with M the max of x_j = s_j log2(e) and
// L = sum_j 2^(x_j - M). No live token (M = -inf, L = 0) gives -inf; a NaN M (non-finite
// input) gives NaN. Written to the optional `lse` output (exact decode's return_lse).
__device__ __forceinline__ float lse_of(float M, float L) {
  return (M + log2f(L)) * 0.69314718055994531f;
}

// One pipeline stage into the online softmax of the G heads: logits x[p * GMAX + g] of
// this thread's RPT rows (rows rg + p * kRowGroups of the V stage `sv`), -inf for rows a
// head must not see. One max shift per head per stage; until a head has seen a finite
// logit its max stays -inf and the shift is taken as 0 so no inf - inf arises
// (exp2(-inf) = 0 then). Overwrites x with the weights.
template <typename T, int D, int GMAX>
__device__ __forceinline__ void accumulate_stage(float (&x)[Tiling<D>::kRowsPerThread * GMAX],
                                                 const unsigned char* __restrict__ sv, int rg,
                                                 int lr, int G, float (&m)[GMAX],
                                                 float (&l)[GMAX], float (&acc)[GMAX][8]) {
  using Tl = Tiling<D>;
  constexpr int RPT = Tl::kRowsPerThread;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
      float xm = STOCHATTN_NEG_INF;
#pragma unroll
      for (int p = 0; p < RPT; ++p) xm = fmaxf(xm, x[p * GMAX + g]);
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
    unpack8<T>(*reinterpret_cast<const uint4*>(sv + (rg + p * Tl::kRowGroups) * (D * 2) + lr * 16),
               vf);
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(x[p * GMAX + g], vf[e], acc[g][e]);
      }
    }
  }
}

// Warp states in shared memory (m, l: [WARPS][GMAX] floats each at `smem`, then
// acc: [WARPS][GMAX][D] floats; warps that saw nothing hold m = -inf, l = 0, acc = 0)
// -> the G heads' output rows (num_chunks == 1) or normalised partial and (max, sum) at
// slot `chunk`. The caller has synchronised after filling the buffers. WARPS and THREADS:
// the CTA's shape (the tiling macros' by default; exact_decode_tc.cu has its own).
// Non-finite input (decode_common.cuh): a warp whose l or m is NaN makes the head's max M
// NaN (nan_max), hence its row and partial NaN (M, L = NaN), never a zero row.
template <typename T, int D, int GMAX, int WARPS = kWarps, int THREADS = kThreads>
__device__ __forceinline__ void combine_warps_and_write(const unsigned char* smem, int G,
                                                        long long head0, T* __restrict__ out,
                                                        float* __restrict__ part_o,
                                                        float* __restrict__ part_ml,
                                                        int num_chunks, int chunk,
                                                        float* __restrict__ lse = nullptr) {
  const int tid = threadIdx.x;
  const float* sm_m = reinterpret_cast<const float*>(smem);
  const float* sm_l = sm_m + WARPS * GMAX;
  const float* sm_acc = sm_l + WARPS * GMAX;

  for (int i = tid; i < G * D; i += THREADS) {
    const int g = i / D, d = i % D;
    float M = STOCHATTN_NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float lw = sm_l[w * GMAX + g];
      M = nan_max(M, lw == lw ? sm_m[w * GMAX + g] : STOCHATTN_NAN);
    }
    float L = 0.f, o = 0.f;
    if (M != STOCHATTN_NEG_INF) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float c = exp2f(sm_m[w * GMAX + g] - M);  // warps that saw nothing: 0
        L = fmaf(sm_l[w * GMAX + g], c, L);
        o = fmaf(sm_acc[(w * GMAX + g) * D + d], c, o);
      }
    }
    const float res = L == 0.f ? 0.f : o / L;  // NaN L: NaN
    const long long hrow = head0 + g;
    if (num_chunks == 1) {
      out[hrow * D + d] = Elem<T>::from_float(res);
      if (lse && d == 0) lse[hrow] = lse_of(M, L);
    } else {
      part_o[(hrow * num_chunks + chunk) * D + d] = res;
      if (d == 0) {
        part_ml[(hrow * num_chunks + chunk) * 2 + 0] = M;
        part_ml[(hrow * num_chunks + chunk) * 2 + 1] = L;
      }
    }
  }
}

// Feature d of the merged output row `row` from its num_chunks partials (written by
// combine_warps_and_write / write_empty_group): out = sum_c w_c o_c / sum_c w_c with
// w_c = l_c * 2^(m_c - M), M the max over chunks (log2 domain). Chunks that saw no token
// have m_c = -inf, l_c = 0 and weigh nothing; a row with no token at all gets 0; a NaN max
// (a chunk that read non-finite input) makes the row NaN. The order of the sums is fixed
// (deterministic). Loads bypass L1 (__ldcg): the in-kernel merge reads
// partials that other CTAs wrote during the same launch.
__device__ __forceinline__ float merge_chunk_partials(const float* __restrict__ part_o,
                                                      const float* __restrict__ part_ml,
                                                      long long row, int d, int num_chunks,
                                                      int D) {
  const float* ml = part_ml + row * num_chunks * 2;
  float M = STOCHATTN_NEG_INF;
  for (int c = 0; c < num_chunks; ++c) M = nan_max(M, __ldcg(ml + 2 * c));
  float L = 0.f, o = 0.f;
  if (M != STOCHATTN_NEG_INF) {
    for (int c = 0; c < num_chunks; ++c) {
      const float w = __ldcg(ml + 2 * c + 1) * exp2f(__ldcg(ml + 2 * c) - M);
      L += w;
      o = fmaf(w, __ldcg(part_o + (row * num_chunks + c) * D + d), o);
    }
  }
  return L == 0.f ? 0.f : o / L;
}

// The log-sum-exp (natural log) of row `row` from its num_chunks (max, sum) partials: M and
// L as merge_chunk_partials computes them (same order), then lse_of.
__device__ __forceinline__ float merge_chunk_lse(const float* __restrict__ part_ml, long long row,
                                                 int num_chunks) {
  const float* ml = part_ml + row * num_chunks * 2;
  float M = STOCHATTN_NEG_INF;
  for (int c = 0; c < num_chunks; ++c) M = nan_max(M, __ldcg(ml + 2 * c));
  float L = 0.f;
  if (M != STOCHATTN_NEG_INF) {
    for (int c = 0; c < num_chunks; ++c) L += __ldcg(ml + 2 * c + 1) * exp2f(__ldcg(ml + 2 * c) - M);
  }
  return lse_of(M, L);
}

// The merge inside the chunk launch: every thread of every CTA of the grid calls this after
// its CTA wrote its partial (or its empty partial). counters[group] (group = b * Hkv + kvh)
// counts the CTAs of the group that are done; the last of the num_chunks to arrive merges
// the group's G rows into `out` (merge_chunk_partials: the same arithmetic as
// exact_decode_merge, so the result is bit for bit the two-launch one) and sets the
// counter back to 0 for the next launch. Release/acquire: each thread's partial stores are
// fenced before its CTA's atomic, and the last CTA fences after seeing the count. The
// counters must start at 0 and must not be shared by two launches that run concurrently
// (the host keeps one array per stream).
template <typename T, int D, int THREADS = kThreads>
__device__ __forceinline__ void merge_if_last_chunk(int* __restrict__ counters, long long group,
                                                    int G, long long head0,
                                                    const float* __restrict__ part_o,
                                                    const float* __restrict__ part_ml,
                                                    T* __restrict__ out, int num_chunks,
                                                    float* __restrict__ lse = nullptr) {
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counters + group, 1) == num_chunks - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < G * D; i += THREADS) {
    const int g = i / D, d = i % D;
    out[(head0 + g) * D + d] =
        Elem<T>::from_float(merge_chunk_partials(part_o, part_ml, head0 + g, d, num_chunks, D));
  }
  if (lse)
    for (int g = threadIdx.x; g < G; g += THREADS)
      lse[head0 + g] = merge_chunk_lse(part_ml, head0 + g, num_chunks);
  if (threadIdx.x == 0) counters[group] = 0;
}

// A CTA that saw no row: zero output rows (and lse -inf when `lse` is given), or an empty
// partial (o = 0, m = -inf, l = 0).
template <typename T, int D, int THREADS = kThreads>
__device__ __forceinline__ void write_empty_group(int G, long long head0, T* __restrict__ out,
                                                  float* __restrict__ part_o,
                                                  float* __restrict__ part_ml, int num_chunks,
                                                  int chunk, float* __restrict__ lse = nullptr) {
  for (int i = threadIdx.x; i < G * D; i += THREADS) {
    const int g = i / D, d = i % D;
    const long long hrow = head0 + g;
    if (num_chunks == 1) {
      out[hrow * D + d] = Elem<T>::from_float(0.f);
      if (lse && d == 0) lse[hrow] = STOCHATTN_NEG_INF;
    } else {
      part_o[(hrow * num_chunks + chunk) * D + d] = 0.f;
      if (d == 0) {
        part_ml[(hrow * num_chunks + chunk) * 2 + 0] = STOCHATTN_NEG_INF;
        part_ml[(hrow * num_chunks + chunk) * 2 + 1] = 0.f;
      }
    }
  }
}

// Merge the per-thread states (m, l, acc) of the CTA and write the G heads' result:
// row groups of a warp by shuffles, then warps through shared memory (`smem`, at least
// (2 + D) * WARPS * GMAX floats; every thread must be done with it: the caller syncs
// before). The order of the sums is fixed, so the result is deterministic. WARPS and
// THREADS: the CTA's shape (the tiling macros' by default). Non-finite input
// (decode_common.cuh): a head whose l is NaN on some thread (it read a non-finite logit)
// gets m = NaN here, which the merges below carry (nan_max) to a NaN output row; with
// `probed` (the caller ran key_probe into l[0] over queries that query_faults made finite)
// a NaN l[0] on any lane of the warp marks a non-finite key, and every head gets m = NaN.
// `bad_q` (query_faults' mask; exact decode passes it) also gives those heads m = NaN (their
// rows are NaN already through the poisoned acc; this makes their lse NaN too). `lse`: the
// optional log-sum-exp output of the one-chunk case (combine_warps_and_write).
template <typename T, int D, int GMAX, int WARPS = kWarps, int THREADS = kThreads>
__device__ __forceinline__ void finish_group_state(float (&m)[GMAX], float (&l)[GMAX],
                                                   float (&acc)[GMAX][8], int G,
                                                   unsigned char* smem, long long head0,
                                                   T* __restrict__ out, float* __restrict__ part_o,
                                                   float* __restrict__ part_ml, int num_chunks,
                                                   int chunk, bool probed = false,
                                                   unsigned bad_q = 0u,
                                                   float* __restrict__ lse = nullptr) {
  constexpr int LPR = Tiling<D>::kLanesPerRow;
  const int tid = threadIdx.x;
  const int lr = tid % LPR, warp = tid / 32, lane = tid % 32;
  const bool bad_key = probed && __any_sync(0xffffffffu, l[0] != l[0]);
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
    if (g < G && (bad_key || l[g] != l[g] || ((bad_q >> g) & 1u))) m[g] = STOCHATTN_NAN;

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
        const float mn = nan_max(m[g], mo);
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

  float* sm_m = reinterpret_cast<float*>(smem);   // [WARPS][GMAX]
  float* sm_l = sm_m + WARPS * GMAX;              // [WARPS][GMAX]
  float* sm_acc = sm_l + WARPS * GMAX;            // [WARPS][GMAX][D]
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
  combine_warps_and_write<T, D, GMAX, WARPS, THREADS>(smem, G, head0, out, part_o, part_ml,
                                                     num_chunks, chunk, lse);
}

}  // namespace stochattn
