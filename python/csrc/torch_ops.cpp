// SPDX-License-Identifier: Apache-2.0
// stria's PyTorch operators (library "stria"), on CUDA tensors in flash-attn's layout: q
// [batch, seq, heads_q, dim], k and v [batch, seq, heads_kv, dim], contiguous, bf16 or fp16.
//   estimate_widths       the widths of estimate_selection's padded rows (no tensors: runs anywhere)
//   rank_blocks           the global blocks of each rank under a sharding (no tensors)
//   estimate_selection    the Vertical-Slash selection of every (batch element, query head), online
//   forward / backward    sparse attention on a selection; autograd, fake implementations and the
//                         user's entry point are in the Python package (stria/_ops.py)
//   nccl_unique_id        a new NCCL unique id, a uint8 CPU tensor (rank 0 of a group makes it)
//   ring_init             this process's communicator of a group on a device (every rank at once)
//   ring_estimate_selection, ring_forward, ring_backward
//                         the same on one rank's shards of a sequence laid out over the processes of
//                         a group (context parallelism: stria's ring over NCCL, joined by that id)
// Bad input raises ValueError (TypeError for a dtype) naming the argument, the value and the rule.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "binding.hpp"

namespace {

using at::Tensor;
namespace sp = stria::python;

/// Raises a failed call's error in PyTorch's terms: the library's invalid_argument as ValueError,
/// anything else as RuntimeError, the message kept.
void raise_if_failed(const sp::outcome& o) {
  TORCH_CHECK_VALUE(o.what != sp::outcome::kind::invalid_argument, o.message);
  TORCH_CHECK(o.what == sp::outcome::kind::ok, o.message);
}

std::pair<std::int64_t, std::int64_t> widths_of(const sp::estimator_options& o, std::int64_t seq_len, std::int64_t heads_q, bool causal) {
  std::pair<std::int64_t, std::int64_t> widths;
  raise_if_failed(sp::estimate_widths(o, seq_len, heads_q, causal, widths));
  return widths;
}

std::string shape_text(const Tensor& x) { return c10::str(x.sizes()); }

void check_attention_tensor(const Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.dim() == 4, "stria: ", name, ".shape = ", shape_text(x), ": must be (batch, seq, heads, head_dim)");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "stria: ", name, ".dtype = ", x.scalar_type(),
                   ": must be torch.bfloat16 or torch.float16");
  TORCH_CHECK_VALUE(x.is_cuda(), "stria: ", name, ".device = ", x.device(), ": must be a CUDA device");
  TORCH_CHECK_VALUE(x.is_contiguous(), "stria: ", name, ".stride() = ", c10::str(x.strides()), ": must be contiguous (call .contiguous())");
}

/// The call's shapes, checked: q, k (and v, d_out, out where given) agree in batch, seq, dim, dtype, device.
sp::problem problem_of(const Tensor& q, const Tensor& k, const Tensor* v, double softmax_scale, bool causal) {
  check_attention_tensor(q, "q");
  check_attention_tensor(k, "k");
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), "stria: k.shape = ", shape_text(k),
                    ": must match q.shape = ", shape_text(q), " in batch, seq and head_dim");
  TORCH_CHECK_VALUE(q.size(2) % k.size(2) == 0, "stria: k.shape[2] = ", k.size(2), ": the KV heads must divide the ", q.size(2),
                    " query heads (grouped-query attention)");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "stria: k.dtype = ", k.scalar_type(), ": must equal q.dtype = ", q.scalar_type());
  TORCH_CHECK_VALUE(k.device() == q.device(), "stria: k.device = ", k.device(), ": must equal q.device = ", q.device());
  if (v) {
    check_attention_tensor(*v, "v");
    TORCH_CHECK_VALUE(v->sizes() == k.sizes(), "stria: v.shape = ", shape_text(*v), ": must equal k.shape = ", shape_text(k));
    TORCH_CHECK_TYPE(v->scalar_type() == q.scalar_type(), "stria: v.dtype = ", v->scalar_type(), ": must equal q.dtype = ", q.scalar_type());
    TORCH_CHECK_VALUE(v->device() == q.device(), "stria: v.device = ", v->device(), ": must equal q.device = ", q.device());
  }
  TORCH_CHECK_VALUE(q.size(1) > 0 && q.size(1) % 64 == 0, "stria: q.shape[1] = ", q.size(1),
                    ": the sequence length must be a positive multiple of 64 (the block size)");
  TORCH_CHECK_VALUE(q.size(3) == 64 || q.size(3) == 128, "stria: q.shape[3] = ", q.size(3), ": the head dim must be 64 or 128");
  sp::problem p;
  p.batch = q.size(0);
  p.seq_len = q.size(1);
  p.heads_q = q.size(2);
  p.heads_kv = k.size(2);
  p.head_dim = q.size(3);
  p.causal = causal;
  p.softmax_scale = softmax_scale;
  p.type = q.scalar_type() == at::kBFloat16 ? sp::element::bf16 : sp::element::fp16;
  p.stream = at::cuda::getCurrentCUDAStream(q.device().index()).stream();
  return p;
}

