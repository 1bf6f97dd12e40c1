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
    int u = 0;
    if (PAIR3) {
      // Eight 3-bit codes fill 3 bytes exactly: four 6-bit table indices from one 24-bit word, with
      // no per-unit straddle test (the tail of a row whose units are not a multiple of 4 goes below).
      for (; u + 4 <= L.units; u += 4) {
        const int byte = 3 * (u / 4);
        for (int i = 0; i < TT; ++i) {
          const uint32_t word = r[i][byte] | (r[i][byte + 1] << 8) | (r[i][byte + 2] << 16);
          for (int k = 0; k < 4; ++k) {
            V e;
            std::memcpy(&e, tables + (u + k) * unit_stride + ((word >> (6 * k)) & 63) * W, sizeof(V));
            acc[i] += e;
          }
        }
      }
    }
    for (; u < L.units; ++u) {
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

Skip make_skip(const torch::Tensor& skip) {
  if (!skip.numel()) return {};
  TORCH_CHECK(skip.scalar_type() == at::kLong && skip.dim() == 1 && skip.is_contiguous(), "skip must be a contiguous 1-D int64 tensor");
  return {skip.data_ptr<int64_t>(), skip.numel()};
}

int64_t split_count(int64_t T) { return std::max<int64_t>(1, (T + kSplit - 1) / kSplit); }

std::vector<torch::Tensor> partial_outputs(const torch::Tensor& q, int64_t d) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2);
  auto opt = q.options();
  return {torch::empty({B, H, R, 1}, opt), torch::empty({B, H, R, 1}, opt), torch::empty({B, H, R, d}, opt)};
}

// Keys centered on a turning mean (TurboQuant's `rope_center`): key t's center holds, besides the constant mean folded
// into row_offset, `RoPE(μ, p_t)` on M RoPE pairs per head, so its raw score gains
//   Σ_m A_m cos(θ_m p_t) + B_m sin(θ_m p_t),   A_m = s(q_a μ_a + q_b μ_b),  B_m = s(q_b μ_a - q_a μ_b)
// from the RoPE'd query q's pair (a, b) = (i_m, i_m + d/2), the pair's un-RoPEd mean (μ_a, μ_b), RoPE's attention
// scaling s (folded into μ by the caller) and frequency θ_m. Tokens go 64 at a time: each pair's phase at a tile's first
// token (from the split's start in double, advanced by e^{64iθ} per tile) turns A, B into the tile's coefficients of
// cos(jθ), sin(jθ) for j < 64 (a per-pair table), so the inner loop runs over 64 tokens and vectorizes; no
// transcendental per token.
struct Turning {
  const float* q = nullptr;       // (BH, R, d) the query as the model formed it (not rotated or scaled)
  const int64_t* pair = nullptr;  // (H, M) RoPE pair index i_m (< d/2); padding repeats a pair whose μ is 0
  const float* mu = nullptr;      // (H, M, 2) s·(μ_a, μ_b)
  const double* freq = nullptr;   // (d/2,) θ of every pair (the layer's inv_freq)
  const float* w = nullptr;       // (d/2, 2, 64) cos(jθ), sin(jθ) of every pair: one table per model, shared
  const int64_t* pos0 = nullptr;  // (B,) RoPE position of the segment's token 0
  int64_t H = 1;
  int M = 0;
  int d = 0;
};
constexpr int kTurnTile = 64;

void add_turning_scores(const Turning& tn, int64_t bh, int R, int64_t t0, int64_t n, float* s) {
  const int M = tn.M, half = tn.d / 2;
  const int64_t h = bh % tn.H, b = bh / tn.H;
  const int64_t* pair = tn.pair + h * M;
  const float* mu = tn.mu + h * M * 2;

  float coef[16][2][64];  // A, B per row and pair: R <= 16, M <= 64 (checked by the caller)
  for (int r = 0; r < R; ++r) {
    const float* q = tn.q + (bh * R + r) * tn.d;
    for (int m = 0; m < M; ++m) {
      const float qa = q[pair[m]], qb = q[pair[m] + half], ma = mu[2 * m], mb = mu[2 * m + 1];
      coef[r][0][m] = qa * ma + qb * mb;
      coef[r][1][m] = qb * ma - qa * mb;
    }
  }
  double c0[64], s0[64], cs[64], sn[64];
  const float* wp[64];
  for (int m = 0; m < M; ++m) {
    const float* w = wp[m] = tn.w + pair[m] * 2 * kTurnTile;
    const double ph = std::fmod(static_cast<double>(tn.pos0[b] + t0) * tn.freq[pair[m]], 2 * M_PI);
    c0[m] = std::cos(ph);
    s0[m] = std::sin(ph);
    const double c1 = w[1], s1 = w[kTurnTile + 1];  // e^{iθ}
    const double cl = w[kTurnTile - 1], sl = w[2 * kTurnTile - 1];  // e^{(tile - 1)iθ}
    cs[m] = cl * c1 - sl * s1;  // e^{tile·iθ} = e^{(tile - 1)iθ} e^{iθ}
    sn[m] = sl * c1 + cl * s1;
  }
  // Per tile, with φ0 the tile's first phase: A cos(φ0 + jθ) + B sin(φ0 + jθ) = E cos(jθ) + F sin(jθ), E = A c0 + B s0,
  // F = B c0 - A s0: two products per pair and row over the tile's tokens, then the phasor (c0, s0) moves a tile on.
  float acc[16 * kTurnTile], e[16][64], f[16][64];
  for (int64_t t = 0; t < n; t += kTurnTile) {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        const float c = static_cast<float>(c0[m]), sm = static_cast<float>(s0[m]);
        e[r][m] = coef[r][0][m] * c + coef[r][1][m] * sm;
        f[r][m] = coef[r][1][m] * c - coef[r][0][m] * sm;
      }
    std::fill(acc, acc + R * kTurnTile, 0.f);
    for (int m = 0; m < M; ++m) {
      const float* wc = wp[m];
      const float* ws = wc + kTurnTile;
      for (int r = 0; r < R; ++r) {
        const float E = e[r][m], F = f[r][m];
        float* __restrict out = acc + r * kTurnTile;
        for (int j = 0; j < kTurnTile; ++j) out[j] += E * wc[j] + F * ws[j];
      }
      const double c = c0[m] * cs[m] - s0[m] * sn[m];
      s0[m] = s0[m] * cs[m] + c0[m] * sn[m];
      c0[m] = c;
    }
    const int64_t c = std::min<int64_t>(kTurnTile, n - t);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < c; ++j) s[r * n + t + j] += acc[r * kTurnTile + j];
  }
}

template <bool PAIR3, int W, int VBITS>
void tq_attention_impl(const float* q, const float* row_off, const uint8_t* kc, int64_t k_bh, const at::Half* kn, int64_t kn_bh,
                       const float* kcent, const Layout& KL, const uint8_t* vc, int64_t v_bh, const at::Half* vn, int64_t vn_bh,
                       const float* vcent, const Layout& VL, int64_t BH, int R, int64_t T, float scale, const Skip& skip, const Turning& tn,
                       Partials& P) {
  const int64_t splits = P.splits;
  const int64_t unit_stride = static_cast<int64_t>(KL.entries) * W;
  std::vector<float> dec(static_cast<int64_t>(VL.entries) * VL.cpu);
  for (int e = 0; e < VL.entries; ++e)
    for (int k = 0; k < VL.cpu; ++k) dec[e * VL.cpu + k] = vcent[(e >> (k * VL.bits)) & VL.mask];
  for_items(BH * splits, BH * T * R, [&](const auto& next) {
    std::vector<float> table(KL.units * unit_stride);
    std::vector<float> s(static_cast<int64_t>(R) * kSplit);
    std::vector<float> rows_buf(4 * static_cast<int64_t>(VL.units) * VL.cpu, 0.f);
    int64_t built = -1;
    for (int64_t i; (i = next()) >= 0;) {
      const int64_t bh = i / splits, sp = i % splits;
      const int64_t t0 = sp * kSplit, t1 = std::min(T, t0 + kSplit), n = t1 - t0;
      if (bh != built) {
        for (int u = 0; u < KL.units; ++u)
          build_unit_table<W>(q + bh * R * KL.d, KL.d, R, u * KL.cpu, KL, kcent, table.data() + u * unit_stride);
        built = bh;
      }
      for (int64_t b0 = 0; b0 < n; b0 += kBlock)
        score_tokens<PAIR3, W>(table.data(), kc + bh * k_bh + t0 * KL.nbytes, kn + bh * kn_bh + t0, b0, std::min(n, b0 + kBlock), KL,
                               s.data(), n, R);
      if (tn.M) add_turning_scores(tn, bh, R, t0, n, s.data());
      for (int r = 0; r < R; ++r) {
        const float off = row_off ? row_off[bh * R + r] : 0.f;
        for (int64_t t = 0; t < n; ++t) s[r * n + t] = (s[r * n + t] + off) * scale;
      }
      skip.apply(s.data(), n, R, t0, n);
      float* pm = P.m.data() + i * R;
      float* pl = P.l.data() + i * R;
      softmax_rows(s.data(), n, R, n, pm, pl);
      accumulate_tokens<VBITS>(s.data(), vc + bh * v_bh + t0 * VL.nbytes, vn + bh * vn_bh + t0, 0, n, VL, n, R, dec.data(), rows_buf.data(),
                               P.o.data() + i * R * VL.d);
    }
  });
}

