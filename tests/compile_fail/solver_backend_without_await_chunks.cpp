// SPDX-License-Identifier: Apache-2.0
// Must not compile: the solver engine waits for the chunks moved here with Backend::await_chunks,
// which this backend lacks.
#include <cstddef>
#include <string>

#include "stria/engine/solver_engine.hpp"

struct without_await_chunks {
  static constexpr bool kv_results = false;
  void begin_transfers() {}
  void end_transfers() {}
  void send_chunk(const stria::solver::chunk_move&) {}
  void receive_chunk(const stria::solver::chunk_move&) {}
  void compute(const stria::solver::task&, stria::index_t, std::size_t) {}
  void check(stria::index_t, const std::string&, bool) {}
  void send_result(const stria::solver::chunk_move&) {}
  void receive_result(const stria::solver::chunk_move&, std::size_t) {}
  void await_results() {}
  void add_result(const stria::solver::chunk_move&, std::size_t) {}
  void finish() {}
};

int main() {
  const stria::solver::problem p{1, 1, 64, 1, 1, {1}};
  const stria::solver::plan plan = stria::solver::solve(p);
  const stria::solver::rank_chunks me(p, plan, 64, 1, 0, 1, 64, 64, 1, 1);
  without_await_chunks backend;
  stria::engine::run_solver_plan(backend, plan, me, stria::finite_check::off);
}
