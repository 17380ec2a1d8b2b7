"""The mutants of tests/mutation_check.py still apply: each edit's text occurs exactly once in the file it edits (a
mutant whose text drifted away from the code would stop the mutation run instead of testing anything)."""

import pytest
from mutation_check import MUTATIONS, REPO, mutate


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_mutant_text_is_in_the_source(mutation):
    source = (REPO / mutation.path).read_text()
    mutant = mutate(source, mutation)  # raises RuntimeError unless every text occurs exactly once
    assert mutant != source
