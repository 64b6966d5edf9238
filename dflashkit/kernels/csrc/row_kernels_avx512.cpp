// AVX512-BF16 kernels for the few rows of a decoding step (dflashkit/kernels/row_kernels.py): a bf16 matrix product
// and grouped-query attention, each computing a row the same way whatever rows run beside it, so that a
// verify pass over a block and one-token steps give bitwise the same results.
//
// Matrix product y = x @ W.T (+ bias).
// The weight is packed once (dflashkit/kernels/row_kernels.py) into groups of 64 output columns:
//   packed[g][k2][b][c][p] = W[64 g + 16 b + c][2 k2 + p]      shape [G, K/2, 4, 16, 2]
// so that one 64-byte load holds the (2 k2, 2 k2 + 1) weight pairs of 16 columns, the operand layout of
// vdpbf16ps, and a group's whole panel is one sequential stream. Each row of x is broadcast two elements at a
// time and accumulated in fp32 into 4 registers (64 columns) per row, up to 6 rows at a time (24
// accumulators); more rows reuse the group's panel from cache. Every output element is the same fp32 sum in
// the same order whatever the number of rows, so a row's result does not depend on the rows beside it.
//
// Built with -DDFLASHKIT_AMX (CPUs with AMX-BF16, such as Intel's Sapphire Rapids), the product runs on AMX tiles
// over the same packed layout: a B tile is 16 (2 k2, 2 k2 + 1) pair rows of one 16-column block (64 bytes each,
// 256 bytes apart in the packed panel), an A tile up to 16 rows of x times 32 of K, and the 4 blocks' fp32 sums
// stay in 4 C tiles for the whole K; K pairs past the last whole 32 are added with vdpbf16ps, in order. Each C row
// depends only on its own A row, so a row's result is again the same whatever rows run beside it.
#include "row_common.h"

#ifdef DFLASHKIT_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef DFLASHKIT_AMX
constexpr const char* kIsa = "AMX-BF16";
#else
constexpr const char* kIsa = "AVX512-BF16";
#endif
constexpr bool kInt8 = true;  // linear also takes int8-packed weights (the AVX2 source's layout), see linear_int8
constexpr int kInt8Group = 16;  // output columns per int8 group
constexpr int kBlocks = 4;                 // 16-column blocks per group
constexpr int kGroup = kBlocks * 16;       // output columns per group
constexpr int kMaxRows = 6;                // rows per micro-kernel call
constexpr int64_t kChunkK2 = 32;           // K pairs per pass when several row chunks share a panel (8 KB of it)
constexpr int64_t kMaxRowChunks = 11;      // row chunks that share a K chunk: up to 66 rows

// One row's fp32 sums of the 16 columns n0.. to bf16 (nearest even) after the fp32 bias; only columns below `valid`
// are stored. Always inlined (as a call, a tile store kept the AVX2 micro-kernel's accumulators in memory).
__attribute__((always_inline)) inline void store_sums(__m512 sums, int64_t n0, int64_t valid, const float* bias,
                                                      uint16_t* y) {
  const int64_t count = valid - n0 < 16 ? valid - n0 : 16;
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  _mm256_mask_storeu_epi16(y + n0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, b)));
}

// R rows of x times one group's panel over the K pairs [k0, k1), summed in fp32 into 4 registers (64 columns) per
// row. A product of up to kMaxRows rows is one call over the whole K (`first` and `last`). More rows run K chunk by
// K chunk, every row chunk over one chunk before the next (it stays in L1 for them): the sums carry over between
// chunks in `state` (R x 4 x 16 floats, stored and reloaded exactly), so every output element is the same fp32 sum
// in the same order in either case, and the first row chunks prefetch the next K chunk into L2 (`ahead`, two cache
// lines per K pair), so that the weights stream from memory while the row chunks compute instead of before them.
template <int R>
void micro(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k0, int64_t k1, float* state, bool first,
           bool last, const char* ahead, uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  __m512 acc[R][kBlocks];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
    _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j)
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(state + (i * kBlocks + j) * 16);
  const int32_t* pairs[R];  // x's rows read as (2 k2, 2 k2 + 1) pairs
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) pairs[i] = reinterpret_cast<const int32_t*>(x + i * ldx);
  for (int64_t k2 = k0; k2 < k1; ++k2) {
    const uint16_t* wk = w + k2 * (kBlocks * 32);
    if (ahead) {
      _mm_prefetch(ahead + (k2 - k0) * 128, _MM_HINT_T1);
      _mm_prefetch(ahead + (k2 - k0) * 128 + 64, _MM_HINT_T1);
    }
    __m512bh wv[kBlocks];
    _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wk + j * 32);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pairs[i][k2]);
      _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xb);
    }
  }
  if (last) {
    for (int j = 0; j < kBlocks && j * 16 < valid; ++j)
      _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) store_sums(acc[i][j], j * 16, valid, bias, y + i * ldy);
  } else {
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
      _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j)
        _mm512_storeu_ps(state + (i * kBlocks + j) * 16, acc[i][j]);
  }
}

