"""One name, one class: no two classes anywhere in kvmesh's packages share a name.

Two `AdmissionController`s (one in the router, one in the engine) once meant a reader had to
check the import to know which admission a line talked about; classes are named by their role
instead (`RouterAdmission`, `EngineAdmission`). The walk reads the source with `ast` and counts
every class, nested ones too (nothing is imported). tests/ is outside it: test doubles such as
a `FakeClock` per test module are private to their file.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "proto", "kv", "quant", "worker", "router", "load_tests", "deploy")  # kvmesh.<folder>


def class_definitions(root: Path, folders: tuple[str, ...]) -> dict[str, list[str]]:
    """class name -> ["path:line", ...] of every definition under the folders."""
    found: dict[str, list[str]] = defaultdict(list)
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    found[node.name].append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def duplicated(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: places for name, places in found.items() if len(places) > 1}


def test_no_two_classes_share_a_name():
    found = class_definitions(ROOT, FOLDERS)
    assert len(found) > 100, "the walk found too few classes: wrong root?"
    assert duplicated(found) == {}, "rename by role, e.g. RouterAdmission / EngineAdmission"


def test_the_walk_sees_nested_and_cross_folder_duplicates(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "sub").mkdir(parents=True)
    (tmp_path / "a" / "x.py").write_text("class Policy:\n    pass\n\nclass Only:\n    pass\n")
    (tmp_path / "b" / "sub" / "y.py").write_text("def f():\n    class Policy:\n        pass\n")
    found = class_definitions(tmp_path, ("a", "b"))
    assert duplicated(found) == {"Policy": ["a/x.py:1", "b/sub/y.py:2"]}
    assert found["Only"] == ["a/x.py:4"]
