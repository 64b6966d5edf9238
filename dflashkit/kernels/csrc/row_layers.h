// The ISA-independent part of dflashkit's row kernels: every decoder layer in one call, the thread probe and the
// Python module. Included at the end of row_kernels_avx512.cpp and row_kernels_avx2.cpp, each of which defines
// before it, for its instruction set: linear, attention (torch-level), ready, and the row helpers rms_norm,
// rotate_into, add_into, silu_mul, plus kBlocks (16-column blocks per packed group), kIsa (its name) and kInt8 (whether linear
// also takes int8-packed weights); u16, u16w come from row_common.h.
#pragma once

// Every decoder layer of a Llama / Qwen2 / Qwen3 target for the rows of several sequences, in one call: RMS norms,
// the fused q/k/v product, per-head q/k norms (Qwen3), rotary, the cache write, attention, o, the fused gate/up
// product, SiLU, down, residuals; every step per row, so a row is bitwise what a one-token step computes, whatever
// rows (of its own sequence or of others) run beside it. The products run once over all rows (the weights are read
// once per step, not once per sequence); the cache write and attention run per sequence, over its own cache.
// x [N, H] bf16: the rows of sequence s are counts[s] consecutive rows, in sequence order; per layer 8 tensors:
// input norm [H], qkv packed, qkv bias (fp32 [..] or an empty tensor), o packed, post norm [H], gate/up packed, down
// packed, q/k norms ([2, d] bf16 or empty); cos, sin_signed [N, d] bf16; per sequence: keys, values [layers,
// kv_heads, capacity, d], the position of its first row `starts[s]` (its rows are written there) and its hidden mask
// [counts[s], starts[s] + counts[s]] bool (an empty tensor: every row sees every key). Sequence s's rows attend to
// cache rows context_starts[s]..start+n-1 (a drafter's context window; 0: all, the only value with a hidden mask).
// Returns x after the last layer and the feature layers' outputs concatenated [N, len(feature_layers) * H] (empty without).
std::vector<torch::Tensor> decoder_layers_batch(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                                                const torch::Tensor& cos, const torch::Tensor& sin_signed,
                                                const std::vector<torch::Tensor>& keys,
                                                const std::vector<torch::Tensor>& values,
                                                const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                                                const std::vector<torch::Tensor>& hiddens, int64_t heads,
                                                int64_t kv_heads, int64_t intermediate, double eps, double scaling,
                                                const std::vector<int64_t>& feature_layers,
                                                const std::vector<int64_t>& context_starts) {
  const int64_t sequences = static_cast<int64_t>(counts.size());
  TORCH_CHECK(sequences >= 1 && static_cast<int64_t>(keys.size()) == sequences &&
              static_cast<int64_t>(values.size()) == sequences && static_cast<int64_t>(starts.size()) == sequences &&
              static_cast<int64_t>(hiddens.size()) == sequences &&
              static_cast<int64_t>(context_starts.size()) == sequences,
              "one cache pair, start, row count, hidden mask and context start per sequence");
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x: contiguous [N, H] bf16");
  const int64_t n_all = x.size(0), width = x.size(1), d = keys[0].size(3), layers = keys[0].size(0);
  const int64_t group = heads / kv_heads, qkv_width = (heads + 2 * kv_heads) * d;
  std::vector<int64_t> offsets(sequences + 1, 0);  // first row of each sequence in x
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t n = counts[s], end = starts[s] + n;
    TORCH_CHECK(n >= 1, "every sequence has at least one row");
    TORCH_CHECK(keys[s].dim() == 4 && keys[s].sizes() == values[s].sizes() && keys[s].size(0) == layers &&
                keys[s].size(1) == kv_heads && keys[s].size(3) == d && keys[s].scalar_type() == at::kBFloat16 &&
                values[s].scalar_type() == at::kBFloat16, "caches: [layers, kv_heads, capacity, d] bf16, alike");
    TORCH_CHECK(keys[s].is_contiguous() && values[s].is_contiguous() && starts[s] >= 0 && end <= keys[s].size(2),
                "caches: contiguous, room for the rows");
    TORCH_CHECK(hiddens[s].numel() == 0 || (hiddens[s].dim() == 2 && hiddens[s].size(0) == n && hiddens[s].size(1) == end &&
                                            hiddens[s].scalar_type() == at::kBool && hiddens[s].is_contiguous()),
                "hidden: contiguous [n, start + n] bool or empty");
    const int64_t context_start = context_starts[s];
    TORCH_CHECK(context_start >= 0 && context_start <= starts[s] && (hiddens[s].numel() == 0 || context_start == 0),
                "context_start: in 0..start, and 0 with a hidden mask");
    offsets[s + 1] = offsets[s] + n;
  }
  TORCH_CHECK(offsets[sequences] == n_all, "the row counts add up to the rows of x");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 8 * layers, "8 tensors per layer");
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() && cos.size(0) == n_all && cos.size(1) == d, "cos/sin: [N, d]");
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128, "head size: 16, 32, 64 or 128");
  x = x.clone();
  auto opts = x.options();
  auto h = torch::empty({n_all, width}, opts);
  auto attn_rows = torch::empty({n_all, heads * d}, opts), act = torch::empty({n_all, intermediate}, opts);
  auto normed_head = torch::empty({d}, opts);
  // per sequence s, from row offsets[s] * heads * d: its queries, the heads sharing a K/V head stacked
  // [kv_heads, group n, d], and its attention output in the same layout
  auto queries = torch::empty({n_all * heads * d}, opts), attended = torch::empty({n_all * heads * d}, opts);
  std::vector<AttnCall> calls(sequences);
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t n = counts[s], seen = starts[s] + n - context_starts[s];  // the cache rows it attends to
    calls[s] = AttnCall{u16(queries) + offsets[s] * heads * d, nullptr, nullptr,
                        u16w(attended) + offsets[s] * heads * d, hiddens[s].numel() ? hiddens[s].data_ptr<bool>() : nullptr,
                        group * n, n, seen, keys[s].size(2) * d, values[s].size(2) * d};
  }
  const int64_t features_count = static_cast<int64_t>(feature_layers.size());
  auto features = features_count ? torch::empty({n_all, features_count * width}, opts) : torch::empty({0}, opts);
  for (int64_t layer = 0; layer < layers; ++layer) {
    const torch::Tensor* w = &weights[8 * layer];
    rms_norm(u16(x), width, n_all, width, u16(w[0]), static_cast<float>(eps), u16w(h), width);
    c10::optional<torch::Tensor> qkv_bias = w[2].numel() ? c10::optional<torch::Tensor>(w[2]) : c10::nullopt;
    torch::Tensor qkv = linear(h, w[1], qkv_width, qkv_bias);  // [N, (heads + 2 kv_heads) d]
    const bool qk_norm = w[7].numel() > 0;
    for (int64_t s = 0; s < sequences; ++s) {
      const int64_t n = counts[s], start = starts[s], first = offsets[s], cap = keys[s].size(2);
      torch::Tensor ks = keys[s], vs = values[s];  // handles to the caller's buffers (written in place)
      uint16_t* kl = u16w(ks) + layer * kv_heads * cap * d;
      uint16_t* vl = u16w(vs) + layer * kv_heads * cap * d;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t* row = u16(qkv) + (first + i) * qkv_width;
        const uint16_t* c = u16(cos) + (first + i) * d;
        const uint16_t* sn = u16(sin_signed) + (first + i) * d;
        for (int64_t head = 0; head < heads + kv_heads; ++head) {  // queries, then keys: (normed,) rotated
          const uint16_t* src = row + head * d;
          if (qk_norm) {
            rms_norm(src, d, 1, d, u16(w[7]) + (head < heads ? 0 : d), static_cast<float>(eps), u16w(normed_head), d);
            src = u16(normed_head);
          }
          uint16_t* dst = head < heads ? u16w(queries) + first * heads * d + ((head / group) * group * n + (head % group) * n + i) * d
                                       : kl + ((head - heads) * cap + start + i) * d;
          rotate_into(src, c, sn, d, dst);
        }
        for (int64_t kh = 0; kh < kv_heads; ++kh)  // values as they are
          std::memcpy(vl + (kh * cap + start + i) * d, row + (heads + kv_heads + kh) * d, d * sizeof(uint16_t));
      }
      calls[s].k = kl + context_starts[s] * d;
      calls[s].v = vl + context_starts[s] * d;
    }
    attention_calls(calls, kv_heads, d, scaling);  // every sequence's attention in one parallel region
    for (int64_t s = 0; s < sequences; ++s) {
      const int64_t n = counts[s], first = offsets[s];
      const uint16_t* out = u16(attended) + first * heads * d;  // [kv_heads, group * n, d]
      for (int64_t i = 0; i < n; ++i)
        for (int64_t head = 0; head < heads; ++head)
          std::memcpy(u16w(attn_rows) + ((first + i) * heads + head) * d,
                      out + ((head / group) * group * n + (head % group) * n + i) * d, d * sizeof(uint16_t));
    }
    torch::Tensor o = linear(attn_rows, w[3], width, c10::nullopt);
    add_into(u16w(x), u16(o), n_all * width);
    rms_norm(u16(x), width, n_all, width, u16(w[4]), static_cast<float>(eps), u16w(h), width);
    torch::Tensor gate_up = linear(h, w[5], 2 * intermediate, c10::nullopt);  // [N, 2 I]
    for (int64_t i = 0; i < n_all; ++i)
      silu_mul(u16(gate_up) + i * 2 * intermediate, u16(gate_up) + i * 2 * intermediate + intermediate, intermediate,
               u16w(act) + i * intermediate);
    torch::Tensor down = linear(act, w[6], width, c10::nullopt);
    add_into(u16w(x), u16(down), n_all * width);
    for (int64_t f = 0; f < features_count; ++f)
      if (feature_layers[f] == layer)
        for (int64_t i = 0; i < n_all; ++i)
          std::memcpy(u16w(features) + (i * features_count + f) * width, u16(x) + i * width, width * sizeof(uint16_t));
  }
  return {x, features};
}

