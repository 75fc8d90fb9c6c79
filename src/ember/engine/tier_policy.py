"""Session tiers as a pure, clock-driven state machine: which conversation moves where, and when.

No I/O, no tensors: the policy keeps one ``TierRecord`` per conversation and
the byte totals, takes facts (a turn ended, a demotion or a write is done) and
returns ``Action``s for ``sessions.py`` to carry out. Every tier change goes
through ``TRANSITIONS``; a change the table does not list raises.

    turn ends ───────────────────▶ HOT   blocks stay in the pool, protected from LRU eviction
    HOT  ── hot_ttl, or pressure ─▶ WARM  KV packed in host RAM
    WARM ── RAM over budget ──────▶ DISK  spilled to session_dir (or dropped without one)
    WARM, DISK ── warm_ttl, disk budget, delete, bad file ──▶ COLD (forgotten)

A restore (copying warm KV back into the pool for a new turn) does not change
the tier: the turn that follows does (TURN), and ``touch`` keeps the
conversation from expiring meanwhile.

Beside the tier, a conversation can have a *copy* on disk: written behind
while it is hot (``WriteBehind``, once it has been idle ``write_behind_s``),
or by a spill. ``file_turn`` is the turn that copy holds; a spill of a
conversation whose copy is current only drops its RAM (``DropRam``).

Invariants: ``ram_bytes`` and ``disk_bytes`` are the sums over the records;
at most one write per conversation is in flight (``writing``); a record whose
bytes are being spilled (``spilling``) is not spilled twice and its bytes
stay counted in RAM until the write is done.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

from ember.config import SessionConfig


class Tier(str, enum.Enum):
    HOT = "hot"
    WARM = "warm"  # host RAM
    DISK = "disk"  # warm, on disk only


class Event(str, enum.Enum):
    TURN = "turn"  # a turn ended: the conversation's KV is the request's blocks
    DEMOTED = "demoted"  # hot_ttl or pool pressure: packed into RAM
    SPILLED = "spilled"  # its RAM copy is gone, the file holds it
    DROPPED = "dropped"  # warm_ttl, a budget, a delete or a bad file


COLD = None  # not in the table
TRANSITIONS: dict[tuple[Tier | None, Event], Tier | None] = {
    (COLD, Event.TURN): Tier.HOT,
    (Tier.HOT, Event.TURN): Tier.HOT,
    (Tier.WARM, Event.TURN): Tier.HOT,
    (Tier.DISK, Event.TURN): Tier.HOT,
    (Tier.HOT, Event.DEMOTED): Tier.WARM,
    (Tier.WARM, Event.SPILLED): Tier.DISK,
    (Tier.HOT, Event.DROPPED): COLD,
    (Tier.WARM, Event.DROPPED): COLD,
    (Tier.DISK, Event.DROPPED): COLD,
}


class InvalidTransition(RuntimeError):
    """A fact that the transition table does not allow (a bug in the caller)."""


@dataclass
class TierRecord:
    """What the policy knows of one conversation."""

    key: str
    tier: Tier
    last_used: float
    turn: int
    ram_bytes: int = 0
    disk_bytes: int = 0
    file_turn: int = -1  # the turn our file on disk holds; -1: none
    writing: bool = False  # a write (behind or spill) is in flight
    write_submitted: bool = False  # this turn was handed to a write already (written or not)
    spilling: bool = False  # its RAM bytes leave when the write in flight is done

    @property
    def has_current_file(self) -> bool:
        return self.file_turn == self.turn and self.file_turn >= 0


@dataclass(frozen=True)
class Action:
    """Something for the session manager to carry out; ``kind`` names it."""

    kind: str  # demote | write_behind | spill | drop_ram | expire | delete_copy
    key: str
    reason: str = ""


class TierPolicy:
    """The session table's decisions; see the module docstring."""

    def __init__(self, config: SessionConfig, *, has_disk: bool, writes_behind: bool) -> None:
        self.config = config
        self.has_disk = has_disk
        self.writes_behind = writes_behind
        self.records: OrderedDict[str, TierRecord] = OrderedDict()  # least recently used first
        self.ram_bytes = 0
        self.disk_bytes = 0
        self._next_check = 0.0
        self._turns = 0

    # -- facts ----------------------------------------------------------------------

    def move(self, key: str, event: Event) -> TierRecord | None:
        """Apply ``event`` to ``key``'s tier through ``TRANSITIONS``; returns the record (None once cold)."""
        record = self.records.get(key)
        before = record.tier if record is not None else COLD
        if (before, event) not in TRANSITIONS:
            raise InvalidTransition(f"session {key!r}: {event.value} is not allowed from {before}")
        after = TRANSITIONS[(before, event)]
        if after is COLD:
            self._forget(key)
            return None
        assert record is not None
        record.tier = after
        return record

    def turn_finished(self, key: str, now: float) -> TierRecord:
        """A new turn: the conversation is hot again with a new turn number; its old RAM copy is gone,
        its file (an older turn, still a valid prefix) stays until a newer one is written."""
        self._turns += 1
        old = self.records.pop(key, None)
        if old is not None:
            self.ram_bytes -= old.ram_bytes
        before = old.tier if old is not None else COLD
        if (before, Event.TURN) not in TRANSITIONS:
            raise InvalidTransition(f"session {key!r}: turn from {before}")
        record = TierRecord(key, Tier.HOT, now, self._turns)
        if old is not None:
            record.file_turn, record.disk_bytes, record.writing = old.file_turn, old.disk_bytes, old.writing
        self.records[key] = record
        due = self.config.hot_ttl_s if not self.writes_behind else min(self.config.hot_ttl_s, self.config.write_behind_s)
        self._next_check = min(self._next_check, now + due)
        return record

    def adopted(self, key: str, last_used: float, disk_bytes: int) -> TierRecord:
        """A file found in session_dir (at start-up, or written by another replica): DISK."""
        self._turns += 1
        record = TierRecord(key, Tier.DISK, last_used, self._turns, disk_bytes=disk_bytes, file_turn=self._turns)
        self.records[key] = record
        self.disk_bytes += disk_bytes
        return record

    def set_ram(self, key: str, nbytes: int) -> None:
        record = self.records[key]
        self.ram_bytes += nbytes - record.ram_bytes
        record.ram_bytes = nbytes

    def set_file(self, key: str, turn: int, disk_bytes: int) -> None:
        """Our file of ``key`` now holds ``turn`` (-1 with 0 bytes: we have no file any more)."""
        record = self.records.get(key)
        if record is None:
            return
        self.disk_bytes += disk_bytes - record.disk_bytes
        record.disk_bytes, record.file_turn = disk_bytes, turn

    def write_done(self, key: str) -> None:
        record = self.records.get(key)
        if record is not None:
            record.writing = False

    def touch(self, key: str, now: float) -> None:
        """Used again (a restore): most recently used, TTL restarted."""
        record = self.records.get(key)
        if record is not None:
            record.last_used = now
            self.records.move_to_end(key)

    # -- decisions ------------------------------------------------------------------

    def due(self, now: float) -> list[Action]:
        """The TTLs and write-behinds that are due at ``now`` (cheap when nothing is)."""
        if now < self._next_check:
            return []
        actions: list[Action] = []
        next_event = float("inf")
        for record in self.records.values():
            if record.tier == Tier.HOT:
                due = record.last_used + self.config.hot_ttl_s
                if now >= due:
                    actions.append(Action("demote", record.key, "ttl"))
                    due = record.last_used + self.config.warm_ttl_s
                elif self._wants_write_behind(record):
                    write_at = record.last_used + self.config.write_behind_s
                    if now < write_at:
                        due = min(due, write_at)
                    elif self.disk_bytes < self.config.warm_disk_bytes:  # else it would be evicted at once
                        record.write_submitted = record.writing = True
                        actions.append(Action("write_behind", record.key))
            else:
                due = record.last_used + self.config.warm_ttl_s
                if now >= due:
                    actions.append(Action("expire", record.key, "expire"))
                    continue
            next_event = min(next_event, due)
        self._next_check = next_event
        return actions

    def _wants_write_behind(self, record: TierRecord) -> bool:
        return self.writes_behind and not record.write_submitted and not record.writing and record.file_turn != record.turn

    def relieve_pressure(self) -> Action | None:
        """The hot conversation to demote when the pool is full: the least recently used,
        one without a write in flight first (a write's references keep its blocks a little longer)."""
        hot = [r for r in self.records.values() if r.tier == Tier.HOT]
        for record in sorted(hot, key=lambda r: r.writing):  # stable: LRU order within each group
            return Action("demote", record.key, "pressure")
        return None

    def over_budget(self) -> list[Action]:
        """Spills while RAM is over budget, then deletions while disk is (copies before warm state)."""
        actions: list[Action] = []
        leaving = sum(r.ram_bytes for r in self.records.values() if r.spilling)
        for record in list(self.records.values()):
            if self.ram_bytes - leaving <= self.config.warm_memory_bytes:
                break
            if record.tier != Tier.WARM or record.spilling or record.ram_bytes == 0:
                continue
            if not self.has_disk:
                actions.append(Action("expire", record.key, "evict"))
            elif record.has_current_file:
                actions.append(Action("drop_ram", record.key))
            elif not record.writing:
                record.spilling = record.writing = True
                actions.append(Action("spill", record.key))
            else:
                continue
            leaving += record.ram_bytes
        excess = self.disk_bytes - self.config.warm_disk_bytes
        if excess > 0:
            # Copies of hot and RAM-warm conversations first: they are only insurance against a crash.
            for record in [r for r in self.records.values() if r.tier != Tier.DISK and r.disk_bytes and not r.writing]:
                if excess <= 0:
                    break
                actions.append(Action("delete_copy", record.key, "copy_evict"))
                excess -= record.disk_bytes
            for record in [r for r in self.records.values() if r.tier == Tier.DISK]:
                if excess <= 0:
                    break
                actions.append(Action("expire", record.key, "evict"))
                excess -= record.disk_bytes
        return actions

    def spill_all(self) -> list[Action]:
        """Everything warm in RAM to disk (shutdown): drop what has a current file, spill the rest."""
        actions = []
        for record in self.records.values():
            if record.tier != Tier.WARM or record.spilling:
                continue
            if record.has_current_file:
                actions.append(Action("drop_ram", record.key))
            else:
                record.spilling = record.writing = True
                actions.append(Action("spill", record.key))
        return actions

    # -- queries --------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        out = {tier.value: 0 for tier in Tier}
        for record in self.records.values():
            out[record.tier.value] += 1
        return out

    def _forget(self, key: str) -> None:
        record = self.records.pop(key)
        self.ram_bytes -= record.ram_bytes
        self.disk_bytes -= record.disk_bytes