template <bool PAIR3, int W>
void tq_attention_vbits(int vbits, const float* q, const float* row_off, const uint8_t* kc, int64_t k_bh, const at::Half* kn, int64_t kn_bh,
                        const float* kcent, const Layout& KL, const uint8_t* vc, int64_t v_bh, const at::Half* vn, int64_t vn_bh,
                        const float* vcent, const Layout& VL, int64_t BH, int R, int64_t T, float scale, const Skip& skip, const Turning& tn,
                        Partials& P) {
  auto run = vbits == 1 ? tq_attention_impl<PAIR3, W, 1> : vbits == 2 ? tq_attention_impl<PAIR3, W, 2>
           : vbits == 3 ? tq_attention_impl<PAIR3, W, 3> : tq_attention_impl<PAIR3, W, 4>;
  run(q, row_off, kc, k_bh, kn, kn_bh, kcent, KL, vc, v_bh, vn, vn_bh, vcent, VL, BH, R, T, scale, skip, tn, P);
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

// -- trellis-coded TurboQuant rows ----------------------------------------------------------------
//
// Codes of a tail-biting bitshift trellis (kvpack/primitives/trellis.py): k-bit symbols packed LSB-first like scalar
// codes, coordinate i the table entry of the L-bit window of the row's circular bit string that starts at bit
// k(i - L/k + 1) (reference.code_values). Eight coordinates' windows lie in one 64-bit word read at the first one's
// start (the string's last bits ahead of bit 0 for the first group), and two neighbours' windows in one of L + k bits,
// so a table of 2**(L+k) float pairs (32 KiB at L = 9, k = 3; built per call) gives two coordinates per 8-byte load.
// Scalar loads, not gathers: a 64-channel K + V token row (L = 9 / 8) on an AMD EPYC (Zen 4) took 29 ns one table load
// per coordinate, 17 ns with the pair table, and AVX2 or AVX-512 gathers were slower than single loads (21 against 15 ns
// a K row); Intel's gather microcode mitigations (GDS) make gathers slower still there.
constexpr int kMaxTrellisRow = 160;  // row bytes: d <= 320 at k <= 4
constexpr int kMaxPairBits = 12;     // pair tables up to 2**12 float pairs (32 KiB, L1-sized)

struct TrellisRows {
  const float* table;  // (2**L,) indexed by the raw window
  int k, L, d, nbytes;

  // Bits [bit, bit + 56) of the row (bit >= 0), zeros past its end.
  uint64_t bits_at(const uint8_t* row, int bit) const {
    const int byte = bit >> 3;
    uint64_t w = 0;
    if (byte + 8 <= nbytes) std::memcpy(&w, row + byte, 8);
    else for (int b = byte; b < nbytes; ++b) w |= static_cast<uint64_t>(row[b]) << (8 * (b - byte));
    return w >> (bit & 7);
  }
  // The circular string's bits from `bit` (> -total) on: the row's last -bit bits first when bit < 0.
  uint64_t circular_at(const uint8_t* row, int bit) const {
    if (bit >= 0) return bits_at(row, bit);
    const int back = -bit;
    return (bits_at(row, d * k - back) & ((uint64_t{1} << back) - 1)) | (bits_at(row, 0) << back);
  }
  const uint64_t* pairs = nullptr;  // (2**(L+k),) two floats each: coordinates 2j and 2j+1 from their joint window, or null

  void operator()(const uint8_t* row, float* dst) const {
    const uint32_t mask = (1u << L) - 1, pair_mask = (1u << (L + k)) - 1;
    const int pre = L - k;
    uint8_t buf[kMaxTrellisRow + 8] = {};  // the row, zero-padded so every group reads one fixed 8-byte word
    std::memcpy(buf, row, nbytes);
    for (int i = 0; i < d; i += 8) {
      const int bit = k * i - pre;
      uint64_t w;
      if (bit >= 0) {
        std::memcpy(&w, buf + (bit >> 3), sizeof(w));
        w >>= bit & 7;
      } else {
        w = circular_at(row, bit);
      }
      if (pairs && d - i >= 8) {
        for (int j = 0; j < 4; ++j) std::memcpy(dst + i + 2 * j, pairs + ((w >> (2 * k * j)) & pair_mask), sizeof(uint64_t));
      } else {
        for (int j = 0; j < std::min(8, d - i); ++j) dst[i + j] = table[(w >> (k * j)) & mask];
      }
    }
  }
};

// Scalar TurboQuant codes widened the same way: dst[i] = centroids[code_i].
struct ScalarRows {
  const float* table;
  int bits, d, nbytes;
  void operator()(const uint8_t* row, float* dst) const {
    const uint32_t mask = (1u << bits) - 1;
    for (int i = 0; i < d; ++i) {
      const int bit = bits * i, byte = bit >> 3;
      uint32_t v = row[byte];
      if (byte + 1 < nbytes) v |= static_cast<uint32_t>(row[byte + 1]) << 8;
      dst[i] = table[(v >> (bit & 7)) & mask];
    }
  }
};

// A TurboQuant code row of either kind, chosen per segment.
struct CodeRows {
  bool trellis;
  TrellisRows tr;
  ScalarRows sc;
  std::vector<uint64_t> pairs;  // tr.pairs' storage
  void operator()(const uint8_t* row, float* dst) const { trellis ? tr(row, dst) : sc(row, dst); }
};

std::unique_ptr<CodeRows> make_code_rows(const torch::Tensor& table, int bits, int d) {
  const int64_t entries = table.numel();
  const int L = entries > 1 ? 63 - __builtin_clzll(static_cast<uint64_t>(entries)) : 0;
  const int nbytes = (d * bits + 7) / 8;
  TORCH_CHECK(entries == (int64_t{1} << L) && L % bits == 0 && L >= bits && L <= 12,
              "a TurboQuant table has 2**bits entries (scalar codes) or 2**L, L a multiple of bits up to 12 (trellis codes)");
  TORCH_CHECK(L == bits || nbytes <= kMaxTrellisRow, "trellis rows hold at most ", kMaxTrellisRow, " bytes, got ", nbytes);
  const float* t = table.data_ptr<float>();
  auto rows = std::make_unique<CodeRows>(CodeRows{L > bits, TrellisRows{t, bits, L, d, nbytes}, ScalarRows{t, bits, d, nbytes}, {}});
  if (L > bits && L + bits <= kMaxPairBits) {
    rows->pairs.resize(size_t{1} << (L + bits));
    for (size_t w = 0; w < rows->pairs.size(); ++w) {
      const float two[2] = {t[w & ((size_t{1} << L) - 1)], t[w >> bits]};
      std::memcpy(&rows->pairs[w], two, sizeof(two));
    }
    rows->tr.pairs = rows->pairs.data();
  }
  return rows;
}

// tq_attention's form for segments with trellis codes on either side: rows decoded in L1 (rows_attention_impl).
void tq_rows_attention(const float* q, const float* row_off, const uint8_t* kc, int64_t k_bh, const at::Half* kn, int64_t kn_bh,
                       const CodeRows& krows, int kbytes, const uint8_t* vc, int64_t v_bh, const at::Half* vn, int64_t vn_bh,
                       const CodeRows& vrows, int vbytes, int64_t BH, int R, int64_t T, int d, float scale, const Skip& skip,
                       const Turning& tn, Partials& P) {
  auto kdec = [&](int64_t bh, int64_t t, float* dst) {
    krows(kc + bh * k_bh + t * kbytes, dst);
    return static_cast<float>(kn[bh * kn_bh + t]);
  };
  auto vdec = [&](int64_t bh, int64_t t, float* dst) {
    vrows(vc + bh * v_bh + t * vbytes, dst);
    return static_cast<float>(vn[bh * vn_bh + t]);
  };
  auto adjust = [&](int64_t bh, int rows, int64_t t0, int64_t n, float* s) {
    if (tn.M) add_turning_scores(tn, bh, rows, t0, n, s);
    if (row_off)
      for (int r = 0; r < rows; ++r)
        for (int64_t t = 0; t < n; ++t) s[r * n + t] += row_off[bh * rows + r];
  };
  rows_attention_impl(q, BH, R, T, d, d, scale, skip, P, kdec, vdec, adjust);
}

// -- trellis encode: the tail-biting Viterbi search of trellis.encode_symbols, float32 costs -------------------------

// Sixteen sequences searched in lockstep, one per lane of every state's cost (GCC vector types: AVX-512 registers where
// the CPU has them, pairs of AVX2 ones elsewhere): each step is vertical min/select/add over the 2**L states with no
// shuffles, and the back-pointers are bytes per lane. Per sequence 4.8x faster than searching one sequence at a time
// (a 64-channel row on one Zen 4 core: 4.7 us against 22.8 us at L = 9, 3.0 against 15.3 us at L = 8), with the
// same results: the same float32 sums, ties to the first predecessor and the first final state.
constexpr int kLanes = 16;
typedef float lanes_f __attribute__((vector_size(4 * kLanes)));
typedef int32_t lanes_i __attribute__((vector_size(4 * kLanes)));

struct TrellisSearch {
  const float* book;  // (2**L,) state codebook, state = symbols oldest-highest
  int k, L, S, tail, n;
  std::vector<lanes_f> cost, best, xs;
  std::vector<lanes_i> arg;
  std::vector<uint8_t> back;    // (n - 1, tail, lanes)
  std::vector<int32_t> states;  // (lanes, n)
  TrellisSearch(const float* book_, int k_, int L_, int n_)
      : book(book_), k(k_), L(L_), S(1 << L_), tail(1 << (L_ - k_)), n(n_), cost(S), best(tail), xs(n_), arg(tail),
        back(static_cast<size_t>(n_) * tail * kLanes), states(static_cast<size_t>(kLanes) * n_) {}

  // Least-error state paths of the sixteen sequences in `xs` (xs[i][lane]) into `states`; with `wrap` (one per lane,
  // else null) each path's first state's high and last state's low L - k bits are held to it.
  void run(const int32_t* wrap) {
    const float inf = std::numeric_limits<float>::infinity();
    for (int s = 0; s < S; ++s) {
      const lanes_f e = xs[0] - book[s];
      cost[s] = e * e;
      if (wrap)
        for (int j = 0; j < kLanes; ++j)
          if ((s >> k) != wrap[j]) cost[s][j] = inf;
    }
    const int fan = 1 << k;
    for (int i = 1; i < n; ++i) {
      // The best predecessor of every low part lo: p = hi * tail + lo over the fan of high parts.
      for (int lo = 0; lo < tail; ++lo) {
        best[lo] = cost[lo];
        arg[lo] = lanes_i{} ;
      }
      for (int hi = 1; hi < fan; ++hi) {
        const lanes_f* c = cost.data() + hi * tail;
        const lanes_i h = lanes_i{} + hi;
        for (int lo = 0; lo < tail; ++lo) {
          const lanes_i less = c[lo] < best[lo];
          best[lo] = less ? c[lo] : best[lo];
          arg[lo] = less ? h : arg[lo];
        }
      }
      uint8_t* bk = back.data() + static_cast<size_t>(i - 1) * tail * kLanes;
      for (int lo = 0; lo < tail; ++lo)
        for (int j = 0; j < kLanes; ++j) bk[lo * kLanes + j] = static_cast<uint8_t>(arg[lo][j]);
      const lanes_f x = xs[i];
      for (int lo = 0; lo < tail; ++lo)
        for (int nw = 0; nw < fan; ++nw) {
          const lanes_f e = x - book[lo * fan + nw];
          cost[lo * fan + nw] = best[lo] + e * e;
        }
    }
    for (int j = 0; j < kLanes; ++j) {
      int last = -1;
      float low = inf;
      for (int s = 0; s < S; ++s)
        if ((!wrap || (s & (tail - 1)) == wrap[j]) && (last < 0 || cost[s][j] < low)) {
          low = cost[s][j];
          last = s;
        }
      int32_t* st = states.data() + static_cast<size_t>(j) * n;
      st[n - 1] = last;
      for (int i = n - 1; i > 0; --i) {
        const int lo = st[i] >> k;
        st[i - 1] = back[(static_cast<size_t>(i - 1) * tail + lo) * kLanes + j] * tail + lo;
      }
    }
  }
};

// symbols (N, n) u8 of tail-biting paths for y (N, n) f32 against a (2**L,) state codebook at k bits per coordinate.
torch::Tensor trellis_encode(torch::Tensor y, torch::Tensor book, int64_t k) {
  y = y.contiguous();
  book = book.contiguous();
  const int64_t S = book.numel();
  const int L = S > 1 ? 63 - __builtin_clzll(static_cast<uint64_t>(S)) : 0;
  TORCH_CHECK(y.scalar_type() == at::kFloat && book.scalar_type() == at::kFloat && y.dim() == 2, "trellis_encode takes y (N, n) and book f32");
  TORCH_CHECK(S == (int64_t{1} << L) && k >= 1 && k <= 4 && L % k == 0 && L > k && L <= 12, "trellis_encode: book of 2**L entries, L a multiple of k in (k, 12]");
  const int64_t N = y.size(0);
  const int n = static_cast<int>(y.size(1));
  auto out = torch::empty({N, n}, y.options().dtype(torch::kUInt8));
  const float* src = y.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int kk = static_cast<int>(k), half = n / 2, sym = (1 << kk) - 1;
  at::parallel_for(0, (N + kLanes - 1) / kLanes, 1, [&](int64_t lo, int64_t hi) {
    TrellisSearch search(book.data_ptr<float>(), kk, L, n);
    int32_t wrap[kLanes];
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t r0 = blk * kLanes, rows = std::min<int64_t>(kLanes, N - r0);
      // A free pass over the sequences rotated by n/2 (the wrap point mid-path) reads the bits there, then the pass
      // over the sequences themselves is held to them at both ends. Lanes past the last row search zeros.
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < kLanes; ++j) search.xs[i][j] = j < rows ? src[(r0 + j) * n + (i + half) % n] : 0.f;
      search.run(nullptr);
      for (int j = 0; j < kLanes; ++j) wrap[j] = search.states[static_cast<size_t>(j) * n + n - half - 1] & (search.tail - 1);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < kLanes; ++j) search.xs[i][j] = j < rows ? src[(r0 + j) * n + i] : 0.f;
      search.run(wrap);
      for (int64_t j = 0; j < rows; ++j)
        for (int i = 0; i < n; ++i) dst[(r0 + j) * n + i] = static_cast<uint8_t>(search.states[j * n + i] & sym);
    }
  });
  return out;
}

