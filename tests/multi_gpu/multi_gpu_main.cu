// SPDX-License-Identifier: Apache-2.0
// doctest's main for multi-GPU tests: with fewer than two usable CUDA devices the program exits with
// 77, which CTest reports as skipped (SKIP_RETURN_CODE). `--one-gpu` runs them on a single GPU
// anyway (one NCCL rank: the wrappers and the single-rank paths, not a multi-GPU test).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool one_gpu = false;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--one-gpu") == 0) one_gpu = true;
    else args.push_back(argv[i]);
  }
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices < (one_gpu ? 1 : 2)) {
    std::printf("fewer than two usable CUDA devices (%d): skipping the multi-GPU tests\n", status == cudaSuccess ? devices : 0);
    return 77;
  }
  std::printf("multi-GPU tests on %d devices\n", devices);
  doctest::Context context(static_cast<int>(args.size()), args.data());
  return context.run();
}
