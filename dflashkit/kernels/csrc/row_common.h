// What both row-kernel sources (row_kernels_avx512.cpp, row_kernels_avx2.cpp) need before their own code: the
// includes, raw bf16 access, and the argument checks of their two torch-level entry points (linear, attention),
// so that both refuse the same bad input with the same message.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t v) { uint32_t u = static_cast<uint32_t>(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
const uint16_t* u16(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* u16w(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

struct LinearShape {
  int64_t m, k, groups, k2_count;
  const float* bias;  // null without
};

// x [M, K] bf16 contiguous.
inline void check_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous [M, K] bf16");
}

// n_out columns fit `groups` packed groups of `group` columns, the last one partly; the bias, [N] fp32 or None, as
// a pointer (null without).
inline const float* check_columns(int64_t n_out, int64_t groups, int64_t group, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(n_out > (groups - 1) * group && n_out <= groups * group, "n_out does not match the packed weight");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out, "bias: [N] fp32");
  return bias->data_ptr<float>();
}

// x [M, K] bf16 contiguous; packed [G, K/2, blocks, 16, 2] bf16 (groups of 16 * blocks output columns); bias [N]
// fp32 or None.
inline LinearShape check_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                                const c10::optional<torch::Tensor>& bias, int64_t blocks) {
  check_rows(x);
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
              packed.size(2) == blocks && packed.size(3) == 16 && packed.size(4) == 2,
              "packed: [G, K/2, ", blocks, ", 16, 2] bf16");
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(0), k2_count = packed.size(1);
  TORCH_CHECK(k == 2 * k2_count, "x has ", k, " columns, the packed weight ", 2 * k2_count);
  return {m, k, groups, k2_count, check_columns(n_out, groups, 16 * blocks, bias)};
}

// x [M, K] bf16 contiguous; packed int8 [G, 16 K + 64] (per group of 16 columns: K rows of 16 int8 weights, then
// their 16 fp32 scales); bias [N] fp32 or None. k2_count is unused (0).
inline LinearShape check_linear_int8(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                                     const c10::optional<torch::Tensor>& bias) {
  check_rows(x);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == 16 * k + 64,
              "int8 packed: [G, 16 K + 64] int8 for x's K = ", k);
  return {m, k, packed.size(0), 0, check_columns(n_out, packed.size(0), 16, bias)};
}

// One grouped-query attention of attention_calls (each ISA's source defines it), as raw bf16 pointers:
// q [kv_heads, rows, d] (the query heads sharing a key/value head stacked: row r is query row r % n); keys, values:
// kv head h's rows at k + h * k_head, v + h * v_head, m rows of d each, contiguous; hidden [n, m] bool (true: row i
// does not see key j) or null (every row sees every key); out [kv_heads, rows, d].
struct AttnCall {
  const uint16_t *q, *k, *v;
  uint16_t* out;
  const bool* hidden;
  int64_t rows, n, m, k_head, v_head;
};

struct AttentionShape {
  int64_t heads, rows, d, m;
  const bool* hidden;  // [n, m] or null
};

// q [kv_heads, R, d] bf16 contiguous; keys, values [kv_heads, m, d] bf16 with contiguous rows, d 16, 32, 64 or 128;
// hidden [n, m] bool contiguous or None; R a multiple of n.
inline AttentionShape check_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                      const c10::optional<torch::Tensor>& hidden, int64_t n) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16, "q: contiguous [kv_heads, R, d] bf16");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3 && keys.sizes() == values.sizes() &&
              keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16, "keys, values: [kv_heads, m, d] bf16");
  const int64_t heads = q.size(0), rows = q.size(1), d = q.size(2), m = keys.size(1);
  TORCH_CHECK(keys.size(0) == heads && keys.size(2) == d && (d == 16 || d == 32 || d == 64 || d == 128), "head size: 16, 32, 64 or 128");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == d && values.stride(2) == 1 && values.stride(1) == d,
              "keys and values need contiguous rows");
  TORCH_CHECK(n >= 1 && rows % n == 0, "R must be a multiple of n");
  const bool* hid = nullptr;
  if (hidden.has_value()) {
    TORCH_CHECK(hidden->scalar_type() == at::kBool && hidden->is_contiguous() && hidden->dim() == 2 &&
                hidden->size(0) == n && hidden->size(1) == m, "hidden: contiguous bool [n, m]");
    hid = hidden->data_ptr<bool>();
  }
  return {heads, rows, d, m, hid};
}

inline AttnCall attention_call(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const AttentionShape& shape, int64_t n, torch::Tensor& out) {
  return {reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()),
          reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), shape.hidden, shape.rows, n, shape.m,
          keys.stride(0), values.stride(0)};
}

}  // namespace