// decoder_layers_batch for one sequence: x [n, H]; keys, values [layers, kv_heads, capacity, d]; hidden [n, start+n]
// bool or None.
std::vector<torch::Tensor> decoder_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                                          const torch::Tensor& cos, const torch::Tensor& sin_signed,
                                          torch::Tensor keys, torch::Tensor values, int64_t start,
                                          const c10::optional<torch::Tensor>& hidden, int64_t heads, int64_t kv_heads,
                                          int64_t intermediate, double eps, double scaling,
                                          const std::vector<int64_t>& feature_layers, int64_t context_start) {
  TORCH_CHECK(x.dim() == 2, "x: contiguous [n, H] bf16");
  torch::Tensor mask = hidden.has_value() ? *hidden : torch::empty({0}, x.options().dtype(at::kBool));
  TORCH_CHECK(!hidden.has_value() || (mask.scalar_type() == at::kBool && mask.is_contiguous()), "hidden: contiguous bool");
  return decoder_layers_batch(x, weights, cos, sin_signed, {keys}, {values}, {start}, {x.size(0)}, {mask}, heads,
                              kv_heads, intermediate, eps, scaling, feature_layers, {context_start});
}

// One drafting step of a DFlash drafter (its inference forward) for several sequences, in one call:
// 1. each sequence's new target-feature rows features[s] [n_s, F] (verified since its last step; n_s may be 0) enter
//    its context cache: fc product, hidden norm (hidden_eps), every layer's context key/value product (context_kv:
//    outputs k_0 v_0 k_1 v_1 ..., kv_heads * d each), each layer's k norm (its q/k norms in `weights`, eps) and
//    rotary; written at cache rows write_rows[s].., positions feature_positions[s]..;
// 2. its block, block_counts[s] rows (0: none, the step only takes its context rows) at positions block_positions[s]..
//    (the last row tail_gaps[s] positions further: a block of k + 1 rows plus its trained block's last row):
//    the anchor's row of `embed` [V, H]
//    (anchors[s] < 0: mask_row [H] instead), then mask_row; every layer over its cache as decoder_layers runs them
//    (weights: 8 per layer), the block's own keys and values written as scratch from starts[s], attending to cache
//    rows context_starts[s]..;
// 3. the final norm (final_eps) of every block row but each block's first.
// Rotary from cos_table, sin_table_signed [P, d] (row p: position p). The products of every stage run once over
// every sequence's rows. Returns the rows the draft head reads, in order: [sum over blocks of (count - 1), H].
torch::Tensor drafter_step_batch(const std::vector<torch::Tensor>& features, const torch::Tensor& fc,
                                 const torch::Tensor& hidden_norm, double hidden_eps, const torch::Tensor& context_kv,
                                 const std::vector<int64_t>& write_rows, const std::vector<int64_t>& feature_positions,
                                 const torch::Tensor& embed, const torch::Tensor& mask_row,
                                 const std::vector<int64_t>& anchors, const std::vector<int64_t>& block_counts,
                                 const std::vector<int64_t>& block_positions, const std::vector<int64_t>& tail_gaps,
                                 const torch::Tensor& cos_table,
                                 const torch::Tensor& sin_table_signed, const std::vector<torch::Tensor>& weights,
                                 const torch::Tensor& final_norm, double final_eps,
                                 const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& context_starts,
                                 int64_t heads, int64_t kv_heads, int64_t intermediate, double eps, double scaling) {
  const int64_t sequences = static_cast<int64_t>(block_counts.size());
  TORCH_CHECK(sequences >= 1 && static_cast<int64_t>(features.size()) == sequences &&
              static_cast<int64_t>(write_rows.size()) == sequences &&
              static_cast<int64_t>(feature_positions.size()) == sequences &&
              static_cast<int64_t>(anchors.size()) == sequences &&
              static_cast<int64_t>(block_positions.size()) == sequences &&
              static_cast<int64_t>(tail_gaps.size()) == sequences &&
              static_cast<int64_t>(keys.size()) == sequences && static_cast<int64_t>(starts.size()) == sequences,
              "one feature matrix, write row, position, anchor, block and cache per sequence");
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() && embed.scalar_type() == at::kBFloat16, "embed: contiguous [V, H] bf16");
  const int64_t width = embed.size(1), layers = keys[0].size(0), d = keys[0].size(3), cap_rows = cos_table.size(0);
  TORCH_CHECK(mask_row.is_contiguous() && mask_row.scalar_type() == at::kBFloat16 && mask_row.numel() == width &&
              hidden_norm.numel() == width && final_norm.numel() == width, "mask row and norms: [H] bf16");
  TORCH_CHECK(cos_table.is_contiguous() && sin_table_signed.is_contiguous() && cos_table.dim() == 2 &&
              cos_table.size(1) == d && sin_table_signed.sizes() == cos_table.sizes(), "rotary tables: [P, d]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 8 * layers, "8 tensors per layer");
  const auto opts = embed.options();
  const int64_t kv_width = kv_heads * d;
  // 1. the context rows of every sequence
  std::vector<int64_t> feature_offsets(sequences + 1, 0);
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t n = features[s].numel() ? features[s].size(0) : 0;
    TORCH_CHECK(n == 0 || (features[s].dim() == 2 && features[s].scalar_type() == at::kBFloat16 &&
                           features[s].size(1) == features[0].size(1)), "features: [n, F] bf16, alike");
    TORCH_CHECK(write_rows[s] >= 0 && write_rows[s] + n <= keys[s].size(2) && feature_positions[s] >= 0 &&
                feature_positions[s] + n <= cap_rows, "context rows: room in the cache and the rotary tables");
    feature_offsets[s + 1] = feature_offsets[s] + n;
  }
  const int64_t n_features = feature_offsets[sequences];
  if (n_features) {
    torch::Tensor rows;
    if (n_features == feature_offsets[1] && features[0].is_contiguous()) {
      rows = features[0];
    } else {
      std::vector<torch::Tensor> parts;
      for (const auto& f : features)
        if (f.numel()) parts.push_back(f);
      rows = torch::cat(parts).contiguous();
    }
    torch::Tensor ctx = linear(rows, fc, width, c10::nullopt);  // [N_f, H]
    rms_norm(u16(ctx), width, n_features, width, u16(hidden_norm), static_cast<float>(hidden_eps), u16w(ctx), width);
    torch::Tensor kv = linear(ctx, context_kv, layers * 2 * kv_width, c10::nullopt);  // [N_f, layers * 2 * kv * d]
    auto normed_head = torch::empty({d}, opts);
    for (int64_t s = 0; s < sequences; ++s) {
      torch::Tensor ks = keys[s], vs = values[s];
      const int64_t cap = ks.size(2);
      for (int64_t i = 0; i < feature_offsets[s + 1] - feature_offsets[s]; ++i) {
        const uint16_t* row = u16(kv) + (feature_offsets[s] + i) * layers * 2 * kv_width;
        const int64_t at = write_rows[s] + i, p = feature_positions[s] + i;
        for (int64_t layer = 0; layer < layers; ++layer) {
          const torch::Tensor& norms = weights[8 * layer + 7];
          for (int64_t kh = 0; kh < kv_heads; ++kh) {
            const uint16_t* src = row + (layer * 2) * kv_width + kh * d;
            if (norms.numel()) {
              rms_norm(src, d, 1, d, u16(norms) + d, static_cast<float>(eps), u16w(normed_head), d);
              src = u16(normed_head);
            }
            const int64_t offset = ((layer * kv_heads + kh) * cap + at) * d;
            rotate_into(src, u16(cos_table) + p * d, u16(sin_table_signed) + p * d, d, u16w(ks) + offset);
            std::memcpy(u16w(vs) + offset, row + (layer * 2 + 1) * kv_width + kh * d, d * sizeof(uint16_t));
          }
        }
      }
    }
  }
  // 2. the blocks (block_counts[s] == 0: sequence s only takes its context rows)
  int64_t n_block = 0, n_out = 0;
  std::vector<int64_t> with_block;
  for (int64_t s = 0; s < sequences; ++s) {
    if (block_counts[s] == 0) continue;
    TORCH_CHECK(block_counts[s] >= 2 && block_positions[s] >= 0 && tail_gaps[s] >= 0 &&
                block_positions[s] + block_counts[s] + tail_gaps[s] <= cap_rows,
                "blocks: none or at least 2 rows, within the rotary tables");
    TORCH_CHECK(anchors[s] < embed.size(0), "anchor id out of the embedding table");
    with_block.push_back(s);
    n_block += block_counts[s];
    n_out += block_counts[s] - 1;
  }
  auto out = torch::empty({n_out, width}, opts);
  if (with_block.empty()) return out;
  auto x = torch::empty({n_block, width}, opts), cos = torch::empty({n_block, d}, opts),
       sin = torch::empty({n_block, d}, opts);
  std::vector<torch::Tensor> ks, vs, no_masks;
  std::vector<int64_t> counts, block_starts, firsts;
  int64_t r = 0;
  for (int64_t s : with_block) {
    for (int64_t i = 0; i < block_counts[s]; ++i, ++r) {
      const uint16_t* src = i == 0 && anchors[s] >= 0 ? u16(embed) + anchors[s] * width : u16(mask_row);
      const int64_t p = block_positions[s] + i + (i == block_counts[s] - 1 ? tail_gaps[s] : 0);  // the tail row's gap
      std::memcpy(u16w(x) + r * width, src, width * sizeof(uint16_t));
      std::memcpy(u16w(cos) + r * d, u16(cos_table) + p * d, d * sizeof(uint16_t));
      std::memcpy(u16w(sin) + r * d, u16(sin_table_signed) + p * d, d * sizeof(uint16_t));
    }
    ks.push_back(keys[s]);
    vs.push_back(values[s]);
    no_masks.push_back(torch::empty({0}, opts.dtype(at::kBool)));
    counts.push_back(block_counts[s]);
    block_starts.push_back(starts[s]);
    firsts.push_back(context_starts[s]);
  }
  torch::Tensor h = decoder_layers_batch(x, weights, cos, sin, ks, vs, block_starts, counts, no_masks, heads, kv_heads,
                                         intermediate, eps, scaling, {}, firsts)[0];
  // 3. the final norm of the rows the head reads
  r = 0;
  int64_t o = 0;
  for (int64_t count : counts) {
    rms_norm(u16(h) + (r + 1) * width, width, count - 1, width, u16(final_norm), static_cast<float>(final_eps),
             u16w(out) + o * width, width);
    r += count;
    o += count - 1;
  }
  return out;
}

