// The router binary: the public specserve.v1.Router API in front of the
// speculator and target services, with /metrics over HTTP and,
// with --http_port, the OpenAI-compatible HTTP API.
//   bazel run //router:router -- --speculator 127.0.0.1:50061
//       --target 127.0.0.1:50052 --tokenizer models/stories260K
//       --port 50051 --metrics_port 9151
// Prints "listening on <port>, metrics on <port>" to stderr when ready and
// shuts down cleanly on SIGINT / SIGTERM. Exit status 2 for bad flags.

#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/service/grpc_util.h"
#include "common/service/server_main.h"
#include "common/service/spec_prefill_flags.h"
#include "common/service/tls.h"
#include "common/service/tls_flags.h"
#include "common/util/paths.h"
#include "common/decoding/ngram_proposer.h"
#include "router/http_server.h"
#include "router/request_options.h"
#include "router/router_server.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "gRPC listen address");
ABSL_FLAG(int, port, 50051, "gRPC port (0 = any free port)");
ABSL_FLAG(int, metrics_port, 9151, "Prometheus /metrics port (0 = any)");
ABSL_FLAG(std::string, speculator, "",
          "speculator replicas: comma-separated host:port or dns:///name:port "
          "(empty = no speculation)");
ABSL_FLAG(std::string, target, "",
          "target replicas: comma-separated host:port or dns:///name:port");
ABSL_FLAG(std::string, tokenizer, "",
          "model directory whose tokenizer the router uses (its fingerprint "
          "must match the services'); empty = token-id prompts only");
ABSL_FLAG(int, max_concurrent_requests, 512,
          "requests served at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int, spec_decode_disable_by_batch_size, 0,
          "with this many requests in flight, rounds go without drafts; from "
          "half of it on with fewer (vLLM speculative_disable_by_batch_size); "
          "0 = never");
ABSL_FLAG(int, speculator_deadline_ms, 2000,
          "deadline of each speculator call (Score, Draft round); past it "
          "the request falls back to the target alone");
ABSL_FLAG(int, request_deadline_ms, 300000,
          "deadline of requests whose client set none");
ABSL_FLAG(int, http_port, 0,
          "OpenAI-compatible HTTP API port (/v1/completions, "
          "/v1/chat/completions, /v1/models, /health); 0 = off");
ABSL_FLAG(std::string, api_key, "",
          "when set (or env SPECSERVE_API_KEY), the HTTP API's /v1/* needs "
          "the header 'Authorization: Bearer <key>' and the gRPC API "
          "(Generate, GenerateStream, Info) the metadata 'authorization: "
          "Bearer <key>'; health checks stay open");
ABSL_FLAG(bool, backend_tls, false,
          "TLS to the speculator and target (implied by any --backend_tls_* "
          "file); without --backend_tls_ca_file gRPC's default roots verify "
          "them");
ABSL_FLAG(std::string, backend_tls_ca_file, "",
          "PEM CA bundle that verifies the speculator and target certificates");
ABSL_FLAG(std::string, backend_tls_cert_file, "",
          "PEM certificate chain the router presents to them (mutual TLS)");
ABSL_FLAG(std::string, backend_tls_key_file, "",
          "PEM private key of --backend_tls_cert_file");
ABSL_FLAG(std::string, backend_tls_server_name, "",
          "name their certificates must carry instead of the dialled host "
          "(e.g. when dialling pod IPs); empty = the host");
ABSL_FLAG(double, shutdown_grace_s, 5, "seconds open requests get on exit");
ABSL_FLAG(int, default_max_new_tokens, 256, "max_new_tokens when unset");
ABSL_FLAG(double, default_temperature, 0, "temperature when unset (0=greedy)");
ABSL_FLAG(int, default_top_k, 0, "top_k when unset (0 = off)");
ABSL_FLAG(double, default_top_p, 1, "top_p when unset");
ABSL_FLAG(bool, default_spec_prefill, true,
          "Speculative Prefill on when the request does not say");
ABSL_FLAG(bool, default_spec_decode, true,
          "speculative decoding on when the request does not say");
ABSL_FLAG(int, default_num_draft_tokens, 4, "drafts per round when unset");
ABSL_FLAG(std::string, default_spec_decode_method, "draft",
          "how drafts are proposed when unset: draft (the speculator's "
          "chain), ngram (prompt lookup in the router), draft_tree (the "
          "speculator's token tree)");
ABSL_FLAG(int, default_prompt_lookup_min, specserve::kDefaultPromptLookupMin,
          "ngram: the shortest n-gram looked up when unset");
ABSL_FLAG(int, default_prompt_lookup_max, specserve::kDefaultPromptLookupMax,
          "ngram: the longest n-gram looked up when unset");
ABSL_FLAG(std::string, default_tree_branching, "3,2,2,2,2,2",
          "draft_tree: children per node at each depth when unset "
          "(comma-separated)");
ABSL_FLAG(int, default_tree_max_nodes, specserve::kDefaultTreeMaxNodes,
          "draft_tree: the tree's node budget when unset");
ABSL_FLAG(double, default_tree_min_path_prob,
          specserve::kDefaultTreeMinPathProb,
          "draft_tree: with one request in flight, the speculator's path "
          "probability a node needs to grow children (greedy: to be kept), "
          "when unset; raised with the requests in flight "
          "(TreeMinPathProbUnderLoad); 0 = the full shape");

