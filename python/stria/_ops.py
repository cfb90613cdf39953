# SPDX-License-Identifier: Apache-2.0
"""The stria operators (torch.ops.stria, built from csrc/torch_ops.cpp): their fake implementations
for torch.compile, autograd for the forward, and the user's entry points."""
from __future__ import annotations

import glob
import math
import os
from typing import NamedTuple, Optional

import torch

_library = glob.glob(os.path.join(os.path.dirname(__file__), "_stria_ops*.so"))
if not _library:
    raise ImportError("stria: the compiled operators (_stria_ops.so) are missing next to stria/__init__.py; "
                      "install with `pip install --no-build-isolation ./python` from a stria checkout")
torch.ops.load_library(_library[0])

#: Fills the tail of a padded selection row (after every real entry, so rows stay ascending).
PADDING = 2**31 - 1


class Selection(NamedTuple):
    """A Vertical-Slash selection per (batch element, query head), on the device, int32:
    vertical (batch, heads_q, width): key tokens every query may attend to (causal permitting);
    slash (batch, heads_q, width): block diagonals, query block - key block, of 64x64 tiles.
    Rows are ascending, unique, padded with PADDING; with causal attention every head keeps diagonal 0."""
    vertical: torch.Tensor
    slash: torch.Tensor


# --- fake implementations (shapes only), for torch.compile and opcheck -----------------------------

def _selection_like(q, seq_len, causal, *options):
    """Empty (vertical, slash) selection tensors of the estimator's widths at `seq_len`, on q's device."""
    batch, _, heads_q, _ = q.shape
    vertical_width, slash_width = torch.ops.stria.estimate_widths(int(seq_len), int(heads_q), causal, *options)
    return (q.new_empty((batch, heads_q, vertical_width), dtype=torch.int32),
            q.new_empty((batch, heads_q, slash_width), dtype=torch.int32))


@torch.library.register_fake("stria::estimate_selection")
def _estimate_selection_fake(q, k, softmax_scale, causal, *options):
    return _selection_like(q, q.shape[1], causal, *options)


@torch.library.register_fake("stria::forward")
def _forward_fake(q, k, v, vertical, slash, softmax_scale, causal, deterministic):
    batch, seq_len, heads_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads_q, seq_len), dtype=torch.float32)


