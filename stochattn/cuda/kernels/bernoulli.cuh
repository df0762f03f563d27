// Bernoulli qK^T on the GPU (docs/estimators.md; reference: stochattn/reference/bernoulli.py):
// the score stage that reads only the key features a random ternary query keeps.
//
// 1. bernoulli_qhat, grid (Hkv, B), block kQhatThreads: per GQA group, the effective query
//    q_hat of every head (fp32, times `scale`) and the features the group reads:
//    - per head (group_shared = 0): a_j = |q_j|, alpha = max_j a_j; draw i keeps feature j
//      when u_ij * alpha < a_j (u_ij: Philox row b * Hq + h, purpose Bernoulli, stream 0,
//      draw i * D + j; u has 24 significant bits, so the float64 product is exact and the
//      decision is the reference's bit for bit); q_hat_j = alpha sign(q_j) c_j / draws with
//      c_j the number of draws that keep j;
//    - mean group query (group_shared = 1): a_j = sum_h |q_hj| (float64), one pattern per
//      KV head (Philox row b * Hkv + kvh), and head h weighs a kept feature by
//      q_hj (c_j / draws) (amax / a_j).
//    Outputs: qhat (B * Hq, D) fp32; feat (B * Hkv, D) int32, the features some head of
//    the group keeps in ascending order, and nfeat (B * Hkv) their number; frac (B * Hq)
//    fp32, the fraction of the D features head h reads (its own pattern, or the group's).
//    A head whose q holds a NaN or an infinity keeps no feature (the reference's counts are
//    0 there: alpha is not finite) and gets q_hat = NaN, and feature 0 joins the group's
//    list so that its logits are NaN (decode_common.cuh, non-finite input); with
//    group_shared such a head makes the group's amax NaN, so no head keeps a feature (the
//    reference's max is NaN too).
// 2. bernoulli_logits_fm, grid (num_chunks, Hkv, B), block kFmThreads: the logits
//    x = q_hat . k of every token of the chunk from a FEATURE-MAJOR copy of K,
//    kfm (B, Hkv, D, ld) with ld (>= N, a multiple of 8) tokens per feature row: only the
//    nfeat rows of kept features are read, each as 16-byte pieces of 8 tokens (one thread,
//    8 tokens, all G heads). Written to the prop stash (rows b * Hq + h, n_pad columns),
//    nothing past the sequence, as santa_prop_logits does.
// The token-major path is santa_prop_logits with QHAT = true (santa_prop.cu): it reads the
// fp32 q_hat and skips the 16-byte pieces of K whose 8 features no head of the group keeps
// (those save DRAM traffic only when both halves of a 32-byte sector are skipped).
#pragma once

#include "decode_common.cuh"
#include "philox.cuh"

namespace stochattn {

constexpr int kQhatThreads = 128;  // >= the largest head dim
constexpr int kFmThreads = 128;
constexpr int kFmTokens = 8;       // tokens per thread per pass (one 16-byte piece)
constexpr int kFmUnroll = 4;       // feature rows in flight per thread

// Max over the block of one double per thread (kQhatThreads threads), via `red` (4 slots).
__device__ __forceinline__ double qhat_block_max(double x, double* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, off));
  __syncthreads();  // `red` may still be read from a previous call
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  double m = red[0];
#pragma unroll
  for (int w = 1; w < kQhatThreads / 32; ++w) m = fmax(m, red[w]);
  return m;
}

// Number of the `draws` draws that keep feature j: #{i : u_ij * amax < a_j}.
__device__ __forceinline__ int qhat_count(const RngStream& rs, int D, int j, int draws, double amax,
                                          double a) {
  int c = 0;
  for (int i = 0; i < draws; ++i)
    c += (double)rs.uniform(0u, (unsigned)(i * D + j)) * amax < a ? 1 : 0;
  return c;
}

