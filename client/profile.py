"""Moved to `tierstore.profile`: the core owns it (the table layout the core stores), and the
client imports it from there. This alias keeps old imports working; it goes in 0.2."""
import sys
import warnings

import tierstore.profile as _moved

warnings.warn("tierstore.client.profile moved to tierstore.profile; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