@torch.library.register_fake("stria::backward")
def _backward_fake(d_out, q, k, v, out, lse, vertical, slash, softmax_scale, causal, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("stria::ring_estimate_selection")
def _ring_estimate_selection_fake(q, k, nccl_id, rank, world, layout, softmax_scale, causal, *options):
    return _selection_like(q, q.shape[1] * world, causal, *options)  # the whole sequence's selection


@torch.library.register_fake("stria::ring_forward")
def _ring_forward_fake(q, k, v, vertical, slash, nccl_id, rank, world, layout, softmax_scale, causal, deterministic):
    return _forward_fake(q, k, v, vertical, slash, softmax_scale, causal, deterministic)


@torch.library.register_fake("stria::ring_backward")
def _ring_backward_fake(d_out, q, k, v, out, lse, vertical, slash, nccl_id, rank, world, layout, softmax_scale, causal, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# --- autograd -------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    q, k, v, vertical, slash, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, vertical, slash)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.mark_non_differentiable(lse)  # the LSE is an output for inspection; no gradient flows through it


def _backward(ctx, d_out, _d_lse):
    q, k, v, out, lse, vertical, slash = ctx.saved_tensors
    dq, dk, dv = torch.ops.stria.backward(d_out.contiguous(), q, k, v, out, lse, vertical, slash, ctx.softmax_scale, ctx.causal,
                                          ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("stria::forward", _backward, setup_context=_setup_context)


def _ring_setup_context(ctx, inputs, output):
    q, k, v, vertical, slash, nccl_id, rank, world, layout, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, vertical, slash, nccl_id)
    ctx.ring = (rank, world, layout)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx, d_out, _d_lse):
    q, k, v, out, lse, vertical, slash, nccl_id = ctx.saved_tensors
    dq, dk, dv = torch.ops.stria.ring_backward(d_out.contiguous(), q, k, v, out, lse, vertical, slash, nccl_id, *ctx.ring,
                                               ctx.softmax_scale, ctx.causal, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 9


torch.library.register_autograd("stria::ring_forward", _ring_backward, setup_context=_ring_setup_context)


# --- entry points ---------------------------------------------------------------------------------

def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor]) -> None:
    """Clear exceptions before any operator runs: TypeError for types and dtypes, ValueError for the rest."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"stria: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"stria: {name}.dtype = {x.dtype}: must be torch.bfloat16 or torch.float16")
        if x.dim() != 4:
            raise ValueError(f"stria: {name}.shape = {tuple(x.shape)}: must be (batch, seq, heads, head_dim)")
        if x.device.type != "cuda":
            raise ValueError(f"stria: {name}.device = {x.device}: must be a CUDA device")
        if not x.is_contiguous():
            raise ValueError(f"stria: {name}.stride() = {x.stride()}: must be contiguous (call .contiguous())")
    if k.dtype != q.dtype or (v is not None and v.dtype != q.dtype):
        raise TypeError(f"stria: q, k, v dtypes {q.dtype}, {k.dtype}, {None if v is None else v.dtype}: must be equal")
    batch, seq_len, heads_q, head_dim = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(f"stria: k.shape = {tuple(k.shape)}: must match q.shape = {tuple(q.shape)} in batch, seq and head_dim")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"stria: v.shape = {tuple(v.shape)}: must equal k.shape = {tuple(k.shape)}")
    if heads_q % k.shape[2] != 0:
        raise ValueError(f"stria: k.shape[2] = {k.shape[2]}: the KV heads must divide the {heads_q} query heads (grouped-query attention)")
    if seq_len <= 0 or seq_len % 64 != 0:
        raise ValueError(f"stria: q.shape[1] = {seq_len}: the sequence length must be a positive multiple of 64 (the block size)")
    if head_dim not in (64, 128):
        raise ValueError(f"stria: q.shape[3] = {head_dim}: the head dim must be 64 or 128")
    if k.device != q.device or (v is not None and v.device != q.device):
        raise ValueError(f"stria: q, k, v must be on one device, got {q.device}, {k.device}, {None if v is None else v.device}")


def _scale(softmax_scale: Optional[float], head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"stria: softmax_scale = {softmax_scale}: must be a finite positive number")
    return float(softmax_scale)


#: The estimator's options and their defaults (binding.hpp's estimator_options, in the operators' order).
_ESTIMATOR_DEFAULTS = dict(p_vertical=0.99, p_slash=0.9, vertical_max=0, slash_max=0, sink_tokens=64, local_diagonals=3, last_q=64)


def _estimator_arguments(options: dict) -> tuple:
    """The operators' estimator arguments from keyword options (the defaults for those not given)."""
    unknown = sorted(set(options) - set(_ESTIMATOR_DEFAULTS))
    if unknown:
        raise TypeError(f"stria: unknown estimator options {unknown}: the options are {sorted(_ESTIMATOR_DEFAULTS)}")
    merged = {**_ESTIMATOR_DEFAULTS, **options}
    return tuple(float(merged[n]) if n.startswith("p_") else int(merged[n]) for n in _ESTIMATOR_DEFAULTS)


