// Pieces shared by the decode kernels: element types, 16-byte vector conversions,
// cp.async (sm_80+) helpers and the tiling constants of one KV stream.
//
// Layout (docs): q (B, Hq, D); k, v (B, Hkv, N, D) contiguous, or paged (kv_rows.cuh: the
// loaders below take a stream's KvRows); query head h reads KV head h / G. Offsets into k
// and v are 64-bit (contexts up to 1M tokens and beyond).
#pragma once
#include "kv_rows.cuh"

// No CUDA headers are included: the sources compile with a bare NVRTC (the
// nvidia-cuda-nvrtc wheel ships no cuda_fp16.h), and the element types are plain 16-bit
// storage types converted with PTX cvt instructions.

#define STOCHATTN_NEG_INF (__int_as_float(0xff800000))
#define STOCHATTN_NAN (__int_as_float(0x7fffffff))

// Kernels compiled on demand. The runtime compiles each instantiation as its own module
// (runtime/launch.py), and NVRTC emits every non-template __global__ function of the source
// into every module: a family with a few plain kernels paid for compiling them again in
// each of its modules (santa_prop: 0.8 s, doublep_decode: 1.1 s per module on this
// project's CPU machine). Such a kernel is therefore written as a template of one unused
// defaulted parameter, `template <int kOnDemand = 0>`, emitted only when its name
// expression ("santa_prop_tiles<0>", abi.Kernel.expr fills the default) asks for it.

// Programmatic dependent launch (sm_90), compiled in with -DSTOCHATTN_PDL=1
// (config.TileConfig.pdl). Every kernel starts with STOCHATTN_PDL_ENTRY(): it waits
// until the grid before it in the stream has completed and its writes are visible (a
// no-op when the kernel was launched without the programmatic-serialization attribute),
// then lets the next grid, if launched with that attribute, be scheduled while this one
// runs; that grid waits in its own entry, so nothing is read early. What is gained: the
// launch of each kernel of a chain (prop's sampling after pass 1, Double-P's five
// kernels) overlaps the tail of the one before it. Without the macro defined the entry
// is empty and the machine code is that of a build without it.
#if defined(STOCHATTN_PDL) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define STOCHATTN_PDL_ENTRY()                                  \
  do {                                                         \
    asm volatile("griddepcontrol.wait;" ::: "memory");         \
    asm volatile("griddepcontrol.launch_dependents;" ::: );    \
  } while (0)
#else
#define STOCHATTN_PDL_ENTRY() \
  do {                        \
  } while (0)
#endif

namespace stochattn {

// ---- element types -------------------------------------------------------------------
// Storage-only 16-bit types: IEEE binary16 and bfloat16 bit patterns.
struct __align__(2) f16 {
  unsigned short bits;
};
struct __align__(2) bf16 {
  unsigned short bits;
};

// Eight elements travel as one 16-byte uint4; each 32-bit word holds a pair, the lower
// address (element 2i) in the low half.
template <typename T>
struct Elem;

template <>
struct Elem<f16> {
  static __device__ __forceinline__ float to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));  // exact widening
    return f;
  }
  static __device__ __forceinline__ float2 pair(unsigned w) {
    return make_float2(to_float((unsigned short)(w & 0xFFFFu)), to_float((unsigned short)(w >> 16)));
  }
  static __device__ __forceinline__ f16 from_float(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));  // round to nearest even
    return r;
  }
};

template <>
struct Elem<bf16> {
  // bfloat16 is the upper half of a float32: widening is a shift, exact.
  static __device__ __forceinline__ float to_float(unsigned short h) {
    return __uint_as_float((unsigned)h << 16);
  }
  static __device__ __forceinline__ float2 pair(unsigned w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  }
  static __device__ __forceinline__ bf16 from_float(float x) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));  // sm_80+, round to nearest even
    return r;
  }
};

