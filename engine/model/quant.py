"""Quantising a model's weights as they load: int8 with one scale per output channel (`--weight-dtype int8`), int4
with a scale and an offset per group of 32 along K (`--weight-dtype int4`), and `auto`'s choice per projection for a
GGUF file. The formats themselves, and the products on them, are the backend's (engine/backends/weight_ops.py).

int8: a weight W [N, K] is kept as codes Q [N, K] int8 and scales s [N] fp32 with s[n] = max_k |W[n, k]| / 127 and
Q = round(W / s) (symmetric, codes in -127..127), computed at load from the checkpoint's own tensors (the GGUF
loader's fp32 dequantisation, or a folder's bf16/fp32) row by row, so no bf16 copy of the weight is ever made.
What is quantised: each decoder layer's projections (every `Linear`, engine/model/layers.py) and the LM head;
with tied embeddings the embedding table is the LM head's tensor, so its lookups dequantise the rows they read.

int4: a weight W [N, K] is kept as codes q in 0..15, two per byte, and per group of 32 consecutive k an fp16 scale
s and offset z, W ~ s * q + z (asymmetric: z one end of the group's range, s its range / 15 or a little more;
`quantize_int4`). 5 bits a weight (0.625 bytes, Q4_1's size) against int8's 8 and bf16's 16. The codes are stored
in the decode kernel's layout only (`pack_int4`, engine/kernels/int4_linear.cpp), written row-chunk by row-chunk
as the checkpoint's tensors arrive. GGUF's Q4_0, Q4_1 and Q4_K blocks are groups of 32 with fp16 scales already:
the loader hands them over as `FileBlocks`, whose codes and scales go into the int4 layout as they are
(engine/model/gguf_repack.py: Q4_0 and Q4_1 exactly, Q4_K with its sub-block scales d * sc and offsets dmin * m
rounded once to fp16), never dequantised and searched again.

int8g: int8 codes with an fp32 scale (and, for the types with minimums, an fp32 offset) per group of 16 along K,
or per 32 where the file's factors hold for 32 values (engine/backends/weight_ops.py). It holds every GGUF block
type's values exactly (engine/model/gguf_int8g.py), so the loader's `FileBlocks` go into it as they are; there is no
quantiser of float weights into it.

`auto` on a GGUF file keeps the values the file holds, but for Q4_K's sub-block scales. It chooses per projection:
int4 where every tensor the projection fuses (q|k|v, gate|up) is Q4_0, Q4_1 or Q4_K (int4 holds the first two
exactly, Q4_K with its sub-block scales and offsets rounded once to fp16: gguf_repack, for a third of int8g's bytes),
else int8g where every one is a quantised block type, else the serving
dtype (bfloat16: F32 / F16 / BF16 tensors). The LM head likewise by its own tensor's type, where int4 or int8g
holds it exactly. One log line says which types went where.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterator, Literal, Mapping, NamedTuple, Protocol

import torch
from torch import nn

from engine.backends.weight_ops import (INT4_CHANNELS, INT4_GROUP, block_int8g_scales, int4_shapes, int8g_put,
                                        int8g_shapes, pair_int8g_scales, whole_blocks)
from engine.config import WEIGHT_DTYPES
from engine.model.layers import Linear

log = logging.getLogger(__name__)

INT8_MAX = 127


WeightFormat = Literal["bfloat16", "int8", "int4", "int8g"]


def resolve_weight_dtype(name: str) -> WeightFormat:
    """'auto' without a file to look at keeps the serving dtype's weights (bfloat16); see `auto_weight_dtype`."""
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {name!r}")
    return "bfloat16" if name == "auto" else name


EXACT_INT4_TYPES = frozenset({"Q4_0", "Q4_1"})  # GGUF types the int4 format holds exactly (gguf_repack)
# Q4_K in int4: its per-32 scales d * sc and offsets dmin * m rounded once to an fp16 pair (gguf_repack; most
# sub-blocks exactly), at 0.625 bytes a weight against int8g's 1.25, the bytes a decode step reads
AUTO_INT4_TYPES = EXACT_INT4_TYPES | {"Q4_K"}
# GGUF types the int8g format holds exactly (gguf_int8g); the loader hands them over as FileBlocks
EXACT_INT8G_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")  # the LM head's tensor (tied: the embedding table)


class WeightChoice(NamedTuple):
    """What a checkpoint loads as: each projection's format (`modules`: its parameter name, as the model's
    `parameter_name` gives it, -> format; `layers` for those it does not name) and the LM head's (tied: the
    embedding's)."""

    layers: WeightFormat
    head: WeightFormat
    modules: Mapping[str, WeightFormat] = MappingProxyType({})


