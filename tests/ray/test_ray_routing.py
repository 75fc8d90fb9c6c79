"""The Ray request router's decisions on fake replica stats: the same policy as ``ember route``."""

from __future__ import annotations

import collections

import pytest

from ember.ray.routing import call_session_key, replica_order
from ember.router.policy import load_capacity, rendezvous_order
from ember.router.session_key import key_from_body

REPLICAS = ["mcwlr1lq", "wo62q5te", "k2j4h5g6"]  # Ray replica ids
KEYS = [f"conversation-{i}" for i in range(3000)]
EPSILON, FLOOR = 0.25, 4


def order(key: str | None, loads: dict[str, int], tick: int = 0) -> tuple[str, ...]:
    return replica_order(key, loads, load_epsilon=EPSILON, load_floor=FLOOR, tick=tick).candidates


def idle(replicas: list[str]) -> dict[str, int]:
    return {replica: 0 for replica in replicas}


@pytest.mark.timeout(10)
def test_a_conversation_goes_to_its_rendezvous_home_and_fails_over_in_rendezvous_order() -> None:
    for key in KEYS[:300]:
        assert list(order(key, idle(REPLICAS))) == rendezvous_order(key, REPLICAS)


@pytest.mark.timeout(10)
def test_every_replica_gets_a_fair_share_of_conversations() -> None:
    homes = collections.Counter(order(key, idle(REPLICAS))[0] for key in KEYS)
    assert set(homes) == set(REPLICAS)
    assert all(abs(n - len(KEYS) / 3) < 0.15 * len(KEYS) / 3 for n in homes.values()), homes


@pytest.mark.timeout(10)
def test_a_dead_replica_gives_away_only_its_own_conversations_each_to_its_next_replica() -> None:
    dead = REPLICAS[0]
    survivors = {replica: 0 for replica in REPLICAS[1:]}
    for key in KEYS[:500]:
        before = order(key, idle(REPLICAS))
        after = order(key, survivors)
        if before[0] == dead:
            assert after[0] == before[1]
        else:
            assert after[0] == before[0]


@pytest.mark.timeout(10)
def test_a_replacement_replica_takes_a_third_and_nothing_moves_between_the_others() -> None:
    # Ray restarts a dead replica under a new id: it is a replica that joins.
    replaced = [*REPLICAS[1:], "n3wr3p1c"]
    homes = collections.Counter()
    for key in KEYS:
        before, after = order(key, idle(REPLICAS))[0], order(key, idle(replaced))[0]
        if before != after:
            assert before == REPLICAS[0] or after == "n3wr3p1c", key
        homes[after] += 1
    assert abs(homes["n3wr3p1c"] / len(KEYS) - 1 / 3) < 0.05


@pytest.mark.timeout(10)
def test_load_below_the_floor_never_moves_a_conversation() -> None:
    key = KEYS[0]
    home = rendezvous_order(key, REPLICAS)[0]
    loads = {**idle(REPLICAS), home: FLOOR - 1}  # busy, but under the floor
    assert order(key, loads)[0] == home


@pytest.mark.timeout(10)
def test_an_overloaded_home_spills_to_the_next_replica_and_keeps_it_last_for_failover() -> None:
    key = KEYS[1]
    ranked = rendezvous_order(key, REPLICAS)
    loads = {ranked[0]: 12, ranked[1]: 0, ranked[2]: 0}
    assert 12 + 1 > load_capacity(list(loads.values()), EPSILON, FLOOR)
    assert order(key, loads) == (ranked[1], ranked[2], ranked[0])


@pytest.mark.timeout(10)
def test_requests_without_a_conversation_go_to_the_less_loaded_of_two() -> None:
    loads = {"a": 5, "b": 1, "c": 3}
    firsts = {order(None, loads, tick)[0] for tick in range(200)}
    assert "a" not in firsts  # the most loaded never wins a draw of two
    assert firsts == {"b", "c"}
    assert all(sorted(order(None, loads, tick)) == ["a", "b", "c"] for tick in range(20))


@pytest.mark.timeout(10)
def test_no_replicas_no_candidates() -> None:
    assert order("k", {}) == ()


@pytest.mark.timeout(10)
def test_the_call_key_is_the_handle_session_id_or_else_the_openai_body() -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    assert call_session_key("from-the-ingress", [body], 1024) == "from-the-ingress"
    assert call_session_key("", [body], 1024) == key_from_body(body, 1024)
    assert call_session_key("", [{"messages": [], "user": "alice"}], 1024) == "alice"
    # A later turn of the same conversation hashes to the same key.
    later = {"messages": [*body["messages"], {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]}
    assert call_session_key("", [later], 1024) == call_session_key("", [body], 1024)
    assert call_session_key("", [], 1024) is None
    assert call_session_key("", ["not a body"], 1024) is None