// Index of the largest value in each row of x [R, V] bf16, as torch's argmax: the first one on ties, and a NaN
// counts as the largest (the first NaN's index). Sixteen lanes each keep their first largest value (strictly larger
// replaces), then the row's largest is the smallest index among the lanes that hold it; the V % 16 last entries
// follow in order. What greedy verification reads off a verify pass's logits (torch's CPU argmax: 55-70 µs per
// 49,152-entry row in fp32 after a conversion, more in bf16).
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) >= 16 &&
              x.size(1) < (int64_t{1} << 31), "x: contiguous [R, V] bf16 with 16 <= V < 2^31");
  const int64_t rows = x.size(0), n = x.size(1), whole = n / 16 * 16;
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const uint16_t* xp = u16(x);
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = xp + r * n;
      alignas(64) float best[16];
      alignas(64) int32_t index[16];  // V < 2^31
      bool nan = false;
#ifdef __AVX512F__  // the AVX512-BF16 source (and its AMX build), with its load_bf16
      __m512 top16 = load_bf16(row);
      __m512i at16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), lane = at16;
      __mmask16 unordered = _mm512_cmp_ps_mask(top16, top16, _CMP_UNORD_Q);
      for (int64_t i = 16; i < whole; i += 16) {
        lane = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
        const __m512 v = load_bf16(row + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 larger = _mm512_cmp_ps_mask(v, top16, _CMP_GT_OQ);
        top16 = _mm512_mask_mov_ps(top16, larger, v);
        at16 = _mm512_mask_mov_epi32(at16, larger, lane);
      }
      _mm512_store_ps(best, top16);
      _mm512_store_si512(index, at16);
      nan = unordered != 0;
#else
      for (int l = 0; l < 16; ++l) {
        best[l] = bf16_to_float(row[l]);
        index[l] = l;
        nan |= best[l] != best[l];
      }
      for (int64_t i = 16; i < whole; i += 16) {
        for (int l = 0; l < 16; ++l) {
          const float v = bf16_to_float(row[i + l]);
          nan |= v != v;
          const bool larger = v > best[l];
          best[l] = larger ? v : best[l];
          index[l] = larger ? static_cast<int32_t>(i + l) : index[l];
        }
      }
#endif
      float top = best[0];
      int64_t at = index[0];
      for (int l = 1; l < 16; ++l)
        if (best[l] > top || (best[l] == top && index[l] < at)) { top = best[l]; at = index[l]; }
      for (int64_t i = whole; i < n; ++i) {
        const float v = bf16_to_float(row[i]);
        nan |= v != v;
        if (v > top) { top = v; at = i; }
      }
      if (nan)
        for (int64_t i = 0; i < n; ++i)
          if (bf16_to_float(row[i]) != bf16_to_float(row[i])) { at = i; break; }
      op[r] = at;
    }
  });
  return out;
}

