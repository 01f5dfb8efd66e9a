"""The torch-free vocabulary and rules: geometry (groups), the HF config readers, the chunk plan
(hit and store rules), keys (chained hashes, namespaces), units, `load_geometry`, and counters
(every counter kvtier keeps, declared once).

core imports nothing of kvtier but `kvtier.errors`; it never imports torch, a tier, an engine or
a command (tests/test_layers.py fails when it does).
"""
