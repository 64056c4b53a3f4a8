// Causal attention of prompt chunks: whole prompts (the usual offline case: many short prompts in one
// 2048-token step), or one chunk after C cached tokens (a long prompt prefilled a chunk a step).
//
// Inputs: q [count * S, Hq, D] and k, v [count * (C + S), Hkv, D], rows strided: `count` chunks of S queries,
// each with its C + S keys (the cached ones first), one after another; query i of a chunk stands at position
// C + i. Whole prompts (C = 0) pass the views paged_attention gets from the fused qkv output; a chunk after a
// prefix passes its keys gathered from the pages. The keys and values of each (chunk, kv head) are first packed
// into 16 x 16-pair bf16 blocks (zeros past the keys), or, for a chunk after its prefix, read in place from the
// KV pages through the chunk's block table (no gathered copy: the gather and the packing were each a cost per
// step that grows with the prefix, paid again for every chunk of a long prompt). Then each work item, (chunk, q head, block of 32
// queries), computes
//   scores = Q K^T over the keys up to its last query (fp32 sums over D);
//   exp(scale * score - max) in fp32 over each query's causal keys, its fp32 sum kept, the values rounded to
//   bf16 for the product with V (as torch's CPU flash attention rounds them);
//   out = (P V) / sum, rounded once to bf16.
// The two products run on one of two engines over the same packed blocks:
// - tiles (AMX): each packed block is a B tile; a 32 x 32 output block is four C tiles;
// - vectors (AVX-512 BF16, e.g. AMD Zen 4/5): a packed block's row k is one vector (16 columns x one pair of
//   the reduction), so 8 rows of the output are 16 registers, each step one vdpbf16ps per row and column block.
//
// Why: torch's SDPA (its CPU flash attention) was slower on every shape measured, on both engines; figures:
// docs/performance.md, "Prompt attention" (python -m bench.prompt_attention). The outputs differ from SDPA's
// by at most one bf16 rounding.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "vec.h"

namespace {

using namespace cpu_ext::amx;

constexpr int64_t kBlock = 2 * kTileRows;  // queries of an item (two A tiles); keys of a step (two C tiles)
constexpr int64_t kMaxPromptTokens = 8192;  // keys of a chunk; an item's scores: 32 x 8192 fp32 = 1 MiB, in L2

#if defined(CPU_EXT_VECTOR_BF16)

using cpu_ext::lanes_below;

inline __m512i load_row16(const uint16_t* p) {  // 16 bf16 into the low half
  return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct Prompts {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  int64_t q_stride, k_stride, v_stride;  // elements from one token's row to the next (out: Hq * D)
  int64_t count, len, context, heads, kv_heads, head_dim;  // len: S queries a chunk; context: C cached keys
  int64_t blocks, key_len, key_blocks;                     // ceil(S / 32); C + S; ceil((C + S) / 32)
  float scale;
  uint16_t* keys;    // [count, Hkv, 2 * key_blocks, D / 32] B tiles: 16 keys x 16 pairs of dims
  uint16_t* values;  // [count, Hkv, key_blocks, D / 16] B tiles: 16 pairs of keys x 16 dims
  const int64_t* table = nullptr;  // paged keys (count 1): page of each block_size keys; k, v are the pages
  int64_t block_size = 0;          // a multiple of 16: a 16-key tile never spans two pages
};

// Row of chunk b's key `pos` in k / v: the chunks' rows one after another, or its page's row.
inline int64_t key_row(const Prompts& p, int64_t b, int64_t pos) {
  if (p.table == nullptr) return b * p.key_len + pos;
  return p.table[pos / p.block_size] * p.block_size + pos % p.block_size;
}

uint16_t* key_tile(const Prompts& p, int64_t b, int64_t h, int64_t key_tile, int64_t dim_block) {
  const int64_t tile = ((b * p.kv_heads + h) * 2 * p.key_blocks + key_tile) * (p.head_dim / kTileK) + dim_block;
  return p.keys + tile * kBlockElems;
}

uint16_t* value_tile(const Prompts& p, int64_t b, int64_t h, int64_t key_block, int64_t dim_block) {
  const int64_t tile = ((b * p.kv_heads + h) * p.key_blocks + key_block) * (p.head_dim / kTileN) + dim_block;
  return p.values + tile * kBlockElems;
}

// Key tiles of (prompt b, kv head h), 32-key blocks [kb0, kb1): tile row r holds, for each of the 16 keys, dims
// 2r and 2r + 1 (one 32-bit pair), so row r is column r of the keys' rows read as pairs: one gather per row.
void pack_keys(const Prompts& p, int64_t b, int64_t h, int64_t kb0, int64_t kb1) {
  const int64_t pair_stride = p.k_stride / 2;
  const __m512i key_offsets =
      _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int32_t>(pair_stride)),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int64_t kt = 2 * kb0; kt < 2 * kb1; ++kt) {
    const int64_t first = kt * kTileN;
    const __mmask16 present = lanes_below(p.key_len - first);
    for (int64_t d = 0; d < p.head_dim / kTileK; ++d) {
      uint16_t* tile = key_tile(p, b, h, kt, d);
      const uint16_t* base =
          p.k + (present ? key_row(p, b, first) : 0) * p.k_stride + h * p.head_dim + d * kTileK;
      for (int64_t r = 0; r < kTileRows; ++r) {
        const __m512i pairs = present ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, key_offsets,
                                                                   base + 2 * r, 4)
                                      : _mm512_setzero_si512();
        _mm512_storeu_si512(tile + r * 2 * kTileN, pairs);
      }
    }
  }
}

