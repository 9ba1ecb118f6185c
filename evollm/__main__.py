"""``python -m evollm train|resume|report ...`` (the same as the ``evollm`` command, exit status included)."""

from evollm.recipes.cli import console

if __name__ == "__main__":
    raise SystemExit(console())
