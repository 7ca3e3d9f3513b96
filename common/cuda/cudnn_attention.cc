#include "common/cuda/cudnn_attention.h"

#include <cudnn_graph.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/cuda/cuda_status.h"

namespace specserve {

namespace {

// Owns one backend descriptor.
class Desc {
 public:
  Desc() = default;
  explicit Desc(cudnnBackendDescriptor_t d) : d_(d) {}
  ~Desc() {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(Desc&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  Desc& operator=(Desc&& o) noexcept {
    std::swap(d_, o.d_);
    return *this;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// cuDNN's status name and its last error message (which says which
// attribute or which engine constraint failed).
absl::Status CudnnError(cudnnStatus_t status, absl::string_view what) {
  char message[1024] = {0};
  cudnnGetLastErrorString(message, sizeof(message));
  return absl::InternalError(absl::StrCat(
      "cuDNN ", what, ": ", cudnnGetErrorString(status),
      message[0] != '\0' ? absl::StrCat(" (", message, ")") : ""));
}

#define SPECSERVE_CUDNN_RETURN(expr, what)                      \
  do {                                                           \
    const cudnnStatus_t specserve_cudnn_st_ = (expr);            \
    if (specserve_cudnn_st_ != CUDNN_STATUS_SUCCESS) {           \
      return CudnnError(specserve_cudnn_st_, what);              \
    }                                                            \
  } while (0)


// Tensor UIDs of the variant pack.
constexpr int64_t kUidQ = 1, kUidK = 2, kUidV = 3, kUidO = 4;
constexpr int64_t kUidScale = 5, kUidNegInf = 6, kUidSkv = 7, kUidSq = 8;

using Dims = std::array<int64_t, 4>;

// Collects the graph's descriptors, in the form cuDNN's frontend (1.x)
// lowers an inference SDPA node to for backends 9.0-9.20: the fused
// engines recognise the pattern, so it is mirrored op for op. The first
// failure sticks (status()); later calls then do nothing and return null.
class SdpaGraph {
 public:
  const absl::Status& status() const { return status_; }

  // A finalized tensor descriptor.
  cudnnBackendDescriptor_t Tensor(int64_t uid, cudnnDataType_t type,
                                  const Dims& dims, const Dims& strides,
                                  bool is_virtual, bool by_value = false) {
    const int64_t alignment = 16;
    cudnnBackendDescriptor_t d = New(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    Set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    Set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    Set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    Set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    Set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    Set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) {
      Set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    }
    return Finalize(d, absl::StrCat("tensor ", uid));
  }

  // A fresh virtual tensor.
  cudnnBackendDescriptor_t Virtual(cudnnDataType_t type, const Dims& dims,
                                   const Dims& strides) {
    return Tensor(next_virtual_uid_++, type, dims, strides, true);
  }

  // y = mode(x[, b[, t]]) with math in `math`; `axis` only for GEN_INDEX.
  void Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math,
                 cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = New(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) {
      Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    }
    Finalize(pw, absl::StrCat("pointwise mode ", mode));
    const float one = 1.0f;
    cudnnBackendDescriptor_t op =
        New(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    SetDescriptors(op, {{CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw},
                        {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x},
                        {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y},
                        {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b},
                        {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t}});
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    AddOp(op, absl::StrCat("pointwise op mode ", mode));
  }

  // y = reduce(x) over the dimensions where y has extent 1 (fp32).
  void Reduction(cudnnReduceTensorOp_t reduce, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t y) {
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t rd = New(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    Set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    Set(rd, CUDNN_ATTR_REDUCTION_OPERATOR,
        CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce);
    if (cudnnGetVersion() >= 91100) {  // the frontend always sets it there
      const bool deterministic = false;
      Set(rd, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1,
          &deterministic);
    }
    Finalize(rd, "reduction");
    cudnnBackendDescriptor_t op =
        New(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    SetDescriptors(op, {{CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd},
                        {CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x},
                        {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y}});
    AddOp(op, "reduction op");
  }

  // c = a @ b, batched over the first two dimensions (fp32 accumulation).
  void Matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
              cudnnBackendDescriptor_t c) {
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t mm = New(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    Set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    Finalize(mm, "matmul");
    cudnnBackendDescriptor_t op =
        New(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    SetDescriptors(op, {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, a},
                        {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b},
                        {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c},
                        {CUDNN_ATTR_OPERATION_MATMUL_DESC, mm}});
    AddOp(op, "matmul op");
  }

  const std::vector<cudnnBackendDescriptor_t>& ops() const { return ops_; }

  // Hands the descriptors over (they must outlive the operation graph).
  std::vector<Desc> TakeOwned() { return std::move(owned_); }

 private:
  cudnnBackendDescriptor_t New(cudnnBackendDescriptorType_t type) {
    if (!status_.ok()) return nullptr;
    cudnnBackendDescriptor_t d = nullptr;
    const cudnnStatus_t st = cudnnBackendCreateDescriptor(type, &d);
    if (st != CUDNN_STATUS_SUCCESS) {
      status_ = CudnnError(st, absl::StrCat("create descriptor type ", type));
      return nullptr;
    }
    owned_.emplace_back(d);
    return d;
  }

  void Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
           cudnnBackendAttributeType_t type, int64_t count,
           const void* value) {
    if (!status_.ok()) return;
    const cudnnStatus_t st =
        cudnnBackendSetAttribute(d, name, type, count, value);
    if (st != CUDNN_STATUS_SUCCESS) {
      status_ = CudnnError(st, absl::StrCat("set attribute ", name));
    }
  }

  // Descriptor-valued attributes; null descriptors are left unset.
  void SetDescriptors(
      cudnnBackendDescriptor_t d,
      std::initializer_list<
          std::pair<cudnnBackendAttributeName_t, cudnnBackendDescriptor_t>>
          attributes) {
    for (const auto& [name, value] : attributes) {
      if (value != nullptr) {
        Set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
      }
    }
  }

  cudnnBackendDescriptor_t Finalize(cudnnBackendDescriptor_t d,
                                    absl::string_view what) {
    if (!status_.ok()) return nullptr;
    const cudnnStatus_t st = cudnnBackendFinalize(d);
    if (st != CUDNN_STATUS_SUCCESS) {
      status_ = CudnnError(st, absl::StrCat("finalize ", what));
      return nullptr;
    }
    return d;
  }

  void AddOp(cudnnBackendDescriptor_t op, absl::string_view what) {
    if (Finalize(op, what) != nullptr) ops_.push_back(op);
  }

  absl::Status status_;
  std::vector<Desc> owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_uid_ = 100;
};

cudnnDataType_t CudnnType(CudaDType t) {
  return t == CudaDType::kFP16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
}

// How a plan is made, in the order tried until one finalizes. Hopper's
// fused SDPA engines generate and NVRTC-compile their kernel while the
// plan is built (~0.4 s a config on a CPU of the build machines); with
// dynamic shapes and a kernel cache, later shapes of the same pattern reuse
// the compiled kernel (cuDNN's frontend: set_dynamic_shape_enabled,
// set_kernel_cache). Fixed-shape plans are the fallback.
// (Without the unused log-sum-exp statistic no Hopper engine takes the
// graph: deviceless planning shows engine 0 rejecting it.)
struct PlanForm {
  bool dynamic;
  const char* name;
};
constexpr PlanForm kForms[] = {
    {true, "dynamic shapes"},
    {false, "fixed shape"},
};
constexpr int kNumForms = static_cast<int>(sizeof(kForms) / sizeof(kForms[0]));

// The SDPA operations for `s` (see the header) into *g; g->status() says
// whether every descriptor finalized. b = 1, and the runner's buffers'
// BSHD layouts as strides.
void BuildSdpaOps(const CudnnSdpaShape& s, SdpaGraph* g) {
  const int64_t H = s.num_heads, KV = s.num_kv_heads, D = s.head_dim;
  const int64_t sq = s.s_q, skv = s.s_kv;
  const cudnnDataType_t io = CudnnType(s.dtype);
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT, i32 = CUDNN_DATA_INT32;
  const cudnnDataType_t boolean = CUDNN_DATA_BOOLEAN;
  // Scalars passed by value: rank 4 like the tensors they broadcast over
  // (pointwise operands must have equal ranks).
  const Dims one = {1, 1, 1, 1};
  const Dims score = {1, H, sq, skv};
  const Dims score_strides = {H * sq * skv, sq * skv, skv, 1};
  const Dims stat = {1, H, sq, 1};
  const Dims stat_strides = {H * sq, sq, 1, 1};

  // Q [1, H, sq, D] over the buffer [sq, H, D]; K^T [1, KV, D, skv] and
  // V [1, KV, skv, D] over [skv, KV, D]; O [1, H, sq, D] over [sq, H * D].
  auto* q = g->Tensor(kUidQ, io, {1, H, sq, D}, {sq * H * D, D, H * D, 1},
                      false);
  auto* kt = g->Tensor(kUidK, io, {1, KV, D, skv},
                       {skv * KV * D, D, 1, KV * D}, false);
  auto* v = g->Tensor(kUidV, io, {1, KV, skv, D},
                      {skv * KV * D, D, KV * D, 1}, false);
  auto* o = g->Tensor(kUidO, io, {1, H, sq, D}, {sq * H * D, D, H * D, 1},
                      false);
  auto* scale = g->Tensor(kUidScale, f32, one, one, false, /*by_value=*/true);
  auto* neg_inf =
      g->Tensor(kUidNegInf, f32, one, one, false, /*by_value=*/true);
  auto scores = [&](cudnnDataType_t t) {
    return g->Virtual(t, score, score_strides);
  };
  auto stats = [&]() { return g->Virtual(f32, stat, stat_strides); };

  // S = Q K^T, then S * scale.
  auto* s0 = scores(f32);
  g->Matmul(q, kt, s0);
  auto* s1 = scores(f32);
  g->Pointwise(CUDNN_POINTWISE_MUL, f32, s0, scale, nullptr, s1);

  // Causal mask: keep column <= row (+ skv - sq when aligned bottom-right).
  auto* row = scores(i32);
  g->Pointwise(CUDNN_POINTWISE_GEN_INDEX, f32, s1, nullptr, nullptr, row, 2);
  auto* col = scores(i32);
  g->Pointwise(CUDNN_POINTWISE_GEN_INDEX, f32, s1, nullptr, nullptr, col, 3);
  if (skv != sq) {
    auto* skv_t = g->Tensor(kUidSkv, i32, one, one, false, /*by_value=*/true);
    auto* sq_t = g->Tensor(kUidSq, i32, one, one, false, /*by_value=*/true);
    auto* plus = scores(i32);
    g->Pointwise(CUDNN_POINTWISE_ADD, i32, row, skv_t, nullptr, plus);
    row = scores(i32);
    g->Pointwise(CUDNN_POINTWISE_SUB, i32, plus, sq_t, nullptr, row);
  }
  auto* keep = scores(boolean);
  g->Pointwise(CUDNN_POINTWISE_CMP_GE, boolean, row, col, nullptr, keep);
  auto* s2 = scores(f32);  // keep ? s1 : -inf
  g->Pointwise(CUDNN_POINTWISE_BINARY_SELECT, f32, s1, neg_inf, keep, s2);

  // Softmax: max, exp(s - max), sum, the log-sum-exp statistic (unused but
  // part of the pattern), exp / sum into P in the I/O type (the A operand
  // of P V).
  auto* mx = stats();
  g->Reduction(CUDNN_REDUCE_TENSOR_MAX, s2, mx);
  auto* centered = scores(f32);
  g->Pointwise(CUDNN_POINTWISE_SUB, f32, s2, mx, nullptr, centered);
  auto* ex = scores(f32);
  g->Pointwise(CUDNN_POINTWISE_EXP, f32, centered, nullptr, nullptr, ex);
  auto* sum = stats();
  g->Reduction(CUDNN_REDUCE_TENSOR_ADD, ex, sum);
  auto* log_sum = stats();
  g->Pointwise(CUDNN_POINTWISE_LOG, f32, sum, nullptr, nullptr, log_sum);
  g->Pointwise(CUDNN_POINTWISE_ADD, f32, mx, log_sum, nullptr, stats());
  auto* p = scores(io);
  g->Pointwise(CUDNN_POINTWISE_DIV, f32, ex, sum, nullptr, p);

  // O = P V.
  g->Matmul(p, v, o);
}

// An empty device-properties descriptor (cuDNN 9.8+). UNAVAILABLE when
// libcudnn is missing or older.
absl::StatusOr<Desc> NewDeviceProperties() {
  if (!CudnnLibraryLoads() || cudnnGetVersion() < 90800) {
    return absl::UnavailableError(absl::StrCat(
        "cuDNN device properties need libcudnn.so.9 >= 9.8; version seen: ",
        cudnnGetVersion()));
  }
  cudnnBackendDescriptor_t raw = nullptr;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendCreateDescriptor(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, &raw),
      "create device properties");
  return Desc(raw);
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                       since)
      .count();
}

// An operation graph and the tensor / operation descriptors it was built
// from, shared by the plans made from it and a kernel cache seeded by it.
struct GraphDescs {
  std::vector<Desc> descs;
  Desc op_graph;
};

}  // namespace

// An execution plan and what it was built from.
struct CudnnAttention::Plan {
  std::shared_ptr<GraphDescs> graph;
  Desc engine_config;  // kept alive with the plan built from it
  Desc plan;
  const char* form = "";  // PlanForm::name
  int64_t workspace_bytes = 0;
  int engine_configs = 0;  // what the heuristics offered
  int chosen_config = 0;   // the first that finalized
  bool bottom_right = false;  // s_kv != s_q: the shift tensors are bound
};

// Compiled kernels of one graph pattern, reused across its shapes.
struct CudnnAttention::KernelCache {
  std::shared_ptr<GraphDescs> seed;  // the graph the cache was built from
  Desc cache;
  // The dynamic-shape form failed once for this pattern: later shapes go
  // straight to fixed-shape plans instead of paying for the failure again.
  bool dynamic_failed = false;
};

absl::Status ValidateCudnnSdpaShape(const CudnnSdpaShape& s) {
  if (s.s_q < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuDNN SDPA: s_q must be >= 1, got ", s.s_q));
  }
  if (s.s_kv < s.s_q) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuDNN SDPA: s_kv (", s.s_kv, ") must be >= s_q (", s.s_q, ")"));
  }
  if (s.num_kv_heads < 1 || s.num_heads < s.num_kv_heads ||
      s.num_heads % s.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuDNN SDPA: num_heads (", s.num_heads,
        ") must be a positive multiple of num_kv_heads (", s.num_kv_heads,
        ")"));
  }
  if (s.head_dim != 64 && s.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuDNN SDPA: head_dim must be 64 or 128, got ", s.head_dim));
  }
  if (s.dtype != CudaDType::kBF16 && s.dtype != CudaDType::kFP16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuDNN SDPA: dtype must be bf16 or fp16, got ",
        CudaDTypeName(s.dtype)));
  }
  return absl::OkStatus();
}

