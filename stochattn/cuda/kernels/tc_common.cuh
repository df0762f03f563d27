// Tensor-core building blocks of the decode kernels (exact_decode_tc.cu, santa_prop.cu):
// mma.sync m16n8k16 with the GQA group's query heads as the M dimension (rows 8..15 zero),
// ldmatrix from XOR-swizzled tiles, per-warp cp.async tile loads (of contiguous or paged
// streams, kv_rows.cuh). Inline PTX only.
#pragma once
#include "decode_common.cuh"

namespace stochattn {
namespace tc {

// Two floats -> one 32-bit word of two T, `lo` at the lower address (the mma's element
// order: lower column in the low half). cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the
// upper half.
template <typename T>
struct Pack;

// D += A . B for one m16n8k16 tile with A rows 8..15 zero (a1 = a3 = 0) and the accumulator
// rows 8..15 discarded: d0, d1 are row groupID, columns 2 tig, 2 tig + 1.
template <typename T>
__device__ __forceinline__ void mma_rows8(float& d0, float& d1, unsigned a0, unsigned a2,
                                          unsigned b0, unsigned b1);

// The two specialisations per element type differ only in the PTX type name.
#define STOCHATTN_TC_TYPE(T, PTX)                                                           \
  template <>                                                                              \
  struct Pack<T> {                                                                         \
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {                  \
      unsigned r;                                                                          \
      asm("cvt.rn." PTX "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                 \
      return r;                                                                            \
    }                                                                                      \
  };                                                                                       \
  template <>                                                                              \
  __device__ __forceinline__ void mma_rows8<T>(float& d0, float& d1, unsigned a0,          \
                                               unsigned a2, unsigned b0, unsigned b1) {    \
    float u2, u3; /* rows 8..15: zero, unused */                                           \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0, %1, %2, %3}, "     \
        "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"                               \
        : "=f"(d0), "=f"(d1), "=f"(u2), "=f"(u3)                                           \
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(d0), "f"(d1), "f"(0.f), \
          "f"(0.f));                                                                       \
  }

STOCHATTN_TC_TYPE(f16, "f16")
STOCHATTN_TC_TYPE(bf16, "bf16")
#undef STOCHATTN_TC_TYPE

// Four 8x8 matrices of 16-bit elements from shared memory; lane 8 i + j gives the address
// of row j of matrix i. Non-transposed: lane t gets row t / 4, elements 2 (t % 4) + {0, 1}
// of matrix i in r[i]; transposed: elements (2 (t % 4) + {0, 1}, t / 4).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Byte offset of 16-byte piece c of row r in a swizzled tile of rows of D elements.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
  return r * (D * 2) + ((c ^ (r & 7)) << 4);
}

// One warp's cp.async copies of a tile of ROWS rows of one matrix starting at row0 into the
// swizzled tile `dst`; rows at or past `end` are zero-filled and read nothing (their logits
// are masked to -inf; zeros keep 0 * V finite).
template <int D, int ROWS>
__device__ __forceinline__ void load_rows(unsigned char* dst, const unsigned char* base,
                                          long long row0, long long end, int lane) {
  constexpr int kPieces = D / 8;  // 16-byte pieces per row
  constexpr int kPerLane = ROWS * kPieces / 32;
  static_assert(kPerLane * 32 == ROWS * kPieces, "a tile must split evenly over the lanes");
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int p = lane + 32 * j;
    const int r = p / kPieces, c = p % kPieces;
    const bool valid = row0 + r < end;
    const long long off = valid ? (row0 + r) * (D * 2) + c * 16 : 0;  // a legal address
    cp_async16(dst + swz<D>(r, c), base + off, valid);
  }
}

// Page numbers one load ahead. A paged load waits for its rows' page numbers before it can
// issue a copy, and with the lookup in the same step that wait sits in every step of the
// ring. The loads of a ring come in piece order (ring_prologue, then ring_step), so each
// load also issues the next piece's lookups (lane l: row l of piece i + 1) into an
// Ahead and leaves them in flight: the next load finds its page numbers arrived. A load
// whose piece is not the one looked up (never, in piece order) looks its rows up itself.
template <int ROWS>
struct Ahead {
  static constexpr int kSlots = (ROWS + 31) / 32;  // rows per lane: lane + 32 i
  long long piece = -1;    // the piece whose lane rows this holds
  int page[kSlots] = {};   // their physical page numbers (0 past `end`: never read)
  int slot[kSlots] = {};   // their rows inside the pages
};

// Issue the page-number loads of this lane's rows of piece `piece` (first row row0).
template <int D, int ROWS>
__device__ __forceinline__ void look_ahead(const KvRows<D>& rows, Ahead<ROWS>& ah,
                                           long long piece, long long row0, long long end,
                                           int lane) {
  ah.piece = piece;
#pragma unroll
  for (int i = 0; i < Ahead<ROWS>::kSlots; ++i) {
    const long long n = row0 + lane + 32 * i;
    const bool valid = lane + 32 * i < ROWS && n < end;
    const int r = valid ? (int)n : 0;
    const int p = rows.page_index(r);
    ah.slot[i] = r - p * rows.page_size;
    ah.page[i] = valid ? __ldg(rows.pages + p) : 0;
  }
}

// This warp's copies of piece `piece` (first row row0_of(piece)) of one matrix, or of two
// that share the page table (K and V: the host checks they share strides), each row looked
// up once, one load ahead (Ahead above); rows at or past `end` are zero-filled and read
// nothing. Contiguous streams take the base-pointer path. Warp-uniform call sites only.
template <int D, int ROWS, bool KV, typename RowOf>
__device__ __forceinline__ void load_pieces_ahead(unsigned char* dst, unsigned char* dst2,
                                                  const KvRows<D>& rows, const KvRows<D>& rows2,
                                                  long long piece, RowOf row0_of, long long end,
                                                  int lane, Ahead<ROWS>& ah) {
  const long long row0 = row0_of(piece);
  if (!rows.pages) {
    load_rows<D, ROWS>(dst, rows.base, row0, end, lane);
    if constexpr (KV) load_rows<D, ROWS>(dst2, rows2.base, row0, end, lane);
    return;
  }
  if (ah.piece != piece) look_ahead<D, ROWS>(rows, ah, piece, row0, end, lane);  // out of order
  long long mine[Ahead<ROWS>::kSlots];
#pragma unroll
  for (int i = 0; i < Ahead<ROWS>::kSlots; ++i)
    mine[i] = (long long)ah.page[i] * rows.page_bytes + (long long)ah.slot[i] * rows.row_bytes;
  look_ahead<D, ROWS>(rows, ah, piece + 1, row0_of(piece + 1), end, lane);
  constexpr int kPieces = D / 8;  // 16-byte pieces per row
  constexpr int kPerLane = ROWS * kPieces / 32;
  static_assert(kPerLane * 32 == ROWS * kPieces, "a tile must split evenly over the lanes");
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int p = lane + 32 * j;
    const int r = p / kPieces, c = p % kPieces;
    // Row r was looked up by lane r % 32 in its slot r / 32: a lane's j-th piece is row
    // lane / (D / 8) + j * 32 / (D / 8), whose slot j * 32 / (D / 8) / 32 is the same on
    // every lane.
    const long long o = __shfl_sync(0xffffffffu, mine[(j * (32 / kPieces)) / 32], r % 32);
    const bool valid = row0 + r < end;
    cp_async16(dst + swz<D>(r, c), valid ? rows.base + o + c * 16 : rows.base, valid);
    if constexpr (KV)
      cp_async16(dst2 + swz<D>(r, c), valid ? rows2.base + o + c * 16 : rows2.base, valid);
  }
}

