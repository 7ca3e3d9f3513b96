#include "common/engine/model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/decoding/row_sampling.h"
#include "common/decoding/sampling.h"

namespace specserve {

namespace {

// Which ids of one row were seen already (a repeated id would make two
// device threads update one entry at once). Per thread and reused, with a
// fresh epoch per row: no allocation or clearing of a vocabulary-sized
// array per step.
class RowIdStamps {
 public:
  static RowIdStamps& ForThread() {
    thread_local RowIdStamps stamps;
    return stamps;
  }
  // Forgets the ids of the previous row.
  void NewRow(int vocab) {
    if (stamp_.size() < static_cast<size_t>(vocab) || ++epoch_ == 0) {
      stamp_.assign(std::max<size_t>(stamp_.size(), vocab), 0);
      epoch_ = 1;
    }
  }
  // Marks `id` (in [0, vocab)); false if this row had it already.
  bool Mark(int id) {
    if (stamp_[id] == epoch_) return false;
    stamp_[id] = epoch_;
    return true;
  }

 private:
  std::vector<uint32_t> stamp_;
  uint32_t epoch_ = 0;
};

absl::Status ValidateRowSampling(const RowSampling& s, bool argmax_only,
                                 size_t rows, int vocab) {
  if (argmax_only) {
    return absl::InvalidArgumentError(
        "sampling and argmax_only are exclusive");
  }
  if (s.params.greedy()) {
    return absl::InvalidArgumentError(
        "sampling needs temperature > 0 (greedy rows use argmax_only)");
  }
  if (absl::Status st = ValidateSamplingParams(s.params); !st.ok()) {
    return st;
  }
  if (s.draft_ids.size() != rows || s.draft_q.size() != rows ||
      s.uniforms.size() != 2 * rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling has ", s.draft_ids.size(), " draft ids, ", s.draft_q.size(),
        " q and ", s.uniforms.size(), " uniforms for ", rows,
        " logit rows (want rows, rows, 2 * rows)"));
  }
  // A draft_q listing an id twice: two device threads would update one
  // residual entry at once.
  RowIdStamps& stamps = RowIdStamps::ForThread();
  for (size_t r = 0; r < rows; ++r) {
    const int x = s.draft_ids[r];
    if (x < -1 || x >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.draft_ids[", r, "] = ", x, " outside [-1, ", vocab, ")"));
    }
    if (x < 0) continue;
    if (s.draft_q[r] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.draft_q[", r, "] is null for a draft"));
    }
    stamps.NewRow(vocab);
    float own = 0.f;
    for (const auto& [id, prob] : *s.draft_q[r]) {
      if (id < 0 || id >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sampling.draft_q[", r, "] lists id ", id,
            " outside the vocabulary"));
      }
      if (!std::isfinite(prob) || prob < 0.f) {
        return absl::InvalidArgumentError(
            absl::StrCat("sampling.draft_q[", r, "] gives id ", id,
                         " probability ", prob, " (want finite, >= 0)"));
      }
      if (!stamps.Mark(id)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sampling.draft_q[", r, "] lists id ", id, " more than once"));
      }
      if (id == x) own = prob;
    }
    // The acceptance test divides by q(draft).
    if (!(own > 0.f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.draft_q[", r, "] gives the draft ", x, " no probability"));
    }
  }
  for (size_t i = 0; i < s.uniforms.size(); ++i) {
    if (!(s.uniforms[i] >= 0.0 && s.uniforms[i] < 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.uniforms[", i, "] = ", s.uniforms[i], " outside [0, 1)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLogitEdits(const ForwardInput& in, size_t rows,
                                int vocab) {
  if (!in.argmax_only && in.sampling == nullptr) {
    return absl::InvalidArgumentError(
        "logit_edits needs argmax_only or sampling (logits come back raw)");
  }
  if (in.logprobs_top_n >= 0) {
    return absl::InvalidArgumentError(
        "logit_edits with logprobs_top_n: logprobs are of the raw logits");
  }
  const LogitEdits& e = *in.logit_edits;
  if (e.offsets.size() != rows + 1 || e.offsets[0] != 0 ||
      e.offsets.back() != static_cast<int>(e.edits.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logit_edits has ", e.offsets.size(), " offsets (want ", rows + 1,
        ", from 0 to ", e.edits.size(), ")"));
  }
  for (size_t r = 0; r < rows; ++r) {
    if (e.offsets[r + 1] < e.offsets[r]) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_edits offsets decrease at row ", r));
    }
  }
  if (e.has_masks()) {
    const int words = (vocab + 31) / 32;
    if (e.mask_words != words || e.allowed.size() % words != 0 ||
        e.mask_of_row.size() > rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_edits masks: ", e.mask_of_row.size(), " rows of masks of ",
          e.mask_words, " words, ", e.allowed.size(), " words in all (want ",
          words, " words a mask, at most ", rows, " rows)"));
    }
    for (size_t r = 0; r < e.mask_of_row.size(); ++r) {
      if (e.mask_of_row[r] < -1 || e.mask_of_row[r] >= e.num_masks()) {
        return absl::InvalidArgumentError(
            absl::StrCat("logit_edits mask_of_row[", r, "] = ",
                         e.mask_of_row[r], " outside [-1, ", e.num_masks(),
                         ")"));
      }
    }
  }
  // A row listing an id twice: two device threads would edit one logit.
  RowIdStamps& stamps = RowIdStamps::ForThread();
  for (size_t r = 0; r < rows; ++r) {
    stamps.NewRow(vocab);
    for (int i = e.offsets[r]; i < e.offsets[r + 1]; ++i) {
      const LogitEdit& x = e.edits[i];
      if (x.id < 0 || x.id >= vocab || !stamps.Mark(x.id)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "logit_edits row ", r, ": id ", x.id,
            " repeated or outside [0, ", vocab, ")"));
      }
      const bool mask = x.subtract == std::numeric_limits<float>::infinity();
      if (!std::isfinite(x.bias) || !std::isfinite(x.scale) ||
          !(x.scale > 0.f) || !(std::isfinite(x.subtract) || mask)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "logit_edits row ", r, ", id ", x.id, ": bias ", x.bias,
            ", scale ", x.scale, ", subtract ", x.subtract,
            " (want finite, finite > 0, finite or +inf)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<int>> ValidateForwardInput(const ModelConfig& c,
                                                      const ForwardInput& in,
                                                      int cached) {
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
  if (in.logprobs_top_n < -1 || in.logprobs_top_n > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("logprobs_top_n must be in [-1, ", kMaxTopLogprobs,
                     "], got ", in.logprobs_top_n));
  }
  if (in.logprobs_top_n >= 0 && !in.argmax_only && in.sampling == nullptr) {
    return absl::InvalidArgumentError(
        "logprobs_top_n needs argmax_only or sampling (with logits, the "
        "caller has the rows)");
  }
  if (!in.logprob_ids.empty()) {
    if (!in.argmax_only || in.logprobs_top_n < 0) {
      return absl::InvalidArgumentError(
          "logprob_ids needs argmax_only and logprobs_top_n >= 0");
    }
    if (in.logprob_ids.size() != logit_rows.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logprob_ids has ", in.logprob_ids.size(), " entries for ",
          logit_rows.size(), " logit rows"));
    }
    for (size_t r = 0; r < in.logprob_ids.size(); ++r) {
      if (in.logprob_ids[r] < -1 || in.logprob_ids[r] >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "logprob_ids[", r, "] = ", in.logprob_ids[r], " outside [-1, ",
            c.vocab_size, ")"));
      }
    }
  }
  if (in.sampling != nullptr) {
    if (absl::Status s = ValidateRowSampling(*in.sampling, in.argmax_only,
                                             logit_rows.size(), c.vocab_size);
        !s.ok()) {
      return s;
    }
  }
  if (in.logit_edits != nullptr) {
    if (absl::Status s = ValidateLogitEdits(in, logit_rows.size(),
                                            c.vocab_size);
        !s.ok()) {
      return s;
    }
  }
  if (!in.tree_parents.empty() && cached >= 0) {
    const int span = static_cast<int>(in.tree_parents.size());
    if (span > kMaxTreeSpan) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tree_parents has ", span, " entries; at most ", kMaxTreeSpan));
    }
    if (span > cached + n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tree_parents has ", span, " entries; it may cover the ", n,
          " new rows and at most the ", cached, " cached before them"));
    }
    for (int j = 0; j < span; ++j) {
      if (in.tree_parents[j] < -1 || in.tree_parents[j] >= j) {
        return absl::InvalidArgumentError(
            absl::StrCat("tree_parents[", j, "] = ", in.tree_parents[j],
                         " must be in [-1, ", j, ")"));
      }
    }
  }
  return logit_rows;
}

