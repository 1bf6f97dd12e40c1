// Fused CPU kernels for decode attention on compressed KV blocks (float32 math, no float K/V).
//
// TurboQuant codes are b-bit centroid indices packed LSB-first (kvpack.primitives.packing).
// A "unit" is the group of codes read with one table index: one byte (8/b codes) for b in
// {1, 2, 4}, and a pair of 3-bit codes (6 bits, may straddle a byte) for b = 3.
//
// lut_scores:      per block of <= W query rows, table[u][e][w] = sum_k q[w, u*cpu+k] * c[code_k(e)];
//                  then score[w, t] = norm[t] * sum_u table[u][idx_u(t)][w]  (W-lane vector adds).
// lut_weighted_sum: a unit -> centroid floats table (256 x 8/b floats, L1-resident) decodes four
//                  token rows into a scratch buffer that never leaves L1, then
//                  acc[r][:] += sum_i p[r, t_i] * norm[t_i] * row_i (one pass over acc per 4 tokens).
// int8_*:          int8 codes widened to float one token row at a time, the scale factored out.
//
// The Python launcher (kvpack/kernels/cpu_lut.py) validates shapes, dtypes and contiguity.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 256;                 // tokens per parallel work item

struct Layout {
  int bits, d, nbytes, cpu, mask, entries, units;
};

Layout make_layout(int bits, int d) {
  Layout L{};
  L.bits = bits;
  L.d = d;
  L.nbytes = (d * bits + 7) / 8;
  L.cpu = bits == 3 ? 2 : 8 / bits;
  L.mask = (1 << bits) - 1;
  L.entries = 1 << (L.cpu * bits);
  L.units = (d + L.cpu - 1) / L.cpu;
  return L;
}

// Table index of unit u of one packed row.
template <bool PAIR3>
inline int unit_index(const uint8_t* row, int u, int nbytes) {
  if (!PAIR3) return row[u];
  const int bit = 6 * u, byte = bit >> 3;
  int v = row[byte];
  if (byte + 1 < nbytes) v |= row[byte + 1] << 8;
  return (v >> (bit & 7)) & 63;
}

// tab[e*W + w] = sum_k q[w][coord0 + k] * c[code_k(e)] for one unit, built code by code:
// after k codes the first nc^k entries hold every prefix, and code k extends them by v * nc^k.
template <int W>
void build_unit_table(const float* q, int64_t q_stride, int rows, int coord0, const Layout& L, const float* cent, float* tab) {
  const int nc = 1 << L.bits;
  for (int w = 0; w < W; ++w) tab[w] = 0.f;
  int size = 1;
  for (int k = 0; k < L.cpu; ++k) {
    const int coord = coord0 + k;
    float qk[W];
    for (int w = 0; w < W; ++w) qk[w] = (w < rows && coord < L.d) ? q[w * q_stride + coord] : 0.f;
    for (int v = nc - 1; v >= 0; --v) {  // v = 0 last: it updates the prefixes in place
      float add[W];
      for (int w = 0; w < W; ++w) add[w] = qk[w] * cent[v];
      float* dst = tab + static_cast<int64_t>(v) * size * W;
      for (int e = 0; e < size; ++e)
        for (int w = 0; w < W; ++w) dst[e * W + w] = tab[e * W + w] + add[w];
    }
    size *= nc;
  }
}

template <int W>
struct VecT {
  typedef float type __attribute__((vector_size(sizeof(float) * W)));  // W lanes, one register
};

// Scores of one block of tokens for one row block: out[w][t] = norm[t] * sum_u tab[u][idx][w].
template <bool PAIR3, int W>
void score_tokens(const float* tables, const uint8_t* codes, const at::Half* norm, int64_t t0, int64_t t1, const Layout& L,
                  float* out, int64_t T, int rows) {
  using V = typename VecT<W>::type;
  constexpr int TT = 4;  // tokens in flight: independent add chains hide the add latency
  const int64_t unit_stride = static_cast<int64_t>(L.entries) * W;
  V buf[kBlock];
  int64_t t = t0;
  for (; t < t1; t += TT) {
    const int n = static_cast<int>(std::min<int64_t>(TT, t1 - t));
    const uint8_t* r[TT];
    for (int i = 0; i < TT; ++i) r[i] = codes + (t + std::min(i, n - 1)) * L.nbytes;  // short tail: repeat the last row
    V acc[TT] = {};
    for (int u = 0; u < L.units; ++u) {
      const float* tab = tables + u * unit_stride;
      for (int i = 0; i < TT; ++i) {
        V e;
        std::memcpy(&e, tab + unit_index<PAIR3>(r[i], u, L.nbytes) * W, sizeof(V));
        acc[i] += e;
      }
    }
    for (int i = 0; i < n; ++i) buf[t - t0 + i] = acc[i];
  }
  for (int w = 0; w < rows; ++w)
    for (int64_t i = t0; i < t1; ++i) out[w * T + i] = buf[i - t0][w] * static_cast<float>(norm[i]);
}

