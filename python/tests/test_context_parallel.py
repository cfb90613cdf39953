# SPDX-License-Identifier: Apache-2.0
"""Device tests of stria.context_parallel_attention (stria's ring over NCCL, its ranks the processes of a
torch.distributed group): on one GPU a group of one process against the single-GPU operator and SDPA's
math path, for every layout, head dims 64 and 128, GQA, given and estimated selections, both backward
modes; with two or more GPUs, two processes (one GPU each) whose shards, put together, must match the
single-GPU operator on the whole sequence; errors on bad input. Run with pytest, or as a script. Skips
(exit 77 as a script) where torch, CUDA or stria is missing."""
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_sparse_attention as single  # noqa: E402  (torch or None, and what the single-GPU tests share)

torch = single.torch
SKIP = single.SKIP


def _available():
    return single._available() and torch.distributed.is_available()


if "pytest" in sys.modules:  # collected by pytest (not run as a script, nor imported by a spawned rank)
    import pytest
    if not _available():
        pytest.skip("torch with CUDA and torch.distributed, and the stria package are needed", allow_module_level=True)

if _available():
    import torch.distributed as dist
    import stria
    from test_sparse_attention import dense_mask, expect, inputs, random_selection, reference, relative_error

LAYOUTS = ("striped", "zigzag", "sequential")


def one_process_group():
    """The default group as one process (gloo over a file: the group only carries NCCL's unique id)."""
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="stria_cp_"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def test_readme_example():
    one_process_group()
    q, k, v, d_out = inputs(1, 4096, 16, 2, 128, torch.bfloat16, 43)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    q, k, v = (stria.shard(x, rank, world, "striped").requires_grad_() for x in (q, k, v))  # this rank's shards of the sequence
    out = stria.context_parallel_attention(q, k, v, group, layout="striped")                # stria's ring over NCCL, ranks = group
    out.backward(stria.shard(d_out, rank, world, "striped"))                                # dq, dk, dv of this rank's shards
    assert out.shape == q.shape and all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v))


def test_world_of_one_matches_the_single_gpu_operator():
    one_process_group()
    batch, seq_len = 2, 512
    for dtype, dim, heads_q, heads_kv, causal in ((torch.bfloat16, 128, 4, 2, True), (torch.float16, 64, 4, 4, True),
                                                  (torch.bfloat16, 64, 8, 1, False)):
        q, k, v, d_out = inputs(batch, seq_len, heads_q, heads_kv, dim, dtype, 31)
        selection = random_selection(batch, heads_q, seq_len, causal, torch.Generator().manual_seed(9))
        scale = 1.0 / math.sqrt(dim)
        single = [x.clone().requires_grad_() for x in (q, k, v)]
        want, want_lse = stria.sparse_attention(*single, scale, causal, selection=selection, deterministic=True, return_lse=True)
        want.backward(d_out)
        ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
        ref = reference(*ref_leaves, dense_mask(selection, seq_len, causal), scale)
        ref.backward(d_out.float())
        tolerance = 2e-2 if dtype == torch.bfloat16 else 5e-3
        for layout, deterministic in zip(LAYOUTS, (True, False, True)):  # one rank: every layout is the sequence itself
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out, lse = stria.context_parallel_attention(*leaves, None, scale, causal, layout=layout, selection=selection,
                                                        deterministic=deterministic, return_lse=True)
            out.backward(d_out)
            what = f"{layout} {dtype} D {dim} Hq {heads_q} Hkv {heads_kv} causal {causal} deterministic {deterministic}"
            assert relative_error(out, want) < 1e-3 and relative_error(lse, want_lse) < 1e-5, what
            for name, a, b, r in zip(("dq", "dk", "dv"), leaves, single, ref_leaves):
                # the atomic mode adds the vertical tokens' dK/dV by fp32 reductions in any order
                assert relative_error(a.grad, b.grad) < (1e-3 if deterministic else 1e-2), f"{what}: {name} against the single-GPU operator"
                assert relative_error(a.grad, r.grad) < tolerance, f"{what}: {name} against SDPA's math path"
            assert relative_error(out, ref) < tolerance, what


def test_world_of_one_estimates_the_single_gpu_selection():
    one_process_group()
    q, k, v, d_out = inputs(1, 1024, 8, 2, 128, torch.bfloat16, 37)
    want = stria.estimate_selection(q, k, vertical_max=64, slash_max=4)
    out, got = stria.context_parallel_attention(q, k, v, vertical_max=64, slash_max=4, return_selection=True)
    assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash)
    assert relative_error(out, stria.sparse_attention(q, k, v, selection=want)) < 1e-3


