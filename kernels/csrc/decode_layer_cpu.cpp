// One Llama decoder layer of a pure decode step (every token a decode row) in one call: add + RMSNorm, the fused
// qkv GEMM, (Qwen3's per-head q/k RMSNorm and) rotary, the K/V write into the paged pool, paged decode attention,
// o_proj, add + RMSNorm, then gate_up, SiLU-and-mul, down, or a mixture of experts (router GEMM, the fused
// experts kernel). See kubellm/kernels/cpu_decode_layer.py for the Python contract and the reference.
//
// Why: at batch 1 a SmolLM2-135M layer is ~9 MB of weights (~0.2 ms of DRAM stream) but the Python module tree
// made ~25 Python calls and ~40 ATen/kubellm dispatches per layer around it. This op runs the same kernels
// (called through the dispatcher, not copied: results are bit for bit the unfused path's) from C++, so a layer
// costs one Python -> C++ crossing. A one-row dense layer runs in one parallel region (not one per GEMM and
// attention): the threads claim each GEMM's work items as thread 0 reaches it, and warm the next GEMM's weights
// while thread 0 runs the serial ops between them (layer_in_one_region).
//
// decode_layer_q_ is the same dense layer with each linear on any native CPU GEMM, chosen per linear by a kind
// code: bf16_linear, int4_gemm (--quantization int4, AWQ, GPTQ, compressed-tensors W4A16, GGUF 4-bit), fp8_gemm
// (FP8 per channel or in blocks), grouped_int8_gemm (GPTQ 8-bit, W8A16, GGUF Q8_0/Q5_K/Q6_K) or int8_gemm
// (--quantization int8), so a GGUF Q4_K_M layer mixing 4- and 8-bit linears is one call too. Each GEMM runs in
// its own parallel region: the one-region path shares bf16_linear's work items only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16_linear.h"
#include "shared_items.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
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
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t, const std::optional<at::Tensor>&, bool)>
      int4_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                  const std::optional<at::Tensor>&, bool)>("kubellm_cpu::int4_gemm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                      const std::optional<at::Tensor>&)>
      fp8_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                 const std::optional<at::Tensor>&)>("kubellm_cpu::fp8_gemm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, int64_t, const std::optional<at::Tensor>&)>
      grouped_int8_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const std::optional<at::Tensor>&, int64_t,
                                          const std::optional<at::Tensor>&)>("kubellm_cpu::grouped_int8_gemm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&)>
      int8_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const std::optional<at::Tensor>&)>("kubellm_cpu::int8_gemm");
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

using OptionalTensor = std::optional<at::Tensor>;

// decode_layer_'s arguments.
struct Layer {
  at::Tensor& hidden;
  at::Tensor& residual;
  const at::Tensor &positions, &slots, &block_tables, &context_lens, &input_norm, &post_norm;
  double eps;
  const at::Tensor& qkv_w;
  const OptionalTensor& qkv_bias;
  const at::Tensor &o_w, &gate_up_w, &down_w;
  int64_t intermediate;
  const at::Tensor &cos, &sin;
  at::Tensor &k_cache, &v_cache;
  int64_t num_heads, num_kv_heads;
  double scale;
  int64_t window;
  double softcap;
  const OptionalTensor &q_norm, &k_norm, &router;  // Qwen3's per-head norms; a mixture of experts' router
  int64_t top_k;
  bool renormalize;
};

