// The shared machinery of kvpack's CPU kernels: one online-softmax partial per segment, split over tokens.
//
// Every attention kernel of the extension returns a partial (m, l, o) per query row: m the max of its scaled scores,
// l = sum exp(s - m), o = sum exp(s - m) * v (unnormalized); kernels/reference.py states the contract. A kernel
// family is one .cpp file beside this header: it includes it, writes its decode loop (or hands `rows_attention_impl`
// a key and a value row decoder), and adds its entry points to the extension with KVPACK_BIND. Every .cpp file in
// this directory is compiled into the one extension (kvpack/kernels/cpu_lut.py); the Python launchers validate
// shapes, dtypes and contiguity before the C++ call.
#pragma once
// ATen's tensor and the few factory ops the kernels call, and the pybind11 casters for tensors: not
// <torch/extension.h>, whose whole C++ frontend took about two thirds of each file's compile time (36 s of headers per
// file against 12 s, on 2 cores a build of the nine files about two minutes shorter).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#if __has_include(<ATen/ops/empty.h>)
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#else  // a torch built without per-operator headers
#include <ATen/Functions.h>
#endif
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#include <cmath>

namespace kvpack {

// -- registration: each family adds its functions to the one Python module ----------------------------------------
using Binder = void (*)(pybind11::module_&);
std::vector<Binder>& binders();  // module.cpp
struct Bind {
  explicit Bind(Binder b) { binders().push_back(b); }
};

constexpr int64_t kBlock = 256;                 // tokens per parallel work item

// Token slices (about one per thread) accumulate privately; the slices are summed at the end.
template <typename F>
void sliced_weighted_sum(int64_t BH, int R, int64_t T, int d, int64_t row_floats, float* out, const F& accumulate) {
  const int64_t nblocks = (T + kBlock - 1) / kBlock;
  const int64_t slices = std::max<int64_t>(1, std::min<int64_t>(nblocks, at::get_num_threads()));
  const int64_t per = static_cast<int64_t>(R) * d;
  std::vector<float> acc(BH * slices * per, 0.f);
  at::parallel_for(0, BH * slices, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> rows_buf(4 * row_floats, 0.f);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bh = i / slices, s = i % slices;
      const int64_t t0 = std::min(T, nblocks * s / slices * kBlock), t1 = std::min(T, nblocks * (s + 1) / slices * kBlock);
      accumulate(bh, t0, t1, rows_buf.data(), acc.data() + i * per);
    }
  });
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t j = 0; j < per; ++j) {
      float s = 0.f;
      for (int64_t sl = 0; sl < slices; ++sl) s += acc[(bh * slices + sl) * per + j];
      out[bh * per + j] = s;
    }
}

// out[i] = <a, k_i> for four rows k_i: four independent FMA chains, one shared horizontal reduction.
inline void dot4(const float* a, const float* const k[4], int n, float out[4]) {
#ifdef __AVX512F__
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, a + i);
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, k[j] + i), acc[j]);
  }
  // Transpose-and-add: lanes of the 4 accumulators fold into one 4-float vector of their sums.
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  for (int j = 0; j < 4; ++j) {
    float lanes[16] = {};
    int i = 0;
    for (; i + 16 <= n; i += 16)
      for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * k[j][i + l];
    for (; i < n; ++i) lanes[i % 16] += a[i] * k[j][i];
    float s = 0.f;
    for (int l = 0; l < 16; ++l) s += lanes[l];
    out[j] = s;
  }
#endif
}

