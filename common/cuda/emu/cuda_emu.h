#ifndef SPECSERVE_COMMON_CUDA_EMU_CUDA_EMU_H_
#define SPECSERVE_COMMON_CUDA_EMU_CUDA_EMU_H_

// A CUDA device emulated on the CPU, for testing our kernels where no GPU
// is (CI, the build machines). The .cu sources are compiled as host C++
// with this header force-included (-include, -DSPECSERVE_CUDA_EMU; see
// emu.bzl) and linked against cuda_emu.cc instead of libcudart. Each CUDA
// thread of a block runs as a fiber (its own stack) on one OS thread;
// blocks run one after another. What this checks that a plain host port
// would not:
//   - __syncthreads / __syncwarp / shuffles are real barriers: a thread
//     only passes once every participant arrived, and a barrier that can
//     never complete (divergent __syncthreads, a warp collective with an
//     exited lane) fails the launch with a report instead of passing;
//   - warp collectives (shuffles, wmma, mma.sync, ldmatrix) exchange data
//     between lanes exactly as the PTX ISA lays their fragments out;
//   - cp.async copies land only at cp.async.wait_group, so a tile read
//     before its wait sees stale shared memory;
//   - launch limits (1,024 threads, 48 KiB of dynamic shared memory unless
//     cudaFuncSetAttribute raised it, 227 KiB at most), pointer checks on
//     cudaMemcpy, and the API calls CUDA forbids during stream capture;
//   - CUDA graphs record launches and copies with their arguments, and
//     replay them.
//   - launches alternate between running blocks, warps and lanes first to
//     last and last to first, and each block's dynamic shared memory
//     starts as 0xff bytes, so a read no barrier orders after another
//     thread's write sees the stale value in one of two launches;
//   - each allocation ends at a guard page: an access past it is an
//     illegal address, as on a device.
// What it does not check: timing, races between interleaved instructions
// of threads that run at once (a fiber runs until its next barrier), and
// floating-point results bit for bit (host libm, fp32 tensor-core sums in
// a different order).

// Before the toolkit's headers: they keep a definition made here.
#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace specserve {
namespace cuda_emu {

/// The calling CUDA thread's coordinates (only inside a kernel).
uint3 ThreadIdx();
uint3 BlockIdx();
dim3 BlockDim();
dim3 GridDim();
/// Linear thread index in the block: x + y * bx + z * bx * by.
int LinearThreadIdx();

/// __syncthreads(): waits for every thread of the block that has not
/// exited.
void SyncThreads();
/// __syncwarp(mask): waits for every lane in `mask`.
void SyncWarp(unsigned mask);
/// The warp collective under every shuffle and tensor-core instruction:
/// each lane in `mask` contributes `bytes` (<= 64) from `mine`; `all` gets
/// 32 slots of `bytes`, lane l's at all + l * bytes (slots of lanes outside
/// `mask` are zero).
void WarpExchange(const void* mine, void* all, size_t bytes, unsigned mask);
/// Records a kernel-side error (a shuffle reading a lane outside its
/// mask, ...): the launch fails with cudaErrorLaunchFailure.
void KernelError(const char* what);

/// The block's dynamic shared memory (extern __shared__), 128-byte aligned.
unsigned char* DynamicShared();

/// One launch's body: calls the kernel with its (copied) arguments.
using KernelBody = std::function<void()>;

/// Runs (or, on a capturing stream, records) `body` over `grid` x `block`.
/// Sets the error cudaGetLastError() returns: cudaErrorInvalidConfiguration
/// for a bad shape or too much shared memory, cudaErrorLaunchFailure when
/// the kernel deadlocked or reported an error.
void Submit(cudaStream_t stream, const void* fn, dim3 grid, dim3 block,
            size_t dynamic_smem, KernelBody body);

/// `kernel<<<grid, block, smem, stream>>>(args...)` as
/// Launch(kernel, grid, block, smem, stream)(args...): arguments are
/// converted to the kernel's parameter types and copied, as CUDA does.
template <typename... P>
struct Launcher {
  void (*fn)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <typename... A>
  void operator()(A&&... args) const {
    auto f = fn;
    std::tuple<std::decay_t<P>...> copied(std::forward<A>(args)...);
    Submit(stream, reinterpret_cast<const void*>(fn), grid, block, smem,
           [f, copied]() { std::apply(f, copied); });
  }
};
template <typename... P>
Launcher<P...> Launch(void (*fn)(P...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream) {
  return Launcher<P...>{fn, grid, block, smem, stream};
}

/// Runs `op` on `stream`: now, or into the graph the stream captures (the
/// emulated cuBLAS's GEMMs).
void EnqueueOnStream(cudaStream_t stream, std::function<void()> op);

inline int Lane() { return LinearThreadIdx() & 31; }

// A shuffle: the value of lane `src` (every lane of `mask` takes part).
template <typename T>
T ShuffleFrom(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "shuffles move 4- or 8-byte values");
  if (((mask >> src) & 1u) == 0) {
    KernelError("shuffle reads a lane outside its mask");
  }
  T all[32];
  WarpExchange(&v, all, sizeof(T), mask);
  return all[src];
}

}  // namespace cuda_emu
}  // namespace specserve