bool CudnnLibraryLoads() {
  return cudnnGetVersion() / 10000 == CUDNN_MAJOR;
}

size_t CudnnAttention::LibraryVersion() { return cudnnGetVersion(); }

absl::StatusOr<int> CheckCudnnSdpaOperations(const CudnnSdpaShape& shape) {
  SPECSERVE_RETURN_IF_ERROR(ValidateCudnnSdpaShape(shape));
  if (!CudnnLibraryLoads()) {
    return absl::UnavailableError("libcudnn.so.9 does not load on this host");
  }
  SdpaGraph g;
  BuildSdpaOps(shape, &g);
  SPECSERVE_RETURN_IF_ERROR(g.status());
  return static_cast<int>(g.ops().size());
}

absl::StatusOr<CudnnAttention::PlanCheck> CudnnAttention::CheckPlanForDevice(
    const CudnnSdpaShape& shape, const std::string& device_json,
    bool first_form_only) {
  SPECSERVE_RETURN_IF_ERROR(ValidateCudnnSdpaShape(shape));
  absl::StatusOr<Desc> props = NewDeviceProperties();
  if (!props.ok()) return props.status();
  cudnnBackendDescriptor_t raw = props->get();
  cudnnStatus_t st = cudnnBackendSetAttribute(
      raw, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
      static_cast<int64_t>(device_json.size()), device_json.data());
  if (st == CUDNN_STATUS_SUCCESS) st = cudnnBackendFinalize(raw);
  if (st != CUDNN_STATUS_SUCCESS) {
    return absl::InvalidArgumentError(
        CudnnError(st, "device properties JSON").message());
  }
  std::string errors;
  KernelCache cache;
  for (int f = 0; f < (first_form_only ? 1 : kNumForms); ++f) {
    absl::StatusOr<std::unique_ptr<Plan>> plan = BuildPlan(
        shape, f, nullptr, raw, kForms[f].dynamic ? &cache : nullptr);
    if (plan.ok()) {
      PlanCheck check;
      check.form = (*plan)->form;
      check.engine_configs = (*plan)->engine_configs;
      check.chosen_config = (*plan)->chosen_config;
      check.workspace_bytes = (*plan)->workspace_bytes;
      return check;
    }
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", kForms[f].name,
                    ": ", plan.status().message());
  }
  return absl::UnimplementedError(errors);
}

