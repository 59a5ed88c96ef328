"""The tiny models that take minutes to train, shipped in the repository (tiny/weights/) so a fresh clone's first
run copies them into the cache instead of training them (about 90 CPU minutes of builds on a 2-core machine).

Each shipped folder is named exactly as the cache names the build (`<name>-<key>`, the key hashing the recipe, the
config and the source of the rows it was trained on), so weights built from other code are never used: a changed
row builder or recipe gives a new key, the shipped folder no longer matches and the model is trained as before.
Every build pins torch to one thread and a seed, so `python -m tiny.shipped verify` retrains them in an empty cache
and finds the same bytes; `python -m tiny.shipped save` rebuilds the folders after such a change.

    python -m tiny.shipped verify [--only tiny-sft tiny-reasoner]   # retrain, compare byte for byte
    python -m tiny.shipped save                                     # (re)write tiny/weights/ from fresh builds

MMGRPO_TINY_SHIPPED=0 turns the copy off (every build trains).
"""

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS_DIR = os.path.join(REPO, "tiny", "weights")
MARKER = "shipped.json"  # beside a trained build's checkpoint: its folder name and held-out accuracy
# what a build leaves that is not the model: resume state, logs with wall times, plots
LEFT_OUT = {"training_state", "metrics.jsonl", "train_summary.json", "completions.jsonl", "loss_curve.png",
            "heldout_curve.png", "config.yaml"}
# shipped (their scores are read) but not compared: they hold the build's wall times
NOT_COMPARED = {MARKER, "tiny_generator.json", "tiny_edit_generator.json"}
# the tiny.cache builders whose builds are shipped, by the name their folders start with
BUILDERS = {"tiny-sft": "tiny_sft_path", "tiny-video-sft": "tiny_video_sft_path", "tiny-base": "tiny_base_path",
            "tiny-reasoner": "tiny_reasoner_path", "tiny-planner": "tiny_planner_path",
            "tiny-reflector": "tiny_reflector_path", "tiny-generator": "tiny_generator_path",
            "tiny-edit-generator": "tiny_edit_generator_path"}


def enabled():
    return os.environ.get("MMGRPO_TINY_SHIPPED", "1") != "0"


def _copy_model(src, dst):
    shutil.copytree(src, dst, ignore=lambda folder, names: [n for n in names if n in LEFT_OUT])


def install(folder_name, path):
    """Copy the shipped build `folder_name` to the cache folder `path` (atomically); False when none is shipped."""
    src = os.path.join(WEIGHTS_DIR, folder_name)
    if not enabled() or not os.path.isdir(src):
        return False
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    shutil.copytree(src, tmp, ignore=lambda folder, names: [n for n in names if n == MARKER])
    try:
        os.rename(tmp, path)
    except OSError:  # another process installed it first
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{folder_name}: copied from the shipped weights (tiny/weights/)", flush=True)
    return True


def install_trained(folder_name, out):
    """A shipped train_sft.py build: copied to `out`; returns (checkpoint path, held-out accuracy) or None."""
    marker = os.path.join(WEIGHTS_DIR, folder_name, MARKER)
    if not enabled() or not os.path.exists(marker) or not install(folder_name, out):
        return None
    with open(marker) as f:
        shipped = json.load(f)
    return os.path.join(out, shipped["checkpoint"]), shipped["heldout_accuracy"]


def _build(names, cache_dir):
    """Run the builders of `names` in a child process with its own cache (the cache folder is read at import);
    returns {name: (cache path, seconds)}."""
    code = ("import json, sys, time; from tiny import cache; out = {}\n"
            "for name, builder in json.loads(sys.argv[1]).items():\n"
            "    start = time.time(); path = getattr(cache, builder)()\n"
            "    out[name] = [path, round(time.time() - start, 1)]\n"
            "print('BUILT ' + json.dumps(out), flush=True)\n")
    env = {**os.environ, "MMGRPO_TINY_CACHE": cache_dir, "MMGRPO_TINY_SHIPPED": "0"}
    result = subprocess.run([sys.executable, "-c", code, json.dumps({n: BUILDERS[n] for n in names})], cwd=REPO,
                            env=env, check=True, stdout=subprocess.PIPE, text=True)
    line = [line for line in result.stdout.splitlines() if line.startswith("BUILT ")][-1]
    return {name: (os.path.join(REPO, path) if not os.path.isabs(path) else path, seconds)
            for name, (path, seconds) in json.loads(line[len("BUILT "):]).items()}


