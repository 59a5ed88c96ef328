"""What an environment made from requirements.txt alone holds, read from the installed packages' metadata (the
venv holds requirements.txt's exact pins, plus the dev extras): the dependency closure of its pins, and a venv that
sees only that closure (each distribution's files linked in from the venv, nothing else importable)."""

import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, distributions

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pinned(path=os.path.join(REPO, "requirements.txt")):
    """{name: version} of a requirements file's `name==version` lines."""
    out = {}
    with open(path) as f:
        for line in f:
            spec = line.partition("#")[0].strip()
            if spec and not spec.startswith("-"):
                name, version = spec.split("==")
                out[canonicalize_name(name)] = version.strip()
    return out


def closure(names):
    """The installed distributions `names` need, transitively (markers evaluated here, no extras)."""
    seen, todo = set(), [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue  # a platform-only dependency (e.g. CUDA libraries on a CPU machine): not installed here
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def extra_requirements(package, extra):
    """Names a package's `extra` adds (its Requires-Dist lines marked extra == ...)."""
    names = set()
    for line in distribution(package).requires or []:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            names.add(canonicalize_name(req.name))
    return names


def make_view_venv(folder, names):
    """A venv (no system site-packages) whose site-packages links exactly the files of the distributions `names`
    from this interpreter's environment: what `pip install -r requirements.txt` would give, without the download.
    Directories that one distribution owns alone are linked whole; shared ones (namespace packages) file by file."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True)
    site = subprocess.run([os.path.join(folder, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
    owners = {}  # top-level entry -> distributions that have files under it
    files = {}
    for dist in distributions():
        name = canonicalize_name(dist.metadata["Name"])
        for f in dist.files or []:
            parts = f.parts
            if parts and parts[0] not in ("..", "__pycache__") and not re.match(r"^\.\.", str(f)):
                owners.setdefault(parts[0], set()).add(name)
                files.setdefault(name, []).append((f, dist))
    wanted = {canonicalize_name(n) for n in names}
    for name in wanted:
        for f, dist in files.get(name, []):
            top = f.parts[0]
            source = os.path.join(str(dist.locate_file("")), str(f))
            if len(f.parts) > 1 and owners[top] == {name}:
                target, source = os.path.join(site, top), os.path.join(str(dist.locate_file("")), top)
            else:
                target = os.path.join(site, str(f))
            if os.path.lexists(target) or not os.path.exists(source):
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(source, target)
    return os.path.join(folder, "bin", "python")
