// The emulated device against what CUDA specifies: kernels here are
// compiled as the project's .cu files are in emulation (cuda_emu.h
// force-included), launched through cuda_emu::Launch.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

using cuda_emu::Launch;

template <typename T>
T* DeviceAlloc(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T*>(p);
}

template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return h;
}

// Block sum of threadIdx.x: warp shuffles, then shared memory.
__global__ void BlockSumKernel(int* out) {
  __shared__ int partial[32];
  int v = static_cast<int>(threadIdx.x) + 1000 * static_cast<int>(blockIdx.x);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) s += partial[w];
    out[blockIdx.x] = s;
  }
}

TEST(CudaEmuTest, BarriersAndShufflesReduceABlock) {
  int* out = DeviceAlloc<int>(3);
  Launch(BlockSumKernel, dim3(3), dim3(256), 0, nullptr)(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<int> h = Download(out, 3);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(h[b], 255 * 256 / 2 + 256 * 1000 * b);
  cudaFree(out);
}

// Lane l of each warp writes the values the shuffle variants gave it.
__global__ void ShuffleKernel(int* out) {
  const int lane = threadIdx.x & 31;
  int* o = out + 4 * threadIdx.x;
  o[0] = __shfl_down_sync(0xffffffffu, lane, 3);
  o[1] = __shfl_up_sync(0xffffffffu, lane, 2, 16);
  o[2] = __shfl_sync(0xffffffffu, lane * 10, 5, 8);
  o[3] = __shfl_xor_sync(0xffffffffu, lane, 20, 16);
}

TEST(CudaEmuTest, ShuffleVariantsFollowTheirWidths) {
  int* out = DeviceAlloc<int>(4 * 64);
  Launch(ShuffleKernel, dim3(1), dim3(64), 0, nullptr)(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<int> h = Download(out, 4 * 64);
  for (int t = 0; t < 64; ++t) {
    const int l = t & 31;
    EXPECT_EQ(h[4 * t + 0], l + 3 < 32 ? l + 3 : l) << t;
    EXPECT_EQ(h[4 * t + 1], l % 16 < 2 ? l : l - 2) << t;
    EXPECT_EQ(h[4 * t + 2], ((l & ~7) + 5) * 10) << t;
    // A lane may read earlier 16-lane segments, not later ones.
    EXPECT_EQ(h[4 * t + 3], (l ^ 20) < (l / 16 + 1) * 16 ? l ^ 20 : l) << t;
  }
  cudaFree(out);
}

// Half a warp at __syncthreads, the other half at __syncwarp: no barrier
// can complete (a hang on a device).
__global__ void DeadlockKernel(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}

// A shuffle that waits for lanes that returned.
__global__ void ExitedLaneKernel(int* out) {
  if (threadIdx.x & 1) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 2);
}

TEST(CudaEmuTest, BarriersThatCannotCompleteFailTheLaunch) {
  int* out = DeviceAlloc<int>(64);
  Launch(DeadlockKernel, dim3(1), dim3(64), 0, nullptr)(out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  Launch(ExitedLaneKernel, dim3(1), dim3(32), 0, nullptr)(out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  // The failure is sticky, as a device's context error: cudaDeviceReset
  // clears it.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  ASSERT_EQ(cudaDeviceReset(), cudaSuccess);
  Launch(BlockSumKernel, dim3(1), dim3(64), 0, nullptr)(out);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(out);
}

__global__ void FillSharedKernel(unsigned char* out, int bytes) {
  unsigned char* smem = cuda_emu::DynamicShared();
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) smem[i] = 7;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = smem[bytes - 1];
}

// A race: each thread writes its slot of dynamic shared memory, then,
// with no __syncthreads between, reads its neighbours' (the next lane's and
// the next warp's). What it reads depends on who ran first; the first
// word of each block reports what the block found there before writing.
__global__ void RacyNeighbourKernel(int* out) {
  int* smem = reinterpret_cast<int*>(cuda_emu::DynamicShared());
  const int t = threadIdx.x, n = blockDim.x;
  const int before = smem[t];
  smem[t] = t;
  out[blockIdx.x * 3 * n + 3 * t] = smem[(t + 1) % n];
  out[blockIdx.x * 3 * n + 3 * t + 1] = smem[(t + 32) % n];
  out[blockIdx.x * 3 * n + 3 * t + 2] = before;
}

// Launches alternate between running blocks, warps and lanes first to last
// and last to first, so a race reads the stale value in one of two
// consecutive launches; each block's dynamic shared memory starts as 0xff
// bytes, not as the last block's.
TEST(CudaEmuTest, RacesShowUnderOneOfTwoOrdersAndSharedMemoryStartsPoisoned) {
  if (const char* o = std::getenv("SPECSERVE_CUDA_EMU_ORDER");
      o != nullptr && std::string(o) != "alternate") {
    GTEST_SKIP() << "SPECSERVE_CUDA_EMU_ORDER=" << o;
  }
  const int n = 64, blocks = 2;
  int* out = DeviceAlloc<int>(blocks * 3 * n);
  std::vector<std::vector<int>> runs;
  for (int launch = 0; launch < 2; ++launch) {
    Launch(RacyNeighbourKernel, dim3(blocks), dim3(n), n * sizeof(int),
           nullptr)(out);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    runs.push_back(Download(out, blocks * 3 * n));
  }
  int stale_next[2] = {0, 0}, stale_warp[2] = {0, 0};
  for (int r = 0; r < 2; ++r) {
    for (int b = 0; b < blocks; ++b) {
      for (int t = 0; t < n; ++t) {
        const int* o = &runs[r][(b * n + t) * 3];
        EXPECT_EQ(o[2], -1) << "block " << b << " thread " << t;
        // Either the neighbour's value or the poison: nothing else.
        EXPECT_TRUE(o[0] == (t + 1) % n || o[0] == -1) << o[0];
        EXPECT_TRUE(o[1] == (t + 32) % n || o[1] == -1) << o[1];
        stale_next[r] += o[0] == -1;
        stale_warp[r] += o[1] == -1;
      }
    }
  }
  // Each order leaves some reads stale, and the two orders leave different
  // ones stale.
  EXPECT_GT(stale_next[0], 0);
  EXPECT_GT(stale_next[1], 0);
  EXPECT_GT(stale_warp[0], 0);
  EXPECT_GT(stale_warp[1], 0);
  EXPECT_NE(runs[0], runs[1]);
  cudaFree(out);
}

// Writes x[i] = i for i < n: n past the allocation's end is a bug.
__global__ void WriteIndicesKernel(int* x, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = i;
}

// Reads x[at] into out[0].
__global__ void ReadAtKernel(const int* x, long long at, int* out) {
  if (threadIdx.x == 0) out[0] = x[at];
}

// An allocation ends at a guard page (its size rounded up to 256 bytes):
// a kernel that writes into the rounding slack fails the launch with
// cudaErrorIllegalAddress, as a device would for an illegal address, and
// one that reaches past the slack dies naming the allocation and the
// kernel's block and thread.
TEST(CudaEmuTest, AccessesPastAnAllocationAreIllegalAddresses) {
  int* x = DeviceAlloc<int>(10);  // 40 bytes: 216 bytes of slack
  Launch(WriteIndicesKernel, dim3(1), dim3(32), 0, nullptr)(x, 10);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  Launch(WriteIndicesKernel, dim3(1), dim3(32), 0, nullptr)(x, 11);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);  // sticky
  ASSERT_EQ(cudaDeviceReset(), cudaSuccess);
  // Reported once: the next good launch succeeds.
  Launch(WriteIndicesKernel, dim3(1), dim3(32), 0, nullptr)(x, 10);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaFree(x);

  int* y = DeviceAlloc<int>(64);  // 256 bytes: no slack
  int* out = DeviceAlloc<int>(1);
  Launch(ReadAtKernel, dim3(1), dim3(32), 0, nullptr)(y, 63, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_DEATH(
      {
        Launch(ReadAtKernel, dim3(1), dim3(32), 0, nullptr)(y, 64, out);
      },
      "illegal address: byte 256 of a 256-byte device allocation \\(past "
      "its end\\) in kernel .*, block \\(0,0,0\\), thread 0");
  cudaFree(y);
  cudaFree(out);
}

TEST(CudaEmuTest, LaunchLimitsAreADevicesLimits) {
  unsigned char* out = DeviceAlloc<unsigned char>(1);
  const int big = 64 << 10;
  Launch(FillSharedKernel, dim3(1), dim3(128), big, nullptr)(out, big);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);  // > 48 KiB
  ASSERT_EQ(
      cudaFuncSetAttribute(reinterpret_cast<const void*>(&FillSharedKernel),
                           cudaFuncAttributeMaxDynamicSharedMemorySize, big),
      cudaSuccess);
  Launch(FillSharedKernel, dim3(1), dim3(128), big, nullptr)(out, big);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(Download(out, 1)[0], 7);
  Launch(FillSharedKernel, dim3(1), dim3(2048), 0, nullptr)(out, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  Launch(FillSharedKernel, dim3(1, 70000), dim3(32), 0, nullptr)(out, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  cudaFree(out);
}

uint16_t Bf16Bits(float x) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  uint16_t u;
  std::memcpy(&u, &b, 2);
  return u;
}

// One warp: D[16][16] = A[16][16] B[16][16], A row-major, B row-major
// [k][n], through ldmatrix (A), ldmatrix.trans (B) and two m16n8k16 MMAs;
// and the same B built by hand from the PTX ISA's B-fragment layout.
__global__ void MmaKernel(const uint16_t* a, const uint16_t* b, float* d,
                          float* d_manual) {
  __shared__ uint16_t as[16 * 16], bs[16 * 16];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) {
    as[i] = a[i];
    bs[i] = b[i];
  }
  __syncwarp();
  uint32_t af[4], bf[4];
  // A: matrices (rows 0-7, cols 0-7), (rows 8-15, 0-7), (0-7, 8-15),
  // (8-15, 8-15); lane l addresses row l % 8 of matrix l / 8.
  const int m = lane / 8, r = lane % 8;
  cuda_kernels::LdMatrixX4(af, &as[(r + 8 * (m & 1)) * 16 + 8 * (m >> 1)]);
  // B^T tiles via .trans: matrices (k 0-7, n 0-7), (k 8-15, n 0-7),
  // (k 0-7, n 8-15), (k 8-15, n 8-15).
  cuda_kernels::LdMatrixX4Trans(bf, &bs[(r + 8 * (m & 1)) * 16 + 8 * (m >> 1)]);
  const int g = lane >> 2, t = lane & 3;
  for (int nt = 0; nt < 2; ++nt) {
    float acc[4] = {0, 0, 0, 0};
    cuda_kernels::MmaM16n8k16<__nv_bfloat16>(acc, af, bf[2 * nt],
                                             bf[2 * nt + 1]);
    float man[4] = {0, 0, 0, 0};
    uint32_t b0 = 0, b1 = 0;
    const int n = 8 * nt + g;
    b0 = b[(2 * t) * 16 + n] | (uint32_t(b[(2 * t + 1) * 16 + n]) << 16);
    b1 = b[(2 * t + 8) * 16 + n] | (uint32_t(b[(2 * t + 9) * 16 + n]) << 16);
    cuda_kernels::MmaM16n8k16<__nv_bfloat16>(man, af, b0, b1);
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = 8 * nt + 2 * t + (i & 1);
      d[row * 16 + col] = acc[i];
      d_manual[row * 16 + col] = man[i];
    }
  }
}

