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
// partial output and (max, sum), and the chunks are combined either by the last CTA of the
// group to finish (counters non-null: one zeroed int per (b, KV head), group_state.cuh:
// merge_if_last_chunk) or by the exact_decode_merge launch (counters null). `lse` (null
// unless return_lse): each row's natural-log log-sum-exp of the scaled logits, written by
// whichever of the three writes the output row (group_state.cuh: lse_of).
//
// K and V: contiguous (B, Hkv, N, D) caches, or page pools read in place through the page
// table that follows seq_lens (kv_rows.cuh; kv_indptr null: contiguous; with pages the
// lengths come from the table and seq_lens is null).
//
// Template parameters: element type (stochattn::f16, stochattn::bf16: 16-bit storage), head dim D (64, 128), GMAX
// (4 or 8): the register arrays are sized for GMAX heads and the actual group size
// G <= GMAX is a run-time argument.
#include "decode_common.cuh"
#include "group_state.cuh"
#include "merge.cuh"

using namespace stochattn;

template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads)
exact_decode_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                   const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len,
                   int page_size, long long page_stride, int row_stride, int head_stride,
                   T* __restrict__ out,
                   float* __restrict__ part_o, float* __restrict__ part_ml,
                   int* __restrict__ counters, int Hkv, int G, long long N, long long chunk_len,
                   int num_chunks, float scale_log2, float* __restrict__ lse) {
  STOCHATTN_PDL_ENTRY();
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

  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const long long len = stream_length(seq_lens, table, b, N);
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, len);
  const long long head0 = (long long)b * Hq + (long long)kvh * G;  // first query head row

  // Pipeline stages (K then V per stage), dynamic shared memory of
  // max(kStages * 2 * kStageBytes, merge buffers) bytes; reused for the cross-warp merge.
  unsigned char* smem = dynamic_smem();

  if (start >= end) {  // nothing in this chunk (past the sequence's length, or it is empty)
    write_empty_group<T, D>(G, head0, out, part_o, part_ml, num_chunks, chunk, lse);
    if (counters)
      merge_if_last_chunk<T, D>(counters, (long long)b * Hkv + kvh, G, head0, part_o, part_ml, out,
                                num_chunks, lse);
    return;
  }

  // The G query vectors, this thread's 8 features each, pre-scaled.
  float qf[GMAX][8];
  load_group_queries<T, D, GMAX>(q, head0, G, lr, scale_log2, qf);

  // The K and V rows of stream (b, kvh): contiguous or through the page table.
  const KvRows<D> krows = kv_rows<D>(k, table, b, kvh, Hkv, N);
  const KvRows<D> vrows = kv_rows<D>(v, table, b, kvh, Hkv, N);
  const long long ntiles = (end - start + ROWS - 1) / ROWS;

  // Prologue: the first kStages - 1 tiles in flight (an empty group keeps the count uniform).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) {
      unsigned char* st = smem + s * 2 * kStageBytes;
      load_kv_tile_async<D>(st, st + kStageBytes, krows, vrows, start + (long long)s * ROWS, end);
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
  // Non-finite input (decode_common.cuh): a head with a bad query gets a NaN accumulator
  // (and a zeroed query); key_probe below marks l[0] when a key is not finite.
  const unsigned bad_q = query_faults<GMAX>(qf, G);
  poison_values<GMAX, 8>(acc, G, bad_q);

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
        load_kv_tile_async<D>(st, st + kStageBytes, krows, vrows, start + nx * ROWS, end);
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
    key_probe<GMAX, RPT>(x, l[0]);
    row_group_sums<LPR>(x, lr);

    // Rows past `end` get logit -inf (weight 0), then the stage enters the online softmax.
#pragma unroll
    for (int p = 0; p < RPT; ++p) {
      const bool valid = row0 + rg + p * RG < end;
#pragma unroll
      for (int g = 0; g < GMAX; ++g) x[p * GMAX + g] = valid ? x[p * GMAX + g] : STOCHATTN_NEG_INF;
    }
    accumulate_stage<T, D, GMAX>(x, sv, rg, lr, G, m, l, acc);
  }
  cp_async_wait<0>();
  __syncthreads();  // the stage buffers become the merge buffers below

  finish_group_state<T, D, GMAX>(m, l, acc, G, smem, head0, out, part_o, part_ml, num_chunks,
                                 chunk, /*probed=*/true, bad_q, lse);
  if (counters)
    merge_if_last_chunk<T, D>(counters, (long long)b * Hkv + kvh, G, head0, part_o, part_ml, out,
                              num_chunks, lse);
}
