// The tile-local draws of S²ANTA-flash (santa_flash.cu, santa_flash_tc.cu): a tile's
// sample points and their rows through its fp32 CDF, bit for bit the reference's
// (stochattn/reference/santa.py, flash_estimate: samplers.sample_points with stream = tile,
// then samplers.invert_cdf). Host and device code without CUDA intrinsics, so that
// tests/test_cuda_sources.py checks it against the reference on a machine without a GPU.
#pragma once

#include "philox.cuh"

namespace stochattn {

// Row of a tile for the point T in [0, 1): the first row whose cumsum exceeds T * l_t
// (searchsorted side="right", compared in float64 like invert_cdf), with the target clipped
// to just below l_t = cr[tile_size - 1] so a target that rounding pushes to l_t selects the
// first row reaching l_t (the last row of positive fp32 weight), never a zero-weight row.
STOCHATTN_HD int flash_local_row(const float* cr, int tile_size, double point) {
  const double cl = (double)cr[tile_size - 1];
  const double target = fmin(fmax(point * cl, 0.0), nextafter(cl, 0.0));
  int lo = 0, hi = tile_size - 1;  // cr[hi] = cl > target: the answer lies in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if ((double)cr[mid] > target) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Point m of the systematic (one uniform, draw 0) or stratified (draw m) sampler of tile
// stream t with n points: samplers.sample_points(..., stream=t), bit for bit.
STOCHATTN_HD double flash_point(const RngStream& rs, int sampler, unsigned t, int m, int n, double u0) {
  const double u = sampler == SAMPLER_SYSTEMATIC ? u0 : (double)rs.uniform(t, (unsigned)m);
  return ((double)m + u) / (double)n;
}

}  // namespace stochattn
