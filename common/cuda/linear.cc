#include "common/cuda/linear.h"

#include <cublas_v2.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda/cuda_status.h"
#include "common/cuda/cuda_weights.h"
#include "common/cuda/device_buffer.h"
#include "common/cuda/prefill_tuning.h"
#include "common/cuda/skinny_linear.h"

namespace specserve {
namespace {

cudaDataType_t ToCudaType(CudaDType dtype) {
  switch (dtype) {
    case CudaDType::kF32:
      return CUDA_R_32F;
    case CudaDType::kBF16:
      return CUDA_R_16BF;
    case CudaDType::kFP16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

}  // namespace

absl::Status CublasLinear(cublasHandle_t handle, CudaDType dtype,
                          const void* x, int n, int in, const void* w, int out,
                          void* y, CudaDType y_dtype, float beta) {
  if (n <= 0 || in <= 0 || out <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CublasLinear: sizes must be positive, got n=", n, " in=", in,
        " out=", out));
  }
  if (y_dtype != CudaDType::kF32 && y_dtype != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("CublasLinear: output dtype ", CudaDTypeName(y_dtype),
                     " with ", CudaDTypeName(dtype), " operands"));
  }
  const float alpha = 1.0f;
  // Column-major view: Y^T [out, n] = W [out, in] (stored as W^T
  // column-major, so op T) x X^T [in, n] (X row-major = X^T column-major).
  SPECSERVE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &alpha, w,
      ToCudaType(dtype), in, x, ToCudaType(dtype), in, &beta, y,
      ToCudaType(y_dtype), out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

const char* ProjectionName(Projection p) {
  switch (p) {
    case Projection::kQkv:
      return "qkv";
    case Projection::kO:
      return "o";
    case Projection::kGateUp:
      return "gate_up";
    case Projection::kDown:
      return "down";
    case Projection::kLmHead:
      return "lm_head";
  }
  return "?";
}

std::vector<ProjectionShape> ForwardProjections(const ModelConfig& c,
                                                CudaDType dtype) {
  return {
      {Projection::kQkv, c.hidden_size, c.qkv_dim(), CudaDType::kF32, 0.0f},
      {Projection::kO, c.num_attention_heads * c.head_dim, c.hidden_size,
       CudaDType::kF32, 1.0f},
      {Projection::kGateUp, c.hidden_size, 2 * c.intermediate_size, dtype,
       0.0f},
      {Projection::kDown, c.intermediate_size, c.hidden_size, CudaDType::kF32,
       1.0f},
      {Projection::kLmHead, c.hidden_size, c.vocab_size, CudaDType::kF32,
       0.0f}};
}

const void* ProjectionWeight(const CudaWeights& weights, Projection p,
                             int layer) {
  const CudaLayerWeights& w = weights.layer(layer);
  switch (p) {
    case Projection::kQkv:
      return w.wqkv;
    case Projection::kO:
      return w.wo;
    case Projection::kGateUp:
      return w.w_gate_up;
    case Projection::kDown:
      return w.w_down;
    case Projection::kLmHead:
      return weights.lm_head();
  }
  return nullptr;
}

namespace {

cuda_kernels::SkinnyLinearArgs SkinnyArgs(CudaDType dtype, const void* x,
                                          int n, int in, const void* w,
                                          int out, void* y, CudaDType y_dtype,
                                          float beta) {
  cuda_kernels::SkinnyLinearArgs a;
  a.x = x;
  a.w = w;
  a.y = y;
  a.n = n;
  a.in = in;
  a.out = out;
  a.dtype = dtype;
  a.y_dtype = y_dtype;
  a.beta = beta;
  return a;
}

}  // namespace

absl::Status FillNormal(void* dst, CudaDType dtype, size_t elems,
                        uint32_t seed, cudaStream_t stream) {
  if (elems == 0) return absl::OkStatus();
  const size_t block = std::min<size_t>(elems, size_t{1} << 24);
  const size_t esize = CudaDTypeBytes(dtype);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> host(block);
  for (float& v : host) v = nd(rng);
  absl::StatusOr<DeviceBuffer> staging =
      DeviceBuffer::Allocate(sizeof(float) * block);
  if (!staging.ok()) return staging.status();
  SPECSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(staging->get(), host.data(), sizeof(float) * block,
                      cudaMemcpyHostToDevice, stream));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cuda_kernels::ConvertFromF32(
      staging->as<float>(), dst, dtype, block, stream));
  char* out = static_cast<char*>(dst);
  for (size_t at = block; at < elems; at += block) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        out + at * esize, out, std::min(block, elems - at) * esize,
        cudaMemcpyDeviceToDevice, stream));
  }
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