absl::StatusOr<std::string> CudnnAttention::DevicePropertiesJson(
    int device_id) {
  absl::StatusOr<Desc> props = NewDeviceProperties();
  if (!props.ok()) return props.status();
  cudnnBackendDescriptor_t raw = props->get();
  const int32_t id = device_id;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendSetAttribute(raw, CUDNN_ATTR_DEVICEPROP_DEVICE_ID,
                               CUDNN_TYPE_INT32, 1, &id),
      "device properties id");
  SPECSERVE_CUDNN_RETURN(cudnnBackendFinalize(raw),
                         "finalize device properties");
  int64_t size = 0;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendGetAttribute(raw, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION,
                               CUDNN_TYPE_CHAR, 0, &size, nullptr),
      "device properties JSON size");
  std::string json(static_cast<size_t>(size), '\0');
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendGetAttribute(raw, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION,
                               CUDNN_TYPE_CHAR, size, &size, json.data()),
      "device properties JSON");
  json.resize(static_cast<size_t>(size));
  while (!json.empty() && json.back() == '\0') json.pop_back();
  return json;
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    cudaStream_t stream) {
  if (!CudnnLibraryLoads()) {
    return absl::UnavailableError(absl::StrCat(
        "cuDNN ", CUDNN_MAJOR,
        " not found (libcudnn.so.9 on LD_LIBRARY_PATH or in "
        "/usr/local/cuda/lib64); version seen: ",
        cudnnGetVersion()));
  }
  // cuDNN's frontend refuses bf16 / fp16 SDPA on 9.10.0 and 9.10.1 (known
  // bugs in those releases); so do we.
  if (const size_t v = cudnnGetVersion(); v == 91000 || v == 91001) {
    return absl::UnavailableError(absl::StrCat(
        "cuDNN ", v, ": its SDPA has known bugs (use another 9.x)"));
  }
  cudnnHandle_t handle = nullptr;
  SPECSERVE_CUDNN_RETURN(cudnnCreate(&handle), "cudnnCreate");
  std::unique_ptr<CudnnAttention> a(new CudnnAttention(handle, stream));
  SPECSERVE_CUDNN_RETURN(cudnnSetStream(handle, stream), "cudnnSetStream");
  return a;
}

