// SPDX-License-Identifier: Apache-2.0
// Benchmark (a program, not a test): how fast L2 can fill shared memory on every SM at once, the
// bound of a forward whose CTAs each load their own K and V tiles (RESULTS, 2026-12-04, sixth: the
// vs95 forward at 71% of ncu's L2 throughput). Each CTA copies 16 KiB tiles shaped like the forward's
// (64 rows of 256 bytes, 512 bytes apart: K or V at head dim 128 with two KV heads) into a ring of
// shared-memory stages, `stages` tiles in flight, walking a pseudo-random sequence of tiles of a
// buffer that L2 holds (or, for the DRAM row, does not). No consumer: a stage is free again once its
// copy has landed, so the figure is what the copies alone can draw. Methods:
//   cp_async   128 threads per CTA, 16-byte cp.async.cg each (the forward's copiers), one commit group
//              per tile;
//   bulk_rows  one warp per CTA issues a tile as 64 cp.async.bulk row copies of 256 bytes that
//              complete the stage's mbarrier by bytes (a TMA-style bulk path for a block tile);
//   bulk_tile  one warp issues each tile as one contiguous 16 KiB cp.async.bulk (the bulk path's
//              upper bound: a tile that were contiguous in memory);
//   tma        one thread issues each tile as two TMA copies (cp.async.bulk.tensor, a tensor map over
//              [tokens, 2 heads, 128] with boxes of 64 tokens x 64 elements and the 128-byte swizzle:
//              exactly the forward's swizzled slabs), completing the stage's mbarrier by bytes.
// Time: CUDA events, median of --repeats after a warm-up; bytes are the tiles' bytes (16 KiB each).
// Every copy lands in shared memory and the last tile's first word is checked against the buffer.
//   l2_bench [--repeats 5] [--json FILE --commit SHA]
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cuda_bf16.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include "args.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/kernel/pipeline.cuh"
#include "timing.cuh"

namespace {

using namespace stria;
namespace kd = stria::kernel::detail;

constexpr int tile_rows = 64;
constexpr int row_bytes = 256;        // one head's row at D 128, bf16
constexpr int row_stride = 512;       // two KV heads per token
constexpr int tile_bytes = tile_rows * row_bytes;
constexpr int block_bytes = tile_rows * row_stride;  // a 64-token block of both heads: two tiles

enum class method { cp_async, bulk_rows, bulk_tile, tma };
const char* name_of(method m) {
  return m == method::cp_async ? "cp_async" : m == method::bulk_rows ? "bulk_rows" : m == method::bulk_tile ? "bulk_tile" : "tma";
}

/// Tile i of CTA c's walk: a block of the buffer and one of its two heads (a multiplicative hash of (c, i), two mixing rounds).
__host__ __device__ inline std::int64_t tile_offset(std::uint64_t cta, std::uint64_t i, std::int64_t blocks, bool contiguous) {
  std::uint64_t h = (cta * 0x100000001b3ULL + i + 1) * 0x9e3779b97f4a7c15ULL;
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 29;
  const auto block = static_cast<std::int64_t>(h % static_cast<std::uint64_t>(blocks));
  return block * block_bytes + (contiguous ? 0 : static_cast<std::int64_t>((h >> 40) & 1) * row_bytes);
}

__device__ inline void expect_bytes(std::uint64_t* barrier, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(kd::shared_address(barrier)), "r"(bytes) : "memory");
#endif
}

__device__ inline void bulk_copy(void* shared, const void* global, unsigned bytes, std::uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(kd::shared_address(shared)),
               "l"(global), "r"(bytes), "r"(kd::shared_address(barrier))
               : "memory");
#endif
}

/// A TMA copy of one box (64 elements x 1 head x 64 tokens) at element `column`, head `head`, token `token`.
__device__ inline void tma_copy(void* shared, const CUtensorMap* map, int column, int head, int token, std::uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          kd::shared_address(shared)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(column), "r"(head), "r"(token), "r"(kd::shared_address(barrier))
      : "memory");
#endif
}

