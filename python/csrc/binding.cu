// SPDX-License-Identifier: Apache-2.0
// The kernel layer's entry points: the element type picks the instantiation (binding_bf16.cu,
// binding_fp16.cu); every error is caught here and returned as an outcome, its message kept for the
// Python exception.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>

#include <stria/sharding/sequential.hpp>
#include <stria/sharding/striped.hpp>
#include <stria/sharding/zigzag.hpp>

#include "binding.hpp"

#if STRIA_TORCH_WITH_NCCL
#include <stria/comm/nccl.cuh>
#endif

namespace stria::python {

template <class T>
void estimate_typed(const problem&, const T*, const T*, const estimator_options&, std::pair<std::int64_t, std::int64_t>, std::int32_t*,
                    std::int32_t*);
template <class T>
void forward_typed(const problem&, const T*, const T*, const T*, const padded_selection&, T*, float*);
template <class T>
void backward_typed(const problem&, const T*, const T*, const T*, const T*, const T*, const float*, const padded_selection&, bool,
                    const backward_scratch&, T*, T*, T*);

template <class T>
void ring_estimate_typed(const problem&, const ring_ranks&, const T*, const T*, const estimator_options&, std::pair<std::int64_t, std::int64_t>,
                         std::int32_t*, std::int32_t*);
template <class T>
void ring_forward_typed(const problem&, const ring_ranks&, const T*, const T*, const T*, const padded_selection&, T*, float*);
template <class T>
void ring_backward_typed(const problem&, const ring_ranks&, const T*, const T*, const T*, const T*, const T*, const float*, const padded_selection&,
                         bool, T*, T*, T*);

#if STRIA_TORCH_WITH_NCCL
static_assert(sizeof(ncclUniqueId) == nccl_id_bytes, "ring_ranks::nccl_id holds an ncclUniqueId");

comm::nccl& ring_communicator(const ring_ranks& r) {
  if (r.world < 1 || r.world > max_world_size) throw invalid_argument("world", r.world, "must lie in [1, " + std::to_string(max_world_size) + "]");
  if (r.rank < 0 || r.rank >= r.world) throw invalid_argument("rank", r.rank, "must lie in [0, world = " + std::to_string(r.world) + ")");
  int device = 0;
  STRIA_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex guard;
  // Never destroyed: at the process's exit Python and the peers may be gone, and a communicator's
  // destruction would wait on them (PyTorch aborts its own there rather than destroying them).
  static auto& communicators = *new std::map<std::pair<std::string, int>, std::unique_ptr<comm::nccl>>;  // by (id, device)
  const std::lock_guard lock(guard);
  const auto key = std::pair{std::string(r.nccl_id.begin(), r.nccl_id.end()), device};
  if (const auto found = communicators.find(key); found != communicators.end()) {
    const comm::nccl& c = *found->second;
    if (c.aborted())
      throw comm_error("rank " + std::to_string(r.rank) + ": this group's NCCL communicator was aborted after an error; "
                       "context parallelism needs a new torch.distributed group (whose first call makes a new communicator)");
    if (c.rank() != r.rank || c.world_size() != r.world)
      throw invalid_argument("nccl_id", "(a communicator of rank " + std::to_string(c.rank()) + " of " + std::to_string(c.world_size()) + ")",
                             "is rank " + std::to_string(r.rank) + " of " + std::to_string(r.world) + " in this call: one id names one group");
    return *found->second;
  }
  ncclUniqueId id;
  std::memcpy(&id, r.nccl_id.data(), sizeof id);
  // An id joins its ranks once: a failed initialisation leaves nothing cached, and a new id is needed.
  return *communicators.emplace(key, std::make_unique<comm::nccl>(comm::nccl::create(id, static_cast<index_t>(r.world), static_cast<index_t>(r.rank))))
              .first->second;
}
#endif

namespace {

#if !STRIA_TORCH_WITH_NCCL
/// What a context-parallel call raises where the extension was built without NCCL.
[[noreturn]] void no_nccl() {
  throw std::runtime_error("stria: this build of the PyTorch extension found no NCCL (nccl.h and libnccl) at build time; "
                           "context-parallel attention needs it: install NCCL (or point NCCL_ROOT at it) and reinstall");
}
#endif

template <class Body>
void with_type(element type, Body&& body) {
  if (type == element::bf16) body(static_cast<const __nv_bfloat16*>(nullptr));
  else body(static_cast<const __half*>(nullptr));
}

/// Runs `body`, its errors caught here and returned.
template <class Body>
outcome caught(Body&& body) noexcept {
  try {
    body();
    return {};
  } catch (const std::invalid_argument& e) {
    return {outcome::kind::invalid_argument, e.what()};
  } catch (const std::exception& e) {
    return {outcome::kind::failure, e.what()};
  } catch (...) {
    return {outcome::kind::failure, "stria: an unknown exception"};
  }
}

std::pair<std::int64_t, std::int64_t> widths_of(const estimator_options& options, std::int64_t seq_len, std::int64_t heads_q, bool causal) {
  const estimator::vertical_slash_top_p e = estimator_of(options);
  e.validate(static_cast<index_t>(seq_len), static_cast<index_t>(heads_q));
  const estimator::top_p_rule rule = e.rule(static_cast<index_t>(seq_len));
  // Sinks come on top of the vertical cap and the local diagonals on top of the slash cap (both
  // sides of diagonal 0 without the causal mask).
  const std::int64_t blocks = seq_len / block_tokens;
  const std::int64_t local = causal ? rule.local_diagonals : 2 * rule.local_diagonals - 1;
  return {std::min<std::int64_t>(seq_len, std::int64_t{rule.vertical_cap} + rule.sink_tokens),
          std::min<std::int64_t>(causal ? blocks : 2 * blocks - 1, std::int64_t{rule.slash_cap} + local)};
}

}  // namespace

outcome estimate_widths(const estimator_options& options, std::int64_t seq_len, std::int64_t heads_q, bool causal,
                        std::pair<std::int64_t, std::int64_t>& widths) noexcept {
  return caught([&] { widths = widths_of(options, seq_len, heads_q, causal); });
}

outcome rank_blocks(const std::string& layout, std::int64_t seq_len, std::int64_t world, std::vector<std::int64_t>& blocks) noexcept {
  return caught([&] {
    if (seq_len < 1 || seq_len > std::numeric_limits<index_t>::max()) throw invalid_argument("seq_len", seq_len, "must lie in [1, 2^31 - 1]");
    if (world < 1 || world > max_world_size) throw invalid_argument("world", world, "must lie in [1, " + std::to_string(max_world_size) + "]");
    if (seq_len % block_tokens != 0) throw invalid_argument("seq_len", seq_len, "must be a multiple of 64 (the block size)");
    const shard_layout shape{static_cast<index_t>(seq_len / block_tokens), static_cast<index_t>(world)};
    auto list = [&](const auto& sharding) {
      sharding.validate(shape);
      const index_t local = sharding.local_blocks(shape);
      blocks.clear();
      for (index_t r = 0; r < shape.world_size; ++r)
        for (index_t i = 0; i < local; ++i) blocks.push_back(sharding.global_block(shape, {r, i}));
    };
    if (layout == "sequential") list(sharding::sequential{});
    else if (layout == "zigzag") list(sharding::zigzag{});
    else if (layout == "striped") list(sharding::striped<>{});
    else throw invalid_argument("layout", layout, "must be \"sequential\", \"zigzag\" or \"striped\"");
  });
}

outcome estimate(const problem& p, const void* q, const void* k, const estimator_options& options, std::int32_t* vertical, std::int32_t* slash) noexcept {
  return caught([&] {
    const auto widths = widths_of(options, p.seq_len, p.heads_q, p.causal);
    with_type(p.type, [&]<class T>(const T*) {
      estimate_typed<T>(p, static_cast<const T*>(q), static_cast<const T*>(k), options, widths, vertical, slash);
    });
  });
}

outcome forward(const problem& p, const void* q, const void* k, const void* v, const padded_selection& selection, void* out, float* lse) noexcept {
  return caught([&] {
    with_type(p.type, [&]<class T>(const T*) {
      forward_typed<T>(p, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), selection, static_cast<T*>(out), lse);
    });
  });
}

