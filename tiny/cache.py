"""The tiny built-in recipes: a from-scratch tiny VLM, the synthetic shapes data and the small models trained
from them, built on first use and cached under outputs/tiny-cache/ (docs/tiny.md says what such a model can
learn).

Model names `tiny`, `tiny-sft` (the GRPO warm start), `tiny-video-sft` (the video task's warm start), `tiny-base`
and `tiny-reasoner` (the OpenVLThinker cycle's base VLM and text reasoner, tiny/cycle.py), `tiny-planner` (the
Mix-GRPO warm start), `tiny-reflector` (tiny-planner also taught to reflect) and the data sets `synthetic:shapes`,
`synthetic:video` (tiny/video_shapes.py), `synthetic:edits` and `synthetic:reflect` (tiny/edits.py) resolve here;
`tiny_generator_path()` and `tiny_edit_generator_path()` build the tiny Qwen-Image generator and its edit sibling;
anything else is passed through untouched. `import tiny` registers `resolve_tiny_name` and `resolve_dataset` with
utils.core.names, through which the library resolves these names. The builds that train for minutes are shipped in
tiny/weights/ (tiny/shipped.py): where the code still gives a shipped folder's name, it is copied instead of trained.

A build calls library functions (tiny.models, tiny.shapes, ...) where one does the work. The trained ones run a
program in a process of their own: train_sft.py for the SFT builds (the SFT loop is the script's, as every loop is)
and `python -m tiny.generator` / `tiny.edit_generator` for the generators (their torch threads are pinned by their
config); a child process leaves the caller's threads and random state alone and gives the bytes that are shipped.

Over 400 lines on purpose: every tiny build's name, cache key and builder in one place, because the keys chain (the
reflector's holds the planner's and tiny-sft's specs, the edit generator's the generator's folder) and are read
together; a split by world (VQA / text-to-image) is the next step when it grows again.
"""

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys

import datasets
from datasets import DatasetDict

