"""The storage agent: backends that hold volume data and exports that serve it to hypervisor nodes."""
