"""Build the proposer an EngineConfig asks for."""
from __future__ import annotations

import torch

from engine.config import ConfigError, EngineConfig, parse_self_draft
from engine.model.llama import LlamaModel
from engine.model.loader import ModelSource, load_model, resolve_model
from engine.model.progress import Progress
from engine.speculative.draft_model import DraftModelProposer, LayerPrefixModel
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import Proposer


def build_proposer(config: EngineConfig, target: LlamaModel, target_source: ModelSource, num_blocks: int,
                   dtype: torch.dtype, device: torch.device | str = "cpu") -> Proposer | None:
    """None when speculation is off. The draft's KV pool has the target's block count plus room for each
    running sequence's K draft positions."""
    if config.speculative == "off":
        return None
    if config.speculative == "ngram":
        return NgramProposer()
    return DraftModelProposer(draft_net(config.draft_model, target_source, dtype, device, target,
                                        config.weight_dtype),
                              num_blocks + draft_spare_blocks(config), config.block_size, dtype, device)


def draft_spare_blocks(config: EngineConfig) -> int:
    """Draft KV blocks beyond the target's: room for each running sequence's K draft positions."""
    return config.max_num_seqs * (-(-config.num_speculative_tokens // config.block_size) + 1)


def draft_net(draft_model: str, target_source: ModelSource, dtype: torch.dtype, device: torch.device | str,
              target: LlamaModel | None = None, weight_dtype: str = "auto", progress: Progress | None = None):
    """The draft network. self:N shares the target's weights: loaded here when `target` is not given (a draft
    actor, which holds no target of its own). `weight_dtype` as EngineConfig.weight_dtype; `progress` hears the
    weights load."""
    if draft_model.startswith("self:"):
        num_layers = parse_self_draft(draft_model)
        if num_layers > target_source.config.num_layers:
            raise ConfigError(f"draft_model {draft_model} asks for more layers than the target has "
                              f"({target_source.config.num_layers})")
        return LayerPrefixModel(target if target is not None
                                else load_model(target_source, dtype, device, weight_dtype, progress), num_layers)
    source = resolve_model(draft_model)
    if source.config.vocab_size != target_source.config.vocab_size:
        raise ConfigError(f"the draft model's vocabulary ({source.config.vocab_size} tokens) differs from the "
                          f"target's ({target_source.config.vocab_size})")
    return load_model(source, dtype, device, weight_dtype, progress)