// The layer's ops in order on the calling thread; linear(i, x, w, N, bias) runs its i-th GEMM (0 qkv, 1 o,
// 2 gate_up or the router, 3 down) and returns the output.
template <class Linear>
at::Tensor layer_ops(const Layer& l, const Linear& linear) {
  const Kernels& kn = kernels();
  const int64_t T = l.hidden.size(0), H = l.hidden.size(1), D = l.k_cache.size(3);
  const int64_t q_size = l.num_heads * D, kv_size = l.num_kv_heads * D;
  kn.add_rms_norm.call(l.hidden, l.residual, l.input_norm, l.eps);
  at::Tensor qkv = linear(0, l.hidden, l.qkv_w, q_size + 2 * kv_size, l.qkv_bias);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, l.num_heads, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, l.num_kv_heads, D});
  if (l.q_norm) {
    kn.qk_norm_rotary.call(l.positions, q, k, *l.q_norm, *l.k_norm, l.eps, l.cos, l.sin);
  } else {
    kn.rotary.call(l.positions, q, k, l.cos, l.sin);
  }
  write_kv(qkv.narrow(1, q_size, kv_size), qkv.narrow(1, q_size + kv_size, kv_size), l.k_cache, l.v_cache, l.slots);
  at::Tensor attn = kn.attention.call(q, l.k_cache, l.v_cache, l.block_tables, l.context_lens, l.scale,
                                      kAttentionChunk, 0, l.window, l.softcap);
  at::Tensor out = linear(1, attn.view({T, q_size}), l.o_w, H, std::nullopt);
  kn.add_rms_norm.call(out, l.residual, l.post_norm, l.eps);
  if (l.router) {  // gate_up_w/down_w hold every expert, packed by cpu_moe.pack
    at::Tensor logits = linear(2, out, *l.router, l.gate_up_w.size(0), std::nullopt);
    return kn.moe_experts.call(out, logits, l.gate_up_w, l.down_w, l.top_k, l.renormalize);
  }
  at::Tensor act = kn.silu_and_mul.call(linear(2, out, l.gate_up_w, 2 * l.intermediate, std::nullopt));
  return linear(3, act, l.down_w, H, std::nullopt);
}

// Each op its own parallel region, through the dispatcher.
at::Tensor layer_by_ops(const Layer& l) {
  const Kernels& kn = kernels();
  return layer_ops(l, [&](int, const at::Tensor& x, const at::Tensor& w, int64_t n, const OptionalTensor& bias) {
    return kn.linear.call(x, w, n, bias);
  });
}

constexpr int64_t kWarmBytes = 1 << 20;  // at most half the 2 MB L2 of the CPUs this runs on

// Reads this thread's share of a packed weight (share t of `threads`, at most kWarmBytes) into its caches, 4 KB
// at a time, until stop(): while thread 0 runs the serial ops before a GEMM the others pull in the lines they
// will claim first, instead of leaving the memory bus idle.
template <class Stop>
void warm(const at::Tensor& w, int64_t t, int64_t threads, const Stop& stop) {
  const auto* p = static_cast<const char*>(w.const_data_ptr());
  const int64_t bytes = w.nbytes(), begin = bytes * t / threads / 64 * 64;
  const int64_t end = std::min(bytes * (t + 1) / threads, begin + kWarmBytes);
  uint64_t sum = 0;
  for (int64_t page = begin; page < end && !stop(); page += 4096)
    for (int64_t line = page; line < std::min(page + 4096, end); line += 64)
      sum += *reinterpret_cast<const uint64_t*>(p + line);
  static volatile uint64_t sink;
  sink = sum;
}

