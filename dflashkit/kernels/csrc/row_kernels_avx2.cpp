// AVX2 + FMA kernels for the few rows of a decoding step (dflashkit/kernels/row_kernels.py), for CPUs without
// AVX512-BF16 (most laptops: Intel Core before and after the AVX512 years, AMD Zen 1-3), where torch's bf16 products
// of a few rows run at ~9 GFLOP/s. The same contract as row_kernels_avx512.cpp: each row is computed the same way whatever
// rows run beside it, so a verify pass over a block and one-token steps give bitwise the same results.
//
// Matrix product y = x @ W.T (+ bias), bf16 weights, fp32 arithmetic.
// The weight is packed once (dflashkit/kernels/row_kernels.py) into groups of 16 output columns:
//   packed[g][k2][0][c][p] = W[16 g + c][2 k2 + p]      shape [G, K/2, 1, 16, 2]
// so that one 64-byte line holds the (2 k2, 2 k2 + 1) weight pairs of 16 columns and a group's panel is one
// sequential stream. A 32-bit lane holds a pair: its high half is already the fp32 pattern of the odd weight,
// the low half shifted up is the even one, so unpacking costs one AND and one shift. x is turned into fp32 once;
// each output element is one fp32 FMA chain over k in order (2 k2, then 2 k2 + 1), whatever the number of rows.
//
// Weight-only int8 (dflashkit/kernels/int8.py): y = (x @ Q.T) * scale (+ bias), int8 Q, one fp32 scale per column.
// Packed once into an int8 tensor [G, 16 K + 64]: group g's K rows of its 16 columns' weights
//   packed[g][16 k + c] = Q[16 g + c][k]
// then the group's 16 scales as fp32 bytes. Half the bytes of bf16 to stream; each weight costs a sign extension
// and a conversion to fp32 (shared by the rows of a pass), then the same fp32 FMA chain in k order per element.
#include "row_common.h"

namespace {

constexpr const char* kIsa = "AVX2";
constexpr bool kInt8 = true;  // linear also takes int8-packed weights
constexpr int kBlocks = 1;    // 16-column blocks per group
constexpr int kGroup = 16;    // output columns per group
constexpr int kMaxRows = 4;   // rows per micro-kernel call: 8 accumulators, 4 weight vectors, 2 broadcasts
constexpr int64_t kRowBlock = 64;  // rows per pass over the weights (more rows: another pass)
constexpr int kPrefetch = 1024;  // bytes ahead in the weight stream (AMD Zen 1, one row: ~20% less time than without)


// 8 fp32 -> 8 bf16, round to nearest even (NaN -> 0x7FC0): torch's rounding of float to bfloat16
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline __m256 load_bf16(const uint16_t* p) {  // 8 bf16 -> fp32 (exact: shift into the high half)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load_bf16_n(const uint16_t* p, int64_t count) {  // the first count (< 8 allowed) of 8, zeros after
  if (count >= 8) return load_bf16(p);
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, count * sizeof(uint16_t));
  return load_bf16(tmp);
}
inline void store_bf16_n(uint16_t* p, int64_t count, __m256 v) {
  const __m128i packed = to_bf16(v);
  if (count >= 8) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed); return; }
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
  std::memcpy(p, tmp, count * sizeof(uint16_t));
}
inline __m256 load_f32_n(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, count * sizeof(float));
  return _mm256_load_ps(tmp);
}

// The sum of 8 lanes, always in the same pattern: (l + l+4), then pairs, then the two halves.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The lane sums of 8 vectors: lane j of the result is the sum of v[j]'s 8 lanes, added in the same pattern for
// every j ((0+1)+(2+3)) + ((4+5)+(6+7)).
inline __m256 sum_lanes8(const float (*v)[8]) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_load_ps(v[0]), _mm256_load_ps(v[1]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_load_ps(v[2]), _mm256_load_ps(v[3]));
  const __m256 t2 = _mm256_hadd_ps(_mm256_load_ps(v[4]), _mm256_load_ps(v[5]));
  const __m256 t3 = _mm256_hadd_ps(_mm256_load_ps(v[6]), _mm256_load_ps(v[7]));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 | v0..v3], [v4..v7 | v4..v7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// A tile's accumulators to y: times the group's scales (int8 weights; none for bf16), plus the fp32 bias, rounded to
// bf16 (nearest even); only the valid columns are stored
// (always inlined: as a call, its reference to acc made GCC keep the accumulators in memory through the k loop,
// 8 rows 1.36x slower)
template <int R, int P>
__attribute__((always_inline)) inline void store_tile(const __m256 (&acc)[P][R][2], const float* const (&scales)[P],
                                                      uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < 2; ++j) {
      const int64_t n0 = p * kGroup + j * 8;
      if (n0 >= valid) break;
      const int64_t count = valid - n0 < 8 ? valid - n0 : 8;
      const __m256 b = bias ? load_f32_n(bias + n0, count) : _mm256_setzero_ps();
      const float* scale = scales[p];
      _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) {
        const __m256 v = scale ? _mm256_mul_ps(acc[p][i][j], _mm256_loadu_ps(scale + j * 8)) : acc[p][i][j];
        store_bf16_n(y + i * ldy + n0, count, _mm256_add_ps(v, b));
      }
    }
}

