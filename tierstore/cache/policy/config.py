"""The cache policy's tuning knobs (`PolicyConfig`), validated when built."""
from __future__ import annotations

from dataclasses import dataclass

from tierstore.errors import InvalidArgument

__all__ = ["PolicyConfig", "KINDS", "MAX_EXPECT_STEPS", "MAX_HITS"]

KINDS = ("s3fifo", "lru", "random")  # tierstore/cache/policy/__init__.py registers one class per kind
MAX_EXPECT_STEPS = 1 << 15  # hint ends are kept mod 2^16 (policy/queues.py): twice the longest hint
MAX_HITS = 31  # a slot's CLOCK hits live in the top five bits of its queue byte (policy/queues.py)


@dataclass(slots=True)
class PolicyConfig:
    """Tuning knobs; the defaults won on the traces of `tierstore bench cache`.

    kind: "s3fifo" (ours), "lru" or "random" (references).
    window: probation FIFO share of the capacity, in (0, 1); where it starts when adapted.
    adapt_window: hill-climb the window online (as Caffeine's W-TinyLFU does):
        every `adapt_period` accesses per cache slot, move it by `adapt_step`
        of the capacity in the direction that last raised the hit ratio (turn
        back when it fell); the step decays by 2% per move. Off by default: the
        best window differs by trace and cache size, but hit-ratio noise between
        periods misleads the climber, and a fixed 0.2 stays close to the best
        reference at every size (docs/decisions.md, "The probation window").
    main_freq: sketch count at which a missed id enters main directly (it was
        seen before and evicted); 0 sends every miss to probation.
    class_bins: equal ranges of the id space whose recent hit rates the policy learns
        (classes.py: an Engram table concatenates its (order, head) sub-tables, and low
        orders recur far more); 0 turns the prior off. A miss of a class hit less
        than class_ratio times the table's rate enters main directly only at
        main_freq + 1 sketch counts; with first_out_ratio > 0, one of a class hit
        under first_out_ratio times it, seen for the first time, enters probation
        at its head (the next victim unless hit first). Off by default: it gains
        on the replays of `bench cache` but cost `bench large --quick`'s sidecar
        its steady hit ratio's lead over LRU (docs/decisions.md, the per-class
        prior). class_decay: each step's counts weigh this
        much less the next step (a memory of about 1 / (1 - class_decay) steps).
        Chosen on the text and aws-docs traces (docs/decisions.md, the per-class
        prior).
    max_hits: CLOCK hit budget of a main-queue row (extra passes it survives), at most
        MAX_HITS (31: a slot's hits share its queue's byte, policy/queues.py).
    expect_steps: how long an `expect` hint lasts when its caller does not say:
        a hinted row (a queued request will read it) is passed over by
        victims() for this many steps after the hint, resident then or
        admitted later; 0: the hint is CLOCK credit only. Callers should pass
        the request's expected wait in the scheduler's queue.
    max_expect_steps: the longest a hint may last; `expect` (and the sidecar's
        Prefetch) refuses more with InvalidArgument, so a hint cannot keep rows
        after its request is long gone. At most MAX_EXPECT_STEPS.
    pending_share, pending_min: hinted ids not resident yet (kept until admitted
        or their hint runs out) remembered in all: pending_share of the capacity,
        but at least pending_min (or twice the capacity, if less); a hint past it
        keeps the ids that fit. Its table costs 10.5 B an id of the bound (7 B an
        entry, 1.5 x the bound: pending.py), so the share costs 10.5 x
        pending_share B a slot from the first hint with ids. Why these: what a
        queue of hints needs is its depth times its steps' missing ids, not a
        share of the arena. A bound below about twice the capacity costs hit
        ratio only in small arenas, where a queue's misses are a large share of
        the slots (a read-ahead id whose entry found no room is not protected,
        and is evicted before its request runs); pending_min keeps twice the
        capacity up to 64 Ki slots, and in large arenas the share leaves room for
        deeper queues (docs/decisions.md, the pending hints' bound).
    pending_client_share: the share of those one client (by its conn_id) may hold,
        so one client's deep queue leaves room for the others' hints (by default
        half: as many ids as the arena has slots in arenas up to 64 Ki slots).
    hint_clients: clients with ids pending at once; a hint from one more is
        dropped until another's hints run out.
    read_admit_freq: a miss a client on the host read itself (Notes.access:
        the row is already served, so promoting it is optional) that needs a
        victim is promoted only once the sketch has counted it this many times,
        this access included: a doorkeeper in front of S3-FIFO's probation. 1
        (promote every miss, as a planned miss is): on real text a document's
        n-grams come back within a few steps, and a doorkeeper of 2 made the
        second sighting a miss too (the 1/6-scale V4.1 table past full: hit
        0.472 at 2, 0.498 at 1, LRU 0.492); 2 pays on synthetic Zipf and costs
        the sidecar fewer promotions (docs/decisions.md, "The read doorkeeper").
        Planned misses are always promoted (the step reads them from the arena).
    sketch_width: sketch counters per row per cache slot (rounded up to whole
        64-byte blocks). With sketch_depth, the sketch's bytes a slot: the default,
        8 B (2 x 8 four-bit counters, TinyLFU's sizing of a few counters a slot),
        keeps a cached table's state within its per-slot budget
        (docs/architecture.md); half of it loses hit ratio on real text in small
        arenas, more gains little (docs/decisions.md, the sketch's size).
    sketch_depth: hash rows of the sketch.
    counter_max: sketch counter saturation (15 = TinyLFU's 4-bit counters, packed two a
        byte; more takes a byte a counter).
    halve_every: recorded accesses between sketch halvings, per cache slot.
    sketch_max_mib: ceiling on the sketch's memory (depth * width bytes).
    seed: for kind="random" only.
    """

    kind: str = "s3fifo"
    window: float = 0.2
    adapt_window: bool = False
    adapt_period: float = 1.0
    adapt_step: float = 0.05
    main_freq: int = 2
    class_bins: int = 64
    class_ratio: float = 0.8
    class_decay: float = 0.99
    first_out_ratio: float = 0.0
    max_hits: int = 3
    expect_steps: int = 16
    max_expect_steps: int = 4096
    pending_share: float = 1 / 16
    pending_min: int = 1 << 17
    pending_client_share: float = 0.5
    hint_clients: int = 64
    read_admit_freq: int = 1
    sketch_width: float = 8.0
    sketch_depth: int = 2
    counter_max: int = 15
    halve_every: float = 5.0
    sketch_max_mib: float = 256.0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidArgument(f"policy kind {self.kind!r} is unknown; use 's3fifo', 'lru' or 'random'")
        if not 0.0 < self.window < 1.0:
            raise InvalidArgument(f"window must be in (0, 1), got {self.window}")
        if not self.adapt_period > 0 or not 0 <= self.adapt_step < 1:
            raise InvalidArgument(f"adapt_period must be > 0 and adapt_step in [0, 1), got "
                                  f"{self.adapt_period}, {self.adapt_step}")
        if self.read_admit_freq < 1:
            raise InvalidArgument(f"read_admit_freq must be >= 1, got {self.read_admit_freq}")
        if not (1 <= self.max_expect_steps <= MAX_EXPECT_STEPS and 0 <= self.expect_steps <= self.max_expect_steps):
            raise InvalidArgument(f"expect_steps must be in 0..max_expect_steps and max_expect_steps in "
                                  f"1..{MAX_EXPECT_STEPS}, got {self.expect_steps}, {self.max_expect_steps}")
        if not (0 < self.pending_share <= 4 and self.pending_min >= 1 and 0 < self.pending_client_share <= 1
                and 1 <= self.hint_clients <= 255):
            raise InvalidArgument(f"pending_share must be in (0, 4], pending_min >= 1, pending_client_share in (0, 1] "
                                  f"and hint_clients in 1..255, got {self.pending_share}, {self.pending_min}, "
                                  f"{self.pending_client_share}, {self.hint_clients}")
        if self.main_freq < 0 or not 0 <= self.max_hits <= MAX_HITS:
            raise InvalidArgument(f"main_freq must be >= 0 and max_hits in 0..{MAX_HITS}, got {self.main_freq}, "
                                  f"{self.max_hits}")
        if (self.class_bins < 0 or not 0 < self.class_ratio <= 1 or not 0 <= self.first_out_ratio <= 1
                or not 0 < self.class_decay < 1):
            raise InvalidArgument(f"class_bins must be >= 0, class_ratio in (0, 1], first_out_ratio in [0, 1] and "
                                  f"class_decay in (0, 1), got {self.class_bins}, {self.class_ratio}, "
                                  f"{self.first_out_ratio}, {self.class_decay}")
        if self.sketch_width <= 0 or self.halve_every < 0 or self.sketch_max_mib <= 0:
            raise InvalidArgument(f"sketch_width must be > 0 and halve_every >= 0, got "
                                  f"{self.sketch_width}, {self.halve_every}")
        if not 1 <= self.counter_max <= 255 or not 1 <= self.sketch_depth <= 8:
            raise InvalidArgument(f"counter_max must be in 1..255 and sketch_depth in 1..8, got "
                                  f"{self.counter_max}, {self.sketch_depth}")

    def hint_steps(self, steps: int | None) -> int:
        """How long a hint lasts: `steps`, or expect_steps when None; InvalidArgument
        unless 0 <= steps <= max_expect_steps."""
        if steps is None:
            return self.expect_steps
        steps = int(steps)
        if steps < 0:
            raise InvalidArgument(f"expect: steps must be >= 0, got {steps}")
        if steps > self.max_expect_steps:
            raise InvalidArgument(
                f"a prefetch hint of {steps} steps is over this sidecar's longest ({self.max_expect_steps} steps, "
                f"PolicyConfig.max_expect_steps); pass the request's expected wait in steps, and hint it again "
                f"if it waits longer")
        return steps