void rows(int64_t r, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k0, int64_t k1, float* state,
          bool first, bool last, const char* ahead, uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  switch (r) {
    case 1: micro<1>(x, ldx, w, k0, k1, state, first, last, ahead, y, ldy, valid, bias); break;
    case 2: micro<2>(x, ldx, w, k0, k1, state, first, last, ahead, y, ldy, valid, bias); break;
    case 3: micro<3>(x, ldx, w, k0, k1, state, first, last, ahead, y, ldy, valid, bias); break;
    case 4: micro<4>(x, ldx, w, k0, k1, state, first, last, ahead, y, ldy, valid, bias); break;
    case 5: micro<5>(x, ldx, w, k0, k1, state, first, last, ahead, y, ldy, valid, bias); break;
    default: micro<6>(x, ldx, w, k0, k1, state, first, last, ahead, y, ldy, valid, bias); break;
  }
}

// 16 int8 weights (one K row of a 16-column int8 group) as fp32, exactly.
inline __m512 int8_fp32(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// Rows 2 k2 and 2 k2 + 1 of a group's int8 weights (16 each) as 16 (even, odd) bf16 pairs, the operand of vdpbf16ps
// (and of an AMX B tile's row): the fp32 of an int8 is exact with zeros in its low half, so its top half is its bf16
// and the odd row's fp32 lanes OR the even row's shifted down are the pairs.
inline __m512i int8_pairs(const int8_t* w) {
  const __m512i even = _mm512_castps_si512(int8_fp32(w)), odd = _mm512_castps_si512(int8_fp32(w + kInt8Group));
  return _mm512_or_si512(_mm512_srli_epi32(even, 16), odd);
}

#ifdef DFLASHKIT_AMX
constexpr int kTileRows = 16;  // rows of x per A tile
constexpr int64_t kPrefetchBytes = 8192;  // software prefetch distance in the weight stream

// ldtilecfg's 64-byte operand (palette 1): per tile, its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are asm statements that name no memory: without this fence around them it may move (or
// drop as dead) the stores of a buffer a tile then loads, or read a buffer before the tile store that fills it.
inline void memory_fence() { __asm__ __volatile__("" ::: "memory"); }

// Linux gives a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// without it the first tile instruction is SIGILL.
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// Tiles 0-3: C, r rows of 16 fp32 (one per 16-column block); 4: A, r rows of 32 bf16; 5, 6: B, 16 pair rows.
void configure_tiles(int r) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) config.rows[t] = static_cast<uint8_t>(r), config.colsb[t] = 64;
  for (int t = 5; t < 7; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// Both AMX products' outer loop: the threads share the groups [0, groups); each group runs begin(g, scratch) once,
// then chunk(g, m0, r, scratch) for the rows m0..m0+r-1 of balanced chunks of at most 16 rows (the tiles configured
// for r whenever it changes, released at the end); scratch: scratch_size words of the thread's own.
template <typename Begin, typename Chunk>
void tile_groups(int64_t groups, int64_t m, int64_t scratch_size, Begin begin, Chunk chunk) {
  TORCH_CHECK(tiles_permitted(), "the kernel could not get AMX tile state from the OS (arch_prctl)");
  const int64_t chunks = (m + kTileRows - 1) / kTileRows;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    int configured = 0;  // the row count the tiles are set up for (0: not yet)
    std::vector<uint32_t> scratch(scratch_size);
    for (int64_t g = g0; g < g1; ++g) {
      begin(g, scratch.data());
      for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
        const int r = static_cast<int>((m - m0 + (chunks - c) - 1) / (chunks - c));
        if (r != configured) configure_tiles(configured = r);
        chunk(g, m0, r, scratch.data());
        m0 += r;
      }
    }
    if (configured) _tile_release();
  });
}

// Rows 0..r-1 (r <= 16, the tiles configured for r) of x times one packed group of 64 columns.
void amx_rows(int r, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k2_count, uint16_t* y, int64_t ldy,
              int64_t valid, const float* bias) {
  constexpr int64_t kPairRow = kBlocks * 32;  // elements from one k2 to the next in the panel
  const int64_t whole = k2_count / 16;  // K steps of 32 on the tiles
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t s = 0; s < whole; ++s) {
    const uint16_t* ws = w + s * 16 * kPairRow;
    const char* ahead = reinterpret_cast<const char*>(ws) + kPrefetchBytes;  // this step's 4 KB, that far ahead
    for (int line = 0; line < 16 * kPairRow * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(4, x + s * 32, ldx * 2);
    _tile_loadd(5, ws, kPairRow * 2);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, ws + 32, kPairRow * 2);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, ws + 64, kPairRow * 2);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, ws + 96, kPairRow * 2);
    _tile_dpbf16ps(3, 4, 6);
  }
  alignas(64) float sums[kTileRows][kGroup];
  _tile_stored(0, &sums[0][0], kGroup * 4);
  _tile_stored(1, &sums[0][16], kGroup * 4);
  _tile_stored(2, &sums[0][32], kGroup * 4);
  _tile_stored(3, &sums[0][48], kGroup * 4);
  memory_fence();
  for (int i = 0; i < r; ++i) {
    const int32_t* pairs = reinterpret_cast<const int32_t*>(x + i * ldx);
    __m512 acc[kBlocks];
    for (int j = 0; j < kBlocks; ++j) acc[j] = _mm512_load_ps(&sums[i][16 * j]);
    for (int64_t k2 = whole * 16; k2 < k2_count; ++k2) {  // the pairs past the last whole 32 of K, in order
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pairs[k2]);
      for (int j = 0; j < kBlocks; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(w + k2 * kPairRow + j * 32), xb);
    }
    for (int j = 0; j < kBlocks && j * 16 < valid; ++j) store_sums(acc[j], j * 16, valid, bias, y + i * ldy);
  }
}

