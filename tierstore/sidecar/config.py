"""Sidecar configuration: one dataclass, validated where it is built.

Every field is set by its TIERSTORE_<FIELD> environment variable, read here
(ServeConfig.environment) and nowhere else in the sidecar, and most by a
`tierstore serve` flag whose dest is the field's name (tierstore/cli/serve.py
passes them by name); a flag wins over the environment.
"""
from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass, fields
from pathlib import Path

from tierstore.cache.leases import MAX_LEASES
from tierstore.errors import InvalidArgument
from tierstore.proto import MAX_REQUEST_IDS
from tierstore.sidecar.startup import PAUSE_POINTS
from tierstore.tiers.pages import MODES

__all__ = ["ServeConfig", "parse_size", "MAX_SIZE", "MAX_LEASE_TTL_S", "MAX_WORKERS"]

# A lease outliving a day is a leak, not a step; a huge TTL overflows expiry maths.
MAX_LEASE_TTL_S = 86400.0
MAX_WORKERS = 1024
MAX_SIZE = 1 << 50  # 1 PiB: far above any host's /dev/shm, far below float and int64 overflow

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "ki": 1 << 10, "kib": 1 << 10, "m": 1e6, "mb": 1e6,
          "mi": 1 << 20, "mib": 1 << 20, "g": 1e9, "gb": 1e9, "gi": 1 << 30, "gib": 1 << 30,
          "t": 1e12, "tb": 1e12, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(text: "str | int") -> int:
    """'4GiB', '512M', '1.5g', 1000 -> bytes, 1..MAX_SIZE; else InvalidArgument naming the range
    (0, a negative, a 400-digit number or 1e999GiB are refused here, before any arithmetic)."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidArgument(f"cannot read size {str(text)[:40]!r}; write e.g. 512MiB, 4GiB or a byte count")
        v = float(m.group(1)) * _UNITS[m.group(2).lower()]
        n = int(v) if math.isfinite(v) and v <= MAX_SIZE else MAX_SIZE + 1
    if not 1 <= n <= MAX_SIZE:
        shown = str(text) if len(str(text)) <= 40 else f"a {len(str(text))}-character number"
        raise InvalidArgument(f"size {shown} is outside 1 byte..{MAX_SIZE >> 50} PiB; write e.g. 512MiB or 4GiB")
    return n


@dataclass(slots=True)
class ServeConfig:
    """How one sidecar serves, validated when built (__post_init__). Each field is its
    TIERSTORE_<FIELD> variable (read by environment() and nowhere else) and most are a
    `tierstore serve` flag too; a flag wins.

    The other TIERSTORE_* variables are not fields, on purpose: each is a process-wide
    switch of code the client's processes run as much as the sidecar's, read where it
    acts, so no sidecar's config could carry it. Every one, and where it is read:

    - TIERSTORE_IO_URING=0: O_DIRECT reads by pread, never io_uring (tiers/nvme/uring.py)
    - TIERSTORE_NO_JIT=1: the numpy reference of every compiled loop (jit.py)
    - TIERSTORE_SPIN_US=N: step-socket readers, both ends, poll N µs before they block
      (proto/frames.py, spin_seconds)
    - TIERSTORE_MISS_FLIGHTS=0: a client on the host reads its O_DIRECT misses itself, sharing
      none with other clients (cache/miss_flights.py)
    - TIERSTORE_FORCE_TORCH=1: the torch reference of every kernel (kernels/dispatch.py)
    - TIERSTORE_VLLM_* and TIERSTORE_SGLANG_*: the engine plugins' settings, read in the
      engine's processes (client/engines/; docs/engines.md)
    """

    data_dir: Path
    socket: Path | None = None          # unix socket (mode 0600); the default transport
    dram_budget: int = 1 << 30          # bytes of /dev/shm for all arenas together
    listen: str | None = None           # HOST:PORT for TCP; needs allow_tcp
    allow_tcp: bool = False
    auth_token: str | None = None       # required on TCP
    auth_token_file: Path | None = None  # the token in a file (not group/world readable)
    tls_cert: Path | None = None        # PEM certificate chain: TCP then speaks TLS
    tls_key: Path | None = None
    metrics_port: int | None = None     # Prometheus text endpoint on 127.0.0.1
    lease_ttl_s: float = 30.0           # a dead client's leases end after this
    max_leases: int = MAX_LEASES        # live leases in all (at most MAX_LEASES: a row's pins never saturate)
    max_leases_per_client: int = 1024   # one client's live leases (a worker holds a few per step), so its pins of a row
    max_client_share: float = 0.5       # of a cache-mode table's arena slots, one client's live leases hold at most
                                        # while another client leases the table or wants its last 1/8 (else: all
                                        # but that 1/8); 1: no per-client bound (cache/leases.py)
    max_request_ids: int = MAX_REQUEST_IDS
    workers: int = 8
    receive_timeout_s: float = 30.0     # a TCP caller's time to deliver its request message
    shm_dir: Path = Path("/dev/shm")     # the sidecar's shared files; its arenas too, unless on hugetlbfs
    arena_pages: str = "auto"           # auto: huge pages where the host gives them, else 4 KiB and a warning;
                                        # huge: or fail at start; small: 4 KiB (tiers/pages.py)
    persist_arena: bool = False         # leave arenas in /dev/shm on shutdown for re-attach
    verify_sample: float = 0.001        # fraction of served rows re-checked off the hot path (0 = off)
    policy: str = "s3fifo"
    profile: Path | None = None         # `tierstore profile` output: seeds the cache policy's hot set
    warm_start: bool = True             # cache mode: promote the recorded hot set (else --profile's) at start
    hot_set_interval_s: float = 300.0   # record each cache-mode table's hot set this often (0: only at stop)
    record_hot_sets: bool = True        # write DATA/hot_sets (off: a benchmark's or a test's sidecar)
    record_trace: Path | None = None    # log the row ids served (bounded) for `tierstore bench cache --trace`
    direct_io: bool = False             # cold-tier row reads with O_DIRECT: no page cache beside the arena
    local_reads: bool = True            # cache mode: clients on the host read resident rows (and, in page-cache
                                        # mode, misses) themselves, no round trip (client/local_reads.py)
    remote: str | None = None           # mooncake://HOST:PORT: versions with no local rows are read from Mooncake
    metadata: str | None = None         # Mooncake metadata URL (with remote)
    parent_pid: int | None = None       # stop once this process is no longer our parent (the launcher died)
    split_layout: tuple = ()            # tables whose arena is split (all weights, then all scales: the host
                                        # table sglang and vLLM map); ("all",): every fp8-e4m3-ue8m0 table.
                                        # Full-resident only: a selected table that would be cached fails at start
    startup_pause: str | None = None    # a test hook: wait at this point of start-up (startup.PAUSE_POINTS)

    def __post_init__(self):
        self.data_dir = Path(self.data_dir)
        self.shm_dir = Path(self.shm_dir)
        try:
            self.dram_budget = parse_size(self.dram_budget)
        except InvalidArgument as e:
            raise InvalidArgument(f"--dram-budget (TIERSTORE_DRAM_BUDGET): {e}") from None
        if self.socket is not None:
            self.socket = Path(self.socket)
        self.profile = Path(self.profile) if self.profile else None
        if self.profile is not None and not self.profile.is_file():
            raise FileNotFoundError(f"--profile {self.profile} does not exist; make one with `tierstore profile`")
        self.tls_cert = Path(self.tls_cert) if self.tls_cert else None
        self.tls_key = Path(self.tls_key) if self.tls_key else None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.auth_token_file is not None:
            self.auth_token = _read_token_file(Path(self.auth_token_file), self.auth_token)
        if self.socket is None and self.listen is None:
            raise ValueError("give --socket PATH (or --listen HOST:PORT with --allow-tcp)")
        if self.listen is not None and not self.allow_tcp:
            raise ValueError("--listen opens a TCP port; pass --allow-tcp to mean it (unix sockets are the default)")
        if self.listen is not None and not self.auth_token:
            raise ValueError("TCP listening needs a shared token: --auth-token or TIERSTORE_AUTH_TOKEN")
        if self.dram_budget <= 0:
            raise ValueError(f"--dram-budget must be positive, got {self.dram_budget}")
        if not 0.0 <= self.verify_sample <= 1.0:  # also refuses nan
            raise ValueError(f"--verify-sample is a fraction in [0, 1], got {self.verify_sample}")
        if not (math.isfinite(self.lease_ttl_s) and 0 < self.lease_ttl_s <= MAX_LEASE_TTL_S):
            raise ValueError(f"--lease-ttl must be seconds in (0, {MAX_LEASE_TTL_S:.0f}], got {self.lease_ttl_s}")
        if not (math.isfinite(self.hot_set_interval_s) and self.hot_set_interval_s >= 0):
            raise ValueError(f"--hot-set-interval must be seconds >= 0 (0: only at stop), got {self.hot_set_interval_s}")
        if not (math.isfinite(self.receive_timeout_s) and 0 < self.receive_timeout_s <= 3600):
            raise ValueError(f"--receive-timeout must be seconds in (0, 3600], got {self.receive_timeout_s}")
        if isinstance(self.workers, bool) or not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"--workers must be 1..{MAX_WORKERS} threads, got {self.workers}")
        if isinstance(self.max_leases, bool) or not 1 <= self.max_leases <= MAX_LEASES:
            raise ValueError(f"--max-leases must be 1..{MAX_LEASES}, got {self.max_leases}")
        if isinstance(self.max_leases_per_client, bool) or not 1 <= self.max_leases_per_client <= MAX_LEASES:
            raise ValueError(f"--max-leases-per-client must be 1..{MAX_LEASES} live leases, got "
                             f"{self.max_leases_per_client} (there is no 'unlimited': --max-leases bounds them all)")
        if not 0.0 < self.max_client_share <= 1.0:  # also refuses nan
            raise ValueError(f"--max-client-share is a fraction of an arena's slots in (0, 1], got "
                             f"{self.max_client_share} (1: no per-client bound, one client may lease a whole arena)")
        from tierstore.cache.policy import PolicyConfig

        PolicyConfig(kind=self.policy)  # an unknown --policy fails here, not at the first cache-mode table
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be a TCP port 1..65535, got {self.metrics_port}")
        if not 0 < self.max_request_ids <= MAX_REQUEST_IDS:
            raise ValueError(f"max_request_ids must be in 1..{MAX_REQUEST_IDS}")
        if bool(self.remote) != bool(self.metadata):
            raise ValueError("--remote mooncake://HOST:PORT and --metadata URL go together")
        if self.remote:
            from tierstore.tiers.remote.mooncake import parse_master
            parse_master(self.remote)
        if self.parent_pid is not None and (isinstance(self.parent_pid, bool) or self.parent_pid != os.getppid()):
            # any other pid would stop the sidecar the moment it is up (or never, for a pid that is not ours)
            raise InvalidArgument(f"--parent-pid {self.parent_pid} is not this sidecar's parent (pid {os.getppid()} "
                                  f"started it); pass the pid of the process that starts the sidecar (os.getpid() "
                                  f"in that process), or leave --parent-pid out")
        if isinstance(self.split_layout, str):  # --split-layout l1,l14 / TIERSTORE_SPLIT_LAYOUT
            self.split_layout = tuple(t.strip() for t in self.split_layout.split(",") if t.strip())
        self.split_layout = tuple(self.split_layout)
        if "all" in self.split_layout and len(self.split_layout) > 1:
            raise ValueError(f"--split-layout is 'all' or a list of tables, not both: {','.join(self.split_layout)}")
        if self.arena_pages not in MODES:
            raise InvalidArgument(f"--arena-pages (TIERSTORE_ARENA_PAGES) {str(self.arena_pages)[:40]!r}: one of "
                                  f"{', '.join(MODES)} (auto: huge pages where the host gives them)")
        self.startup_pause = self.startup_pause or None  # set but empty: no pause, as unset
        if self.startup_pause is not None and self.startup_pause not in PAUSE_POINTS:
            raise InvalidArgument(f"TIERSTORE_STARTUP_PAUSE={self.startup_pause[:40]!r} names no point of start-up; "
                                  f"the points: {', '.join(PAUSE_POINTS)} (or unset it)")
        if not self.data_dir.is_dir():
            raise FileNotFoundError(f"data directory {self.data_dir} does not exist; create a table first "
                                    f"(tierstore demo-table / tierstore ingest)")

    @staticmethod
    def environment() -> dict:
        """The TIERSTORE_<FIELD> variables set in this process's environment, as field values:
        the one place the sidecar reads its environment."""
        values = {}
        for f in fields(ServeConfig):
            env = os.environ.get(f"TIERSTORE_{f.name.upper()}")
            if env is not None:
                values[f.name] = _coerce(f.type, env)
        return values

    @classmethod
    def from_env(cls, environment: dict | None = None, **overrides) -> "ServeConfig":
        """Defaults < TIERSTORE_<FIELD> environment variables (`environment`, read now when None)
        < explicit overrides (flags; None: not given)."""
        values = dict(cls.environment() if environment is None else environment)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if overrides.get("auth_token_file") is not None and overrides.get("auth_token") is None:
            values.pop("auth_token", None)  # a flag wins over the environment
        return cls(**values)


def _read_token_file(path: Path, token: str | None) -> str:
    """The shared token from a file that only its owner can read."""
    if token:
        raise ValueError("give the token once: --auth-token (TIERSTORE_AUTH_TOKEN) or --auth-token-file")
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--auth-token-file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(f"--auth-token-file {path} is readable by group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}); run chmod 600 {path}")
        text = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read --auth-token-file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--auth-token-file {path} is not text") from None
    if not text:
        raise ValueError(f"--auth-token-file {path} is empty")
    return text


def _coerce(type_name: str, text: str):
    t = str(type_name)
    if t.startswith("bool"):
        return text.lower() in ("1", "true", "yes", "on")
    if t.startswith("int") and "None" not in t:
        return parse_size(text) if not text.isdigit() else int(text)
    if t.startswith("float"):
        return float(text)
    if "int" in t and "None" in t:
        return int(text)
    return text