CudnnAttention::CudnnAttention(void* handle, cudaStream_t stream)
    : handle_(handle), stream_(stream) {}

CudnnAttention::~CudnnAttention() {
  // A plan owns its kernels: none may still be queued when it goes.
  cudaStreamSynchronize(stream_);
  plans_.clear();  // plans before the kernel caches and the handle
  kernel_caches_.clear();
  if (handle_ != nullptr) cudnnDestroy(static_cast<cudnnHandle_t>(handle_));
}

absl::StatusOr<std::unique_ptr<CudnnAttention::Plan>>
CudnnAttention::BuildPlan(const CudnnSdpaShape& shape, int form_index,
                          void* handle_or_null, void* device_properties,
                          KernelCache* kernel_cache) {
  const PlanForm& form = kForms[form_index];
  if (form.dynamic != (kernel_cache != nullptr)) {
    return absl::InternalError("a dynamic-shape form needs a kernel cache");
  }
  auto plan = std::make_unique<Plan>();
  plan->bottom_right = shape.s_kv != shape.s_q;
  plan->form = form.name;
  SdpaGraph g;
  BuildSdpaOps(shape, &g);
  SPECSERVE_RETURN_IF_ERROR(g.status());
  std::vector<cudnnBackendDescriptor_t> ops = g.ops();
  plan->graph = std::make_shared<GraphDescs>();
  plan->graph->descs = g.TakeOwned();

  cudnnBackendDescriptor_t og = nullptr;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendCreateDescriptor(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR,
                                   &og),
      "create operation graph");
  plan->graph->op_graph = Desc(og);
  cudnnHandle_t handle = static_cast<cudnnHandle_t>(handle_or_null);
  cudnnBackendDescriptor_t props =
      static_cast<cudnnBackendDescriptor_t>(device_properties);
  if (handle != nullptr) {  // optional since cuDNN 9.8
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendSetAttribute(og, CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
                                 CUDNN_TYPE_HANDLE, 1, &handle),
        "operation graph handle");
  }
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendSetAttribute(og, CUDNN_ATTR_OPERATIONGRAPH_OPS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR,
                               static_cast<int64_t>(ops.size()),
                               ops.data()),
      "operation graph ops");
  if (kernel_cache != nullptr) {
    const bool dynamic = true;
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendSetAttribute(
            og, CUDNN_ATTR_OPERATIONGRAPH_IS_DYNAMIC_SHAPE_ENABLED,
            CUDNN_TYPE_BOOLEAN, 1, &dynamic),
        "operation graph dynamic shapes");
  }
  SPECSERVE_CUDNN_RETURN(cudnnBackendFinalize(og),
                         "finalize operation graph");
  if (kernel_cache != nullptr && kernel_cache->cache.get() == nullptr) {
    cudnnBackendDescriptor_t kc = nullptr;
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendCreateDescriptor(CUDNN_BACKEND_KERNEL_CACHE_DESCRIPTOR,
                                     &kc),
        "create kernel cache");
    Desc owned(kc);
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendSetAttribute(kc, CUDNN_ATTR_KERNEL_CACHE_OPERATION_GRAPH,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &og),
        "kernel cache graph");
    SPECSERVE_CUDNN_RETURN(cudnnBackendFinalize(kc), "finalize kernel cache");
    kernel_cache->cache = std::move(owned);
    kernel_cache->seed = plan->graph;
  }

  cudnnBackendDescriptor_t heur_raw = nullptr;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR,
                                   &heur_raw),
      "create heuristics");
  Desc heur(heur_raw);
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendSetAttribute(heur_raw,
                               CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &og),
      "heuristics graph");
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendSetAttribute(heur_raw, CUDNN_ATTR_ENGINEHEUR_MODE,
                               CUDNN_TYPE_HEUR_MODE, 1, &mode),
      "heuristics mode");
  if (props != nullptr) {
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendSetAttribute(heur_raw, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &props),
        "heuristics device properties");
  }
  SPECSERVE_CUDNN_RETURN(cudnnBackendFinalize(heur_raw),
                         "finalize heuristics");
  int64_t count = 0;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendGetAttribute(heur_raw, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                               nullptr),
      "heuristics result count");
  if (count <= 0) {
    return absl::UnimplementedError(absl::StrCat(
        "cuDNN has no engine for causal SDPA s_q=", shape.s_q,
        " s_kv=", shape.s_kv, " H=", shape.num_heads,
        " KV=", shape.num_kv_heads, " D=", shape.head_dim));
  }
  std::vector<Desc> configs;
  std::vector<cudnnBackendDescriptor_t> raw(count);
  for (int64_t i = 0; i < count; ++i) {
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
                                     &raw[i]),
        "create engine config");
    configs.emplace_back(raw[i]);
  }
  int64_t returned = 0;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendGetAttribute(heur_raw, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                               &returned, raw.data()),
      "heuristics results");
  absl::Status last = absl::UnimplementedError("no engine config");
  if (returned == 0) {
    // The heuristics' support checks dropped every config; cuDNN says why.
    char why[1024] = {0};
    cudnnGetLastErrorString(why, sizeof(why));
    last = absl::UnimplementedError(absl::StrCat(
        count, " heuristics results, none viable",
        why[0] != '\0' ? absl::StrCat(": ", why) : ""));
  }
  for (int64_t i = 0; i < returned; ++i) {
    cudnnBackendDescriptor_t ep = nullptr;
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendCreateDescriptor(
            CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &ep),
        "create execution plan");
    Desc candidate(ep);
    if (handle != nullptr) {
      SPECSERVE_CUDNN_RETURN(
          cudnnBackendSetAttribute(ep, CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                   CUDNN_TYPE_HANDLE, 1, &handle),
          "plan handle");
    }
    if (kernel_cache != nullptr) {
      cudnnBackendDescriptor_t kc = kernel_cache->cache.get();
      SPECSERVE_CUDNN_RETURN(
          cudnnBackendSetAttribute(ep, CUDNN_ATTR_EXECUTION_PLAN_KERNEL_CACHE,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &kc),
          "plan kernel cache");
    }
    if (props != nullptr) {
      SPECSERVE_CUDNN_RETURN(
          cudnnBackendSetAttribute(ep, CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &props),
          "plan device properties");
    }
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendSetAttribute(ep, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw[i]),
        "plan engine config");
    const cudnnStatus_t st = cudnnBackendFinalize(ep);
    if (st != CUDNN_STATUS_SUCCESS) {
      last = CudnnError(st, absl::StrCat("finalize plan ", i));
      continue;
    }
    int64_t ws = 0, n = 0;
    SPECSERVE_CUDNN_RETURN(
        cudnnBackendGetAttribute(ep, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                 CUDNN_TYPE_INT64, 1, &n, &ws),
        "plan workspace size");
    plan->plan = std::move(candidate);
    plan->engine_config = std::move(configs[i]);
    plan->workspace_bytes = ws;
    plan->engine_configs = static_cast<int>(returned);
    plan->chosen_config = static_cast<int>(i);
    return plan;
  }
  return absl::UnimplementedError(absl::StrCat(
      "no cuDNN engine config of ", returned,
      " finalizes for causal SDPA s_q=", shape.s_q, " s_kv=", shape.s_kv,
      "; last: ", last.message()));
}

