"""The control-plane index: which (chunk hash, group) lives in which tier and slot, per-group
slot pools (`pool`), eviction policies (`policies`) and admission rules (`admission`).

Pure Python over `kvtier.core`: it never imports torch, a tier, an engine or a command.
"""
