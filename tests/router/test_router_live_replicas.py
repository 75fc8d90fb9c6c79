"""The router in front of real Ember replicas: affinity, bounded load, failover, the openai client.

Three small ``ember serve`` processes (1 torch thread, 128 MiB KV pool) share one
``--session-dir`` and run with ``--write-behind 0.2``: well within a second
after a turn, a copy of the conversation's KV is in the shared directory while
the conversation stays hot in its replica's pool; any replica can restore the
copy. ``ember route`` runs as its own process in front of them.

Which replica served a request comes from the router's ``X-Ember-Upstream``
response header, cross-checked with the replicas' own ``/v1/sessions``
listings, so the router is not the only witness of its own affinity.

The replica-killing test is the last one in this file: it leaves the module's
replica set one short, and every test first checks that all replicas run.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from router_fakes import wait_until
from server_process import ServerProcess, metric_value

from ember.config import EngineConfig
from ember.router import RouterConfig, rendezvous_order
from ember.router.policy import load_capacity

NUM_REPLICAS = 3
REPLICA_ARGS = (
    "--warmup-requests", "1",
    "--kv-cache-mb", "128",
    # A copy of each conversation reaches the shared directory within a second of its turn.
    "--write-behind", "0.2",
)
BLOCK_SIZE = EngineConfig().block_size  # the replicas run with the default
ROUTER_DEFAULTS = RouterConfig()  # the router runs with its default epsilon and floor
UPSTREAM_HEADER = "x-ember-upstream"


@dataclass
class Cluster:
    """Replicas and the router in front of them (all real processes)."""

    replicas: list[ServerProcess]
    router: ServerProcess
    session_dir: Path

    @property
    def urls(self) -> list[str]:
        """The replicas' base URLs, as the router names them (and hashes them)."""
        return [replica.base for replica in self.replicas]

    def replica(self, url: str) -> ServerProcess:
        return next(r for r in self.replicas if r.base == url)

    def assert_all_running(self) -> None:
        for replica in self.replicas:
            assert replica.proc.poll() is None, f"replica {replica.base} is not running:\n{replica.log()}"

    def sessions_on(self, url: str) -> set[str]:
        """Conversation ids a replica knows (any tier), from its own API."""
        listing = httpx.get(f"{url}/v1/sessions", timeout=10).json()["data"]
        return {row["id"] for row in listing}


@dataclass
class Turn:
    """One chat turn as the client saw it."""

    upstream: str
    content: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    session_dir = tmp_path_factory.mktemp("shared-sessions")
    replicas: list[ServerProcess] = []
    router: ServerProcess | None = None
    try:
        # Start every replica before waiting for any: they load in parallel.
        for _ in range(NUM_REPLICAS):
            replicas.append(ServerProcess(*REPLICA_ARGS, "--session-dir", str(session_dir), threads=1))
        for replica in replicas:
            replica.wait_ready(timeout=150)
        upstream_flags = [flag for replica in replicas for flag in ("--upstream", replica.base)]
        router = ServerProcess(
            *upstream_flags, "--probe-interval", "0.5", "--log-level", "warning", command="route"
        ).wait_ready(timeout=60)
        # The router probes every replica before it serves: all of them count.
        assert httpx.get(f"{router.base}/ready", timeout=5).json()["available_upstreams"] == NUM_REPLICAS
        yield Cluster(replicas, router, session_dir)
    finally:
        for process in [*replicas, *([router] if router else [])]:
            process.stop()


# -- helpers -------------------------------------------------------------------------------------


def conversation_ids(prefix: str, urls: list[str], homes: list[str]) -> list[str]:
    """One session id per entry of ``homes`` whose rendezvous home is that replica.

    The replicas' ports, hence their hashes, change from run to run; picking
    ids by home keeps what each test sets up (who lives where) the same.
    """
    wanted = list(homes)
    chosen: list[str] = []
    for i in range(10_000):
        key = f"{prefix}-{i}"
        home = rendezvous_order(key, urls)[0]
        if home in wanted:
            wanted.remove(home)
            chosen.append(key)
            if not wanted:
                break
    assert not wanted
    # Reorder to match ``homes``.
    by_home: dict[str, list[str]] = {}
    for key in chosen:
        by_home.setdefault(rendezvous_order(key, urls)[0], []).append(key)
    return [by_home[home].pop(0) for home in homes]


def opening(session: str) -> list[dict[str, str]]:
    """A system prompt unique from its first token: a conversation's cached KV is only its own."""
    return [{"role": "system", "content": f"Conversation {session}. You are a terse travel assistant. " * 4}]