TreeMask TreeAttentionMask(absl::Span<const int> tree_parents, int first,
                           int n) {
  TreeMask mask;
  if (tree_parents.empty()) return mask;  // causal: the common case
  std::vector<int> starts(n);
  std::vector<uint64_t> bits(n);
  if (!TreeSpanBits(tree_parents, first, n, starts.data(), bits.data())) {
    return mask;
  }
  mask.offsets.assign(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    if (starts[i] != std::numeric_limits<int>::max()) {
      for (int key = starts[i]; key < first + i; ++key) {
        if (((bits[i] >> (key - starts[i])) & 1) == 0) {
          mask.masked_keys.push_back(key);
        }
      }
    }
    mask.offsets[i + 1] = static_cast<int>(mask.masked_keys.size());
  }
  if (mask.masked_keys.empty()) mask.offsets.clear();
  return mask;
}

bool TreeSpanBits(absl::Span<const int> tree_parents, int first, int n,
                  int* starts, uint64_t* bits) {
  const int span = static_cast<int>(tree_parents.size());
  bool chain = true;
  for (int j = 0; j < span && chain; ++j) chain = tree_parents[j] == j - 1;
  if (chain) return false;
  const int start = first + n - span;
  for (int i = 0; i < n; ++i) {
    const int self = span - n + i;
    if (self < 0) {
      starts[i] = std::numeric_limits<int>::max();
      bits[i] = ~uint64_t{0};
      continue;
    }
    uint64_t b = 0;
    for (int a = self; a >= 0; a = tree_parents[a]) b |= uint64_t{1} << a;
    starts[i] = start;
    bits[i] = b;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<KvSequence>> ModelRunner::NewSequence(
    int max_tokens) {
  const int max_ctx = config().max_position_embeddings;
  if (max_tokens < 1 || max_tokens > max_ctx) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache capacity ", max_tokens, " outside [1, ", max_ctx, "]"));
  }
  return kv_cache().NewSequence(max_tokens);
}

absl::Status ModelRunner::Forward(const ForwardInput& in, KvSequence* kv,
                                  ForwardOutput* out) {
  SequenceForward entry;
  entry.kv = kv;
  entry.input = in;
  std::vector<ForwardOutput> outs;
  absl::Status s = Forward(absl::MakeConstSpan(&entry, 1), &outs);
  if (s.ok()) *out = std::move(outs[0]);
  return s;
}

void ReduceToArgmax(absl::Span<const SequenceForward> batch, int vocab,
                    std::vector<ForwardOutput>* out) {
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!batch[i].input.argmax_only) continue;
    ForwardOutput& o = (*out)[i];
    const size_t rows = o.logits.size() / vocab;
    o.argmax.resize(rows);
    const int top_n = batch[i].input.logprobs_top_n;
    const LogitEdits* edits = batch[i].input.logit_edits;
    for (size_t r = 0; r < rows; ++r) {
      if (edits != nullptr) {
        ApplyLogitEdits(*edits, static_cast<int>(r),
                        absl::MakeSpan(o.logits.data() + r * vocab, vocab));
      }
      const auto row = absl::MakeConstSpan(o.logits.data() + r * vocab, vocab);
      o.argmax[r] = Argmax(row);
      if (top_n >= 0) {
        const std::vector<int>& forced = batch[i].input.logprob_ids;
        const int id = forced.empty() || forced[r] < 0 ? o.argmax[r]
                                                       : forced[r];
        o.token_logprobs.push_back(ComputeTokenLogprobs(row, id, top_n));
      }
    }
    o.logits.clear();
  }
}

