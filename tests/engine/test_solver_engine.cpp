// SPDX-License-Identifier: Apache-2.0
// The solver engine on backends written as a third party would: one runs the forward in fp32 with
// the reference kernels on its own storage and must equal host::solver_forward to the bit; one
// counts, per chunk, the tasks whose results reach it, and every own chunk must end with each of
// its tasks exactly once (KV results too), local tasks done before any moved chunk is awaited.
#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/engine/solver_engine.hpp"
#include "stria/host/reference_attention.hpp"
#include "stria/host/solver_attention.hpp"
#include "stria/index/local_index.hpp"
#include "support/selection.hpp"

namespace third_party {

using stria::index_t;
using stria::solver::chunk_move;
using stria::solver::message;

/// Whole fp32 tensors of this rank's shard and per chunk fp32 buffers; transfers are host_threads messages.
struct attention_backend {
  static constexpr bool kv_results = false;
  using view3 = stria::tensor_view<const float, 3>;

  stria::comm::host_threads& comm;
  const stria::solver::problem& p;
  const stria::global_selection& g;
  const stria::solver::rank_chunks& me;
  const float *q, *k, *v;  // [m x tokens, H, D]
  index_t hq, hkv, dim;
  std::map<index_t, std::vector<float>> query{}, kv{}, out{}, lse{};  // by chunk: own and moved here
  std::vector<chunk_move> arriving{};
  int checks = 0;

  std::size_t rows(index_t heads) const { return static_cast<std::size_t>(me.tokens()) * heads * dim; }
  std::vector<float> copy(const float* x, index_t c, index_t heads) const {
    const float* first = x + static_cast<std::size_t>(me.first_token(c)) * heads * dim;
    return {first, first + rows(heads)};
  }
  std::vector<float>& query_of(index_t c) { return me.owns(c) && !query.contains(c) ? query[c] = copy(q, c, hq) : query.at(c); }
  std::vector<float>& kv_of(index_t c) {
    if (!me.owns(c) || kv.contains(c)) return kv.at(c);
    std::vector<float> x = copy(k, c, hkv), y = copy(v, c, hkv);
    x.insert(x.end(), y.begin(), y.end());
    return kv[c] = x;
  }
  void state(index_t c) {  // O = 0, LSE = -inf until a task merges in
    if (out.contains(c)) return;
    out[c].assign(rows(hq), 0.0f);
    lse[c].assign(static_cast<std::size_t>(hq) * me.tokens(), -std::numeric_limits<float>::infinity());
  }
  void merge(index_t c, std::vector<float>& o, std::vector<float>& l) {
    state(c);
    stria::host::merge_partial<float>(stria::tensor_view<float, 3>(out[c].data(), {me.tokens(), hq, dim}), stria::tensor_view<float, 2>(lse[c].data(), {hq, me.tokens()}), view3(o.data(), {me.tokens(), hq, dim}),
                                stria::tensor_view<const float, 2>(l.data(), {hq, me.tokens()}));
  }

