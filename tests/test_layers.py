"""The package layers hold: server > router > prefill / decode / encode > engine > kernels,
with kvstore under all of them. No module imports a package above its own or a sibling
at its own level, and none imports another package's private module (``_name``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {
    "kvstore": 0, "kernels": 1, "engine": 2, "prefill": 3, "decode": 3, "encode": 3,
    "router": 4, "server": 5,
}  # fmt: skip


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for package, rank in LAYERS.items():
        for path in sorted((root / package).rglob("*.py")):
            where = path.relative_to(root)
            for line, module in imported_modules(path):
                parts = module.split(".")
                target = parts[0]
                if target not in LAYERS or target == package:
                    continue
                if LAYERS[target] > rank:
                    bad.append(f"{where}:{line} imports {module} (a higher layer)")
                elif LAYERS[target] == rank:
                    bad.append(f"{where}:{line} imports {module} (a sibling)")
                if any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                    bad.append(f"{where}:{line} imports {module} (another package's private "
                               "module)")  # fmt: skip
    return bad


def test_no_import_runs_up_the_layers_or_into_a_private_module():
    assert violations() == []


def test_the_check_finds_each_kind_of_violation(tmp_path):
    files = {
        "engine/core.py": "def f():\n    from router.routing import Router\n",  # upwards
        "prefill/worker.py": "import decode.messages\n",  # a sibling
        "engine/models/llama.py": "from kernels._tl import check_tensor\n",  # private
        "router/pools.py": "from engine.worker.config import WorkerConfig\n",  # fine
    }  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    assert any("engine/core.py:2 imports router.routing (a higher layer)" in v for v in found)
    assert any("prefill/worker.py:1 imports decode.messages (a sibling)" in v for v in found)
    assert any("llama.py:1 imports kernels._tl (another package's private" in v for v in found)
    assert not any("router/pools.py" in v for v in found)