// 16 bytes -> 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  float2 a = Elem<T>::pair(u.x), b = Elem<T>::pair(u.y), c = Elem<T>::pair(u.z),
         d = Elem<T>::pair(u.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

// ---- cp.async ------------------------------------------------------------------------
// 16-byte global -> shared copy that bypasses L1 (.cg). `valid == false` reads nothing and
// zero-fills the 16 shared bytes (src-size 0), which is how rows past the sequence end
// (or past the chunk) become zeros without a branch around the copy.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_size)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- tiling of one KV stream ---------------------------------------------------------
// The tiling is set at compile time by macros (-D options; config.TileConfig is the one
// place of truth on the Python side, and the module cache is keyed on the options):
//   STOCHATTN_THREADS      threads per CTA of the streaming kernels (128 or 256)
//   STOCHATTN_STAGE_BYTES  bytes of K (and as much of V) per pipeline stage
//   STOCHATTN_STAGES       cp.async pipeline depth (>= 2)
//   STOCHATTN_REDUCE       0: every (row, head) partial dot product is all-reduced over the
//                          row group by a butterfly (log2(LPR) shuffles each);
//                          1: reduce-scatter (each step exchanges half of the remaining
//                          values) then one broadcast shuffle per logit from its owner lane.
// A CTA has kThreads threads. Each thread owns 8 consecutive features (16 bytes) of a row:
// D/8 lanes per row ("a row group"), kThreads / (D/8) row groups per CTA. A pipeline stage
// holds kStageBytes of K (and as much of V for exact decode): kStageBytes / (2 D) rows,
// kRowsPerThread per thread. Thread t copies exactly the 16-byte pieces it later reads
// (row group rg, lane lr: rows rg + p * kRowGroups, bytes [16 lr, 16 lr + 16)), so its own
// cp.async.wait_group suffices and the streaming loop has no CTA barrier.
#ifndef STOCHATTN_THREADS
#define STOCHATTN_THREADS 128
#endif
#ifndef STOCHATTN_STAGE_BYTES
#define STOCHATTN_STAGE_BYTES 4096
#endif
#ifndef STOCHATTN_STAGES
#define STOCHATTN_STAGES 4
#endif
#ifndef STOCHATTN_REDUCE
#define STOCHATTN_REDUCE 0
#endif

constexpr int kThreads = STOCHATTN_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kStageBytes = STOCHATTN_STAGE_BYTES;
constexpr int kStages = STOCHATTN_STAGES;
constexpr int kReduce = STOCHATTN_REDUCE;
static_assert(kThreads % 32 == 0 && kThreads >= 64 && kThreads <= 1024, "STOCHATTN_THREADS");
static_assert(kStages >= 2 && kStages <= 8, "STOCHATTN_STAGES must be in [2, 8]");
static_assert(kReduce == 0 || kReduce == 1, "STOCHATTN_REDUCE must be 0 or 1");

template <int D>
struct Tiling {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static constexpr int kLanesPerRow = D / 8;                        // 8 or 16
  static constexpr int kRowGroups = kThreads / kLanesPerRow;
  static constexpr int kTileRows = kStageBytes / (D * 2);
  static constexpr int kRowsPerThread = kTileRows / kRowGroups;
  static_assert(kRowsPerThread >= 1 && kRowsPerThread * kRowGroups == kTileRows,
                "a stage must hold a whole number of rows per thread");
  static_assert((kRowsPerThread & (kRowsPerThread - 1)) == 0, "rows per thread: a power of two");
};

// Issue the cp.async copies of this thread's pieces of RPT rows of one (b, kv head)
// stream into a stage buffer: rows row0 + rg + p * RG (p < RPT), bytes [16 lr, 16 lr + 16),
// to the same offsets relative to `stage`; rows at or past `end` are zero-filled. These are
// the very pieces the thread reads in the compute step (see above).
// `need == false` (a piece no query reads) zero-fills without reading memory.
template <int D, int RPT, int RG>
__device__ __forceinline__ void load_rows_async(unsigned char* stage, const unsigned char* base,
                                                long long row0, long long end, int rg, int lr,
                                                bool need = true) {
  constexpr int kRowBytes = D * 2;
  const long long first = row0 + rg;
  const unsigned char* src0 = base + first * kRowBytes + lr * 16;
  unsigned char* dst0 = stage + rg * kRowBytes + lr * 16;
#pragma unroll
  for (int p = 0; p < RPT; ++p) {
    const bool valid = need && first + p * RG < end;
    // A zero-filled copy still needs a legal address: point it at the stream's first row.
    const unsigned char* src = valid ? src0 + (long long)p * RG * kRowBytes : base;
    cp_async16(dst0 + p * RG * kRowBytes, src, valid);
  }
}

// The CTA-wide stage of kTileRows rows [row0, row0 + kTileRows): thread (rg, lr) of the
// CTA copies rows row0 + rg + p * kRowGroups.
template <int D>
__device__ __forceinline__ void load_tile_async(unsigned char* stage, const unsigned char* base,
                                                long long row0, long long end, bool need = true) {
  using Tl = Tiling<D>;
  load_rows_async<D, Tl::kRowsPerThread, Tl::kRowGroups>(
      stage, base, row0, end, threadIdx.x / Tl::kLanesPerRow, threadIdx.x % Tl::kLanesPerRow, need);
}

// The row lane `lane` of the warp looks up for a load whose first row is row0 (rg: this
// thread's row group): lane p * GPW + g finds row p of row group g of the warp, where GPW
// = 32 / (D / 8) row groups share a warp (paged_row_offsets below).
template <int D, int RPT, int RG>
__device__ __forceinline__ long long lookup_row(long long row0, int rg, int lane) {
  constexpr int LPR = D / 8, GPW = 32 / LPR;
  return row0 + (rg - lane / LPR) + lane % GPW + (long long)(lane / GPW) * RG;
}

// The byte offsets (from the stream's base) of this thread's RPT rows row0 + rg + p * RG of
// a paged stream (kv_rows.cuh), rows at or past `end` 0 (they read nothing, not even their
// page number: they may lie past the sequence's pages). Each distinct row of the warp is
// looked up once: lane j finds row j of the warp's rows and shuffles it to the D / 8 lanes
// that copy pieces of it (one page-number load and division per lane instead of one per
// piece). Every lane of the warp calls it (all call sites are warp-uniform), with
// rg = (the warp's first row group) + lane / (D / 8).
template <int D, int RPT, int RG>
__device__ __forceinline__ void paged_row_offsets(long long (&off)[RPT], const KvRows<D>& rows,
                                                  long long row0, long long end, int rg) {
  constexpr int LPR = D / 8;    // lanes per row
  constexpr int GPW = 32 / LPR;  // row groups per warp
  if constexpr (GPW * RPT <= 32) {
    const int lane = threadIdx.x & 31;
    const int rgl = lane / LPR;
    const long long mine = lookup_row<D, RPT, RG>(row0, rg, lane);
    const long long o = lane < GPW * RPT && mine < end ? rows.offset(mine) : 0;
#pragma unroll
    for (int p = 0; p < RPT; ++p) off[p] = __shfl_sync(0xffffffffu, o, p * GPW + rgl);
  } else {
#pragma unroll
    for (int p = 0; p < RPT; ++p) {
      const long long n = row0 + rg + (long long)p * RG;
      off[p] = n < end ? rows.offset(n) : 0;
    }
  }
}

// This thread's cp.async copies of its RPT row pieces at `base + off[p]` (see above).
template <int D, int RPT, int RG>
__device__ __forceinline__ void copy_rows_async(unsigned char* stage, const unsigned char* base,
                                                const long long (&off)[RPT], long long row0,
                                                long long end, int rg, int lr, bool need) {
  constexpr int kRowBytes = D * 2;
  unsigned char* dst0 = stage + rg * kRowBytes + lr * 16;
#pragma unroll
  for (int p = 0; p < RPT; ++p) {
    const bool valid = need && row0 + rg + (long long)p * RG < end;
    const unsigned char* src = valid ? base + off[p] + lr * 16 : base;
    cp_async16(dst0 + p * RG * kRowBytes, src, valid);
  }
}

// The same pieces of the rows of one stream that may be paged (kv_rows.cuh): a contiguous
// stream takes the base-pointer path above (the same addresses and instructions, behind
// one uniform branch); a paged one finds its rows through paged_row_offsets.
template <int D, int RPT, int RG>
__device__ __forceinline__ void load_rows_async(unsigned char* stage, const KvRows<D>& rows,
                                                long long row0, long long end, int rg, int lr,
                                                bool need = true) {
  if (!rows.pages) {
    load_rows_async<D, RPT, RG>(stage, rows.base, row0, end, rg, lr, need);
    return;
  }
  long long off[RPT];
  paged_row_offsets<D, RPT, RG>(off, rows, row0, end, rg);
  copy_rows_async<D, RPT, RG>(stage, rows.base, off, row0, end, rg, lr, need);
}

// Page numbers one load ahead (tc_common.cuh's tc::Ahead, for the CUDA-core row layout
// of paged_row_offsets): each load also issues the lookups of the next load's rows (first
// row next0) and leaves them in flight, so no step of the pipeline waits for its page
// numbers. A load whose rows are not the ones looked up looks them up itself.
struct RowsAhead {
  long long row0 = -1;  // first row of the load looked up
  int page = 0;         // this lane's row's physical page number (0: none)
  int slot = 0;         // and its row inside the page
};

template <int D, int RPT, int RG>
__device__ __forceinline__ void rows_look_ahead(const KvRows<D>& rows, RowsAhead& ah,
                                                long long row0, long long end, int rg) {
  constexpr int LPR = D / 8, GPW = 32 / LPR;
  const int lane = threadIdx.x & 31;
  const long long n = lookup_row<D, RPT, RG>(row0, rg, lane);
  const bool valid = lane < GPW * RPT && n < end;
  const int r = valid ? (int)n : 0;
  const int p = rows.page_index(r);
  ah.row0 = row0;
  ah.slot = r - p * rows.page_size;
  ah.page = valid ? __ldg(rows.pages + p) : 0;
}

// load_rows_async of a stream that may be paged, with the page numbers of the load after
// it (first row next0) looked up ahead. Every lane of the warp calls it (warp-uniform call
// sites), in load order.
template <int D, int RPT, int RG>
__device__ __forceinline__ void load_rows_async_ahead(unsigned char* stage, const KvRows<D>& rows,
                                                      long long row0, long long next0,
                                                      long long end, int rg, int lr,
                                                      RowsAhead& ah) {
  constexpr int LPR = D / 8, GPW = 32 / LPR;
  if (!rows.pages || GPW * RPT > 32) {
    load_rows_async<D, RPT, RG>(stage, rows, row0, end, rg, lr);
    return;
  }
  if (ah.row0 != row0) rows_look_ahead<D, RPT, RG>(rows, ah, row0, end, rg);
  const long long o = (long long)ah.page * rows.page_bytes + (long long)ah.slot * rows.row_bytes;
  rows_look_ahead<D, RPT, RG>(rows, ah, next0, end, rg);
  const int rgl = (threadIdx.x & 31) / LPR;
  long long off[RPT];
#pragma unroll
  for (int p = 0; p < RPT; ++p) off[p] = __shfl_sync(0xffffffffu, o, p * GPW + rgl);
  copy_rows_async<D, RPT, RG>(stage, rows.base, off, row0, end, rg, lr, true);
}

template <int D>
__device__ __forceinline__ void load_tile_async(unsigned char* stage, const KvRows<D>& rows,
                                                long long row0, long long end, bool need = true) {
  using Tl = Tiling<D>;
  load_rows_async<D, Tl::kRowsPerThread, Tl::kRowGroups>(
      stage, rows, row0, end, threadIdx.x / Tl::kLanesPerRow, threadIdx.x % Tl::kLanesPerRow, need);
}

// The K and V stages of tile [row0, row0 + kTileRows) of one stream pair: K and V share
// their page table and strides (the host checks it), so a paged pair looks its rows up once.
template <int D>
__device__ __forceinline__ void load_kv_tile_async(unsigned char* kstage, unsigned char* vstage,
                                                   const KvRows<D>& krows, const KvRows<D>& vrows,
                                                   long long row0, long long end) {
  using Tl = Tiling<D>;
  constexpr int RPT = Tl::kRowsPerThread, RG = Tl::kRowGroups;
  const int rg = threadIdx.x / Tl::kLanesPerRow, lr = threadIdx.x % Tl::kLanesPerRow;
  if (!krows.pages) {
    load_rows_async<D, RPT, RG>(kstage, krows.base, row0, end, rg, lr);
    load_rows_async<D, RPT, RG>(vstage, vrows.base, row0, end, rg, lr);
    return;
  }
  long long off[RPT];
  paged_row_offsets<D, RPT, RG>(off, krows, row0, end, rg);
  copy_rows_async<D, RPT, RG>(kstage, krows.base, off, row0, end, rg, lr, true);
  copy_rows_async<D, RPT, RG>(vstage, vrows.base, off, row0, end, rg, lr, true);
}

// The stage buffers live in dynamic shared memory (sizes above 48 KB need the opt-in the
// launcher does); the byte count is computed on the host (config.TileConfig.smem_bytes).
__device__ __forceinline__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char stochattn_dyn_smem[];
  return stochattn_dyn_smem;
}

