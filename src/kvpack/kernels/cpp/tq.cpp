// TurboQuant: scalar codes read through per-unit lookup tables, trellis codes decoded in L1 (trellis values beside
// scalar keys keep the keys' tables: tq_attention_impl with VBITS = 0).
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
#include "softmax.h"

namespace kvpack {
namespace {

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

// Scores of one block of tokens for one row block: out[w][t] = norm[t] * sum_u tab[u][idx][w]. Token t's codes start
// at codes + t * cstride and its norm is norm[t * nstride] (a segment's own tensors: nbytes and 1; a paged pool's
// rows: the row size in bytes and in halves).
template <bool PAIR3, int W>
void score_tokens(const float* tables, const uint8_t* codes, const at::Half* norm, int64_t t0, int64_t t1, const Layout& L,
                  float* out, int64_t T, int rows, int64_t cstride, int64_t nstride) {
  using V = typename VecT<W>::type;
  constexpr int TT = 4;  // tokens in flight: independent add chains hide the add latency
  const int64_t unit_stride = static_cast<int64_t>(L.entries) * W;
  V buf[kBlock];
  int64_t t = t0;
  for (; t < t1; t += TT) {
    const int n = static_cast<int>(std::min<int64_t>(TT, t1 - t));
    const uint8_t* r[TT];
    for (int i = 0; i < TT; ++i) r[i] = codes + (t + std::min(i, n - 1)) * cstride;  // short tail: repeat the last row
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
    for (int64_t i = t0; i < t1; ++i) out[w * T + i] = buf[i - t0][w] * static_cast<float>(norm[i * nstride]);
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
      score_tokens<PAIR3, W>(table.data(), codes + bh * T * L.nbytes, norm + bh * T, t0, t1, L, out + (bh * R + r0) * T, T, rows, L.nbytes, 1);
    }
  });
}

// acc[r][:] += sum_t p[r][t] * norm[t] * row_t over tokens [t0, t1), where row_t is token t's
// centroid vector, decoded TT tokens at a time through the unit -> floats table `dec` (L1-sized). Strides as in
// score_tokens.
template <int BITS>
void accumulate_tokens(const float* p, const uint8_t* codes, const at::Half* norm, int64_t t0, int64_t t1, const Layout& L,
                       int64_t T, int R, const float* dec, float* rows_buf, float* __restrict acc, int64_t cstride, int64_t nstride) {
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
      const uint8_t* code_row = codes + (t + i) * cstride;
      for (int u = 0; u < L.units; ++u)
        std::memcpy(rw[i] + u * CPU, dec + unit_index<PAIR3>(code_row, u, L.nbytes) * CPU, sizeof(float) * CPU);
    }
    for (int r = 0; r < R; ++r) {
      float w[TT] = {};
      for (int i = 0; i < n; ++i) w[i] = p[r * T + t + i] * static_cast<float>(norm[(t + i) * nstride]);
      float* __restrict a = acc + r * L.d;
      const float *r0 = rw[0], *r1 = rw[1], *r2 = rw[2], *r3 = rw[3];
      for (int j = 0; j < L.d; ++j) a[j] += w[0] * r0[j] + w[1] * r1[j] + w[2] * r2[j] + w[3] * r3[j];
    }
  }
}


// accumulate_tokens' sum for codes that no unit table decodes (trellis values): `dec(row, dst)` widens token t's codes
// (codes + t * cstride) into d floats in `rows_buf` (4 rows, L1), four tokens at a time, then the same pass over acc.
template <typename Dec>
void accumulate_decoded(const float* p, const uint8_t* codes, const at::Half* norm, int64_t t0, int64_t t1, int d, int64_t T, int R,
                        const Dec& dec, float* rows_buf, float* __restrict acc, int64_t cstride, int64_t nstride) {
  constexpr int TT = 4;
  for (int64_t t = t0; t < t1; t += TT) {
    const int n = static_cast<int>(std::min<int64_t>(TT, t1 - t));
    for (int i = 0; i < n; ++i) dec(codes + (t + i) * cstride, rows_buf + i * d);
    for (int r = 0; r < R; ++r) {
      float w[TT] = {};  // rows past n keep earlier finite values and take weight 0
      for (int i = 0; i < n; ++i) w[i] = p[r * T + t + i] * static_cast<float>(norm[(t + i) * nstride]);
      float* __restrict a = acc + r * d;
      const float *r0 = rows_buf, *r1 = r0 + d, *r2 = r1 + d, *r3 = r2 + d;
      for (int j = 0; j < d; ++j) a[j] += w[0] * r0[j] + w[1] * r1[j] + w[2] * r2[j] + w[3] * r3[j];
    }
  }
}


