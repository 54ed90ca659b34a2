"""Export drivers: how a volume is served to one hypervisor node (one module per protocol)."""