// Weight-only int8 (dflashkit/kernels/int8.py): y = (x @ Q.T) * scale (+ bias), one fp32 scale per column, in the AVX2
// source's layout: an int8 tensor [G, 16 K + 64] whose group g holds packed[g][16 k + c] = Q[16 g + c][k] for its 16
// columns, then their 16 scales as fp32 bytes. Each 32 of K, the group's 32 x 16 int8 weights become one bf16 B
// tile in a buffer (int8 is exact in bf16), then the same tile product as above into one C tile; K past the last
// whole 32 in fp32 FMAs, in order. Half the bytes of bf16 to stream, for a conversion shared by the rows.

// One step's B tile (32 of K: 16 k2 rows of 16 (even, odd) bf16 pairs) from a group's int8 weights ws [32][16].
inline void int8_tile(const int8_t* ws, uint32_t* tile) {
  for (int line = 0; line < 32 * kInt8Group; line += 64)  // this step's 512 bytes, kPrefetchBytes ahead
    _mm_prefetch(reinterpret_cast<const char*>(ws) + kPrefetchBytes + line, _MM_HINT_T0);
  for (int k2 = 0; k2 < 16; ++k2) _mm512_storeu_si512(tile + 16 * k2, int8_pairs(ws + 2 * k2 * kInt8Group));
}

// Tiles as configure_tiles(r) leaves them: 0 (C), 4 (A), 5 (B). One int8 group of 16 columns for rows 0..r-1. Its B
// tiles are converted step by step, or read from `panel` (all of them, converted once for several row chunks).
void amx_rows_int8(int r, const uint16_t* x, int64_t ldx, const int8_t* w, const uint32_t* panel, int64_t k,
                   uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  const int64_t whole = k / 32;
  alignas(64) uint32_t tile[16 * 16];
  _tile_zero(0);
  for (int64_t s = 0; s < whole; ++s) {
    const uint32_t* b_tile = panel ? panel + s * 256 : tile;
    if (!panel) int8_tile(w + s * 32 * kInt8Group, tile);
    memory_fence();
    _tile_loadd(4, x + s * 32, ldx * 2);
    _tile_loadd(5, b_tile, 64);
    memory_fence();  // the next step's conversion must not overwrite the buffer before this load
    _tile_dpbf16ps(0, 4, 5);
  }
  alignas(64) float sums[kTileRows][kInt8Group];
  _tile_stored(0, &sums[0][0], kInt8Group * 4);
  memory_fence();
  const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + kInt8Group * k));  // the group's 16 scales
  for (int i = 0; i < r; ++i) {
    __m512 acc = _mm512_load_ps(sums[i]);
    for (int64_t kk = whole * 32; kk < k; ++kk)  // K past the last whole 32, in order
      acc = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_float(x[i * ldx + kk])), int8_fp32(w + kk * kInt8Group), acc);
    store_sums(_mm512_mul_ps(acc, scale), 0, valid, bias, y + i * ldy);
  }
}

#else
// Weight-only int8 without AMX, in the same layout (see above: per group of 16 columns, K rows of 16 int8 weights,
// then their 16 fp32 scales). Each (2 k2, 2 k2 + 1) pair of rows becomes one vector of 16 (even, odd) bf16 pairs
// (exact: fp32 of an int8 is exact and its top half is its bf16), the operand of vdpbf16ps as in the bf16 product.
// Two accumulators per row (even and odd pair steps, added at the end) keep two vdpbf16ps chains in flight for a
// single row; an odd K's last weight row is added in fp32, last. A chunk of up to kInt8Rows rows converts each pair
// step once for all its rows; past kInt8Panel rows (prefills) a group's whole panel is converted once into a buffer
// that every chunk reads. Either way a row's sums are the same values in the same order, whatever rows run beside
// it. On AMD EPYC Zen 4 a whole SmolLM2 step (scripts/step_cost.py --quantize int8) takes about half the bf16
// weights' time at one row and about the same at 16: the conversion, not the bytes, bounds the larger steps. Other
// shapes decoded within ~3% of this or were slower: groups of 64 columns in one stream, several groups per call
// (several weight streams), pairs interleaved per column (one sign-extension instead of two), the buffer from 7
// rows on.
constexpr int kInt8Rows = 8;  // rows per int8 micro-kernel call (2 accumulators each: 16 registers)
constexpr int64_t kInt8Panel = 16;  // more rows than this: a group's pairs converted once, into a buffer

