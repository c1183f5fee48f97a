"""The scorer the reward tests share (one per module: it loads the language identifier)."""

import pytest

from reward.scoring import ComplianceScorer


@pytest.fixture(scope="module")
def scorer() -> ComplianceScorer:
    return ComplianceScorer()
