"""The simulator's network: what learners and syncers send each other through a store
arrives after ``latency + 8 n / bandwidth`` simulated seconds (``SimulatedNetwork``), and
a learner sees a new version only once it has arrived."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from diloco.config import SimConfig
from diloco.loops import Clock, GlobalView, StoredFragment, Unreadable
from diloco.outer import Contribution
from diloco.records import Record
from diloco.syncer import GlobalVersion
from diloco.transport import Store, StoreLearnerView


def transfer_seconds(nbytes: int, sim: SimConfig) -> float:
    return sim.latency_seconds + 8.0 * nbytes / (sim.bandwidth_gbps * 1e9)


class SimulatedNetwork:
    """The simulator's transport: the store, seen through the virtual clock.

    ``notify(process, time)`` tells the scheduler when something will arrive for a
    process (a contribution for the syncer that owns its fragment, a global version for
    every learner), so a waiting loop is woken then. ``finished(budget_spent)`` is the
    scheduler's word that every learner's loop has ended (once the budget is spent, a
    vacant slot's excepted).
    """

    def __init__(
        self,
        store: Store,
        clock: Clock,
        sim: SimConfig,
        global_bytes: Sequence[int],
        learners: Sequence[str],
        owner: Callable[[int], str],
        notify: Callable[[str, float], None],
        finished: Callable[[bool], bool],
        members: Callable[[], Collection[str]] | None = None,
    ):
        self.store, self.clock, self.sim = store, clock, sim
        self.global_bytes = list(global_bytes)
        self.learners = list(learners)
        self.owner, self.notify, self.finished = owner, notify, finished
        self._members = members or (lambda: self.learners)
        self.arrival: dict[tuple[str, int, int], float] = {}  # (learner, fragment, seq)
        self.last_arrival = 0.0
        # fragment -> [(time available to learners, version)]; version 0 always is.
        self.available: dict[int, list[tuple[float, int]]] = {
            p: [(float("-inf"), 0)] for p in range(len(global_bytes))
        }

    def learner_view(self, learner: str) -> _DelayedLearnerView:
        return _DelayedLearnerView(self, learner)

    # syncer side ----------------------------------------------------------------------
    def contributions(
        self, learner: str, fragment: int, after: int
    ) -> list[Contribution | Unreadable]:
        now, out = self.clock.now(), []
        for c in self.store.contributions(learner, fragment, after):
            if self.arrival.get((learner, fragment, c.seq), now) > now:
                break  # in flight; later seqs of one learner and fragment arrive later
            out.append(c)
        return out

    def read(self, c: Contribution) -> Contribution | Unreadable:
        return self.store.read(c)

    def publish(self, gv: GlobalVersion, opt_leaves: list[Any], record: Record) -> bool:
        if not self.store.publish(gv, opt_leaves, record):
            return False
        for key in [
            k for k in self.arrival if k[1] == gv.fragment and k[2] <= gv.cursor.get(k[0], 0)
        ]:
            del self.arrival[key]  # settled: nobody asks again
        at = self.clock.now() + self.delivery_seconds(gv.fragment)
        self.available[gv.fragment].append((at, gv.version))
        for learner in self.learners:
            self.notify(learner, at)
        return True

    def load_fragment(self, fragment: int, window: int) -> StoredFragment:
        return self.store.load_fragment(fragment, window)

    def delivery_seconds(self, fragment: int) -> float:
        return transfer_seconds(self.global_bytes[fragment], self.sim)

    def learners_finished(self, budget_spent: bool = False) -> bool:
        """Every learner is done and its every send has arrived. Done with sends still in
        flight: every syncer is woken when the last lands (news goes only to a fragment's
        owner, and the last send may be another's)."""
        if not self.finished(budget_spent):
            return False
        if self.last_arrival > self.clock.now():
            for syncer in sorted({self.owner(p) for p in range(len(self.global_bytes))}):
                self.notify(syncer, self.last_arrival)
            return False
        return True

    def members(self) -> Collection[str]:
        """The scheduler's learners that are not down (``members``; all by default)."""
        return self._members()

    def tend(self) -> None:
        pass

    # learner side ---------------------------------------------------------------------
    def send(self, c: Contribution) -> None:
        self.store.put_contribution(c)
        at = self.clock.now() + transfer_seconds(c.nbytes, self.sim)
        self.arrival[(c.learner, c.fragment, c.seq)] = at
        self.last_arrival = max(self.last_arrival, at)
        self.notify(self.owner(c.fragment), at)

    def newest_available(self, fragment: int) -> int:
        """Versions become available in publishing order: drop those a newer one hides."""
        held, now = self.available[fragment], self.clock.now()
        while len(held) > 1 and held[1][0] <= now:
            held.pop(0)
        return held[0][1]


class _DelayedLearnerView(StoreLearnerView):
    def __init__(self, network: SimulatedNetwork, learner: str):
        super().__init__(network.store, learner)
        self.network = network

    def send(self, c: Contribution) -> None:
        self.network.send(c)

    def latest_global(self, fragment: int) -> GlobalView | None:
        return self.read(fragment, self.network.newest_available(fragment))