from tiny import cycle, edits, shapes, shipped, t2i, tokenizer, tools_task, video_shapes
from tiny.edits import make_edit_triples, reflector_rows
from tiny.generator_config import TinyEditGeneratorConfig, TinyGeneratorConfig
from tiny.models import make_tiny_llm, make_tiny_vlm
from tiny.reflector import describe_rows, reflector_sft_rows, with_eye
from tiny.shapes import make_shapes_vqa
from tiny.t2i import make_t2i_prompts, write_jsonl
from utils.core import image_tools
from utils.core.checkpoint import latest_checkpoint
from utils.core.config import ConfigError
from utils.core.data_sources import load_table
from utils.t2i import r3_format
from utils.t2i.r3_format import REASON_PROMPT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = "tiny"
TINY_SFT_MODEL = "tiny-sft"  # the tiny VLM after train_sft.py's tiny recipe: the warm start of tiny GRPO
TINY_VIDEO_SFT_MODEL = "tiny-video-sft"  # tiny-sft after SFT on the video task: the warm start of tiny video GRPO
TINY_BASE_MODEL = "tiny-base"  # the tiny VLM pre-trained to describe scenes: the cycle's base and captioner
TINY_REASONER_MODEL = "tiny-reasoner"  # the tiny text LLM trained to reason over scene descriptions
TINY_PLANNER_MODEL = "tiny-planner"  # a word-level tiny VLM taught to write scene plans: the Mix-GRPO warm start
TINY_REFLECTOR_MODEL = "tiny-reflector"  # tiny-planner also taught R3's reflect step: the warm start of both stages
TINY_GENERATOR = "tiny-generator"  # the tiny Qwen-Image generator (tiny/generator.py), conditioned on tiny-planner
TINY_EDIT_GENERATOR = "tiny-edit-generator"  # the tiny generator taught to edit (tiny/edit_generator.py)
TINY_DATASET = "synthetic:shapes"
TINY_VIDEO_DATASET = "synthetic:video"
TINY_TOOLS_DATASET = "synthetic:tools"  # the tiny tool task (tiny/tools_task.py), in TRL's conversational format
TINY_TOOLS_ZOOM_DATASET = "synthetic:tools-zoom"  # its held-out questions with the asked box zoomed (a check)
TINY_TOOLS_SFT_MODEL = "tiny-tools-sft"  # tiny-sft after SFT on tool-use traces: the warm start of tiny tool GRPO
TINY_EDITS_DATASET = "synthetic:edits"  # (scene, instruction, edited scene) triples: the edit generator's data
TINY_REFLECT_DATASET = "synthetic:reflect"  # sharegpt rows (prompt, flawed draft) -> reflection: the reflector's
TINY_RECIPE = os.path.join(REPO, "recipes", "tiny_grpo.yaml")
TINY_SFT_RECIPE = os.path.join(REPO, "recipes", "tiny_sft.yaml")
TINY_VIDEO_SFT_RECIPE = os.path.join(REPO, "recipes", "stages", "tiny_video_sft.yaml")
TINY_TOOLS_SFT_RECIPE = os.path.join(REPO, "recipes", "stages", "tiny_tools_sft.yaml")
TINY_TOOLS_EYE_RECIPE = os.path.join(REPO, "recipes", "stages", "tiny_tools_eye.yaml")
TINY_BASE_RECIPE = os.path.join(REPO, "recipes", "stages", "tiny_base.yaml")
TINY_REASONER_RECIPE = os.path.join(REPO, "recipes", "stages", "tiny_reasoner.yaml")
TINY_PLANNER_RECIPE = os.path.join(REPO, "recipes", "stages", "tiny_planner.yaml")
TINY_DESCRIBER_RECIPE = os.path.join(REPO, "recipes", "stages", "tiny_describer.yaml")
TINY_REFLECTOR_RECIPE = os.path.join(REPO, "recipes", "stages", "tiny_reflector.yaml")
PLANNER_ROWS = dict(n=4096, seed=0, image_size=32)  # the tiny generator's rows: plans of the renders it draws
# The planner's SFT adds rows whose prompts all name colours, drawn with their own seed (the job's prompts use 0 and
# 1). On the generator's rows alone, where a third of the prompts name one, whether the planner ever learnt to copy
# a colour depended on the build's seed (docs/results/2026-12-05-tiny-planner-untied.md).
PLANNER_COLOUR_ROWS = dict(n=2048, seed=7, tags=("colors", "color_attr"))
# The reflector's SFT rows: every reflect training row, with this many of the planner's rows replayed among them so
# the reason step is kept (R3 trains one model for both)
REFLECTOR_PLAN_ROWS = 2048
# The reflector first learns to say what a draft shows ("I see <its plan>") on drafts of another seed; straight from
# the reflect rows its "I see" got the colours right on 0.23 of held-out drafts, after this on 0.91
# (docs/results/2026-12-05-tiny-planner-untied.md)
DESCRIBE_ROWS = dict(n=8192, seed=7, image_size=32)
CACHE_DIR = os.environ.get("MMGRPO_TINY_CACHE", os.path.join("outputs", "tiny-cache"))

# Train and held-out splits come from different seeds, so no held-out image is seen in training.
# Counting questions (all shapes, or one colour) with objects in their own 28 px cells: what a model
# this small learns by SFT, and improves on with RL (docs/tiny.md).
SHAPES_KINDS = ["count", "count_color"]
SHAPES_SPLITS = {"train": dict(n=4000, seed=0, kinds=SHAPES_KINDS), "test": dict(n=256, seed=1, kinds=SHAPES_KINDS)}
# The GRPO recipe's validation rows (--val_split validation), from a third seed: it picks its checkpoint on them, never
# on the held-out split. Kept apart from SHAPES_SPLITS, which the SFT builds' cache keys hash (they train on train).
SHAPES_VALIDATION = dict(n=256, seed=2, kinds=SHAPES_KINDS)
# The video task's clips (8 frames at 4 fps, 84 x 84); train and held-out rows from different seeds.
VIDEO_SPLITS = {"train": dict(n=4000, seed=0), "test": dict(n=256, seed=1)}
# The reflect -> refine data (tiny/edits.py), at the tiny generator's image size; held-out rows from another seed.
EDIT_SPLITS = {"train": dict(n=4096, seed=0, image_size=32), "test": dict(n=256, seed=1, image_size=32)}
REFLECT_SPLITS = {"train": dict(n=4096, seed=0, image_size=32), "test": dict(n=256, seed=1, image_size=32)}
TINY_VLM = dict(family="qwen2_5_vl", hidden_size=128, num_hidden_layers=2, vision_depth=2, image_size=84, seed=0)
TINY_LLM = dict(hidden_size=128, num_hidden_layers=2, seed=0)
# The planner's base: the tiny VLM with every merge its tokenizer corpus has (~530 tokens; 1024 is more than there
# are), so each word of a plan is one token. On the 384-token vocabulary the planner never learns to read the
# prompt (docs/results/2026-12-02-tiny-planner-reads.md). Its LM head is its own: with tied embeddings the colour
# words collapse onto one vector and the planner never reads the prompt's colour
# (docs/results/2026-12-05-tiny-planner-untied.md).
TINY_PLANNER_VLM = dict(TINY_VLM, vocab_size=1024, tie_word_embeddings=False)


