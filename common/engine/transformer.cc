#include "common/engine/transformer.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/engine/kernels.h"
#include "common/engine/thread_pool.h"

namespace specserve {
namespace {

// Up to this many rows, Linear streams the weights once with BatchedGemv
// (decode and verify rounds); beyond it OpenBLAS sgemm is compute-bound
// and wins.
constexpr int kMaxGemvRows = 12;
// Below this many multiply-adds a Linear runs on the calling thread.
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;

// y[n, out] = x[n, in] W^T (+ beta * y), W row-major [out, in].
void Linear(const float* x, int n, int in, const float* w, int out, float* y,
            float beta) {
  if (n <= kMaxGemvRows) {
    // Waking the pool costs tens of microseconds: small weights (tiny
    // models, which fit in cache) run inline.
    if (static_cast<int64_t>(out) * in * n < kMinParallelMacs) {
      kernels::BatchedGemv(x, n, in, w, 0, out, y, out, beta);
      return;
    }
    ThreadPool::Default().ParallelFor(out, 16, [&](int b, int e) {
      kernels::BatchedGemv(x, n, in, w, b, e, y, out, beta);
    });
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.f, x,
                in, w, in, beta, y, out);
  }
}

// Caps the attention score block at ~16M floats (64 MiB) per call.
constexpr size_t kMaxScoreFloats = size_t{1} << 24;
// Target rows (query tokens x heads of a GQA group) per score GEMM.
constexpr int kTargetGemmRows = 256;

}  // namespace

absl::StatusOr<std::vector<int>> ValidateForwardInput(const ModelConfig& c,
                                                      const ForwardInput& in) {
  const int n = static_cast<int>(in.token_ids.size());
  if (n == 0) return absl::InvalidArgumentError("token_ids is empty");
  if (in.position_ids.size() != in.token_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "position_ids has ", in.position_ids.size(), " entries, token_ids ",
        n));
  }
  for (int i = 0; i < n; ++i) {
    if (in.token_ids[i] < 0 || in.token_ids[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ids[", i, "] = ", in.token_ids[i],
                       " outside the vocabulary [0, ", c.vocab_size, ")"));
    }
    if (in.position_ids[i] < 0 ||
        in.position_ids[i] >= c.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "position_ids[", i, "] = ", in.position_ids[i], " outside [0, ",
          c.max_position_embeddings, ")"));
    }
  }
  std::vector<int> logit_rows = in.logit_rows;
  if (logit_rows.empty()) logit_rows.push_back(n - 1);
  for (int r : logit_rows) {
    if (r < 0 || r >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit row ", r, " outside [0, ", n, ")"));
    }
  }
  for (int r : in.capture_query_rows) {
    if (r < 0 || r >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("query capture row ", r, " outside [0, ", n, ")"));
    }
  }
  return logit_rows;
}

Transformer::Transformer(std::shared_ptr<const ModelWeights> weights)
    : weights_(std::move(weights)) {}

void Transformer::Attention(int layer, int n, int first, const float* qkv,
                            KvCache* cache, float* attn_out,
                            AttentionScratch* scratch) const {
  const ModelConfig& c = weights_->config;
  const int H = c.num_attention_heads, KV = c.num_key_value_heads;
  const int D = c.head_dim, group = c.gqa_group();
  const int qkv_dim = c.qkv_dim();
  const int rw = cache->row_width();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float* K = cache->keys(layer);
  const float* V = cache->values(layer);
  const int total = first + n;

  int block = std::max(1, kTargetGemmRows / group);
  block = std::min(block, n);
  while (block > 1 &&
         static_cast<size_t>(block) * group * total > kMaxScoreFloats) {
    block /= 2;
  }
  // resize() keeps the capacity, so only the first layer allocates.
  std::vector<float>& qg = scratch->qg;
  std::vector<float>& og = scratch->og;
  std::vector<float>& s = scratch->scores;
  qg.resize(static_cast<size_t>(block) * group * D);
  og.resize(static_cast<size_t>(block) * group * D);
  s.resize(static_cast<size_t>(block) * group * total);

  for (int g = 0; g < KV; ++g) {
    for (int i0 = 0; i0 < n; i0 += block) {
      const int i1 = std::min(n, i0 + block);
      const int m = (i1 - i0) * group;
      const int nk = first + i1;  // keys visible to the block's last row
      // Gather the group's query heads: row (i - i0) * group + hh.
      for (int i = i0; i < i1; ++i) {
        for (int hh = 0; hh < group; ++hh) {
          std::memcpy(&qg[(static_cast<size_t>(i - i0) * group + hh) * D],
                      qkv + static_cast<size_t>(i) * qkv_dim +
                          (g * group + hh) * D,
                      D * sizeof(float));
        }
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nk, D, scale,
                  qg.data(), D, K + g * D, rw, 0.f, s.data(), nk);
      for (int i = i0; i < i1; ++i) {
        const int allowed = first + i + 1;  // causal over cache order
        for (int hh = 0; hh < group; ++hh) {
          kernels::SoftmaxPrefix(
              &s[(static_cast<size_t>(i - i0) * group + hh) * nk], allowed,
              nk);
        }
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, D, nk, 1.f,
                  s.data(), nk, V + g * D, rw, 0.f, og.data(), D);
      for (int i = i0; i < i1; ++i) {
        for (int hh = 0; hh < group; ++hh) {
          std::memcpy(attn_out + static_cast<size_t>(i) * H * D +
                          (g * group + hh) * D,
                      &og[(static_cast<size_t>(i - i0) * group + hh) * D],
                      D * sizeof(float));
        }
      }
    }
  }
}