// Length of sequence b, clamped to [0, N]: an out-of-range GPU seq_lens (unchecked unless
// the caller asks, since checking needs a host sync) can never make a kernel read outside
// the cache.
__device__ __forceinline__ long long sequence_length(const int* __restrict__ seq_lens, int b,
                                                     long long N) {
  if (!seq_lens) return N;
  const long long len = seq_lens[b];
  return len < 0 ? 0 : (len > N ? N : len);
}

// The G query vectors of a GQA group (rows head0 .. head0 + G - 1 of q), this thread's
// 8 features [8 lr, 8 lr + 8) each, multiplied by `scale`; heads G .. GMAX-1 are zeros.
template <typename T, int D, int GMAX>
__device__ __forceinline__ void load_group_queries(const T* __restrict__ q, long long head0, int G,
                                                   int lr, float scale, float (&qf)[GMAX][8]) {
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
      const uint4 u = *reinterpret_cast<const uint4*>(q + (head0 + g) * D + lr * 8);
      unpack8<T>(u, qf[g]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[g][e] *= scale;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[g][e] = 0.f;
    }
  }
}

// The same from fp32 queries that are already scaled (Bernoulli's q_hat rows).
template <int D, int GMAX>
__device__ __forceinline__ void load_group_queries_f32(const float* __restrict__ q, long long head0,
                                                       int G, int lr, float (&qf)[GMAX][8]) {
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
      const float4 a = *reinterpret_cast<const float4*>(q + (head0 + g) * D + lr * 8);
      const float4 c = *reinterpret_cast<const float4*>(q + (head0 + g) * D + lr * 8 + 4);
      qf[g][0] = a.x; qf[g][1] = a.y; qf[g][2] = a.z; qf[g][3] = a.w;
      qf[g][4] = c.x; qf[g][5] = c.y; qf[g][6] = c.z; qf[g][7] = c.w;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[g][e] = 0.f;
    }
  }
}

