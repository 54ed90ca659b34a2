"""The export driver contract, as the storage agent's export drivers name it. It is defined below both
agents (``vbs.pools.exports``): a backend's contract names it, and local pools use backends too.
"""

from vbs.pools.exports import (
    RBD_IMAGE_RE,
    ExportDriver,
    ExportSource,
    FileSource,
    LimitEnforcer,
    PointInTimeCopier,
    RbdSource,
)

__all__ = ["FileSource", "RbdSource", "ExportSource", "ExportDriver", "PointInTimeCopier", "LimitEnforcer",
           "RBD_IMAGE_RE"]
