// Weight-only 4-bit products (dflashkit/kernels/int4.py), included by both row-kernel sources after their own
// helpers (store_sums on AVX512, store_bf16_n on AVX2): the AVX512 source runs them with VNNI (vpdpbusd), the AVX2
// source with vpmaddubsw + vpmaddwd. Both compute the same integers and the same fp32 operations in the same order,
// so the two agree bitwise (unlike their bf16 products).
//
// The weight. Per output column c and block b of 32 inputs: w ~ d[c, b] * q + m[c, b] with q in 0..15 (an
// asymmetric 4-bit code, as llama.cpp's Q4_1), d and m fp16. Packed per group of 16 columns, block after block:
//   320 bytes per block = 4 steps x 64 bytes of codes, then the 16 d (fp16), then the 16 m (fp16)
//   byte 64 j + 4 c + t of a block: low nibble q[c][32 b + 4 j + t], high nibble q[c][32 b + 16 + 4 j + t]
// so one 64-byte load and two masks give the u8 operands of two vpdpbusd (16 columns x 4 inputs each), and a
// group's panel is one sequential stream of 5 bits per weight.
//
// The activations. Each row of x is quantized per block of 32 to int8 on the way in (as llama.cpp's Q8_0 for its
// 4-bit products): s = max|x| / 127, qx = round(x / s) (nearest even; 0 for a zero block). Then per block
//   y[c] += (d[c, b] s) * sum_k q[c][k] qx[k]  +  m[c, b] * (s * sum_k qx[k])
// with the integer dot exact (at most 32 * 15 * 127) and the two fp32 terms added in block order with fused
// multiply-adds. Every row is quantized and summed on its own, in the same order whatever rows run beside it, so a
// verify pass gives bitwise the rows of one-token steps: the 4-bit target is one deterministic function.
#pragma once

namespace {

constexpr int kQ4Block = 32;                 // inputs per scale
constexpr int kQ4Cols = 16;                  // output columns per group
constexpr int64_t kQ4BlockBytes = 320;       // per group and block: 256 bytes of codes, 16 d, 16 m (fp16)

struct Q4Rows {  // x's rows quantized: codes [M, K] int8; per row and block its s and s * sum(codes)
  std::vector<int8_t> q;
  std::vector<float> s, s_sum;
};

inline Q4Rows quantize_rows(const uint16_t* x, int64_t m, int64_t k) {
  const int64_t blocks = k / kQ4Block;
  Q4Rows r{std::vector<int8_t>(m * k), std::vector<float>(m * blocks), std::vector<float>(m * blocks)};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* xb = x + i * k + b * kQ4Block;
      float v[kQ4Block], amax = 0.0f;
      for (int t = 0; t < kQ4Block; ++t) v[t] = bf16_to_float(xb[t]), amax = std::max(amax, std::fabs(v[t]));
      const float s = amax / 127.0f;
      int sum = 0;
      int8_t* qb = r.q.data() + i * k + b * kQ4Block;
      for (int t = 0; t < kQ4Block; ++t) {
        const int c = s > 0.0f ? static_cast<int>(std::nearbyint(v[t] / s)) : 0;
        qb[t] = static_cast<int8_t>(std::min(127, std::max(-127, c)));
        sum += qb[t];
      }
      r.s[i * blocks + b] = s;
      r.s_sum[i * blocks + b] = s * static_cast<float>(sum);
    }
  }
  return r;
}

// x [M, K] bf16 contiguous, K a multiple of 32; packed uint8 [G, K / 32 * 320]; bias [N] fp32 or None.
inline LinearShape check_linear_int4(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                                     const c10::optional<torch::Tensor>& bias) {
  check_rows(x);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kQ4Block == 0, "int4 products need K a multiple of 32, got ", k);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == k / kQ4Block * kQ4BlockBytes,
              "int4 packed: [G, K / 32 * 320] uint8 for x's K = ", k);
  return {m, k, packed.size(0), 0, check_columns(n_out, packed.size(0), kQ4Cols, bias)};
}