template <int BITS>
void lut_weighted_sum_impl(const float* p, const uint8_t* codes, const at::Half* norm, const float* cent, int64_t BH, int R, int64_t T,
                           const Layout& L, float* out) {
  std::vector<float> dec(static_cast<int64_t>(L.entries) * L.cpu);
  for (int e = 0; e < L.entries; ++e)
    for (int k = 0; k < L.cpu; ++k) dec[e * L.cpu + k] = cent[(e >> (k * L.bits)) & L.mask];
  sliced_weighted_sum(BH, R, T, L.d, static_cast<int64_t>(L.units) * L.cpu, out, [&](int64_t bh, int64_t t0, int64_t t1, float* rows, float* acc) {
    accumulate_tokens<BITS>(p + bh * R * T, codes + bh * T * L.nbytes, norm + bh * T, t0, t1, L, T, R, dec.data(), rows, acc, L.nbytes, 1);
  });
}

// Row block width W (lanes of one table entry): the smallest of 1, 4, 8, 16 that holds R rows.
void lut_scores_dispatch(int bits, const float* q, const uint8_t* codes, const at::Half* norm, const float* cent, int64_t BH, int R,
                         int64_t T, const Layout& L, float* out) {
  auto run = R == 1 ? lut_scores_impl<false, 1> : R <= 4 ? lut_scores_impl<false, 4> : R <= 8 ? lut_scores_impl<false, 8> : lut_scores_impl<false, 16>;
  if (bits == 3) run = R == 1 ? lut_scores_impl<true, 1> : R <= 4 ? lut_scores_impl<true, 4> : R <= 8 ? lut_scores_impl<true, 8> : lut_scores_impl<true, 16>;
  run(q, codes, norm, cent, BH, R, T, L, out);
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
  const int64_t* pair = nullptr;  // (H, M) or, one state per batch row, (B, H, M): RoPE pair index i_m (< d/2); padding repeats a pair whose μ is 0
  const float* mu = nullptr;      // (H, M, 2) or (B, H, M, 2): s·(μ_a, μ_b)
  const double* freq = nullptr;   // (d/2,) θ of every pair (the layer's inv_freq)
  const float* w = nullptr;       // (d/2, 2, 64) cos(jθ), sin(jθ) of every pair: one table per model, shared
  const int64_t* pos0 = nullptr;  // (B,) RoPE position of the segment's token 0
  int64_t H = 1;
  int M = 0;
  int d = 0;
  bool per_row = false;  // pair and mu hold one state per batch row
};
constexpr int kTurnTile = 64;

