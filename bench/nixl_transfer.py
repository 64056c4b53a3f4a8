"""NIXL (UCX backend) against our direct KV stream, moving the same pages over loopback in one run.

    pip install --no-deps nixl nixl-cu12   # not a dependency: the UCX backend runs without a GPU
    python -m bench.nixl_transfer [--tokens 1024,8192] [--repeats 5] [--tls tcp]

Both move a prompt's KV in SmolLM2-135M's geometry (bench.kv_transfer: 30 layers, 23,040 bytes per token) from
one pool to another, one transfer per layer: ours with transport.kv_stream (sendmsg out of band, timed to the
receiver's acknowledgement), NIXL with one WRITE of the layers' descriptors between two agents of this process,
timed to DONE. UCX_TLS=tcp (the default here) makes UCX use TCP, as between hosts; `--tls ""` leaves UCX to
choose (shared memory on one host). Medians of `--repeats`, the two alternating per size.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.kv_transfer import BLOCK, DTYPE, HEAD_DIM, HEADS, LAYERS, pool_shape, run_direct


def nixl_write_ms(tokens: int, repeats: int) -> float:
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(backends=["UCX"])
    target, initiator = nixl_agent("target", config), nixl_agent("initiator", config)
    src = torch.randn(pool_shape(-(-tokens // BLOCK)), dtype=torch.float32).to(DTYPE)
    dst = torch.zeros_like(src)
    target.register_memory(dst)
    initiator.register_memory(src)
    initiator.add_remote_agent(target.get_agent_metadata())
    layer_bytes = src[0].numel() * src.element_size()
    descs = lambda agent, t: agent.get_xfer_descs([(t[i].data_ptr(), layer_bytes, 0) for i in range(LAYERS)],  # noqa: E731
                                                  "DRAM")
    local, remote = descs(initiator, src), descs(target, dst)
    samples = []
    for i in range(repeats + 1):
        xfer = initiator.initialize_xfer("WRITE", local, remote, "target", f"r{i}".encode())
        start = time.perf_counter()
        state = initiator.transfer(xfer)
        while state not in ("DONE", "ERR"):
            state = initiator.check_xfer_state(xfer)
        if i:
            samples.append((time.perf_counter() - start) * 1e3)
        initiator.release_xfer_handle(xfer)
        assert state == "DONE", f"NIXL transfer ended {state}"
    assert torch.equal(dst, src), "NIXL corrupted the pages"
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,8192")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tls", default="tcp", help="UCX_TLS for NIXL's UCX backend ('' lets UCX choose)")
    args = parser.parse_args(argv)
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        raise SystemExit("nixl is not installed: pip install --no-deps nixl nixl-cu12")
    print(f"UCX_TLS={args.tls or '(UCX chooses)'}")
    print(f"{'tokens':>7} {'MB':>8} {'ours direct ms':>22} {'NIXL UCX ms':>22}")
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        mbytes = LAYERS * 2 * -(-tokens // BLOCK) * BLOCK * HEADS * HEAD_DIM * 2 / 1e6
        ours, theirs = run_direct(tokens, args.repeats), nixl_write_ms(tokens, args.repeats)
        gbps = lambda ms: mbytes / ms  # noqa: E731  (MB / ms = GB/s)
        print(f"{tokens:>7} {mbytes:>8.1f} {ours:>9.1f} ({gbps(ours):5.2f} GB/s) {theirs:>9.1f} ({gbps(theirs):5.2f} GB/s)",
              flush=True)


if __name__ == "__main__":
    main()
