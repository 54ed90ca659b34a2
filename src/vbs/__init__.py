"""VBS, the Virtual Block Store: standalone, EBS-like block storage for virtual machines.

One package, three services and one ``vbs`` executable:

- ``vbs.controller``: the public REST API, the metadata DB and the workflows with rollback;
- ``vbs.storage``: the storage agent on each volume server (backends and exports);
- ``vbs.host``: the host agent on each hypervisor node (hot-plug into running VMs);
- ``vbs.cli``: the command line, including ``vbs up``, the embedded single-machine default.
"""

# The release: the wheel's version (pyproject.toml reads it from here) and what `vbs --version` prints.
__version__ = "0.2.0.dev0"
