"""The package layout is the architecture: imports between ray_ppu's sub-packages run one way,
down the data flow, and no two modules import each other, even lazily.

Read from the source with ``ast`` (lazy imports inside functions count: they are how a cycle
hides), so the test needs no import of torch or Ray.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ray_ppu"

# Top to bottom: a package may import only the packages below it. The entry programs come
# first, the driver next, then training, the one-process tools, recovery, the model side,
# monitoring, and the plan, data and config everything stands on.
LAYERS = ["tools", "launch", "train", "offline", "recovery", "checkpoint", "model", "hf",
          "monitor", "plan", "devices", "data", "config", "errors", "util", "quiet",
          "lean_imports"]

# (importer, imported): the few arrows that run back up, each with its reason; the import line
# itself carries a comment saying why.
EXCEPTIONS = {
    # A run that names a Hugging Face directory (checkpoint.pretrained) takes its architecture
    # from that config.json, and the mapping from config.json to ModelConfig lives beside the
    # weight mapping it must agree with.
    ("config", "hf"),
}


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported ray_ppu module, line) for every import in the file, lazy ones included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import mod` names a module when pkg.mod is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        out += [(t, node.lineno) for t in targets if t.split(".")[0] == "ray_ppu"]
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(modules: dict[str, Path]) -> tuple[list[str], set[tuple[str, str]]]:
    """Imports that run back up LAYERS (file:line src -> dst), and the exceptions in use (an
    EXCEPTIONS pair whose import line, or the line above it, carries a comment)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward, used = [], set()
    for name, path in modules.items():
        src = _package(name)
        lines = [""] + path.read_text().splitlines()
        for target, line in _imports(name, path, set(modules)):
            dst = _package(target)
            if not src or not dst or src == dst or rank[src] < rank[dst]:
                continue
            if (src, dst) in EXCEPTIONS and "#" in lines[line] + lines[line - 1]:
                used.add((src, dst))
                continue
            upward.append(f"{path.relative_to(path.parents[len(name.split('.')) - 1])}:{line} "
                          f"{src} -> {dst}")
    return upward, used


def import_cycles(modules: dict[str, Path]) -> list[str]:
    """Every loop of module imports (lazy ones included), as ``a -> b -> a``."""
    graph = {name: {t for t, _ in _imports(name, path, set(modules)) if t in modules and t != name}
             for name, path in modules.items()}
    # a package's face importing its own modules is how it hands names on, not a cycle
    for name in graph:
        if modules[name].name == "__init__.py":
            graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_the_root_holds_only_the_shared_pieces():
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    # what every process installs on ``import ray_ppu`` (quiet, lean_imports) and the errors
    assert flat == ["__init__.py", "errors.py", "lean_imports.py", "quiet.py"], flat
    for sub in PACKAGE.iterdir():
        if sub.is_dir() and sub.name != "__pycache__":
            assert sub.name in LAYERS, f"{sub.name}/ has no place in LAYERS"
            doc = ast.get_docstring(ast.parse((sub / "__init__.py").read_text()))
            assert doc and len(doc) > 200, f"{sub.name}/__init__.py needs its paragraph"


def test_sub_packages_import_downwards_only():
    upward, used = upward_imports(_modules())
    assert upward == [], "imports that run back up the layers:\n" + "\n".join(upward)
    assert used == EXCEPTIONS, f"exceptions no import needs any more: {EXCEPTIONS - used}"
    assert len(EXCEPTIONS) <= 3


def test_no_import_cycles():
    cycles = import_cycles(_modules())
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path):
    """The same checks on a small tree: an import back up (and the known exception without its
    comment) is reported, the commented exception is not, and a loop of two modules is one."""
    root = tmp_path / "ray_ppu"
    files = {
        "model/up.py": "from ray_ppu.train import loop\n",
        "config/bare.py": "from ray_ppu.hf import config\n",
        "config/said.py": "# why, in a comment\nfrom ray_ppu.hf import config\n",
        "util/a.py": "def f():\n    from ray_ppu.util import b\n",
        "util/b.py": "from ray_ppu.util import a\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    modules = _modules(root)
    upward, used = upward_imports(modules)
    assert sorted(upward) == ["ray_ppu/config/bare.py:1 config -> hf",
                              "ray_ppu/model/up.py:1 model -> train"]
    assert used == {("config", "hf")}
    assert import_cycles(modules) == ["ray_ppu.util.a -> ray_ppu.util.b -> ray_ppu.util.a"]
