"""The draft actor: a draft model in its own process serving decode actors through `RemoteProposer`.

Greedy outputs equal plain decoding (a tiny random draft and self:N; colocated and disaggregated, in batches
mixed with requests that do not speculate); a draft actor killed mid-stream costs speculation, not requests,
and comes back; the client's deadline and back-off against peers that never answer."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from actors.draft_actor import build_draft_server
from actors.remote_proposer import DraftUnavailable, RemoteDraftSettings, RemoteProposer
from actors.spec import ActorSpec
from engine import LLM, AsyncLLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from router.layout import ActorLayout, actor_specs
from engine.speculative.proposer import DraftRequest
from server.args import actor_options, add_actor_args
from tests.server_utils import guarded, wait_for
from tests.test_spec_decode import repetitive_prompts
from transport import private_socket_dir
from transport import messages as m
from transport.blocking import BlockingConnection

OPTIONS = dict(dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
PROJECT_ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(8, seed=5)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """Greedy decoding without speculation: the reference every speculative output must equal. Awaitable: on a
    thread, so the loop keeps heartbeating the actors meanwhile."""
    llm = LLM(str(tiny_model_dir), **OPTIONS)

    async def reference(prompts, params=GREEDY) -> list[list[int]]:
        outs = await asyncio.to_thread(llm.generate, prompts, params)
        return [o.token_ids for o in outs]

    return reference


async def generate(llm: AsyncLLM, prompt, params=GREEDY, on_token=None) -> list[int]:
    token_ids: list[int] = []
    async for out in llm.generate(prompt, params):
        token_ids = out.token_ids
        if on_token is not None:
            on_token(len(token_ids))
    return token_ids


async def mixed_batch(llm: AsyncLLM, prompts, plain) -> None:
    """Greedy speculating requests beside sampled ones (drafts with probabilities), one-token requests (never
    speculate) and a long prompt being prefilled in chunks: the greedy outputs equal plain decoding."""
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    long_prompt = prompts[0] * 8
    jobs = [generate(llm, p) for p in prompts] + [generate(llm, p, SAMPLED.with_seed(i)) for i, p in
                                                   enumerate(prompts[:2])]
    jobs += [generate(llm, p, one_token) for p in prompts[2:4]] + [generate(llm, long_prompt)]
    outs = await asyncio.gather(*jobs)
    n = len(prompts)
    assert outs[:n] == await plain(prompts)
    assert all(len(o) == SAMPLED.max_tokens and all(0 <= t < 512 for t in o) for o in outs[n:n + 2])
    assert outs[n + 2:n + 4] == await plain(prompts[2:4], one_token)
    assert outs[-1] == (await plain([long_prompt]))[0]


async def drafting_observed(llm: AsyncLLM, prompt, plain) -> bool:
    """Run a long greedy request: did drafts verified for it come from the draft actor? (The decode actor has
    no drafter of its own, so every proposed token counted in its heartbeats did.) Counting beats sampling the
    draft's state at one instant: adaptive K may pause speculation for a poor random draft at any moment."""
    router = llm._client
    before = router.stats().spec_proposed
    assert await asyncio.wait_for(generate(llm, prompt, LONG), guarded(30)) == (await plain([prompt], LONG))[0]
    deadline = asyncio.get_running_loop().time() + 5  # the counters arrive with the next heartbeats
    while router.stats().spec_proposed == before and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    return router.stats().spec_proposed > before


async def drafts_within(llm: AsyncLLM, prompt, plain, seconds: float) -> bool:
    """drafting_observed, retried: a draft call that missed its deadline (a cold draft model, a loaded machine)
    backs speculation off for 1-8 s by design, and one long request can fit inside that window."""
    deadline = time.monotonic() + seconds
    while not await drafting_observed(llm, prompt, plain):
        if time.monotonic() > deadline:
            return False
    return True


async def assert_clean(llm: AsyncLLM) -> None:
    """Once the work is done: no block leaked on the decode actors, no draft state left on the draft actors."""
    router = llm._client
    await wait_for(lambda: not router.routed, 10, "the router to forget finished requests")
    for handle in router.supervisor.ready("decode") + router.supervisor.ready("draft"):
        report = await router.integrity.check(handle.actor_id)
        assert report.error is None, report.error
        assert (report.used_blocks, report.running) == (0, 0), report


# ---------------------------------------------------------------- a separate draft actor, end to end

@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tiny_model_dir, draft_dir):
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, draft_actors=1, speculative="draft",
                   draft_model=str(draft_dir), num_speculative_tokens=4, **OPTIONS)
    await llm.start()
    yield llm
    await llm.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_outputs_with_a_draft_actor_equal_plain_decoding(cluster, prompts, plain):
    roles = {a["id"]: a["role"] for a in cluster.actors()}
    assert roles == {"decode-0": "decode", "draft-0": "draft"}  # what /status lists
    assert all(a["state"] == "ready" for a in cluster.actors())
    await mixed_batch(cluster, prompts, plain)
    assert await drafts_within(cluster, prompts[1], plain, 30)
    await assert_clean(cluster)


