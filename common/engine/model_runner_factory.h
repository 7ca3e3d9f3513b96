#ifndef SPECSERVE_COMMON_ENGINE_MODEL_RUNNER_FACTORY_H_
#define SPECSERVE_COMMON_ENGINE_MODEL_RUNNER_FACTORY_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/engine/cpu_model_runner.h"
#include "common/engine/model_runner.h"
#include "common/model/weights.h"

namespace specserve {

/// How a service runs its model (the `--device`, `--kv_budget_bytes`,
/// `--kv_block_size`, `--cuda_dtype`, `--weight_dtype` and
/// `--kv_cache_dtype` flags of both services).
struct RunnerOptions {
  /// "cpu", "cuda" (alias "gpu"), or "" / "auto": cuda when a GPU is
  /// present, else cpu (common/cuda/device.h).
  std::string device = "auto";
  KvCacheOptions kv_cache;
  /// Weights and KV cache element type on CUDA: "bf16" or "fp16".
  std::string cuda_dtype = "bf16";
  /// Element type of the CPU engine's Linear weights: "auto" (the
  /// checkpoint's: bf16 for BF16 checkpoints, else f32), "f32", "bf16" or
  /// "int8" (Q8_0-style blocks, quantized at load). CUDA takes cuda_dtype
  /// and refuses anything but "auto" here.
  std::string weight_dtype = "auto";
  /// Element type of the KV cache (ParseKvCacheDType): "auto" (f32 on CPU,
  /// cuda_dtype on CUDA), "f32" or "bf16" (half the bytes per token, so a
  /// pool of the same bytes holds twice the tokens). Overrides
  /// kv_cache.dtype. CUDA stores its cache in cuda_dtype and refuses any
  /// other value with INVALID_ARGUMENT ("bf16" with cuda_dtype bf16 is
  /// accepted).
  std::string kv_cache_dtype = "auto";
  /// Size the KV pool from the device instead of kv_cache.pool_bytes (the
  /// services' --kv_budget_bytes 0, their default): on CUDA from
  /// gpu_memory_utilization (KvPoolBytesFromUtilization, with the workspace
  /// reserve of max_num_batched_tokens rows), on CPU
  /// kDefaultCpuKvBudgetBytes.
  bool kv_pool_from_device = false;
  /// vLLM's --gpu_memory_utilization: the fraction of the GPU's memory this
  /// instance may hold (weights, workspace and KV pool), in (0, 1].
  double gpu_memory_utilization = 0.9;
  /// Rows of the service's largest forward (its scheduler's
  /// --max_num_batched_tokens); 0: DefaultMaxNumBatchedTokens's for the
  /// backend and device. On CUDA it sizes the workspace reserve of
  /// kv_pool_from_device and the warm-up's prefill chunk.
  int max_num_batched_tokens = 0;
  /// CUDA: replay decode / verify steps from CUDA graphs
  /// (CudaModelRunner::set_cuda_graphs). Ignored on CPU.
  bool cuda_graphs = true;
  /// CUDA prefill attention for long chunks: "auto" (with warm_up, the
  /// fastest kernel that agrees, timed at creation by CudaModelRunner::
  /// TunePrefillAttention on a kPrefillTuningChunkRows-row chunk at
  /// kPrefillTuningContextTokens tokens, prefill_tuning.h; without, the WMMA
  /// FlashAttention), "flash" (the WMMA FlashAttention, untimed), "mma"
  /// (FlashMmaAttention, CudaModelRunner::AttentionPath::kFlashMma) or
  /// "cudnn" (cuDNN's fused SDPA, AttentionPath::kCudnn). Anything else is
  /// INVALID_ARGUMENT; ignored on CPU.
  std::string prefill_attention = "auto";
  /// CUDA projections of steps of at most cuda_kernels::kSkinnyMaxRows rows
  /// (decode, verify, look-ahead): "auto" (with warm_up, on a GPU, each
  /// projection and row count on SkinnyLinear where it beats cuBLAS,
  /// timed at creation by CudaModelRunner::TuneSkinnyLinear and logged;
  /// else cuBLAS), "cublas" or "skinny" (every one on SkinnyLinear where it
  /// takes the shape). Anything else is INVALID_ARGUMENT; ignored on CPU.
  std::string decode_gemm = "auto";
  /// CUDA: CudaModelRunner::WarmUp at creation (a max_num_batched_tokens-row
  /// prefill chunk, then every graph bucket captured), so the first
  /// requests do not pay for lazy loading and captures; with
  /// prefill_attention "auto" the prefill kernels are timed first.
  /// Ignored on CPU.
  bool warm_up = true;
};

/// The CPU pool when RunnerOptions::kv_pool_from_device is set (2 GiB).
inline constexpr size_t kDefaultCpuKvBudgetBytes = size_t{2} << 30;
/// Device memory from which CudaDefaultMaxNumBatchedTokens takes a larger
/// token budget: 70 GiB (H100, H200) and 160 GiB (B200, B300).
inline constexpr size_t kLargeGpuBytes = size_t{70} << 30;
inline constexpr size_t kLargerGpuBytes = size_t{160} << 30;

/// vLLM V1's default token budget for its OpenAI API server on a CUDA GPU
/// (EngineArgs' defaults, 2025-2026): 16384 rows on devices of at least
/// kLargerGpuBytes, 8192 on devices of at least kLargeGpuBytes except
/// A100s (where vLLM measured 8192 slower and went back), 2048 on smaller
/// ones. `total_bytes`: the device's memory (cudaMemGetInfo's total);
/// `device_name`: its name, or a description that starts with it
/// (CudaDeviceDescription). Larger budgets take long prompts in fewer,
/// larger chunks (a 32K prompt in 4 forwards instead of 16) at the cost of
/// longer steps for the streams decoding beside them.
int CudaDefaultMaxNumBatchedTokens(size_t total_bytes,
                                   absl::string_view device_name);

/// Builds the ModelRunner `options.device` names over `weights` (uploaded
/// to the GPU for cuda; the host copy can be dropped afterwards). Logs the
/// KV pool (tokens, blocks, bytes, where its size came from) to stderr.
/// Errors: INVALID_ARGUMENT naming a bad device / dtype / cache option;
/// FAILED_PRECONDITION for cuda without a GPU; the backends' errors
/// (RESOURCE_EXHAUSTED when the weights or the KV pool do not fit, or when
/// gpu_memory_utilization leaves no room for the pool); INVALID_ARGUMENT
/// for gpu_memory_utilization outside (0, 1].
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(
    std::shared_ptr<const ModelWeights> weights, const RunnerOptions& options);

/// As above, handing the runner `weights` itself: the CPU backend frees
/// each f32 Linear weight as it packs it, so loading does not hold two
/// copies at once (what the services and tools call).
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(
    ModelWeights&& weights, const RunnerOptions& options);

/// Loads `model_dir` and builds its runner: on CPU each layer is packed
/// into the weight dtype as soon as it is read (CpuModelRunner::Load), so
/// loading never holds the whole model in f32; on CUDA, LoadModelWeights
/// then the overload above. Errors: the loader's and the backends'.
absl::StatusOr<std::unique_ptr<ModelRunner>> LoadModelRunner(
    const std::string& model_dir, const RunnerOptions& options);

/// The rows one batched forward should take when the user gave none
/// (`requested` <= 0): on CUDA vLLM's default for the current device
/// (CudaDefaultMaxNumBatchedTokens; 2048 when its memory cannot be read),
/// on CPU 512, where a 2048-row prompt chunk stalls every decoding stream
/// for seconds. `requested` > 0 is returned as is.
int DefaultMaxNumBatchedTokens(const ModelRunner& runner, int requested);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_MODEL_RUNNER_FACTORY_H_