// One matrix (K of the logit kernels).
template <int D, int ROWS, typename RowOf>
__device__ __forceinline__ void load_rows_ahead(unsigned char* dst, const KvRows<D>& rows,
                                                long long piece, RowOf row0_of, long long end,
                                                int lane, Ahead<ROWS>& ah) {
  load_pieces_ahead<D, ROWS, false>(dst, nullptr, rows, rows, piece, row0_of, end, lane, ah);
}

// K and V of the same rows (exact decode): one lookup serves both.
template <int D, int ROWS, typename RowOf>
__device__ __forceinline__ void load_kv_rows_ahead(unsigned char* kdst, unsigned char* vdst,
                                                   const KvRows<D>& krows,
                                                   const KvRows<D>& vrows, long long piece,
                                                   RowOf row0_of, long long end, int lane,
                                                   Ahead<ROWS>& ah) {
  load_pieces_ahead<D, ROWS, true>(kdst, vdst, krows, vrows, piece, row0_of, end, lane, ah);
}

// The K-only ring of santa_prop_logits_tc and santa_flash_tc_chunk: pieces of ROWS keys
// (kNT n8 tiles of the mma, kTileBytes bytes) in STAGES slots per warp.
template <int D, int ROWS, int STAGES>
struct KPieces {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static_assert(ROWS == 16 || ROWS == 32, "ROWS must divide the smallest sampling tile (32)");
  static_assert(STAGES >= 2 && STAGES <= 8, "STAGES must be in [2, 8]");
  static constexpr int kNT = ROWS / 8;
  static constexpr int kTileBytes = ROWS * D * 2;
};

