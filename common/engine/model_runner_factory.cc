#include "common/engine/model_runner_factory.h"

#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cuda/cuda_model_runner.h"
#include "common/cuda/cuda_weights.h"
#include "common/cuda/device.h"
#include "common/cuda/kv_pool_sizing.h"
#include "common/cuda/linear.h"
#include "common/cuda/prefill_tuning.h"

namespace specserve {
namespace {

absl::StatusOr<CudaDType> ParseCudaDType(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return CudaDType::kBF16;
  if (s == "fp16" || s == "float16") return CudaDType::kFP16;
  return absl::InvalidArgumentError(
      absl::StrCat("cuda_dtype must be bf16 or fp16, got \"", s, "\""));
}

// One line on stderr: the pool in tokens, as the services' start log.
void LogPool(ModelRunner& runner, const std::string& source) {
  const PagedKvCache& kv = runner.kv_cache();
  const auto* cpu = dynamic_cast<const CpuModelRunner*>(&runner);
  const std::string dtype =
      cpu == nullptr ? "" : ", " + KvCacheDTypeName(cpu->kv_cache_dtype());
  std::fprintf(stderr,
               "kv cache: %lld tokens (%d blocks of %d tokens, %zu bytes%s) "
               "on %s, sized by %s\n",
               static_cast<long long>(kv.num_blocks()) * kv.block_size(),
               kv.num_blocks(), kv.block_size(), kv.bytes_capacity(),
               dtype.c_str(), runner.backend().c_str(), source.c_str());
}

// Where the pool size comes from, for the log line.
std::string PoolSource(const KvCacheOptions& kv) {
  return kv.pool_bytes > 0 ? "--kv_budget_bytes" : "max context";
}

// The CPU pool: kv_cache.pool_bytes, or 2 GiB when sized "from the device",
// in `dtype` (nullopt: kv_cache.dtype).
KvCacheOptions CpuPool(const RunnerOptions& options,
                       std::optional<KvCacheDType> dtype, std::string* source) {
  KvCacheOptions kv = options.kv_cache;
  if (dtype.has_value()) kv.dtype = *dtype;
  *source = PoolSource(kv);
  if (options.kv_pool_from_device) {
    kv.pool_bytes = kDefaultCpuKvBudgetBytes;
    *source = "the CPU default (2 GiB)";
  }
  return kv;
}

// `requested` if > 0, else vLLM's default for the current device
// (CudaDefaultMaxNumBatchedTokens; 2048 when its memory cannot be read).
int CudaMaxNumBatchedTokens(int requested) {
  if (requested > 0) return requested;
  const absl::StatusOr<CudaMemory> memory = QueryCudaMemory();
  if (!memory.ok()) return 2048;
  return CudaDefaultMaxNumBatchedTokens(memory->total_bytes,
                                        CudaDeviceDescription());
}

// Puts a model on the device as `dtype`: CudaWeights::Upload or Load.
using CudaWeightsSource =
    std::function<absl::StatusOr<std::shared_ptr<const CudaWeights>>(
        CudaDType)>;

// The CUDA path of CreateModelRunner: puts the weights on the device
// through `source`, sizes the pool from the memory left when
// kv_pool_from_device.
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaRunner(
    const CudaWeightsSource& source_weights, const RunnerOptions& options) {
  absl::StatusOr<CudaDType> dt = ParseCudaDType(options.cuda_dtype);
  if (!dt.ok()) return dt.status();
  KvCacheOptions kv = options.kv_cache;
  std::string source = PoolSource(kv);
  absl::StatusOr<CudaMemory> before;
  if (options.kv_pool_from_device) {
    before = QueryCudaMemory();
    if (!before.ok()) return before.status();
  }
  // The service's forward budget, as its scheduler resolves it
  // (DefaultMaxNumBatchedTokens).
  const int max_rows = CudaMaxNumBatchedTokens(options.max_num_batched_tokens);
  absl::StatusOr<std::shared_ptr<const CudaWeights>> gw = source_weights(*dt);
  if (!gw.ok()) return gw.status();
  if (options.kv_pool_from_device) {
    GpuMemoryBudget m;
    m.total_bytes = before->total_bytes;
    m.free_before_bytes = before->free_bytes;
    m.instance_bytes = (*gw)->bytes();
    m.reserve_bytes = ForwardWorkspaceReserveBytes((*gw)->config(), max_rows,
                                                   CudaDTypeBytes(*dt));
    if (options.cuda_graphs) {
      // The graphs' workspace, for GPUs of up to 256 multiprocessors.
      m.reserve_bytes += CudaModelRunner::GraphWorkspaceBytes(
          (*gw)->config(), *dt, kv.block_size, 256);
    }
    m.utilization = options.gpu_memory_utilization;
    absl::StatusOr<size_t> pool = KvPoolBytesFromUtilization(m);
    if (!pool.ok()) return pool.status();
    kv.pool_bytes = *pool;
    source = absl::StrCat("--gpu_memory_utilization ",
                          options.gpu_memory_utilization);
  }
  absl::StatusOr<std::unique_ptr<CudaModelRunner>> r =
      CudaModelRunner::Create(*std::move(gw), kv);
  if (!r.ok()) return r.status();
  (*r)->set_cuda_graphs(options.cuda_graphs);
  if (options.prefill_attention == "mma") {
    (*r)->set_attention_path(CudaModelRunner::AttentionPath::kFlashMma);
  } else if (options.prefill_attention == "cudnn") {
    (*r)->set_attention_path(CudaModelRunner::AttentionPath::kCudnn);
  }
  LogPool(**r, source);
  // Before WarmUp, whose graphs capture the kept kernels. "auto" times
  // them, so only with a warm-up and on a real device (the emulated one
  // would time the host); a failure keeps cuBLAS: the service still starts.
  if (options.decode_gemm != "auto" ||
      (options.warm_up && !CudaDeviceEmulated())) {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::string> chosen =
        (*r)->ChooseDecodeGemm(options.decode_gemm);
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    if (chosen.ok()) {
      std::fprintf(stderr, "%s in %.2f s\n", chosen->c_str(), s);
    } else {
      std::fprintf(stderr,
                   "decode GEMMs: cuBLAS (not tuned after %.2f s: %s)\n", s,
                   chosen.status().ToString().c_str());
    }
  }
  if (options.warm_up && options.prefill_attention == "auto") {
    // Before WarmUp, so its prefill loads the kept kernel. A failure keeps
    // FlashAttention: the service still starts.
    const absl::Time start = absl::Now();
    absl::StatusOr<PrefillTuning> tuned = (*r)->TunePrefillAttention(
        kPrefillTuningContextTokens, kPrefillTuningChunkRows);
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    if (tuned.ok()) {
      std::fprintf(stderr, "%s in %.2f s\n",
                   DescribePrefillTuning(*tuned).c_str(), s);
    } else {
      std::fprintf(stderr,
                   "prefill attention: flash (not tuned after %.2f s: %s)\n",
                   s, tuned.status().ToString().c_str());
    }
  }
  if (options.warm_up) {
    // A failed warm-up (a pool too small for it, say) does not stop the
    // service: requests then pay the first-use costs themselves.
    const absl::Time start = absl::Now();
    const absl::Status warm = (*r)->WarmUp(max_rows);
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    if (warm.ok()) {
      std::fprintf(stderr,
                   "warm-up: %d-row prefill and %d cuda graphs in %.2f s\n",
                   max_rows, (*r)->graphs_captured(), s);
    } else {
      std::fprintf(stderr, "warning: warm-up failed after %.2f s: %s\n", s,
                   warm.ToString().c_str());
    }
  }
  return std::unique_ptr<ModelRunner>(*std::move(r));
}

// The device and, for cpu, the weight and KV cache dtypes `options` ask
// for.
absl::StatusOr<DeviceKind> ResolveDevice(
    const RunnerOptions& options, std::optional<WeightDType>* weight_dtype,
    std::optional<KvCacheDType>* kv_dtype) {
  if (!(options.gpu_memory_utilization > 0.0 &&
        options.gpu_memory_utilization <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_memory_utilization must be in (0, 1], got ",
                     options.gpu_memory_utilization));
  }
  if (options.prefill_attention != "auto" &&
      options.prefill_attention != "flash" &&
      options.prefill_attention != "mma" &&
      options.prefill_attention != "cudnn") {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill_attention must be auto, flash, mma or cudnn, got \"",
        options.prefill_attention, "\""));
  }
  if (absl::Status s = ValidateDecodeGemm(options.decode_gemm); !s.ok()) {
    return s;
  }
  absl::StatusOr<DeviceKind> kind =
      ParseDevice(options.device, CudaAvailable());
  if (!kind.ok()) return kind.status();
  absl::StatusOr<std::optional<WeightDType>> wt =
      ParseWeightDType(options.weight_dtype);
  if (!wt.ok()) return wt.status();
  if (*kind != DeviceKind::kCpu && wt->has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight_dtype \"", options.weight_dtype,
        "\" is for the CPU engine; on cuda use cuda_dtype"));
  }
  absl::StatusOr<std::optional<KvCacheDType>> kt =
      ParseKvCacheDType(options.kv_cache_dtype);
  if (!kt.ok()) return kt.status();
  if (*kind != DeviceKind::kCpu && kt->has_value()) {
    // The CUDA cache is in the compute dtype: only a matching request.
    absl::StatusOr<CudaDType> dt = ParseCudaDType(options.cuda_dtype);
    if (!dt.ok()) return dt.status();
    if (!(**kt == KvCacheDType::kBF16 && *dt == CudaDType::kBF16)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_cache_dtype \"", options.kv_cache_dtype,
          "\": the CUDA KV cache is stored in cuda_dtype (",
          options.cuda_dtype, "); use auto"));
    }
  }
  *weight_dtype = *wt;
  *kv_dtype = *kt;
  return kind;
}

}  // namespace