// -- Shard: PCA-coefficient keys (RoPE undone) + VQ values --------------------------------------
//
// Keys are stored as integer PCA coefficients of un-RoPEd keys, one basis per group of kv heads.
// Per tile of 8 tokens the kernel rebuilds the group's keys in L1 (levels x basis^T + mean: a
// micro-GEMM with the basis read once per tile), re-applies RoPE at each key's position with
// cos/sin advanced by an exact float64 rotation recurrence (anchored per split, no per-token
// sincos), and dots them with the RoPE'd query. Scoring through the relative-position identity
// instead costs rows x d x rank per token: (q_heads / kv_heads) times the rebuild. Values are VQ
// codeword indices in a Hadamard-rotated space: each token row is gathered from the codebook in L1
// and accumulated with p x norm; the caller applies the channel scale and one inverse Hadamard.

struct Run { int first, n, bits, pos; };  // consecutive components of one width, contiguous bits

struct PCAKeys {
  std::vector<Run> runs;
  const uint8_t* codes; int64_t bh_stride; int nbytes;  // (B, groups, T, nbytes) rows
  const int32_t* bitpos; const float* qmax; int rank;    // per component: first bit in a row, level offset
  const uint8_t* bits;
  const float* basis_t; const float* mean;               // (groups, rank, gdim) scaled basis, (groups, gdim)
  int groups, gdim;
  // Integer form of basis_t (cpu_lut.int8_basis), null unless given and this build has VNNI:
  // w8 (groups, rank4, gdim, 4) i8, col_scale and mean8 (groups, gdim) f32.
  const int8_t* w8 = nullptr; const float* col_scale = nullptr; const float* mean8 = nullptr; int rank4 = 0;
};

