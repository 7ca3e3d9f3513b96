#include "common/service/runner_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, device, "auto",
          "engine backend: cpu, cuda, or auto (cuda when a GPU is present)");
ABSL_FLAG(int, kv_block_size, 16, "tokens per paged KV cache block");
ABSL_FLAG(std::string, cuda_dtype, "bf16",
          "weights and KV cache type on the GPU: bf16 or fp16");

namespace specserve {

RunnerOptions RunnerOptionsFromFlags() {
  RunnerOptions o;
  o.device = absl::GetFlag(FLAGS_device);
  o.kv_cache.block_size = absl::GetFlag(FLAGS_kv_block_size);
  o.cuda_dtype = absl::GetFlag(FLAGS_cuda_dtype);
  return o;
}

}  // namespace specserve
