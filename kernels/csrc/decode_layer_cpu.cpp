// One Llama decoder layer of a pure decode step (every token a decode row) in one call: add + RMSNorm, the fused
// qkv GEMM, (Qwen3's per-head q/k RMSNorm and) rotary, the K/V write into the paged pool, paged decode attention,
// o_proj, add + RMSNorm, then gate_up, SiLU-and-mul, down, or a mixture of experts (router GEMM, the fused
// experts kernel). See kubellm/kernels/cpu_decode_layer.py for the Python contract and the reference.
//
// Why: at batch 1 a SmolLM2-135M layer is ~9 MB of weights (~0.2 ms of DRAM stream) but the Python module tree
// made ~25 Python calls and ~40 ATen/kubellm dispatches per layer around it. This op runs the same kernels
// (called through the dispatcher, not copied: results are bit for bit the unfused path's) from C++, so a layer
// costs one Python -> C++ crossing.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>

namespace kubellm_cpu {
namespace {

// The kernels this layer is made of, resolved once (after every source has registered its ops).
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>
      linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>(
          "kubellm_cpu::bf16_linear");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)> add_rms_norm =
      op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>("kubellm_cpu::add_rms_norm_");
  c10::TypedOperatorHandle<void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&)>
      rotary = op<void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "kubellm_cpu::rotary_embedding_");
  c10::TypedOperatorHandle<void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                double, const at::Tensor&, const at::Tensor&)>
      qk_norm_rotary = op<void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                               double, const at::Tensor&, const at::Tensor&)>("kubellm_cpu::qk_norm_rotary_");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t, bool)>
      moe_experts = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                  bool)>("kubellm_cpu::moe_experts");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      op<at::Tensor(const at::Tensor&)>("kubellm_cpu::silu_and_mul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double, int64_t, int64_t, int64_t, double)>
      attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, int64_t, int64_t, int64_t, double)>(
          "kubellm_cpu::paged_decode_attention");
};

const Kernels& kernels() {
  static const Kernels k;
  return k;
}

constexpr int64_t kAttentionChunk = 128;  // cpu_paged_attention._CHUNK_TOKENS

// k/v rows [T, KVH * D] (strided views into the qkv output) -> pool rows at slots[t] of [blocks * bs, KVH * D].
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  const int64_t T = k.size(0), row = k.size(1), pool = k_cache.numel() / row;
  const int64_t* s = slots.const_data_ptr<int64_t>();
  const auto* kp = k.const_data_ptr<c10::BFloat16>();
  const auto* vp = v.const_data_ptr<c10::BFloat16>();
  auto* kc = k_cache.mutable_data_ptr<c10::BFloat16>();
  auto* vc = v_cache.mutable_data_ptr<c10::BFloat16>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < pool, "slot ", s[t], " outside the KV pool of ", pool, " slots");
    std::memcpy(kc + s[t] * row, kp + t * k.stride(0), row * sizeof(c10::BFloat16));
    std::memcpy(vc + s[t] * row, vp + t * v.stride(0), row * sizeof(c10::BFloat16));
  }
}

at::Tensor decode_layer_(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                         const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                         const at::Tensor& qkv_w, const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_w,
                         const at::Tensor& gate_up_w, const at::Tensor& down_w, int64_t intermediate,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         int64_t num_heads, int64_t num_kv_heads, double scale, int64_t window, double softcap,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                         const std::optional<at::Tensor>& router, int64_t top_k, bool renormalize) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16, "hidden must be [T, hidden] bfloat16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "k_cache/v_cache must be contiguous bfloat16 [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == hidden.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "slots must be a contiguous int64 [T] tensor");
  const Kernels& kn = kernels();
  const int64_t T = hidden.size(0), H = hidden.size(1), D = k_cache.size(3);
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  TORCH_CHECK(k_cache.size(2) == num_kv_heads, "the cache holds ", k_cache.size(2), " kv heads, not ", num_kv_heads);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together (Qwen3) or not at all");

  kn.add_rms_norm.call(hidden, residual, input_norm, eps);
  at::Tensor qkv = kn.linear.call(hidden, qkv_w, q_size + 2 * kv_size, qkv_bias);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
  if (q_norm) {
    kn.qk_norm_rotary.call(positions, q, k, *q_norm, *k_norm, eps, cos, sin);
  } else {
    kn.rotary.call(positions, q, k, cos, sin);
  }
  write_kv(qkv.narrow(1, q_size, kv_size), qkv.narrow(1, q_size + kv_size, kv_size), k_cache, v_cache, slots);
  at::Tensor attn = kn.attention.call(q, k_cache, v_cache, block_tables, context_lens, scale, kAttentionChunk, 0,
                                      window, softcap);
  at::Tensor out = kn.linear.call(attn.view({T, q_size}), o_w, H, std::nullopt);
  kn.add_rms_norm.call(out, residual, post_norm, eps);
  if (router) {  // gate_up_w/down_w hold every expert, packed by cpu_moe.pack
    at::Tensor logits = kn.linear.call(out, *router, gate_up_w.size(0), std::nullopt);
    return kn.moe_experts.call(out, logits, gate_up_w, down_w, top_k, renormalize);
  }
  at::Tensor act = kn.silu_and_mul.call(kn.linear.call(out, gate_up_w, 2 * intermediate, std::nullopt));
  return kn.linear.call(act, down_w, H, std::nullopt);
}

}  // namespace
}  // namespace kubellm_cpu

TORCH_LIBRARY_FRAGMENT(kubellm_cpu, m) {
  m.def(
      "decode_layer_(Tensor(a!) hidden, Tensor(b!) residual, Tensor positions, Tensor slots, Tensor block_tables, "
      "Tensor context_lens, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv, Tensor? qkv_bias, Tensor o, "
      "Tensor gate_up, Tensor down, int intermediate, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
      "Tensor(d!) v_cache, int num_heads, int num_kv_heads, float scale, int window, float softcap, "
      "Tensor? q_norm=None, Tensor? k_norm=None, Tensor? router=None, int top_k=0, bool renormalize=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) { m.impl("decode_layer_", &kubellm_cpu::decode_layer_); }