struct VQValues {
  const uint8_t* idx; int64_t bh_stride; int nbytes, bits;  // (B, kv, T, nbytes) rows
  const at::Half* norm; int64_t norm_stride;              // (B, kv, T, 1) or null; head stride
  const float* books; int book_count, entries, gsize;     // (1 or kv, entries, gsize)
};

constexpr int kTile = 8;  // tokens rebuilt together: the basis is read once per tile

inline int read_code(const uint8_t* row, int nbytes, int bitpos, int bits) {
  const int byte = bitpos >> 3;
  int v = row[byte];
  if (byte + 1 < nbytes) v |= row[byte + 1] << 8;
  return (v >> (bitpos & 7)) & ((1 << bits) - 1);
}

// out[i][:] = mean + sum_r lev[i][r] * basis_t[r][:] for kTile tokens. 16-float GCC vector types keep
// the kTile accumulators of one column block in registers on any x86 level (one zmm or two ymm each).
typedef float f16v __attribute__((vector_size(64)));

inline f16v load16(const float* p) { f16v v; std::memcpy(&v, p, sizeof(v)); return v; }

// NB column blocks of 16 per pass: each level broadcast feeds NB FMAs, so loads stop bounding the
// FMAs; 8 x NB accumulators must fit the register file (32 zmm with AVX-512: NB = 2, as 3 made GCC spill; 16 ymm: NB = 1).
template <int NB>
inline void rebuild_columns(const float* lev, int rank, const float* basis_t, const float* mean, int gdim, int j, float* out) {
  f16v acc[kTile][NB];
  for (int c = 0; c < NB; ++c) {
    const f16v m = load16(mean + j + 16 * c);
    for (int i = 0; i < kTile; ++i) acc[i][c] = m;
  }
  const float* b = basis_t + j;
  for (int r = 0; r < rank; ++r, b += gdim) {
    f16v bv[NB];
    for (int c = 0; c < NB; ++c) bv[c] = load16(b + 16 * c);
    for (int i = 0; i < kTile; ++i) {
      const float l = lev[r * kTile + i];
      for (int c = 0; c < NB; ++c) acc[i][c] += l * bv[c];
    }
  }
  for (int i = 0; i < kTile; ++i)
    for (int c = 0; c < NB; ++c) std::memcpy(out + i * gdim + j + 16 * c, &acc[i][c], sizeof(f16v));
}

void rebuild_tile(const float* lev, int rank, const float* basis_t, const float* mean, int gdim, float* out) {
#ifdef __AVX512F__
  constexpr int kWide = 2;
#else
  constexpr int kWide = 1;
#endif
  int j = 0;
  for (; j + 16 * kWide <= gdim; j += 16 * kWide) rebuild_columns<kWide>(lev, rank, basis_t, mean, gdim, j, out);
  for (; j + 16 <= gdim; j += 16) rebuild_columns<1>(lev, rank, basis_t, mean, gdim, j, out);
  for (; j < gdim; ++j)
    for (int i = 0; i < kTile; ++i) {
      float a = mean[j];
      for (int r = 0; r < rank; ++r) a += lev[r * kTile + i] * basis_t[static_cast<int64_t>(r) * gdim + j];
      out[i * gdim + j] = a;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kInt8Rebuild = true;

// Integer rebuild of kTile tokens: out[i][j] = mean8[j] + scale[j] * sum_r code[i][r] * w8[r][j], where the
// unsigned codes (level + qmax, 0..254) meet the int8 basis in VPDPBUSD: 64 multiply-adds per instruction
// against 16 for a float FMA. w8 holds 4 consecutive components per column (rank4, gdim, 4); cq holds each
// token's codes (kTile, 4 * rank4), zero-padded. mean8 = mean - scale * sum_r qmax[r] w8[r] turns codes
// back into levels exactly (integers in float32). Column blocks go to rebuild_cols_i8 below.

// acc += a (unsigned bytes) . w (signed bytes), per 32-bit lane. Written as asm: with the intrinsic GCC 12
// copied every accumulator to another register (and spilled two) on each VPDPBUSD of the loop below.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
  return acc;
}

// 16, 32 or 48 columns (NB blocks of 16) with the 8 tokens' accumulators as named variables, so they stay in
// registers (24 of 32 zmm at NB = 3); each broadcast code word then feeds NB multiply-adds.
#define KV_ACC8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
template <int NB>
__attribute__((noinline)) void rebuild_cols_i8(const uint8_t* cq, int rank4, const int8_t* w8, const float* scale, const float* mean8,
                                               int gdim, int j, float* out) {
  static_assert(NB >= 1 && NB <= 3, "16, 32 or 48 columns");
#define KV_DECL(I) __m512i a0_##I = _mm512_setzero_si512(), a1_##I = _mm512_setzero_si512(), a2_##I = _mm512_setzero_si512();
  KV_ACC8(KV_DECL)
#undef KV_DECL
  const int8_t* wq = w8 + static_cast<int64_t>(j) * 4;
  const int64_t wstep = static_cast<int64_t>(gdim) * 4, row = static_cast<int64_t>(rank4) * 4;
  for (int q = 0; q < rank4; ++q, wq += wstep) {
    const __m512i w0 = _mm512_loadu_si512(wq);
    const __m512i w1 = NB >= 2 ? _mm512_loadu_si512(wq + 64) : w0, w2 = NB == 3 ? _mm512_loadu_si512(wq + 128) : w0;
#define KV_STEP(I)                                                          \
    {                                                                       \
      int32_t four;                                                         \
      std::memcpy(&four, cq + I * row + 4 * q, sizeof(four));              \
      const __m512i a = _mm512_set1_epi32(four);                            \
      a0_##I = dpbusd(a0_##I, a, w0);                                       \
      if (NB >= 2) a1_##I = dpbusd(a1_##I, a, w1);                          \
      if (NB == 3) a2_##I = dpbusd(a2_##I, a, w2);                          \
    }
    KV_ACC8(KV_STEP)
#undef KV_STEP
  }
  const __m512 s0 = _mm512_loadu_ps(scale + j), m0 = _mm512_loadu_ps(mean8 + j);
  const __m512 s1 = NB >= 2 ? _mm512_loadu_ps(scale + j + 16) : s0, m1 = NB >= 2 ? _mm512_loadu_ps(mean8 + j + 16) : m0;
  const __m512 s2 = NB == 3 ? _mm512_loadu_ps(scale + j + 32) : s0, m2 = NB == 3 ? _mm512_loadu_ps(mean8 + j + 32) : m0;
#define KV_STORE(I)                                                                                                 \
  _mm512_storeu_ps(out + I * gdim + j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0_##I), s0, m0));                        \
  if (NB >= 2) _mm512_storeu_ps(out + I * gdim + j + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1_##I), s1, m1));      \
  if (NB == 3) _mm512_storeu_ps(out + I * gdim + j + 32, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2_##I), s2, m2));
  KV_ACC8(KV_STORE)
#undef KV_STORE
}
#undef KV_ACC8
static_assert(kTile == 8, "rebuild_cols_i8 names one accumulator set per tile token");

void rebuild_tile_i8(const uint8_t* cq, int rank4, const int8_t* w8, const float* scale, const float* mean8, int gdim, float* out) {
  int j = 0;
  for (; j + 48 <= gdim; j += 48) rebuild_cols_i8<3>(cq, rank4, w8, scale, mean8, gdim, j, out);
  for (; j + 32 <= gdim; j += 32) rebuild_cols_i8<2>(cq, rank4, w8, scale, mean8, gdim, j, out);
  for (; j + 16 <= gdim; j += 16) rebuild_cols_i8<1>(cq, rank4, w8, scale, mean8, gdim, j, out);
  for (; j < gdim; ++j)
    for (int i = 0; i < kTile; ++i) {
      int32_t a = 0;
      for (int k = 0; k < 4 * rank4; ++k) a += cq[i * 4 * rank4 + k] * w8[(static_cast<int64_t>(k >> 2) * gdim + j) * 4 + (k & 3)];
      out[i * gdim + j] = mean8[j] + scale[j] * static_cast<float>(a);
    }
}
#else
constexpr bool kInt8Rebuild = false;
void rebuild_tile_i8(const uint8_t*, int, const int8_t*, const float*, const float*, int, float*) {}
#endif

// Runs of consecutive components with one width and contiguous bits: each unpacks in one loop.
std::vector<Run> component_runs(const int32_t* bitpos, const uint8_t* bits, int rank) {
  std::vector<Run> runs;
  for (int r = 0; r < rank;) {
    int n = 1;
    while (r + n < rank && bits[r + n] == bits[r] && bitpos[r + n] == bitpos[r] + n * bits[r]) ++n;
    runs.push_back({r, n, bits[r], bitpos[r]});
    r += n;
  }
  return runs;
}

// n codes of a byte-aligned run of BITS-bit codes: a whole byte at a time, with constant shifts.
template <int BITS>
inline void unpack_run(const uint8_t* src, int n, uint8_t* out) {
  constexpr int per = 8 / BITS, mask = (1 << BITS) - 1;
  int k = 0;
#ifdef __SSE2__
  if (BITS == 4)  // 16 bytes -> 32 codes: low nibbles are the even codes, high the odd, interleaved back in order
    for (; k + 32 <= n; k += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k / 2)), m = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k + 16), _mm_unpackhi_epi8(lo, hi));
    }
#endif
  for (; k + per <= n; k += per) {
    const int b = src[k / per];
    for (int u = 0; u < per; ++u) out[k + u] = static_cast<uint8_t>((b >> (u * BITS)) & mask);
  }
  for (; k < n; ++k) out[k] = static_cast<uint8_t>((src[k / per] >> ((k % per) * BITS)) & mask);
}