// cuda_runtime.h's typed overload, which it declares for nvcc only.
template <typename... P>
cudaError_t cudaFuncSetAttribute(void (*fn)(P...), cudaFuncAttribute attr,
                                 int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(fn), attr,
                                value);
}

#define threadIdx (::specserve::cuda_emu::ThreadIdx())
#define blockIdx (::specserve::cuda_emu::BlockIdx())
#define blockDim (::specserve::cuda_emu::BlockDim())
#define gridDim (::specserve::cuda_emu::GridDim())

inline void __syncthreads() { ::specserve::cuda_emu::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::specserve::cuda_emu::SyncWarp(mask);
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = ::specserve::cuda_emu::Lane();
  return ::specserve::cuda_emu::ShuffleFrom(
      mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = ::specserve::cuda_emu::Lane();
  int src = lane ^ lane_mask;
  if (src >= ((lane / width) + 1) * width) src = lane;
  return ::specserve::cuda_emu::ShuffleFrom(mask, v, src);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::specserve::cuda_emu::Lane();
  const int src = (lane % width) + static_cast<int>(delta) >= width
                      ? lane
                      : lane + static_cast<int>(delta);
  return ::specserve::cuda_emu::ShuffleFrom(mask, v, src);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::specserve::cuda_emu::Lane();
  const int d = static_cast<int>(delta);
  const int src = (lane % width) < d ? lane : lane - d;
  return ::specserve::cuda_emu::ShuffleFrom(mask, v, src);
}

// CUDA's global min / max overloads.
#define SPECSERVE_EMU_MINMAX(T)                  \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
SPECSERVE_EMU_MINMAX(int)
SPECSERVE_EMU_MINMAX(unsigned)
SPECSERVE_EMU_MINMAX(long)
SPECSERVE_EMU_MINMAX(unsigned long)
SPECSERVE_EMU_MINMAX(long long)
SPECSERVE_EMU_MINMAX(unsigned long long)
SPECSERVE_EMU_MINMAX(float)
SPECSERVE_EMU_MINMAX(double)
#undef SPECSERVE_EMU_MINMAX
inline unsigned min(int a, unsigned b) { return min(unsigned(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, unsigned(b)); }
inline unsigned max(int a, unsigned b) { return max(unsigned(a), b); }
inline unsigned max(unsigned a, int b) { return max(a, unsigned(b)); }

using std::isfinite;
using std::isinf;
using std::isnan;

// Device math the host libm lacks (the fast intrinsics as their accurate
// forms).
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
namespace specserve {
namespace cuda_emu {
template <typename To, typename From>
To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}
}  // namespace cuda_emu
}  // namespace specserve
inline unsigned __float_as_uint(float x) {
  return ::specserve::cuda_emu::BitCast<unsigned>(x);
}
inline float __uint_as_float(unsigned u) {
  return ::specserve::cuda_emu::BitCast<float>(u);
}
inline int __float_as_int(float x) {
  return ::specserve::cuda_emu::BitCast<int>(x);
}
inline float __int_as_float(int u) {
  return ::specserve::cuda_emu::BitCast<float>(u);
}

// ---------------------------------------------------------------------------
// nvcuda::wmma for 16x16x16 tiles. A fragment is warp-wide on the device
// with an unspecified per-lane layout; here every lane holds the whole tile
// in fp32 (exact for bf16 / fp16 inputs), and mma accumulates in fp32.
// ---------------------------------------------------------------------------
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int kRows = std::is_same<Use, matrix_b>::value ? K : M;
  static constexpr int kCols = std::is_same<Use, matrix_a>::value ? K : N;
  static constexpr int num_elements = kRows * kCols;
  float x[num_elements];
};

namespace internal {
template <typename T>
float ToFloat(T v) {
  return static_cast<float>(v);
}
}  // namespace internal

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, float v) {
  for (float& x : f.x) x = v;
}

template <typename Use, int M, int N, int K, typename T, typename Layout,
          typename P>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const P* p,
                      unsigned ld) {
  using Frag = fragment<Use, M, N, K, T, Layout>;
  ::specserve::cuda_emu::SyncWarp(0xffffffffu);  // warp-collective
  for (int r = 0; r < Frag::kRows; ++r) {
    for (int c = 0; c < Frag::kCols; ++c) {
      const P v = std::is_same<Layout, col_major>::value ? p[c * ld + r]
                                                         : p[r * ld + c];
      f.x[r * Frag::kCols + c] = internal::ToFloat(v);
    }
  }
}

