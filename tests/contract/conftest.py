"""Shared fixtures of the tier contract suite (see tier_contract.py)."""

from __future__ import annotations

import sys
from pathlib import Path

# tier_contract.py is imported by the per-tier test modules as a plain module
sys.path.insert(0, str(Path(__file__).parent))
