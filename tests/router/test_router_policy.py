"""Routing policies as pure functions of replica snapshots: no servers, no clocks."""

from __future__ import annotations

import collections

import pytest

from ember.router.policy import (
    ReplicaSnapshot,
    choose,
    least_load_decision,
    load_capacity,
    rendezvous_order,
    round_robin_decision,
    session_decision,
)

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
KEYS = [f"session-{i}" for i in range(4000)]


def snaps(urls: list[str], loads: dict[str, int] | None = None, down: set[str] = frozenset()) -> list[ReplicaSnapshot]:
    loads = loads or {}
    return [ReplicaSnapshot(url, available=url not in down, in_flight=loads.get(url, 0)) for url in urls]


def home_of(key: str, urls: list[str]) -> str:
    return session_decision(key, snaps(urls), epsilon=0.25).candidates[0]


@pytest.mark.timeout(10)
def test_assignment_is_stable_and_independent_of_listing_order() -> None:
    for key in KEYS[:200]:
        first = session_decision(key, snaps(URLS), 0.25)
        again = session_decision(key, snaps(list(reversed(URLS))), 0.25)
        assert first.candidates == again.candidates
        assert first.home == first.candidates[0] == rendezvous_order(key, URLS)[0]
        assert first.affinity_hit is True


@pytest.mark.timeout(10)
def test_keys_spread_evenly_over_replicas() -> None:
    counts = collections.Counter(home_of(key, URLS) for key in KEYS)
    expected = len(KEYS) / len(URLS)
    assert set(counts) == set(URLS)
    # Binomial spread at n=4000, p=0.2: sigma ~ 25; 15% is more than 6 sigma.
    assert all(abs(count - expected) < 0.15 * expected for count in counts.values()), counts


@pytest.mark.timeout(10)
def test_joining_replica_takes_only_its_share_and_nothing_else_moves() -> None:
    before = {key: home_of(key, URLS[:4]) for key in KEYS}
    after = {key: home_of(key, URLS) for key in KEYS}
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == URLS[4] for key in moved), "a key moved between two old replicas"
    assert 0.15 < len(moved) / len(KEYS) < 0.25  # about 1/5


@pytest.mark.timeout(10)
def test_leaving_replica_gives_away_only_its_own_keys() -> None:
    leaving = URLS[2]
    remaining = [u for u in URLS if u != leaving]
    before = {key: home_of(key, URLS) for key in KEYS}
    after = {key: home_of(key, remaining) for key in KEYS}
    for key in KEYS:
        if before[key] != leaving:
            assert after[key] == before[key]
        else:
            # It goes to its second choice, so it comes back when the replica does.
            assert after[key] == rendezvous_order(key, URLS)[1]


@pytest.mark.timeout(10)
def test_unavailable_home_moves_the_key_to_its_next_choice_and_back() -> None:
    key = "conversation-42"
    ranked = rendezvous_order(key, URLS)
    while_down = session_decision(key, snaps(URLS, down={ranked[0]}), 0.25)
    assert ranked[0] not in while_down.candidates
    assert while_down.candidates[0] == ranked[1]
    assert while_down.home == ranked[0] and while_down.affinity_hit is False
    assert session_decision(key, snaps(URLS), 0.25).candidates[0] == ranked[0]


@pytest.mark.timeout(10)
def test_bounded_load_spills_to_next_replica_on_the_ring() -> None:
    key = "busy-session"
    ranked = rendezvous_order(key, URLS)
    # Mean load with the new request: (10 + 1) / 5 = 2.2; capacity ceil(1.25 * 2.2) = 3.
    loads = {ranked[0]: 3, ranked[1]: 3, ranked[2]: 4}
    assert load_capacity([loads.get(u, 0) for u in URLS], 0.25) == 3
    decision = session_decision(key, snaps(URLS, loads), 0.25)
    assert decision.candidates[0] == ranked[3]  # the first under capacity, in ring order
    # The overloaded ones stay at the end, in ring order, for failover.
    assert decision.candidates == (ranked[3], ranked[4], ranked[0], ranked[1], ranked[2])
    assert decision.affinity_hit is False
    # Within the bound the home keeps the key, though another replica is idle.
    light = session_decision(key, snaps(URLS, {ranked[0]: 2, ranked[1]: 3, ranked[2]: 3, ranked[3]: 2}), 0.25)
    assert light.candidates[0] == ranked[0]


@pytest.mark.timeout(10)
def test_bounded_load_keeps_every_replica_within_the_bound_under_hot_keys() -> None:
    # Every request carries the same key: pure hashing would pile all on one replica.
    loads = dict.fromkeys(URLS, 0)
    for _ in range(100):
        chosen = session_decision("hot-key", snaps(URLS, loads), 0.25).candidates[0]
        capacity = load_capacity(list(loads.values()), 0.25)
        loads[chosen] += 1
        assert loads[chosen] <= capacity
    assert max(loads.values()) <= 1.25 * (100 / len(URLS)) + 1