// ---- non-finite input (docs/conventions.md) -------------------------------------------
// A NaN or an infinity in a query, or in a key a head reads, makes that head's output row
// NaN, never a zero row or a finite wrong answer. No extra live register in the streaming
// loops: the exact and flash CUDA-core kernels pay one FFMA per K row (key_probe), the
// tensor-core ones one FFMA per logit (l + x * 0, or inf_to_nan on stored logits); the
// rest happens once per CTA. A NaN l (a head's sum of weights) or acc is the mark that
// group_state.cuh turns into a NaN row; the sampled kernels mark a NaN tile mass.

// Bits of a float that is a NaN or an infinity (integer ops: no compiler may fold them).
__device__ __forceinline__ bool not_finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// x with an infinity made a NaN, finite values bit for bit (x * 0 + x: the product is an
// exact zero of x's sign; inf * 0 is NaN). One FFMA. A logit of -inf of a row in the
// sequence would otherwise look like a row past it (weight 0); a NaN one poisons the
// softmax state (l) or the tile statistics of its head.
__device__ __forceinline__ float inf_to_nan(float x) { return fmaf(x, 0.f, x); }

// max that keeps a NaN (fmaxf drops it: fmaxf(NaN, x) = x), for the merges of states whose
// max may be NaN. One instruction, as fmaxf (sm_80+).
__device__ __forceinline__ float nan_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The heads of the group whose query holds a NaN or an infinity (bit g), from the loaded
// queries qf (load_group_queries); their features are zeroed, so every logit stays finite
// for finite keys and head 0's partial dot products can probe the keys (key_probe). The
// caller marks those heads with poison_values. A vote over the warp: every lane of the warp
// calls it; the row groups of a warp each hold the whole query (D / 8 lanes of 8
// features), so the vote sees every feature.
template <int GMAX>
__device__ __forceinline__ unsigned query_faults(float (&qf)[GMAX][8], int G) {
  unsigned bad = 0;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < G) {
      bool mine = false;
#pragma unroll
      for (int e = 0; e < 8; ++e) mine |= not_finite(qf[g][e]);
      if (__any_sync(0xffffffffu, mine)) {
        bad |= 1u << g;
#pragma unroll
        for (int e = 0; e < 8; ++e) qf[g][e] = 0.f;
      }
    }
  }
  return bad;
}

