// The CUDA backend against the CPU backend (llama.cpp's test-backend-ops
// idea): every kernel on fresh random inputs (contiguous and paged caches),
// CudaModelRunner against CpuModelRunner on the bundled checkpoints (single
// sequences, mixed batches, every attention path), Speculative Prefill
// scoring, and the paged KV cache on the device (capacity, rollback, forks
// with copy-on-write).
//
// Tolerances, as relative errors ||out - ref|| / ||ref||: below 1e-5 where
// the device does fp32 math on the same inputs as the reference (operands
// rounded to bf16 on both sides where the device stores bf16), below 1e-2
// where a bf16 / fp16 rounding of operands or outputs is involved, and the
// model-level bounds below (several layers of bf16 rounding compound).
//
// Every test skips where no CUDA device is present (CudaAvailable() false),
// so this passes on CPU-only CI; tools/gpu/run_gpu_tests.sh runs it on a GPU
// machine. Inputs are drawn from a seed printed at the start of each test;
// set SPECSERVE_TEST_SEED to replay one. Outputs are poisoned (0xFF bytes:
// NaN in fp32, bf16 and fp16) before every launch, so a kernel that skips
// an element fails the comparison, and every CUDA call and launch is
// checked.

#include <cblas.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/cuda/attention_plan.h"
#include "common/cuda/cuda_importance.h"
#include "common/cuda/cuda_model_runner.h"
#include "common/cuda/cuda_weights.h"
#include "common/cuda/cudnn_attention.h"
#include "common/cuda/device.h"
#include "common/cuda/device_buffer.h"
#include "common/cuda/kernels.h"
#include "common/cuda/linear.h"
#include "common/cuda/phase_timer.h"
#include "common/cuda/prefill_tuning.h"
#include "common/cuda/skinny_linear.h"
#include "common/decoding/logprobs.h"
#include "common/decoding/row_sampling.h"
#include "common/engine/cpu_model_runner.h"
#include "common/speculation/target_session.h"
#include "common/engine/kernels.h"
#include "common/engine/model_runner.h"
#include "common/engine/paged_kv_cache.h"
#include "common/model/synthetic.h"
#include "common/model/weights.h"
#include "common/specprefill/importance.h"
#include "common/specprefill/selection.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

namespace ck = cuda_kernels;

// Model-level bounds vs the fp32 CPU engine, calibrated with a host
// emulation of the device's bf16 rounding points on the bundled checkpoints
// (4 seeds each): batches of >= 100 logits rows reached 1.1e-2 relative
// error (stories260K-draft; the others <= 7e-3) and captured queries
// 6e-3, but single rows of the 48-wide stories260K-draft reached 9.5e-2, so
// small batches (decode, verify) get a looser bound. fp16 keeps 3 more
// mantissa bits. Wrong attention, positions or cache handling give errors
// of order 1.
constexpr double kBatchTolBf16 = 3e-2;
constexpr double kRowsTolBf16 = 1.5e-1;
constexpr double kBatchTolFp16 = 1e-2;
constexpr double kRowsTolFp16 = 4e-2;
// Those bounds for a dtype.
double BatchTol(CudaDType dt) {
  return dt == CudaDType::kBF16 ? kBatchTolBf16 : kBatchTolFp16;
}
double RowsTol(CudaDType dt) {
  return dt == CudaDType::kBF16 ? kRowsTolBf16 : kRowsTolFp16;
}

#define EXPECT_CUDA_OK(expr) EXPECT_EQ((expr), cudaSuccess) << #expr
#define ASSERT_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr
#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status st_ = (expr);             \
    ASSERT_TRUE(st_.ok()) << #expr << ": " << st_; \
  } while (0)

// After a launcher: its return (the launch error) and the kernel's run.
#define EXPECT_LAUNCH_OK(expr)                                  \
  do {                                                          \
    EXPECT_EQ((expr), cudaSuccess) << "launch: " << #expr;      \
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << #expr;   \
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << #expr;        \
  } while (0)

// ---------------------------------------------------------------------------
// Host-side helpers
// ---------------------------------------------------------------------------

float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  u &= 0xFFFF0000u;
  float y;
  std::memcpy(&y, &u, 4);
  return y;
}

float RoundFp16(float x) {
  return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}

float RoundTo(float x, CudaDType dt) {
  switch (dt) {
    case CudaDType::kBF16:
      return RoundBf16(x);
    case CudaDType::kFP16:
      return RoundFp16(x);
    case CudaDType::kF32:
      return x;
  }
  return x;
}

std::vector<float> Rounded(std::vector<float> v, CudaDType dt) {
  for (float& x : v) x = RoundTo(x, dt);
  return v;
}

// ||out - ref|| / ||ref||; infinity if `out` holds a non-finite value (a
// poisoned element the kernel never wrote). The reference must not be 0:
// a test on zeros proves nothing.
double RelErr(const std::vector<float>& out, const std::vector<float>& ref) {
  EXPECT_EQ(out.size(), ref.size());
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  EXPECT_GT(den, 0.0) << "reference is all zeros";
  return std::sqrt(num / den);
}

// A device buffer filled with 0xFF bytes (NaN in every float format).
DeviceBuffer Poisoned(size_t bytes) {
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(bytes);
  EXPECT_TRUE(buf.ok()) << buf.status();
  if (!buf.ok()) return DeviceBuffer();
  EXPECT_CUDA_OK(cudaMemset(buf->get(), 0xFF, bytes));
  return *std::move(buf);
}

template <typename T>
DeviceBuffer Upload(const std::vector<T>& host) {
  absl::StatusOr<DeviceBuffer> buf =
      DeviceBuffer::Allocate(host.size() * sizeof(T));
  EXPECT_TRUE(buf.ok()) << buf.status();
  if (!buf.ok()) return DeviceBuffer();
  EXPECT_CUDA_OK(cudaMemcpy(buf->get(), host.data(), host.size() * sizeof(T),
                            cudaMemcpyHostToDevice));
  return *std::move(buf);
}

// `host` as a device tensor of `dt` (converted on the device; the
// conversion itself is checked by ConvertRoundsToNearestEven).
DeviceBuffer UploadAs(const std::vector<float>& host, CudaDType dt) {
  DeviceBuffer f32 = Upload(host);
  DeviceBuffer out = Poisoned(host.size() * CudaDTypeBytes(dt));
  EXPECT_LAUNCH_OK(ck::ConvertFromF32(f32.as<float>(), out.get(), dt,
                                      host.size(), nullptr));
  return out;
}

// `n` elements of `dt` at `dev` as fp32 on the host.
std::vector<float> Download(const void* dev, CudaDType dt, size_t n) {
  std::vector<float> host(n);
  if (dt == CudaDType::kF32) {
    EXPECT_CUDA_OK(cudaMemcpy(host.data(), dev, n * sizeof(float),
                              cudaMemcpyDeviceToHost));
    return host;
  }
  DeviceBuffer f32 = Poisoned(n * sizeof(float));
  EXPECT_LAUNCH_OK(ck::ConvertToF32(dev, dt, f32.as<float>(), n, nullptr));
  EXPECT_CUDA_OK(cudaMemcpy(host.data(), f32.get(), n * sizeof(float),
                            cudaMemcpyDeviceToHost));
  return host;
}