template <method M, int Stages>
__global__ void __launch_bounds__(128) copy_tiles(const unsigned char* buffer, std::int64_t blocks, int tiles, unsigned* first_words,
                                                  const __grid_constant__ CUtensorMap map) {
  // The stages, then their barriers; no static shared memory, so the block starts 1024-byte aligned
  // (the 128-byte swizzle's period, which the TMA copies' layout assumes; checked).
  extern __shared__ __align__(1024) unsigned char stages[];
  auto* full = reinterpret_cast<std::uint64_t*>(stages + Stages * tile_bytes);
  if (kd::shared_address(stages) % 1024 != 0) __trap();
  const auto cta = static_cast<std::uint64_t>(blockIdx.x);
  if constexpr (M == method::cp_async) {
    const int r = static_cast<int>(threadIdx.x) / 16, c = static_cast<int>(threadIdx.x) % 16;  // 8 rows of 16 chunks per pass
    for (int t = 0; t < tiles; ++t) {
      const unsigned char* from = buffer + tile_offset(cta, static_cast<std::uint64_t>(t), blocks, false);
      unsigned char* to = stages + (t % Stages) * tile_bytes;
#pragma unroll
      for (int pass = 0; pass < tile_rows / 8; ++pass) {
        const int row = r + 8 * pass;
        kd::cp_async_16(to + row * row_bytes + c * 16, from + row * row_stride + c * 16, true);
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
      asm volatile("cp.async.wait_group %0;\n" ::"n"(Stages - 1) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
  } else {
    if (threadIdx.x == 0) {
      for (int s = 0; s < Stages; ++s) kd::barrier_init(&full[s], 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // the initialised barriers, visible to the bulk copies
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      const int lane = static_cast<int>(threadIdx.x);
      for (int t = 0; t < tiles; ++t) {
        const int s = t % Stages;
        if (t >= Stages) kd::barrier_wait(&full[s], static_cast<unsigned>((t / Stages - 1) % 2));  // tile t - Stages has landed
        const unsigned char* from = buffer + tile_offset(cta, static_cast<std::uint64_t>(t), blocks, M == method::bulk_tile);
        unsigned char* to = stages + s * tile_bytes;
        if (lane == 0) expect_bytes(&full[s], tile_bytes);
        __syncwarp();
        if constexpr (M == method::tma) {
          if (lane == 0) {  // the tile's block and head from its byte offset; two 64-element slabs of 8 KiB
            const std::int64_t offset = tile_offset(cta, static_cast<std::uint64_t>(t), blocks, false);
            const int token = static_cast<int>(offset / block_bytes) * tile_rows, head = static_cast<int>(offset % block_bytes) / row_bytes;
            tma_copy(to, &map, 0, head, token, &full[s]);
            tma_copy(to + tile_bytes / 2, &map, 64, head, token, &full[s]);
          }
        } else if constexpr (M == method::bulk_rows) {
          bulk_copy(to + lane * row_bytes, from + lane * row_stride, row_bytes, &full[s]);
          bulk_copy(to + (lane + 32) * row_bytes, from + (lane + 32) * row_stride, row_bytes, &full[s]);
        } else if (lane == 0) {
          bulk_copy(to, from, tile_bytes, &full[s]);
        }
      }
      for (int t = tiles > Stages ? tiles - Stages : 0; t < tiles; ++t) kd::barrier_wait(&full[t % Stages], static_cast<unsigned>((t / Stages) % 2));
    }
    __syncthreads();
  }
  // The last tile's first word, for the host to compare with the buffer.
  if (threadIdx.x == 0 && tiles > 0) first_words[blockIdx.x] = *reinterpret_cast<const unsigned*>(stages + ((tiles - 1) % Stages) * tile_bytes);
}

/// The buffer as a tensor [tokens][2 heads][128 elements] of 2-byte elements, boxes of 64 elements x
/// 1 head x 64 tokens with the 128-byte swizzle (cuTensorMapEncodeTiled through the runtime's driver
/// entry point: no link against libcuda).
CUtensorMap tensor_map(const void* base, std::size_t bytes) {
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found{};
  STRIA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || entry == nullptr) throw std::runtime_error("cuTensorMapEncodeTiled: not found in the driver");
  const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  CUtensorMap map{};
  const cuuint64_t dims[3] = {row_bytes / 2, row_stride / row_bytes, bytes / row_stride};
  const cuuint64_t strides[2] = {row_bytes, row_stride};  // bytes, of dims 1 and 2
  const cuuint32_t box[3] = {64, 1, tile_rows}, element_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw std::runtime_error("cuTensorMapEncodeTiled failed: CUresult " + std::to_string(static_cast<int>(r)));
  return map;
}

struct row {
  method how;
  int ctas_per_sm, stages;
  double buffer_mib, tb_per_s;
};

template <method M, int Stages>
bool run(std::vector<row>& rows, const device_buffer<unsigned char>& buffer, const std::vector<unsigned char>& host, const CUtensorMap& map,
         int ctas_per_sm, int sms, int repeats) {
  const std::size_t bytes = host.size();
  const std::size_t shared = static_cast<std::size_t>(Stages) * (tile_bytes + sizeof(std::uint64_t));
  auto kernel = copy_tiles<M, Stages>;
  STRIA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  int fit = 0;
  STRIA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, 128, shared));
  if (fit < ctas_per_sm) {
    std::printf("%-10s %2d CTAs/SM %2d stages  skipped: %d CTAs of %zu KiB fit an SM\n", name_of(M), ctas_per_sm, Stages, fit, shared >> 10);
    return false;
  }
  const int grid = sms * ctas_per_sm, tiles = 4096 / ctas_per_sm;  // the same bytes per SM in every row
  const auto blocks = static_cast<std::int64_t>(bytes / block_bytes);
  device_buffer<unsigned> words(static_cast<std::size_t>(grid));
  const double ms = bench::median_ms(repeats, [&] {
    kernel<<<grid, 128, shared>>>(buffer.data(), blocks, tiles, words.data(), map);
    STRIA_CUDA_CHECK_LAUNCH("copy_tiles");
  });
  // Check: each CTA's last tile landed (its first word equals the buffer's at that tile).
  std::vector<unsigned> got(static_cast<std::size_t>(grid));
  STRIA_CUDA_CHECK(cudaMemcpy(got.data(), words.data(), got.size() * sizeof(unsigned), cudaMemcpyDeviceToHost));
  for (int c = 0; c < grid; ++c) {
    const std::int64_t offset = tile_offset(static_cast<std::uint64_t>(c), static_cast<std::uint64_t>(tiles - 1), blocks, M == method::bulk_tile);
    unsigned want = 0;
    std::memcpy(&want, host.data() + offset, sizeof want);
    if (got[static_cast<std::size_t>(c)] != want) {
      std::fprintf(stderr, "%s: CTA %d's last tile did not land (0x%08x, want 0x%08x)\n", name_of(M), c, got[static_cast<std::size_t>(c)], want);
      std::exit(1);
    }
  }
  const double moved = double(grid) * tiles * tile_bytes;
  rows.push_back({M, ctas_per_sm, Stages, double(bytes) / (1 << 20), moved / (ms * 1e-3) / 1e12});
  std::printf("%-10s %2d CTAs/SM %2d stages  %7.0f MiB  %6.2f TB/s\n", name_of(M), ctas_per_sm, Stages, double(bytes) / (1 << 20),
              rows.back().tb_per_s);
  return true;
}

}  // namespace

