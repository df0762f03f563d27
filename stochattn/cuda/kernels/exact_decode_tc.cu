// Exact decode attention, split-KV, on the tensor cores (mma.sync.m16n8k16, fp32 accumulate).
//
// Same contract and grid as exact_decode_chunk (exact_decode.cu): grid (num_chunks, Hkv, B),
// one CTA per (sequence b, KV head, chunk of tokens) computes the G <= 8 query heads of the
// GQA group, writes the output (one chunk) or the normalised partial output and its
// (max, sum) in the log2 domain, which the group's last CTA (counters non-null) or
// exact_decode_merge combines, and the optional `lse` output as there (a query fault makes
// l NaN here, hence lse NaN). K and V contiguous or paged, read through the page table
// that follows seq_lens (kv_rows.cuh), as there.
//
// FlashAttention-2 style, with the group's query heads as the M dimension (16 rows, rows
// >= G zero):
//   S^T = Q (16 x D) . K_tile^T   A = the queries, loaded once into registers;
//                                 B = K rows from shared memory by ldmatrix (K is row-major
//                                 (N, D), the "col" layout B needs); one mma gives 16 heads
//                                 x 8 key rows.
//   online softmax per head, fp32, log2 domain (exp2f; the scale * log2(e) is applied to
//   the fp32 logits, so the queries enter the mma unrounded); rows past the end get -inf.
//   O += P (16 x 16 keys) . V_tile  A = P straight from the S accumulators of two adjacent
//                                 n8 tiles (the accumulator fragment of an m16n8 tile is the
//                                 A fragment of the m16k16 operand), rounded to T;
//                                 B = V rows by ldmatrix.trans.
// The softmax sum l adds the rounded weights, so the output is an exact convex
// combination of V rows with the weights the mma used.
//
// Pipeline: each warp streams its own tiles (tiles w, w + WARPS, ... of the chunk: a chunk
// cut short by seq_lens stays balanced over the warps) through its own STAGES-deep cp.async
// ring of K and V tiles, so the loop needs __syncwarp only, no CTA barrier. The 16-byte
// pieces of a row are XOR-swizzled (piece c of row r at c ^ (r & 7)) so that the 8 row
// addresses of an ldmatrix 8x8 matrix hit 8 different bank groups.
//
// Template parameters: element type T (stochattn::f16, stochattn::bf16), head dim D (64,
// 128), WARPS per CTA, ROWS per tile (a multiple of 16), STAGES (>= 2); config.TcTiling
// lists the compiled ones. The register arrays always hold 8 heads (the m16 rows 8..15 are
// never computed); G <= 8 is a run-time value. Inline PTX only (mma, ldmatrix, cvt): no
// CUDA headers (decode_common.cuh).
//
// Occupancy (sm_90, D 128): WARPS 8, ROWS 16, STAGES 3 takes 192 KB of rings (one CTA of 8
// warps per SM, 158 registers); the 4-warp tilings take about 200 registers (the compiler
// keeps a whole tile's ldmatrix results live), fine for a kernel bound by HBM. The launch
// bound's minimum of 1 CTA stops ptxas from capping registers (it spilled at D 64, 8 warps).
#include "decode_common.cuh"
#include "group_state.cuh"
#include "tc_common.cuh"
#include "merge.cuh"

using namespace stochattn;


