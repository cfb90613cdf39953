// SPDX-License-Identifier: Apache-2.0
// ring_bench --trace: where one layer of the shared-GPU ring (W ranks on one GPU through
// comm::local_device) spends its time, per rank and per step. The library runs unchanged: the ring
// backend is device::detail::ring_backend itself, reached through two bench wrappers that only
// observe it:
//  - traced_comm wraps the communicator: host time in each group_end (the ranks' lockstep through
//    their host messages) and in each wait() (the backend's confirm_before: the host polling a
//    device event), and timing events on the transfer stream at the group's first send/recv (the
//    stream has then passed the backend's wait on the compute stream) and after group_end (the
//    receive copy is queued, and the wait for the peer's copy of our send);
//  - traced_backend wraps the backend (engine::ring_backend): when each step starts on the host,
//    when its post_kv returns (after the confirm wait), the backward's partial sums and sends;
// and bench copies of device::ring_forward / ring_backward (finite_check::off) whose compute calls
// are bracketed by timing events on the compute stream and host times. Host times are
// steady_clock, from a common t0 taken after a barrier with every stream idle; device times come
// from cudaEventElapsedTime against one event recorded (by rank 0, on its compute stream) at that
// t0, so both are on one time line to within the launch latency (a few us; each rank's own t0
// event is printed against it). Optionally the SM clock is sampled through NVML (dlopen'ed, no
// link dependency) while each phase runs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "stria/comm/local_device.cuh"
#include "stria/core/cuda_check.cuh"
#include "stria/core/cuda_stream.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/device/ring_attention.cuh"
#include "stria/device/sparse_attention_step.cuh"
#include "stria/engine/ring_engine.hpp"
#include "stria/index/local_index.cuh"
#include "stria/topology/flat_ring.hpp"
#include "timing.cuh"

namespace stria::bench::trace {

using clock = std::chrono::steady_clock;
inline constexpr double none = std::numeric_limits<double>::quiet_NaN();

inline double ms_between(clock::time_point a, clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

/// Timing events made before the traced call (their creation stays out of the traced path).
class event_pool {
 public:
  explicit event_pool(std::size_t n) { grow(n); }
  ~event_pool() {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  }
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;

  cudaEvent_t record(cudaStream_t stream) {
    if (next_ == events_.size()) grow(events_.size());
    cudaEvent_t e = events_[next_++];
    STRIA_CUDA_CHECK(cudaEventRecord(e, stream));
    return e;
  }
  void reset() { next_ = 0; }

 private:
  void grow(std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      cudaEvent_t e = nullptr;
      STRIA_CUDA_CHECK(cudaEventCreate(&e));  // with timing
      events_.push_back(e);
    }
  }
  std::vector<cudaEvent_t> events_;
  std::size_t next_ = 0;
};

/// One (rank, step). Host times: ms from the common t0; device times: ms from the reference event.
struct step_record {
  double start = none;          // host: the engine's first call of the step (complete_kv, post_kv or, at step 0, load_own_kv)
  double posted = none;         // host: the step's KV group send/recv returned (none: the step posts no KV)
  double confirmed = none;      // host: post_kv returned (after confirm_before's waits)
  double compute_call = none;   // host: the compute call began (its start event was recorded)
  double queued = none;         // host: the compute call returned (kernels queued)
  double end = none;            // host: the next step started (the backward's partial sums and sends come before)
  double group_ms = 0;          // host ms inside the step's KV group_end
  double wait_ms = 0;           // host ms inside comm.wait during the step (confirm_before)
  int waits = 0;
  double partial_ms = 0;        // host ms in add_partial / send_partial / receive_partial (backward)
  double compute_start = none;  // device: compute stream reached the step's kernels (after the KV's arrival)
  double compute_end = none;    // device: the step's kernels done
  double kv_ready = none;       // device: transfer stream at the step's KV group (past its wait on compute)
  double kv_end = none;         // device: transfer stream after the group (copy in, peer's copy of our send)
  double dkdv_ready = none, dkdv_end = none;  // the same around the step's dK/dV sends (backward)
  double alone_ms = none;       // the same compute call alone on the GPU (median), when measured
};

/// What a rank's host thread did, from `begin` to `end` (host ms from t0).
struct host_interval {
  const char* what;  // "group" (a group_end), "wait" (comm.wait), "compute" (the compute call), "partial", "finish"
  index_t step;
  double begin, end;
};

/// A group of sends and receives on the transfer stream, or a partial's addition on the compute stream.
struct device_span {
  const char* what;  // "kv", "dkdv", "finish" (transfer groups); "add" (add_partial on the compute stream)
  index_t step;
  double begin = none, end = none;
};

struct rank_record {
  index_t rank = 0;
  double t0_host = none;            // this rank's own t0 after the barrier (host ms from the common t0)
  double t0_compute = none;         // its t0 event on the compute stream against the reference
  double t0_transfer = none;        // and on the transfer stream
  double finish_begin = none, finish_end = none;  // host: finish_transfers
  double returned = none;           // host: the ring call returned
  double tail = none;               // device: compute stream after the whole call (outputs written)
  double synchronized = none;       // host: both streams synchronized
  std::vector<step_record> steps;
  std::vector<host_interval> host;
  std::vector<device_span> spans;
};

/// One rank's recorder for one traced call.
class recorder {
 public:
  recorder(index_t rank, index_t steps, clock::time_point t0, cudaEvent_t reference, event_pool& pool) : t0_(t0), reference_(reference), pool_(pool) {
    pool_.reset();
    record_.rank = rank;
    record_.steps.resize(static_cast<std::size_t>(steps));
  }

  [[nodiscard]] double now() const { return ms_between(t0_, clock::now()); }
  [[nodiscard]] index_t current_step() const { return current_; }
  step_record& step(index_t s) { return record_.steps.at(static_cast<std::size_t>(s)); }
  rank_record& record() { return record_; }

  /// Marks `target` with the time `stream` reaches this point (resolved after synchronization).
  void mark(cudaStream_t stream, double& target) { pending_.emplace_back(&target, pool_.record(stream)); }
  cudaEvent_t event(cudaStream_t stream) { return pool_.record(stream); }
  void resolve_into(cudaEvent_t e, double& target) { pending_.emplace_back(&target, e); }

