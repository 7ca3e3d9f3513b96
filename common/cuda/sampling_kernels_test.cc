// cuda_kernels::SampleRows against the host reference SampleRow
// (common/decoding/row_sampling.h):
// - argument checks (run everywhere: they precede any CUDA call);
// - exact agreement, row by row, on random rows of several vocabularies
//   (ties, -0/+0, -inf, NaN, +inf logits; top-k / top-p / temperature
//   mixes; no draft, drafts from q's of three kinds; logits rows shared by
//   several sampled rows). A difference must be explained by rounding at a
//   boundary: the host with a uniform or top_p moved by 1e-6 (relative for
//   top_p) gives the device's answer; and such rows must be rare;
// - hand-made edge rows with known answers;
// - chi-square tests of the sampled tokens against ComputeDistribution, for
//   plain sampling and for "accept x ~ q, else the residual" (lossless:
//   the emitted token must follow p), plus the acceptance rate
//   sum_i min(p_i, q_i).
//
// GPU tests skip where no CUDA device is present. The agreement tests draw
// from a seed printed at the start (set SPECSERVE_TEST_SEED to replay); the
// chi-square tests use fixed seeds (the kernel is deterministic), so they
// cannot fail by chance on a correct kernel.

#include "common/cuda/sampling_kernels.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "common/cuda/device.h"
#include "common/cuda/device_array_test_util.h"
#include "common/decoding/logits_processors.h"
#include "common/decoding/logprobs.h"
#include "common/decoding/row_sampling.h"
#include "common/decoding/sampling.h"
#include "common/decoding/stats.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

namespace ck = cuda_kernels;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One sampled row of a batch.
struct Row {
  int logit_row = 0;
  SamplingParams params;
  int draft_id = -1;
  SparseDist q;
  double u_accept = 0.0;
  double u_sample = 0.0;
};

struct Batch {
  int vocab = 0;
  std::vector<float> logits;  // [logits rows, vocab]
  std::vector<Row> rows;
  bool pass_drafts = true;  // false: draft_id = null (every row plain)

  absl::Span<const float> LogitsOf(const Row& row) const {
    return absl::MakeConstSpan(logits).subspan(
        static_cast<size_t>(row.logit_row) * vocab, vocab);
  }
};

using testing_cuda::DeviceArray;

// Runs SampleRows on `batch` and returns each row's outcome in *out. The
// outputs are poisoned first (0x55 bytes: neither a token nor a flag), so
// a row the kernel skips fails the range checks.
void RunOnDevice(const Batch& batch, std::vector<RowSample>* out,
                 float* kernel_ms = nullptr) {
  const int n = static_cast<int>(batch.rows.size());
  std::vector<int> logit_row(n), top_k(n), draft_id(n), q_offsets(n + 1, 0);
  std::vector<float> temperature(n), top_p(n), min_p(n), q_probs;
  std::vector<int> q_ids;
  std::vector<double> uniforms(2 * static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const Row& r = batch.rows[i];
    logit_row[i] = r.logit_row;
    temperature[i] = r.params.temperature;
    top_k[i] = r.params.top_k;
    top_p[i] = r.params.top_p;
    min_p[i] = r.params.min_p;
    draft_id[i] = r.draft_id;
    for (const auto& e : r.q) {
      q_ids.push_back(e.first);
      q_probs.push_back(e.second);
    }
    q_offsets[i + 1] = static_cast<int>(q_ids.size());
    uniforms[2 * i] = r.u_accept;
    uniforms[2 * i + 1] = r.u_sample;
  }
  DeviceArray d_logits(batch.logits.size() * sizeof(float));
  DeviceArray d_logit_row(n * sizeof(int)), d_top_k(n * sizeof(int)),
      d_draft_id(n * sizeof(int)), d_q_offsets((n + 1) * sizeof(int)),
      d_temperature(n * sizeof(float)), d_top_p(n * sizeof(float)),
      d_min_p(n * sizeof(float)),
      d_q_ids(q_ids.size() * sizeof(int)),
      d_q_probs(q_probs.size() * sizeof(float)),
      d_uniforms(uniforms.size() * sizeof(double)),
      d_scratch(ck::SampleRowsScratchBytes(n, batch.vocab)),
      d_token(n * sizeof(int)), d_accepted(n * sizeof(int));
  ASSERT_CUDA_OK(d_logits.Upload(batch.logits));
  ASSERT_CUDA_OK(d_logit_row.Upload(logit_row));
  ASSERT_CUDA_OK(d_top_k.Upload(top_k));
  ASSERT_CUDA_OK(d_draft_id.Upload(draft_id));
  ASSERT_CUDA_OK(d_q_offsets.Upload(q_offsets));
  ASSERT_CUDA_OK(d_temperature.Upload(temperature));
  ASSERT_CUDA_OK(d_top_p.Upload(top_p));
  ASSERT_CUDA_OK(d_min_p.Upload(min_p));
  ASSERT_CUDA_OK(d_q_ids.Upload(q_ids));
  ASSERT_CUDA_OK(d_q_probs.Upload(q_probs));
  ASSERT_CUDA_OK(d_uniforms.Upload(uniforms));
  ASSERT_CUDA_OK(d_scratch.error());
  ASSERT_CUDA_OK(d_token.error());
  ASSERT_CUDA_OK(d_accepted.error());
  ASSERT_CUDA_OK(cudaMemset(d_token.as<int>(), 0x55, n * sizeof(int)));
  ASSERT_CUDA_OK(cudaMemset(d_accepted.as<int>(), 0x55, n * sizeof(int)));
  // Scratch contents on entry must not matter.
  ASSERT_CUDA_OK(cudaMemset(d_scratch.as<void>(), 0x7f,
                            ck::SampleRowsScratchBytes(n, batch.vocab)));

  ck::SampleRowsArgs args;
  args.logits = d_logits.as<float>();
  args.vocab = batch.vocab;
  args.num_rows = n;
  args.logit_row = d_logit_row.as<int>();
  args.temperature = d_temperature.as<float>();
  args.top_k = d_top_k.as<int>();
  args.top_p = d_top_p.as<float>();
  args.min_p = d_min_p.as<float>();
  if (batch.pass_drafts) {
    args.draft_id = d_draft_id.as<int>();
    args.q_offsets = d_q_offsets.as<int>();
    args.q_ids = d_q_ids.as<int>();
    args.q_probs = d_q_probs.as<float>();
  }
  args.uniforms = d_uniforms.as<double>();
  args.scratch = d_scratch.as<void>();
  args.token = d_token.as<int>();
  args.accepted = d_accepted.as<int>();

  cudaEvent_t start, stop;
  ASSERT_CUDA_OK(cudaEventCreate(&start));
  ASSERT_CUDA_OK(cudaEventCreate(&stop));
  ASSERT_CUDA_OK(cudaEventRecord(start, nullptr));
  ASSERT_CUDA_OK(ck::SampleRows(args, nullptr));
  ASSERT_CUDA_OK(cudaEventRecord(stop, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  float ms = 0.f;
  ASSERT_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
  if (kernel_ms != nullptr) *kernel_ms = ms;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);

  std::vector<int> token(n), accepted(n);
  ASSERT_CUDA_OK(cudaMemcpy(token.data(), d_token.as<int>(), n * sizeof(int),
                            cudaMemcpyDeviceToHost));
  ASSERT_CUDA_OK(cudaMemcpy(accepted.data(), d_accepted.as<int>(),
                            n * sizeof(int), cudaMemcpyDeviceToHost));
  out->assign(n, RowSample{});
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(accepted[i] == 0 || accepted[i] == 1)
        << "row " << i << ": accepted = " << accepted[i];
    (*out)[i].accepted = accepted[i] == 1;
    (*out)[i].token = token[i];
    if (accepted[i] == 1) {
      ASSERT_EQ(token[i], -1) << "row " << i;
    } else {
      ASSERT_GE(token[i], 0) << "row " << i;
      ASSERT_LT(token[i], batch.vocab) << "row " << i;
    }
  }
}

