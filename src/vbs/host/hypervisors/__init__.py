"""Hypervisor drivers: attach a connection to a running VM and detach it (one module per hypervisor)."""