  /// The engine's first call of step `s` (later calls of the same step change nothing).
  void begin_step(index_t s) {
    if (s == current_ || s < 0 || s >= static_cast<index_t>(record_.steps.size())) return;
    const double t = now();
    if (current_ >= 0) step(current_).end = t;
    current_ = s;
    step(s).start = t;
  }
  void end_steps() {
    if (current_ >= 0 && std::isnan(step(current_).end)) step(current_).end = now();
  }
  void interval(const char* what, double begin, double end) { record_.host.push_back({what, current_, begin, end}); }
  device_span& span(const char* what) { return spans_.emplace_back(device_span{what, current_, none, none}); }

  /// Events to ms (every event recorded so far must have completed).
  void resolve() {
    for (const auto& [target, e] : pending_) {
      float ms = 0;
      STRIA_CUDA_CHECK(cudaEventElapsedTime(&ms, reference_, e));
      *target = ms;
    }
    pending_.clear();
    record_.spans.assign(spans_.begin(), spans_.end());
    for (const device_span& d : record_.spans) {  // each step's transfer groups: the first ready, the last end
      if (d.step < 0 || d.step >= static_cast<index_t>(record_.steps.size())) continue;
      step_record& s = step(d.step);
      const std::string_view what(d.what);
      if (what != "kv" && what != "dkdv") continue;
      double& ready = what == "kv" ? s.kv_ready : s.dkdv_ready;
      double& end = what == "kv" ? s.kv_end : s.dkdv_end;
      ready = std::isnan(ready) ? d.begin : std::min(ready, d.begin);
      end = std::isnan(end) ? d.end : std::max(end, d.end);
    }
  }

 private:
  clock::time_point t0_;
  cudaEvent_t reference_;
  event_pool& pool_;
  rank_record record_;
  std::deque<device_span> spans_;  // stable addresses for pending targets
  index_t current_ = -1;
  std::vector<std::pair<double*, cudaEvent_t>> pending_;
};

/// A device communicator that forwards to `Comm` (comm::local_device) and records what its calls cost.
/// With `spin`, wait() polls the event without backing off (then asks Comm's wait, which returns at
/// once, for its checks), to tell the library's polling backoff from the rest.
template <class Comm>
class traced_comm {
 public:
  traced_comm(Comm& inner, bool spin) : inner_(inner), spin_(spin) {}

  void attach(recorder* r) { rec_ = r; }
  void context(const char* what) { what_ = what; }

  [[nodiscard]] index_t rank() const { return inner_.rank(); }
  [[nodiscard]] index_t world_size() const { return inner_.world_size(); }

  void group_start() {
    if (depth_++ == 0) stream_ = nullptr;
    inner_.group_start();
  }
  void group_end() {
    if (depth_ == 0) {
      inner_.group_end();  // throws: unpaired
      return;
    }
    const bool outermost = --depth_ == 0;
    const double begin = rec_->now();
    inner_.group_end();
    if (!outermost) return;
    const double end = rec_->now();
    rec_->interval("group", begin, end);
    if (stream_ != nullptr) {
      rec_->resolve_into(ready_, span_->begin);
      rec_->mark(stream_, span_->end);
    }
    if (std::string_view(what_) == "kv" && rec_->current_step() >= 0) {
      step_record& s = rec_->step(rec_->current_step());
      s.posted = end;
      s.group_ms += end - begin;
    }
  }

  template <class T>
  void send(const T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag = 0) {
    const bool lone = depth_ == 0;
    if (lone) group_start();
    note(stream);
    inner_.send(data, count, peer, stream, tag);
    if (lone) group_end();
  }
  template <class T>
  void recv(T* data, std::size_t count, index_t peer, cudaStream_t stream, int tag = 0) {
    const bool lone = depth_ == 0;
    if (lone) group_start();
    note(stream);
    inner_.recv(data, count, peer, stream, tag);
    if (lone) group_end();
  }

  void wait(cudaEvent_t done, const std::string& what) {
    const double begin = rec_->now();
    if (spin_) {  // bounded: Comm's wait below keeps its timeout and its checks
      const auto deadline = clock::now() + inner_.host().timeout();
      while (cudaEventQuery(done) == cudaErrorNotReady && clock::now() < deadline) std::this_thread::yield();
    }
    inner_.wait(done, what);
    const double end = rec_->now();
    rec_->interval("wait", begin, end);
    if (std::string_view(what_) != "finish" && rec_->current_step() >= 0) {  // finish_transfers' waits: its own interval
      step_record& s = rec_->step(rec_->current_step());
      s.wait_ms += end - begin;
      ++s.waits;
    }
  }

 private:
  void note(cudaStream_t stream) {  // the group's first operation: its stream, and where that stream is
    if (stream_ != nullptr) return;
    stream_ = stream;
    ready_ = rec_->event(stream);
    span_ = &rec_->span(what_);
  }

  Comm& inner_;
  bool spin_;
  recorder* rec_ = nullptr;
  const char* what_ = "kv";
  int depth_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  device_span* span_ = nullptr;
};

/// engine::ring_backend over the library's device backend, recording the step boundaries.
template <class Comm, class T>
class traced_backend {
  using inner_type = device::detail::ring_backend<traced_comm<Comm>, T>;

 public:
  using partial = typename inner_type::partial;

  traced_backend(traced_comm<Comm>& comm, recorder& rec, index_t steps, tensor_view<const T, 3> k, tensor_view<const T, 3> v, cudaStream_t compute,
                 cudaStream_t transfer)
      : comm_(comm), rec_(rec), steps_(steps), compute_(compute), inner_(comm, steps, k, v, compute, transfer) {}