def _key(spec):
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def cached(name, spec, build):
    """Build `name` once per spec into CACHE_DIR/name-<hash>, atomically (tmp folder then rename; a failed
    build leaves nothing behind)."""
    path = os.path.join(CACHE_DIR, f"{name}-{_key(spec)}")
    if os.path.isdir(path) or shipped.install(os.path.basename(path), path):
        return path
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_vlm_path():
    return cached("tiny-vlm", TINY_VLM, lambda out: make_tiny_vlm(out, **TINY_VLM))


def tiny_llm_path():
    return cached("tiny-llm", TINY_LLM, lambda out: make_tiny_llm(out, **TINY_LLM))


def shapes_dataset_path():
    splits = {**SHAPES_SPLITS, "validation": SHAPES_VALIDATION}

    def build(out):
        DatasetDict({split: make_shapes_vqa(**spec) for split, spec in splits.items()}).save_to_disk(out)

    return cached("shapes", splits, build)


def video_dataset_path():
    """The video task's folder: clips/ and train.jsonl, test.jsonl (tiny/video_shapes.py)."""
    def build(out):
        for split, spec in VIDEO_SPLITS.items():
            video_shapes.save_video_vqa(out, split=split, **spec)

    return cached("video", _video_spec(), build)


def _video_spec():
    return {"splits": VIDEO_SPLITS, "source": _source(*[getattr(video_shapes, name) for name in (
        "_frames", "_direction", "_count_frames", "_last", "write_clip", "save_video_vqa")])}


def _edits_source():
    return _source(edits, t2i._t2i_row, t2i.layout_t2i, t2i.relative_position, t2i._box, shapes._place_in_cell,
                   shapes.draw_shape, shapes.render_objects, r3_format.NO_EDIT, r3_format.REFLECT_PROMPT)


def edits_dataset_path():
    """The edit triples (tiny.edits.make_edit_triples): a save_to_disk DatasetDict with EDIT_SPLITS."""
    def build(out):
        DatasetDict({split: make_edit_triples(**spec) for split, spec in EDIT_SPLITS.items()}).save_to_disk(out)

    return cached("edits", {"splits": EDIT_SPLITS, "source": _edits_source()}, build)


def reflect_dataset_path():
    """The reflector's sharegpt rows (tiny.edits.reflector_rows): a save_to_disk DatasetDict with REFLECT_SPLITS,
    read by train_sft.py's `--dataset_format sharegpt`."""
    def build(out):
        DatasetDict({split: sharegpt_dataset(reflector_rows(**spec))
                     for split, spec in REFLECT_SPLITS.items()}).save_to_disk(out)

    return cached("reflect", {"splits": REFLECT_SPLITS, "source": _edits_source()}, build)


def resolve_dataset(name):
    """The folder of a synthetic data set name (built on first use); any other name or path unchanged."""
    return SYNTHETIC_DATASETS[name]() if name in SYNTHETIC_DATASETS else name