// Work items are (batch*head, row block of <= W rows, block of tokens). One parallel region:
// each thread builds a row block's table when its contiguous range of items first reaches it,
// so a table is built at most once per thread and no barrier separates building from scoring.
template <bool PAIR3, int W>
void lut_scores_impl(const float* q, const uint8_t* codes, const at::Half* norm, const float* cent, int64_t BH, int R, int64_t T,
                     const Layout& L, float* out) {
  const int64_t row_blocks = (R + W - 1) / W, nblocks = (T + kBlock - 1) / kBlock;
  const int64_t unit_stride = static_cast<int64_t>(L.entries) * W;
  at::parallel_for(0, BH * row_blocks * nblocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> table(L.units * unit_stride);
    int64_t built = -1;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t task = i / nblocks, bh = task / row_blocks;
      const int r0 = static_cast<int>(task % row_blocks) * W, rows = std::min(W, R - r0);
      if (task != built) {
        for (int u = 0; u < L.units; ++u)
          build_unit_table<W>(q + (bh * R + r0) * L.d, L.d, rows, u * L.cpu, L, cent, table.data() + u * unit_stride);
        built = task;
      }
      const int64_t t0 = (i % nblocks) * kBlock, t1 = std::min(T, t0 + kBlock);
      score_tokens<PAIR3, W>(table.data(), codes + bh * T * L.nbytes, norm + bh * T, t0, t1, L, out + (bh * R + r0) * T, T, rows);
    }
  });
}

// acc[r][:] += sum_t p[r][t] * norm[t] * row_t over tokens [t0, t1), where row_t is token t's
// centroid vector, decoded TT tokens at a time through the unit -> floats table `dec` (L1-sized).
template <int BITS>
void accumulate_tokens(const float* p, const uint8_t* codes, const at::Half* norm, int64_t t0, int64_t t1, const Layout& L,
                       int64_t T, int R, const float* dec, float* rows_buf, float* __restrict acc) {
  constexpr bool PAIR3 = BITS == 3;
  constexpr int CPU = PAIR3 ? 2 : 8 / BITS;
  constexpr int TT = 4;
  const int width = L.units * CPU;  // >= d: padded codes decode into ignored columns
  for (int64_t t = t0; t < t1; t += TT) {
    const int n = static_cast<int>(std::min<int64_t>(TT, t1 - t));
    float* rw[TT];
    for (int i = 0; i < TT; ++i) {
      rw[i] = rows_buf + i * width;
      if (i >= n) continue;
      const uint8_t* code_row = codes + (t + i) * L.nbytes;
      for (int u = 0; u < L.units; ++u)
        std::memcpy(rw[i] + u * CPU, dec + unit_index<PAIR3>(code_row, u, L.nbytes) * CPU, sizeof(float) * CPU);
    }
    for (int r = 0; r < R; ++r) {
      float w[TT] = {};
      for (int i = 0; i < n; ++i) w[i] = p[r * T + t + i] * static_cast<float>(norm[t + i]);
      float* __restrict a = acc + r * L.d;
      const float *r0 = rw[0], *r1 = rw[1], *r2 = rw[2], *r3 = rw[3];
      for (int j = 0; j < L.d; ++j) a[j] += w[0] * r0[j] + w[1] * r1[j] + w[2] * r2[j] + w[3] * r3[j];
    }
  }
}

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

template <int BITS>
void lut_weighted_sum_impl(const float* p, const uint8_t* codes, const at::Half* norm, const float* cent, int64_t BH, int R, int64_t T,
                           const Layout& L, float* out) {
  std::vector<float> dec(static_cast<int64_t>(L.entries) * L.cpu);
  for (int e = 0; e < L.entries; ++e)
    for (int k = 0; k < L.cpu; ++k) dec[e * L.cpu + k] = cent[(e >> (k * L.bits)) & L.mask];
  sliced_weighted_sum(BH, R, T, L.d, static_cast<int64_t>(L.units) * L.cpu, out, [&](int64_t bh, int64_t t0, int64_t t1, float* rows, float* acc) {
    accumulate_tokens<BITS>(p + bh * R * T, codes + bh * T * L.nbytes, norm + bh * T, t0, t1, L, T, R, dec.data(), rows, acc);
  });
}