// One parallel region for the whole layer. Thread 0 runs the ops in order; at each GEMM it publishes the work
// items, which every thread claims (SharedItems), and waits until all have run. The other threads, between
// GEMMs, warm their share of the next weight. Bit for bit layer_by_ops: the same kernels on the same inputs.
at::Tensor layer_in_one_region(const Layer& l) {
  struct Phase {
    Bf16LinearItems items;
    SharedItems shared;
    std::atomic<bool> ready{false};
  };
  const int64_t threads = std::max(1, at::get_num_threads());
  std::array<Phase, 4> phases;
  const std::array<const at::Tensor*, 4> weights{&l.qkv_w, &l.o_w, &l.gate_up_w, &l.down_w};
  std::atomic<bool> failed{false};
  at::Tensor out;
  auto claim = [&](Phase& p, int64_t t) {
    p.shared.run(static_cast<int>(t), [&](int64_t item) { p.items.run(item, item + 1); });
  };
  auto linear = [&](int i, const at::Tensor& x, const at::Tensor& w, int64_t n, const OptionalTensor& bias) {
    Phase& p = phases[i];
    p.items = bf16_linear_items(x, w, n, bias);
    p.shared.reset(p.items.items, static_cast<int>(threads));
    p.ready.store(true, std::memory_order_release);
    claim(p, 0);
    p.shared.wait();
    return p.items.y;
  };
  // One thread may be handed several roles (a smaller team than asked for): role 0 then does all the work and the
  // others find every item taken.
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t == 0) {
        try {
          out = layer_ops(l, linear);
        } catch (...) {
          failed.store(true, std::memory_order_release);  // the others stop waiting; parallel_for rethrows
          throw;
        }
        continue;
      }
      for (size_t i = 0; i < phases.size(); ++i) {
        Phase& p = phases[i];
        auto started = [&] {
          return p.ready.load(std::memory_order_acquire) || failed.load(std::memory_order_acquire);
        };
        warm(*weights[i], t, threads, started);
        while (!started()) cpu_relax();
        if (!p.ready.load(std::memory_order_acquire)) return;
        claim(p, t);
      }
    }
  });
  return out;
}

// KUBELLM_LAYER_REGION=0: each kernel its own parallel region (the A/B baseline). Read at every call (under a
// microsecond against a layer's ~0.2 ms), so tests and A/B runs switch it in-process.
bool one_region() {
  const char* v = std::getenv("KUBELLM_LAYER_REGION");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

void check_layer(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, int64_t num_kv_heads, const OptionalTensor& q_norm,
                 const OptionalTensor& k_norm) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16, "hidden must be [T, hidden] bfloat16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "k_cache/v_cache must be contiguous bfloat16 [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == hidden.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "slots must be a contiguous int64 [T] tensor");
  TORCH_CHECK(k_cache.size(2) == num_kv_heads, "the cache holds ", k_cache.size(2), " kv heads, not ", num_kv_heads);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together (Qwen3) or not at all");
}

at::Tensor decode_layer_(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                         const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                         const at::Tensor& qkv_w, const OptionalTensor& qkv_bias, const at::Tensor& o_w,
                         const at::Tensor& gate_up_w, const at::Tensor& down_w, int64_t intermediate,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         int64_t num_heads, int64_t num_kv_heads, double scale, int64_t window, double softcap,
                         const OptionalTensor& q_norm, const OptionalTensor& k_norm,
                         const OptionalTensor& router, int64_t top_k, bool renormalize) {
  check_layer(hidden, slots, k_cache, v_cache, num_kv_heads, q_norm, k_norm);
  const Layer l{hidden, residual, positions, slots, block_tables, context_lens, input_norm, post_norm, eps,
                qkv_w, qkv_bias, o_w, gate_up_w, down_w, intermediate, cos, sin, k_cache, v_cache,
                num_heads, num_kv_heads, scale, window, softcap, q_norm, k_norm, router, top_k, renormalize};
  // One row, several threads and a dense MLP only: batched decode's attention and norms and the experts kernel
  // parallelise in regions of their own, which thread 0 would run alone here; one thread has no regions to save,
  // only claims to pay for (2.5% slower at 1 thread).
  const bool region = hidden.size(0) == 1 && !router && at::get_num_threads() > 1 && !at::in_parallel_region() &&
                      one_region();
  return region ? layer_in_one_region(l) : layer_by_ops(l);
}

// decode_layer_q_'s kind codes (kernels/cpu_decode_layer.py's BF16 ... INT8): which GEMM runs a linear.
enum Kind : int64_t { kBf16 = 0, kInt4 = 1, kFp8 = 2, kGroupedInt8 = 3, kInt8 = 4 };

