"""A pool of volumes as both agents hold one: the contracts of backends and export drivers, and the
volume calls of the HTTP API. The storage agent's pools use them, and so do a hypervisor node's local
pools (semi-shared storage), made by the same backend drivers; neither agent imports the other.
"""
