#ifndef SPECSERVE_COMMON_CUDA_CUDNN_ATTENTION_H_
#define SPECSERVE_COMMON_CUDA_CUDNN_ATTENTION_H_

// Prefill attention through cuDNN 9's fused scaled-dot-product attention
// (the "flash" SDPA engines), expressed in cuDNN's backend graph API: Q.K^T,
// a scale, a causal mask, softmax and P.V as one operation graph that
// cuDNN's heuristics match to a fused kernel (cuDNN developer guide,
// "Scaled Dot Product Attention"; the graph is the one cuDNN's own frontend
// builds for cuDNN 9.0-9.20, see docs/ARCHITECTURE.md). libcudnn is loaded
// lazily (third_party/cuda/cudnn_dlopen.cc): a host without it still runs
// the binary, and this path reports UNAVAILABLE.
//
// Keys and values are dense here: the runner gathers a sequence's cached
// rows out of the paged pool first (cuda_kernels::GatherKv).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/cuda/device_buffer.h"
#include "common/cuda/kernels.h"

namespace specserve {

/// The shape of one causal SDPA call, and the key of the plan cache: cuDNN
/// plans are built for fixed sizes.
struct CudnnSdpaShape {
  int s_q = 0;           ///< query rows (the chunk's new tokens)
  int s_kv = 0;          ///< keys: cached + new tokens, >= s_q
  int num_heads = 0;     ///< H, a positive multiple of num_kv_heads (GQA)
  int num_kv_heads = 0;  ///< KV
  int head_dim = 0;      ///< D: 64 or 128
  CudaDType dtype = CudaDType::kBF16;  ///< of Q, K, V and O: bf16 or fp16

  bool operator==(const CudnnSdpaShape& o) const {
    return s_q == o.s_q && s_kv == o.s_kv && num_heads == o.num_heads &&
           num_kv_heads == o.num_kv_heads && head_dim == o.head_dim &&
           dtype == o.dtype;
  }
  template <typename H>
  friend H AbslHashValue(H h, const CudnnSdpaShape& s) {
    return H::combine(std::move(h), s.s_q, s.s_kv, s.num_heads,
                      s.num_kv_heads, s.head_dim, static_cast<int>(s.dtype));
  }
};

/// INVALID_ARGUMENT (naming the field) unless 1 <= s_q <= s_kv, heads as
/// documented on CudnnSdpaShape, head_dim 64 or 128 and dtype bf16 / fp16.
absl::Status ValidateCudnnSdpaShape(const CudnnSdpaShape& shape);

/// The shape cuDNN actually runs for `shape`: s_q rounded up to its bucket
/// (a power of two up to 256, then a multiple of 256) and s_kv grown by
/// the same number of rows. Padding both ends of the diagonal alike keeps
/// the bottom-right causal mask of the real rows as it was: real row i sees
/// keys [0, s_kv - s_q + i], never a padding key. Plans are cached per
/// padded shape, so prompts of nearby lengths share one (cuDNN plans are
/// built per fixed size, which costs time at the first call).
///
/// s_kv is not rounded up any further: cuDNN 9.14 takes the causal
/// diagonal from the plan's dimensions, not from the mask's by-value
/// scalars, so real rows would attend to any further padding keys (seen
/// on an H200, 2026-11-29).
CudnnSdpaShape PaddedCudnnSdpaShape(const CudnnSdpaShape& shape);

/// Whether planning `shape` (not planned yet) for a model of `num_layers`
/// layers pays off: true for chunks of 2048 rows or more (a long prompt's
/// full chunks, whose shapes recur from prompt to prompt: at most one per
/// 2048 tokens of context), else when the chunk's causal attention work,
/// 4 * H * D * s_q * (s_kv - s_q / 2) FLOPs a layer, is at least
/// kCudnnPlanPaysOffFlops over all layers. Below that FlashMmaAttention
/// runs the chunk sooner than cuDNN plans it: on an H200 (cuDNN 9.14,
/// 2026-11-29) a fixed-shape plan took 0.037-0.041 s to build and cuDNN
/// ran causal SDPA at 500-650 TFLOP/s against FlashMma's ~175, so a plan
/// saves ~3.9e-15 s a FLOP and pays for itself from ~1e13 FLOPs. Odd chunk
/// shapes are common in serving: a prompt's tail, a prompt split between
/// two steps by the token budget, a pruned prompt's kept rows.
inline constexpr double kCudnnPlanPaysOffFlops = 1e13;
/// Chunks of this many rows or more always plan: the smallest of the CUDA
/// services' default max_num_batched_tokens (DefaultMaxNumBatchedTokens),
/// a long prompt's full chunk.
inline constexpr int kCudnnRecurringChunkRows = 2048;
bool CudnnPlanPaysOff(const CudnnSdpaShape& shape, int num_layers);

/// The causal attention work of `shape` over `num_layers` layers, in FLOPs:
/// 4 * H * D * s_q * (s_kv - s_q / 2) a layer.
double CudnnSdpaFlops(const CudnnSdpaShape& shape, int num_layers);

/// Which chunk shapes without a plan get one, as in ski rental (the
/// rent-or-buy problem; Karlin, Manasse, Rudolph and Sleator, "Competitive
/// snoopy caching", 1988): a shape runs on FlashMmaAttention
/// (renting) until the attention work its padded shape (what one plan
/// covers) has run there reaches kCudnnPlanPaysOffFlops, the work whose
/// time on FlashMma one plan's build costs; then it is planned (buying).
/// A shape that recurs, such as the kept tail of a pruned prompt of a
/// usual length, is planned after costing at most one build's worth of
/// slower attention; one seen once never pays for a plan it would use
/// once. CudnnPlanPaysOff's shapes plan at once. Not thread-safe.
class CudnnPlanPolicy {
 public:
  /// Whether to plan `shape` (it has no plan) before running this chunk,
  /// rather than run the chunk on FlashMmaAttention; when not, counts the
  /// chunk's work towards the next answer.
  bool ShouldPlan(const CudnnSdpaShape& shape, int num_layers);
  /// Padded shapes counted at most; the counts restart when it is reached
  /// (at ~50 bytes a shape).
  static constexpr size_t kMaxShapes = 4096;