def chat(base: str, session: str, messages: list[dict[str, str]], *, max_tokens: int = 8, **extra: Any) -> Turn:
    """One non-streaming chat turn through ``base`` (the router or a replica)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Session-ID": session}, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    usage = data["usage"]
    return Turn(
        upstream=response.headers[UPSTREAM_HEADER],
        content=data["choices"][0]["message"]["content"],
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )


def stream_chat(base: str, session: str, messages: list[dict[str, str]], *, max_tokens: int = 8) -> Turn:
    """One streaming chat turn; fails on an error event or a stream without ``[DONE]``."""
    body = {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers={"X-Session-ID": session}, timeout=60
    ) as response:
        assert response.status_code == 200, response.read().decode()
        upstream = response.headers[UPSTREAM_HEADER]
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                text.append(choice["delta"].get("content") or "")
            usage = event.get("usage") or usage
    assert done and usage is not None
    return Turn(
        upstream=upstream,
        content="".join(text),
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )


def disk_hit_tokens(replica: ServerProcess) -> float:
    """Prompt tokens a replica has restored from warm state on disk (its own metric)."""
    return metric_value(replica.metrics(), "llm_prefix_cache_hits_total", {"tier": "disk"})


def router_in_flight(cluster: Cluster, url: str) -> int:
    """Requests the router has outstanding on one replica (its admin listing)."""
    listing = httpx.get(f"{cluster.router.base}/admin/upstreams", timeout=5).json()["upstreams"]
    return next(u["in_flight"] for u in listing if u["url"] == url)


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(240)  # includes starting the module's replicas (about 30 s on 2 cores)
def test_conversations_stay_on_their_replica(cluster: Cluster) -> None:
    cluster.assert_all_running()
    urls = cluster.urls
    # Two conversations per replica. With a handful of conversations, hashing
    # alone may put most on one replica, and then the load bound rightly moves
    # some; that is the next test. Here: does each stay on its replica?
    homes = [url for url in urls for _ in range(2)]
    sessions = conversation_ids("affinity", urls, homes)
    questions = ["Where is Lisbon?", "What should I eat there?", "And in Porto?"]

    def converse(session: str) -> list[Turn]:
        messages = opening(session)
        turns = []
        for question in questions:
            messages.append({"role": "user", "content": question})
            turn = chat(cluster.router.base, session, messages)
            messages.append({"role": "assistant", "content": turn.content})
            turns.append(turn)
        return turns

    with ThreadPoolExecutor(len(sessions)) as pool:  # all conversations at once
        results = dict(zip(sessions, pool.map(converse, sessions)))

    home_of = dict(zip(sessions, homes))
    all_turns = [(session, turn) for session, turns in results.items() for turn in turns]
    at_home = sum(turn.upstream == home_of[session] for session, turn in all_turns)
    affinity = at_home / len(all_turns)
    print(f"affinity: {at_home}/{len(all_turns)} turns on their conversation's home replica ({affinity:.0%})")
    assert affinity >= 0.95
    for session, turns in results.items():
        served = {turn.upstream for turn in turns}
        # The replicas' own records agree with the router's header: a conversation is
        # known exactly where it was served.
        assert {url for url in urls if session in cluster.sessions_on(url)} == served
        # Staying home pays: every later turn reuses the whole previous prompt.
        for previous, turn in zip(turns, turns[1:]):
            if turn.upstream == previous.upstream:
                assert turn.cached_tokens >= previous.prompt_tokens - BLOCK_SIZE, (session, turns)
    # The conversations spread over every replica.
    assert {turn.upstream for _, turn in all_turns} == set(urls)


@pytest.mark.timeout(120)
def test_bounded_load_spreads_a_hot_spot(cluster: Cluster) -> None:
    cluster.assert_all_running()
    urls = cluster.urls
    hot = urls[0]
    sessions = conversation_ids("hotspot", urls, [hot] * 6)
    # Six requests in flight at once: the most the hot replica may hold. The
    # first ``bound`` arrivals stay home (each within the bound), the rest spill.
    bound = load_capacity([len(sessions) - 1, 0, 0], ROUTER_DEFAULTS.load_epsilon, ROUTER_DEFAULTS.load_floor)
    assert bound < len(sessions)  # else nothing would spill and the test would prove nothing
    start = threading.Barrier(len(sessions))

    def first_turn(session: str) -> Turn:
        messages = [*opening(session), {"role": "user", "content": "Plan a day in Rome."}]
        start.wait()
        # ignore_eos: no request ends early, so all six overlap at the router.
        return chat(cluster.router.base, session, messages, max_tokens=16, ignore_eos=True)

    with ThreadPoolExecutor(len(sessions)) as pool:
        turns = list(pool.map(first_turn, sessions))
    on_hot = [turn for turn in turns if turn.upstream == hot]
    print(f"hot spot: {len(on_hot)} of {len(turns)} on the home replica (bound {bound})")
    assert len(on_hot) == bound
    # What spills goes to the conversation's next replica in rendezvous order,
    # the same one every router would pick.
    for session, turn in zip(sessions, turns):
        assert turn.upstream in (hot, rendezvous_order(session, urls)[1])


@pytest.mark.timeout(120)
def test_openai_client_through_the_router(cluster: Cluster) -> None:
    cluster.assert_all_running()
    session = "openai-live"
    home = rendezvous_order(session, cluster.urls)[0]
    client = openai.OpenAI(base_url=f"{cluster.router.base}/v1", api_key="sk-unused", max_retries=0, timeout=60)
    with client:
        model = client.models.list().data[0].id
        messages: list[dict[str, str]] = [*opening(session), {"role": "user", "content": "Name a river."}]
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, temperature=0, extra_headers={"X-Session-ID": session}
        )
        assert raw.headers[UPSTREAM_HEADER] == home
        first = raw.parse()
        assert first.choices[0].message.content and first.usage is not None
        assert first.usage.completion_tokens >= 1

        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "How long is it?"},
        ]
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Session-ID": session},
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert text and finish in (["stop"], ["length"])
    assert usage is not None and usage.completion_tokens >= 1
    # The stream went to the same replica, which still had the first turn's KV (hot or on disk).
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - BLOCK_SIZE
    assert session in cluster.sessions_on(home)


@pytest.mark.timeout(120)
def test_killed_replica_conversations_continue_elsewhere_from_disk(cluster: Cluster) -> None:
    """SIGKILL a replica while turns run on it: no client sees an error, and the
    conversations continue on their next replica, restored from the shared disk."""
    cluster.assert_all_running()
    urls = cluster.urls
    victim = urls[0]
    sessions = conversation_ids("failover", urls, [victim] * 3)
    histories = {session: opening(session) for session in sessions}

    def ask(session: str, question: str, *, stream: bool = False) -> Turn:
        history = histories[session]
        history.append({"role": "user", "content": question})
        turn = (stream_chat if stream else chat)(cluster.router.base, session, history, max_tokens=16)
        history.append({"role": "assistant", "content": turn.content})
        return turn

    first = {session: ask(session, "Name a famous bridge.") for session in sessions}
    assert all(turn.upstream == victim for turn in first.values())

    def copies_on_disk() -> bool:
        infos = [httpx.get(f"{victim}/v1/sessions/{s}", timeout=5).json() for s in sessions]
        print("victim's sessions:", [(info["location"], info["on_disk"]) for info in infos])  # hot, unless the pool was short
        return all(info["on_disk"] for info in infos)

    # A SIGKILLed replica cannot write anything: the copies written behind are all that is left.
    wait_until(copies_on_disk, timeout_s=15, interval_s=0.1)
    assert len(list(cluster.session_dir.glob("*.ekv"))) >= len(sessions)
    disk_hits_before = {url: disk_hit_tokens(cluster.replica(url)) for url in urls[1:]}

    with ThreadPoolExecutor(len(sessions)) as pool:
        # Second turns go out; once the victim holds some of them (non-streaming
        # answers send nothing before they are complete), it dies.
        second_futures = {s: pool.submit(ask, s, "How long is it?") for s in sessions}
        wait_until(lambda: router_in_flight(cluster, victim) > 0, timeout_s=10, interval_s=0.005)
        cluster.replica(victim).proc.send_signal(signal.SIGKILL)
        cluster.replica(victim).proc.wait(10)
        second = {s: future.result() for s, future in second_futures.items()}

    for session in sessions:
        turn = second[session]
        # The next replica in rendezvous order: every router sends the conversation there.
        assert turn.upstream == rendezvous_order(session, urls)[1], turn
        # It never saw this conversation: the reused prefix came from the victim's file.
        turn1 = first[session]
        full = (turn1.prompt_tokens + turn1.completion_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        print(f"{session}: turn 2 on a new replica reused {turn.cached_tokens} of {full} tokens the victim had on disk")
        assert turn.cached_tokens >= turn1.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    for url in urls[1:]:
        restored = sum(second[s].cached_tokens for s in sessions if second[s].upstream == url)
        assert disk_hit_tokens(cluster.replica(url)) - disk_hits_before[url] == restored

    # Turn 3 streams, and stays where turn 2 went, with its KV hot there.
    for session in sessions:
        turn = ask(session, "Who built it?", stream=True)
        assert turn.upstream == second[session].upstream
        assert turn.cached_tokens >= second[session].prompt_tokens - BLOCK_SIZE
    # The router has noticed: the victim is out of rotation.
    wait_until(lambda: not _listed_ready(cluster, victim), timeout_s=5, interval_s=0.1)


def _listed_ready(cluster: Cluster, url: str) -> bool:
    listing = httpx.get(f"{cluster.router.base}/admin/upstreams", timeout=5).json()["upstreams"]
    return bool(next(u for u in listing if u["url"] == url)["ready"])
