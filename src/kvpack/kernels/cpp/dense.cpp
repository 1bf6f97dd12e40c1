// Dense rows: int8 codes with a per-token fp16 scale, or fp16 / fp32 rows (sinks, window), widened one token row at a
// time in L1.
#include "softmax.h"

namespace kvpack {
namespace {

void int8_scores_impl(const float* q, const int8_t* codes, const at::Half* scale, int64_t BH, int R, int64_t T, int d, float* out) {
  const int64_t nblocks = (T + kBlock - 1) / kBlock;
  at::parallel_for(0, BH * nblocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> rows(4 * d);
    const float* k[4] = {rows.data(), rows.data() + d, rows.data() + 2 * d, rows.data() + 3 * d};
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bh = i / nblocks, t0 = (i % nblocks) * kBlock, t1 = std::min(T, t0 + kBlock);
      for (int64_t t = t0; t < t1; t += 4) {
        const int n = static_cast<int>(std::min<int64_t>(4, t1 - t));
        for (int j = 0; j < n; ++j) widen(codes + (bh * T + t + j) * d, rows.data() + j * d, d);
        for (int r = 0; r < R; ++r) {
          float s[4];
          dot4(q + (bh * R + r) * d, k, d, s);
          for (int j = 0; j < n; ++j) out[(bh * R + r) * T + t + j] = s[j] * static_cast<float>(scale[bh * T + t + j]);
        }
      }
    }
  });
}

void int8_weighted_sum_impl(const float* p, const int8_t* codes, const at::Half* scale, int64_t BH, int R, int64_t T, int d, float* out) {
  sliced_weighted_sum(BH, R, T, d, d, out, [&](int64_t bh, int64_t t0, int64_t t1, float* rows, float* __restrict acc) {
    const float* pb = p + bh * R * T;
    const at::Half* sb = scale + bh * T;
    for (int64_t t = t0; t < t1; t += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, t1 - t));
      for (int i = 0; i < n; ++i) widen(codes + (bh * T + t + i) * d, rows + i * d, d);
      for (int r = 0; r < R; ++r) {
        float w[4] = {};
        for (int i = 0; i < n; ++i) w[i] = pb[r * T + t + i] * static_cast<float>(sb[t + i]);
        float* __restrict a = acc + r * d;
        const float *r0 = rows, *r1 = rows + d, *r2 = rows + 2 * d, *r3 = rows + 3 * d;
        for (int j = 0; j < d; ++j) a[j] += w[0] * r0[j] + w[1] * r1[j] + w[2] * r2[j] + w[3] * r3[j];
      }
    }
  });
}


template <typename KT, typename VT>
void dense_attention_impl(const float* q, const KT* k, int64_t k_bh, const at::Half* ks, int64_t ks_bh, const VT* v, int64_t v_bh,
                          const at::Half* vs, int64_t vs_bh, int64_t BH, int R, int64_t T, int d, int dv, float scale, const Skip& skip,
                          Partials& P) {
  auto kdec = [&](int64_t bh, int64_t t, float* dst) {
    widen_row(k + bh * k_bh + t * d, dst, d);
    return ks ? static_cast<float>(ks[bh * ks_bh + t]) : 1.f;
  };
  auto vdec = [&](int64_t bh, int64_t t, float* dst) {
    widen_row(v + bh * v_bh + t * dv, dst, dv);
    return vs ? static_cast<float>(vs[bh * vs_bh + t]) : 1.f;
  };
  rows_attention_impl(q, BH, R, T, d, dv, scale, skip, P, kdec, vdec, [](int64_t, int, int64_t, int64_t, float*) {});
}

at::Tensor int8_scores(at::Tensor q, at::Tensor codes, at::Tensor scale) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3), T = codes.size(2);
  auto out = at::empty({B, H, R, T}, q.options());
  if (out.numel() == 0) return out;
  int8_scores_impl(q.data_ptr<float>(), codes.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), B * H, static_cast<int>(R), T,
                   static_cast<int>(d), out.data_ptr<float>());
  return out;
}

at::Tensor int8_weighted_sum(at::Tensor p, at::Tensor codes, at::Tensor scale) {
  const int64_t B = p.size(0), H = p.size(1), R = p.size(2), T = p.size(3), d = codes.size(3);
  auto out = at::zeros({B, H, R, d}, p.options());
  if (out.numel() == 0 || T == 0) return out;
  int8_weighted_sum_impl(p.data_ptr<float>(), codes.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), B * H, static_cast<int>(R), T,
                         static_cast<int>(d), out.data_ptr<float>());
  return out;
}

template <typename KT, typename VT>
void dense_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& ks, const at::Tensor& v, const at::Tensor& vs,
                    double scale, const Skip& skip, Partials& P) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3), T = k.size(2), dv = v.size(3);
  dense_attention_impl<KT, VT>(q.data_ptr<float>(), k.data_ptr<KT>(), head_stride(k, "k"), ks.numel() ? ks.data_ptr<at::Half>() : nullptr,
                               ks.numel() ? head_stride(ks, "k_scale") : 0, v.data_ptr<VT>(), head_stride(v, "v"),
                               vs.numel() ? vs.data_ptr<at::Half>() : nullptr, vs.numel() ? head_stride(vs, "v_scale") : 0, B * H,
                               static_cast<int>(R), T, static_cast<int>(d), static_cast<int>(dv), static_cast<float>(scale), skip, P);
}