// Fixture: skips without a device; a fresh seed per test (printed; override
// with SPECSERVE_TEST_SEED).
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) {
      GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription();
    }
    const char* env = std::getenv("SPECSERVE_TEST_SEED");
    seed_ = env != nullptr ? std::strtoull(env, nullptr, 10)
                           : (static_cast<uint64_t>(std::random_device{}())
                              << 32) ^ std::random_device{}();
    rng_.seed(seed_);
    std::printf("[   SEED   ] %llu\n", static_cast<unsigned long long>(seed_));
    RecordProperty("seed", std::to_string(seed_));
  }

  std::vector<float> Normal(size_t n, float stddev = 1.0f, float mean = 0.0f) {
    std::normal_distribution<float> dist(mean, stddev);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  int Uniform(int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

ModelConfig SmallConfig() {
  ModelConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 100;
  c.max_position_embeddings = 256;
  return c;
}

// ---------------------------------------------------------------------------
// Host-side logic: argument checks that return before any CUDA call and the
// split-K plan. These run (and must pass) on machines without a GPU too.
// ---------------------------------------------------------------------------

TEST(CudaHostTest, DTypeHelpers) {
  EXPECT_EQ(CudaDTypeBytes(CudaDType::kF32), 4u);
  EXPECT_EQ(CudaDTypeBytes(CudaDType::kBF16), 2u);
  EXPECT_EQ(CudaDTypeBytes(CudaDType::kFP16), 2u);
  EXPECT_STREQ(CudaDTypeName(CudaDType::kBF16), "bf16");
}

TEST(CudaHostTest, PhaseTimerChecksItsUseBeforeAnyCudaCall) {
  PhaseTimer timer({"a", "b"});
  EXPECT_EQ(timer.Mark(0, nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  int steps = -1;
  const std::vector<std::pair<std::string, double>> times = timer.Take(&steps);
  ASSERT_EQ(times.size(), 2u);
  EXPECT_EQ(times[0], std::make_pair(std::string("a"), 0.0));
  EXPECT_EQ(times[1], std::make_pair(std::string("b"), 0.0));
  EXPECT_EQ(steps, 0);
  EXPECT_TRUE(timer.Collect().ok());  // nothing recorded: nothing to add
}

TEST(CudaHostTest, LaunchersRejectBadShapesBeforeTouchingTheDevice) {
  EXPECT_FALSE(ck::FlashAttentionSupported(8, CudaDType::kBF16));
  EXPECT_FALSE(ck::FlashAttentionSupported(64, CudaDType::kF32));
  EXPECT_FALSE(ck::FlashAttentionSupported(256, CudaDType::kBF16));
  EXPECT_TRUE(ck::FlashAttentionSupported(16, CudaDType::kFP16));
  EXPECT_TRUE(ck::FlashAttentionSupported(128, CudaDType::kBF16));
  ck::AttentionArgs a;  // n = 0, null pointers
  EXPECT_EQ(ck::FlashAttention(a, nullptr), cudaErrorInvalidValue);
  {
    // FlashAttention reads Q, K and V rows in 16-byte loads: a pointer off
    // that alignment is refused before the launch.
    ck::AttentionArgs f;
    f.n = 4;
    f.num_heads = 4;
    f.num_kv_heads = 2;
    f.head_dim = 64;
    f.dtype = CudaDType::kBF16;
    f.out = reinterpret_cast<void*>(uintptr_t{0x40000});
    for (int off : {0, 1, 2}) {  // misaligns q, k_cache, v_cache in turn
      f.q = reinterpret_cast<const void*>(uintptr_t{0x10000} + 8 * (off == 0));
      f.k_cache =
          reinterpret_cast<const void*>(uintptr_t{0x20000} + 2 * (off == 1));
      f.v_cache =
          reinterpret_cast<const void*>(uintptr_t{0x30000} + 4 * (off == 2));
      EXPECT_EQ(ck::FlashAttention(f, nullptr), cudaErrorInvalidValue) << off;
    }
  }
  EXPECT_EQ(ck::SplitKAttention(a, 1, nullptr, nullptr),
            cudaErrorInvalidValue);
  {
    // A valid shape, but more splits than the merge has threads for.
    ck::AttentionArgs k;
    k.n = 1;
    k.first = 8191;
    k.num_heads = 4;
    k.num_kv_heads = 2;
    k.head_dim = 64;
    k.block_size = 16;
    k.dtype = CudaDType::kBF16;
    k.q = k.k_cache = k.v_cache =
        reinterpret_cast<const void*>(uintptr_t{0x10000});
    k.block_table = reinterpret_cast<const int*>(uintptr_t{0x20000});
    k.out = reinterpret_cast<void*>(uintptr_t{0x40000});
    void* ws = reinterpret_cast<void*>(uintptr_t{0x50000});
    EXPECT_EQ(ck::SplitKAttention(k, 65, ws, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(ck::SplitKAttention(k, 0, ws, nullptr), cudaErrorInvalidValue);
  }
  ck::RopeArgs r;
  r.n = 2;
  r.head_dim = 7;  // odd
  EXPECT_EQ(ck::RopeQkvStore(r, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(ck::EmbeddingGather(nullptr, CudaDType::kBF16, nullptr, 0, 8,
                                nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ImportanceLogits(nullptr, nullptr, CudaDType::kBF16, 8, 10, 1,
                                 4, 2, 8, 1.0f, nullptr, nullptr),
            cudaErrorInvalidValue);  // stride 8 < kv_heads * head_dim
  EXPECT_EQ(ck::ImportancePoolFold(nullptr, 1, 4, 10, 4, true, nullptr,
                                   nullptr),
            cudaErrorInvalidValue);  // even pool kernel
  EXPECT_EQ(ck::GatherKvRows(nullptr, CudaDType::kBF16, nullptr, 16, 4, 8,
                             nullptr, nullptr),
            cudaErrorInvalidValue);  // no block table
}

TEST(CudaHostTest, BatchedAttentionRejectsBadArgsBeforeTouchingTheDevice) {
  ck::BatchedAttentionArgs a;  // no heads
  EXPECT_EQ(ck::BatchedAttention(a, nullptr), cudaErrorInvalidValue);
  a.num_heads = 6;
  a.num_kv_heads = 4;  // not a multiple
  a.head_dim = 64;
  EXPECT_EQ(ck::BatchedAttention(a, nullptr), cudaErrorInvalidValue);
  a.num_heads = 8;
  a.head_dim = 264;  // > 256
  EXPECT_EQ(ck::BatchedAttention(a, nullptr), cudaErrorInvalidValue);
  a.head_dim = 64;
  a.num_work = 0;  // empty plan: nothing to launch
  EXPECT_EQ(ck::BatchedAttention(a, nullptr), cudaSuccess);
  a.num_work = 3;  // work but null pointers
  EXPECT_EQ(ck::BatchedAttention(a, nullptr), cudaErrorInvalidValue);
}

TEST(CudaHostTest, SplitKPlanFillsTheDeviceOnlyWhenItPays) {
  ck::AttentionArgs a;  // the plan reads shapes only
  a.num_heads = 32;
  a.num_kv_heads = 8;
  a.head_dim = 128;
  // Decode on a 32K cache (Llama-3.1-8B shape, 132 SMs): 8 kv heads x 33
  // splits ~ 2 blocks per SM.
  a.n = 1;
  a.first = 32767;
  EXPECT_EQ(ck::SplitKAttentionSplits(a, 132), 33);
  // A long prefill already has thousands of blocks.
  a.n = 4096;
  a.first = 0;
  EXPECT_EQ(ck::SplitKAttentionSplits(a, 132), 1);
  // A short cache: at least 64 keys per split.
  a.n = 1;
  a.first = 100;
  EXPECT_EQ(ck::SplitKAttentionSplits(a, 132), 2);
  // Capped at 64.
  a.num_kv_heads = 1;
  a.num_heads = 1;
  a.first = 1 << 20;
  EXPECT_EQ(ck::SplitKAttentionSplits(a, 132), 64);
  a.num_heads = 32;
  a.num_kv_heads = 8;
  a.n = 9;
  EXPECT_EQ(ck::SplitKAttentionWorkspaceBytes(a, 5),
            sizeof(float) * 5 * 9 * 32 * (128 + 2));
  a.num_kv_heads = 5;  // does not divide num_heads
  EXPECT_EQ(ck::SplitKAttentionSplits(a, 132), 1);
}

TEST(CudaHostTest, FactoriesValidateBeforeAllocating) {
  const ModelConfig c = SmallConfig();
  EXPECT_EQ(CudaQueryCapture::Create(c, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // kv heads must divide heads; pool kernel must be odd; head_dim <= 256.
  EXPECT_EQ(CudaImportance::Create(10, 1, 6, 4, 8, 2, ScoringOptions())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  ScoringOptions even;
  even.pool_kernel_size = 4;
  EXPECT_EQ(CudaImportance::Create(10, 1, 4, 2, 8, 2, even).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaImportance::Create(10, 1, 4, 2, 512, 2, ScoringOptions())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaImportance::Create(0, 1, 4, 2, 8, 2, ScoringOptions())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  ModelWeights w;
  w.config = c;  // no layers
  EXPECT_EQ(CudaWeights::Upload(w, CudaDType::kF32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaWeights::Upload(w, CudaDType::kBF16).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaWeights::Load("models/stories260K", CudaDType::kF32)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaModelRunner::Create(nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The device pool stores K and V in the weights' dtype: half the CPU
// runner's fp32 bytes per token at bf16 / fp16 (what admission charges).
TEST(CudaHostTest, BytesPerTokenFollowTheDType) {
  const ModelConfig c = SmallConfig();
  // 3 layers x (K + V) x 2 kv heads x 16 dims x 2 bytes.
  EXPECT_EQ(CudaModelRunner::BytesPerToken(c, CudaDType::kBF16), 384u);
  EXPECT_EQ(CudaModelRunner::BytesPerToken(c, CudaDType::kBF16),
            CpuModelRunner::BytesPerToken(c) / 2);
  EXPECT_EQ(CudaModelRunner::BytesPerToken(c, CudaDType::kFP16),
            CudaModelRunner::BytesPerToken(c, CudaDType::kBF16));
  EXPECT_EQ(CudaModelRunner::BytesPerToken(c, CudaDType::kF32),
            CpuModelRunner::BytesPerToken(c));
}

// `n` bytes at device address `dev`.
std::vector<uint8_t> DeviceBytes(const void* dev, size_t n) {
  std::vector<uint8_t> host(n);
  EXPECT_CUDA_OK(cudaMemcpy(host.data(), dev, n, cudaMemcpyDeviceToHost));
  return host;
}

// Load (file -> device) equals Upload of LoadModelWeights bit for bit, for
// every tensor: the copy-as-stored path (a bf16 checkpoint on bf16) and the
// widen-and-convert path (fp32 checkpoint; bf16 on fp16), tied and untied.
TEST_F(CudaTest, LoadEqualsUploadOfHostWeights) {
  ModelConfig untied = *PresetConfig("llama3-tiny");
  untied.tie_word_embeddings = false;
  const std::string bf16_dir = ::testing::TempDir() + "/cuda_load_bf16";
  ASSERT_TRUE(WriteSyntheticCheckpointForConfig(untied, bf16_dir, seed_,
                                                DType::kBF16)
                  .ok());
  struct Case {
    std::string dir;
    CudaDType dt;
  } cases[] = {{bf16_dir, CudaDType::kBF16},
               {bf16_dir, CudaDType::kFP16},
               {"models/stories260K", CudaDType::kBF16},
               {"models/stories260K", CudaDType::kFP16}};
  for (const Case& k : cases) {
    SCOPED_TRACE(absl::StrCat(k.dir, " as ", CudaDTypeName(k.dt)));
    absl::StatusOr<ModelWeights> host = LoadModelWeights(k.dir);
    ASSERT_TRUE(host.ok()) << host.status();
    absl::StatusOr<std::shared_ptr<const CudaWeights>> want =
        CudaWeights::Upload(*host, k.dt);
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<std::shared_ptr<const CudaWeights>> got =
        CudaWeights::Load(k.dir, k.dt);
    ASSERT_TRUE(got.ok()) << got.status();
    const CudaWeights& a = **want;
    const CudaWeights& b = **got;
    const ModelConfig& c = a.config();
    EXPECT_EQ(b.bytes(), a.bytes());
    EXPECT_EQ(b.config().num_hidden_layers, c.num_hidden_layers);
    EXPECT_EQ(b.lm_head() == b.embed(), a.lm_head() == a.embed());
    const size_t w = CudaDTypeBytes(k.dt);
    const size_t hidden = c.hidden_size, ffn = c.intermediate_size;
    const size_t table = size_t{static_cast<size_t>(c.vocab_size)} * hidden;
    auto same = [&](const void* x, const void* y, size_t bytes,
                    const std::string& name) {
      EXPECT_TRUE(DeviceBytes(x, bytes) == DeviceBytes(y, bytes)) << name;
    };
    same(a.embed(), b.embed(), table * w, "embed");
    same(a.lm_head(), b.lm_head(), table * w, "lm_head");
    same(a.final_norm(), b.final_norm(), hidden * 4, "final_norm");
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const CudaLayerWeights& x = a.layer(l);
      const CudaLayerWeights& y = b.layer(l);
      const std::string p = absl::StrCat("layer ", l, " ");
      same(x.wqkv, y.wqkv, size_t(c.qkv_dim()) * hidden * w, p + "wqkv");
      same(x.wo, y.wo, hidden * c.num_attention_heads * c.head_dim * w,
           p + "wo");
      same(x.w_gate_up, y.w_gate_up, 2 * ffn * hidden * w, p + "w_gate_up");
      same(x.w_down, y.w_down, hidden * ffn * w, p + "w_down");
      same(x.attn_norm, y.attn_norm, hidden * 4, p + "attn_norm");
      same(x.mlp_norm, y.mlp_norm, hidden * 4, p + "mlp_norm");
    }
  }
  EXPECT_EQ(CudaWeights::Load("models/no-such-model", CudaDType::kBF16)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------
// Element-wise and row-wise kernels
// ---------------------------------------------------------------------------

TEST_F(CudaTest, ConvertRoundsToNearestEven) {
  for (CudaDType dt : {CudaDType::kBF16, CudaDType::kFP16}) {
    SCOPED_TRACE(CudaDTypeName(dt));
    std::vector<float> x = Normal(10007, 3.0f);
    // A few magnitudes far from 1 (fp16 keeps |x| < 65504).
    for (size_t i = 0; i < x.size(); i += 97) x[i] *= (i % 2 ? 1000.f : 1e-3f);
    DeviceBuffer dev = UploadAs(x, dt);
    const std::vector<float> back = Download(dev.get(), dt, x.size());
    const std::vector<float> want = Rounded(x, dt);
    size_t mismatches = 0;
    for (size_t i = 0; i < x.size(); ++i) mismatches += back[i] != want[i];
    EXPECT_EQ(mismatches, 0u);
    EXPECT_LT(RelErr(back, x), 1e-2);
  }
}

TEST_F(CudaTest, EmbeddingGatherMatchesCpu) {
  const int vocab = 1001, hidden = 300, n = 37;
  const std::vector<float> table = Rounded(Normal(static_cast<size_t>(vocab) * hidden),
                                           CudaDType::kBF16);
  std::vector<int> ids(n);
  for (int& id : ids) id = Uniform(0, vocab - 1);
  ids[5] = ids[9];  // a repeated token
  ids[0] = vocab - 1;
  DeviceBuffer d_table = UploadAs(table, CudaDType::kBF16);
  DeviceBuffer d_ids = Upload(ids);
  DeviceBuffer d_out = Poisoned(sizeof(float) * n * hidden);
  EXPECT_LAUNCH_OK(ck::EmbeddingGather(d_table.get(), CudaDType::kBF16,
                                       d_ids.as<int>(), n, hidden,
                                       d_out.as<float>(), nullptr));
  std::vector<float> ref(static_cast<size_t>(n) * hidden);
  for (int i = 0; i < n; ++i) {
    std::copy_n(&table[static_cast<size_t>(ids[i]) * hidden], hidden, &ref[static_cast<size_t>(i) * hidden]);
  }
  EXPECT_EQ(RelErr(Download(d_out.get(), CudaDType::kF32, ref.size()), ref),
            0.0);
}

TEST_F(CudaTest, RmsNormMatchesCpu) {
  for (int dim : {100, 2048, 4096}) {
    SCOPED_TRACE(dim);
    const int rows = 7;
    const float eps = 1e-5f;
    const std::vector<float> x = Normal(static_cast<size_t>(rows) * dim, 2.0f);
    const std::vector<float> w = Normal(dim, 0.3f, 1.0f);
    std::vector<float> ref(x.size());
    kernels::RmsNorm(x.data(), dim, w.data(), eps, rows, dim, ref.data(), dim);
    DeviceBuffer d_x = Upload(x), d_w = Upload(w);
    for (CudaDType dt : {CudaDType::kF32, CudaDType::kBF16}) {
      SCOPED_TRACE(CudaDTypeName(dt));
      DeviceBuffer d_out = Poisoned(x.size() * CudaDTypeBytes(dt));
      EXPECT_LAUNCH_OK(ck::RmsNorm(d_x.as<float>(), nullptr, rows, dim,
                                   d_w.as<float>(), eps, d_out.get(), dt,
                                   nullptr));
      const double err = RelErr(Download(d_out.get(), dt, x.size()), ref);
      EXPECT_LT(err, dt == CudaDType::kF32 ? 1e-5 : 1e-2);
    }
    // Gathered rows (the logit rows of the final norm), repeats allowed.
    const std::vector<int> pick = {5, 0, 5, 3};
    DeviceBuffer d_pick = Upload(pick);
    DeviceBuffer d_out = Poisoned(sizeof(float) * pick.size() * dim);
    EXPECT_LAUNCH_OK(ck::RmsNorm(d_x.as<float>(), d_pick.as<int>(),
                                 static_cast<int>(pick.size()), dim,
                                 d_w.as<float>(), eps, d_out.get(),
                                 CudaDType::kF32, nullptr));
    std::vector<float> ref_pick;
    for (int r : pick) {
      ref_pick.insert(ref_pick.end(), &ref[static_cast<size_t>(r) * dim],
                      &ref[static_cast<size_t>(r) * dim] + dim);
    }
    EXPECT_LT(RelErr(Download(d_out.get(), CudaDType::kF32, ref_pick.size()),
                     ref_pick),
              1e-5);
  }
}

TEST_F(CudaTest, RopeAtExplicitPositionsMatchesCpuAndStoresQkv) {
  struct Shape {
    int n, H, KV, D;
  };
  for (const Shape s : {Shape{13, 8, 2, 64}, Shape{5, 8, 4, 8},
                        Shape{3, 32, 8, 128}}) {
    SCOPED_TRACE(absl::StrCat("n=", s.n, " H=", s.H, " KV=", s.KV,
                              " D=", s.D));
    const int qkv_dim = (s.H + 2 * s.KV) * s.D, rw = s.KV * s.D;
    const double theta = 500000.0;
    const int first = 4, capacity = first + s.n + 3;
    const std::vector<float> qkv = Normal(static_cast<size_t>(s.n) * qkv_dim);
    std::vector<int> pos(s.n);
    for (int& p : pos) p = Uniform(0, 131071);  // any order, large values
    std::vector<float> ref = qkv;
    kernels::ApplyRope(ref.data(), qkv_dim, s.n, s.H + s.KV, s.D, pos.data(),
                       theta);
    for (const auto [dt, in_place] :
         {std::pair{CudaDType::kF32, true}, std::pair{CudaDType::kBF16, true},
          std::pair{CudaDType::kBF16, false}}) {
      SCOPED_TRACE(absl::StrCat(CudaDTypeName(dt),
                                in_place ? " in place" : " qkv read only"));
      const size_t tb = CudaDTypeBytes(dt);
      DeviceBuffer d_qkv = Upload(qkv), d_pos = Upload(pos);
      DeviceBuffer d_q = Poisoned(tb * s.n * s.H * s.D);
      DeviceBuffer d_k = Poisoned(tb * capacity * rw);
      DeviceBuffer d_v = Poisoned(tb * capacity * rw);
      ck::RopeArgs a;
      a.qkv = d_qkv.as<float>();
      a.n = s.n;
      a.num_heads = s.H;
      a.num_kv_heads = s.KV;
      a.head_dim = s.D;
      a.positions = d_pos.as<int>();
      a.theta = theta;
      a.q_out = d_q.get();
      a.k_cache = d_k.get();
      a.v_cache = d_v.get();
      a.cache_first = first;
      a.dtype = dt;
      a.rotate_in_place = in_place;
      EXPECT_LAUNCH_OK(ck::RopeQkvStore(a, nullptr));
      if (in_place) {  // fp32: the CPU rotation to fp32 rounding
        EXPECT_LT(RelErr(Download(d_qkv.get(), CudaDType::kF32, qkv.size()),
                         ref),
                  1e-5);
      } else {
        EXPECT_EQ(Download(d_qkv.get(), CudaDType::kF32, qkv.size()), qkv);
      }
      std::vector<float> ref_q, ref_k, ref_v;
      for (int i = 0; i < s.n; ++i) {
        const float* row = &ref[static_cast<size_t>(i) * qkv_dim];
        ref_q.insert(ref_q.end(), row, row + s.H * s.D);
        ref_k.insert(ref_k.end(), row + s.H * s.D, row + (s.H + s.KV) * s.D);
        ref_v.insert(ref_v.end(), row + (s.H + s.KV) * s.D, row + qkv_dim);
      }
      const double tol = dt == CudaDType::kF32 ? 1e-5 : 1e-2;
      EXPECT_LT(RelErr(Download(d_q.get(), dt, ref_q.size()), ref_q), tol);
      const std::vector<float> k = Download(d_k.get(), dt, static_cast<size_t>(capacity) * rw);
      const std::vector<float> v = Download(d_v.get(), dt, static_cast<size_t>(capacity) * rw);
      EXPECT_LT(RelErr(std::vector<float>(k.begin() + first * rw,
                                          k.begin() + (first + s.n) * rw),
                       ref_k),
                tol);
      EXPECT_LT(RelErr(std::vector<float>(v.begin() + first * rw,
                                          v.begin() + (first + s.n) * rw),
                       ref_v),
                tol);
      // Slots outside [first, first + n) are untouched (still poison).
      for (int slot : {0, first - 1, first + s.n, capacity - 1}) {
        EXPECT_TRUE(std::isnan(k[static_cast<size_t>(slot) * rw])) << "slot " << slot;
        EXPECT_TRUE(std::isnan(v[static_cast<size_t>(slot) * rw])) << "slot " << slot;
      }
    }
  }
}

// Scaled frequencies (llama3 / yarn rope_scaling) and YaRN's attention
// factor: the same rotation as the CPU kernel given the same inv_freq.
TEST_F(CudaTest, RopeWithInvFreqAndAttentionFactorMatchesCpu) {
  const int n = 7, H = 4, KV = 2, D = 32;
  const int qkv_dim = (H + 2 * KV) * D;
  const std::vector<float> qkv = Normal(static_cast<size_t>(n) * qkv_dim);
  std::vector<int> pos(n);
  for (int& p : pos) p = Uniform(0, 131071);
  std::vector<double> inv_freq(D / 2);
  for (int i = 0; i < D / 2; ++i) {
    inv_freq[i] = std::pow(500000.0, -2.0 * i / D) / (i % 3 == 0 ? 8.0 : 1.0);
  }
  const double factor = 1.1386;
  std::vector<float> ref = qkv;
  kernels::ApplyRope(ref.data(), qkv_dim, n, H + KV, D, pos.data(),
                     inv_freq.data(), factor);
  DeviceBuffer d_qkv = Upload(qkv), d_pos = Upload(pos);
  DeviceBuffer d_freq = Upload(inv_freq);
  ck::RopeArgs a;
  a.qkv = d_qkv.as<float>();
  a.n = n;
  a.num_heads = H;
  a.num_kv_heads = KV;
  a.head_dim = D;
  a.positions = d_pos.as<int>();
  a.inv_freq = d_freq.as<double>();
  a.attention_factor = factor;
  a.dtype = CudaDType::kF32;
  EXPECT_LAUNCH_OK(ck::RopeQkvStore(a, nullptr));
  EXPECT_LT(RelErr(Download(d_qkv.get(), CudaDType::kF32, qkv.size()), ref),
            1e-5);
}

TEST_F(CudaTest, AddBiasAndHeadRmsNormMatchCpu) {
  const int n = 9, H = 8, KV = 2, D = 128;
  const int qkv_dim = (H + 2 * KV) * D;
  const std::vector<float> qkv = Normal(static_cast<size_t>(n) * qkv_dim);
  const std::vector<float> bias = Normal(qkv_dim);
  const std::vector<float> qw = Normal(D), kw = Normal(D);
  std::vector<float> ref = qkv;
  kernels::AddBias(ref.data(), qkv_dim, n, qkv_dim, bias.data());
  for (int t = 0; t < n; ++t) {
    float* row = &ref[static_cast<size_t>(t) * qkv_dim];
    kernels::RmsNorm(row, D, qw.data(), 1e-6f, H, D, row, D);
    kernels::RmsNorm(row + H * D, D, kw.data(), 1e-6f, KV, D, row + H * D, D);
  }
  DeviceBuffer d_qkv = Upload(qkv), d_bias = Upload(bias);
  DeviceBuffer d_qw = Upload(qw), d_kw = Upload(kw);
  EXPECT_LAUNCH_OK(ck::AddBias(d_qkv.as<float>(), qkv_dim, n, qkv_dim,
                               d_bias.as<float>(), nullptr));
  EXPECT_LAUNCH_OK(ck::HeadRmsNorm(d_qkv.as<float>(), n, H, KV, D,
                                   d_qw.as<float>(), d_kw.as<float>(), 1e-6f,
                                   nullptr));
  const std::vector<float> got =
      Download(d_qkv.get(), CudaDType::kF32, qkv.size());
  EXPECT_LT(RelErr(got, ref), 1e-5);
  // v heads: bias added, not normalised.
  for (int t = 0; t < n; ++t) {
    const size_t v0 = static_cast<size_t>(t) * qkv_dim + (H + KV) * D;
    EXPECT_FLOAT_EQ(got[v0], qkv[v0] + bias[(H + KV) * D]);
  }
  EXPECT_EQ(ck::AddBias(d_qkv.as<float>(), 4, n, 8, d_bias.as<float>(),
                        nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::HeadRmsNorm(nullptr, n, H, KV, D, d_qw.as<float>(),
                            d_kw.as<float>(), 1e-6f, nullptr),
            cudaErrorInvalidValue);
}

// A paged cache: row i's K and V land at physical row slots[i] (any order,
// anywhere in the pool) and no other row is written.
TEST_F(CudaTest, RopeStoresIntoPagedSlots) {
  const int n = 11, H = 4, KV = 2, D = 16, pool_rows = 64;
  const int qkv_dim = (H + 2 * KV) * D, rw = KV * D;
  const std::vector<float> qkv = Normal(static_cast<size_t>(n) * qkv_dim);
  std::vector<int> pos(n), rows(pool_rows);
  for (int& p : pos) p = Uniform(0, 4095);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng_);
  const std::vector<int> slots(rows.begin(), rows.begin() + n);
  std::vector<float> ref = qkv;
  kernels::ApplyRope(ref.data(), qkv_dim, n, H + KV, D, pos.data(), 10000.0);
  const CudaDType dt = CudaDType::kBF16;
  const size_t tb = CudaDTypeBytes(dt);
  DeviceBuffer d_qkv = Upload(qkv), d_pos = Upload(pos);
  DeviceBuffer d_slots = Upload(slots);
  DeviceBuffer d_q = Poisoned(tb * n * H * D);
  DeviceBuffer d_k = Poisoned(tb * pool_rows * rw);
  DeviceBuffer d_v = Poisoned(tb * pool_rows * rw);
  ck::RopeArgs a;
  a.qkv = d_qkv.as<float>();
  a.n = n;
  a.num_heads = H;
  a.num_kv_heads = KV;
  a.head_dim = D;
  a.positions = d_pos.as<int>();
  a.theta = 10000.0;
  a.q_out = d_q.get();
  a.k_cache = d_k.get();
  a.v_cache = d_v.get();
  a.cache_first = 1000;  // ignored when slots are given
  a.slots = d_slots.as<int>();
  a.dtype = dt;
  EXPECT_LAUNCH_OK(ck::RopeQkvStore(a, nullptr));
  const size_t pool_elems = static_cast<size_t>(pool_rows) * rw;
  const std::vector<float> k = Download(d_k.get(), dt, pool_elems);
  const std::vector<float> v = Download(d_v.get(), dt, pool_elems);
  std::vector<float> got_k, got_v, ref_k, ref_v;
  for (int i = 0; i < n; ++i) {
    const float* row = &ref[static_cast<size_t>(i) * qkv_dim];
    ref_k.insert(ref_k.end(), row + H * D, row + (H + KV) * D);
    ref_v.insert(ref_v.end(), row + (H + KV) * D, row + qkv_dim);
    const size_t at = static_cast<size_t>(slots[i]) * rw;
    got_k.insert(got_k.end(), k.begin() + at, k.begin() + at + rw);
    got_v.insert(got_v.end(), v.begin() + at, v.begin() + at + rw);
  }
  EXPECT_LT(RelErr(got_k, ref_k), 1e-2);
  EXPECT_LT(RelErr(got_v, ref_v), 1e-2);
  for (int r = n; r < pool_rows; ++r) {  // rows no token maps to
    const size_t at = static_cast<size_t>(rows[r]) * rw;
    EXPECT_TRUE(std::isnan(k[at])) << "row " << rows[r];
    EXPECT_TRUE(std::isnan(v[at])) << "row " << rows[r];
  }
}

TEST_F(CudaTest, GatherKvRowsFollowsTheBlockTable) {
  const int rw = 40, bs = 4, pool_blocks = 9, count = 14;  // 3.5 blocks
  std::vector<int> table(pool_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng_);
  table.resize(PagedKvCache::BlocksForTokens(count, bs));
  DeviceBuffer d_table = Upload(table);
  for (CudaDType dt : {CudaDType::kF32, CudaDType::kBF16}) {
    SCOPED_TRACE(CudaDTypeName(dt));
    const std::vector<float> pool =
        Rounded(Normal(static_cast<size_t>(pool_blocks) * bs * rw), dt);
    std::vector<float> ref;
    for (int t = 0; t < count; ++t) {
      const size_t row = static_cast<size_t>(table[t / bs]) * bs + t % bs;
      ref.insert(ref.end(), pool.begin() + row * rw,
                 pool.begin() + (row + 1) * rw);
    }
    DeviceBuffer d_pool = UploadAs(pool, dt);
    // One row more than gathered: it must stay poisoned.
    DeviceBuffer d_dst = Poisoned(CudaDTypeBytes(dt) * (count + 1) * rw);
    EXPECT_LAUNCH_OK(ck::GatherKvRows(d_pool.get(), dt, d_table.as<int>(), bs,
                                      count, rw, d_dst.get(), nullptr));
    std::vector<float> got =
        Download(d_dst.get(), dt, static_cast<size_t>(count + 1) * rw);
    EXPECT_TRUE(std::isnan(got[static_cast<size_t>(count) * rw]));
    got.resize(ref.size());
    EXPECT_EQ(RelErr(got, ref), 0.0);
  }
}

// Greedy's argmax on the device follows specserve::Argmax: ties to the
// lowest id, NaN never wins (all NaN: 0), -inf is an ordinary value; rows
// shorter and longer than a block, and a 128K vocabulary.
TEST_F(CudaTest, ArgmaxRowsFollowsHostArgmax) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (int vocab : {1, 37, 256, 1000, 128256}) {
    SCOPED_TRACE(vocab);
    const int rows = 7;
    std::vector<float> x(static_cast<size_t>(rows) * vocab);
    for (float& v : x) v = std::round(4.f * Normal(1)[0]);  // many ties
    float* r = x.data();
    r[vocab - 1] = 1e9f;                                 // row 0: the last id
    std::fill(r + vocab, r + 2 * vocab, nan);            // row 1: all NaN
    std::fill(r + 2 * vocab, r + 3 * vocab, -inf);       // row 2: all -inf
    r[3 * vocab + vocab / 2] = nan;                      // row 3: one NaN
    std::fill(r + 4 * vocab, r + 5 * vocab, 2.f);        // row 4: all tied
    std::vector<int> want(rows);
    for (int i = 0; i < rows; ++i) {
      int best = 0;
      float bv = nan;
      for (int j = 0; j < vocab; ++j) {
        const float v = r[static_cast<size_t>(i) * vocab + j];
        if (std::isnan(v)) continue;
        if (std::isnan(bv) || v > bv) bv = v, best = j;
      }
      want[i] = best;
    }
    EXPECT_EQ(want[1], 0);
    EXPECT_EQ(want[4], 0);
    DeviceBuffer d_x = Upload(x);
    DeviceBuffer d_out = Upload(std::vector<int>(rows, -1));
    EXPECT_LAUNCH_OK(ck::ArgmaxRows(d_x.as<float>(), rows, vocab,
                                    d_out.as<int>(), nullptr));
    std::vector<int> got(rows);
    EXPECT_CUDA_OK(cudaMemcpy(got.data(), d_out.get(), rows * sizeof(int),
                              cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, want);
  }
  EXPECT_EQ(ck::ArgmaxRows(nullptr, 1, 0, nullptr, nullptr),
            cudaErrorInvalidValue);
}

// Widths that take 16-byte packs (1000 and an 8B model's 14,336, which
// needs several column blocks a row) and one that does not (1003: every
// row after the first starts off 16 bytes), for each storage type.
TEST_F(CudaTest, SiluMulMatchesCpu) {
  for (const int ffn : {1000, 1003, 14336}) {
    const int rows = ffn > 2000 ? 3 : 5;
    const std::vector<float> gu =
        Normal(static_cast<size_t>(rows) * 2 * ffn, 2.0f);
    for (CudaDType dt : {CudaDType::kF32, CudaDType::kBF16, CudaDType::kFP16}) {
      SCOPED_TRACE(absl::StrCat(CudaDTypeName(dt), " ffn ", ffn));
      const std::vector<float> in = Rounded(gu, dt);
      std::vector<float> ref(static_cast<size_t>(rows) * ffn);
      kernels::SiluMul(in.data(), rows, ffn, ref.data());
      DeviceBuffer d_gu = UploadAs(in, dt);
      DeviceBuffer d_out = Poisoned(ref.size() * CudaDTypeBytes(dt));
      EXPECT_LAUNCH_OK(
          ck::SiluMul(d_gu.get(), rows, ffn, d_out.get(), dt, nullptr));
      EXPECT_LT(RelErr(Download(d_out.get(), dt, ref.size()), ref),
                dt == CudaDType::kF32 ? 1e-5 : 1e-2);
    }
  }
}

// ---------------------------------------------------------------------------
// Projections (cuBLAS)
// ---------------------------------------------------------------------------

class CublasTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cublasCreate(&handle_), CUBLAS_STATUS_SUCCESS);
  }
  void TearDown() override {
    if (handle_ != nullptr) cublasDestroy(handle_);
  }
  cublasHandle_t handle_ = nullptr;
};

TEST_F(CublasTest, LinearMatchesCpuSgemm) {
  const int in = 512, out = 384;
  for (int n : {1, 5, 77}) {
    for (CudaDType dt : {CudaDType::kF32, CudaDType::kBF16, CudaDType::kFP16}) {
      for (float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE(absl::StrCat("n=", n, " ", CudaDTypeName(dt),
                                  " beta=", beta));
        // Operands rounded on the host: the CPU then multiplies exactly the
        // values the GPU holds, and both accumulate in fp32.
        const std::vector<float> x = Rounded(Normal(static_cast<size_t>(n) * in), dt);
        const std::vector<float> w = Rounded(Normal(static_cast<size_t>(out) * in, 0.05f), dt);
        const std::vector<float> y0 = Normal(static_cast<size_t>(n) * out);
        std::vector<float> ref = y0;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f,
                    x.data(), in, w.data(), in, beta, ref.data(), out);
        DeviceBuffer d_x = UploadAs(x, dt), d_w = UploadAs(w, dt);
        DeviceBuffer d_y = beta != 0.0f ? Upload(y0)
                                        : Poisoned(sizeof(float) * y0.size());
        ASSERT_OK(CublasLinear(handle_, dt, d_x.get(), n, in, d_w.get(), out,
                               d_y.get(), CudaDType::kF32, beta));
        EXPECT_CUDA_OK(cudaDeviceSynchronize());
        EXPECT_CUDA_OK(cudaGetLastError());
        EXPECT_LT(RelErr(Download(d_y.get(), CudaDType::kF32, ref.size()), ref),
                  1e-5);
        if (dt != CudaDType::kF32 && beta == 0.0f) {
          // 16-bit output: one more rounding.
          DeviceBuffer d_y16 = Poisoned(CudaDTypeBytes(dt) * ref.size());
          ASSERT_OK(CublasLinear(handle_, dt, d_x.get(), n, in, d_w.get(), out,
                                 d_y16.get(), dt, 0.0f));
          EXPECT_LT(RelErr(Download(d_y16.get(), dt, ref.size()), ref), 1e-2);
        }
      }
    }
  }
  // Mismatched dtypes are rejected before cuBLAS sees them.
  EXPECT_EQ(CublasLinear(handle_, CudaDType::kBF16, nullptr, 1, 1, nullptr, 1,
                         nullptr, CudaDType::kFP16, 0.0f)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

// Causal GQA attention over the cache order, in double: row i (slot
// first + i) attends to slots [0, first + i]. q [n, H, D], k / v
// [first + n, KV, D]; out [n, H * D].
std::vector<float> ReferenceAttention(const std::vector<float>& q,
                                      const std::vector<float>& k,
                                      const std::vector<float>& v, int n,
                                      int first, int H, int KV, int D) {
  const int group = H / KV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<float> out(static_cast<size_t>(n) * H * D);
  std::vector<double> s;
  for (int i = 0; i < n; ++i) {
    const int visible = first + i + 1;
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const float* qr = &q[(static_cast<size_t>(i) * H + h) * D];
      s.assign(visible, 0.0);
      double mx = -1e300;
      for (int j = 0; j < visible; ++j) {
        const float* kr = &k[(static_cast<size_t>(j) * KV + g) * D];
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += double{qr[d]} * kr[d];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int d = 0; d < D; ++d) {
        double o = 0;
        for (int j = 0; j < visible; ++j) {
          o += s[j] * v[(static_cast<size_t>(j) * KV + g) * D + d];
        }
        out[(static_cast<size_t>(i) * H + h) * D + d] = static_cast<float>(o / sum);
      }
    }
  }
  return out;
}

struct AttnCase {
  int n, first, H, KV, D;
};

class AttentionTest : public CudaTest {
 protected:
  // Runs one case through `path` ("flash" or "splitk:<splits>", splits 0 =
  // SplitKAttentionSplits) and returns the relative error vs the reference.
  // block_size > 0: the keys and values sit in a paged pool, in shuffled
  // blocks of that many tokens among unused blocks, and every pool row no
  // slot maps to is NaN (reading one would show).
  double Run(const AttnCase& c, CudaDType dt, const std::string& path,
             int block_size = 0) {
    const int total = c.first + c.n;
    const size_t rw = static_cast<size_t>(c.KV) * c.D;
    // Scaled so that softmaxes are peaky enough for masking to matter.
    const std::vector<float> q = Rounded(Normal(static_cast<size_t>(c.n) * c.H * c.D, 2.0f), dt);
    const std::vector<float> k = Rounded(Normal(total * rw), dt);
    const std::vector<float> v = Rounded(Normal(total * rw), dt);
    const std::vector<float> ref =
        ReferenceAttention(q, k, v, c.n, c.first, c.H, c.KV, c.D);
    std::vector<float> k_pool = k, v_pool = v;
    std::vector<int> table;
    if (block_size > 0) {
      const int used = PagedKvCache::BlocksForTokens(total, block_size);
      const int pool_blocks = 2 * used + 1;
      table.resize(pool_blocks);
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), rng_);
      table.resize(used);
      const size_t pool_rows = static_cast<size_t>(pool_blocks) * block_size;
      k_pool.assign(pool_rows * rw, std::numeric_limits<float>::quiet_NaN());
      v_pool = k_pool;
      for (int t = 0; t < total; ++t) {
        const size_t row =
            static_cast<size_t>(table[t / block_size]) * block_size +
            t % block_size;
        std::copy_n(&k[t * rw], rw, &k_pool[row * rw]);
        std::copy_n(&v[t * rw], rw, &v_pool[row * rw]);
      }
    }
    DeviceBuffer d_q = UploadAs(q, dt), d_k = UploadAs(k_pool, dt),
                 d_v = UploadAs(v_pool, dt);
    DeviceBuffer d_table = block_size > 0 ? Upload(table) : DeviceBuffer();
    DeviceBuffer d_out = Poisoned(ref.size() * CudaDTypeBytes(dt));
    ck::AttentionArgs a;
    a.q = d_q.get();
    a.k_cache = d_k.get();
    a.v_cache = d_v.get();
    if (block_size > 0) {
      a.block_table = d_table.as<int>();
      a.block_size = block_size;
    }
    a.out = d_out.get();
    a.dtype = dt;
    a.n = c.n;
    a.first = c.first;
    a.num_heads = c.H;
    a.num_kv_heads = c.KV;
    a.head_dim = c.D;
    a.scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    if (path == "flash") {
      EXPECT_LAUNCH_OK(ck::FlashAttention(a, nullptr));
    } else {
      int splits = std::atoi(path.substr(7).c_str());
      if (splits == 0) {
        int sms = 0;
        EXPECT_CUDA_OK(
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        splits = ck::SplitKAttentionSplits(a, sms);
      }
      DeviceBuffer ws = Poisoned(ck::SplitKAttentionWorkspaceBytes(a, splits));
      EXPECT_LAUNCH_OK(ck::SplitKAttention(a, splits, ws.get(), nullptr));
    }
    return RelErr(Download(d_out.get(), dt, ref.size()), ref);
  }
};

TEST_F(AttentionTest, SplitKFp32MatchesReference) {
  for (const AttnCase c : {AttnCase{1, 700, 8, 2, 64},     // decode
                           AttnCase{9, 300, 32, 8, 128},   // verify round
                           AttnCase{70, 0, 6, 2, 8},       // tiny head_dim
                           AttnCase{40, 13, 4, 4, 16},     // no GQA
                           AttnCase{3, 50, 4, 1, 256}}) {  // large head_dim
    for (const std::string path : {"splitk:1", "splitk:0", "splitk:7"}) {
      SCOPED_TRACE(absl::StrCat(path, " n=", c.n, " first=", c.first, " H=",
                                c.H, " KV=", c.KV, " D=", c.D));
      EXPECT_LT(Run(c, CudaDType::kF32, path), 1e-5);
    }
  }
}

TEST_F(AttentionTest, SplitKBf16MatchesReference) {
  for (const AttnCase c : {AttnCase{1, 4000, 32, 8, 128},
                           AttnCase{6, 1000, 32, 8, 64},
                           AttnCase{100, 20, 8, 4, 8}}) {
    SCOPED_TRACE(absl::StrCat("n=", c.n, " first=", c.first, " D=", c.D));
    EXPECT_LT(Run(c, CudaDType::kBF16, "splitk:0"), 1e-2);
  }
}

TEST_F(AttentionTest, FlashMatchesReference) {
  for (const AttnCase c : {AttnCase{200, 0, 4, 2, 16},
                           AttnCase{150, 77, 8, 1, 32},
                           AttnCase{64, 0, 4, 4, 64},
                           AttnCase{333, 40, 8, 2, 64},
                           AttnCase{130, 0, 4, 1, 128},
                           AttnCase{7, 500, 8, 2, 128}}) {
    for (CudaDType dt : {CudaDType::kBF16, CudaDType::kFP16}) {
      SCOPED_TRACE(absl::StrCat(CudaDTypeName(dt), " n=", c.n, " first=",
                                c.first, " H=", c.H, " KV=", c.KV,
                                " D=", c.D));
      EXPECT_LT(Run(c, dt, "flash"), 1e-2);
    }
  }
}

// Both kernels over a paged cache (PagedAttention): logical slot t read
// from block_table[t / block_size]; block sizes 1 (every token its own
// block), 16 (the runner's default) and 7 (blocks straddle the kernels'
// key tiles).
TEST_F(AttentionTest, PagedCacheMatchesReference) {
  for (const int bs : {1, 7, 16}) {
    for (const AttnCase c : {AttnCase{1, 300, 8, 2, 64},
                             AttnCase{5, 90, 8, 4, 128},
                             AttnCase{70, 33, 4, 2, 16}}) {
      SCOPED_TRACE(absl::StrCat("block_size=", bs, " n=", c.n, " first=",
                                c.first, " D=", c.D));
      EXPECT_LT(Run(c, CudaDType::kF32, "splitk:0", bs), 1e-5);
      EXPECT_LT(Run(c, CudaDType::kBF16, "splitk:3", bs), 1e-2);
      EXPECT_LT(Run(c, CudaDType::kBF16, "flash", bs), 1e-2);
    }
  }
}

// ---------------------------------------------------------------------------
// The batched launch (one per layer for every sequence of a step) against
// today's per-sequence kernels and the float64 reference
// ---------------------------------------------------------------------------

struct BatchSeq {
  int n, first;
};

// Device copies of a BatchedAttentionPlan's arrays and split workspace
// (poisoned), kept alive for the launches PlanArgs describes.
struct DevicePlan {
  DeviceBuffer info, work, combine, workspace;
};

// The arguments of one BatchedAttention launch of `plan` over q [rows, H,
// D], the paged K / V pools and the concatenated block tables, uploading
// the plan into *dev; scale 1 / sqrt(D).
ck::BatchedAttentionArgs PlanArgs(const ck::BatchedAttentionPlan& plan, int H,
                                  int KV, int D, CudaDType dt, int block_size,
                                  const void* q, const void* k, const void* v,
                                  void* out, const int* tables,
                                  DevicePlan* dev) {
  dev->info = Upload(plan.seq_info);
  dev->work = Upload(plan.work);
  dev->combine = plan.combine.empty() ? DeviceBuffer() : Upload(plan.combine);
  const size_t ws = ck::BatchedAttentionWorkspaceBytes(plan, D);
  dev->workspace = ws > 0 ? Poisoned(ws) : DeviceBuffer();
  ck::BatchedAttentionArgs a;
  a.q = q;
  a.k_cache = k;
  a.v_cache = v;
  a.out = out;
  a.dtype = dt;
  a.num_heads = H;
  a.num_kv_heads = KV;
  a.head_dim = D;
  a.scale = 1.0f / std::sqrt(static_cast<float>(D));
  a.block_tables = tables;
  a.block_size = block_size;
  a.seq_info = dev->info.as<int>();
  a.work = dev->work.as<int>();
  a.num_work = plan.num_work();
  a.combine = dev->combine.as<int>();
  a.num_combine = plan.num_combine();
  a.workspace = dev->workspace.get();
  a.partial_triples = plan.partial_triples;
  return a;
}

class BatchedAttentionTest : public CudaTest {
 protected:
  // Runs `seqs` through one BatchedAttention launch planned for `num_sms`
  // (0: the device's count) over a shared paged pool whose blocks are
  // shuffled and dealt to the sequences interleaved (and every pool row no
  // slot maps to is NaN), and checks each sequence's rows against
  // SplitKAttention on the same pool and table (`tol_kernel`) and against
  // ReferenceAttention (`tol_ref`). Returns the number of split sequences.
  int Check(const std::vector<BatchSeq>& seqs, int H, int KV, int D,
            CudaDType dt, int block_size, int num_sms, double tol_kernel,
            double tol_ref) {
    int device_sms = 0;
    EXPECT_CUDA_OK(
        cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, 0));
    const int S = static_cast<int>(seqs.size());
    const size_t rw = static_cast<size_t>(KV) * D;
    const size_t qw = static_cast<size_t>(H) * D;
    // Blocks of all sequences, dealt round-robin from a shuffled pool so
    // that neighbouring physical blocks belong to different sequences.
    std::vector<int> need(S);
    int used = 0;
    for (int i = 0; i < S; ++i) {
      need[i] =
          PagedKvCache::BlocksForTokens(seqs[i].first + seqs[i].n, block_size);
      used += need[i];
    }
    const int pool_blocks = used + 5;
    std::vector<int> ids(pool_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng_);
    std::vector<std::vector<int>> tables(S);
    for (int next = 0, round = 0; next < used; ++round) {
      for (int i = 0; i < S; ++i) {
        if (round < need[i]) tables[i].push_back(ids[next++]);
      }
    }
    const size_t pool_rows = static_cast<size_t>(pool_blocks) * block_size;
    std::vector<float> k_pool(pool_rows * rw,
                              std::numeric_limits<float>::quiet_NaN());
    std::vector<float> v_pool = k_pool;
    std::vector<float> q_all;
    std::vector<std::vector<float>> refs(S);
    std::vector<int> all_tables;
    std::vector<ck::AttentionSequence> plan_seqs;
    for (int i = 0; i < S; ++i) {
      const int total = seqs[i].first + seqs[i].n;
      const std::vector<float> q =
          Rounded(Normal(static_cast<size_t>(seqs[i].n) * qw, 2.0f), dt);
      const std::vector<float> k = Rounded(Normal(total * rw), dt);
      const std::vector<float> v = Rounded(Normal(total * rw), dt);
      refs[i] = ReferenceAttention(q, k, v, seqs[i].n, seqs[i].first, H, KV, D);
      for (int t = 0; t < total; ++t) {
        const size_t row =
            static_cast<size_t>(tables[i][t / block_size]) * block_size +
            t % block_size;
        std::copy_n(&k[t * rw], rw, &k_pool[row * rw]);
        std::copy_n(&v[t * rw], rw, &v_pool[row * rw]);
      }
      q_all.insert(q_all.end(), q.begin(), q.end());
      plan_seqs.push_back(
          {seqs[i].n, seqs[i].first, static_cast<int>(all_tables.size())});
      all_tables.insert(all_tables.end(), tables[i].begin(), tables[i].end());
    }
    absl::StatusOr<ck::BatchedAttentionPlan> plan = ck::PlanBatchedAttention(
        plan_seqs, H, KV, num_sms > 0 ? num_sms : device_sms);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) return -1;
    const int rows = plan->total_rows;
    DeviceBuffer d_q = UploadAs(q_all, dt), d_k = UploadAs(k_pool, dt),
                 d_v = UploadAs(v_pool, dt);
    DeviceBuffer d_tables = Upload(all_tables);
    DeviceBuffer d_out =
        Poisoned(static_cast<size_t>(rows) * qw * CudaDTypeBytes(dt));
    DevicePlan dev;
    const ck::BatchedAttentionArgs a =
        PlanArgs(*plan, H, KV, D, dt, block_size, d_q.get(), d_k.get(),
                 d_v.get(), d_out.get(), d_tables.as<int>(), &dev);
    EXPECT_LAUNCH_OK(ck::BatchedAttention(a, nullptr));
    const std::vector<float> got = Download(d_out.get(), dt, rows * qw);

    int split_seqs = 0;
    for (int i = 0; i < S; ++i) {
      const int* info =
          plan->seq_info.data() + static_cast<size_t>(i) * ck::kSeqInfoFields;
      split_seqs += info[ck::kSeqSplits] > 1;
      // A sequence without rows has nothing to compare (and the
      // per-sequence kernels reject n = 0).
      if (seqs[i].n == 0) continue;
      SCOPED_TRACE(absl::StrCat("sequence ", i, ": n=", seqs[i].n,
                                " first=", seqs[i].first,
                                " splits=", info[ck::kSeqSplits]));
      // Today's per-sequence kernel on the same pool and block table.
      ck::AttentionArgs one;
      one.q =
          static_cast<const char*>(d_q.get()) +
          static_cast<size_t>(info[ck::kSeqRowStart]) * qw * CudaDTypeBytes(dt);
      one.k_cache = d_k.get();
      one.v_cache = d_v.get();
      one.block_table = d_tables.as<int>() + plan_seqs[i].table_start;
      one.block_size = block_size;
      one.dtype = dt;
      one.n = seqs[i].n;
      one.first = seqs[i].first;
      one.num_heads = H;
      one.num_kv_heads = KV;
      one.head_dim = D;
      one.scale = a.scale;
      DeviceBuffer d_one = Poisoned(refs[i].size() * CudaDTypeBytes(dt));
      one.out = d_one.get();
      const int splits = ck::SplitKAttentionSplits(one, device_sms);
      DeviceBuffer ws =
          Poisoned(ck::SplitKAttentionWorkspaceBytes(one, splits));
      EXPECT_LAUNCH_OK(ck::SplitKAttention(one, splits, ws.get(), nullptr));
      const std::vector<float> want = Download(d_one.get(), dt, refs[i].size());
      const std::vector<float> mine(
          got.begin() + static_cast<size_t>(info[ck::kSeqRowStart]) * qw,
          got.begin() +
              static_cast<size_t>(info[ck::kSeqRowStart] + seqs[i].n) * qw);
      EXPECT_LT(RelErr(mine, want), tol_kernel);
      EXPECT_LT(RelErr(mine, refs[i]), tol_ref);
    }
    return split_seqs;
  }
};

// A step of the continuous batcher: decode rows at different context
// lengths (a fresh sequence, short, long), a verify round (k = 4), a
// prefill chunk after a restored prefix (first > 0, its blocks scattered:
// the kernel sees cache order only; RoPE positions were applied upstream,
// see ModelTest.MixedBatchMatchesCpu for non-contiguous positions end to
// end), with the sequences' blocks interleaved in one pool.
std::vector<BatchSeq> MixedStep() {
  return {{1, 0}, {1, 37}, {1, 700}, {1, 3000}, {5, 200}, {70, 133}, {1, 129}};
}

TEST_F(BatchedAttentionTest, MixedStepFp32MatchesPerSequenceKernels) {
  for (const int D : {64, 128}) {
    // 1 SM: no splits; the device's count; 4096 SMs: every sequence splits.
    for (const int sms : {1, 0, 4096}) {
      SCOPED_TRACE(absl::StrCat("D=", D, " sms=", sms));
      const int split =
          Check(MixedStep(), 32, 8, D, CudaDType::kF32, 16, sms, 1e-5, 1e-5);
      if (sms == 1) {
        EXPECT_EQ(split, 0);
      }
      if (sms == 4096) {
        EXPECT_GE(split, 5);
      }
    }
  }
  // A head_dim that is not a multiple of 4: the scores take the scalar
  // loop, not the float4 one.
  SCOPED_TRACE("D=18");
  Check(MixedStep(), 32, 8, 18, CudaDType::kF32, 16, 0, 1e-5, 1e-5);
}

TEST_F(BatchedAttentionTest, MixedStepBf16MatchesPerSequenceKernels) {
  for (const int D : {64, 128}) {
    for (const int sms : {1, 0, 4096}) {
      SCOPED_TRACE(absl::StrCat("D=", D, " sms=", sms));
      Check(MixedStep(), 32, 8, D, CudaDType::kBF16, 16, sms, 1e-2, 1e-2);
    }
  }
  // A head_dim that is not a multiple of 8: K / V rows are not whole
  // 16-byte vectors, so the kernel loads them element by element.
  SCOPED_TRACE("D=36");
  Check(MixedStep(), 32, 8, 36, CudaDType::kBF16, 16, 0, 1e-2, 1e-2);
}

// Block sizes that straddle the key tiles (7) or give every token its own
// block (1); no GQA and 4:1 GQA.
TEST_F(BatchedAttentionTest, BlockSizesAndGroups) {
  const std::vector<BatchSeq> seqs = {{1, 300}, {9, 90}, {33, 5}, {1, 1}};
  for (const int bs : {1, 7}) {
    for (const int KV : {8, 2}) {
      SCOPED_TRACE(absl::StrCat("block_size=", bs, " KV=", KV));
      Check(seqs, 8, KV, 64, CudaDType::kF32, bs, 0, 1e-5, 1e-5);
      Check(seqs, 8, KV, 128, CudaDType::kBF16, bs, 4096, 1e-2, 1e-2);
    }
  }
}

// 64 decode streams (the issue's batch) at random contexts up to 4K, fp16.
TEST_F(BatchedAttentionTest, SixtyFourDecodeStreams) {
  std::vector<BatchSeq> seqs;
  for (int i = 0; i < 64; ++i) seqs.push_back({1, Uniform(0, 4000)});
  Check(seqs, 32, 8, 128, CudaDType::kFP16, 16, 0, 1e-2, 1e-2);
}

// An empty sequence in the batch (no rows this step) gets no blocks and
// does not disturb its neighbours.
TEST_F(BatchedAttentionTest, SequenceWithoutRows) {
  Check({{1, 50}, {0, 40}, {3, 10}}, 4, 2, 64, CudaDType::kF32, 16, 4096, 1e-5,
        1e-5);
}

// Prints the batched kernel's time and K / V read rate for one sequence's
// decode row (and a k = 4 verify round) over a long context, Llama 3's
// shapes (32 query heads over 8 kv heads, head_dim 128 and 64), blocks of
// 16 shuffled in the pool as a server's are, planned for the device's
// multiprocessors and for 2x and 4x as many (more, smaller splits). The
// decode step of a 32K context is bound by these reads: 134 MB a layer at
// head_dim 128. Values are not checked here (the tests above do).
TEST_F(CudaTest, ReportsTimeOfBatchedAttentionOverLongContexts) {
  int sms = 0;
  ASSERT_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  constexpr int kH = 32, kKV = 8, kBs = 16;
  const CudaDType dt = CudaDType::kBF16;
  for (const int D : {128, 64}) {
    for (const int ctx : {4096, 32768}) {
      for (const int rows : {1, 5}) {
        if (rows > 1 && (ctx != 32768 || D != 128)) continue;
        const int blocks = (ctx + rows + kBs - 1) / kBs;
        std::vector<int> table(blocks);
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), rng_);
        const size_t pool = static_cast<size_t>(blocks) * kBs * kKV * D;
        DeviceBuffer d_k = UploadAs(Normal(pool), dt);
        DeviceBuffer d_v = UploadAs(Normal(pool), dt);
        DeviceBuffer d_q =
            UploadAs(Normal(static_cast<size_t>(rows) * kH * D), dt);
        DeviceBuffer d_out = Poisoned(static_cast<size_t>(rows) * kH * D * 2);
        DeviceBuffer d_table = Upload(table);
        for (const int scale : {1, 2, 4}) {
          absl::StatusOr<ck::BatchedAttentionPlan> plan =
              ck::PlanBatchedAttention({{rows, ctx, 0}}, kH, kKV, scale * sms);
          ASSERT_TRUE(plan.ok()) << plan.status();
          DevicePlan dev;
          const ck::BatchedAttentionArgs a =
              PlanArgs(*plan, kH, kKV, D, dt, kBs, d_q.get(), d_k.get(),
                       d_v.get(), d_out.get(), d_table.as<int>(), &dev);
          for (int w = 0; w < 3; ++w) {
            EXPECT_LAUNCH_OK(ck::BatchedAttention(a, nullptr));
          }
          cudaEvent_t start, stop;
          ASSERT_CUDA_OK(cudaEventCreate(&start));
          ASSERT_CUDA_OK(cudaEventCreate(&stop));
          constexpr int kReps = 20;
          ASSERT_CUDA_OK(cudaEventRecord(start));
          for (int r = 0; r < kReps; ++r) {
            EXPECT_LAUNCH_OK(ck::BatchedAttention(a, nullptr));
          }
          ASSERT_CUDA_OK(cudaEventRecord(stop));
          ASSERT_CUDA_OK(cudaEventSynchronize(stop));
          float ms = 0.0f;
          ASSERT_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
          cudaEventDestroy(start);
          cudaEventDestroy(stop);
          const double us = 1e3 * ms / kReps;
          const double bytes = 2.0 * (ctx + rows) * kKV * D * 2;
          const int* info = plan->seq_info.data();
          std::printf(
              "batched attention D=%d context %d rows %d, planned for %d "
              "SMs: %d blocks (%d splits of %d keys): %.1f us, %.0f GB/s of "
              "K / V\n",
              D, ctx, rows, scale * sms, plan->num_work() * kKV,
              info[ck::kSeqSplits], info[ck::kSeqKeysPerSplit], us,
              bytes / us * 1e-3);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Speculative Prefill scoring kernels vs ImportanceAccumulator
// ---------------------------------------------------------------------------

// Relative distance from the selection threshold within which two chunk
// scores are the same number up to fp32 rounding (a few ulps): which of
// them ranks first is decided by the last bit of each side's summation
// order, not by the scores.
constexpr double kRoundingTieRel = 1e-6;

// The selections SelectTokens makes from importances `got` (device) and
// `want` (reference) at `keep` / `chunk` agree: the same chunks are kept,
// except chunks whose `want` score lies within `tie_rel` (relative) of the
// selection threshold (the lowest kept chunk score), where rounding may
// break a near-tie either way. Swaps among chunks tied to within fp32
// rounding (kRoundingTieRel) are free: inputs can tie structurally (a
// prompt shorter than the pooling window gives its middle tokens exactly
// 1 / pool_kernel_size each, whatever the logits). Of the other near-ties,
// no more than a fifth of the kept chunks (at least one) may differ.
void ExpectSelectionsAgree(const std::vector<float>& got,
                           const std::vector<float>& want, float keep,
                           int chunk, double tie_rel) {
  SCOPED_TRACE(absl::StrCat("keep ", keep, " chunk ", chunk));
  SelectionOptions opts;
  opts.keep_ratio = keep;
  opts.chunk_size = chunk;
  absl::StatusOr<Selection> g = SelectTokens(got, opts);
  absl::StatusOr<Selection> w = SelectTokens(want, opts);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(g->kept_chunks.size(), w->kept_chunks.size());
  ASSERT_FALSE(w->kept_chunks.empty());
  std::vector<float> sorted = w->chunk_scores;
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  const double threshold = sorted[w->kept_chunks.size() - 1];
  const std::set<int> gk(g->kept_chunks.begin(), g->kept_chunks.end());
  const std::set<int> wk(w->kept_chunks.begin(), w->kept_chunks.end());
  int differing = 0, near_ties = 0;
  for (int c = 0; c < static_cast<int>(w->chunk_scores.size()); ++c) {
    if (gk.count(c) == wk.count(c)) continue;
    ++differing;
    const double gap = std::abs(w->chunk_scores[c] - threshold);
    EXPECT_LE(gap, tie_rel * threshold)
        << "chunk " << c << " (score " << w->chunk_scores[c]
        << ", threshold " << threshold << ") kept by one side only";
    if (gap > kRoundingTieRel * threshold) ++near_ties;
  }
  // One near-tie swap is always possible (CI met one with 2 chunks kept:
  // a fifth of 2 would allow none).
  EXPECT_LE(near_ties, std::max(1, static_cast<int>(wk.size()) / 5))
      << near_ties << " chunks that are not rounding ties kept by one side "
      << "only (" << differing << " in all) of " << wk.size() << " kept";
  if (differing == 0) {
    EXPECT_EQ(g->kept_indices, w->kept_indices);
  }
}

// Both sides scored the same inputs in fp32 (differences ~1e-7 relative).
void ExpectSameSelection(const std::vector<float>& got,
                         const std::vector<float>& want) {
  for (float keep : {0.1f, 0.3f}) {
    for (int chunk : {1, 32}) {
      ExpectSelectionsAgree(got, want, keep, chunk, 1e-5);
    }
  }
}

// Host arithmetic: a dry run sizes what the same calls then carve.
TEST(DeviceCarverTest, DryRunSizesTheRegionsTheRealRunCarves) {
  EXPECT_EQ(AlignDeviceBytes(0), 0u);
  EXPECT_EQ(AlignDeviceBytes(1), 256u);
  EXPECT_EQ(AlignDeviceBytes(256), 256u);
  EXPECT_EQ(AlignDeviceBytes(257), 512u);
  DeviceCarver dry(nullptr);
  EXPECT_EQ(dry.Take(10), nullptr);
  EXPECT_EQ(dry.Take(0), nullptr);
  EXPECT_EQ(dry.Take(300), nullptr);
  EXPECT_EQ(dry.size(), 256u + 512u);
  alignas(256) static char base[1024];
  DeviceCarver real(base);
  EXPECT_EQ(real.Take(10), base);
  EXPECT_EQ(real.Take(0), base + 256);  // an empty region takes no room
  EXPECT_EQ(real.Take(300), base + 256);
  EXPECT_EQ(real.size(), dry.size());
  EXPECT_EQ(CudaImportance::ScratchBytes(1000, 9, 32),
            AlignDeviceBytes(4u * 9 * 1000 * 32) + AlignDeviceBytes(4u * 9 * 1000) +
                AlignDeviceBytes(4u * 1000));
}

TEST_F(CudaTest, ImportanceMatchesCpuAccumulator) {
  struct Case {
    int prompt_len, rows, H, KV, D, layers;
    ScoringOptions opts;
  };
  ScoringOptions dflt;
  ScoringOptions mean_last2;
  mean_last2.head_layer_aggregation = ScoringOptions::Aggregation::kMean;
  mean_last2.num_layers_used = 2;
  ScoringOptions no_pool;
  no_pool.pool_kernel_size = 1;
  int case_index = 0;
  for (const Case c : {Case{1000, 9, 8, 2, 64, 3, dflt},
                       Case{2500, 5, 32, 8, 128, 2, dflt},
                       Case{300, 3, 6, 2, 8, 3, mean_last2},
                       // Prompt shorter than the pool kernel: tokens
                       // 2..6 are exact ties (see below).
                       Case{9, 2, 4, 2, 16, 2, dflt},
                       Case{777, 4, 4, 4, 32, 2, no_pool}}) {
    SCOPED_TRACE(absl::StrCat("P=", c.prompt_len, " rows=", c.rows, " H=", c.H,
                              " KV=", c.KV, " D=", c.D));
    // Keys laid out as a KV cache plane with a wider stride and extra rows
    // after the prompt (look-ahead tokens), which must not be read.
    const int rw = c.KV * c.D, stride = rw + 16, cached = c.prompt_len + 3;
    absl::StatusOr<ImportanceAccumulator> cpu = ImportanceAccumulator::Create(
        c.prompt_len, c.rows, c.H, c.KV, c.D, c.layers, c.opts);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    // Every other case runs in the caller's scratch (as the runner's step
    // workspace), poisoned with 3.4e38 (0x7f7f7f7f; a NaN would pass
    // through fmaxf unseen): nothing may rely on fresh memory.
    const bool caller_scratch = case_index++ % 2 == 1;
    DeviceBuffer scratch;
    if (caller_scratch) {
      absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(
          CudaImportance::ScratchBytes(c.prompt_len, c.rows, c.H));
      ASSERT_TRUE(b.ok()) << b.status();
      scratch = *std::move(b);
      EXPECT_CUDA_OK(cudaMemset(scratch.get(), 0x7F, scratch.bytes()));
    }
    SCOPED_TRACE(caller_scratch ? "caller's scratch" : "owned buffers");
    absl::StatusOr<std::unique_ptr<CudaImportance>> gpu = CudaImportance::Create(
        c.prompt_len, c.rows, c.H, c.KV, c.D, c.layers, c.opts, nullptr,
        scratch.get());
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    for (int l = 0; l < c.layers; ++l) {
      const std::vector<float> q = Normal(static_cast<size_t>(c.rows) * c.H * c.D, 1.5f);
      std::vector<float> keys =
          Rounded(Normal(static_cast<size_t>(cached) * stride, 1.5f), CudaDType::kBF16);
      // Poison the look-ahead rows: reading them would show.
      for (size_t i = static_cast<size_t>(c.prompt_len) * stride; i < keys.size(); ++i) {
        keys[i] = std::numeric_limits<float>::quiet_NaN();
      }
      ASSERT_OK(cpu->AddLayer(l, q.data(), keys.data(), stride));
      DeviceBuffer d_q = Upload(q);
      DeviceBuffer d_k = UploadAs(keys, CudaDType::kBF16);
      ASSERT_OK((*gpu)->AddLayer(l, d_q.as<float>(), d_k.get(),
                                 CudaDType::kBF16, stride));
      EXPECT_CUDA_OK(cudaDeviceSynchronize());
      EXPECT_CUDA_OK(cudaGetLastError());
      if ((*gpu)->UsesLayer(l)) {
        EXPECT_EQ((*gpu)->AddLayer(l, d_q.as<float>(), d_k.get(),
                                   CudaDType::kBF16, stride)
                      .code(),
                  absl::StatusCode::kFailedPrecondition);
      }
    }
    EXPECT_EQ((*gpu)->layers_added(), cpu->layers_added());
    EXPECT_TRUE((*gpu)->complete());
    absl::StatusOr<std::vector<float>> got = (*gpu)->Importance();
    ASSERT_TRUE(got.ok()) << got.status();
    const std::vector<float> want = cpu->Importance();
    EXPECT_LT(RelErr(*got, want), 1e-5);
    absl::StatusOr<std::vector<std::vector<float>>> rows =
        (*gpu)->PerRowImportance();
    ASSERT_TRUE(rows.ok()) << rows.status();
    const auto want_rows = cpu->PerRowImportance();
    for (int r = 0; r < c.rows; ++r) {
      EXPECT_LT(RelErr((*rows)[r], want_rows[r]), 1e-5) << "row " << r;
    }
    // A token whose pooling window covers the whole prompt pools a whole
    // softmax: 1 / kernel for every head, row and layer, so under kMax its
    // importance is exactly 1 / kernel on both sides, whatever the inputs.
    // Which of these tied tokens ranks first is decided by rounding (the
    // device and the CPU sum in different orders); ExpectSameSelection
    // lets such ties swap.
    const int k = c.opts.pool_kernel_size, hk = k / 2;
    if (c.opts.head_layer_aggregation == ScoringOptions::Aggregation::kMax) {
      for (int j = std::max(0, c.prompt_len - 1 - hk);
           j <= std::min(c.prompt_len - 1, hk); ++j) {
        EXPECT_NEAR((*got)[j], 1.0 / k, kRoundingTieRel / k) << "token " << j;
        EXPECT_NEAR(want[j], 1.0 / k, kRoundingTieRel / k) << "token " << j;
      }
    }
    ExpectSameSelection(*got, want);
  }
}

TEST_F(CudaTest, ImportanceRejectsBadLayers) {
  absl::StatusOr<std::unique_ptr<CudaImportance>> imp =
      CudaImportance::Create(10, 1, 4, 2, 8, 2, ScoringOptions());
  ASSERT_TRUE(imp.ok()) << imp.status();
  float dummy = 0;
  EXPECT_EQ((*imp)->AddLayer(2, &dummy, &dummy, CudaDType::kF32, 16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*imp)->AddLayer(0, nullptr, &dummy, CudaDType::kF32, 16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*imp)->AddLayer(0, &dummy, &dummy, CudaDType::kF32, 15).code(),
            absl::StatusCode::kInvalidArgument);
  // No layer yet: all zeros, like the CPU accumulator.
  absl::StatusOr<std::vector<float>> zeros = (*imp)->Importance();
  ASSERT_TRUE(zeros.ok());
  EXPECT_EQ(*zeros, std::vector<float>(10, 0.0f));
}

// ---------------------------------------------------------------------------
// Whole model and its paged KV cache vs the CPU runner on the bundled
// checkpoints
// ---------------------------------------------------------------------------

// Cache options for a pool of at least `tokens` tokens in blocks of
// `block_size` (tokens 0: the runners' default, one sequence at the model's
// max context).
KvCacheOptions PoolOptions(size_t bytes_per_token, int tokens,
                           int block_size) {
  KvCacheOptions o;
  o.block_size = block_size;
  if (tokens > 0) {
    o.pool_bytes = bytes_per_token * static_cast<size_t>(block_size) *
                   PagedKvCache::BlocksForTokens(tokens, block_size);
  }
  return o;
}

struct Engines {
  std::shared_ptr<const ModelWeights> cpu_weights;
  std::unique_ptr<CpuModelRunner> cpu;
  std::shared_ptr<const CudaWeights> gpu_weights;
  std::unique_ptr<CudaModelRunner> gpu;
};

// Both runners of the checkpoint in `dir`, each with a pool of
// `pool_tokens` tokens (0 = one sequence at the max context) in blocks of
// `block_size`.
Engines LoadEnginesFromDir(const std::string& dir, CudaDType dt,
                           int pool_tokens = 0, int block_size = 16) {
  Engines e;
  absl::StatusOr<ModelWeights> w = LoadModelWeights(dir);
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return e;
  e.cpu_weights = std::make_shared<const ModelWeights>(*std::move(w));
  const ModelConfig& c = e.cpu_weights->config;
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> cpu = CpuModelRunner::Create(
      e.cpu_weights,
      PoolOptions(CpuModelRunner::BytesPerToken(c), pool_tokens, block_size));
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  if (!cpu.ok()) return e;
  e.cpu = *std::move(cpu);
  absl::StatusOr<std::shared_ptr<const CudaWeights>> gw =
      CudaWeights::Upload(*e.cpu_weights, dt);
  EXPECT_TRUE(gw.ok()) << gw.status();
  if (!gw.ok()) return e;
  e.gpu_weights = *gw;
  absl::StatusOr<std::unique_ptr<CudaModelRunner>> gpu =
      CudaModelRunner::Create(
          e.gpu_weights,
          PoolOptions(CudaModelRunner::BytesPerToken(c, dt), pool_tokens,
                      block_size));
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (gpu.ok()) e.gpu = *std::move(gpu);
  return e;
}

// LoadEnginesFromDir of the bundled model `model` (models/<model>).
Engines LoadEngines(const std::string& model, CudaDType dt,
                    int pool_tokens = 0, int block_size = 16) {
  return LoadEnginesFromDir("models/" + model, dt, pool_tokens, block_size);
}

// A new sequence of `runner` with room for `max_tokens` (null on failure,
// which is reported).
std::unique_ptr<KvSequence> NewSeq(ModelRunner& runner, int max_tokens) {
  absl::StatusOr<std::unique_ptr<KvSequence>> s =
      runner.NewSequence(max_tokens);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  return *std::move(s);
}

// `count` new sequences of `runner`; fewer if one cannot be made (the
// failure is reported).
std::vector<std::unique_ptr<KvSequence>> NewSeqs(ModelRunner& runner,
                                                 int count, int max_tokens) {
  std::vector<std::unique_ptr<KvSequence>> seqs;
  for (int i = 0; i < count; ++i) {
    std::unique_ptr<KvSequence> s = NewSeq(runner, max_tokens);
    if (s == nullptr) break;
    seqs.push_back(std::move(s));
  }
  return seqs;
}

// The first `count` cached keys of `kv` at `layer` in the CPU runner's pool,
// as dense fp32 [count, kv_heads * head_dim] rows (CopyKeysToHost's layout).
std::vector<float> CpuKeys(const CpuModelRunner& cpu, const KvSequence& kv,
                           int layer, int count) {
  const int rw = cpu.row_width();
  std::vector<float> out;
  out.reserve(static_cast<size_t>(count) * rw);
  std::vector<float> row(rw);
  for (int t = 0; t < count; ++t) {
    cpu.KeyRow(layer, kv.PhysicalSlot(t), row.data());
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

const char* PathName(CudaModelRunner::AttentionPath path) {
  switch (path) {
    case CudaModelRunner::AttentionPath::kAuto:
      return "auto";
    case CudaModelRunner::AttentionPath::kFlash:
      return "flash";
    case CudaModelRunner::AttentionPath::kSplitK:
      return "splitk";
    case CudaModelRunner::AttentionPath::kFlashMma:
      return "flash_mma";
    case CudaModelRunner::AttentionPath::kCudnn:
      return "cudnn";
  }
  return "?";
}

constexpr CudaModelRunner::AttentionPath kAllPaths[] = {
    CudaModelRunner::AttentionPath::kAuto,
    CudaModelRunner::AttentionPath::kFlash,
    CudaModelRunner::AttentionPath::kSplitK,
    CudaModelRunner::AttentionPath::kFlashMma,
    CudaModelRunner::AttentionPath::kCudnn};

int Argmax(const float* x, int n) {
  return static_cast<int>(std::max_element(x, x + n) - x);
}

// The largest and second-largest of row[0, n), n >= 2.
std::pair<float, float> TopTwo(const float* row, int n) {
  std::vector<float> sorted(row, row + n);
  std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(),
                    std::greater<float>());
  return {sorted[0], sorted[1]};
}

// Compares the logits rows of a CPU and a GPU forward: relative error of the
// whole batch under `tol` (the check a wrong kernel fails, with errors of
// order 1), and the same top-1 token in every row whose CPU margin (top-1
// minus top-2) exceeds 10 * `tol` standard deviations of the row's logits:
// a threshold set by the tolerance, not by the GPU's error. Measured in the
// emulation over 6 seeds x 4 models x 5 paths (18,000 rows per dtype),
// rounding moved a top-1/top-2 gap by up to 0.22 sd in bf16 (0.3 sd here)
// and 0.04 sd in fp16 (0.1 sd here); thresholds of 0.05 and 0.15 sd each
// flipped a bf16 row in CI-style runs. Random-token prompts give the small
// bundled models flat logits, so as few as 2% of a batch's rows may be
// clear enough to check; the top-1 check counts for what qualifies.
void ExpectLogitsMatch(const ForwardOutput& cpu, const ForwardOutput& gpu,
                       int vocab, double tol) {
  ASSERT_EQ(cpu.logit_rows, gpu.logit_rows);
  ASSERT_EQ(cpu.logits.size(), gpu.logits.size());
  EXPECT_LT(RelErr(gpu.logits, cpu.logits), tol);
  const int rows = static_cast<int>(cpu.logit_rows.size());
  for (int r = 0; r < rows; ++r) {
    const float* c = cpu.logits_row(r, vocab);
    double mean = 0, sq = 0;
    for (int j = 0; j < vocab; ++j) mean += c[j];
    mean /= vocab;
    for (int j = 0; j < vocab; ++j) sq += (c[j] - mean) * (c[j] - mean);
    const double sd = std::sqrt(sq / vocab);
    const auto [top, second] = TopTwo(c, vocab);
    if (top - second <= 10 * tol * sd) continue;
    EXPECT_EQ(Argmax(gpu.logits_row(r, vocab), vocab), Argmax(c, vocab))
        << "row " << cpu.logit_rows[r] << " (CPU margin " << top - second
        << ", logit sd " << sd << ")";
  }
}

// Appends the logits rows of `step` to `all`, numbering them on.
void AppendRows(const ForwardOutput& step, ForwardOutput* all) {
  for (size_t i = 0; i < step.logit_rows.size(); ++i) {
    all->logit_rows.push_back(static_cast<int>(all->logit_rows.size()));
  }
  all->logits.insert(all->logits.end(), step.logits.begin(),
                     step.logits.end());
}

std::vector<int> Iota(int from, int n) {
  std::vector<int> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

// All rows' logits of `ids` at `pos`.
ForwardInput AllRows(const std::vector<int>& ids, const std::vector<int>& pos) {
  ForwardInput in;
  in.token_ids = ids;
  in.position_ids = pos;
  in.logit_rows = Iota(0, static_cast<int>(ids.size()));
  return in;
}

// One decode row, `token` at `position`, appended to a CPU and a GPU
// sequence: the two rows' logits match (single-row tolerance).
void ExpectDecodeRowMatches(ModelRunner& cpu, KvSequence* ckv,
                            ModelRunner& gpu, KvSequence* gkv, int token,
                            int position) {
  ForwardInput d;
  d.token_ids = absl::MakeConstSpan(&token, 1);
  d.position_ids = absl::MakeConstSpan(&position, 1);
  ForwardOutput cd, gd;
  ASSERT_OK(cpu.Forward(d, ckv, &cd));
  ASSERT_OK(gpu.Forward(d, gkv, &gd));
  ExpectLogitsMatch(cd, gd, cpu.config().vocab_size, kRowsTolBf16);
}

// The device pool of the runner (what the CudaKvCache tests covered), at
// bf16 and fp16: its size, block accounting through Forward, a sequence's
// capacity, pool exhaustion, truncation returning blocks, and the cached
// keys against the CPU runner's.
TEST_F(CudaTest, PagedKvCacheCapacityTruncateAndKeys) {
  for (CudaDType dt : {CudaDType::kBF16, CudaDType::kFP16}) {
    SCOPED_TRACE(CudaDTypeName(dt));
    const int bs = 4, blocks = 6;
    Engines e = LoadEngines("stories260K", dt, blocks * bs, bs);
    ASSERT_NE(e.gpu, nullptr);
    const ModelConfig& c = e.gpu->config();
    const int L = c.num_hidden_layers;
    PagedKvCache& cache = e.gpu->kv_cache();
    const size_t per_token = CudaModelRunner::BytesPerToken(c, dt);
    EXPECT_EQ(cache.bytes_per_token(), per_token);
    EXPECT_EQ(cache.block_size(), bs);
    EXPECT_EQ(cache.num_blocks(), blocks);
    EXPECT_EQ(cache.bytes_capacity(), per_token * bs * blocks);
    EXPECT_EQ(cache.num_free_blocks(), blocks);
    // Layer planes are distinct and aligned for vector loads.
    EXPECT_NE(e.gpu->keys(0), e.gpu->values(0));
    EXPECT_NE(e.gpu->values(0), e.gpu->keys(1));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(e.gpu->keys(L - 1)) % 16, 0u);

    std::unique_ptr<KvSequence> kv = NewSeq(*e.gpu, 10);
    std::unique_ptr<KvSequence> ref = NewSeq(*e.cpu, 10);
    ASSERT_NE(kv, nullptr);
    ASSERT_NE(ref, nullptr);
    EXPECT_EQ(kv->max_tokens(), 10);
    EXPECT_EQ(kv->last_position(), -1);
    const std::vector<int> ids = {1, 57, 300, 12, 499, 8};
    const std::vector<int> pos = {0, 1, 3, 6, 7, 9};  // pruned
    ForwardInput in;
    in.token_ids = ids;
    in.position_ids = pos;
    ForwardOutput out;
    ASSERT_OK(e.gpu->Forward(in, kv.get(), &out));
    ASSERT_OK(e.cpu->Forward(in, ref.get(), &out));
    EXPECT_EQ(kv->size(), 6);
    EXPECT_EQ(kv->positions(), pos);
    EXPECT_EQ(kv->last_position(), 9);
    EXPECT_EQ(kv->block_table().size(), 2u);
    EXPECT_EQ(cache.num_free_blocks(), blocks - 2);
    EXPECT_EQ(kv->bytes_used(), per_token * bs * 2);
    EXPECT_EQ(kv->bytes_capacity(), per_token * bs * 3);  // 10 tokens

    // The cached keys are the CPU runner's to the dtype's precision.
    const double tol = BatchTol(dt);
    for (int l = 0; l < L; ++l) {
      absl::StatusOr<std::vector<float>> keys =
          e.gpu->CopyKeysToHost(l, *kv, 6);
      ASSERT_TRUE(keys.ok()) << keys.status();
      EXPECT_LT(RelErr(*keys, CpuKeys(*e.cpu, *ref, l, 6)), tol)
          << "layer " << l;
    }
    EXPECT_EQ(e.gpu->CopyKeysToHost(0, *kv, 7).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(e.gpu->CopyKeysToHost(L, *kv, 1).status().code(),
              absl::StatusCode::kInvalidArgument);

    // Past the sequence's 10 tokens: rejected, nothing changes.
    const std::vector<int> five(5, 7), five_pos = Iota(10, 5);
    ForwardInput big;
    big.token_ids = five;
    big.position_ids = five_pos;
    EXPECT_EQ(e.gpu->Forward(big, kv.get(), &out).code(),
              absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(kv->size(), 6);
    EXPECT_EQ(cache.num_free_blocks(), blocks - 2);

    // Rolling back (rejected drafts) returns whole blocks and keeps the
    // remaining keys.
    EXPECT_EQ(kv->Truncate(7).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(kv->Truncate(-1).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_OK(kv->Truncate(3));
    EXPECT_EQ(kv->positions(), (std::vector<int>{0, 1, 3}));
    EXPECT_EQ(kv->last_position(), 3);
    EXPECT_EQ(kv->block_table().size(), 1u);
    EXPECT_EQ(cache.num_free_blocks(), blocks - 1);
    {
      absl::StatusOr<std::vector<float>> keys =
          e.gpu->CopyKeysToHost(L - 1, *kv, 3);
      ASSERT_TRUE(keys.ok()) << keys.status();
      EXPECT_LT(RelErr(*keys, CpuKeys(*e.cpu, *ref, L - 1, 3)), tol);
    }

    // Pool exhaustion: a second sequence may take the 5 free blocks, not 6.
    std::unique_ptr<KvSequence> other = NewSeq(*e.gpu, 32);
    ASSERT_NE(other, nullptr);
    const std::vector<int> many(21, 3), many_pos = Iota(0, 21);
    ForwardInput six_blocks;
    six_blocks.token_ids = many;
    six_blocks.position_ids = many_pos;
    EXPECT_EQ(e.gpu->Forward(six_blocks, other.get(), &out).code(),
              absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(other->size(), 0);
    EXPECT_EQ(cache.num_free_blocks(), blocks - 1);
    ForwardInput five_blocks = six_blocks;
    five_blocks.token_ids = absl::MakeConstSpan(many.data(), 20);
    five_blocks.position_ids = absl::MakeConstSpan(many_pos.data(), 20);
    ASSERT_OK(e.gpu->Forward(five_blocks, other.get(), &out));
    EXPECT_EQ(cache.num_free_blocks(), 0);
    EXPECT_DOUBLE_EQ(cache.usage(), 1.0);
    // `kv` still has room in its block for one token, not two.
    const int tok = 5, p10 = 10, p11 = 11;
    ForwardInput d10, d11;
    d10.token_ids = absl::MakeConstSpan(&tok, 1);
    d10.position_ids = absl::MakeConstSpan(&p10, 1);
    d11.token_ids = absl::MakeConstSpan(&tok, 1);
    d11.position_ids = absl::MakeConstSpan(&p11, 1);
    ASSERT_OK(e.gpu->Forward(d10, kv.get(), &out));
    EXPECT_EQ(e.gpu->Forward(d11, kv.get(), &out).code(),
              absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(kv->size(), 4);
    ASSERT_OK(other->Truncate(16));  // frees its fifth block
    EXPECT_EQ(cache.num_free_blocks(), 1);
    ASSERT_OK(e.gpu->Forward(d11, kv.get(), &out));
    EXPECT_EQ(kv->size(), 5);
    EXPECT_EQ(kv->last_position(), 11);

    kv->Clear();
    EXPECT_EQ(kv->size(), 0);
    EXPECT_EQ(kv->last_position(), -1);
    other.reset();
    EXPECT_EQ(cache.num_free_blocks(), blocks);
  }
}

class ModelTest : public CudaTest,
                  public ::testing::WithParamInterface<std::string> {};

TEST_P(ModelTest, PrefillDecodeVerifyAndQueriesMatchCpu) {
  for (CudaDType dt : {CudaDType::kBF16, CudaDType::kFP16}) {
    SCOPED_TRACE(CudaDTypeName(dt));
    const double batch_tol = BatchTol(dt), rows_tol = RowsTol(dt);
    Engines e = LoadEngines(GetParam(), dt);
    ASSERT_NE(e.gpu, nullptr);
    const ModelConfig& c = e.cpu->config();
    const int vocab = c.vocab_size;
    for (const CudaModelRunner::AttentionPath path : kAllPaths) {
      SCOPED_TRACE(PathName(path));
      e.gpu->set_attention_path(path);
      const int max_tokens = c.max_position_embeddings;
      std::unique_ptr<KvSequence> ckv = NewSeq(*e.cpu, max_tokens);
      std::unique_ptr<KvSequence> gkv = NewSeq(*e.gpu, max_tokens);
      ASSERT_NE(ckv, nullptr);
      ASSERT_NE(gkv, nullptr);

      // Prefill: random tokens, every row's logits, two captured rows.
      const int n = 150;
      std::vector<int> ids(n);
      for (int& id : ids) id = Uniform(0, vocab - 1);
      const std::vector<int> pos = Iota(0, n);
      ForwardInput in = AllRows(ids, pos);
      in.capture_query_rows = {n - 1, 10};
      ForwardOutput cpu_out, gpu_out;
      ASSERT_OK(e.cpu->Forward(in, ckv.get(), &cpu_out));
      ASSERT_OK(e.gpu->Forward(in, gkv.get(), &gpu_out));
      ExpectLogitsMatch(cpu_out, gpu_out, vocab, batch_tol);
      EXPECT_LT(RelErr(gpu_out.queries, cpu_out.queries), batch_tol);
      EXPECT_EQ(gkv->size(), n);
      EXPECT_EQ(gkv->positions(), ckv->positions());

      // Decode: one row at a time, the CPU's greedy tokens for both.
      ForwardOutput cpu_steps, gpu_steps;
      int next = Argmax(cpu_out.logits_row(n - 1, vocab), vocab);
      for (int step = 0; step < 6; ++step) {
        const int p = n + step;
        ForwardInput d;
        d.token_ids = absl::MakeConstSpan(&next, 1);
        d.position_ids = absl::MakeConstSpan(&p, 1);
        ForwardOutput co, go;
        ASSERT_OK(e.cpu->Forward(d, ckv.get(), &co));
        ASSERT_OK(e.gpu->Forward(d, gkv.get(), &go));
        AppendRows(co, &cpu_steps);
        AppendRows(go, &gpu_steps);
        next = Argmax(co.logits.data(), vocab);
      }
      {
        SCOPED_TRACE("decode steps");
        ExpectLogitsMatch(cpu_steps, gpu_steps, vocab, rows_tol);
      }

      // Verify round: 5 draft tokens, logits for all of them.
      std::vector<int> draft(5);
      for (int& t : draft) t = Uniform(0, vocab - 1);
      const std::vector<int> dpos = Iota(n + 6, 5);
      const ForwardInput v = AllRows(draft, dpos);
      ForwardOutput cv, gv;
      ASSERT_OK(e.cpu->Forward(v, ckv.get(), &cv));
      ASSERT_OK(e.gpu->Forward(v, gkv.get(), &gv));
      SCOPED_TRACE("verify round");
      ExpectLogitsMatch(cv, gv, vocab, rows_tol);
    }
  }
}

// argmax_only: the runner reduces on the device and returns each logit
// row's argmax, equal to the argmax of the logits it returns otherwise;
// a mixed batch keeps the other sequence's logits.
TEST_P(ModelTest, ArgmaxOnlyEqualsArgmaxOfLogits) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, n = 40;
  std::vector<int> ids(n);
  for (int& id : ids) id = Uniform(0, vocab - 1);
  const std::vector<int> pos = Iota(0, n);
  std::vector<std::unique_ptr<KvSequence>> kv =
      NewSeqs(*e.gpu, 3, c.max_position_embeddings);
  ASSERT_EQ(kv.size(), 3u);
  ForwardOutput full;
  ASSERT_OK(e.gpu->Forward(AllRows(ids, pos), kv[0].get(), &full));
  std::vector<SequenceForward> batch(2);
  batch[0].kv = kv[1].get();
  batch[0].input = AllRows(ids, pos);
  batch[0].input.argmax_only = true;
  batch[1].kv = kv[2].get();
  batch[1].input = AllRows(ids, pos);
  std::vector<ForwardOutput> out;
  ASSERT_OK(e.gpu->Forward(batch, &out));
  EXPECT_TRUE(out[0].logits.empty());
  ASSERT_EQ(out[0].argmax.size(), static_cast<size_t>(n));
  EXPECT_TRUE(out[1].argmax.empty());
  ASSERT_EQ(out[1].logits.size(), static_cast<size_t>(n) * vocab);
  // The same rows in the same batch: the device's argmax is the argmax of
  // the logits it hands out wherever the top two are apart (and, across
  // forwards, a near-top id).
  int clear = 0;
  for (int r = 0; r < n; ++r) {
    const float* row = out[1].logits_row(r, vocab);
    const auto [top, second] = TopTwo(row, vocab);
    if (top - second > 1e-3f) {
      EXPECT_EQ(out[0].argmax[r], Argmax(row, vocab)) << "row " << r;
      ++clear;
    }
    EXPECT_GE(row[out[0].argmax[r]], top - 1e-3f) << "row " << r;
    const float* alone = full.logits_row(r, vocab);
    EXPECT_GE(alone[out[0].argmax[r]],
              *std::max_element(alone, alone + vocab) - 0.05f)
        << "row " << r;
  }
  EXPECT_GT(clear, n / 2);
}

// set_phase_timing: an eager prefill's phases come back in a layer's
// order, every phase a prefill runs has time, and together they fit in the
// forward's wall time; once timing is off, forwards add nothing.
TEST_P(ModelTest, PhaseTimesCoverAnEagerForward) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, n = 48;
  std::vector<int> ids(n);
  for (int& id : ids) id = Uniform(0, vocab - 1);
  const std::vector<int> pos = Iota(0, n);
  std::unique_ptr<KvSequence> kv = NewSeq(*e.gpu, c.max_position_embeddings);
  ASSERT_NE(kv, nullptr);
  // A step this short whose rows all want logits would replay a graph,
  // which is not timed.
  e.gpu->set_cuda_graphs(false);
  e.gpu->set_phase_timing(true);
  ForwardOutput out;
  const absl::Time t0 = absl::Now();
  ASSERT_OK(e.gpu->Forward(AllRows(ids, pos), kv.get(), &out));
  const double wall = absl::ToDoubleSeconds(absl::Now() - t0);
  int forwards = -1;
  const std::vector<std::pair<std::string, double>> times =
      e.gpu->TakePhaseTimes(&forwards);
  EXPECT_EQ(forwards, 1);
  std::vector<std::string> names;
  double sum = 0.0;
  for (const auto& [name, seconds] : times) {
    names.push_back(name);
    EXPECT_GE(seconds, 0.0) << name;
    sum += seconds;
    // Only the cuDNN path gathers K / V rows, and only a pruned last layer
    // its live rows.
    if (name != "kv_gather" && name != "row_gather") {
      EXPECT_GT(seconds, 0.0) << name;
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{
                       "embed", "norm", "qkv_proj", "rope_kv_store",
                       "kv_gather", "attention", "row_gather", "o_proj",
                       "gate_up_proj", "silu_mul", "down_proj", "logits"}));
  EXPECT_LE(sum, wall);

  e.gpu->set_phase_timing(false);
  const int tok = ids[0], p = n;
  ForwardInput d;
  d.token_ids = absl::MakeConstSpan(&tok, 1);
  d.position_ids = absl::MakeConstSpan(&p, 1);
  ASSERT_OK(e.gpu->Forward(d, kv.get(), &out));
  for (const auto& [name, seconds] : e.gpu->TakePhaseTimes(&forwards)) {
    EXPECT_EQ(seconds, 0.0) << name;
  }
  EXPECT_EQ(forwards, 0);
  e.gpu->set_cuda_graphs(true);
}

// ForwardInput::sampling: the runner samples on the device and returns each
// row's accept flag and token, SampleRow's outcome on the logits it hands
// out for the same rows otherwise (up to rounding at a boundary); two
// sampling sequences with different params around a logits one check the
// packing of their rows.
// logprobs_top_n with argmax_only: each row's logprobs, computed on the
// device from the logits it keeps, equal ComputeTokenLogprobs of the same
// rows' logits handed out by a logits sequence of the same batch (same
// kernels, same numbers), for the argmax token, or with logprob_ids for
// the next prompt token (teacher forcing; the last row's -1 keeps its
// argmax); no logits come back. The step runs eagerly (no graph).
TEST_P(ModelTest, DeviceLogprobsEqualHostLogprobsOfLogits) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, n = 12, top_n = std::min(5, vocab);
  std::vector<int> ids(n);
  for (int& id : ids) id = Uniform(0, vocab - 1);
  const std::vector<int> pos = Iota(0, n);
  std::vector<std::unique_ptr<KvSequence>> kv =
      NewSeqs(*e.gpu, 3, c.max_position_embeddings);
  ASSERT_EQ(kv.size(), 3u);
  std::vector<SequenceForward> batch(3);
  batch[0].kv = kv[0].get();
  batch[0].input = AllRows(ids, pos);
  batch[0].input.argmax_only = true;
  batch[0].input.logprobs_top_n = top_n;
  batch[1].kv = kv[1].get();
  batch[1].input = AllRows(ids, pos);
  batch[2].kv = kv[2].get();
  batch[2].input = batch[0].input;
  for (int r = 0; r < n; ++r) {
    batch[2].input.logprob_ids.push_back(r + 1 < n ? ids[r + 1] : -1);
  }
  const int64_t replays = e.gpu->graph_replays();
  std::vector<ForwardOutput> out;
  ASSERT_OK(e.gpu->Forward(batch, &out));
  EXPECT_EQ(e.gpu->graph_replays(), replays);
  EXPECT_TRUE(out[0].logits.empty());
  ASSERT_EQ(out[0].argmax.size(), static_cast<size_t>(n));
  ASSERT_EQ(out[0].token_logprobs.size(), static_cast<size_t>(n));
  EXPECT_TRUE(out[1].token_logprobs.empty());
  for (int r = 0; r < n; ++r) {
    const TokenLogprobs want = ComputeTokenLogprobs(
        absl::MakeConstSpan(out[1].logits_row(r, vocab), vocab),
        out[0].argmax[r], top_n);
    const TokenLogprobs& got = out[0].token_logprobs[r];
    EXPECT_NEAR(got.logprob, want.logprob, 1e-4) << "row " << r;
    ASSERT_EQ(got.top.size(), static_cast<size_t>(top_n)) << "row " << r;
    for (int k = 0; k < top_n; ++k) {
      EXPECT_NEAR(got.top[k].second, want.top[k].second, 1e-4)
          << "row " << r << " rank " << k;
    }
    EXPECT_EQ(got.top[0].first, out[0].argmax[r]) << "row " << r;
    const int forced = r + 1 < n ? ids[r + 1] : out[0].argmax[r];
    const TokenLogprobs want_forced = ComputeTokenLogprobs(
        absl::MakeConstSpan(out[1].logits_row(r, vocab), vocab), forced,
        top_n);
    ASSERT_EQ(out[2].token_logprobs.size(), static_cast<size_t>(n));
    EXPECT_NEAR(out[2].token_logprobs[r].logprob, want_forced.logprob, 1e-4)
        << "row " << r;
    EXPECT_EQ(out[2].argmax[r], out[0].argmax[r]) << "row " << r;
  }
}

TEST_P(ModelTest, RowSamplingEqualsSampleRowOfLogits) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, n = 24;
  std::vector<int> ids(n);
  for (int& id : ids) id = Uniform(0, vocab - 1);
  const std::vector<int> pos = Iota(0, n);
  std::vector<std::unique_ptr<KvSequence>> kv =
      NewSeqs(*e.gpu, 3, c.max_position_embeddings);
  ASSERT_EQ(kv.size(), 3u);
  // Row r verifies ids[r + 1] with a q that gives it 0.5 (rows r < n - 1).
  // A random id is rarely accepted at q = 0.5, so every third row's q gives
  // its draft 1e-30: accepted whenever the target's probability is larger
  // (with params a's full support, always).
  std::vector<SparseDist> qs(n - 1);
  for (int r = 0; r + 1 < n; ++r) {
    if (r % 3 == 0) {
      qs[r] = {{ids[r + 1], 1e-30f}, {(ids[r + 1] + 1) % vocab, 1.0f}};
      continue;
    }
    qs[r] = {{ids[r + 1], 0.5f}, {(ids[r + 1] + 1) % vocab, 0.3f},
             {(ids[r + 1] + 7) % vocab, 0.2f}};
  }
  std::mt19937_64 gen(11);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  auto sampling = [&](SamplingParams params) {
    RowSampling rs;
    rs.params = params;
    for (int r = 0; r < n; ++r) {
      const bool draft = r + 1 < n && r % 3 != 2;
      rs.draft_ids.push_back(draft ? ids[r + 1] : -1);
      rs.draft_q.push_back(draft ? &qs[r] : nullptr);
      rs.uniforms.push_back(u01(gen));
      rs.uniforms.push_back(u01(gen));
    }
    return rs;
  };
  const RowSampling a = sampling({1.f, 0, 1.f, 0});
  SamplingParams with_min_p = {0.7f, 40, 0.9f, 0};
  with_min_p.min_p = 0.05f;  // and min_p, on the device as on the host
  const RowSampling b = sampling(with_min_p);
  std::vector<SequenceForward> batch(3);
  for (int i = 0; i < 3; ++i) {
    batch[i].kv = kv[i].get();
    batch[i].input = AllRows(ids, pos);
  }
  batch[0].input.sampling = &a;
  batch[2].input.sampling = &b;
  std::vector<ForwardOutput> out;
  ASSERT_OK(e.gpu->Forward(batch, &out));
  ASSERT_EQ(out[1].logits.size(), static_cast<size_t>(n) * vocab);
  int exact = 0, accepted = 0;
  for (int i : {0, 2}) {
    const RowSampling& rs = i == 0 ? a : b;
    EXPECT_TRUE(out[i].logits.empty());
    ASSERT_EQ(out[i].sampled.size(), static_cast<size_t>(n));
    ASSERT_EQ(out[i].accepted.size(), static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      const absl::Span<const float> row(out[1].logits_row(r, vocab), vocab);
      const SparseDist& q = rs.draft_q[r] ? *rs.draft_q[r] : SparseDist{};
      const double ua = rs.uniforms[2 * r], us = rs.uniforms[2 * r + 1];
      const RowSample want =
          SampleRow(row, rs.params, rs.draft_ids[r], q, ua, us);
      const bool got_acc = out[i].accepted[r] != 0;
      const int got = out[i].sampled[r];
      accepted += got_acc;
      if (got_acc) {
        EXPECT_EQ(got, -1) << i << "/" << r;
      }
      if (got_acc == want.accepted && got == want.token) {
        ++exact;
        continue;
      }
      // Otherwise a nearby uniform must explain it (bf16 logits of the
      // same row in another slot of the batch may differ in the last bit).
      bool explained = false;
      for (double d : {-1e-3, 1e-3}) {
        const RowSample near = SampleRow(row, rs.params, rs.draft_ids[r], q,
                                         std::clamp(ua + d, 0.0, 0.999999),
                                         std::clamp(us + d, 0.0, 0.999999));
        explained |= near.accepted == got_acc && near.token == got;
      }
      EXPECT_TRUE(explained) << i << "/" << r << ": got " << got_acc << ","
                             << got << " want " << want.accepted << ","
                             << want.token;
    }
  }
  EXPECT_GE(exact, 2 * n * 9 / 10);
  EXPECT_GT(accepted, 0);
}

// CUDA graphs: decode and verify steps replayed from the graph of their
// bucket give what the same step gives eagerly, for batches that grow and
// shrink between steps (1 ... 40 sequences, verify rounds of 3-4 rows),
// with twin sequences' blocks interleaved in the pool, so a padding row
// that wrote KV, or a stale input of a larger bucket, would show in a
// later step. Greedy: the argmax of the eager step's logits (a near-tie may
// differ: the bucket's GEMM shapes are not the eager step's). With
// `sampled`, every other sequence samples on the device with drafts on its
// verify rows: the same accept flags and tokens as eagerly, from the same
// uniforms, in at least 90% of the rows.
void CheckGraphReplay(const std::string& model, bool sampled,
                      std::mt19937_64* gen) {
  Engines e = LoadEngines(model, CudaDType::kBF16, 96 * 128);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size;
  constexpr int kSeqs = 40;
  auto uniform_id = [&] {
    return std::uniform_int_distribution<int>(0, vocab - 1)(*gen);
  };
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  // Twins: graph[i] runs with graphs on, eager[i] with graphs off; both
  // always get the same tokens.
  std::vector<std::unique_ptr<KvSequence>> graph, eager;
  std::vector<int> len(kSeqs);
  for (int i = 0; i < kSeqs; ++i) {
    len[i] = 5 + (i * 7) % 30;
    std::vector<int> ids(len[i]);
    for (int& id : ids) id = uniform_id();
    const std::vector<int> pos = Iota(0, len[i]);
    for (auto* twins : {&graph, &eager}) {
      twins->push_back(NewSeq(*e.gpu, 128));
      ASSERT_NE(twins->back(), nullptr);
      ForwardInput in;
      in.token_ids = ids;
      in.position_ids = pos;
      ForwardOutput o;
      ASSERT_OK(e.gpu->Forward(in, twins->back().get(), &o));
    }
  }
  int exact = 0, rows_seen = 0, accepted = 0, logit_rows_seen = 0,
      edited_rows_seen = 0;
  int64_t replays = e.gpu->graph_replays();
  // (sequences, rows per sequence) of each step.
  const std::vector<std::pair<int, int>> steps = {
      {1, 1}, {3, 1}, {8, 1}, {5, 1}, {17, 1}, {40, 1}, {2, 1},
      {3, 4}, {1, 4}, {24, 1}, {12, 3}, {1, 1}};
  for (const auto& [seqs, rows] : steps) {
    SCOPED_TRACE(absl::StrCat(seqs, " sequences x ", rows, " rows"));
    std::vector<std::vector<int>> ids(seqs), pos(seqs);
    std::vector<RowSampling> jobs(seqs);
    std::vector<std::vector<SparseDist>> qs(seqs);
    // Every fifth sequence that is decided on the device carries logit
    // edits (a request with a logit bias / penalties): +50 on one random
    // id per row, a repetition-style scale and a subtraction on the next.
    // Steps without such a sequence follow steps with them, so stale edit
    // offsets in the graphs' workspace would show.
    std::vector<LogitEdits> edits(seqs);
    for (int i = 0; i < seqs; ++i) {
      if (i % 5 != 4) continue;
      edits[i].offsets = {0};
      for (int r = 0; r < rows; ++r) {
        const int x = uniform_id();
        edits[i].edits.push_back({x, 50.f, 1.f, 0.f});
        edits[i].edits.push_back({(x + 1) % vocab, 0.f, 1.5f, 0.25f});
        edits[i].offsets.push_back(static_cast<int>(edits[i].edits.size()));
      }
    }
    for (int i = 0; i < seqs; ++i) {
      for (int r = 0; r < rows; ++r) {
        ids[i].push_back(uniform_id());
        pos[i].push_back(len[i] + r);
      }
      if (!sampled || i % 2 == 0) continue;
      // Row r verifies ids[i][r + 1] with q giving it 0.6. A random id is
      // rarely accepted that way: sequences i % 4 == 1 sample from the full
      // support and their q gives the draft 1e-30, so it is accepted.
      RowSampling& rs = jobs[i];
      const bool full = i % 4 == 1;
      rs.params = {0.8f, full ? 0 : 50, full ? 1.0f : 0.95f, 0};
      if (i % 8 == 3) rs.params.min_p = 0.1f;  // packed at its own offset
      qs[i].resize(rows);
      for (int r = 0; r < rows; ++r) {
        const bool draft = r + 1 < rows;
        if (draft) {
          const float q = full ? 1e-30f : 0.6f;
          qs[i][r] = {{ids[i][r + 1], q},
                      {(ids[i][r + 1] + 1) % vocab, 1.0f - q}};
        }
        rs.draft_ids.push_back(draft ? ids[i][r + 1] : -1);
        rs.uniforms.push_back(u01(*gen));
        rs.uniforms.push_back(u01(*gen));
      }
      for (int r = 0; r < rows; ++r) {
        rs.draft_q.push_back(r + 1 < rows ? &qs[i][r] : nullptr);
      }
    }
    std::vector<SequenceForward> gb(seqs), eb(seqs);
    for (int i = 0; i < seqs; ++i) {
      const bool samples = sampled && i % 2 == 1;
      gb[i].kv = graph[i].get();
      gb[i].input = AllRows(ids[i], pos[i]);
      // Every third greedy sequence asks for its logits (a request the
      // host decides): copied out of the graph's logits.
      gb[i].input.argmax_only = !samples && i % 3 != 2;
      gb[i].input.sampling = samples ? &jobs[i] : nullptr;
      eb[i].kv = eager[i].get();
      eb[i].input = AllRows(ids[i], pos[i]);
      eb[i].input.sampling = samples ? &jobs[i] : nullptr;
      if (!edits[i].offsets.empty() &&
          (samples || gb[i].input.argmax_only)) {
        gb[i].input.logit_edits = &edits[i];
        // A greedy twin's eager logits come back raw: edited below.
        if (samples) eb[i].input.logit_edits = &edits[i];
      }
    }
    std::vector<ForwardOutput> go, eo;
    e.gpu->set_cuda_graphs(true);
    ASSERT_OK(e.gpu->Forward(gb, &go));
    EXPECT_TRUE(e.gpu->cuda_graphs());
    EXPECT_EQ(e.gpu->graph_replays(), ++replays);
    e.gpu->set_cuda_graphs(false);
    ASSERT_OK(e.gpu->Forward(eb, &eo));
    EXPECT_EQ(e.gpu->graph_replays(), replays);
    for (int i = 0; i < seqs; ++i) {
      for (int r = 0; r < rows; ++r) {
        ++rows_seen;
        if (gb[i].input.sampling != nullptr) {
          ASSERT_EQ(go[i].sampled.size(), static_cast<size_t>(rows));
          ASSERT_EQ(eo[i].sampled.size(), static_cast<size_t>(rows));
          accepted += go[i].accepted[r];
          exact += go[i].sampled[r] == eo[i].sampled[r] &&
                   go[i].accepted[r] == eo[i].accepted[r];
          continue;
        }
        const float* row = eo[i].logits_row(r, vocab);
        if (!gb[i].input.argmax_only) {
          ASSERT_EQ(go[i].logits.size(), static_cast<size_t>(rows) * vocab);
          const float* got = go[i].logits_row(r, vocab);
          float worst = 0.f;
          for (int v = 0; v < vocab; ++v) {
            worst = std::max(worst, std::abs(got[v] - row[v]) /
                                        (1.f + std::abs(row[v])));
          }
          EXPECT_LT(worst, 2e-2f) << i << "/" << r;
          exact += Argmax(got, vocab) == Argmax(row, vocab);
          ++logit_rows_seen;
          continue;
        }
        ASSERT_EQ(go[i].argmax.size(), static_cast<size_t>(rows));
        if (gb[i].input.logit_edits != nullptr) {
          std::vector<float> edited(row, row + vocab);
          ApplyLogitEdits(edits[i], r, absl::MakeSpan(edited));
          EXPECT_EQ(go[i].argmax[r], Argmax(edited.data(), vocab))
              << i << "/" << r;
          EXPECT_EQ(go[i].argmax[r], edits[i].edits[2 * r].id);
          ++edited_rows_seen;
          continue;
        }
        const auto [top, second] = TopTwo(row, vocab);
        const int got = go[i].argmax[r];
        if (got == Argmax(row, vocab)) {
          ++exact;
        } else {
          EXPECT_LT(top - second, 2e-2f) << i << "/" << r;
        }
        EXPECT_GE(row[got], top - 2e-2f) << i << "/" << r;
      }
      len[i] += rows;
    }
  }
  EXPECT_GE(exact + edited_rows_seen, rows_seen * 9 / 10);
  EXPECT_GT(logit_rows_seen, 0);
  if (sampled) {
    EXPECT_GT(accepted, 0);
  } else {
    EXPECT_GT(edited_rows_seen, 0);
  }
  // A step that asks for logits replays; a greedy one that asks for
  // logprobs (RowLogprobs runs after an eager step) does not.
  e.gpu->set_cuda_graphs(true);
  ForwardOutput o;
  ASSERT_OK(e.gpu->Forward(AllRows({1}, {len[0]}), graph[0].get(), &o));
  EXPECT_EQ(e.gpu->graph_replays(), ++replays);
  EXPECT_EQ(o.logits.size(), static_cast<size_t>(vocab));
  const std::vector<int> one = {1}, next = {len[0] + 1};
  ForwardInput with_logprobs = AllRows(one, next);
  with_logprobs.argmax_only = true;
  with_logprobs.logprobs_top_n = 2;
  ASSERT_OK(e.gpu->Forward(with_logprobs, graph[0].get(), &o));
  EXPECT_EQ(e.gpu->graph_replays(), replays);
  // An eager greedy step with edits: +50 on an id makes it the argmax.
  e.gpu->set_cuda_graphs(false);
  const std::vector<int> after = {len[0] + 2};
  ForwardInput edited = AllRows(one, after);
  edited.argmax_only = true;
  LogitEdits bias;
  bias.offsets = {0, 1};
  bias.edits = {{uniform_id(), 50.f, 1.f, 0.f}};
  edited.logit_edits = &bias;
  ASSERT_OK(e.gpu->Forward(edited, graph[0].get(), &o));
  ASSERT_EQ(o.argmax.size(), 1u);
  EXPECT_EQ(o.argmax[0], bias.edits[0].id);
  // A token mask (JSON mode's) that allows one id: that id wins, with
  // graphs on too (the step goes eager).
  e.gpu->set_cuda_graphs(true);
  const int only = uniform_id();
  std::vector<int> all_but;
  for (int id = 0; id < vocab; ++id) {
    if (id != only) all_but.push_back(id);
  }
  LogitEdits masked;
  AppendRowEdits(SamplingParams(), nullptr, {}, {}, vocab, &masked);
  MaskLastRow(all_but, vocab, &masked);
  const std::vector<int> later = {len[0] + 3};
  ForwardInput masked_in = AllRows(one, later);
  masked_in.argmax_only = true;
  masked_in.logit_edits = &masked;
  const int64_t before_masked = e.gpu->graph_replays();
  ASSERT_OK(e.gpu->Forward(masked_in, graph[0].get(), &o));
  EXPECT_EQ(e.gpu->graph_replays(), before_masked);
  ASSERT_EQ(o.argmax.size(), 1u);
  EXPECT_EQ(o.argmax[0], only);
}

TEST_P(ModelTest, GraphReplayEqualsEager) {
  CheckGraphReplay(GetParam(), /*sampled=*/false, &rng_);
}

TEST_P(ModelTest, SampledGraphReplayEqualsEager) {
  CheckGraphReplay(GetParam(), /*sampled=*/true, &rng_);
}

// Speculative Prefill's look-ahead steps replay from graphs that capture
// their queries: the captured rows equal the eager step's (within the bf16
// bound of graph against eager logits: a graph's bucket may plan attention
// and pick GEMMs differently), land at each capture's next rows even when
// the capturing sequence is not the step's first or shares the step with
// others, and the scores and kept tokens follow.
TEST_P(ModelTest, GraphedLookAheadCapturesWhatEagerCaptures) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16, 64 * 128);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, n = 200, lookahead = 4;
  constexpr int kScored = 2;  // sequences scored side by side
  const size_t qrow = static_cast<size_t>(c.num_attention_heads) * c.head_dim;
  // Twins: index 0 runs with graphs on, 1 with graphs off.
  std::unique_ptr<KvSequence> kv[2][kScored], other[2];
  std::unique_ptr<QueryCapture> cap[2][kScored];
  std::vector<int> prompt[kScored];
  for (int s = 0; s < kScored; ++s) {
    prompt[s].resize(n - 40 * s);
    for (int& t : prompt[s]) t = Uniform(0, vocab - 1);
  }
  std::vector<int> other_ids(7);
  for (int& t : other_ids) t = Uniform(0, vocab - 1);
  for (int g = 0; g < 2; ++g) {
    e.gpu->set_cuda_graphs(g == 0);
    for (int s = 0; s < kScored; ++s) {
      kv[g][s] = NewSeq(*e.gpu, c.max_position_embeddings);
      ASSERT_NE(kv[g][s], nullptr);
      absl::StatusOr<std::unique_ptr<QueryCapture>> qc =
          e.gpu->NewQueryCapture(1 + lookahead);
      ASSERT_TRUE(qc.ok()) << qc.status();
      cap[g][s] = *std::move(qc);
      // The prompt, capturing its last row (a long chunk: eager).
      const std::vector<int> pos = Iota(0, prompt[s].size());
      ForwardInput in;
      in.token_ids = prompt[s];
      in.position_ids = pos;
      in.argmax_only = true;
      in.capture_query_rows = {static_cast<int>(prompt[s].size()) - 1};
      std::vector<SequenceForward> batch(1);
      batch[0].kv = kv[g][s].get();
      batch[0].capture = cap[g][s].get();
      batch[0].input = in;
      std::vector<ForwardOutput> out;
      ASSERT_OK(e.gpu->Forward(batch, &out));
    }
    other[g] = NewSeq(*e.gpu, 128);
    ASSERT_NE(other[g], nullptr);
    const std::vector<int> pos = Iota(0, other_ids.size());
    ForwardInput in = AllRows(other_ids, pos);
    ForwardOutput o;
    ASSERT_OK(e.gpu->Forward(in, other[g].get(), &o));
  }
  // Look-ahead steps: [other's 3-row verify, scored 0, scored 1], then
  // [scored 1, other's decode row], then [scored 0] alone, and so on; each
  // scored sequence feeds the eager twin's greedy token to both twins.
  std::vector<int> next(kScored, 1), other_len(2, other_ids.size());
  int64_t replays = e.gpu->graph_replays();
  // Steps 0 and 1 hold both scored sequences, the others one each in turn:
  // `lookahead` rows each.
  for (int step = 0; step < 2 + 2 * (lookahead - 2); ++step) {
    const bool both = step < 2;
    std::vector<int> scored;
    if (both) {
      scored = {0, 1};
    } else {
      scored = {(step % 2)};
    }
    const int other_rows = step == 0 ? 3 : step % 3 == 1 ? 1 : 0;
    std::vector<int> oid(other_rows), opos(other_rows);
    for (int r = 0; r < other_rows; ++r) oid[r] = Uniform(0, vocab - 1);
    std::vector<std::vector<int>> pos(kScored);
    std::vector<int> eager_next(kScored, -1);
    for (int g = 0; g < 2; ++g) {
      e.gpu->set_cuda_graphs(g == 0);
      std::vector<SequenceForward> batch;
      std::vector<int> scored_at;
      const auto add_other = [&] {
        if (other_rows == 0) return;
        opos = Iota(other_len[g], other_rows);
        SequenceForward f;
        f.kv = other[g].get();
        f.input = AllRows(oid, opos);
        f.input.argmax_only = true;
        batch.push_back(std::move(f));
      };
      if (step == 0) add_other();
      for (int s : scored) {
        pos[s] = {kv[g][s]->size()};
        SequenceForward f;
        f.kv = kv[g][s].get();
        f.capture = cap[g][s].get();
        f.input.token_ids = absl::MakeConstSpan(&next[s], 1);
        f.input.position_ids = pos[s];
        f.input.argmax_only = true;
        f.input.capture_query_rows = {0};
        scored_at.push_back(static_cast<int>(batch.size()));
        batch.push_back(std::move(f));
      }
      if (step != 0) add_other();
      other_len[g] += other_rows;
      std::vector<ForwardOutput> out;
      ASSERT_OK(e.gpu->Forward(batch, &out));
      for (size_t k = 0; k < scored.size(); ++k) {
        ASSERT_EQ(out[scored_at[k]].argmax.size(), 1u);
        if (g == 1) eager_next[scored[k]] = out[scored_at[k]].argmax[0];
      }
    }
    EXPECT_EQ(e.gpu->graph_replays(), ++replays) << "step " << step;
    for (int s : scored) next[s] = eager_next[s];
  }
  for (int s = 0; s < kScored; ++s) {
    SCOPED_TRACE(absl::StrCat("scored sequence ", s));
    const int rows = 1 + lookahead;
    ASSERT_EQ(cap[0][s]->rows(), rows);
    ASSERT_EQ(cap[1][s]->rows(), rows);
    absl::StatusOr<std::vector<float>> gq = cap[0][s]->CopyToHost();
    absl::StatusOr<std::vector<float>> eq = cap[1][s]->CopyToHost();
    ASSERT_TRUE(gq.ok()) << gq.status();
    ASSERT_TRUE(eq.ok()) << eq.status();
    ASSERT_EQ(gq->size(), c.num_hidden_layers * rows * qrow);
    // Row by row and layer by layer, so a row landing in the wrong place
    // (or a stale row) shows where it is.
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      for (int r = 0; r < rows; ++r) {
        const size_t at = (static_cast<size_t>(l) * rows + r) * qrow;
        const std::vector<float> got(gq->begin() + at,
                                     gq->begin() + at + qrow);
        const std::vector<float> want(eq->begin() + at,
                                      eq->begin() + at + qrow);
        EXPECT_LT(RelErr(got, want), 2e-2) << "layer " << l << " row " << r;
      }
    }
    const int len = static_cast<int>(prompt[s].size());
    const ScoringOptions opts;
    absl::StatusOr<ImportanceResult> gs =
        e.gpu->ScoreImportance(*kv[0][s], len, *cap[0][s], opts, 1);
    absl::StatusOr<ImportanceResult> es =
        e.gpu->ScoreImportance(*kv[1][s], len, *cap[1][s], opts, 1);
    ASSERT_TRUE(gs.ok()) << gs.status();
    ASSERT_TRUE(es.ok()) << es.status();
    EXPECT_LT(RelErr(gs->importance, es->importance), 5e-2);
    for (float keep : {0.1f, 0.3f}) {
      ExpectSelectionsAgree(gs->importance, es->importance, keep, 16, 5e-2);
    }
  }
}

// WarmUp captures one greedy and one sampled graph per bucket up to its
// max_batch and a capturing one-row graph, leaves the pool as it found
// it, and later steps of those
// buckets replay without capturing again; with graphs off it captures
// nothing, and its prefill still runs.
TEST_P(ModelTest, WarmUpCapturesEveryBucketAndFreesItsSequences) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16, 64 * 128);
  ASSERT_NE(e.gpu, nullptr);
  const int vocab = e.cpu->config().vocab_size;
  const int free_before = e.gpu->kv_cache().num_free_blocks();
  ASSERT_OK(e.gpu->WarmUp(/*prefill_rows=*/100, /*max_batch=*/8));
  // Buckets 1, 2, 4, 8, and the look-ahead's.
  EXPECT_EQ(e.gpu->graphs_captured(), 2 * 4 + 1);
  EXPECT_EQ(e.gpu->kv_cache().num_free_blocks(), free_before);
  // A greedy step of 3 sequences (bucket 4) replays what WarmUp captured.
  std::vector<std::unique_ptr<KvSequence>> seqs;
  std::vector<int> ids(3);
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(NewSeq(*e.gpu, 16));
    ASSERT_NE(seqs.back(), nullptr);
    ids[i] = Uniform(0, vocab - 1);
  }
  const int zero = 0;
  std::vector<SequenceForward> batch(3);
  for (int i = 0; i < 3; ++i) {
    batch[i].kv = seqs[i].get();
    batch[i].input.token_ids = absl::MakeConstSpan(&ids[i], 1);
    batch[i].input.position_ids = absl::MakeConstSpan(&zero, 1);
    batch[i].input.argmax_only = true;
  }
  const int64_t replays = e.gpu->graph_replays();
  std::vector<ForwardOutput> out;
  ASSERT_OK(e.gpu->Forward(batch, &out));
  EXPECT_EQ(e.gpu->graph_replays(), replays + 1);
  EXPECT_EQ(e.gpu->graphs_captured(), 2 * 4 + 1);

  Engines off = LoadEngines(GetParam(), CudaDType::kBF16, 64 * 128);
  ASSERT_NE(off.gpu, nullptr);
  off.gpu->set_cuda_graphs(false);
  ASSERT_OK(off.gpu->WarmUp(100, 8));
  EXPECT_EQ(off.gpu->graphs_captured(), 0);
  EXPECT_EQ(off.gpu->kv_cache().num_free_blocks(),
            off.gpu->kv_cache().num_blocks());
}

// TunePrefillAttention times the prefill kernels that apply on the bench
// pair's tiny twins (head_dim 64 and 128, bf16: FlashAttention, the mma
// kernel, cuDNN where libcudnn loads), keeps one that ran and agrees,
// frees its sequence, and the model still matches the CPU after it; a
// context too short for a chunk of kFlashMinRows rows is refused and
// leaves the path alone.
TEST_F(CudaTest, TunePrefillAttentionKeepsAnAgreeingKernel) {
  for (const char* preset : {"llama-3.2-1b-tiny", "llama-3.1-8b-tiny"}) {
    SCOPED_TRACE(preset);
    const std::string dir = ::testing::TempDir() + "/tune_" + preset;
    ASSERT_OK(WriteSyntheticCheckpoint(preset, dir, seed_, "BF16"));
    Engines e = LoadEnginesFromDir(dir, CudaDType::kBF16, 1024);
    ASSERT_NE(e.gpu, nullptr);
    const int free_before = e.gpu->kv_cache().num_free_blocks();

    absl::StatusOr<PrefillTuning> short_context =
        e.gpu->TunePrefillAttention(/*context_tokens=*/40, /*chunk_rows=*/2048);
    EXPECT_EQ(short_context.status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(e.gpu->attention_path(), CudaModelRunner::AttentionPath::kAuto);

    absl::StatusOr<PrefillTuning> t =
        e.gpu->TunePrefillAttention(/*context_tokens=*/256, /*chunk_rows=*/64,
                                    /*reps=*/1);
    ASSERT_OK(t.status());
    std::printf("%s: %s\n", preset, DescribePrefillTuning(*t).c_str());
    EXPECT_EQ(t->context_tokens, 256);
    EXPECT_EQ(t->chunk_rows, 64);
    ASSERT_EQ(t->trials.size(), 3u);
    EXPECT_EQ(t->trials[0].name, "flash");
    EXPECT_TRUE(t->trials[0].ran);
    EXPECT_GT(t->trials[0].seconds, 0);
    // The mma kernel takes head_dim 64 and 128 in bf16, and is right.
    EXPECT_EQ(t->trials[1].name, "mma");
    EXPECT_TRUE(t->trials[1].ran) << t->trials[1].note;
    EXPECT_TRUE(t->trials[1].agrees) << t->trials[1].max_rel_diff;
    EXPECT_LT(t->trials[1].max_rel_diff, kBatchTolBf16);
    EXPECT_EQ(t->trials[2].name, "cudnn");
    if (t->trials[2].ran) {
      EXPECT_TRUE(t->trials[2].agrees) << t->trials[2].max_rel_diff;
    } else {
      EXPECT_FALSE(t->trials[2].note.empty());
    }
    ASSERT_EQ(t->chosen, ChoosePrefillTrial(t->trials));
    EXPECT_TRUE(t->trials[t->chosen].ran);
    const CudaModelRunner::AttentionPath kept[] = {
        CudaModelRunner::AttentionPath::kAuto,
        CudaModelRunner::AttentionPath::kFlashMma,
        CudaModelRunner::AttentionPath::kCudnn};
    EXPECT_EQ(e.gpu->attention_path(), kept[t->chosen]);
    EXPECT_EQ(e.gpu->kv_cache().num_free_blocks(), free_before);

    // A prefill on the kept kernel still matches the CPU.
    const int vocab = e.cpu->config().vocab_size, n = 150;
    std::vector<int> ids(n);
    for (int& id : ids) id = Uniform(0, vocab - 1);
    const ForwardInput in = AllRows(ids, Iota(0, n));
    std::unique_ptr<KvSequence> ckv = NewSeq(*e.cpu, n);
    std::unique_ptr<KvSequence> gkv = NewSeq(*e.gpu, n);
    ASSERT_NE(gkv, nullptr);
    ForwardOutput cpu_out, gpu_out;
    ASSERT_OK(e.cpu->Forward(in, ckv.get(), &cpu_out));
    ASSERT_OK(e.gpu->Forward(in, gkv.get(), &gpu_out));
    ExpectLogitsMatch(cpu_out, gpu_out, vocab, kBatchTolBf16);
  }
}

// LinearDispatch's choice per (projection, rows) and the tuning's log
// line, without a device.
TEST(CudaHostTest, LinearDispatchAndSkinnyTuningLine) {
  LinearDispatch d;
  EXPECT_FALSE(d.skinny(Projection::kQkv, 1));
  d.set_skinny(Projection::kO, 3, true);
  EXPECT_TRUE(d.skinny(Projection::kO, 3));
  EXPECT_FALSE(d.skinny(Projection::kO, 2));
  EXPECT_FALSE(d.skinny(Projection::kQkv, 3));
  d.set_skinny(Projection::kO, 3, false);
  EXPECT_FALSE(d.skinny(Projection::kO, 3));
  d.set_skinny(Projection::kO, 0, true);  // out of range: ignored
  d.set_skinny(Projection::kO, cuda_kernels::kSkinnyMaxRows + 1, true);
  EXPECT_FALSE(d.skinny(Projection::kO, 0));
  EXPECT_FALSE(d.skinny(Projection::kO, cuda_kernels::kSkinnyMaxRows + 1));
  d.UseSkinnyEverywhere();
  for (int r = 1; r <= cuda_kernels::kSkinnyMaxRows; ++r) {
    EXPECT_TRUE(d.skinny(Projection::kLmHead, r)) << r;
  }
  EXPECT_EQ(d.skinny_launches(), 0);

  std::vector<SkinnyLinearTrial> trials;
  for (int rows = 1; rows <= 4; ++rows) {
    SkinnyLinearTrial t;
    t.projection = Projection::kGateUp;
    t.rows = rows;
    t.cublas_seconds = 1e-3;
    t.skinny_seconds = 0.8e-3;
    t.skinny = rows != 3;
    trials.push_back(t);
    t.projection = Projection::kLmHead;
    t.skinny = false;
    trials.push_back(t);
  }
  EXPECT_EQ(DescribeSkinnyTuning(trials),
            "decode GEMMs: skinny for gate_up at 1-2,4; cuBLAS else (1 row, "
            "ms a forward, cuBLAS / skinny: gate_up 1.000 / 0.800, lm_head "
            "1.000 / 0.800)");
  for (SkinnyLinearTrial& t : trials) t.skinny = false;
  EXPECT_EQ(DescribeSkinnyTuning(trials).rfind(
                "decode GEMMs: cuBLAS for every projection (", 0),
            0u);
}

// TuneSkinnyLinear times every projection at each row count, keeps
// SkinnyLinear only where it agrees and wins by the margin, and the runner
// then forwards with that choice (the emulated device's times are the
// host's: the choices are arbitrary there, the rule is not).
TEST_F(CudaTest, TuneSkinnyLinearFollowsItsRule) {
  const std::string dir = ::testing::TempDir() + "/tune_skinny";
  ASSERT_OK(WriteSyntheticCheckpoint("llama-3.2-1b-tiny", dir, seed_, "BF16"));
  Engines e = LoadEnginesFromDir(dir, CudaDType::kBF16, 1024);
  ASSERT_NE(e.gpu, nullptr);
  EXPECT_EQ(e.gpu->TuneSkinnyLinear(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.gpu->TuneSkinnyLinear(cuda_kernels::kSkinnyMaxRows + 1)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::vector<SkinnyLinearTrial>> trials =
      e.gpu->TuneSkinnyLinear(3);
  ASSERT_OK(trials.status());
  std::printf("%s\n", DescribeSkinnyTuning(*trials).c_str());
  ASSERT_EQ(trials->size(), static_cast<size_t>(kNumProjections) * 3);
  int chosen = 0;
  for (const SkinnyLinearTrial& t : *trials) {
    SCOPED_TRACE(absl::StrCat(ProjectionName(t.projection), " at ", t.rows));
    EXPECT_GT(t.cublas_seconds, 0);
    EXPECT_GT(t.skinny_seconds, 0);
    // Every projection of this model is SkinnyLinear's shape, and right.
    EXPECT_LT(t.max_rel_diff, 1e-3);
    EXPECT_EQ(t.skinny, t.skinny_seconds <=
                            (1 - kSkinnyMargin) * t.cublas_seconds);
    chosen += t.skinny;
  }
  EXPECT_EQ(e.gpu->skinny_linear_launches(), 0);  // the tuning's are its own
  // A decode step after a prefill: SkinnyLinear runs where it was chosen.
  const int vocab = e.cpu->config().vocab_size, n = 20;
  std::vector<int> ids(n);
  for (int& id : ids) id = Uniform(0, vocab - 1);
  std::unique_ptr<KvSequence> ckv = NewSeq(*e.cpu, n + 2);
  std::unique_ptr<KvSequence> gkv = NewSeq(*e.gpu, n + 2);
  ASSERT_NE(gkv, nullptr);
  e.gpu->set_cuda_graphs(false);
  ForwardOutput co, go;
  const std::vector<int> pos = Iota(0, n);
  ASSERT_OK(e.cpu->Forward(AllRows(ids, pos), ckv.get(), &co));
  ASSERT_OK(e.gpu->Forward(AllRows(ids, pos), gkv.get(), &go));
  const std::vector<int> one = {ids[0]}, at = {n};
  ASSERT_OK(e.cpu->Forward(AllRows(one, at), ckv.get(), &co));
  ASSERT_OK(e.gpu->Forward(AllRows(one, at), gkv.get(), &go));
  ExpectLogitsMatch(co, go, vocab, kRowsTolBf16);
  int one_row = 0;
  for (const SkinnyLinearTrial& t : *trials) {
    if (t.rows == 1 && t.skinny) {
      one_row += t.projection == Projection::kLmHead
                     ? 1
                     : e.cpu->config().num_hidden_layers;
    }
  }
  EXPECT_EQ(e.gpu->skinny_linear_launches(), one_row) << chosen;

  // --decode_gemm's other modes through ChooseDecodeGemm.
  EXPECT_EQ(e.gpu->ChooseDecodeGemm("fast").status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> line = e.gpu->ChooseDecodeGemm("skinny");
  ASSERT_OK(line.status());
  EXPECT_EQ(line->rfind("decode GEMMs: skinny wherever", 0), 0u) << *line;
  const std::vector<int> two = {ids[1]}, at2 = {n + 1};
  ASSERT_OK(e.gpu->Forward(AllRows(two, at2), gkv.get(), &go));
  // Every projection of this model is SkinnyLinear's shape: 4 a layer and
  // the lm_head.
  EXPECT_EQ(e.gpu->skinny_linear_launches(),
            4 * e.cpu->config().num_hidden_layers + 1);
  ASSERT_OK(e.gpu->ChooseDecodeGemm("cublas").status());
  EXPECT_EQ(e.gpu->skinny_linear_launches(), 0);
}

// With every few-row projection on SkinnyLinear, decode steps, a verify
// round, a two-sequence step and their graph replays match the CPU engine
// as cuBLAS's do; a prefill chunk stays on cuBLAS but for its pruned last
// layer's live row. Widths SkinnyLinear does not take (stories260K's
// ffn of 172) fall back to cuBLAS.
TEST_P(ModelTest, SkinnyProjectionsMatchCpu) {
  for (CudaDType dt : {CudaDType::kBF16, CudaDType::kFP16}) {
    SCOPED_TRACE(CudaDTypeName(dt));
    Engines e = LoadEngines(GetParam(), dt);
    ASSERT_NE(e.gpu, nullptr);
    e.gpu->set_skinny_linear(true);
    const int vocab = e.cpu->config().vocab_size;
    for (bool graphs : {false, true}) {
      SCOPED_TRACE(graphs ? "graphs" : "eager");
      e.gpu->set_cuda_graphs(graphs);
      const int64_t replays0 = e.gpu->graph_replays();
      const int n = 60;
      std::unique_ptr<KvSequence> ckv[2], gkv[2];
      for (int s = 0; s < 2; ++s) {
        ckv[s] = NewSeq(*e.cpu, n + 16);
        gkv[s] = NewSeq(*e.gpu, n + 16);
        ASSERT_NE(gkv[s], nullptr);
      }
      // Prefills asking for the last row only (the pruned last layer).
      std::vector<int> next(2);
      for (int s = 0; s < 2; ++s) {
        std::vector<int> ids(n);
        for (int& id : ids) id = Uniform(0, vocab - 1);
        ForwardInput in;
        in.token_ids = ids;
        const std::vector<int> pos = Iota(0, n);
        in.position_ids = pos;
        ForwardOutput co, go;
        ASSERT_OK(e.cpu->Forward(in, ckv[s].get(), &co));
        const int64_t before = e.gpu->skinny_linear_launches();
        ASSERT_OK(e.gpu->Forward(in, gkv[s].get(), &go));
        EXPECT_GT(e.gpu->skinny_linear_launches(), before);
        // One logit row: the small-batch bound.
        ExpectLogitsMatch(co, go, vocab, RowsTol(dt));
        next[s] = Argmax(co.logits.data(), vocab);
      }
      // Decode steps of both sequences together (2 rows), then of one.
      ForwardOutput cpu_rows, gpu_rows;
      for (int step = 0; step < 4; ++step) {
        const int p = n + step, seqs = step < 2 ? 2 : 1;
        std::vector<SequenceForward> cb(seqs), gb(seqs);
        for (int s = 0; s < seqs; ++s) {
          for (auto* b : {&cb, &gb}) {
            (*b)[s].input.token_ids = absl::MakeConstSpan(&next[s], 1);
            (*b)[s].input.position_ids = absl::MakeConstSpan(&p, 1);
            (*b)[s].input.logit_rows = {0};
          }
          cb[s].kv = ckv[s].get();
          gb[s].kv = gkv[s].get();
        }
        std::vector<ForwardOutput> co, go;
        ASSERT_OK(e.cpu->Forward(cb, &co));
        ASSERT_OK(e.gpu->Forward(gb, &go));
        for (int s = 0; s < seqs; ++s) {
          AppendRows(co[s], &cpu_rows);
          AppendRows(go[s], &gpu_rows);
          next[s] = Argmax(co[s].logits.data(), vocab);
        }
      }
      // A verify round of 5 rows on the first sequence.
      std::vector<int> draft(5);
      for (int& t : draft) t = Uniform(0, vocab - 1);
      const std::vector<int> dpos = Iota(n + 4, 5);
      const ForwardInput v = AllRows(draft, dpos);
      ForwardOutput cv, gv;
      ASSERT_OK(e.cpu->Forward(v, ckv[0].get(), &cv));
      ASSERT_OK(e.gpu->Forward(v, gkv[0].get(), &gv));
      AppendRows(cv, &cpu_rows);
      AppendRows(gv, &gpu_rows);
      ExpectLogitsMatch(cpu_rows, gpu_rows, vocab, RowsTol(dt));
      if (graphs) {
        EXPECT_GT(e.gpu->graph_replays(), replays0);
      }
    }
    // Back on cuBLAS: no SkinnyLinear launch.
    e.gpu->set_skinny_linear(false);
    e.gpu->set_cuda_graphs(false);
    std::unique_ptr<KvSequence> kv = NewSeq(*e.gpu, 4);
    const std::vector<int> one = {1}, zero = {0};
    ForwardOutput o;
    ASSERT_OK(e.gpu->Forward(AllRows(one, zero), kv.get(), &o));
    EXPECT_EQ(e.gpu->skinny_linear_launches(), 0);
  }
}

// The cuDNN path through the runner: prefill chunks (a full prefill, a
// chunk at restored positions after cached keys, one more chunk) match the
// CPU on the bench pair's tiny twins (head_dim 64 and 128), and a decode
// row after them too. Where cuDNN's handle cannot be created (the emulated
// device) the runner falls back to FlashAttention, and the test checks
// only its own chunks.
TEST_F(CudaTest, CudnnChunksMatchCpu) {
  if (!CudnnAttention::Create(nullptr).ok()) {
    std::printf("no cuDNN handle here: the chunks run on FlashAttention\n");
  }
  // Every chunk through cuDNN (a plan per shape), then the serving default:
  // these small unplanned shapes do not pay for a plan (CudnnPlanPaysOff)
  // and run on FlashMma, building none.
  for (const bool every_chunk : {true, false}) {
    for (const char* preset : {"llama-3.2-1b-tiny", "llama-3.1-8b-tiny"}) {
      SCOPED_TRACE(absl::StrCat(preset, every_chunk ? ", every chunk planned"
                                                    : ", plans that pay off"));
      const std::string dir = ::testing::TempDir() + "/cudnn_" + preset;
      ASSERT_OK(WriteSyntheticCheckpoint(preset, dir, seed_, "BF16"));
      Engines e = LoadEnginesFromDir(dir, CudaDType::kBF16, 1024);
      ASSERT_NE(e.gpu, nullptr);
      e.gpu->set_cudnn_plan_every_chunk(every_chunk);
      e.gpu->set_attention_path(CudaModelRunner::AttentionPath::kCudnn);
      const int plans_at_start = e.gpu->cudnn_plans_built();
      const int vocab = e.cpu->config().vocab_size;
      std::unique_ptr<KvSequence> ckv = NewSeq(*e.cpu, 600);
      std::unique_ptr<KvSequence> gkv = NewSeq(*e.gpu, 600);
      ASSERT_NE(ckv, nullptr);
      ASSERT_NE(gkv, nullptr);
      // 150 rows at 0..149; 77 at 150, 152, ... (kept tokens); 40 after.
      int next_pos = 0;
      for (const auto& [rows, stride] :
           {std::pair<int, int>{150, 1}, {77, 2}, {40, 1}}) {
        std::vector<int> ids(rows), pos(rows);
        for (int& id : ids) id = Uniform(0, vocab - 1);
        for (int j = 0; j < rows; ++j) pos[j] = next_pos + j * stride;
        next_pos = pos.back() + 1;
        ForwardOutput co, go;
        ASSERT_OK(e.cpu->Forward(AllRows(ids, pos), ckv.get(), &co));
        ASSERT_OK(e.gpu->Forward(AllRows(ids, pos), gkv.get(), &go));
        SCOPED_TRACE(absl::StrCat(rows, " rows"));
        ExpectLogitsMatch(co, go, vocab, kBatchTolBf16);
      }
      ExpectDecodeRowMatches(*e.cpu, ckv.get(), *e.gpu, gkv.get(),
                             Uniform(0, vocab - 1), next_pos);
      if (every_chunk) {
        // One plan per chunk shape, where cuDNN loads at all.
        if (plans_at_start > 0) {
          EXPECT_EQ(e.gpu->cudnn_plans_built(), plans_at_start + 3);
        }
      } else {
        EXPECT_EQ(e.gpu->cudnn_plans_built(), plans_at_start);
      }
    }
  }
}

TEST_P(ModelTest, NonContiguousPositionsMatchCpu) {
  // Speculative Prefill: kept tokens at their original positions, decoding
  // continues at the original prompt length.
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, prompt = 400;
  std::vector<int> kept;
  for (int i = 0; i < prompt; ++i) {
    if (i == 0 || i == prompt - 1 || (i / 16) % 3 == 1) kept.push_back(i);
  }
  std::vector<int> ids(kept.size());
  for (int& id : ids) id = Uniform(0, vocab - 1);
  std::unique_ptr<KvSequence> ckv = NewSeq(*e.cpu, c.max_position_embeddings);
  std::unique_ptr<KvSequence> gkv = NewSeq(*e.gpu, c.max_position_embeddings);
  ASSERT_NE(ckv, nullptr);
  ASSERT_NE(gkv, nullptr);
  ForwardOutput co, go;
  ASSERT_OK(e.cpu->Forward(AllRows(ids, kept), ckv.get(), &co));
  ASSERT_OK(e.gpu->Forward(AllRows(ids, kept), gkv.get(), &go));
  ExpectLogitsMatch(co, go, vocab, kBatchTolBf16);
  const int tok = Argmax(co.logits_row(static_cast<int>(kept.size()) - 1, vocab),
                         vocab);
  ExpectDecodeRowMatches(*e.cpu, ckv.get(), *e.gpu, gkv.get(), tok, prompt);
  EXPECT_EQ(gkv->last_position(), prompt);
}

// One Forward over a mixed batch, as the scheduler issues it: a prefill
// chunk of a new sequence A (40 rows at pruned, non-contiguous positions:
// the FlashAttention path under kAuto where the head_dim allows it), one
// decode row of B, and a k + 1 = 5 row verify round of C, whose cached
// prompt was pruned (positions 3i + 1). B's and C's histories were
// prefilled in alternating chunks, so their blocks interleave in the pool.
// Every sequence's logits and captured queries match the CPU runner's for
// the same batch, on every attention path.
// Three fresh 128-token sequences on each of a test's CPU and GPU runner.
void NewSeqsOnBoth(ModelRunner* const (&runners)[2],
                   std::unique_ptr<KvSequence> (&kv)[2][3]) {
  for (int r = 0; r < 2; ++r) {
    for (int s = 0; s < 3; ++s) {
      kv[r][s] = NewSeq(*runners[r], 128);
      ASSERT_NE(kv[r][s], nullptr);
    }
  }
}

// One step of three sequences on a test's CPU and GPU runner: sequence s
// is inputs[s] on kv[r][s] of runner r, whose outputs go to out[r].
void StepOnBoth(ModelRunner* const (&runners)[2],
                std::unique_ptr<KvSequence> (&kv)[2][3],
                const ForwardInput* const (&inputs)[3],
                std::vector<ForwardOutput> (&out)[2]) {
  for (int r = 0; r < 2; ++r) {
    std::vector<SequenceForward> batch(3);
    for (int s = 0; s < 3; ++s) {
      batch[s].kv = kv[r][s].get();
      batch[s].input = *inputs[s];
    }
    ASSERT_OK(runners[r]->Forward(batch, &out[r]));
    ASSERT_EQ(out[r].size(), 3u);
  }
}

TEST_P(ModelTest, MixedBatchMatchesCpu) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16, /*pool_tokens=*/256,
                          /*block_size=*/4);
  ASSERT_NE(e.gpu, nullptr);
  const int vocab = e.cpu->config().vocab_size;
  auto tokens = [&](int n) {
    std::vector<int> t(n);
    for (int& x : t) x = Uniform(0, vocab - 1);
    return t;
  };
  // Histories.
  const std::vector<int> hb = tokens(37), hc = tokens(23);
  const std::vector<int> pb = Iota(0, 37);
  std::vector<int> pc(hc.size());
  for (size_t i = 0; i < pc.size(); ++i) pc[i] = 3 * static_cast<int>(i) + 1;
  // The step's new tokens.
  const std::vector<int> na = tokens(40), nb = tokens(1), nc = tokens(5);
  std::vector<int> pa(na.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    pa[i] = 2 * static_cast<int>(i) + (i > 10 ? 9 : 0);
  }
  const std::vector<int> qb = {static_cast<int>(hb.size())};
  const std::vector<int> qc = Iota(pc.back() + 1, 5);
  ForwardInput ia = AllRows(na, pa);
  ia.capture_query_rows = {39, 5};
  ForwardInput ib;
  ib.token_ids = nb;
  ib.position_ids = qb;  // logit_rows empty: the last (only) row
  ib.capture_query_rows = {0};
  ForwardInput ic = AllRows(nc, qc);
  ic.capture_query_rows = {4};

  for (const CudaModelRunner::AttentionPath path : kAllPaths) {
    SCOPED_TRACE(PathName(path));
    e.gpu->set_attention_path(path);
    ModelRunner* runners[2] = {e.cpu.get(), e.gpu.get()};
    std::unique_ptr<KvSequence> kv[2][3];  // [cpu, gpu][A, B, C]
    ASSERT_NO_FATAL_FAILURE(NewSeqsOnBoth(runners, kv));
    // B's and C's histories, 8 tokens of each per batch.
    for (int from = 0; from < static_cast<int>(hb.size()); from += 8) {
      for (int r = 0; r < 2; ++r) {
        std::vector<SequenceForward> batch;
        for (int s : {1, 2}) {
          const std::vector<int>& h = s == 1 ? hb : hc;
          const std::vector<int>& p = s == 1 ? pb : pc;
          const int len = std::min<int>(8, static_cast<int>(h.size()) - from);
          if (len <= 0) continue;
          SequenceForward f;
          f.kv = kv[r][s].get();
          f.input.token_ids = absl::MakeConstSpan(&h[from], len);
          f.input.position_ids = absl::MakeConstSpan(&p[from], len);
          batch.push_back(std::move(f));
        }
        std::vector<ForwardOutput> out;
        ASSERT_OK(runners[r]->Forward(batch, &out));
      }
    }
    int jumps = 0;
    const std::vector<int>& table = kv[1][1]->block_table();
    for (size_t b = 1; b < table.size(); ++b) {
      jumps += table[b] != table[b - 1] + 1;
    }
    EXPECT_GT(jumps, 0) << "B's blocks are contiguous";

    // The mixed step, in one Forward on each runner.
    std::vector<ForwardOutput> out[2];
    ASSERT_NO_FATAL_FAILURE(StepOnBoth(runners, kv, {&ia, &ib, &ic}, out));
    {
      SCOPED_TRACE("A: prefill chunk");
      ExpectLogitsMatch(out[0][0], out[1][0], vocab, kBatchTolBf16);
      EXPECT_LT(RelErr(out[1][0].queries, out[0][0].queries), kBatchTolBf16);
    }
    {
      SCOPED_TRACE("B: decode row");
      ExpectLogitsMatch(out[0][1], out[1][1], vocab, kRowsTolBf16);
      EXPECT_LT(RelErr(out[1][1].queries, out[0][1].queries), kRowsTolBf16);
    }
    {
      SCOPED_TRACE("C: verify round");
      ExpectLogitsMatch(out[0][2], out[1][2], vocab, kRowsTolBf16);
      EXPECT_LT(RelErr(out[1][2].queries, out[0][2].queries), kRowsTolBf16);
    }
    const int sizes[3] = {40, 38, 28};
    for (int s = 0; s < 3; ++s) {
      EXPECT_EQ(kv[1][s]->size(), sizes[s]) << "sequence " << s;
      EXPECT_EQ(kv[1][s]->positions(), kv[0][s]->positions())
          << "sequence " << s;
    }
  }
}

// The last layer computes only the rows somebody reads
// (CudaModelRunner::kPrunedMaxRows): in one step, a long chunk asking for
// its last row's logits, a chunk on a cached context asking for a 3-row
// suffix (out of order) and a decode row give the CPU's logits; the next
// step of each reads back every row's K / V, the pruned rows' last layer
// included, and matches the CPU again. The phase timer tells whether the
// step pruned (its row_gather phase): wherever long chunks run on a
// per-sequence kernel, never on split-K alone.
TEST_P(ModelTest, LastLayerComputesOnlyTheRowsRead) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16, /*pool_tokens=*/256,
                          /*block_size=*/4);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size;
  auto tokens = [&](int n) {
    std::vector<int> t(n);
    for (int& x : t) x = Uniform(0, vocab - 1);
    return t;
  };
  const std::vector<int> hb = tokens(20), hc = tokens(30);
  const std::vector<int> na = tokens(48), nb = tokens(40), nc = tokens(1);
  const std::vector<int> pa = Iota(0, 48), pb = Iota(20, 40), pc = {30};
  ForwardInput ia;  // logit_rows empty: the last row
  ia.token_ids = na;
  ia.position_ids = pa;
  ForwardInput ib;
  ib.token_ids = nb;
  ib.position_ids = pb;
  ib.logit_rows = {39, 37};
  ForwardInput ic;
  ic.token_ids = nc;
  ic.position_ids = pc;
  for (const CudaModelRunner::AttentionPath path : kAllPaths) {
    SCOPED_TRACE(PathName(path));
    e.gpu->set_attention_path(path);
    ModelRunner* runners[2] = {e.cpu.get(), e.gpu.get()};
    std::unique_ptr<KvSequence> kv[2][3];  // [cpu, gpu][A, B, C]
    ASSERT_NO_FATAL_FAILURE(NewSeqsOnBoth(runners, kv));
    for (int r = 0; r < 2; ++r) {
      ForwardOutput unused;
      ASSERT_OK(runners[r]->Forward(AllRows(hb, Iota(0, 20)), kv[r][1].get(),
                                    &unused));
      ASSERT_OK(runners[r]->Forward(AllRows(hc, Iota(0, 30)), kv[r][2].get(),
                                    &unused));
    }
    e.gpu->TakePhaseTimes();
    e.gpu->set_phase_timing(true);
    std::vector<ForwardOutput> out[2];
    ASSERT_NO_FATAL_FAILURE(StepOnBoth(runners, kv, {&ia, &ib, &ic}, out));
    e.gpu->set_phase_timing(false);
    double row_gather = -1.0;
    for (const auto& [name, seconds] : e.gpu->TakePhaseTimes()) {
      if (name == "row_gather") row_gather = seconds;
    }
    const bool prunes =
        path != CudaModelRunner::AttentionPath::kSplitK &&
        cuda_kernels::FlashAttentionSupported(c.head_dim, CudaDType::kBF16);
    EXPECT_EQ(row_gather > 0.0, prunes) << row_gather;
    // One or two logit rows each: the small-batch bound (a seed gave a
    // decode row 0.11 at the batch bound on stories260K-draft, which
    // prunes nothing).
    for (int s = 0; s < 3; ++s) {
      SCOPED_TRACE(absl::StrCat("sequence ", s));
      ExpectLogitsMatch(out[0][s], out[1][s], vocab, kRowsTolBf16);
    }
    // The next token of each, reading every row's K / V.
    std::vector<int> next(3), pos = {48, 60, 31};
    ForwardInput decode[3];
    for (int s = 0; s < 3; ++s) {
      next[s] = Argmax(out[0][s].logits_row(0, vocab), vocab);
      decode[s].token_ids = absl::MakeConstSpan(&next[s], 1);
      decode[s].position_ids = absl::MakeConstSpan(&pos[s], 1);
    }
    std::vector<ForwardOutput> step[2];
    ASSERT_NO_FATAL_FAILURE(
        StepOnBoth(runners, kv, {&decode[0], &decode[1], &decode[2]}, step));
    for (int s = 0; s < 3; ++s) {
      SCOPED_TRACE(absl::StrCat("next step of sequence ", s));
      ExpectLogitsMatch(step[0][s], step[1][s], vocab, kRowsTolBf16);
      EXPECT_EQ(kv[1][s]->positions(), kv[0][s]->positions());
    }
  }
}

// Forking shares the prompt's blocks; appending to both sides (in one
// batch) copies the shared, partially filled block for the first writer
// (copy-on-write on the device), so neither side sees the other's tokens:
// the next decode row of each reads back what its own round cached. Both
// branches then give, bit for bit, the logits of two independent sequences
// fed the same tokens through the same calls, and match the CPU runner.
TEST_P(ModelTest, ForkedBranchesMatchIndependentSequences) {
  const int bs = 8;
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16, /*pool_tokens=*/128,
                          bs);
  ASSERT_NE(e.gpu, nullptr);
  const int vocab = e.cpu->config().vocab_size;
  PagedKvCache& cache = e.gpu->kv_cache();
  auto tokens = [&](int n) {
    std::vector<int> t(n);
    for (int& x : t) x = Uniform(0, vocab - 1);
    return t;
  };
  const int n = 13;  // one full block and 5 tokens of the second
  const std::vector<int> prompt = tokens(n), ppos = Iota(0, n);
  const std::vector<int> ta = tokens(3), tb = tokens(2);
  const std::vector<int> pa = Iota(n, 3), pb = Iota(n, 2);
  const std::vector<int> da = tokens(1), db = tokens(1);
  const std::vector<int> qa = {n + 3}, qb = {n + 2};
  // Round 1: x += ta, y += tb (both write into the prompt's second block);
  // round 2: one decode row each. Every row's logits, per side.
  auto rounds = [&](ModelRunner& runner, KvSequence* x, KvSequence* y,
                    ForwardOutput* ox, ForwardOutput* oy) {
    const ForwardInput inputs[2][2] = {{AllRows(ta, pa), AllRows(tb, pb)},
                                       {AllRows(da, qa), AllRows(db, qb)}};
    for (const auto& round : inputs) {
      std::vector<SequenceForward> batch(2);
      batch[0].kv = x;
      batch[0].input = round[0];
      batch[1].kv = y;
      batch[1].input = round[1];
      std::vector<ForwardOutput> out;
      ASSERT_OK(runner.Forward(batch, &out));
      AppendRows(out[0], ox);
      AppendRows(out[1], oy);
    }
  };

  std::unique_ptr<KvSequence> root = NewSeq(*e.gpu, 64);
  ASSERT_NE(root, nullptr);
  ForwardOutput out;
  ASSERT_OK(e.gpu->Forward(AllRows(prompt, ppos), root.get(), &out));
  const int free_before = cache.num_free_blocks();
  std::unique_ptr<KvSequence> branch = root->Fork();
  EXPECT_EQ(cache.num_free_blocks(), free_before);  // shared, no copy yet
  EXPECT_EQ(branch->block_table(), root->block_table());
  EXPECT_EQ(branch->positions(), root->positions());
  ForwardOutput fork_a, fork_b;
  rounds(*e.gpu, root.get(), branch.get(), &fork_a, &fork_b);
  EXPECT_EQ(root->block_table()[0], branch->block_table()[0]);  // shared
  EXPECT_NE(root->block_table()[1], branch->block_table()[1]);  // copied
  // The copy, and root's third block (its 17th token).
  EXPECT_EQ(cache.num_free_blocks(), free_before - 2);
  EXPECT_EQ(root->size(), n + 4);
  EXPECT_EQ(branch->size(), n + 3);

  // Independent sequences through the same calls.
  std::unique_ptr<KvSequence> a = NewSeq(*e.gpu, 64), b = NewSeq(*e.gpu, 64);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_OK(e.gpu->Forward(AllRows(prompt, ppos), a.get(), &out));
  ASSERT_OK(e.gpu->Forward(AllRows(prompt, ppos), b.get(), &out));
  ForwardOutput ind_a, ind_b;
  rounds(*e.gpu, a.get(), b.get(), &ind_a, &ind_b);
  EXPECT_EQ(fork_a.logits, ind_a.logits);
  EXPECT_EQ(fork_b.logits, ind_b.logits);

  // And the CPU runner on independent sequences.
  std::unique_ptr<KvSequence> ca = NewSeq(*e.cpu, 64), cb = NewSeq(*e.cpu, 64);
  ASSERT_NE(ca, nullptr);
  ASSERT_NE(cb, nullptr);
  ASSERT_OK(e.cpu->Forward(AllRows(prompt, ppos), ca.get(), &out));
  ASSERT_OK(e.cpu->Forward(AllRows(prompt, ppos), cb.get(), &out));
  ForwardOutput cpu_a, cpu_b;
  rounds(*e.cpu, ca.get(), cb.get(), &cpu_a, &cpu_b);
  ExpectLogitsMatch(cpu_a, fork_a, vocab, kRowsTolBf16);
  ExpectLogitsMatch(cpu_b, fork_b, vocab, kRowsTolBf16);

  root.reset();
  branch.reset();
  a.reset();
  b.reset();
  EXPECT_EQ(cache.num_free_blocks(), cache.num_blocks());
}

TEST_P(ModelTest, KvRollbackRestoresState) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16, /*pool_tokens=*/128,
                          /*block_size=*/16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, n = 60;
  std::vector<int> prompt(n), a(6), b(3);
  for (int& t : prompt) t = Uniform(0, vocab - 1);
  for (int& t : a) t = Uniform(0, vocab - 1);
  for (int& t : b) t = Uniform(0, vocab - 1);
  std::unique_ptr<KvSequence> ckv = NewSeq(*e.cpu, 128);
  std::unique_ptr<KvSequence> gkv = NewSeq(*e.gpu, 128);
  ASSERT_NE(ckv, nullptr);
  ASSERT_NE(gkv, nullptr);
  PagedKvCache& cache = e.gpu->kv_cache();
  auto run = [&](const std::vector<int>& toks, int from, ForwardOutput* co,
                 ForwardOutput* go) {
    const std::vector<int> pos = Iota(from, static_cast<int>(toks.size()));
    const ForwardInput in = AllRows(toks, pos);
    if (co != nullptr) {
      ASSERT_OK(e.cpu->Forward(in, ckv.get(), co));
    }
    ASSERT_OK(e.gpu->Forward(in, gkv.get(), go));
  };
  ForwardOutput co, go;
  run(prompt, 0, &co, &go);
  const int free_after_prompt = cache.num_free_blocks();  // 4 blocks held
  // Drafts `a` (rejected; they open a fifth block), then roll back and run
  // them again: the GPU must reproduce its own logits bit for bit.
  ForwardOutput ga1, ga2;
  run(a, n, nullptr, &ga1);
  EXPECT_EQ(gkv->size(), n + 6);
  EXPECT_EQ(cache.num_free_blocks(), free_after_prompt - 1);
  ASSERT_OK(gkv->Truncate(n));
  EXPECT_EQ(gkv->size(), n);
  EXPECT_EQ(cache.num_free_blocks(), free_after_prompt);  // block returned
  run(a, n, nullptr, &ga2);
  EXPECT_EQ(ga1.logits, ga2.logits);
  // Roll back again and take another branch `b`: matches the CPU runner,
  // which never saw `a`.
  ASSERT_OK(gkv->Truncate(n));
  ForwardOutput cb, gb;
  run(b, n, &cb, &gb);
  ExpectLogitsMatch(cb, gb, vocab, kRowsTolBf16);
  EXPECT_EQ(gkv->positions(), ckv->positions());
  // The cached keys after the rollback are the CPU's to bf16 precision.
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    absl::StatusOr<std::vector<float>> keys =
        e.gpu->CopyKeysToHost(l, *gkv, gkv->size());
    ASSERT_TRUE(keys.ok()) << keys.status();
    EXPECT_LT(RelErr(*keys, CpuKeys(*e.cpu, *ckv, l, ckv->size())),
              kBatchTolBf16)
        << "layer " << l;
  }
}

TEST_P(ModelTest, ForwardErrorsLeaveCacheUntouched) {
  const int bs = 4;
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16, /*pool_tokens=*/64,
                          bs);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  PagedKvCache& cache = e.gpu->kv_cache();
  std::unique_ptr<KvSequence> kv = NewSeq(*e.gpu, 8);
  std::unique_ptr<KvSequence> other = NewSeq(*e.gpu, 8);
  ASSERT_NE(kv, nullptr);
  ASSERT_NE(other, nullptr);
  const std::vector<int> ids = {1, 2, 3}, pos = {0, 1, 2};
  ForwardOutput out;
  ForwardInput ok_in;
  ok_in.token_ids = ids;
  ok_in.position_ids = pos;
  ForwardInput bad_id;
  const std::vector<int> oob = {1, c.vocab_size, 3};
  bad_id.token_ids = oob;
  bad_id.position_ids = pos;
  EXPECT_EQ(e.gpu->Forward(bad_id, kv.get(), &out).code(),
            absl::StatusCode::kInvalidArgument);
  ForwardInput bad_row = ok_in;
  bad_row.logit_rows = {3};
  EXPECT_EQ(e.gpu->Forward(bad_row, kv.get(), &out).code(),
            absl::StatusCode::kInvalidArgument);
  ForwardInput big;
  const std::vector<int> nine(9, 1), nine_pos = Iota(0, 9);
  big.token_ids = nine;
  big.position_ids = nine_pos;
  EXPECT_EQ(e.gpu->Forward(big, kv.get(), &out).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(kv->size(), 0);

  // A sequence of another runner's pool, a capture of another backend.
  std::unique_ptr<KvSequence> cpu_kv = NewSeq(*e.cpu, 8);
  ASSERT_NE(cpu_kv, nullptr);
  EXPECT_EQ(e.gpu->Forward(ok_in, cpu_kv.get(), &out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu_kv->size(), 0);
  absl::StatusOr<std::unique_ptr<QueryCapture>> cpu_capture =
      e.cpu->NewQueryCapture(4);
  ASSERT_TRUE(cpu_capture.ok()) << cpu_capture.status();
  std::vector<SequenceForward> batch(1);
  batch[0].kv = kv.get();
  batch[0].input = ok_in;
  batch[0].input.capture_query_rows = {2};
  batch[0].capture = cpu_capture->get();
  std::vector<ForwardOutput> outs;
  EXPECT_EQ(e.gpu->Forward(batch, &outs).code(),
            absl::StatusCode::kInvalidArgument);
  // A full capture.
  absl::StatusOr<std::unique_ptr<QueryCapture>> capture =
      e.gpu->NewQueryCapture(1);
  ASSERT_TRUE(capture.ok()) << capture.status();
  batch[0].input.capture_query_rows = {0, 2};
  batch[0].capture = capture->get();
  EXPECT_EQ(e.gpu->Forward(batch, &outs).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*capture)->rows(), 0);
  EXPECT_EQ(kv->size(), 0);

  // One bad entry fails the whole batch: the good one appends nothing.
  batch.assign(2, SequenceForward());
  batch[0].kv = kv.get();
  batch[0].input = ok_in;
  batch[1].kv = other.get();
  batch[1].input = bad_id;
  EXPECT_EQ(e.gpu->Forward(batch, &outs).code(),
            absl::StatusCode::kInvalidArgument);
  batch[1].kv = kv.get();  // the same sequence twice
  batch[1].input = ok_in;
  EXPECT_EQ(e.gpu->Forward(batch, &outs).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv->size(), 0);
  EXPECT_EQ(other->size(), 0);

  // Out of blocks in the second entry: the first is rolled back too.
  std::unique_ptr<KvSequence> hog = NewSeq(*e.gpu, 64);
  ASSERT_NE(hog, nullptr);
  const std::vector<int> fill(cache.num_blocks() * bs - 2 * bs, 1);
  const std::vector<int> fill_pos = Iota(0, static_cast<int>(fill.size()));
  ForwardInput fill_in;
  fill_in.token_ids = fill;
  fill_in.position_ids = fill_pos;
  ASSERT_OK(e.gpu->Forward(fill_in, hog.get(), &out));
  ASSERT_EQ(cache.num_free_blocks(), 2);
  const std::vector<int> eight(8, 1), eight_pos = Iota(0, 8);
  batch[1].kv = other.get();
  batch[1].input.token_ids = eight;  // 2 blocks; `kv` takes the first
  batch[1].input.position_ids = eight_pos;
  EXPECT_EQ(e.gpu->Forward(batch, &outs).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(kv->size(), 0);
  EXPECT_EQ(other->size(), 0);
  EXPECT_EQ(cache.num_free_blocks(), 2);

  // The runner still works.
  ASSERT_OK(e.gpu->Forward(ok_in, kv.get(), &out));
  EXPECT_EQ(kv->size(), 3);
  EXPECT_EQ(out.logits.size(), static_cast<size_t>(c.vocab_size));
}

// Speculative Prefill scoring end to end: the speculator's prefill captures
// the last prompt row, look-ahead steps capture one row each, and the device
// reduction (CudaModelRunner::ScoreImportance) scores the prompt.
TEST_P(ModelTest, DeviceScoringMatchesCpuScoring) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, n = 300, lookahead = 4;
  const int L = c.num_hidden_layers, H = c.num_attention_heads;
  const int KV = c.num_key_value_heads, D = c.head_dim, rows = 1 + lookahead;
  std::vector<int> prompt(n);
  for (int& t : prompt) t = Uniform(0, vocab - 1);
  std::unique_ptr<KvSequence> ckv = NewSeq(*e.cpu, c.max_position_embeddings);
  std::unique_ptr<KvSequence> gkv = NewSeq(*e.gpu, c.max_position_embeddings);
  ASSERT_NE(ckv, nullptr);
  ASSERT_NE(gkv, nullptr);
  absl::StatusOr<std::unique_ptr<QueryCapture>> ccap =
      e.cpu->NewQueryCapture(rows);
  absl::StatusOr<std::unique_ptr<QueryCapture>> gcap =
      e.gpu->NewQueryCapture(rows);
  ASSERT_TRUE(ccap.ok()) << ccap.status();
  ASSERT_TRUE(gcap.ok()) << gcap.status();
  // One step on both runners, the captured rows kept by their captures.
  auto step = [&](const ForwardInput& in, ForwardOutput* co,
                  ForwardOutput* go) {
    std::vector<SequenceForward> batch(1);
    batch[0].input = in;
    std::vector<ForwardOutput> outs;
    batch[0].kv = ckv.get();
    batch[0].capture = ccap->get();
    ASSERT_OK(e.cpu->Forward(batch, &outs));
    *co = std::move(outs[0]);
    batch[0].kv = gkv.get();
    batch[0].capture = gcap->get();
    ASSERT_OK(e.gpu->Forward(batch, &outs));
    *go = std::move(outs[0]);
    EXPECT_TRUE(go->queries.empty());  // they went to the capture
  };
  const std::vector<int> pos = Iota(0, n);
  ForwardInput in;
  in.token_ids = prompt;
  in.position_ids = pos;
  in.capture_query_rows = {n - 1};
  ForwardOutput co, go;
  step(in, &co, &go);
  int next = Argmax(co.logits.data(), vocab);
  for (int s = 0; s < lookahead; ++s) {
    const int p = n + s;
    ForwardInput d;
    d.token_ids = absl::MakeConstSpan(&next, 1);
    d.position_ids = absl::MakeConstSpan(&p, 1);
    d.capture_query_rows = {0};
    step(d, &co, &go);
    next = Argmax(co.logits.data(), vocab);
  }
  ASSERT_EQ((*gcap)->rows(), rows);
  ASSERT_EQ((*ccap)->rows(), rows);

  const ScoringOptions opts;
  absl::StatusOr<ImportanceResult> gpu_scores =
      e.gpu->ScoreImportance(*gkv, n, **gcap, opts, 1);
  ASSERT_TRUE(gpu_scores.ok()) << gpu_scores.status();
  ASSERT_EQ(gpu_scores->importance.size(), static_cast<size_t>(n));
  ASSERT_EQ(gpu_scores->per_row_importance.size(), static_cast<size_t>(rows));
  // Scored again in the runner's step workspace, which the first scoring
  // left dirty: the same scores, bit for bit.
  absl::StatusOr<ImportanceResult> again =
      e.gpu->ScoreImportance(*gkv, n, **gcap, opts, 1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->importance, gpu_scores->importance);

  // (1) The device reduction on the device's own queries and keys equals
  // the CPU reduction of the same numbers (fp32 math): 1e-5, same chunks.
  absl::StatusOr<std::vector<float>> gq = (*gcap)->CopyToHost();
  ASSERT_TRUE(gq.ok()) << gq.status();
  ASSERT_EQ(gq->size(), static_cast<size_t>(L) * rows * H * D);
  absl::StatusOr<ImportanceAccumulator> same_inputs =
      ImportanceAccumulator::Create(n, rows, H, KV, D, L, opts);
  ASSERT_TRUE(same_inputs.ok()) << same_inputs.status();
  for (int l = 0; l < L; ++l) {
    absl::StatusOr<std::vector<float>> keys = e.gpu->CopyKeysToHost(l, *gkv, n);
    ASSERT_TRUE(keys.ok()) << keys.status();
    ASSERT_OK(same_inputs->AddLayer(
        l, gq->data() + static_cast<size_t>(l) * rows * H * D, keys->data(),
        static_cast<size_t>(KV) * D));
  }
  const std::vector<float> same = same_inputs->Importance();
  EXPECT_LT(RelErr(gpu_scores->importance, same), 1e-5);
  const std::vector<std::vector<float>> same_rows =
      same_inputs->PerRowImportance();
  for (int r = 0; r < rows; ++r) {
    EXPECT_LT(RelErr(gpu_scores->per_row_importance[r], same_rows[r]), 1e-5)
        << "row " << r;
  }
  ExpectSameSelection(gpu_scores->importance, same);

  // (2) Against the fp32 CPU runner's own scoring: within bf16 tolerance,
  // and chunks may differ only where the CPU's chunk scores are near-ties
  // with the selection threshold.
  absl::StatusOr<ImportanceResult> cpu_scores =
      e.cpu->ScoreImportance(*ckv, n, **ccap, opts, 2);
  ASSERT_TRUE(cpu_scores.ok()) << cpu_scores.status();
  EXPECT_LT(RelErr(gpu_scores->importance, cpu_scores->importance), 5e-2);
  for (float keep : {0.1f, 0.3f}) {
    ExpectSelectionsAgree(gpu_scores->importance, cpu_scores->importance,
                          keep, 16, 5e-2);
  }

  // Bad requests.
  EXPECT_EQ(e.gpu->ScoreImportance(*gkv, 0, **gcap, opts, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      e.gpu->ScoreImportance(*gkv, gkv->size() + 1, **gcap, opts, 1)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.gpu->ScoreImportance(*gkv, n, **ccap, opts, 1).status().code(),
            absl::StatusCode::kInvalidArgument);  // a CPU capture
  (*gcap)->Clear();
  EXPECT_EQ(e.gpu->ScoreImportance(*gkv, n, **gcap, opts, 1).status().code(),
            absl::StatusCode::kInvalidArgument);  // empty
}

// Tree attention on the device: a prefill, then a draft tree (random
// parents, 20 nodes: the batched kernel) in one forward and a deeper one
// grown in two forwards (the span reaching back), and a 70-row forward of
// causal context rows plus a 24-node tree (FlashAttention where the
// head_dim allows it, under kAuto): every node's logits match the CPU's
// for the same forwards, on every attention path.
TEST_P(ModelTest, TreeAttentionMatchesCpu) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size;
  auto random_parents = [this](int n) {
    std::vector<int> p(n);
    for (int j = 0; j < n; ++j) p[j] = Uniform(0, j) - 1;  // [-1, j)
    return p;
  };
  for (const CudaModelRunner::AttentionPath path : kAllPaths) {
    SCOPED_TRACE(PathName(path));
    e.gpu->set_attention_path(path);
    std::unique_ptr<KvSequence> ckv = NewSeq(*e.cpu, c.max_position_embeddings);
    std::unique_ptr<KvSequence> gkv = NewSeq(*e.gpu, c.max_position_embeddings);
    ASSERT_NE(ckv, nullptr);
    ASSERT_NE(gkv, nullptr);
    std::vector<int> ids(60);
    for (int& id : ids) id = Uniform(0, vocab - 1);
    ForwardOutput co, go;
    ASSERT_OK(e.cpu->Forward(AllRows(ids, Iota(0, 60)), ckv.get(), &co));
    ASSERT_OK(e.gpu->Forward(AllRows(ids, Iota(0, 60)), gkv.get(), &go));
    // Tree 1: 20 nodes in one forward.
    std::vector<int> nodes(20);
    for (int& id : nodes) id = Uniform(0, vocab - 1);
    std::vector<int> parents = random_parents(20), npos(20);
    for (int j = 0; j < 20; ++j) {
      npos[j] = 60 + (parents[j] < 0 ? 0 : npos[parents[j]] - 60 + 1);
    }
    ForwardInput t1 = AllRows(nodes, npos);
    t1.tree_parents = parents;
    ASSERT_OK(e.cpu->Forward(t1, ckv.get(), &co));
    ASSERT_OK(e.gpu->Forward(t1, gkv.get(), &go));
    {
      SCOPED_TRACE("tree in one forward");
      ExpectLogitsMatch(co, go, vocab, kRowsTolBf16);
    }
    // Tree 2 grown in two forwards: 6 roots' children, then 10 more whose
    // parents may be any of the first 6 (the span reaches back).
    ASSERT_OK(ckv->Truncate(60));
    ASSERT_OK(gkv->Truncate(60));
    std::vector<int> level1(6), level2(10);
    for (int& id : level1) id = Uniform(0, vocab - 1);
    for (int& id : level2) id = Uniform(0, vocab - 1);
    const std::vector<int> pos1(6, 60), pos2(10, 61);
    ForwardInput a = AllRows(level1, pos1);
    a.tree_parents.assign(6, -1);
    ASSERT_OK(e.cpu->Forward(a, ckv.get(), &co));
    ASSERT_OK(e.gpu->Forward(a, gkv.get(), &go));
    ForwardInput b = AllRows(level2, pos2);
    b.tree_parents.assign(6, -1);
    for (int j = 0; j < 10; ++j) b.tree_parents.push_back(Uniform(0, 5));
    ASSERT_OK(e.cpu->Forward(b, ckv.get(), &co));
    ASSERT_OK(e.gpu->Forward(b, gkv.get(), &go));
    {
      SCOPED_TRACE("tree grown by depth");
      ExpectLogitsMatch(co, go, vocab, kRowsTolBf16);
    }
    // 70 rows: 46 causal context rows, then a 24-node tree.
    ASSERT_OK(ckv->Truncate(60));
    ASSERT_OK(gkv->Truncate(60));
    std::vector<int> big(70), bpos(70);
    for (int& id : big) id = Uniform(0, vocab - 1);
    const std::vector<int> tparents = random_parents(24);
    for (int j = 0; j < 70; ++j) {
      if (j < 46) {
        bpos[j] = 60 + j;
      } else {
        const int p = tparents[j - 46];
        bpos[j] = p < 0 ? 106 : bpos[46 + p] + 1;
      }
    }
    ForwardInput t3 = AllRows(big, bpos);
    t3.tree_parents = tparents;
    ASSERT_OK(e.cpu->Forward(t3, ckv.get(), &co));
    ASSERT_OK(e.gpu->Forward(t3, gkv.get(), &go));
    SCOPED_TRACE("context rows then a tree");
    ExpectLogitsMatch(co, go, vocab, kRowsTolBf16);
  }
}

// Speculative decoding with token trees on the device: TargetSession
// rounds with random trees, some nodes on the true continuation, emit the
// GPU's own plain greedy decoding. The device holds bf16 weights only, and
// a tree row's logits come from other kernels than a decode row's (last-bit
// differences), so the two may part only where plain greedy's top two
// logits were within 2e-2 of each other; and tree rounds do accept paths
// of two tokens or more.
TEST_P(ModelTest, GreedyTreeRoundsEqualPlainGreedy) {
  Engines e = LoadEngines(GetParam(), CudaDType::kBF16);
  ASSERT_NE(e.gpu, nullptr);
  const ModelConfig& c = e.cpu->config();
  const int vocab = c.vocab_size, kNew = 40;
  std::vector<int> prompt(24);
  for (int& id : prompt) id = Uniform(0, vocab - 1);
  // Plain greedy on the GPU, one token per forward, with each choice's
  // margin over the runner-up.
  std::vector<int> want;
  std::vector<float> margin;
  auto top2_margin = [vocab](const float* row) {
    const auto [top, second] = TopTwo(row, vocab);
    return top - second;
  };
  {
    std::unique_ptr<KvSequence> kv = NewSeq(*e.gpu, c.max_position_embeddings);
    ASSERT_NE(kv, nullptr);
    const std::vector<int> pos = Iota(0, 24);
    ForwardOutput out;
    ASSERT_OK(e.gpu->Forward(AllRows(prompt, pos), kv.get(), &out));
    int tok = Argmax(out.logits_row(23, vocab), vocab);
    margin.push_back(top2_margin(out.logits_row(23, vocab)));
    for (int i = 0; i < kNew; ++i) {
      want.push_back(tok);
      const int p = 24 + i;
      ForwardInput d;
      d.token_ids = absl::MakeConstSpan(&tok, 1);
      d.position_ids = absl::MakeConstSpan(&p, 1);
      ASSERT_OK(e.gpu->Forward(d, kv.get(), &out));
      tok = Argmax(out.logits.data(), vocab);
      margin.push_back(top2_margin(out.logits.data()));
    }
  }
  TargetRequest r;
  r.token_ids = prompt;
  r.position_ids = Iota(0, 24);
  r.stop.max_new_tokens = kNew;
  r.ignore_eos = true;
  auto session = TargetSession::Create(e.gpu.get(), r);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<int> got;
  int deep = 0;
  while (!(*session)->finished()) {
    // The first round's first two nodes are plain greedy's first two
    // tokens, a chain: it accepts both unless the tree rows part from plain
    // greedy at once (a near tie), so `deep` does not depend on luck.
    const bool first = got.empty();
    const int n = std::max(first ? 2 : 0, Uniform(0, 16));
    std::vector<DraftToken> drafts(n);
    std::vector<int> parents(n), depth(n);
    std::vector<bool> truth(n);
    for (int i = 0; i < n; ++i) {
      parents[i] = first && i < 2 ? i - 1 : Uniform(0, i) - 1;
      depth[i] = parents[i] < 0 ? 0 : depth[parents[i]] + 1;
      const size_t at = got.size() + depth[i];
      const bool parent_true = parents[i] < 0 || truth[parents[i]];
      drafts[i].id = parent_true && at < want.size() &&
                             ((first && i < 2) || Uniform(0, 1) == 1)
                         ? want[at]
                         : Uniform(0, vocab - 1);
      truth[i] = parent_true && at < want.size() && drafts[i].id == want[at];
    }
    auto round = (*session)->Step(drafts, parents);
    ASSERT_TRUE(round.ok()) << round.status();
    got.insert(got.end(), round->tokens.begin(), round->tokens.end());
    deep += round->num_accepted >= 2;
  }
  ASSERT_EQ(got.size(), want.size());
  size_t same = 0;
  while (same < got.size() && got[same] == want[same]) ++same;
  if (same < got.size()) {
    EXPECT_LT(margin[same], 2e-2f)
        << "tree rounds part from plain greedy at token " << same;
  }
  // Parted at token 0 or 1 (a tie; seen once in ten seeded runs), the
  // drafts built from plain greedy no longer match what the session emits.
  if (same >= 2) {
    EXPECT_GT(deep, 0);
  }
}

// The graphs' workspace (host arithmetic, no GPU): at least its two big
// regions, 128 rows of fp32 logits and of sampling scratch; growing with
// the GPU's multiprocessors; in the hundreds of MB at most for an 8B model
// (the factory reserves it out of the KV pool).
TEST(GraphWorkspaceTest, CoversLogitsAndSamplingScratch) {
  absl::StatusOr<ModelConfig> c = PresetConfig("llama-3.1-8b");
  ASSERT_TRUE(c.ok()) << c.status();
  const size_t bytes =
      CudaModelRunner::GraphWorkspaceBytes(*c, CudaDType::kBF16, 16, 132);
  std::printf("graph workspace, llama-3.1-8b bf16, block 16, 132 SMs: %.1f "
              "MiB\n", bytes / 1048576.0);
  const size_t big = 2 * sizeof(float) *
                     static_cast<size_t>(CudaModelRunner::kMaxGraphRows) *
                     c->vocab_size;
  EXPECT_GT(bytes, big);
  EXPECT_LT(bytes, big + (size_t{128} << 20));
  EXPECT_GE(CudaModelRunner::GraphWorkspaceBytes(*c, CudaDType::kBF16, 16, 256),
            bytes);
  // Block size 1: a table entry per token of every sequence's context.
  const size_t ctx = c->max_position_embeddings;
  EXPECT_GE(CudaModelRunner::GraphWorkspaceBytes(*c, CudaDType::kBF16, 1, 132),
            bytes + sizeof(int) * CudaModelRunner::kMaxGraphRows *
                        (ctx - (ctx + 15) / 16));
}

INSTANTIATE_TEST_SUITE_P(BundledCheckpoints, ModelTest,
                         ::testing::Values("stories260K", "stories260K-draft",
                                           "tinystories-656K",
                                           "tinystories-656K-draft"));

}  // namespace
}  // namespace specserve