  [[nodiscard]] index_t rank() const { return inner_.rank(); }
  void load_own_kv(int slot) {
    rec_.begin_step(0);
    inner_.load_own_kv(slot);
  }
  void post_kv(index_t step, const transfer_list& list) {
    rec_.begin_step(step);
    comm_.context("kv");
    inner_.post_kv(step, list);
    rec_.step(step).confirmed = rec_.now();
  }
  void complete_kv(const ring_transfer& t) {
    if (t.ready_step < steps_) rec_.begin_step(t.ready_step);
    inner_.complete_kv(t);
  }
  void finish_transfers() {
    rec_.end_steps();
    comm_.context("finish");
    const double begin = rec_.now();
    inner_.finish_transfers();
    rank_record& r = rec_.record();
    r.finish_begin = begin;
    r.finish_end = rec_.now();
    rec_.interval("finish", r.finish_begin, r.finish_end);
  }
  void add_partial(partial& sum, const partial& x) {
    const double begin = rec_.now();
    device_span& s = rec_.span("add");
    rec_.mark(compute_, s.begin);
    inner_.add_partial(sum, x);
    rec_.mark(compute_, s.end);
    host_partial(begin);
  }
  void send_partial(const ring_transfer& t, partial sum) {
    const double begin = rec_.now();
    comm_.context("dkdv");
    inner_.send_partial(t, std::move(sum));
    host_partial(begin);
  }
  partial receive_partial(const ring_transfer& t, std::size_t n) {
    const double begin = rec_.now();
    partial p = inner_.receive_partial(t, n);
    host_partial(begin);
    return p;
  }
  tensor_view<const T, 3> k(int slot) { return inner_.k(slot); }
  tensor_view<const T, 3> v(int slot) { return inner_.v(slot); }

 private:
  void host_partial(double begin) {
    const double end = rec_.now();
    rec_.interval("partial", begin, end);
    if (rec_.current_step() >= 0) rec_.step(rec_.current_step()).partial_ms += end - begin;
  }

  traced_comm<Comm>& comm_;
  recorder& rec_;
  index_t steps_;
  cudaStream_t compute_;
  inner_type inner_;
};

static_assert(check_device_communicator<traced_comm<comm::local_device>>());
static_assert(engine::ring_backend<traced_backend<comm::local_device, __nv_bfloat16>>);

/// The compute call of a step, bracketed on the host and on the compute stream.
template <class Call>
void traced_compute(recorder& rec, index_t step, cudaStream_t stream, Call&& call) {
  step_record& s = rec.step(step);
  s.compute_call = rec.now();
  rec.mark(stream, s.compute_start);
  call();
  rec.mark(stream, s.compute_end);
  s.queued = rec.now();
  rec.interval("compute", s.compute_call, s.queued);
}

/// device::ring_forward's body (finite_check::off) on the traced backend: the same allocations, calls and order.
template <class Comm, class T>
void ring_forward(traced_comm<Comm>& comm, recorder& rec, const topology::flat_ring& topology, std::span<const device_step_index> indices,
                  const forward_tensors<T>& tensors, double softmax_scale, cudaStream_t stream, cudaStream_t transfer_stream,
                  device::forward_kernel which) {
  const auto [q, k, v, out, lse] = tensors;
  const attention_shape s = engine::check_ring_call(topology, comm.world_size(), comm.rank(), indices, q, k);
  const index_t steps = topology.num_steps();
  device_buffer<float> running(steps > 1 ? static_cast<std::size_t>(q.size()) : 0, stream);
  traced_backend<Comm, T> backend(comm, rec, steps, k, v, stream, transfer_stream);
  engine::ring_forward(
      backend, topology, finite_check::off,
      [&](index_t step, int slot) {
        traced_compute(rec, step, stream, [&] {
          const device::step_forward_tensors<T> operands{.q = q,
                                                         .k = backend.k(slot),
                                                         .v = backend.v(slot),
                                                         .out = tensor_view<float, 3>(running.data(), {s.query_tokens, s.heads_q, s.head_dim}),
                                                         .lse = lse,
                                                         .final_out = step + 1 == steps ? out : tensor_view<T, 3>{}};
          device::sparse_forward<T>(indices[static_cast<std::size_t>(step)], operands, softmax_scale, stream,
                                    {.state = step == 0 ? device::running_state::overwrite : device::running_state::merge, .which = which});
        });
      },
      [](index_t, const std::string&) {});
}

/// device::ring_backward's body (finite_check::off, so dQ is written by the last step) on the traced backend.
template <class Comm, class T>
void ring_backward(traced_comm<Comm>& comm, recorder& rec, const topology::flat_ring& topology, std::span<const device_step_index> indices,
                   const backward_tensors<T>& tensors, double softmax_scale, device::determinism mode, cudaStream_t stream,
                   cudaStream_t transfer_stream) {
  const auto [q, k, v, out, d_out, lse, dq, dk, dv] = tensors;
  const attention_shape s = engine::check_ring_call(topology, comm.world_size(), comm.rank(), indices, q, k);
  const std::array<index_t, 3> q_extents{s.query_tokens, s.heads_q, s.head_dim}, kv_extents{s.kv_tokens, s.heads_kv, s.head_dim};
  const auto kv_elems = static_cast<std::size_t>(k.size());
  const index_t steps = topology.num_steps();
  const bool dq32_needed = steps > 1;
  device_buffer<float> delta(static_cast<std::size_t>(s.heads_q) * s.query_tokens, stream),
      dq32(dq32_needed ? static_cast<std::size_t>(q.size()) : 0, stream);
  const tensor_view<float, 2> delta_view(delta.data(), {s.heads_q, s.query_tokens});
  device::backward_delta(out, d_out, delta_view, stream);
  if (dq32_needed) dq32.fill_bytes(0, stream);
  traced_backend<Comm, T> backend(comm, rec, steps, k, v, stream, transfer_stream);
  const device_buffer<float> own = engine::ring_backward(
      backend, topology, finite_check::off,
      [&](index_t step, int slot) {
        device_buffer<float> working;
        traced_compute(rec, step, stream, [&] {
          working = device_buffer<float>(2 * kv_elems, stream);
          working.fill_bytes(0, stream);
          const device::step_backward_tensors<T> operands{.q = q,
                                                          .k = backend.k(slot),
                                                          .v = backend.v(slot),
                                                          .d_out = d_out,
                                                          .lse = lse,
                                                          .delta = delta_view,
                                                          .dq = tensor_view<float, 3>(dq32.data(), q_extents),
                                                          .dk = tensor_view<float, 3>(working.data(), kv_extents),
                                                          .dv = tensor_view<float, 3>(working.data() + kv_elems, kv_extents),
                                                          .dq_out = step + 1 == steps ? dq.data() : nullptr};
          device::sparse_backward<T>(indices[static_cast<std::size_t>(step)], operands, softmax_scale, stream, {.mode = mode});
        });
        return working;
      },
      [](index_t, const std::string&, index_t, const device_buffer<float>&) {});
  device::write_output(tensor_view<const float, 3>(own.data(), kv_extents), dk, stream);
  device::write_output(tensor_view<const float, 3>(own.data() + kv_elems, kv_extents), dv, stream);
}

/// The SM clock through NVML, loaded at run time (nothing to link; absent NVML: no samples).
class clock_sampler {
 public:
  struct sample {
    double ms;             // host ms from the phase's t0
    unsigned sm_mhz;       // NVML_CLOCK_SM
    unsigned long long reasons;  // clocks event (throttle) reasons; bit 0: GPU idle
  };