def _trained(name, recipe, spec, args=()):
    """train_sft.py's `recipe` (plus `args`, or a function returning them: the model and data it starts from, built
    only when this trains), run once in its own process and reused while the recipe and `spec` stay the same (or
    copied from tiny/weights/ where that build is shipped); returns the run's last checkpoint."""
    with open(recipe) as f:
        spec = {"recipe": f.read(), **spec}
    key = _key(spec)
    marker = os.path.join(CACHE_DIR, f"{name}-{key}.json")
    if os.path.exists(marker):
        with open(marker) as f:
            path = json.load(f)["checkpoint"]
        if os.path.isdir(path):
            return path
    out = os.path.join(CACHE_DIR, f"{name}-{key}")
    installed = shipped.install_trained(os.path.basename(out), out)
    if installed:
        with open(marker, "w") as f:
            json.dump({"checkpoint": installed[0], "heldout_accuracy": installed[1]}, f)
        return installed[0]
    args = args() if callable(args) else args
    print(f"{name}: training with train_sft.py into {out} (once; cached afterwards)", flush=True)
    # a build killed before its marker was written starts over (the folder's half run is deleted, not mixed in)
    subprocess.run([sys.executable, os.path.join(REPO, "train_sft.py"), "--config", recipe, "--output_dir", out,
                    "--overwrite_output_dir", *args], check=True, env={**os.environ, "ACCELERATE_USE_CPU": "false"})
    path = latest_checkpoint(out)
    with open(os.path.join(out, "train_summary.json")) as f:
        summary = json.load(f)
    with open(marker, "w") as f:
        json.dump({"checkpoint": path, "heldout_accuracy": summary.get("heldout_accuracy")}, f)
    return path


def tiny_sft_path():
    """The warm start of tiny GRPO: train_sft.py's tiny recipe on the tiny VLM and the shapes data."""
    return _trained("tiny-sft", TINY_SFT_RECIPE, {"model": TINY_VLM, "data": SHAPES_SPLITS})


def tiny_video_sft_path():
    """The warm start of the tiny video task: tiny-sft (which has learnt to see the shapes and to answer in the
    CRYSTAL format) after a short SFT on the video clips (recipes/stages/tiny_video_sft.yaml)."""
    spec = {"tiny-sft": _tiny_sft_spec(), "video": _video_spec()}
    return _trained("tiny-video-sft", TINY_VIDEO_SFT_RECIPE, spec, lambda: [
        "--model_name_or_path", tiny_sft_path(), "--dataset_name", video_dataset_path()])


def _tools_spec():
    return {"splits": tools_task.SPLITS, "warm_start": tools_task.WARM_START,
            "source": _source(tools_task, image_tools.zoom_image, image_tools.fit_pixels, tokenizer._im_start_template,
                              tokenizer._QWEN_TOOLS_SYSTEM, tokenizer._QWEN_TOOL_CALLS)}


def tools_dataset_path():
    """The tiny tool task's rows (tiny/tools_task.py): a save_to_disk DatasetDict in TRL's conversational format."""
    def build(out):
        DatasetDict({split: tools_task.make_tools_dataset(**spec)
                     for split, spec in tools_task.SPLITS.items()}).save_to_disk(out)

    return cached("tools", _tools_spec(), build)


def tools_zoom_dataset_path():
    """The tool task's held-out rows with the asked box already zoomed ("What shape is this?"): can a model read the
    zoomed shape at all (tiny/tools_task.py)?"""
    return cached("tools-zoom", _tools_spec(), lambda out: DatasetDict(
        {"test": tools_task.make_tools_dataset(**tools_task.SPLITS["test"], zoom=True)}).save_to_disk(out))


def _tools_sft(name, recipe, start, spec, shares=None):
    """`recipe` (a stage of the tiny tool task's warm start) from the checkpoint `start()` on the warm-start rows of
    `shares` (tools_task.warm_start_rows), with the chat template that writes Qwen's tool format."""
    rows = {**tools_task.WARM_START, "shares": shares} if shares else tools_task.WARM_START
    return _trained(name, recipe, spec, lambda: [
        "--model_name_or_path", start(),
        "--dataset_name", cached(f"{name}-rows", {**spec, "rows": rows}, lambda out: tools_task.save_warm_start(
            tools_task.warm_start_rows(**rows), out)),
        "--chat_template_path", cached("tools-template", spec, tools_task.save_template)])


