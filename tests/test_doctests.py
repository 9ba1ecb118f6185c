"""The examples in the library's docstrings are run, so what they show stays true."""

import doctest
import importlib

import pytest

MODULES = ("evollm.hpo.narrowing", "evollm.hpo.horizon", "evollm.hpo.lone", "evollm.hpo.optuna_utils", "evollm.hpo.selection",
           "evollm.run.population", "evollm.run.search",
           "benchmarks.hpo.arms", "benchmarks.hpo.run", "benchmarks.hpo.noise_floor", "benchmarks.hpo.replay_decline",
           "benchmarks.hpo.stats", "benchmarks.hpo.verdicts")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