// The k largest values of each row of x [R, V] bf16 as softmax probabilities, largest first, and their indices:
// what a token tree is built from (the drafter's top candidates per block position and their probabilities), in one
// pass over each row instead of torch's softmax and topk (~0.2 ms for 11 x 8,192 scores once the target's pass has
// evicted everything). Ties: the smaller index first. p = exp(v - max) / sum over the row of exp(x - max), both with
// the softmax exp of the attention (relative error ~2e-7); -inf scores weigh 0. A row with a NaN, or whose largest
// value is +-inf, gets NaN probabilities (as torch's softmax).
std::tuple<torch::Tensor, torch::Tensor> top_probs_rows(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) >= 16 &&
              x.size(1) < (int64_t{1} << 31) && k >= 1 && k <= 16 && k <= x.size(1),
              "x: contiguous [R, V] bf16 with 16 <= V < 2^31, 1 <= k <= min(16, V)");
  const int64_t rows = x.size(0), n = x.size(1);
  auto probs = torch::empty({rows, k}, x.options().dtype(at::kFloat));
  auto index = torch::empty({rows, k}, x.options().dtype(at::kLong));
  const uint16_t* xp = u16(x);
  float* pp = probs.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
#ifdef __AVX512F__
  constexpr int64_t L = 16;
#else
  constexpr int64_t L = 8;
#endif
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = xp + r * n;
      const int64_t whole = n / L * L;
      float top[16];
      int64_t at[16];
      int64_t filled = 0;
      auto offer = [&](float v, int64_t i) {  // keep the k largest, earlier index first among equals
        if (filled == k && !(v > top[k - 1])) return;
        int64_t j = filled < k ? filled++ : k - 1;
        for (; j > 0 && v > top[j - 1]; --j) { top[j] = top[j - 1]; at[j] = at[j - 1]; }
        top[j] = v;
        at[j] = i;
      };
      for (int64_t i = 0; i < n && filled < k; ++i) offer(bf16_to_float(row[i]), i);
      int64_t i = filled;  // == k: the first k entries are in
      for (; i < n && i % L; ++i) offer(bf16_to_float(row[i]), i);
#ifdef __AVX512F__
      for (; i < whole; i += L) {
        const __m512 v = load_bf16(row + i);
        __mmask16 above = _mm512_cmp_ps_mask(v, _mm512_set1_ps(top[k - 1]), _CMP_GT_OQ);
        while (above) {
          const int l = __builtin_ctz(above);
          offer(bf16_to_float(row[i + l]), i + l);
          above &= above - 1;
          above &= _mm512_cmp_ps_mask(v, _mm512_set1_ps(top[k - 1]), _CMP_GT_OQ);
        }
      }
#else
      for (; i < whole; i += L) {
        const __m256 v = load_bf16(row + i);
        int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(top[k - 1]), _CMP_GT_OQ));
        while (above) {
          const int l = __builtin_ctz(above);
          offer(bf16_to_float(row[i + l]), i + l);
          above &= above - 1;
          above &= _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(top[k - 1]), _CMP_GT_OQ));
        }
      }
#endif
      for (; i < n; ++i) offer(bf16_to_float(row[i]), i);
      const float largest = top[0];
      // the row's sum of exp(x - largest), in lanes, then the tail; and whether the row holds a NaN
      float lanes[16] = {0};
      bool nan = false;
#ifdef __AVX512F__
      __m512 acc = _mm512_setzero_ps();
      __mmask16 unordered = 0;
      for (int64_t j = 0; j < whole; j += L) {
        const __m512 v = load_bf16(row + j);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        acc = _mm512_add_ps(acc, exp_nonpositive(_mm512_sub_ps(v, _mm512_set1_ps(largest))));
      }
      _mm512_storeu_ps(lanes, acc);
      nan = unordered != 0;
#else
      __m256 acc = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
      for (int64_t j = 0; j < whole; j += L) {
        const __m256 v = load_bf16(row + j);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        acc = _mm256_add_ps(acc, exp_nonpositive(_mm256_sub_ps(v, _mm256_set1_ps(largest))));
      }
      _mm256_storeu_ps(lanes, acc);
      nan = _mm256_movemask_ps(unordered) != 0;
#endif
      float sum = 0.0f;
      for (int64_t l = 0; l < L; ++l) sum += lanes[l];
      float tail[16] = {0}, values[16] = {0};
      const int64_t rest = n - whole;
      for (int64_t j = 0; j < rest; ++j) {
        tail[j] = bf16_to_float(row[whole + j]) - largest;
        nan |= tail[j] != tail[j];
      }
      for (int64_t j = 0; j < k; ++j) values[j] = top[j] - largest;
#ifdef __AVX512F__
      _mm512_storeu_ps(tail, exp_nonpositive(_mm512_loadu_ps(tail)));
      _mm512_storeu_ps(values, exp_nonpositive(_mm512_loadu_ps(values)));
#else
      for (int h = 0; h < 16; h += 8) {
        _mm256_storeu_ps(tail + h, exp_nonpositive(_mm256_loadu_ps(tail + h)));
        _mm256_storeu_ps(values + h, exp_nonpositive(_mm256_loadu_ps(values + h)));
      }
#endif
      for (int64_t j = 0; j < rest; ++j) sum += tail[j];
      if (nan || !std::isfinite(largest)) sum = NAN;  // as torch's softmax: NaN rows, and rows whose max is +-inf
      for (int64_t j = 0; j < k; ++j) {
        pp[r * k + j] = values[j] / sum;
        ip[r * k + j] = at[j];
      }
    }
  });
  return {probs, index};
}

