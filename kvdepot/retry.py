"""How a call that found no service is tried again: backoff and retry policies.

Given to the clients that retry (the engine's metadata client, the store's
lease), never written out at a call site, so one place says how hard kvdepot
tries before it reports a dependency unavailable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.errors import InvalidArgument

# Doublings beyond this change nothing but risk an overflow.
_MAX_DOUBLINGS = 32


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: ``base_s * factor**n`` after ``n`` failed rounds, capped.

    Attributes:
        base_s: The delay after the first failed round.
        cap_s: The longest delay.
        factor: Growth per failed round (1: a constant delay).
    """

    base_s: float = 0.05
    cap_s: float = 2.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.base_s <= self.cap_s:
            raise InvalidArgument(
                f"backoff needs 0 <= base ({self.base_s}) <= cap ({self.cap_s}) seconds"
            )
        if self.factor < 1:
            raise InvalidArgument(f"backoff factor must be at least 1, not {self.factor}")

    def delay(self, rounds: int) -> float:
        """Seconds to wait after ``rounds`` failed rounds in a row (0 for none)."""
        if rounds <= 0:
            return 0.0
        return float(min(self.cap_s, self.base_s * self.factor ** min(rounds - 1, _MAX_DOUBLINGS)))


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a call tries every replica before it raises ``Unavailable``.

    Attributes:
        rounds: Rounds per call; a round tries each replica once, starting
            with the one in use. 1: no waiting, the caller (an engine that
            must not stall) sees the outage at once.
        backoff: The wait between rounds.
    """

    rounds: int = 1
    backoff: Backoff = field(default_factory=Backoff)

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise InvalidArgument(f"retry rounds must be a positive integer, not {self.rounds!r}")


__all__ = ["Backoff", "RetryPolicy"]
