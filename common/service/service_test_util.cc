#include "common/service/service_test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"

namespace specserve {
namespace service_test {

bool Eventually(const std::function<bool()>& cond) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return cond();
}

double MetricValue(const std::string& text, const std::string& name,
                          const std::vector<std::string>& labels) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.rfind(name, 0) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : ' ';
    if (next != ' ' && next != '{') continue;
    bool all = true;
    for (const auto& l : labels) all &= line.find(l) != std::string::npos;
    if (all) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return std::nan("");
}

absl::StatusOr<std::string> RawCall(
    const std::shared_ptr<grpc::Channel>& ch, const std::string& method,
    const std::string& request) {
  grpc::GenericStub stub(ch);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto call = stub.PrepareCall(&ctx, method, &cq);
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::Status status;
  bool got = false;
  auto step = [&](intptr_t tag) {
    void* t;
    bool ok = false;
    cq.Next(&t, &ok);  // every op completes by the context deadline
    return ok && t == reinterpret_cast<void*>(tag);
  };
  call->StartCall(reinterpret_cast<void*>(1));
  if (step(1)) {
    call->Write(req, reinterpret_cast<void*>(2));
    step(2);
    call->WritesDone(reinterpret_cast<void*>(3));
    step(3);
    call->Read(&resp, reinterpret_cast<void*>(4));
    got = step(4);
  }
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  cq.Shutdown();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.error_message());
  }
  if (!got) return absl::InternalError("no response");
  std::vector<grpc::Slice> slices;
  resp.Dump(&slices);
  std::string out;
  for (const auto& sl : slices) {
    out.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return out;
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req =
        "GET " + path + " HTTP/1.0\r\nConnection: close\r\n\r\n";
    if (send(fd, req.data(), req.size(), 0) == ssize_t(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

}  // namespace service_test
}  // namespace specserve