def tiny_tools_eye_path():
    """The first stage of the tiny tool task's warm start: tiny-sft after SFT on zoomed boxes alone ("What shape is
    this?"; recipes/stages/tiny_tools_eye.yaml), so that it reads the zoom before it learns to call the tool."""
    spec = {"tiny-sft": _tiny_sft_spec(), "tools": _tools_spec()}
    return _tools_sft("tiny-tools-eye", TINY_TOOLS_EYE_RECIPE, tiny_sft_path, spec, shares={"zoom": 1.0})


def tiny_tools_sft_path():
    """The warm start of the tiny tool task: tiny-tools-eye (tiny-sft after SFT on zoomed boxes) after SFT on tool-use
    traces (zoom into the asked colour's box, then answer), answers from the overview alone and zoomed boxes alone
    (tools_task.warm_start_rows; recipes/stages/tiny_tools_sft.yaml)."""
    with open(TINY_TOOLS_EYE_RECIPE) as f:
        spec = {"tiny-sft": _tiny_sft_spec(), "tools": _tools_spec(), "eye": f.read()}
    return _tools_sft("tiny-tools-sft", TINY_TOOLS_SFT_RECIPE, tiny_tools_eye_path, spec)


def _source(*objects):
    """The source of functions and modules (and the repr of constants): part of a cache key, so a changed row builder
    rebuilds what was made with it while other edits to its module do not."""
    return [inspect.getsource(o) if callable(o) or inspect.ismodule(o) else repr(o) for o in objects]


def sharegpt_dataset(rows):
    """sharegpt rows (id, messages, images when the rows have them, and any other text columns) as a Dataset."""
    message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    features = {key: datasets.Value("string") for key in rows[0]}
    features["messages"] = datasets.List(message)
    if "images" in rows[0]:
        features["images"] = datasets.List(datasets.Image())
    return datasets.Dataset.from_list(rows, features=datasets.Features(features))


def save_sharegpt(rows, out):
    """`sharegpt_dataset(rows)` as a save_to_disk folder."""
    sharegpt_dataset(rows).save_to_disk(out)
    return out


def _sharegpt_folder(name, spec, make_rows):
    """A save_to_disk folder of sharegpt rows made from the shapes training split, cached by `spec`."""
    def build(out):

        train = load_table(shapes_dataset_path(), split="train")
        save_sharegpt(make_rows([train[i] for i in range(len(train))]), out)

    return cached(name, spec, build)


def tiny_base_path():
    """The tiny cycle's base VLM: the tiny VLM trained to describe the shapes scenes (tiny/cycle.py)."""
    spec = {"model": TINY_VLM, "data": SHAPES_SPLITS,
            "rows": _source(cycle.caption_rows, cycle.scene_caption, cycle._objects, cycle.CAPTION_PROMPT)}
    return _trained("tiny-base", TINY_BASE_RECIPE, spec, lambda: [
        "--model_name_or_path", tiny_vlm_path(),
        "--dataset_name", _sharegpt_folder("captions", spec, cycle.caption_rows)])


def tiny_reasoner_path():
    """The tiny cycle's text reasoner: the tiny LLM trained to answer counting questions from scene
    descriptions, a share of its chains with a reflection (tiny/cycle.py)."""
    spec = {"model": TINY_LLM, "data": SHAPES_SPLITS,
            "rows": _source(cycle.reasoner_rows, cycle.reasoner_chain, cycle._counted, cycle.scene_caption,
                            cycle._objects, cycle.REASONER_PROMPT, cycle.REFLECTIONS)}
    return _trained("tiny-reasoner", TINY_REASONER_RECIPE, spec, lambda: [
        "--model_name_or_path", tiny_llm_path(),
        "--dataset_name", _sharegpt_folder("reasoner-chains", spec, cycle.reasoner_rows)])


def tiny_t2i_prompts(n, seed):
    """A cached prompts.jsonl of `n` tiny text-to-image rows (tiny.t2i.make_t2i_prompts with `seed`)."""
    folder = cached(f"t2i-prompts-{seed}", dict(n=n, seed=seed), lambda out: write_jsonl(
        make_t2i_prompts(n, seed=seed), os.path.join(out, "prompts.jsonl")))
    return os.path.join(folder, "prompts.jsonl")


