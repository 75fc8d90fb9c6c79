"""The tier policy on its own: events in, exact actions and tiers out, with a fake clock (no engine)."""

from __future__ import annotations

import pytest

from ember.config import SessionConfig
from ember.engine.tier_policy import COLD, TRANSITIONS, Action, Event, InvalidTransition, Tier, TierPolicy

CONFIG = SessionConfig(hot_ttl_s=300, warm_ttl_s=3600, warm_memory_bytes=1000, warm_disk_bytes=5000, session_dir="/unused", write_behind_s=1)


def policy(**overrides) -> TierPolicy:
    from dataclasses import replace

    config = replace(CONFIG, **overrides)
    return TierPolicy(config, has_disk=config.session_dir is not None, writes_behind=config.session_dir is not None and config.write_behind_s >= 0)


def tier(p: TierPolicy, key: str) -> Tier | None:
    record = p.records.get(key)
    return None if record is None else record.tier


def demote(p: TierPolicy, key: str, nbytes: int) -> None:
    """What the manager does for a "demote" action."""
    p.move(key, Event.DEMOTED)
    p.set_ram(key, nbytes)


def test_the_table_lists_exactly_the_tier_moves():
    assert TRANSITIONS == {
        (COLD, Event.TURN): Tier.HOT, (Tier.HOT, Event.TURN): Tier.HOT, (Tier.WARM, Event.TURN): Tier.HOT, (Tier.DISK, Event.TURN): Tier.HOT,
        (Tier.HOT, Event.DEMOTED): Tier.WARM, (Tier.WARM, Event.SPILLED): Tier.DISK,
        (Tier.HOT, Event.DROPPED): COLD, (Tier.WARM, Event.DROPPED): COLD, (Tier.DISK, Event.DROPPED): COLD,
    }


def test_a_move_the_table_does_not_list_raises():
    p = policy()
    p.turn_finished("a", 0.0)
    with pytest.raises(InvalidTransition):
        p.move("a", Event.SPILLED)  # hot -> disk skips warm
    with pytest.raises(InvalidTransition):
        p.move("nobody", Event.DEMOTED)
    assert tier(p, "a") == Tier.HOT


def test_hot_ttl_then_warm_ttl_event_by_event():
    p = policy(session_dir=None)
    p.turn_finished("a", 100.0)
    assert p.due(399.9) == []
    assert p.due(400.0) == [Action("demote", "a", "ttl")]
    demote(p, "a", 200)
    assert tier(p, "a") == Tier.WARM and p.ram_bytes == 200
    assert p.due(3699.9) == []
    assert p.due(3700.0) == [Action("expire", "a", "expire")]
    p.move("a", Event.DROPPED)
    assert tier(p, "a") is None and p.ram_bytes == 0 and p.records == {}


def test_a_turn_refreshes_the_ttl_and_frees_the_old_ram_copy():
    p = policy(session_dir=None)
    p.turn_finished("a", 0.0)
    demote(p, "a", 300)
    p.turn_finished("a", 250.0)
    assert tier(p, "a") == Tier.HOT and p.ram_bytes == 0
    assert p.due(549.0) == [] and p.due(550.0) == [Action("demote", "a", "ttl")]


def test_write_behind_once_idle_and_only_once_per_turn():
    p = policy()
    p.turn_finished("a", 10.0)
    assert p.due(10.5) == []
    assert p.due(11.0) == [Action("write_behind", "a", "")]
    assert p.records["a"].writing
    assert p.due(12.0) == []  # in flight
    p.write_done("a")
    p.set_file("a", p.records["a"].turn, 400)
    assert p.records["a"].has_current_file and p.disk_bytes == 400
    assert p.due(20.0) == []  # this turn is on disk
    p.turn_finished("a", 30.0)
    assert not p.records["a"].has_current_file and p.disk_bytes == 400  # the older copy stays
    assert p.due(31.0) == [Action("write_behind", "a", "")]


def test_pressure_demotes_the_least_recently_used_hot_session_without_a_write_first():
    p = policy()
    p.turn_finished("old", 0.0)
    p.turn_finished("mid", 1.0)
    p.turn_finished("new", 2.0)
    p.records["old"].writing = True
    assert p.relieve_pressure() == Action("demote", "mid", "pressure")
    demote(p, "mid", 10)
    assert p.relieve_pressure() == Action("demote", "new", "pressure")
    demote(p, "new", 10)
    assert p.relieve_pressure() == Action("demote", "old", "pressure")  # the last resort
    demote(p, "old", 10)
    assert p.relieve_pressure() is None


def test_ram_budget_spills_lru_first_and_counts_bytes_in_flight():
    p = policy()  # RAM budget 1000
    for i, key in enumerate(("a", "b", "c")):
        p.turn_finished(key, float(i))
        demote(p, key, 400)
    assert p.ram_bytes == 1200
    assert p.over_budget() == [Action("spill", "a", "")]  # 1200 - 400 leaving <= 1000
    assert p.over_budget() == []  # a's bytes are already leaving
    p.write_done("a")
    p.set_file("a", p.records["a"].turn, 350)
    p.records["a"].spilling = False
    p.set_ram("a", 0)
    p.move("a", Event.SPILLED)
    assert tier(p, "a") == Tier.DISK and p.ram_bytes == 800 and p.disk_bytes == 350


def test_a_session_with_a_current_copy_only_drops_its_ram():
    p = policy()
    p.turn_finished("a", 0.0)
    p.set_file("a", p.records["a"].turn, 100)
    demote(p, "a", 1500)
    assert p.over_budget() == [Action("drop_ram", "a", "")]


def test_without_a_directory_over_budget_means_cold():
    p = policy(session_dir=None)
    p.turn_finished("a", 0.0)
    demote(p, "a", 1500)
    assert p.over_budget() == [Action("expire", "a", "evict")]


def test_disk_budget_deletes_copies_of_live_sessions_before_warm_state():
    p = policy()  # disk budget 5000
    p.turn_finished("disk1", 0.0)
    p.set_file("disk1", p.records["disk1"].turn, 3000)
    demote(p, "disk1", 10)
    p.set_ram("disk1", 0)
    p.move("disk1", Event.SPILLED)
    p.turn_finished("hot_copy", 1.0)
    p.set_file("hot_copy", p.records["hot_copy"].turn, 2500)
    assert p.disk_bytes == 5500
    assert p.over_budget() == [Action("delete_copy", "hot_copy", "copy_evict")]
    p.set_file("hot_copy", -1, 0)
    p.adopted("other", 2.0, 3000)  # a file another replica left
    assert p.over_budget() == [Action("expire", "disk1", "evict")]
