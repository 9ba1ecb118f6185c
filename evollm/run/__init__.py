"""What a run leaves behind and how it is watched: loop callbacks, live logging, run files and
the ``evollm report`` rebuild. Sits between :mod:`evollm.population` and :mod:`evollm.training`."""
