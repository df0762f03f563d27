// Counter-based random numbers and SANTA sample points, bit for bit as the NumPy reference
// (stochattn/reference/rng.py and samplers.py).
//
// Generator: Philox-4x32-10. Stream layout (rng.py is authoritative):
//     key     = (seed & 0xFFFFFFFF, seed >> 32)
//     counter = (draw, stream, (purpose << 28) | row, offset)
// Only the first output word x0 is used; the uniform on (0, 1) is
//     u = ((x0 >> 9) * 2 + 1) * 2^-24        (an odd multiple of 2^-24: exact in float)
//
// Everything here is __host__ __device__ and uses no CUDA intrinsic, so that a host-only
// build (tests/test_cuda_sources.py) can compare it with the reference without a GPU.
#pragma once

#ifndef STOCHATTN_HD
#define STOCHATTN_HD __host__ __device__ __forceinline__
#endif

namespace stochattn {

// Purposes (never renumber: rng.py's PURPOSE_* constants).
enum Purpose : unsigned {
  PURPOSE_VALUE_SAMPLER = 0u,
  PURPOSE_BERNOULLI = 1u,
  PURPOSE_KMEANS_INIT = 2u,
  PURPOSE_CLUSTER_SAMPLER = 3u,
};

// Sampler codes shared with the Python wrappers (stochattn/cuda/santa.py).
enum Sampler : int { SAMPLER_SYSTEMATIC = 0, SAMPLER_STRATIFIED = 1, SAMPLER_IID = 2 };

struct PhiloxCounter {
  unsigned c0, c1, c2, c3;
};

// Philox-4x32-10 block function (Salmon et al., SC'11; the cuRAND / Random123 constants).
STOCHATTN_HD PhiloxCounter philox4x32_10(PhiloxCounter c, unsigned k0, unsigned k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {  // key schedule: bump by the Weyl constants before every round but the first
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    // 32x32 -> 64-bit products (the device compiles these to IMAD.WIDE / IMAD.HI).
    const unsigned long long p0 = 0xD2511F53ull * (unsigned long long)c.c0;
    const unsigned long long p1 = 0xCD9E8D57ull * (unsigned long long)c.c2;
    const unsigned hi0 = (unsigned)(p0 >> 32), lo0 = (unsigned)p0;
    const unsigned hi1 = (unsigned)(p1 >> 32), lo1 = (unsigned)p1;
    PhiloxCounter n;
    n.c0 = hi1 ^ c.c1 ^ k0;
    n.c1 = lo1;
    n.c2 = hi0 ^ c.c3 ^ k1;
    n.c3 = lo0;
    c = n;
  }
  return c;
}

// Seeds and offsets read on the device (docs/rng.md): a kernel that draws takes the host
// values (seed, offset), the device pointers (seed_ptr, offset_ptr; null when unused) and
// these flags, and reads sequence b's words with stream_seed / stream_offset after its PDL
// entry (a previous launch may have just advanced the offset). A device word is one per
// call (shape ()) or one per sequence (shape (B,)), 32 or 64 bits wide; a 64-bit offset
// word uses its low 32 bits, a 32-bit seed word is zero-extended.
enum StreamFlags {
  STREAM_SEED_DEVICE = 1,
  STREAM_SEED_PER_SEQ = 2,
  STREAM_SEED_WIDE = 4,
  STREAM_OFFSET_DEVICE = 8,
  STREAM_OFFSET_PER_SEQ = 16,
  STREAM_OFFSET_WIDE = 32
};

STOCHATTN_HD unsigned long long stream_seed(unsigned long long seed, const void* seed_ptr,
                                                   unsigned flags, long long b) {
  if (!(flags & STREAM_SEED_DEVICE)) return seed;
  const long long i = (flags & STREAM_SEED_PER_SEQ) ? b : 0;
  return (flags & STREAM_SEED_WIDE) ? static_cast<const unsigned long long*>(seed_ptr)[i]
                                    : (unsigned long long)static_cast<const unsigned*>(seed_ptr)[i];
}

STOCHATTN_HD unsigned stream_offset(unsigned offset, const void* offset_ptr,
                                           unsigned flags, long long b) {
  if (!(flags & STREAM_OFFSET_DEVICE)) return offset;
  const long long i = (flags & STREAM_OFFSET_PER_SEQ) ? b : 0;
  return (flags & STREAM_OFFSET_WIDE)
             ? (unsigned)static_cast<const unsigned long long*>(offset_ptr)[i]
             : static_cast<const unsigned*>(offset_ptr)[i];
}

// One stream of the layout: a (seed, offset, purpose, row) tuple; draws are indexed by
// (stream, draw).
struct RngStream {
  unsigned key0, key1;  // seed low / high word
  unsigned word2;       // (purpose << 28) | row
  unsigned offset;