// The accumulators of the heads of `bad` (query_faults) start NaN: NaN * c and NaN + w stay
// NaN, so the head's output row is NaN (0 * NaN too: a weight that underflows keeps it).
template <int GMAX, int W>
__device__ __forceinline__ void poison_values(float (&acc)[GMAX][W], int G, unsigned bad) {
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int e = 0; e < W; ++e)
      if (g < G && ((bad >> g) & 1u)) acc[g][e] = STOCHATTN_NAN;
}

// One FFMA per K row, into head 0's running sum l0 (l0 + x * 0 = l0 bit for bit): l0 turns
// NaN once a row's partial dot product of head 0 (x[p * GMAX], this thread's 8 features,
// before the row-group reduction) is not finite. With a finite query (query_faults zeroed
// the bad ones) that happens exactly when one of the key's 8 features is NaN or infinite,
// which a logit of -inf would otherwise hide (weight 0). Rows past the end are zero-filled.
// finish_group_state(..., probed = true) turns a NaN l[0] into NaN rows for every head.
template <int GMAX, int RPT>
__device__ __forceinline__ void key_probe(const float (&x)[RPT * GMAX], float& l0) {
#pragma unroll
  for (int p = 0; p < RPT; ++p) l0 = fmaf(x[p * GMAX], 0.f, l0);
}

