// Per-row helpers of the codecs' encode and decode steps: bucketize-and-pack, per-head products, Hadamard rows.
#include "softmax.h"

namespace kvpack {
namespace {

// The unnormalized Sylvester Walsh-Hadamard transform of y[0, D) in place (D a power of two; primitives/rotation.py's
// order): the butterflies of the encode and of the query and output maps.
inline void butterflies(float* __restrict y, int64_t D) {
  for (int64_t len = 1; len < D; len <<= 1) {
    for (int64_t i = 0; i < D; i += 2 * len) {
      for (int64_t j = i; j < i + len; ++j) {
        const float a = y[j], b = y[j + len];
        y[j] = a + b;
        y[j + len] = a - b;
      }
    }
  }
}

// codes[n] = LSB-first bit-packed bucket indices of y[n] (index = boundaries strictly below the value,
// torch.bucketize's right=False), one pass per row: the encode step after rotation, for any width 1-8.
at::Tensor quantize_pack(at::Tensor y, at::Tensor boundaries, int64_t bits) {
  y = y.contiguous();
  boundaries = boundaries.contiguous();
  TORCH_CHECK(bits >= 1 && bits <= 8 && boundaries.numel() == (1 << bits) - 1, "quantize_pack: 2**bits - 1 boundaries, bits in 1..8");
  const int64_t d = y.size(-1), N = y.numel() / std::max<int64_t>(d, 1), nbytes = (d * bits + 7) / 8;
  auto sizes = y.sizes().vec();
  sizes.back() = nbytes;
  auto out = at::zeros(sizes, y.options().dtype(at::kByte));
  const float* src = y.data_ptr<float>();
  const float* bnd = boundaries.data_ptr<float>();
  const int nb = static_cast<int>(boundaries.numel());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const float* row = src + n * d;
      uint8_t* o = dst + n * nbytes;
      uint32_t acc = 0;
      int filled = 0, pos = 0;
      for (int64_t j = 0; j < d; ++j) {
        int idx = 0;
        for (int k = 0; k < nb; ++k) idx += bnd[k] < row[j];  // sorted boundaries: a branch-free count
        acc |= static_cast<uint32_t>(idx) << filled;
        filled += static_cast<int>(bits);
        while (filled >= 8) {
          o[pos++] = static_cast<uint8_t>(acc & 0xFF);
          acc >>= 8;
          filled -= 8;
        }
      }
      if (filled > 0) o[pos] = static_cast<uint8_t>(acc & 0xFF);
    }
  });
  return out;
}