void SampleOnHost(absl::Span<const SequenceForward> batch, int vocab,
                  std::vector<ForwardOutput>* out) {
  static const SparseDist kNoDraft;
  for (size_t i = 0; i < batch.size(); ++i) {
    const RowSampling* s = batch[i].input.sampling;
    if (s == nullptr) continue;
    ForwardOutput& o = (*out)[i];
    const size_t rows = o.logits.size() / vocab;
    o.sampled.assign(rows, -1);
    o.accepted.assign(rows, 0);
    // Rows in order up to the first one not accepted: verification reads
    // no further, and each row costs a ComputeDistribution.
    const int top_n = batch[i].input.logprobs_top_n;
    const LogitEdits* edits = batch[i].input.logit_edits;
    for (size_t r = 0; r < rows; ++r) {
      if (edits != nullptr) {
        ApplyLogitEdits(*edits, static_cast<int>(r),
                        absl::MakeSpan(o.logits.data() + r * vocab, vocab));
      }
      const auto logits =
          absl::MakeConstSpan(o.logits.data() + r * vocab, vocab);
      const RowSample row = SampleRow(
          logits, s->params, s->draft_ids[r],
          s->draft_q[r] != nullptr ? *s->draft_q[r] : kNoDraft,
          s->uniforms[2 * r], s->uniforms[2 * r + 1]);
      o.sampled[r] = row.token;
      o.accepted[r] = row.accepted ? 1 : 0;
      if (top_n >= 0) {
        o.token_logprobs.push_back(ComputeTokenLogprobs(
            logits, row.accepted ? s->draft_ids[r] : row.token, top_n));
      }
      if (!row.accepted) break;
    }
    o.logits.clear();
  }
}

