"""Shared pytest setup: Hypothesis profiles without timing checks."""

from hypothesis import Phase, settings

# Hypothesis's default 200 ms deadline per example is a timing assertion: a loaded 2-core
# machine misses it (speed belongs in benchmarks/), so no test has one.
settings.register_profile("specctl", deadline=None)
# scripts/mutation.py runs every mutant's tests with --hypothesis-profile=mutation: one
# failing example kills the mutant, so shrinking it (minutes when torch is in the loop)
# would only cost time; and mutants must not fill the example database.
settings.register_profile(
    "mutation", parent=settings.get_profile("specctl"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None,
)
settings.load_profile("specctl")
