// bf16 matrix product y = x @ W.T (+ bias) for the few rows of a decoding step, with AVX512-BF16.
//
// The weight is packed once (dflashkit/cpu_gemm.py) into groups of 64 output columns:
//   packed[g][k2][b][c][p] = W[64 g + 16 b + c][2 k2 + p]      shape [G, K/2, 4, 16, 2]
// so that one 64-byte load holds the (2 k2, 2 k2 + 1) weight pairs of 16 columns, the operand layout of
// vdpbf16ps, and a group's whole panel is one sequential stream. Each row of x is broadcast two elements at a
// time and accumulated in fp32 into 4 registers (64 columns) per row, up to 6 rows at a time (24
// accumulators); more rows reuse the group's panel from cache. Every output element is the same fp32 sum in
// the same order whatever the number of rows, so a row's result does not depend on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int kBlocks = 4;                 // 16-column blocks per group
constexpr int kGroup = kBlocks * 16;       // output columns per group
constexpr int kMaxRows = 6;                // rows per micro-kernel call

template <int R>
void micro(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k2_count, uint16_t* y, int64_t ldy,
           int64_t valid, const float* bias) {
  __m512 acc[R][kBlocks];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
    _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j) acc[i][j] = _mm512_setzero_ps();
  const int32_t* pairs[R];  // x's rows read as (2 k2, 2 k2 + 1) pairs
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) pairs[i] = reinterpret_cast<const int32_t*>(x + i * ldx);
  for (int64_t k2 = 0; k2 < k2_count; ++k2) {
    const uint16_t* wk = w + k2 * (kBlocks * 32);
    __m512bh wv[kBlocks];
    _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wk + j * 32);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pairs[i][k2]);
      _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xb);
    }
  }
  for (int j = 0; j < kBlocks; ++j) {  // round to bf16 (nearest even) after the fp32 bias, store valid columns
    const int64_t n0 = j * 16;
    if (n0 >= valid) break;
    const int64_t count = valid - n0 < 16 ? valid - n0 : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
      _mm256_mask_storeu_epi16(y + i * ldy + n0, mask, (__m256i)out);
    }
  }
}

void rows(int64_t r, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k2_count, uint16_t* y,
          int64_t ldy, int64_t valid, const float* bias) {
  switch (r) {
    case 1: micro<1>(x, ldx, w, k2_count, y, ldy, valid, bias); break;
    case 2: micro<2>(x, ldx, w, k2_count, y, ldy, valid, bias); break;
    case 3: micro<3>(x, ldx, w, k2_count, y, ldy, valid, bias); break;
    case 4: micro<4>(x, ldx, w, k2_count, y, ldy, valid, bias); break;
    case 5: micro<5>(x, ldx, w, k2_count, y, ldy, valid, bias); break;
    default: micro<6>(x, ldx, w, k2_count, y, ldy, valid, bias); break;
  }
}

}  // namespace

// x [M, K] bf16 contiguous; packed [G, K/2, 4, 16, 2] bf16; bias [N] fp32 or None. Returns y [M, N] bf16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous [M, K] bf16");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
              packed.size(2) == kBlocks && packed.size(3) == 16 && packed.size(4) == 2, "packed: [G, K/2, 4, 16, 2] bf16");
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(0), k2_count = packed.size(1);
  TORCH_CHECK(k == 2 * k2_count, "x has ", k, " columns, the packed weight ", 2 * k2_count);
  TORCH_CHECK(n_out > (groups - 1) * kGroup && n_out <= groups * kGroup, "n_out does not match the packed weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out, "bias: [N] fp32");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({m, n_out}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* w = wp + g * k2_count * (kBlocks * 32);
      const int64_t valid = n_out - g * kGroup < kGroup ? n_out - g * kGroup : kGroup;
      const float* bg = b ? b + g * kGroup : nullptr;
      const int64_t chunks = (m + kMaxRows - 1) / kMaxRows;  // balanced: 8 rows run as 4 + 4, not 6 + 2
      for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
        const int64_t r = (m - m0 + (chunks - c) - 1) / (chunks - c);
        rows(r, xp + m0 * k, k, w, k2_count, yp + m0 * n_out + g * kGroup, n_out, valid, bg);
        m0 += r;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("linear", &linear, "bf16 x @ W.T (+ bias) with a packed W"); }