// The micro kernels: R <= 4 rows times P = 1 or 2 groups (16 or 32 adjacent output columns, each group's panel a
// stream of its own, `stride` elements apart). Each output element is one fp32 FMA chain in k order, so P and R
// change the speed only: a chain waits ~5 cycles per FMA on Zen 1, and one row of one group has only 2 chains to
// keep the FMA pipe busy, so a single row takes two groups at a time (Zen 1: the LM head's one-row product ~25%
// faster, a one-token step ~2%). Two rows with P = 2 (16 accumulators: spills) were slower.
template <int R, int P>
void micro(const float* x, int64_t ldx, const uint16_t* w, int64_t stride, int64_t k2_count, uint16_t* y,
           int64_t ldy, int64_t valid, const float* bias) {
  __m256 acc[P][R][2];
  _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p)
    _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) acc[p][i][0] = acc[p][i][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k2 = 0; k2 < k2_count; ++k2) {
    _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p) {
      const __m256i* wk = reinterpret_cast<const __m256i*>(w + p * stride + k2 * 32);
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch, _MM_HINT_T0);  // (past a panel: the next one's)
      const __m256i p0 = _mm256_loadu_si256(wk), p1 = _mm256_loadu_si256(wk + 1);  // columns 0-7, 8-15
      const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16)), odd0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high));
      const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16)), odd1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high));
      _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) {
        const __m256 xe = _mm256_broadcast_ss(x + i * ldx + 2 * k2), xo = _mm256_broadcast_ss(x + i * ldx + 2 * k2 + 1);
        acc[p][i][0] = _mm256_fmadd_ps(xo, odd0, _mm256_fmadd_ps(xe, even0, acc[p][i][0]));
        acc[p][i][1] = _mm256_fmadd_ps(xo, odd1, _mm256_fmadd_ps(xe, even1, acc[p][i][1]));
      }
    }
  }
  const float* no_scales[P] = {};
  store_tile<R, P>(acc, no_scales, y, ldy, valid, bias);
}

// The same for int8 weights (layout at the top): per k, 16 int8 sign-extended and converted to fp32 once for the
// R rows; the group's scales follow its k_count * 16 weights.
template <int R, int P>
void micro_int8(const float* x, int64_t ldx, const int8_t* w, int64_t stride, int64_t k_count, uint16_t* y,
                int64_t ldy, int64_t valid, const float* bias) {
  __m256 acc[P][R][2];
  _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p)
    _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) acc[p][i][0] = acc[p][i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_count; ++k) {
    _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p) {
      const int8_t* wk = w + p * stride + k * kGroup;
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch, _MM_HINT_T0);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk));  // columns 0-15 at this k
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
      _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) {
        const __m256 xk = _mm256_broadcast_ss(x + i * ldx + k);
        acc[p][i][0] = _mm256_fmadd_ps(xk, w0, acc[p][i][0]);
        acc[p][i][1] = _mm256_fmadd_ps(xk, w1, acc[p][i][1]);
      }
    }
  }
  const float* scales[P];
  for (int p = 0; p < P; ++p) scales[p] = reinterpret_cast<const float*>(w + p * stride + k_count * kGroup);  // after the weights
  store_tile<R, P>(acc, scales, y, ldy, valid, bias);
}

struct Bf16Weights {
  using T = uint16_t;
  template <int R, int P>
  static void run(const float* x, int64_t ldx, const T* w, int64_t stride, int64_t steps, uint16_t* y, int64_t ldy,
                  int64_t valid, const float* bias) { micro<R, P>(x, ldx, w, stride, steps, y, ldy, valid, bias); }
};