// TurboQuant's whole MSE encode, one pass per row: x (B, H, T, D) f32 (D a power of two), mean and inv_scale (H, D)
// f32 or empty, signs (H, D) f32 ±1, boundaries (2**bits - 1,) f32 sorted. For each row u = x' / ||x'|| with
// x' = (x - mean) ⊙ inv_scale (u = 0 when x' = 0), y = FWHT(signs ⊙ u) / sqrt(D), codes = boundaries strictly below
// each y_j, bit-packed LSB-first. With centroids (2**bits,) f32 (non-empty) the stored scalar is ||x'|| divided by the
// length of the row's centroids c[codes] (at least `floor`): the reconstruction as long as the input. Returns
// (norm (B, H, T, 1) f16, codes (B, H, T, D·bits/8) u8). The torch path
// takes about eight ops and as many float copies of the block per side and layer; a serving engine's write path
// runs it for every token of every prefill step.
std::vector<at::Tensor> tq_encode(at::Tensor x, at::Tensor mean, at::Tensor inv_scale, at::Tensor signs,
                                     at::Tensor boundaries, int64_t bits, at::Tensor centroids, double floor) {
  x = x.contiguous();
  signs = signs.contiguous();
  boundaries = boundaries.contiguous();
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(D >= 8 && (D & (D - 1)) == 0, "tq_encode: head_dim must be a power of two >= 8");
  TORCH_CHECK(bits >= 1 && bits <= 4 && boundaries.numel() == (1 << bits) - 1, "tq_encode: 2**bits - 1 boundaries, bits in 1..4");
  const bool centered = mean.numel() > 0, scaled = inv_scale.numel() > 0, matched = centroids.numel() > 0;
  TORCH_CHECK(!matched || centroids.numel() == (1 << bits), "tq_encode: 2**bits centroids");
  if (centered) mean = mean.contiguous();
  if (scaled) inv_scale = inv_scale.contiguous();
  TORCH_CHECK(signs.numel() == H * D && (!centered || mean.numel() == H * D) && (!scaled || inv_scale.numel() == H * D),
              "tq_encode: signs, mean and inv_scale must be (H, D)");
  const int64_t nbytes = D * bits / 8;
  auto norm = at::empty({B, H, T, 1}, x.options().dtype(at::kHalf));
  auto codes = at::empty({B, H, T, nbytes}, x.options().dtype(at::kByte));
  // Raw pointers hoisted out of the loops: data_ptr<T>() checks the dtype on every call.
  const float* xs = x.data_ptr<float>();
  const float* mp = centered ? mean.data_ptr<float>() : nullptr;
  const float* sp = scaled ? inv_scale.data_ptr<float>() : nullptr;
  const float* gp = signs.data_ptr<float>();
  const float* bnd = boundaries.data_ptr<float>();
  const float* cen = matched ? centroids.data_ptr<float>() : nullptr;
  const float floor_f = static_cast<float>(floor);
  const int nb = static_cast<int>(boundaries.numel());
  at::Half* np = norm.data_ptr<at::Half>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const float root = 1.f / std::sqrt(static_cast<float>(D));
  const float tiny = std::numeric_limits<float>::min();  // torch.finfo(float32).tiny, the reference's clamp
  // Rows run inline below the grain (a decode step's few tokens: no parallel region), split across threads above it.
  // Working rows are float and int32 arrays, never bytes: a uint8_t store may alias any object, which kept the
  // compiler from vectorizing every loop that wrote codes (500 ns a 64-channel row on one thread, 250 ns as written here).
  at::parallel_for(0, B * H * T, 64, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(D);
    std::vector<int32_t> level(D);
    float* __restrict y = buf.data();
    int32_t* __restrict idx = level.data();
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t h = (row / T) % H;
      const float* __restrict xr = xs + row * D;
      const float* __restrict mh = centered ? mp + h * D : nullptr;
      const float* __restrict sh = scaled ? sp + h * D : nullptr;
      const float* __restrict gh = gp + h * D;
      for (int64_t j = 0; j < D; ++j) y[j] = xr[j];
      if (centered)
        for (int64_t j = 0; j < D; ++j) y[j] -= mh[j];
      if (scaled)
        for (int64_t j = 0; j < D; ++j) y[j] *= sh[j];
      float part[8] = {};  // eight running sums (D is a multiple of 8): a vector's lanes, where one sum is a chain
      for (int64_t j = 0; j < D; j += 8)
        for (int l = 0; l < 8; ++l) part[l] += y[j + l] * y[j + l];
      float sq = 0.f;
      for (int l = 0; l < 8; ++l) sq += part[l];
      const float n = std::sqrt(sq);
      const float inv = 1.f / std::max(n, tiny);
      for (int64_t j = 0; j < D; ++j) y[j] = y[j] * inv * gh[j];
      butterflies(y, D);
      // Boundaries strictly below each coordinate, one boundary at a time over the row.
      for (int64_t j = 0; j < D; ++j) {
        y[j] *= root;
        idx[j] = 0;
      }
      for (int k = 0; k < nb; ++k) {
        const float b = bnd[k];
        for (int64_t j = 0; j < D; ++j) idx[j] += b < y[j] ? 1 : 0;
      }
      if (matched) {
        float cp8[8] = {};
        for (int64_t j = 0; j < D; j += 8)
          for (int l = 0; l < 8; ++l) cp8[l] += cen[idx[j + l]] * cen[idx[j + l]];
        float len = 0.f;
        for (int l = 0; l < 8; ++l) len += cp8[l];
        np[row] = static_cast<at::Half>(n / std::max(std::sqrt(len), floor_f));
      } else {
        np[row] = static_cast<at::Half>(n);
      }
      // Eight codes fill exactly `bits` bytes, LSB first.
      uint8_t* o = cp + row * nbytes;
      for (int64_t j = 0; j < D; j += 8) {
        uint64_t word = 0;
        for (int l = 0; l < 8; ++l) word |= static_cast<uint64_t>(idx[j + l]) << (bits * l);
        for (int64_t b = 0; b < bits; ++b) o[(j / 8) * bits + b] = static_cast<uint8_t>(word >> (8 * b));
      }
    }
  });
  return {norm, codes};
}

