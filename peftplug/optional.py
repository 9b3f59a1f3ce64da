"""The one availability check of bitsandbytes, an optional dependency (Triton's is ``peftplug_kernels``' own).

A leaf module (it imports nothing of peftplug), so method packages may ask it too. The check imports the package
once and caches the answer: importing bitsandbytes takes seconds, and a broken native library raises something
other than ``ImportError``, which must read as "not available" rather than crash the caller.
"""

from __future__ import annotations

import functools


@functools.cache
def bitsandbytes_available() -> bool:
    """Whether bitsandbytes imports (cached for the process).

    Returns:
        ``True`` if ``import bitsandbytes`` succeeds.
    """
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001  (ImportError, or a broken native library raising something else)
        return False
    return True
