#include "common/service/grpc_util.h"

#include "absl/strings/str_cat.h"
#include "common/model/config.h"
#include "common/tokenizer/tokenizer.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace specserve {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

void EnableHealthAndReflection() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
}

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetricsExposer(
    const std::string& host, int port,
    std::shared_ptr<prometheus::Registry> registry, int* bound_port) {
  // civetweb's listening_ports syntax: "127.0.0.1:9090", "[::1]:9090";
  // port 0 binds an ephemeral port.
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  const std::string address =
      v6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  exposer->RegisterCollectable(registry);
  const auto ports = exposer->GetListeningPorts();
  if (bound_port != nullptr) *bound_port = ports.empty() ? port : ports[0];
  return exposer;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& host, int port,
    std::shared_ptr<grpc::ServerCredentials> credentials,
    grpc::Service* service, int* bound_port) {
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat(host, ":", port),
                           credentials != nullptr
                               ? std::move(credentials)
                               : grpc::InsecureServerCredentials(),
                           &bound);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", host, ":", port));
  }
  if (bound_port != nullptr) *bound_port = bound;
  return server;
}

v1::ModelInfo MakeModelInfo(const std::string& model_id,
                            const ModelConfig& config,
                            const Tokenizer* tokenizer) {
  v1::ModelInfo info;
  info.set_model_id(model_id);
  info.set_vocab_size(config.vocab_size);
  info.set_max_context(config.max_position_embeddings);
  info.set_dtype("float32");
  info.set_bos_token_id(config.bos_token_id);
  for (int id : config.eos_token_ids) info.add_eos_token_ids(id);
  info.set_num_layers(config.num_hidden_layers);
  info.set_hidden_size(config.hidden_size);
  if (tokenizer != nullptr) {
    info.set_tokenizer_fingerprint(tokenizer->Fingerprint());
    info.set_tokenizer_kind(tokenizer->kind());
  }
  return info;
}

}  // namespace specserve
