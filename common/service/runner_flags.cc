#include "common/service/runner_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, device, "auto",
          "engine backend: cpu, cuda, or auto (cuda when a GPU is present)");
ABSL_FLAG(int, kv_block_size, 16, "tokens per paged KV cache block");
ABSL_FLAG(bool, enable_prefix_caching, true,
          "automatic prefix caching: requests whose prompts (kept tokens at "
          "their positions) start with KV blocks computed before reuse them");
ABSL_FLAG(std::string, cuda_dtype, "bf16",
          "weights and KV cache type on the GPU: bf16 or fp16");
ABSL_FLAG(std::string, weight_dtype, "auto",
          "CPU engine weights: auto (the checkpoint's: bf16 stays bf16, else "
          "f32), f32, bf16, or int8 (8-bit blocks of 32 with f16 scales, "
          "quantized at load)");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "KV cache element type: auto (f32 on CPU, --cuda_dtype on CUDA), "
          "f32, or bf16 (CPU: half the bytes per token, so --kv_budget_bytes "
          "holds twice the tokens; K/V rounded to nearest even when stored). "
          "CUDA refuses anything but its own --cuda_dtype");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "fraction of the GPU's memory this service may hold (weights, "
          "workspace and KV cache), vLLM's meaning: the KV pool gets the "
          "rest; used when --kv_budget_bytes is 0 (the default). Two "
          "services on one GPU need fractions that sum to < 1");
ABSL_FLAG(bool, cuda_graphs, true,
          "CUDA: replay decode / verify steps (greedy or sampled; "
          "Speculative Prefill's look-ahead steps too) of up to 128 rows "
          "from CUDA graphs captured per batch-size bucket (1, 2, 4, 8, "
          "then multiples of 8); --nocuda_graphs runs every step eagerly "
          "(to debug)");
ABSL_FLAG(bool, warm_up, true,
          "CUDA: at start-up, before listening, run one prefill chunk of "
          "--max_num_batched_tokens rows and capture every CUDA graph "
          "bucket (vLLM's start-up capture), so the first requests do not "
          "pay for them");
ABSL_FLAG(std::string, prefill_attention, "auto",
          "CUDA attention of long prefill chunks: auto (with --warm_up, the "
          "fastest of flash, mma and cudnn whose logits agree with flash's, "
          "timed at start-up on a 2048-row chunk at 8192 tokens and logged; "
          "without, flash), flash (the WMMA FlashAttention kernel), mma "
          "(FlashMmaAttention: mma.sync, FlashAttention-2 style) or cudnn "
          "(cuDNN 9's fused SDPA, FlashAttention where libcudnn or a plan "
          "is missing)");

ABSL_FLAG(std::string, decode_gemm, "auto",
          "CUDA projections of steps of at most 8 rows (decode, verify, "
          "look-ahead): auto (with --warm_up, per projection and row count "
          "the faster of cuBLAS and our SkinnyLinear kernel, timed at "
          "start-up and logged; without, cublas), cublas or skinny");

namespace specserve {

RunnerOptions RunnerOptionsFromFlags() {
  RunnerOptions o;
  o.device = absl::GetFlag(FLAGS_device);
  o.kv_cache.block_size = absl::GetFlag(FLAGS_kv_block_size);
  o.kv_cache.prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);
  o.cuda_dtype = absl::GetFlag(FLAGS_cuda_dtype);
  o.weight_dtype = absl::GetFlag(FLAGS_weight_dtype);
  o.kv_cache_dtype = absl::GetFlag(FLAGS_kv_cache_dtype);
  o.gpu_memory_utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
  o.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  o.warm_up = absl::GetFlag(FLAGS_warm_up);
  o.prefill_attention = absl::GetFlag(FLAGS_prefill_attention);
  o.decode_gemm = absl::GetFlag(FLAGS_decode_gemm);
  return o;
}

}  // namespace specserve
