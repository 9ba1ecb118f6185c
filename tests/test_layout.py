"""The package's rooms import one way: a room imports only the rooms below it (also inside functions),
`models/` is a leaf that loads base models, only `recipes/` and `config/` touch the run config, and
there are no loose modules at the top of the package."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "evollm"
#: lowest first; a room may import any room before it in this list
ROOMS = ["utils", "functional", "adapters", "models", "hpo", "envs", "tasks", "rollout", "parallel", "algorithms",
         "run", "training", "config", "recipes"]


def imported_rooms(path: Path) -> dict[str, int]:
    """``{room: line}`` of every evollm room ``path`` imports (relative or absolute, at any depth)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            base = (list(package[: len(package) - node.level + 1]) if node.level else []) + \
                (node.module.split(".") if node.module else [])
            names = [base + [a.name] for a in node.names] if len(base) == 1 else [base]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        for parts in names:
            if len(parts) > 1 and parts[0] == "evollm":
                out.setdefault(parts[1], node.lineno)
    return out


def room_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) > 1:
            yield parts[0], path


def test_every_room_is_known_and_no_loose_modules():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(ROOMS)
    loose = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert not loose, f"modules outside a room: {sorted(loose)}"


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_only_rooms_below_it(room):
    allowed = set(ROOMS[: ROOMS.index(room)]) | {room}
    bad = [f"{path.relative_to(PACKAGE)}:{line} imports evollm.{other}"
           for r, path in room_files() if r == room
           for other, line in imported_rooms(path).items() if other not in allowed]
    assert not bad, "\n".join(bad)


def test_only_recipes_and_config_read_the_run_config():
    bad = [f"{path.relative_to(PACKAGE)}" for room, path in room_files() if room not in ("config", "recipes")
           if "config" in imported_rooms(path)]
    assert not bad, bad