def _same_name(name: str) -> str:
    return name


def auto_weight_dtype(types: Mapping[str, str], tied: bool = True,
                      parameter_name: Callable[[str], str] = _same_name) -> tuple[WeightChoice, str]:
    """`--weight-dtype auto` for a checkpoint whose tensors (Hugging Face names) have these GGUF types (empty for a
    Hugging Face folder) -> (choice, why): a projection is int4 where every checkpoint tensor it fuses
    (`parameter_name`: checkpoint name -> the model parameter it fills) is of EXACT_INT4_TYPES, else bfloat16;
    the LM head int4 where its own tensor is (files often keep it at more bits than the layers, as SmolLM2's Q4_1
    file keeps a Q8_0 head)."""
    projections = {name: kind for name, kind in types.items()  # weights only: a bias stays in the serving dtype
                   if name.endswith(".weight") and name.rpartition(".")[0].rpartition(".")[2] in PROJECTIONS}
    if not projections:
        return WeightChoice("bfloat16", "bfloat16"), "no GGUF-quantised projections (a Hugging Face folder or floats)"
    fused: dict[str, set[str]] = {}
    for name, kind in projections.items():
        fused.setdefault(parameter_name(name), set()).add(kind)
    modules = {param: exact_format(kinds) for param, kinds in fused.items()}
    head_type = types.get(HEAD_NAMES[1] if tied else HEAD_NAMES[0], "F32")
    head = exact_format({head_type})
    choice = WeightChoice("bfloat16", head, MappingProxyType(modules))
    return choice, _auto_reasons(projections, {n: modules[parameter_name(n)] for n in projections}, head_type, head)


def exact_format(kinds: set[str] | frozenset[str]) -> WeightFormat:
    """The format that holds tensors of these GGUF types (fused into one weight) without rounding them again (Q4_K:
    but for its sub-block scales' fp16 rounding): int4 for Q4_0 / Q4_1 / Q4_K alone, int8g for other quantised
    blocks, else bfloat16."""
    if kinds <= AUTO_INT4_TYPES:
        return "int4"
    return "int8g" if kinds <= EXACT_INT8G_TYPES else "bfloat16"


AUTO_REASONS: Mapping[str, str] = MappingProxyType({
    "int4": "int4 (the file's codes and scales repacked; Q4_K's sub-block scales to fp16)",
    "int8g": "int8g (the file's codes as int8, fp32 scales per 16 or 32, exactly)",
    "bfloat16": "bfloat16 (float tensors, or fused with one)"})


def _auto_reasons(types: Mapping[str, str], formats: Mapping[str, WeightFormat], head_type: str,
                  head: WeightFormat) -> str:
    """One line: each projection type's tensors counted by the format they got, then the LM head's."""
    groups: dict[str, dict[str, int]] = {reason: {} for reason in AUTO_REASONS.values()}
    for name, kind in types.items():
        reason = AUTO_REASONS[formats[name]]
        groups[reason][kind] = groups[reason].get(kind, 0) + 1
    parts = [f"{reason}: {', '.join(f'{count} {kind}' for kind, count in counts.items())}"
             for reason, counts in groups.items() if counts]
    return f"projections {'; '.join(parts)}; LM head {head_type} -> {head}"


