"""The import arrows: the library (utils/, kernels/, rewards/, tiny/) and the benches import no top-level script,
utils/, rewards/ and kernels/ import nothing of tiny/, and no module imports its way back to itself. Every import
counts, those inside functions too (a circle hidden in a function body still ties the two modules together). Read
from the source; nothing is imported."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("train_grpo", "train_sft", "train_mixgrpo", "evaluate", "distill", "iterate")
LIBRARY = ("utils", "kernels", "rewards", "tiny", "bench")
# bench_grpo.py times train_grpo.main itself (as a test runs a script), tiny_hard_stage_arms.py reruns iterate.py's
# hard stage with iterate's own recipe and runner: the script is what they measure.
MEASURES_A_SCRIPT = {("bench.bench_grpo", "train_grpo"), ("bench.experiments.tiny_hard_stage_arms", "iterate")}


def project_modules():
    """{dotted module name: path} of the scripts and every .py under LIBRARY (tests/ are left out: they import
    the scripts they test)."""
    modules = {name: os.path.join(REPO, f"{name}.py") for name in SCRIPTS}
    for top in LIBRARY:
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), REPO)[:-3].replace(os.sep, ".")
                    modules[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return modules


def imports_of(name, path, modules):
    """The project modules `name` imports anywhere in its file: `from pkg import sub` names the submodule where
    there is one, else the package; relative imports resolve against the module's package."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import utils.t2i.sde` reads utils/t2i/sde.py
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph():
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_library_module_or_bench_imports_a_top_level_script():
    bad = sorted(f"{name} imports {target}" for name, targets in import_graph().items()
                 if name.split(".")[0] in LIBRARY for target in targets
                 if target in SCRIPTS and (name, target) not in MEASURES_A_SCRIPT)
    assert not bad, "a script is a program, not a library; move what these need into utils/: " + "; ".join(bad)


def find_cycle(graph):
    """One import circle as [a, b, ..., a], or None (depth-first search, nodes in sorted order)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_project_import_graph_has_no_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# The worlds stand one way: tiny/ (the synthetic world, built on first use) sits above the library and registers what
# it adds (its names in utils.core.names, the shapes_t2i reward); the library never imports it.
BELOW_TINY = ("utils", "rewards", "kernels")


def arrows_into(graph, below, above):
    """`a imports b` for every module a under a top-level package of `below` that imports one under `above`."""
    return sorted(f"{name} imports {target}" for name, targets in graph.items() if name.split(".")[0] in below
                  for target in targets if target.split(".")[0] == above)


def test_the_library_imports_nothing_of_the_tiny_world():
    bad = arrows_into(import_graph(), BELOW_TINY, "tiny")
    assert not bad, "tiny/ stands above utils/, rewards/ and kernels/; register through utils.core.names or " \
                    "rewards.register from tiny/ instead: " + "; ".join(bad)


def test_the_arrow_check_notices_a_library_module_importing_tiny(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from tiny.cache import resolve_dataset\n")
    modules = {"utils.eval.m": str(src), "tiny.cache": "", "tiny": ""}
    graph = {"utils.eval.m": imports_of("utils.eval.m", str(src), modules), "tiny.cache": {"utils.eval.m"}}
    assert arrows_into(graph, BELOW_TINY, "tiny") == ["utils.eval.m imports tiny.cache"]


def test_the_walk_sees_function_level_imports_relative_imports_and_circles(tmp_path):
    # the checks above are only as good as this reader: a circle through a function body and a relative import
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from utils.b import X\n    from . import c\n")
    modules = {"utils.a": str(src), "utils.b": "", "utils.c": "", "train_sft": ""}
    assert imports_of("utils.a", str(src), modules) == {"utils.b", "utils.c"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_old_flat_utils_names_import_as_the_modules_in_their_wings():
    import importlib

    import utils

    for old, new in utils.MOVED.items():
        module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert module.__spec__.name == new and module.__name__ == new, old
        assert os.path.isfile(module.__file__) and os.sep + "flow" + os.sep not in module.__file__
    from utils.flow.sde import ode_step
    from utils.t2i.sde import ode_step as same
    assert ode_step is same