template <int M, int N, int K, typename T>
void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, float>& f,
                       unsigned ld, layout_t layout) {
  ::specserve::cuda_emu::SyncWarp(0xffffffffu);
  if (::specserve::cuda_emu::Lane() == 0) {
    for (int r = 0; r < M; ++r) {
      for (int c = 0; c < N; ++c) {
        const float v = f.x[r * N + c];
        if (layout == mem_row_major) {
          p[r * ld + c] = static_cast<T>(v);
        } else {
          p[c * ld + r] = static_cast<T>(v);
        }
      }
    }
  }
  ::specserve::cuda_emu::SyncWarp(0xffffffffu);
}

template <int M, int N, int K, typename Ta, typename La, typename Tb,
          typename Lb>
void mma_sync(fragment<accumulator, M, N, K, float>& d,
              const fragment<matrix_a, M, N, K, Ta, La>& a,
              const fragment<matrix_b, M, N, K, Tb, Lb>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  ::specserve::cuda_emu::SyncWarp(0xffffffffu);
  float out[M * N];
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float s = c.x[i * N + j];
      for (int k = 0; k < K; ++k) s += a.x[i * K + k] * b.x[k * N + j];
      out[i * N + j] = s;
    }
  }
  std::memcpy(d.x, out, sizeof(out));
}
}  // namespace wmma
}  // namespace nvcuda

// ---------------------------------------------------------------------------
// flash_mma.cu's PTX wrappers (mma.sync m16n8k16, ldmatrix, cp.async) with
// the fragment layouts of the PTX ISA ("Matrix fragments for mma.m16n8k16
// with floating point type", "ldmatrix").
// ---------------------------------------------------------------------------
namespace specserve {
namespace cuda_emu {
/// Queues a 16-byte cp.async (zero-fill when !valid) for this thread.
void CpAsyncQueue(void* dst, const void* src, bool valid);
/// Closes this thread's open group of copies.
void CpAsyncCommitGroup();
/// Completes this thread's oldest groups until at most `pending` remain.
void CpAsyncWaitGroup(int pending);

template <typename T>
float Half16ToFloat(uint16_t bits) {
  T v;
  std::memcpy(&v, &bits, 2);
  return static_cast<float>(v);
}
}  // namespace cuda_emu

namespace cuda_kernels {

template <typename T>
void MmaM16n8k16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  struct Frag {
    uint32_t a[4];
    uint32_t b[2];
  };
  Frag mine{{a[0], a[1], a[2], a[3]}, {b0, b1}}, all[32];
  cuda_emu::WarpExchange(&mine, all, sizeof(Frag), 0xffffffffu);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    // a[r]: row g (+8 for r odd), cols 2t, 2t + 1 (+8 for r >= 2).
    for (int r = 0; r < 4; ++r) {
      const int row = g + ((r & 1) ? 8 : 0), col = 2 * t + ((r & 2) ? 8 : 0);
      A[row][col] = cuda_emu::Half16ToFloat<T>(all[l].a[r] & 0xffffu);
      A[row][col + 1] = cuda_emu::Half16ToFloat<T>(all[l].a[r] >> 16);
    }
    for (int r = 0; r < 2; ++r) {  // b[r]: k = 2t (+8 for r = 1), n = g
      const int k = 2 * t + 8 * r;
      B[k][g] = cuda_emu::Half16ToFloat<T>(all[l].b[r] & 0xffffu);
      B[k + 1][g] = cuda_emu::Half16ToFloat<T>(all[l].b[r] >> 16);
    }
  }
  const int lane = cuda_emu::Lane(), g = lane >> 2, t = lane & 3;
  // d[i]: row g (+8 for i >= 2), col 2t + (i & 1).
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[i] = s;
  }
}

// Lane l gives the row address of row l % 8 of matrix l / 8.
inline void LdMatrixX4Impl(uint32_t r[4], const void* row, bool trans) {
  const void* rows[32];
  cuda_emu::WarpExchange(&row, rows, sizeof(row), 0xffffffffu);
  const int lane = cuda_emu::Lane(), g = lane >> 2, t = lane & 3;
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (!trans) {  // row g, cols 2t and 2t + 1
      const uint16_t* p = static_cast<const uint16_t*>(rows[8 * j + g]);
      lo = p[2 * t];
      hi = p[2 * t + 1];
    } else {  // rows 2t and 2t + 1, col g
      lo = static_cast<const uint16_t*>(rows[8 * j + 2 * t])[g];
      hi = static_cast<const uint16_t*>(rows[8 * j + 2 * t + 1])[g];
    }
    r[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}
inline void LdMatrixX4(uint32_t r[4], const void* row) {
  LdMatrixX4Impl(r, row, false);
}
inline void LdMatrixX4Trans(uint32_t r[4], const void* row) {
  LdMatrixX4Impl(r, row, true);
}
inline void CpAsync16(void* dst, const void* src, bool valid) {
  cuda_emu::CpAsyncQueue(dst, src, valid);
}
inline void CpAsyncCommit() { cuda_emu::CpAsyncCommitGroup(); }
template <int kPending>
void CpAsyncWait() {
  cuda_emu::CpAsyncWaitGroup(kPending);
}

}  // namespace cuda_kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_CUDA_EMU_CUDA_EMU_H_