bool LinearDispatch::skinny(Projection p, int rows) const {
  return rows >= 1 && rows <= cuda_kernels::kSkinnyMaxRows &&
         (masks_[static_cast<int>(p)] >> (rows - 1) & 1) != 0;
}

void LinearDispatch::set_skinny(Projection p, int rows, bool skinny) {
  if (rows < 1 || rows > cuda_kernels::kSkinnyMaxRows) return;
  uint16_t& m = masks_[static_cast<int>(p)];
  const uint16_t bit = static_cast<uint16_t>(1u << (rows - 1));
  m = skinny ? (m | bit) : (m & ~bit);
}

void LinearDispatch::UseSkinnyEverywhere() {
  masks_.fill(static_cast<uint16_t>((1u << cuda_kernels::kSkinnyMaxRows) - 1));
}

absl::Status LinearDispatch::Run(Projection p, cublasHandle_t handle,
                                 cudaStream_t stream, CudaDType dtype,
                                 const void* x, int n, int in, const void* w,
                                 int out, void* y, CudaDType y_dtype,
                                 float beta) {
  if (skinny(p, n)) {
    const cuda_kernels::SkinnyLinearArgs a =
        SkinnyArgs(dtype, x, n, in, w, out, y, y_dtype, beta);
    if (cuda_kernels::SkinnyLinearSupported(a)) {
      ++skinny_launches_;
      return CudaStatus(cuda_kernels::SkinnyLinear(a, stream), "SkinnyLinear");
    }
  }
  return CublasLinear(handle, dtype, x, n, in, w, out, y, y_dtype, beta);
}

namespace {

// Seconds between two events recorded around `run`.
absl::StatusOr<double> TimeOnStream(cudaStream_t stream, cudaEvent_t start,
                                    cudaEvent_t stop,
                                    const std::function<absl::Status()>& run) {
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
  SPECSERVE_RETURN_IF_ERROR(run());
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
  float ms = 0;
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
  return ms * 1e-3;
}

}  // namespace

absl::StatusOr<std::vector<SkinnyLinearTrial>> TuneSkinnyLinear(
    const CudaWeights& weights, cublasHandle_t handle, cudaStream_t stream,
    int max_rows, LinearDispatch* dispatch) {
  if (max_rows < 1 || max_rows > cuda_kernels::kSkinnyMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("TuneSkinnyLinear: max_rows must be in [1, ",
                     cuda_kernels::kSkinnyMaxRows, "], got ", max_rows));
  }
  const ModelConfig& c = weights.config();
  const CudaDType dt = weights.dtype();
  const int L = c.num_hidden_layers;
  const std::vector<ProjectionShape> shapes = ForwardProjections(c, dt);
  size_t max_in = 0, max_out = 0;
  for (const ProjectionShape& s : shapes) {
    max_in = std::max<size_t>(max_in, s.in);
    max_out = std::max<size_t>(max_out, s.out);
  }
  const size_t x_elems = cuda_kernels::kSkinnyMaxRows * max_in;
  const size_t y_elems = cuda_kernels::kSkinnyMaxRows * max_out;
  // One allocation: x (dt), y and the reference (fp32).
  const auto carve = [&](char* base, void** x, float** y, float** ref) {
    DeviceCarver cv(base);
    *x = cv.Take(CudaDTypeBytes(dt) * x_elems);
    *y = static_cast<float*>(cv.Take(sizeof(float) * y_elems));
    *ref = static_cast<float*>(cv.Take(sizeof(float) * y_elems));
    return cv.size();
  };
  void* x = nullptr;
  float *y = nullptr, *ref = nullptr;
  absl::StatusOr<DeviceBuffer> scratch =
      DeviceBuffer::Allocate(carve(nullptr, &x, &y, &ref));
  if (!scratch.ok()) return scratch.status();
  carve(scratch->as<char>(), &x, &y, &ref);
  // Random activations (the residual too: beta = 1 reads y).
  SPECSERVE_RETURN_IF_ERROR(FillNormal(x, dt, x_elems, 11, stream));
  SPECSERVE_RETURN_IF_ERROR(
      FillNormal(y, CudaDType::kF32, y_elems, 12, stream));
  cudaEvent_t start = nullptr, stop = nullptr;
  SPECSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  if (cudaError_t e = cudaEventCreate(&stop); e != cudaSuccess) {
    cudaEventDestroy(start);
    return CudaStatus(e, "cudaEventCreate");
  }
  LinearDispatch cublas_only, skinny_all;
  skinny_all.UseSkinnyEverywhere();
  std::vector<SkinnyLinearTrial> trials;
  absl::Status status = [&]() -> absl::Status {
    for (const ProjectionShape& s : shapes) {
      for (int rows = 1; rows <= max_rows; ++rows) {
        SkinnyLinearTrial t;
        t.projection = s.projection;
        t.rows = rows;
        const void* w0 = ProjectionWeight(weights, s.projection, 0);
        if (!cuda_kernels::SkinnyLinearSupported(SkinnyArgs(
                dt, x, rows, s.in, w0, s.out, y, s.y_dtype, s.beta))) {
          t.skinny_seconds = std::numeric_limits<double>::infinity();
          dispatch->set_skinny(s.projection, rows, false);
          trials.push_back(t);
          continue;
        }
        // Agreement on layer 0, both in fp32 without the residual.
        const size_t count = static_cast<size_t>(rows) * s.out;
        SPECSERVE_RETURN_IF_ERROR(
            cublas_only.Run(s.projection, handle, stream, dt, x, rows, s.in,
                            w0, s.out, ref, CudaDType::kF32, 0.0f));
        SPECSERVE_RETURN_IF_ERROR(
            skinny_all.Run(s.projection, handle, stream, dt, x, rows, s.in, w0,
                           s.out, y, CudaDType::kF32, 0.0f));
        std::vector<float> h_ref(count), h_y(count);
        SPECSERVE_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(h_ref.data(), ref, sizeof(float) * count,
                            cudaMemcpyDeviceToHost, stream));
        SPECSERVE_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(h_y.data(), y, sizeof(float) * count,
                            cudaMemcpyDeviceToHost, stream));
        SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
        t.max_rel_diff = MaxRelDiff(h_ref, h_y);
        // Each projection through every layer, as a forward runs it.
        const auto through_layers = [&](LinearDispatch* d) {
          return [&, d]() -> absl::Status {
            for (int l = 0; l < L; ++l) {
              SPECSERVE_RETURN_IF_ERROR(d->Run(
                  s.projection, handle, stream, dt, x, rows, s.in,
                  ProjectionWeight(weights, s.projection, l), s.out, y,
                  s.y_dtype, s.beta));
            }
            return absl::OkStatus();
          };
        };
        t.cublas_seconds = t.skinny_seconds =
            std::numeric_limits<double>::infinity();
        for (int round = 0; round < 2; ++round) {
          absl::StatusOr<double> tc = TimeOnStream(
              stream, start, stop, through_layers(&cublas_only));
          if (!tc.ok()) return tc.status();
          absl::StatusOr<double> ts = TimeOnStream(
              stream, start, stop, through_layers(&skinny_all));
          if (!ts.ok()) return ts.status();
          t.cublas_seconds = std::min(t.cublas_seconds, *tc);
          t.skinny_seconds = std::min(t.skinny_seconds, *ts);
        }
        t.skinny = t.max_rel_diff <= 1e-2 &&
                   t.skinny_seconds <= (1 - kSkinnyMargin) * t.cublas_seconds;
        dispatch->set_skinny(s.projection, rows, t.skinny);
        trials.push_back(t);
      }
    }
    return absl::OkStatus();
  }();
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!status.ok()) return status;
  return trials;
}