// ---- exact speculative sampling on the target's logits (dflashkit/decoding/sampling.py: verify_sampled) -------------
// The sampling math of a sampled decoding step in one call: the target's logits rows in, the kept drafts and the
// emitted token out, instead of some 40 small torch ops whose code and data the target's pass (270 MB of weights
// through the caches) has just evicted, 20-70 µs each on AMD EPYC Zen 4.

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
using VecF = __m512;
inline VecF vec_load(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vec_load(const uint16_t* p) { return load_bf16(p); }
inline VecF vec_max(VecF a, VecF b) { return _mm512_max_ps(a, b); }
inline bool vec_has_nan(VecF v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
inline VecF vec_exp_scaled(VecF v, float largest, float scale) {
  return exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(largest)), _mm512_set1_ps(scale)));
}
inline void vec_store(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF vec_set_all(float v) { return _mm512_set1_ps(v); }
#else
constexpr int64_t kLanes = 8;
using VecF = __m256;
inline VecF vec_load(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vec_load(const uint16_t* p) { return load_bf16(p); }
inline VecF vec_max(VecF a, VecF b) { return _mm256_max_ps(a, b); }
inline bool vec_has_nan(VecF v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
inline VecF vec_exp_scaled(VecF v, float largest, float scale) {
  return exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(largest)), _mm256_set1_ps(scale)));
}
inline void vec_store(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF vec_set_all(float v) { return _mm256_set1_ps(v); }
#endif
inline float scalar_value(float v) { return v; }
inline float scalar_value(uint16_t v) { return bf16_to_float(v); }

// The fp32 sum of w[0..n) (n <= a chunk of 256) in 16 lanes: the chunk sums that row_exps and draw_index add in fp64.
inline float chunk_sum(const float* w, int64_t n) {
  float lanes[16] = {0};
  const int64_t full = n / 16 * 16;
  for (int64_t j = 0; j < full; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += w[j + l];
  float part = 0.0f;
  for (int l = 0; l < 16; ++l) part += lanes[l];
  for (int64_t j = full; j < n; ++j) part += w[j];
  return part;
}
constexpr int64_t kChunk = 256;

// exp((row[j] - largest) * scale) of a row of n fp32 or bf16 logits into out[n] (the softmax exp of the attention,
// relative error ~2e-7); returns their fp64 sum, or -1 where the row holds a NaN or its largest value is not finite.
template <typename T>
double row_exps(const T* row, int64_t n, float scale, float* out) {
  const int64_t whole = n / kLanes * kLanes;
  float largest = -INFINITY;
  bool nan = false;
  if (whole) {
    VecF top = vec_load(row);
    nan = vec_has_nan(top);
    for (int64_t j = kLanes; j < whole; j += kLanes) {
      const VecF v = vec_load(row + j);
      nan |= vec_has_nan(v);
      top = vec_max(top, v);
    }
    alignas(64) float lanes[16];
    vec_store(lanes, top);
    for (int64_t l = 0; l < kLanes; ++l) largest = std::max(largest, lanes[l]);
  }
  for (int64_t j = whole; j < n; ++j) {
    const float v = scalar_value(row[j]);
    nan |= v != v;
    largest = std::max(largest, v);
  }
  if (nan || !std::isfinite(largest)) return -1.0;
  for (int64_t j = 0; j < whole; j += kLanes) vec_store(out + j, vec_exp_scaled(vec_load(row + j), largest, scale));
  if (whole < n) {
    alignas(64) float tail[16];
    for (int64_t l = 0; l < kLanes; ++l) tail[l] = whole + l < n ? scalar_value(row[whole + l]) : largest;
    vec_store(tail, vec_exp_scaled(vec_load(tail), largest, scale));
    for (int64_t j = whole; j < n; ++j) out[j] = tail[j - whole];
  }
  double sum = 0.0;
  for (int64_t c = 0; c < n; c += kChunk) sum += chunk_sum(out + c, std::min(kChunk, n - c));
  return sum;
}

// The index drawn from nonnegative weights w[n] at u * total (u in (0, 1]): the first index whose fp64 running sum
// reaches it, as sampling.sample inverts its running sum. The chunks of 256 are summed first and only the one holding
// the point is walked; an index of weight 0 is never returned (where rounding leaves the walk short of the point, the
// chunk's last entry of positive weight is). -1 when every weight is 0.
int64_t draw_index(const float* w, int64_t n, double u) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> sums(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += (sums[c] = chunk_sum(w + c * kChunk, std::min(kChunk, n - c * kChunk)));
  if (!(total > 0.0)) return -1;
  const double point = u * total;
  double run = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (sums[c] > 0.0 && run + sums[c] >= point) {
      int64_t last = -1;
      for (int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); ++j) {
        if (!(w[j] > 0.0f)) continue;
        run += w[j];
        last = j;
        if (run >= point) return j;
      }
      return last;
    }
    run += sums[c];
  }
  return -1;  // not reached: run ends at total, added in the same order, and point <= total
}

// The drafter's sampled proposals: per row of scores [k, V'] (fp32 or bf16), the softmax of scores * scale (fp32
// [k, V']) and the index drawn from it at 1 - uniforms[i] (as sampling.sample: the first index whose running sum
// reaches that share of the total). Returns (indices [k], probs), or empty tensors where a row holds a NaN or a
// non-finite largest score (the caller then works in torch).
std::tuple<torch::Tensor, torch::Tensor> sample_rows(const torch::Tensor& scores, double scale,
                                                     const torch::Tensor& uniforms) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() && scores.size(1) >= 1 &&
              (scores.scalar_type() == at::kBFloat16 || scores.scalar_type() == at::kFloat),
              "scores: contiguous [k, V] fp32 or bf16");
  const int64_t k = scores.size(0), n = scores.size(1);
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == k && uniforms.scalar_type() == at::kDouble &&
              uniforms.is_contiguous(), "uniforms: contiguous [k] fp64");
  TORCH_CHECK(scale > 0.0 && std::isfinite(scale), "scale: 1 / temperature, > 0");
  auto probs = torch::empty({k, n}, scores.options().dtype(at::kFloat));
  auto index = torch::empty({k}, scores.options().dtype(at::kLong));
  float* pp = probs.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  const double* u = uniforms.data_ptr<double>();
  const float s = static_cast<float>(scale);
  for (int64_t i = 0; i < k; ++i) {
    float* row = pp + i * n;
    const double sum = scores.scalar_type() == at::kFloat ? row_exps(scores.data_ptr<float>() + i * n, n, s, row)
                                                          : row_exps(u16(scores) + i * n, n, s, row);
    if (!(sum > 0.0)) return {torch::empty({0}, index.options()), torch::empty({0}, probs.options())};
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
    ip[i] = draw_index(row, n, 1.0 - u[i]);
  }
  return {index, probs};
}

