// Command-line client of the router (specserve.v1.Router).
//
//   bazel run //tools:client -- --router localhost:50050
//     --prompt "Once upon a time" --max_new_tokens 64 [--stream] [--json]
//     [--logprobs N] [--prompt_logprobs N]
//
// Plaintext by default; --tls (gRPC's default roots) or --tls_ca_file
// speaks TLS to a router serving it, --tls_cert_file / --tls_key_file add
// the client certificate mutual TLS asks for, and --tls_server_name checks
// the router's certificate for another name than the dialled host (the
// router's --backend_tls_* flags, for its own channels, work the same way).
//
// Unset request options take the router's defaults. Exit status: 0 on
// success, 2 for INVALID_ARGUMENT (from the router or a bad flag, e.g. a
// certificate without its key) and NOT_FOUND flags (a missing file), 1 for
// any other error (the gRPC status is printed on stderr; a failed TLS
// handshake is UNAVAILABLE).

#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/service/tls.h"
#include "common/util/cli.h"
#include "common/util/parse.h"
#include "common/util/paths.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "protos/router.grpc.pb.h"

ABSL_FLAG(std::string, router, "localhost:50050", "router host:port");
ABSL_FLAG(std::string, prompt, "", "prompt text");
ABSL_FLAG(std::string, token_ids, "", "prompt token ids instead of --prompt");
ABSL_FLAG(std::string, prompt_file, "",
          "read the prompt text from this file (\"-\" = stdin) instead of "
          "--prompt");
ABSL_FLAG(std::string, token_ids_file, "",
          "read the prompt's token ids (separated by commas and/or "
          "whitespace) from this file (\"-\" = stdin): long prompts exceed "
          "the command line's length limit");
ABSL_FLAG(int, max_new_tokens, -1, "tokens to generate (-1 = router default)");
ABSL_FLAG(double, temperature, -1, "sampling temperature (-1 = default)");
ABSL_FLAG(int, top_k, -1, "top-k (-1 = default)");
ABSL_FLAG(double, top_p, -1, "top-p (-1 = default)");
ABSL_FLAG(double, presence_penalty, 0,
          "presence penalty in [-2, 2] on generated ids (0 = off)");
ABSL_FLAG(double, frequency_penalty, 0,
          "frequency penalty in [-2, 2] per generated occurrence (0 = off)");
ABSL_FLAG(double, repetition_penalty, 1,
          "repetition penalty > 0 on prompt and generated ids (1 = off)");
ABSL_FLAG(std::string, logit_bias, "",
          "id:bias,... added to those ids' logits (bias in [-100, 100])");
ABSL_FLAG(double, min_p, 0,
          "min_p in [0, 1]: drop tokens less likely than min_p x the top one");
ABSL_FLAG(bool, json_object, false,
          "JSON mode (OpenAI's response_format json_object): the output is "
          "one JSON object");
ABSL_FLAG(std::string, json_schema, "",
          "structured output: a JSON Schema the output is an instance of "
          "(the schema's JSON text, or @path to a file holding it)");
ABSL_FLAG(int, min_tokens, 0,
          "no EOS, stop id or stop string before this many tokens");
ABSL_FLAG(int64_t, seed, -1, "sampling seed (-1 = default)");
ABSL_FLAG(std::string, stop, "", "stop strings, '|'-separated");
ABSL_FLAG(std::string, stop_token_ids, "", "stop token ids");
ABSL_FLAG(int, logprobs, -1,
          "each token's logprob (target raw logits) with the N likeliest "
          "alternatives, N in [0, 20] (-1 = off); --json prints them");
ABSL_FLAG(int, prompt_logprobs, -1,
          "each prompt token's logprob (after the first) with the N "
          "likeliest alternatives, N in [0, 20] (-1 = off); the whole prompt "
          "is prefilled (no Speculative Prefill); --json prints them");
ABSL_FLAG(double, keep_ratio, -1, "Speculative Prefill keep ratio");
ABSL_FLAG(int, look_ahead, -1, "Speculative Prefill look-ahead tokens");
ABSL_FLAG(int, chunk_size, -1, "Speculative Prefill chunk size");
ABSL_FLAG(int, num_draft_tokens, -1, "speculative decoding drafts per round");
ABSL_FLAG(std::string, spec_decode_method, "",
          "draft | ngram | draft_tree (empty = router default)");