  explicit clock_sampler(int cuda_device) {
    library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library_ == nullptr) {
      why_ = "libnvidia-ml.so.1 not found";
      return;
    }
    using init_t = int (*)();
    using by_bus_t = int (*)(const char*, void**);
    const auto init = reinterpret_cast<init_t>(dlsym(library_, "nvmlInit_v2"));
    const auto by_bus = reinterpret_cast<by_bus_t>(dlsym(library_, "nvmlDeviceGetHandleByPciBusId_v2"));
    clock_info_ = reinterpret_cast<clock_info_t>(dlsym(library_, "nvmlDeviceGetClockInfo"));
    reasons_ = reinterpret_cast<reasons_t>(dlsym(library_, "nvmlDeviceGetCurrentClocksEventReasons"));
    if (reasons_ == nullptr) reasons_ = reinterpret_cast<reasons_t>(dlsym(library_, "nvmlDeviceGetCurrentClocksThrottleReasons"));
    shutdown_ = reinterpret_cast<init_t>(dlsym(library_, "nvmlShutdown"));
    if (!init || !by_bus || !clock_info_ || !shutdown_) {
      why_ = "NVML lacks a needed function";
      return;
    }
    if (init() != 0) {
      why_ = "nvmlInit failed";
      return;
    }
    initialized_ = true;
    char bus[64] = {};
    STRIA_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), cuda_device));
    if (by_bus(bus, &device_) != 0) {
      why_ = std::string("no NVML device at PCI bus ") + bus;
      device_ = nullptr;
    }
  }
  ~clock_sampler() {
    stop();
    if (initialized_) (void)shutdown_();
    if (library_ != nullptr) dlclose(library_);
  }
  clock_sampler(const clock_sampler&) = delete;
  clock_sampler& operator=(const clock_sampler&) = delete;

  [[nodiscard]] bool available() const { return device_ != nullptr; }
  [[nodiscard]] const std::string& why_not() const { return why_; }

  /// Samples every `period` from now until stop(), times from `t0`.
  void start(clock::time_point t0, std::chrono::microseconds period) {
    stop();
    samples_.clear();
    if (!available()) return;
    running_.store(true);
    thread_ = std::thread([this, t0, period] {
      while (running_.load()) {
        sample s{ms_between(t0, clock::now()), 0, 0};
        (void)clock_info_(device_, 1 /* NVML_CLOCK_SM */, &s.sm_mhz);
        if (reasons_ != nullptr) (void)reasons_(device_, &s.reasons);
        samples_.push_back(s);
        std::this_thread::sleep_for(period);
      }
    });
  }
  std::vector<sample> stop() {
    if (thread_.joinable()) {
      running_.store(false);
      thread_.join();
    }
    return samples_;
  }

 private:
  using clock_info_t = int (*)(void*, int, unsigned*);
  using reasons_t = int (*)(void*, unsigned long long*);
  void* library_ = nullptr;
  void* device_ = nullptr;
  bool initialized_ = false;
  clock_info_t clock_info_ = nullptr;
  reasons_t reasons_ = nullptr;
  int (*shutdown_)() = nullptr;
  std::string why_;
  std::atomic<bool> running_{false};
  std::thread thread_;
  std::vector<sample> samples_;
};

/// What a run of clock samples says: count, min / median / max SM clock, and the share of samples
/// with NVML's GPU-idle reason.
struct clock_summary {
  std::size_t samples = 0;
  double min = none, median = none, max = none, idle_share = none;
};

inline clock_summary summarize_clocks(const std::vector<clock_sampler::sample>& clocks) {
  clock_summary c;
  if (clocks.empty()) return c;
  std::vector<unsigned> mhz;
  std::size_t idle = 0;
  for (const clock_sampler::sample& x : clocks) {
    mhz.push_back(x.sm_mhz);
    if (x.reasons & 1ull) ++idle;
  }
  std::sort(mhz.begin(), mhz.end());
  c.samples = mhz.size();
  c.min = mhz.front();
  c.median = mhz[mhz.size() / 2];
  c.max = mhz.back();
  c.idle_share = double(idle) / double(mhz.size());
  return c;
}

inline void print_clocks(const char* what, const clock_summary& c) {
  if (c.samples > 0)
    std::printf("  SM clock%s over %zu samples: min %.0f, median %.0f, max %.0f MHz; 'GPU idle' clock reason in %.0f%% of them\n", what, c.samples,
                c.min, c.median, c.max, 100.0 * c.idle_share);
}

/// One traced call of the W ranks: forward or backward.
struct phase_trace {
  std::string name;
  double wall_ms = none;  // rank 0's host: t0 to every rank's streams synchronized and a barrier
  std::vector<rank_record> ranks;
  std::vector<clock_sampler::sample> clocks;
  std::uint64_t pool_reserved_before = 0, pool_reserved_after = 0;  // stria's pool, bytes
};

inline std::uint64_t pool_reserved() {
  std::uint64_t bytes = 0;
  STRIA_CUDA_CHECK(cudaMemPoolGetAttribute(stria::detail::memory_pool(), cudaMemPoolAttrReservedMemCurrent, &bytes));
  return bytes;
}

/// The W ranks' streams and barriers around one traced call: every stream idle, a barrier, rank 0
/// takes the common t0 and records the reference event, a barrier, the call, both streams
/// synchronized, a barrier (rank 0 then has the wall time), the events resolved.
struct phase_driver {
  index_t world;
  clock_sampler* sampler;  // may be null
  clock::time_point t0;
  cudaEvent_t reference = nullptr;
  phase_trace result;

