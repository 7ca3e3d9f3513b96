#include "common/decoding/row_sampling.h"

#include <algorithm>
#include <utility>

namespace specserve {

int SampleFromInIdOrder(const SparseDist& dist, double u) {
  SparseDist by_id = dist;
  std::sort(by_id.begin(), by_id.end());
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
  SparseDist q_sorted = q;
  std::sort(q_sorted.begin(), q_sorted.end());
  SparseDist residual;
  for (const auto& e : p) {
    auto it = std::lower_bound(q_sorted.begin(), q_sorted.end(),
                               std::make_pair(e.first, -1.f));
    const float q_i =
        it != q_sorted.end() && it->first == e.first ? it->second : 0.f;
    const float r = e.second - q_i;
    if (r > 0.f) residual.emplace_back(e.first, r);
  }
  out.token = SampleFromInIdOrder(residual.empty() ? p : residual, u_sample);
  return out;
}

}  // namespace specserve