#if defined(__AVX512VNNI__)
constexpr int kQ4Rows = 6;   // rows per micro-kernel call
constexpr int kQ4Pairs = 2;  // groups per micro-kernel call: a row's broadcast feeds both

// Rows row0..row0+R-1 times G groups (16 G columns; group j at w + j * stride), one accumulator per row and group.
template <int R, int G>
void micro_int4(const Q4Rows& xq, int64_t row0, int64_t k, const uint8_t* w, int64_t stride, uint16_t* y, int64_t ldy,
                int64_t valid, const float* bias) {
  const int64_t blocks = k / kQ4Block;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 sum[R][G];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) _Pragma("GCC unroll 2") for (int g = 0; g < G; ++g)
    sum[i][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i acc[R][G];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) _Pragma("GCC unroll 2") for (int g = 0; g < G; ++g)
      acc[i][g] = _mm512_setzero_si512();
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
      __m512i lo[G], hi[G];
      _Pragma("GCC unroll 2") for (int g = 0; g < G; ++g) {
        const __m512i v = _mm512_loadu_si512(w + g * stride + b * kQ4BlockBytes + 64 * j);
        lo[g] = _mm512_and_si512(v, low), hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
        const int32_t* xi = reinterpret_cast<const int32_t*>(xq.q.data() + (row0 + i) * k + b * kQ4Block);
        const __m512i x0 = _mm512_set1_epi32(xi[j]), x1 = _mm512_set1_epi32(xi[4 + j]);
        _Pragma("GCC unroll 2") for (int g = 0; g < G; ++g) {
          acc[i][g] = _mm512_dpbusd_epi32(acc[i][g], lo[g], x0);
          acc[i][g] = _mm512_dpbusd_epi32(acc[i][g], hi[g], x1);
        }
      }
    }
    _Pragma("GCC unroll 2") for (int g = 0; g < G; ++g) {
      const uint8_t* wb = w + g * stride + b * kQ4BlockBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 256)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 288)));
      _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
        const int64_t at = (row0 + i) * blocks + b;
        sum[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][g]), _mm512_mul_ps(d, _mm512_set1_ps(xq.s[at])), sum[i][g]);
        sum[i][g] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xq.s_sum[at]), sum[i][g]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) _Pragma("GCC unroll 2") for (int g = 0; g < G; ++g)
    if (16 * g < valid) store_sums(sum[i][g], 16 * g, valid, bias, y + i * ldy);
}

template <int G>
inline void rows_int4_g(int64_t r, const Q4Rows& xq, int64_t row0, int64_t k, const uint8_t* w, int64_t stride,
                        uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  switch (r) {
    case 1: micro_int4<1, G>(xq, row0, k, w, stride, y, ldy, valid, bias); break;
    case 2: micro_int4<2, G>(xq, row0, k, w, stride, y, ldy, valid, bias); break;
    case 3: micro_int4<3, G>(xq, row0, k, w, stride, y, ldy, valid, bias); break;
    case 4: micro_int4<4, G>(xq, row0, k, w, stride, y, ldy, valid, bias); break;
    case 5: micro_int4<5, G>(xq, row0, k, w, stride, y, ldy, valid, bias); break;
    default: micro_int4<6, G>(xq, row0, k, w, stride, y, ldy, valid, bias); break;
  }
}

// r rows times the groups' 16 * groups columns (1 or 2 groups); valid: of those columns, how many are real.
inline void rows_int4(int64_t r, const Q4Rows& xq, int64_t row0, int64_t k, const uint8_t* w, int64_t stride,
                      int groups, uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  if (groups == 2) rows_int4_g<2>(r, xq, row0, k, w, stride, y, ldy, valid, bias);
  else rows_int4_g<1>(r, xq, row0, k, w, stride, y, ldy, valid, bias);
}
#else
constexpr int kQ4Rows = 4;  // rows per micro-kernel call (8 columns at a time: 2 registers each)

