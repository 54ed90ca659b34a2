"""Backend drivers: where volume and snapshot data lives (one module per backend)."""
