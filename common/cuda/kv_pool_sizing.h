#ifndef SPECSERVE_COMMON_CUDA_KV_POOL_SIZING_H_
#define SPECSERVE_COMMON_CUDA_KV_POOL_SIZING_H_

// Sizing the CUDA KV pool from device memory, with vLLM's meaning of
// --gpu_memory_utilization: the fraction of the device's total memory this
// instance may hold (weights, forward workspace and KV cache together); the
// KV pool gets what is left. Plain C++ (no CUDA headers): tested on the CPU;
// the factory (common/engine/model_runner_factory.cc) feeds it
// cudaMemGetInfo's numbers.

#include <cstddef>

#include "absl/status/statusor.h"
#include "common/model/config.h"

namespace specserve {

/// What the pool sizing needs to know, all in bytes.
struct GpuMemoryBudget {
  /// Device memory in all (cudaMemGetInfo's total).
  size_t total_bytes = 0;
  /// Free device memory before this instance loaded its weights: other
  /// processes on the GPU (a second service) hold the rest.
  size_t free_before_bytes = 0;
  /// Memory this instance holds already (the weights).
  size_t instance_bytes = 0;
  /// Memory it will still take besides the pool (forward workspace,
  /// cuBLAS): ForwardWorkspaceReserveBytes.
  size_t reserve_bytes = 0;
  /// The fraction of total_bytes this instance may hold, in (0, 1].
  double utilization = 0.9;
};

/// Pool bytes = floor(utilization x total) - instance - reserve.
/// Errors: INVALID_ARGUMENT unless 0 < utilization <= 1 or when
/// total_bytes is 0; RESOURCE_EXHAUSTED when floor(utilization x total)
/// exceeds free_before_bytes (other processes hold that memory, as vLLM
/// refuses to start; lower --gpu_memory_utilization or set
/// --kv_budget_bytes) or when weights and reserve leave nothing for the
/// pool.
absl::StatusOr<size_t> KvPoolBytesFromUtilization(const GpuMemoryBudget& m);

/// Upper bound of the device memory CudaModelRunner's forward takes besides
/// the KV pool and the weights, for batches of up to `rows` token rows
/// (every row a logits row, the worst case) with `dtype_bytes`-byte
/// activations: the workspace regions of CudaModelRunner::Forward (residual
/// stream, projections, attention, MLP, fp32 logits) plus 256 MiB for
/// cuBLAS's workspace, the split-K partials and alignment.
size_t ForwardWorkspaceReserveBytes(const ModelConfig& config, int rows,
                                    size_t dtype_bytes);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_KV_POOL_SIZING_H_