// Unsigned codes (level + qmax) of one packed row into cq[0, rank); the caller zero-pads to 4 * rank4.
inline void unpack_codes(const uint8_t* row, const PCAKeys& K, uint8_t* cq) {
  for (const Run& run : K.runs) {
    const int r = run.first, n = run.n, bits = run.bits, pos = run.pos;
    const uint8_t* src = row + (pos >> 3);
    if ((pos & 7) == 0 && bits == 8) {
      std::memcpy(cq + r, src, n);
    } else if ((pos & 7) == 0 && bits == 4) {
      unpack_run<4>(src, n, cq + r);
    } else if ((pos & 7) == 0 && bits == 2) {
      unpack_run<2>(src, n, cq + r);
    } else {
      for (int k = 0; k < n; ++k) cq[r + k] = static_cast<uint8_t>(read_code(row, K.nbytes, pos + k * bits, bits));
    }
  }
}

// Signed levels of one packed row into li[r * kTile] (r = component) for the float rebuild: the same
// unpacking as the integer path (into `scratch`, rank bytes), less each component's level offset.
inline void unpack_levels(const uint8_t* row, const PCAKeys& K, uint8_t* scratch, float* li) {
  unpack_codes(row, K, scratch);
  for (int r = 0; r < K.rank; ++r) li[r * kTile] = static_cast<float>(scratch[r]) - K.qmax[r];
}

// In place on one key (d coordinates): x <- x * cos + rotate_half(x) * sin, with cos/sin per pair.
inline void rope_row(float* x, const float* c, const float* s, int half) {
  for (int j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * c[j] - b * s[j];
    x[j + half] = b * c[j] + a * s[j];
  }
}

// Scores of one split [t0, t1) of group g for batch row b into s[(hh * R + r) * n + t].
void pca_split_scores(const float* q, const PCAKeys& K, int64_t b, int g, int per, int R, int d, int64_t t0, int64_t t1,
                      int64_t pos0, const double* inv_freq, float rope_scale, float scale, float* s, std::vector<float>& lev, std::vector<uint8_t>& scratch,
                      std::vector<float>& kt, std::vector<double>& rot, std::vector<float>& cs) {
  const int half = d / 2, rank = K.rank, gdim = K.gdim;
  const int64_t n = t1 - t0;
  const uint8_t* codes = K.codes + (b * K.groups + g) * K.bh_stride;
  const float* basis_t = K.basis_t ? K.basis_t + static_cast<int64_t>(g) * rank * gdim : nullptr;  // null on the integer path
  const float* mean = K.mean + static_cast<int64_t>(g) * gdim;
  // Exact phases at the split's first key, then one float64 complex step per token.
  double* c = rot.data();
  double* sn = c + half;
  const double* step_c = sn + half;
  const double* step_s = step_c + half;
  for (int j = 0; j < half; ++j) {
    const double ph = std::fmod(static_cast<double>(pos0 + t0) * inv_freq[j], 2 * M_PI);
    c[j] = std::cos(ph);
    sn[j] = std::sin(ph);
  }
  const bool integer = K.w8 != nullptr;
  for (int64_t tt = 0; tt < n; tt += kTile) {
    const int cnt = static_cast<int>(std::min<int64_t>(kTile, n - tt));
    if (integer) {  // lev's storage holds kTile rows of 4 * rank4 unsigned codes
      uint8_t* cq = reinterpret_cast<uint8_t*>(lev.data());
      std::memset(cq, 0, static_cast<size_t>(kTile) * 4 * K.rank4);
      for (int i = 0; i < cnt; ++i) unpack_codes(codes + (t0 + tt + i) * K.nbytes, K, cq + static_cast<int64_t>(i) * 4 * K.rank4);
      const int64_t off = static_cast<int64_t>(g) * gdim;
      rebuild_tile_i8(cq, K.rank4, K.w8 + off * K.rank4 * 4, K.col_scale + off, K.mean8 + off, gdim, kt.data());
    } else {
      for (int i = 0; i < kTile; ++i) {
        float* li = lev.data() + i;
        if (i >= cnt) {
          for (int r = 0; r < rank; ++r) li[r * kTile] = 0.f;
          continue;
        }
        unpack_levels(codes + (t0 + tt + i) * K.nbytes, K, scratch.data(), li);
      }
      rebuild_tile(lev.data(), rank, basis_t, mean, gdim, kt.data());
    }
    for (int i = 0; i < cnt; ++i) {
      float* ci = cs.data() + i * d;
      for (int j = 0; j < half; ++j) {
        ci[j] = static_cast<float>(c[j]) * rope_scale;
        ci[half + j] = static_cast<float>(sn[j]) * rope_scale;
        const double nc = c[j] * step_c[j] - sn[j] * step_s[j];
        sn[j] = sn[j] * step_c[j] + c[j] * step_s[j];
        c[j] = nc;
      }
      for (int hh = 0; hh < per; ++hh) rope_row(kt.data() + i * gdim + hh * d, ci, ci + half, half);
    }
    for (int hh = 0; hh < per; ++hh) {
      const float* kr[4];
      for (int i0 = 0; i0 < cnt; i0 += 4) {
        const int c4 = std::min(4, cnt - i0);
        for (int i = 0; i < 4; ++i) kr[i] = kt.data() + (i0 + std::min(i, c4 - 1)) * gdim + hh * d;
        for (int r = 0; r < R; ++r) {
          float dots[4];
          dot4(q + ((b * K.groups + g) * per + hh) * static_cast<int64_t>(R) * d + r * d, kr, d, dots);
          for (int i = 0; i < c4; ++i) s[(hh * R + r) * n + tt + i0 + i] = dots[i] * scale;
        }
      }
    }
  }
}

