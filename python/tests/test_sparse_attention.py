# SPDX-License-Identifier: Apache-2.0
"""Device tests of stria's PyTorch operators: output and every gradient against PyTorch SDPA's math path
(fp32, the same mask built from the selection), bf16 and fp16, head dims 64 and 128, GQA 1 / 2 / 8;
the online estimate; opcheck; torch.compile; a deterministic backward; errors on bad input.
Run with pytest, or as a script. Skips (exit 77 as a script) where torch, CUDA or stria is missing."""
import math
import sys

try:
    import torch
except ImportError:  # no torch here: nothing to test
    torch = None

SKIP = 77


def _available():
    if torch is None or not torch.cuda.is_available():
        return False
    try:
        import stria  # noqa: F401
    except ImportError:
        return False
    return True


if "pytest" in sys.modules:  # collected by pytest (not run as a script, nor imported by another test file)
    import pytest
    if not _available():
        pytest.skip("torch with CUDA and the stria package are needed", allow_module_level=True)

if _available():
    import stria


def random_selection(batch, heads, seq_len, causal, generator):
    """A selection per (batch, head): diagonal 0, some random block diagonals and vertical tokens, padded."""
    blocks = seq_len // 64
    vertical_rows, slash_rows = [], []
    for _ in range(batch * heads):
        deltas = torch.randperm(blocks, generator=generator)[: max(1, blocks // 3)]
        if not causal:
            deltas = torch.cat([deltas, -torch.randperm(blocks - 1, generator=generator)[: blocks // 4] - 1])
        slash_rows.append(torch.unique(torch.cat([torch.tensor([0]), deltas])))
        vertical_rows.append(torch.unique(torch.randperm(seq_len, generator=generator)[: seq_len // 16]))

    def padded(rows):
        width = max(len(r) for r in rows) + 2  # some padding on every row
        out = torch.full((batch * heads, width), stria.PADDING, dtype=torch.int32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r.to(torch.int32)
        return out.view(batch, heads, width).cuda()

    return stria.Selection(padded(vertical_rows), padded(slash_rows))


def dense_mask(selection, seq_len, causal):
    """(batch, heads, seq, seq) bool: the entries the selection keeps (causal permitting)."""
    vertical, slash = selection.vertical.cpu(), selection.slash.cpu()
    batch, heads, _ = vertical.shape
    token = torch.arange(seq_len)
    delta = token[:, None] // 64 - token[None, :] // 64
    mask = torch.zeros(batch, heads, seq_len, seq_len, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            s = slash[b, h][slash[b, h] != stria.PADDING]
            v = vertical[b, h][vertical[b, h] != stria.PADDING].long()
            m = torch.isin(delta, s.long())
            m[:, v] = True
            if causal:
                m &= token[None, :] <= token[:, None]
            mask[b, h] = m
    return mask.cuda()


def reference(q, k, v, mask, scale):
    """SDPA's math path in fp32 on (batch, seq, heads, dim) tensors; GQA by repeating KV heads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def inputs(batch, seq_len, heads_q, heads_kv, dim, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda heads: torch.randn(batch, seq_len, heads, dim, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return make(heads_q), make(heads_kv), make(heads_kv), make(heads_q)


def check_against_reference(dtype, dim, heads_q, heads_kv, causal, selection_kind, seed=0):
    batch, seq_len = 2, 512
    q, k, v, d_out = inputs(batch, seq_len, heads_q, heads_kv, dim, dtype, seed)
    scale = 1.0 / math.sqrt(dim)
    if selection_kind == "given":
        selection = random_selection(batch, heads_q, seq_len, causal, torch.Generator().manual_seed(seed))
    else:
        selection = stria.estimate_selection(q, k, scale, causal, vertical_max=32, slash_max=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = stria.sparse_attention(*leaves, scale, causal, selection=selection)
    out.backward(d_out)
    ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = reference(*ref_leaves, dense_mask(selection, seq_len, causal), scale)
    ref.backward(d_out.float())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 5e-3
    errors = {"out": relative_error(out, ref)}
    for name, got, want in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        errors[name] = relative_error(got.grad, want.grad)
    bad = {name: e for name, e in errors.items() if not e < tolerance}
    assert not bad, f"{dtype} D {dim} Hq {heads_q} Hkv {heads_kv} causal {causal} {selection_kind}: relative errors {errors}"


def test_readme_example():
    q, k, v, d_out = inputs(1, 4096, 16, 2, 128, torch.bfloat16, 23)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = stria.sparse_attention(q, k, v)  # q (batch, seq, heads_q, dim), k, v (batch, seq, heads_kv, dim)
    out.backward(d_out)                    # dq, dk, dv by stria's sparse backward
    assert out.shape == q.shape and all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v))


def test_matches_sdpa_math_on_given_selections():
    for dtype in (torch.bfloat16, torch.float16):
        for dim in (64, 128):
            for heads_q, heads_kv in ((4, 4), (4, 2), (8, 1)):
                check_against_reference(dtype, dim, heads_q, heads_kv, True, "given")
    check_against_reference(torch.bfloat16, 128, 4, 2, False, "given")


def test_matches_sdpa_math_on_estimated_selections():
    for dtype in (torch.bfloat16, torch.float16):
        for dim in (64, 128):
            check_against_reference(dtype, dim, 8, 2, True, "estimated", seed=3)


def test_estimated_selection_shape_and_safeguards():
    q, k, _, _ = inputs(2, 1024, 4, 2, 128, torch.bfloat16, 7)
    sel = stria.estimate_selection(q, k, sink_tokens=4, local_diagonals=2)
    widths = torch.ops.stria.estimate_widths(1024, 4, True, 0.99, 0.9, 0, 0, 4, 2, 64)
    assert tuple(sel.vertical.shape) == (2, 4, widths[0]) and tuple(sel.slash.shape) == (2, 4, widths[1])
    assert sel.vertical.dtype == torch.int32 and sel.vertical.device == q.device
    for rows, limit in ((sel.vertical, 1024), (sel.slash, 16)):
        rows = rows.cpu()
        for row in rows.view(-1, rows.shape[-1]):
            real = row[row != stria.PADDING]
            assert len(real) > 0 and bool((real[1:] > real[:-1]).all()) and int(real.max()) < limit
            assert bool((row[len(real):] == stria.PADDING).all()), "padding only at the end"
    slash, vertical = sel.slash.cpu(), sel.vertical.cpu()
    assert bool((slash[..., 0] == 0).all() and (slash[..., 1] == 1).all()), "local diagonals 0 and 1 are always kept"
    assert bool((vertical[..., :4] == torch.arange(4, dtype=torch.int32)).all()), "the 4 sink tokens are always kept"
    default = stria.estimate_selection(q, k)  # the defaults: the sink block (64 tokens) and local diagonals 0, 1, 2
    assert bool((default.slash.cpu()[..., :3] == torch.arange(3, dtype=torch.int32)).all()), "local diagonals 0, 1 and 2"
    assert bool((default.vertical.cpu()[..., :64] == torch.arange(64, dtype=torch.int32)).all()), "the sink block"


def test_deterministic_backward_is_bit_identical():
    q, k, v, d_out = inputs(1, 1024, 8, 2, 128, torch.bfloat16, 11)
    selection = random_selection(1, 8, 1024, True, torch.Generator().manual_seed(5))
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        stria.sparse_attention(*leaves, selection=selection, deterministic=True).backward(d_out)
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_opcheck():
    q, k, v, d_out = inputs(1, 256, 4, 2, 64, torch.bfloat16, 13)
    selection = random_selection(1, 4, 256, True, torch.Generator().manual_seed(2))
    scale = 0.125
    torch.library.opcheck(torch.ops.stria.forward.default, (q, k, v, selection.vertical, selection.slash, scale, True, False))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    torch.library.opcheck(torch.ops.stria.forward.default, (qg, kg, vg, selection.vertical, selection.slash, scale, True, False))
    out, lse = torch.ops.stria.forward(q, k, v, selection.vertical, selection.slash, scale, True, False)
    torch.library.opcheck(torch.ops.stria.backward.default,
                          (d_out, q, k, v, out, lse, selection.vertical, selection.slash, scale, True, False))
    torch.library.opcheck(torch.ops.stria.estimate_selection.default, (q, k, scale, True, 0.9, 0.9, 0, 0, 4, 1, 64))


def test_torch_compile_matches_eager():
    q, k, v, d_out = inputs(1, 512, 4, 2, 128, torch.bfloat16, 17)
    selection = random_selection(1, 4, 512, True, torch.Generator().manual_seed(4))

    # Deterministic: in the atomic mode the vertical tokens' dK/dV are fp32 reductions from several
    # CTAs, whose order (and last bits) may differ from run to run.
    def step(q, k, v):
        return stria.sparse_attention(q, k, v, selection=selection, deterministic=True)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(d_out)
        results.append([out] + [x.grad for x in leaves])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


def test_shard_and_unshard():
    x = torch.arange(2 * 768 * 3, device="cuda").view(2, 768, 3)  # (batch, seq, features): 12 blocks
    for world in (1, 2, 3, 6):
        for layout in ("striped", "zigzag", "sequential"):
            if layout == "zigzag" and 768 % (128 * world) != 0:
                expect(ValueError, "seq_len", lambda: stria.shard(x, 0, world, "zigzag"))
                continue
            shards = [stria.shard(x, r, world, layout) for r in range(world)]
            assert torch.equal(stria.unshard(shards, layout), x), (layout, world)
            for r, s in enumerate(shards):
                tokens = s[0, :, 0] // 3
                assert bool((tokens[1:] > tokens[:-1]).all()), "a rank's tokens keep their global order"
                blocks = (tokens[::64] // 64).tolist()
                nb = 12
                if layout == "striped":
                    assert blocks == [i * world + r for i in range(nb // world)]
                elif layout == "sequential":
                    assert blocks == list(range(r * nb // world, (r + 1) * nb // world))
                else:
                    chunk = nb // (2 * world)
                    assert blocks == list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * world - 1 - r) * chunk, (2 * world - r) * chunk))
    expect(ValueError, "layout = 'ring'", lambda: stria.shard(x, 0, 2, "ring"))
    expect(ValueError, "rank = 2", lambda: stria.shard(x, 2, 2))
    expect(ValueError, "multiple of 64", lambda: stria.shard(x[:, :100], 0, 1))


def expect(exception, text, fn):
    try:
        fn()
    except exception as e:
        assert text in str(e), f"{exception.__name__} without {text!r}: {e}"
        return
    raise AssertionError(f"no {exception.__name__} ({text!r})")


def test_bad_input_raises_clear_errors():
    q, k, v, _ = inputs(1, 256, 4, 2, 64, torch.bfloat16, 19)
    sel = random_selection(1, 4, 256, True, torch.Generator().manual_seed(1))
    run = lambda *a, **kw: stria.sparse_attention(*a, **kw)  # noqa: E731
    expect(TypeError, "q.dtype = torch.float32", lambda: run(q.float(), k, v, selection=sel))
    expect(TypeError, "must be equal", lambda: run(q, k.half(), v, selection=sel))
    expect(ValueError, "q.device = cpu", lambda: run(q.cpu(), k.cpu(), v.cpu(), selection=sel))
    expect(ValueError, "must be contiguous", lambda: run(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, selection=sel))
    expect(ValueError, "must be (batch, seq, heads, head_dim)", lambda: run(q[0], k, v, selection=sel))
    expect(ValueError, "positive multiple of 64", lambda: run(q[:, :100].contiguous(), k[:, :100].contiguous(), v[:, :100].contiguous()))
    expect(ValueError, "must divide the 4 query heads", lambda: run(q, k[:, :, :1].expand(-1, -1, 3, -1).contiguous(),
                                                                     v[:, :, :1].expand(-1, -1, 3, -1).contiguous()))
    expect(ValueError, "head dim must be 64 or 128", lambda: run(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous()))
    expect(ValueError, "must match q.shape", lambda: run(q, k[:, :128].contiguous(), v[:, :128].contiguous()))
    expect(ValueError, "softmax_scale = nan", lambda: run(q, k, v, float("nan"), selection=sel))
    expect(ValueError, "p_vertical", lambda: run(q, k, v, p_vertical=1.5))
    expect(ValueError, "apply only when no selection", lambda: run(q, k, v, selection=sel, p_slash=0.5))
    swapped = sel.vertical.clone()
    swapped[..., [0, 1]] = swapped[..., [1, 0]]
    expect(ValueError, "batch element 0: global_selection.heads[0].vertical_tokens",
           lambda: run(q, k, v, selection=stria.Selection(swapped, sel.slash)))
    no_diagonal = stria.Selection(sel.vertical, torch.where(sel.slash == 0, stria.PADDING, sel.slash).sort(-1).values.to(torch.int32))
    expect(ValueError, "diagonal 0", lambda: run(q, k, v, selection=no_diagonal))
    expect(TypeError, "vertical.dtype", lambda: run(q, k, v, selection=stria.Selection(sel.vertical.long(), sel.slash)))
    expect(ValueError, "vertical.shape", lambda: run(q, k, v, selection=stria.Selection(sel.vertical[:, :2], sel.slash)))


class Skipped(Exception):
    """A test that cannot run here (a script reports it as SKIP, pytest as skipped)."""


def skip(reason):
    if "pytest" in sys.modules:
        pytest.skip(reason)
    raise Skipped(reason)


def run_as_script(tests: dict, available: bool, needs: str) -> None:
    """Runs every test_* of `tests` (a module's globals), reports each, and exits: 0, 1 if any failed,
    SKIP where `available` is false (`needs` says what is missing)."""
    if not available:
        print(f"skipped: {needs} are needed")
        sys.exit(SKIP)
    failed = 0
    for name, fn in sorted((n, f) for n, f in tests.items() if n.startswith("test_") and callable(f)):
        try:
            fn()
            print(f"PASS {name}")
        except Skipped as e:
            print(f"SKIP {name}: {e}")
        except Exception as e:  # report every test, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    print(f"{failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run_as_script(globals(), _available(), "torch with CUDA and the stria package")
