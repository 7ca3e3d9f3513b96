#include "common/service/grpc_util.h"

#include <chrono>
#include <memory>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/service_type.h"
#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(StartGrpcServerTest, PortZeroBindsAFreePortThatAcceptsConnections) {
  grpc::Service service;
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer("127.0.0.1", 0, nullptr, &service, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_NE(*server, nullptr);
  EXPECT_GT(port, 0);

  std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  EXPECT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(10)));
  (*server)->Shutdown();
}

TEST(StartGrpcServerTest, AnAddressOfAnotherHostIsUnavailable) {
  grpc::Service service;
  int port = -1;
  // 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this host.
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer("192.0.2.1", 0, nullptr, &service, &port);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(server.status().message().find("192.0.2.1:0"),
            absl::string_view::npos)
      << server.status();
  EXPECT_EQ(port, -1);  // untouched on failure
}

}  // namespace
}  // namespace specserve