// Partial dot products of this thread's 8 features with the G queries, for its RPT rows
// of a K stage (rows rg + p * RG): x[p * GMAX + g]; heads g >= G give 0. The row-group
// sums are then row_group_sums (all lanes) or Scatter (owner lanes).
template <typename T, int D, int GMAX, int RPT, int RG>
__device__ __forceinline__ void partial_dots_rows(const unsigned char* __restrict__ sk, int rg,
                                                  int lr, int G, const float (&qf)[GMAX][8],
                                                  float (&x)[RPT * GMAX]) {
#pragma unroll
  for (int p = 0; p < RPT; ++p) {
    const int r = rg + p * RG;
    float kf[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(sk + r * (D * 2) + lr * 16), kf);
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      float s = 0.f;
      if (g < G) {  // G is uniform over the CTA
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(qf[g][e], kf[e], s);
      }
      x[p * GMAX + g] = s;
    }
  }
}

// The same for the CTA-wide stage (Tiling<D>: rows rg + p * kRowGroups).
template <typename T, int D, int GMAX>
__device__ __forceinline__ void group_partial_dots(
    const unsigned char* __restrict__ sk, int rg, int lr, int G, const float (&qf)[GMAX][8],
    float (&x)[Tiling<D>::kRowsPerThread * GMAX]) {
  using Tl = Tiling<D>;
  partial_dots_rows<T, D, GMAX, Tl::kRowsPerThread, Tl::kRowGroups>(sk, rg, lr, G, qf, x);
}