TEST(CudaEmuTest, LdmatrixAndMmaFollowThePtxFragmentLayouts) {
  std::vector<uint16_t> a(256), b(256);
  std::vector<float> af(256), bf(256);
  for (int i = 0; i < 256; ++i) {
    af[i] = static_cast<float>((i * 7) % 13) - 6.0f;
    bf[i] = static_cast<float>((i * 5) % 11) * 0.5f - 2.0f;
    a[i] = Bf16Bits(af[i]);
    b[i] = Bf16Bits(bf[i]);
  }
  uint16_t* da = DeviceAlloc<uint16_t>(256);
  uint16_t* db = DeviceAlloc<uint16_t>(256);
  float* dd = DeviceAlloc<float>(256);
  float* dm = DeviceAlloc<float>(256);
  cudaMemcpy(da, a.data(), 512, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), 512, cudaMemcpyHostToDevice);
  Launch(MmaKernel, dim3(1), dim3(32), 0, nullptr)(da, db, dd, dm);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> d = Download(dd, 256), man = Download(dm, 256);
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      float want = 0;
      for (int k = 0; k < 16; ++k) want += af[i * 16 + k] * bf[k * 16 + j];
      EXPECT_EQ(d[i * 16 + j], want) << i << "," << j;
      EXPECT_EQ(man[i * 16 + j], want) << i << "," << j;
    }
  }
  for (void* p : {static_cast<void*>(da), static_cast<void*>(db),
                  static_cast<void*>(dd), static_cast<void*>(dm)}) {
    cudaFree(p);
  }
}