// Value tiles of (prompt b, kv head h), 32-key blocks [kb0, kb1): tile row r interleaves keys 2r and 2r + 1 of
// the block, dim by dim.
void pack_values(const Prompts& p, int64_t b, int64_t h, int64_t kb0, int64_t kb1) {
  const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                              39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t kb = kb0; kb < kb1; ++kb)
    for (int64_t n = 0; n < p.head_dim / kTileN; ++n) {
      uint16_t* tile = value_tile(p, b, h, kb, n);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t key = kb * kBlock + 2 * r;  // even, so key + 1 shares its page
        const uint16_t* row =
            p.v + (key < p.key_len ? key_row(p, b, key) : 0) * p.v_stride + h * p.head_dim + n * kTileN;
        const __m512i even = key < p.key_len ? load_row16(row) : _mm512_setzero_si512();
        const __m512i odd = key + 1 < p.key_len ? load_row16(row + p.v_stride) : _mm512_setzero_si512();
        _mm512_storeu_si512(tile + r * 2 * kTileN, _mm512_permutex2var_epi16(even, interleave, odd));
      }
    }
}

struct Scratch {
  std::vector<uint16_t> q;      // [32, D]: the item's queries, rows past the prompt zero
  std::vector<float> scores;    // [32, width]
  std::vector<uint16_t> probs;  // [32, width] bf16, zero past each query's keys
  std::vector<float> out;       // [32, D]
  float sum[kBlock];
};

#if defined(CPU_EXT_AMX)

// One k step of a 2 x 2 block: C tiles 0-3 += A rows 0-15 | 16-31 (from `a`, `a_bytes` a row; the second
// tile `second` elements on) x B tiles b0 | b1. Tiles 4-5 hold B, 6-7 A. Without two_rows, rows 0-15 only.
inline void block_step(const uint16_t* a, int64_t a_bytes, int64_t second, const uint16_t* b0, const uint16_t* b1,
                       bool two_rows) {
  _tile_loadd(6, a, a_bytes);
  _tile_loadd(4, b0, 64);
  _tile_loadd(5, b1, 64);
  _tile_dpbf16ps(0, 6, 4);
  _tile_dpbf16ps(1, 6, 5);
  if (two_rows) {
    _tile_loadd(7, a + second, a_bytes);
    _tile_dpbf16ps(2, 7, 4);
    _tile_dpbf16ps(3, 7, 5);
  }
}

inline void zero_block() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// C tiles 0-3 -> c [32, 32] fp32 at `ld` floats a row (rows 0-15 only without two_rows).
inline void store_block(float* c, int64_t ld, bool two_rows) {
  _tile_stored(0, c, ld * 4);
  _tile_stored(1, c + kTileN, ld * 4);
  if (two_rows) {
    _tile_stored(2, c + kTileRows * ld, ld * 4);
    _tile_stored(3, c + kTileRows * ld + kTileN, ld * 4);
  }
}

