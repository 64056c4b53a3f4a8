// The decoder layers of a decode-only step in one call: the ops engine/model/llama.py runs for each layer with
// its kernels on, in the same order and through the same kernels, so the hidden states are bit-identical to
// the Python layer loop; only the interpreter's time between the ~50 ops of a layer goes. Built into the
// cpu_ext extension (engine/kernels/cpu_ext.py); LlamaModel decides when a step may take it.
// Figures: docs/performance.md, "Decode stack" (python -m bench.cpu_kernels: "all" against "layers").
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

// Kernels of cpu_ext.cpp.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, bool fp32_out = false);
torch::Tensor decode_attention_bf16(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                   torch::Tensor block_tables, torch::Tensor context_lens, double scale);
std::vector<torch::Tensor> rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul_bf16(torch::Tensor gate_up);
void rotary_bf16_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
// tiled_linear.cpp (engine 0: the fastest here)
torch::Tensor tiled_linear_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t engine,
                                bool fp32_out = false);
torch::Tensor tiled_linear_silu_mul_bf16(torch::Tensor x, torch::Tensor packed, int64_t engine);
// int8_linear.cpp
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor weight, torch::Tensor scale,
                          const std::optional<torch::Tensor>& bias, bool fp32_out = false);
torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                          const std::optional<torch::Tensor>& bias, bool fp32_out = false);
// int4_linear.cpp
torch::Tensor linear_w4a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          const std::optional<torch::Tensor>& bias, bool fp32_out = false);
torch::Tensor linear_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          const std::optional<torch::Tensor>& bias, bool fp32_out = false);
torch::Tensor linear_int4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                               const std::optional<torch::Tensor>& bias, bool fp32_out = false);
torch::Tensor linear_int4_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                               const std::optional<torch::Tensor>& bias, bool fp32_out = false);
torch::Tensor dequantize_int4(torch::Tensor packed, torch::Tensor scales, int64_t k, int64_t begin, int64_t end,
                              bool fp32_out);
int64_t int4_channels(const torch::Tensor& scales);
// int8_grouped.cpp
torch::Tensor linear_int8g(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           const std::optional<torch::Tensor>& bias, bool fp32_out = false);
torch::Tensor linear_int8g_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                const std::optional<torch::Tensor>& bias, bool fp32_out = false);
torch::Tensor dequantize_int8g(torch::Tensor codes, torch::Tensor scales, int64_t k, int64_t begin, int64_t end,
                               bool fp32_out);
int64_t int8g_channels(const torch::Tensor& scales);

namespace {

// mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm)
using PackedLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                std::string_view, c10::List<std::optional<c10::Scalar>>,
                                std::optional<std::string_view>);

const c10::TypedOperatorHandle<PackedLinear>& packed_linear_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<PackedLinear>();
  return op;
}

// A Linear module's tensors, as Python passes them: (weight [N, K], bias [N] or None, packed weight or None,
// per-channel scale [N] fp32 or None). The packed weight is 16x16-pair blocks (4-D, from tile_pack_bf16) or
// oneDNN's packed copy (engine/kernels/packed_linear.py). With a scale the weight is int8 (engine/model/quant.py)
// and its packed copy, where the backend made one, is the W8A8 kernel's (quant.py pack_w8a8); or, with a uint8
// weight, int4: the weight is pack_int4's layout and the scale its fp16 scales and offsets ([2, G, N], or blocked
// [N / 16, G, 2, 16]: engine/kernels/int4_linear.cpp); or, with an
// int8 weight and a 3- or 4-D scale, int8g: codes in 16-channel blocks [ceil(N / 16), G, 256] and fp32 scales (and
// offsets) [1 or 2, G', N] or blocked [N / 16, G', 1 or 2, 16] (engine/kernels/int8_grouped.cpp).
using ProjectionArgs = std::tuple<torch::Tensor, std::optional<torch::Tensor>, std::optional<torch::Tensor>,
                                  std::optional<torch::Tensor>>;

