// S²ANTA-flash: sampled attention in one streaming pass, no global sync (docs/estimators.md,
// schedule "flash"; reference: stochattn/reference/santa.py, flash_estimate).
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
// a multiple of tile_size, so no sampling tile straddles two chunks. K and V are contiguous
// (B, Hkv, N, D) caches or page pools read in place through the page table that follows
// seq_lens (kv_rows.cuh: the K pipeline and the V gather go through the stream's KvRows,
// the lengths through stream_length); the same tokens and N give the same draws and
// output. Inside a CTA every WARP owns whole sampling tiles (tiles warp, warp + kWarps, ... of the chunk) and carries
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
// or else exact_decode_merge (merge.cuh).
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
// exact_decode_merge (the flash partials have its form).
#include "merge.cuh"
#include "flash_tile.cuh"

using namespace stochattn;

// Occupancy (H200, tile 64): 3 CTAs of 4 warps per SM for GMAX = 4 (164 registers; forcing
// 4 CTAs with 128 registers spilled and measured 26% slower), 2 for GMAX = 8.
template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads)
santa_flash_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                  const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len,
                  int page_size, long long page_stride, int row_stride, int head_stride,
                  T* __restrict__ out,
                  float* __restrict__ part_o, float* __restrict__ part_ml,
                  int* __restrict__ counters, long long* __restrict__ idx_out, float* __restrict__ tile_m_out,
                  float* __restrict__ tile_l_out, int* __restrict__ samples_out, int Hkv, int G,
                  long long N, long long chunk_len, int num_chunks, int tile_size,
                  long long n_tiles, long long idx_stride, int S, int sampler, float scale,
                  unsigned long long seed, unsigned offset, const void* __restrict__ seed_ptr,
                  const void* __restrict__ offset_ptr, unsigned streams) {
  STOCHATTN_PDL_ENTRY();
  seed = stream_seed(seed, seed_ptr, streams, blockIdx.z);  // sequence b = blockIdx.z
  offset = stream_offset(offset, offset_ptr, streams, blockIdx.z);
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

  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const FlashChunk fc = flash_chunk(seq_lens, table, Hkv, G, N, chunk_len, TS, S);
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

  // The K and V rows of stream (b, kvh): contiguous or through the page table.
  const KvRows<D> krows = kv_rows<D>(k, table, b, kvh, Hkv, N);
  const KvRows<D> vrows = kv_rows<D>(v, table, b, kvh, Hkv, N);

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

  // Paged caches: each load looks up the next one's page numbers (decode_common.cuh).
  RowsAhead ahead;
  const auto load_ahead = [&](unsigned char* stage) {
    const long long r0 = next_row();
    load_rows_async_ahead<D, RPT, RG>(stage, krows, r0, ld_tile + ld_off, end, rg, lr, ahead);
  };

#pragma unroll
  for (int s = 0; s < kFlashStages - 1; ++s) {
    if (s < n_stages) load_ahead(stages + s * WSB);
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
  // Non-finite input (decode_common.cuh): a head with a bad query gets a NaN accumulator
  // (and a zeroed query); key_probe below marks L[0] when a key is not finite.
  poison_values<GMAX, 8>(acc, G, query_faults<GMAX>(qf, G));

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
        if (nx < n_stages) load_ahead(stages + wr * WSB);
        cp_async_commit();
      }
      const unsigned char* sk = stages + rd * WSB;
      rd = rd + 1 == kFlashStages ? 0 : rd + 1;
      wr = wr + 1 == kFlashStages ? 0 : wr + 1;
      const long long row0 = tok0 + ss * SR;
      float x[RPT * GMAX];
      partial_dots_rows<T, D, GMAX, RPT, RG>(sk, rg, lr, G, qf, x);
      key_probe<GMAX, RPT>(x, L[0]);
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
    flash_tile_epilogue<T, D, GMAX>(xs, TS, cnt, list, TS, G, tok0, end, t, head0, n_tiles,
                                    tile_m_out, tile_l_out, idx_out, idx_stride, St, sampler,
                                    seed, offset, vrows, lane, M, L, acc);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp left the loop: the shared memory becomes the merge buffer

  // finish_group_state merges the row groups by summing l: one row group carries the warp's L
  // (a NaN L[0] of another row group, key_probe's mark, reaches it through the vote there).
  float l[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) l[g] = rg == 0 ? L[g] : 0.f;
  l[0] = L[0] != L[0] ? L[0] : l[0];
  finish_group_state<T, D, GMAX>(M, l, acc, G, smem, head0, out, part_o, part_ml, num_chunks,
                                 chunk, /*probed=*/true);
  if (counters)
    merge_if_last_chunk<T, D>(counters, (long long)b * Hkv + kvh, G, head0, part_o, part_ml, out,
                              num_chunks);
}
