"""The `tierstore` command: one entry point, one module per subcommand.

Each module in COMMANDS exposes `add_arguments(parser)` and `run(args) -> int`
and keeps heavy imports (torch, grpc) inside `run`, so `tierstore --help` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tierstore.errors import InvalidArgument, NotFound, TierstoreError

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS: dict[str, tuple[str, str]] = {
    "hash": ("tierstore.cli.hash", "hash token ids to Engram row ids (JSON)"),
    "tokenizer-map": ("tierstore.cli.tokenizer_map", "build the tokenizer compression map from tokenizer.json"),
    "demo-table": ("tierstore.cli.demo_table", "write a deterministic synthetic table with a preset's layout"),
    "ingest": ("tierstore.cli.ingest", "ingest safetensors / .npy / torch state dict as a new table version"),
    "ingest-checkpoint": ("tierstore.cli.ingest_checkpoint",
                          "ingest every Engram layer of a Hugging Face checkpoint dir (DeepSeek-V4.1)"),
    "tables": ("tierstore.cli.tables", "list tables and versions"),
    "verify": ("tierstore.cli.verify", "re-check every block checksum"),
    "export": ("tierstore.cli.export", "export a table version as a zstd-compressed portable file"),
    "import": ("tierstore.cli.import_", "import a portable file as a new table version"),
    "serve": ("tierstore.cli.serve", "run the sidecar (gRPC over a unix socket)"),
    "reload": ("tierstore.cli.reload", "make a running sidecar serve another table version, live"),
    "gc": ("tierstore.cli.gc", "remove table versions nobody serves"),
    "lookup": ("tierstore.cli.lookup", "read rows from a running sidecar"),
    "demo": ("tierstore.cli.demo", "end-to-end demo: sidecar + model forward pass vs in-process table"),
    "bench": ("tierstore.cli.bench", "storage benchmarks against simple alternatives"),
    "profile": ("tierstore.cli.profile", "build a frequency profile (hot set) from token traces"),
    "publish": ("tierstore.cli.publish", "publish a table version to Mooncake Store (shared remote tier)"),
    "fetch-manifest": ("tierstore.cli.fetch_manifest", "record a version published in Mooncake in a local catalog"),
    "audit": ("tierstore.cli.audit", "compare execution paths of a model served by tierstore"),
    "sglang": ("tierstore.cli.sglang", "run sglang's server with its Engram tables mapped from the sidecar"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command's name and help; `command`'s module is imported and its
    arguments added (only that one: `tierstore serve` never imports what `audit` needs,
    torch among it). "": no command's (the top-level help); None: every command's."""
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is not None and name != command:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue  # command not built yet
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _command(argv: list[str]) -> str:
    """The command argv names (its first word that is not an option), '' for none."""
    first = next((a for a in argv if not a.startswith("-")), "")
    return first if first in COMMANDS else ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except TierstoreError as e:
        # bad input (2) vs a fault of the data or the machine (1)
        print(f"tierstore {args.command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (InvalidArgument, NotFound)) else 1
    except (ValueError, KeyError, FileNotFoundError, PermissionError) as e:
        # typed errors carry the fix; no traceback for a user's mistake
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"tierstore {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
