"""The audit's paths and its report: one PathResult per path, the AuditReport over all of them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["EXACT_PATHS", "ROW_FORMAT_PATHS", "PATHS", "SIDECAR_OF", "CustomPath", "PathResult", "AuditReport"]

EXACT_PATHS = ("sidecar-full", "sidecar-cache", "sidecar-cold", "hbm-cache", "late-plan")
ROW_FORMAT_PATHS = {"rows-bf16": "bf16", "rows-fp16": "fp16", "rows-fp8": "fp8-e4m3-ue8m0"}
PATHS = ("in-process", *EXACT_PATHS, *ROW_FORMAT_PATHS, "bf16-engram", "bf16-model", "threads", "triton")
SIDECAR_OF = {"sidecar-full": "full", "sidecar-cache": "cache", "sidecar-cold": "cold",
              "hbm-cache": "cache", "late-plan": "cache"}

@dataclass
class CustomPath:
    """An extra path: the model served by `source` (any RowSource) as it is."""

    name: str
    source: object
    expect_exact: bool = True
    note: str = ""

@dataclass
class PathResult:
    """One path against the reference. bit_exact: every run equal to it, bit for bit; *_max_abs /
    *_max_rel: errors of the first run (None when the path did not run); top1_agree: fraction of
    positions with the reference's argmax token; deterministic: runs equal to each other (None: not
    run); note: what the path did (tiers hit, formats); error: why it failed, if it did."""

    name: str
    expect_exact: bool
    bit_exact: bool = False
    deterministic: bool | None = None
    engram_max_abs: float | None = None
    engram_max_rel: float | None = None
    logits_max_abs: float | None = None
    logits_max_rel: float | None = None
    top1_agree: float | None = None
    note: str = ""
    nondeterminism: str = ""   # why the runs differ, when they do
    error: str = ""

    @property
    def ok(self) -> bool:
        """False for a path that must be exact and is not (or failed)."""
        return not self.expect_exact or (self.bit_exact and self.deterministic is not False and not self.error)

@dataclass
class AuditReport:
    """Every path's result; `offenders()` names the paths that must be exact and are not."""

    config: dict
    paths: list[PathResult] = field(default_factory=list)

    def offenders(self) -> list[str]:
        return [p.name for p in self.paths if not p.ok]

    @property
    def exit_code(self) -> int:
        return 1 if self.offenders() else 0

    def to_dict(self) -> dict:
        return {"config": self.config, "exact_paths": [p.name for p in self.paths if p.expect_exact],
                "offenders": self.offenders(), "paths": [asdict(p) for p in self.paths]}