// scores[i, j] = q_i . k_j for the item's 32 queries and keys [0, width).
void block_scores(const Prompts& p, int64_t b, int64_t h, int64_t width, bool two_rows, Scratch& s) {
  for (int64_t kb = 0; kb < width / kBlock; ++kb) {
    zero_block();
    for (int64_t d = 0; d < p.head_dim / kTileK; ++d)
      block_step(s.q.data() + d * kTileK, p.head_dim * 2, kTileRows * p.head_dim, key_tile(p, b, h, 2 * kb, d),
                 key_tile(p, b, h, 2 * kb + 1, d), two_rows);
    store_block(s.scores.data() + kb * kBlock, width, two_rows);
  }
}

// out[i, :] = sum_j probs[i, j] v_j, fp32, for the item's 32 queries.
void block_values(const Prompts& p, int64_t b, int64_t h, int64_t width, bool two_rows, Scratch& s) {
  for (int64_t n = 0; n < p.head_dim / kTileN; n += 2) {
    zero_block();
    for (int64_t kb = 0; kb < width / kBlock; ++kb)
      block_step(s.probs.data() + kb * kBlock, width * 2, kTileRows * width, value_tile(p, b, h, kb, n),
                 value_tile(p, b, h, kb, n + 1), two_rows);
    store_block(s.out.data() + n * kTileN, p.head_dim, two_rows);
  }
}

struct Tiles {
  static void scores(const Prompts& p, int64_t b, int64_t h, int64_t width, int64_t rows, Scratch& s) {
    block_scores(p, b, h, width, rows > kTileRows, s);
  }
  static void values(const Prompts& p, int64_t b, int64_t h, int64_t width, int64_t rows, Scratch& s) {
    block_values(p, b, h, width, rows > kTileRows, s);
  }
  struct ThreadState {  // the tile configuration is per thread
    ThreadState() { load_tile_config(); }
    ~ThreadState() { _tile_release(); }
  };
};

#endif  // CPU_EXT_AMX

struct Vectors {
  // As Tiles::scores, `rows` rounded up to 8 (the scratch rows past the prompt are zero).
  static void scores(const Prompts& p, int64_t b, int64_t h, int64_t width, int64_t rows, Scratch& s) {
    const int64_t dim_blocks = p.head_dim / kTileK;
    for (int64_t kb = 0; kb < width / kBlock; ++kb)
      for (int64_t i = 0; i < rows; i += kVectorRows)
        vector_block<kVectorRows>(s.q.data() + i * p.head_dim, p.head_dim, key_tile(p, b, h, 2 * kb, 0),
                                  key_tile(p, b, h, 2 * kb + 1, 0), kBlockElems, dim_blocks,
                                  s.scores.data() + i * width + kb * kBlock, width, [] {});
  }
  static void values(const Prompts& p, int64_t b, int64_t h, int64_t width, int64_t rows, Scratch& s) {
    const int64_t value_step = (p.head_dim / kTileN) * kBlockElems;  // from one key block to the next
    for (int64_t n = 0; n < p.head_dim / kTileN; n += 2)
      for (int64_t i = 0; i < rows; i += kVectorRows)
        vector_block<kVectorRows>(s.probs.data() + i * width, width, value_tile(p, b, h, 0, n),
                                  value_tile(p, b, h, 0, n + 1), value_step, width / kBlock,
                                  s.out.data() + i * p.head_dim + n * kTileN, p.head_dim, [] {});
  }
  struct ThreadState {};
};

// Row i (query q0 + i, at C + q0 + i) of the scores -> bf16 exp(scale * s - max) over keys [0, C + q0 + i], zero
// after; fp32 sum.
void block_softmax(const Prompts& p, int64_t q0, int64_t rows, int64_t width, Scratch& s) {
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = s.scores.data() + i * width;
    uint16_t* probs = s.probs.data() + i * width;
    const int64_t keys = p.context + q0 + i + 1;
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < keys; j += 16)
      peak = _mm512_mask_max_ps(peak, lanes_below(keys - j), peak, _mm512_mul_ps(_mm512_loadu_ps(row + j), scale));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(row + j), scale, shift);
      const __m512 e = _mm512_maskz_mov_ps(lanes_below(keys - j), cpu_ext::exp512(x));
      total = _mm512_add_ps(total, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    s.sum[i] = _mm512_reduce_add_ps(total);
  }
  std::fill(s.probs.begin() + rows * width, s.probs.end(), 0);  // rows past the prompt, which the products read
}