  explicit phase_driver(index_t w, clock_sampler* s, std::string name) : world(w), sampler(s) {
    STRIA_CUDA_CHECK(cudaEventCreate(&reference));
    result.name = std::move(name);
    result.ranks.resize(static_cast<std::size_t>(world));
  }
  ~phase_driver() { (void)cudaEventDestroy(reference); }
  phase_driver(const phase_driver&) = delete;
  phase_driver& operator=(const phase_driver&) = delete;

  /// Called by every rank: `call(recorder&)` queues the rank's ring call.
  template <class Comm, class Call>
  void run(Comm& c, index_t steps, const cuda_stream& compute, const cuda_stream& transfer, event_pool& pool, Call&& call) {
    compute.synchronize();
    transfer.synchronize();
    c.barrier();
    if (c.rank() == 0) {
      result.pool_reserved_before = pool_reserved();
      t0 = clock::now();
      STRIA_CUDA_CHECK(cudaEventRecord(reference, compute.get()));
      if (sampler != nullptr) sampler->start(t0, std::chrono::microseconds(500));
    }
    c.barrier();
    recorder rec(c.rank(), steps, t0, reference, pool);
    rank_record& r = rec.record();
    r.t0_host = rec.now();
    rec.mark(compute.get(), r.t0_compute);
    rec.mark(transfer.get(), r.t0_transfer);
    call(rec);
    r.returned = rec.now();
    rec.mark(compute.get(), r.tail);
    compute.synchronize();
    transfer.synchronize();
    r.synchronized = rec.now();
    c.barrier();
    if (c.rank() == 0) {
      result.wall_ms = ms_between(t0, clock::now());
      if (sampler != nullptr) result.clocks = sampler->stop();
      result.pool_reserved_after = pool_reserved();
    }
    rec.resolve();
    result.ranks[static_cast<std::size_t>(c.rank())] = std::move(r);
    c.barrier();  // the reference event is recorded again only after every rank has resolved against it
  }
};

/// Each (rank, step)'s compute call alone on the GPU, as the ring makes it (the forward overwrites at
/// step 0, merges after, writes the output at the last step; the backward allocates and zeroes its
/// dK/dV sums, writes dQ at the last step): median ms after warm-up, [rank][step].
struct alone_times {
  std::vector<std::vector<double>> forward, backward;
  // The SM clock over a second, untimed pass of the same calls (warm-ups included): the timed pass
  // runs unsampled.
  std::vector<clock_sampler::sample> forward_clocks, backward_clocks;
};

template <class Sharding>
alone_times time_alone(const global_selection& g, const Sharding& sharding, index_t world, index_t hq, index_t hkv, index_t dim, int repeats,
                       device::forward_kernel which, clock_sampler* sampler = nullptr) {
  using T = __nv_bfloat16;
  const index_t local = g.seq_len / world;
  const topology::flat_ring ring(world);
  const double scale = 1.0 / std::sqrt(double(dim));
  const cuda_stream stream;
  const cudaStream_t st = stream.get();
  const auto q = random_buffer(std::size_t(local) * hq * dim, 1, 2.0f), k = random_buffer(std::size_t(local) * hkv * dim, 2, 2.0f),
             v = random_buffer(std::size_t(local) * hkv * dim, 3, 1.0f), d_out = random_buffer(q.size(), 4, 1.0f);
  device_buffer<T> out(q.size()), dq(q.size());
  device_buffer<float> running(q.size()), lse(std::size_t(hq) * local), delta(lse.size()), dq32(q.size());
  for (auto* b : {&running, &lse, &delta, &dq32}) b->fill_bytes(0);
  STRIA_CUDA_CHECK(cudaDeviceSynchronize());
  const device_selection selection(g, st);
  const tensor_view<const T, 3> qv(q.data(), {local, hq, dim}), kv(k.data(), {local, hkv, dim}), vv(v.data(), {local, hkv, dim}),
      dov(d_out.data(), {local, hq, dim});
  const auto kv_elems = static_cast<std::size_t>(kv.size());
  alone_times t;
  // With a sampler, each call's timing runs twice: timed and unsampled, then sampled at the traced
  // ring's period, so that the sampler cannot move the times. The ring ran a few percent slower than
  // its calls alone (RESULTS 2026-12-05, sixth and seventh); the clocks say whether the clock is why.
  const auto clocked = [&](std::vector<clock_sampler::sample>& clocks, auto&& run) {
    const double ms = run();
    if (sampler != nullptr) {
      sampler->start(clock::now(), std::chrono::microseconds(500));
      (void)run();
      const std::vector<clock_sampler::sample> pass = sampler->stop();
      clocks.insert(clocks.end(), pass.begin(), pass.end());
    }
    return ms;
  };
  for (index_t r = 0; r < world; ++r) {
    const std::vector<device_step_index> indices = build_ring_indices_device(selection, sharding, ring, r, st);
    std::vector<double> fwd, bwd;
    for (index_t s = 0; s < ring.num_steps(); ++s) {
      const device_step_index& index = indices[static_cast<std::size_t>(s)];
      const bool last = s + 1 == ring.num_steps();
      fwd.push_back(clocked(t.forward_clocks, [&] {
        return median_ms(
          repeats,
          [&] {
            device::sparse_forward<T>(index,
                                      {.q = qv,
                                       .k = kv,
                                       .v = vv,
                                       .out = tensor_view<float, 3>(running.data(), {local, hq, dim}),
                                       .lse = tensor_view<float, 2>(lse.data(), {hq, local}),
                                       .final_out = last ? tensor_view<T, 3>(out.data(), {local, hq, dim}) : tensor_view<T, 3>{}},
                                      scale, st,
                                      {.state = s == 0 ? device::running_state::overwrite : device::running_state::merge, .which = which});
          },
          st);
      }));
      bwd.push_back(clocked(t.backward_clocks, [&] {
        return median_ms(
          repeats,
          [&] {
            device_buffer<float> working(2 * kv_elems, st);
            working.fill_bytes(0, st);
            device::sparse_backward<T>(index,
                                       {.q = qv,
                                        .k = kv,
                                        .v = vv,
                                        .d_out = dov,
                                        .lse = tensor_view<const float, 2>(lse.data(), {hq, local}),
                                        .delta = tensor_view<const float, 2>(delta.data(), {hq, local}),
                                        .dq = tensor_view<float, 3>(dq32.data(), {local, hq, dim}),
                                        .dk = tensor_view<float, 3>(working.data(), {local, hkv, dim}),
                                        .dv = tensor_view<float, 3>(working.data() + kv_elems, {local, hkv, dim}),
                                        .dq_out = last ? dq.data() : nullptr},
                                       scale, st);
          },
          st);
      }));
    }
    t.forward.push_back(std::move(fwd));
    t.backward.push_back(std::move(bwd));
  }
  return t;
}