// A 16x16x16 wmma product, B loaded column-major.
__global__ void WmmaKernel(const __nv_bfloat16* a, const __nv_bfloat16* bt,
                           float* d) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 1.0f);
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, bt, 16);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(d, acc, 16, wmma::mem_row_major);
}

TEST(CudaEmuTest, WmmaComputesAPlusOne) {
  std::vector<__nv_bfloat16> a(256), bt(256);
  std::vector<float> af(256), btf(256);
  for (int i = 0; i < 256; ++i) {
    af[i] = static_cast<float>(i % 5) - 2.0f;
    btf[i] = static_cast<float>(i % 7) - 3.0f;
    a[i] = __float2bfloat16_rn(af[i]);
    bt[i] = __float2bfloat16_rn(btf[i]);
  }
  auto* da = DeviceAlloc<__nv_bfloat16>(256);
  auto* db = DeviceAlloc<__nv_bfloat16>(256);
  float* dd = DeviceAlloc<float>(256);
  cudaMemcpy(da, a.data(), 512, cudaMemcpyHostToDevice);
  cudaMemcpy(db, bt.data(), 512, cudaMemcpyHostToDevice);
  Launch(WmmaKernel, dim3(1), dim3(32), 0, nullptr)(da, db, dd);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> d = Download(dd, 256);
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      float want = 1.0f;  // column-major B: B[k][j] = bt[j * 16 + k]
      for (int k = 0; k < 16; ++k) want += af[i * 16 + k] * btf[j * 16 + k];
      EXPECT_EQ(d[i * 16 + j], want);
    }
  }
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
}