// One half (8 columns, h = 0 or 1) of a group for rows row0..row0+R-1.
template <int R>
void micro_int4_half(const Q4Rows& xq, int64_t row0, int64_t k, const uint8_t* w, int h, uint16_t* y, int64_t ldy,
                     int64_t valid, const float* bias) {
  const int64_t blocks = k / kQ4Block;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 sum[R];
  _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) sum[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kQ4BlockBytes;
    __m256i acc[R];
    _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_si256();
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j + 32 * h));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) {
        const int32_t* xi = reinterpret_cast<const int32_t*>(xq.q.data() + (row0 + i) * k + b * kQ4Block);
        // int16 sums of 4 products each (at most 4 * 15 * 127: no saturation), then int32
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xi[j])),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xi[4 + j])));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 256 + 16 * h)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 288 + 16 * h)));
    _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) {
      const int64_t at = (row0 + i) * blocks + b;
      sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(d, _mm256_set1_ps(xq.s[at])), sum[i]);
      sum[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xq.s_sum[at]), sum[i]);
    }
  }
  const int64_t n0 = 8 * h;
  if (n0 >= valid) return;
  _Pragma("GCC unroll 4") for (int i = 0; i < R; ++i) {
    __m256 s = sum[i];
    if (bias) s = _mm256_add_ps(s, load_f32_n(bias + n0, valid - n0));
    store_bf16_n(y + i * ldy + n0, valid - n0, s);
  }
}

template <int R>
void micro_int4(const Q4Rows& xq, int64_t row0, int64_t k, const uint8_t* w, uint16_t* y, int64_t ldy, int64_t valid,
                const float* bias) {
  micro_int4_half<R>(xq, row0, k, w, 0, y, ldy, valid, bias);
  if (valid > 8) micro_int4_half<R>(xq, row0, k, w, 1, y, ldy, valid, bias);
}

constexpr int kQ4Pairs = 1;  // groups per micro-kernel call

inline void rows_int4(int64_t r, const Q4Rows& xq, int64_t row0, int64_t k, const uint8_t* w, int64_t, int,
                      uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  switch (r) {
    case 1: micro_int4<1>(xq, row0, k, w, y, ldy, valid, bias); break;
    case 2: micro_int4<2>(xq, row0, k, w, y, ldy, valid, bias); break;
    case 3: micro_int4<3>(xq, row0, k, w, y, ldy, valid, bias); break;
    default: micro_int4<4>(xq, row0, k, w, y, ldy, valid, bias); break;
  }
}
#endif

// The 4-bit product (layout above): groups of 16 columns across the threads, each over all rows in chunks.
inline torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                                 const c10::optional<torch::Tensor>& bias) {
  const LinearShape shape = check_linear_int4(x, packed, n_out, bias);
  const int64_t m = shape.m, k = shape.k, stride = packed.size(1);
  const float* b = shape.bias;
  auto y = torch::empty({m, n_out}, x.options());
  if (m == 0) return y;
  const Q4Rows xq = quantize_rows(u16(x), m, k);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  uint16_t* yp = u16w(y);
  const int64_t calls = (shape.groups + kQ4Pairs - 1) / kQ4Pairs;  // kQ4Pairs groups per call
  at::parallel_for(0, calls, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g = c * kQ4Pairs, n0 = g * kQ4Cols;
      const int groups = static_cast<int>(std::min<int64_t>(kQ4Pairs, shape.groups - g));
      const int64_t valid = std::min<int64_t>(groups * kQ4Cols, n_out - n0);
      const int64_t chunks = (m + kQ4Rows - 1) / kQ4Rows;  // balanced chunks
      for (int64_t h = 0, m0 = 0; h < chunks; ++h) {
        const int64_t r = (m - m0 + (chunks - h) - 1) / (chunks - h);
        rows_int4(r, xq, m0, k, wp + g * stride, stride, groups, yp + m0 * n_out + n0, n_out, valid,
                  b ? b + n0 : nullptr);
        m0 += r;
      }
    }
  });
  return y;
}

}  // namespace