  void begin_transfers() {}
  void end_transfers() {}
  void send_chunk(const chunk_move& m) {
    const std::vector<float>& x = m.what == chunk_move::kind::kv ? kv_of(m.chunk) : query_of(m.chunk);
    comm.send(x.data(), x.size(), m.to, me.tag(message::kv, m.chunk));
  }
  void receive_chunk(const chunk_move& m) { arriving.push_back(m); }
  void await_chunks() {
    for (const chunk_move& m : arriving) {
      std::vector<float>& x = (m.what == chunk_move::kind::kv ? kv : query)[m.chunk];
      x.resize(m.what == chunk_move::kind::kv ? 2 * rows(hkv) : rows(hq));
      comm.recv(x.data(), x.size(), me.owner(m.chunk), me.tag(message::kv, m.chunk));
      if (m.what == chunk_move::kind::qo) state(m.chunk);
    }
  }
  void compute(const stria::solver::task& t, index_t, std::size_t) {
    const stria::step_index index = stria::build_local_index(g, stria::sharding::sequential{}, p.num_chunks(), t.query_chunk, t.kv_chunk);
    std::vector<float> o(rows(hq)), l(static_cast<std::size_t>(hq) * me.tokens());
    const std::vector<float>& x = kv_of(t.kv_chunk);
    stria::host::reference_forward<float>(view3(query_of(t.query_chunk).data(), {me.tokens(), hq, dim}), view3(x.data(), {me.tokens(), hkv, dim}),
                                    view3(x.data() + rows(hkv), {me.tokens(), hkv, dim}), index.view(), 0.125,
                                    stria::tensor_view<float, 3>(o.data(), {me.tokens(), hq, dim}), stria::tensor_view<float, 2>(l.data(), {hq, me.tokens()}));
    merge(t.query_chunk, o, l);
  }
  void check(index_t, const std::string&, bool) { ++checks; }
  void send_result(const chunk_move& m) {
    comm.send(out.at(m.chunk).data(), rows(hq), me.owner(m.chunk), me.tag(message::partial_out, m.chunk));
    comm.send(lse.at(m.chunk).data(), lse.at(m.chunk).size(), me.owner(m.chunk), me.tag(message::partial_lse, m.chunk));
  }
  void receive_result(const chunk_move&, std::size_t) {}
  void await_results() {}
  void add_result(const chunk_move& m, std::size_t) {
    std::vector<float> o(rows(hq)), l(static_cast<std::size_t>(hq) * me.tokens());
    comm.recv(o.data(), o.size(), m.to, me.tag(message::partial_out, m.chunk));
    comm.recv(l.data(), l.size(), m.to, me.tag(message::partial_lse, m.chunk));
    merge(m.chunk, o, l);
  }
  void finish() {
    for (index_t c = me.first_chunk(); c < me.end_chunk(); ++c) state(c);
  }
};
static_assert(stria::engine::solver_backend<attention_backend>);

/// A chunk is its number; a task's result is a 1 at (query chunk, KV chunk) of a [C, C] count, added
/// into its query chunk's and its KV chunk's counts, which go home and are added there.
struct counting_backend {
  static constexpr bool kv_results = true;
  stria::comm::host_threads& comm;
  const stria::solver::rank_chunks& me;
  std::size_t chunks;
  std::map<index_t, std::vector<float>> query{}, kv{};  // counts by chunk: own and moved here
  std::map<std::size_t, std::vector<float>> returned{};
  bool awaited = false, local_before_await = true, chunks_arrived = true;

  std::vector<float>& count(std::map<index_t, std::vector<float>>& of, index_t c) { return of.try_emplace(c, chunks * chunks, 0.0f).first->second; }
  std::vector<float>& count_of(const chunk_move& m) { return count(m.what == chunk_move::kind::kv ? kv : query, m.chunk); }
  void begin_transfers() {}
  void end_transfers() {}
  void send_chunk(const chunk_move& m) {
    const float chunk = static_cast<float>(m.chunk);
    comm.send(&chunk, 1, m.to, me.tag(message::kv, m.chunk));
  }
  void receive_chunk(const chunk_move& m) {
    float chunk = -1;
    comm.recv(&chunk, 1, me.owner(m.chunk), me.tag(message::kv, m.chunk));
    chunks_arrived = chunks_arrived && chunk == static_cast<float>(m.chunk);
    (void)count_of(m);  // a chunk moved here has a count that goes home, used or not
  }
  void await_chunks() { awaited = true; }
  void compute(const stria::solver::task& t, index_t stage, std::size_t) {
    local_before_await = local_before_await && (stage == 1) == awaited;
    const std::size_t at = static_cast<std::size_t>(t.query_chunk) * chunks + static_cast<std::size_t>(t.kv_chunk);
    count(query, t.query_chunk)[at] += 1.0f;
    count(kv, t.kv_chunk)[at] += 1.0f;
  }
  void check(index_t, const std::string&, bool) {}
  void send_result(const chunk_move& m) { comm.send(count_of(m).data(), chunks * chunks, me.owner(m.chunk), me.tag(message::partial_dq, m.chunk)); }
  void receive_result(const chunk_move& m, std::size_t i) {
    returned[i].resize(chunks * chunks);
    comm.recv(returned[i].data(), chunks * chunks, m.to, me.tag(message::partial_dq, m.chunk));
  }
  void await_results() {}
  void add_result(const chunk_move& m, std::size_t i) {
    std::vector<float>& into = count_of(m);
    for (std::size_t j = 0; j < into.size(); ++j) into[j] += returned.at(i)[j];
  }
  void finish() {}
};
static_assert(stria::engine::solver_backend<counting_backend>);

/// Lacks await_chunks.
struct without_await {
  static constexpr bool kv_results = false;
  void begin_transfers() {}
  void end_transfers() {}
  void send_chunk(const chunk_move&) {}
  void receive_chunk(const chunk_move&) {}
};
static_assert(!stria::engine::solver_backend<without_await>);

}  // namespace third_party