void add_turning_scores(const Turning& tn, int64_t bh, int R, int64_t t0, int64_t n, float* s) {
  const int M = tn.M, half = tn.d / 2;
  const int64_t h = bh % tn.H, b = bh / tn.H;
  const int64_t state = tn.per_row ? bh : h;  // which (row,) head's pairs and means
  const int64_t* pair = tn.pair + state * M;
  const float* mu = tn.mu + state * M * 2;

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

// Scalar keys scored through their unit tables; values VBITS-bit scalar codes through a unit -> floats table, or, with
// VBITS = 0, trellis codes widened by `vrows` (a TrellisRows: the values' side of `+tcqv`), so a segment whose keys are
// scalar keeps the table-scored keys whatever its values are.
template <bool PAIR3, int W, int VBITS, typename VRows = std::nullptr_t>
void tq_attention_impl(const float* q, const float* row_off, const uint8_t* kc, int64_t k_bh, const at::Half* kn, int64_t kn_bh,
                       const float* kcent, const Layout& KL, const uint8_t* vc, int64_t v_bh, const at::Half* vn, int64_t vn_bh,
                       const float* vcent, const Layout& VL, int64_t BH, int R, int64_t T, float scale, const Skip& skip, const Turning& tn,
                       Partials& P, const VRows& vrows = nullptr) {
  const int64_t splits = P.splits;
  const int64_t unit_stride = static_cast<int64_t>(KL.entries) * W;
  std::vector<float> dec;
  if constexpr (VBITS != 0) {
    dec.resize(static_cast<int64_t>(VL.entries) * VL.cpu);
    for (int e = 0; e < VL.entries; ++e)
      for (int k = 0; k < VL.cpu; ++k) dec[e * VL.cpu + k] = vcent[(e >> (k * VL.bits)) & VL.mask];
  }
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
                               s.data(), n, R, KL.nbytes, 1);
      if (tn.M) add_turning_scores(tn, bh, R, t0, n, s.data());
      for (int r = 0; r < R; ++r) {
        const float off = row_off ? row_off[bh * R + r] : 0.f;
        for (int64_t t = 0; t < n; ++t) s[r * n + t] = (s[r * n + t] + off) * scale;
      }
      skip.apply(s.data(), n, R, t0, n);
      float* pm = P.m.data() + i * R;
      float* pl = P.l.data() + i * R;
      softmax_rows(s.data(), n, R, n, pm, pl);
      if constexpr (VBITS == 0)
        accumulate_decoded(s.data(), vc + bh * v_bh + t0 * VL.nbytes, vn + bh * vn_bh + t0, 0, n, VL.d, n, R, vrows, rows_buf.data(),
                           P.o.data() + i * R * VL.d, VL.nbytes, 1);
      else
        accumulate_tokens<VBITS>(s.data(), vc + bh * v_bh + t0 * VL.nbytes, vn + bh * vn_bh + t0, 0, n, VL, n, R, dec.data(), rows_buf.data(),
                                 P.o.data() + i * R * VL.d, VL.nbytes, 1);
    }
  });
}

