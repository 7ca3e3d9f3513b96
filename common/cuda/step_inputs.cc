#include "common/cuda/step_inputs.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace specserve {
namespace cuda_step {

PackedRowSampling PackRowSampling(absl::Span<const SequenceForward> batch,
                                  absl::Span<const int> logit_row_start,
                                  int capacity) {
  PackedRowSampling p;
  if (capacity > 0) {
    p.num_rows = capacity;
  } else {
    for (size_t i = 0; i < batch.size(); ++i) {
      if (batch[i].input.sampling == nullptr) continue;
      p.num_rows += logit_row_start[i + 1] - logit_row_start[i];
    }
  }
  if (p.num_rows == 0) return p;
  const int M = p.num_rows;
  // Placeholders everywhere first: each job reads its own row, top-k 1.
  p.ints.assign(4 * M + 1, 0);
  p.floats.assign(3 * M, 1.f);
  p.uniforms.assign(2 * M, 0.0);
  int* top_k = p.ints.data() + PackedRowSampling::top_k_at(M);
  int* draft = p.ints.data() + PackedRowSampling::draft_id_at(M);
  int* q_off = p.ints.data() + PackedRowSampling::q_offsets_at(M);
  float* top_p = p.floats.data() + PackedRowSampling::top_p_at(M);
  float* min_p = p.floats.data() + PackedRowSampling::min_p_at(M);
  for (int r = 0; r < M; ++r) {
    p.ints[r] = r;
    top_k[r] = 1;
    draft[r] = -1;
    min_p[r] = 0.f;
  }
  std::vector<int> q_ids;
  std::vector<float> q_probs;
  int job = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const RowSampling* rs = batch[i].input.sampling;
    if (rs == nullptr && capacity == 0) continue;
    for (int j = logit_row_start[i]; j < logit_row_start[i + 1]; ++j, ++job) {
      q_off[job] = static_cast<int>(q_ids.size());
      if (rs == nullptr) continue;  // a placeholder
      const int r = j - logit_row_start[i];
      p.ints[job] = j;
      p.floats[job] = rs->params.temperature;
      top_k[job] = rs->params.top_k;
      top_p[job] = rs->params.top_p;
      min_p[job] = rs->params.min_p;
      draft[job] = rs->draft_ids[r];
      p.uniforms[2 * job] = rs->uniforms[2 * r];
      p.uniforms[2 * job + 1] = rs->uniforms[2 * r + 1];
      if (rs->draft_ids[r] >= 0) {
        for (const auto& [id, prob] : *rs->draft_q[r]) {
          q_ids.push_back(id);
          q_probs.push_back(prob);
        }
      }
    }
  }
  for (int r = job; r <= M; ++r) q_off[r] = static_cast<int>(q_ids.size());
  p.ints.insert(p.ints.end(), q_ids.begin(), q_ids.end());
  p.floats.insert(p.floats.end(), q_probs.begin(), q_probs.end());
  return p;
}

int GraphBucket(int rows) {
  if (rows <= 2) return std::max(rows, 1);
  if (rows <= 4) return 4;
  return (rows + 7) / 8 * 8;
}

bool GraphEligible(absl::Span<const SequenceForward> batch,
                   const std::vector<std::vector<int>>& logit_rows,
                   int max_rows, int flash_min_rows, int max_q,
                   int max_edits, int max_capture_rows) {
  int rows = 0, captured = 0;
  size_t q = 0, edits = 0;
  bool sampled = false;
  for (size_t i = 0; i < batch.size(); ++i) {
    const ForwardInput& in = batch[i].input;
    const int n = static_cast<int>(in.token_ids.size());
    if (!in.capture_query_rows.empty() && batch[i].capture == nullptr) {
      return false;  // queries for the host: the eager step copies them
    }
    if (batch[i].capture != nullptr) {
      captured += static_cast<int>(in.capture_query_rows.size());
    }
    sampled |= in.sampling != nullptr;
    if ((in.argmax_only && in.sampling != nullptr) ||
        !in.tree_parents.empty() || in.logprobs_top_n >= 0 ||
        static_cast<int>(logit_rows[i].size()) != n) {
      return false;
    }
    for (int j = 0; j < n; ++j) {
      if (logit_rows[i][j] != j) return false;
    }
    if (flash_min_rows > 0 && n >= flash_min_rows) return false;
    if (in.sampling != nullptr) {
      for (int j = 0; j < n; ++j) {
        if (in.sampling->draft_ids[j] >= 0) q += in.sampling->draft_q[j]->size();
      }
    }
    if (in.logit_edits != nullptr) {
      if (in.logit_edits->has_masks()) return false;
      edits += in.logit_edits->edits.size();
    }
    rows += n;
  }
  return !batch.empty() && rows <= max_rows &&
         q <= static_cast<size_t>(max_q) &&
         edits <= static_cast<size_t>(max_edits) &&
         captured <= max_capture_rows && (captured == 0 || !sampled);
}

