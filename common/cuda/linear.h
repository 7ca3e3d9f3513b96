#ifndef SPECSERVE_COMMON_CUDA_LINEAR_H_
#define SPECSERVE_COMMON_CUDA_LINEAR_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/cuda/kernels.h"
#include "common/model/config.h"

namespace specserve {

class CudaWeights;

/// A projection through cuBLAS (cublasGemmEx, fp32 accumulation
/// CUBLAS_COMPUTE_32F, tensor cores for 16-bit operands):
///   y[n, out] = x[n, in] W^T + beta * y
/// with W row-major [out, in] (PyTorch Linear layout), all on the device.
/// `x` and `w` are `dtype` (kBF16, kFP16 or kF32); `y` is `y_dtype` (kF32,
/// or the same as `dtype`). beta = 1 with an fp32 `y` is the residual add
/// of the Llama block (the residual stream stays fp32). Runs on the stream
/// bound to `handle` (cublasSetStream).
/// Errors: INVALID_ARGUMENT for non-positive sizes or an unsupported dtype
/// pair; INTERNAL / RESOURCE_EXHAUSTED from cuBLAS.
absl::Status CublasLinear(cublasHandle_t handle, CudaDType dtype,
                          const void* x, int n, int in, const void* w, int out,
                          void* y, CudaDType y_dtype, float beta);

/// The projections of a Llama forward, in a layer's order, then the
/// vocabulary projection.
enum class Projection { kQkv, kO, kGateUp, kDown, kLmHead };
inline constexpr int kNumProjections = 5;
/// "qkv", "o", "gate_up", "down", "lm_head".
const char* ProjectionName(Projection p);

/// A projection as the forward runs it (CudaModelRunner's EnqueueForward):
/// y[n, out] = x[n, in] W^T + beta y, y in y_dtype.
struct ProjectionShape {
  Projection projection;
  int in, out;
  CudaDType y_dtype;  ///< fp32, but gate_up's in the model dtype
  float beta;         ///< 1 for o and down: the residual add
};
/// The five, in Projection's order, for `config` with weights in `dtype`.
std::vector<ProjectionShape> ForwardProjections(const ModelConfig& config,
                                                CudaDType dtype);
/// Layer `layer`'s weight of `p` (lm_head: the same for every layer).
const void* ProjectionWeight(const CudaWeights& weights, Projection p,
                             int layer);

/// Which kernel runs each projection of a step of few rows: cuBLAS, or
/// cuda_kernels::SkinnyLinear (skinny_linear.h) for the (projection, rows)
/// pairs chosen, rows <= kSkinnyMaxRows. All cuBLAS until told otherwise.
class LinearDispatch {
 public:
  /// Whether `p` at `rows` rows goes to SkinnyLinear.
  bool skinny(Projection p, int rows) const;
  void set_skinny(Projection p, int rows, bool skinny);
  /// Every projection at every rows <= kSkinnyMaxRows (tests).
  void UseSkinnyEverywhere();

  /// y[n, out] = x[n, in] W^T + beta * y as CublasLinear (same arguments,
  /// on the stream bound to `handle`, which must be `stream`), through
  /// SkinnyLinear where chosen and SkinnyLinearSupported, else cuBLAS.
  /// Errors as CublasLinear; INTERNAL for a failed SkinnyLinear launch.
  absl::Status Run(Projection p, cublasHandle_t handle, cudaStream_t stream,
                   CudaDType dtype, const void* x, int n, int in,
                   const void* w, int out, void* y, CudaDType y_dtype,
                   float beta);
  /// SkinnyLinear launches Run has made (a graph's replays not counted).
  int64_t skinny_launches() const { return skinny_launches_; }

 private:
  std::array<uint16_t, kNumProjections> masks_{};  // bit r - 1: rows r
  int64_t skinny_launches_ = 0;
};

/// Fills `elems` values of `dtype` at `dst` with standard normals: one
/// block of at most 16M values drawn on the host (`seed`), repeated.
/// Operands for timing GEMMs: on constant or zero operands tensor cores
/// likely draw less power and hold higher clocks, so such timings flatter
/// the model's GEMMs. Synchronises `stream`. Errors: CUDA errors,
/// RESOURCE_EXHAUSTED for its fp32 staging buffer.
absl::Status FillNormal(void* dst, CudaDType dtype, size_t elems,
                        uint32_t seed, cudaStream_t stream);

/// One (projection, rows) trial of TuneSkinnyLinear: seconds for the
/// projection over every layer's weights (lm_head: num_layers times the
/// one matrix), the better of two rounds each. Where SkinnyLinear does not
/// take the shape nothing is timed: cublas_seconds 0, skinny_seconds
/// infinite.
struct SkinnyLinearTrial {
  Projection projection = Projection::kQkv;
  int rows = 0;
  double cublas_seconds = 0;
  double skinny_seconds = 0;
  /// max |skinny - cuBLAS| / max |cuBLAS| over layer 0's outputs
  /// (prefill_tuning.h's MaxRelDiff: +inf on a NaN).
  double max_rel_diff = 0;
  bool skinny = false;  ///< the choice
};

/// The fraction of cuBLAS's time SkinnyLinear must save to be kept.
inline constexpr double kSkinnyMargin = 0.03;

/// Chooses, by timing on this GPU, which few-row projections SkinnyLinear
/// runs (as TunePrefillAttention chooses the prefill kernel): for every
/// projection and rows 1..max_rows (<= kSkinnyMaxRows), random activations
/// through each layer's weights with the forward's output dtype and beta,
/// cuBLAS and SkinnyLinear alternately, two rounds. SkinnyLinear is kept
/// where it agrees with cuBLAS (max_rel_diff <= 1e-2) and takes at most
/// (1 - kSkinnyMargin) of cuBLAS's time: the library wins near ties.
/// Writes the choices into *dispatch (the others cuBLAS). Synchronises
/// `stream`; allocates its scratch and frees it before returning.
/// Errors: INVALID_ARGUMENT for max_rows outside [1, kSkinnyMaxRows];
/// CUDA / cuBLAS errors.
absl::StatusOr<std::vector<SkinnyLinearTrial>> TuneSkinnyLinear(
    const CudaWeights& weights, cublasHandle_t handle, cudaStream_t stream,
    int max_rows, LinearDispatch* dispatch);

/// OK for a --decode_gemm mode: "auto", "cublas" or "skinny"; else
/// INVALID_ARGUMENT naming the value.
absl::Status ValidateDecodeGemm(absl::string_view mode);

/// One log line: "decode GEMMs: skinny for qkv at 1-4, o at 1-2,4; cuBLAS
/// else (1 row, ms a forward, cuBLAS / skinny: qkv 0.410 / 0.330, ...)",
/// or "decode GEMMs: cuBLAS for every projection (...)".
std::string DescribeSkinnyTuning(absl::Span<const SkinnyLinearTrial> trials);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_LINEAR_H_