absl::StatusOr<const CudnnAttention::Plan*> CudnnAttention::GetPlan(
    const CudnnSdpaShape& shape) {
  auto it = plans_.find(shape);
  if (it != plans_.end()) {
    if (!it->second.ok()) return it->second.status();
    return it->second->get();
  }
  // Bound the cache: a long-running server sees many chunk shapes. A plan
  // owns its kernels, so the stream must be done with them first.
  if (plans_.size() >= 512) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    plans_.clear();
  }

  const auto start = std::chrono::steady_clock::now();
  // One kernel cache per graph pattern: the mask's alignment, heads, head
  // size and dtype.
  const KernelCacheKey key{shape.s_kv != shape.s_q, shape.num_heads,
                           shape.num_kv_heads, shape.head_dim,
                           static_cast<int>(shape.dtype)};
  std::unique_ptr<KernelCache>& cache = kernel_caches_[key];
  if (cache == nullptr) cache = std::make_unique<KernelCache>();
  absl::StatusOr<std::unique_ptr<Plan>> built;
  std::string errors;
  for (int f = 0; f < kNumForms; ++f) {
    if (kForms[f].dynamic && cache->dynamic_failed) continue;
    built = BuildPlan(shape, f, handle_, nullptr,
                      kForms[f].dynamic ? cache.get() : nullptr);
    if (built.ok()) break;
    if (kForms[f].dynamic) cache->dynamic_failed = true;
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", kForms[f].name,
                    ": ", built.status().message());
  }
  // Every failure, descriptor-level ones included, means "not this shape".
  if (!built.ok()) built = absl::UnimplementedError(errors);
  if (built.ok()) last_plan_form_ = (*built)->form;
  ++plans_built_;
  plan_build_seconds_ += Seconds(start);
  auto [pos, inserted] = plans_.emplace(shape, std::move(built));
  (void)inserted;
  if (!pos->second.ok()) return pos->second.status();
  return pos->second->get();
}

