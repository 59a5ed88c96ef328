"""The test files whose behaviour the vLLM set's moved pins can change, chosen by what they import: a test file is
selected when it imports torch, torchvision, transformers or numpy (anywhere in the file: a test's own lazy import
runs), or a project module that does at module level (followed transitively), or asks for a tests/conftest.py
fixture whose body does.
    python .ci/vllm_tests.py            prints one test file a line
    python .ci/vllm_tests.py --why      prints every test file with the chain of imports that selects it, or none"""

import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOVING = ("torch", "torchvision", "transformers", "numpy")


def module_path(name):
    """The project file of a dotted module name, or None for a third-party module."""
    base = os.path.join(REPO, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def imports(nodes):
    """Dotted names imported by these statements (`from utils import losses` gives utils and utils.core.losses)."""
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def parse(path):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def chain_of(names, seen):
    """The import chain from one of `names` to a moving package, following project modules' module-level
    imports, or None."""
    for name in names:
        if name.split(".")[0] in MOVING:
            return [name]
        local = module_path(name)
        if local and local not in seen:
            seen.add(local)
            chain = chain_of(imports(parse(local).body), seen)
            if chain:
                return [name, *chain]
    return None


def conftest_fixtures():
    """{fixture name: the names its body imports} of tests/conftest.py."""
    tree = parse(os.path.join(REPO, "tests", "conftest.py"))
    return {f.name: imports(ast.walk(f)) for f in tree.body if isinstance(f, ast.FunctionDef)}


def selection():
    """{test file: its import chain to a moving package, or None}."""
    fixtures, chains = conftest_fixtures(), {}
    for test in sorted(os.listdir(os.path.join(REPO, "tests"))):
        if not (test.startswith("test_") and test.endswith(".py")):
            continue
        tree = parse(os.path.join(REPO, "tests", test))
        asked = {a.arg for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for a in f.args.args}
        names = imports(ast.walk(tree)) + [n for fixture in sorted(asked & set(fixtures)) for n in fixtures[fixture]]
        chains[f"tests/{test}"] = chain_of(names, set())
    return chains


def main(argv):
    chains = selection()
    if "--why" in argv:
        for test, chain in chains.items():
            print(f"{test}: " + (" -> ".join(chain) if chain else "imports none of " + ", ".join(MOVING)))
    else:
        print("\n".join(test for test, chain in chains.items() if chain))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