absl::Status Transformer::Forward(const ForwardInput& in, KvCache* cache,
                                  ForwardOutput* out) const {
  const ModelConfig& c = weights_->config;
  const int n = static_cast<int>(in.token_ids.size());
  absl::StatusOr<std::vector<int>> rows_or = ValidateForwardInput(c, in);
  if (!rows_or.ok()) return rows_or.status();
  std::vector<int> logit_rows = *std::move(rows_or);
  absl::StatusOr<int> first_or = cache->Reserve(n);
  if (!first_or.ok()) return first_or.status();
  const int first = *first_or;
  cache->SetPositions(first, in.position_ids.data(), n);

  const int hidden = c.hidden_size, H = c.num_attention_heads;
  const int KV = c.num_key_value_heads, D = c.head_dim;
  const int ffn = c.intermediate_size, qkv_dim = c.qkv_dim();
  const int rw = cache->row_width();
  const size_t N = n;

  std::vector<float> x(N * hidden), h(N * hidden), qkv(N * qkv_dim);
  std::vector<float> attn(N * H * D), gu(N * 2 * ffn), act(N * ffn);
  AttentionScratch scratch;
  for (int i = 0; i < n; ++i) {
    std::memcpy(&x[i * size_t{hidden}],
                &weights_->embed[static_cast<size_t>(in.token_ids[i]) * hidden],
                hidden * sizeof(float));
  }
  const int nq = static_cast<int>(in.capture_query_rows.size());
  out->queries.assign(
      static_cast<size_t>(c.num_hidden_layers) * nq * H * D, 0.f);

  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = weights_->layers[l];
    kernels::RmsNorm(x.data(), hidden, w.attn_norm.data(), c.rms_norm_eps, n,
                     hidden, h.data(), hidden);
    Linear(h.data(), n, hidden, w.wqkv.data(), qkv_dim, qkv.data(), 0.f);
    // RoPE on q heads and k heads (contiguous: q then k in each row).
    kernels::ApplyRope(qkv.data(), qkv_dim, n, H + KV, D,
                       in.position_ids.data(), c.rope_theta);
    for (int j = 0; j < nq; ++j) {
      std::memcpy(&out->queries[((static_cast<size_t>(l) * nq) + j) * H * D],
                  &qkv[in.capture_query_rows[j] * size_t{qkv_dim}],
                  H * D * sizeof(float));
    }
    float* kc = cache->keys(l);
    float* vc = cache->values(l);
    for (int i = 0; i < n; ++i) {
      const float* row = &qkv[i * size_t{qkv_dim}];
      std::memcpy(kc + static_cast<size_t>(first + i) * rw, row + H * D,
                  rw * sizeof(float));
      std::memcpy(vc + static_cast<size_t>(first + i) * rw,
                  row + (H + KV) * D, rw * sizeof(float));
    }
    Attention(l, n, first, qkv.data(), cache, attn.data(), &scratch);
    Linear(attn.data(), n, H * D, w.wo.data(), hidden, x.data(), 1.f);
    kernels::RmsNorm(x.data(), hidden, w.mlp_norm.data(), c.rms_norm_eps, n,
                     hidden, h.data(), hidden);
    Linear(h.data(), n, hidden, w.w_gate_up.data(), 2 * ffn, gu.data(), 0.f);
    kernels::SiluMul(gu.data(), n, ffn, act.data());
    Linear(act.data(), n, ffn, w.w_down.data(), hidden, x.data(), 1.f);
  }

  // Final norm and vocabulary projection for the requested rows only.
  const int r = static_cast<int>(logit_rows.size());
  std::vector<float> hr(static_cast<size_t>(r) * hidden);
  for (int j = 0; j < r; ++j) {
    kernels::RmsNorm(&x[logit_rows[j] * size_t{hidden}], hidden,
                     weights_->final_norm.data(), c.rms_norm_eps, 1, hidden,
                     &hr[j * size_t{hidden}], hidden);
  }
  out->logit_rows = std::move(logit_rows);
  out->logits.resize(static_cast<size_t>(r) * c.vocab_size);
  Linear(hr.data(), r, hidden, weights_->lm_head(), c.vocab_size,
         out->logits.data(), 0.f);
  return absl::OkStatus();
}

void SetEngineThreads(int n) {
  if (n > 0) {
    openblas_set_num_threads(n);
    ThreadPool::SetDefaultThreads(n);
  }
}

void MaybeReexecForAvx512(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return;
  // Newer OpenBLAS builds detect AVX-512 cores themselves (e.g. Cooperlake,
  // SkylakeX); only AVX2 fallbacks (Haswell, Zen) need the override.
  const std::string core = openblas_get_corename();
  if (core.find("lake") != std::string::npos ||
      core.find("Sapphire") != std::string::npos) {
    return;
  }
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  execv("/proc/self/exe", argv);
  // execv failed: carry on with the default kernels.
}

}  // namespace specserve