void check_same_as(const Tensor& x, const Tensor& like, const char* name, const char* like_name) {
  TORCH_CHECK_VALUE(x.sizes() == like.sizes(), "stria: ", name, ".shape = ", shape_text(x), ": must equal ", like_name, ".shape = ", shape_text(like));
  TORCH_CHECK_TYPE(x.scalar_type() == like.scalar_type(), "stria: ", name, ".dtype = ", x.scalar_type(), ": must equal ", like_name,
                   ".dtype = ", like.scalar_type());
  TORCH_CHECK_VALUE(x.device() == like.device(), "stria: ", name, ".device = ", x.device(), ": must equal ", like_name, ".device = ", like.device());
  TORCH_CHECK_VALUE(x.is_contiguous(), "stria: ", name, " must be contiguous");
}

/// The selection tensors on the host, checked against the problem (their entries are checked by the
/// library when the index is built).
struct host_selection {
  Tensor vertical, slash;
  sp::padded_selection view;
};
host_selection selection_of(const sp::problem& p, const Tensor& vertical, const Tensor& slash) {
  for (auto [x, name] : {std::pair{&vertical, "vertical"}, std::pair{&slash, "slash"}}) {
    TORCH_CHECK_TYPE(x->scalar_type() == at::kInt, "stria: ", name, ".dtype = ", x->scalar_type(), ": must be torch.int32");
    TORCH_CHECK_VALUE(x->dim() == 3 && x->size(0) == p.batch && x->size(1) == p.heads_q, "stria: ", name, ".shape = ", shape_text(*x),
                      ": must be (batch, heads_q, width) = (", p.batch, ", ", p.heads_q, ", width)");
  }
  host_selection s{vertical.to(at::kCPU).contiguous(), slash.to(at::kCPU).contiguous(), {}};
  s.view = {s.vertical.data_ptr<std::int32_t>(), s.vertical.size(2), s.slash.data_ptr<std::int32_t>(), s.slash.size(2)};
  return s;
}

sp::estimator_options options_of(double p_vertical, double p_slash, std::int64_t vertical_max, std::int64_t slash_max, std::int64_t sink_tokens,
                                 std::int64_t local_diagonals, std::int64_t last_q) {
  return {p_vertical, p_slash, vertical_max, slash_max, sink_tokens, local_diagonals, last_q};
}

std::vector<std::int64_t> estimate_widths(std::int64_t seq_len, std::int64_t heads_q, bool causal, double p_vertical, double p_slash,
                                          std::int64_t vertical_max, std::int64_t slash_max, std::int64_t sink_tokens,
                                          std::int64_t local_diagonals, std::int64_t last_q) {
  const auto [vertical, slash] =
      widths_of(options_of(p_vertical, p_slash, vertical_max, slash_max, sink_tokens, local_diagonals, last_q), seq_len, heads_q, causal);
  return {vertical, slash};
}

