// Shard segments: PCA-coefficient keys stored without RoPE, VQ values.
#include "softmax.h"

namespace kvpack {
namespace {

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

// Index rows of BITS-bit codes (8 codes fill BITS bytes exactly) widened to one byte per code: n rows of nbytes
// into out (n, groups). The accumulation loops then read bytes, as for 8-bit indices: read per code with
// variable shifts, a 64-entry (6-bit) codebook's rows were ~40% of the kernel.
template <int BITS>
void unpack_rows(const uint8_t* src, int64_t n, int nbytes, int groups, uint8_t* out) {
  constexpr uint64_t mask = (1u << BITS) - 1;
  if (groups * BITS == 8 * nbytes) {  // rows without padding bits: one stream of n * groups codes, read 8 bytes at a time
    const int64_t total = n * groups, bytes = n * nbytes;
    int64_t k = 0;
    for (; k + 8 <= total && k / 8 * BITS + 8 <= bytes; k += 8) {
      uint64_t w;
      std::memcpy(&w, src + k / 8 * BITS, sizeof(w));  // little-endian: code u sits at bit u * BITS
      for (int u = 0; u < 8; ++u) out[k + u] = static_cast<uint8_t>((w >> (u * BITS)) & mask);
    }
    for (; k < total; ++k) out[k] = static_cast<uint8_t>(read_code(src, static_cast<int>(bytes), static_cast<int>(k * BITS), BITS));
    return;
  }
  for (int64_t t = 0; t < n; ++t, src += nbytes, out += groups) {
    int k = 0;
    for (; k + 8 <= groups; k += 8) {
      uint64_t w = 0;
      std::memcpy(&w, src + k / 8 * BITS, BITS);  // little-endian: code u sits at bit u * BITS
      for (int u = 0; u < 8; ++u) out[k + u] = static_cast<uint8_t>((w >> (u * BITS)) & mask);
    }
    for (; k < groups; ++k) out[k] = static_cast<uint8_t>(read_code(src, nbytes, k * BITS, BITS));
  }
}

void unpack_indices(const uint8_t* src, int64_t n, int nbytes, int bits, int groups, uint8_t* out) {
  switch (bits) {
    case 1: unpack_rows<1>(src, n, nbytes, groups, out); break;
    case 2: unpack_rows<2>(src, n, nbytes, groups, out); break;
    case 3: unpack_rows<3>(src, n, nbytes, groups, out); break;
    case 4: unpack_rows<4>(src, n, nbytes, groups, out); break;
    case 5: unpack_rows<5>(src, n, nbytes, groups, out); break;
    case 6: unpack_rows<6>(src, n, nbytes, groups, out); break;
    default: unpack_rows<7>(src, n, nbytes, groups, out); break;
  }
}

// acc[r][:] += sum_t p[r][t] * norm[t] * codeword-row(t) for one kv head over n tokens; idx holds one byte per
// index (8-bit rows as stored, narrower ones widened by unpack_indices), nbytes per token row.
void vq_accumulate(const float* p, int R, int64_t n, const VQValues& V, const uint8_t* idx, int nbytes, const at::Half* norm, const float* book,
                   int d, float* acc, float* rows) {
  const int groups = d / V.gsize;
  for (int64_t t = 0; t < n; t += 4) {
    const int c = static_cast<int>(std::min<int64_t>(4, n - t));
    for (int i = 0; i < 4; ++i) {
      float* row = rows + i * d;
      if (i >= c) { std::fill(row, row + d, 0.f); continue; }
      const uint8_t* src = idx + (t + i) * nbytes;
      if (V.gsize == 4) {  // the default layout: a fixed-size copy inlines (a runtime size calls memcpy)
        for (int gi = 0; gi < groups; ++gi) std::memcpy(row + gi * 4, book + static_cast<int64_t>(src[gi]) * 4, sizeof(float) * 4);
        continue;
      }
      for (int gi = 0; gi < groups; ++gi) {
        const float* cw = book + static_cast<int64_t>(src[gi]) * V.gsize;
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
// vq_accumulate for groups of 4 with d a multiple of 64 (one byte per index), RB rows at a time:
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
    std::vector<uint8_t> wide(V.bits == 8 ? 0 : kSplit * static_cast<int64_t>(d / V.gsize));
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
        int nbytes = V.nbytes;
        if (V.bits != 8) {  // one byte per index for the loops below
          unpack_indices(idx, n, V.nbytes, V.bits, d / V.gsize, wide.data());
          idx = wide.data();
          nbytes = d / V.gsize;
        }
#ifdef __AVX512F__
        if (V.gsize == 4 && d % 64 == 0) {
          vq_accumulate_g4(srow, R, n, idx, nbytes, nrm, book, d, P.o.data() + item * R * d);
          continue;
        }
#endif
        vq_accumulate(srow, R, n, V, idx, nbytes, nrm, book, d, P.o.data() + item * R * d, rows.data());
      }
    }
  });
}

// keys: codes (B, groups, T, nbytes) u8 rows; bitpos (rank,) i32; bits (rank,) u8; qmax (rank,) f32;
// basis_t (groups, rank, gdim) f32 with coefficient and basis scales folded in (empty when w8 is given); mean
// (groups, gdim) f32; w8, col_scale, mean8: basis_t's integer form for the VNNI rebuild, or empty tensors.
// values: idx (B, kv, T, vbytes) u8 rows of vbits-bit indices; norm (B, kv, T, 1) f16 or empty;
// books (1 or kv, entries, gsize) f16 (the codec's own, widened here per call: a few KB) or f32. pos0 (B,) i64: RoPE
// position of token 0; inv_freq (d/2,) f32.
std::vector<at::Tensor> pca_vq_attention(at::Tensor q, at::Tensor pos0, at::Tensor inv_freq, double rope_scale,
                                            at::Tensor codes, at::Tensor bitpos, at::Tensor bits, at::Tensor qmax,
                                            at::Tensor basis_t, at::Tensor mean, at::Tensor idx, int64_t vbits,
                                            at::Tensor norm, at::Tensor books, double scale, at::Tensor w8,
                                            at::Tensor col_scale, at::Tensor mean8, at::Tensor skip) {
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

}  // namespace
}  // namespace kvpack

KVPACK_BIND(m) {
  using namespace kvpack;
  m.def("int8_rebuild", [] { return kInt8Rebuild; }, "whether this build rebuilds Shard keys with VNNI integer products");
  m.def("pca_vq_attention", &pca_vq_attention, "online-softmax partial over Shard's PCA-coefficient keys and VQ values (rotated space)");
}