// Rows 0..R-1 of x times one int8 group (16 columns): weight pairs converted on the way, or read from `panel`.
template <int R>
void micro_int8(const uint16_t* x, int64_t ldx, const int8_t* w, const __m512i* panel, int64_t k, uint16_t* y,
                int64_t ldy, int64_t valid, const float* bias) {
  __m512 acc[R][2];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const int32_t* pairs[R];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) pairs[i] = reinterpret_cast<const int32_t*>(x + i * ldx);
  const int64_t k2_count = k / 2;
  int64_t k2 = 0;
  for (; k2 + 1 < k2_count; k2 += 2) {
    const __m512bh w0 = (__m512bh)(panel ? _mm512_load_si512(panel + k2) : int8_pairs(w + 32 * k2));
    const __m512bh w1 = (__m512bh)(panel ? _mm512_load_si512(panel + k2 + 1) : int8_pairs(w + 32 * k2 + 32));
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, (__m512bh)_mm512_set1_epi32(pairs[i][k2]));
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, (__m512bh)_mm512_set1_epi32(pairs[i][k2 + 1]));
    }
  }
  if (k2 < k2_count) {
    const __m512bh w0 = (__m512bh)(panel ? _mm512_load_si512(panel + k2) : int8_pairs(w + 32 * k2));
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, (__m512bh)_mm512_set1_epi32(pairs[i][k2]));
  }
  const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + kInt8Group * k));  // the group's 16 scales
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
    __m512 sum = _mm512_add_ps(acc[i][0], acc[i][1]);
    if (k & 1)  // the last weight row of an odd K
      sum = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_float(x[i * ldx + k - 1])), int8_fp32(w + (k - 1) * kInt8Group),
                            sum);
    store_sums(_mm512_mul_ps(sum, scale), 0, valid, bias, y + i * ldy);
  }
}

void rows_int8(int64_t r, const uint16_t* x, int64_t ldx, const int8_t* w, const __m512i* panel, int64_t k,
               uint16_t* y, int64_t ldy, int64_t valid, const float* bias) {
  switch (r) {
    case 1: micro_int8<1>(x, ldx, w, panel, k, y, ldy, valid, bias); break;
    case 2: micro_int8<2>(x, ldx, w, panel, k, y, ldy, valid, bias); break;
    case 3: micro_int8<3>(x, ldx, w, panel, k, y, ldy, valid, bias); break;
    case 4: micro_int8<4>(x, ldx, w, panel, k, y, ldy, valid, bias); break;
    case 5: micro_int8<5>(x, ldx, w, panel, k, y, ldy, valid, bias); break;
    case 6: micro_int8<6>(x, ldx, w, panel, k, y, ldy, valid, bias); break;
    case 7: micro_int8<7>(x, ldx, w, panel, k, y, ldy, valid, bias); break;
    default: micro_int8<8>(x, ldx, w, panel, k, y, ldy, valid, bias); break;
  }
}

#endif

// The int8 product (layout above): each group of 16 columns on the AMX tiles, or with vdpbf16ps.
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                          const c10::optional<torch::Tensor>& bias) {
  const LinearShape shape = check_linear_int8(x, packed, n_out, bias);
  const int64_t m = shape.m, k = shape.k, stride = packed.size(1);
  const float* b = shape.bias;
  auto y = torch::empty({m, n_out}, x.options());
  const uint16_t* xp = u16(x);
  const int8_t* wp = packed.data_ptr<int8_t>();
  uint16_t* yp = u16w(y);
  auto valid = [&](int64_t g) { return n_out - g * kInt8Group < kInt8Group ? n_out - g * kInt8Group : kInt8Group; };
#ifdef DFLASHKIT_AMX
  const int64_t whole = k / 32;
  const bool once = m > kTileRows;  // several row chunks: a group's B tiles converted once, into the scratch
  tile_groups(shape.groups, m, once ? whole * 256 : 0,
    [&](int64_t g, uint32_t* panel) {
      if (once)
        for (int64_t s = 0; s < whole; ++s) int8_tile(wp + g * stride + s * 32 * kInt8Group, panel + s * 256);
    },
    [&](int64_t g, int64_t m0, int r, uint32_t* panel) {
      amx_rows_int8(r, xp + m0 * k, k, wp + g * stride, once ? panel : nullptr, k, yp + m0 * n_out + g * kInt8Group,
                    n_out, valid(g), b ? b + g * kInt8Group : nullptr);
    });
#else
  const int64_t k2_count = k / 2;
  const bool once = m > kInt8Panel;  // many row chunks: a group's pairs converted once, into the buffer
  at::parallel_for(0, shape.groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<__m512i> buffer(once ? k2_count : 0);
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* w = wp + g * stride;
      if (once)
        for (int64_t k2 = 0; k2 < k2_count; ++k2) buffer[k2] = int8_pairs(w + 32 * k2);
      const int64_t chunks = (m + kInt8Rows - 1) / kInt8Rows;  // balanced, as the bf16 product
      for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
        const int64_t r = (m - m0 + (chunks - c) - 1) / (chunks - c);
        rows_int8(r, xp + m0 * k, k, w, once ? buffer.data() : nullptr, k, yp + m0 * n_out + g * kInt8Group, n_out,
                  valid(g), b ? b + g * kInt8Group : nullptr);
        m0 += r;
      }
    }
  });
#endif
  return y;
}

}  // namespace

#include "row_int4.h"

// Whether the kernels can run in this process: with AMX, whether the OS granted the tile state.
bool ready() {
#ifdef DFLASHKIT_AMX
  return tiles_permitted();
#else
  return true;
#endif
}

