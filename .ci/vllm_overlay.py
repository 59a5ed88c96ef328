"""The overlay of .ci/vllm_env, from pip's --report of the vLLM set:
    python .ci/vllm_overlay.py differ REPORT   prints name==version of each resolved package installed at another one
    python .ci/vllm_overlay.py check REPORT    fails unless every installed resolved package is at its version"""

import importlib.metadata as metadata
import json
import re
import sys


def _key(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved(report_path):
    with open(report_path) as f:
        return {_key(item["metadata"]["name"]): item["metadata"]["version"] for item in json.load(f)["install"]}


def installed():
    """The version import finds for each distribution: the first on sys.path (the overlay before .venv)."""
    found = {}
    for dist in metadata.distributions():
        found.setdefault(_key(dist.metadata["Name"]), dist.version)
    return found


def main(mode, report_path):
    want, have = resolved(report_path), installed()
    differ = {name: version for name, version in want.items() if name in have and have[name] != version}
    if mode == "differ":
        print("\n".join(f"{name}=={version}" for name, version in sorted(differ.items())))
        return 0
    if differ:
        raise SystemExit(f"{report_path}: the overlay does not give these resolved versions (name: wanted, got): "
                         + ", ".join(f"{name}: {version}, {have[name]}" for name, version in differ.items()))
    if "vllm" in have:
        raise SystemExit("vllm is installed: this check is for a CPU runner's .venv without it")
    import torch
    import transformers
    print("torch", torch.__version__, "transformers", transformers.__version__, "from", torch.__file__)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("differ", "check"):
        raise SystemExit(__doc__)
    sys.exit(main(*sys.argv[1:]))
