// Per-row helpers of the codecs' encode and decode steps: bucketize-and-pack, per-head products, Hadamard rows.
#include "softmax.h"

namespace kvpack {
namespace {

// codes[n] = LSB-first bit-packed bucket indices of y[n] (index = boundaries strictly below the value,
// torch.bucketize's right=False), one pass per row: the encode step after rotation, for any width 1-8.
torch::Tensor quantize_pack(torch::Tensor y, torch::Tensor boundaries, int64_t bits) {
  y = y.contiguous();
  boundaries = boundaries.contiguous();
  TORCH_CHECK(bits >= 1 && bits <= 8 && boundaries.numel() == (1 << bits) - 1, "quantize_pack: 2**bits - 1 boundaries, bits in 1..8");
  const int64_t d = y.size(-1), N = y.numel() / std::max<int64_t>(d, 1), nbytes = (d * bits + 7) / 8;
  auto sizes = y.sizes().vec();
  sizes.back() = nbytes;
  auto out = torch::zeros(sizes, y.options().dtype(torch::kUInt8));
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

// out[b, h, r, :] = x[b, h, r, :] @ w[h] (+ s[b, h, r] * bias[h]): x (B, H, R, D), w (H, D, E) read through its
// strides (a transposed rotation is passed as a view), s (B, H, R, 1), bias (H, E), all f32 (s, bias empty for none).
// The decode step's small per-head products (the query's q.mu, dense rotations): a few rows, so they run on the
// calling thread. A torch matmul opens a parallel region per call, and on a loaded machine each one waited for a
// preempted thread.
torch::Tensor head_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor bias) {
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
  auto out = torch::empty({B, H, R, E}, x.options());
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
torch::Tensor fwht_rows(torch::Tensor x, torch::Tensor pre, torch::Tensor post, torch::Tensor s, torch::Tensor bias) {
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
  auto out = torch::empty({B, H, R, D}, x.options());
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
    for (int64_t len = 1; len < D; len <<= 1) {
      for (int64_t i = 0; i < D; i += 2 * len) {
        for (int64_t j = i; j < i + len; ++j) {
          const float a = y[j], b = y[j + len];
          y[j] = a + b;
          y[j + len] = a - b;
        }
      }
    }
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
  m.def("quantize_pack", &quantize_pack, "bucketize against sorted boundaries and bit-pack LSB-first, one pass per row");
  m.def("head_matmul", &head_matmul, "x @ w[h] (+ s * bias[h]) per head, on the calling thread (a few decode rows)");
  m.def("fwht_rows", &fwht_rows, "FWHT(x * pre[h]) * post[h] (+ s * bias[h]) per row, on the calling thread (a few decode rows)");
}
