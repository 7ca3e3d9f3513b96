// --device flag parsing and the GPU probe. Runs everywhere (no GPU needed).

#include "common/cuda/device.h"

#include <string>

#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(ParseDeviceTest, DefaultIsCudaOnlyWhenAGpuIsPresent) {
  for (const std::string flag : {"", "auto"}) {
    absl::StatusOr<DeviceKind> with_gpu = ParseDevice(flag, true);
    ASSERT_TRUE(with_gpu.ok()) << with_gpu.status();
    EXPECT_EQ(*with_gpu, DeviceKind::kCuda) << flag;
    absl::StatusOr<DeviceKind> without = ParseDevice(flag, false);
    ASSERT_TRUE(without.ok()) << without.status();
    EXPECT_EQ(*without, DeviceKind::kCpu) << flag;
  }
}

TEST(ParseDeviceTest, ExplicitChoices) {
  EXPECT_EQ(*ParseDevice("cpu", true), DeviceKind::kCpu);
  EXPECT_EQ(*ParseDevice("cpu", false), DeviceKind::kCpu);
  EXPECT_EQ(*ParseDevice("cuda", true), DeviceKind::kCuda);
  EXPECT_EQ(*ParseDevice("gpu", true), DeviceKind::kCuda);
}

TEST(ParseDeviceTest, CudaWithoutGpuIsAPreconditionFailure) {
  absl::StatusOr<DeviceKind> kind = ParseDevice("cuda", false);
  ASSERT_FALSE(kind.ok());
  EXPECT_EQ(kind.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(kind.status().message().find("--device=cpu"), std::string::npos)
      << kind.status();
}

TEST(ParseDeviceTest, UnknownValuesAreRejectedByName) {
  for (const std::string flag : {"tpu", "CUDA", "cuda:0", " cpu"}) {
    absl::StatusOr<DeviceKind> kind = ParseDevice(flag, true);
    ASSERT_FALSE(kind.ok()) << flag;
    EXPECT_EQ(kind.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(kind.status().message().find("\"" + flag + "\""),
              std::string::npos)
        << kind.status();
  }
}

TEST(DeviceKindNameTest, Names) {
  EXPECT_EQ(DeviceKindName(DeviceKind::kCpu), "cpu");
  EXPECT_EQ(DeviceKindName(DeviceKind::kCuda), "cuda");
}

// The probe must not abort or throw on a machine without a driver, and its
// answer must agree with the description and be stable.
TEST(CudaAvailableTest, ProbeIsSafeAndConsistent) {
  const bool available = CudaAvailable();
  EXPECT_EQ(CudaAvailable(), available);
  const std::string description = CudaDeviceDescription();
  EXPECT_FALSE(description.empty());
  EXPECT_EQ(description.rfind("no CUDA device", 0) == 0, !available)
      << description;
  absl::StatusOr<DeviceKind> kind = ParseDevice("", available);
  ASSERT_TRUE(kind.ok());
  EXPECT_EQ(*kind, available ? DeviceKind::kCuda : DeviceKind::kCpu);
}

}  // namespace
}  // namespace specserve