struct Int8Weights {
  using T = int8_t;
  template <int R, int P>
  static void run(const float* x, int64_t ldx, const T* w, int64_t stride, int64_t steps, uint16_t* y, int64_t ldy,
                  int64_t valid, const float* bias) { micro_int8<R, P>(x, ldx, w, stride, steps, y, ldy, valid, bias); }
};

// r rows of one group (16 columns).
template <class K>
void run_rows(int64_t r, const float* x, int64_t ldx, const typename K::T* w, int64_t stride, int64_t steps,
              uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  switch (r) {
    case 1: K::template run<1, 1>(x, ldx, w, stride, steps, y, ldy, valid, bias); break;
    case 2: K::template run<2, 1>(x, ldx, w, stride, steps, y, ldy, valid, bias); break;
    case 3: K::template run<3, 1>(x, ldx, w, stride, steps, y, ldy, valid, bias); break;
    default: K::template run<4, 1>(x, ldx, w, stride, steps, y, ldy, valid, bias); break;
  }
}

// The rows of x (fp32 [m, k]) times a packed weight of `groups` panels `stride` elements apart (`steps` k or k-pair
// steps each), in row blocks, groups spread over the threads. A single row takes two groups per pass (4 FMA chains
// instead of 2); more rows run each group's rows in chunks of <= 4.
template <class K>
void each_group(int64_t m, int64_t k, int64_t groups, int64_t stride, int64_t steps, const float* xf,
                const typename K::T* wp, uint16_t* yp, int64_t n_out, const float* b) {
  auto valid_of = [&](int64_t g, int64_t count) {
    return n_out - g * kGroup < count * kGroup ? n_out - g * kGroup : count * kGroup;
  };
  if (m == 1) {
    at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t g = 2 * p0; g < 2 * p1 && g < groups; g += 2) {
        const float* bg = b ? b + g * kGroup : nullptr;
        if (g + 1 < groups) K::template run<1, 2>(xf, k, wp + g * stride, stride, steps, yp + g * kGroup, n_out, valid_of(g, 2), bg);
        else run_rows<K>(1, xf, k, wp + g * stride, stride, steps, yp + g * kGroup, n_out, valid_of(g, 1), bg);
      }
    });
    return;
  }
  for (int64_t block = 0; block < m; block += kRowBlock) {  // a prefill's rows: blocks whose fp32 x stays in cache
    const int64_t mb = m - block < kRowBlock ? m - block : kRowBlock;
    const float* xb = xf + block * k;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const float* bg = b ? b + g * kGroup : nullptr;
        const int64_t chunks = (mb + kMaxRows - 1) / kMaxRows;  // balanced: 6 rows run as 3 + 3, not 4 + 2
        for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
          const int64_t r = (mb - m0 + (chunks - c) - 1) / (chunks - c);
          run_rows<K>(r, xb + m0 * k, k, wp + g * stride, stride, steps, yp + (block + m0) * n_out + g * kGroup, n_out,
                      valid_of(g, 1), bg);
          m0 += r;
        }
      }
    });
  }
}

std::vector<float> rows_in_fp32(const torch::Tensor& x) {
  const int64_t count = x.numel();
  std::vector<float> xf(count);
  const uint16_t* xp = u16(x);
  for (int64_t i = 0; i < count; ++i) xf[i] = bf16_to_float(xp[i]);
  return xf;
}

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                          const c10::optional<torch::Tensor>& bias) {
  const LinearShape shape = check_linear_int8(x, packed, n_out, bias);
  const int64_t m = shape.m, k = shape.k, groups = shape.groups;
  const float* b = shape.bias;
  auto y = torch::empty({m, n_out}, x.options());
  const std::vector<float> xf = rows_in_fp32(x);
  each_group<Int8Weights>(m, k, groups, packed.size(1), k, xf.data(), packed.data_ptr<int8_t>(), u16w(y), n_out, b);
  return y;
}

}  // namespace

#include "row_int4.h"

bool ready() { return true; }  // nothing to ask the OS for