def estimate_selection(q: torch.Tensor, k: torch.Tensor, softmax_scale: Optional[float] = None, causal: bool = True,
                       **options) -> Selection:
    """The Vertical-Slash selection of every (batch element, query head), estimated online from q and k
    (estimator::vertical_slash_top_p: the last `last_q` queries' attention, top-p of its vertical and
    slash mass; a max of 0 picks the default cap at this length). Options and defaults: p_vertical 0.99,
    p_slash 0.9, vertical_max 0, slash_max 0, sink_tokens 64, local_diagonals 3, last_q 64."""
    _check_inputs(q, k, None)
    arguments = _estimator_arguments(options)
    with torch.no_grad():
        vertical, slash = torch.ops.stria.estimate_selection(q.detach(), k.detach(), _scale(softmax_scale, q.shape[-1]), bool(causal),
                                                             *arguments)
    return Selection(vertical, slash)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float] = None,
                     causal: bool = True, *, selection: Optional[Selection] = None, deterministic: bool = False,
                     return_lse: bool = False, return_selection: bool = False, **estimator_options):
    """Sparse attention of q (batch, seq, heads_q, dim) over k, v (batch, seq, heads_kv, dim), bf16 or fp16,
    on the entries of `selection` (estimated online from q and k when None, with `estimator_options`:
    see estimate_selection). Differentiable in q, k, v; `deterministic` makes the backward bit-identical
    across runs. Returns out (like q), then lse (batch, heads_q, seq) fp32 and the selection if asked."""
    _check_inputs(q, k, v)
    scale = _scale(softmax_scale, q.shape[-1])
    if selection is None:
        selection = estimate_selection(q, k, scale, causal, **estimator_options)
    else:
        _check_selection(selection, estimator_options)
    out, lse = torch.ops.stria.forward(q, k, v, selection[0], selection[1], scale, bool(causal), bool(deterministic))
    return _results(out, lse, selection, return_lse, return_selection)


def _check_selection(selection, estimator_options: dict) -> None:
    """A given selection: a Selection, and no estimator options beside it."""
    if estimator_options:
        raise ValueError(f"stria: estimator options {sorted(estimator_options)} apply only when no selection is given")
    if not isinstance(selection, tuple) or len(selection) != 2:
        raise TypeError("stria: selection must be a stria.Selection(vertical, slash)")


def _results(out, lse, selection, return_lse: bool, return_selection: bool):
    """out, then lse and the selection where asked."""
    result = (out,) + ((lse,) if return_lse else ()) + ((Selection(*selection),) if return_selection else ())
    return result[0] if len(result) == 1 else result


# --- sharding helpers -----------------------------------------------------------------------------

_LAYOUTS = ("striped", "zigzag", "sequential")


def _token_order(seq_len: int, world: int, layout: str, device) -> torch.Tensor:
    """Global token positions rank after rank, each rank's in local order (stria's sharding maps)."""
    if layout not in _LAYOUTS:
        raise ValueError(f"stria: layout = {layout!r}: must be one of {', '.join(_LAYOUTS)}")
    blocks = torch.tensor(torch.ops.stria.rank_blocks(layout, int(seq_len), int(world)), dtype=torch.long, device=device)
    return (blocks[:, None] * 64 + torch.arange(64, device=device)).flatten()


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "striped", *, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of the global tensor `x` along `dim` (the sequence), as stria's sharding
    `layout` lays tokens out over `world` ranks ("striped": 64-token stripes dealt round-robin;
    "zigzag": 2 x world chunks, rank r holding chunks r and 2 world - 1 - r; "sequential": contiguous).
    A rank's tokens keep their global order."""
    if not 0 <= rank < world:
        raise ValueError(f"stria: rank = {rank}: must lie in [0, world = {world})")
    order = _token_order(x.shape[dim], world, layout, x.device)
    local = x.shape[dim] // world
    return x.index_select(dim, order[rank * local:(rank + 1) * local]).contiguous()