@pytest.mark.asyncio(loop_scope="module")
async def test_killing_the_draft_actor_mid_stream_loses_no_request(cluster, prompts, plain):
    router = cluster._client
    (draft,) = router.supervisor.ready("draft")
    streamed = asyncio.Event()
    jobs = [asyncio.create_task(generate(cluster, p, LONG, lambda n: n >= 16 and streamed.set()))
            for p in prompts[:3]]
    await asyncio.wait_for(streamed.wait(), guarded(20))
    os.kill(draft.pid, signal.SIGKILL)
    outs = await asyncio.wait_for(asyncio.gather(*jobs), guarded(60))
    assert outs == await plain(prompts[:3], LONG)
    await wait_for(lambda: draft.state == "ready" and draft.restarts == 1, 30, "the draft actor's restart")
    # The decode actor reconnects once its back-off runs out, then drafts with the new draft actor.
    assert await drafts_within(cluster, prompts[4], plain, 40), "never drafted with the restarted draft actor"
    await assert_clean(cluster)


@pytest.mark.asyncio
async def test_self_draft_actor_with_disaggregated_prefill(tiny_model_dir, prompts, plain):
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, prefill_actors=1, draft_actors=1, disagg="always",
                   speculative="draft", draft_model="self:1", **OPTIONS)
    await llm.start()
    try:
        outs = await asyncio.gather(*(generate(llm, p) for p in prompts[:6]))
        assert outs == await plain(prompts[:6])
        assert llm._client.handoff.counters.kv_transfers >= 6
        assert await drafts_within(llm, prompts[6], plain, 30)
        await assert_clean(llm)
    finally:
        await llm.aclose()


# ---------------------------------------------------------------- the client against a real draft actor