ABSL_FLAG(int, prompt_lookup_min, -1, "ngram: shortest n-gram looked up");
ABSL_FLAG(int, prompt_lookup_max, -1, "ngram: longest n-gram looked up");
ABSL_FLAG(std::string, tree_branching, "",
          "draft_tree: children per node at each depth, e.g. 3,2,2,2,2,2");
ABSL_FLAG(int, tree_max_nodes, -1, "draft_tree: node budget");
ABSL_FLAG(double, tree_min_path_prob, -1,
          "draft_tree: path probability a node needs to grow, with one "
          "request in flight (< 0 = router default)");
ABSL_FLAG(bool, no_spec_prefill, false, "turn Speculative Prefill off");
ABSL_FLAG(bool, no_spec_decode, false, "turn speculative decoding off");
ABSL_FLAG(bool, stream, false, "use GenerateStream and print text as it comes");
ABSL_FLAG(bool, json, false, "print one JSON object (the final response)");
ABSL_FLAG(int, deadline_ms, 60000, "request deadline");
ABSL_FLAG(bool, tls, false,
          "TLS to the router (implied by any --tls_* file); without "
          "--tls_ca_file gRPC's default roots verify it");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA bundle that verifies the router's certificate");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain this client presents (mutual TLS)");
ABSL_FLAG(std::string, tls_key_file, "",
          "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_server_name, "",
          "name the router's certificate must carry instead of the dialled "
          "host; empty = the host");