// ---- What a phase's trace says -------------------------------------------------------------------

/// Time intervals merged where they overlap, sorted.
inline std::vector<std::pair<double, double>> merged(std::vector<std::pair<double, double>> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::pair<double, double>> out;
  for (const auto& [b, e] : v) {
    if (std::isnan(b) || std::isnan(e) || e < b) continue;
    if (!out.empty() && b <= out.back().second) out.back().second = std::max(out.back().second, e);
    else out.emplace_back(b, e);
  }
  return out;
}

inline double length(const std::vector<std::pair<double, double>>& v) {
  double total = 0;
  for (const auto& [b, e] : v) total += e - b;
  return total;
}

/// "wait@3": what rank `r`'s host thread was doing at host time `t`.
inline std::string host_state(const rank_record& r, double t) {
  const host_interval* found = nullptr;
  for (const host_interval& h : r.host)
    if (h.begin <= t && t < h.end && (found == nullptr || h.begin >= found->begin)) found = &h;
  if (found != nullptr) return std::string(found->what) + "@" + std::to_string(found->step);
  if (!r.steps.empty() && t < r.steps.front().start) return "before";
  if (t >= r.returned) return t >= r.synchronized ? "barrier" : "sync";
  for (std::size_t s = 0; s < r.steps.size(); ++s)
    if (r.steps[s].start <= t && t < r.steps[s].end) return "step@" + std::to_string(s);
  return "other";
}

struct stream_gap {
  index_t rank, step;
  double begin, end;   // device ms: the compute stream's previous work done, the step's start
  std::string cause;   // "host", "transfer" or "stream": which of them came last; "unexplained": the start came well after all three
  std::string detail;
};

struct idle_gap {
  double begin, end;  // device ms: no rank's compute stream ran a step or a partial's addition
  int transfers;      // transfer groups overlapping it
  std::string hosts;  // each rank's host state at its middle
};

struct phase_summary {
  double wall_ms = none, device_end_ms = none, compute_sum_ms = 0, alone_sum_ms = 0, compute_union_ms = 0, transfer_union_ms = 0;
  double host_group_ms = 0, host_wait_ms = 0, host_compute_ms = 0, host_partial_ms = 0, host_finish_ms = 0;  // sums over ranks
  int waits = 0;
  double gap_host_ms = 0, gap_transfer_ms = 0, gap_stream_ms = 0, gap_unexplained_ms = 0;  // stream gaps by cause, sums over ranks
  // Of the compute spans, the part before the host had queued the step's kernels: the start mark is
  // recorded before the call, so on an idle stream it completes at once and the span then holds
  // the call's host side (allocations, checks, launches). Summed over ranks.
  double host_bound_in_compute_ms = 0;
  double transfer_median_ms = none, transfer_max_ms = none;  // a transfer group's end - ready
  clock_summary clocks;
  std::vector<stream_gap> stream_gaps;  // largest first
  std::vector<idle_gap> idle_gaps;      // largest first
};

inline phase_summary summarize(const phase_trace& p) {
  phase_summary m;
  m.wall_ms = p.wall_ms;
  std::vector<std::pair<double, double>> compute, transfers;
  double device_end = 0;
  for (const rank_record& r : p.ranks) {
    device_end = std::max(device_end, r.tail);
    for (const step_record& s : r.steps) {
      m.compute_sum_ms += s.compute_end - s.compute_start;
      if (!std::isnan(s.queued)) m.host_bound_in_compute_ms += std::max(0.0, std::min(s.queued, s.compute_end) - s.compute_start);
      if (!std::isnan(s.alone_ms)) m.alone_sum_ms += s.alone_ms;
      compute.emplace_back(s.compute_start, s.compute_end);
      m.waits += s.waits;
    }
    for (const device_span& d : r.spans) {
      if (std::string_view(d.what) == "add") compute.emplace_back(d.begin, d.end);
      else transfers.emplace_back(d.begin, d.end);
    }
    for (const host_interval& h : r.host) {
      const std::string_view what(h.what);
      const double ms = h.end - h.begin;
      if (std::isnan(ms)) continue;
      if (what == "group") m.host_group_ms += ms;
      else if (what == "wait") m.host_wait_ms += ms;
      else if (what == "compute") m.host_compute_ms += ms;
      else if (what == "partial") m.host_partial_ms += ms;
      else if (what == "finish") m.host_finish_ms += ms;
    }
    // The compute stream's gaps before each step, and what came last: the stream's earlier work,
    // the KV chunk's arrival, or the host's queuing of the step.
    for (std::size_t i = 0; i < r.steps.size(); ++i) {
      const step_record& s = r.steps[i];
      double previous = r.t0_compute;
      if (i > 0) {
        previous = r.steps[i - 1].compute_end;
        for (const device_span& d : r.spans)
          if (std::string_view(d.what) == "add" && d.step == static_cast<index_t>(i) - 1) previous = std::max(previous, d.end);
      }
      const double arrival = i > 0 ? r.steps[i - 1].kv_end : none;
      const double gap = s.compute_start - previous;
      if (!(gap > 0.01)) continue;
      stream_gap g{r.rank, static_cast<index_t>(i), previous, s.compute_start, "stream", ""};
      double latest = previous;
      if (!std::isnan(arrival) && arrival > latest) latest = arrival, g.cause = "transfer";
      if (s.compute_call > latest) latest = s.compute_call, g.cause = "host";
      // None of them explains the start: the stream was held by something else (another stream
      // sharing its hardware queue, an implicit synchronisation), beyond the clocks' ~us offset.
      if (s.compute_start - latest > 0.05) g.cause = "unexplained";
      char text[256];
      std::snprintf(text, sizeof text, "host began its compute call at %.3f (its step began %.3f: group %.3f ms, wait %.3f ms); KV arrived %.3f", s.compute_call,
                    s.start, s.group_ms, s.wait_ms, arrival);
      g.detail = text;
      if (g.cause == "host") m.gap_host_ms += gap;
      else if (g.cause == "transfer") m.gap_transfer_ms += gap;
      else if (g.cause == "stream") m.gap_stream_ms += gap;
      else m.gap_unexplained_ms += gap;
      m.stream_gaps.push_back(std::move(g));
    }
  }
  m.device_end_ms = device_end;
  {
    std::vector<double> durations;
    for (const auto& [b, e] : transfers)
      if (!std::isnan(e - b)) durations.push_back(e - b);
    std::sort(durations.begin(), durations.end());
    if (!durations.empty()) m.transfer_median_ms = durations[durations.size() / 2], m.transfer_max_ms = durations.back();
  }
  const auto busy = merged(compute), moving = merged(transfers);
  m.compute_union_ms = length(busy);
  m.transfer_union_ms = length(moving);
  std::sort(m.stream_gaps.begin(), m.stream_gaps.end(), [](const stream_gap& a, const stream_gap& b) { return a.end - a.begin > b.end - b.begin; });
  // Whole-GPU idle: from t0 to the last tail, where no compute span runs.
  double at = 0;
  auto idle = [&](double b, double e) {
    if (e - b <= 0.01) return;
    idle_gap g{b, e, 0, ""};
    for (const auto& [tb, te] : transfers)
      if (tb < e && te > b) ++g.transfers;
    const double middle = 0.5 * (b + e);
    for (const rank_record& r : p.ranks) g.hosts += (g.hosts.empty() ? "" : " ") + std::string("r") + std::to_string(r.rank) + ":" + host_state(r, middle);
    m.idle_gaps.push_back(std::move(g));
  };
  for (const auto& [b, e] : busy) {
    idle(at, b);
    at = std::max(at, e);
  }
  idle(at, device_end);
  std::sort(m.idle_gaps.begin(), m.idle_gaps.end(), [](const idle_gap& a, const idle_gap& b) { return a.end - a.begin > b.end - b.begin; });
  m.clocks = summarize_clocks(p.clocks);
  return m;
}