 private:
  absl::flat_hash_map<CudnnSdpaShape, double> flops_;  // by padded shape
};

/// Whether libcudnn (major version 9, what the build's headers declare)
/// loads on this host. No CUDA call.
bool CudnnLibraryLoads();

/// Builds and finalizes every tensor and operation descriptor of the SDPA
/// graph for `shape` (everything short of the operation graph, which needs a
/// GPU handle) and returns how many operations the graph has. Lets a host
/// without a GPU check the graph's attribute types and shapes against the
/// real library. INVALID_ARGUMENT for a bad shape; UNAVAILABLE when libcudnn
/// does not load; INTERNAL with cuDNN's message when a descriptor is
/// rejected.
absl::StatusOr<int> CheckCudnnSdpaOperations(const CudnnSdpaShape& shape);

/// Causal grouped-query attention of `shape.s_q` new rows over `s_kv` keys,
/// on the GPU through cuDNN. Row i of the chunk is cache slot
/// s_kv - s_q + i and attends to keys [0, s_kv - s_q + i] (the causal mask
/// aligned bottom-right, as a chunk appended to a cache needs); query head h
/// reads kv head h / (H / KV); softmax of scale * q.k in fp32.
///
/// Not thread-safe: the owner serializes calls (CudaModelRunner holds its
/// mutex). One plan per shape is built on first use (cuDNN heuristics, mode
/// A, first engine config that finalizes) and cached; shapes no engine
/// supports are remembered too, so a caller can fall back cheaply.
class CudnnAttention {
 public:
  /// Creates the cuDNN handle bound to `stream`. UNAVAILABLE when libcudnn
  /// does not load, its major version is not 9, or it is 9.10.0 / 9.10.1
  /// (SDPA bugs the frontend also refuses); INTERNAL when the handle
  /// cannot be created (no GPU included).
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(
      cudaStream_t stream);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  /// Enqueues the attention on the handle's stream.
  /// q: T [s_q, H, D]; k, v: T [s_kv, KV, D] (dense, row t = slot t) with
  /// room for PaddedCudnnSdpaShape(shape).s_kv rows: Run zeroes the rows
  /// past s_kv (they are read, and must be finite); out: T [s_q, H * D];
  /// T = shape.dtype; all 16-byte aligned. When s_q is not its own bucket,
  /// q and out go through padded copies held here.
  /// Errors: INVALID_ARGUMENT for a bad shape or null / misaligned pointer;
  /// UNIMPLEMENTED when no cuDNN engine supports the shape (cached: later
  /// calls with the shape fail the same way at once); RESOURCE_EXHAUSTED
  /// when the plan's workspace cannot be allocated; INTERNAL with cuDNN's
  /// message when execution fails.
  absl::Status Run(const CudnnSdpaShape& shape, const void* q, void* k,
                   void* v, void* out, float scale);