std::vector<std::int64_t> rank_blocks(std::string layout, std::int64_t seq_len, std::int64_t world) {
  std::vector<std::int64_t> blocks;
  raise_if_failed(sp::rank_blocks(layout, seq_len, world, blocks));
  return blocks;
}

std::tuple<Tensor, Tensor> estimate_selection(const Tensor& q, const Tensor& k, double softmax_scale, bool causal, double p_vertical,
                                              double p_slash, std::int64_t vertical_max, std::int64_t slash_max, std::int64_t sink_tokens,
                                              std::int64_t local_diagonals, std::int64_t last_q) {
  const c10::cuda::CUDAGuard guard(q.device());
  const sp::problem p = problem_of(q, k, nullptr, softmax_scale, causal);
  const sp::estimator_options o = options_of(p_vertical, p_slash, vertical_max, slash_max, sink_tokens, local_diagonals, last_q);
  const auto [vertical_width, slash_width] = widths_of(o, p.seq_len, p.heads_q, causal);
  const auto host_int = at::TensorOptions().dtype(at::kInt).device(at::kCPU);
  Tensor vertical = at::empty({p.batch, p.heads_q, vertical_width}, host_int), slash = at::empty({p.batch, p.heads_q, slash_width}, host_int);
  raise_if_failed(sp::estimate(p, q.data_ptr(), k.data_ptr(), o, vertical.data_ptr<std::int32_t>(), slash.data_ptr<std::int32_t>()));
  return {vertical.to(q.device()), slash.to(q.device())};
}

std::tuple<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& vertical, const Tensor& slash,
                                   double softmax_scale, bool causal, bool deterministic) {
  (void)deterministic;  // the backward's mode, kept by autograd for it
  const c10::cuda::CUDAGuard guard(q.device());
  const sp::problem p = problem_of(q, k, &v, softmax_scale, causal);
  const host_selection s = selection_of(p, vertical, slash);
  Tensor out = at::empty_like(q);
  Tensor lse = at::empty({p.batch, p.heads_q, p.seq_len}, q.options().dtype(at::kFloat));
  raise_if_failed(sp::forward(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), s.view, out.data_ptr(), lse.data_ptr<float>()));
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                            const Tensor& lse, const Tensor& vertical, const Tensor& slash, double softmax_scale, bool causal,
                                            bool deterministic) {
  const c10::cuda::CUDAGuard guard(q.device());
  const sp::problem p = problem_of(q, k, &v, softmax_scale, causal);
  check_same_as(out, q, "out", "q");
  check_same_as(d_out, q, "d_out", "q");
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == p.batch && lse.size(1) == p.heads_q &&
                        lse.size(2) == p.seq_len && lse.is_contiguous() && lse.device() == q.device(),
                    "stria: lse must be the forward's: float32 (batch, heads_q, seq) = (", p.batch, ", ", p.heads_q, ", ", p.seq_len,
                    "), contiguous, on q's device; got ", lse.scalar_type(), " ", shape_text(lse));
  const host_selection s = selection_of(p, vertical, slash);
  const auto fp32 = q.options().dtype(at::kFloat);
  Tensor dk_sum = at::empty({p.seq_len, p.heads_kv, p.head_dim}, fp32), dv_sum = at::empty_like(dk_sum),
         delta = at::empty({p.heads_q, p.seq_len}, fp32);
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  raise_if_failed(sp::backward(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), d_out.data_ptr(), lse.data_ptr<float>(), s.view,
                               deterministic, {dk_sum.data_ptr<float>(), dv_sum.data_ptr<float>(), delta.data_ptr<float>()},
                               dq.data_ptr(), dk.data_ptr(), dv.data_ptr()));
  return {dq, dk, dv};
}

// --- context parallelism ------------------------------------------------------------------------