RowSample HostSample(const Batch& batch, const Row& row) {
  return SampleRow(batch.LogitsOf(row), row.params, row.draft_id, row.q,
                   row.u_accept, row.u_sample);
}

bool Same(const RowSample& a, const RowSample& b) {
  return a.accepted == b.accepted && a.token == b.token;
}

std::string Describe(const RowSample& s) {
  return s.accepted ? "accepted" : "token " + std::to_string(s.token);
}

// Whether the host gives the device's answer once a uniform, top_p or
// min_p moves by 1e-6 (a rounding-level difference decided a boundary: the
// device's double log may differ from the host's by an ulp).
bool ExplainedByRounding(const Batch& batch, const Row& row,
                         const RowSample& device) {
  const double kDelta = 1e-6;
  const double kBelowOne = std::nextafter(1.0, 0.0);
  for (double da : {-kDelta, 0.0, kDelta}) {
    for (double ds : {-kDelta, 0.0, kDelta}) {
      for (double dp : {-kDelta, 0.0, kDelta}) {
        if (row.params.top_p >= 1.f && dp != 0.0) continue;
        for (double dm : {-kDelta, 0.0, kDelta}) {
          if (row.params.min_p <= 0.f && dm != 0.0) continue;
          Row moved = row;
          moved.u_accept = std::clamp(row.u_accept + da, 0.0, kBelowOne);
          moved.u_sample = std::clamp(row.u_sample + ds, 0.0, kBelowOne);
          moved.params.top_p = static_cast<float>(
              std::min(1.0, row.params.top_p * (1.0 + dp)));
          moved.params.min_p = static_cast<float>(
              std::min(1.0, row.params.min_p * (1.0 + dm)));
          if (Same(HostSample(batch, moved), device)) return true;
        }
      }
    }
  }
  return false;
}

