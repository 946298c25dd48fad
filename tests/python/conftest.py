"""Shared fixtures for the kmla Python tests (run by CTest: python3 -m pytest tests/python)."""
import os
import pathlib

import pytest

SOURCE_DIR = pathlib.Path(os.environ.get("KMLA_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
CHECKPOINTS = SOURCE_DIR / "tests" / "checkpoints"


@pytest.fixture
def checkpoints():
    return CHECKPOINTS