inline void widen(const int8_t* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// -- fused decode attention: one online-softmax partial per segment ---------------------------
//
// A segment's partial is (m, l, o) per query row: m the max of its scaled scores, l = sum exp(s - m),
// o = sum exp(s - m) * v (unnormalized). The token axis is split; each (head, split) work item
// scores its tokens into an L1/L2-sized buffer, exponentiates in place and accumulates values from
// the same tokens while they are still in cache, so K and V are each read once and never widened
// into a float tensor. Splits merge by log-sum-exp at the end. Tensors are (B, H, T, n) with rows
// contiguous and heads at a fixed stride (a view of a capacity buffer), read through `stride(1)`.

constexpr int64_t kSplit = 512;  // tokens per work item: scores of 16 rows stay in L1/L2

// Work items of a decode kernel, handed out one at a time from a shared counter. A parallel region
// costs a fork and a barrier: microseconds on a quiet machine, but up to a scheduler time slice when
// other processes share the cores, since the barrier waits for every thread and a preempted one holds
// its whole static share. A layer step opens one region per part (sinks, window, anchors, segments),
// so parts with little work run on the calling thread (no region at all), and larger ones let a
// running thread take the items a preempted thread has not started. Each item writes only its own
// partial, so results do not depend on which thread ran it.
constexpr int64_t kSerialWork = 8192;  // token x query-row pairs below which a part runs on the calling thread

template <typename F>
void for_items(int64_t n, int64_t work, const F& body) {
  if (n <= 0) return;
  std::atomic<int64_t> counter{0};
  auto next = [&]() -> int64_t {
    const int64_t i = counter.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || work < kSerialWork || at::in_parallel_region()) {
    body(next);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(next); });
}

struct Partials {
  int64_t BH, R, d, splits;
  std::vector<float> m, l, o;
  Partials(int64_t BH_, int64_t R_, int64_t d_, int64_t splits_)
      : BH(BH_), R(R_), d(d_), splits(splits_), m(BH_ * splits_ * R_), l(BH_ * splits_ * R_), o(BH_ * splits_ * R_ * d_, 0.f) {}
  // Merge the splits of every (bh, row) into out tensors m, l (B, H, R, 1) and o (B, H, R, d).
  void merge(float* om, float* ol, float* oo) const {
    for (int64_t bh = 0; bh < BH; ++bh)
      for (int64_t r = 0; r < R; ++r) {
        float mx = -INFINITY;
        for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, m[(bh * splits + s) * R + r]);
        if (mx == -INFINITY) mx = 0.f;
        float lsum = 0.f;
        float* dst = oo + (bh * R + r) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = 0.f;
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t i = (bh * splits + s) * R + r;
          if (l[i] == 0.f) continue;
          const float w = std::exp(m[i] - mx);
          lsum += l[i] * w;
          const float* src = o.data() + i * d;
          for (int64_t j = 0; j < d; ++j) dst[j] += w * src[j];
        }
        om[bh * R + r] = mx;
        ol[bh * R + r] = lsum;
      }
  }
};

#ifdef __AVX512F__
// exp(x) for x <= 0 (scores minus their max), 16 lanes: x = k ln2 + f with |f| <= ln2 / 2 (ln2 split in two so
// f is exact), a degree-6 Taylor polynomial for exp(f) (relative error < 1.3e-7 there), scaled by 2^k.
// Below -103 exp underflows float32 to 0, which masked (-inf) scores get exactly. std::exp per element
// (a libm call each) was ~12% of a Shard decode step.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.f), _CMP_GT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_maskz_scalef_ps(live, p, k);
}
#endif

// In place: s <- exp(s - max) per row over n tokens (row stride ld); returns (max, sum) per row.
inline void softmax_rows(float* s, int64_t ld, int R, int64_t n, float* m, float* l) {
  for (int r = 0; r < R; ++r) {
    float* row = s + r * ld;
    float mx = -INFINITY;
#ifdef __AVX512F__
    {
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
        vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, row + t));
      }
      mx = _mm512_reduce_max_ps(vmax);
      if (mx != -INFINITY) {
        const __m512 vm = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
          const __m512 e = _mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + t), vm)));
          _mm512_mask_storeu_ps(row + t, k, e);
          vsum = _mm512_add_ps(vsum, e);
        }
        m[r] = mx;
        l[r] = _mm512_reduce_add_ps(vsum);
        continue;
      }
    }
