"""The code's shape, as the design promises it: each stage imports only the bus, its own folder
and the shared modules at the top of services/ (model files, the GGUF tokenizer, CPU features),
never another stage; no module imports itself back through others; and a module over 300 lines
says why on its first line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("api", "tokenizer", "scheduler", "executor", "detokenizer")


def _imports() -> dict[str, set[str]]:
    """Module name -> the llmbus modules it imports (anywhere in its body)."""
    graph = {}
    for path in [*ROOT.joinpath("services").rglob("*.py"), *ROOT.joinpath("bus").rglob("*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found |= {n.removeprefix("llmbus.") for n in names
                      if n.split(".")[:2] in (["llmbus", "services"], ["llmbus", "bus"])}
        graph[name] = found
    return graph


def test_everything_imports_the_installed_names():
    """`from services...` would still work in a checkout (its root is on sys.path), as a second
    copy of every module beside llmbus.services; in an installed wheel it fails."""
    bare = []
    for folder in ("bus", "services", "bench", "tests"):
        for path in ROOT.joinpath(folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                         and not node.level
                         else [a.name for a in node.names] if isinstance(node, ast.Import)
                         else [])
                bare += [f"{path.relative_to(ROOT)}: {n}" for n in names
                         if n.split(".")[0] in ("bus", "services", "bench")]
    assert bare == []


def test_stages_import_no_other_stage():
    crossings = sorted(
        (module, target) for module, targets in _imports().items() for target in targets
        if module.split(".")[:1] == ["services"] and len(module.split(".")) > 2
        and module.split(".")[1] in STAGES
        and target.split(".")[1:2] != module.split(".")[1:2]
        and len(target.split(".")) > 2 and target.split(".")[1] in STAGES)
    assert crossings == []


def test_no_import_cycles():
    graph = _imports()
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module] & graph.keys()):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


MAX_LINES = 300
REASON = "# Over 300 lines: "


def test_long_modules_say_why():
    unexplained = []
    for folder in ("bus", "services", "bench", "tests"):
        for path in ROOT.joinpath(folder).rglob("*.py"):
            text = path.read_text()
            if text.count("\n") > MAX_LINES and not text.startswith(REASON):
                unexplained.append(str(path.relative_to(ROOT)))
    assert unexplained == []