absl::Status CudnnAttention::Prepare(const CudnnSdpaShape& shape) {
  SPECSERVE_RETURN_IF_ERROR(ValidateCudnnSdpaShape(shape));
  return GetPlan(PaddedCudnnSdpaShape(shape)).status();
}

bool CudnnAttention::HasPlan(const CudnnSdpaShape& shape) const {
  return plans_.contains(PaddedCudnnSdpaShape(shape));
}

double CudnnSdpaFlops(const CudnnSdpaShape& shape, int num_layers) {
  return 4.0 * shape.num_heads * shape.head_dim * shape.s_q *
         (shape.s_kv - 0.5 * shape.s_q) * std::max(num_layers, 0);
}

bool CudnnPlanPaysOff(const CudnnSdpaShape& shape, int num_layers) {
  if (shape.s_q >= kCudnnRecurringChunkRows) return true;
  return CudnnSdpaFlops(shape, num_layers) >= kCudnnPlanPaysOffFlops;
}

bool CudnnPlanPolicy::ShouldPlan(const CudnnSdpaShape& shape,
                                 int num_layers) {
  if (CudnnPlanPaysOff(shape, num_layers)) return true;
  const CudnnSdpaShape key = PaddedCudnnSdpaShape(shape);
  if (flops_.size() >= kMaxShapes && !flops_.contains(key)) flops_.clear();
  double& total = flops_[key];
  total += CudnnSdpaFlops(shape, num_layers);
  if (total < kCudnnPlanPaysOffFlops) return false;
  flops_.erase(key);
  return true;
}

