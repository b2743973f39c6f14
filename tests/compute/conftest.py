"""The computes the conformance suite runs against, one fixture per compute."""

from __future__ import annotations

import pytest

from support.conformance import LocalCase

@pytest.fixture
def local_case() -> LocalCase:
    return LocalCase()
