"""QEMU's protocols, shared by the storage agent (qemu-storage-daemon) and the host agent (QEMU VMs):
the one QMP client (qmp) and QEMU's X.509 credential directories (tls)."""