template <typename T>
__global__ void __launch_bounds__(kQhatThreads)
bernoulli_qhat(const T* __restrict__ q, float* __restrict__ qhat, int* __restrict__ feat,
               int* __restrict__ nfeat, float* __restrict__ frac, int Hkv, int G, int D,
               int draws, int group_shared, float scale, unsigned long long seed,
               unsigned offset, const void* __restrict__ seed_ptr,
               const void* __restrict__ offset_ptr, unsigned streams) {
  STOCHATTN_PDL_ENTRY();
  const int kvh = blockIdx.x, b = blockIdx.y;
  seed = stream_seed(seed, seed_ptr, streams, b);
  offset = stream_offset(offset, offset_ptr, streams, b);
  const int j = threadIdx.x;
  const bool active = j < D;
  const int Hq = Hkv * G;
  const long long head0 = (long long)b * Hq + (long long)kvh * G;
  __shared__ double red[kQhatThreads / 32];
  __shared__ int kept[kQhatThreads];
  __shared__ int heads_kept[8];
  if (j < 8) heads_kept[j] = 0;
  __syncthreads();

  // Heads whose query holds a NaN or an infinity (bit g): uniform over the block.
  unsigned bad = 0;
  for (int g = 0; g < G; ++g)
    if (__syncthreads_or(active && not_finite(Elem<T>::to_float(q[(head0 + g) * D + j].bits))))
      bad |= 1u << g;

  bool any = false;  // some head of the group reads feature j
  if (group_shared) {
    double a = 0.0;
    for (int g = 0; g < G; ++g)
      if (active) a += fabs((double)Elem<T>::to_float(q[(head0 + g) * D + j].bits));
    double amax = qhat_block_max(active ? a : 0.0, red);
    if (bad) amax = (double)STOCHATTN_NAN;  // no draw keeps a feature (u * NaN < a is false)
    const RngStream rs = RngStream::make(seed, offset, PURPOSE_BERNOULLI, (unsigned)(b * Hkv + kvh));
    const int c = active ? qhat_count(rs, D, j, draws, amax, a) : 0;
    any = c > 0;
    // (c / draws) (amax / a_j): exactly c / draws for a p_j = 1 feature; 0 if never kept.
    const double w = any ? ((double)c / (double)draws) * (amax / a) : 0.0;
    for (int g = 0; g < G; ++g)
      if (active)
        qhat[(head0 + g) * D + j] = ((bad >> g) & 1u)
            ? STOCHATTN_NAN
            : (float)((double)Elem<T>::to_float(q[(head0 + g) * D + j].bits) * w * (double)scale);
    if (any) atomicAdd(&heads_kept[0], 1);
  } else {
    for (int g = 0; g < G; ++g) {
      const float qj = active ? Elem<T>::to_float(q[(head0 + g) * D + j].bits) : 0.f;
      const double a = fabs((double)qj);
      const double amax = qhat_block_max(a, red);
      const RngStream rs = RngStream::make(seed, offset, PURPOSE_BERNOULLI, (unsigned)(head0 + g));
      const int c = active ? qhat_count(rs, D, j, draws, amax, a) : 0;
      const double sgn = qj > 0.f ? 1.0 : (qj < 0.f ? -1.0 : 0.0);
      const bool badg = (bad >> g) & 1u;
      if (active)
        qhat[(head0 + g) * D + j] = badg ? STOCHATTN_NAN
            : (float)(amax * sgn * ((double)c / (double)draws) * (double)scale);
      if (c > 0 && !badg) {
        any = true;
        atomicAdd(&heads_kept[g], 1);
      }
    }
  }
  kept[j] = any || (bad && j == 0) ? 1 : 0;  // a bad head reads feature 0: NaN logits
  __syncthreads();
  if (j == 0) {  // ascending list of the group's features (D <= 128 steps, once per group)
    int n = 0;
    for (int f = 0; f < D; ++f)
      if (kept[f]) feat[((long long)b * Hkv + kvh) * D + n++] = f;
    nfeat[(long long)b * Hkv + kvh] = n;
  }
  if (j < G) frac[head0 + j] = (float)heads_kept[group_shared ? 0 : j] / (float)D;
}

template <typename T, int GMAX>
__global__ void __launch_bounds__(kFmThreads)
bernoulli_logits_fm(const float* __restrict__ qhat, const T* __restrict__ kfm,
                    const int* __restrict__ feat, const int* __restrict__ nfeat,
                    const int* __restrict__ seq_lens, float* __restrict__ logits, int Hkv, int G,
                    int D, long long N, long long ld, long long chunk_len, long long n_pad) {
  STOCHATTN_PDL_ENTRY();
  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int Hq = Hkv * G;
  const long long len = sequence_length(seq_lens, b, N);
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, len);
  if (start >= end) return;  // logits past the sequence are never read
  const long long head0 = (long long)b * Hq + (long long)kvh * G;
  const long long group = (long long)b * Hkv + kvh;
  float* xout = logits + head0 * n_pad;

  __shared__ float qs[GMAX * 128];  // q_hat of the G heads at the kept features, in list order
  __shared__ int fl[128];           // feature row offsets (features)
  const int nf = nfeat[group];
  for (int i = threadIdx.x; i < nf; i += kFmThreads) {
    const int f = feat[group * D + i];
    fl[i] = f;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) qs[g * 128 + i] = g < G ? qhat[(head0 + g) * D + f] : 0.f;
  }
  __syncthreads();

  const T* kg = kfm + group * D * ld;
  for (long long n0 = start + (long long)threadIdx.x * kFmTokens; n0 < end;
       n0 += (long long)kFmThreads * kFmTokens) {
    float acc[GMAX][kFmTokens];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
      for (int e = 0; e < kFmTokens; ++e) acc[g][e] = 0.f;
    for (int i0 = 0; i0 < nf; i0 += kFmUnroll) {
      uint4 raw[kFmUnroll];
#pragma unroll
      for (int u = 0; u < kFmUnroll; ++u)  // n0 + 8 <= ld: ld is a multiple of 8 and n0 < N
        raw[u] = i0 + u < nf ? __ldg(reinterpret_cast<const uint4*>(kg + (long long)fl[i0 + u] * ld + n0))
                             : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int u = 0; u < kFmUnroll; ++u) {
        if (i0 + u < nf) {
          float kf[8];
          unpack8<T>(raw[u], kf);
#pragma unroll
          for (int g = 0; g < GMAX; ++g) {
            const float w = qs[g * 128 + i0 + u];
#pragma unroll
            for (int e = 0; e < kFmTokens; ++e) acc[g][e] = fmaf(w, kf[e], acc[g][e]);
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < G) {
        float* xo = xout + g * n_pad + n0;
        // inf_to_nan: an infinity (a non-finite key feature that is read) becomes NaN.
#pragma unroll
        for (int e = 0; e < kFmTokens; ++e) acc[g][e] = inf_to_nan(acc[g][e]);
        if (n0 + kFmTokens <= end) {  // n_pad and n0 are multiples of 8: 16-byte aligned
          *reinterpret_cast<float4*>(xo) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
          *reinterpret_cast<float4*>(xo + 4) = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
        } else {
#pragma unroll
          for (int e = 0; e < kFmTokens; ++e)
            if (n0 + e < end) xo[e] = acc[g][e];
        }
      }
    }
  }
}

}  // namespace stochattn
