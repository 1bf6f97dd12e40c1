// The extension module: every family's KVPACK_BIND adds its functions here, plus the merge of parts' partials.
#include "softmax.h"

namespace kvpack {

std::vector<Binder>& binders() {
  static std::vector<Binder> all;  // filled by static initializers before the module's init runs
  return all;
}

}  // namespace kvpack

KVPACK_BIND(m) {
  using namespace kvpack;
  m.def("merge_partials", &merge_partials, "normalized attention from per-part (m, l, o) partials, merged by log-sum-exp");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  for (const auto bind : kvpack::binders()) bind(m);
}
