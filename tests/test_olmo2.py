"""OLMo 2 (engine/model/olmo2.py) from a Hugging Face folder against transformers' Olmo2ForCausalLM: prefill,
chunked prefill and decode logits on the default backend (the CPU kernels for bf16) and on --enforce-eager's
torch ops, and whole greedy generations through the engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends import CpuKernelBackend, TorchBackend, select_backend
from engine.model.hf_loader import read_hf_config
from engine.model.loader import load_model, model_class, resolve_model
from engine.model.olmo2 import Olmo2Model
from tests.kernel_helpers import require_kernels
from tests.test_model_parity import assert_close_relative, decode_logits, paged_logits, reference_logits
from tests.tiny_models import TINY_VOCAB, write_tiny_model

PROMPTS = [[5, 9, 33, 2, 7, 100, 3], [11, 12, 13], list(range(400, 431)), [21]]
# the parity tests' bounds: fp32 against transformers' fp32 (test_model_parity.py), bf16 on the kernels
# (test_qwen3.py's kernel test)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory) -> Path:
    """Untied LM head, two kv heads for four q heads; norms drawn around 1, so that a norm applied to the wrong
    tensor (q's to k, or per head rather than over the projection) changes the logits."""
    from transformers import Olmo2Config

    config = Olmo2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-olmo2"), config, seed=3, random_norms=True)


def test_config_and_model_class(olmo2_dir):
    cfg = read_hf_config(olmo2_dir)
    assert cfg.architecture == "olmo2" and model_class(cfg) is Olmo2Model
    assert not cfg.qk_norm and not cfg.tie_word_embeddings and cfg.rope_theta == 500000.0
    model = load_model(resolve_model(olmo2_dir), torch.float32)
    attn = model.layers[0].self_attn
    assert type(model) is Olmo2Model and attn.q_norm.weight.shape == (cfg.q_size,)
    assert attn.k_norm.weight.shape == (cfg.kv_size,)


@pytest.fixture(params=[(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                        (torch.bfloat16, True)], ids=["fp32", "fp32-eager", "bf16-kernels", "bf16-eager"])
def olmo2_model(request, olmo2_dir):
    """The folder's model on the backend an engine would choose for this dtype and --enforce-eager."""
    dtype, eager = request.param
    backend = select_backend("cpu", dtype, eager)
    if isinstance(backend, CpuKernelBackend):
        require_kernels()
    model = load_model(resolve_model(olmo2_dir), dtype)
    model.set_backend(backend)
    assert isinstance(backend, TorchBackend) and (type(backend) is TorchBackend) == (eager or dtype != torch.bfloat16)
    return model


@pytest.mark.parametrize("chunk", [1000, 7])
def test_prefill_logits_match_transformers(olmo2_dir, olmo2_model, chunk):
    cfg = olmo2_model.cfg
    ids = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        ours = paged_logits(olmo2_model, cfg, ids, chunk)
    assert_close_relative(ours, reference_logits(olmo2_dir, ids), TOLERANCE[olmo2_model.dtype])


def test_decode_logits_match_transformers(olmo2_dir, olmo2_model):
    cfg = olmo2_model.cfg
    ids = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        ours = decode_logits(olmo2_model, cfg, ids)
    assert_close_relative(ours, reference_logits(olmo2_dir, ids), TOLERANCE[olmo2_model.dtype])
    assert olmo2_model.prepared.stack is None  # the fused decode step computes Llama's layer, not this one


def test_engine_greedy_tokens_equal_transformers_generate(olmo2_dir):
    """fp32 greedy generations through the engine (paged cache, chunked prefill, batched decode steps) against
    transformers' generate on the same folder, one prompt at a time."""
    llm = LLM(str(olmo2_dir), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    ours = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))]
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(olmo2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert ours == expected