def _planner_spec():
    return {"model": TINY_PLANNER_VLM, "rows": PLANNER_ROWS, "colour_rows": PLANNER_COLOUR_ROWS,
            "source": _source(t2i.planner_rows, t2i.scene_plan, t2i.layout_t2i, REASON_PROMPT, _planner_sft_rows)}


def _plan_rows(n):
    rows = t2i.make_t2i_prompts(PLANNER_ROWS["n"], seed=PLANNER_ROWS["seed"])[:n]
    return t2i.planner_rows(rows, REASON_PROMPT, image_size=PLANNER_ROWS["image_size"])


# Its source, imports included, is part of tiny-planner's cache key (and so of the shipped folder's name): its imports
# stay inside it, as the shipped build was made.
def _planner_sft_rows():
    """The planner's SFT rows: the generator's plan rows, then PLANNER_COLOUR_ROWS planned the same way."""
    from tiny import t2i
    from utils.r3_format import REASON_PROMPT

    spec = PLANNER_COLOUR_ROWS
    coloured = t2i.planner_rows(t2i.make_t2i_prompts(spec["n"], seed=spec["seed"], tags=spec["tags"]), REASON_PROMPT,
                                image_size=PLANNER_ROWS["image_size"])
    return _plan_rows(PLANNER_ROWS["n"]) + [dict(row, id=f"colour-{row['id']}") for row in coloured]


def tiny_planner_path():
    """The tiny Mix-GRPO policy's warm start: a fresh word-level tiny VLM (TINY_PLANNER_VLM) taught to answer
    train_mixgrpo's reason prompt with `<think>{scene plan}</think>` for the text-to-image rows the tiny generator is
    trained on and PLANNER_COLOUR_ROWS (tiny.t2i.scene_plan: the objects with a colour and a grid cell each)."""
    spec = _planner_spec()
    return _trained("tiny-planner", TINY_PLANNER_RECIPE, spec, lambda: [
        "--model_name_or_path", cached("tiny-planner-vlm", TINY_PLANNER_VLM,
                                       lambda out: make_tiny_vlm(out, **TINY_PLANNER_VLM)),
        "--dataset_name", cached("plans", spec, lambda out: save_sharegpt(_planner_sft_rows(), out))])


def _planner_eye_spec():
    with open(TINY_PLANNER_RECIPE) as f:
        return {"tiny-planner": _planner_spec(), "planner_recipe": f.read(), "eye": _tiny_sft_spec(),
                "source": _source(with_eye)}


def _planner_eye_path():
    """tiny-planner with tiny-sft's vision tower and merger: where the reflector's SFTs start."""
    return cached("planner-eye", _planner_eye_spec(), lambda out: with_eye(tiny_planner_path(), tiny_sft_path(), out))


def _describer_spec():
    return {"planner-eye": _planner_eye_spec(), "describe": DESCRIBE_ROWS,
            "source": _edits_source() + _source(describe_rows)}


def tiny_describer_path():
    """The reflector's first SFT: tiny-planner with tiny-sft's eye, taught to describe a draft under
    tiny.reflector.DESCRIBE_PROMPT -> "I see <the draft's plan>" (recipes/stages/tiny_describer.yaml)."""
    spec = _describer_spec()
    return _trained("tiny-describer", TINY_DESCRIBER_RECIPE, spec, lambda: [
        "--model_name_or_path", _planner_eye_path(),
        "--dataset_name", cached("describe-rows", spec, lambda out: save_sharegpt(
            describe_rows(reflector_rows(**DESCRIBE_ROWS)), out))])


