"""Moved to `tierstore.bench.audit`: the audit runs the whole stack (sidecars, client layers,
kernels), so it lives beside the benchmarks, outside the core. This alias keeps old imports
working; it goes in 0.2."""
import sys
import warnings

import tierstore.bench.audit as _moved

warnings.warn("tierstore.audit moved to tierstore.bench.audit; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