def choose_weight_dtype(name: str, types: Mapping[str, str], dtype: torch.dtype = torch.bfloat16,
                        tied: bool = True, parameter_name: Callable[[str], str] = _same_name,
                        quiet: bool = False) -> WeightChoice:
    """The formats `--weight-dtype name` loads this checkpoint with; `auto` logs its choice and the reasons (unless
    `quiet`: an estimate ahead of the load). With
    a serving dtype other than bfloat16 (float32 asks for exactness, and the CPU kernels of the quantised
    formats take bf16 activations) `auto` keeps every weight in that dtype."""
    if name != "auto":
        chosen = resolve_weight_dtype(name)
        return WeightChoice(chosen, chosen)
    level = logging.DEBUG if quiet else logging.INFO
    if dtype != torch.bfloat16:
        log.log(level, "weight dtype auto: %s weights (the serving dtype)", str(dtype).removeprefix("torch."))
        return WeightChoice("bfloat16", "bfloat16")
    choice, why = auto_weight_dtype(types, tied, parameter_name)
    log.log(level, "weight dtype auto: %s", why)
    return choice


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (codes [N, K] int8, scales [N] fp32): per-row absmax / 127. A row of
    zeros gets scale 1 (codes 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


INT4_LEVELS = 15  # codes 0..15
QUANTIZE_CHUNK_ROWS = 2048  # rows quantised at once at load: their few fp32 copies stay a few MiB


INT4_SPANS = (15, 14, 13, 12)  # the code spans quantize_int4 tries for a group's range, from each end


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (codes [N, G * 32] uint8 in 0..15, zero past K; scale [N, G] fp16;
    offset [N, G] fp16), value = scale * code + offset. Per group of 32, from each end of its range (z = min with
    s > 0, or z = max with s < 0; z rounded to fp16) and each span m of INT4_SPANS, s = (max - min) / m rounded
    to fp16 and codes round((w - z) / s): the candidate of least squared error, the first on a tie. z = min and
    m = 15 is Q4_1's min-max rule, so its blocks come back exactly; Q4_0's blocks (d (q - 8), its largest
    magnitude at -8 d, exact in fp16, the other end at most 7 |d| away) come back exactly from that end for the
    common spans; a group with one outlier fits better on a shorter span. A constant group: s = 0, codes 0."""
    n, k = weight.shape
    groups = -(-k // INT4_GROUP)
    w = weight.detach().float()
    if groups * INT4_GROUP != k:  # the last group's padding takes its last value, so min and max stay the row's
        w = torch.cat([w, w[:, -1:].expand(n, groups * INT4_GROUP - k)], dim=1)
    g = w.view(n * groups, INT4_GROUP)
    low, high = g.amin(dim=1), g.amax(dim=1)
    best = _int4_candidate(g, low, high, 1.0, INT4_SPANS[0])
    # The other candidates only for the groups the first leaves inexact: none can beat an error of 0, and nearly
    # every group of a Q4_1 file's values is exact (a third of the time of trying them all).
    rest = (best[0] > 0).nonzero().squeeze(1)
    inexact, g_rest, low_rest, high_rest = [t[rest] for t in best], g[rest], low[rest], high[rest]
    for sign, m in [(sign, m) for sign in (1.0, -1.0) for m in INT4_SPANS][1:]:
        inexact = _keep_better(inexact, _int4_candidate(g_rest, low_rest, high_rest, sign, m))
    for whole, part in zip(best, inexact):
        whole[rest] = part
    codes = best[3].to(torch.uint8).view(n, groups * INT4_GROUP)
    codes[:, k:] = 0
    return codes, best[1].view(n, groups), best[2].view(n, groups)


def _int4_candidate(g: torch.Tensor, low: torch.Tensor, high: torch.Tensor, sign: float,
                    span: int) -> list[torch.Tensor]:
    """groups g [R, 32] with their min and max [R] -> [err [R], scale [R], offset [R], codes [R, 32]] for the
    offset at the low end (sign 1) or the high end (sign -1) and `span` codes across the range."""
    offset = (low if sign > 0 else high).to(torch.float16)
    shifted = g - offset.float().unsqueeze(1)
    scale = (sign * (high - low) / span).to(torch.float16)
    step = torch.where(scale != 0, scale.float(), torch.ones_like(low)).unsqueeze(1)
    codes = torch.round(shifted / step).clamp_(0, INT4_LEVELS)
    err = (codes * scale.float().unsqueeze(1) - shifted).square_().sum(dim=1)
    return [err, scale, offset, codes]


def _keep_better(best: list[torch.Tensor], candidate: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per group, the candidate (err [R], then tensors [R] or [R, 32]) of the lesser error (the first on a tie)."""
    if not best:
        return candidate
    better = candidate[0] < best[0]
    return [torch.where(better.view(*better.shape, *[1] * (new.dim() - better.dim())), new, old)
            for new, old in zip(candidate, best)]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, G * 32] uint8 (0..15) -> their rows in the kernel's layout, uint8 [N, G, 4, 4]: byte [n, g, t, j]
    = codes[n, 32 g + 4 t + j] | codes[n, 32 g + 16 + 4 t + j] << 4 (the 16 rows of a block then interleave:
    `store_int4`)."""
    n = codes.shape[0]
    halves = codes.view(n, -1, 2, 4, 4)  # [n, g, low / high half of the group, t, j]
    return halves[:, :, 0] | (halves[:, :, 1] << 4)


class Int4Rows(NamedTuple):
    """Rows of an int4 weight before they take their place in its layout."""

    codes: torch.Tensor  # uint8 [R, G, 4, 4]: pack_int4's layout
    scale: torch.Tensor  # fp16 [R, G]
    offset: torch.Tensor  # fp16 [R, G]


class Int8gRows(NamedTuple):
    """Rows of an int8g weight before they take their place in it."""

    codes: torch.Tensor  # int8 [R, K]
    scale: torch.Tensor  # fp32 [R, K / 16]
    offset: torch.Tensor | None  # fp32 [R, K / 16], or None (zero offsets)


@dataclass(frozen=True, eq=False)
class FileBlocks:
    """A checkpoint tensor [N, K] in a file's quantised blocks (the GGUF loader makes them): an int8g weight takes
    its rows from `int8g_rows`, an int4 one from `rows` (Q4_0 / Q4_1 / Q4_K blocks only), any other format its
    float32 `values`."""

    shape: tuple[int, ...]
    values: Callable[[], torch.Tensor]  # float32 [N, K]
    rows: Callable[[], Iterator[tuple[int, Int4Rows]]] | None = None  # (first row, its rows), covering rows 0..N-1
    int8g_rows: Callable[[], Iterator[tuple[int, Int8gRows]]] | None = None
    kind: str = ""  # the GGUF type's name


def float_values(tensor: torch.Tensor | FileBlocks) -> torch.Tensor:
    """A checkpoint tensor's values as a float tensor (FileBlocks dequantised; a tensor as it is)."""
    return tensor.values() if isinstance(tensor, FileBlocks) else tensor


