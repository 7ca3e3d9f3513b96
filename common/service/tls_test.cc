#include "common/service/tls.h"

#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/service/service_test_util.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

using ::testing::HasSubstr;

// Certificates made once per test binary by tests/make_test_certs.sh
// (the openssl CLI) in the test's temporary directory.
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = new std::string(
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/tls_test_certs"));
    const std::string cmd =
        absl::StrCat("bash tests/make_test_certs.sh ", *dir_);
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  static std::string F(const std::string& name) {
    return absl::StrCat(*dir_, "/", name);
  }

  // Starts a server with only the standard health service on 127.0.0.1.
  void Serve(const ServerTlsOptions& options) {
    auto creds = MakeServerCredentials(options);
    ASSERT_TRUE(creds.ok()) << creds.status();
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", *creds, &port_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
  }

  // Health/Check through a channel built from `options` to `host`:port_.
  absl::Status Call(const ClientTlsOptions& options,
                    const std::string& host = "127.0.0.1") {
    auto sec = MakeChannelSecurity(options);
    if (!sec.ok()) return sec.status();
    grpc::ChannelArguments args;
    sec->Apply(&args);
    auto ch = grpc::CreateCustomChannel(absl::StrCat(host, ":", port_),
                                        sec->credentials, args);
    return service_test::RawCall(ch, "/grpc.health.v1.Health/Check", "")
        .status();
  }

  ServerTlsOptions ServerTls(bool mutual, bool require = true) {
    ServerTlsOptions o;
    o.cert_file = F("server.pem");
    o.key_file = F("server.key");
    if (mutual) o.client_ca_file = F("ca.pem");
    o.require_client_cert = require;
    return o;
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  static std::string* dir_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

std::string* TlsTest::dir_ = nullptr;

TEST_F(TlsTest, NothingSetIsPlaintext) {
  auto server = MakeServerCredentials({});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = MakeChannelSecurity({});
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_FALSE(client->tls);
  Serve({});
  EXPECT_TRUE(Call({}).ok());
}

TEST_F(TlsTest, MissingFileIsNotFoundNamingFlagAndPath) {
  ServerTlsOptions s = ServerTls(false);
  s.key_file = F("nope.key");
  absl::Status st = MakeServerCredentials(s).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("--tls_key_file"));
  EXPECT_THAT(std::string(st.message()), HasSubstr(F("nope.key")));

  ClientTlsOptions c;
  c.ca_file = F("missing_ca.pem");
  st = MakeChannelSecurity(c).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("--backend_tls_ca_file"));
  EXPECT_THAT(std::string(st.message()), HasSubstr(F("missing_ca.pem")));
}

TEST_F(TlsTest, IncompleteSettingsAreInvalidArgumentNamingTheFlags) {
  ServerTlsOptions s;
  s.key_file = F("server.key");
  absl::Status st = MakeServerCredentials(s).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("--tls_cert_file"));

  s = {};
  s.client_ca_file = F("ca.pem");
  st = MakeServerCredentials(s).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("--tls_client_ca_file"));

  s = {};
  s.cert_file = F("server.pem");
  st = MakeServerCredentials(s).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("--tls_key_file"));

  ClientTlsOptions c;
  c.cert_file = F("client.pem");
  st = MakeChannelSecurity(c).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("--backend_tls_key_file"));

  c = {};
  c.server_name = "specserve-internal";
  st = MakeChannelSecurity(c).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("--backend_tls_server_name"));
}

TEST_F(TlsTest, FilesWithoutPemBlocksAreInvalidArgument) {
  const std::string junk = F("junk.txt");
  std::ofstream(junk) << "not a certificate\n";
  ServerTlsOptions s = ServerTls(false);
  s.cert_file = junk;
  absl::Status st = MakeServerCredentials(s).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("--tls_cert_file"));
  EXPECT_THAT(std::string(st.message()), HasSubstr(junk));

  s = ServerTls(false);
  s.key_file = F("server.pem");  // a certificate where the key belongs
  st = MakeServerCredentials(s).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("PRIVATE KEY"));

  s = ServerTls(false);
  s.key_file = F("client.key");  // another certificate's key
  st = MakeServerCredentials(s).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr(F("client.key")));
  EXPECT_THAT(std::string(st.message()), HasSubstr("--tls_key_file"));

  const std::string encrypted = F("encrypted.key");
  std::ofstream(encrypted) << "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n"
                              "-----END ENCRYPTED PRIVATE KEY-----\n";
  s = ServerTls(false);
  s.key_file = encrypted;
  st = MakeServerCredentials(s).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("encrypted"));

  ClientTlsOptions c;
  c.ca_file = *dir_;  // a directory
  st = MakeChannelSecurity(c).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

TEST_F(TlsTest, TlsServerServesClientsThatTrustItsCa) {
  Serve(ServerTls(false));
  ClientTlsOptions c;
  c.ca_file = F("ca.pem");
  EXPECT_TRUE(Call(c).ok()) << Call(c);
  EXPECT_TRUE(Call(c, "localhost").ok()) << Call(c, "localhost");

  // A plaintext client and a client trusting another CA are refused.
  EXPECT_EQ(Call({}).code(), absl::StatusCode::kUnavailable);
  ClientTlsOptions wrong;
  wrong.ca_file = F("other_ca.pem");
  EXPECT_EQ(Call(wrong).code(), absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, ServerNameOverrideChecksTheCertificateName) {
  Serve(ServerTls(false));
  ClientTlsOptions c;
  c.ca_file = F("ca.pem");
  c.server_name = "specserve-internal";  // a SAN of server.pem
  EXPECT_TRUE(Call(c).ok()) << Call(c);
  c.server_name = "someone-else";
  EXPECT_EQ(Call(c).code(), absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, MutualTlsRefusesClientsWithoutATrustedCertificate) {
  Serve(ServerTls(/*mutual=*/true));
  ClientTlsOptions c;
  c.ca_file = F("ca.pem");
  EXPECT_EQ(Call(c).code(), absl::StatusCode::kUnavailable) << "no cert";
  c.cert_file = F("other_client.pem");
  c.key_file = F("other_client.key");
  EXPECT_EQ(Call(c).code(), absl::StatusCode::kUnavailable) << "other CA";
  c.cert_file = F("client.pem");
  c.key_file = F("client.key");
  EXPECT_TRUE(Call(c).ok()) << Call(c);
}

TEST_F(TlsTest, OptionalClientCertificateLetsAnonymousClientsIn) {
  Serve(ServerTls(/*mutual=*/true, /*require=*/false));
  ClientTlsOptions c;
  c.ca_file = F("ca.pem");
  EXPECT_TRUE(Call(c).ok()) << Call(c);
  c.cert_file = F("other_client.pem");  // sent, so verified, and refused
  c.key_file = F("other_client.key");
  EXPECT_EQ(Call(c).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace specserve
