#include "common/speculation/draft_session.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/decoding/logits_processors.h"
#include "common/engine/kernels.h"
#include "common/util/clock.h"

namespace specserve {
namespace {

absl::Status CheckIds(absl::Span<const int> ids, int vocab,
                      std::string_view field) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(absl::string_view(field.data(), field.size()), "[", i, "] = ", ids[i],
                       " outside the vocabulary [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

DraftSession::DraftSession(ModelRunner* model,
                           std::unique_ptr<KvSequence> cache,
                           const SamplingParams& sampling)
    : model_(model),
      cache_(std::move(cache)),
      sampling_(sampling),
      rng_(sampling.seed) {
}

DraftSession::~DraftSession() {
  // Before any member goes: waits for a preemption in progress.
  StopPreemption();
}

int DraftSession::AttachCachedPrefix(absl::Span<const int> tokens) {
  std::vector<int> pos(tokens.size());
  std::iota(pos.begin(), pos.end(), 0);
  const int n = cache_->AttachCachedPrefix(tokens, pos,
                                           static_cast<int>(tokens.size()) - 1);
  cached_.assign(tokens.begin(), tokens.begin() + n);
  return n;
}

void DraftSession::Preempt() {
  cache_->Clear();
  cached_.clear();
  op_start_ = 0;
  ++num_preemptions_;
  if (op_ == Op::kNone || finished_op_) return;  // the next Draft re-feeds
  // Restart the operation in progress on the empty cache.
  next_token_ = -1;
  if (op_ == Op::kScore) {
    capture_->Clear();
    score_.look_ahead_tokens.clear();
    fed_ = AttachCachedPrefix(feed_);
  } else {
    feed_ = committed_;
    fed_ = AttachCachedPrefix(feed_);
    drafts_.clear();
    nodes_.clear();
    level_.clear();
    span_parents_.clear();
    planned_level_ = false;
  }
}

absl::StatusOr<std::unique_ptr<DraftSession>> DraftSession::Create(
    ModelRunner* model, int capacity, const SamplingParams& sampling,
    const JsonTokenMask* json_mask) {
  if (auto s = ValidateSamplingParams(sampling); !s.ok()) return s;
  auto cache = model->NewSequence(capacity);
  if (!cache.ok()) return cache.status();
  std::unique_ptr<DraftSession> session(
      new DraftSession(model, *std::move(cache), sampling));
  const bool choice =
      sampling.json_schema != nullptr && sampling.json_schema->raw_choice();
  if (sampling.json_object && json_mask != nullptr &&
      (choice || json_mask->can_open())) {
    session->json_mask_ = json_mask;
    session->json_.emplace(sampling.json_schema.get());
  }
  return session;
}

std::vector<int> DraftSession::DraftIds() const {
  std::vector<int> ids;
  if (penalties_ || json_) {
    for (const DraftToken& t : drafts_) ids.push_back(t.id);
  }
  return ids;
}

std::vector<int> DraftSession::JsonDisallowed(
    absl::Span<const int> pending) const {
  std::vector<int> out;
  if (json_) {
    json_mask_->DisallowedAfter(*json_, pending, model_->config().vocab_size,
                                &out);
  }
  return out;
}

namespace {

// The last logit row's argmax: ForwardOutput::argmax when the forward was
// argmax_only, else from the logits.
int LastArgmax(const ForwardOutput& out, int vocab) {
  if (!out.argmax.empty()) return out.argmax.back();
  return Argmax(absl::MakeConstSpan(
      out.logits.data() + out.logits.size() - vocab, vocab));
}

}  // namespace

const float* DraftSession::Adjusted(const float* logits,
                                   absl::Span<const int> pending) {
  if (!Adjusts()) return logits;
  const int vocab = model_->config().vocab_size;
  adjusted_.assign(logits, logits + vocab);
  const absl::Span<float> row = absl::MakeSpan(adjusted_);
  ApplyLogitBias(sampling_, row);
  if (penalties_) penalties_->Apply(sampling_, pending, row);
  for (const int id : JsonDisallowed(pending)) {
    if (id < vocab) row[id] = -std::numeric_limits<float>::infinity();
  }
  return adjusted_.data();
}

DraftToken DraftSession::Propose(const ForwardOutput& out) {
  const int vocab = model_->config().vocab_size;
  DraftToken d;
  if (sampling_.greedy() && (!Adjusts() || !out.argmax.empty())) {
    d.id = LastArgmax(out, vocab);  // edited by the backend, if adjusted
  } else if (sampling_.greedy()) {
    d.id = Argmax(absl::MakeConstSpan(
        Adjusted(out.logits.data() + out.logits.size() - vocab, DraftIds()),
        vocab));
  } else {
    d.q = ComputeDistribution(
        absl::MakeConstSpan(Adjusted(out.logits.data(), DraftIds()), vocab),
        sampling_);
    d.id = SampleFrom(d.q, &rng_);
  }
  return d;
}

absl::StatusOr<ScoreResult> DraftSession::Score(absl::Span<const int> prompt,
                                                const ScoreOptions& options) {
  if (absl::Status s = BeginScore(prompt, options); !s.ok()) return s;
  if (absl::Status s = RunOp(); !s.ok()) return s;
  return TakeScoreResult();
}

absl::StatusOr<std::vector<DraftToken>> DraftSession::Draft(
    absl::Span<const int> emitted, int k) {
  if (absl::Status s = BeginDraft(emitted, k); !s.ok()) return s;
  if (absl::Status s = RunOp(); !s.ok()) return s;
  return TakeDrafts();
}

absl::Status DraftSession::RunOp() {
  while (pending_rows() > 0) {
    SequenceForward entry;
    if (absl::Status s = PlanForward(pending_rows(), &entry); !s.ok()) {
      Abort();
      return s;
    }
    // The span form keeps entry.capture (a Score's query rows).
    std::vector<ForwardOutput> outs;
    if (absl::Status s =
            model_->Forward(absl::MakeConstSpan(&entry, 1), &outs);
        !s.ok()) {
      Abort();
      return s;
    }
    if (absl::Status s = CompleteForward(outs[0]); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status DraftSession::BeginScore(absl::Span<const int> prompt,
                                      const ScoreOptions& options) {
  const ModelConfig& c = model_->config();
  if (op_ != Op::kNone) {
    return absl::FailedPreconditionError("an operation is in progress");
  }
  if (started_) {
    return absl::FailedPreconditionError("session already has a prompt");
  }
  if (prompt.empty()) return absl::InvalidArgumentError("token_ids is empty");
  if (auto s = CheckIds(prompt, c.vocab_size, "token_ids"); !s.ok()) return s;
  if (auto s = ValidateScoreOptions(options, c.num_hidden_layers); !s.ok()) {
    return s;
  }
  const int n = static_cast<int>(prompt.size());
  if (n + options.look_ahead > cache_->max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", n, " tokens + look_ahead ", options.look_ahead,
        " exceeds the speculator's context of ", cache_->max_tokens(),
        " tokens"));
  }
  // The scoring rows' queries stay where the model runs (host or device).
  auto capture = model_->NewQueryCapture(1 + options.look_ahead);
  if (!capture.ok()) return capture.status();
  capture_ = *std::move(capture);
  score_ = ScoreResult();
  score_options_ = options;
  op_ = Op::kScore;
  op_start_ = cache_->size();
  feed_.assign(prompt.begin(), prompt.end());
  // Prefix caching: whole blocks of the prompt another request computed
  // need no forward (the last prompt row always runs: it is scored).
  fed_ = AttachCachedPrefix(prompt);
  cached_prompt_tokens_ = fed_;
  wanted_ = options.look_ahead;
  next_token_ = -1;
  finished_op_ = false;
  t_begin_ = MonotonicNowNs();
  return absl::OkStatus();
}

absl::Status ValidateDraftTreeShape(const DraftTreeShape& shape) {
  const int depth = static_cast<int>(shape.branching.size());
  if (depth < 1 || depth > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tree.branching must list 1 to 16 depths, got ", depth));
  }
  for (int d = 0; d < depth; ++d) {
    if (shape.branching[d] < 1 || shape.branching[d] > 8) {
      return absl::InvalidArgumentError(
          absl::StrCat("tree.branching[", d, "] must be in [1, 8], got ",
                       shape.branching[d]));
    }
  }
  if (shape.max_nodes < 1 || shape.max_nodes > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tree.max_nodes must be in [1, 64], got ", shape.max_nodes));
  }
  if (!(shape.min_path_prob >= 0.0 && shape.min_path_prob < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tree.min_path_prob must be in [0, 1), got ", shape.min_path_prob));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> DraftSession::PrepareDraft(absl::Span<const int> emitted) {
  const ModelConfig& c = model_->config();
  if (auto s = CheckIds(emitted, c.vocab_size, "emitted_token_ids"); !s.ok()) {
    return s;
  }
  committed_.insert(committed_.end(), emitted.begin(), emitted.end());
  if (penalties_) penalties_->AddOutput(emitted);
  if (json_) json_mask_->Advance(&*json_, emitted);

  // Keep the longest cached prefix that agrees with what the target
  // emitted (rejected drafts roll back; a tree's nodes are cached as -1 and
  // never agree), but re-feed at least the last committed token so its
  // logits are at hand.
  size_t keep = 0;
  while (keep < cached_.size() && keep < committed_.size() &&
         cached_[keep] == committed_[keep]) {
    ++keep;
  }
  keep = std::min(keep, committed_.size() - 1);
  if (auto s = cache_->Truncate(static_cast<int>(keep)); !s.ok()) return s;
  cached_.resize(keep);
  // After a preemption: the prompt's full blocks may still be cached.
  if (keep == 0) keep = AttachCachedPrefix(committed_);

  op_start_ = cache_->size();
  drafts_.clear();
  draft_parents_.clear();
  fed_ = 0;
  next_token_ = -1;
  finished_op_ = false;
  const int pending = static_cast<int>(committed_.size() - keep);
  const int room = cache_->max_tokens() - static_cast<int>(keep);
  if (pending > room) {  // context full: the target goes alone
    feed_.clear();
    wanted_ = 0;
    finished_op_ = true;
    return -1;
  }
  feed_.assign(committed_.begin() + keep, committed_.end());
  return room - pending;
}

absl::Status DraftSession::BeginDraft(absl::Span<const int> emitted, int k) {
  if (op_ != Op::kNone) {
    return absl::FailedPreconditionError("an operation is in progress");
  }
  if (!started_) {
    return absl::FailedPreconditionError("session has no prompt yet");
  }
  if (k < 1 || k > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_draft_tokens must be in [1, 64], got ", k));
  }
  absl::StatusOr<int> free = PrepareDraft(emitted);
  if (!free.ok()) return free.status();
  op_ = Op::kDraft;
  if (*free >= 0) wanted_ = std::min(k, *free + 1);
  return absl::OkStatus();
}

absl::Status DraftSession::BeginDraftTree(absl::Span<const int> emitted,
                                          const DraftTreeShape& shape) {
  if (op_ != Op::kNone) {
    return absl::FailedPreconditionError("an operation is in progress");
  }
  if (!started_) {
    return absl::FailedPreconditionError("session has no prompt yet");
  }
  if (absl::Status s = ValidateDraftTreeShape(shape); !s.ok()) return s;
  absl::StatusOr<int> free = PrepareDraft(emitted);
  if (!free.ok()) return free.status();
  op_ = Op::kDraftTree;
  tree_shape_ = shape;
  nodes_.clear();
  level_.clear();
  span_parents_.clear();
  // Nodes at depth d sit at position committed + d; only expanded nodes
  // enter the KV cache, at most `free` of them.
  tree_room_ = std::max(*free, 0);
  tree_depth_limit_ =
      std::min(static_cast<int>(shape.branching.size()), tree_room_ + 1);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<DraftToken>> DraftSession::DraftTree(
    absl::Span<const int> emitted, const DraftTreeShape& shape,
    std::vector<int>* parents) {
  if (absl::Status s = BeginDraftTree(emitted, shape); !s.ok()) return s;
  if (absl::Status s = RunOp(); !s.ok()) return s;
  return TakeDrafts(parents);
}

void DraftSession::ExpandTreeNode(int parent, const float* logits) {
  const int vocab = model_->config().vocab_size;
  const int depth = parent < 0 ? 0 : nodes_[parent].depth + 1;
  if (depth >= tree_depth_limit_) return;
  // Greedy trees are cut to max_nodes at the end (EmitTree); sampled ones
  // stop growing at the budget (their children must not be selected by
  // value).
  const int budget = sampling_.greedy()
                         ? tree_shape_.branching[depth]
                         : tree_shape_.max_nodes -
                               static_cast<int>(nodes_.size());
  const int count = std::min(tree_shape_.branching[depth], budget);
  if (count <= 0) return;
  const double base = parent < 0 ? 1.0 : nodes_[parent].path_prob;
  // Only confident enough nodes grow (decided by the parent's path alone,
  // so a sampled node's children stay i.i.d. draws from q).
  const double min_prob = tree_shape_.min_path_prob;
  if (base < min_prob) return;
  // The node's row follows its path from the root (penalties count it).
  std::vector<int> path;
  if (penalties_ || json_) {
    for (int n = parent; n >= 0; n = nodes_[n].parent) {
      path.push_back(nodes_[n].token.id);
    }
    std::reverse(path.begin(), path.end());
  }
  const absl::Span<const float> row =
      absl::MakeConstSpan(Adjusted(logits, path), vocab);
  if (sampling_.greedy()) {
    // The top `count` tokens (lowest id first on ties, as Argmax); their
    // probabilities (softmax at temperature 1, vectorised) rank the paths.
    thread_local std::vector<float> probs;
    probs.assign(row.begin(), row.end());
    kernels::SoftmaxPrefix(probs.data(), vocab, vocab);
    thread_local std::vector<int> best;
    best.clear();
    for (int v = 0; v < vocab; ++v) {
      if (static_cast<int>(best.size()) == count &&
          probs[v] <= probs[best.back()]) {
        continue;
      }
      auto at = std::upper_bound(
          best.begin(), best.end(), v,
          [&](int a, int b) { return probs[a] > probs[b]; });
      best.insert(at, v);
      if (static_cast<int>(best.size()) > count) best.pop_back();
    }
    for (int id : best) {
      // best is sorted. The root's likeliest child stays whatever its
      // probability: a round without drafts would still pay the
      // speculator's round trip for one token.
      if (base * probs[id] < min_prob && !(parent < 0 && id == best[0])) {
        break;
      }
      TreeNode n;
      n.token.id = id;
      n.parent = parent;
      n.depth = depth;
      n.path_prob = base * probs[id];
      nodes_.push_back(std::move(n));
    }
    return;
  }
  // Sampled: i.i.d. draws from q, duplicates kept (lossless tree
  // verification needs independent siblings).
  const SparseDist q = ComputeDistribution(row, sampling_);
  for (int i = 0; i < count; ++i) {
    TreeNode n;
    n.token.id = SampleFrom(q, &rng_);
    n.token.q = q;
    n.parent = parent;
    n.depth = depth;
    n.path_prob = base * ProbabilityOf(q, n.token.id);
    nodes_.push_back(std::move(n));
  }
}

void DraftSession::NextTreeLevel(int first_new) {
  level_.clear();
  // The frontier is what the last expansion added (all of one depth); a
  // depth that added nothing (every child below min_path_prob) ends the
  // tree.
  if (first_new >= static_cast<int>(nodes_.size())) return;
  const int depth = nodes_[first_new].depth;
  const int budget = tree_shape_.max_nodes - static_cast<int>(nodes_.size());
  if (depth + 1 >= tree_depth_limit_) return;
  if (!sampling_.greedy() && budget <= 0) return;
  std::vector<int> frontier(nodes_.size() - first_new);
  std::iota(frontier.begin(), frontier.end(), first_new);
  std::stable_sort(frontier.begin(), frontier.end(), [&](int a, int b) {
    return nodes_[a].path_prob > nodes_[b].path_prob;
  });
  const int per_node = tree_shape_.branching[depth + 1];
  // Greedy (EAGLE-2, Li et al. 2024): the branching[d] likeliest paths of
  // each depth grow, and the best max_nodes nodes are kept at the end.
  // Sampled: as many as the remaining budget takes.
  int want = sampling_.greedy() ? per_node
                                : (budget + per_node - 1) / per_node;
  want = std::min(want, std::min(tree_room_, kMaxTreeSpan) -
                            static_cast<int>(span_parents_.size()));
  want = std::min(want, static_cast<int>(frontier.size()));
  if (want <= 0) return;
  level_.assign(frontier.begin(), frontier.begin() + want);
}

void DraftSession::EmitTree() {
  // Greedy: keep the max_nodes nodes of highest path probability. A
  // child's is at most its parent's, and ties keep creation order
  // (parents first), so the kept nodes form a tree.
  std::vector<bool> kept(nodes_.size(), true);
  if (sampling_.greedy() &&
      static_cast<int>(nodes_.size()) > tree_shape_.max_nodes) {
    std::vector<int> order(nodes_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return nodes_[a].path_prob > nodes_[b].path_prob;
    });
    kept.assign(nodes_.size(), false);
    for (int i = 0; i < tree_shape_.max_nodes; ++i) kept[order[i]] = true;
  }
  std::vector<std::vector<int>> children(nodes_.size() + 1);
  for (int i = 0; i < static_cast<int>(nodes_.size()); ++i) {
    if (kept[i] && (nodes_[i].parent < 0 || kept[nodes_[i].parent])) {
      children[nodes_[i].parent + 1].push_back(i);
    }
  }
  // Depth-first preorder, children in creation order.
  std::vector<std::pair<int, int>> stack;  // (node, its new parent index)
  for (auto it = children[0].rbegin(); it != children[0].rend(); ++it) {
    stack.emplace_back(*it, -1);
  }
  while (!stack.empty()) {
    const auto [node, parent] = stack.back();
    stack.pop_back();
    const int index = static_cast<int>(drafts_.size());
    drafts_.push_back(std::move(nodes_[node].token));
    draft_parents_.push_back(parent);
    const std::vector<int>& kids = children[node + 1];
    for (auto it = kids.rbegin(); it != kids.rend(); ++it) {
      stack.emplace_back(*it, index);
    }
  }
  nodes_.clear();
}

int DraftSession::pending_rows() const {
  if (op_ == Op::kNone || finished_op_) return 0;
  if (fed_ < static_cast<int>(feed_.size())) {
    return static_cast<int>(feed_.size()) - fed_;
  }
  if (op_ == Op::kDraftTree) return static_cast<int>(level_.size());
  return next_token_ >= 0 ? 1 : 0;
}

int DraftSession::min_forward_rows() const {
  if (op_ == Op::kDraftTree && !finished_op_ &&
      fed_ >= static_cast<int>(feed_.size())) {
    return std::max(1, static_cast<int>(level_.size()));
  }
  return 1;
}

bool DraftSession::prefilling() const {
  // A Score's prompt, or a Draft that must first feed more than a verify
  // round's worth of tokens (a prompt never scored).
  const int left = static_cast<int>(feed_.size()) - fed_;
  if (op_ == Op::kScore) return left > 0;
  return (op_ == Op::kDraft || op_ == Op::kDraftTree) && left > 65;
}

absl::Status DraftSession::PlanForward(int max_rows, SequenceForward* entry) {
  if (pending_rows() == 0) {
    return absl::FailedPreconditionError("no forward pending");
  }
  if (max_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_rows must be >= 1, got ", max_rows));
  }
  const int first = static_cast<int>(cached_.size());
  const int left = static_cast<int>(feed_.size()) - fed_;
  entry->input.tree_parents.clear();
  planned_level_ = false;
  if (left == 0 && op_ == Op::kDraftTree) {
    // One depth of the tree: its nodes after the committed tokens and the
    // nodes forwarded before, each seeing its ancestors only.
    if (max_rows < static_cast<int>(level_.size())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a tree depth needs ", level_.size(), " rows, the budget is ",
          max_rows));
    }
    const int base = static_cast<int>(committed_.size());
    plan_tokens_.clear();
    plan_positions_.clear();
    entry->input.tree_parents = span_parents_;
    entry->input.logit_rows.clear();
    for (size_t r = 0; r < level_.size(); ++r) {
      const TreeNode& n = nodes_[level_[r]];
      plan_tokens_.push_back(n.token.id);
      plan_positions_.push_back(base + n.depth);
      entry->input.tree_parents.push_back(
          n.parent < 0 ? -1 : nodes_[n.parent].span_index);
      entry->input.logit_rows.push_back(static_cast<int>(r));
    }
    planned_level_ = true;
    entry->kv = cache_.get();
    entry->input.token_ids = plan_tokens_;
    entry->input.position_ids = plan_positions_;
    entry->input.capture_query_rows.clear();
    entry->input.argmax_only = false;  // the children need probabilities
    entry->input.logit_edits = nullptr;
    entry->capture = nullptr;
    return absl::OkStatus();
  }
  if (left > 0) {
    const int take = std::min(left, max_rows);
    plan_tokens_.assign(feed_.begin() + fed_, feed_.begin() + fed_ + take);
  } else {
    plan_tokens_ = {next_token_};
  }
  const int n = static_cast<int>(plan_tokens_.size());
  plan_positions_.resize(n);
  std::iota(plan_positions_.begin(), plan_positions_.end(), first);
  entry->kv = cache_.get();
  entry->input.token_ids = plan_tokens_;
  entry->input.position_ids = plan_positions_;
  entry->input.logit_rows.clear();  // the last row
  entry->input.capture_query_rows.clear();
  // The look-ahead is greedy, and so is a greedy chain's next draft: the
  // argmax is all they read (a logit bias or penalties travel with the
  // forward as edits of its row; Propose's pending drafts). A tree's root
  // needs probabilities.
  entry->input.argmax_only =
      op_ == Op::kScore || (op_ == Op::kDraft && sampling_.greedy());
  entry->input.logit_edits = nullptr;
  if (op_ == Op::kDraft && sampling_.greedy() && Adjusts()) {
    const std::vector<int> pending = DraftIds();
    draft_edits_.Clear();
    const int vocab = model_->config().vocab_size;
    AppendRowEdits(sampling_, penalties_ ? &*penalties_ : nullptr, pending,
                   {}, vocab, &draft_edits_);
    // JSON mode's mask as a bitmask (most of the vocabulary, outside
    // strings).
    if (json_) MaskLastRow(JsonDisallowed(pending), vocab, &draft_edits_);
    entry->input.logit_edits = &draft_edits_;
  }
  entry->capture = nullptr;
  // Speculative Prefill scores the last prompt row and every look-ahead
  // row: capture them.
  const bool last_of_feed = left > 0 && n == left;
  if (op_ == Op::kScore && (last_of_feed || left == 0)) {
    entry->input.capture_query_rows = {n - 1};
    entry->capture = capture_.get();
  }
  return absl::OkStatus();
}

void DraftSession::CommitPlanned() {
  if (planned_level_) {
    // Tree nodes: cached as -1 so the next Draft drops them.
    for (int node : level_) {
      const TreeNode& n = nodes_[node];
      nodes_[node].span_index = static_cast<int>(span_parents_.size());
      span_parents_.push_back(n.parent < 0 ? -1 : nodes_[n.parent].span_index);
      cached_.push_back(-1);
    }
    return;
  }
  cached_.insert(cached_.end(), plan_tokens_.begin(), plan_tokens_.end());
  if (fed_ < static_cast<int>(feed_.size())) {
    fed_ += static_cast<int>(plan_tokens_.size());
  }
}

absl::Status DraftSession::CompleteForward(const ForwardOutput& out) {
  const ModelConfig& c = model_->config();
  if (pending_rows() == 0) {
    return absl::FailedPreconditionError("no forward pending");
  }
  CommitPlanned();
  if (fed_ < static_cast<int>(feed_.size())) return absl::OkStatus();
  const float* logits = out.logits.data();
  if (op_ == Op::kScore) {
    if (next_token_ < 0) {  // the prompt is in: list its full blocks
      t_prefilled_ = MonotonicNowNs();
      std::vector<int> pos(feed_.size());
      std::iota(pos.begin(), pos.end(), 0);
      cache_->CachePrefix(feed_, pos);
    }
    // Greedy look-ahead, stopping at EOS or after `wanted_` tokens.
    const int have = static_cast<int>(score_.look_ahead_tokens.size());
    if (have < wanted_) {
      const int tok = LastArgmax(out, c.vocab_size);
      const std::vector<int>& eos = c.eos_token_ids;
      if (std::find(eos.begin(), eos.end(), tok) == eos.end()) {
        score_.look_ahead_tokens.push_back(tok);
        next_token_ = tok;
        return absl::OkStatus();
      }
    }
    next_token_ = -1;
    return FinishScore();
  }
  if (op_ == Op::kDraftTree) {
    const int first_new = static_cast<int>(nodes_.size());
    if (planned_level_) {
      const int vocab = c.vocab_size;
      for (size_t r = 0; r < level_.size(); ++r) {
        ExpandTreeNode(level_[r], out.logits_row(static_cast<int>(r), vocab));
      }
    } else {
      ExpandTreeNode(-1, logits);  // the last committed token's logits
    }
    planned_level_ = false;
    NextTreeLevel(first_new);
    if (level_.empty()) {
      EmitTree();
      finished_op_ = true;
    }
    return absl::OkStatus();
  }
  drafts_.push_back(Propose(out));
  if (static_cast<int>(drafts_.size()) >= wanted_) {
    next_token_ = -1;
    finished_op_ = true;
  } else {
    next_token_ = drafts_.back().id;
  }
  return absl::OkStatus();
}

absl::Status DraftSession::FinishScore() {
  const int64_t t2 = MonotonicNowNs();
  score_.prefill_ns = t_prefilled_ - t_begin_;
  score_.look_ahead_ns = t2 - t_prefilled_;
  const int n = static_cast<int>(feed_.size());
  finished_op_ = true;
  // Score against the prompt keys only, one layer at a time.
  auto importance = model_->ScoreImportance(*cache_, n, *capture_,
                                            score_options_.scoring,
                                            score_options_.num_threads);
  capture_.reset();
  if (!importance.ok()) {
    op_ = Op::kNone;
    return importance.status();
  }
  score_.importance = std::move(importance->importance);
  score_.per_row_importance = std::move(importance->per_row_importance);
  auto sel = SelectTokens(score_.importance, score_options_.selection);
  if (!sel.ok()) {
    op_ = Op::kNone;
    return sel.status();
  }
  score_.selection = *std::move(sel);
  score_.score_ns = MonotonicNowNs() - t2;
  committed_ = feed_;
  // The prompt is what the repetition penalty reads besides the output.
  if (sampling_.has_penalties()) penalties_.emplace(committed_);
  started_ = true;
  return absl::OkStatus();
}

void DraftSession::Abort() {
  if (op_ == Op::kNone) return;
  planned_level_ = false;
  cache_->Truncate(op_start_).IgnoreError();
  cached_.resize(op_start_);
  capture_.reset();
  op_ = Op::kNone;
}

absl::StatusOr<ScoreResult> DraftSession::TakeScoreResult() {
  if (op_ != Op::kScore || !finished_op_) {
    return absl::FailedPreconditionError("no finished Score");
  }
  op_ = Op::kNone;
  return std::move(score_);
}

std::vector<DraftToken> DraftSession::TakeDrafts(std::vector<int>* parents) {
  if (parents != nullptr) parents->clear();
  if ((op_ != Op::kDraft && op_ != Op::kDraftTree) || !finished_op_) {
    return {};
  }
  op_ = Op::kNone;
  if (parents != nullptr) *parents = std::move(draft_parents_);
  draft_parents_.clear();
  return std::move(drafts_);
}

}  // namespace specserve