@pytest.mark.timeout(10)
def test_epsilon_zero_means_strict_balance() -> None:
    loads = dict.fromkeys(URLS, 0)
    for i in range(50):
        chosen = session_decision(f"k{i % 3}", snaps(URLS, loads), 0.0).candidates[0]
        loads[chosen] += 1
    assert max(loads.values()) - min(loads.values()) <= 1


@pytest.mark.timeout(10)
def test_power_of_two_choices_takes_the_lighter_of_its_pair() -> None:
    loads = {URLS[0]: 9, URLS[1]: 0, URLS[2]: 5, URLS[3]: 1, URLS[4]: 7}
    chosen = collections.Counter()
    for tick in range(2000):
        decision = least_load_decision(snaps(URLS, loads), tick)
        assert sorted(decision.candidates) == sorted(URLS)
        assert decision.candidates == least_load_decision(snaps(URLS, loads), tick).candidates  # deterministic
        chosen[decision.candidates[0]] += 1
        # After the choice, the failover order is by load.
        rest = [loads[u] for u in decision.candidates[1:]]
        assert rest == sorted(rest)
    assert chosen[URLS[0]] == 0  # the busiest never wins a pair
    assert chosen[URLS[1]] > chosen[URLS[3]] > chosen[URLS[2]] > chosen[URLS[4]] > 0


@pytest.mark.timeout(10)
def test_least_load_skips_unavailable_replicas() -> None:
    for tick in range(200):
        decision = least_load_decision(snaps(URLS[:3], down={URLS[1]}), tick)
        assert URLS[1] not in decision.candidates and len(decision.candidates) == 2
    assert least_load_decision(snaps(URLS[:2], down={URLS[0]}), 7).candidates == (URLS[1],)
    assert least_load_decision(snaps(URLS[:2], down=set(URLS)), 7).candidates == ()


@pytest.mark.timeout(10)
def test_round_robin_rotates_over_available_replicas() -> None:
    firsts = [round_robin_decision(snaps(URLS[:3], down={URLS[1]}), tick).candidates[0] for tick in range(6)]
    assert firsts == [URLS[0], URLS[2]] * 3
    assert round_robin_decision(snaps(URLS[:3]), 1).candidates == (URLS[1], URLS[2], URLS[0])


@pytest.mark.timeout(10)
def test_choose_dispatches_by_policy_and_handles_missing_keys() -> None:
    replicas = snaps(URLS)
    session = choose("session", replicas, session_key="abc", load_epsilon=0.25, tick=0)
    assert session == session_decision("abc", replicas, 0.25)
    keyless = choose("session", replicas, session_key=None, load_epsilon=0.25, tick=3)
    assert keyless == least_load_decision(replicas, 3) and keyless.affinity_hit is None
    assert choose("round-robin", replicas, session_key="abc", load_epsilon=0.25, tick=2).candidates[0] == URLS[2]
    assert choose("least-load", [], session_key=None, load_epsilon=0.25, tick=0).candidates == ()
    assert choose("session", snaps(URLS, down=set(URLS)), session_key="x", load_epsilon=0.25, tick=0).candidates == ()
    with pytest.raises(ValueError):
        choose("random", replicas, session_key=None, load_epsilon=0.25, tick=0)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_load_floor_keeps_sessions_home_at_light_load() -> None:
    urls = URLS[:3]
    key = "light-session"
    ranked = rendezvous_order(key, urls)
    # One request in flight on the home: the bound alone is ceil(1.25 * 2 / 3) = 1,
    # so without a floor the second turn leaves its cache behind.
    loads = {ranked[0]: 1}
    assert session_decision(key, snaps(urls, loads), 0.25).candidates[0] == ranked[1]
    assert session_decision(key, snaps(urls, loads), 0.25, floor=4).candidates[0] == ranked[0]
    assert choose("session", snaps(urls, loads), session_key=key, load_epsilon=0.25, tick=0, load_floor=4).affinity_hit
    # At the floor, the bound applies again: 4 + 1 > max(ceil(1.25 * 5 / 3), 4).
    assert session_decision(key, snaps(urls, {ranked[0]: 4}), 0.25, floor=4).candidates[0] == ranked[1]
    # Above the floor the floor changes nothing: ceil(1.25 * 28 / 3) = 12.
    assert load_capacity([9, 9, 9], 0.25, floor=4) == load_capacity([9, 9, 9], 0.25) == 12
