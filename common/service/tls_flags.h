#ifndef SPECSERVE_COMMON_SERVICE_TLS_FLAGS_H_
#define SPECSERVE_COMMON_SERVICE_TLS_FLAGS_H_

// The server-side TLS flags every specserve binary takes:
//   --tls_cert_file            PEM certificate chain ("" = plaintext)
//   --tls_key_file             its PEM private key
//   --tls_client_ca_file       PEM CA bundle for client certificates (mTLS)
//   --tls_require_client_cert  refuse clients without one (default true)

#include <memory>

#include "absl/status/statusor.h"
#include "common/service/tls.h"
#include "grpcpp/grpcpp.h"

namespace specserve {

/// The --tls_* flag values.
ServerTlsOptions ServerTlsOptionsFromFlags();

/// MakeServerCredentials(ServerTlsOptionsFromFlags()): insecure when no
/// flag is set; its errors name the flag and path. With TLS it starts
/// gRPC's threads (the key check), so call it after BlockStopSignals().
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>>
ServerCredentialsFromFlags();

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_TLS_FLAGS_H_
