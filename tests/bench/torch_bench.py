# SPDX-License-Identifier: Apache-2.0
"""One attention layer's training step in PyTorch (issue 22): stria's op, cuDNN SDPA (dense causal) and
FlexAttention on the same Vertical-Slash pattern as a BlockMask, in one run, Qwen2.5-3B's attention
shape (Hq 16, Hkv 2, D 128, bf16, batch 1).

    python3 tests/bench/torch_bench.py [--seq-len 131072] [--repeats 5] [--commit SHA] [--out torch_h200.json]

stria's step is what a training step runs: the online estimate of the selection from q and k, the
forward and the backward. Its selection is then given to FlexAttention as a token-exact mask_mod over
128x128 blocks (FlexAttention's 64x64 backward does not compile, ANCHORS.md), whose output and
gradients stria's are checked against (the same function: relative L2 errors in grad_check). cuDNN
computes dense causal attention: a different function, checked for finiteness only. Times: CUDA
events, three warm-up runs, median of --repeats; effective TFLOPS on stria's active entries (4 D per
entry forward, 2.5x that backward) for stria and FlexAttention, on the causal entries for cuDNN.
"""
import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_flex import median_ms  # noqa: E402

import stria  # noqa: E402

HQ, HKV, D = 16, 2, 128


def active_entries(selection, seq_len):
    """Causal entries the selection keeps, summed over heads: selected block diagonals whole (diagonal 0
    as its causal triangles), plus each vertical token's entries in query blocks no selected diagonal covers."""
    nb = seq_len // 64
    total = 0
    for slash, vertical in zip(selection.slash[0].cpu(), selection.vertical[0].cpu()):
        deltas = slash[slash != stria.PADDING].long()
        tokens = vertical[vertical != stria.PADDING].long()
        total += sum((nb - d) * 64 * 64 if d > 0 else nb * 64 * 65 // 2 for d in deltas.tolist())
        covered = torch.zeros(nb, dtype=torch.long)
        covered[deltas[deltas > 0]] = 1
        covered_upto = torch.cumsum(covered, 0)  # diagonals 1..d selected
        block = tokens // 64
        later_blocks = nb - 1 - block
        total += int((64 * (later_blocks - covered_upto[later_blocks])).sum())
    return total


def relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def step_times(forward, backward, repeats):
    fwd = median_ms(forward, repeats)
    bwd = median_ms(backward, repeats, setup=forward)
    step = median_ms(lambda: backward(forward()), repeats)
    return step, fwd, bwd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default="torch_h200.json")
    args = parser.parse_args()
    s = args.seq_len
    torch.manual_seed(0)

    def make(heads, scale):
        return ((torch.rand(1, s, heads, D, device="cuda") * 2 - 1) * scale).to(torch.bfloat16)

    q, k, v, d_out = make(HQ, 2.0).requires_grad_(), make(HKV, 2.0).requires_grad_(), make(HKV, 1.0).requires_grad_(), make(HQ, 1.0)
    rows = []

    # stria: estimate + forward, backward.
    def stria_forward():
        return stria.sparse_attention(q, k, v)

    def grads(out):
        return torch.autograd.grad(out, (q, k, v), d_out)

    selection = stria.estimate_selection(q, k)
    estimate_ms = median_ms(lambda: stria.estimate_selection(q, k), args.repeats)
    entries = active_entries(selection, s)
    flops = 4.0 * entries * D
    density = entries / (s * (s + 1) / 2 * HQ)
    step, fwd, bwd = step_times(stria_forward, grads, args.repeats)
    out = stria.sparse_attention(q, k, v, selection=selection)
    mine = [out.detach()] + list(grads(out))
    rows.append({"name": "stria", "step_ms": round(step, 3), "fwd_ms": round(fwd, 3), "bwd_ms": round(bwd, 3), "estimate_ms": round(estimate_ms, 3),
                 "density": round(density, 5), "fwd_tflops": round(flops / fwd * 1e-9, 1), "bwd_tflops": round(2.5 * flops / bwd * 1e-9, 1)})
    print(f"stria: step {step:.2f} ms (estimate {estimate_ms:.2f}), density {density:.2%}", flush=True)

    # FlexAttention with stria's selection, token-exact.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    nb = s // 64
    slash_on = torch.zeros(HQ, nb, dtype=torch.bool, device="cuda")
    vertical_on = torch.zeros(HQ, s, dtype=torch.bool, device="cuda")
    for h in range(HQ):
        d = selection.slash[0, h]
        slash_on[h, d[d != stria.PADDING].long()] = True
        t = selection.vertical[0, h]
        vertical_on[h, t[t != stria.PADDING].long()] = True

    def mask_mod(b, h, q_idx, kv_idx):
        delta = ((q_idx // 64) - (kv_idx // 64)).clamp(min=0)
        return (q_idx >= kv_idx) & (slash_on[h, delta] | vertical_on[h, kv_idx])

    block_mask = torch.compile(create_block_mask)(mask_mod, 1, HQ, s, s, device="cuda", BLOCK_SIZE=128)
    attend = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def flex_forward():
        return attend(qt, kt, vt, block_mask=block_mask, enable_gqa=True).transpose(1, 2)

    step, fwd, bwd = step_times(flex_forward, grads, args.repeats)
    out = flex_forward()
    theirs = [out.detach()] + list(grads(out))
    errors = {n: relative_error(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), mine, theirs)}
    check = "ok" if max(errors.values()) < 2e-2 else "mismatch"
    rows[0]["grad_check"] = f"{check}: relative L2 error to FlexAttention " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
    rows.append({"name": "flex", "step_ms": round(step, 3), "fwd_ms": round(fwd, 3), "bwd_ms": round(bwd, 3), "block": 128,
                 "fwd_tflops": round(flops / fwd * 1e-9, 1), "bwd_tflops": round(2.5 * flops / bwd * 1e-9, 1),
                 "grad_check": "the reference of stria's row (the same mask)"})
    print(f"flex: step {step:.2f} ms; stria vs flex {errors}", flush=True)
    del theirs, out
    torch.cuda.empty_cache()

    # cuDNN SDPA, dense causal (K and V repeated over each group's query heads).
    group = HQ // HKV
    kx = k.detach().repeat_interleave(group, dim=2).requires_grad_()
    vx = v.detach().repeat_interleave(group, dim=2).requires_grad_()
    qx = q.detach().clone().requires_grad_()

    def cudnn_forward():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qx.transpose(1, 2), kx.transpose(1, 2), vx.transpose(1, 2), is_causal=True).transpose(1, 2)

    def cudnn_grads(out):
        return torch.autograd.grad(out, (qx, kx, vx), d_out)

    step, fwd, bwd = step_times(cudnn_forward, cudnn_grads, args.repeats)
    out = cudnn_forward()
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in cudnn_grads(out))
    dense_flops = 4.0 * s * (s + 1) / 2 * HQ * D
    rows.append({"name": "sdpa_cudnn", "step_ms": round(step, 3), "fwd_ms": round(fwd, 3), "bwd_ms": round(bwd, 3), "density": 1.0,
                 "fwd_tflops": round(dense_flops / fwd * 1e-9, 1), "bwd_tflops": round(2.5 * dense_flops / bwd * 1e-9, 1),
                 "grad_check": "finite" if finite else "non-finite"})

    result = {"commit": args.commit, "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "shape": {"batch": 1, "seq_len": s, "heads_q": HQ, "heads_kv": HKV, "head_dim": D, "dtype": "bf16", "causal": True},
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'name':12} {'step ms':>9} {'fwd ms':>9} {'bwd ms':>9}  grad_check")
    for r in rows:
        print(f"{r['name']:12} {r['step_ms']:9.2f} {r['fwd_ms']:9.2f} {r['bwd_ms']:9.2f}  {r.get('grad_check', '')}")
    print(f"stria's step is {rows[2]['step_ms'] / rows[0]['step_ms']:.1f}x faster than cuDNN dense (goal >= 10x), "
          f"{rows[1]['step_ms'] / rows[0]['step_ms']:.2f}x FlexAttention's")


if __name__ == "__main__":
    main()