CudnnSdpaShape PaddedCudnnSdpaShape(const CudnnSdpaShape& shape) {
  CudnnSdpaShape padded = shape;
  int bucket = 1;
  while (bucket < shape.s_q && bucket < 256) bucket *= 2;
  if (shape.s_q > 256) bucket = (shape.s_q + 255) / 256 * 256;
  padded.s_q = bucket;
  padded.s_kv = shape.s_kv + (bucket - shape.s_q);
  return padded;
}

absl::Status CudnnAttention::Run(const CudnnSdpaShape& shape, const void* q,
                                 void* k, void* v, void* out, float scale) {
  SPECSERVE_RETURN_IF_ERROR(ValidateCudnnSdpaShape(shape));
  for (const void* p : {q, static_cast<const void*>(k),
                        static_cast<const void*>(v),
                        static_cast<const void*>(out)}) {
    if (p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return absl::InvalidArgumentError(
          "cuDNN SDPA: q, k, v and out must be non-null and 16-byte aligned");
    }
  }
  const CudnnSdpaShape padded = PaddedCudnnSdpaShape(shape);
  absl::StatusOr<const Plan*> plan = GetPlan(padded);
  if (!plan.ok()) return plan.status();
  SPECSERVE_RETURN_IF_ERROR(
      workspace_.Reserve(static_cast<size_t>((*plan)->workspace_bytes)));

  // Padding: zero key / value rows past s_kv; q and out through copies of
  // padded.s_q rows, the extra query rows zero (their outputs are dropped).
  const size_t elem = CudaDTypeBytes(shape.dtype);
  const size_t kv_row = elem * shape.num_kv_heads * shape.head_dim;
  const size_t q_row = elem * shape.num_heads * shape.head_dim;
  const size_t extra = static_cast<size_t>(padded.s_q - shape.s_q);
  const void* run_q = q;
  void* run_out = out;
  if (extra > 0) {
    for (void* plane : {k, v}) {
      SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
          static_cast<char*>(plane) + kv_row * shape.s_kv, 0, kv_row * extra,
          stream_));
    }
    SPECSERVE_RETURN_IF_ERROR(padded_q_.Reserve(q_row * padded.s_q));
    SPECSERVE_RETURN_IF_ERROR(padded_out_.Reserve(q_row * padded.s_q));
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        padded_q_.get(), q, q_row * shape.s_q, cudaMemcpyDeviceToDevice,
        stream_));
    SPECSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
        padded_q_.as<char>() + q_row * shape.s_q, 0, q_row * extra, stream_));
    run_q = padded_q_.get();
    run_out = padded_out_.get();
  }

  // By-value scalars are read from the host during the call.
  float scale_value = scale;
  float neg_inf = -std::numeric_limits<float>::infinity();
  int32_t skv = padded.s_kv, sq = padded.s_q;
  std::vector<int64_t> uids = {kUidQ, kUidK, kUidV, kUidO, kUidScale,
                               kUidNegInf};
  std::vector<void*> ptrs = {const_cast<void*>(run_q), k, v, run_out,
                             &scale_value, &neg_inf};
  if ((*plan)->bottom_right) {
    uids.push_back(kUidSkv);
    ptrs.push_back(&skv);
    uids.push_back(kUidSq);
    ptrs.push_back(&sq);
  }
  cudnnBackendDescriptor_t vp_raw = nullptr;
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR,
                                   &vp_raw),
      "create variant pack");
  Desc vp(vp_raw);
  void* ws = workspace_.get();
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendSetAttribute(vp_raw, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
                               CUDNN_TYPE_INT64,
                               static_cast<int64_t>(uids.size()),
                               uids.data()),
      "variant pack uids");
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendSetAttribute(vp_raw, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                               CUDNN_TYPE_VOID_PTR,
                               static_cast<int64_t>(ptrs.size()),
                               ptrs.data()),
      "variant pack pointers");
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendSetAttribute(vp_raw, CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                               CUDNN_TYPE_VOID_PTR, 1, &ws),
      "variant pack workspace");
  SPECSERVE_CUDNN_RETURN(cudnnBackendFinalize(vp_raw),
                         "finalize variant pack");
  SPECSERVE_CUDNN_RETURN(
      cudnnBackendExecute(static_cast<cudnnHandle_t>(handle_),
                          (*plan)->plan.get(), vp_raw),
      "execute SDPA");
  if (run_out != out) {
    SPECSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out, run_out, q_row * shape.s_q,
                        cudaMemcpyDeviceToDevice, stream_));
  }
  return absl::OkStatus();
}

}  // namespace specserve