uint64_t TestSeed() {
  const char* env = std::getenv("SPECSERVE_TEST_SEED");
  const uint64_t seed =
      env != nullptr ? std::strtoull(env, nullptr, 10)
                     : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                           std::random_device{}();
  std::printf("[   SEED   ] %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

double Uniform(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
}

// Random logits of one of several shapes (ties, specials, spreads).
std::vector<float> MakeLogits(int vocab, int kind, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(vocab);
  for (float& x : v) x = normal(rng);
  switch (kind) {
    case 0:  // plain
      for (float& x : v) x *= 2.f;
      break;
    case 1:  // coarse grid: many exact ties, -0 and +0 included
      for (float& x : v) x = std::round(x * 2.f) / 2.f;
      break;
    case 2:  // -inf and NaN entries
      for (float& x : v) {
        const double u = Uniform(rng);
        x = u < 0.1 ? -kInf : (u < 0.15 ? kNaN : 2.f * x);
      }
      break;
    case 3:  // wide spread: most weights underflow, peaky p
      for (float& x : v) x *= 40.f;
      break;
    case 4:  // a few +inf entries: they share the mass
      for (int j = 0; j < 1 + static_cast<int>(rng() % 3); ++j) {
        v[rng() % vocab] = kInf;
      }
      break;
    case 5:  // no finite logit: the host samples token 0
      for (float& x : v) x = Uniform(rng) < 0.5 ? -kInf : kNaN;
      break;
    case 6:  // all equal
      std::fill(v.begin(), v.end(), 1.25f);
      break;
    default:  // a few large logits spread over the ids, a low tail
      for (int j = 0; j < 20; ++j) v[rng() % vocab] += 8.f;
      break;
  }
  return v;
}

// A draft distribution q (ValidateDrafts-valid: distinct ids, q(x) > 0,
// summing to 1) and the draft x drawn from it, of one of three kinds.
void MakeDraft(const Batch& batch, const Row& row, std::mt19937_64& rng, int* x,
               SparseDist* q) {
  const int vocab = batch.vocab;
  const int kind = static_cast<int>(rng() % 3);
  if (kind == 0) {
    // A draft model close to the target: perturbed logits, same params.
    std::normal_distribution<float> noise(0.f, 0.7f);
    std::vector<float> logits(batch.LogitsOf(row).begin(),
                              batch.LogitsOf(row).end());
    for (float& l : logits) l += noise(rng);
    *q = ComputeDistribution(logits, row.params);
    Rng draw(rng());
    *x = SampleFrom(*q, &draw);
    return;
  }
  if (kind == 1) {
    // Random sparse ids and weights.
    const int m = 1 + static_cast<int>(rng() % std::min(vocab, 48));
    std::vector<int> ids;
    while (static_cast<int>(ids.size()) < m) {
      const int id = static_cast<int>(rng() % vocab);
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) {
        ids.push_back(id);
      }
    }
    std::vector<double> w(m);
    double sum = 0.0;
    for (double& v : w) sum += (v = 0.05 + Uniform(rng));
    q->clear();
    for (int i = 0; i < m; ++i) {
      q->emplace_back(ids[i], static_cast<float>(w[i] / sum));
    }
    *x = ids[rng() % m];
    return;
  }
  // A point mass anywhere (often outside p's support: always rejected).
  *x = static_cast<int>(rng() % vocab);
  *q = {{*x, 1.f}};
}

// A batch of `num_rows` random rows over num_rows / 2 + 1 logits rows.
Batch RandomBatch(int vocab, int num_rows, std::mt19937_64& rng) {
  Batch b;
  b.vocab = vocab;
  const int logit_rows = num_rows / 2 + 1;
  for (int r = 0; r < logit_rows; ++r) {
    // Kind 5 (no finite logit) is rare in practice: 1 row in 32.
    int kind = static_cast<int>(rng() % 7);
    if (kind >= 5) ++kind;
    if (rng() % 32 == 0) kind = 5;
    const std::vector<float> l = MakeLogits(vocab, kind, rng);
    b.logits.insert(b.logits.end(), l.begin(), l.end());
  }
  const float kTemps[] = {0.3f, 0.7f, 1.f, 1.6f};
  const float kTopPs[] = {1.f, 0.9f, 0.5f, 0.05f};
  const int kTopKs[] = {0, 1, 5, 50, vocab + 3, vocab - 1, -1 /* random */};
  for (int i = 0; i < num_rows; ++i) {
    Row row;
    row.logit_row = static_cast<int>(rng() % logit_rows);
    row.params.temperature = kTemps[rng() % 4];
    row.params.top_p = kTopPs[rng() % 4];
    int k = kTopKs[rng() % 7];
    if (k < 0) k = 1 + static_cast<int>(rng() % vocab);
    row.params.top_k = std::max(0, k);
    const float kMinPs[] = {0.f, 0.f, 0.05f, 0.3f, 1.f};
    row.params.min_p = kMinPs[rng() % 5];
    row.u_accept = Uniform(rng);
    row.u_sample = Uniform(rng);
    if (rng() % 5 < 3) MakeDraft(b, row, rng, &row.draft_id, &row.q);
    b.rows.push_back(std::move(row));
  }
  return b;
}

// Compares every row with the host; returns the number of rows that
// differ (each must be explained by rounding).
int CompareWithHost(const Batch& batch, const std::vector<RowSample>& dev) {
  int differ = 0;
  for (size_t i = 0; i < batch.rows.size(); ++i) {
    const Row& row = batch.rows[i];
    const RowSample host = HostSample(batch, row);
    if (Same(host, dev[i])) continue;
    ++differ;
    EXPECT_TRUE(ExplainedByRounding(batch, row, dev[i]))
        << "vocab " << batch.vocab << " row " << i << " (logits row "
        << row.logit_row << ", T " << row.params.temperature << ", top_k "
        << row.params.top_k << ", top_p " << row.params.top_p << ", min_p "
        << row.params.min_p << ", draft "
        << row.draft_id << " with |q| " << row.q.size() << ", u_accept "
        << row.u_accept << ", u_sample " << row.u_sample << "): host "
        << Describe(host) << ", device " << Describe(dev[i]);
  }
  return differ;
}

class SampleRowsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) {
      GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription();
    }
  }
};

// ---------------------------------------------------------------------------
// Argument checks: no device needed.

TEST(SampleRowsArgsTest, RejectsBadArgumentsBeforeAnyCudaCall) {
  float f = 0.f;
  int i = 0;
  double d = 0.0;
  ck::SampleRowsArgs ok;
  ok.logits = &f;
  ok.vocab = 10;
  ok.num_rows = 1;
  ok.logit_row = &i;
  ok.temperature = &f;
  ok.top_k = &i;
  ok.top_p = &f;
  ok.uniforms = &d;
  ok.scratch = &f;
  ok.token = &i;
  ok.accepted = &i;
  // Host pointers: never launched, every case below is invalid.
  auto expect_invalid = [](ck::SampleRowsArgs a, const char* what) {
    EXPECT_EQ(ck::SampleRows(a, nullptr), cudaErrorInvalidValue) << what;
  };
  ck::SampleRowsArgs a = ok;
  a.vocab = 0;
  expect_invalid(a, "vocab 0");
  a.vocab = -5;
  expect_invalid(a, "vocab < 0");
  a = ok;
  a.num_rows = -1;
  expect_invalid(a, "num_rows < 0");
  a = ok;
  a.logits = nullptr;
  expect_invalid(a, "logits");
  a = ok;
  a.logit_row = nullptr;
  expect_invalid(a, "logit_row");
  a = ok;
  a.temperature = nullptr;
  expect_invalid(a, "temperature");
  a = ok;
  a.top_k = nullptr;
  expect_invalid(a, "top_k");
  a = ok;
  a.top_p = nullptr;
  expect_invalid(a, "top_p");
  a = ok;
  a.uniforms = nullptr;
  expect_invalid(a, "uniforms");
  a = ok;
  a.scratch = nullptr;
  expect_invalid(a, "scratch");
  a = ok;
  a.token = nullptr;
  expect_invalid(a, "token");
  a = ok;
  a.accepted = nullptr;
  expect_invalid(a, "accepted");
  // Drafts need their q lists.
  a = ok;
  a.draft_id = &i;
  expect_invalid(a, "draft_id without q");
  a.q_offsets = &i;
  a.q_ids = &i;
  expect_invalid(a, "draft_id without q_probs");
  a.q_probs = nullptr;
  a.q_ids = nullptr;
  a.q_probs = &f;
  expect_invalid(a, "draft_id without q_ids");
  a.q_ids = &i;
  a.q_offsets = nullptr;
  expect_invalid(a, "draft_id without q_offsets");

  // num_rows == 0: a no-op, whatever the pointers.
  ck::SampleRowsArgs empty;
  empty.vocab = 10;
  EXPECT_EQ(ck::SampleRows(empty, nullptr), cudaSuccess);
  empty.vocab = 0;
  EXPECT_EQ(ck::SampleRows(empty, nullptr), cudaErrorInvalidValue);
}