// x [M, K] bf16 contiguous; packed [G, K/2, 4, 16, 2] bf16 (or int8 [G, 16 K + 64], see linear_int8, or uint8 4-bit
// codes, see row_int4.h); bias [N]
// fp32 or None. Returns y [M, N] bf16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                     const c10::optional<torch::Tensor>& bias) {
  if (packed.scalar_type() == at::kChar) return linear_int8(x, packed, n_out, bias);
  if (packed.scalar_type() == at::kByte) return linear_int4(x, packed, n_out, bias);
  const LinearShape shape = check_linear(x, packed, n_out, bias, kBlocks);
  const int64_t m = shape.m, k = shape.k, groups = shape.groups, k2_count = shape.k2_count;
  const float* b = shape.bias;
  auto y = torch::empty({m, n_out}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#ifdef DFLASHKIT_AMX
  tile_groups(groups, m, 0, [](int64_t, uint32_t*) {}, [&](int64_t g, int64_t m0, int r, uint32_t*) {
    const int64_t valid = n_out - g * kGroup < kGroup ? n_out - g * kGroup : kGroup;
    amx_rows(r, xp + m0 * k, k, wp + g * k2_count * (kBlocks * 32), k2_count, yp + m0 * n_out + g * kGroup, n_out,
             valid, b ? b + g * kGroup : nullptr);
  });
#else
  const int64_t chunks = (m + kMaxRows - 1) / kMaxRows;  // balanced: 8 rows run as 4 + 4, not 6 + 2
  const bool chunked = chunks > 1 && chunks <= kMaxRowChunks;  // longer products (a prefill): each row chunk whole
  const int64_t step = chunked ? kChunkK2 : k2_count;  // K pairs per pass
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float state[kMaxRowChunks * kMaxRows * kBlocks * 16];  // the row chunks' sums between K chunks
    const char* end = reinterpret_cast<const char*>(wp + g1 * k2_count * (kBlocks * 32));  // this thread's panels
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* w = wp + g * k2_count * (kBlocks * 32);
      const int64_t valid = n_out - g * kGroup < kGroup ? n_out - g * kGroup : kGroup;
      const float* bg = b ? b + g * kGroup : nullptr;
      for (int64_t k0 = 0; k0 < k2_count; k0 += step) {
        const int64_t k1 = std::min(k0 + step, k2_count);
        const char* next = reinterpret_cast<const char*>(w + k1 * (kBlocks * 32));  // groups' panels are contiguous
        for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
          const int64_t r = (m - m0 + (chunks - c) - 1) / (chunks - c);
          const char* mine = next + c * kChunkK2 * 128;  // the first two row chunks fetch 4 KB of the next K chunk each
          const char* ahead = chunked && c < 2 && mine < end ? mine : nullptr;
          rows(r, xp + m0 * k, k, w, k0, k1, state + c * (kMaxRows * kBlocks * 16), k0 == 0, k1 == k2_count, ahead,
               yp + m0 * n_out + g * kGroup, n_out, valid, bg);
          m0 += r;
        }
      }
    }
  });
#endif
  return y;
}


namespace {

// exp(x) for x <= 0 in fp32 (softmax after subtracting the max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// a degree-6 polynomial (relative error ~2e-7); below -87 it returns 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 out = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), out);
}

inline __m512 load_bf16(const uint16_t* p) {  // 16 bf16 -> fp32 (exact: shift into the high half)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}


// Rows r[0..15] of 16 int32 transposed in place: lane j of r[i] becomes lane i of the old r[j].
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int e = 0; e < 4; ++e) {
      t[8 * i + e] = _mm512_shuffle_i32x4(r[8 * i + e], r[8 * i + 4 + e], 0x88);
      t[8 * i + 4 + e] = _mm512_shuffle_i32x4(r[8 * i + e], r[8 * i + 4 + e], 0xDD);
    }
  for (int e = 0; e < 8; ++e) {
    r[e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0xDD);
  }
}

constexpr int kKeyBlock = 64;  // keys per pass of the scores (4 vectors of 16)

// Keys 0..m-1 of one kv head (contiguous rows of d = 2 P bf16) as vdpbf16ps operands, 16 keys to a vector:
// out[(g P + c) 16 + l] = the bf16 pair c of key 16 g + l, as one int32; keys up to the next multiple of kKeyBlock
// are zeros. Once per call, kv head and thread: the scores then need no sums across lanes.
template <int P>
void pack_keys(const uint16_t* keys, int64_t m, int32_t* out) {
  const int64_t groups = (m + kKeyBlock - 1) / kKeyBlock * (kKeyBlock / 16);
  const __mmask16 lanes = P >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << P) - 1u);
  for (int64_t g = 0; g < groups; ++g)
    for (int c0 = 0; c0 < P; c0 += 16) {
      __m512i r[16];
      for (int l = 0; l < 16; ++l) {
        const int64_t j = 16 * g + l;
        r[l] = j < m ? _mm512_maskz_loadu_epi32(lanes, keys + j * 2 * P + 2 * c0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < 16 && c0 + i < P; ++i) _mm512_storeu_si512(out + (g * P + c0 + i) * 16, r[i]);
    }
}