absl::StatusOr<std::vector<std::vector<int>>> ValidateBatch(
    const ModelConfig& config, const PagedKvCache& cache,
    absl::Span<const SequenceForward> batch) {
  if (batch.empty()) return absl::InvalidArgumentError("the batch is empty");
  std::vector<std::vector<int>> rows(batch.size());
  absl::flat_hash_set<const KvSequence*> seen;
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceForward& e = batch[i];
    if (e.kv == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch[", i, "]: no KV sequence"));
    }
    if (e.kv->cache() != &cache) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch[", i, "]: the KV sequence belongs to another model's cache"));
    }
    if (!seen.insert(e.kv).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch[", i, "]: a sequence appears twice"));
    }
    absl::StatusOr<std::vector<int>> r =
        ValidateForwardInput(config, e.input, e.kv->size());
    if (!r.ok()) {
      // One sequence alone keeps the plain message callers already match.
      if (batch.size() == 1) return r.status();
      return absl::Status(r.status().code(),
                          absl::StrCat("batch[", i, "]: ", r.status().message()));
    }
    rows[i] = *std::move(r);
  }
  return rows;
}

absl::Status ValidateScoringInput(const QueryCapture* capture,
                                  const KvSequence& kv, int prompt_len) {
  if (capture == nullptr) {
    return absl::InvalidArgumentError(
        "the query capture belongs to another backend");
  }
  if (capture->rows() < 1) {
    return absl::InvalidArgumentError("the query capture is empty");
  }
  if (prompt_len < 1 || prompt_len > kv.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_len ", prompt_len, " outside [1, ", kv.size(), "]"));
  }
  return absl::OkStatus();
}

absl::Status ReserveBatch(absl::Span<const SequenceForward> batch,
                          std::vector<int>* first) {
  first->assign(batch.size(), 0);
  for (size_t i = 0; i < batch.size(); ++i) {
    const ForwardInput& in = batch[i].input;
    const int n = static_cast<int>(in.token_ids.size());
    absl::StatusOr<int> f = batch[i].kv->Reserve(n);
    if (!f.ok()) {
      UnreserveBatch(batch.subspan(0, i), *first);
      return f.status();
    }
    (*first)[i] = *f;
    batch[i].kv->SetPositions(*f, in.position_ids.data(), n);
  }
  return absl::OkStatus();
}

void UnreserveBatch(absl::Span<const SequenceForward> batch,
                    const std::vector<int>& first) {
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].kv->Truncate(first[i]).IgnoreError();
  }
}

}  // namespace specserve