// Row block width W (lanes of one table entry): the smallest of 1, 4, 8, 16 that holds R rows.
void lut_scores_dispatch(int bits, const float* q, const uint8_t* codes, const at::Half* norm, const float* cent, int64_t BH, int R,
                         int64_t T, const Layout& L, float* out) {
  auto run = R == 1 ? lut_scores_impl<false, 1> : R <= 4 ? lut_scores_impl<false, 4> : R <= 8 ? lut_scores_impl<false, 8> : lut_scores_impl<false, 16>;
  if (bits == 3) run = R == 1 ? lut_scores_impl<true, 1> : R <= 4 ? lut_scores_impl<true, 4> : R <= 8 ? lut_scores_impl<true, 8> : lut_scores_impl<true, 16>;
  run(q, codes, norm, cent, BH, R, T, L, out);
}

// -- int8 -------------------------------------------------------------------------------------

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

}  // namespace

// Entry points: shapes were checked by the launcher; tensors are contiguous.
torch::Tensor lut_scores(torch::Tensor q, torch::Tensor codes, torch::Tensor norm, torch::Tensor centroids, int64_t bits) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3), T = codes.size(2);
  auto out = torch::empty({B, H, R, T}, q.options());
  if (out.numel() == 0) return out;
  const Layout L = make_layout(static_cast<int>(bits), static_cast<int>(d));
  lut_scores_dispatch(static_cast<int>(bits), q.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                     norm.data_ptr<at::Half>(), centroids.data_ptr<float>(), B * H, static_cast<int>(R), T, L, out.data_ptr<float>());
  return out;
}

torch::Tensor lut_weighted_sum(torch::Tensor p, torch::Tensor codes, torch::Tensor norm, torch::Tensor centroids, int64_t bits, int64_t d) {
  const int64_t B = p.size(0), H = p.size(1), R = p.size(2), T = p.size(3);
  auto out = torch::zeros({B, H, R, d}, p.options());
  if (out.numel() == 0 || T == 0) return out;
  const Layout L = make_layout(static_cast<int>(bits), static_cast<int>(d));
  const auto run = bits == 1 ? lut_weighted_sum_impl<1> : bits == 2 ? lut_weighted_sum_impl<2> : bits == 3 ? lut_weighted_sum_impl<3> : lut_weighted_sum_impl<4>;
  run(p.data_ptr<float>(), codes.data_ptr<uint8_t>(),
      norm.data_ptr<at::Half>(), centroids.data_ptr<float>(), B * H, static_cast<int>(R), T, L, out.data_ptr<float>());
  return out;
}

torch::Tensor int8_scores(torch::Tensor q, torch::Tensor codes, torch::Tensor scale) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3), T = codes.size(2);
  auto out = torch::empty({B, H, R, T}, q.options());
  if (out.numel() == 0) return out;
  int8_scores_impl(q.data_ptr<float>(), codes.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), B * H, static_cast<int>(R), T,
                   static_cast<int>(d), out.data_ptr<float>());
  return out;
}

torch::Tensor int8_weighted_sum(torch::Tensor p, torch::Tensor codes, torch::Tensor scale) {
  const int64_t B = p.size(0), H = p.size(1), R = p.size(2), T = p.size(3), d = codes.size(3);
  auto out = torch::zeros({B, H, R, d}, p.options());
  if (out.numel() == 0 || T == 0) return out;
  int8_weighted_sum_impl(p.data_ptr<float>(), codes.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), B * H, static_cast<int>(R), T,
                         static_cast<int>(d), out.data_ptr<float>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lut_scores", &lut_scores, "TurboQuant scores from a per-unit lookup table of query x centroid partial sums");
  m.def("lut_weighted_sum", &lut_weighted_sum, "TurboQuant probability-weighted centroid sum, rotated space");
  m.def("int8_scores", &int8_scores, "q . int8 codes, per-token scale factored out");
  m.def("int8_weighted_sum", &int8_weighted_sum, "sum_t p * scale * int8 codes");
}
