"""Time dflashkit's row kernels against oneDNN (or F.linear) and SDPA on the shapes of one SmolLM2-135M step.

Products: the 211 matrices of one decoding step (30 layers of q, k, v, o, gate, up, down, and the 49,152-row LM head),
random bf16 weights of the real shapes, streamed once per repeat, for each row count. Attention: 30 layers of 9 query
heads over 3 key/value heads of 64 at --context cached positions, a causal block of `rows` queries. Both sides run
interleaved in one process after a warm-up; the medians and their ratio are printed. To compare two builds of the
kernels themselves, use scripts/compare_kernel_builds.py.

    python scripts/bench_row_kernels.py [--rows 1,2,4,6,8,12,16,24,32] [--context 400] [--repeats 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [out, in] per layer
LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 30, 49152, 9, 3, 64


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,6,8,12,16,24,32")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from dflashkit.kernels import row_kernels
    from dflashkit.kernels.linear import packing_supported

    torch.set_num_threads(args.threads)
    if row_kernels.kernel() is None:
        raise SystemExit("no row kernel runs here (see dflashkit/kernels/row_kernels.py)")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g).to(torch.bfloat16) * 0.02 for _ in range(LAYERS) for o, i in SHAPES]
    weights.append(torch.randn(VOCAB, 576, generator=g).to(torch.bfloat16) * 0.02)
    prepacked = packing_supported(weights[0].device, torch.bfloat16)  # oneDNN's bf16 reorder needs AVX512 or AVX-NE
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) if prepacked else w for w in weights]
    ours = [row_kernels.pack(w) for w in weights]
    mb = sum(w.numel() * 2 for w in weights) / 1e6
    print(
        f"products: {len(weights)} matrices, {mb:.0f} MB of bf16 weights, {args.threads} threads, "
        f"median of {args.repeats}"
    )
    print(
        f"baseline: {'oneDNN, prepacked' if prepacked else 'F.linear (no oneDNN bf16 packing on this CPU)'}; "
        f"kernel: {row_kernels.label()}"
    )
    print(f"{'rows':>5} {'oneDNN ms':>10} {'kernel ms':>10} {'ratio':>6} {'kernel GB/s':>12}")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            x = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in (576, 1536)}

            def run_onednn(x=x):
                for w, p in zip(weights, onednn):
                    if prepacked:
                        torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                    else:
                        F.linear(x[w.shape[1]], w)

            def run_kernel(x=x):
                for w, p in zip(weights, ours):
                    row_kernels.linear(x[w.shape[1]], p, w.shape[0])

            run_onednn(), run_kernel()  # warm-up
            a, b = [], []
            for _ in range(args.repeats):  # interleaved
                a += timed(run_onednn, 1)
                b += timed(run_kernel, 1)
            ma, mb_ = statistics.median(a) * 1e3, statistics.median(b) * 1e3
            print(f"{rows:>5} {ma:>10.1f} {mb_:>10.1f} {ma / mb_:>6.2f} {mb / mb_:>12.1f}")

        m = args.context
        print(f"\nattention: {LAYERS} layers, {HEADS} heads / {KV_HEADS} kv heads of {HEAD_DIM}, {m} cached positions")
        print(f"{'rows':>5} {'SDPA ms':>10} {'kernel ms':>10} {'ratio':>6}")
        keys = torch.randn(KV_HEADS, m + 64, HEAD_DIM, generator=g).to(torch.bfloat16)
        values = torch.randn(KV_HEADS, m + 64, HEAD_DIM, generator=g).to(torch.bfloat16)
        group = HEADS // KV_HEADS
        for rows in [int(r) for r in args.rows.split(",")]:
            end = m + rows
            q = torch.randn(KV_HEADS, group * rows, HEAD_DIM, generator=g).to(torch.bfloat16)
            hidden = torch.ones(rows, end, dtype=torch.bool).triu(m + 1) if rows > 1 else None
            mask = None
            if hidden is not None:
                mask = torch.zeros(rows, end, dtype=torch.bfloat16).masked_fill_(hidden, float("-inf"))
                mask = mask[None].expand(group, rows, end).reshape(1, 1, group * rows, end)
            k, v = keys[:, :end], values[:, :end]

            def run_sdpa(q=q, k=k, v=v, mask=mask):
                for _ in range(LAYERS):
                    F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=0.125)

            def run_ours(q=q, k=k, v=v, hidden=hidden):
                for _ in range(LAYERS):
                    row_kernels.attention(q, k, v, hidden, 0.125)

            run_sdpa(), run_ours()
            a, b = [], []
            for _ in range(args.repeats):
                a += timed(run_sdpa, 1)
                b += timed(run_ours, 1)
            ma, mb_ = statistics.median(a) * 1e3, statistics.median(b) * 1e3
            print(f"{rows:>5} {ma:>10.2f} {mb_:>10.2f} {ma / mb_:>6.2f}")


if __name__ == "__main__":
    main()
