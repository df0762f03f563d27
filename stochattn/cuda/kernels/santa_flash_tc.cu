// S²ANTA-flash with its logits on the tensor cores: the estimator, draws, optional outputs,
// chunking and merge of santa_flash_chunk (santa_flash.cu, whose comment says what each
// step computes); only step 1 differs.
//
// santa_flash_tc_chunk<T, D, GMAX, WARPS, ROWS, STAGES>: grid (num_chunks, Hkv, B) and
// chunk_len a multiple of tile_size, as santa_flash_chunk; WARPS warps per CTA, each owning
// whole sampling tiles of the chunk (tiles warp, warp + WARPS, ...). Step 1 of a tile: its
// TS / ROWS pieces of ROWS keys stream through the warp's own STAGES-slot cp.async ring of
// XOR-swizzled tiles (tc_common.cuh, as santa_prop_logits_tc), and mma.sync m16n8k16 with
// the GQA group's query heads as the M rows (fp32 accumulation) gives lane (grp, tig) the
// logits of head grp at keys 8 t + 2 tig + {0, 1} of the piece, which it scales, masks (-inf
// at or past `end`) and stores into xs. Then steps 2-4 (flash_tile_epilogue) and the end
// (finish_group_state, the in-kernel or launched merge) are santa_flash_chunk's code.
//
// The logits differ from the CUDA-core kernel's only by fp32 rounding (another order of
// the q.k products): the draws equal the reference's up to CDF-boundary rounding, as there.
//
// Shared memory per warp (dynamic; the host mirrors it in config.flash_tc_smem_bytes):
// the ring, STAGES * ROWS * D * 2 bytes; xs [GMAX][TS + 8] fp32 (rows padded by 8 floats,
// so the 8 heads' lanes store to different banks); cnt [GMAX][TS] int32 (zero between
// tiles); list [TS] int32. After the loop the CTA's shared memory holds the merge buffers.
#include "merge.cuh"
#include "flash_tile.cuh"
#include "tc_common.cuh"

using namespace stochattn;