def _build_folder(path, cache_dir):
    """(cache folder name, checkpoint inside it or None) of a build's returned path."""
    rel = os.path.relpath(path, cache_dir)
    top, _, rest = rel.partition(os.sep)
    return top, rest or None


def save(names, cache_dir):
    """Build `names` in `cache_dir` (reusing what is there) and write their shipped folders."""
    for name, (path, seconds) in _build(names, cache_dir).items():
        top, checkpoint = _build_folder(path, cache_dir)
        old = shipped_folder(name)
        if old:
            shutil.rmtree(old)
        dst = os.path.join(WEIGHTS_DIR, top)
        if checkpoint:
            _copy_model(path, os.path.join(dst, checkpoint))
            with open(os.path.join(cache_dir, f"{top}.json")) as f:
                accuracy = json.load(f)["heldout_accuracy"]
            with open(os.path.join(dst, MARKER), "w") as f:
                json.dump({"checkpoint": checkpoint, "heldout_accuracy": accuracy}, f, indent=1)
        else:
            _copy_model(path, dst)
        _relative_paths(dst, cache_dir)
        print(f"{name}: {top} saved ({seconds:.0f} s to build)", flush=True)


def _relative_paths(folder, cache_dir):
    """A build summary names the folders it read by this machine's paths: ship them relative to the cache."""
    for file in NOT_COMPARED - {MARKER}:
        path = os.path.join(folder, file)
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.replace(os.path.abspath(cache_dir) + os.sep, "").replace(REPO + os.sep, ""))


def shipped_folder(name):
    """The shipped folder of build `name`, or None."""
    folders = [f for f in os.listdir(WEIGHTS_DIR) if f.rsplit("-", 1)[0] == name] if os.path.isdir(WEIGHTS_DIR) else []
    return os.path.join(WEIGHTS_DIR, folders[0]) if folders else None


def compare(shipped, rebuilt):
    """The files of the shipped folder that the rebuilt one lacks or has with other bytes (relative paths)."""
    bad = []
    for folder, _, files in os.walk(shipped):
        for file in files:
            rel = os.path.relpath(os.path.join(folder, file), shipped)
            if file in NOT_COMPARED:
                continue
            other = os.path.join(rebuilt, rel)
            if not os.path.exists(other) or not (filecmp.cmp(os.path.join(folder, file), other, shallow=False)
                                                 or _same_config(os.path.join(folder, file), other)):
                bad.append(rel)
    return bad


# keys of a saved config that say how the build loaded what it started from, not what the model is: the folder
# (diffusers writes it into the edit generator's configs) and whether the hub was offline (the tokenizer's config)
LOAD_KEYS = ("_name_or_path", "local_files_only")


def _same_config(a, b):
    """Two JSON configs equal but for LOAD_KEYS."""
    if not a.endswith(".json"):
        return False
    configs = []
    for path in (a, b):
        with open(path) as f:
            config = json.load(f)
        if isinstance(config, dict):
            for key in LOAD_KEYS:
                config.pop(key, None)
        configs.append(config)
    return configs[0] == configs[1]


def verify(names, cache_dir):
    """Retrain `names` in the empty `cache_dir` and compare each with its shipped folder; returns the mismatches."""
    mismatches = {}
    for name, (path, seconds) in _build(names, cache_dir).items():
        top, checkpoint = _build_folder(path, cache_dir)
        shipped = shipped_folder(name)
        if shipped is None or os.path.basename(shipped) != top:
            mismatches[name] = [f"shipped {shipped and os.path.basename(shipped)}, the code builds {top}"]
            continue
        bad = compare(shipped, os.path.join(cache_dir, top))
        if bad:
            mismatches[name] = bad
        print(f"{name}: {'same bytes' if not bad else 'DIFFERENT: ' + ', '.join(bad)} ({seconds:.0f} s to build)",
              flush=True)
    return mismatches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["save", "verify"])
    parser.add_argument("--only", nargs="+", choices=sorted(BUILDERS), help="these builds only (default: all)")
    parser.add_argument("--cache_dir", help="save: build in this cache (default: a new temporary one); verify: "
                        "retrain here (must not hold the builds already)")
    args = parser.parse_args(argv)
    names = args.only or list(BUILDERS)
    cache_dir = os.path.abspath(args.cache_dir or tempfile.mkdtemp(prefix="mmgrpo-tiny-rebuild-"))
    start = time.time()
    if args.command == "save":
        save(names, cache_dir)
        return 0
    mismatches = verify(names, cache_dir)
    print(f"{len(names) - len(mismatches)}/{len(names)} builds reproduce their shipped weights "
          f"({time.time() - start:.0f} s)", flush=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