def quantized_int4_rows(weight: torch.Tensor) -> Int4Rows:
    """weight [R, K] (any float dtype) quantised (quantize_int4) and packed (pack_int4)."""
    codes, scale, offset = quantize_int4(weight)
    return Int4Rows(pack_int4(codes), scale, offset)


def store_int4(packed: torch.Tensor, scales: torch.Tensor, first: int, weight: torch.Tensor | FileBlocks) -> None:
    """Puts weight [R, K] (rows first..first+R of the weight) in its place in packed and scales: FileBlocks' int4
    rows as they are (other blocks dequantised first), a float weight quantised a chunk of rows at a time (their few fp32 copies stay small)."""
    if isinstance(weight, FileBlocks) and weight.rows is not None:
        pieces = weight.rows()
    else:
        weight = float_values(weight)
        pieces = ((start, quantized_int4_rows(weight[start:start + QUANTIZE_CHUNK_ROWS]))
                  for start in range(0, weight.shape[0], QUANTIZE_CHUNK_ROWS))
    for start, rows in pieces:
        _place_int4(packed, scales, first + start, rows)


def _place_int4(packed: torch.Tensor, scales: torch.Tensor, first: int, rows: Int4Rows) -> None:
    """Rows first.. of the weight: whole 16-channel blocks by one strided copy, the rows around them by index."""
    n = rows.codes.shape[0]
    pair = torch.stack([rows.scale, rows.offset], dim=2).to(scales.device)  # [n, G, 2]
    if scales.dim() == 3:
        scales[:, :, first:first + n] = pair.permute(2, 1, 0)
    codes = rows.codes.to(packed.device).contiguous()
    start, stop = whole_blocks(first, n, INT4_CHANNELS)
    if stop > start:  # [blocks, 16, G, 4, 4] -> [blocks, G, 4, 16, 4], moving 4 bytes (one int32) at a time
        block, blocks = (first + start) // INT4_CHANNELS, (stop - start) // INT4_CHANNELS
        whole = codes[start:stop].view(torch.int32).view(blocks, INT4_CHANNELS, *codes.shape[1:3], 1)
        packed.view(torch.int32)[block:block + blocks] = whole.permute(0, 2, 3, 1, 4)
        if scales.dim() == 4:  # blocked scales: [blocks, 16, G, 2] -> [blocks, G, 2, 16]
            scales[block:block + blocks] = pair[start:stop].view(blocks, INT4_CHANNELS, -1, 2).permute(0, 2, 3, 1)
    for first_row, last_row in ((0, start), (stop, n)):
        index = torch.arange(first + first_row, first + last_row)
        packed[index // INT4_CHANNELS, :, :, index % INT4_CHANNELS, :] = codes[first_row:last_row]
        if scales.dim() == 4:
            scales[index // INT4_CHANNELS, :, :, index % INT4_CHANNELS] = pair[first_row:last_row]


def int4_layout(modules: list[nn.Module], device: torch.device | str) -> None:
    """As int8_layout, for int4: each module's weight becomes pack_int4's uint8 layout, with its fp16 scales and
    offsets (int4_shapes') as the module's `weight_scale` (filled by load_weights, `store_int4`)."""
    for module in modules:
        rows, cols = module.weight.shape
        codes, scales = int4_shapes(rows, cols)
        module.weight = nn.Parameter(torch.zeros(codes, dtype=torch.uint8, device=device), requires_grad=False)
        module.weight_scale = torch.zeros(scales, dtype=torch.float16, device=device)


def store_int8g(codes: torch.Tensor, scales: torch.Tensor, first: int, weight: torch.Tensor | FileBlocks) -> None:
    """Puts a file's blocks [R, K] (rows first..first+R of the weight) in their place in an int8g weight's codes
    and scales [2, G, N], as they are (a tensor without offsets leaves its rows' offsets zero)."""
    if not isinstance(weight, FileBlocks) or weight.int8g_rows is None:
        raise ValueError("int8g takes a file's quantised blocks only (there is no int8g quantiser of float weights); "
                         f"expected GGUF blocks of {', '.join(sorted(EXACT_INT8G_TYPES))}")
    for start, rows in weight.int8g_rows():
        int8g_put(codes, scales, first + start, rows.codes, rows.scale, rows.offset)


def int8g_layout(modules: list[nn.Module], device: torch.device | str) -> None:
    """As int4_layout, for int8g: int8 codes in 16-channel blocks [ceil(N / 16), G, 256] (zero past N and K) and
    fp32 scales and offsets [2, G, N] (filled by load_weights, `store_int8g`; `compact_int8g_scales` then drops
    offsets that are all zero and pairs groups that share their scales)."""
    for module in modules:
        rows, cols = module.weight.shape
        codes, scales = int8g_shapes(rows, cols, offsets=True)
        module.weight = nn.Parameter(torch.zeros(codes, dtype=torch.int8, device=device), requires_grad=False)
        module.weight_scale = torch.zeros(scales, dtype=torch.float32, device=device)


def compact_int8g_scales(model: nn.Module) -> None:
    """int8g weights whose offsets are all zero (types without minimums) keep their scales only: the products then
    skip the offsets, and s q keeps the file's sign of a zero. Where every pair of groups of 16 holds the same
    scales (and offsets), one per 32 values stays (pair_int8g_scales); then the scales go into the codes' blocks
    where N allows (block_int8g_scales)."""
    for module in model.modules():
        scale = getattr(module, "weight_scale", None)
        if scale is None or scale.dim() != 3 or scale.dtype != torch.float32:
            continue
        if scale.shape[0] == 2 and not scale[1].any():
            scale = scale[:1].clone()
        paired = pair_int8g_scales(scale)
        scale = scale if paired is None else paired
        blocked = block_int8g_scales(scale)
        module.weight_scale = scale if blocked is None else blocked


def int8_layout(modules: list[nn.Module], device: torch.device | str) -> None:
    """On a model still on the meta device (before its storage is made): each module's weight becomes an int8
    parameter, with its fp32 scales [N] (real storage, filled by load_weights) beside it as the module's
    `weight_scale`."""
    for module in modules:
        rows, cols = module.weight.shape
        module.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.int8, device="meta"), requires_grad=False)
        module.weight_scale = torch.empty(rows, dtype=torch.float32, device=device)