// -- a paged pool of TurboQuant rows ----------------------------------------------------------------
//
// Rows read where they lie (PagedPool, softmax.h): work items are (b, head, split of up to kSplit tokens of
// [start[b], end[b])), each split walked block run by block run, with the kernels above at a row stride of C bytes.
template <bool PAIR3, int W, int VBITS>
void tq_paged_impl(const float* q, const float* row_off, const PagedPool& pp, const int64_t* start, const int64_t* end, const float* kcent,
                   const Layout& KL, const float* vcent, const Layout& VL, int64_t B, int R, float scale, Partials& P) {
  const int64_t H = pp.H, splits = P.splits, cstride = pp.C, nstride = pp.C / 2;
  const int64_t unit_stride = static_cast<int64_t>(KL.entries) * W;
  std::vector<float> dec(static_cast<int64_t>(VL.entries) * VL.cpu);
  for (int e = 0; e < VL.entries; ++e)
    for (int k = 0; k < VL.cpu; ++k) dec[e * VL.cpu + k] = vcent[(e >> (k * VL.bits)) & VL.mask];
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += std::max<int64_t>(0, end[b] - start[b]) * H * R;
  for_items(B * H * splits, work, [&](const auto& next) {
    std::vector<float> table(KL.units * unit_stride);
    std::vector<float> s(static_cast<int64_t>(R) * kSplit);
    std::vector<float> rows_buf(4 * static_cast<int64_t>(VL.units) * VL.cpu, 0.f);
    int64_t built = -1;
    for (int64_t i; (i = next()) >= 0;) {
      const int64_t bh = i / splits, sp = i % splits, b = bh / H, h = bh % H;
      const int64_t t0 = start[b] + sp * kSplit, t1 = std::min(end[b], t0 + kSplit), n = t1 - t0;
      if (n <= 0) {  // a shorter sequence: no token here (m = -inf, l = 0, o = 0: the merge's max and sums skip it)
        for (int r = 0; r < R; ++r) P.m[i * R + r] = -INFINITY;
        continue;
      }
      if (bh != built) {
        for (int u = 0; u < KL.units; ++u)
          build_unit_table<W>(q + bh * R * KL.d, KL.d, R, u * KL.cpu, KL, kcent, table.data() + u * unit_stride);
        built = bh;
      }
      paged_runs(pp, b, h, t0, t1, [&](int64_t t, int64_t run, const uint8_t* kc, const at::Half* kn, const uint8_t*, const at::Half*) {
        score_tokens<PAIR3, W>(table.data(), kc, kn, 0, run, KL, s.data() + (t - t0), n, R, cstride, nstride);
      });
      for (int r = 0; r < R; ++r) {
        const float off = row_off ? row_off[bh * R + r] : 0.f;
        for (int64_t t = 0; t < n; ++t) s[r * n + t] = (s[r * n + t] + off) * scale;
      }
      float* pm = P.m.data() + i * R;
      float* pl = P.l.data() + i * R;
      softmax_rows(s.data(), n, R, n, pm, pl);
      float* acc = P.o.data() + i * R * VL.d;
      paged_runs(pp, b, h, t0, t1, [&](int64_t t, int64_t run, const uint8_t*, const at::Half*, const uint8_t* vc, const at::Half* vn) {
        accumulate_tokens<VBITS>(s.data() + (t - t0), vc, vn, 0, run, VL, n, R, dec.data(), rows_buf.data(), acc, cstride, nstride);
      });
    }
  });
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

std::unique_ptr<CodeRows> make_code_rows(const at::Tensor& table, int bits, int d) {
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

// tq_attention_impl for scalar keys at the values' width: vbits-bit scalar values, or trellis values widened by `vtr`.
template <bool PAIR3, int W>
void tq_attention_vbits(int vbits, const TrellisRows* vtr, const float* q, const float* row_off, const uint8_t* kc, int64_t k_bh,
                        const at::Half* kn, int64_t kn_bh, const float* kcent, const Layout& KL, const uint8_t* vc, int64_t v_bh,
                        const at::Half* vn, int64_t vn_bh, const float* vcent, const Layout& VL, int64_t BH, int R, int64_t T, float scale,
                        const Skip& skip, const Turning& tn, Partials& P) {
  if (vtr) {
    tq_attention_impl<PAIR3, W, 0>(q, row_off, kc, k_bh, kn, kn_bh, kcent, KL, vc, v_bh, vn, vn_bh, vcent, VL, BH, R, T, scale, skip, tn, P, *vtr);
    return;
  }
  auto run = vbits == 1 ? tq_attention_impl<PAIR3, W, 1> : vbits == 2 ? tq_attention_impl<PAIR3, W, 2>
           : vbits == 3 ? tq_attention_impl<PAIR3, W, 3> : tq_attention_impl<PAIR3, W, 4>;
  run(q, row_off, kc, k_bh, kn, kn_bh, kcent, KL, vc, v_bh, vn, vn_bh, vcent, VL, BH, R, T, scale, skip, tn, P, nullptr);
}

// tq_attention's form for segments with trellis keys (either kind of values): rows decoded in L1 (rows_attention_impl).
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

// Entry points: shapes were checked by the launcher; tensors are contiguous.
at::Tensor lut_scores(at::Tensor q, at::Tensor codes, at::Tensor norm, at::Tensor centroids, int64_t bits) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3), T = codes.size(2);
  auto out = at::empty({B, H, R, T}, q.options());
  if (out.numel() == 0) return out;
  const Layout L = make_layout(static_cast<int>(bits), static_cast<int>(d));
  lut_scores_dispatch(static_cast<int>(bits), q.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                     norm.data_ptr<at::Half>(), centroids.data_ptr<float>(), B * H, static_cast<int>(R), T, L, out.data_ptr<float>());
  return out;
}

