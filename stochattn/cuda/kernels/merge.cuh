// exact_decode_merge: the split-KV merge launch, shared by every family whose chunk
// kernels write (max, sum) partials (exact decode on the CUDA and tensor cores,
// S²ANTA-flash, Double-P). Compiled into each of their modules; the host declares which
// (kernels.MERGE_FAMILIES).
#pragma once
#include "decode_common.cuh"
#include "group_state.cuh"

// Combine the chunks of each (b, query head) (group_state.cuh: merge_chunk_partials) when
// the chunk kernel did not (counters null: the in-kernel merge turned off; Double-P always
// uses this launch). `lse` (null for every family but exact decode with return_lse): also
// the row's natural-log log-sum-exp (group_state.cuh: merge_chunk_lse).
// Grid (B * Hq), block (D).
template <typename T>
__global__ void exact_decode_merge(const float* __restrict__ part_o,
                                   const float* __restrict__ part_ml, T* __restrict__ out,
                                   int num_chunks, int D, float* __restrict__ lse) {
  STOCHATTN_PDL_ENTRY();
  const long long row = blockIdx.x;
  const int d = threadIdx.x;
  out[row * D + d] = stochattn::Elem<T>::from_float(
      stochattn::merge_chunk_partials(part_o, part_ml, row, d, num_chunks, D));
  if (lse && d == 0) lse[row] = stochattn::merge_chunk_lse(part_ml, row, num_chunks);
}