/// "12.345" or "-" for none.
inline std::string number(double x, int width, int precision = 3) {
  char text[64];
  if (std::isnan(x)) std::snprintf(text, sizeof text, "%*s", width, "-");
  else std::snprintf(text, sizeof text, "%*.*f", width, precision, x);
  return text;
}

inline void print_table(const phase_trace& p) {
  const bool backward = p.name == "backward";
  std::printf("\n%s, per rank and step. h.*: host ms from t0 (start of the step, KV group_end returned, post_kv returned after its "
              "confirm wait, compute queued); grp / wait: host ms inside group_end / comm.wait; d.*: device ms from t0 on the compute stream "
              "(the step's work reached, done); alone: the same call alone on the GPU; kv.*: transfer stream at the step's KV group "
              "(past its wait on compute) and after it%s\n",
              p.name.c_str(), backward ? "; dkdv.*: the same for the dK/dV sends; part: host ms in the partials' calls" : "");
  std::printf("%3s %2s %9s %9s %9s %9s %7s %7s %9s %9s %7s %7s %9s %9s%s\n", "r", "s", "h.start", "h.posted", "h.confirm", "h.queued", "grp", "wait",
              "d.start", "d.end", "span", "alone", "kv.rdy", "kv.end", backward ? "  dkdv.rdy  dkdv.end    part" : "");
  for (const rank_record& r : p.ranks) {
    for (std::size_t i = 0; i < r.steps.size(); ++i) {
      const step_record& s = r.steps[i];
      std::printf("%3d %2zu %s %s %s %s %s %s %s %s %s %s %s %s", r.rank, i, number(s.start, 9).c_str(), number(s.posted, 9).c_str(),
                  number(s.confirmed, 9).c_str(), number(s.queued, 9).c_str(), number(s.group_ms, 7).c_str(), number(s.wait_ms, 7).c_str(),
                  number(s.compute_start, 9).c_str(), number(s.compute_end, 9).c_str(), number(s.compute_end - s.compute_start, 7).c_str(),
                  number(s.alone_ms, 7).c_str(), number(s.kv_ready, 9).c_str(), number(s.kv_end, 9).c_str());
      if (backward) std::printf(" %s %s %s", number(s.dkdv_ready, 9).c_str(), number(s.dkdv_end, 9).c_str(), number(s.partial_ms, 7).c_str());
      std::printf("\n");
    }
    std::printf("%3d    t0 event %s (transfer %s), host t0 %s; finish_transfers %s-%s; returned %s; tail (device) %s; synchronized %s\n", r.rank,
                number(r.t0_compute, 0).c_str(), number(r.t0_transfer, 0).c_str(), number(r.t0_host, 0).c_str(), number(r.finish_begin, 0).c_str(),
                number(r.finish_end, 0).c_str(), number(r.returned, 0).c_str(), number(r.tail, 0).c_str(), number(r.synchronized, 0).c_str());
  }
}

inline void print_summary(const std::string& label, const phase_trace& p, const phase_summary& m) {
  std::printf("%s %s: wall %.2f ms (device tail %.2f); compute spans %.2f ms summed (of which before the host had queued the step: %.2f; alone %.2f), GPU running a step %.2f ms (%.0f%% of the "
              "wall), a transfer %.2f ms (a group's end - ready: median %.3f, max %.3f); host, summed over ranks: group_end %.2f, waits %.2f (%d), compute calls %.2f, partials %.2f, "
              "finish %.2f ms; compute streams' gaps before steps, by what came last: host %.2f, transfer %.2f, earlier stream work %.2f, unexplained %.2f ms; "
              "pool %.1f -> %.1f MiB\n",
              label.c_str(), p.name.c_str(), m.wall_ms, m.device_end_ms, m.compute_sum_ms, m.host_bound_in_compute_ms, m.alone_sum_ms, m.compute_union_ms,
              100.0 * m.compute_union_ms / m.wall_ms, m.transfer_union_ms, m.transfer_median_ms, m.transfer_max_ms, m.host_group_ms, m.host_wait_ms, m.waits, m.host_compute_ms,
              m.host_partial_ms, m.host_finish_ms, m.gap_host_ms, m.gap_transfer_ms, m.gap_stream_ms, m.gap_unexplained_ms, double(p.pool_reserved_before) / 1048576.0,
              double(p.pool_reserved_after) / 1048576.0);
  print_clocks("", m.clocks);
  for (std::size_t i = 0; i < std::min<std::size_t>(5, m.idle_gaps.size()); ++i) {
    const idle_gap& g = m.idle_gaps[i];
    std::printf("  GPU idle %.3f-%.3f (%.3f ms), %d transfer groups overlap; hosts: %s\n", g.begin, g.end, g.end - g.begin, g.transfers, g.hosts.c_str());
  }
  for (std::size_t i = 0; i < std::min<std::size_t>(6, m.stream_gaps.size()); ++i) {
    const stream_gap& g = m.stream_gaps[i];
    std::printf("  r%d s%d compute stream waited %.3f ms (%.3f-%.3f), last: %s; %s\n", g.rank, g.step, g.end - g.begin, g.begin, g.end, g.cause.c_str(),
                g.detail.c_str());
  }
}