// Exact speculative sampling over a chain of k drafts, on the target's rows of logits [k+1, V] (fp32 or bf16) warped
// by temperature alone (scale = 1 / temperature), with uniforms [k+1] (fp64, in [0, 1)); draft_probs [k, V] fp32 (the
// drafter's proposal distributions; [k, V'] over the tokens `columns` [V'], a draft vocabulary, where that is not empty)
// or empty (one-hot proposals: copies, argmax drafts). The law and the use of the
// uniforms are sampling.verify_sampled's: sampled drafts by block verification (coin i - 1 = uniforms[i - 1] walked
// back from the last draft), one-hot drafts token by token (draft i kept while uniforms[i] < p_i(x_i)); the token
// after the kept drafts is drawn at 1 - uniforms[k] from the target's row or the residual. Returns (kept drafts,
// token), or (0, -1) where a row it reads holds a NaN or a non-finite largest logit (the caller then works in torch).
std::tuple<int64_t, int64_t> verify_chain(const torch::Tensor& logits, double scale, const torch::Tensor& drafts,
                                          const torch::Tensor& draft_probs, const torch::Tensor& columns,
                                          const torch::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(0) >= 1 && logits.size(1) >= 1 &&
              (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat),
              "logits: contiguous [k+1, V] fp32 or bf16");
  const int64_t k = logits.size(0) - 1, n = logits.size(1);
  TORCH_CHECK(drafts.dim() == 1 && drafts.size(0) == k && drafts.scalar_type() == at::kLong && drafts.is_contiguous(),
              "drafts: contiguous [k] int64");
  const bool one_hot = draft_probs.numel() == 0, over_columns = columns.numel() > 0;
  const int64_t width = over_columns ? columns.size(0) : n;
  TORCH_CHECK(!over_columns || (columns.dim() == 1 && columns.scalar_type() == at::kLong && columns.is_contiguous()),
              "columns: contiguous [V'] int64, or empty");
  TORCH_CHECK(one_hot || (draft_probs.dim() == 2 && draft_probs.size(0) == k && draft_probs.size(1) == width &&
                          draft_probs.scalar_type() == at::kFloat && draft_probs.is_contiguous()),
              "draft_probs: contiguous [k, V] fp32 (over `columns`: [k, V']), or empty");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == k + 1 && uniforms.scalar_type() == at::kDouble &&
              uniforms.is_contiguous(), "uniforms: contiguous [k+1] fp64");
  TORCH_CHECK(scale > 0.0 && std::isfinite(scale), "scale: 1 / temperature, > 0");
  const int64_t* x = drafts.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) TORCH_CHECK(x[i] >= 0 && x[i] < n, "draft tokens in [0, V)");
  const double* u = uniforms.data_ptr<double>();
  const float* q = one_hot ? nullptr : draft_probs.data_ptr<float>();
  // scratch kept between calls (fresh buffers of this size cost page faults on every call: ~0.1 ms)
  thread_local std::vector<float> exps, work, q_row;
  thread_local std::vector<int32_t> slot;  // over `columns`: token -> its column, -1 elsewhere (reset after use)
  if (static_cast<int64_t>(exps.size()) < (k + 1) * n) exps.resize((k + 1) * n);
  if (static_cast<int64_t>(work.size()) < n) { work.resize(n); q_row.resize(n); }
  const int64_t* col = over_columns ? columns.data_ptr<int64_t>() : nullptr;
  if (!one_hot && over_columns) {
    if (static_cast<int64_t>(slot.size()) < n) slot.assign(n, -1);
    for (int64_t c = 0; c < width; ++c) {
      TORCH_CHECK(col[c] >= 0 && col[c] < n, "columns in [0, V)");
      slot[col[c]] = static_cast<int32_t>(c);  // a repeated token: its last column, as index_copy_
    }
  }
  struct ResetSlots {  // leave `slot` all -1 again however this call ends
    const int64_t* col; int64_t width;
    ~ResetSlots() { if (col) for (int64_t c = 0; c < width; ++c) slot[col[c]] = -1; }
  } reset{!one_hot && over_columns ? col : nullptr, width};
  auto q_at = [&](int64_t i, int64_t token) -> float {  // q_i(token)
    if (!over_columns) return q[i * n + token];
    const int32_t c = slot[token];
    return c >= 0 ? q[i * width + c] : 0.0f;
  };
  auto q_dense = [&](int64_t i) -> const float* {  // row i of q over the whole vocabulary
    if (!over_columns) return q + i * n;
    std::fill(q_row.begin(), q_row.begin() + n, 0.0f);
    for (int64_t c = 0; c < width; ++c) q_row[col[c]] = q[i * width + c];
    return q_row.data();
  };
  std::vector<double> sums(k + 1, 0.0);  // 0: not computed yet
  auto row = [&](int64_t i) -> const float* {  // row i's exps (its sum in sums[i]); null for a NaN or inf row
    if (sums[i] == 0.0) {
      const float s = static_cast<float>(scale);
      sums[i] = logits.scalar_type() == at::kFloat ? row_exps(logits.data_ptr<float>() + i * n, n, s, &exps[i * n])
                                                   : row_exps(u16(logits) + i * n, n, s, &exps[i * n]);
    }
    return sums[i] > 0.0 ? &exps[i * n] : nullptr;
  };
  // work = max(0, w p_i - q_i), the residual after i kept sampled drafts (p_i: row i, which row(i) has loaded);
  // returns its mass |r_i|
  auto residual = [&](int64_t i, double weight) -> double {
    const float* e = &exps[i * n];
    const float wi = static_cast<float>(weight), inv = static_cast<float>(1.0 / sums[i]);
    const float* qi = q_dense(i);
    for (int64_t j = 0; j < n; ++j) work[j] = std::max(0.0f, wi * (e[j] * inv) - qi[j]);
    double mass = 0.0;
    for (int64_t c = 0; c < n; c += kChunk) mass += chunk_sum(&work[c], std::min(kChunk, n - c));
    return mass;
  };
  const auto fail = std::make_tuple(int64_t{0}, int64_t{-1});
  std::vector<double> w(k + 1, 1.0);  // sampled drafts: block weights w_0..w_k
  int64_t kept = 0;
  if (one_hot) {
    for (; kept < k; ++kept) {
      const float* e = row(kept);
      if (!e) return fail;
      if (!(u[kept] < e[x[kept]] / sums[kept])) break;
    }
  } else if (k > 0) {
    for (int64_t i = 0; i < k; ++i) {
      const float* e = row(i);
      if (!e) return fail;
      const double px = e[x[i]] / sums[i], qx = q_at(i, x[i]);  // q(x) > 0: x was drawn from q
      w[i + 1] = std::min(1.0, qx > 0.0 ? w[i] * (px / qx) : 1.0);
    }
    for (int64_t i = k; i >= 1; --i) {
      if (!(u[i - 1] < w[i])) continue;
      double stop = w[i];  // h_k = w_k; h_i = |r_i| / (|r_i| + 1 - w_i), r_i = max(0, w_i p_i - q_i)
      if (i < k) {  // row i was loaded for its weight
        const double mass = residual(i, w[i]), denominator = mass + 1.0 - w[i];
        stop = denominator > 0.0 ? mass / denominator : 1.0;
      }
      if (u[i - 1] < stop) { kept = i; break; }
    }
  }
  const float* e = row(kept);
  if (!e) return fail;
  const double at = 1.0 - u[k];  // in (0, 1]
  if (kept == k) return {kept, draw_index(e, n, at)};
  // the token after the kept drafts: from the residual max(0, w p - q) (one-hot: p without the refused draft)
  if (one_hot) {
    const float inv = static_cast<float>(1.0 / sums[kept]);
    for (int64_t j = 0; j < n; ++j) work[j] = e[j] * inv;
    work[x[kept]] = 0.0f;
  } else {
    residual(kept, w[kept]);
  }
  const int64_t token = draw_index(work.data(), n, at);
  return {kept, token >= 0 ? token : draw_index(e, n, at)};  // an empty residual: an event of probability 0
}

// ---- coupled sampling's Gumbel noise (dflashkit/decoding/sampling.py: PositionNoise) --------------------------------
// G(key, token) = -log(-log u) with u = ((h >> 8) | 1) / 2^24 in (0, 1) and h = r(r(token ^ lo) ^ hi), r Chris
// Wellons' lowbias32 and (lo, hi) the halves of an output position's 64-bit key: a counter-based function, so a
// decision computes the noise of the columns it reads where it reads them (numpy's PCG64 and two torch logs took
// ~0.36 ms a 49,152-entry row, plus the small ops around them). The logs are Cephes' logf polynomial in FMAs. The hash,
// the log and the noise are written once, over the few vector operations each instruction set defines below, so the
// two builds run the same sequence of operations and give the same noise.

