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


def tiny_qwen3_config(**overrides):
    """A tiny Qwen3 whose head_dim (32) is not hidden / heads (16), so that a loader deriving it would fail."""
    from transformers import Qwen3Config

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
                eos_token_id=None)
    base.update(overrides)
    return Qwen3Config(**base)


def tiny_gemma2_config(**overrides):
    """A tiny Gemma 2: four layers alternating windowed (8 tokens) and global, head_dim 32 != hidden / heads,
    a query scalar that is not head_dim, and caps small enough to bend these weights' scores and logits."""
    from transformers import Gemma2Config

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=24,
                attn_logit_softcapping=4.0, final_logit_softcapping=6.0, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
    base.update(overrides)
    return Gemma2Config(**base)


def tiny_gemma3_config(**overrides):
    """A tiny Gemma 3 text model: six layers, two windowed (8 tokens) then one global, twice; q/k norms; the
    windowed layers' RoPE base (100) far from the global one's (1e6, linearly scaled by 2)."""
    from transformers import Gemma3TextConfig

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=48,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base.update(overrides)
    return Gemma3TextConfig(**base)


def tiny_mistral_config(**overrides):
    """A tiny Mistral whose every layer attends through an 8-token sliding window."""
    from transformers import MistralConfig

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                rms_norm_eps=1e-5, sliding_window=8, tie_word_embeddings=False, bos_token_id=None,
                eos_token_id=None)
    base.update(overrides)
    return MistralConfig(**base)


def write_tiny_model(folder: Path, config, seed: int = 0, random_norms: bool = False,
                     **tokenizer_options) -> Path:
    """Save a randomly initialised model for `config` (Llama, Mistral, Qwen2, Qwen3, Gemma 2 or 3) with the tiny
    tokenizer.
    `random_norms`: RMSNorm weights drawn around 1 instead of all ones (Gemma, which stores w for (1 + w):
    around 0), so that a norm applied to the wrong tensor (q's to k, one head's to another) changes the logits.
    `tokenizer_options`: write_tiny_tokenizer's (a chat template, added tokens)."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_tokenizer import write_tiny_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    _scale_up_weights(model)
    if random_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
                    if config.model_type.startswith("gemma"):
                        param.sub_(1.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder, vocab_size=config.vocab_size, **tokenizer_options)
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