// x [M, K] bf16 contiguous; packed [G, K/2, 1, 16, 2] bf16 (or int8 [G, 16 K + 64], see above, or uint8 4-bit codes,
// see row_int4.h); bias [N] fp32 or
// None. Returns y [M, N] bf16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                     const c10::optional<torch::Tensor>& bias) {
  if (packed.scalar_type() == at::kChar) return linear_int8(x, packed, n_out, bias);
  if (packed.scalar_type() == at::kByte) return linear_int4(x, packed, n_out, bias);
  const LinearShape shape = check_linear(x, packed, n_out, bias, kBlocks);
  const int64_t k2_count = shape.k2_count;
  auto y = torch::empty({shape.m, n_out}, x.options());
  const std::vector<float> xf = rows_in_fp32(x);  // x in fp32, once
  each_group<Bf16Weights>(shape.m, shape.k, shape.groups, k2_count * 32, k2_count, xf.data(), u16(packed), u16w(y),
                          n_out, shape.bias);
  return y;
}

namespace {

// exp(x) for x <= 0 in fp32 (softmax after subtracting the max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// a degree-6 polynomial (relative error ~2e-7); below -87 it returns 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n for n in [-126, 0]: the exponent field
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, scale));
}

struct Attn {
  const uint16_t *q, *k, *v;
  uint16_t* out;
  const bool* hidden;  // [n, m] or null
  int64_t rows, n, m, k_head, v_head, d;
  float scale;
};

constexpr int kTile = 4;  // query rows that share each key and value vector loaded

// Rows r0..r0+T-1 of kv head h (all of them share its keys and values), CH = head_dim / 8.
// A key's score: 8 lanes of an FMA chain over the head dimension, summed by one transposed reduction for 8 keys
// (the same pattern for each), so it depends only on its query and key; the key is turned into fp32 once per tile.
// Softmax per row over the keys it sees (max, then exp and a lane-wise sum in the order of those keys, then
// sum8); out = sum over keys in key order of weight * value, hidden keys weighing +0 (adding +0 changes no
// sum), rounded once. A row's result is bitwise the one computed over only the keys it sees, whatever rows
// run beside it.
template <int T, int CH>
void attend_tile(const Attn& a, int64_t h, int64_t r0, int64_t m8, float* scores, float* probs, int64_t* seen) {
  constexpr int64_t d = CH * 8;
  const int64_t m = a.m;
  float qf[T][d];
  const bool* sees_not[T];
  int64_t limit[T];  // keys past it are hidden from the row
  int64_t keys_seen = 0;  // keys past it are hidden from every row of the tile
  for (int t = 0; t < T; ++t) {
    const int64_t i = (r0 + t) % a.n;
    const uint16_t* qr = a.q + (h * a.rows + r0 + t) * d;
    for (int64_t c = 0; c < d; ++c) qf[t][c] = bf16_to_float(qr[c]);
    sees_not[t] = a.hidden ? a.hidden + i * m : nullptr;
    int64_t last = m;
    if (sees_not[t]) while (last > 0 && sees_not[t][last - 1]) --last;
    limit[t] = last;
    keys_seen = last > keys_seen ? last : keys_seen;
  }
  alignas(32) float part[T][8][8];  // per row, 8 keys' fp32 partial sums (8 lanes each)
  const uint16_t* kh = a.k + h * a.k_head;
  for (int64_t j0 = 0; j0 < keys_seen; j0 += 8) {  // scores (hidden keys' are dropped below), 8 keys at a time
    const int64_t keys = keys_seen - j0 < 8 ? keys_seen - j0 : 8;
    for (int64_t jj = 0; jj < 8; ++jj) {
      if (jj >= keys) {  // past the last key: zeros, whose sums are ignored
        _Pragma("GCC unroll 4") for (int t = 0; t < T; ++t) _mm256_store_ps(part[t][jj], _mm256_setzero_ps());
        continue;
      }
      __m256 kv[CH];  // the key in fp32, once for the tile's rows
      _Pragma("GCC unroll 16") for (int c = 0; c < CH; ++c) kv[c] = load_bf16(kh + (j0 + jj) * d + c * 8);
      _Pragma("GCC unroll 4") for (int t = 0; t < T; ++t) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qf[t]), kv[0]);
        _Pragma("GCC unroll 16") for (int c = 1; c < CH; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf[t] + c * 8), kv[c], acc);
        _mm256_store_ps(part[t][jj], acc);
      }
    }
    const __m256 scale = _mm256_set1_ps(a.scale);
    _Pragma("GCC unroll 4") for (int t = 0; t < T; ++t)
      _mm256_storeu_ps(scores + t * m8 + j0, _mm256_mul_ps(sum_lanes8(part[t]), scale));
  }
  for (int t = 0; t < T; ++t) {  // softmax over the keys the row sees; scores[t] becomes the weights by key (0: hidden)
    float* w = scores + t * m8;
    float* p = probs + t * (m + 8);
    int64_t* idx = seen + t * m;
    int64_t count = 0;
    float best = -INFINITY;
    for (int64_t j = 0; j < limit[t]; ++j) {
      if (sees_not[t] && sees_not[t][j]) continue;
      p[count] = w[j];
      idx[count++] = j;
      best = w[j] > best ? w[j] : best;
    }
    __m256 total = _mm256_setzero_ps();  // lane l sums entries i = l mod 8, in order
    const __m256 top = _mm256_set1_ps(best);
    for (int64_t i0 = 0; i0 < count; i0 += 8) {
      const int64_t lanes = count - i0 < 8 ? count - i0 : 8;
      alignas(32) float es[8];
      _mm256_store_ps(es, exp_nonpositive(_mm256_sub_ps(load_f32_n(p + i0, lanes), top)));
      for (int64_t l = lanes; l < 8; ++l) es[l] = 0.0f;
      std::memcpy(p + i0, es, lanes * sizeof(float));
      total = _mm256_add_ps(total, _mm256_load_ps(es));
    }
    const float inv = 1.0f / sum8(total);
    for (int64_t j = 0; j < keys_seen; ++j) w[j] = 0.0f;
    for (int64_t c = 0; c < count; ++c) w[idx[c]] = p[c] * inv;
  }
  const uint16_t* vh = a.v + h * a.v_head;
  for (int c0 = 0; c0 < CH; c0 += 2) {  // out, 16 dimensions at a time: a chain over the keys in order
    __m256 acc[T][2];
    _Pragma("GCC unroll 4") for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < keys_seen; ++j) {
      const __m256 v0 = load_bf16(vh + j * d + c0 * 8), v1 = load_bf16(vh + j * d + c0 * 8 + 8);
      _Pragma("GCC unroll 4") for (int t = 0; t < T; ++t) {
        const __m256 wj = _mm256_broadcast_ss(scores + t * m8 + j);
        acc[t][0] = _mm256_fmadd_ps(wj, v0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(wj, v1, acc[t][1]);
      }
    }
    _Pragma("GCC unroll 4") for (int t = 0; t < T; ++t) {
      uint16_t* o = a.out + (h * a.rows + r0 + t) * d + c0 * 8;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16(acc[t][0]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8), to_bf16(acc[t][1]));
    }
  }
}