// Item = (chunk, q head, block of 32 queries): keys up to its last query, in whole 32-key blocks.
template <typename Products>
void attend_block(const Prompts& p, int64_t item, Scratch& s) {
  const int64_t qb = item % p.blocks, hq = item / p.blocks % p.heads, b = item / (p.blocks * p.heads);
  const int64_t h = hq / (p.heads / p.kv_heads);
  const int64_t q0 = qb * kBlock, rows = std::min(kBlock, p.len - q0);
  const int64_t width = std::min((p.context + q0 + kBlock + kBlock - 1) / kBlock, p.key_blocks) * kBlock;
  s.q.assign(kBlock * p.head_dim, 0);
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* query = p.q + (b * p.len + q0 + i) * p.q_stride + hq * p.head_dim;
    std::memcpy(s.q.data() + i * p.head_dim, query, p.head_dim * 2);
  }
  s.scores.resize(kBlock * width);
  s.probs.resize(kBlock * width);
  s.out.resize(kBlock * p.head_dim);
  Products::scores(p, b, h, width, rows, s);
  block_softmax(p, q0, rows, width, s);
  Products::values(p, b, h, width, rows, s);
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* out = p.out + ((b * p.len + q0 + i) * p.heads + hq) * p.head_dim;
    const __m512 sum = _mm512_set1_ps(s.sum[i]);
    for (int64_t d = 0; d < p.head_dim; d += 16) {
      const __m512 value = _mm512_div_ps(_mm512_loadu_ps(s.out.data() + i * p.head_dim + d), sum);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)_mm512_cvtneps_pbh(value));
    }
  }
}

constexpr int64_t kPackBlocks = 16;  // 32-key blocks a packing unit takes: a long prefix splits over every thread

template <typename Products>
void run(const Prompts& p) {
  const int64_t spans = (p.key_blocks + kPackBlocks - 1) / kPackBlocks;
  cpu_ext::parallel_claim(p.count * p.kv_heads * spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t span = i % spans, head = i / spans % p.kv_heads, b = i / (spans * p.kv_heads);
      const int64_t kb0 = span * kPackBlocks, kb1 = std::min(p.key_blocks, kb0 + kPackBlocks);
      pack_keys(p, b, head, kb0, kb1);
      pack_values(p, b, head, kb0, kb1);
    }
  });
  cpu_ext::parallel_claim(p.count * p.heads * p.blocks, 1, [&](int64_t begin, int64_t end) {
    const typename Products::ThreadState state{};
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) attend_block<Products>(p, item, scratch);
  });
}

#endif  // CPU_EXT_VECTOR_BF16

void check_rows(const torch::Tensor& x, int64_t rows, int64_t head_dim, const char* what) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.size(0) == rows && x.size(2) == head_dim &&
                  x.stride(2) == 1 && x.stride(1) == head_dim && x.stride(0) % 2 == 0,
              "prompt_attention_bf16: ", what,
              " must be bf16 [T, heads, D], heads and dims contiguous, an even row stride");
}

}  // namespace

void check_pages(const torch::Tensor& pages, const torch::Tensor& table, int64_t key_len, int64_t head_dim,
                 const char* what) {
  TORCH_CHECK(pages.dim() == 4 && pages.scalar_type() == at::kBFloat16 && pages.is_contiguous() &&
                  pages.size(3) == head_dim && pages.size(1) % 16 == 0,
              "prompt_attention_bf16: ", what, " pages must be contiguous bf16 [N, block_size, Hkv, D], block_size a ",
              "multiple of 16");
  TORCH_CHECK(table.dim() == 1 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  table.size(0) * pages.size(1) >= key_len,
              "prompt_attention_bf16: the block table must be int64 and cover the context and the chunk");
  const auto* ids = table.data_ptr<int64_t>();
  const int64_t used = (key_len + pages.size(1) - 1) / pages.size(1);
  TORCH_CHECK(std::all_of(ids, ids + used, [&](int64_t id) { return 0 <= id && id < pages.size(0); }),
              "prompt_attention_bf16: a block id outside the pages");
}

