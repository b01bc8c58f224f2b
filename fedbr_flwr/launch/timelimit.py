"""Time-boxed runs (``--time-limit`` of fedbr-run and fedbr-sweep): the duration, the rule that decides whether
another round still fits before the deadline, and the watch that applies it to a run's progress events.

Under a time limit a run checkpoints after every round. The launcher follows the run's ``checkpoint`` events: at
each one it stops the run (right after that checkpoint) when the next round, estimated from the rounds so far with
a margin, would not end before the deadline. At the deadline itself a run is stopped wherever it is: only the round
in progress is lost, and ``--resume`` continues from the last checkpoint exactly."""

from __future__ import annotations

import re
import threading
import time

from ..core.errors import ConfigError

EXIT_TIME_LIMIT = 75  # EX_TEMPFAIL (sysexits.h): stopped on purpose, to be continued
ROUND_MARGIN = 1.5  # a round may take this many times the mean of the rounds before it
STOP_RESERVE_S = 30.0  # the most kept back before the limit for stopping Flower: its share is STOP_RESERVE_SHARE
STOP_RESERVE_SHARE = 0.1
DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


class TimeLimitReached(Exception):
    """A run stopped at its time limit; ``saved_round``: the round of its last checkpoint (None: no checkpoint);
    ``where`` and ``num_rounds``: the run (a sweep's label and folder) and its rounds, where the caller knows."""

    def __init__(self, saved_round: int | None, where: str = "", num_rounds: int = 0):
        super().__init__(f"time limit reached (last checkpoint: round {saved_round})")
        self.saved_round, self.where, self.num_rounds = saved_round, where, num_rounds


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``15m``, ``1h30m``, ``2h`` (a plain number is seconds); ConfigError otherwise."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    else:
        match = DURATION.fullmatch(text)
        if not text or match is None:
            raise ConfigError(f"--time-limit {text!r} is not a duration: write it like 90s, 15m, 1h30m or 2h")
        h, m, s = (float(part or 0) for part in match.groups())
        seconds = 3600 * h + 60 * m + s
    if seconds <= 0:
        raise ConfigError(f"--time-limit {text!r} must be longer than 0 s")
    return seconds


def stop_deadline(start: float, limit_s: float) -> float:
    """When runs must stop so that the command ends by ``start + limit_s``: a small share of the limit (at most
    STOP_RESERVE_S) is kept back for stopping Flower and writing the last lines."""
    return start + limit_s - min(STOP_RESERVE_S, STOP_RESERVE_SHARE * limit_s)


def next_round_fits(now: float, deadline: float, round_seconds: list[float], margin: float = ROUND_MARGIN) -> bool:
    """Whether one more round, estimated as the mean of ``round_seconds`` times ``margin``, ends by ``deadline``;
    with no round measured yet, whether any time is left."""
    if not round_seconds:
        return now < deadline
    return now + margin * sum(round_seconds) / len(round_seconds) <= deadline


class RoundWatch:
    """Follows a run's progress events (``on_event``, a ``progress.Follower`` callback) and sets ``stop`` when
    the run should stop: after a round's checkpoint when the next round would not fit before ``deadline``
    (never after the last round), or at the deadline itself (``at_deadline``). ``saved_round``: the round of
    the run's last checkpoint (``resumed_round`` until this run writes one)."""

    def __init__(self, deadline: float, num_rounds: int, resumed_round: int | None = None):
        self.deadline, self.num_rounds = deadline, num_rounds
        self.saved_round = resumed_round
        self.round_seconds: list[float] = []
        self.last_end: float | None = None  # when the last round ended (or the clients were found)
        self.stop = threading.Event()

    def on_event(self, event: dict) -> None:
        kind, at = event.get("kind"), float(event.get("time", time.time()))
        if kind == "start":  # the clients are found: the first round starts now
            self.last_end = at
        elif kind == "checkpoint" and isinstance(event.get("round"), int):
            self.saved_round = event["round"]
            if self.last_end is not None:
                self.round_seconds.append(max(0.0, at - self.last_end))
            self.last_end = at
            fits = next_round_fits(time.time(), self.deadline, self.round_seconds)
            if self.saved_round < self.num_rounds and not fits:
                self.stop.set()

    def at_deadline(self) -> bool:
        """Set ``stop`` once the deadline has passed; whether the run should stop."""
        if time.time() >= self.deadline:
            self.stop.set()
        return self.stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the run should stop (True), at most ``timeout`` s (None: until the deadline)."""
        left = self.deadline - time.time()
        self.stop.wait(max(0.0, left if timeout is None else min(left, timeout)))
        return self.at_deadline()


def stopped_line(command: str, where: str, saved_round: int | None, num_rounds: int, again: str) -> str:
    """The line a command prints when its time limit stopped it: where it stopped and how to continue."""
    if saved_round is None:
        when = f"before the first round of {where} ended (no checkpoint)"
    else:
        when = f"after round {saved_round} of {num_rounds} in {where} (checkpoint saved)"
    return f"{command}: time limit reached {when}; continue with: {again}"