namespace specserve {
namespace {

int Run() {
  RouterServerOptions o;
  o.host = absl::GetFlag(FLAGS_host);
  // Before the credentials: their check starts gRPC's threads.
  const sigset_t stop = BlockStopSignals();
  auto credentials = ServerCredentialsFromFlags();
  if (!credentials.ok()) {
    std::fprintf(stderr, "router: %s\n",
                 credentials.status().ToString().c_str());
    return 2;
  }
  o.credentials = *std::move(credentials);
  ClientTlsOptions backend;
  backend.enabled = absl::GetFlag(FLAGS_backend_tls);
  backend.ca_file = absl::GetFlag(FLAGS_backend_tls_ca_file);
  backend.cert_file = absl::GetFlag(FLAGS_backend_tls_cert_file);
  backend.key_file = absl::GetFlag(FLAGS_backend_tls_key_file);
  backend.server_name = absl::GetFlag(FLAGS_backend_tls_server_name);
  auto security = MakeChannelSecurity(backend);
  if (!security.ok()) {
    std::fprintf(stderr, "router: %s\n", security.status().ToString().c_str());
    return 2;
  }
  o.pool.credentials = security->credentials;
  o.pool.server_name = security->server_name;
  o.speculator = absl::GetFlag(FLAGS_speculator);
  o.target = absl::GetFlag(FLAGS_target);
  o.api_key = absl::GetFlag(FLAGS_api_key);
  if (const char* env = std::getenv("SPECSERVE_API_KEY");
      o.api_key.empty() && env != nullptr) {
    o.api_key = env;
  }
  if (o.api_key.empty()) {
    std::fprintf(stderr,
                 "router: no --api_key: the gRPC%s API answers anyone who "
                 "can reach %s\n",
                 absl::GetFlag(FLAGS_http_port) != 0 ? " and HTTP" : "",
                 o.host.c_str());
  }
  const std::string tok = absl::GetFlag(FLAGS_tokenizer);
  o.tokenizer_dir = tok.empty() ? "" : ResolveUserPath(tok);
  o.max_concurrent_requests = absl::GetFlag(FLAGS_max_concurrent_requests);
  o.speculator_deadline =
      absl::Milliseconds(absl::GetFlag(FLAGS_speculator_deadline_ms));
  o.spec_decode_disable_by_batch_size =
      absl::GetFlag(FLAGS_spec_decode_disable_by_batch_size);
  o.request_deadline =
      absl::Milliseconds(absl::GetFlag(FLAGS_request_deadline_ms));
  RequestDefaults& d = o.defaults;
  d.max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  d.temperature = static_cast<float>(absl::GetFlag(FLAGS_default_temperature));
  d.top_k = absl::GetFlag(FLAGS_default_top_k);
  d.top_p = static_cast<float>(absl::GetFlag(FLAGS_default_top_p));
  d.spec_prefill = absl::GetFlag(FLAGS_default_spec_prefill);
  d.prefill = SpecPrefillDefaultsFromFlags();
  d.spec_decode = absl::GetFlag(FLAGS_default_spec_decode);
  d.num_draft_tokens = absl::GetFlag(FLAGS_default_num_draft_tokens);
  auto method = ParseSpecDecodeMethod(
      absl::GetFlag(FLAGS_default_spec_decode_method),
      "--default_spec_decode_method");
  if (!method.ok()) {
    std::fprintf(stderr, "router: %s\n", method.status().ToString().c_str());
    return 2;
  }
  d.spec_decode_method = *method;
  d.prompt_lookup_min = absl::GetFlag(FLAGS_default_prompt_lookup_min);
  d.prompt_lookup_max = absl::GetFlag(FLAGS_default_prompt_lookup_max);
  d.tree_branching.clear();
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_default_tree_branching), ',',
                      absl::SkipWhitespace())) {
    int b = 0;
    if (!absl::SimpleAtoi(part, &b)) {
      std::fprintf(stderr,
                   "router: --default_tree_branching must be integers "
                   "separated by commas, got \"%s\"\n",
                   absl::GetFlag(FLAGS_default_tree_branching).c_str());
      return 2;
    }
    d.tree_branching.push_back(b);
  }
  d.tree_max_nodes = absl::GetFlag(FLAGS_default_tree_max_nodes);
  d.tree_min_path_prob = absl::GetFlag(FLAGS_default_tree_min_path_prob);

  EnableHealthAndReflection();
  auto server = RouterServer::Create(o);
  if (!server.ok()) {
    std::fprintf(stderr, "router: %s\n", server.status().ToString().c_str());
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  HttpServerOptions http;
  http.host = o.host;
  http.api_key = o.api_key;
  auto front = RouterWithHttp::Create(server->get(), http,
                                      absl::GetFlag(FLAGS_http_port));
  if (!front.ok()) {
    std::fprintf(stderr, "router: %s\n", front.status().ToString().c_str());
    return 2;
  }
  return ServeUntilStopSignal("router", **front, absl::GetFlag(FLAGS_port),
                              o.host, absl::GetFlag(FLAGS_metrics_port),
                              (*server)->registry(), stop,
                              absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s)));
}

}  // namespace
}  // namespace specserve

int main(int argc, char** argv) {
  specserve::InitServerProcess();
  absl::ParseCommandLine(argc, argv);
  return specserve::Run();
}
