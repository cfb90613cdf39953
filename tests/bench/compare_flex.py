# SPDX-License-Identifier: Apache-2.0
"""Runs PyTorch FlexAttention (64x64 and 128x128 blocks) and cuDNN SDPA on the patterns that
attention_bench wrote (--pattern-dir), on the same shapes, and prints one table next to stria's numbers.

    python3 tests/bench/compare_flex.py PATTERN_DIR [--seq-len 131072] [--patterns dense,vs95] [--repeats 10]

The token-level mask is exactly stria's: causal, and (block diagonal q//64 - k//64 selected, or key
token selected as vertical). Effective TFLOPS use stria's active-entry count for every library
(4 D per entry forward, 2.5x that backward), so the columns compare time on the same work. stria's
rows are read from PATTERN_DIR/../attention_bench.log. Times: CUDA events, 3 warm-up runs, median.
"""
import argparse
import json
import os
import re
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HQ, HKV, D = 16, 2, 128


def median_ms(fn, repeats, setup=None):
    """Median time of fn() over `repeats` runs after 3 warm-up runs; setup() runs untimed before each."""
    times = []
    for i in range(3 + repeats):
        state = setup() if setup else None
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(state) if setup else fn()
        stop.record()
        stop.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def ours(pattern_dir):
    """stria's rows from attention_bench.log: (S, pattern) -> (fwd ms, bwd ms)."""
    rows = {}
    log = os.path.join(os.path.dirname(os.path.abspath(pattern_dir)), "attention_bench.log")
    if os.path.exists(log):
        for line in open(log):
            f = line.split()
            if len(f) >= 11 and f[0].isdigit():
                rows[(int(f[0]), f[1])] = (float(f[3]), float(f[5]))
    return rows


def mask_for(pattern, device):
    s = pattern["seq_len"]
    nb = s // 64
    slash = torch.zeros(HQ, nb, dtype=torch.bool, device=device)
    vertical = torch.zeros(HQ, s, dtype=torch.bool, device=device)
    for h, head in enumerate(pattern["heads"]):
        slash[h, torch.tensor(head["slash"], dtype=torch.long, device=device)] = True
        if head["vertical"]:
            vertical[h, torch.tensor(head["vertical"], dtype=torch.long, device=device)] = True

    def mask_mod(b, h, q_idx, kv_idx):
        delta = ((q_idx // 64) - (kv_idx // 64)).clamp(min=0)  # above the diagonal the causal term decides
        return (q_idx >= kv_idx) & (slash[h, delta] | vertical[h, kv_idx])

    return mask_mod


def run_flex(q, k, v, d_out, mask_mod, block, repeats):
    s = q.shape[2]
    mask = torch.compile(create_block_mask)(mask_mod, 1, HQ, s, s, device="cuda", BLOCK_SIZE=block)
    options = {"BLOCK_M": block, "BLOCK_N": block} if block == 64 else None
    attend = torch.compile(flex_attention, dynamic=False)

    def forward():
        return attend(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)

    fwd = median_ms(forward, repeats)
    try:  # a compiled backward frees its graph: a fresh (untimed) forward before each timed backward
        bwd = median_ms(lambda out: torch.autograd.grad(out, (q, k, v), d_out), repeats, setup=forward)
    except Exception as e:  # FlexAttention's 64x64 backward does not compile (ANCHORS.md)
        print(f"  flex {block}x{block} backward failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
        bwd = None
    return fwd, bwd


def run_cudnn(q, k, v, d_out, repeats):
    kx, vx = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        def forward():
            return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)

        fwd = median_ms(forward, repeats)
        bwd = median_ms(lambda out: torch.autograd.grad(out, (q, kx, vx), d_out), repeats, setup=forward)
    return fwd, bwd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("pattern_dir")
    parser.add_argument("--seq-len", default="131072")
    parser.add_argument("--patterns", default="vs95,slash95")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    stria = ours(args.pattern_dir)

    def cell(ms, flops):
        return f"{ms:8.2f} ({flops / ms * 1e-9:5.0f})" if ms else f"{'n/a':>16}"

    print(f"bf16 causal, Hq {HQ}, Hkv {HKV}, D {D}; ms (effective TFLOPS on the pattern's active entries); cuDNN is dense causal")
    heads = ["stria fwd", "stria bwd", "flex64 fwd", "flex64 bwd", "flex128 fwd", "flex128 bwd", "cudnn fwd", "cudnn bwd"]
    print(f"{'S':>7} {'pattern':7} " + " ".join(f"{h:>16}" for h in heads), flush=True)
    for s in [int(x) for x in args.seq_len.split(",")]:
        make = lambda heads, scale: ((torch.rand(1, heads, s, D, device="cuda") * 2 - 1) * scale).to(torch.bfloat16).requires_grad_()
        q, k, v, d_out = make(HQ, 2.0), make(HKV, 2.0), make(HKV, 1.0), make(HQ, 1.0).detach()
        cudnn = run_cudnn(q, k, v, d_out, args.repeats)
        dense_flops = 4.0 * s * (s + 1) / 2 * HQ * D
        for name in args.patterns.split(","):
            path = os.path.join(args.pattern_dir, f"{name}_{s}.json")
            if not os.path.exists(path):
                continue
            pattern = json.load(open(path))
            flops = 4.0 * pattern["active_entries"] * D
            mask_mod = mask_for(pattern, "cuda")
            flex64 = run_flex(q, k, v, d_out, mask_mod, 64, args.repeats)
            flex128 = run_flex(q, k, v, d_out, mask_mod, 128, args.repeats)
            mine = stria.get((s, name), (None, None))
            cells = [cell(mine[0], flops), cell(mine[1], 2.5 * flops), cell(flex64[0], flops), cell(flex64[1], 2.5 * flops),
                     cell(flex128[0], flops), cell(flex128[1], 2.5 * flops), cell(cudnn[0], dense_flops), cell(cudnn[1], 2.5 * dense_flops)]
            print(f"{s:>7} {name:7} " + " ".join(cells), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
