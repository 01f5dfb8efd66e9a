"""Shared fixtures: the shipped config.json and geometry JSON fixtures (package data)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import os

import pytest
from hypothesis import settings

import kvtier

# CI (`.ci/run` sets KVTIER_CI=1) draws the same hypothesis examples every run, so a merge is never
# blocked by an example first drawn there; local runs draw new examples each time and keep the
# ones that failed in .hypothesis/ to replay them.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("KVTIER_CI"):
    settings.load_profile("ci")

DATA = Path(kvtier.__file__).parent / "data"


@pytest.fixture
def config_path() -> Callable[[str], Path]:
    """Path of a shipped Hugging Face config.json fixture, by stem (`"gemma-3-270m"`)."""
    return lambda name: DATA / "configs" / f"{name}.json"


@pytest.fixture
def hf_config(config_path: Callable[[str], Path]) -> Callable[[str], dict]:
    """A shipped config.json fixture as a dict (a fresh copy each call)."""
    return lambda name: json.loads(config_path(name).read_text())


@pytest.fixture
def geometry_path() -> Callable[[str], Path]:
    """Path of a shipped geometry JSON, by stem (`"deepseek-v4-like"`)."""
    return lambda name: DATA / "geometries" / f"{name}.json"
