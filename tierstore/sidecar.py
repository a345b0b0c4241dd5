"""Moved to `tierstore.served` (class ServedTables): two `sidecar.py` files with unrelated
roles misled readers; the client is `tierstore.client.sidecar`. This alias keeps old
imports working (`Sidecar` is ServedTables); it goes in 0.2."""
import warnings

from tierstore.served import ServedTables

__all__ = ["Sidecar", "ServedTables"]

Sidecar = ServedTables
warnings.warn("tierstore.sidecar moved to tierstore.served (class ServedTables); import it from there",
              DeprecationWarning, stacklevel=2)
