"""requirements-vllm.txt: the complete vLLM environment keeps requirements.txt's pins except the few vLLM 0.33.0
needs moved (each marked), and those satisfy vLLM's requirements (copied from its wheel's metadata). Whether the
whole set resolves on the index is .ci/vllm_env's job (pip install --dry-run)."""

import os

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# vllm 0.33.0 Requires-Dist (cp38-abi3 manylinux wheel) for the packages requirements.txt also pins; numpy's
# bound is its mistral_common's (>= 1.11.6) on Python <= 3.12
VLLM_NEEDS = {"torch": "==2.14.0", "torchvision": "==0.29.0", "transformers": ">=5.16.1,<5.21.0",
              "tokenizers": ">=0.23.2", "safetensors": ">=0.6.2", "huggingface-hub": ">=1.31.0",
              "requests": ">=2.33.0", "pillow": ">=13.0.0", "numpy": ">=1.25,<2.4", "fastapi": ">=0.133,<0.137"}


def pins(name):
    out = {}
    with open(os.path.join(REPO, name)) as f:
        for line in f:
            spec, _, comment = line.partition("#")
            if spec.strip():
                package, version = spec.strip().split("==")
                out[canonicalize_name(package)] = (version, comment.strip())
    return out


def test_vllm_set_is_the_main_set_with_marked_moves():
    main, vllm = pins("requirements.txt"), pins("requirements-vllm.txt")
    assert vllm.pop("vllm")[0] == "0.33.0"
    assert set(vllm) == set(main)
    moved = {name for name in main if vllm[name][0] != main[name][0]}
    assert moved == {name for name, (_, comment) in vllm.items() if comment.startswith("vLLM")}
    for name in moved:
        assert f"requirements.txt: {main[name][0]}" in vllm[name][1], name  # the comment names what it replaces


def test_vllm_set_satisfies_vllms_requirements():
    vllm = pins("requirements-vllm.txt")
    for name, spec in VLLM_NEEDS.items():
        assert vllm[canonicalize_name(name)][0] in SpecifierSet(spec), (name, spec)
    main = pins("requirements.txt")
    clashing = {n for n, spec in VLLM_NEEDS.items() if main[canonicalize_name(n)][0] not in SpecifierSet(spec)}
    assert clashing == {"torch", "torchvision", "transformers", "numpy", "fastapi"}  # why a second set exists at all


def test_the_main_set_holds_transformers_serve():
    """`python iterate.py` starts `transformers serve`: its extras (transformers[serving]) are in the dependency
    closure of requirements.txt's pins, not only in requirements-dev.txt."""
    from tests.requirements_env import closure, extra_requirements
    from utils.core.serving import SERVING_PACKAGES

    main = closure(pins("requirements.txt"))
    assert extra_requirements("transformers", "serving") | set(SERVING_PACKAGES) <= main
    assert {"fastapi", "uvicorn", "openai", "pydantic", "starlette"} <= set(pins("requirements.txt"))


def test_the_optional_reward_packages_are_pinned_and_named_by_the_refusal():
    """requirements-rewards.txt pins every package a reward's refusal names, exactly; requirements-dev.txt installs
    it (so CI runs the reward tests), and none of it is in requirements.txt."""
    from rewards.models import OPTIONAL_REQUIREMENTS, PACKAGES

    optional = pins(OPTIONAL_REQUIREMENTS)
    assert {canonicalize_name(p) for p in PACKAGES.values()} <= set(optional)
    assert not set(optional) & set(pins("requirements.txt"))
    with open(os.path.join(REPO, "requirements-dev.txt")) as f:
        assert f"-r {OPTIONAL_REQUIREMENTS}" in f.read().splitlines()
