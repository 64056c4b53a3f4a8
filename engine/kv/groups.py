"""KV-cache groups: how a model's layers share the pool's blocks so that windowed layers can give theirs back.

The layers are split into groups of one size; the layer at position i of every group keeps its pages in
storage slot i, indexed by block id, so a pool block is the same bytes whichever group holds it and one
pool serves them all. Each sequence has one block table per group. In a windowed group (every layer reads
only the last W tokens), a block whose tokens all precede the window of the oldest position that can
still be queried is released and its table entry becomes NULL_BLOCK (gathered as block 0 and masked out
with everything else before the window; never written, and never seen by a kernel: such a context is cut by
the window, which sends it to the masked gather).

Layouts: one group of every layer (no window, or freeing off: the plain layout); one windowed group
(Mistral: every layer windowed); or, where full and windowed layers mix (Gemma 2/3), groups the size of
the smaller class, full groups first (a prefix-cache lookup then bounds the hit by a full group before
it tries the windowed ones). The last group of a class may be short: its missing slots hold pages no
layer reads (Gemma 3 1B: 4 full layers and 22 windowed ones, groups of 4, 2 of 28 slots idle).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig

NULL_BLOCK = -1  # a table entry whose block was released outside the window; read as block 0, masked out


@dataclass(frozen=True)
class KVGroups:
    group_size: int  # layers per group: the storage slots of the pool
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: its storage slot (position within its group)
    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: whole contexts)

    def __post_init__(self) -> None:
        if len(self.layer_groups) != len(self.layer_slots) or not self.layer_groups:
            raise ValueError("layer_groups and layer_slots must name the same, non-zero number of layers")
        if any(not 0 <= s < self.group_size for s in self.layer_slots):
            raise ValueError(f"a layer slot lies outside 0..{self.group_size - 1}")
        if set(self.layer_groups) != set(range(len(self.windows))):
            raise ValueError(f"layer groups {sorted(set(self.layer_groups))} do not cover {len(self.windows)} groups")
        placed = list(zip(self.layer_groups, self.layer_slots))
        if len(set(placed)) != len(placed):
            raise ValueError("two layers share one (group, slot)")

    @staticmethod
    def single(num_layers: int, window: int | None = None) -> "KVGroups":
        """Every layer in one group (slot = layer): the plain layout; windowed only when every layer is."""
        return KVGroups(num_layers, (0,) * num_layers, tuple(range(num_layers)), (window,))

    @staticmethod
    def for_model(cfg: ModelConfig, free_windows: bool) -> "KVGroups":
        windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
        if not free_windows or all(w is None for w in windows):
            return KVGroups.single(cfg.num_layers)
        if len(set(windows)) == 1:
            return KVGroups.single(cfg.num_layers, windows[0])
        return _mixed(windows)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def frees_blocks(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def is_plain(self) -> bool:
        """One group, slot = layer: the layout every path (hand-off, compression) was written for."""
        return self.num_groups == 1 and self.layer_slots == tuple(range(len(self.layer_slots)))


def _mixed(windows: list[int | None]) -> KVGroups:
    full = [i for i, w in enumerate(windows) if w is None]
    windowed = [i for i, w in enumerate(windows) if w is not None]
    size = min(len(full), len(windowed))
    groups, slots = [0] * len(windows), [0] * len(windows)
    group_windows: list[int | None] = []
    for layers in (full, windowed):
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                groups[layer], slots[layer] = len(group_windows), slot
            group_windows.append(windows[layers[0]])
    return KVGroups(size, tuple(groups), tuple(slots), tuple(group_windows))


def first_needed_block(next_query: int, window: int, block_size: int) -> int:
    """Index of the first block a windowed layer still reads when no query precedes `next_query`: keys j with
    j > next_query - window, so blocks wholly at or before next_query - window are never read again."""
    return max(0, next_query - window + 1) // block_size


def blocks_in_use(groups: KVGroups, num_tokens: int, block_size: int) -> int:
    """Pool blocks one sequence of `num_tokens` computed tokens holds (its next query at num_tokens)."""
    total = -(-num_tokens // block_size)
    return sum(total - (0 if w is None else first_needed_block(num_tokens, w, block_size)) for w in groups.windows)