using namespace stria;

namespace {

struct plan_case {
  global_selection g;
  solver::problem problem;
  solver::plan plan;
};

std::vector<plan_case> plans(test::seeded_rng& rng) {
  std::vector<plan_case> out;
  for (const auto& [world, m, hkv] : {std::tuple{1, 2, 2}, std::tuple{3, 2, 2}, std::tuple{4, 1, 1}, std::tuple{6, 4, 1}}) {
    const index_t seq = world * m * 64;
    for (int mask = 0; mask < 2; ++mask) {
      global_selection g = mask == 0 ? test::random_selection(rng, seq, 4, true, 0.3, 0.03) : test::document_selection(rng, seq, 4);
      solver::problem p = solver::problem_from_selection(g, world, m, hkv);
      solver::plan x = solver::solve(p);
      out.push_back({std::move(g), std::move(p), std::move(x)});
    }
  }
  return out;
}

}  // namespace

TEST_CASE("solver engine: a third party's fp32 forward backend equals host::solver_forward to the bit") {
  STRIA_SEEDED_RNG(rng);
  std::size_t with_moves = 0;
  for (const plan_case& c : plans(rng)) {
    const index_t world = c.problem.world_size, hq = 4, hkv = c.problem.heads_kv, dim = 64, local = c.g.seq_len / world;
    CAPTURE(world);
    const std::vector<float> q = rng.values<float>(static_cast<std::size_t>(c.g.seq_len) * hq * dim),
                             k = rng.values<float>(static_cast<std::size_t>(c.g.seq_len) * hkv * dim), v = rng.values<float>(k.size());
    std::vector<float> out(q.size()), lse(static_cast<std::size_t>(hq) * c.g.seq_len), third_out(q.size()), third_lse(lse.size());
    std::vector<int> checks(static_cast<std::size_t>(world));
    comm::host_world(world, std::chrono::seconds(60)).run([&](comm::host_threads& comm) {
      const index_t first = comm.rank() * local;
      const auto shard = [&](const std::vector<float>& x, index_t h) { return tensor_view<const float, 3>(x.data() + first * h * dim, {local, h, dim}); };
      host::solver_forward(comm, c.problem, c.plan, c.g,
                           forward_tensors<float>{shard(q, hq), shard(k, hkv), shard(v, hkv),
                                                  tensor_view<float, 3>(out.data() + first * hq * dim, {local, hq, dim}),
                                                  tensor_view<float, 2>(lse.data() + first * hq, {hq, local})},
                           0.125, finite_check::every_step);
      const solver::rank_chunks me(c.problem, c.plan, c.g.seq_len, hq, comm.rank(), world, local, local, hq, hkv);
      third_party::attention_backend b{comm, c.problem, c.g, me, shard(q, hq).data(), shard(k, hkv).data(), shard(v, hkv).data(), hq, hkv, dim};
      engine::run_solver_plan(b, c.plan, me, finite_check::every_step);
      checks[static_cast<std::size_t>(comm.rank())] = b.checks;
      for (index_t ch = me.first_chunk(); ch < me.end_chunk(); ++ch) {
        std::memcpy(third_out.data() + (first + me.first_token(ch)) * hq * dim, b.out.at(ch).data(), b.out.at(ch).size() * sizeof(float));
        for (index_t h = 0; h < hq; ++h)  // lse: rank-major [Hq, local] blocks
          std::memcpy(third_lse.data() + first * hq + h * local + me.first_token(ch), b.lse.at(ch).data() + h * me.tokens(), me.tokens() * sizeof(float));
      }
    });
    with_moves += !c.plan.moves.empty();
    CHECK(std::memcmp(out.data(), third_out.data(), out.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(lse.data(), third_lse.data(), lse.size() * sizeof(float)) == 0);
    CHECK(checks == std::vector<int>(static_cast<std::size_t>(world), 3));  // after stage 0, stage 1, and the merge
  }
  CHECK(with_moves > 0);
}

TEST_CASE("solver engine: every task's results reach both its chunks' owners exactly once, local tasks before the moves are awaited") {
  STRIA_SEEDED_RNG(rng);
  std::size_t third_rank_tasks = 0;
  for (const plan_case& c : plans(rng)) {
    const index_t world = c.problem.world_size, chunks = c.problem.num_chunks(), local = c.g.seq_len / world;
    CAPTURE(world);
    std::vector<std::vector<float>> query_counts(static_cast<std::size_t>(chunks)), kv_counts(query_counts.size());
    std::vector<char> ordered(static_cast<std::size_t>(world)), arrived(ordered.size());
    comm::host_world(world, std::chrono::seconds(60)).run([&](comm::host_threads& comm) {
      const solver::rank_chunks me(c.problem, c.plan, c.g.seq_len, 4, comm.rank(), world, local, local, 4, c.problem.heads_kv);
      third_party::counting_backend b{comm, me, static_cast<std::size_t>(chunks)};
      engine::run_solver_plan(b, c.plan, me, finite_check::off);
      for (index_t ch = me.first_chunk(); ch < me.end_chunk(); ++ch) {
        query_counts[static_cast<std::size_t>(ch)] = b.count(b.query, ch);
        kv_counts[static_cast<std::size_t>(ch)] = b.count(b.kv, ch);
      }
      ordered[static_cast<std::size_t>(comm.rank())] = b.local_before_await;
      arrived[static_cast<std::size_t>(comm.rank())] = b.chunks_arrived;
    });
    for (index_t r = 0; r < world; ++r)
      for (const solver::task& t : c.plan.remote_tasks[static_cast<std::size_t>(r)])
        third_rank_tasks += c.problem.owner(t.query_chunk) != r && c.problem.owner(t.kv_chunk) != r;
    CHECK(ordered == std::vector<char>(ordered.size(), 1));
    CHECK(arrived == std::vector<char>(arrived.size(), 1));
    // The owner of chunk i holds, for each task (i, j) with work, a 1 at (i, j) in its query count, and of chunk j at (i, j) in its KV count.
    for (index_t i = 0; i < chunks; ++i)
      for (index_t j = 0; j < chunks; ++j) {
        const float expected = c.problem.at(i, j) > 0 ? 1.0f : 0.0f;
        const auto at = static_cast<std::size_t>(i * chunks + j);
        CHECK(query_counts[static_cast<std::size_t>(i)][at] == expected);
        CHECK(kv_counts[static_cast<std::size_t>(j)][at] == expected);
        for (index_t other = 0; other < chunks; ++other)
          if (other != i) CHECK(query_counts[static_cast<std::size_t>(other)][at] == 0.0f);
      }
  }
  CHECK(third_rank_tasks > 0);
}
