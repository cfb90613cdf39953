// SPDX-License-Identifier: Apache-2.0
// STRIA_CUDA_CHECK and STRIA_NCCL_CHECK turn error codes into exceptions with the call and file:line.
// No GPU is needed: the checks only translate codes.
#include <doctest/doctest.h>

#include <string>

#include "stria/core/cuda_check.cuh"
#if defined(STRIA_TEST_NCCL)
#include "stria/core/nccl_check.cuh"
#endif

namespace {
cudaError_t fails_with_invalid_value() { return cudaErrorInvalidValue; }
}  // namespace

TEST_CASE("STRIA_CUDA_CHECK passes success through and throws cuda_error naming the call and location") {
  CHECK_NOTHROW(STRIA_CUDA_CHECK(cudaSuccess));
  const int line = __LINE__ + 2;
  try {
    STRIA_CUDA_CHECK(fails_with_invalid_value());
    FAIL("no exception");
  } catch (const stria::cuda_error& e) {
    CHECK(e.code() == static_cast<int>(cudaErrorInvalidValue));
    CHECK(e.call() == "fails_with_invalid_value()");
    CHECK(e.line() == static_cast<unsigned>(line));
    const std::string what = e.what();
    CHECK(what.find("cudaErrorInvalidValue") != std::string::npos);
    CHECK(what.find("test_cuda_check.cu:" + std::to_string(line)) != std::string::npos);
  }
}

#if defined(STRIA_TEST_NCCL)
TEST_CASE("STRIA_NCCL_CHECK throws nccl_error naming the call and the NCCL reason") {
  CHECK_NOTHROW(STRIA_NCCL_CHECK(ncclSuccess));
  try {
    STRIA_NCCL_CHECK(ncclInvalidArgument);
    FAIL("no exception");
  } catch (const stria::nccl_error& e) {
    CHECK(e.code() == static_cast<int>(ncclInvalidArgument));
    CHECK(e.call() == "ncclInvalidArgument");
    CHECK(std::string(e.what()).find("NCCL call `ncclInvalidArgument` failed") != std::string::npos);
  }
}
#endif
