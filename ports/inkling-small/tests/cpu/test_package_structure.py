"""The package's structure: its modules import one another without a cycle (imports inside functions
counted: they are how a cycle hides), and the platform classes vLLM builds are the one platform-neutral
model class with their adapter, neither deriving from the other nor overriding its methods."""
from __future__ import annotations

import ast
from pathlib import Path

import inkling_hpu

PACKAGE = Path(inkling_hpu.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports, wherever in the file."""
    found, package = set(), _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found - {_module_name(path)}


def import_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "tests" not in p.parts]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): {m for name in _imports(p, modules) for m in _runs(name, _module_name(p), modules)}
            for p in paths}


def _runs(name: str, importer: str, modules: set[str]) -> set[str]:
    """What importing `name` runs: it and each package above it, except the importer's own packages
    (already running when the importer runs)."""
    parts = name.split(".")
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    return ({".".join(parts[:i]) for i in range(2, len(parts) + 1)} & modules) - own


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    """(Before the loader became a package: inkling_hpu.loader -> inkling_hpu.model.weights -> inkling_hpu.loader,
    broken at run time by an import inside a function.)"""
    graph = import_graph()
    assert "inkling_hpu.model.weights" in graph and "inkling_hpu.loader.presharded" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_each_platform_class_is_the_neutral_class_with_its_adapter():
    from inkling_hpu import cpu_glue, hpu_glue
    from inkling_hpu.vllm_model import InklingVllmModel

    for cls, platform in ((hpu_glue.HpuInklingForCausalLM, hpu_glue.HpuPlatform),
                          (cpu_glue.CpuInklingForCausalLM, cpu_glue.CpuPlatform)):
        assert cls.__bases__ == (InklingVllmModel,) and cls.Platform is platform
        # besides Platform, only what Python writes into any class (a subclass of vLLM's SupportsPP, a
        # typing.Protocol, gets its ABC bookkeeping too)
        assert set(vars(cls)) <= {"Platform", "__module__", "__doc__", "__qualname__", "__firstlineno__",
                                  "__static_attributes__", "__abstractmethods__", "__parameters__",
                                  "__subclasshook__", "_abc_impl", "_is_protocol"}, cls
        assert object in platform.__mro__ and platform.__bases__ == (object,)