struct Projection {
  torch::Tensor weight;
  std::optional<torch::Tensor> bias;
  std::optional<torch::Tensor> packed;
  std::optional<torch::Tensor> scale;
  torch::Tensor gemv_bias;  // bias, or empty: linear_bf16's "no bias"

  explicit Projection(const ProjectionArgs& args)
      : weight(std::get<0>(args)), bias(std::get<1>(args)), packed(std::get<2>(args)), scale(std::get<3>(args)),
        gemv_bias(bias ? *bias : torch::empty({0})) {}
};

// The row limits of engine/kernels/cpu_ext.py (MAX_GEMV_ROWS) and packed_linear.py (MAX_PACKED_ROWS for oneDNN's
// packed copy, max_tiled_rows() for the packed blocks), read by Python at each step as its own `linear` reads them.
struct RowLimits {
  int64_t gemv;
  int64_t packed;
  int64_t tiled;
  int64_t int8;  // rows the int8 kernel takes; more dequantise the weight to bf16 for at::linear
  int64_t w8a8;  // of those, rows that take it on int8-quantised activations (linear_w8a8)
  int64_t w4a8;  // rows an int4 weight takes on linear_w4a8
  int64_t int4;  // rows an int4 weight takes on linear_int4 (past w4a8's); more dequantise it to bf16 for at::linear
  int64_t int8g;  // rows an int8g weight takes on linear_int8g; more dequantise it to bf16 for at::linear
  int64_t int4_gemm;  // rows an int4 weight takes on linear_int4_gemm (before linear_int4's)
  int64_t int4_bf16;  // rows an int4 weight takes on linear_int4_bf16 (before linear_int4_gemm's)
  int64_t int8g_bf16;  // rows an int8g weight takes on linear_int8g_bf16 (before linear_int8g's)
};

// engine/model/llama.py `linear` with the kernels on: the packed weight for 2..limits.tiled rows (packed blocks)
// or 2..limits.packed (oneDNN's copy), else the GEMV for up to limits.gemv rows, else F.linear.
// An int8, int4 or int8g weight: CpuKernelBackend.linear_int8's, linear_int4's or linear_int8g's choice, the same ops.
torch::Tensor project(const Projection& p, const torch::Tensor& x, const RowLimits& limits) {
  const int64_t rows = x.size(0);
  if (p.scale && p.weight.scalar_type() == at::kByte) {
    if (rows <= limits.w4a8) return linear_w4a8(x, p.weight, *p.scale, p.bias);
    if (rows <= limits.int4_bf16) return linear_int4_bf16(x, p.weight, *p.scale, p.bias);
    if (rows <= limits.int4_gemm) return linear_int4_gemm(x, p.weight, *p.scale, p.bias);
    if (rows <= limits.int4) return linear_int4(x, p.weight, *p.scale, p.bias);
    const int64_t n = int4_channels(*p.scale);
    return at::linear(x, dequantize_int4(p.weight, *p.scale, x.size(1), 0, n, false), p.bias);
  }
  if (p.scale && p.scale->dim() >= 3) {
    if (rows <= limits.int8g_bf16) return linear_int8g_bf16(x, p.weight, *p.scale, p.bias);
    if (rows <= limits.int8g) return linear_int8g(x, p.weight, *p.scale, p.bias);
    return at::linear(x, dequantize_int8g(p.weight, *p.scale, x.size(1), 0, int8g_channels(*p.scale), false), p.bias);
  }
  if (p.scale) {
    if (p.packed && rows <= limits.w8a8) return linear_w8a8(x, *p.packed, *p.scale, p.bias);
    if (rows <= limits.int8) return linear_int8(x, p.weight, *p.scale, p.bias);
    return at::linear(x, p.weight.to(at::kBFloat16).mul_(p.scale->unsqueeze(1)), p.bias);
  }
  const bool tiled = p.packed && p.packed->dim() == 4;
  if (p.packed && rows >= 2 && rows <= (tiled ? limits.tiled : limits.packed)) {
    if (tiled) return tiled_linear_bf16(x, *p.packed, p.gemv_bias, 0);
    return packed_linear_op().call(x.contiguous(), *p.packed, p.bias, "none", c10::List<std::optional<c10::Scalar>>(),
                                   std::string_view(""));
  }
  if (rows <= limits.gemv && p.weight.is_contiguous()) return linear_bf16(x, p.weight, p.gemv_bias);
  return at::linear(x, p.weight, p.bias);
}