Tensor nccl_unique_id() {
  std::array<unsigned char, sp::nccl_id_bytes> id{};
  raise_if_failed(sp::nccl_unique_id(id));
  Tensor bytes = at::empty({static_cast<std::int64_t>(id.size())}, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  std::memcpy(bytes.data_ptr(), id.data(), id.size());
  return bytes;
}

/// The call's place in the group's ring, checked.
sp::ring_ranks ring_of(const Tensor& nccl_id, std::int64_t rank, std::int64_t world, const std::string& layout = {}) {
  TORCH_CHECK_VALUE(nccl_id.scalar_type() == at::kByte && nccl_id.dim() == 1 && nccl_id.numel() == static_cast<std::int64_t>(sp::nccl_id_bytes) &&
                        nccl_id.device().is_cpu(),
                    "stria: nccl_id must be the uint8 CPU tensor of ", sp::nccl_id_bytes, " bytes that nccl_unique_id made; got ",
                    nccl_id.scalar_type(), " ", shape_text(nccl_id), " on ", nccl_id.device());
  TORCH_CHECK_VALUE(world >= 1, "stria: world = ", world, ": must be at least 1");
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "stria: rank = ", rank, ": must lie in [0, world = ", world, ")");
  sp::ring_ranks r;
  std::memcpy(r.nccl_id.data(), nccl_id.contiguous().data_ptr(), sp::nccl_id_bytes);
  r.rank = rank;
  r.world = world;
  r.layout = layout;
  return r;
}

void ring_init(const Tensor& nccl_id, std::int64_t rank, std::int64_t world, std::int64_t device) {
  TORCH_CHECK_VALUE(device >= 0, "stria: device = ", device, ": must be a CUDA device index");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  raise_if_failed(sp::ring_init(ring_of(nccl_id, rank, world)));  // the communicator knows no layout
}

/// problem_of for a rank's shards: the whole sequence is world times the shard.
sp::problem ring_problem_of(const Tensor& q, const Tensor& k, const Tensor* v, double softmax_scale, bool causal, const sp::ring_ranks& r) {
  sp::problem p = problem_of(q, k, v, softmax_scale, causal);
  p.seq_len *= r.world;
  return p;
}

std::tuple<Tensor, Tensor> ring_estimate_selection(const Tensor& q, const Tensor& k, const Tensor& nccl_id, std::int64_t rank, std::int64_t world,
                                                   std::string layout, double softmax_scale, bool causal, double p_vertical, double p_slash,
                                                   std::int64_t vertical_max, std::int64_t slash_max, std::int64_t sink_tokens,
                                                   std::int64_t local_diagonals, std::int64_t last_q) {
  const c10::cuda::CUDAGuard guard(q.device());
  const sp::ring_ranks r = ring_of(nccl_id, rank, world, layout);
  const sp::problem p = ring_problem_of(q, k, nullptr, softmax_scale, causal, r);
  const sp::estimator_options o = options_of(p_vertical, p_slash, vertical_max, slash_max, sink_tokens, local_diagonals, last_q);
  const auto [vertical_width, slash_width] = widths_of(o, p.seq_len, p.heads_q, causal);
  const auto host_int = at::TensorOptions().dtype(at::kInt).device(at::kCPU);
  Tensor vertical = at::empty({p.batch, p.heads_q, vertical_width}, host_int), slash = at::empty({p.batch, p.heads_q, slash_width}, host_int);
  raise_if_failed(sp::ring_estimate(p, r, q.data_ptr(), k.data_ptr(), o, vertical.data_ptr<std::int32_t>(), slash.data_ptr<std::int32_t>()));
  return {vertical.to(q.device()), slash.to(q.device())};
}

