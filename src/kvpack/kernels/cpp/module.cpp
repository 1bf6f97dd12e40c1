// The extension module: every family's KVPACK_BIND adds its functions here, plus the merge of parts' partials.
#include "softmax.h"

namespace kvpack {

std::vector<Binder>& binders() {
  static std::vector<Binder> all;  // filled by static initializers before the module's init runs
  return all;
}

namespace {

// Normalized attention (B, H, R, d) from per-part online-softmax partials m, l (B, H, R, 1), o (B, H, R, d):
// out = sum_i exp(m_i - M) o_i / sum_i exp(m_i - M) l_i, M = max_i m_i (parts with l = 0 contribute nothing).
torch::Tensor merge_partials(std::vector<torch::Tensor> ms, std::vector<torch::Tensor> ls, std::vector<torch::Tensor> os) {
  TORCH_CHECK(!ms.empty() && ms.size() == ls.size() && ms.size() == os.size(), "merge_partials needs one (m, l, o) per part");
  for (auto& t : ms) t = t.contiguous();
  for (auto& t : ls) t = t.contiguous();
  for (auto& t : os) t = t.contiguous();
  const int64_t rows = ms[0].numel(), d = os[0].size(-1);
  auto out = torch::zeros_like(os[0]);
  float* dst = out.data_ptr<float>();
  // Raw pointers taken once: data_ptr<T>() checks the dtype on every call.
  std::vector<const float*> mp, lp, op;
  for (size_t p = 0; p < ms.size(); ++p) {
    mp.push_back(ms[p].data_ptr<float>());
    lp.push_back(ls[p].data_ptr<float>());
    op.push_back(os[p].data_ptr<float>());
  }
  for (int64_t i = 0; i < rows; ++i) {
    float mx = -INFINITY;
    for (const float* m : mp) mx = std::max(mx, m[i]);
    float total = 0.f;
    for (size_t p = 0; p < ms.size(); ++p) {
      const float l = lp[p][i];
      if (l == 0.f) continue;
      const float w = std::exp(mp[p][i] - mx);
      total += w * l;
      const float* src = op[p] + i * d;
      for (int64_t j = 0; j < d; ++j) dst[i * d + j] += w * src[j];
    }
    const float inv = 1.f / std::max(total, 1e-30f);
    for (int64_t j = 0; j < d; ++j) dst[i * d + j] *= inv;
  }
  return out;
}

}  // namespace
}  // namespace kvpack

KVPACK_BIND(m) {
  using namespace kvpack;
  m.def("merge_partials", &merge_partials, "normalized attention from per-part (m, l, o) partials, merged by log-sum-exp");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  for (const auto bind : kvpack::binders()) bind(m);
}