// acc[r][:] += sum_t p[r][t] * norm[t] * codeword-row(t) for one kv head over n tokens.
void vq_accumulate(const float* p, int R, int64_t n, const VQValues& V, const uint8_t* idx, const at::Half* norm, const float* book,
                   int d, float* acc, float* rows) {
  const int groups = d / V.gsize;
  for (int64_t t = 0; t < n; t += 4) {
    const int c = static_cast<int>(std::min<int64_t>(4, n - t));
    for (int i = 0; i < 4; ++i) {
      float* row = rows + i * d;
      if (i >= c) { std::fill(row, row + d, 0.f); continue; }
      const uint8_t* src = idx + (t + i) * V.nbytes;
      if (V.bits == 8 && V.gsize == 4) {  // the default layout: a fixed-size copy inlines (a runtime size calls memcpy)
        for (int gi = 0; gi < groups; ++gi) std::memcpy(row + gi * 4, book + static_cast<int64_t>(src[gi]) * 4, sizeof(float) * 4);
        continue;
      }
      for (int gi = 0; gi < groups; ++gi) {
        const int e = V.bits == 8 ? src[gi] : read_code(src, V.nbytes, gi * V.bits, V.bits);
        const float* cw = book + static_cast<int64_t>(e) * V.gsize;
        for (int u = 0; u < V.gsize; ++u) row[gi * V.gsize + u] = cw[u];
      }
    }
    for (int r = 0; r < R; ++r) {
      float w[4] = {};
      for (int i = 0; i < c; ++i) w[i] = p[r * n + t + i] * (norm ? static_cast<float>(norm[t + i]) : 1.f);
      float* __restrict a = acc + r * d;
      const float *r0 = rows, *r1 = rows + d, *r2 = rows + 2 * d, *r3 = rows + 3 * d;
      for (int j = 0; j < d; ++j) a[j] += w[0] * r0[j] + w[1] * r1[j] + w[2] * r2[j] + w[3] * r3[j];
    }
  }
}

#ifdef __AVX512F__
// vq_accumulate for the default layout (8-bit indices, groups of 4, d a multiple of 64), RB rows at a time:
// a token's 64-float codeword row is assembled in 4 registers from 16 codewords (no trip through memory)
// and the RB x 4 accumulators stay in registers for the whole split instead of being loaded and stored
// per 4 tokens (the gather and the accumulate were ~35% of the kernel).
template <int RB>
void vq_accumulate_g4_rows(const float* p, int64_t n, const uint8_t* idx, int nbytes, const at::Half* norm, const float* book, int j0,
                           float* acc, int d) {
  __m512 a[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  const uint8_t* src = idx + j0 / 4;
  for (int64_t t = 0; t < n; ++t, src += nbytes) {
    __m512 row[4];
    for (int c = 0; c < 4; ++c) {
      const uint8_t* e = src + 4 * c;
      __m512 v = _mm512_castps128_ps512(_mm_loadu_ps(book + 4 * e[0]));
      v = _mm512_insertf32x4(v, _mm_loadu_ps(book + 4 * e[1]), 1);
      v = _mm512_insertf32x4(v, _mm_loadu_ps(book + 4 * e[2]), 2);
      row[c] = _mm512_insertf32x4(v, _mm_loadu_ps(book + 4 * e[3]), 3);
    }
    const float nt = norm ? static_cast<float>(norm[t]) : 1.f;
    for (int r = 0; r < RB; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * n + t] * nt);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(w, row[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 4; ++c) {
      float* o = acc + r * d + j0 + 16 * c;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), a[r][c]));
    }
}

void vq_accumulate_g4(const float* p, int R, int64_t n, const uint8_t* idx, int nbytes, const at::Half* norm, const float* book, int d,
                      float* acc) {
  for (int j0 = 0; j0 < d; j0 += 64)
    for (int r0 = 0; r0 < R; r0 += 4) {
      const float* pr = p + r0 * n;
      float* ar = acc + r0 * d;
      switch (std::min(4, R - r0)) {
        case 1: vq_accumulate_g4_rows<1>(pr, n, idx, nbytes, norm, book, j0, ar, d); break;
        case 2: vq_accumulate_g4_rows<2>(pr, n, idx, nbytes, norm, book, j0, ar, d); break;
        case 3: vq_accumulate_g4_rows<3>(pr, n, idx, nbytes, norm, book, j0, ar, d); break;
        default: vq_accumulate_g4_rows<4>(pr, n, idx, nbytes, norm, book, j0, ar, d); break;
      }
    }
}
#endif

