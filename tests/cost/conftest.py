"""Fixtures of the cost-model tests."""

import pytest


@pytest.fixture(autouse=True)
def _no_host_profile(monkeypatch, tmp_path):
    """Never pick up a profile saved on this machine (tests must not depend on it)."""
    monkeypatch.setenv("RLHFC_CACHE_DIR", str(tmp_path / "cache"))