outcome backward(const problem& p, const void* q, const void* k, const void* v, const void* out, const void* d_out, const float* lse,
                 const padded_selection& selection, bool deterministic, const backward_scratch& scratch, void* dq, void* dk, void* dv) noexcept {
  return caught([&] {
    with_type(p.type, [&]<class T>(const T*) {
      backward_typed<T>(p, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(out),
                        static_cast<const T*>(d_out), lse, selection, deterministic, scratch, static_cast<T*>(dq), static_cast<T*>(dk),
                        static_cast<T*>(dv));
    });
  });
}

outcome nccl_unique_id(std::array<unsigned char, nccl_id_bytes>& id) noexcept {
  return caught([&] {
#if STRIA_TORCH_WITH_NCCL
    ncclUniqueId made;
    STRIA_NCCL_CHECK(ncclGetUniqueId(&made));
    std::memcpy(id.data(), &made, sizeof made);
#else
    (void)id;
    no_nccl();
#endif
  });
}

outcome ring_init(const ring_ranks& r) noexcept {
  return caught([&] {
#if STRIA_TORCH_WITH_NCCL
    (void)ring_communicator(r);
#else
    (void)r;
    no_nccl();
#endif
  });
}

outcome ring_estimate(const problem& p, const ring_ranks& r, const void* q, const void* k, const estimator_options& options, std::int32_t* vertical,
                      std::int32_t* slash) noexcept {
  return caught([&] {
#if STRIA_TORCH_WITH_NCCL
    const auto widths = widths_of(options, p.seq_len, p.heads_q, p.causal);
    with_type(p.type, [&]<class T>(const T*) {
      ring_estimate_typed<T>(p, r, static_cast<const T*>(q), static_cast<const T*>(k), options, widths, vertical, slash);
    });
#else
    (void)p, (void)r, (void)q, (void)k, (void)options, (void)vertical, (void)slash;
    no_nccl();
#endif
  });
}