std::vector<at::Tensor> dense_attention(at::Tensor q, at::Tensor k, at::Tensor k_scale, at::Tensor v, at::Tensor v_scale,
                                           double scale, at::Tensor skip) {
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), T = k.size(2), dv = v.size(3);
  const Skip sk = make_skip(skip);
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  auto out = partial_outputs(q, dv);
  Partials P(B * H, R, dv, split_count(T));
  if (T > 0) {
    switch (k.scalar_type()) {
      case at::kChar: dense_dispatch<int8_t, int8_t>(q, k, k_scale, v, v_scale, scale, sk, P); break;
      case at::kHalf: dense_dispatch<at::Half, at::Half>(q, k, k_scale, v, v_scale, scale, sk, P); break;
      case at::kFloat: dense_dispatch<float, float>(q, k, k_scale, v, v_scale, scale, sk, P); break;
      default: TORCH_CHECK(false, "dense_attention takes int8, float16 or float32 K/V, got ", k.scalar_type());
    }
  }
  P.merge(out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>());
  return out;
}

// A decode step's last stage in one call: the partial over uncompressed rows k, v (B, H, T, d) fp16 / fp32 (the sinks,
// window and anchors), merged with the segments' partials (ms, ls, os) into the normalized output (B, H, R, dv) f32.
// The same two kernels as dense_attention then merge_partials, without the round trip into Python between them.
at::Tensor exact_merge(at::Tensor q, at::Tensor k, at::Tensor v, double scale, std::vector<at::Tensor> ms,
                          std::vector<at::Tensor> ls, std::vector<at::Tensor> os) {
  TORCH_CHECK(ms.size() == ls.size() && ms.size() == os.size(), "exact_merge needs one (m, l, o) per part");
  const auto none = at::empty({0}, q.options());
  auto exact = dense_attention(q, k, none, v, none, scale, at::empty({0}, q.options().dtype(at::kLong)));
  ms.insert(ms.begin(), exact[0]);
  ls.insert(ls.begin(), exact[1]);
  os.insert(os.begin(), exact[2]);
  return merge_partials(ms, ls, os);
}

// Online-softmax partial over a paged pool's int8 rows (PagedPool): q (B, H, R, d) f32, pool (blocks, H, bs, C) uint8,
// block_table (B, M) int64, start/end (B,) int64 each sequence's token range, offsets (k_scale, v_scale, k_codes,
// v_codes) bytes within a row (d int8 codes a side, fp16 scales). Rows widened in L1 (rows_attention_impl); tokens
// outside a sequence's range are never read and score -inf.
std::vector<at::Tensor> int8_paged_attention(at::Tensor q, at::Tensor pool, at::Tensor block_table, at::Tensor start,
                                                at::Tensor end, std::vector<int64_t> offsets, double scale) {
  q = q.contiguous();
  block_table = block_table.contiguous();
  start = start.contiguous();
  end = end.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3);
  const auto [pp, longest] = paged_view(pool, block_table, start, end, offsets, B, H, d, d);
  const int64_t* st = start.data_ptr<int64_t>();
  const int64_t* en = end.data_ptr<int64_t>();
  int64_t T = 0;
  for (int64_t b = 0; b < B; ++b) T = std::max(T, en[b]);
  auto out = partial_outputs(q, d);
  Partials P(B * H, R, d, split_count(T));
  if (longest > 0) {
    auto live = [&](int64_t b, int64_t t) { return t >= st[b] && t < en[b]; };
    auto dec = [&](int64_t code_at, int64_t scale_at) {
      return [&, code_at, scale_at](int64_t bh, int64_t t, float* dst) {
        const int64_t b = bh / H;
        if (!live(b, t)) {
          std::memset(dst, 0, sizeof(float) * d);
          return 0.f;
        }
        const uint8_t* row = pp.row(b, bh % H, t);
        widen(reinterpret_cast<const int8_t*>(row + code_at), dst, static_cast<int>(d));
        at::Half s;
        std::memcpy(&s, row + scale_at, sizeof(s));
        return static_cast<float>(s);
      };
    };
    auto hide = [&](int64_t bh, int rows, int64_t t0, int64_t n, float* s) {
      const int64_t b = bh / H;
      for (int64_t t = 0; t < n; ++t)
        if (!live(b, t0 + t))
          for (int r = 0; r < rows; ++r) s[r * n + t] = -INFINITY;
    };
    rows_attention_impl(q.data_ptr<float>(), B * H, static_cast<int>(R), T, static_cast<int>(d), static_cast<int>(d), static_cast<float>(scale),
                        Skip{}, P, dec(pp.k_code, pp.k_norm), dec(pp.v_code, pp.v_norm), hide);
  }
  P.merge(out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace kvpack

KVPACK_BIND(m) {
  using namespace kvpack;
  m.def("int8_scores", &int8_scores, "q . int8 codes, per-token scale factored out");
  m.def("int8_weighted_sum", &int8_weighted_sum, "sum_t p * scale * int8 codes");
  m.def("dense_attention", &dense_attention, "online-softmax partial (m, l, o) over int8 (scaled), fp16 or fp32 K/V");
  m.def("exact_merge", &exact_merge, "the partial over fp16 / fp32 rows merged with other parts' partials: normalized attention");
  m.def("int8_paged_attention", &int8_paged_attention, "online-softmax partial (m, l, o) over a paged pool's int8 rows, read through a block table");
}
