#ifndef SPECSERVE_COMMON_SERVICE_TLS_H_
#define SPECSERVE_COMMON_SERVICE_TLS_H_

// gRPC transport security from file paths: the server side of every
// service (TLS, optionally mutual TLS) and the client side of the router's
// channels to the speculator and target. Plaintext is what an empty
// configuration gives. Files are PEM (RFC 7468): certificates as
// "-----BEGIN CERTIFICATE-----" blocks, keys as "-----BEGIN ... PRIVATE
// KEY-----" blocks, read once when the credentials are built.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace specserve {

/// Server-side settings (the --tls_* flags of every binary).
struct ServerTlsOptions {
  /// PEM certificate chain the server presents; "" = plaintext.
  std::string cert_file;
  /// PEM private key of `cert_file`; required with it.
  std::string key_file;
  /// PEM CA bundle client certificates are verified against (mutual TLS);
  /// "" = clients are not asked for a certificate.
  std::string client_ca_file;
  /// With `client_ca_file`: a client without a valid certificate is
  /// refused (true) or let in when it sends none (false). Ignored without.
  bool require_client_cert = true;
  /// Flag prefix used in error messages ("tls" -> "--tls_cert_file").
  std::string flag_prefix = "tls";
};

/// Client-side settings (the router's --backend_tls* flags).
struct ClientTlsOptions {
  /// Use TLS; also implied by any of the files below.
  bool enabled = false;
  /// PEM CA bundle that verifies the server; "" = gRPC's default roots
  /// (GRPC_DEFAULT_SSL_ROOTS_FILE_PATH or the bundled roots).
  std::string ca_file;
  /// PEM certificate chain and key the client presents (mutual TLS); both
  /// or neither.
  std::string cert_file;
  std::string key_file;
  /// Name the server certificate must carry instead of the dialled host
  /// (e.g. a Service name when dialling pod IPs); "" = the host.
  std::string server_name;
  /// Flag prefix used in error messages ("backend_tls" ->
  /// "--backend_tls_ca_file").
  std::string flag_prefix = "backend_tls";
};

/// What a channel to one server needs: credentials plus the optional
/// target-name override, which gRPC takes as a channel argument.
struct ChannelSecurity {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string server_name;  ///< "" = verify the dialled host.
  bool tls = false;

  /// Adds the server-name override (if any) to `args`.
  void Apply(grpc::ChannelArguments* args) const;
};

/// Reads a PEM file for `flag` (named in errors with its path): NOT_FOUND
/// if it does not exist, PERMISSION_DENIED if it may not be read,
/// INVALID_ARGUMENT if it cannot be read (a directory), is over 1 MiB, or
/// holds no "-----BEGIN <label>" block where
/// `label` is "CERTIFICATE" or "PRIVATE KEY" (any key type).
absl::StatusOr<std::string> ReadPemFile(absl::string_view flag,
                                        const std::string& path,
                                        absl::string_view label);

/// Server credentials for `options`: insecure when no file is given, else
/// TLS (mutual when client_ca_file is set), checked by starting a
/// throwaway server on a loopback port. INVALID_ARGUMENT naming the flags
/// when the combination is incomplete (a certificate without a key, a key
/// or client CA without a certificate) or gRPC cannot serve with the pair
/// (a key that does not belong to the certificate); ReadPemFile's errors
/// (also INVALID_ARGUMENT for an encrypted key).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsOptions& options);

/// Channel credentials for `options`: insecure when TLS is off, else SSL
/// with the given roots and identity. INVALID_ARGUMENT naming the flags for
/// a certificate without a key (or the reverse), or a server-name override
/// without TLS; ReadPemFile's errors.
absl::StatusOr<ChannelSecurity> MakeChannelSecurity(
    const ClientTlsOptions& options);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SERVICE_TLS_H_
