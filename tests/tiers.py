"""How many examples a property test runs: all it asks for in the full suite, a tenth in the quick tier.

``tests/conftest.py`` loads the Hypothesis profile ``quick`` when the run leaves out the slow tests and runs
the unmarked ones (``-m "not integration and not slow"``, ``-m "not slow"``), ``full`` otherwise; the
option ``--hypothesis-profile`` overrides it.  A property test that asks for more than Hypothesis's default
writes ``@settings(max_examples=examples(400))``: 400 in the full suite (CI), 40 in the quick tier.
"""

from __future__ import annotations

from hypothesis import settings

FULL = 100  # Hypothesis's own default, which the full profile keeps
QUICK = 10

settings.register_profile("full", max_examples=FULL)
settings.register_profile("quick", max_examples=QUICK)


def examples(n: int) -> int:
    """``n`` under the full profile; the same share of ``n`` as the loaded profile has of the default (at least 3)."""
    return max(min(n, 3), n * settings.default.max_examples // FULL)


def quick_tier(markexpr: str) -> bool:
    """Whether a run with ``-m markexpr`` runs the unmarked tests and leaves out the slow ones."""
    if not markexpr.strip():
        return False
    try:
        from _pytest.mark.expression import Expression  # pytest's own parser of -m (not public; pinned below 10)

        expr = Expression.compile(markexpr)
        return expr.evaluate(lambda name, **kw: False) and not expr.evaluate(lambda name, **kw: name == "slow")
    except (ImportError, AttributeError, TypeError):
        return "not slow" in " ".join(markexpr.split())