def unshard(shards, layout: str = "striped", *, dim: int = 1) -> torch.Tensor:
    """The global tensor from every rank's shard (the inverse of shard), shards in rank order."""
    shards = list(shards)
    if not shards:
        raise ValueError("stria: shards is empty: give every rank's shard, in rank order")
    world = len(shards)
    local = shards[0].shape[dim]
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"stria: shard shapes {[tuple(s.shape) for s in shards]}: every rank's shard must have the same shape")
    order = _token_order(local * world, world, layout, shards[0].device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(shards, dim=dim).index_select(dim, inverse).contiguous()


# --- context parallelism --------------------------------------------------------------------------

_NCCL_IDS = {}  # (process group, CUDA device index) -> the NCCL unique id that names its ranks' communicator


def _ring_of(group, device: torch.device):
    """(nccl_id, rank, world) of this process in `group` (None: the default group) on `device`. The first
    call for a group and device is collective: rank 0 makes an NCCL unique id, the group broadcasts it
    (or rank 0's error, so that no rank waits for an id that never comes), and every rank makes its
    communicator at once (an id joins its ranks once: another device needs another id)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("stria: context_parallel_attention needs torch.distributed initialized "
                         "(torch.distributed.init_process_group) and a group of the ranks that hold the sequence's shards")
    group = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("stria: group: this process is not a member of the group it was given")
    key = (group, device.index)
    nccl_id = _NCCL_IDS.get(key)
    if nccl_id is None:
        box = [None]
        if rank == 0:
            try:
                box[0] = ("id", torch.ops.stria.nccl_unique_id())
            except Exception as e:  # every rank raises it, none waits
                box[0] = ("error", f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        kind, value = box[0]
        if kind == "error":
            raise RuntimeError(f"stria: rank 0 of the group could not make an NCCL unique id: {value}")
        nccl_id = value.cpu()
        torch.ops.stria.ring_init(nccl_id, rank, world, device.index)
        _NCCL_IDS[key] = nccl_id
    return nccl_id, rank, world


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, softmax_scale: Optional[float] = None,
                               causal: bool = True, *, layout: str = "striped", selection: Optional[Selection] = None,
                               deterministic: bool = False, return_lse: bool = False, return_selection: bool = False,
                               **estimator_options):
    """Sparse attention over a sequence sharded across the processes of a torch.distributed `group`
    (None: the default group), each process on its own GPU: stria's ring over NCCL (KV chunks travel
    while each step computes; dK/dV come back to their owners). q (batch, seq / world, heads_q, dim)
    and k, v (batch, seq / world, heads_kv, dim) are this rank's shards in stria's `layout` ("striped",
    "zigzag", "sequential"; make them with stria.shard). `selection` covers the whole sequence and is
    the same on every rank; None estimates it online from every rank's shards (the estimator's
    collectives run over the ring; `estimator_options` as for estimate_selection). Differentiable in
    q, k, v. Returns this rank's out (like q), then lse (batch, heads_q, seq / world) and the selection
    if asked. Every rank of the group must make the same calls in the same order. The ring has its own
    NCCL communicator: no other NCCL work of these ranks may run on other streams while a call runs
    (DDP's and FSDP's gradient reductions overlap the backward: keep them out of the attention's
    backward, e.g. in another phase or a separate group of ranks), and the host confirms each ring
    step's transfers (it waits a step behind the device). A communicator that gave up after an error
    (a peer failed, a timeout) is aborted for good: the group's later calls raise, and a new group
    gets a new one."""
    _check_inputs(q, k, v)
    if layout not in _LAYOUTS:
        raise ValueError(f"stria: layout = {layout!r}: must be one of {', '.join(_LAYOUTS)}")
    nccl_id, rank, world = _ring_of(group, q.device)
    scale = _scale(softmax_scale, q.shape[-1])
    if selection is None:
        arguments = _estimator_arguments(estimator_options)
        with torch.no_grad():
            selection = Selection(*torch.ops.stria.ring_estimate_selection(q.detach(), k.detach(), nccl_id, rank, world, layout, scale,
                                                                           bool(causal), *arguments))
    else:
        _check_selection(selection, estimator_options)
    out, lse = torch.ops.stria.ring_forward(q, k, v, selection[0], selection[1], nccl_id, rank, world, layout, scale, bool(causal),
                                            bool(deterministic))
    return _results(out, lse, selection, return_lse, return_selection)