  STOCHATTN_HD static RngStream make(unsigned long long seed, unsigned offset, unsigned purpose,
                                     unsigned row) {
    RngStream s;
    s.key0 = (unsigned)(seed & 0xFFFFFFFFull);
    s.key1 = (unsigned)(seed >> 32);
    s.word2 = (purpose << 28) | (row & 0x0FFFFFFFu);
    s.offset = offset;
    return s;
  }

  // First Philox output word x0 for (stream, draw): rng.random_words.
  STOCHATTN_HD unsigned word(unsigned stream, unsigned draw) const {
    PhiloxCounter c;
    c.c0 = draw;
    c.c1 = stream;
    c.c2 = word2;
    c.c3 = offset;
    return philox4x32_10(c, key0, key1).c0;
  }

  // Uniform on (0, 1): rng.uniforms. ((x0 >> 9) * 2 + 1) < 2^24 is exact in float, and so
  // is the product by 2^-24, so float and double give the same value as the reference.
  STOCHATTN_HD float uniform(unsigned stream, unsigned draw) const {
    return (float)(((word(stream, draw) >> 9) * 2u + 1u)) * 5.9604644775390625e-08f;  // 2^-24
  }
};

// Point m of the systematic / stratified samplers (samplers.sample_points), float64 as the
// reference computes it: T_m = (m + u) / S, with u the one systematic uniform (draw 0) or
// the stratum's own uniform (draw m). Both the sum and the quotient are correctly rounded
// IEEE double operations on host and device, so the value is bit-identical.
STOCHATTN_HD double systematic_point(int m, double u, int S) {
  return ((double)m + u) / (double)S;
}

STOCHATTN_HD double stratified_point(const RngStream& rs, int m, int S, unsigned stream = 0u) {
  return ((double)m + (double)rs.uniform(stream, (unsigned)m)) / (double)S;
}

// Exponential spacing E_i = -log(u_i) of the iid sampler (draw i, i = 0..S). The iid points
// are T_m = (E_0 + ... + E_m) / (E_0 + ... + E_S) (Renyi's representation of sorted
// uniforms). Precision: float64 throughout (log, prefix sums, ratio). The device `log` is
// within 1 ulp and the kernels sum the spacings with a segmented scan instead of NumPy's
// sequential cumsum, so iid points can differ from the reference in the last bits (a
// relative 1e-15), which changes an index only when a point falls within that distance of
// a CDF boundary.
STOCHATTN_HD double iid_spacing(const RngStream& rs, int i, unsigned stream = 0u) {
  return -log((double)rs.uniform(stream, (unsigned)i));
}

// The S sample points of one row on Philox stream `stream` of its RngStream, in float64
// exactly as samplers.sample_points (the reference's uniforms(..., stream, m)); stream 0
// for the estimator's points, others for the error-targeted budgets' pilot sets.
struct Points {
  int sampler, S;
  unsigned stream = 0u;
  double u;           // systematic offset (draw 0 of the stream)
  RngStream rs;
  const double* iid;  // iid: the S sorted points (scratch)

  STOCHATTN_HD double operator()(int m) const {
    if (sampler == SAMPLER_SYSTEMATIC) return systematic_point(m, u, S);
    if (sampler == SAMPLER_STRATIFIED) return stratified_point(rs, m, S, stream);
    return iid[m];
  }

  // n(c) = #{m : T_m * Z < c}: the points of tiles before the prefix value c. Monotone in
  // c, so consecutive tiles get consecutive, disjoint index ranges.
  STOCHATTN_HD int count_below(double c, double Z) const {
    if (sampler == SAMPLER_IID) {
      int lo = 0, hi = S;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((*this)(mid) * Z < c) lo = mid + 1; else hi = mid;
      }
      return lo;
    }
    // Closed form, then fixed up against the float64 comparison itself.
    const double g = (double)S * (c / Z);
    double guess = sampler == SAMPLER_SYSTEMATIC ? ceil(g - u) : floor(g);
    guess = fmin(fmax(guess, 0.0), (double)S);
    int n = (int)guess;
    while (n > 0 && !((*this)(n - 1) * Z < c)) --n;
    while (n < S && (*this)(n) * Z < c) ++n;
    return n;
  }
};

}  // namespace stochattn
