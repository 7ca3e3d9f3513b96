#ifndef SPECSERVE_COMMON_SERVICE_RUNNER_FLAGS_H_
#define SPECSERVE_COMMON_SERVICE_RUNNER_FLAGS_H_

#include "common/engine/model_runner_factory.h"

namespace specserve {

/// The engine flags both model services take:
///   --device cpu|cuda|auto  (auto: cuda when a GPU is present)
///   --kv_block_size N       (tokens per KV cache block, default 16)
///   --enable_prefix_caching (automatic prefix caching, default on)
///   --cuda_dtype bf16|fp16  (weights and KV cache on the GPU)
///   --weight_dtype auto|f32|bf16|int8  (CPU engine weights)
///   --kv_cache_dtype auto|f32|bf16  (KV cache; auto = f32 on CPU, the
///                                    --cuda_dtype on CUDA)
///   --gpu_memory_utilization F  (default 0.9, vLLM's meaning)
///   --cuda_graphs           (CUDA graphs for decode / verify steps,
///                            default on; CudaModelRunner::set_cuda_graphs)
///   --prefill_attention auto|mma|cudnn  (CUDA attention of long prefill
///                            chunks)
///   --decode_gemm auto|cublas|skinny  (CUDA projections of steps of at
///                            most 8 rows)
///   --warm_up               (CUDA: prefill chunk and graph captures at
///                            start-up, default on; CudaModelRunner::WarmUp)
/// The pool size comes from each service's --kv_budget_bytes; at 0 (the
/// services set RunnerOptions::kv_pool_from_device) from
/// --gpu_memory_utilization on CUDA, 2 GiB on CPU.
RunnerOptions RunnerOptionsFromFlags();

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_RUNNER_FLAGS_H_
