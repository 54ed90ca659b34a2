"""The backend contract, as the storage agent's backends name it. It is defined below both agents
(``vbs.pools.backend``): a hypervisor node's local pools are made by the same backend drivers.
"""

from vbs.pools.backend import Backend, EncryptingBackend, PullingBackend, ReportsUsage

__all__ = ["Backend", "EncryptingBackend", "ReportsUsage", "PullingBackend"]
