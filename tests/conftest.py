"""Shared pytest setup: a Hypothesis profile for mutation runs."""

from hypothesis import Phase, settings

# scripts/mutation.py runs every mutant's tests with --hypothesis-profile=mutation: one
# failing example kills the mutant, so shrinking it (minutes when torch is in the loop)
# would only cost time; and mutants must not fill the example database.
settings.register_profile(
    "mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None
)
