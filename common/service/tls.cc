#include "common/service/tls.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace specserve {
namespace {

std::string Flag(absl::string_view prefix, absl::string_view name) {
  return absl::StrCat("--", prefix, "_", name);
}

// PEM files of a few KB at most; anything larger is not a credential.
constexpr size_t kMaxPemBytes = size_t{1} << 20;

}  // namespace

void ChannelSecurity::Apply(grpc::ChannelArguments* args) const {
  if (!server_name.empty()) args->SetSslTargetNameOverride(server_name);
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag,
                                        const std::string& path,
                                        absl::string_view label) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    const std::string what =
        absl::StrCat(flag, ": cannot open ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(what);
    if (err == EACCES) return absl::PermissionDeniedError(what);
    return absl::InvalidArgumentError(what);
  }
  std::string pem;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0 &&
         pem.size() <= kMaxPemBytes) {
    pem.append(buf, n);
  }
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(err)));
  }
  if (pem.size() > kMaxPemBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " is over ", kMaxPemBytes,
                     " bytes, not a PEM credential"));
  }
  // "-----BEGIN CERTIFICATE-----", or "-----BEGIN [RSA |EC ]PRIVATE KEY-----".
  const bool found = label == "CERTIFICATE"
                         ? absl::StrContains(pem, "-----BEGIN CERTIFICATE-----")
                         : absl::StrContains(pem, "-----BEGIN ") &&
                               absl::StrContains(pem, "PRIVATE KEY-----");
  if (!found) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM \"", label, "\" block"));
  }
  if (label != "CERTIFICATE" &&
      absl::StrContains(pem, "-----BEGIN ENCRYPTED PRIVATE KEY-----")) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": ", path,
        " is an encrypted private key; gRPC needs it unencrypted"));
  }
  return pem;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsOptions& o) {
  const std::string cert_flag = Flag(o.flag_prefix, "cert_file");
  const std::string key_flag = Flag(o.flag_prefix, "key_file");
  const std::string ca_flag = Flag(o.flag_prefix, "client_ca_file");
  if (o.cert_file.empty()) {
    if (!o.key_file.empty() || !o.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(o.key_file.empty() ? ca_flag : key_flag, " is set but ",
                       cert_flag, " is empty: TLS needs a server certificate"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (o.key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(cert_flag, " needs ", key_flag, " (its private key)"));
  }
  auto cert = ReadPemFile(cert_flag, o.cert_file, "CERTIFICATE");
  if (!cert.ok()) return cert.status();
  auto key = ReadPemFile(key_flag, o.key_file, "PRIVATE KEY");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl(
      GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!o.client_ca_file.empty()) {
    auto ca = ReadPemFile(ca_flag, o.client_ca_file, "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    ssl.client_certificate_request =
        o.require_client_cert
            ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
            : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  auto creds = grpc::SslServerCredentials(ssl);
  // gRPC checks the key against the certificate only when a port is added;
  // try it on a throwaway loopback server so that a mismatch is reported
  // here, naming the files, instead of as "cannot listen".
  int port = 0;
  grpc::ServerBuilder probe;
  probe.AddListeningPort("127.0.0.1:0", creds, &port);
  std::unique_ptr<grpc::Server> server =
      creds != nullptr ? probe.BuildAndStart() : nullptr;
  if (server == nullptr || port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gRPC cannot serve TLS with ", cert_flag, " ", o.cert_file,
                     " and ", key_flag, " ", o.key_file,
                     " (does the key belong to the certificate?)"));
  }
  server->Shutdown(std::chrono::system_clock::now());
  return creds;
}

absl::StatusOr<ChannelSecurity> MakeChannelSecurity(const ClientTlsOptions& o) {
  const std::string ca_flag = Flag(o.flag_prefix, "ca_file");
  const std::string cert_flag = Flag(o.flag_prefix, "cert_file");
  const std::string key_flag = Flag(o.flag_prefix, "key_file");
  const std::string name_flag = Flag(o.flag_prefix, "server_name");
  ChannelSecurity out;
  out.tls = o.enabled || !o.ca_file.empty() || !o.cert_file.empty() ||
            !o.key_file.empty();
  if (!out.tls) {
    if (!o.server_name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_flag, " is set but TLS is off (set --",
                       o.flag_prefix, " or ", ca_flag, ")"));
    }
    out.credentials = grpc::InsecureChannelCredentials();
    return out;
  }
  if (o.cert_file.empty() != o.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mutual TLS needs both ", cert_flag, " and ", key_flag, "; only ",
        o.cert_file.empty() ? key_flag : cert_flag, " is set"));
  }
  grpc::SslCredentialsOptions ssl;
  if (!o.ca_file.empty()) {
    auto ca = ReadPemFile(ca_flag, o.ca_file, "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!o.cert_file.empty()) {
    auto cert = ReadPemFile(cert_flag, o.cert_file, "CERTIFICATE");
    if (!cert.ok()) return cert.status();
    auto key = ReadPemFile(key_flag, o.key_file, "PRIVATE KEY");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  out.credentials = grpc::SslCredentials(ssl);
  if (out.credentials == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gRPC rejected the TLS settings of --", o.flag_prefix, "_*"));
  }
  out.server_name = o.server_name;
  return out;
}

}  // namespace specserve
