"""Session-wide test hooks: every chat and completion response read from a real server is checked against the openai
package's types (tests/openai_shapes.py)."""

from __future__ import annotations

import openai_shapes
import pytest

openai_shapes.install()


@pytest.fixture(autouse=True)
def _responses_match_the_openai_types():
    """Fail a test when a response it caused did not match, even one read in a thread or behind a client's retries."""
    openai_shapes.take_mismatches()
    yield
    mismatches = openai_shapes.take_mismatches()
    assert not mismatches, "responses that do not match the openai types:\n" + "\n".join(mismatches)
