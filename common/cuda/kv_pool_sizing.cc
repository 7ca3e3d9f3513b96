#include "common/cuda/kv_pool_sizing.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace specserve {

absl::StatusOr<size_t> KvPoolBytesFromUtilization(const GpuMemoryBudget& m) {
  if (!(m.utilization > 0.0 && m.utilization <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu_memory_utilization must be in (0, 1], got ", m.utilization));
  }
  if (m.total_bytes == 0) {
    return absl::InvalidArgumentError("GPU reports 0 bytes of memory");
  }
  const size_t budget = static_cast<size_t>(
      std::floor(m.utilization * static_cast<double>(m.total_bytes)));
  if (budget > m.free_before_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "gpu_memory_utilization ", m.utilization, " asks for ", budget,
        " bytes of the GPU's ", m.total_bytes, " but only ",
        m.free_before_bytes,
        " were free at start (another process holds the rest): lower "
        "--gpu_memory_utilization or set --kv_budget_bytes"));
  }
  const size_t used = m.instance_bytes + m.reserve_bytes;
  if (used >= budget) {
    return absl::ResourceExhaustedError(
        absl::StrCat("gpu_memory_utilization ", m.utilization, " allows ",
                     budget, " bytes; weights (", m.instance_bytes,
                     ") and workspace (", m.reserve_bytes,
                     ") leave nothing for the KV cache: raise "
                     "--gpu_memory_utilization or set --kv_budget_bytes"));
  }
  return budget - used;
}

size_t ForwardWorkspaceReserveBytes(const ModelConfig& config, int rows,
                                    size_t dtype_bytes) {
  const size_t n = static_cast<size_t>(std::max(rows, 1));
  const size_t hidden = std::max(config.hidden_size, 0);
  const size_t qrow =
      static_cast<size_t>(std::max(config.num_attention_heads, 0)) *
      std::max(config.head_dim, 0);
  const size_t qkv = std::max(config.qkv_dim(), 0);
  const size_t ffn = std::max(config.intermediate_size, 0);
  const size_t vocab = std::max(config.vocab_size, 0);
  const size_t per_row = 4 * hidden                // fp32 residual
                         + dtype_bytes * hidden    // normed input
                         + 4 * qkv                 // fused projection
                         + 2 * dtype_bytes * qrow  // q, attention out
                         + 3 * dtype_bytes * ffn   // gate/up, activation
                         + 4 * vocab               // fp32 logits
                         + 64;                     // ids, slots, tables
  return n * per_row + (size_t{256} << 20);
}

}  // namespace specserve
