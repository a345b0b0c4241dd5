"""Start-up as a transaction for shared memory: a sidecar that does not get as far as
serving leaves no file in its shm directory, whatever ended its start-up (a signal, an
error, a bad table).

Every file a sidecar makes there is named tierstore.<uid>.<tag>.<token>.<what>
(EngineBuilder.new_name: the tag names its data directory and address, the token is random).
StartUpFiles notes the directory's files of that tag as start-up begins; remove()
deletes every file of the tag that was not there then: arenas (published or still
`.new`), slot indexes and the lease board, a file whose object was never built
included (a signal between its open and its constructor's return leaves no object to
close). The files that were there are start-up's own to judge: stale ones it removes,
persisted arenas (--persist-arena) it re-attaches or keeps.

pause(config, point) is a test hook: with TIERSTORE_STARTUP_PAUSE=point in its environment
(ServeConfig.startup_pause), a sidecar says `tierstore: start-up paused at POINT` on stderr
when it reaches that named point of its start-up and waits there up to PAUSE_S seconds (a
signal ends the wait, as it would any other step), so a test can signal it at that very
point. The points (PAUSE_POINTS), in order: leases (the lease board made), arena (a table's
arena reserved, not published), loaded (a full table's rows in its arena), published (a
table's arena at its name), tables (every table served), bound (the socket bound), started
(serving, the stop signals not yet taken over; tierstore/cli/serve.py); a reload passes
arena, loaded and published too. Unset, a point costs one attribute read.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from tierstore.tiers.dram import arena_tag, own_files, retire_file

__all__ = ["StartUpFiles", "shm_tag", "pause", "PAUSE_ENV", "PAUSE_POINTS", "PAUSE_S"]

PAUSE_ENV = "TIERSTORE_STARTUP_PAUSE"  # ServeConfig.startup_pause
PAUSE_POINTS = ("leases", "arena", "loaded", "published", "tables", "bound", "started")
PAUSE_S = 60.0


def shm_tag(config) -> str:
    """The tag in a sidecar's shm file names (arena_tag): its data directory and address."""
    return arena_tag(config.data_dir, str(config.socket.resolve() if config.socket else config.listen))


class StartUpFiles:
    """The shm files of a sidecar's identity that were in its shm directory as its start-up began.
    config: its ServeConfig."""

    def __init__(self, config):
        self.shm_dir, self.tag = Path(config.shm_dir), shm_tag(config)
        self.before = set(own_files(self.shm_dir, self.tag))

    def remove(self) -> list[Path]:
        """Retire and remove every file of the tag made since (idempotent); returns them.
        Retired first: a client that mapped an arena while start-up was ending switches away."""
        made = [p for p in own_files(self.shm_dir, self.tag) if p not in self.before]
        for path in made:
            retire_file(path)
            path.unlink(missing_ok=True)
        return made


def pause(config, point: str) -> None:
    """Wait at `point` when config.startup_pause (TIERSTORE_STARTUP_PAUSE) names it (the module
    docstring). config: the sidecar's ServeConfig."""
    if config.startup_pause != point:
        return
    print(f"tierstore: start-up paused at {point}", file=sys.stderr, flush=True)
    time.sleep(PAUSE_S)