def tiny_reflector_path():
    """The warm start of the tiny job's two stages: tiny-describer after SFT on the reflect rows
    (tiny.edits.reflector_rows) with planner rows replayed (recipes/stages/tiny_reflector.yaml)."""
    with open(TINY_DESCRIBER_RECIPE) as f:
        describer = {"recipe": f.read(), **_describer_spec()}
    spec = {"tiny-describer": describer, "reflect": REFLECT_SPLITS["train"], "plans": REFLECTOR_PLAN_ROWS,
            "source": _edits_source() + _source(reflector_sft_rows)}
    return _trained("tiny-reflector", TINY_REFLECTOR_RECIPE, spec, lambda: [
        "--model_name_or_path", tiny_describer_path(),
        "--dataset_name", cached("reflector-rows", spec, lambda out: save_sharegpt(reflector_sft_rows(
            reflector_rows(**REFLECT_SPLITS["train"]), _plan_rows(REFLECTOR_PLAN_ROWS)), out))])


SYNTHETIC_DATASETS = {TINY_DATASET: shapes_dataset_path, TINY_VIDEO_DATASET: video_dataset_path,
                      TINY_TOOLS_DATASET: tools_dataset_path, TINY_TOOLS_ZOOM_DATASET: tools_zoom_dataset_path,
                      TINY_EDITS_DATASET: edits_dataset_path, TINY_REFLECT_DATASET: reflect_dataset_path}
TINY_MODELS = {TINY_MODEL: tiny_vlm_path, TINY_SFT_MODEL: tiny_sft_path, TINY_VIDEO_SFT_MODEL: tiny_video_sft_path,
               TINY_TOOLS_SFT_MODEL: tiny_tools_sft_path,
               TINY_BASE_MODEL: tiny_base_path, TINY_REASONER_MODEL: tiny_reasoner_path,
               TINY_PLANNER_MODEL: tiny_planner_path, TINY_REFLECTOR_MODEL: tiny_reflector_path}


def resolve_tiny_name(name):
    """The folder of a tiny model name (built on first use); any other name or path unchanged."""
    return TINY_MODELS[name]() if name in TINY_MODELS else name


def tiny_recipe(recipe, *model_flags):
    """A script's default recipe (utils.core.config.parse_config's `default_recipe`): with no --config, `recipe` (a
    tiny one) is read under the flags given, so that each flag changes only itself; unless one of `model_flags` (the
    flags that name a model, or an endpoint that serves one) is given something other than a tiny model name (or
    none): a run on a model of its own starts from the script's defaults, as with a --config."""
    def pick(given):
        own = [flag for flag in model_flags if given.get(flag) is not None
               and str(given[flag]).lower() not in ("none", "null") and given[flag] not in TINY_MODELS]
        return None if own else recipe

    return pick


def _tiny_sft_spec():
    with open(TINY_SFT_RECIPE) as f:
        return {"recipe": f.read(), "model": TINY_VLM, "data": SHAPES_SPLITS}


def _text_encoder_spec(name):
    if name == TINY_SFT_MODEL:
        return {"tiny-sft": _tiny_sft_spec()}
    if name == TINY_MODEL:
        return {"tiny": TINY_VLM}
    if name == TINY_PLANNER_MODEL:  # the plan rows' source is part of it: a changed plan format rebuilds
        # its folder inside the cache, not the cache's own path: the key is the same wherever the cache lives
        return {"tiny-planner": os.path.relpath(tiny_planner_path(), CACHE_DIR)}
    return {"path": os.path.abspath(name)}