#else
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, row[t]);
#endif
    if (mx == -INFINITY) {  // every token masked: contributes nothing
      for (int64_t t = 0; t < n; ++t) row[t] = 0.f;
      m[r] = -INFINITY;
      l[r] = 0.f;
      continue;
    }
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      row[t] = std::exp(row[t] - mx);
      sum += row[t];
    }
    m[r] = mx;
    l[r] = sum;
  }
}

// Tokens a segment must not count in this call: offsets (ascending, shared by every batch row and head) of its
// anchors, whose exact copies another part holds (kvpack/cache/anchors.py). Their scores in the split's rows
// [t0, t0 + n) become -inf before the softmax, so they add nothing to m, l or o.
struct Skip {
  const int64_t* at = nullptr;
  int64_t count = 0;
  void apply(float* s, int64_t ld, int R, int64_t t0, int64_t n) const {
    for (const int64_t* t = std::lower_bound(at, at + count, t0); t != at + count && *t < t0 + n; ++t)
      for (int r = 0; r < R; ++r) s[r * ld + (*t - t0)] = -INFINITY;
  }
};

inline Skip make_skip(const at::Tensor& skip) {
  if (!skip.numel()) return {};
  TORCH_CHECK(skip.scalar_type() == at::kLong && skip.dim() == 1 && skip.is_contiguous(), "skip must be a contiguous 1-D int64 tensor");
  return {skip.data_ptr<int64_t>(), skip.numel()};
}

// Normalized attention (B, H, R, d) from per-part online-softmax partials m, l (B, H, R, 1), o (B, H, R, d):
// out = sum_i exp(m_i - M) o_i / sum_i exp(m_i - M) l_i, M = max_i m_i (parts with l = 0 contribute nothing).
inline at::Tensor merge_partials(std::vector<at::Tensor> ms, std::vector<at::Tensor> ls, std::vector<at::Tensor> os) {
  TORCH_CHECK(!ms.empty() && ms.size() == ls.size() && ms.size() == os.size(), "merge_partials needs one (m, l, o) per part");
  for (auto& t : ms) t = t.contiguous();
  for (auto& t : ls) t = t.contiguous();
  for (auto& t : os) t = t.contiguous();
  const int64_t rows = ms[0].numel(), d = os[0].size(-1);
  auto out = at::zeros_like(os[0]);
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

inline int64_t split_count(int64_t T) { return std::max<int64_t>(1, (T + kSplit - 1) / kSplit); }

inline std::vector<at::Tensor> partial_outputs(const at::Tensor& q, int64_t d) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2);
  auto opt = q.options();
  return {at::empty({B, H, R, 1}, opt), at::empty({B, H, R, 1}, opt), at::empty({B, H, R, d}, opt)};
}