// decode_layer_ with each linear on its own native GEMM: kinds/weights/scales/zeros/group_sizes/int8_activations
// hold qkv, o, gate_up and down in that order, each as its layer's forward hands its kernel them (unused entries
// None / 0 / false); a dense MLP only. qkv_bias is what the qkv layer passes its kernel (float32).
at::Tensor decode_layer_q_(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                           const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                           at::IntArrayRef kinds, at::TensorList weights,
                           const c10::List<std::optional<at::Tensor>>& scales,
                           const c10::List<std::optional<at::Tensor>>& zeros, at::IntArrayRef group_sizes,
                           std::array<bool, 4> int8_activations, const OptionalTensor& qkv_bias,
                           int64_t intermediate, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                           at::Tensor& v_cache, int64_t num_heads, int64_t num_kv_heads, double scale,
                           int64_t window, double softcap, const OptionalTensor& q_norm,
                           const OptionalTensor& k_norm) {
  check_layer(hidden, slots, k_cache, v_cache, num_kv_heads, q_norm, k_norm);
  TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && scales.size() == 4 && zeros.size() == 4 &&
                  group_sizes.size() == 4,
              "kinds, weights, scales, zeros and group_sizes each hold the 4 linears qkv, o, gate_up, down");
  std::array<OptionalTensor, 4> s, z;
  for (size_t i = 0; i < 4; ++i) {
    s[i] = scales.get(i);
    z[i] = zeros.get(i);
    const int64_t kind = kinds[i];
    TORCH_CHECK(kind >= kBf16 && kind <= kInt8, "linear ", i, ": unknown kind ", kind);
    TORCH_CHECK(kind == kBf16 || s[i].has_value(), "linear ", i, " (kind ", kind, ") needs its scales");
    TORCH_CHECK(kind != kInt4 || z[i].has_value(), "linear ", i, " (int4) needs its zero points");
  }
  const OptionalTensor no_router;
  const Layer l{hidden, residual, positions, slots, block_tables, context_lens, input_norm, post_norm, eps,
                weights[0], qkv_bias, weights[1], weights[2], weights[3], intermediate, cos, sin, k_cache, v_cache,
                num_heads, num_kv_heads, scale, window, softcap, q_norm, k_norm, no_router, 0, false};
  const Kernels& kn = kernels();
  return layer_ops(l, [&](int i, const at::Tensor& x, const at::Tensor& w, int64_t n, const OptionalTensor& bias) {
    at::Tensor y;
    switch (kinds[i]) {
      case kBf16: y = kn.linear.call(x, w, n, bias); break;
      case kInt4: y = kn.int4_linear.call(x, w, *s[i], *z[i], group_sizes[i], bias, int8_activations[i]); break;
      case kFp8: y = kn.fp8_linear.call(x, w, *s[i], group_sizes[i], bias); break;
      case kGroupedInt8: y = kn.grouped_int8_linear.call(x, w, *s[i], z[i], group_sizes[i], bias); break;
      default: y = kn.int8_linear.call(x, w, *s[i], bias); break;
    }
    TORCH_CHECK(y.size(1) == n, "linear ", i, " (qkv, o, gate_up, down) has ", y.size(1), " outputs, not ", n);
    return y;
  });
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
  m.def(
      "decode_layer_q_(Tensor(a!) hidden, Tensor(b!) residual, Tensor positions, Tensor slots, "
      "Tensor block_tables, Tensor context_lens, Tensor input_norm, Tensor post_norm, float eps, int[] kinds, "
      "Tensor[] weights, Tensor?[] scales, Tensor?[] zeros, int[] group_sizes, bool[4] int8_activations, "
      "Tensor? qkv_bias, int intermediate, Tensor cos, Tensor sin, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "int num_heads, int num_kv_heads, float scale, int window, float softcap, Tensor? q_norm=None, "
      "Tensor? k_norm=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kubellm_cpu, CPU, m) {
  m.impl("decode_layer_", &kubellm_cpu::decode_layer_);
  m.impl("decode_layer_q_", &kubellm_cpu::decode_layer_q_);
}
