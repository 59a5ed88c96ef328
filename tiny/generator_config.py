"""The tiny generators' build configs (tiny/generator.py's and tiny/edit_generator.py's flags) and their cache
keys. A module of its own so that tiny.cache keys and checks a build without importing the builder, which reads its
cached text encoders from tiny.cache: the arrows run generator -> cache -> generator_config, never back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TinyGeneratorConfig:
    output_dir: str = "outputs/tiny-generator"  # the QwenImagePipeline folder to write
    # the frozen VLM whose last hidden states condition it: tiny|tiny-sft|tiny-planner|a path. The untrained tiny VLM
    # keeps every word in its states; a trained tiny LM's last layer keeps only what predicts the next token, so a
    # colour or shape word moves its state by ~0.13 (normalised) against ~1.1, and the generator learns to ignore it
    text_encoder: str = "tiny"
    plan: bool = True  # condition on "prompt\nscene plan" as train_mixgrpo on prompt + reasoning; off: prompt alone
    image_size: int = 32  # px; the VAE halves it, and 2 x 2 latent patches make (image_size / 4)^2 image tokens
    train_rows: int = 4096  # synthetic rows (make_t2i_prompts seed `seed`), each rendered once as ground truth
    seed: int = 0
    threads: int = 1  # torch threads, pinned: the thread count changes float sums, and with them the cache
    negative_prompt: str = " "  # the adapter's default negative prompt, the unconditional branch of CFG

    # VAE (AutoencoderKLQwenImage)
    vae_base_dim: int = 8
    vae_z_dim: int = 4
    vae_dim_mult: list[int] = field(default_factory=lambda: [1, 2])  # one 2x down-sampling per entry after the first
    vae_steps: int = 600
    vae_batch_size: int = 16
    vae_lr: float = 3e-3  # AdamW (0.9, 0.99), 20 warm-up steps, cosine to 0, grad clip 1
    vae_ink_weight: float = 10.0  # squared-error weight of ink pixels and their 1 px ring (the canvas is mostly white)
    vae_kl_weight: float = 1e-4
    vae_latent_noise: float = 0.5  # decoder trained on latents + U(0, this) x (their std) noise: it learns to snap

    # Transformer (QwenImageTransformer2DModel)
    num_layers: int = 4
    num_attention_heads: int = 2
    attention_head_dim: int = 32
    shift: float = 1.0  # FlowMatchEulerDiscreteScheduler shift of the saved pipeline (sampling schedule)

    # Flow matching
    steps: int = 8000  # held-out 0.47 (0.32 with another row's plan); 3000 steps: 0.35 (docs/tiny.md)
    batch_size: int = 32
    learning_rate: float = 2e-3  # AdamW (0.9, 0.99), linear warm-up, cosine to 0, grad clip 1
    warmup_steps: int = 30
    cfg_dropout: float = 0.1  # share of rows trained on the negative prompt's encoding
    logit_mean: float = 0.0  # sigma = sigmoid(N(logit_mean, logit_std)) (SD3's logit-normal)
    logit_std: float = 1.0
    ema_decay: float = 0.995  # > 0: the saved transformer is the exponential moving average of its weights
    log_every: int = 50

    def __post_init__(self):
        factor = 2 ** len(self.vae_dim_mult)  # the VAE's down-sampling, then 2 x 2 latent patches per token
        if self.image_size % factor:
            raise ValueError(f"--image_size {self.image_size}: must be a multiple of {factor} (VAE "
                             f"{factor // 2}x down-sampling, then 2 x 2 latent patches)")
        if self.attention_head_dim % 4:
            raise ValueError(f"--attention_head_dim {self.attention_head_dim}: must be a multiple of 4 (3-axis RoPE)")
        if not 0 <= self.cfg_dropout < 1:
            raise ValueError(f"--cfg_dropout {self.cfg_dropout}: must be in [0, 1)")

    def spec(self) -> dict:
        """What the built weights depend on (the cache key): everything but where they are written."""
        return {k: v for k, v in self.__dict__.items() if k not in ("output_dir", "log_every")}


@dataclass
class TinyEditGeneratorConfig:
    """tiny/edit_generator.py's flags: the tiny generator taught to edit on the synthetic edit triples."""

    output_dir: str = "outputs/tiny-edit-generator"  # the QwenImageEditPipeline folder to write
    # the generator whose VAE, frozen text encoder, scheduler (and with warm_start, transformer) it starts from:
    # tiny-generator (tiny.cache.tiny_generator_path(), built on first use) or a Qwen-Image pipeline folder
    generator: str = "tiny-generator"
    warm_start: bool = True  # start from the generator's transformer; off: a fresh one of the same shape
    image_size: int = 32  # px, the generator's
    train_rows: int = 4096  # tiny.edits.edit_triples(train_rows, seed=seed): the first rows of synthetic:edits train
    seed: int = 0
    threads: int = 1  # torch threads, pinned (the thread count changes float sums, and with them the cache)
    negative_prompt: str = " "  # the adapter's default negative prompt, the text branch of CFG

    # Flow matching (the generator's loop, tiny.generator.fit_transformer)
    # held-out edit success 0.28 of 256 rows with zero_cond_t, kept 0.77 (identity 0.20); 3000 steps 0.25, kept 0.66
    # (without zero_cond_t 0.19, 0.55): docs/results/2026-12-04-tiny-edit-generator-variants.md
    steps: int = 5000
    batch_size: int = 32
    learning_rate: float = 3e-3  # AdamW (0.9, 0.99), linear warm-up, cosine to 0, grad clip 1 (1e-3: 0.04)
    warmup_steps: int = 30
    cfg_dropout: float = 0.1  # share of rows on the negative prompt's encoding (with their input image)
    image_dropout: float = 0.1  # share of rows without the input image: the branch image CFG guides against
    logit_mean: float = 0.0  # sigma = sigmoid(N(logit_mean, logit_std))
    logit_std: float = 1.0
    ema_decay: float = 0.995
    # Copying the input: the "no change" rows (a fifth of the triples) teach it directly
    # (at 1000 steps without zero_cond_t, against 0.07: copy_share 0.3 0.06, copy_steps 300 0.05)
    copy_share: float = 0.0  # share of each batch's rows swapped for a random "no change" row
    copy_steps: int = 0  # the first copy_steps steps train on "no change" rows alone (a copy-first curriculum)
    # the input image's tokens modulated at timestep 0 (as clean latents) while the noise tokens get the step's
    # timestep: the transformer's zero_cond_t (Qwen-Image-Edit-2511's), saved in its config
    zero_cond_t: bool = True
    log_every: int = 50

    def __post_init__(self):
        if not 0 <= self.copy_share <= 1 or self.copy_steps < 0:
            raise ValueError(f"--copy_share {self.copy_share} --copy_steps {self.copy_steps}: a share in [0, 1], "
                             "steps >= 0")
        if not (0 <= self.cfg_dropout and 0 <= self.image_dropout and self.cfg_dropout + self.image_dropout < 1):
            raise ValueError(f"--cfg_dropout {self.cfg_dropout} --image_dropout {self.image_dropout}: each >= 0, "
                             "their sum < 1")

    def spec(self) -> dict:
        """What the built weights depend on (the cache key, with the generator's): all but where they go, and the
        fields added after the first builds only when they differ from what those builds did (_LATER_FIELDS), so
        that those builds keep their keys."""
        return {k: v for k, v in self.__dict__.items() if k not in ("output_dir", "log_every", "generator")
                and not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}


# TinyEditGeneratorConfig's fields added after the first builds, at the values those builds had
_LATER_FIELDS = dict(copy_share=0.0, copy_steps=0, zero_cond_t=False)
