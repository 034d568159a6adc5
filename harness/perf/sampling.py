"""How an A/B samples: its warm-up, pairs, launches, replicas, time and confidence, checked together, and how many
pairs each launch runs (about as long as the launch cost: dear launches do not starve cheap pairs)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.perf.stats import MAX_PAIRS, min_pairs

MAX_BLOCK_PAIRS = 32  # a block's pairs at most (a launch lasts about its cost, up to this many pairs a replica)
MAX_REPLICAS = 8  # instances of each side alive per launch at most


@dataclass(frozen=True)
class Sampling:
    """How many runs an A/B makes: warm-up per side, the pairs before the first verdict, the caps in pairs and in
    seconds, the confidence, the launches, the instances of each side alive per launch (replicas, each pair of them a
    launch block of its own), and whether each launch starts while the one before runs its pairs
    (:mod:`harness.perf.launches`)."""

    warmup: int = 1
    min_pairs: int = 10
    max_pairs: int = MAX_PAIRS
    max_time_s: float = 300.0  # per case: no block (or pair) is started that would end later
    confidence: float = 0.95
    launches: int = 3  # each side started afresh this many times at least (1: one process or server per side)
    dear_launch_s: float = 1.0  # a launch this long or longer sizes the next blocks by its cost (next_block_pairs)
    overlap: bool = False  # start each launch's sides while the launch before runs its pairs
    replicas: int = 1  # instances of each side alive per launch, pairs rotating over them one at a time

    @property
    def quartets(self) -> int:
        """Pairs of one ABBA quartet on every replica: a launch's pairs come in multiples of it."""
        return 2 * self.replicas

    @property
    def least_launches(self) -> int:
        """Launches before the first verdict: each side started afresh ``launches`` times, ``replicas`` at each."""
        return -(-self.launches // self.replicas)

    @property
    def block_pairs(self) -> int:
        """Pairs of a launch at least: ``min_pairs`` spread over :attr:`least_launches`, rounded up to whole ABBA
        quartets on every replica; with one launch, every pair."""
        if self.launches == 1:
            return self.max_pairs
        return max(self.quartets, _round_up(-(-self.min_pairs // self.least_launches), self.quartets))

    def next_block_pairs(self, launch_s: float, pair_s: float, pairs_done: int, launches_done: int) -> int:
        """Pairs of the next launch, from what the last one cost: about as long timing pairs as starting its sides
        took (``launch_s``, warm-up included), so that cheap pairs are not starved by dear launches (a launch under
        ``dear_launch_s`` starves nothing); at most MAX_BLOCK_PAIRS a replica (the blocks still see the
        launch-to-launch spread) and what leaves room under ``max_pairs`` for the ``launches`` still owed; at least
        :attr:`block_pairs`; whole quartets on every replica."""
        if self.launches == 1 or pair_s <= 0 or launch_s < self.dear_launch_s:
            return self.block_pairs
        balanced = int(min(MAX_BLOCK_PAIRS * self.replicas, -(-launch_s // pair_s)))
        pairs = max(self.block_pairs, _round_up(balanced, self.quartets))
        owed = self.least_launches - launches_done
        if owed > 0:
            room = (self.max_pairs - pairs_done) // owed
            pairs = min(pairs, max(self.quartets, room - room % self.quartets))
        return pairs

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1.0:
            raise SamplingError("confidence", f"must be in [0.5, 1), got {self.confidence}")
        fewest = min_pairs(self.confidence)
        if self.warmup < 0:
            raise SamplingError("warmup", f"must be >= 0, got {self.warmup}")
        if not fewest <= self.min_pairs <= self.max_pairs:
            raise SamplingError(
                "min_pairs",
                f"must be between {fewest} (at confidence {self.confidence:g}) and max_pairs ({self.max_pairs}), "
                f"got {self.min_pairs}",
            )
        if not 1 <= self.launches <= self.max_pairs // 2:
            raise SamplingError(
                "launches", f"must be between 1 and max_pairs / 2 ({self.max_pairs // 2}), got {self.launches}"
            )
        if not self.max_time_s > 0:
            raise SamplingError("max_time", f"must be > 0 seconds, got {self.max_time_s}")
        if self.max_pairs > MAX_PAIRS:
            raise SamplingError("max_pairs", f"must be at most {MAX_PAIRS}, got {self.max_pairs}")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise SamplingError("replicas", f"must be between 1 and {MAX_REPLICAS}, got {self.replicas}")
        if self.launches > 1 and self.least_launches * self.quartets > self.max_pairs:
            raise SamplingError(
                "replicas",
                f"{self.replicas} x {self.least_launches} launches need {self.least_launches * self.quartets} pairs at "
                f"least (a quartet on each replica), more than max_pairs ({self.max_pairs})",
            )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class SamplingError(ValueError):
    """A sampling setting out of range; ``field`` names it (the CLI names its option)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