LogitEdits PackLogitEdits(absl::Span<const SequenceForward> batch,
                          absl::Span<const int> logit_row_start, int rows) {
  LogitEdits p;
  bool any = false;
  for (const SequenceForward& e : batch) any |= e.input.logit_edits != nullptr;
  if (!any) return p;
  p.offsets.reserve(rows + 1);
  p.offsets.push_back(0);
  bool masks = false;
  for (const SequenceForward& e : batch) {
    masks |= e.input.logit_edits != nullptr && e.input.logit_edits->has_masks();
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const LogitEdits* e = batch[i].input.logit_edits;
    // Where this sequence's masks start in p.allowed.
    const int first_mask = p.num_masks();
    if (e != nullptr && e->has_masks()) {
      p.mask_words = e->mask_words;
      p.allowed.insert(p.allowed.end(), e->allowed.begin(), e->allowed.end());
    }
    for (int j = logit_row_start[i]; j < logit_row_start[i + 1]; ++j) {
      const int r = j - logit_row_start[i];
      if (e != nullptr) {
        p.edits.insert(p.edits.end(), e->edits.begin() + e->offsets[r],
                       e->edits.begin() + e->offsets[r + 1]);
      }
      p.offsets.push_back(static_cast<int>(p.edits.size()));
      if (masks) {
        const int m = e != nullptr ? e->mask_of(r) : -1;
        p.mask_of_row.push_back(m < 0 ? -1 : first_mask + m);
      }
    }
  }
  p.offsets.resize(rows + 1, static_cast<int>(p.edits.size()));
  if (masks) p.mask_of_row.resize(rows, -1);
  return p;
}

bool AnySampling(absl::Span<const SequenceForward> batch) {
  for (const SequenceForward& e : batch) {
    if (e.input.sampling != nullptr) return true;
  }
  return false;
}

absl::StatusOr<GraphStepInputs> PackGraphStep(
    absl::Span<const SequenceForward> batch, absl::Span<const int> first,
    int max_rows, int max_tables, int num_heads, int num_kv_heads,
    int num_sms) {
  GraphStepInputs g;
  for (const SequenceForward& e : batch) {
    g.rows += static_cast<int>(e.input.token_ids.size());
  }
  if (g.rows < 1 || g.rows > max_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a graph step holds 1 to ", max_rows, " rows, got ", g.rows));
  }
  g.bucket = GraphBucket(g.rows);
  const size_t M = max_rows;
  g.head.assign(4 * M, 0);
  std::vector<cuda_kernels::AttentionSequence> seqs;
  int row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const ForwardInput& in = batch[i].input;
    const int n = static_cast<int>(in.token_ids.size());
    seqs.push_back({n, first[i], static_cast<int>(g.tables.size()), row});
    for (int t = 0; t < n; ++t, ++row) {
      g.head[row] = in.token_ids[t];
      g.head[M + row] = in.position_ids[t];
      g.head[2 * M + row] = batch[i].kv->PhysicalSlot(first[i] + t);
    }
    const std::vector<int>& table = batch[i].kv->block_table();
    g.tables.insert(g.tables.end(), table.begin(), table.end());
  }
  if (static_cast<int>(g.tables.size()) > max_tables) {
    return absl::InvalidArgumentError(
        absl::StrCat("the step's block tables hold ", g.tables.size(),
                     " entries, the graph's room is ", max_tables));
  }
  for (int r = g.rows; r < g.bucket; ++r) g.head[2 * M + r] = -1;
  for (int r = 0; r < g.bucket; ++r) g.head[3 * M + r] = r;
  absl::StatusOr<cuda_kernels::BatchedAttentionPlan> plan =
      cuda_kernels::PlanBatchedAttention(seqs, num_heads, num_kv_heads,
                                         num_sms);
  if (!plan.ok()) return plan.status();
  g.plan = *std::move(plan);
  return g;
}

}  // namespace cuda_step
}  // namespace specserve
