"""Tiny random Llama-family checkpoints saved as real Hugging Face folders (safetensors + tokenizer)."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 512


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, rope_theta=10000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    base.update(overrides)
    return LlamaConfig(**base)


def write_tiny_model(folder: Path, config, seed: int = 0) -> Path:
    """Save a randomly initialised model for `config` (Llama or Qwen2) with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_tokenizer import write_tiny_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    _scale_up_weights(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder, vocab_size=config.vocab_size)
    return folder


def _scale_up_weights(model) -> None:
    # HF's default init (std 0.02) makes logits nearly uniform; larger weights give peaked, distinct
    # distributions so that greedy decoding is stable and comparisons are meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)
            elif "bias" in name:
                param.normal_(0.0, 0.1)