at::Tensor lut_weighted_sum(at::Tensor p, at::Tensor codes, at::Tensor norm, at::Tensor centroids, int64_t bits, int64_t d) {
  const int64_t B = p.size(0), H = p.size(1), R = p.size(2), T = p.size(3);
  auto out = at::zeros({B, H, R, d}, p.options());
  if (out.numel() == 0 || T == 0) return out;
  const Layout L = make_layout(static_cast<int>(bits), static_cast<int>(d));
  const auto run = bits == 1 ? lut_weighted_sum_impl<1> : bits == 2 ? lut_weighted_sum_impl<2> : bits == 3 ? lut_weighted_sum_impl<3> : lut_weighted_sum_impl<4>;
  run(p.data_ptr<float>(), codes.data_ptr<uint8_t>(),
      norm.data_ptr<at::Half>(), centroids.data_ptr<float>(), B * H, static_cast<int>(R), T, L, out.data_ptr<float>());
  return out;
}

std::vector<at::Tensor> tq_attention(at::Tensor q, at::Tensor row_offset, at::Tensor k_codes, at::Tensor k_norm,
                                        at::Tensor k_cent, int64_t k_bits, at::Tensor v_codes, at::Tensor v_norm,
                                        at::Tensor v_cent, int64_t v_bits, double scale, at::Tensor skip,
                                        std::vector<at::Tensor> turning) {
  q = q.contiguous();
  if (row_offset.numel()) row_offset = row_offset.contiguous();
  // turning: empty, or {q (B, H, R, d) f32, pair (H, M) i64, mu (H, M, 2) f32, freq (d/2,) f64, w (d/2, 2, 64) f32, pos0 (B,) i64},
  // pair and mu with a leading B when each batch row holds its own means
  Turning tn;
  if (!turning.empty()) {
    TORCH_CHECK(turning.size() == 6, "turning takes 6 tensors: q, pair, mu, freq, w, pos0");
    for (auto& t : turning) t = t.contiguous();
    const bool per_row = turning[1].dim() == 3;
    const int64_t M = turning[1].size(-1);
    TORCH_CHECK(M <= 64 && turning[0].sizes() == q.sizes() && turning[1].size(-2) == q.size(1) && (!per_row || turning[1].size(0) == q.size(0)) &&
                    turning[2].dim() == turning[1].dim() + 1 && turning[2].numel() == turning[1].numel() * 2 && turning[3].scalar_type() == at::kDouble &&
                    turning[3].numel() == q.size(3) / 2 && turning[4].size(0) == q.size(3) / 2 && turning[4].size(2) == kTurnTile &&
                    turning[5].numel() == q.size(0),
                "turning tensors do not match the query: q (B, H, R, d), pair ([B,] H, M <= 64), mu ([B,] H, M, 2), freq (d/2,) f64, w (d/2, 2, 64), pos0 (B,)");
    tn = {turning[0].data_ptr<float>(), turning[1].data_ptr<int64_t>(), turning[2].data_ptr<float>(), turning[3].data_ptr<double>(),
          turning[4].data_ptr<float>(), turning[5].data_ptr<int64_t>(), q.size(1), static_cast<int>(M), static_cast<int>(q.size(3)), per_row};
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
    const bool k_trellis = k_cent.numel() != (int64_t{1} << kb), v_trellis = v_cent.numel() != (int64_t{1} << vb);
    // Scalar keys are scored through their tables whatever the values are; trellis values are then widened in L1.
    const auto vrows_ = !k_trellis && v_trellis ? make_code_rows(v_cent, vb, static_cast<int>(d)) : nullptr;
    const TrellisRows* vtr = vrows_ ? &vrows_->tr : nullptr;
    if (k_trellis) {  // trellis keys: every row decoded in L1 (a key's window has no per-unit table)
      const auto krows_ = make_code_rows(k_cent, kb, static_cast<int>(d)), vrows_ = make_code_rows(v_cent, vb, static_cast<int>(d));
      const CodeRows &krows = *krows_, &vrows = *vrows_;
      tq_rows_attention(q.data_ptr<float>(), off, k_codes.data_ptr<uint8_t>(), head_stride(k_codes, "k_codes"), k_norm.data_ptr<at::Half>(),
                        head_stride(k_norm, "k_norm"), krows, KL.nbytes, v_codes.data_ptr<uint8_t>(), head_stride(v_codes, "v_codes"),
                        v_norm.data_ptr<at::Half>(), head_stride(v_norm, "v_norm"), vrows, VL.nbytes, B * H, static_cast<int>(R), T,
                        static_cast<int>(d), static_cast<float>(scale), sk, tn, P);
      P.merge(out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>());
      return out;
    }
#define KVP_TQ(PAIR3, W) tq_attention_vbits<PAIR3, W>(vb, vtr, q.data_ptr<float>(), off, k_codes.data_ptr<uint8_t>(), head_stride(k_codes, "k_codes"), \
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

// Online-softmax partial over a paged pool's TurboQuant rows: q (B, H, R, d) f32 rotated for the key codec, row_offset
// (B, H, R, 1) f32 or empty, pool (blocks, H, bs, C) uint8, block_table (B, M) int64, start/end (B,) int64 each
// sequence's token range read, offsets (k_norm, v_norm, k_code, v_code) bytes within a row. Block ids and strides
// were checked by the launcher (kvpack.kernels.cpu_lut.tq_paged_attention); checked again here where cheap.
std::vector<at::Tensor> tq_paged_attention(at::Tensor q, at::Tensor row_offset, at::Tensor pool, at::Tensor block_table,
                                              at::Tensor start, at::Tensor end, std::vector<int64_t> offsets, at::Tensor k_cent,
                                              int64_t k_bits, at::Tensor v_cent, int64_t v_bits, double scale) {
  q = q.contiguous();
  if (row_offset.numel()) row_offset = row_offset.contiguous();
  block_table = block_table.contiguous();
  start = start.contiguous();
  end = end.contiguous();
  TORCH_CHECK(k_cent.numel() == (int64_t{1} << k_bits) && v_cent.numel() == (int64_t{1} << v_bits), "paged rows hold scalar codes");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3);
  TORCH_CHECK(R <= 16, "tq_paged_attention serves up to 16 query rows per kv head, got ", R);
  const Layout KL = make_layout(static_cast<int>(k_bits), static_cast<int>(d));
  const Layout VL = make_layout(static_cast<int>(v_bits), static_cast<int>(d));
  const auto [pp, longest] = paged_view(pool, block_table, start, end, offsets, B, H, KL.nbytes, VL.nbytes);
  const int64_t* st = start.data_ptr<int64_t>();
  const int64_t* en = end.data_ptr<int64_t>();
  auto out = partial_outputs(q, d);
  Partials P(B * H, R, d, split_count(longest));
  if (longest > 0) {
    const float* off = row_offset.numel() ? row_offset.data_ptr<float>() : nullptr;
    const int vb = static_cast<int>(v_bits);
#define KVP_TQP(PAIR3, W) { auto run = vb == 1 ? tq_paged_impl<PAIR3, W, 1> : vb == 2 ? tq_paged_impl<PAIR3, W, 2> \
      : vb == 3 ? tq_paged_impl<PAIR3, W, 3> : tq_paged_impl<PAIR3, W, 4>; \
      run(q.data_ptr<float>(), off, pp, st, en, k_cent.data_ptr<float>(), KL, v_cent.data_ptr<float>(), VL, B, static_cast<int>(R), \
          static_cast<float>(scale), P); }
    if (k_bits == 3) {
      if (R == 1) KVP_TQP(true, 1) else if (R <= 4) KVP_TQP(true, 4) else if (R <= 8) KVP_TQP(true, 8) else KVP_TQP(true, 16)
    } else {
      if (R == 1) KVP_TQP(false, 1) else if (R <= 4) KVP_TQP(false, 4) else if (R <= 8) KVP_TQP(false, 8) else KVP_TQP(false, 16)
    }
#undef KVP_TQP
  }
  P.merge(out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace kvpack

KVPACK_BIND(m) {
  using namespace kvpack;
  m.def("lut_scores", &lut_scores, "TurboQuant scores from a per-unit lookup table of query x centroid partial sums");
  m.def("lut_weighted_sum", &lut_weighted_sum, "TurboQuant probability-weighted centroid sum, rotated space");
  m.def("tq_attention", &tq_attention, "online-softmax partial (m, l, o) over a TurboQuant K/V segment, V in the rotated space");
  m.def("tq_paged_attention", &tq_paged_attention, "online-softmax partial (m, l, o) over a paged pool's TurboQuant rows, read through a block table");
}