@pytest.fixture
def draft_process(tiny_model_dir):
    """A lone draft actor (self:1 of the tiny model), spawned exactly as the supervisor does."""
    engine = dict(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=4,
                  speculative="draft", draft_model="self:1")
    directory = private_socket_dir()
    spec = ActorSpec("draft-t", "draft", threads=1, socket_path=str(directory / "draft-t.sock"), engine=engine)
    proc = subprocess.Popen([sys.executable, "-m", "actors.worker", "--spec", spec.to_json()],
                            env=spec.child_environment(), cwd=PROJECT_ROOT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not Path(spec.socket_path).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the draft actor did not start"
            time.sleep(0.05)
        _wait_ready(spec.socket_path, deadline)  # it listens while it loads: serving is its Ready
        yield spec
    finally:
        proc.terminate()
        proc.wait(20)
        shutil.rmtree(directory, ignore_errors=True)


def _wait_ready(socket_path: str, deadline: float) -> None:
    conn = BlockingConnection.open_unix(socket_path, deadline)
    try:
        assert isinstance(conn.recv(deadline), m.Hello)
        while isinstance(msg := conn.recv(deadline), m.StartupProgress):
            pass
        assert isinstance(msg, m.Ready), msg
    finally:
        conn.close()


def integrity(socket_path: str) -> m.IntegrityReport:
    conn = BlockingConnection.open_unix(socket_path, time.monotonic() + 5)
    try:
        assert isinstance(conn.recv(time.monotonic() + 5), m.Hello)
        assert isinstance(conn.recv(time.monotonic() + 5), m.Ready)
        conn.send(m.CheckIntegrity(), time.monotonic() + 5)
        return conn.recv(time.monotonic() + 10)
    finally:
        conn.close()


def test_warm_up_drafts_once_and_leaves_nothing_behind(draft_process):
    server = build_draft_server(EngineConfig(**draft_process.engine), "cpu")
    calls = []
    propose = server.proposer.propose
    server.proposer.propose = lambda requests: calls.append(len(requests)) or propose(requests)
    server.warm_up()
    assert calls == [1]
    server.proposer.pool.check_integrity()
    assert server.proposer.pool.num_used == 0 and not server.proposer.seqs


def test_remote_drafts_equal_in_process_drafts(draft_process, prompts):
    """Tokens and probabilities (fp32 bytes) as the in-process draft model proposes them, through accepted and
    rejected drafts; a release and a closed connection free the draft actor's KV."""
    config = EngineConfig(**draft_process.engine)
    local = build_draft_server(config, "cpu").proposer
    remote = RemoteProposer(draft_process.socket_path, settings=RemoteDraftSettings(deadline=10.0))
    sequences = {0: list(prompts[0]), 1: list(prompts[1])}
    params = {0: GREEDY, 1: SAMPLED}
    for step in range(4):
        requests = [DraftRequest(i, list(tokens), 3, params[i], 77 if i else None) for i, tokens in sequences.items()]
        want, got = local.propose(requests), remote.propose(requests)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids and len(g.token_ids) == 3
            assert (g.draft_probs is None) == (w.draft_probs is None)
            if w.draft_probs is not None:
                torch.testing.assert_close(g.draft_probs, w.draft_probs, atol=1e-6, rtol=1e-5)
        for i, proposal in zip(sequences, want):  # keep `step` drafts, then a token the draft did not propose
            sequences[i] += proposal.token_ids[:step % 3] + [(proposal.token_ids[step % 3] + 1) % 512]
    assert integrity(draft_process.socket_path).running == 2
    remote.release(0)
    assert wait_report(draft_process.socket_path, lambda r: r.running == 1).error is None
    remote.close()  # the actor drops the connection's sequences with it
    report = wait_report(draft_process.socket_path, lambda r: r.running == 0)
    assert report.used_blocks == 0 and report.error is None


def wait_report(socket_path: str, predicate, timeout: float = 10.0) -> m.IntegrityReport:
    """Messages on different connections are not ordered: poll until the report says what we wait for."""
    deadline = time.monotonic() + timeout
    while not predicate(report := integrity(socket_path)):
        assert time.monotonic() < deadline, report
        time.sleep(0.02)
    return report


# ---------------------------------------------------------------- the client's deadline and back-off

class FakeDraftActor:
    """A Unix socket on a thread that accepts connections and runs `script(conn)` on each."""

    def __init__(self, script) -> None:
        self.directory = private_socket_dir()
        self.path = str(self.directory / "fake.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.connections: list[socket.socket] = []
        self.script = script
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(sock)
            threading.Thread(target=self.script, args=(BlockingConnection(sock),), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for sock in self.connections:
            sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def greet(conn: BlockingConnection) -> None:
    deadline = time.monotonic() + 5
    conn.send(m.Hello("draft", "cpu", os.getpid(), "fake"), deadline)
    conn.send(m.Ready("fake", 0, 8, {"kind": "none"}), deadline)


def requests_for(tokens: list[int], params=GREEDY) -> list[DraftRequest]:
    return [DraftRequest(5, tokens, 2, params, None)]


class FakeClock:
    """The proposer's back-off clock: it moves only when the test advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_draft_actor_that_never_answers_costs_one_deadline_then_backs_off():
    fake = FakeDraftActor(lambda conn: None)  # accepts, never says a word
    clock = FakeClock()
    settings = RemoteDraftSettings(deadline=0.5, backoff=2.0, max_backoff=4.0)
    proposer = RemoteProposer(fake.path, settings=settings, clock=clock)
    try:
        with pytest.raises(DraftUnavailable) as failed:
            proposer.propose(requests_for([3, 4, 5]))
        assert isinstance(failed.value.__cause__, TimeoutError)  # it gave up at its deadline
        assert proposer.backing_off and proposer.num_failures == 1
        # Quietly, without asking: any call to this actor could only end in DraftUnavailable.
        assert proposer.propose(requests_for([3, 4, 5]))[0].token_ids == []
        assert len(fake.connections) == 1 and proposer.num_failures == 1
        clock.advance(1.9)
        assert proposer.backing_off
        clock.advance(0.2)
        with pytest.raises(DraftUnavailable):  # tries again after the back-off: a fresh connection
            proposer.propose(requests_for([3, 4, 5]))
        assert len(fake.connections) == 2
        clock.advance(2.5)
        assert proposer.backing_off  # the second failure in a row backs off twice as long (4 s, not 2)
        clock.advance(1.6)
        assert not proposer.backing_off
    finally:
        proposer.close()
        fake.close()


def test_a_draft_actor_still_loading_is_left_alone_like_one_not_listening_yet():
    def loading(conn: BlockingConnection) -> None:
        deadline = time.monotonic() + 5
        conn.send(m.Hello("draft", "cpu", os.getpid(), "fake"), deadline)
        conn.send(m.StartupProgress("fake", "loading weights", 1, 10, "tensors"), deadline)

    fake = FakeDraftActor(loading)
    clock = FakeClock()
    proposer = RemoteProposer(fake.path, settings=RemoteDraftSettings(deadline=5.0, backoff=2.0), clock=clock)
    try:
        assert proposer.propose(requests_for([3, 4, 5]))[0].token_ids == []  # no drafts, and no error
        assert proposer.num_failures == 0 and proposer.backing_off and len(fake.connections) == 1
        assert proposer.propose(requests_for([3, 4, 5]))[0].token_ids == []
        assert len(fake.connections) == 1  # not asked again before the back-off ends
        clock.advance(2.1)
        proposer.propose(requests_for([3, 4, 5]))
        assert len(fake.connections) == 2 and proposer.num_failures == 0
    finally:
        proposer.close()
        fake.close()


def test_a_late_answer_is_skipped_and_only_new_tokens_travel():
    seen: list[m.ProposeDrafts] = []
    probs = torch.softmax(torch.randn(2, 512), dim=-1)
    client_gave_up = threading.Event()

    def script(conn: BlockingConnection) -> None:
        greet(conn)
        first = conn.recv(time.monotonic() + 5)
        seen.append(first)
        client_gave_up.wait(10)  # answer only once the client's deadline has passed
        conn.send(m.DraftProposals(first.call_id, [m.DraftProposal(5, [7, 7])], 512, "float32", []),
                  time.monotonic() + 5)
        second = conn.recv(time.monotonic() + 5)
        seen.append(second)
        rows = [m.DraftProposal(5, [9, 10], probs.numpy().tobytes())]
        conn.send(m.DraftProposals(second.call_id, rows, 512, "float32", []), time.monotonic() + 5)

    fake = FakeDraftActor(script)
    clock = FakeClock()
    proposer = RemoteProposer(fake.path, settings=RemoteDraftSettings(deadline=0.5, backoff=0.2), clock=clock)
    try:
        with pytest.raises(DraftUnavailable) as failed:
            proposer.propose(requests_for([3, 4, 5]))
        assert isinstance(failed.value.__cause__, TimeoutError)
        client_gave_up.set()
        clock.advance(0.25)  # past the back-off
        (proposal,) = proposer.propose(requests_for([3, 4, 5, 6, 8], SAMPLED))
        assert proposal.token_ids == [9, 10] and torch.equal(proposal.draft_probs, probs)
        assert len(fake.connections) == 1  # a timeout does not cost the connection (nor the actor's state)
        first, second = (call.queries[0] for call in seen)
        assert (first.num_kept, first.new_token_ids, first.sampling is not None) == (0, [3, 4, 5], True)
        assert (second.num_kept, second.new_token_ids, second.sampling) == (3, [6, 8], None)
    finally:
        proposer.close()
        fake.close()


def test_no_draft_actor_listening_means_no_speculation_not_an_error(tmp_path):
    proposer = RemoteProposer(str(tmp_path / "nobody.sock"), settings=RemoteDraftSettings(backoff=5.0),
                              clock=FakeClock())
    assert proposer.propose(requests_for([3, 4]))[0].token_ids == []
    assert proposer.backing_off and proposer.num_failures == 0
    proposer.release(5)  # never raises, even with nothing to talk to


# ---------------------------------------------------------------- wiring

@pytest.mark.unit
def test_draft_actors_are_laid_out_only_for_draft_speculation():
    options = dict(OPTIONS, speculative="draft", draft_model="self:1")
    specs = actor_specs(ActorLayout(decode_actors=3, draft_actors=2), options)
    by_id = {s.actor_id: s for s in specs}
    assert [s.role for s in specs] == ["decode"] * 3 + ["draft"] * 2
    assert [by_id[f"decode-{i}"].draft_actor for i in range(3)] == ["draft-0", "draft-1", "draft-0"]
    assert by_id["draft-0"].engine["num_kv_blocks"] == 2 * OPTIONS["num_kv_blocks"]  # it serves two decoders
    assert by_id["draft-1"].engine["num_kv_blocks"] == OPTIONS["num_kv_blocks"]
    spec = ActorSpec("decode-0", "decode", socket_path="/tmp/x/decode-0.sock", draft_actor="draft-1")
    assert spec.draft_socket == "/tmp/x/draft-1.sock"
    assert ActorSpec.from_json(spec.to_json()) == spec
    ngram = actor_specs(ActorLayout(decode_actors=1, draft_actors=1), dict(OPTIONS, speculative="ngram"))
    assert [s.role for s in ngram] == ["decode"] and not ngram[0].draft_actor


@pytest.mark.unit
def test_draft_actors_flag_and_option(tiny_model_dir):
    parser = argparse.ArgumentParser()
    add_actor_args(parser)
    assert actor_options(parser.parse_args(["--draft-actors", "2"]))["draft_actors"] == 2
    assert actor_options(parser.parse_args([]))["draft_actors"] == 0
    with pytest.raises(ConfigError, match="speculative='draft'"):
        AsyncLLM(str(tiny_model_dir), decode_actors=1, draft_actors=1, speculative="ngram", **OPTIONS)
    with pytest.raises(ValueError, match="decode actor"):
        ActorLayout(draft_actors=1)