void pca_vq_attention_impl(const float* q, const PCAKeys& K, const VQValues& V, const int64_t* pos0, const double* inv_freq,
                           float rope_scale, int64_t B, int kv, int R, int d, int64_t T, float scale, const Skip& skip, Partials& P) {
  const int per = kv / K.groups;
  const int64_t splits = P.splits;
  const int half = d / 2;
  std::vector<double> steps(2 * half);
  for (int j = 0; j < half; ++j) {
    steps[j] = std::cos(inv_freq[j]);
    steps[half + j] = std::sin(inv_freq[j]);
  }
  for_items(B * K.groups * splits, B * kv * T * R, [&](const auto& next) {
    std::vector<float> s(static_cast<int64_t>(per) * R * kSplit);
    std::vector<float> lev(static_cast<int64_t>(kTile) * std::max(K.rank, 1));
    std::vector<uint8_t> scratch(std::max(K.rank, 1));
    std::vector<float> kt(static_cast<int64_t>(kTile) * K.gdim);
    std::vector<double> rot(4 * half);
    std::vector<float> cs(static_cast<int64_t>(kTile) * d);
    std::vector<float> rows(4 * static_cast<int64_t>(d));
    std::copy(steps.begin(), steps.end(), rot.begin() + 2 * half);
    for (int64_t i; (i = next()) >= 0;) {
      const int64_t b = i / (K.groups * splits), g = (i / splits) % K.groups, sp = i % splits;
      const int64_t t0 = sp * kSplit, t1 = std::min(T, t0 + kSplit), n = t1 - t0;
      pca_split_scores(q, K, b, static_cast<int>(g), per, R, d, t0, t1, pos0[b], inv_freq, rope_scale, scale, s.data(), lev, scratch, kt, rot, cs);
      for (int hh = 0; hh < per; ++hh) {
        const int64_t h = g * per + hh, bh = b * kv + h, item = bh * splits + sp;
        float* srow = s.data() + static_cast<int64_t>(hh) * R * n;
        skip.apply(srow, n, R, t0, n);
        softmax_rows(srow, n, R, n, P.m.data() + item * R, P.l.data() + item * R);
        const at::Half* nrm = V.norm ? V.norm + bh * V.norm_stride + t0 : nullptr;
        const float* book = V.books + (V.book_count == 1 ? 0 : h) * static_cast<int64_t>(V.entries) * V.gsize;
        const uint8_t* idx = V.idx + bh * V.bh_stride + t0 * V.nbytes;
#ifdef __AVX512F__
        if (V.bits == 8 && V.gsize == 4 && d % 64 == 0) {
          vq_accumulate_g4(srow, R, n, idx, V.nbytes, nrm, book, d, P.o.data() + item * R * d);
          continue;
        }
#endif
        vq_accumulate(srow, R, n, V, idx, nrm, book, d, P.o.data() + item * R * d, rows.data());
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

// Head stride of a (B, H, T, n) view whose rows are contiguous and whose heads sit at one stride
// (so batch stride = H * head stride): a capacity buffer narrowed along tokens.
int64_t head_stride(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D");
  TORCH_CHECK(t.stride(3) == 1 && (t.size(2) <= 1 || t.stride(2) == t.size(3)), name, ": token rows must be contiguous");
  TORCH_CHECK(t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1), name, ": batch stride must be heads x head stride");
  return t.stride(1);
}

std::vector<torch::Tensor> tq_attention(torch::Tensor q, torch::Tensor row_offset, torch::Tensor k_codes, torch::Tensor k_norm,
                                        torch::Tensor k_cent, int64_t k_bits, torch::Tensor v_codes, torch::Tensor v_norm,
                                        torch::Tensor v_cent, int64_t v_bits, double scale, torch::Tensor skip,
                                        std::vector<torch::Tensor> turning) {
  q = q.contiguous();
  if (row_offset.numel()) row_offset = row_offset.contiguous();
  // turning: empty, or {q (B, H, R, d) f32, pair (H, M) i64, mu (H, M, 2) f32, freq (d/2,) f64, w (d/2, 2, 64) f32, pos0 (B,) i64}
  Turning tn;
  if (!turning.empty()) {
    TORCH_CHECK(turning.size() == 6, "turning takes 6 tensors: q, pair, mu, freq, w, pos0");
    for (auto& t : turning) t = t.contiguous();
    const int64_t M = turning[1].size(1);
    TORCH_CHECK(M <= 64 && turning[0].sizes() == q.sizes() && turning[1].size(0) == q.size(1) && turning[3].scalar_type() == at::kDouble &&
                    turning[3].numel() == q.size(3) / 2 && turning[4].size(0) == q.size(3) / 2 && turning[4].size(2) == kTurnTile &&
                    turning[5].numel() == q.size(0),
                "turning tensors do not match the query: q (B, H, R, d), pair (H, M <= 64), mu (H, M, 2), freq (d/2,) f64, w (d/2, 2, 64), pos0 (B,)");
    tn = {turning[0].data_ptr<float>(), turning[1].data_ptr<int64_t>(), turning[2].data_ptr<float>(), turning[3].data_ptr<double>(),
          turning[4].data_ptr<float>(), turning[5].data_ptr<int64_t>(), q.size(1), static_cast<int>(M), static_cast<int>(q.size(3))};
  }
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3), T = k_codes.size(2);
  TORCH_CHECK(R <= 16, "tq_attention serves up to 16 query rows per kv head, got ", R);
  const Layout KL = make_layout(static_cast<int>(k_bits), static_cast<int>(d));
  const Layout VL = make_layout(static_cast<int>(v_bits), static_cast<int>(d));
  auto out = partial_outputs(q, d);
  Partials P(B * H, R, d, split_count(T));
  if (T > 0) {
    const float* off = row_offset.numel() ? row_offset.data_ptr<float>() : nullptr;
    const int kb = static_cast<int>(k_bits), vb = static_cast<int>(v_bits);
    const Skip sk = make_skip(skip);
    if (k_cent.numel() != (int64_t{1} << kb) || v_cent.numel() != (int64_t{1} << vb)) {  // trellis codes on a side: rows decoded in L1
      const auto krows_ = make_code_rows(k_cent, kb, static_cast<int>(d)), vrows_ = make_code_rows(v_cent, vb, static_cast<int>(d));
      const CodeRows &krows = *krows_, &vrows = *vrows_;
      tq_rows_attention(q.data_ptr<float>(), off, k_codes.data_ptr<uint8_t>(), head_stride(k_codes, "k_codes"), k_norm.data_ptr<at::Half>(),
                        head_stride(k_norm, "k_norm"), krows, KL.nbytes, v_codes.data_ptr<uint8_t>(), head_stride(v_codes, "v_codes"),
                        v_norm.data_ptr<at::Half>(), head_stride(v_norm, "v_norm"), vrows, VL.nbytes, B * H, static_cast<int>(R), T,
                        static_cast<int>(d), static_cast<float>(scale), sk, tn, P);
      P.merge(out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>());
      return out;
    }
#define KVP_TQ(PAIR3, W) tq_attention_vbits<PAIR3, W>(vb, q.data_ptr<float>(), off, k_codes.data_ptr<uint8_t>(), head_stride(k_codes, "k_codes"), \
      k_norm.data_ptr<at::Half>(), head_stride(k_norm, "k_norm"), k_cent.data_ptr<float>(), KL, v_codes.data_ptr<uint8_t>(), \
      head_stride(v_codes, "v_codes"), v_norm.data_ptr<at::Half>(), head_stride(v_norm, "v_norm"), v_cent.data_ptr<float>(), VL, B * H, \
      static_cast<int>(R), T, static_cast<float>(scale), sk, tn, P)
    if (kb == 3) {
      if (R == 1) KVP_TQ(true, 1); else if (R <= 4) KVP_TQ(true, 4); else if (R <= 8) KVP_TQ(true, 8); else KVP_TQ(true, 16);
    } else {
      if (R == 1) KVP_TQ(false, 1); else if (R <= 4) KVP_TQ(false, 4); else if (R <= 8) KVP_TQ(false, 8); else KVP_TQ(false, 16);
    }
#undef KVP_TQ
  }
  P.merge(out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>());
  return out;
}

template <typename KT, typename VT>
void dense_dispatch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& ks, const torch::Tensor& v, const torch::Tensor& vs,
                    double scale, const Skip& skip, Partials& P) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3), T = k.size(2), dv = v.size(3);
  dense_attention_impl<KT, VT>(q.data_ptr<float>(), k.data_ptr<KT>(), head_stride(k, "k"), ks.numel() ? ks.data_ptr<at::Half>() : nullptr,
                               ks.numel() ? head_stride(ks, "k_scale") : 0, v.data_ptr<VT>(), head_stride(v, "v"),
                               vs.numel() ? vs.data_ptr<at::Half>() : nullptr, vs.numel() ? head_stride(vs, "v_scale") : 0, B * H,
                               static_cast<int>(R), T, static_cast<int>(d), static_cast<int>(dv), static_cast<float>(scale), skip, P);
}