class QuantizableModel(Protocol):
    def modules(self) -> Iterator[nn.Module]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    def head_module(self) -> nn.Module: ...


def quantized_modules(model: QuantizableModel) -> list[nn.Module]:
    """The modules whose weight --weight-dtype int8 (or int4) quantises: the layers' projections and the LM head
    (the embedding table where it is tied)."""
    return layer_projections(model) + [model.head_module()]


def layer_projections(model: QuantizableModel) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, Linear)]


def apply_layout(model: QuantizableModel, choice: WeightChoice, device: torch.device | str) -> None:
    """The quantised layouts of `choice` on a model still on the meta device (bfloat16: the plain weights)."""
    layouts = {"int8": int8_layout, "int4": int4_layout, "int8g": int8g_layout}
    projections = {f"{name}.weight": module for name, module in model.named_modules() if isinstance(module, Linear)}
    unknown = sorted(set(choice.modules) - set(projections))
    if unknown:
        raise ValueError(f"weight formats chosen for {unknown[:3]}, which are not the model's projections; "
                         f"expected names such as {next(iter(projections), None)!r}")
    chosen = [(module, choice.modules.get(name, choice.layers)) for name, module in projections.items()]
    for module, chosen_format in [*chosen, (model.head_module(), choice.head)]:
        if chosen_format in layouts:
            layouts[chosen_format]([module], device)


def weight_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name of each quantised weight -> its scales."""
    return {f"{name}.weight" if name else "weight": module.weight_scale for name, module in model.named_modules()
            if getattr(module, "weight_scale", None) is not None}