std::tuple<Tensor, Tensor> ring_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& vertical, const Tensor& slash,
                                        const Tensor& nccl_id, std::int64_t rank, std::int64_t world, std::string layout, double softmax_scale,
                                        bool causal, bool deterministic) {
  (void)deterministic;  // the backward's mode, kept by autograd for it
  const c10::cuda::CUDAGuard guard(q.device());
  const sp::ring_ranks r = ring_of(nccl_id, rank, world, layout);
  const sp::problem p = ring_problem_of(q, k, &v, softmax_scale, causal, r);
  const host_selection s = selection_of(p, vertical, slash);
  Tensor out = at::empty_like(q);
  Tensor lse = at::empty({p.batch, p.heads_q, q.size(1)}, q.options().dtype(at::kFloat));
  raise_if_failed(sp::ring_forward(p, r, q.data_ptr(), k.data_ptr(), v.data_ptr(), s.view, out.data_ptr(), lse.data_ptr<float>()));
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> ring_backward(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                                 const Tensor& lse, const Tensor& vertical, const Tensor& slash, const Tensor& nccl_id,
                                                 std::int64_t rank, std::int64_t world, std::string layout, double softmax_scale, bool causal,
                                                 bool deterministic) {
  const c10::cuda::CUDAGuard guard(q.device());
  const sp::ring_ranks r = ring_of(nccl_id, rank, world, layout);
  const sp::problem p = ring_problem_of(q, k, &v, softmax_scale, causal, r);
  check_same_as(out, q, "out", "q");
  check_same_as(d_out, q, "d_out", "q");
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == p.batch && lse.size(1) == p.heads_q &&
                        lse.size(2) == q.size(1) && lse.is_contiguous() && lse.device() == q.device(),
                    "stria: lse must be the forward's: float32 (batch, heads_q, local seq) = (", p.batch, ", ", p.heads_q, ", ", q.size(1),
                    "), contiguous, on q's device; got ", lse.scalar_type(), " ", shape_text(lse));
  const host_selection s = selection_of(p, vertical, slash);
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  raise_if_failed(sp::ring_backward(p, r, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), d_out.data_ptr(), lse.data_ptr<float>(), s.view,
                                    deterministic, dq.data_ptr(), dk.data_ptr(), dv.data_ptr()));
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(stria, m) {
  m.def("estimate_widths(int seq_len, int heads_q, bool causal, float p_vertical, float p_slash, int vertical_max, int slash_max, "
        "int sink_tokens, int local_diagonals, int last_q) -> int[]",
        &estimate_widths);
  m.def("rank_blocks(str layout, int seq_len, int world) -> int[]", &rank_blocks);
  m.def("estimate_selection(Tensor q, Tensor k, float softmax_scale, bool causal, float p_vertical, float p_slash, int vertical_max, "
        "int slash_max, int sink_tokens, int local_diagonals, int last_q) -> (Tensor vertical, Tensor slash)");
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor vertical, Tensor slash, float softmax_scale, bool causal, bool deterministic) "
        "-> (Tensor out, Tensor lse)");
  m.def("backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor vertical, Tensor slash, float softmax_scale, "
        "bool causal, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("nccl_unique_id() -> Tensor", &nccl_unique_id);
  m.def("ring_init(Tensor nccl_id, int rank, int world, int device) -> ()", &ring_init);
  m.def("ring_estimate_selection(Tensor q, Tensor k, Tensor nccl_id, int rank, int world, str layout, float softmax_scale, bool causal, "
        "float p_vertical, float p_slash, int vertical_max, int slash_max, int sink_tokens, int local_diagonals, int last_q) "
        "-> (Tensor vertical, Tensor slash)");
  m.def("ring_forward(Tensor q, Tensor k, Tensor v, Tensor vertical, Tensor slash, Tensor nccl_id, int rank, int world, str layout, "
        "float softmax_scale, bool causal, bool deterministic) -> (Tensor out, Tensor lse)");
  m.def("ring_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor vertical, Tensor slash, Tensor nccl_id, "
        "int rank, int world, str layout, float softmax_scale, bool causal, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(stria, CUDA, m) {
  m.impl("estimate_selection", &estimate_selection);
  m.impl("forward", &forward);
  m.impl("backward", &backward);
  m.impl("ring_estimate_selection", &ring_estimate_selection);
  m.impl("ring_forward", &ring_forward);
  m.impl("ring_backward", &ring_backward);
}