std::vector<torch::Tensor> dense_attention(torch::Tensor q, torch::Tensor k, torch::Tensor k_scale, torch::Tensor v, torch::Tensor v_scale,
                                           double scale, torch::Tensor skip) {
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

// keys: codes (B, groups, T, nbytes) u8 rows; bitpos (rank,) i32; bits (rank,) u8; qmax (rank,) f32;
// basis_t (groups, rank, gdim) f32 with coefficient and basis scales folded in (empty when w8 is given); mean
// (groups, gdim) f32; w8, col_scale, mean8: basis_t's integer form for the VNNI rebuild, or empty tensors.
// values: idx (B, kv, T, vbytes) u8 rows of vbits-bit indices; norm (B, kv, T, 1) f16 or empty;
// books (1 or kv, entries, gsize) f16 (the codec's own, widened here per call: a few KB) or f32. pos0 (B,) i64: RoPE
// position of token 0; inv_freq (d/2,) f32.
std::vector<torch::Tensor> pca_vq_attention(torch::Tensor q, torch::Tensor pos0, torch::Tensor inv_freq, double rope_scale,
                                            torch::Tensor codes, torch::Tensor bitpos, torch::Tensor bits, torch::Tensor qmax,
                                            torch::Tensor basis_t, torch::Tensor mean, torch::Tensor idx, int64_t vbits,
                                            torch::Tensor norm, torch::Tensor books, double scale, torch::Tensor w8,
                                            torch::Tensor col_scale, torch::Tensor mean8, torch::Tensor skip) {
  q = q.contiguous();
  pos0 = pos0.contiguous();
  books = books.to(at::kFloat).contiguous();
  const int64_t B = q.size(0), kv = q.size(1), R = q.size(2), d = q.size(3), T = codes.size(2);
  auto out = partial_outputs(q, d);
  // Sizes come from mean (groups, gdim) and qmax (rank,): basis_t may be empty when its integer form w8 is given.
  const int groups = static_cast<int>(mean.size(0)), rank = static_cast<int>(qmax.numel()), gdim = static_cast<int>(mean.size(1));
  TORCH_CHECK(groups > 0 && kv % groups == 0, "kv heads must be a multiple of the PCA groups");
  const bool integer = kInt8Rebuild && w8.numel();
  TORCH_CHECK(integer || basis_t.numel() == static_cast<int64_t>(groups) * rank * gdim, "basis_t must be (groups, rank, gdim) unless w8 is given");
  Partials P(B * kv, R, d, split_count(T));
  if (T > 0) {
    PCAKeys K{component_runs(bitpos.data_ptr<int32_t>(), bits.data_ptr<uint8_t>(), rank), codes.data_ptr<uint8_t>(), head_stride(codes, "codes"), static_cast<int>(codes.size(3)), bitpos.data_ptr<int32_t>(),
              qmax.data_ptr<float>(), rank, bits.data_ptr<uint8_t>(), basis_t.numel() ? basis_t.data_ptr<float>() : nullptr,
              mean.data_ptr<float>(), groups, gdim};
    VQValues V{idx.data_ptr<uint8_t>(), head_stride(idx, "idx"), static_cast<int>(idx.size(3)), static_cast<int>(vbits),
               norm.numel() ? norm.data_ptr<at::Half>() : nullptr, norm.numel() ? head_stride(norm, "norm") : 0,
               books.data_ptr<float>(), static_cast<int>(books.size(0)), static_cast<int>(books.size(1)), static_cast<int>(books.size(2))};
    if (integer) {
      TORCH_CHECK(w8.dim() == 4 && w8.size(0) == groups && w8.size(2) == K.gdim && w8.size(3) == 4 && 4 * w8.size(1) >= K.rank,
                  "w8 must be (groups, ceil(rank / 4), gdim, 4)");
      K.w8 = w8.data_ptr<int8_t>();
      K.col_scale = col_scale.data_ptr<float>();
      K.mean8 = mean8.data_ptr<float>();
      K.rank4 = static_cast<int>(w8.size(1));
    }
    std::vector<double> freq(d / 2);
    for (int64_t j = 0; j < d / 2; ++j) freq[j] = inv_freq.data_ptr<float>()[j];
    pca_vq_attention_impl(q.data_ptr<float>(), K, V, pos0.data_ptr<int64_t>(), freq.data(), static_cast<float>(rope_scale), B,
                          static_cast<int>(kv), static_cast<int>(R), static_cast<int>(d), T, static_cast<float>(scale), make_skip(skip), P);
  }
  P.merge(out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>());
  return out;
}

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
  for (int64_t i = 0; i < rows; ++i) {
    float mx = -INFINITY;
    for (const auto& m : ms) mx = std::max(mx, m.data_ptr<float>()[i]);
    float total = 0.f;
    for (size_t p = 0; p < ms.size(); ++p) {
      const float l = ls[p].data_ptr<float>()[i];
      if (l == 0.f) continue;
      const float w = std::exp(ms[p].data_ptr<float>()[i] - mx);
      total += w * l;
      const float* src = os[p].data_ptr<float>() + i * d;
      for (int64_t j = 0; j < d; ++j) dst[i * d + j] += w * src[j];
    }
    const float inv = 1.f / std::max(total, 1e-30f);
    for (int64_t j = 0; j < d; ++j) dst[i * d + j] *= inv;
  }
  return out;
}

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
  float* dst = out.data_ptr<float>();
  for (int64_t row = 0; row < B * H * R; ++row) {
    const int64_t h = (row / R) % H;
    const float* xr = xs + row * D;
    float* o = dst + row * E;
    for (int64_t e = 0; e < E; ++e) o[e] = affine ? s.data_ptr<float>()[row] * bias.data_ptr<float>()[h * E + e] : 0.f;
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
  float* dst = out.data_ptr<float>();
  const float norm = 1.f / std::sqrt(static_cast<float>(D));
  for (int64_t row = 0; row < B * H * R; ++row) {
    const int64_t h = (row / R) % H;
    float* y = dst + row * D;
    const float* xr = xs + row * D;
    for (int64_t j = 0; j < D; ++j) y[j] = has_pre ? xr[j] * pre.data_ptr<float>()[h * D + j] : xr[j];
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
      if (has_post) v *= post.data_ptr<float>()[h * D + j];
      if (affine) v += s.data_ptr<float>()[row] * bias.data_ptr<float>()[h * D + j];
      y[j] = v;
    }
  }
  return out;
}

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
std::vector<torch::Tensor> nearest_codeword(torch::Tensor x, torch::Tensor centroids) {
  x = x.contiguous();
  const int64_t G = x.size(0), N = x.size(1), D = x.size(2), K = centroids.size(1);
  TORCH_CHECK(centroids.size(0) == G && centroids.size(2) == D && K >= 1, "nearest_codeword: centroids must be (G, K>=1, D)");
  const int64_t Kp = (K + 15) / 16 * 16;
  auto ct = torch::full({G, D, Kp}, std::numeric_limits<float>::infinity(), x.options());  // padding never wins
  ct.narrow(2, 0, K).copy_(centroids.transpose(1, 2));
  auto index = torch::empty({G, N}, x.options().dtype(torch::kInt64));
  auto dist = torch::empty({G, N}, x.options());
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
torch::Tensor d2_picks(torch::Tensor x, torch::Tensor first, torch::Tensor u) {
  x = x.contiguous();
  first = first.contiguous();
  u = u.contiguous();
  const int64_t G = x.size(0), N = x.size(1), D = x.size(2), draws = u.size(1);
  TORCH_CHECK(first.numel() == G && u.size(0) == G && N >= 1, "d2_picks: first (G,), u (G, k - 1), N >= 1");
  auto picks = torch::empty({G, draws + 1}, first.options());
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lut_scores", &lut_scores, "TurboQuant scores from a per-unit lookup table of query x centroid partial sums");
  m.def("lut_weighted_sum", &lut_weighted_sum, "TurboQuant probability-weighted centroid sum, rotated space");
  m.def("int8_scores", &int8_scores, "q . int8 codes, per-token scale factored out");
  m.def("int8_weighted_sum", &int8_weighted_sum, "sum_t p * scale * int8 codes");
  m.def("tq_attention", &tq_attention, "online-softmax partial (m, l, o) over a TurboQuant K/V segment, V in the rotated space");
  m.def("int8_rebuild", [] { return kInt8Rebuild; }, "whether this build rebuilds Shard keys with VNNI integer products");
  m.def("pca_vq_attention", &pca_vq_attention, "online-softmax partial over Shard's PCA-coefficient keys and VQ values (rotated space)");
  m.def("merge_partials", &merge_partials, "normalized attention from per-part (m, l, o) partials, merged by log-sum-exp");
  m.def("quantize_pack", &quantize_pack, "bucketize against sorted boundaries and bit-pack LSB-first, one pass per row");
  m.def("head_matmul", &head_matmul, "x @ w[h] (+ s * bias[h]) per head, on the calling thread (a few decode rows)");
  m.def("fwht_rows", &fwht_rows, "FWHT(x * pre[h]) * post[h] (+ s * bias[h]) per row, on the calling thread (a few decode rows)");
  m.def("nearest_codeword", &nearest_codeword, "index and squared distance of each point's nearest codeword, (G, N, D) vs (G, K, D)");
  m.def("d2_picks", &d2_picks, "k-means++ seed indices from pre-drawn uniforms, (G, N, D) points");
  m.def("trellis_encode", &trellis_encode, "symbols of tail-biting bitshift-trellis paths (two Viterbi passes), float32 costs");
  m.def("dense_attention", &dense_attention, "online-softmax partial (m, l, o) over int8 (scaled), fp16 or fp32 K/V");
}
