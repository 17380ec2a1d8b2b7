"""Session-wide test settings and hooks.

- On a machine of a few cores (CI's two) the suite runs engines, servers and Hugging Face references side by side,
  and torch's OpenMP threads spin while they wait for each other: on an oversubscribed machine one test ran 50x
  slower (the speculative chi-square test: 99 s in the suite, 2 s with one thread; the whole suite 12 min against 8).
  One intra-op thread per process there, set before any test module imports torch; subprocesses (servers, engine
  cores) inherit it. Larger machines keep torch's default.
- Every chat and completion response read from a real server is checked against the openai package's types
  (tests/openai_shapes.py)."""

from __future__ import annotations

import os

if (os.cpu_count() or 1) <= 4:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import openai_shapes  # noqa: E402  (after the thread setting: nothing may import torch before it)
import pytest  # noqa: E402

openai_shapes.install()


@pytest.fixture(autouse=True)
def _responses_match_the_openai_types():
    """Fail a test when a response it caused did not match, even one read in a thread or behind a client's retries."""
    openai_shapes.take_mismatches()
    yield
    mismatches = openai_shapes.take_mismatches()
    assert not mismatches, "responses that do not match the openai types:\n" + "\n".join(mismatches)
