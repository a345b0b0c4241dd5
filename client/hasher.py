"""The client's hashing API: `NgramHasher`, `DecodeState`.

The code lives in `tierstore.hasher` (the core needs it too: `tierstore hash`,
`tierstore profile`); this module is the same module under the client's name,
so model code keeps importing `tierstore.client.hasher`."""
import sys

import tierstore.hasher as _core

sys.modules[__name__] = _core
