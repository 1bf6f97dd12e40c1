// k-means for VQ codebooks: nearest-codeword assignment and k-means++ seeding.
#include "softmax.h"

namespace kvpack {
namespace {

typedef int32_t i16v __attribute__((vector_size(64)));

// The nearest of Kp (a multiple of 16) transposed codewords ct (D, Kp) for P points x (P, D): 16 codewords per
// vector, each codeword load feeding P points; per-lane running minima, then the lowest index among the lanes' ties.
template <int P>
inline void nearest_points(const float* x, int64_t D, const float* ct, int64_t Kp, int64_t K, int64_t* index, float* dist) {
  const f16v inf = f16v{} + std::numeric_limits<float>::infinity();
  i16v lane;
  for (int l = 0; l < 16; ++l) lane[l] = l;
  f16v best[P];
  i16v arg[P];
  for (int p = 0; p < P; ++p) { best[p] = inf; arg[p] = lane; }
  for (int64_t kb = 0; kb < Kp; kb += 16) {
    f16v acc[P] = {};
    for (int64_t j = 0; j < D; ++j) {
      const f16v c = load16(ct + j * Kp + kb);
      for (int p = 0; p < P; ++p) {
        const f16v e = x[p * D + j] - c;
        acc[p] += e * e;
      }
    }
    const i16v at = lane + static_cast<int32_t>(kb);
    for (int p = 0; p < P; ++p) {
      const i16v better = acc[p] < best[p];  // strict: the earlier block keeps a tie
      best[p] = better ? acc[p] : best[p];
      arg[p] = better ? at : arg[p];
    }
  }
  for (int p = 0; p < P; ++p) {
    int l0 = 0;
    for (int l = 1; l < 16; ++l) l0 = (best[p][l] < best[p][l0] || (best[p][l] == best[p][l0] && arg[p][l] < arg[p][l0])) ? l : l0;
    index[p] = std::min<int64_t>(arg[p][l0], K - 1);  // an all-inf row (non-finite input) still names a real codeword
    dist[p] = best[p][l0];
  }
}

// Nearest codeword of every point, k-means' assignment step and VQ's encode: x (G, N, D), centroids (G, K, D) f32 ->
// index (G, N) i64 and squared distance (G, N) f32. Distances are summed as (x - c)^2 (no |x|^2 - 2x.c + |c|^2
// cancellation); ties go to the lowest index (torch.min's choice). torch's version materialized the (N, K) distance
// matrix in 16 MiB chunks and was most of Shard's prompt fit.
std::vector<at::Tensor> nearest_codeword(at::Tensor x, at::Tensor centroids) {
  x = x.contiguous();
  const int64_t G = x.size(0), N = x.size(1), D = x.size(2), K = centroids.size(1);
  TORCH_CHECK(centroids.size(0) == G && centroids.size(2) == D && K >= 1, "nearest_codeword: centroids must be (G, K>=1, D)");
  const int64_t Kp = (K + 15) / 16 * 16;
  auto ct = at::full({G, D, Kp}, std::numeric_limits<float>::infinity(), x.options());  // padding never wins
  ct.narrow(2, 0, K).copy_(centroids.transpose(1, 2));
  auto index = at::empty({G, N}, x.options().dtype(at::kLong));
  auto dist = at::empty({G, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* cs = ct.data_ptr<float>();
  int64_t* is = index.data_ptr<int64_t>();
  float* ds = dist.data_ptr<float>();
  constexpr int64_t kPoints = 4;
  at::parallel_for(0, G * ((N + kPoints - 1) / kPoints), 128, [&](int64_t lo, int64_t hi) {
    const int64_t tiles = (N + kPoints - 1) / kPoints;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t g = item / tiles, n = (item % tiles) * kPoints, row = g * N + n;
      const float* cg = cs + g * D * Kp;
      if (n + kPoints <= N) {
        nearest_points<kPoints>(xs + row * D, D, cg, Kp, K, is + row, ds + row);
      } else {
        for (int64_t r = row; r < g * N + N; ++r) nearest_points<1>(xs + r * D, D, cg, Kp, K, is + r, ds + r);
      }
    }
  });
  return {index, dist};
}

// k-means++ seeds as indices (primitives/kmeans.py d2_picks, with the same draws): x (G, N, D) f32, first (G,) i64,
// u (G, k - 1) f64 -> picks (G, k) i64. Per draw: the running cumulative D^2 weights in f64 (torch.cumsum's order),
// the first point whose cumulative weight exceeds u * total (searchsorted right=True), then the nearest-seed
// distances updated in f32 as (x - c)^2 summed in channel order. The draws are sequential; groups run in parallel.
// torch spent ~8 small ops per draw, 255 draws per codebook: the larger part of Shard's k-means.
at::Tensor d2_picks(at::Tensor x, at::Tensor first, at::Tensor u) {
  x = x.contiguous();
  first = first.contiguous();
  u = u.contiguous();
  const int64_t G = x.size(0), N = x.size(1), D = x.size(2), draws = u.size(1);
  TORCH_CHECK(first.numel() == G && u.size(0) == G && N >= 1, "d2_picks: first (G,), u (G, k - 1), N >= 1");
  auto picks = at::empty({G, draws + 1}, first.options());
  const float* xs = x.data_ptr<float>();
  const int64_t* fs = first.data_ptr<int64_t>();
  const double* us = u.data_ptr<double>();
  int64_t* ps = picks.data_ptr<int64_t>();
  at::parallel_for(0, G, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> nearest(N);
    std::vector<double> cdf(N);
    for (int64_t g = lo; g < hi; ++g) {
      const float* xg = xs + g * N * D;
      int64_t* out = ps + g * (draws + 1);
      auto update = [&](int64_t pick, bool init) {
        const float* c = xg + pick * D;
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0.f;
          for (int64_t j = 0; j < D; ++j) {
            const float e = xg[n * D + j] - c[j];
            acc += e * e;
          }
          nearest[n] = init ? acc : std::min(nearest[n], acc);
        }
      };
      out[0] = fs[g];
      update(out[0], true);
      for (int64_t i = 0; i < draws; ++i) {
        double run = 0.0;
        for (int64_t n = 0; n < N; ++n) cdf[n] = run += static_cast<double>(nearest[n]);
        const double total = cdf[N - 1], draw = us[g * draws + i];
        int64_t pick;
        if (total > 0) {
          pick = std::upper_bound(cdf.begin(), cdf.end(), draw * total) - cdf.begin();
        } else {  // every point is a seed already: uniform
          pick = static_cast<int64_t>(draw * static_cast<double>(N));
        }
        out[i + 1] = pick = std::min<int64_t>(pick, N - 1);
        update(pick, false);
      }
    }
  });
  return picks;
}

}  // namespace
}  // namespace kvpack

KVPACK_BIND(m) {
  using namespace kvpack;
  m.def("nearest_codeword", &nearest_codeword, "index and squared distance of each point's nearest codeword, (G, N, D) vs (G, K, D)");
  m.def("d2_picks", &d2_picks, "k-means++ seed indices from pre-drawn uniforms, (G, N, D) points");
}
