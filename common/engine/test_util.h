#ifndef SPECSERVE_COMMON_ENGINE_TEST_UTIL_H_
#define SPECSERVE_COMMON_ENGINE_TEST_UTIL_H_

// Helpers shared by the engine's and the services' tests: load bundled
// models, read golden JSON, and compute reference greedy continuations
// token by token from a fresh cache.

#include <fstream>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "common/decoding/sampling.h"
#include "common/engine/cpu_model_runner.h"
#include "nlohmann/json.hpp"

namespace specserve {
namespace testing_util {

inline std::shared_ptr<const ModelWeights> LoadBundled(const std::string& m) {
  auto w = LoadModelWeights("models/" + m);
  if (!w.ok()) return nullptr;
  return std::make_shared<const ModelWeights>(*std::move(w));
}

/// A CPU runner whose KV pool holds `sequences` max-context sequences in
/// `kv_dtype`.
inline std::unique_ptr<CpuModelRunner> MakeCpuRunner(
    std::shared_ptr<const ModelWeights> weights, int sequences = 8,
    KvCacheDType kv_dtype = KvCacheDType::kF32) {
  KvCacheOptions o;
  o.dtype = kv_dtype;
  o.pool_bytes = CpuModelRunner::BytesPerToken(weights->config, kv_dtype) *
                 weights->config.max_position_embeddings * sequences;
  auto r = CpuModelRunner::Create(std::move(weights), o);
  return r.ok() ? *std::move(r) : nullptr;
}

/// A CPU runner with automatic prefix caching in blocks of `block_size`
/// tokens and a pool of 2048 tokens; null if it cannot be made.
inline std::unique_ptr<CpuModelRunner> MakePrefixCachingRunner(
    std::shared_ptr<const ModelWeights> weights, int block_size) {
  KvCacheOptions o;
  o.block_size = block_size;
  o.prefix_caching = true;
  o.pool_bytes = CpuModelRunner::BytesPerToken(weights->config) * 512 * 4;
  auto r = CpuModelRunner::Create(std::move(weights), o);
  return r.ok() ? *std::move(r) : nullptr;
}

inline nlohmann::json ReadJson(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

/// Greedy continuation of `tokens` at positions `positions`, decoding
/// continuing at `next_position` + i, one token per forward (the plain,
/// unspeculated reference).
inline std::vector<int> GreedyReference(ModelRunner& model,
                                        const std::vector<int>& tokens,
                                        std::vector<int> positions,
                                        int next_position, int n) {
  if (positions.empty()) {
    positions.resize(tokens.size());
    std::iota(positions.begin(), positions.end(), 0);
  }
  auto seq = model.NewSequence(model.config().max_position_embeddings);
  if (!seq.ok()) return {};
  KvSequence* cache = seq->get();
  ForwardInput in;
  in.token_ids = tokens;
  in.position_ids = positions;
  ForwardOutput out;
  std::vector<int> result;
  if (!model.Forward(in, cache, &out).ok()) return result;
  const int vocab = model.config().vocab_size;
  for (int i = 0; i < n; ++i) {
    const int tok = Argmax(absl::MakeConstSpan(out.logits.data(), vocab));
    result.push_back(tok);
    if (i + 1 == n) break;
    const int p = next_position + i;
    ForwardInput step;
    step.token_ids = absl::MakeConstSpan(&result.back(), 1);
    step.position_ids = absl::MakeConstSpan(&p, 1);
    if (!model.Forward(step, cache, &out).ok()) return {};
  }
  return result;
}

}  // namespace testing_util
}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_TEST_UTIL_H_
