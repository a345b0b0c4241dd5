"""Checks made before the sidecar binds anything, so a bad --socket, --listen,
--tls-* or --metrics-port is a one-line error (InvalidArgument, exit 2) instead
of gRPC's "Failed to bind ... GRPC_VERBOSITY", and nothing at a socket path is
ever removed unless it is a socket nobody answers on.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from tierstore.errors import InvalidArgument
from tierstore.proto.frames import step_socket_path

__all__ = ["claim_socket", "check_socket", "grpc_uri_misread", "socket_answers", "check_tcp", "check_port", "check_tls",
           "UNIX_PATH_MAX"]

UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL


def claim_socket(path: Path) -> None:
    """Make `path` free for a new unix socket, or refuse (check_socket's errors): a stale
    socket there (nothing accepts on it: its sidecar died) is removed."""
    if check_socket(path):
        path.unlink(missing_ok=True)  # a dead sidecar's socket


def check_socket(path: Path) -> bool:
    """Refuse (InvalidArgument) a `path` no new unix socket may take, changing nothing; True
    when a stale socket is there (claim_socket removes it), False when nothing is.

    A live socket means another sidecar serves there; a regular file, directory or
    anything else is not ours to delete (`--socket DATA/catalog/data.mdb`). A path gRPC
    would read as something else (grpc_uri_misread) is refused before anything is looked at.
    """
    misread = grpc_uri_misread(str(path))
    if misread:
        raise InvalidArgument(f"--socket {path}: gRPC reads a unix socket path as a URI, and {misread}; "
                              f"choose a path without % , ? or # that does not start with //")
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise InvalidArgument(f"--socket {path} is {len(os.fsencode(path))} bytes long; unix socket paths "
                              f"are limited to {UNIX_PATH_MAX}: choose a shorter path")
    steps = step_socket_path(path)  # the step socket beside it: the longer path
    if len(os.fsencode(steps)) > UNIX_PATH_MAX:
        raise InvalidArgument(f"--socket {path}: its step socket {steps} is {len(os.fsencode(steps))} bytes "
                              f"long; unix socket paths are limited to {UNIX_PATH_MAX}: choose a shorter path")
    if not path.parent.is_dir():
        raise InvalidArgument(f"--socket {path}: directory {path.parent} does not exist")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a symlink" if stat.S_ISLNK(st.st_mode) \
            else "a regular file" if stat.S_ISREG(st.st_mode) else "not a socket"
        raise InvalidArgument(f"--socket {path} exists and is {kind}; refusing to replace it: choose another path")
    if socket_answers(path):
        raise InvalidArgument(f"--socket {path}: another sidecar is serving on it (or it is another user's "
                              f"socket); stop that one first or choose another path")
    return True


def grpc_uri_misread(path: str) -> str | None:
    """How gRPC would read `unix:{path}` as another path than `path` (None: it reads it as
    written). The sidecar binds `unix:{path}` and clients dial it, but the step socket and
    these checks use the path itself, so every difference is one of these:
    - the server and the client decode each %XX escape (`a%2Fb.sock` binds `a/b.sock`,
      replacing whatever socket serves there);
    - a client splits the path into addresses at each `,`, and ends it at `?` (a query) or `#`
      (a fragment): the sidecar would bind a socket no client reaches;
    - a client reads what follows a leading `//` up to the next `/` as a host, and refuses it.
    """
    if "%" in path:
        return "it decodes each %XX escape (a%2Fb.sock binds a/b.sock, where another sidecar may serve)"
    for c, why in ((",", "a client splits the path into several addresses at each ','"),
                   ("?", "a client ends the path at '?'"), ("#", "a client ends the path at '#'")):
        if c in path:
            return f"{why}: no client could reach this sidecar"
    if path.startswith("//"):
        return "a client reads what follows a leading // as a host: no client could reach this sidecar"
    return None


def socket_answers(path: Path) -> bool:
    """True when a process accepts connections on the unix socket `path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as e:  # EACCES (another user's), a timeout (a listener with a full backlog)
        return e.errno != errno.ECONNREFUSED
    finally:
        s.close()


def check_tcp(listen: str, what: str = "--listen") -> None:
    """Bind HOST:PORT once ourselves to say precisely why gRPC could not."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(f"{what} {listen!r} is not HOST:PORT with a port in 0..65535")
    check_port(host.strip("[]") or "0.0.0.0", int(port), what)


def check_port(host: str, port: int, what: str) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InvalidArgument(f"{what}: cannot resolve {host!r} ({e.strerror})") from None
    for family, kind, proto, _, addr in infos[:1]:
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and http.server do
            s.bind(addr)
        except OSError as e:
            why = {errno.EADDRINUSE: "the port is in use", errno.EADDRNOTAVAIL: "it is not an address of this host",
                   errno.EACCES: "ports below 1024 need privileges"}.get(e.errno, e.strerror)
            raise InvalidArgument(f"{what}: cannot listen on {host}:{port}: {why}") from None
        finally:
            s.close()


def check_tls(cert: Path, key: Path) -> tuple[bytes, bytes]:
    """The PEM chain and key, read and checked to belong together."""
    import ssl

    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        return cert.read_bytes(), key.read_bytes()
    except FileNotFoundError as e:
        raise InvalidArgument(f"TLS file {e.filename} does not exist") from None
    except (ssl.SSLError, OSError) as e:
        raise InvalidArgument(f"--tls-cert {cert} / --tls-key {key} are not a PEM certificate chain and its "
                              f"private key ({getattr(e, 'reason', None) or e})") from None