def tiny_generator_path(**overrides):
    """The tiny text-to-image generator: tiny/generator.py's defaults (or `overrides` of its config), pre-trained
    once in its own process (torch threads pinned by the config) and reused while the config and the text
    encoder's spec stay the same. Returns a QwenImagePipeline folder."""
    cfg = TinyGeneratorConfig(**overrides)  # bad overrides fail here, before anything is built
    # which text states condition it: the template's system prompt dropped as counted by the tokenizer
    # (utils.flow.adapters.template_prefix_length), so a build conditioned under diffusers' constant is not reused
    spec = {"generator": cfg.spec(), "text_encoder": _text_encoder_spec(cfg.text_encoder), "template_drop": "tokenizer"}
    if cfg.text_encoder in TINY_MODELS:  # build the VLM here, so the child only reads the cache
        TINY_MODELS[cfg.text_encoder]()

    def build(out):
        print(f"tiny generator: pre-training into {out} (once; cached afterwards)", flush=True)
        flags = [f"--{k}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in overrides.items()]
        env = {**os.environ, "MMGRPO_TINY_CACHE": os.path.abspath(CACHE_DIR)}
        subprocess.run([sys.executable, "-m", "tiny.generator", "--output_dir", out, *flags], check=True, cwd=REPO,
                       env=env)

    return cached(TINY_GENERATOR, spec, build)


def tiny_edit_generator_path(**overrides):
    """The tiny edit generator: tiny/edit_generator.py's defaults (or `overrides` of its config), trained once in its
    own process from the tiny generator (built first, here) on the edit triples, and reused while the config, the
    generator it starts from and the triples' source stay the same. Returns a QwenImageEditPipeline folder."""
    cfg = TinyEditGeneratorConfig(**overrides)  # bad overrides fail here, before anything is built
    base = tiny_generator_path() if cfg.generator == TINY_GENERATOR else os.path.abspath(cfg.generator)
    # a cached generator by its name (its hash), wherever the cache lives; another folder by its path
    generator = os.path.basename(base) if cfg.generator == TINY_GENERATOR else base
    spec = {"edit_generator": cfg.spec(), "generator": generator, "rows": _edits_source()}

    def build(out):
        print(f"tiny edit generator: training into {out} (once; cached afterwards)", flush=True)
        flags = [f"--{k}={v}" for k, v in dict(overrides, generator=base).items()]
        env = {**os.environ, "MMGRPO_TINY_CACHE": os.path.abspath(CACHE_DIR)}
        subprocess.run([sys.executable, "-m", "tiny.edit_generator", "--output_dir", out, *flags], check=True,
                       cwd=REPO, env=env)

    return cached(TINY_EDIT_GENERATOR, spec, build)


def resolve_tiny(cfg, accelerator):
    """(model path, dataset path) for a config, building the tiny pieces on the main process first."""
    with accelerator.main_process_first():
        model = resolve_tiny_name(cfg.model_name_or_path)
        data = resolve_dataset(cfg.dataset_name)
    return model, data


def resolve_tiny_t2i(cfg, accelerator):
    """Mix-GRPO's (VLM path, generator path, edit generator path or None, train prompts, held-out prompts), building
    the tiny pieces on the main process first: 'tiny' is the pre-trained tiny Qwen-Image generator (tiny/generator.py)
    and the VLM that reads for it: tiny-planner, or tiny-reflector (tiny-planner also taught R3's reflect step) when
    --reflect_refine is on; the 'tiny' edit generator is tiny-edit-generator; 'tiny' prompt files are synthetic
    shapes_t2i prompts."""
    for flag in ("generator_name_or_path", "edit_generator_name_or_path"):
        if getattr(cfg, flag) == TINY_MODEL and cfg.conditioning != "generator":
            # it was pre-trained on its own encoder's states; the planner's would condition it on what it never saw
            raise ConfigError(f"--{flag} tiny reads its own text encoder (the untrained tiny VLM): "
                              f"use --conditioning generator, not {cfg.conditioning}")
    if cfg.edit_generator_name_or_path == TINY_MODEL and cfg.generator_name_or_path != TINY_MODEL:
        raise ConfigError("--edit_generator_name_or_path tiny edits for --generator_name_or_path tiny "
                          f"(it reads that generator's encoder), not {cfg.generator_name_or_path}")
    with accelerator.main_process_first():
        gen = tiny_generator_path() if cfg.generator_name_or_path == TINY_MODEL else cfg.generator_name_or_path
        edit = cfg.edit_generator_name_or_path
        edit = tiny_edit_generator_path() if edit == TINY_MODEL else edit
        tiny_vlm = TINY_REFLECTOR_MODEL if cfg.reflect_refine else TINY_PLANNER_MODEL
        vlm = None if getattr(cfg, "text_free", False) else resolve_tiny_name(  # --text_free: no VLM
            tiny_vlm if cfg.model_name_or_path == TINY_MODEL else cfg.model_name_or_path)
        paths = []
        for value, n, seed in ((cfg.train_data_path, 2000, 0), (cfg.val_data_path, 256, 1)):
            paths.append(tiny_t2i_prompts(n, seed) if value == TINY_MODEL else value)
    return vlm, gen, edit, paths[0], paths[1]
