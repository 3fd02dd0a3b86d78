// The dynamic shared-memory limit of a kernel, raised once per kernel and device.
//
// cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize) applies to the current device only: a kernel
// whose limit was raised on GPU 0 is still refused on GPU 1, and a process runs kernels on several GPUs whenever
// transformers spreads a model over them (device_map="auto"). So every kernel keeps one flag per device, and each
// launch checks the flag of the device it launches on (the caller's CUDAGuard makes it current). Setting the same
// limit twice is harmless, so two threads racing on one flag do no damage.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace zipkv::cuda {

inline constexpr int kMaxDevices = 64;

// One kernel's flags: done[d] once its limit is raised on device d.
using SmemFlags = std::atomic<bool>[kMaxDevices];

// The current device, checked against kMaxDevices (the size of every per-device table here).
inline int current_device_index() {
  const int device = c10::cuda::current_device();
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "zipkv: CUDA device ", device, " is past the ", kMaxDevices,
              " devices the kernels' per-device settings hold");
  return device;
}

// Raises kernel's limit to bytes on the current device unless done[device] says it is raised already.
template <typename Kernel>
void set_smem_limit(Kernel kernel, int bytes, SmemFlags& done) {
  std::atomic<bool>& flag = done[current_device_index()];
  if (flag.load(std::memory_order_acquire)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  flag.store(true, std::memory_order_release);
}

}  // namespace zipkv::cuda