// Dense rows (int8 with a per-token scale, fp16 or fp32 without) widened to float in L1, 4 tokens at a time.
inline void widen_row(const int8_t* src, float* dst, int n) { widen(src, dst, n); }
inline void widen_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void widen_row(const at::Half* src, float* dst, int n) {
  int i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Attention over rows widened to float in L1, 4 tokens at a time: `kdec(bh, t, dst)` writes key t's d floats and
// returns the factor its dot products take (a per-token scale or norm); `vdec` likewise for values (dv floats), the
// factor multiplying its probability. `adjust(bh, t0, n, s)` adds terms to the raw scores of a split's n tokens before
// they are scaled (a turning mean, a row offset), or does nothing.
template <typename KDec, typename VDec, typename Adjust>
void rows_attention_impl(const float* q, int64_t BH, int R, int64_t T, int d, int dv, float scale, const Skip& skip, Partials& P,
                         const KDec& kdec, const VDec& vdec, const Adjust& adjust) {
  const int64_t splits = P.splits;
  for_items(BH * splits, BH * T * R, [&](const auto& next) {
    std::vector<float> s(static_cast<int64_t>(R) * kSplit);
    std::vector<float> rows(4 * static_cast<int64_t>(std::max(d, dv)), 0.f);
    const float* kr[4] = {rows.data(), rows.data() + d, rows.data() + 2 * d, rows.data() + 3 * d};
    for (int64_t i; (i = next()) >= 0;) {
      const int64_t bh = i / splits, sp = i % splits;
      const int64_t t0 = sp * kSplit, t1 = std::min(T, t0 + kSplit), n = t1 - t0;
      for (int64_t t = 0; t < n; t += 4) {
        const int c = static_cast<int>(std::min<int64_t>(4, n - t));
        float f[4];
        for (int j = 0; j < c; ++j) f[j] = kdec(bh, t0 + t + j, rows.data() + j * d);
        for (int r = 0; r < R; ++r) {
          float dots[4];
          dot4(q + (bh * R + r) * d, kr, d, dots);
          for (int j = 0; j < c; ++j) s[r * n + t + j] = dots[j] * f[j];
        }
      }
      adjust(bh, R, t0, n, s.data());
      for (int64_t j = 0; j < R * n; ++j) s[j] *= scale;
      skip.apply(s.data(), n, R, t0, n);
      float* pm = P.m.data() + i * R;
      float* pl = P.l.data() + i * R;
      softmax_rows(s.data(), n, R, n, pm, pl);
      float* acc = P.o.data() + i * R * dv;
      for (int64_t t = 0; t < n; t += 4) {
        const int c = static_cast<int>(std::min<int64_t>(4, n - t));
        float f[4] = {};
        for (int j = 0; j < c; ++j) f[j] = vdec(bh, t0 + t + j, rows.data() + j * dv);
        for (int j = c; j < 4; ++j) std::memset(rows.data() + j * dv, 0, sizeof(float) * dv);
        for (int r = 0; r < R; ++r) {
          float w[4] = {};
          for (int j = 0; j < c; ++j) w[j] = s[r * n + t + j] * f[j];
          float* __restrict a = acc + r * dv;
          const float *r0 = rows.data(), *r1 = r0 + dv, *r2 = r1 + dv, *r3 = r2 + dv;
          for (int jj = 0; jj < dv; ++jj) a[jj] += w[0] * r0[jj] + w[1] * r1[jj] + w[2] * r2[jj] + w[3] * r3[jj];
        }
      }
    }
  });
}

// A serving engine's paged pool: (blocks, H, bs, C) uint8, one row of C bytes per (token, head), written once, holding
// both sides' fp16 scales or norms and codes at fixed byte offsets (kvpack/serve/paged_pool.py). Sequence b's token t
// lies in block table[b][t / bs] at slot t % bs, so within a block a head's rows sit C bytes apart: kernels read them
// there, with no gather into a temporary.
struct PagedPool {
  const uint8_t* pool;
  int64_t H, bs, C;
  const int64_t* table;  // (B, table_stride) block ids
  int64_t table_stride;
  int64_t k_norm, v_norm, k_code, v_code;  // byte offsets within a row
  const uint8_t* row(int64_t b, int64_t h, int64_t t) const {
    return pool + ((table[b * table_stride + t / bs] * H + h) * bs + t % bs) * C;
  }
};

// The pool's view for sequences reading tokens [start[b], end[b]): checks the layout, each side's fields within a row
// of C bytes (`widths`: the key's and the value's code bytes), and every block id inside a range against the pool (an
// id outside it would read foreign memory). Returns the view and the longest range.
inline std::pair<PagedPool, int64_t> paged_view(const at::Tensor& pool, const at::Tensor& block_table, const at::Tensor& start,
                                                const at::Tensor& end, const std::vector<int64_t>& offsets, int64_t B, int64_t H,
                                                int64_t k_width, int64_t v_width) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.scalar_type() == at::kByte, "pool must be a contiguous (blocks, H, bs, C) uint8 tensor");
  TORCH_CHECK(pool.size(1) == H, "the pool's heads (", pool.size(1), ") must match the query's kv heads (", H, ")");
  const int64_t C = pool.size(3), bs = pool.size(2), blocks = pool.size(0);
  TORCH_CHECK(C % 2 == 0, "pool rows must hold an even number of bytes (their fp16 scales are read in place)");
  TORCH_CHECK(offsets.size() == 4, "offsets are (k_norm, v_norm, k_code, v_code)");
  TORCH_CHECK(offsets[0] % 2 == 0 && offsets[1] % 2 == 0 && offsets[0] >= 0 && offsets[1] >= 0 && offsets[0] + 2 <= C && offsets[1] + 2 <= C,
              "the fp16 scales or norms must lie at even byte offsets within a row");
  TORCH_CHECK(offsets[2] >= 0 && offsets[3] >= 0 && offsets[2] + k_width <= C && offsets[3] + v_width <= C, "the codes must lie within a row of ", C, " bytes");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.size(0) == B && block_table.is_contiguous() &&
                  start.numel() == B && end.numel() == B && start.scalar_type() == at::kLong && end.scalar_type() == at::kLong,
              "block_table (B, M) int64 and start, end (B,) int64 must match the query's batch");
  const int64_t* ids = block_table.data_ptr<int64_t>();
  const int64_t* st = start.data_ptr<int64_t>();
  const int64_t* en = end.data_ptr<int64_t>();
  const int64_t M = block_table.size(1);
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (en[b] <= st[b]) continue;
    TORCH_CHECK(st[b] >= 0 && (en[b] - 1) / bs < M, "sequence ", b, " reads tokens [", st[b], ", ", en[b], ") past its block table's ", M, " blocks");
    for (int64_t j = st[b] / bs; j <= (en[b] - 1) / bs; ++j)
      TORCH_CHECK(ids[b * M + j] >= 0 && ids[b * M + j] < blocks, "sequence ", b, " block ", j, " is ", ids[b * M + j], ", outside the pool's ", blocks, " blocks");
    longest = std::max(longest, en[b] - st[b]);
  }
  return {PagedPool{pool.data_ptr<uint8_t>(), H, bs, C, ids, M, offsets[0], offsets[1], offsets[2], offsets[3]}, longest};
}