absl::Status ValidateDecodeGemm(absl::string_view mode) {
  if (mode == "auto" || mode == "cublas" || mode == "skinny") {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "decode_gemm must be auto, cublas or skinny, got \"", mode, "\""));
}

std::string DescribeSkinnyTuning(absl::Span<const SkinnyLinearTrial> trials) {
  std::string chosen, one_row;
  for (int pi = 0; pi < kNumProjections; ++pi) {
    const Projection p = static_cast<Projection>(pi);
    std::vector<int> rows;
    for (const SkinnyLinearTrial& t : trials) {
      if (t.projection != p) continue;
      if (t.skinny) rows.push_back(t.rows);
      if (t.rows == 1) {
        absl::StrAppend(&one_row, one_row.empty() ? "" : ", ",
                        ProjectionName(p),
                        absl::StrFormat(" %.3f / %.3f", 1e3 * t.cublas_seconds,
                                        1e3 * t.skinny_seconds));
      }
    }
    if (rows.empty()) continue;
    // Runs of consecutive rows as "a-b".
    std::string ranges;
    for (size_t i = 0; i < rows.size();) {
      size_t j = i;
      while (j + 1 < rows.size() && rows[j + 1] == rows[j] + 1) ++j;
      absl::StrAppend(&ranges, ranges.empty() ? "" : ",", rows[i]);
      if (j > i) absl::StrAppend(&ranges, "-", rows[j]);
      i = j + 1;
    }
    absl::StrAppend(&chosen, chosen.empty() ? "" : ", ", ProjectionName(p),
                    " at ", ranges);
  }
  return absl::StrCat(
      "decode GEMMs: ",
      chosen.empty() ? "cuBLAS for every projection"
                     : absl::StrCat("skinny for ", chosen, "; cuBLAS else"),
      " (1 row, ms a forward, cuBLAS / skinny: ", one_row, ")");
}

}  // namespace specserve
