"""Moved to `tierstore.hf_config`: the core owns it (the table layout the core stores), and the
client imports it from there. This alias keeps old imports working; it goes in 0.2."""
import sys
import warnings

import tierstore.hf_config as _moved

warnings.warn("tierstore.client.hf_config moved to tierstore.hf_config; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