template <int CH, int T>
void attend_rows(const Attn& a, int64_t h, int64_t r0, int64_t left, int64_t m8, float* scores, float* probs,
                 int64_t* seen) {
  if constexpr (T > 1) {
    if (left < T) return attend_rows<CH, T - 1>(a, h, r0, left, m8, scores, probs, seen);
  }
  attend_tile<T, CH>(a, h, r0, m8, scores, probs, seen);
}

template <int CH>
void attend_calls(const std::vector<AttnCall>& calls, int64_t heads, int64_t d, float scale) {
  const int64_t count = static_cast<int64_t>(calls.size());
  std::vector<Attn> jobs;
  std::vector<int64_t> first_task(count + 1, 0), tiles(count);
  int64_t widest = 1;
  for (int64_t c = 0; c < count; ++c) {
    const AttnCall& call = calls[c];
    jobs.push_back(Attn{call.q, call.k, call.v, call.out, call.hidden, call.rows, call.n, call.m, call.k_head,
                        call.v_head, d, scale});
    tiles[c] = (call.rows + kTile - 1) / kTile;
    first_task[c + 1] = first_task[c] + heads * tiles[c];
    widest = call.m > widest ? call.m : widest;
  }
  const int64_t widest8 = (widest + 7) / 8 * 8;
  at::parallel_for(0, first_task[count], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kTile * widest8), probs(kTile * (widest + 8));
    std::vector<int64_t> seen(kTile * widest + 1);
    int64_t c = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first_task[c + 1]) ++c;
      const int64_t local = task - first_task[c], h = local / tiles[c], r0 = (local % tiles[c]) * kTile;
      const int64_t m8 = (jobs[c].m + 7) / 8 * 8;
      attend_rows<CH, kTile>(jobs[c], h, r0, jobs[c].rows - r0, m8, scores.data(), probs.data(), seen.data());
    }
  });
}

}  // namespace