#ifdef __AVX512F__
using VecI = __m512i;
using MaskF = __mmask16;
inline VecI vi_set(int32_t v) { return _mm512_set1_epi32(v); }
inline VecI vi_add(VecI a, VecI b) { return _mm512_add_epi32(a, b); }
inline VecI vi_sub(VecI a, VecI b) { return _mm512_sub_epi32(a, b); }
inline VecI vi_and(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI vi_or(VecI a, VecI b) { return _mm512_or_si512(a, b); }
inline VecI vi_xor(VecI a, VecI b) { return _mm512_xor_si512(a, b); }
inline VecI vi_mul(VecI a, VecI b) { return _mm512_mullo_epi32(a, b); }
template <int S> inline VecI vi_srl(VecI a) { return _mm512_srli_epi32(a, S); }
inline VecI vi_select(MaskF m, VecI yes, VecI no) { return _mm512_mask_mov_epi32(no, m, yes); }
inline VecF vf_add(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF vf_sub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF vf_mul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vf_fmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vf_fnmadd(VecF a, VecF b, VecF c) { return _mm512_fnmadd_ps(a, b, c); }
inline VecF vf_from_int(VecI a) { return _mm512_cvtepi32_ps(a); }
inline VecF vf_bits(VecI a) { return _mm512_castsi512_ps(a); }
inline VecI vi_bits(VecF a) { return _mm512_castps_si512(a); }
inline MaskF vf_greater(VecF a, VecF b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline VecF vf_select(MaskF m, VecF yes, VecF no) { return _mm512_mask_mov_ps(no, m, yes); }
inline VecI token_lanes(int32_t first) {
  return _mm512_add_epi32(_mm512_set1_epi32(first),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
inline VecI token_load(const int32_t* p) { return _mm512_loadu_si512(p); }
inline void store_lanes(int32_t* p, VecI v) { _mm512_storeu_si512(p, v); }
inline void keep_apart(VecF& v) { asm("" : "+v"(v)); }  // an opaque step: the compiler cannot fuse across it
#else
using VecI = __m256i;
using MaskF = __m256;
inline VecI vi_set(int32_t v) { return _mm256_set1_epi32(v); }
inline VecI vi_add(VecI a, VecI b) { return _mm256_add_epi32(a, b); }
inline VecI vi_sub(VecI a, VecI b) { return _mm256_sub_epi32(a, b); }
inline VecI vi_and(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI vi_or(VecI a, VecI b) { return _mm256_or_si256(a, b); }
inline VecI vi_xor(VecI a, VecI b) { return _mm256_xor_si256(a, b); }
inline VecI vi_mul(VecI a, VecI b) { return _mm256_mullo_epi32(a, b); }
template <int S> inline VecI vi_srl(VecI a) { return _mm256_srli_epi32(a, S); }
inline VecI vi_select(MaskF m, VecI yes, VecI no) { return _mm256_blendv_epi8(no, yes, _mm256_castps_si256(m)); }
inline VecF vf_add(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF vf_sub(VecF a, VecF b) { return _mm256_sub_ps(a, b); }
inline VecF vf_mul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vf_fmadd(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vf_fnmadd(VecF a, VecF b, VecF c) { return _mm256_fnmadd_ps(a, b, c); }
inline VecF vf_from_int(VecI a) { return _mm256_cvtepi32_ps(a); }
inline VecF vf_bits(VecI a) { return _mm256_castsi256_ps(a); }
inline VecI vi_bits(VecF a) { return _mm256_castps_si256(a); }
inline MaskF vf_greater(VecF a, VecF b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline VecF vf_select(MaskF m, VecF yes, VecF no) { return _mm256_blendv_ps(no, yes, m); }
inline VecI token_lanes(int32_t first) {
  return _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline VecI token_load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store_lanes(int32_t* p, VecI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline void keep_apart(VecF& v) { asm("" : "+x"(v)); }
#endif

inline VecI lowbias32(VecI x) {
  x = vi_xor(x, vi_srl<16>(x));
  x = vi_mul(x, vi_set(0x21f0aaad));
  x = vi_xor(x, vi_srl<15>(x));
  x = vi_mul(x, vi_set(0x735a2d97));
  return vi_xor(x, vi_srl<15>(x));
}

// log(x) for normal x > 0: x = m 2^e with m in (sqrt(1/2), sqrt(2)], log m by Cephes' degree-8 polynomial in m - 1
inline VecF log_positive(VecF x) {
  const VecI bits = vi_bits(x);
  VecI e = vi_sub(vi_srl<23>(bits), vi_set(127));
  VecF m = vf_bits(vi_or(vi_and(bits, vi_set(0x007FFFFF)), vi_set(0x3F800000)));  // [1, 2)
  const MaskF big = vf_greater(m, vec_set_all(1.41421356237f));
  m = vf_select(big, vf_mul(m, vec_set_all(0.5f)), m);  // exact
  e = vi_select(big, vi_add(e, vi_set(1)), e);
  const VecF f = vf_sub(m, vec_set_all(1.0f)), ef = vf_from_int(e), z = vf_mul(f, f);
  static constexpr float kPoly[] = {7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f,
                                    1.4249322787e-1f, -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f,
                                    3.3333331174e-1f};
  VecF p = vec_set_all(kPoly[0]);
  for (int i = 1; i < 9; ++i) p = vf_fmadd(p, f, vec_set_all(kPoly[i]));
  VecF y = vf_mul(vf_mul(p, f), z);
  y = vf_fmadd(ef, vec_set_all(-2.12194440e-4f), y);
  y = vf_fnmadd(z, vec_set_all(0.5f), y);
  return vf_fmadd(ef, vec_set_all(0.693359375f), vf_add(f, y));
}

inline VecF gumbel_of(VecI tokens, uint32_t lo, uint32_t hi) {
  VecI h = lowbias32(vi_xor(tokens, vi_set(static_cast<int32_t>(lo))));
  h = lowbias32(vi_xor(h, vi_set(static_cast<int32_t>(hi))));
  const VecF u = vf_mul(vf_from_int(vi_or(vi_srl<8>(h), vi_set(1))),
                        vec_set_all(5.9604644775390625e-8f));  // exact: an odd integer < 2^24, / 2^24
  const VecF zero = vec_set_all(0.0f);
  return vf_sub(zero, log_positive(vf_sub(zero, log_positive(u))));  // -log(-log u), -log u in [6e-8, 16.7]
}

// x * scale, then + g: two roundings, as torch's `x * scale + g` (the compiler may not fuse them into an FMA)
inline VecF scaled_plus(VecF x, float scale, VecF g) {
  VecF s = vf_mul(x, vec_set_all(scale));
  keep_apart(s);
  return vf_add(s, g);
}

inline void keep_larger(VecF& top, VecI& at, VecF v, VecI index) {  // lanes where v > top (NaN: never)
  const MaskF larger = vf_greater(v, top);
  top = vf_select(larger, v, top);
  at = vi_select(larger, index, at);
}

// A best score and where it is: the first largest (a NaN's index, the first of them, wherever one was seen).
struct Best {
  float value = -INFINITY;
  int64_t index = -1;
  int64_t first_nan = -1;
};

// Columns [begin, end) of one row of coupled sampling (begin a multiple of kLanes): s_c = x_c * scale + G(key, token)
// with token columns[c] (or c where columns is null; x null: G alone) into out[c] where out is not null, and, where
// `track`, the first largest s_c (and the first NaN) returned.
template <typename T>
Best coupled_row(const T* x, int64_t begin, int64_t end, float scale, uint64_t key, const int64_t* columns,
                 float* out, bool track) {
  const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
  alignas(64) float pad[16];
  alignas(64) int32_t tokens[16], lanes[16];
  VecF top = vec_set_all(-INFINITY);
  VecI at = token_lanes(static_cast<int32_t>(begin));
  bool nan = false;
  for (int64_t j = begin; j < end; j += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, end - j);
    VecI tok;
    if (columns) {
      for (int64_t l = 0; l < kLanes; ++l) tokens[l] = static_cast<int32_t>(columns[j + std::min(l, count - 1)]);
      tok = token_load(tokens);
    } else {
      tok = token_lanes(static_cast<int32_t>(j));
    }
    VecF s = gumbel_of(tok, lo, hi);
    if (x) {
      VecF v;
      if (count == kLanes) {
        v = vec_load(x + j);
      } else {  // past the range: -inf, never the largest
        for (int64_t l = 0; l < kLanes; ++l) pad[l] = l < count ? scalar_value(x[j + l]) : -INFINITY;
        v = vec_load(pad);
      }
      s = scaled_plus(v, scale, s);
    }
    if (out) {
      if (count == kLanes) {
        vec_store(out + j, s);
      } else {
        vec_store(pad, s);
        std::memcpy(out + j, pad, count * sizeof(float));
      }
    }
    if (track) {
      nan |= vec_has_nan(s);
      keep_larger(top, at, s, token_lanes(static_cast<int32_t>(j)));  // a lane keeps its first largest
    }
  }
  Best best;
  if (!track || end <= begin) return best;
  alignas(64) float values[16];
  vec_store(values, top);
  store_lanes(lanes, at);
  best.index = begin;  // every entry -inf: the first
  for (int64_t l = 0; l < kLanes && begin + l < end; ++l)  // a lane that never saw a larger value holds its first index
    if (values[l] > best.value || (values[l] == best.value && lanes[l] < best.index))
      best.value = values[l], best.index = lanes[l];
  if (nan) {  // the first NaN, computed again entry by entry: rare (a broken row)
    std::vector<float> row(end - begin);
    coupled_row(x ? x + begin : nullptr, 0, end - begin, scale, key, columns ? columns + begin : nullptr, row.data(),
                false);
    for (int64_t c = 0; c < end - begin; ++c)
      if (row[c] != row[c]) { best.first_nan = begin + c; break; }
  }
  return best;
}

struct CoupledArgs {
  int64_t rows, width;
  const uint64_t* keys;
  const int64_t* columns;  // null: the identity
};

// keys: int64 [R] (each a position's 64-bit key, bits as uint64); columns: int64 [W] in [0, 2^31), or empty (tokens
// 0..width-1).
CoupledArgs coupled_args(const torch::Tensor& keys, int64_t width, const torch::Tensor& columns) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.is_contiguous(), "keys: contiguous [R] int64");
  TORCH_CHECK(width >= 1 && width < (int64_t{1} << 31), "width: 1 to 2^31 - 1 columns");
  const int64_t* col = nullptr;
  if (columns.numel() > 0) {
    TORCH_CHECK(columns.dim() == 1 && columns.scalar_type() == at::kLong && columns.is_contiguous() &&
                columns.size(0) == width, "columns: contiguous [W] int64, or empty");
    col = columns.data_ptr<int64_t>();
    for (int64_t c = 0; c < width; ++c) TORCH_CHECK(col[c] >= 0 && col[c] < (int64_t{1} << 31), "columns in [0, 2^31)");
  }
  return {keys.size(0), width, reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>()), col};
}

// Rows of a coupled call, split into parts of whole vectors where the rows alone would leave a thread idle (a
// one-token step's one row: both threads, ~45 µs instead of ~85 for 49,152 entries on AMD EPYC Zen 4); runs
// part(row, part index, begin, end) for every part, in parallel.
template <typename F>
void coupled_parts(int64_t rows, int64_t width, int64_t parts, F part) {
  const int64_t vectors = (width + kLanes - 1) / kLanes, per = (vectors + parts - 1) / parts;
  at::parallel_for(0, rows * parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / parts, p = t % parts;
      const int64_t begin = std::min(width, p * per * kLanes), end = std::min(width, (p + 1) * per * kLanes);
      part(r, p, begin, end);
    }
  });
}

int64_t coupled_split(int64_t rows, int64_t width) {  // parts per row
  const int64_t threads = at::get_num_threads();
  return rows % threads == 0 || rows >= 4 * threads || width < 4096 ? 1 : threads;  // 1 or 3 rows on 2 threads: 2
}

// The noise G(keys[r], token of column c) [R, W] fp32.
torch::Tensor gumbel_rows(const torch::Tensor& keys, int64_t width, const torch::Tensor& columns) {
  const CoupledArgs a = coupled_args(keys, width, columns);
  auto out = torch::empty({a.rows, a.width}, keys.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  coupled_parts(a.rows, a.width, coupled_split(a.rows, a.width), [&](int64_t r, int64_t, int64_t begin, int64_t end) {
    coupled_row<float>(nullptr, begin, end, 1.0f, a.keys[r], a.columns, op + r * a.width, false);
  });
  return out;
}

// Coupled scores x * scale + G [R, W] fp32 of rows x [R, W] (fp32 or bf16), and / or each row's argmax [R] int64
// (the first largest, a NaN counting as the largest: torch's argmax of those scores).
std::vector<torch::Tensor> coupled_rows(const torch::Tensor& x, double scale, const torch::Tensor& keys,
                                        const torch::Tensor& columns, bool scores, bool argmax) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: contiguous [R, W] fp32 or bf16");
  const CoupledArgs a = coupled_args(keys, x.size(1), columns);
  TORCH_CHECK(a.rows == x.size(0), "one key per row");
  TORCH_CHECK(scale > 0.0 && std::isfinite(scale), "scale: 1 / temperature, > 0");
  const float s = static_cast<float>(scale);
  auto out = torch::empty({scores ? a.rows : 0, scores ? a.width : 0}, x.options().dtype(at::kFloat));
  auto index = torch::empty({argmax ? a.rows : 0}, x.options().dtype(at::kLong));
  float* op = scores ? out.data_ptr<float>() : nullptr;
  const int64_t parts = coupled_split(a.rows, a.width);
  std::vector<Best> found(a.rows * parts);
  coupled_parts(a.rows, a.width, parts, [&](int64_t r, int64_t p, int64_t begin, int64_t end) {
    float* o = op ? op + r * a.width : nullptr;
    found[r * parts + p] = x.scalar_type() == at::kFloat
        ? coupled_row(x.data_ptr<float>() + r * a.width, begin, end, s, a.keys[r], a.columns, o, argmax)
        : coupled_row(u16(x) + r * a.width, begin, end, s, a.keys[r], a.columns, o, argmax);
  });
  if (argmax) {
    int64_t* ip = index.data_ptr<int64_t>();
    for (int64_t r = 0; r < a.rows; ++r) {
      Best best;
      for (int64_t p = 0; p < parts; ++p) {  // parts in column order: a later part wins only with a larger value
        const Best& b = found[r * parts + p];
        if (b.first_nan >= 0 && best.first_nan < 0) best.first_nan = b.first_nan;
        if (b.index >= 0 && (best.index < 0 || b.value > best.value)) best.value = b.value, best.index = b.index;
      }
      ip[r] = best.first_nan >= 0 ? best.first_nan : best.index;
    }
  }
  return {out, index};
}

// How many threads at::parallel_for gives the kernels' work: it is compiled into this file, so without -fopenmp
// here it runs on one thread whatever torch.get_num_threads() says (tests guard the build flags with this).
int64_t parallel_threads() {
  std::vector<int> used(at::get_num_threads() + 1, 0);
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  int64_t count = 0;
  for (int u : used) count += u;
  return count;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = kIsa;
  m.attr("blocks") = kBlocks;
  m.attr("int8") = kInt8;
  m.attr("int4") = true;  // linear takes 4-bit packed weights (row_int4.h)
  m.def("parallel_threads", &parallel_threads, "threads the kernels' parallel loops run on");
  m.def("ready", &ready, "whether the kernels can run in this process (AMX: the OS granted the tile state)");
  m.def("linear", &linear, "bf16 x @ W.T (+ bias) with a packed W");
  m.def("attention", &attention, "grouped-query attention, one query row at a time");
  m.def("argmax_rows", &argmax_rows, "index of each bf16 row's largest value, as torch's argmax");
  m.def("sample_rows", &sample_rows, "a drafter's sampled proposals: each row's softmax and an index drawn from it");
  m.def("verify_chain", &verify_chain, "exact speculative sampling over a chain of drafts on the target's logits");
  m.def("gumbel_rows", &gumbel_rows, "coupled sampling's Gumbel noise of positions' keys over columns");
  m.def("coupled_rows", &coupled_rows, "coupled sampling's noisy scores of rows and / or their argmax");
  m.def("top_probs_rows", &top_probs_rows, "each bf16 row's k largest values as softmax probabilities, and their indices");
  m.def("decoder_layers", &decoder_layers, "every decoder layer for a few rows, each row on its own");
  m.def("decoder_layers_batch", &decoder_layers_batch,
        "every decoder layer for the rows of several sequences, each over its own cache, each row on its own");
  m.def("drafter_step_batch", &drafter_step_batch,
        "a DFlash drafter's step for several sequences: context rows in, block through every layer, final norm");
}
