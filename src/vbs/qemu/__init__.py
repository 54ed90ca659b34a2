"""QEMU's protocols, shared by the storage agent (qemu-storage-daemon) and the host agent (QEMU VMs):
the one QMP client (qmp), QEMU's X.509 credential directories (tls) and its LUKS1 containers read without
QEMU (luks1: the storage agent's header offsets, the controller's decryption of snapshot blocks)."""