template <typename T, int D, int GMAX, int WARPS, int ROWS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32)
santa_flash_tc_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                     const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len,
                     int page_size, long long page_stride, int row_stride, int head_stride,
                     T* __restrict__ out,
                     float* __restrict__ part_o, float* __restrict__ part_ml,
                     int* __restrict__ counters, long long* __restrict__ idx_out,
                     float* __restrict__ tile_m_out, float* __restrict__ tile_l_out,
                     int* __restrict__ samples_out, int Hkv, int G, long long N,
                     long long chunk_len, int num_chunks, int tile_size, long long n_tiles,
                     long long idx_stride, int S, int sampler, float scale,
                     unsigned long long seed, unsigned offset, const void* __restrict__ seed_ptr,
                     const void* __restrict__ offset_ptr, unsigned streams) {
  STOCHATTN_PDL_ENTRY();
  seed = stream_seed(seed, seed_ptr, streams, blockIdx.z);  // sequence b = blockIdx.z
  offset = stream_offset(offset, offset_ptr, streams, blockIdx.z);
  static_assert(GMAX <= 8, "the mma's M rows 0..7 hold at most 8 query heads");
  using Shape = tc::KPieces<D, ROWS, STAGES>;
  constexpr int THREADS = WARPS * 32;
  constexpr int NT = Shape::kNT;  // n8 tiles of keys per piece
  constexpr int kTileBytes = Shape::kTileBytes;

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane >> 2, tig = lane & 3;
  const int TS = tile_size;
  const int XS = TS + 8;                        // padded row of xs
  const int tile_shift = __ffs(TS) - 1;         // TS is a power of two
  const int spt_shift = tile_shift - __ffs(ROWS) + 1;  // log2(TS / ROWS): pieces per tile

  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const FlashChunk fc = flash_chunk(seq_lens, table, Hkv, G, N, chunk_len, TS, S);
  const long long start = fc.start, end = fc.end, head0 = fc.head0;
  const int St = fc.St;
  if (flash_chunk_outputs<T, D, THREADS>(fc, out, part_o, part_ml, counters, idx_out, tile_m_out,
                                         tile_l_out, samples_out, Hkv, G, chunk_len, num_chunks,
                                         TS, n_tiles, idx_stride))
    return;  // nothing in this chunk: its empty partial is written

  // This warp's shared memory (layout above).
  unsigned char* smem = dynamic_smem();
  unsigned char* ring =
      smem + (long long)warp * (STAGES * kTileBytes + TS * (8 * GMAX + 4) + 32 * GMAX);
  float* xs = reinterpret_cast<float*>(ring + STAGES * kTileBytes);  // [GMAX][XS]
  int* cnt = reinterpret_cast<int*>(xs + GMAX * XS);                  // [GMAX][TS]
  int* list = cnt + GMAX * TS;                                        // [TS]
  for (int i = lane; i < GMAX * TS; i += 32) cnt[i] = 0;
  const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(ring));

  unsigned qa[D / 16][2];
  tc::load_query_frags<T, D>(qa, q, head0, G, grp, tig);

  // The K and V rows of stream (b, kvh): contiguous or through the page table.
  const KvRows<D> krows = kv_rows<D>(k, table, b, kvh, Hkv, N);
  const KvRows<D> vrows = kv_rows<D>(v, table, b, kvh, Hkv, N);

  // The warp's pieces: piece i is piece i % SPT of the warp's (i / SPT)-th tile.
  const long long chunk_tiles = (end - start + TS - 1) / TS;
  const int my_tiles = chunk_tiles > warp ? (int)((chunk_tiles - warp + WARPS - 1) / WARPS) : 0;
  const long long my_pieces = (long long)my_tiles << spt_shift;
  const long long spt_mask = (1ll << spt_shift) - 1;
  auto piece_row0 = [&](long long i) {
    return start + (((i >> spt_shift) * WARPS + warp) << tile_shift) + (i & spt_mask) * ROWS;
  };
  tc::Ahead<ROWS> ahead;  // page numbers one load ahead (paged caches)
  auto load = [&](int slot, long long i) {
    tc::load_rows_ahead<D, ROWS>(ring + slot * kTileBytes, krows, i, piece_row0, end, lane,
                                 ahead);
  };
  tc::ring_prologue<STAGES>(my_pieces, load);

  // Running state per head (log2 units), equal on every lane; acc: this lane's 8 features of
  // the V rows its row group gathered, relative to exp2(M) (santa_flash_chunk's layout).
  float M[GMAX], L[GMAX], acc[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    M[g] = STOCHATTN_NEG_INF;
    L[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  tc::RingSlots<STAGES> slots;
  long long i = 0;
  for (int j = 0; j < my_tiles; ++j) {
    const long long tok0 = start + (((long long)j * WARPS + warp) << tile_shift);  // < end

    // ---- 1. logits of the tile's rows into xs (-inf at or past `end`) ----
    for (int ss = 0; ss < (1 << spt_shift); ++ss, ++i) {
      const unsigned sk = ring_s + tc::ring_step<STAGES>(i, my_pieces, slots, load) * kTileBytes;
      const long long row0 = tok0 + ss * ROWS;
      float x[NT][2];
      tc::tile_logits<T, D, ROWS>(x, sk, qa, lane);
      if (grp < G) {
        float* xr = xs + grp * XS + ss * ROWS + 2 * tig;  // 8-byte aligned: XS, ROWS even
        // Non-finite input (decode_common.cuh): an infinite logit of a row in the sequence
        // is stored NaN (inf_to_nan; a -inf would weigh 0), so the head's tile has l_t = NaN:
        // no draws, a NaN output row (flash_tile.cuh).
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const long long r = row0 + 8 * t + 2 * tig;
          *reinterpret_cast<float2*>(xr + 8 * t) =
              make_float2(r < end ? inf_to_nan(x[t][0] * scale) : STOCHATTN_NEG_INF,
                          r + 1 < end ? inf_to_nan(x[t][1] * scale) : STOCHATTN_NEG_INF);
        }
      }
    }
    __syncwarp();  // the tile's logits are visible to every lane

    const long long t = (start >> tile_shift) + (long long)j * WARPS + warp;  // the Philox stream
    flash_tile_epilogue<T, D, GMAX>(xs, XS, cnt, list, TS, G, tok0, end, t, head0, n_tiles,
                                    tile_m_out, tile_l_out, idx_out, idx_stride, St, sampler,
                                    seed, offset, vrows, lane, M, L, acc);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp left the loop: the shared memory becomes the merge buffer

  // finish_group_state merges the row groups by summing l: one row group carries the warp's L.
  float l[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) l[g] = lane < D / 8 ? L[g] : 0.f;
  finish_group_state<T, D, GMAX, WARPS, THREADS>(M, l, acc, G, smem, head0, out, part_o, part_ml,
                                                 num_chunks, chunk);
  if (counters)
    merge_if_last_chunk<T, D, THREADS>(counters, (long long)b * Hkv + kvh, G, head0, part_o,
                                       part_ml, out, num_chunks);
}