struct Attn {
  const uint16_t *q, *k, *v;
  uint16_t* out;
  const bool* hidden;  // [n, m] or null
  const int64_t* prefix;  // [n]: row i sees exactly keys 0..prefix[i]-1, or -1 (any other pattern: read hidden)
  const int64_t* lead;  // [n]: row i sees keys 0..lead[i]-1 (a tree row: the context), then what hidden says
  int64_t rows, n, m, k_head, v_head;
  float scale;
};

// Rows r0..r0+T-1 of head h (T query rows share each key and value row loaded); CH = head_dim / 16; keys: head h's
// keys packed by pack_keys.
template <int T, int CH>
void attend_tile(const Attn& a, int64_t h, int64_t r0, const int32_t* keys, float* scores, float* probs,
                 int64_t* seen) {
  const int64_t m = a.m, d = CH * 16;
  constexpr int P = CH * 8;  // bf16 pairs per query or key row
  constexpr int NV = T <= 6 ? kKeyBlock / 16 : kKeyBlock / 32;  // 16-key vectors per product pass (T NV sums)
  const bool* sees_not[T];  // null where the row sees a prefix of the keys
  int64_t limit[T];  // keys past it are hidden from the row
  int64_t leading[T];  // the row sees keys 0..leading-1 (the whole prefix, or a tree row's context), then maybe others
  int64_t keys_seen = 0;  // keys past it are hidden from every row of the tile
  const int32_t* q[T];  // the query rows as bf16 pairs
  _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t) {
    const int64_t i = (r0 + t) % a.n, prefix = a.prefix[i];
    sees_not[t] = prefix < 0 ? a.hidden + i * m : nullptr;
    limit[t] = prefix < 0 ? m : prefix;
    leading[t] = prefix < 0 ? a.lead[i] : prefix;
    keys_seen = limit[t] > keys_seen ? limit[t] : keys_seen;
    q[t] = reinterpret_cast<const int32_t*>(a.q + (h * a.rows + r0 + t) * d);
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < keys_seen; j0 += 16 * NV) {  // scores (hidden keys' are dropped below): per key, the
    __m512 acc[T][NV];                                    // pairs' products summed in pair order, in fp32
    _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t)
      _Pragma("GCC unroll 4") for (int b = 0; b < NV; ++b) acc[t][b] = _mm512_setzero_ps();
    const int32_t* kg = keys + (j0 / 16) * P * 16;
    for (int c = 0; c < P; ++c) {
      __m512bh kv[NV];
      _Pragma("GCC unroll 4") for (int b = 0; b < NV; ++b) kv[b] = (__m512bh)_mm512_loadu_si512(kg + (b * P + c) * 16);
      _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(q[t][c]);
        _Pragma("GCC unroll 4") for (int b = 0; b < NV; ++b) acc[t][b] = _mm512_dpbf16_ps(acc[t][b], kv[b], qb);
      }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < NV; ++b) {
      const int64_t j = j0 + 16 * b, keys_here = keys_seen - j;
      if (keys_here <= 0) break;
      const __mmask16 valid = keys_here >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << keys_here) - 1u);
      _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t)
        _mm512_mask_storeu_ps(scores + t * m + j, valid, _mm512_mul_ps(acc[t][b], scale));
    }
  }
  for (int t = 0; t < T; ++t) {  // softmax over each row's visible keys, in key order
    float* w = scores + t * m;  // scores, then the weights by key
    if (!sees_not[t]) {  // keys 0..limit-1: the general path below with an identity compaction, vectorized
      const int64_t count = limit[t];
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const __mmask16 keep = static_cast<__mmask16>((1u << (count - i0 < 16 ? count - i0 : 16)) - 1u);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, keep, w + i0));
      }
      top = _mm512_set1_ps(_mm512_reduce_max_ps(top));
      __m512 total = _mm512_setzero_ps();
      for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const __mmask16 keep = static_cast<__mmask16>((1u << (count - i0 < 16 ? count - i0 : 16)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(keep, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, w + i0), top)));
        _mm512_mask_storeu_ps(w + i0, keep, e);
        total = _mm512_add_ps(total, e);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
      for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const __mmask16 keep = static_cast<__mmask16>((1u << (count - i0 < 16 ? count - i0 : 16)) - 1u);
        _mm512_mask_storeu_ps(w + i0, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, w + i0), inv));
      }
      continue;
    }
    // the visible scores compacted into p in key order: the leading visible keys (a tree row's context) copied
    // as vectors, the rest one by one; the max is the same value whichever way it is taken
    float* p = probs + t * (m + 16);
    int64_t* idx = seen + t * m;
    const int64_t lead = leading[t];
    __m512 top_lanes = _mm512_set1_ps(-INFINITY);
    for (int64_t i0 = 0; i0 < lead; i0 += 16) {
      const __mmask16 keep = static_cast<__mmask16>((1u << (lead - i0 < 16 ? lead - i0 : 16)) - 1u);
      const __m512 s = _mm512_maskz_loadu_ps(keep, w + i0);
      _mm512_mask_storeu_ps(p + i0, keep, s);
      top_lanes = _mm512_mask_max_ps(top_lanes, keep, top_lanes, s);
    }
    float best = lead > 0 ? _mm512_reduce_max_ps(top_lanes) : -INFINITY;
    int64_t count = lead;
    for (int64_t j = lead; j < m; ++j) {
      if (sees_not[t][j]) continue;
      const float sj = w[j];
      p[count] = sj;
      idx[count++] = j;
      best = sj > best ? sj : best;
    }
    __m512 total = _mm512_setzero_ps();  // lane l sums entries i = l mod 16, in order
    const __m512 top = _mm512_set1_ps(best);
    for (int64_t i0 = 0; i0 < count; i0 += 16) {
      const int64_t lanes = count - i0 < 16 ? count - i0 : 16;
      const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1u);
      const __m512 e = _mm512_maskz_mov_ps(keep, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, p + i0), top)));
      _mm512_storeu_ps(p + i0, e);
      total = _mm512_add_ps(total, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(total);
    const __m512 inv_lanes = _mm512_set1_ps(inv);
    for (int64_t i0 = 0; i0 < lead; i0 += 16) {  // the leading keys' weights in place, then the others'
      const __mmask16 keep = static_cast<__mmask16>((1u << (lead - i0 < 16 ? lead - i0 : 16)) - 1u);
      _mm512_mask_storeu_ps(w + i0, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, p + i0), inv_lanes));
    }
    for (int64_t i = lead; i < count; ++i) w[idx[i]] = p[i] * inv;
  }
  __m512 acc[T][CH];
  _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t)
    _Pragma("GCC unroll 8") for (int c = 0; c < CH; ++c) acc[t][c] = _mm512_setzero_ps();
  const uint16_t* vh = a.v + h * a.v_head;
  int64_t common = keys_seen;  // keys every row of the tile sees: no test per row below it
  _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t) common = leading[t] < common ? leading[t] : common;
  for (int64_t j = 0; j < common; ++j) {  // out = sum of the visible keys' weights times their values, in key order
    __m512 vv[CH];
    _Pragma("GCC unroll 8") for (int c = 0; c < CH; ++c) vv[c] = load_bf16(vh + j * d + c * 16);
    _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t) {
      const __m512 wj = _mm512_set1_ps(scores[t * m + j]);
      _Pragma("GCC unroll 8") for (int c = 0; c < CH; ++c) acc[t][c] = _mm512_fmadd_ps(wj, vv[c], acc[t][c]);
    }
  }
  for (int64_t j = common; j < keys_seen; ++j) {  // the same for the keys some rows do not see
    __m512 vv[CH];
    _Pragma("GCC unroll 8") for (int c = 0; c < CH; ++c) vv[c] = load_bf16(vh + j * d + c * 16);
    _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t) {
      if (j >= limit[t] || (sees_not[t] && sees_not[t][j])) continue;
      const __m512 wj = _mm512_set1_ps(scores[t * m + j]);
      _Pragma("GCC unroll 8") for (int c = 0; c < CH; ++c) acc[t][c] = _mm512_fmadd_ps(wj, vv[c], acc[t][c]);
    }
  }
  _Pragma("GCC unroll 8") for (int t = 0; t < T; ++t) {
    uint16_t* o = a.out + (h * a.rows + r0 + t) * d;
    _Pragma("GCC unroll 8") for (int c = 0; c < CH; ++c)
      _mm256_storeu_si256((__m256i*)(o + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[t][c]));
  }
}