// Query A fragments of one GQA group for S^T = Q K^T: head grp (zero for grp >= G),
// features 16 s + 2 tig + {0, 1} (qa[s][0]) and 16 s + 8 + 2 tig + {0, 1} (qa[s][1]).
template <typename T, int D>
__device__ __forceinline__ void load_query_frags(unsigned (&qa)[D / 16][2], const T* q,
                                                 long long head0, int G, int grp, int tig) {
  const unsigned* qrow = reinterpret_cast<const unsigned*>(q + (head0 + grp) * D);
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    qa[s][0] = grp < G ? qrow[8 * s + tig] : 0u;
    qa[s][1] = grp < G ? qrow[8 * s + 4 + tig] : 0u;
  }
}

// x[t][e] = q_grp . k_(8 t + 2 tig + e) for the ROWS keys of the swizzled K tile at shared
// address sk (fp32 accumulate; head grp of the group, zero for grp >= G). ldmatrix lane
// roles (non-transposed): matrix i = piece 4 p + i of rows 8 t + (lane & 7) gives b0, b1 of
// k-steps 2 p and 2 p + 1 of key tile t.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void tile_logits(float (&x)[ROWS / 8][2], unsigned sk,
                                            const unsigned (&qa)[D / 16][2], int lane) {
  const int k_row = lane & 7, k_piece = lane >> 3;
#pragma unroll
  for (int t = 0; t < ROWS / 8; ++t) {
    x[t][0] = x[t][1] = 0.f;
#pragma unroll
    for (int p = 0; p < D / 32; ++p) {
      unsigned r[4];
      ldmatrix_x4(r, sk + swz<D>(8 * t + k_row, 4 * p + k_piece));
      mma_rows8<T>(x[t][0], x[t][1], qa[2 * p][0], qa[2 * p][1], r[0], r[1]);
      mma_rows8<T>(x[t][0], x[t][1], qa[2 * p + 1][0], qa[2 * p + 1][1], r[2], r[3]);
    }
  }
}

// Scales the logits of tile_logits (key 8 t + 2 tig + e of a tile starting at row0) by
// `scale`, masks keys at or past `end` to -inf, and returns the max over the quad's lanes
// (the 16 keys of head grp; -inf if none is valid).
template <int NT>
__device__ __forceinline__ float scale_mask_max(float (&x)[NT][2], long long row0,
                                                long long end, int tig, float scale) {
  float xm = STOCHATTN_NEG_INF;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      x[t][e] = row0 + 8 * t + 2 * tig + e < end ? x[t][e] * scale : STOCHATTN_NEG_INF;
      xm = fmaxf(xm, x[t][e]);
    }
  }
  xm = fmaxf(xm, __shfl_xor_sync(0xffffffffu, xm, 1));
  return fmaxf(xm, __shfl_xor_sync(0xffffffffu, xm, 2));
}

// A warp's STAGES-slot cp.async ring over `steps` tiles: `load(slot, step)` issues the
// copies of one tile into one slot. ring_prologue puts the first STAGES - 1 tiles in
// flight (empty commit groups keep the count uniform); ring_step(i, ...) waits for tile
// i, refills the slot freed by tile i - 1 with tile i + STAGES - 1 and returns the slot
// holding tile i. No CTA barrier: each lane waits for its own copies, __syncwarp for the
// others'.
template <int STAGES, typename Load>
__device__ __forceinline__ void ring_prologue(long long steps, Load load) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load(s, (long long)s);
    cp_async_commit();
  }
}

template <int STAGES>
struct RingSlots {
  int rd = 0, wr = STAGES - 1;  // the slot read and the slot refilled this step
};

template <int STAGES, typename Load>
__device__ __forceinline__ int ring_step(long long i, long long steps, RingSlots<STAGES>& ring,
                                         Load load) {
  cp_async_wait<STAGES - 2>();
  __syncwarp();  // every lane's copies of tile i landed; every lane is done with tile i - 1
  if (i + STAGES - 1 < steps) load(ring.wr, i + STAGES - 1);
  cp_async_commit();
  const int slot = ring.rd;
  ring.rd = ring.rd + 1 == STAGES ? 0 : ring.rd + 1;
  ring.wr = ring.wr + 1 == STAGES ? 0 : ring.wr + 1;
  return slot;
}

}  // namespace tc
}  // namespace stochattn
