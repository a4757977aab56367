"""The code's shape, as the design promises it: each stage imports only the bus, its own folder
and the shared modules at the top of services/ (model files, the GGUF tokenizer, CPU features),
never another stage; no module imports itself back through others; a module over 300 lines
says why on its first line; and only `service.py` and `*_bus.py` modules talk to NATS."""

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


# ServiceRuntime's calls that put something on the bus or take something off it, and nats-py's
# Client's; made on a receiver named as this code names them (`runtime`, `self.runtime`,
# `nc`, `self.nc`), so that `asyncio.gather` and a tensor's `.gather` are not counted.
RUNTIME_CALLS = {"publish", "request", "gather", "on_message", "on_request"}
BUS_CALLS = RUNTIME_CALLS | {"subscribe", "jetstream"}


def _talks_to_nats(tree: ast.Module) -> bool:
    """Imports nats-py (outside `if TYPE_CHECKING:`), or calls the bus through a runtime or a
    connection."""
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and ast.unparse(node.test).endswith("TYPE_CHECKING")
                 for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if id(node) not in type_only and any(n.split(".")[0] == "nats" for n in names):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in BUS_CALLS):
            receiver = node.func.value
            name = (receiver.id if isinstance(receiver, ast.Name)
                    else receiver.attr if isinstance(receiver, ast.Attribute) else "")
            if name.endswith("runtime") or name == "nc":
                return True
    return False


def test_only_service_and_bus_modules_talk_to_nats():
    """Each stage's `service.py`, and the `*_bus.py` modules beside it, are the only modules of
    services/ that import nats-py or call the bus; the rest is pure (bus/ is the shared
    runtime itself). The launcher only starts nats-server processes: no import, no call."""
    from llmbus.bus.runtime import ServiceRuntime

    assert all(hasattr(ServiceRuntime, name) for name in RUNTIME_CALLS)  # else update the set
    talkers = [path for path in sorted(ROOT.joinpath("services").rglob("*.py"))
               if _talks_to_nats(ast.parse(path.read_text()))]
    assert ROOT / "services/api/service.py" in talkers  # what it finds, it can find
    strays = [str(path.relative_to(ROOT)) for path in talkers
              if path.name != "service.py" and not path.name.endswith("_bus.py")]
    assert strays == [], f"talk to NATS but are neither service.py nor *_bus.py: {strays}"


MAX_CORE_MODULE_LINES = 350  # the scheduler's and the executor's modules, reason or not
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60


def test_no_module_class_or_function_outgrows_its_room():
    """A class past 300 lines or a function past 60 holds more than one idea; a scheduler or
    executor module past 350 lines is one that should be split, whatever its first line says.
    Counted from the `def`/`class` line to the last line of the body."""
    too_big = []
    for folder in ("bus", "services"):
        for path in ROOT.joinpath(folder).rglob("*.py"):
            text = path.read_text()
            where = path.relative_to(ROOT)
            core = where.parts[:2] in (("services", "scheduler"), ("services", "executor"))
            if core and text.count("\n") > MAX_CORE_MODULE_LINES:
                too_big.append(f"{where}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else
                         MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef,
                                                                 ast.AsyncFunctionDef))
                         else None)
                if limit and node.end_lineno - node.lineno + 1 > limit:
                    too_big.append(f"{where}:{node.lineno} {node.name}: "
                                   f"{node.end_lineno - node.lineno + 1} lines")
    assert too_big == []


def test_no_test_module_imports_another():
    """What tests share lives in helper modules (tests/stack.py, tests/scheduler/sim.py, ...),
    never in a test module another one imports: moving or deleting a test stays local."""
    crossings = []
    for path in ROOT.joinpath("tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            crossings += [f"{path.relative_to(ROOT)}: {name}" for name in names
                          if name.split(".")[0] == "tests"
                          and name.split(".")[-1].startswith(("test_", "conftest"))]
    assert crossings == []
