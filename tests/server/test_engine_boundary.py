"""The server talks to the engine through one façade module, ``ember.engine.api``.

Checked on the source (every import statement, top-level or nested), so a new
reach into the scheduler, the pool or the model fails here instead of
becoming a convention nobody remembers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ember

ALLOWED = "ember.engine.api"
FORBIDDEN_PREFIXES = ("ember.engine", "ember.model", "ember.kernels")
PACKAGES = ("server", "grpc")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # "from ember.engine import sessions" names a module too
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names if node.module in ("ember", "ember.engine")]
    return found


def test_server_and_grpc_import_only_the_engine_facade():
    root = Path(ember.__file__).parent
    files = [f for package in PACKAGES for f in sorted((root / package).rglob("*.py")) if "_generated" not in f.parts]
    assert len(files) > 15  # the walk found the packages
    offending = []
    for path in files:
        for line, module in _imports(path):
            if module == ALLOWED or module.startswith(ALLOWED + "."):
                continue
            if module in ("ember.engine", "ember.model", "ember.kernels") or module.startswith(tuple(p + "." for p in FORBIDDEN_PREFIXES)):
                offending.append(f"{path.relative_to(root)}:{line} imports {module}")
    assert not offending, "the server must use ember.engine.api only:\n" + "\n".join(offending)


def test_the_check_catches_a_reach_through(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ember.engine.scheduler import Scheduler\ndef f():\n    import ember.model.llama\n")
    assert [m for _, m in _imports(bad)] == ["ember.engine.scheduler", "ember.model.llama"]
