"""The data plane: the `Store` facade (`store.store`), its tier I/O (`io`), the payload format
(`payload`), metrics, and the tiers (`tiers/`: cpu, disk, redis).

This package's `__init__` imports nothing, so the torch-free parts (`payload`, `tiers.redis`,
`tiers.disk_scan`) can be used by the vLLM scheduler process without importing torch.
"""