// Grouped-query attention of several independent calls (AttnCall, row_common.h), fp32 inside, one query row at a
// time, in one parallel region over (call, kv head, tile of query rows); a row's result does not depend on the rows
// or calls beside it.
void attention_calls(const std::vector<AttnCall>& calls, int64_t heads, int64_t d, double scale) {
  if (calls.empty()) return;
  switch (d) {
    case 16: attend_calls<2>(calls, heads, d, static_cast<float>(scale)); break;
    case 32: attend_calls<4>(calls, heads, d, static_cast<float>(scale)); break;
    case 64: attend_calls<8>(calls, heads, d, static_cast<float>(scale)); break;
    default: attend_calls<16>(calls, heads, d, static_cast<float>(scale)); break;
  }
}

// Grouped-query attention (torch-level): one call of attention_calls.
// q [kv_heads, R, d] bf16 (the query heads sharing a key/value head stacked: row r is query row r % n);
// keys, values [kv_heads, m, d] bf16 with contiguous rows; hidden [n, m] bool (true: row i does not see key j)
// or None (every row sees every key). d: 16, 32, 64 or 128. Returns [kv_heads, R, d] bf16.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                        const c10::optional<torch::Tensor>& hidden, int64_t n, double scale) {
  const AttentionShape shape = check_attention(q, keys, values, hidden, n);
  auto out = torch::empty_like(q);
  attention_calls({attention_call(q, keys, values, shape, n, out)}, shape.heads, shape.d, scale);
  return out;
}

namespace {

// RMS norm of each row of x [rows, width] (row stride ld): out = bf16(bf16(x / rms(x)) * w), the sum of squares in fp32
// in a fixed order (8 lanes, then their sum), as transformers rounds (normalise in fp32, scale in bf16).
void rms_norm(const uint16_t* x, int64_t ld, int64_t rows, int64_t width, const uint16_t* w, float eps, uint16_t* out,
              int64_t ld_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * ld;
    __m256 sq = _mm256_setzero_ps();
    for (int64_t c = 0; c < width; c += 8) {
      const __m256 v = load_bf16_n(xr + c, width - c);
      sq = _mm256_fmadd_ps(v, v, sq);
    }
    const float scale = 1.0f / std::sqrt(sum8(sq) / static_cast<float>(width) + eps);
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t c = 0; c < width; c += 8) {
      const int64_t count = width - c;
      // round x / rms to bf16 first (transformers' .to(input_dtype)), then the bf16 product with the weight
      const __m256 h = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16(_mm256_mul_ps(load_bf16_n(xr + c, count), s))), 16));
      store_bf16_n(out + r * ld_out + c, count, _mm256_mul_ps(h, load_bf16_n(w + c, count)));
    }
  }
}

// x * cos + rotate_half(x) * sin for one head vector of d (rotate_half(x) = [-x2, x1]; `sin` is signed: its first half
// negated), in fp32, rounded once.
void rotate_into(const uint16_t* x, const uint16_t* cos, const uint16_t* sin_signed, int64_t d, uint16_t* out) {
  const int64_t half = d / 2;
  uint16_t rolled[256];  // x rolled by half the head: [x2, x1]
  std::memcpy(rolled, x + half, half * sizeof(uint16_t));
  std::memcpy(rolled + half, x, half * sizeof(uint16_t));
  for (int64_t c = 0; c < d; c += 8) {
    const int64_t count = d - c;
    const __m256 v = load_bf16_n(x + c, count), r = load_bf16_n(rolled + c, count);
    store_bf16_n(out + c, count, _mm256_fmadd_ps(v, load_bf16_n(cos + c, count),
                                                 _mm256_mul_ps(r, load_bf16_n(sin_signed + c, count))));
  }
}

// out = bf16(x + y), elementwise over count values
void add_into(uint16_t* x, const uint16_t* y, int64_t count) {
  for (int64_t c = 0; c < count; c += 8)
    store_bf16_n(x + c, count - c, _mm256_add_ps(load_bf16_n(x + c, count - c), load_bf16_n(y + c, count - c)));
}

// out = bf16(silu(gate) * up), silu(g) = g * sigmoid(g) with exp of -|g| only
void silu_mul(const uint16_t* gate, const uint16_t* up, int64_t count, uint16_t* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t c = 0; c < count; c += 8) {
    const int64_t left = count - c;
    const __m256 g = load_bf16_n(gate + c, left);
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 numerator = _mm256_blendv_ps(one, e, negative);
    const __m256 sig = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
    store_bf16_n(out + c, left, _mm256_mul_ps(_mm256_mul_ps(g, sig), load_bf16_n(up + c, left)));
  }
}


}  // namespace

#include "row_layers.h"
