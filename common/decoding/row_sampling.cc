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
  SparseDist by_id;
  if (dist.size() <= kSortedMax) {
    by_id = dist;
    std::sort(by_id.begin(), by_id.end());
  } else {
    // Ids are distinct and bounded: place them, then read them in order.
    int max_id = 0;
    for (const auto& e : dist) max_id = std::max(max_id, e.first);
    thread_local std::vector<float> dense;
    dense.assign(static_cast<size_t>(max_id) + 1, 0.f);
    for (const auto& e : dist) dense[e.first] = e.second;
    by_id.reserve(dist.size());
    for (int id = 0; id <= max_id; ++id) {
      if (dense[id] != 0.f) by_id.emplace_back(id, dense[id]);
    }
  }
  return SampleAt(by_id, u);
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
  // min(1, p/q) without the division, as VerifyDrafts writes it.
  if (u_accept * ProbabilityOf(q, draft_id) < ProbabilityOf(p, draft_id)) {
    out.accepted = true;
    return out;
  }
  thread_local std::vector<float> q_dense;
  if (q_dense.size() < logits.size()) q_dense.resize(logits.size(), 0.f);
  const SparseDist residual = Residual(p, q, &q_dense);
  out.token = SampleFromInIdOrder(residual.empty() ? p : residual, u_sample);
  return out;
}

}  // namespace specserve