template <int CH, int T>
void attend_rows(const Attn& a, int64_t h, int64_t r0, int64_t left, const int32_t* keys, float* scores, float* probs,
                 int64_t* seen) {
  if constexpr (T > 1) {
    if (left < T) return attend_rows<CH, T - 1>(a, h, r0, left, keys, scores, probs, seen);
  }
  attend_tile<T, CH>(a, h, r0, keys, scores, probs, seen);
}

template <int CH>
void attend_calls(const std::vector<AttnCall>& calls, int64_t heads, float scale) {
  // rows per tile: kTile * CH accumulators for the values (and kTile * CH / 2 query vectors for the scores)
  constexpr int kTile = CH >= 8 ? 3 : CH == 4 ? 6 : 8;
  const int64_t count = static_cast<int64_t>(calls.size());
  std::vector<Attn> jobs;
  std::vector<std::vector<int64_t>> prefixes(count);  // per call and mask row: the prefix it sees, or -1
  std::vector<std::vector<int64_t>> leads(count);  // per call and mask row: how many keys it sees before a hidden one
  std::vector<int64_t> first_task(count + 1, 0), tiles(count);
  int64_t widest = 1;
  for (int64_t c = 0; c < count; ++c) {
    const AttnCall& call = calls[c];
    std::vector<int64_t>& prefix = prefixes[c];
    prefix.resize(call.n);
    leads[c].resize(call.n);
    for (int64_t i = 0; i < call.n; ++i) {
      const bool* row = call.hidden ? call.hidden + i * call.m : nullptr;
      int64_t length = 0;
      while (length < call.m && !(row && row[length])) ++length;
      int64_t j = length;
      while (j < call.m && row[j]) ++j;
      prefix[i] = j == call.m ? length : -1;
      leads[c][i] = length;
    }
    jobs.push_back(Attn{call.q, call.k, call.v, call.out, call.hidden, prefix.data(), leads[c].data(), call.rows,
                        call.n, call.m, call.k_head, call.v_head, scale});
    tiles[c] = (call.rows + kTile - 1) / kTile;
    first_task[c + 1] = first_task[c] + heads * tiles[c];
    widest = call.m > widest ? call.m : widest;
  }
  at::parallel_for(0, first_task[count], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kTile * widest), probs(kTile * (widest + 16));
    std::vector<int64_t> seen(kTile * widest);
    // the keys of the (call, kv head) this thread works on, packed once per thread (a thread's tasks are consecutive)
    std::vector<int32_t> keys((widest + kKeyBlock - 1) / kKeyBlock * kKeyBlock * CH * 8);
    int64_t packed_call = -1, packed_head = -1;
    int64_t c = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first_task[c + 1]) ++c;
      const int64_t local = task - first_task[c], h = local / tiles[c], r0 = (local % tiles[c]) * kTile;
      if (c != packed_call || h != packed_head) {
        pack_keys<CH * 8>(jobs[c].k + h * jobs[c].k_head, jobs[c].m, keys.data());
        packed_call = c, packed_head = h;
      }
      attend_rows<CH, kTile>(jobs[c], h, r0, jobs[c].rows - r0, keys.data(), scores.data(), probs.data(),
                             seen.data());
    }
  });
}

}  // namespace