template <typename T, int D, int WARPS, int ROWS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, 1)
exact_decode_tc_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const int* __restrict__ seq_lens, const int* __restrict__ kv_indptr,
                      const int* __restrict__ kv_indices,
                      const int* __restrict__ kv_last_page_len, int page_size,
                      long long page_stride, int row_stride, int head_stride,
                      T* __restrict__ out,
                      float* __restrict__ part_o, float* __restrict__ part_ml,
                      int* __restrict__ counters, int Hkv, int G, long long N,
                      long long chunk_len, int num_chunks, float scale_log2,
                      float* __restrict__ lse) {
  STOCHATTN_PDL_ENTRY();
  using namespace stochattn;
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static_assert(ROWS % 16 == 0 && ROWS >= 16 && ROWS <= 128, "ROWS: a multiple of 16");
  static_assert(STAGES >= 2 && STAGES <= 8, "STAGES must be in [2, 8]");
  constexpr int kThreadsTc = WARPS * 32;
  constexpr int KS = D / 16;           // k16 steps of the q.k products
  constexpr int NT = ROWS / 8;         // n8 tiles of keys per tile
  constexpr int NO = D / 8;            // n8 tiles of output features
  constexpr int kTileBytes = ROWS * D * 2;
  constexpr int kStageBytesTc = 2 * kTileBytes;  // K then V

  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int Hq = Hkv * G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane >> 2, tig = lane & 3;  // mma fragment coordinates

  const PageTable table = page_table(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                     page_stride, row_stride, head_stride);
  const long long len = stream_length(seq_lens, table, b, N);
  const long long start = (long long)chunk * chunk_len;
  const long long end = min(start + chunk_len, len);
  const long long head0 = (long long)b * Hq + (long long)kvh * G;  // first query head row

  unsigned char* smem = dynamic_smem();
  if (start >= end) {  // nothing in this chunk (past the sequence's length, or it is empty)
    write_empty_group<T, D, kThreadsTc>(G, head0, out, part_o, part_ml, num_chunks, chunk, lse);
    if (counters)
      merge_if_last_chunk<T, D, kThreadsTc>(counters, (long long)b * Hkv + kvh, G, head0, part_o,
                                            part_ml, out, num_chunks, lse);
    return;
  }

  unsigned qa[KS][2];  // A fragments of the queries (tc_common.cuh)
  tc::load_query_frags<T, D>(qa, q, head0, G, grp, tig);

  // The K and V rows of stream (b, kvh): contiguous or through the page table.
  const KvRows<D> krows = kv_rows<D>(k, table, b, kvh, Hkv, N);
  const KvRows<D> vrows = kv_rows<D>(v, table, b, kvh, Hkv, N);
  const long long ntiles = (end - start + ROWS - 1) / ROWS;
  // This warp's tiles: warp, warp + WARPS, ...
  const int my_tiles = ntiles > warp ? (int)((ntiles - warp + WARPS - 1) / WARPS) : 0;
  unsigned char* ring = smem + warp * (STAGES * kStageBytesTc);
  const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(ring));
  auto tile_row0 = [&](long long i) { return start + (i * WARPS + warp) * ROWS; };

  tc::Ahead<ROWS> ahead;  // page numbers one load ahead (paged caches), shared by K and V
  auto load = [&](int slot, long long i) {  // tile i of this warp (K, then V) into a slot
    unsigned char* st = ring + slot * kStageBytesTc;
    tc::load_kv_rows_ahead<D, ROWS>(st, st + kTileBytes, krows, vrows, i, tile_row0, end, lane,
                                    ahead);
  };
  tc::ring_prologue<STAGES>(my_tiles, load);

  // Online softmax state of head grp: m (the quad's shared max, log2 domain), l (this
  // lane's partial sum; the quad's are added at the end), o[n] features 8 n + 2 tig + {0,1}.
  float m = STOCHATTN_NEG_INF, l = 0.f;
  float o[NO][2];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = 0.f;

  // ldmatrix lane roles for V (transposed; K's are in tc::tile_logits): matrices
  // (keys 0-7, piece 2 j), (keys 8-15, piece 2 j), (keys 0-7, piece 2 j + 1), (keys 8-15,
  // piece 2 j + 1) of a 16-key step give b0, b1 of output tiles 2 j and 2 j + 1.
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_piece = lane >> 4;

  tc::RingSlots<STAGES> slots;
  for (int i = 0; i < my_tiles; ++i) {
    const unsigned sk = ring_s + tc::ring_step<STAGES>(i, my_tiles, slots, load) * kStageBytesTc;
    const unsigned sv = sk + kTileBytes;
    const long long row0 = tile_row0(i);

    // S^T: x[t][e] = logit of head grp, key 8 t + 2 tig + e.
    float x[NT][2];
    tc::tile_logits<T, D, ROWS>(x, sk, qa, lane);
    // Non-finite input (decode_common.cuh): l + x * 0 is l, or NaN once a logit of head
    // grp is not finite (its query or a key holds a NaN or an infinity; a -inf would weigh
    // 0), and a NaN l makes the head's output row NaN (rows past the end are zeros: 0).
#pragma unroll
    for (int t = 0; t < NT; ++t) l = fmaf(x[t][0], 0.f, fmaf(x[t][1], 0.f, l));

    // Scale, mask rows past the end, one max shift per tile (the quad's lanes share it).
    const float xm = tc::scale_mask_max<NT>(x, row0, end, tig, scale_log2);
    const float mn = fmaxf(m, xm);
    const float shift = mn == STOCHATTN_NEG_INF ? 0.f : mn;  // no inf - inf
    const float corr = exp2f(m - shift);
    m = mn;
    l *= corr;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      o[n][0] *= corr;
      o[n][1] *= corr;
    }

    // P, rounded to T, as A fragments: pa[t] = keys 8 t + 2 tig + {0, 1}; l adds the
    // rounded weights.
    unsigned pa[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      pa[t] = tc::Pack<T>::pack(exp2f(x[t][0] - shift), exp2f(x[t][1] - shift));
      const float2 w = Elem<T>::pair(pa[t]);
      l += w.x + w.y;
    }

    // O += P . V, 16 keys per step.
#pragma unroll
    for (int s = 0; s < ROWS / 16; ++s) {
#pragma unroll
      for (int j = 0; j < NO / 2; ++j) {
        unsigned r[4];
        tc::ldmatrix_x4_trans(r, sv + tc::swz<D>(16 * s + v_row, 2 * j + v_piece));
        tc::mma_rows8<T>(o[2 * j][0], o[2 * j][1], pa[2 * s], pa[2 * s + 1], r[0], r[1]);
        tc::mma_rows8<T>(o[2 * j + 1][0], o[2 * j + 1][1], pa[2 * s], pa[2 * s + 1], r[2], r[3]);
      }
    }
  }
  cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // every warp is done with its ring: the merge buffers reuse it

  // Warp states -> shared memory in combine_warps_and_write's layout (GMAX = 8).
  float* sm_m = reinterpret_cast<float*>(smem);  // [WARPS][8]
  float* sm_l = sm_m + WARPS * 8;                // [WARPS][8]
  float* sm_acc = sm_l + WARPS * 8;              // [WARPS][8][D]
  if (grp < G) {
    float* a = sm_acc + (warp * 8 + grp) * D + 2 * tig;
#pragma unroll
    for (int n = 0; n < NO; ++n) *reinterpret_cast<float2*>(a + 8 * n) = make_float2(o[n][0], o[n][1]);
    if (tig == 0) {
      sm_m[warp * 8 + grp] = m;
      sm_l[warp * 8 + grp] = l;
    }
  }
  __syncthreads();
  combine_warps_and_write<T, D, 8, WARPS, kThreadsTc>(smem, G, head0, out, part_o, part_ml,
                                                      num_chunks, chunk, lse);
  if (counters)
    merge_if_last_chunk<T, D, kThreadsTc>(counters, (long long)b * Hkv + kvh, G, head0, part_o,
                                          part_ml, out, num_chunks, lse);
}
