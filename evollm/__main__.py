"""``python -m evollm train|resume|report ...`` (the same as the ``evollm`` command, exit status included)."""

from evollm.recipes.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