namespace specserve {
namespace {

int Fail(const grpc::Status& s) {
  std::fprintf(stderr, "error: %d %s\n", s.error_code(),
               s.error_message().c_str());
  return s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ? 2 : 1;
}

// The whole of `path` ("-" = stdin). NOT_FOUND if it cannot be read.
absl::StatusOr<std::string> ReadAll(const std::string& path) {
  std::ifstream file;
  std::istream* in = &std::cin;
  if (path != "-") {
    file.open(ResolveUserPath(path), std::ios::binary);
    if (!file) return absl::NotFoundError("cannot read " + path);
    in = &file;
  }
  std::ostringstream all;
  all << in->rdbuf();
  return all.str();
}

absl::StatusOr<v1::GenerateTextRequest> BuildRequest() {
  v1::GenerateTextRequest req;
  const int sources = !absl::GetFlag(FLAGS_prompt).empty() +
                      !absl::GetFlag(FLAGS_token_ids).empty() +
                      !absl::GetFlag(FLAGS_prompt_file).empty() +
                      !absl::GetFlag(FLAGS_token_ids_file).empty();
  if (sources > 1) {
    return absl::InvalidArgumentError(
        "give one of --prompt, --token_ids, --prompt_file, --token_ids_file");
  }
  if (!absl::GetFlag(FLAGS_token_ids_file).empty()) {
    auto text = ReadAll(absl::GetFlag(FLAGS_token_ids_file));
    if (!text.ok()) return text.status();
    // Whitespace (newlines included) separates ids as commas do.
    for (char& c : *text) {
      if (c == ' ' || c == '\n' || c == '\r' || c == '\t') c = ',';
    }
    std::vector<std::string> parts = absl::StrSplit(*text, ',', absl::SkipEmpty());
    auto ids = ParseIntList(absl::StrJoin(parts, ","), "--token_ids_file");
    if (!ids.ok()) return ids.status();
    for (int id : *ids) req.mutable_token_ids()->add_ids(id);
  } else if (!absl::GetFlag(FLAGS_token_ids).empty()) {
    auto ids = ParseIntList(absl::GetFlag(FLAGS_token_ids), "--token_ids");
    if (!ids.ok()) return ids.status();
    for (int id : *ids) req.mutable_token_ids()->add_ids(id);
  } else if (!absl::GetFlag(FLAGS_prompt_file).empty()) {
    auto text = ReadAll(absl::GetFlag(FLAGS_prompt_file));
    if (!text.ok()) return text.status();
    req.set_text(*text);
  } else {
    req.set_text(absl::GetFlag(FLAGS_prompt));
  }
  auto* s = req.mutable_sampling();
  if (absl::GetFlag(FLAGS_max_new_tokens) >= 0) {
    s->set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  }
  if (absl::GetFlag(FLAGS_temperature) >= 0) {
    s->set_temperature(absl::GetFlag(FLAGS_temperature));
  }
  if (absl::GetFlag(FLAGS_top_k) >= 0) s->set_top_k(absl::GetFlag(FLAGS_top_k));
  if (absl::GetFlag(FLAGS_top_p) >= 0) s->set_top_p(absl::GetFlag(FLAGS_top_p));
  if (absl::GetFlag(FLAGS_presence_penalty) != 0) {
    s->set_presence_penalty(absl::GetFlag(FLAGS_presence_penalty));
  }
  if (absl::GetFlag(FLAGS_frequency_penalty) != 0) {
    s->set_frequency_penalty(absl::GetFlag(FLAGS_frequency_penalty));
  }
  if (absl::GetFlag(FLAGS_repetition_penalty) != 1) {
    s->set_repetition_penalty(absl::GetFlag(FLAGS_repetition_penalty));
  }
  const std::string logit_bias = absl::GetFlag(FLAGS_logit_bias);
  for (absl::string_view entry :
       absl::StrSplit(logit_bias, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(entry, ':');
    int id = 0;
    float bias = 0;
    if (!absl::SimpleAtoi(kv.first, &id) ||
        !absl::SimpleAtof(kv.second, &bias)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--logit_bias: \"", entry, "\" is not id:bias"));
    }
    (*s->mutable_logit_bias())[id] = bias;
  }
  if (absl::GetFlag(FLAGS_min_p) > 0) s->set_min_p(absl::GetFlag(FLAGS_min_p));
  if (absl::GetFlag(FLAGS_json_object)) s->set_json_object(true);
  if (std::string schema = absl::GetFlag(FLAGS_json_schema); !schema.empty()) {
    if (schema[0] == '@') {
      auto text = ReadAll(schema.substr(1));
      if (!text.ok()) return text.status();
      schema = *std::move(text);
    }
    s->set_json_schema(schema);
  }
  if (absl::GetFlag(FLAGS_min_tokens) > 0) {
    s->set_min_tokens(absl::GetFlag(FLAGS_min_tokens));
  }
  if (absl::GetFlag(FLAGS_seed) >= 0) s->set_seed(absl::GetFlag(FLAGS_seed));
  if (!absl::GetFlag(FLAGS_stop).empty()) {
    for (auto part : absl::StrSplit(absl::GetFlag(FLAGS_stop), '|')) {
      s->add_stop(std::string(part));
    }
  }
  auto stop_ids =
      ParseIntList(absl::GetFlag(FLAGS_stop_token_ids), "--stop_token_ids");
  if (!stop_ids.ok()) return stop_ids.status();
  for (int id : *stop_ids) s->add_stop_token_ids(id);
  if (absl::GetFlag(FLAGS_logprobs) >= 0) {
    s->set_logprobs(true);
    s->set_top_logprobs(absl::GetFlag(FLAGS_logprobs));
  }
  if (absl::GetFlag(FLAGS_prompt_logprobs) >= 0) {
    s->set_prompt_logprobs(absl::GetFlag(FLAGS_prompt_logprobs));
  }
  auto* sp = req.mutable_speculative_prefill();
  if (absl::GetFlag(FLAGS_no_spec_prefill)) sp->set_enabled(false);
  if (absl::GetFlag(FLAGS_keep_ratio) >= 0) {
    sp->set_keep_ratio(absl::GetFlag(FLAGS_keep_ratio));
  }
  if (absl::GetFlag(FLAGS_look_ahead) >= 0) {
    sp->set_look_ahead(absl::GetFlag(FLAGS_look_ahead));
  }
  if (absl::GetFlag(FLAGS_chunk_size) >= 0) {
    sp->set_chunk_size(absl::GetFlag(FLAGS_chunk_size));
  }
  auto* sd = req.mutable_speculative_decoding();
  if (absl::GetFlag(FLAGS_no_spec_decode)) sd->set_enabled(false);
  if (absl::GetFlag(FLAGS_num_draft_tokens) >= 0) {
    sd->set_num_draft_tokens(absl::GetFlag(FLAGS_num_draft_tokens));
  }
  if (!absl::GetFlag(FLAGS_spec_decode_method).empty()) {
    sd->set_method(absl::GetFlag(FLAGS_spec_decode_method));
  }
  if (absl::GetFlag(FLAGS_prompt_lookup_min) >= 0) {
    sd->set_prompt_lookup_min(absl::GetFlag(FLAGS_prompt_lookup_min));
  }
  if (absl::GetFlag(FLAGS_prompt_lookup_max) >= 0) {
    sd->set_prompt_lookup_max(absl::GetFlag(FLAGS_prompt_lookup_max));
  }
  auto branching =
      ParseIntList(absl::GetFlag(FLAGS_tree_branching), "--tree_branching");
  if (!branching.ok()) return branching.status();
  for (int b : *branching) sd->add_tree_branching(b);
  if (absl::GetFlag(FLAGS_tree_max_nodes) >= 0) {
    sd->set_tree_max_nodes(absl::GetFlag(FLAGS_tree_max_nodes));
  }
  if (absl::GetFlag(FLAGS_tree_min_path_prob) >= 0) {
    sd->set_tree_min_path_prob(absl::GetFlag(FLAGS_tree_min_path_prob));
  }
  return req;
}

nlohmann::json StatsJson(const v1::Usage& u, const v1::GenerationStats& s) {
  nlohmann::json j;
  j["usage"] = {{"prompt_tokens", u.prompt_tokens()},
                {"kept_prompt_tokens", u.kept_prompt_tokens()},
                {"completion_tokens", u.completion_tokens()}};
  j["stats"] = {{"keep_ratio", s.keep_ratio()},
                {"ttft_s", s.ttft_s()},
                {"speculate_s", s.speculate_s()},
                {"target_prefill_s", s.target_prefill_s()},
                {"score_prefill_s", s.score_prefill_s()},
                {"score_look_ahead_s", s.score_look_ahead_s()},
                {"score_select_s", s.score_select_s()},
                {"score_total_s", s.score_total_s()},
                {"total_s", s.total_s()},
                {"num_drafts", s.num_drafts()},
                {"num_draft_tokens", s.num_draft_tokens()},
                {"num_accepted_tokens", s.num_accepted_tokens()},
                {"mean_acceptance_length", s.mean_acceptance_length()},
                {"accepted_per_position",
                 std::vector<int>(s.accepted_per_position().begin(),
                                  s.accepted_per_position().end())},
                {"fallback_reason", s.fallback_reason()},
                {"spec_decode_method", s.spec_decode_method()},
                {"num_target_forwards", s.num_target_forwards()},
                {"tokens_per_target_forward", s.tokens_per_target_forward()}};
  return j;
}

// [{"logprob": x, "top": [[id, logprob], ...]}, ...] of `logprobs`.
void AppendLogprobs(
    const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& logprobs,
    nlohmann::json* out) {
  for (const v1::TokenLogprob& lp : logprobs) {
    nlohmann::json top = nlohmann::json::array();
    for (const v1::TopLogprob& t : lp.top()) {
      top.push_back({t.id(), t.logprob()});
    }
    out->push_back({{"logprob", lp.logprob()}, {"top", std::move(top)}});
  }
}

void PrintSummary(const nlohmann::json& j) {
  const auto& u = j["usage"];
  const auto& s = j["stats"];
  std::fprintf(stderr,
               "\n[finish %s] prompt %d tokens, kept %d (%.2f), completion %d; "
               "TTFT %.4f s (speculate %.4f s, target prefill %.4f s), total "
               "%.3f s; drafting %s: drafts %d rounds / %d tokens, accepted "
               "%d, mean acceptance length %.2f, %d target forwards, %.2f "
               "tokens per forward%s%s\n",
               j.value("finish_reason", "").c_str(),
               int(u["prompt_tokens"]), int(u["kept_prompt_tokens"]),
               double(s["keep_ratio"]), int(u["completion_tokens"]),
               double(s["ttft_s"]), double(s["speculate_s"]),
               double(s["target_prefill_s"]), double(s["total_s"]),
               std::string(s["spec_decode_method"]).empty()
                   ? "none"
                   : std::string(s["spec_decode_method"]).c_str(),
               int(s["num_drafts"]), int(s["num_draft_tokens"]),
               int(s["num_accepted_tokens"]),
               double(s["mean_acceptance_length"]),
               int(s["num_target_forwards"]),
               double(s["tokens_per_target_forward"]),
               std::string(s["fallback_reason"]).empty() ? "" : "; fallback: ",
               std::string(s["fallback_reason"]).c_str());
}

// The channel to --router: plaintext, or TLS from the --tls* flags
// (common/service/tls.h); INVALID_ARGUMENT / NOT_FOUND naming the flag and
// path for an incomplete set or an unreadable file.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeRouterChannel() {
  ClientTlsOptions tls;
  tls.enabled = absl::GetFlag(FLAGS_tls);
  tls.ca_file = ResolveUserPath(absl::GetFlag(FLAGS_tls_ca_file));
  tls.cert_file = ResolveUserPath(absl::GetFlag(FLAGS_tls_cert_file));
  tls.key_file = ResolveUserPath(absl::GetFlag(FLAGS_tls_key_file));
  tls.server_name = absl::GetFlag(FLAGS_tls_server_name);
  tls.flag_prefix = "tls";
  absl::StatusOr<ChannelSecurity> security = MakeChannelSecurity(tls);
  if (!security.ok()) return security.status();
  grpc::ChannelArguments args;
  security->Apply(&args);
  return grpc::CreateCustomChannel(absl::GetFlag(FLAGS_router),
                                   security->credentials, args);
}

