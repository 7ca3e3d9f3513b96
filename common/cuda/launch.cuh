#ifndef SPECSERVE_COMMON_CUDA_LAUNCH_CUH_
#define SPECSERVE_COMMON_CUDA_LAUNCH_CUH_

// Kernel launches and dynamic shared memory, spelled so the same .cu source
// also compiles as host C++ for the CPU emulation of the device
// (common/cuda/emu/cuda_emu.h, SPECSERVE_CUDA_EMU), where `<<<...>>>` and
// `extern __shared__` do not exist.
//
//   SPECSERVE_LAUNCH(grid, block, smem_bytes, stream, Kernel<T, D>)(args...)
//     is Kernel<T, D><<<grid, block, smem_bytes, stream>>>(args...); the
//     kernel comes last because its template arguments may hold commas.
//   SPECSERVE_DYNAMIC_SHARED(T, name);
//     declares `name` as the block's dynamic shared memory viewed as T[],
//     128-byte aligned.

#ifdef SPECSERVE_CUDA_EMU
#define SPECSERVE_LAUNCH(grid, block, smem, stream, ...) \
  ::specserve::cuda_emu::Launch(__VA_ARGS__, grid, block, smem, stream)
#define SPECSERVE_DYNAMIC_SHARED(T, name) \
  T* const name = reinterpret_cast<T*>(::specserve::cuda_emu::DynamicShared())
#else
#define SPECSERVE_LAUNCH(grid, block, smem, stream, ...) \
  __VA_ARGS__<<<grid, block, smem, stream>>>
#define SPECSERVE_DYNAMIC_SHARED(T, name) \
  extern __shared__ __align__(128) T name[]
#endif

#endif  // SPECSERVE_COMMON_CUDA_LAUNCH_CUH_
