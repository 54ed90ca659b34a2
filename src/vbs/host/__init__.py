"""The host agent: discovers VMs on a hypervisor node and hot-plugs volumes into them."""
