#include "common/decoding/row_sampling.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace specserve {
namespace {

// Supports up to this size are sorted by id; larger ones (a full
// vocabulary's) are walked densely by id, O(max id), with no sort.
constexpr size_t kSortedMax = 2048;

}  // namespace

int SampleFromInIdOrder(const SparseDist& dist, double u) {
  if (dist.size() <= kSortedMax) {
    SparseDist by_id = dist;
    std::sort(by_id.begin(), by_id.end());
    return SampleAt(by_id, u);
  }
  int max_id = 0;
  for (const auto& e : dist) max_id = std::max(max_id, e.first);
  thread_local std::vector<float> dense;
  dense.assign(static_cast<size_t>(max_id) + 1, 0.f);
  for (const auto& e : dist) dense[e.first] = e.second;
  // SampleAt's walk over the id-sorted entries: absent ids add exactly 0.
  double total = 0.0;
  for (float p : dense) total += p;
  if (!(total > 0.0)) return -1;
  const double target = u * total;
  double cum = 0.0;
  int last_positive = -1;
  for (int id = 0; id <= max_id; ++id) {
    if (dense[id] <= 0.f) continue;
    cum += dense[id];
    last_positive = id;
    if (cum > target) return id;
  }
  return last_positive;  // target rounded past the final cumulative sum
}

RowSample SampleRow(absl::Span<const float> logits,
                    const SamplingParams& params, int draft_id,
                    const SparseDist& q, double u_accept, double u_sample) {
  const SparseDist p = ComputeDistribution(logits, params);
  RowSample out;
  if (draft_id < 0) {
    out.token = SampleFromInIdOrder(p, u_sample);
    return out;
  }
  double p_x = 0.0, q_x = 0.0;
  for (const auto& e : p) {
    if (e.first == draft_id) p_x = e.second;
  }
  for (const auto& e : q) {
    if (e.first == draft_id) q_x = e.second;
  }
  // min(1, p/q) without the division, as VerifyDrafts writes it.
  if (u_accept * q_x < p_x) {
    out.accepted = true;
    return out;
  }
  // The residual's support lies inside p's (q-only tokens have p = 0).
  // A dense q by id (as VerifyDrafts keeps it), zeroed again after use.
  thread_local std::vector<float> q_dense;
  if (q_dense.size() < logits.size()) q_dense.resize(logits.size(), 0.f);
  for (const auto& e : q) q_dense[e.first] = e.second;
  SparseDist residual;
  for (const auto& e : p) {
    const float r = e.second - q_dense[e.first];
    if (r > 0.f) residual.emplace_back(e.first, r);
  }
  for (const auto& e : q) q_dense[e.first] = 0.f;
  out.token = SampleFromInIdOrder(residual.empty() ? p : residual, u_sample);
  return out;
}

}  // namespace specserve