int main(int argc, char** argv) try {
  int repeats = 5;
  std::string json_path, commit = "unknown";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw stria::invalid_argument(flag, "(no value)", "every option takes a value: [--repeats N] [--json FILE --commit SHA]");
    const std::string value = argv[++i];
    if (flag == "--repeats") repeats = stria::cli::parse_integer<int>(flag, value, 1, 1000);
    else if (flag == "--json") json_path = value;
    else if (flag == "--commit") commit = value;
    else throw stria::invalid_argument("option", flag, "is not known: [--repeats N] [--json FILE --commit SHA]");
  }
  cudaDeviceProp prop{};
  STRIA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 9) {
    std::fprintf(stderr, "l2_bench: needs an sm_90 device (cp.async.bulk); this is sm_%d%d\n", prop.major, prop.minor);
    return 77;
  }
  std::printf("l2_bench on %s: %d SMs, L2 %d MiB; 16 KiB tiles (64 rows of 256 B, 512 B apart), median of %d\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, repeats);
  std::vector<row> rows;
  for (const std::size_t mib : {std::size_t{16}, std::size_t{32}, std::size_t{4096}}) {
    const std::size_t bytes = mib << 20;
    device_buffer<unsigned char> buffer(bytes);
    stria::bench::fill_random<><<<2048, 256>>>(reinterpret_cast<__nv_bfloat16*>(buffer.data()), static_cast<std::int64_t>(bytes / 2), 7 + mib, 1.0f);
    STRIA_CUDA_CHECK_LAUNCH("fill_random");
    std::vector<unsigned char> host(bytes);  // what every tile must land as
    STRIA_CUDA_CHECK(cudaMemcpy(host.data(), buffer.data(), bytes, cudaMemcpyDeviceToHost));
    const CUtensorMap map = tensor_map(buffer.data(), bytes);
    const int sms = prop.multiProcessorCount;
    for (const int ctas : {1, 2, 3}) {
      run<method::cp_async, 4>(rows, buffer, host, map, ctas, sms, repeats);
      run<method::cp_async, 7>(rows, buffer, host, map, ctas, sms, repeats);
      run<method::bulk_rows, 4>(rows, buffer, host, map, ctas, sms, repeats);
      run<method::bulk_rows, 7>(rows, buffer, host, map, ctas, sms, repeats);
      run<method::bulk_tile, 4>(rows, buffer, host, map, ctas, sms, repeats);
      run<method::bulk_tile, 7>(rows, buffer, host, map, ctas, sms, repeats);
      run<method::tma, 4>(rows, buffer, host, map, ctas, sms, repeats);
      run<method::tma, 7>(rows, buffer, host, map, ctas, sms, repeats);
    }
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    out << "{\"commit\": \"" << commit << "\", \"date\": \"" << date << "\", \"gpu\": \"" << prop.name << "\", \"rows\": [";
    for (std::size_t i = 0; i < rows.size(); ++i)
      out << (i ? ", " : "") << "{\"method\": \"" << name_of(rows[i].how) << "\", \"ctas_per_sm\": " << rows[i].ctas_per_sm
          << ", \"stages\": " << rows[i].stages << ", \"buffer_mib\": " << rows[i].buffer_mib << ", \"tb_per_s\": " << rows[i].tb_per_s << "}";
    out << "]}\n";
    if (!out) throw std::runtime_error("--json " + json_path + ": could not be written");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "l2_bench: %s\n", e.what());
  return 2;
}