int CudaDefaultMaxNumBatchedTokens(size_t total_bytes,
                                   absl::string_view device_name) {
  if (total_bytes >= kLargerGpuBytes) return 16384;
  if (total_bytes >= kLargeGpuBytes &&
      !absl::StrContains(absl::AsciiStrToLower(device_name), "a100")) {
    return 8192;
  }
  return 2048;
}

int DefaultMaxNumBatchedTokens(const ModelRunner& runner, int requested) {
  if (runner.backend() != "cuda") return requested > 0 ? requested : 512;
  return CudaMaxNumBatchedTokens(requested);
}

namespace {

// The shared shape of the three entry points: resolve the device, then
// build the CPU runner with `make_cpu(kv, weight_dtype)` (its pool logged)
// or the CUDA runner with `make_cuda()`.
template <typename MakeCpu, typename MakeCuda>
absl::StatusOr<std::unique_ptr<ModelRunner>> Build(const RunnerOptions& options,
                                                  MakeCpu make_cpu,
                                                  MakeCuda make_cuda) {
  std::optional<WeightDType> wt;
  std::optional<KvCacheDType> kt;
  absl::StatusOr<DeviceKind> kind = ResolveDevice(options, &wt, &kt);
  if (!kind.ok()) return kind.status();
  if (*kind != DeviceKind::kCpu) return make_cuda();
  std::string source;
  const KvCacheOptions kv = CpuPool(options, kt, &source);
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> r = make_cpu(kv, wt);
  if (!r.ok()) return r.status();
  LogPool(**r, source);
  return std::unique_ptr<ModelRunner>(*std::move(r));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(
    std::shared_ptr<const ModelWeights> weights, const RunnerOptions& options) {
  if (weights == nullptr) {
    return absl::InvalidArgumentError("CreateModelRunner: weights is null");
  }
  return Build(
      options,
      [&](const KvCacheOptions& kv, std::optional<WeightDType> wt) {
        return CpuModelRunner::Create(std::move(weights), kv, wt);
      },
      [&] {
        return CreateCudaRunner(
            [&](CudaDType dt) { return CudaWeights::Upload(*weights, dt); },
            options);
      });
}

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(
    ModelWeights&& weights, const RunnerOptions& options) {
  return Build(
      options,
      [&](const KvCacheOptions& kv, std::optional<WeightDType> wt) {
        return CpuModelRunner::Create(std::move(weights), kv, wt);
      },
      [&] {
        return CreateCudaRunner(
            [&](CudaDType dt) { return CudaWeights::Upload(weights, dt); },
            options);
      });
}

absl::StatusOr<std::unique_ptr<ModelRunner>> LoadModelRunner(
    const std::string& model_dir, const RunnerOptions& options) {
  return Build(
      options,
      [&](const KvCacheOptions& kv, std::optional<WeightDType> wt) {
        return CpuModelRunner::Load(model_dir, kv, wt);
      },
      [&] {
        // Straight from the file to the device: no fp32 copy of the model
        // on the host (32 GB for an 8B).
        return CreateCudaRunner(
            [&](CudaDType dt) { return CudaWeights::Load(model_dir, dt); },
            options);
      });
}

}  // namespace specserve