// Grouped-query attention of several independent calls (AttnCall, row_common.h), fp32 inside, one query row at a
// time, in one parallel region over (call, kv head, tile of query rows). Per row: s_j = scale * q.k_j (the bf16
// pairs' products by vdpbf16ps, exact, summed in fp32 in a fixed order), softmax over the visible keys (max, then
// exp and a sum in key order), out = sum_j p_j v_j / sum, rounded once. Hidden keys are skipped before anything is summed, so a row's result is bitwise the one computed over only
// the keys it sees (a chain's row i = a one-token step), whatever rows or calls run beside it.
void attention_calls(const std::vector<AttnCall>& calls, int64_t heads, int64_t d, double scale) {
  if (calls.empty()) return;
  switch (d) {
    case 16: attend_calls<1>(calls, heads, static_cast<float>(scale)); break;
    case 32: attend_calls<2>(calls, heads, static_cast<float>(scale)); break;
    case 64: attend_calls<4>(calls, heads, static_cast<float>(scale)); break;
    default: attend_calls<8>(calls, heads, static_cast<float>(scale)); break;
  }
}

// Grouped-query attention (torch-level): one call of attention_calls.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                        const c10::optional<torch::Tensor>& hidden, int64_t n, double scale) {
  const AttentionShape shape = check_attention(q, keys, values, hidden, n);
  auto out = torch::empty_like(q);
  attention_calls({attention_call(q, keys, values, shape, n, out)}, shape.heads, shape.d, scale);
  return out;
}

namespace {

inline __m512 load_bf16_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store_bf16_masked(uint16_t* p, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
inline __mmask16 tail(int64_t left) { return static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u); }

// RMS norm of each row of x [rows, width] (row stride ld): out = bf16(bf16(x / rms(x)) * w), the sum of squares in fp32
// in a fixed order (16 lanes, then their sum), as transformers rounds (normalise in fp32, scale in bf16).
void rms_norm(const uint16_t* x, int64_t ld, int64_t rows, int64_t width, const uint16_t* w, float eps, uint16_t* out,
              int64_t ld_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * ld;
    __m512 sq = _mm512_setzero_ps();
    for (int64_t c = 0; c < width; c += 16) {
      const __m512 v = load_bf16_masked(xr + c, tail(width - c));
      sq = _mm512_fmadd_ps(v, v, sq);
    }
    const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(width) + eps);
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < width; c += 16) {
      const __mmask16 m = tail(width - c);
      const __m512 normed = load_bf16_masked(xr + c, m);
      // round x / rms to bf16 first (transformers' .to(input_dtype)), then the bf16 product with the weight
      const __m512 h = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(normed, s))), 16));
      store_bf16_masked(out + r * ld_out + c, m, _mm512_mul_ps(h, load_bf16_masked(w + c, m)));
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
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 m = tail(d - c);
    const __m512 v = load_bf16_masked(x + c, m), r = load_bf16_masked(rolled + c, m);
    store_bf16_masked(out + c, m, _mm512_fmadd_ps(v, load_bf16_masked(cos + c, m),
                                                  _mm512_mul_ps(r, load_bf16_masked(sin_signed + c, m))));
  }
}

// out = bf16(x + y), elementwise over count values
void add_into(uint16_t* x, const uint16_t* y, int64_t count) {
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 m = tail(count - c);
    store_bf16_masked(x + c, m, _mm512_add_ps(load_bf16_masked(x + c, m), load_bf16_masked(y + c, m)));
  }
}

// out = bf16(silu(gate) * up), silu(g) = g * sigmoid(g) with exp of -|g| only
void silu_mul(const uint16_t* gate, const uint16_t* up, int64_t count, uint16_t* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 m = tail(count - c);
    const __m512 g = load_bf16_masked(gate + c, m);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));  // exp(-|g|)
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
    const __m512 sig = _mm512_div_ps(numerator, _mm512_add_ps(one, e));
    store_bf16_masked(out + c, m, _mm512_mul_ps(_mm512_mul_ps(g, sig), load_bf16_masked(up + c, m)));
  }
}


}  // namespace

#include "row_layers.h"