int Run() {
  auto req = BuildRequest();
  if (!req.ok()) {
    std::fprintf(stderr, "error: %s\n", req.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeRouterChannel();
  if (!channel.ok()) return ReportCliError(channel.status());
  auto stub = v1::Router::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms)));
  const bool json = absl::GetFlag(FLAGS_json);
  nlohmann::json out;
  if (absl::GetFlag(FLAGS_stream)) {
    auto reader = stub->GenerateStream(&ctx, *req);
    v1::GenerateTextChunk chunk;
    std::string text;
    std::vector<int> ids;
    nlohmann::json logprobs = nlohmann::json::array();
    nlohmann::json prompt_logprobs = nlohmann::json::array();
    while (reader->Read(&chunk)) {
      text += chunk.text();
      ids.insert(ids.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      AppendLogprobs(chunk.logprobs(), &logprobs);
      AppendLogprobs(chunk.prompt_logprobs(), &prompt_logprobs);
      if (!json) {
        std::fputs(chunk.text().c_str(), stdout);
        std::fflush(stdout);
      }
      if (!chunk.finish_reason().empty()) {
        out = StatsJson(chunk.usage(), chunk.stats());
        out["finish_reason"] = chunk.finish_reason();
      }
    }
    grpc::Status s = reader->Finish();
    if (!s.ok()) return Fail(s);
    out["text"] = text;
    out["token_ids"] = ids;
    if (req->sampling().logprobs()) out["logprobs"] = std::move(logprobs);
    if (req->sampling().has_prompt_logprobs()) {
      out["prompt_logprobs"] = std::move(prompt_logprobs);
    }
  } else {
    v1::GenerateTextResponse resp;
    grpc::Status s = stub->Generate(&ctx, *req, &resp);
    if (!s.ok()) return Fail(s);
    out = StatsJson(resp.usage(), resp.stats());
    out["finish_reason"] = resp.finish_reason();
    out["text"] = resp.text();
    out["token_ids"] = std::vector<int>(resp.token_ids().begin(),
                                        resp.token_ids().end());
    if (req->sampling().logprobs()) {
      out["logprobs"] = nlohmann::json::array();
      AppendLogprobs(resp.logprobs(), &out["logprobs"]);
    }
    if (req->sampling().has_prompt_logprobs()) {
      out["prompt_logprobs"] = nlohmann::json::array();
      AppendLogprobs(resp.prompt_logprobs(), &out["prompt_logprobs"]);
    }
    if (!json) std::fputs(resp.text().c_str(), stdout);
  }
  if (json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("\n");
    std::fflush(stdout);  // the text before the summary on stderr
    PrintSummary(out);
  }
  return 0;
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return specserve::Run();
}