TEST(SampleRowsArgsTest, ScratchBytes) {
  EXPECT_EQ(ck::SampleRowsScratchBytes(0, 100), 0u);
  EXPECT_EQ(ck::SampleRowsScratchBytes(3, 0), 0u);
  EXPECT_EQ(ck::SampleRowsScratchBytes(-1, 100), 0u);
  EXPECT_EQ(ck::SampleRowsScratchBytes(3, 7), 3u * 7u * 4u);
  // No int overflow at serving sizes: 4096 rows of Qwen's vocabulary.
  EXPECT_EQ(ck::SampleRowsScratchBytes(4096, 152064),
            size_t{4096} * 152064 * 4);
}

// ---------------------------------------------------------------------------
// Agreement with the host, row by row.

void ExpectAgreement(int vocab, int num_rows, uint64_t seed) {
  std::mt19937_64 rng(seed ^ static_cast<uint64_t>(vocab));
  const Batch batch = RandomBatch(vocab, num_rows, rng);
  std::vector<RowSample> dev;
  ASSERT_NO_FATAL_FAILURE(RunOnDevice(batch, &dev));
  const int differ = CompareWithHost(batch, dev);
  std::printf("vocab %d: %d of %d rows differ from the host\n", vocab, differ,
              num_rows);
  // Boundaries within 1e-6 of a uniform are hit about 1e-6 of the time;
  // 1% allows for tie-heavy rows and still catches a systematic error.
  EXPECT_LE(differ, std::max(1, num_rows / 100))
      << "vocab " << vocab << ": " << differ << " of " << num_rows
      << " rows differ from the host";
  // Deterministic: the same batch again gives the same answers.
  std::vector<RowSample> again;
  ASSERT_NO_FATAL_FAILURE(RunOnDevice(batch, &again));
  for (int i = 0; i < num_rows; ++i) {
    EXPECT_TRUE(Same(dev[i], again[i])) << "vocab " << vocab << " row " << i;
  }
}

TEST_F(SampleRowsTest, MatchesHostTinyVocab) {
  const uint64_t seed = TestSeed();
  // Emulated, each row's block of threads costs host time whatever the
  // vocabulary: 600 rows took 97 s of a CI shard.
  ExpectAgreement(7, testing_cuda::EmulatedDevice() ? 200 : 600, seed);
  ExpectAgreement(1, 50, seed);
  ExpectAgreement(2, 100, seed);
}

TEST_F(SampleRowsTest, MatchesHostSmallVocabs) {
  const uint64_t seed = TestSeed();
  ExpectAgreement(512, 400, seed);
  ExpectAgreement(1000, 400, seed);
  // Not a multiple of the block: the last thread chunks are short or empty.
  ExpectAgreement(1531, 200, seed);
}

TEST_F(SampleRowsTest, MatchesHostLargeVocabs) {
  const uint64_t seed = TestSeed();
  ExpectAgreement(32000, 120, seed);
  ExpectAgreement(128256, 24, seed);  // Llama 3: ids past 2^16
}

// ---------------------------------------------------------------------------
// Hand-made rows with known answers (checked on the host too).

// SampleRow(logits, params, draft, q, u_accept, u_sample) must be `want`
// on the device and on the host.
void ExpectRow(const char* what, const std::vector<float>& logits,
               const SamplingParams& params, int draft_id, const SparseDist& q,
               double u_accept, double u_sample, RowSample want) {
  Batch one;
  one.vocab = static_cast<int>(logits.size());
  one.logits = logits;
  Row row;
  row.params = params;
  row.draft_id = draft_id;
  row.q = q;
  row.u_accept = u_accept;
  row.u_sample = u_sample;
  one.rows.push_back(row);
  const RowSample host = HostSample(one, row);
  EXPECT_TRUE(Same(host, want))
      << what << ": the host gives " << Describe(host);
  std::vector<RowSample> dev;
  ASSERT_NO_FATAL_FAILURE(RunOnDevice(one, &dev));
  EXPECT_TRUE(Same(dev[0], want))
      << what << ": device " << Describe(dev[0]) << ", want " << Describe(want);
}