// Sum over the kLanesPerRow lanes of a row group (butterfly: every lane gets the sum).
template <int LANES>
__device__ __forceinline__ float row_group_sum(float x) {
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

}  // namespace stochattn

namespace stochattn {

// Reduce-scatter of N partial sums over the LANES lanes of a row group (xor offsets
// LANES/2 ... 1). At each step a lane keeps the half of its remaining values selected by
// its offset bit and adds the partner's copy of that half: N/2 + N/4 + ... shuffles
// instead of N log2(LANES). Once one value is left the remaining steps all-reduce it.
// Afterwards a lane holds per = max(N / LANES, 1) sums v[0..per): value j (of the original
// N) sits on the lanes lr with lr / span == j / per (span = max(LANES / N, 1)), slot
// j % per. `Scatter<LANES, O, C>` handles offset O with C values remaining.
template <int O, int C>
struct Scatter {
  template <int N>
  static __device__ __forceinline__ void run(float (&v)[N], int lr) {
    if constexpr (O >= 1) {
      if constexpr (C > 1) {
        const bool up = (lr & O) != 0;
#pragma unroll
        for (int i = 0; i < C / 2; ++i) {
          const float send = up ? v[i] : v[i + C / 2];
          const float keep = up ? v[i + C / 2] : v[i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
        }
        Scatter<O / 2, C / 2>::run(v, lr);
      } else {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
        Scatter<O / 2, 1>::run(v, lr);
      }
    }
  }
};

template <int LANES, int N>
struct ScatterLayout {
  static_assert((N & (N - 1)) == 0 && N >= 1, "a power of two of values");
  static constexpr int kPer = N >= LANES ? N / LANES : 1;   // sums held per lane
  static constexpr int kSpan = N >= LANES ? 1 : LANES / N;  // lanes holding the same sums
  // Original index of slot i on lane lr.
  static __device__ __forceinline__ int index(int i, int lr) { return i + kPer * (lr / kSpan); }
};

// Row-group reduction of N partial dot products: x[j] becomes the row-group sum on every
// lane, by STOCHATTN_REDUCE's method.
template <int LANES, int N>
__device__ __forceinline__ void row_group_sums(float (&x)[N], int lr) {
  if constexpr (kReduce == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = row_group_sum<LANES>(x[j]);
  } else {
    using L = ScatterLayout<LANES, N>;
    float v[N];
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = x[j];
    Scatter<LANES / 2, N>::run(v, lr);
    // Broadcast: value j from the first lane of its owners, slot j % per (the same
    // register on every lane, so one shuffle per value).
#pragma unroll
    for (int j = 0; j < N; ++j)
      x[j] = __shfl_sync(0xffffffffu, v[j % L::kPer], (j / L::kPer) * L::kSpan, LANES);
  }
}

}  // namespace stochattn