def test_bad_input_raises_clear_errors():
    one_process_group()
    q, k, v, _ = inputs(1, 256, 4, 2, 64, torch.bfloat16, 41)
    sel = random_selection(1, 4, 256, True, torch.Generator().manual_seed(3))
    run = stria.context_parallel_attention
    expect(ValueError, "layout = 'ring'", lambda: run(q, k, v, layout="ring", selection=sel))
    expect(TypeError, "q.dtype = torch.float32", lambda: run(q.float(), k, v, selection=sel))
    expect(ValueError, "positive multiple of 64", lambda: run(q[:, :100].contiguous(), k[:, :100].contiguous(), v[:, :100].contiguous()))
    expect(TypeError, "unknown estimator options ['p_vertcal']", lambda: run(q, k, v, p_vertcal=0.5))
    expect(ValueError, "apply only when no selection", lambda: run(q, k, v, selection=sel, p_slash=0.5))
    past_the_end = sel.vertical.clone()
    past_the_end[..., 0] = 256  # a key token past the whole sequence (256 tokens: one rank)
    expect(ValueError, "vertical_tokens", lambda: run(q, k, v, selection=stria.Selection(past_the_end, sel.slash)))
    nccl_id = torch.ops.stria.nccl_unique_id()
    assert nccl_id.dtype == torch.uint8 and tuple(nccl_id.shape) == (128,) and nccl_id.device.type == "cpu"
    ring = lambda nid, rank, world, layout="striped": torch.ops.stria.ring_forward(q, k, v, sel.vertical, sel.slash, nid, rank, world,  # noqa: E731
                                                                                   layout, 0.125, True, False)
    expect(ValueError, "nccl_id must be the uint8 CPU tensor", lambda: ring(nccl_id[:64], 0, 1))
    expect(ValueError, "nccl_id must be the uint8 CPU tensor", lambda: ring(nccl_id.cuda(), 0, 1))
    expect(ValueError, "rank = 1", lambda: ring(nccl_id, 1, 1))
    expect(ValueError, "world = 0", lambda: ring(nccl_id, 0, 0))
    expect(ValueError, "layout", lambda: ring(nccl_id, 0, 1, "diagonal"))


# --- two processes, one GPU each ------------------------------------------------------------------

def _global_case(seed, dim=128, heads_q=8, heads_kv=2, seq_len=2048):
    """The whole problem in bf16, made the same way in every process (CPU generator, then the GPU)."""
    g = torch.Generator().manual_seed(seed)
    make = lambda heads: torch.randn(1, seq_len, heads, dim, generator=g).to(torch.bfloat16)  # noqa: E731
    return make(heads_q), make(heads_kv), make(heads_kv), make(heads_q)


def _two_process_rank(rank, world, store, results):
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for layout in ("striped", "zigzag"):
            for estimated in (False, True):
                q, k, v, d_out = (x.cuda() for x in _global_case(5))
                selection = None if estimated else random_selection(1, 8, 2048, True, torch.Generator().manual_seed(8))
                shards = [stria.shard(x, rank, world, layout).requires_grad_() for x in (q, k, v)]
                out, lse, sel = stria.context_parallel_attention(*shards, layout=layout, selection=selection, return_lse=True,
                                                                 return_selection=True, deterministic=True)
                out.backward(stria.shard(d_out, rank, world, layout))
                torch.save({"out": out.detach().cpu(), "lse": lse.cpu(), "selection": (sel.vertical.cpu(), sel.slash.cpu()),
                            "grads": [x.grad.cpu() for x in shards]}, os.path.join(results, f"{layout}_{estimated}_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_processes_match_the_whole_sequence_on_one_gpu():
    if torch.cuda.device_count() < 2:
        single.skip("fewer than two GPUs")
    import torch.multiprocessing as mp
    world = 2
    results = tempfile.mkdtemp(prefix="stria_cp_results_")
    mp.spawn(_two_process_rank, args=(world, os.path.join(results, "store"), results), nprocs=world, join=True)
    for layout in ("striped", "zigzag"):
        for estimated in (False, True):
            parts = [torch.load(os.path.join(results, f"{layout}_{estimated}_{r}.pt")) for r in range(world)]
            vertical, slash = parts[0]["selection"]
            for p in parts[1:]:
                assert torch.equal(p["selection"][0], vertical) and torch.equal(p["selection"][1], slash), "the selection differs between ranks"
            q, k, v, d_out = (x.cuda() for x in _global_case(5))
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            want, want_lse = stria.sparse_attention(*leaves, selection=stria.Selection(vertical.cuda(), slash.cuda()), deterministic=True,
                                                    return_lse=True)
            want.backward(d_out)
            what = f"{layout}, {'estimated' if estimated else 'given'} selection"
            got = stria.unshard([p["out"] for p in parts], layout).cuda()
            got_lse = stria.unshard([p["lse"] for p in parts], layout, dim=2).cuda()
            assert relative_error(got, want) < 1e-2 and relative_error(got_lse, want_lse) < 1e-3, what
            for i, name in enumerate(("dq", "dk", "dv")):
                grad = stria.unshard([p["grads"][i] for p in parts], layout).cuda()
                assert relative_error(grad, leaves[i].grad) < 2e-2, f"{what}: {name}"


if __name__ == "__main__":
    single.run_as_script(globals(), _available(), "torch with CUDA and torch.distributed, and the stria package")
