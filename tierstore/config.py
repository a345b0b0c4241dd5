"""Sidecar configuration: one dataclass, validated where it is built.

Flags (`tierstore serve ...`) and environment variables (TIERSTORE_*) map onto
ServeConfig here and nowhere else; a flag wins over the environment.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

# Wire limits. gRPC's default receive limit is 4 MiB; a 4,096-token step of
# V4.1 hashes to 98k ids (786 KB), a long prefill to tens of MB, so requests
# may be 64 MiB. Inline Lookup responses carry rows and may be 256 MiB.
MAX_REQUEST_BYTES = 64 << 20
MAX_RESPONSE_BYTES = 256 << 20
MAX_REQUEST_IDS = MAX_REQUEST_BYTES // 8 - 4096
# One inline Lookup's rows (remote clients, debugging): larger lookups are split.
MAX_INLINE_BYTES = 64 << 20

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "ki": 1 << 10, "kib": 1 << 10, "m": 1e6, "mb": 1e6,
          "mi": 1 << 20, "mib": 1 << 20, "g": 1e9, "gb": 1e9, "gi": 1 << 30, "gib": 1 << 30,
          "t": 1e12, "tb": 1e12, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(text: "str | int") -> int:
    """'4GiB', '512M', '1.5g', 1000 -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write e.g. 512MiB, 4GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(slots=True)
class ServeConfig:
    data_dir: Path
    socket: Path | None = None          # unix socket (mode 0600); the default transport
    dram_budget: int = 1 << 30          # bytes of /dev/shm for all arenas together
    listen: str | None = None           # HOST:PORT for TCP; needs allow_tcp
    allow_tcp: bool = False
    auth_token: str | None = None       # required on TCP
    tls_cert: Path | None = None        # PEM certificate chain: TCP then speaks TLS
    tls_key: Path | None = None
    metrics_port: int | None = None     # Prometheus text endpoint on 127.0.0.1
    lease_ttl_s: float = 30.0           # a dead client's leases end after this
    max_leases: int = 65536
    max_leases_per_client: int = 1024   # one client's live leases (a worker holds a few per step)
    max_request_ids: int = MAX_REQUEST_IDS
    workers: int = 8
    shm_dir: Path = Path("/dev/shm")
    persist_arena: bool = False         # leave arenas in /dev/shm on shutdown for re-attach
    verify_sample: float = 0.001        # fraction of served rows re-checked off the hot path (0 = off)
    policy: str = "tinylfu"
    profile: Path | None = None         # `tierstore profile` output: seeds the cache policy's hot set
    remote: str | None = None           # mooncake://HOST:PORT: versions with no local rows are read from Mooncake
    metadata: str | None = None         # Mooncake metadata URL (with remote)

    def __post_init__(self):
        self.data_dir = Path(self.data_dir)
        self.shm_dir = Path(self.shm_dir)
        self.dram_budget = parse_size(self.dram_budget)
        if self.socket is not None:
            self.socket = Path(self.socket)
        self.profile = Path(self.profile) if self.profile else None
        if self.profile is not None and not self.profile.is_file():
            raise FileNotFoundError(f"--profile {self.profile} does not exist; make one with `tierstore profile`")
        self.tls_cert = Path(self.tls_cert) if self.tls_cert else None
        self.tls_key = Path(self.tls_key) if self.tls_key else None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.socket is None and self.listen is None:
            raise ValueError("give --socket PATH (or --listen HOST:PORT with --allow-tcp)")
        if self.listen is not None and not self.allow_tcp:
            raise ValueError("--listen opens a TCP port; pass --allow-tcp to mean it (unix sockets are the default)")
        if self.listen is not None and not self.auth_token:
            raise ValueError("TCP listening needs a shared token: --auth-token or TIERSTORE_AUTH_TOKEN")
        if self.dram_budget <= 0:
            raise ValueError(f"--dram-budget must be positive, got {self.dram_budget}")
        if not 0.0 <= self.verify_sample <= 1.0:
            raise ValueError(f"--verify-sample is a fraction in [0, 1], got {self.verify_sample}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"--lease-ttl must be positive seconds, got {self.lease_ttl_s}")
        if not 0 < self.max_request_ids <= MAX_REQUEST_IDS:
            raise ValueError(f"max_request_ids must be in 1..{MAX_REQUEST_IDS}")
        if bool(self.remote) != bool(self.metadata):
            raise ValueError("--remote mooncake://HOST:PORT and --metadata URL go together")
        if self.remote:
            from tierstore.mooncake import parse_master
            parse_master(self.remote)
        if not self.data_dir.is_dir():
            raise FileNotFoundError(f"data directory {self.data_dir} does not exist; create a table first "
                                    f"(tierstore demo-table / tierstore ingest)")

    @classmethod
    def from_env(cls, **overrides) -> "ServeConfig":
        """Defaults < TIERSTORE_<FIELD> environment variables < explicit overrides (flags)."""
        values = {}
        for f in fields(cls):
            env = os.environ.get(f"TIERSTORE_{f.name.upper()}")
            if env is not None:
                values[f.name] = _coerce(f.type, env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


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