// Each thread copies 16 bytes with cp.async and reads its destination
// before and after the wait; a second copy is zero-filled.
__global__ void CpAsyncKernel(const uint32_t* src, uint32_t* before,
                              uint32_t* after, uint32_t* zeroed) {
  __shared__ uint32_t tile[32 * 4], other[32 * 4];
  const int t = threadIdx.x;
  for (int i = 0; i < 4; ++i) {
    tile[4 * t + i] = 0;
    other[4 * t + i] = 0xffffffffu;
  }
  cuda_kernels::CpAsync16(&tile[4 * t], &src[4 * t], true);
  cuda_kernels::CpAsync16(&other[4 * t], &src[4 * t], false);
  cuda_kernels::CpAsyncCommit();
  before[t] = tile[4 * t];
  cuda_kernels::CpAsyncWait<0>();
  after[t] = tile[4 * t];
  zeroed[t] = other[4 * t];
}

TEST(CudaEmuTest, CpAsyncLandsAtItsWait) {
  std::vector<uint32_t> src(128);
  for (int i = 0; i < 128; ++i) src[i] = 100 + i;
  uint32_t* d_src = DeviceAlloc<uint32_t>(128);
  uint32_t* before = DeviceAlloc<uint32_t>(32);
  uint32_t* after = DeviceAlloc<uint32_t>(32);
  uint32_t* zeroed = DeviceAlloc<uint32_t>(32);
  cudaMemcpy(d_src, src.data(), 512, cudaMemcpyHostToDevice);
  Launch(CpAsyncKernel, dim3(1), dim3(32), 0, nullptr)(d_src, before, after,
                                                       zeroed);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto b = Download(before, 32), a = Download(after, 32),
             z = Download(zeroed, 32);
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(b[t], 0u) << "read before the wait sees the old tile";
    EXPECT_EQ(a[t], src[4 * t]);
    EXPECT_EQ(z[t], 0u);
  }
  for (void* p : {static_cast<void*>(d_src), static_cast<void*>(before),
                  static_cast<void*>(after), static_cast<void*>(zeroed)}) {
    cudaFree(p);
  }
}

__global__ void AddKernel(int* x, int v) { x[threadIdx.x] += v; }

TEST(CudaEmuTest, GraphsRecordLaunchesAndCopiesAndReplayThem) {
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  int* x = DeviceAlloc<int>(4);
  int* y = DeviceAlloc<int>(4);
  ASSERT_EQ(cudaMemset(x, 0, 16), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal),
            cudaSuccess);
  Launch(AddKernel, dim3(1), dim3(4), 0, s)(x, 5);
  ASSERT_EQ(cudaMemcpyAsync(y, x, 16, cudaMemcpyDeviceToDevice, s),
            cudaSuccess);
  // (A synchronous copy is forbidden during capture; device memory is host
  // memory in the emulator.)
  EXPECT_EQ(x[0], 0) << "captured work does not run";
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(Download(x, 4), std::vector<int>(4, 10));
  EXPECT_EQ(Download(y, 4), std::vector<int>(4, 10));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  // What CUDA forbids during capture fails and invalidates it.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal),
            cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 64), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  cudaGetLastError();
  cudaFree(x);
  cudaFree(y);
  cudaStreamDestroy(s);
}

TEST(CudaEmuTest, CopiesOutsideAnAllocationAreRejected) {
  int* x = DeviceAlloc<int>(4);
  std::vector<int> h(8);
  EXPECT_EQ(cudaMemcpy(h.data(), x, 32, cudaMemcpyDeviceToHost),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(x, h.data(), 16, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), h.data() + 4, 16, cudaMemcpyDeviceToHost),
            cudaErrorInvalidValue);
  cudaGetLastError();
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  cudaGetLastError();
  cudaFree(x);
}

}  // namespace
}  // namespace specserve
