// Pieces shared by the decode kernels: element types, 16-byte vector conversions,
// cp.async (sm_80+) helpers and the tiling constants of one KV stream.
//
// Layout (docs): q (B, Hq, D); k, v (B, Hkv, N, D) contiguous; query head h reads KV head
// h / G. Offsets into k and v are 64-bit (contexts up to 1M tokens and beyond).
#pragma once

// No CUDA headers are included: the sources compile with a bare NVRTC (the
// nvidia-cuda-nvrtc wheel ships no cuda_fp16.h), and the element types are plain 16-bit
// storage types converted with PTX cvt instructions.

#define STOCHATTN_NEG_INF (__int_as_float(0xff800000))

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
// A CTA has kThreads threads. Each thread owns 8 consecutive features (16 bytes) of a
// row: D/8 lanes per row ("a row group"), kThreads / (D/8) row groups per CTA. A pipeline
// stage holds kStageBytes of K (and as much of V for exact decode): kStageBytes / (2 D)
// rows, i.e. 16 rows at D = 128 and 32 at D = 64, two rows per thread.
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kStageBytes = 4096;
constexpr int kStages = 4;

template <int D>
struct Tiling {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static constexpr int kLanesPerRow = D / 8;                        // 8 or 16
  static constexpr int kRowGroups = kThreads / kLanesPerRow;         // 16 or 8
  static constexpr int kTileRows = kStageBytes / (D * 2);            // 32 or 16
  static constexpr int kRowsPerThread = kTileRows / kRowGroups;      // 2
  static constexpr int kChunksPerTile = kStageBytes / 16;            // 256 16-byte pieces
  static constexpr int kChunksPerThread = kChunksPerTile / kThreads; // 2
  static constexpr int kGroupsPerWarp = 32 / kLanesPerRow;           // 2 or 4
  static_assert(kRowsPerThread * kRowGroups == kTileRows, "tile rows");
  static_assert(kChunksPerThread * kThreads == kChunksPerTile, "tile chunks");
};

// Issue the cp.async copies of rows [row0, row0 + kTileRows) of one (b, kv head) stream
// into a stage buffer; rows at or past `end` are zero-filled.
template <int D>
__device__ __forceinline__ void load_tile_async(unsigned char* stage, const unsigned char* base,
                                                long long row0, long long end) {
  using Tl = Tiling<D>;
  constexpr int kRowBytes = D * 2;
#pragma unroll
  for (int i = 0; i < Tl::kChunksPerThread; ++i) {
    const int piece = threadIdx.x + i * kThreads;  // consecutive threads: consecutive bytes
    const int r = piece / (kRowBytes / 16);
    const int c = piece % (kRowBytes / 16);
    const long long row = row0 + r;
    const bool valid = row < end;
    // A zero-filled copy still needs a legal address: point it at the stream's first row.
    const unsigned char* src = base + (valid ? row * kRowBytes + c * 16 : 0);
    cp_async16(stage + piece * 16, src, valid);
  }
}

// Sum over the kLanesPerRow lanes of a row group (butterfly: every lane gets the sum).
template <int LANES>
__device__ __forceinline__ float row_group_sum(float x) {
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

}  // namespace stochattn
