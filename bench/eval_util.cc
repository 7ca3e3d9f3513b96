#include "bench/eval_util.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/decoding/sampling.h"

namespace specserve {
namespace bench {

std::vector<int> KeepRandom(int n, int count, uint64_t seed) {
  if (count >= n) {
    std::vector<int> all(n);
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  std::vector<int> middle(n - 2);
  std::iota(middle.begin(), middle.end(), 1);
  std::mt19937_64 rng(seed);
  // Partial Fisher-Yates: the first count-2 entries become the sample.
  const int pick = std::max(count - 2, 0);
  for (int i = 0; i < pick; ++i) {
    std::uniform_int_distribution<int> u(i,
                                         static_cast<int>(middle.size()) - 1);
    std::swap(middle[i], middle[u(rng)]);
  }
  std::vector<int> kept = {0, n - 1};
  kept.insert(kept.end(), middle.begin(), middle.begin() + pick);
  std::sort(kept.begin(), kept.end());
  return kept;
}

std::vector<int> KeepSinkRecent(int n, int count, int sink) {
  count = std::min(count, n);
  sink = std::max(0, std::min(sink, count - 1));
  std::vector<int> kept;
  for (int i = 0; i < sink; ++i) kept.push_back(i);
  for (int i = n - (count - sink); i < n; ++i) kept.push_back(i);
  return kept;
}

std::vector<int> KeepRecent(int n, int count) {
  return KeepSinkRecent(n, count, 1);
}

absl::StatusOr<PrunedRun> RunPruned(ModelRunner& target,
                                    absl::Span<const int> prompt,
                                    absl::Span<const int> kept, int gen) {
  const ModelConfig& c = target.config();
  const int n = static_cast<int>(prompt.size());
  if (kept.empty() || kept.back() != n - 1 ||
      !std::is_sorted(kept.begin(), kept.end())) {
    return absl::InvalidArgumentError(
        "kept must be sorted, non-empty and end at the last prompt token");
  }
  if (n + gen > c.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", n, " tokens + ", gen, " generated exceeds the context ",
        c.max_position_embeddings));
  }
  auto cache = target.NewSequence(static_cast<int>(kept.size()) + gen);
  if (!cache.ok()) return cache.status();
  std::vector<int> tokens;
  for (int i : kept) tokens.push_back(prompt[i]);
  ForwardInput in;
  in.token_ids = tokens;
  in.position_ids = kept;
  ForwardOutput out;
  if (auto s = target.Forward(in, cache->get(), &out); !s.ok()) return s;
  PrunedRun run;
  run.next_logits = out.logits;
  for (int i = 0; i < gen; ++i) {
    const int tok = Argmax(out.logits);
    run.continuation.push_back(tok);
    if (i + 1 == gen) break;
    const int pos = n + i;
    ForwardInput step;
    step.token_ids = absl::MakeConstSpan(&tok, 1);
    step.position_ids = absl::MakeConstSpan(&pos, 1);
    if (auto s = target.Forward(step, cache->get(), &out); !s.ok()) return s;
  }
  return run;
}

double KlDivergence(absl::Span<const float> p_logits,
                    absl::Span<const float> q_logits) {
  auto log_softmax = [](absl::Span<const float> x) {
    double mx = -INFINITY;
    for (float v : x) mx = std::max(mx, static_cast<double>(v));
    double sum = 0;
    for (float v : x) sum += std::exp(v - mx);
    const double lse = mx + std::log(sum);
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] - lse;
    return out;
  };
  const std::vector<double> lp = log_softmax(p_logits);
  const std::vector<double> lq = log_softmax(q_logits);
  double kl = 0;
  for (size_t i = 0; i < lp.size() && i < lq.size(); ++i) {
    kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  }
  return std::max(kl, 0.0);  // rounding can leave -1e-17
}

double MatchRate(absl::Span<const int> a, absl::Span<const int> b) {
  const size_t len = std::max(a.size(), b.size());
  if (len == 0) return 1.0;
  size_t same = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    same += a[i] == b[i];
  return static_cast<double>(same) / len;
}

MeanStd ComputeMeanStd(absl::Span<const double> xs) {
  MeanStd r;
  if (xs.empty()) return r;
  for (double x : xs) r.mean += x;
  r.mean /= xs.size();
  if (xs.size() < 2) return r;
  double ss = 0;
  for (double x : xs) ss += (x - r.mean) * (x - r.mean);
  r.std = std::sqrt(ss / (xs.size() - 1));
  return r;
}

absl::StatusOr<std::string> ReadPromptFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) {
    s.pop_back();
  }
  return s;
}

std::vector<std::string> PromptFiles(const std::vector<std::string>& dirs) {
  std::vector<std::string> all;
  for (const std::string& d : dirs) {
    std::vector<std::string> files;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(d, ec)) {
      if (e.path().extension() == ".txt") files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    all.insert(all.end(), files.begin(), files.end());
  }
  return all;
}

}  // namespace bench
}  // namespace specserve
