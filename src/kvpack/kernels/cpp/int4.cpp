// Per-token int4: 4-bit asymmetric codes, two per byte (channel 2j in the low nibble), with an fp16 scale and zero per
// (token, head): x = code * scale + zero. Rows are decoded into L1 four tokens at a time by the shared
// `rows_attention_impl` (softmax.h); the decoded rows never leave the work item's buffer.
#include "softmax.h"

namespace kvpack {
namespace {

// dst[0, n) = code * scale + zero for one packed row of n (even) channels.
inline void int4_row(const uint8_t* row, float scale, float zero, float* dst, int n) {
  for (int j = 0; j < n / 2; ++j) {
    dst[2 * j] = static_cast<float>(row[j] & 15) * scale + zero;
    dst[2 * j + 1] = static_cast<float>(row[j] >> 4) * scale + zero;
  }
}

// q (B, H, R, d) f32; k_codes (B, H, T, d/2) u8 with k_scale, k_zero (B, H, T, 1) f16; v likewise (dv = 2 * its row
// bytes); skip (S,) i64 ascending token offsets to leave out, or empty. -> m, l (B, H, R, 1), o (B, H, R, dv) f32.
std::vector<at::Tensor> int4_attention(at::Tensor q, at::Tensor k_codes, at::Tensor k_scale, at::Tensor k_zero,
                                          at::Tensor v_codes, at::Tensor v_scale, at::Tensor v_zero, double scale,
                                          at::Tensor skip) {
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3), T = k_codes.size(2), dv = 2 * v_codes.size(3);
  TORCH_CHECK(k_codes.size(3) * 2 == d, "k_codes must hold d / 2 bytes per row");
  auto out = partial_outputs(q, dv);
  Partials P(B * H, R, dv, split_count(T));
  if (T > 0) {
    const uint8_t *kc = k_codes.data_ptr<uint8_t>(), *vc = v_codes.data_ptr<uint8_t>();
    const at::Half *ks = k_scale.data_ptr<at::Half>(), *kz = k_zero.data_ptr<at::Half>();
    const at::Half *vs = v_scale.data_ptr<at::Half>(), *vz = v_zero.data_ptr<at::Half>();
    const int64_t kc_bh = head_stride(k_codes, "k_codes"), vc_bh = head_stride(v_codes, "v_codes");
    const int64_t ks_bh = head_stride(k_scale, "k_scale"), kz_bh = head_stride(k_zero, "k_zero");
    const int64_t vs_bh = head_stride(v_scale, "v_scale"), vz_bh = head_stride(v_zero, "v_zero");
    auto kdec = [&](int64_t bh, int64_t t, float* dst) {
      int4_row(kc + bh * kc_bh + t * (d / 2), static_cast<float>(ks[bh * ks_bh + t]), static_cast<float>(kz[bh * kz_bh + t]), dst,
               static_cast<int>(d));
      return 1.f;
    };
    auto vdec = [&](int64_t bh, int64_t t, float* dst) {
      int4_row(vc + bh * vc_bh + t * (dv / 2), static_cast<float>(vs[bh * vs_bh + t]), static_cast<float>(vz[bh * vz_bh + t]), dst,
               static_cast<int>(dv));
      return 1.f;
    };
    rows_attention_impl(q.data_ptr<float>(), B * H, static_cast<int>(R), T, static_cast<int>(d), static_cast<int>(dv),
                        static_cast<float>(scale), make_skip(skip), P, kdec, vdec, [](int64_t, int, int64_t, int64_t, float*) {});
  }
  P.merge(out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace kvpack

KVPACK_BIND(m) {
  m.def("int4_attention", &kvpack::int4_attention, "online-softmax partial (m, l, o) over per-token int4 K/V (fp16 scale and zero)");
}
