"""torch's matrix products in bf16 against fp32 on this CPU: the measurement behind CpuKernelConfig.linear_fp32.

    python -m bench.product_dtypes [--rows 1,8,32,64,512,2048] [--shape 3072x576] [--threads 2] [--repeats 5]

For each row count M: F.linear of x [M, K] on a bf16 weight [N, K] in bf16, and the same in fp32 with x and the
weight widened to fp32 in the call (what `linear` does with linear_fp32 on: it pays the widening every call), the
median seconds of --repeats runs each, alternated, as GFLOP/s (2 M N K). Then a 2048 x 2048 x 2048 product in
each dtype. A CPU without native bf16 dot products (no AVX-512 BF16, no AMX) runs torch's bf16 products on a slow
path; the line after the table says which features this CPU has.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.kv_transfer import median_ms
from bench.provenance import provenance
from engine.kernels.extension_build import build_key, cpu_model


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32,64,512,2048")
    p.add_argument("--shape", default="3072x576", help="NxK of the weight (default: SmolLM2-135M's gate|up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    weight = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    out = {**provenance("product_dtypes", argv), "cpu": cpu_model(), "features": list(build_key().features),
           "shape": [n, k], "rows": {}}
    print(f"F.linear on a {n}x{k} bf16 weight, {args.threads} threads; GFLOP/s (median of {args.repeats})")
    print(f"{'rows':>6} {'bf16':>9} {'fp32 (widened)':>15} {'fp32 / bf16':>12}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k).to(torch.bfloat16)
        bf16 = median_ms(lambda: F.linear(x, weight), args.repeats) / 1e3
        fp32 = median_ms(lambda: F.linear(x.float(), weight.float()).to(torch.bfloat16), args.repeats) / 1e3
        flops = 2 * rows * n * k
        out["rows"][rows] = {"bf16_gflops": flops / bf16 / 1e9, "fp32_gflops": flops / fp32 / 1e9}
        print(f"{rows:>6} {flops / bf16 / 1e9:>9.1f} {flops / fp32 / 1e9:>15.1f} {bf16 / fp32:>12.2f}", flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(2048, 2048).to(dtype)
        rate = 2 * 2048 ** 3 / (median_ms(lambda: a @ a, 2) / 1e3) / 1e9
        out[f"square_2048_{str(dtype).split('.')[-1]}_gflops"] = rate
        print(f"2048^3 {str(dtype).split('.')[-1]}: {rate:.1f} GFLOP/s")
    print(f"CPU: {out['cpu']}; kernel ISA features: {', '.join(out['features'])}")
    return out


if __name__ == "__main__":
    main()