TEST_F(SampleRowsTest, EdgeRows) {
  SamplingParams plain;
  plain.temperature = 1.f;
  SamplingParams k1 = plain;
  k1.top_k = 1;
  SamplingParams p_small = plain;
  p_small.top_p = 0.01f;
  const double kAlmostOne = std::nextafter(1.0, 0.0);
  const RowSample accepted{true, -1};
  auto token = [](int t) { return RowSample{false, t}; };

  ExpectRow("all -inf", {-kInf, -kInf, -kInf}, plain, -1, {}, 0, 0.9, token(0));
  ExpectRow("all NaN / -inf", {kNaN, kNaN, -kInf, kNaN}, plain, -1, {}, 0, 0.7,
            token(0));
  ExpectRow("no finite logit, draft elsewhere: residual = p = token 0",
            {-kInf, kNaN, -kInf}, plain, 2, {{2, 1.f}}, 0.5, 0.4, token(0));
  ExpectRow("no finite logit, draft 0: p(0) = 1", {-kInf, kNaN, -kInf}, plain,
            0, {{0, 1.f}}, 0.99, 0.4, accepted);
  ExpectRow("+inf logits share the mass: lower half",
            {1.f, kInf, 2.f, kInf, -kInf}, plain, -1, {}, 0, 0.25, token(1));
  ExpectRow("+inf logits share the mass: upper half",
            {1.f, kInf, 2.f, kInf, -kInf}, plain, -1, {}, 0, 0.75, token(3));
  ExpectRow("vocab 1", {0.3f}, plain, -1, {}, 0, kAlmostOne, token(0));
  ExpectRow("vocab 1, draft", {0.3f}, plain, 0, {{0, 1.f}}, kAlmostOne, 0.5,
            accepted);
  ExpectRow("top-k 1 on a tie: the lower id", {2.f, 5.f, 5.f, 1.f}, k1, -1, {},
            0, kAlmostOne, token(1));
  ExpectRow("-0 ties +0", {-0.f, 0.f, -1.f}, k1, -1, {}, 0, kAlmostOne,
            token(0));
  ExpectRow("top-p: the tie's lower id comes first", {2.f, 5.f, 5.f, 1.f},
            p_small, -1, {}, 0, kAlmostOne, token(1));
  ExpectRow("draft outside top-k: rejected even at u_accept 0",
            {2.f, 5.f, 5.f, 1.f}, k1, 2, {{2, 1.f}}, 0.0, 0.3, token(1));
  ExpectRow("u_accept 0 and p(x) > 0: accepted", {2.f, 5.f, 5.f, 1.f}, plain, 2,
            {{1, 0.5f}, {2, 0.5f}}, 0.0, 0.0, accepted);
  const std::vector<float> flat = {0.f, 0.f, 0.f, 0.f};  // p = 1/4 each
  const SparseDist q = {{1, 0.25f}, {2, 0.75f}};
  ExpectRow("q(x) = p(x): accepted for any u_accept < 1", flat, plain, 1, q,
            kAlmostOne, 0.0, accepted);
  ExpectRow("rejected: residual {0, 3}, u_sample 0 -> 0", flat, plain, 2, q,
            0.5, 0.0, token(0));
  ExpectRow("rejected: residual {0, 3}, u_sample ~1 -> 3", flat, plain, 2, q,
            0.5, kAlmostOne, token(3));
  // q >= p everywhere (q sums just over 1): rejected only when u_accept
  // rounds past p(x) / q(x), and then the residual is empty: sample p.
  ExpectRow(
      "rejected with an empty residual", flat, plain, 3,
      {{0, 0.25f}, {1, 0.25f}, {2, 0.25f}, {3, std::nextafter(0.25f, 1.f)}},
      kAlmostOne, 0.6, token(2));
}

// ---------------------------------------------------------------------------
// Distributions.

// Dense p (by id) of ComputeDistribution.
std::vector<double> DenseP(absl::Span<const float> logits,
                           const SamplingParams& params) {
  std::vector<double> p(logits.size(), 0.0);
  for (const auto& e : ComputeDistribution(logits, params)) {
    p[e.first] = e.second;
  }
  return p;
}

// Plain sampling, draft_id = null: tokens ~ p.
void ExpectSamplesFollowP(int vocab, const std::vector<float>& logits,
                          const SamplingParams& params, int num_rows,
                          uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch batch;
  batch.vocab = vocab;
  batch.logits = logits;
  batch.pass_drafts = false;
  for (int i = 0; i < num_rows; ++i) {
    Row row;
    row.params = params;
    row.u_accept = Uniform(rng);
    row.u_sample = Uniform(rng);
    batch.rows.push_back(row);
  }
  std::vector<RowSample> dev;
  ASSERT_NO_FATAL_FAILURE(RunOnDevice(batch, &dev));
  std::vector<int64_t> counts(vocab, 0);
  for (const RowSample& s : dev) ++counts[s.token];
  const ChiSquareResult chi = ChiSquareTest(counts, DenseP(logits, params));
  EXPECT_GT(chi.p_value, 1e-4)
      << "vocab " << vocab << " T " << params.temperature << " top_k "
      << params.top_k << " top_p " << params.top_p << ": chi2 " << chi.statistic
      << " dof " << chi.dof;
}

TEST_F(SampleRowsTest, PlainSamplesFollowComputeDistribution) {
  std::mt19937_64 rng(20240611);
  std::vector<float> logits = MakeLogits(300, 0, rng);
  SamplingParams params;
  params.temperature = 0.8f;
  ExpectSamplesFollowP(300, logits, params, 20000, 1);
  params.top_k = 40;
  params.top_p = 0.9f;
  ExpectSamplesFollowP(300, logits, params, 20000, 2);
  params.top_k = 0;
  params.top_p = 0.5f;
  params.temperature = 1.3f;
  ExpectSamplesFollowP(300, logits, params, 20000, 3);
  // Llama 3's vocabulary: 20 heavy ids (~85% of the mass) spread past
  // 2^16, top-p cutting into the tail.
  logits = MakeLogits(128256, 7, rng);
  params = SamplingParams();
  params.temperature = 0.7f;
  params.top_p = 0.95f;
  ExpectSamplesFollowP(128256, logits, params, 2000, 4);
}

