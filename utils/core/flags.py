"""The flag groups several scripts share, each a dataclass that a script's config includes as a base (its fields
and help written once here; `--help` and docs/flags.md show each as one group, utils.core.config_notes.flag_groups):

    ModelFlags        how a model loads and trains (train_grpo.py, train_sft.py; read by utils.core.models)
    ImageVideoFlags   the image and video processors' budget (train_grpo.py, train_sft.py, evaluate.py)
    CheckpointFlags   checkpoints, resume, the Hub and the run skeleton's own flags (the three training scripts;
                      utils.core.run, checkpoint, guards)
    HeldOutFlags      the held-out VQA evaluation of a training run (train_grpo.py, train_sft.py; utils.eval.heldout)

A script changes a shared flag's default by declaring the field again in its own body (train_sft.py's save_steps).
"""

from dataclasses import dataclass, field
from typing import Optional

from utils.core.config import choice


@dataclass
class ModelFlags:
    # model
    dtype: str = choice("auto", "float32", "bfloat16", "float16", help="weights dtype when loading")
    attn_implementation: Optional[str] = None  # attention: sdpa, eager, flash_attention_2...; none: the model's default
    freeze_vision_tower: bool = False  # freeze the vision encoder, its LoRA too (its projector stays trainable)
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    use_peft: bool = False  # train LoRA adapters instead of all weights
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA alpha (updates scaled by alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA branch input
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # modules LoRA wraps (or all-linear)


@dataclass
class ImageVideoFlags:
    # data: image and video inputs
    max_pixels: Optional[int] = None  # max pixels per image (Qwen-style image processors); none: the processor's
    min_pixels: Optional[int] = None  # min pixels per image (Qwen-style image processors); none: the processor's
    max_anyres_num: Optional[int] = field(default=None, metadata={
        "help": "max tiles per image (InternVL-style image processors); none: the processor's"})
    fps: Optional[float] = field(default=None, metadata={
        "help": "video frames sampled per second (a frame folder or list counts as a clip at this rate); none: 2"})
    max_frames: Optional[int] = field(default=None, metadata={
        "help": "most frames per video, floored to the model's temporal patch; none: the video processor's"})
    video_max_pixels: Optional[int] = field(default=None, metadata={
        "help": "max pixels per video frame (Qwen-style video processors); none: the video processor's"})
    video_min_pixels: Optional[int] = field(default=None, metadata={
        "help": "min pixels per video frame (Qwen-style video processors); none: the video processor's"})
    video_total_pixels: Optional[int] = field(default=None, metadata={
        "help": "pixels per video, shared by its frames (qwen-vl-utils' total_pixels); none: 128000 tokens' worth x "
                "0.9"})


@dataclass
class CheckpointFlags:
    # logging: checkpoints
    save_steps: int = 100  # checkpoint every N optimizer steps and at the end
    save_total_limit: Optional[int] = None  # keep the newest N checkpoints; none: keep all
    resume_from_checkpoint: Optional[str] = None  # checkpoint folder, or latest (newest in --output_dir); none: fresh
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "a fresh run into an --output_dir that holds another run deletes that run's checkpoints and logs "
                "first (HF's flag); without it such a run is refused"})
    # hub
    push_to_hub: bool = False  # upload every checkpoint to --hub_model_id (in the background)
    hub_model_id: Optional[str] = None  # Hub repository for --push_to_hub
    hub_private_repo: Optional[bool] = field(default=None, metadata={
        "help": "create the --hub_model_id repository private (HF's flag); none: the Hub's default visibility "
                "(public)"})
    # distributed
    ddp_timeout: int = 1800  # seconds a collective waits for the other processes before the run fails (HF's flag)
    # training
    max_skipped_steps: int = field(default=3, metadata={
        "help": "stop after this many optimizer steps in a row skipped for a NaN or infinite loss or gradient norm "
                "(utils/core/guards.py)"})


@dataclass
class HeldOutFlags:
    # logging: held-out evaluation (greedy answer accuracy on VQA rows)
    eval_dataset_name: Optional[str] = field(default=None,
                                             metadata={"help": "VQA set for held-out accuracy; none: no evaluation"})
    eval_split: str = "test"  # split of --eval_dataset_name
    eval_samples: Optional[int] = 256  # evaluate the first N questions; none: all
    eval_batch_size: int = 64  # prompts per generation batch in evaluation
    eval_max_new_tokens: int = 128  # max tokens per greedy evaluation answer