// f(t, run, k_codes, k_norm, v_codes, v_norm) for each run of tokens [t, t + run) of [t0, t1) that one block holds.
template <typename F>
inline void paged_runs(const PagedPool& pp, int64_t b, int64_t h, int64_t t0, int64_t t1, const F& f) {
  for (int64_t t = t0; t < t1;) {
    const int64_t run = std::min({pp.bs - t % pp.bs, t1 - t, kBlock});
    const uint8_t* row = pp.row(b, h, t);
    f(t, run, row + pp.k_code, reinterpret_cast<const at::Half*>(row + pp.k_norm), row + pp.v_code,
      reinterpret_cast<const at::Half*>(row + pp.v_norm));
    t += run;
  }
}

// Head stride of a (B, H, T, n) view whose rows are contiguous and whose heads sit at one stride
// (so batch stride = H * head stride): a capacity buffer narrowed along tokens.
inline int64_t head_stride(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D");
  TORCH_CHECK(t.stride(3) == 1 && (t.size(2) <= 1 || t.stride(2) == t.size(3)), name, ": token rows must be contiguous");
  TORCH_CHECK(t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1), name, ": batch stride must be heads x head stride");
  return t.stride(1);
}

// 16-float GCC vector type: one zmm, or two ymm on AVX2 (the PCA rebuild and the nearest-codeword search).
typedef float f16v __attribute__((vector_size(64)));

inline f16v load16(const float* p) { f16v v; std::memcpy(&v, p, sizeof(v)); return v; }

}  // namespace kvpack

// In a family's .cpp, at file scope: KVPACK_BIND(m) { m.def("name", &fn, "doc"); }
#define KVPACK_CAT2(a, b) a##b
#define KVPACK_CAT(a, b) KVPACK_CAT2(a, b)
#define KVPACK_BIND(m)                                                                                    \
  static void KVPACK_CAT(kvpack_bind_, __LINE__)(pybind11::module_&);                                     \
  static const ::kvpack::Bind KVPACK_CAT(kvpack_bound_, __LINE__)(KVPACK_CAT(kvpack_bind_, __LINE__));    \
  static void KVPACK_CAT(kvpack_bind_, __LINE__)(pybind11::module_ & m)