// "Accept x ~ q with probability min(1, p(x)/q(x)), else draw the residual"
// must emit tokens distributed as p (Leviathan et al. 2023, Thm. 1), and
// accept with probability sum_i min(p_i, q_i).
void ExpectLossless(int vocab, const std::vector<float>& target,
                    const std::vector<float>& draft,
                    const SamplingParams& p_params,
                    const SamplingParams& q_params, int num_rows,
                    uint64_t seed) {
  std::mt19937_64 rng(seed);
  const SparseDist q = ComputeDistribution(draft, q_params);
  const std::vector<double> p = DenseP(target, p_params);
  std::vector<double> q_dense(vocab, 0.0);
  for (const auto& e : q) q_dense[e.first] = e.second;
  double accept_prob = 0.0;
  for (int i = 0; i < vocab; ++i) accept_prob += std::min(p[i], q_dense[i]);

  Batch batch;
  batch.vocab = vocab;
  batch.logits = target;
  Rng draw(seed + 1);
  for (int i = 0; i < num_rows; ++i) {
    Row row;
    row.params = p_params;
    row.q = q;
    row.draft_id = SampleFrom(q, &draw);
    row.u_accept = Uniform(rng);
    row.u_sample = Uniform(rng);
    batch.rows.push_back(std::move(row));
  }
  std::vector<RowSample> dev;
  ASSERT_NO_FATAL_FAILURE(RunOnDevice(batch, &dev));
  std::vector<int64_t> counts(vocab, 0);
  int accepted = 0;
  for (int i = 0; i < num_rows; ++i) {
    if (dev[i].accepted) {
      ++accepted;
      ++counts[batch.rows[i].draft_id];
    } else {
      ++counts[dev[i].token];
    }
  }
  const ChiSquareResult chi = ChiSquareTest(counts, p);
  EXPECT_GT(chi.p_value, 1e-4)
      << "vocab " << vocab << ": emitted tokens do not follow p: chi2 "
      << chi.statistic << " dof " << chi.dof;
  const double mean = num_rows * accept_prob;
  const double sd = std::sqrt(num_rows * accept_prob * (1.0 - accept_prob));
  EXPECT_NEAR(accepted, mean, 5.0 * sd + 1.0)
      << "acceptance rate " << static_cast<double>(accepted) / num_rows
      << ", want " << accept_prob;
}

TEST_F(SampleRowsTest, AcceptOrResidualIsLossless) {
  std::mt19937_64 rng(777);
  std::vector<float> target = MakeLogits(200, 0, rng);
  std::vector<float> draft = target;
  std::normal_distribution<float> noise(0.f, 1.f);
  for (float& l : draft) l += noise(rng);
  SamplingParams params;
  params.temperature = 0.9f;
  ExpectLossless(200, target, draft, params, params, 20000, 11);
  // Truncated p and a q whose support is partly outside it.
  SamplingParams p_params = params;
  p_params.top_k = 30;
  p_params.top_p = 0.8f;
  SamplingParams q_params = params;
  q_params.top_k = 50;
  ExpectLossless(200, target, draft, p_params, q_params, 20000, 12);
  // A draft far from the target: mostly residual draws.
  std::vector<float> other = MakeLogits(200, 0, rng);
  ExpectLossless(200, target, other, params, params, 20000, 13);
}

// Kernel time at Llama 3's vocabulary, printed for the record (no bound).
TEST_F(SampleRowsTest, ReportsTimeAtLlama3Vocab) {
  std::mt19937_64 rng(99);
  const int vocab = 128256;
  for (int num_rows : {1, 64}) {
    for (int mode = 0; mode < 3; ++mode) {
      Batch batch;
      batch.vocab = vocab;
      batch.pass_drafts = false;
      for (int r = 0; r < num_rows; ++r) {
        const std::vector<float> l = MakeLogits(vocab, 0, rng);
        batch.logits.insert(batch.logits.end(), l.begin(), l.end());
        Row row;
        row.logit_row = r;
        row.params.temperature = 0.8f;
        if (mode == 1) row.params.top_k = 50;
        if (mode == 2) row.params.top_p = 0.9f;
        row.u_sample = Uniform(rng);
        batch.rows.push_back(row);
      }
      std::vector<RowSample> dev;
      float ms = 0.f;
      ASSERT_NO_FATAL_FAILURE(RunOnDevice(batch, &dev));  // warm-up
      ASSERT_NO_FATAL_FAILURE(RunOnDevice(batch, &dev, &ms));
      std::printf(
          "SampleRows vocab %d rows %d %s: %.3f ms\n", vocab, num_rows,
          mode == 0 ? "full support" : (mode == 1 ? "top_k 50" : "top_p 0.9"),
          ms);
    }
  }
}

// ---------------------------------------------------------------------------
// RowLogprobs: the device twin of ComputeTokenLogprobs.
// ---------------------------------------------------------------------------

