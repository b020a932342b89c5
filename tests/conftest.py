"""Shared fixtures. Test data lives in tests/data (a user's clone has no ../shared)."""

import json
import pathlib

import pytest

DATA = pathlib.Path(__file__).parent / "data"



@pytest.fixture(scope="session")
def seed002():
    """Reference numbers for seed 002's 'The cat sat on the mat' walkthrough."""
    return json.loads((DATA / "seed002_cat_sat_mat.json").read_text())
