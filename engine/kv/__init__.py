"""The paged KV cache, one concept per module.

- `block_pool`: pure-Python block bookkeeping with an integrity check, built from the parts below; no torch.
- `block_states`: every block's state, the free list, the LRU of cached blocks, refcounts and groups.
- `prefix_index`: the prefix cache's chained hashes, which block holds each, and the hit counters.
- `reservations`: blocks held for KV another process writes, per owner with a deadline.
- `groups`: KV-cache groups, the layers that share one block table, and which blocks a windowed group still
  reads (no torch).
- `cache`: the pool's tensor, every layer's key and value pages, and page reads/writes for hand-offs.
- `formats`: quantised page layouts (fp8, fp4 with their scales beside the codes) and the per-layer store.
- `compaction`: which old pages of running sequences move to the FP4 cold region (bookkeeping, no torch).
- `compress`: the cold region's tensors and the tiered pages that read both regions.
- `export`: a decode actor's pool exported once (shared memory on CPU, CUDA IPC on GPU) for prefill actors.
- `staging`: a streamed hand-off's pages copied off a GPU on a side stream, layer by layer, into pinned memory.
- `host_memory`: keep freed heap memory in the process between steps.
- `tiers`: the KV tiers below the pool (host, disk): keys, write-back of evicted blocks, loads at admission.
- `tier_store`: one tier's directory of checked entry files, shared by processes, with its capacity and eviction.
- `tier_writer`: the thread that publishes evicted blocks to the tiers off the step thread.
- `host_tier`: the host tier's shared-memory directory, owned by one process and attached to by the others.
"""