TEST(RowLogprobsArgsTest, RejectsBadArgumentsBeforeAnyCudaCall) {
  // Fake device pointers: never dereferenced, every call is rejected or
  // has no rows.
  const float* logits = reinterpret_cast<const float*>(uintptr_t{0x10000});
  const int* ints = reinterpret_cast<const int*>(uintptr_t{0x20000});
  float* lp = reinterpret_cast<float*>(uintptr_t{0x30000});
  int* ids = reinterpret_cast<int*>(uintptr_t{0x40000});
  float* top = reinterpret_cast<float*>(uintptr_t{0x50000});
  EXPECT_EQ(ck::RowLogprobs(logits, 0, ints, ints, 1, 0, lp, ids, top,
                            nullptr),
            cudaErrorInvalidValue);  // vocab
  EXPECT_EQ(ck::RowLogprobs(logits, 10, ints, ints, -1, 0, lp, ids, top,
                            nullptr),
            cudaErrorInvalidValue);  // rows
  EXPECT_EQ(ck::RowLogprobs(logits, 10, ints, ints, 1, 11, lp, ids, top,
                            nullptr),
            cudaErrorInvalidValue);  // top_n > vocab
  EXPECT_EQ(ck::RowLogprobs(logits, 1000, ints, ints, 1, 65, lp, ids, top,
                            nullptr),
            cudaErrorInvalidValue);  // top_n > 64
  EXPECT_EQ(ck::RowLogprobs(logits, 10, ints, ints, 1, 2, lp, nullptr, top,
                            nullptr),
            cudaErrorInvalidValue);  // top ids
  EXPECT_EQ(ck::RowLogprobs(nullptr, 10, ints, ints, 1, 0, lp, ids, top,
                            nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::RowLogprobs(nullptr, 10, nullptr, nullptr, 0, 0, nullptr,
                            nullptr, nullptr, nullptr),
            cudaSuccess);  // no rows: nothing launched
}

// Rows of every kind ComputeTokenLogprobs handles (random, ties, NaN,
// -inf, one +inf, all -inf, a one-entry vocabulary is separate), read in
// a scrambled order, at a small and a Llama 3 vocabulary: the same
// logprob (1e-5 absolute) and the same top ids in the same order.
TEST_F(SampleRowsTest, RowLogprobsMatchComputeTokenLogprobs) {
  for (int vocab : {37, 128256}) {
    SCOPED_TRACE(vocab);
    std::mt19937 rng(vocab);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    constexpr int kRows = 8, kTop = 20;
    std::vector<float> logits(static_cast<size_t>(kRows) * vocab);
    for (float& x : logits) x = normal(rng);
    auto row = [&](int r) { return logits.data() + static_cast<size_t>(r) * vocab; };
    // Row 1: ties (a few values repeated across ids).
    for (int i = 0; i < vocab; ++i) row(1)[i] = static_cast<float>(i % 3);
    // Row 2: NaNs and -infs mixed in.
    for (int i = 0; i < vocab; i += 5) row(2)[i] = std::nanf("");
    for (int i = 1; i < vocab; i += 7) {
      row(2)[i] = -std::numeric_limits<float>::infinity();
    }
    // Row 3: one +inf.
    row(3)[vocab / 2] = std::numeric_limits<float>::infinity();
    // Row 4: all -inf.
    for (int i = 0; i < vocab; ++i) {
      row(4)[i] = -std::numeric_limits<float>::infinity();
    }
    // Jobs read the rows in a scrambled order; each job's token is some id.
    const std::vector<int> rows = {5, 0, 1, 2, 3, 4, 7, 6};
    std::vector<int> tokens;
    for (int r : rows) tokens.push_back((r * 7919 + 3) % vocab);
    const int top_n = std::min(kTop, vocab);
    DeviceArray d_logits(logits.size() * sizeof(float)),
        d_rows(rows.size() * sizeof(int)), d_tokens(rows.size() * sizeof(int)),
        d_lp(rows.size() * sizeof(float)),
        d_ids(rows.size() * top_n * sizeof(int)),
        d_top(rows.size() * top_n * sizeof(float));
    ASSERT_CUDA_OK(d_logits.Upload(logits));
    ASSERT_CUDA_OK(d_rows.Upload(rows));
    ASSERT_CUDA_OK(d_tokens.Upload(tokens));
    ASSERT_CUDA_OK(ck::RowLogprobs(d_logits.as<float>(), vocab,
                                   d_rows.as<int>(), d_tokens.as<int>(),
                                   static_cast<int>(rows.size()), top_n,
                                   d_lp.as<float>(), d_ids.as<int>(),
                                   d_top.as<float>(), nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> lp(rows.size()), top(rows.size() * top_n);
    std::vector<int> ids(rows.size() * top_n);
    ASSERT_CUDA_OK(d_lp.Download(&lp));
    ASSERT_CUDA_OK(d_ids.Download(&ids));
    ASSERT_CUDA_OK(d_top.Download(&top));
    auto same = [](float got, float want) {
      if (std::isinf(want) || std::isinf(got)) return got == want;
      return std::fabs(got - want) <= 1e-5f;
    };
    for (size_t j = 0; j < rows.size(); ++j) {
      const TokenLogprobs want = ComputeTokenLogprobs(
          absl::MakeConstSpan(row(rows[j]), vocab), tokens[j], top_n);
      EXPECT_TRUE(same(lp[j], want.logprob))
          << "job " << j << ": " << lp[j] << " vs " << want.logprob;
      for (int k = 0; k < top_n; ++k) {
        const size_t at = j * top_n + k;
        EXPECT_EQ(ids[at], want.top[k].first) << "job " << j << " rank " << k;
        EXPECT_TRUE(same(top[at], want.top[k].second))
            << "job " << j << " rank " << k;
      }
    }
  }
}


// ---------------------------------------------------------------------------
// ApplyLogitEdits: a request's logit bias / penalties / mask on the device.
// ---------------------------------------------------------------------------

TEST(ApplyLogitEditsArgsTest, RejectsBadArgumentsBeforeAnyCudaCall) {
  float* logits = reinterpret_cast<float*>(uintptr_t{0x10000});
  const int* offsets = reinterpret_cast<const int*>(uintptr_t{0x20000});
  const LogitEdit* edits = reinterpret_cast<const LogitEdit*>(uintptr_t{0x30000});
  EXPECT_EQ(ck::ApplyLogitEdits(logits, 0, 1, offsets, edits, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyLogitEdits(logits, 10, -1, offsets, edits, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyLogitEdits(nullptr, 10, 1, offsets, edits, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyLogitEdits(logits, 10, 1, nullptr, edits, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyLogitEdits(logits, 10, 1, offsets, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyLogitEdits(nullptr, 10, 0, nullptr, nullptr, nullptr),
            cudaSuccess);  // no rows: nothing launched
}

// The host's ApplyLogitEdits of every row of `logits` ([rows, vocab]).
std::vector<float> EditedOnHost(const LogitEdits& edits,
                                std::vector<float> logits, int vocab) {
  const int rows = static_cast<int>(logits.size() / vocab);
  for (int r = 0; r < rows; ++r) {
    ApplyLogitEdits(edits, r,
                    absl::MakeSpan(logits.data() + static_cast<size_t>(r) * vocab,
                                   vocab));
  }
  return logits;
}

// Expects `got` to equal `want` bit for bit (the first difference is
// reported); returns how many entries differ from `before`.
int ChangedIfEqual(const std::vector<float>& got,
                   const std::vector<float>& want,
                   const std::vector<float>& before, int vocab) {
  int changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(got[i] == want[i])) {
      ADD_FAILURE() << "row " << i / vocab << " id " << i % vocab << ": "
                    << got[i] << " != " << want[i];
      return -1;
    }
    changed += got[i] != before[i];
  }
  return changed;
}

TEST(ApplyTokenMasksArgsTest, RejectsBadArgumentsBeforeAnyCudaCall) {
  float* logits = reinterpret_cast<float*>(uintptr_t{0x10000});
  const int* rows = reinterpret_cast<const int*>(uintptr_t{0x20000});
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(uintptr_t{0x30000});
  EXPECT_EQ(ck::ApplyTokenMasks(logits, 0, 1, rows, bits, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyTokenMasks(logits, 40, -1, rows, bits, 2, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyTokenMasks(logits, 40, 1, rows, bits, 1, nullptr),
            cudaErrorInvalidValue);  // 40 ids need 2 words
  EXPECT_EQ(ck::ApplyTokenMasks(nullptr, 40, 1, rows, bits, 2, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyTokenMasks(logits, 40, 1, nullptr, bits, 2, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyTokenMasks(logits, 40, 1, rows, nullptr, 2, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ck::ApplyTokenMasks(nullptr, 40, 0, nullptr, nullptr, 2, nullptr),
            cudaSuccess);  // no rows: nothing launched
}

// Token masks (JSON mode) on the device equal the host's ApplyLogitEdits
// of the same LogitEdits bit for bit: random masks, rows without one, a
// vocabulary that is not a multiple of 32.
TEST_F(SampleRowsTest, ApplyTokenMasksMatchesHost) {
  for (int vocab : {37, 128256}) {
    SCOPED_TRACE(vocab);
    std::mt19937 rng(vocab + 7);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    constexpr int kRows = 5;
    std::vector<float> logits(static_cast<size_t>(kRows) * vocab);
    for (float& x : logits) x = normal(rng);
    LogitEdits edits;
    for (int r = 0; r < kRows; ++r) {
      AppendRowEdits(SamplingParams(), nullptr, {}, {}, vocab, &edits);
      if (r == 1 || r == 3) continue;  // rows without a mask
      std::vector<int> disallowed;
      for (int id = 0; id < vocab; ++id) {
        if (rng() % 4 != 0 || id == vocab - 1) disallowed.push_back(id);
      }
      MaskLastRow(disallowed, vocab, &edits);
    }
    std::vector<int> mask_of_row = edits.mask_of_row;
    mask_of_row.resize(kRows, -1);
    const std::vector<float> want = EditedOnHost(edits, logits, vocab);
    DeviceArray d_logits(logits.size() * sizeof(float)),
        d_rows(mask_of_row.size() * sizeof(int)),
        d_bits(edits.allowed.size() * sizeof(uint32_t));
    ASSERT_CUDA_OK(d_logits.Upload(logits));
    ASSERT_CUDA_OK(d_rows.Upload(mask_of_row));
    ASSERT_CUDA_OK(d_bits.Upload(edits.allowed));
    ASSERT_CUDA_OK(ck::ApplyTokenMasks(d_logits.as<float>(), vocab, kRows,
                                       d_rows.as<int>(), d_bits.as<uint32_t>(),
                                       edits.mask_words, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got(logits.size());
    ASSERT_CUDA_OK(d_logits.Download(&got));
    EXPECT_GT(ChangedIfEqual(got, want, logits, vocab), 0);
  }
}

// Rows edited by AppendRowEdits' output for random biases, penalties and
// masks (rows without edits among them, more edits than a block has
// threads) equal the host's ApplyLogitEdits bit for bit, and untouched ids
// keep their logits.
TEST_F(SampleRowsTest, ApplyLogitEditsMatchesHost) {
  for (int vocab : {37, 128256}) {
    SCOPED_TRACE(vocab);
    std::mt19937 rng(vocab + 1);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::uniform_int_distribution<int> id(0, vocab - 1);
    constexpr int kRows = 6;
    std::vector<float> logits(static_cast<size_t>(kRows) * vocab);
    for (float& x : logits) x = normal(rng);
    SamplingParams p;
    p.presence_penalty = 0.4f;
    p.frequency_penalty = -0.3f;
    p.repetition_penalty = 1.3f;
    for (int b = 0; b < 20; ++b) p.logit_bias.push_back({b * (vocab / 20), normal(rng)});
    std::vector<int> prompt(600), output(50);
    for (int& x : prompt) x = id(rng);
    for (int& x : output) x = id(rng);
    PenaltyTracker t(prompt);
    t.AddOutput(output);
    LogitEdits edits;
    const std::vector<int> masked = {1, vocab - 1};
    for (int r = 0; r < kRows; ++r) {
      std::vector<int> pending(r);
      for (int& x : pending) x = id(rng);
      if (r == 2) {  // a row without edits
        AppendRowEdits(SamplingParams(), nullptr, {}, {}, vocab, &edits);
      } else {
        AppendRowEdits(p, &t, pending, r % 2 ? absl::MakeConstSpan(masked)
                                              : absl::Span<const int>(),
                       vocab, &edits);
      }
    }
    ASSERT_EQ(edits.offsets[3] - edits.offsets[2], 0);
    if (vocab > 1000) {
      ASSERT_GT(edits.offsets[1] - edits.offsets[0], 128);
    }
    const std::vector<float> want = EditedOnHost(edits, logits, vocab);
    DeviceArray d_logits(logits.size() * sizeof(float)),
        d_offsets(edits.offsets.size() * sizeof(int)),
        d_edits(edits.edits.size() * sizeof(LogitEdit));
    ASSERT_CUDA_OK(d_logits.Upload(logits));
    ASSERT_CUDA_OK(d_offsets.Upload(edits.offsets));
    ASSERT_CUDA_OK(d_edits.Upload(edits.edits));
    ASSERT_CUDA_OK(ck::ApplyLogitEdits(d_logits.as<float>(), vocab, kRows,
                                       d_offsets.as<int>(),
                                       d_edits.as<LogitEdit>(), nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got(logits.size());
    ASSERT_CUDA_OK(d_logits.Download(&got));
    EXPECT_GT(ChangedIfEqual(got, want, logits, vocab), 0);
  }
}

}  // namespace
}  // namespace specserve