// out[b, h, r, :] = x[b, h, r, :] @ w[h] (+ s[b, h, r] * bias[h]): x (B, H, R, D), w (H, D, E) read through its
// strides (a transposed rotation is passed as a view), s (B, H, R, 1), bias (H, E), all f32 (s, bias empty for none).
// The decode step's small per-head products (the query's q.mu, dense rotations): a few rows, so they run on the
// calling thread. A torch matmul opens a parallel region per call, and on a loaded machine each one waited for a
// preempted thread.
at::Tensor head_matmul(at::Tensor x, at::Tensor w, at::Tensor s, at::Tensor bias) {
  x = x.contiguous();
  const int64_t B = x.size(0), H = x.size(1), R = x.size(2), D = x.size(3), E = w.size(2);
  TORCH_CHECK(w.size(0) == H && w.size(1) == D, "head_matmul: w must be (H, D, E) for x (B, H, R, D)");
  const int64_t sh = w.stride(0), sk = w.stride(1), se = w.stride(2);
  const bool affine = s.numel() > 0;
  if (affine) {
    s = s.contiguous();
    bias = bias.contiguous();
    TORCH_CHECK(s.numel() == B * H * R && bias.numel() == H * E, "head_matmul: s (B, H, R, 1) and bias (H, E)");
  }
  auto out = at::empty({B, H, R, E}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  // Raw pointers hoisted out of the loops: data_ptr<T>() checks the dtype on every call.
  const float* sp = affine ? s.data_ptr<float>() : nullptr;
  const float* bp = affine ? bias.data_ptr<float>() : nullptr;
  float* dst = out.data_ptr<float>();
  for (int64_t row = 0; row < B * H * R; ++row) {
    const int64_t h = (row / R) % H;
    const float* xr = xs + row * D;
    float* o = dst + row * E;
    for (int64_t e = 0; e < E; ++e) o[e] = affine ? sp[row] * bp[h * E + e] : 0.f;
    for (int64_t k = 0; k < D; ++k) {
      const float xk = xr[k];
      const float* wk = ws + h * sh + k * sk;
      for (int64_t e = 0; e < E; ++e) o[e] += xk * wk[e * se];
    }
  }
  return out;
}

// out[b, h, r, :] = FWHT(x[b, h, r, :] * pre[h]) * post[h] (+ s[b, h, r] * bias[h]), FWHT the orthonormal Sylvester
// Hadamard transform (D a power of two; primitives/rotation.py's order). x (B, H, R, D) f32; pre, post, bias (H, D) f32
// and s (B, H, R, 1) f32, each empty for none. The decode step's query and output maps of Hadamard-rotated codecs
// (channel scale and signs folded into pre / post): O(D log D) per row on the calling thread, no matrix held.
at::Tensor fwht_rows(at::Tensor x, at::Tensor pre, at::Tensor post, at::Tensor s, at::Tensor bias) {
  x = x.contiguous();
  const int64_t B = x.size(0), H = x.size(1), R = x.size(2), D = x.size(3);
  TORCH_CHECK(D > 0 && (D & (D - 1)) == 0, "fwht_rows: the last dim must be a power of two");
  const bool has_pre = pre.numel() > 0, has_post = post.numel() > 0, affine = s.numel() > 0;
  if (has_pre) pre = pre.contiguous();
  if (has_post) post = post.contiguous();
  if (affine) {
    s = s.contiguous();
    bias = bias.contiguous();
  }
  TORCH_CHECK((!has_pre || pre.numel() == H * D) && (!has_post || post.numel() == H * D), "fwht_rows: pre and post must be (H, D)");
  TORCH_CHECK(!affine || (s.numel() == B * H * R && bias.numel() == H * D), "fwht_rows: s (B, H, R, 1) and bias (H, D)");
  auto out = at::empty({B, H, R, D}, x.options());
  const float* xs = x.data_ptr<float>();
  // Raw pointers hoisted out of the loops: data_ptr<T>() checks the dtype on every call.
  const float* prep = has_pre ? pre.data_ptr<float>() : nullptr;
  const float* postp = has_post ? post.data_ptr<float>() : nullptr;
  const float* sp = affine ? s.data_ptr<float>() : nullptr;
  const float* bp = affine ? bias.data_ptr<float>() : nullptr;
  float* dst = out.data_ptr<float>();
  const float norm = 1.f / std::sqrt(static_cast<float>(D));
  for (int64_t row = 0; row < B * H * R; ++row) {
    const int64_t h = (row / R) % H;
    float* y = dst + row * D;
    const float* xr = xs + row * D;
    for (int64_t j = 0; j < D; ++j) y[j] = has_pre ? xr[j] * prep[h * D + j] : xr[j];
    butterflies(y, D);
    for (int64_t j = 0; j < D; ++j) {
      float v = y[j] * norm;
      if (has_post) v *= postp[h * D + j];
      if (affine) v += sp[row] * bp[h * D + j];
      y[j] = v;
    }
  }
  return out;
}

}  // namespace
}  // namespace kvpack

KVPACK_BIND(m) {
  using namespace kvpack;
  m.def("tq_encode", &tq_encode, "TurboQuant MSE encode (center, scale, norm, randomized Hadamard, bucketize, pack), one pass per row");
  m.def("quantize_pack", &quantize_pack, "bucketize against sorted boundaries and bit-pack LSB-first, one pass per row");
  m.def("head_matmul", &head_matmul, "x @ w[h] (+ s * bias[h]) per head, on the calling thread (a few decode rows)");
  m.def("fwht_rows", &fwht_rows, "FWHT(x * pre[h]) * post[h] (+ s * bias[h]) per row, on the calling thread (a few decode rows)");
}