outcome ring_forward(const problem& p, const ring_ranks& r, const void* q, const void* k, const void* v, const padded_selection& selection,
                     void* out, float* lse) noexcept {
  return caught([&] {
#if STRIA_TORCH_WITH_NCCL
    with_type(p.type, [&]<class T>(const T*) {
      ring_forward_typed<T>(p, r, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), selection, static_cast<T*>(out), lse);
    });
#else
    (void)p, (void)r, (void)q, (void)k, (void)v, (void)selection, (void)out, (void)lse;
    no_nccl();
#endif
  });
}

outcome ring_backward(const problem& p, const ring_ranks& r, const void* q, const void* k, const void* v, const void* out, const void* d_out,
                      const float* lse, const padded_selection& selection, bool deterministic, void* dq, void* dk, void* dv) noexcept {
  return caught([&] {
#if STRIA_TORCH_WITH_NCCL
    with_type(p.type, [&]<class T>(const T*) {
      ring_backward_typed<T>(p, r, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(out),
                             static_cast<const T*>(d_out), lse, selection, deterministic, static_cast<T*>(dq), static_cast<T*>(dk),
                             static_cast<T*>(dv));
    });
#else
    (void)p, (void)r, (void)q, (void)k, (void)v, (void)out, (void)d_out, (void)lse, (void)selection, (void)deterministic, (void)dq, (void)dk, (void)dv;
    no_nccl();
#endif
  });
}

}  // namespace stria::python