struct Layer {
  torch::Tensor input_norm, post_norm;  // RMSNorm weights [hidden]
  Projection qkv, o, gate_up, down;
  std::optional<torch::Tensor> gate_up_silu;  // Weight.silu_fused: gate|up interleaved in packed blocks, or None
  std::optional<torch::Tensor> q_norm, k_norm;  // Attention.q_norm / k_norm weights [head_dim] (Qwen3), or None
};

// What one step brings, shared by all layers.
struct Step {
  torch::Tensor cos, sin;  // [T, head_dim / 2]
  torch::Tensor slot_mapping, block_tables, context_lens;
  RowLimits limits;
};

using LayerPages = std::pair<torch::Tensor, torch::Tensor>;  // keys, values [num_blocks, block_size, Hkv, D]

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}

  void add_layer(torch::Tensor input_norm, const ProjectionArgs& qkv, const ProjectionArgs& o,
                 torch::Tensor post_norm, const ProjectionArgs& gate_up, const ProjectionArgs& down,
                 std::optional<torch::Tensor> gate_up_silu, std::optional<torch::Tensor> q_norm,
                 std::optional<torch::Tensor> k_norm) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeStack: a q norm without a k norm, or the reverse");
    layers_.push_back(Layer{input_norm, post_norm, Projection(qkv), Projection(o), Projection(gate_up),
                            Projection(down), std::move(gate_up_silu), std::move(q_norm), std::move(k_norm)});
  }

  // x [T, hidden] bf16 (the embeddings), one decode token a row; cos, sin [T, 1, D/2]; the attention metadata's
  // slot mapping, decode block tables and context lengths; the pages of the first kv.size() layers, which
  // run -> (the last layer's output, the residual stream), not yet added: the final norm adds them.
  std::vector<torch::Tensor> forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     torch::Tensor slot_mapping, torch::Tensor block_tables,
                                     torch::Tensor context_lens, const std::vector<LayerPages>& kv,
                                     int64_t max_gemv_rows, int64_t max_packed_rows, int64_t max_tiled_rows,
                                     int64_t max_int8_rows, int64_t max_w8a8_rows, int64_t max_w4a8_rows,
                                     int64_t max_int4_rows, int64_t max_int8g_rows,
                                     int64_t max_int4_gemm_rows, int64_t max_int4_bf16_rows,
                                     int64_t max_int8g_bf16_rows) const {
    TORCH_CHECK(!kv.empty() && kv.size() <= layers_.size(), "DecodeStack: ", kv.size(), " layers of pages for ",
                layers_.size(), " layers");
    const Step step{cos.reshape({cos.size(0), -1}), sin.reshape({sin.size(0), -1}), std::move(slot_mapping),
                    std::move(block_tables), std::move(context_lens),
                    RowLimits{max_gemv_rows, max_packed_rows, max_tiled_rows, max_int8_rows,
                              std::min(max_w8a8_rows, max_int8_rows), max_w4a8_rows, max_int4_rows,
                              max_int8g_rows, max_int4_gemm_rows, max_int4_bf16_rows, max_int8g_bf16_rows}};
    torch::Tensor residual = no_residual_;
    for (size_t i = 0; i < kv.size(); ++i) {
      const Layer& layer = layers_[i];
      std::vector<torch::Tensor> normed = rms_norm_bf16(x, residual, layer.input_norm, eps_);
      torch::Tensor h = attention(layer, normed[0], step, kv[i]);
      normed = rms_norm_bf16(h, normed[1], layer.post_norm, eps_);
      residual = normed[1];
      x = project(layer.down, gate_up_silu_mul(layer, normed[0], step.limits), step.limits);
    }
    return {x, residual};
  }

 private:
  // MLP.forward up to the down projection: silu(gate) * up [T, intermediate].
  static torch::Tensor gate_up_silu_mul(const Layer& layer, const torch::Tensor& h, const RowLimits& limits) {
    if (layer.gate_up_silu && h.size(0) >= 2) return tiled_linear_silu_mul_bf16(h, *layer.gate_up_silu, 0);
    return silu_mul_bf16(project(layer.gate_up, h, limits));
  }

  // Attention.forward, then paged_attention's page writes and decode-group kernel (engine/attention.py).
  torch::Tensor attention(const Layer& layer, const torch::Tensor& h, const Step& step, const LayerPages& pages) const {
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    torch::Tensor qkv = project(layer.qkv, h, step.limits);
    if (layer.q_norm) {
      norm_heads(qkv, 0, q_size, *layer.q_norm);
      norm_heads(qkv, q_size, kv_size, *layer.k_norm);
    }
    rotary_bf16_(qkv, step.cos, step.sin, num_heads_ + num_kv_heads_, head_dim_);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads_, head_dim_});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({-1, num_kv_heads_, head_dim_});
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, num_kv_heads_, head_dim_});
    write_pages(pages.first, k, step.slot_mapping);
    write_pages(pages.second, v, step.slot_mapping);
    torch::Tensor out = decode_attention_bf16(q, pages.first, pages.second, step.block_tables, step.context_lens,
                                              scale_);
    return project(layer.o, out.view({-1, q_size}), step.limits);
  }

  // Attention._norm_qk (llama.py): RMSNorm over head_dim of each head in qkv's columns [start, start + size), in place,
  // through a contiguous [T * H, D] copy as Python makes it.
  void norm_heads(torch::Tensor& qkv, int64_t start, int64_t size, const torch::Tensor& weight) const {
    torch::Tensor part = qkv.narrow(1, start, size);
    torch::Tensor heads = part.reshape({-1, head_dim_});
    part.copy_(rms_norm_bf16(heads, no_residual_, weight, eps_)[0].view(part.sizes()));
  }

  // pages.view(-1, Hkv, D).index_copy_(0, slot_mapping, x) as engine/attention.py writes them, one row copy per
  // token: index_copy_'s dispatch and checks cost more than the 64 copies of 384 bytes themselves.
  void write_pages(const torch::Tensor& pages, const torch::Tensor& x, const torch::Tensor& slot_mapping) const {
    TORCH_CHECK(pages.is_contiguous() && pages.scalar_type() == x.scalar_type() && x.stride(2) == 1 &&
                    x.stride(1) == head_dim_ && slot_mapping.scalar_type() == at::kLong &&
                    slot_mapping.is_contiguous() && slot_mapping.numel() == x.size(0),
                "DecodeStack: page write layout");
    const int64_t row = num_kv_heads_ * head_dim_, num_slots = pages.numel() / row;
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const auto* src = static_cast<const char*>(x.data_ptr());
    auto* dst = static_cast<char*>(pages.data_ptr());
    const int64_t bytes = row * x.element_size(), src_stride = x.stride(0) * x.element_size();
    for (int64_t t = 0; t < x.size(0); ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "DecodeStack: slot ", slots[t], " outside the pages");
      std::memcpy(dst + slots[t] * bytes, src + t * src_stride, bytes);
    }
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  torch::Tensor no_residual_ = torch::empty({0});  // rms_norm_bf16's "no residual": the first layer's input norm
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack", "the decoder layers of a decode-only bf16 step in one call (bf16, int8, int4 or int8g weights)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
