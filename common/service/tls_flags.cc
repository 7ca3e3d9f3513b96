#include "common/service/tls_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain this server presents; empty = plaintext");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle client certificates must chain to (mutual TLS); "
          "empty = no client certificates");
ABSL_FLAG(bool, tls_require_client_cert, true,
          "with --tls_client_ca_file: refuse clients without a valid "
          "certificate (false: verify one only if sent)");

namespace specserve {

ServerTlsOptions ServerTlsOptionsFromFlags() {
  ServerTlsOptions o;
  o.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  o.key_file = absl::GetFlag(FLAGS_tls_key_file);
  o.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  o.require_client_cert = absl::GetFlag(FLAGS_tls_require_client_cert);
  return o;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>>
ServerCredentialsFromFlags() {
  return MakeServerCredentials(ServerTlsOptionsFromFlags());
}

}  // namespace specserve
