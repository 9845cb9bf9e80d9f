"""The query of death: a request that crashes whichever group runs it must not crash the groups
one after another: a fault costs at most one group, never the service.

The rule (`QueryOfDeath`, one per frontend):

- When a group fails (fenced: any failure, a watchdog verdict or a rank's fatal error), every
  request in flight on it becomes a *suspect*.
- A suspect is retried as a continuation, on a READY group that holds no other suspect *on
  probation* (it waits for one, at most `--migration-wait-s`; a group that failed and restarted
  holds none). It is on probation from its placement until its first token there: the
  continuation resumes exactly where the failure struck (its prompt and every token produced so
  far), so a request that crashes groups deterministically crashes the next one before that
  token. Once the token came, the group may take the next suspect; so suspects move one per
  group per first token, not one per group per whole generation, and a failed group's long
  generations all continue well within `--migration-wait-s`. Suspects take no retry budget:
  at most one per group is on probation at a time, and one past it runs as any request there.
- A suspect on probation when its group fails too is *quarantined*: answered 422
  `request_quarantined`, never retried, and its fingerprint (the original prompt's token ids and
  every sampling parameter, the fault field included) is refused at admission for
  `--quarantine-s`, so a client's retry loop cannot crash group after group. A suspect past its
  probation whose group fails is a suspect of that failure (on probation again where it goes
  next): the failure did not come with its own start there.
- A suspect that ends any other way (it completed, its client went away, it failed cleanly) is
  cleared.

With `--quarantine-s 0` the rule is off: requests migrate as before, up to
`--max-request-attempts`, and nothing is quarantined. The table of fingerprints is an LRU of at
most `MAX_FINGERPRINTS`; entries expire after `--quarantine-s`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_FINGERPRINTS = 10_000
RECENT = 50  # quarantines kept for the admin API after they expire or are lifted


def fingerprint(prompt_ids: list[int], params: Any) -> str:
    """What identifies "the same request": its prompt's token ids and its sampling parameters
    (a dataclass), hashed; 16 hex digits."""
    blob = json.dumps(
        [list(prompt_ids), dataclasses.asdict(params)], sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Suspect:
    rid: str
    fingerprint: str
    failed_group: int  # the group that failed with it in flight
    since: float = field(default_factory=time.time)  # wall time
    group: int | None = None  # the group it runs on now; None while it waits for one
    probation: bool = False  # placed on `group`, no token from there yet


@dataclass
class Quarantine:
    fingerprint: str
    rid: str
    groups: tuple[int, int]  # the two groups that failed with it in flight
    at: float  # wall time
    until: float  # monotonic clock
    refused: int = 0  # identical requests refused at admission since

    def view(self, now: float) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "rid": self.rid,
            "groups": list(self.groups),
            "at": self.at,
            "expires_in_s": round(max(0.0, self.until - now), 1),
            "refused": self.refused,
        }


class QueryOfDeath:
    def __init__(
        self,
        quarantine_s: float,
        max_fingerprints: int = MAX_FINGERPRINTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quarantine_s = quarantine_s
        self.max_fingerprints = max_fingerprints
        self.clock = clock
        self.suspects: dict[str, Suspect] = {}
        self._table: OrderedDict[str, Quarantine] = OrderedDict()
        self.recent: deque[Quarantine] = deque(maxlen=RECENT)

    @property
    def enabled(self) -> bool:
        return self.quarantine_s > 0

    # -- failures ---------------------------------------------------------------------------
    def group_failed(self, rid: str, fp: str, group: int) -> Quarantine | None:
        """`rid` was in flight on `group` when it failed. None: it is a suspect now (retry it
        on a group `suspect_groups` does not name); else its quarantine (it was on probation
        there)."""
        prior = self.suspects.pop(rid, None)
        if prior is None or not prior.probation:
            self.suspects[rid] = Suspect(rid, fp, group)
            return None
        groups = (prior.failed_group, group)
        q = Quarantine(fp, rid, groups, time.time(), self.clock() + self.quarantine_s)
        self._table.pop(fp, None)
        self._table[fp] = q
        while len(self._table) > self.max_fingerprints:
            self._table.popitem(last=False)
        self.recent.append(q)
        return q

    def place(self, rid: str, group: int) -> None:
        """The suspect now runs on `group`, on probation there (the group takes no other
        suspect until its first token)."""
        s = self.suspects[rid]
        s.group, s.probation = group, True

    def first_token(self, rid: str) -> bool:
        """A token came for `rid` from its group: a suspect's probation there ends. True if one
        did (its group can take another suspect)."""
        s = self.suspects.get(rid)
        if s is None or not s.probation:
            return False
        s.probation = False
        return True

    def suspect_groups(self) -> set[int]:
        """The groups holding a suspect on probation: a suspect is placed elsewhere."""
        return {s.group for s in self.suspects.values() if s.group is not None and s.probation}

    def clear(self, rid: str) -> bool:
        """The request ended without crashing a second group; True if it was a suspect."""
        return self.suspects.pop(rid, None) is not None

    # -- admission --------------------------------------------------------------------------
    def refusal(self, fp: str) -> Quarantine | None:
        """The live quarantine of this fingerprint (counted as one more refusal), or None."""
        q = self._table.get(fp)
        if q is None:
            return None
        if self.clock() >= q.until:
            del self._table[fp]
            return None
        q.refused += 1
        self._table.move_to_end(fp)
        return q

    def remaining_s(self, q: Quarantine) -> float:
        return max(0.0, q.until - self.clock())

    def held(self) -> list[Quarantine]:
        """Live quarantines, oldest first (expired ones are dropped here)."""
        now = self.clock()
        for fp in [fp for fp, q in self._table.items() if now >= q.until]:
            del self._table[fp]
        return list(self._table.values())

    def lift(self, fp: str | None = None, dry_run: bool = False) -> list[Quarantine]:
        """Ends the quarantine of `fp` (every one when None); returns those it ended."""
        held = self.held()
        out = [q for q in held if fp is None or q.fingerprint == fp]
        if not dry_run:
            for q in out:
                del self._table[q.fingerprint]
        return out

    def view(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "quarantine_s": self.quarantine_s,
            "max_fingerprints": self.max_fingerprints,
            "suspects": [dataclasses.asdict(s) for s in self.suspects.values()],
            "quarantined": [q.view(now) for q in self.held()],
            "recent": [q.view(now) for q in self.recent],
        }