/// A minimal JSON writer (numbers, strings without control characters, nested containers); NaN as null.
class json_writer {
 public:
  explicit json_writer(std::FILE* f) : f_(f) {}
  json_writer& open(char bracket) {
    separate();
    std::fputc(bracket, f_);
    first_ = true;
    return *this;
  }
  json_writer& close(char bracket) {
    std::fputc(bracket, f_);
    first_ = false;
    return *this;
  }
  json_writer& key(const char* k) {
    separate();
    write_string(k);
    std::fputc(':', f_);
    first_ = true;  // the value follows without a comma
    return *this;
  }
  json_writer& value(double x) {
    separate();
    if (std::isnan(x) || std::isinf(x)) std::fputs("null", f_);
    else std::fprintf(f_, "%.6g", x);
    return *this;
  }
  json_writer& value(const std::string& s) {
    separate();
    write_string(s.c_str());
    return *this;
  }
  template <class V>
  json_writer& field(const char* k, const V& v) {
    key(k);
    if constexpr (std::is_convertible_v<V, std::string>) return value(std::string(v));
    else return value(static_cast<double>(v));
  }

 private:
  void separate() {
    if (!first_) std::fputc(',', f_);
    first_ = false;
  }
  void write_string(const char* s) {
    std::fputc('"', f_);
    for (; *s; ++s) {
      if (*s == '"' || *s == '\\') std::fputc('\\', f_);
      std::fputc(*s, f_);
    }
    std::fputc('"', f_);
  }
  std::FILE* f_;
  bool first_ = true;
};

inline void write_phase(json_writer& j, const phase_trace& p, const phase_summary& m) {
  j.open('{').field("phase", p.name).field("wall_ms", p.wall_ms);
  j.key("summary").open('{');
  j.field("device_end_ms", m.device_end_ms).field("compute_sum_ms", m.compute_sum_ms).field("alone_sum_ms", m.alone_sum_ms);
  j.field("compute_union_ms", m.compute_union_ms).field("transfer_union_ms", m.transfer_union_ms);
  j.field("transfer_median_ms", m.transfer_median_ms).field("transfer_max_ms", m.transfer_max_ms);
  j.field("host_group_ms", m.host_group_ms).field("host_wait_ms", m.host_wait_ms).field("waits", m.waits);
  j.field("host_compute_ms", m.host_compute_ms).field("host_partial_ms", m.host_partial_ms).field("host_finish_ms", m.host_finish_ms);
  j.field("gap_host_ms", m.gap_host_ms).field("gap_transfer_ms", m.gap_transfer_ms).field("gap_stream_ms", m.gap_stream_ms);
  j.field("gap_unexplained_ms", m.gap_unexplained_ms).field("host_bound_in_compute_ms", m.host_bound_in_compute_ms);
  j.field("clock_min_mhz", m.clocks.min).field("clock_median_mhz", m.clocks.median).field("clock_max_mhz", m.clocks.max);
  j.field("idle_reason_share", m.clocks.idle_share);
  j.field("pool_reserved_before", double(p.pool_reserved_before)).field("pool_reserved_after", double(p.pool_reserved_after));
  j.key("idle_gaps").open('[');
  for (const idle_gap& g : m.idle_gaps) j.open('{').field("begin", g.begin).field("end", g.end).field("transfers", g.transfers).field("hosts", g.hosts).close('}');
  j.close(']');
  j.key("stream_gaps").open('[');
  for (const stream_gap& g : m.stream_gaps)
    j.open('{').field("rank", g.rank).field("step", g.step).field("begin", g.begin).field("end", g.end).field("cause", g.cause).close('}');
  j.close(']');
  j.close('}');
  j.key("clock").open('[');
  for (const auto& c : p.clocks) j.open('[').value(c.ms).value(double(c.sm_mhz)).value(double(c.reasons)).close(']');
  j.close(']');
  j.key("ranks").open('[');
  for (const rank_record& r : p.ranks) {
    j.open('{').field("rank", r.rank).field("t0_host", r.t0_host).field("t0_compute", r.t0_compute).field("t0_transfer", r.t0_transfer);
    j.field("finish_begin", r.finish_begin).field("finish_end", r.finish_end).field("returned", r.returned).field("tail", r.tail);
    j.field("synchronized", r.synchronized);
    j.key("steps").open('[');
    for (const step_record& s : r.steps) {
      j.open('{').field("start", s.start).field("posted", s.posted).field("confirmed", s.confirmed).field("compute_call", s.compute_call);
      j.field("queued", s.queued).field("end", s.end).field("group_ms", s.group_ms).field("wait_ms", s.wait_ms).field("waits", s.waits);
      j.field("partial_ms", s.partial_ms).field("compute_start", s.compute_start).field("compute_end", s.compute_end);
      j.field("kv_ready", s.kv_ready).field("kv_end", s.kv_end).field("dkdv_ready", s.dkdv_ready).field("dkdv_end", s.dkdv_end);
      j.field("alone_ms", s.alone_ms).close('}');
    }
    j.close(']');
    j.key("host").open('[');
    for (const host_interval& h : r.host) j.open('{').field("what", h.what).field("step", h.step).field("begin", h.begin).field("end", h.end).close('}');
    j.close(']');
    j.key("device").open('[');
    for (const device_span& d : r.spans) j.open('{').field("what", d.what).field("step", d.step).field("begin", d.begin).field("end", d.end).close('}');
    j.close(']');
    j.close('}');
  }
  j.close(']');
  j.close('}');
}

}  // namespace stria::bench::trace
