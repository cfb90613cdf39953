# SPDX-License-Identifier: Apache-2.0
"""cuDNN's dense causal attention (PyTorch SDPA, cuDNN backend) on attention_bench's shapes, in the same
device call, and the merge of attention_bench's JSON files into tests/bench/results/attention_h200.json.

    python3 tests/bench/cudnn_bench.py PART.json [PART.json ...] --out attention_h200.json [--repeats 5]

For every (seq_len, head_dim) that has a `dense` row in the parts, times SDPA forward and backward on
random bf16 inputs of the same shape (Hq and Hkv from the row; K and V repeated over the query heads of
their group, as SDPA's cuDNN path takes them) and adds a `cudnn_dense` row. Effective TFLOPS count the
causal entries, 4 D per entry forward and 2.5x that backward (ANCHORS.md). Times: CUDA events, three
warm-up runs, median. Prints the issue's figures of merit last. Without torch it writes the merged rows
alone and says so.
"""
import argparse
import json
import sys


def cudnn_row(torch, seq_len, head_dim, heads_q, heads_kv, repeats):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from compare_flex import median_ms  # this script's folder is on the path; that module needs torch

    def make(heads, scale):
        return ((torch.rand(1, heads, seq_len, head_dim, device="cuda") * 2 - 1) * scale).to(torch.bfloat16)

    q, k, v, d_out = make(heads_q, 2.0).requires_grad_(), make(heads_kv, 2.0), make(heads_kv, 1.0), make(heads_q, 1.0)
    group = heads_q // heads_kv
    kx = k.repeat_interleave(group, dim=1).requires_grad_()
    vx = v.repeat_interleave(group, dim=1).requires_grad_()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        def forward():
            return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)

        out = forward()
        if not torch.isfinite(out).all():
            raise RuntimeError("cuDNN SDPA gave a non-finite output")
        fwd = median_ms(forward, repeats)
        bwd = median_ms(lambda o: torch.autograd.grad(o, (q, kx, vx), d_out), repeats, setup=forward)
    entries = seq_len * (seq_len + 1) / 2 * heads_q
    del q, k, v, kx, vx, d_out, out
    torch.cuda.empty_cache()
    flops = 4.0 * entries * head_dim
    return {"name": "cudnn_dense", "seq_len": seq_len, "head_dim": head_dim, "heads_q": heads_q, "heads_kv": heads_kv, "density": 1.0,
            "fwd_ms": round(fwd, 4), "bwd_ms": round(bwd, 4), "fwd_tflops": round(flops / fwd * 1e-9, 4),
            "bwd_tflops": round(2.5 * flops / bwd * 1e-9, 4)}


def summary(rows):
    """The issue's figures of merit from the rows: effective TFLOPS and the ratios to cuDNN."""
    at = {(r["name"], r["seq_len"], r["head_dim"]): r for r in rows}
    lines = []
    for d in (128, 64):
        vs = at.get(("vs95", 131072, d))
        if vs:
            total = vs["fwd_ms"] + vs["bwd_ms"]
            line = f"D {d} vs95 128K: fwd {vs['fwd_tflops']:.0f} TF, bwd {vs['bwd_tflops']:.0f} TF, fwd+bwd {total:.2f} ms"
            det = at.get(("vs95_deterministic", 131072, d))
            if det:
                line += f"; deterministic bwd {det['bwd_ms'] / vs['bwd_ms']:.2f}x"
            cudnn = at.get(("cudnn_dense", 131072, d))
            if cudnn:
                line += f"; cuDNN dense fwd+bwd / vs95 fwd+bwd = {(cudnn['fwd_ms'] + cudnn['bwd_ms']) / total:.1f}x"
            lines.append(line)
        dense, cudnn = at.get(("dense", 131072, d)), at.get(("cudnn_dense", 131072, d))
        if dense and cudnn:
            lines.append(f"D {d} dense 128K: stria / cuDNN speed fwd {cudnn['fwd_ms'] / dense['fwd_ms']:.2f}, "
                         f"bwd {cudnn['bwd_ms'] / dense['bwd_ms']:.2f}")
    for s in (32768, 524288):
        vs = at.get(("vs95", s, 128))
        if vs:
            lines.append(f"D 128 vs95 {s // 1024}K: fwd {vs['fwd_tflops']:.0f} TF, bwd {vs['bwd_tflops']:.0f} TF")
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("parts", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    merged, rows = None, []
    for path in args.parts:
        part = json.load(open(path))
        merged = merged or {k: part[k] for k in ("commit", "date", "gpu")}
        rows += part["rows"]
    try:
        import torch
        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if available:
        torch.manual_seed(0)
        shapes = sorted({(r["seq_len"], r["head_dim"], r["heads_q"], r["heads_kv"]) for r in rows if r["name"] == "dense"})
        for seq_len, head_dim, heads_q, heads_kv in shapes:
            row = cudnn_row(torch, seq_len, head_dim, heads_q, heads_kv, args.repeats)
            print(f"cudnn_dense S {seq_len} D {head_dim}: fwd {row['fwd_ms']:.2f} ms ({row['fwd_tflops']:.0f} TF), "
                  f"bwd {row['bwd_ms']:.2f} ms ({row['bwd_tflops']:.0f} TF)", flush=True)
            rows.append(row)
    else:
        print("cudnn_bench: no CUDA PyTorch here, so no cudnn_dense rows", file=sys.stderr)
    merged["rows"] = rows
    with open(args.out, "w") as out:
        json.dump(merged, out, indent=1)
        out.write("\n")
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
