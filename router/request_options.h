#ifndef SPECSERVE_ROUTER_REQUEST_OPTIONS_H_
#define SPECSERVE_ROUTER_REQUEST_OPTIONS_H_

// A router request's options, resolved once at the edge: the router's
// --default_* flags fill the unset fields of GenerateTextRequest
// (protos/router.proto), everything is validated (INVALID_ARGUMENT naming
// the field), and the prompt becomes token ids checked against the
// target's vocabulary and context. The gRPC and HTTP APIs both come
// through here (the HTTP API maps OpenAI JSON to GenerateTextRequest
// first, router/openai_api.h).

#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/decoding/ngram_proposer.h"
#include "common/service/wire_options.h"
#include "protos/router.pb.h"
#include "protos/speculator.pb.h"

namespace specserve {

class Tokenizer;

/// How a request's drafts are proposed (protos/router.proto,
/// SpeculativeDecodingConfig.method; vLLM's speculative_config.method):
/// the speculator model's chain ("draft"), prompt lookup in the router
/// ("ngram", common/decoding/ngram_proposer.h), or the speculator's token
/// tree verified with tree attention ("draft_tree", SpecInfer).
enum class SpecDecodeMethod { kDraft, kNgram, kDraftTree };

/// The wire name: "draft", "ngram" or "draft_tree".
absl::string_view SpecDecodeMethodName(SpecDecodeMethod method);

/// The method named `name`; INVALID_ARGUMENT naming `field` and listing the
/// known names otherwise.
absl::StatusOr<SpecDecodeMethod> ParseSpecDecodeMethod(absl::string_view name,
                                                       absl::string_view field);

/// The default draft tree shape: children per node at each depth (the
/// roots' first), and the node budget. Measured on the bundled pairs
/// (bench/draft_tree_bench, bench/results/draft_methods.md): 16 nodes over
/// 6 depths accept 1.33-1.46x the tokens of a chain of 4 per target
/// forward, with the fewest speculator rows of the shapes tried.
inline constexpr int kDefaultTreeBranching[] = {3, 2, 2, 2, 2, 2};
inline constexpr int kDefaultTreeMaxNodes = 16;
/// The default confidence threshold of tree nodes with one request in
/// flight (DraftTreeShape.min_path_prob; TreeMinPathProbUnderLoad scales
/// it with the load: 0.32 at 16 requests). Measured through the router on
/// the bundled pair (bench/results/draft_methods.md): at one client the
/// tree keeps most of its full size (12.6 drafts a round, 4.13 tokens per
/// target forward against 4.29); 0 (the full shape) lost to the chain at
/// 16 clients (0.82x); 0.02-0.15 at one client tied the chain as 0.01
/// does.
inline constexpr double kDefaultTreeMinPathProb = 0.01;

/// What an unset request field means: one --default_* flag each. Defaults
/// of Speculative Prefill follow the official code (keep 0.3, chunk 32,
/// pool 13, look-ahead 8; docs/ARCHITECTURE.md) plus forced BOS / last
/// token keeps.
struct RequestDefaults {
  int max_new_tokens = 256;
  float temperature = 0.f;  ///< 0 = greedy.
  int top_k = 0;            ///< 0 = off.
  float top_p = 1.f;        ///< (0, 1].
  bool spec_prefill = true;
  SpecPrefillDefaults prefill;  ///< the Speculative Prefill options.
  bool spec_decode = true;
  int num_draft_tokens = 4;
  SpecDecodeMethod spec_decode_method = SpecDecodeMethod::kDraft;
  /// Prompt lookup's n range; vLLM's defaults (ngram_proposer.h).
  int prompt_lookup_min = kDefaultPromptLookupMin;
  int prompt_lookup_max = kDefaultPromptLookupMax;
  std::vector<int> tree_branching{std::begin(kDefaultTreeBranching),
                                  std::end(kDefaultTreeBranching)};
  int tree_max_nodes = kDefaultTreeMaxNodes;
  double tree_min_path_prob = kDefaultTreeMinPathProb;
};
/// A request's options with every default applied and every value valid.
/// The prompt is not part of it (it needs the tokenizer and the target).
struct ResolvedOptions {
  int max_new_tokens = 0;
  v1::SamplingParams sampling;  ///< top_p in (0, 1]; seed as sent (or 0).
  bool has_seed = false;
  std::vector<std::string> stop;    ///< non-empty stop strings.
  /// A matched stop string ends the text (vLLM's
  /// include_stop_str_in_output); false = cut before it.
  bool include_stop_str = false;
  std::vector<int> stop_token_ids;  ///< >= 0 (vocabulary checked later).
  bool ignore_eos = false;
  /// vLLM's min_tokens, in [0, max_new_tokens]: no EOS, stop id or stop
  /// string ends the output before this many tokens.
  int min_tokens = 0;
  bool logprobs = false;  ///< each token's logprob (target raw logits).
  int top_logprobs = 0;   ///< in [0, kMaxTopLogprobs]; > 0 only with logprobs.
  /// vLLM's prompt_logprobs: -1 = none, else in [0, kMaxTopLogprobs]
  /// alternatives per prompt token; spec_prefill is then false.
  int prompt_logprobs = -1;
  bool spec_prefill = false;
  v1::SpecPrefillOptions prefill;  ///< every field set (keep_ratio etc.).
  bool spec_decode = false;
  int num_draft_tokens = 0;  ///< k in [1, 64].
  SpecDecodeMethod spec_decode_method = SpecDecodeMethod::kDraft;
  int prompt_lookup_min = 0;  ///< in [1, prompt_lookup_max].
  int prompt_lookup_max = 0;  ///< in [prompt_lookup_min, 16].
  std::vector<int> tree_branching;  ///< 1..16 depths, each 1..8 children.
  int tree_max_nodes = 0;           ///< in [1, 64].
  double tree_min_path_prob = 0.0;  ///< in [0, 1), at one request in flight.
};

/// Applies `defaults` to the unset fields of `request` and validates the
/// result once, at the edge. INVALID_ARGUMENT naming the field
/// ("sampling.top_p must be in (0, 1], got 0"): max_new_tokens < 1,
/// temperature negative or not finite, top_k < 0, top_p outside (0, 1],
/// presence_penalty / frequency_penalty outside [-2, 2],
/// repetition_penalty not > 0 or not finite, min_p outside [0, 1],
/// logit_bias of more than
/// kMaxLogitBias ids or with a bias outside [-100, 100], min_tokens
/// outside [0, max_new_tokens],
/// an empty stop string, a negative stop token id, top_logprobs outside
/// [0, 20] or set without logprobs, prompt_logprobs outside [0, 20] or
/// with speculative_prefill.enabled = true (a request that leaves it
/// unset gets no pruning), keep_ratio outside
/// (0, 1], keep_mass outside [0, 1], chunk_size < 1, pool_kernel_size even or <
/// 1, look_ahead outside [0, 64], keep_first / keep_last / min_prompt_tokens <
/// 0, num_draft_tokens outside [1, 64], an unknown method, prompt_lookup_min
/// < 1, prompt_lookup_max < prompt_lookup_min or > 16, tree_branching of no
/// or more than 16 depths or with an entry outside [1, 8], tree_max_nodes
/// outside [1, 64], tree_min_path_prob outside [0, 1) or not finite. The
/// lookup and tree fields are checked whatever the
/// method. A request that sets only one of prompt_lookup_min / max gets the
/// default of the other clamped to stay valid (min = min(default, max),
/// max = max(default, min)); a request's tree_branching replaces the
/// default list whole.
absl::StatusOr<ResolvedOptions> ResolveOptions(
    const v1::GenerateTextRequest& request, const RequestDefaults& defaults);

/// INVALID_ARGUMENT if `defaults` themselves are invalid (the message
/// names the --default_ flag's field).
absl::Status ValidateDefaults(const RequestDefaults& defaults);

/// The prompt of `request`: text through `tokenizer` (BOS prepended) or ids
/// as given, checked against the target's vocabulary and context (0 =
/// unknown). A text longer than MaxPromptBytes(max_context,
/// max_bytes_per_token) is refused before it is tokenized. INVALID_ARGUMENT
/// naming the field: no prompt, empty text or ids, ids outside [0, vocab),
/// text without a tokenizer, a prompt that leaves no room to generate.
absl::StatusOr<std::vector<int>> ResolvePrompt(
    const v1::GenerateTextRequest& request, const Tokenizer* tokenizer,
    int max_bytes_per_token, int vocab, int max_context);

}  // namespace specserve

#endif  // SPECSERVE_ROUTER_REQUEST_OPTIONS_H_
