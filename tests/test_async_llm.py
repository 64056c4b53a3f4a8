"""AsyncLLM: streaming deltas, cancellation that frees everything, requests joining a running batch."""
from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLM, LLM, SamplingParams
from tests.test_engine import GREEDY, make_prompts


@pytest.fixture(scope="module")
def async_llm(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=8)
    yield llm
    llm.shutdown()


async def collect(stream) -> tuple[str, list[int], list]:
    text, outs = "", []
    async for out in stream:
        text += out.outputs[0].delta_text
        outs.append(out)
    return text, outs[-1].token_ids, outs


async def wait_until_idle(llm: AsyncLLM, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while llm.stats().running or llm.stats().waiting or llm.stats().kv_blocks_used:
        assert asyncio.get_running_loop().time() < deadline, f"engine still busy: {llm.stats()}"
        await asyncio.sleep(0.01)


async def test_stream_deltas_add_up_to_the_blocking_result(async_llm, tiny_model_dir):
    prompt = make_prompts(1, seed=21)[0]
    text, token_ids, outs = await collect(async_llm.generate(prompt, GREEDY))
    reference = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=8).generate([prompt], GREEDY)[0]
    assert token_ids == reference.token_ids and text == reference.text
    assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].metrics.ttft is not None and outs[-1].metrics.ttft >= 0


async def test_cancel_mid_generation_frees_every_block(async_llm):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = async_llm.generate(make_prompts(1, seed=22)[0], params)
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await stream.aclose()
    await wait_until_idle(async_llm)
    async_llm.engine.pool.check_integrity()
    assert async_llm.stats().kv_blocks_used == 0


async def test_task_cancellation_aborts_the_request(async_llm):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    started = asyncio.Event()

    async def consume():
        async for _ in async_llm.generate(make_prompts(1, seed=23)[0], params):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_idle(async_llm)
    async_llm.engine.pool.check_integrity()


async def test_requests_join_while_others_run(async_llm, tiny_model_dir):
    prompts = make_prompts(4, seed=24)
    reference = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=8).generate(prompts, GREEDY)

    async def late(i: int):
        await asyncio.sleep(0.01 * i)
        return await collect(async_llm.generate(prompts[i], GREEDY))

    results = await asyncio.gather(*(late(i) for i in range(4)))
    assert [r[1] for r in results] == [r.token_ids for r in reference]
    await wait_until_idle(async_llm)


async def test_invalid_request_raises_to_the_caller(async_llm):
    too_long = list(range(3, 3 + async_llm.max_model_len))
    with pytest.raises(ValueError, match="context"):
        await collect(async_llm.generate(too_long, GREEDY))


async def test_parallel_samples_share_the_prompt_blocks(async_llm):
    prompt = make_prompts(1, seed=25)[0] * 3  # several full blocks
    hits_before = async_llm.engine.pool.prefix.stats.prefix_hits
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    _, _, outs = await collect(async_llm.generate(prompt, params))
    assert len(outs[-1].outputs) == 4 and all(o.finished for o in outs[-1].outputs)
    full_blocks = (len(prompt) - 1) // 8
    assert async_llm.engine.pool.prefix.stats.prefix_hits - hits_before >= 3 * full_blocks


def test_an_in_process_engine_names_its_backend(async_llm):
    described = async_llm.backend()
    assert (described["backend"], described["kernels"], described["device"]) == ("torch", [], "cpu")  # fp32