// q [count * S, Hq, D], k/v [count * (C + S), Hkv, D] bf16 (rows may be strided) -> [count * S, Hq, D] bf16:
// each of the `count` chunks of S queries, standing after C = `context` cached keys, attends causally to its keys.
// With `block_table` (count 1), k / v are the KV pages [N, block_size, Hkv, D] and the chunk's C + S keys are
// read in place from the blocks the table names. D % 32 == 0, C + S <= 8192. engine: 0 the fastest available
// (tiles, then vectors), 1 tiles, 2 vectors.
torch::Tensor prompt_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t count, double scale,
                                    int64_t engine, int64_t context, std::optional<torch::Tensor> block_table) {
  TORCH_CHECK(count >= 1 && context >= 0 && q.dim() == 3 && q.size(0) % count == 0 && q.size(0) > 0,
              "prompt_attention_bf16: q rows must be count x S, S >= 1, and the context at least 0");
  const int64_t rows = q.size(0), head_dim = q.size(2), len = rows / count, key_len = context + len;
  check_rows(q, rows, head_dim, "q");
  const int64_t block_size = block_table ? k.size(1) : 0;
  if (block_table) {
    TORCH_CHECK(count == 1, "prompt_attention_bf16: paged keys take one chunk");
    check_pages(k, *block_table, key_len, head_dim, "k");
    check_pages(v, *block_table, key_len, head_dim, "v");
    TORCH_CHECK(k.sizes() == v.sizes(), "prompt_attention_bf16: k and v pages differ in shape");
    k = k.view({-1, k.size(2), head_dim});  // token rows; key_row() finds each key's
    v = v.view({-1, v.size(2), head_dim});
  } else {
    check_rows(k, count * key_len, head_dim, "k");
    check_rows(v, count * key_len, head_dim, "v");
  }
  TORCH_CHECK(k.size(1) == v.size(1) && q.size(1) % k.size(1) == 0, "prompt_attention_bf16: heads");
  TORCH_CHECK(head_dim % kTileK == 0 && key_len <= kMaxPromptTokens, "prompt_attention_bf16: head_dim ", head_dim,
              " (a multiple of 32) or keys of a chunk ", key_len, " (at most ", kMaxPromptTokens, ")");
  const bool tiles = use_tiles(engine, "prompt_attention_bf16");
  torch::Tensor out = torch::empty({rows, q.size(1), head_dim}, q.options());
#if defined(CPU_EXT_VECTOR_BF16)
  const int64_t kv_heads = k.size(1), blocks = (len + kBlock - 1) / kBlock, key_blocks = (key_len + kBlock - 1) / kBlock;
  torch::Tensor keys =
      torch::empty({count * kv_heads * 2 * key_blocks * (head_dim / kTileK) * kBlockElems}, q.options());
  torch::Tensor values =
      torch::empty({count * kv_heads * key_blocks * (head_dim / kTileN) * kBlockElems}, q.options());
  auto bf16 = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const Prompts p{bf16(q),    bf16(k),   bf16(v),    bf16(out), q.stride(0), k.stride(0),
                  v.stride(0), count,    len,        context,   q.size(1),   kv_heads,
                  head_dim,   blocks,    key_len,    key_blocks, static_cast<float>(scale), bf16(keys),
                  bf16(values), block_table ? block_table->data_ptr<int64_t>() : nullptr, block_size};
#if defined(CPU_EXT_AMX)
  if (tiles) {
    run<Tiles>(p);
    return out;
  }
#endif
  run<Vectors>(p);
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(phase_serve, m) {
  m.def(
      "prompt_attention_bf16(Tensor q, Tensor k, Tensor v, int count, float scale, int engine, int context=0, "
      "Tensor? block_table=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(phase_serve, CPU, m) { m.impl("prompt_attention_bf16", &prompt_attention_bf16); }