  /// Finds or builds the plan for `shape`'s padded shape (no GPU work is
  /// enqueued).
  /// Errors as Run's: INVALID_ARGUMENT, UNIMPLEMENTED (cached).
  absl::Status Prepare(const CudnnSdpaShape& shape);

  /// Whether `shape`'s padded shape was planned already (a plan, or the
  /// remembered UNIMPLEMENTED of a shape no engine supports): Prepare then
  /// costs no planning.
  bool HasPlan(const CudnnSdpaShape& shape) const;

  /// Plans built so far, and the seconds spent building them (heuristics
  /// and finalization), for the benchmarks' logs.
  int plans_built() const { return plans_built_; }
  double plan_build_seconds() const { return plan_build_seconds_; }
  /// How the last successful plan was made: "dynamic shapes" (kernels
  /// shared across shapes through a kernel cache) or "fixed shape" (one
  /// compiled kernel per shape); empty before one.
  const std::string& last_plan_form() const { return last_plan_form_; }

  /// cudnnGetVersion() of the loaded library, e.g. 91900.
  static size_t LibraryVersion();

  /// What planning a shape for a device chose.
  struct PlanCheck {
    std::string form;        ///< how the plan was made (last_plan_form)
    int engine_configs = 0;  ///< engine configs the heuristics offered
    int chosen_config = 0;   ///< index of the first that finalized
    int64_t workspace_bytes = 0;
  };

  /// Plans `shape` as it is (no padding) for the device that
  /// `device_json` describes, without a GPU (cuDNN 9.8+'s deviceless
  /// ahead-of-time compilation: the operation graph without a handle, the
  /// heuristics and the execution plan from a DEVICEPROP descriptor
  /// deserialized from `device_json`, the JSON DevicePropertiesJson gives on
  /// that device). Lets a host without a GPU check that cuDNN's engines take
  /// the graph. INVALID_ARGUMENT for a bad shape or JSON cuDNN rejects;
  /// UNAVAILABLE when libcudnn does not load or is older than 9.8;
  /// UNIMPLEMENTED (with every form's reason) when no plan finalizes.
  /// `first_form_only` tries only the form the runner tries first.
  static absl::StatusOr<PlanCheck> CheckPlanForDevice(
      const CudnnSdpaShape& shape, const std::string& device_json,
      bool first_form_only = false);

  /// cuDNN's JSON description of CUDA device `device_id` (needs the GPU).
  /// UNAVAILABLE as CheckPlanForDevice; INTERNAL with cuDNN's message.
  static absl::StatusOr<std::string> DevicePropertiesJson(int device_id);

 private:
  struct Plan;
  struct KernelCache;
  // A graph pattern: bottom-right mask, heads, kv heads, head_dim, dtype.
  using KernelCacheKey = std::tuple<bool, int, int, int, int>;
  CudnnAttention(void* handle, cudaStream_t stream);
  // One plan for `shape` made as kForms[form_index] says (cudnn_attention
  // .cc), with a handle (serving) or a DEVICEPROP descriptor
  // (CheckPlanForDevice); `kernel_cache` for the dynamic-shape form only
  // (seeded by the first graph that uses it).
  static absl::StatusOr<std::unique_ptr<Plan>> BuildPlan(
      const CudnnSdpaShape& shape, int form_index, void* handle_or_null,
      void* device_properties, KernelCache* kernel_cache);
  absl::StatusOr<const Plan*> GetPlan(const CudnnSdpaShape& shape);

  void* handle_ = nullptr;  // cudnnHandle_t
  cudaStream_t stream_ = nullptr;
  // Plans by shape; a failed build is cached as its status.
  absl::flat_hash_map<CudnnSdpaShape, absl::StatusOr<std::unique_ptr<Plan>>>
      plans_;
  absl::flat_hash_map<KernelCacheKey, std::unique_ptr<KernelCache>>
      kernel_caches_;
  DeviceBuffer workspace_;
  DeviceBuffer padded_q_, padded_out_;  // when s_q is not its own bucket
  int plans_built_ = 0;
  double plan_build_seconds_ = 0;
  std::string last_plan_form_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_CUDNN_ATTENTION_H_
