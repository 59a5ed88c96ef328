"""The flow-matching generator interface Mix-GRPO trains through, the sampler with SDE steps, and the step log-prob.

A generator (an adapter over a diffusers pipeline, in `utils.t2i.adapters`) offers:
  encode_condition(prompts, images=None, *, height, width, negative_prompt) -> FlowCondition   once per rollout
  velocity(latents, timestep, cond, guidance)   the pipeline's CFG (true CFG, norm rescale) + a guidance interval
  schedule(num_steps, latents, shift=None)      the pipeline's set_timesteps call (its mu, or a fixed shift)
  prepare_latents / decode / encode_image       the pipeline's latent packing and VAE normalisation
  add_lora or full_finetune / enable_gradient_checkpointing / reference()   training
`sample` runs ODE steps except at `sde_steps` and records those steps (`SDEStep`); `step_logprob` recomputes a
recorded step's log-prob, mean and std with the current weights and the rollout's guidance. Latents stay in fp32
between steps (the transformer sees its own dtype), so bf16 weights do not round the trajectory.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

from utils.core.models import adapters_disabled
from utils.t2i.guidance import Guidance, renormalize
from utils.t2i.sde import ode_step, sde_std_t, sde_step_from_std

DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def to_pil(images, image_processor):
    """PIL images, or a [B, 3, H, W] tensor in [0, 1] -> a list of PIL images (the pipelines' image input)."""
    if torch.is_tensor(images):
        return image_processor.numpy_to_pil(image_processor.pt_to_numpy(images.detach().float().cpu()))
    return [images] if not isinstance(images, (list, tuple)) else list(images)


def pipeline_schedule(scheduler, num_steps, device, sigmas, mu=None):
    """(timesteps, sigmas) as a pipeline's own `retrieve_timesteps` call sets them (its sigmas, its mu)."""
    kwargs = {} if mu is None else {"mu": mu}
    timesteps, _ = retrieve_timesteps(scheduler, num_steps, device, sigmas=sigmas, **kwargs)
    return timesteps.clone(), scheduler.sigmas.to(device).clone()


def _take(value, index):
    return value[index] if torch.is_tensor(value) else value


def _map_dict(d, fn):
    return None if d is None else {k: (fn(v) if torch.is_tensor(v) else v) for k, v in d.items()}


@dataclass
class FlowCondition:
    """What one batch of images is drawn from. Tensors in pos/neg/extra and the latents are batch-first; `shared`
    holds what every sample shares (position ids, RoPE shapes) and is never indexed."""

    pos: dict  # the prompt branch, as the adapter's forward takes it
    neg: dict | None  # the negative-prompt branch; None = no CFG
    height: int
    width: int
    image_latents: torch.Tensor | None = None  # image-conditioned edit: clean input-image tokens joined to the sequence
    init_latents: torch.Tensor | None = None  # SDEdit refine: clean latents of the previous image
    no_image: dict | None = None  # an edit's prompt branch without the input image (image CFG); None = none
    extra: dict = field(default_factory=dict)
    shared: dict = field(default_factory=dict)

    @property
    def batch_size(self):
        return next(v for v in self.pos.values() if torch.is_tensor(v)).shape[0]

    def map(self, fn):
        """Apply fn to every batch-first tensor (select, repeat, detach, move)."""
        return replace(self, pos=_map_dict(self.pos, fn), neg=_map_dict(self.neg, fn), extra=_map_dict(self.extra, fn),
                       no_image=_map_dict(self.no_image, fn),
                       image_latents=None if self.image_latents is None else fn(self.image_latents),
                       init_latents=None if self.init_latents is None else fn(self.init_latents))

    def select(self, index):
        index = torch.as_tensor(index, dtype=torch.long)
        return self.map(lambda t: t[index.to(t.device)])

    def repeat_interleave(self, n):
        return self.map(lambda t: t.repeat_interleave(n, dim=0))

    def detach(self):
        return self.map(torch.Tensor.detach)


@dataclass
class SDEStep:
    """One recorded SDE step of a batch: what the loss needs to recompute its log-prob (all [B] or [B, ...])."""

    index: torch.Tensor  # step index in the schedule
    timestep: torch.Tensor  # the scheduler's timestep (sigma * num_train_timesteps) the transformer was given
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    std_t: torch.Tensor  # std = std_t * sqrt(sigma - sigma_next)
    latents: torch.Tensor  # x before the step
    next_latents: torch.Tensor  # x after it
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor
    guidance: Guidance

    def select(self, index):
        index = torch.as_tensor(index, dtype=torch.long, device=self.latents.device)
        return replace(self, **{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    @staticmethod
    def cat(steps):
        """Join the steps of several rollouts (same guidance) into one training batch."""
        if any(s.guidance != steps[0].guidance for s in steps):
            raise ValueError("SDEStep.cat: steps with different guidance; recompute them separately")
        names = [f.name for f in fields(SDEStep) if f.name != "guidance"]
        return SDEStep(guidance=steps[0].guidance, **{n: torch.cat([getattr(s, n) for s in steps]) for n in names})


@dataclass
class FlowSample:
    images: torch.Tensor | list | None  # decoded images ([B, 3, H, W] in [0, 1] for output_type="pt")
    latents: torch.Tensor  # final latents (fp32, the adapter's packing)
    steps: list  # SDEStep per SDE step index, in step order
    timesteps: torch.Tensor
    sigmas: torch.Tensor  # the schedule, with the terminal 0
    noise: torch.Tensor  # the initial latents


def absent_components(name_or_path, components=None):
    """components, plus None for those the folder declares absent (e.g. a generator without text encoders,
    conditioned through `condition_from_embeds`), which the pipeline's from_pretrained needs passed explicitly."""
    from diffusers import DiffusionPipeline

    out = dict(components or {})
    for name, entry in DiffusionPipeline.load_config(name_or_path).items():
        if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] is None:
            out.setdefault(name, None)
    return out


class FlowGenerator:
    """Base of the adapters: CFG velocity, LoRA, checkpointing. Subclasses wrap one diffusers pipeline (`pipe`) and
    implement encode_condition, prepare_latents, schedule, forward (one branch's velocity), decode, encode_image."""

    pipeline_class = None
    lora_targets = DEFAULT_LORA_TARGETS
    cfg_renorm = False  # Qwen-Image rescales the guided velocity to the conditional norm
    channel_dim = -1  # the latents' channel axis, per latent token (packed latents); SD3's unpacked ones: 1
    cfg_batched = False  # one forward on [neg, pos] (SD3 does; set it where cfg_batchable: one forward per backward)
    cfg_batchable = True  # one forward on both branches gives what two give (Qwen-Image 2.1: no)

    def __init__(self, pipe):
        self.pipe = pipe
        self.transformer, self.vae, self.scheduler = pipe.transformer, pipe.vae, pipe.scheduler
        self.denoiser = self.transformer  # what forward calls: set it to the accelerate/DDP-wrapped transformer
        self.vae.requires_grad_(False)
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(pipe, name, None) is not None:
                getattr(pipe, name).requires_grad_(False)

    @classmethod
    def from_pretrained(cls, name_or_path, *, dtype=torch.float32, device=None, components=None, **options):
        """Load the adapter's pipeline (hub name or local folder); components override subfolders."""
        components = absent_components(name_or_path, components)
        pipe = cls.pipeline_class.from_pretrained(name_or_path, dtype=dtype, **components)
        if device is not None:
            pipe.to(device)
        return cls(pipe, **options)

    @property
    def device(self):
        return self.transformer.device

    @property
    def dtype(self):
        return self.transformer.dtype

    @property
    def cfg_allowed(self):
        return True

    # ---- CFG velocity ----------------------------------------------------------------------------------------

    def velocity(self, latents, timestep, cond, guidance=None):
        """The velocity the pipeline steps with (fp32), CFG included; timestep: the scheduler's, [B] or scalar."""
        guidance = guidance if guidance is not None else Guidance(scale=1.0)
        x = latents.to(self.dtype)
        t = torch.as_tensor(timestep, device=x.device, dtype=torch.float32).reshape(-1).expand(x.shape[0])
        on = guidance.active(t / self.scheduler.config.num_train_timesteps)
        if cond.neg is None or not self.cfg_allowed or not bool(on.any()):
            return self.forward(x, t, cond, cond.pos, guidance).float()
        v_pos, v = self._text_guided(x, t, cond, guidance)
        if guidance.image_scale > 1 and cond.no_image is not None:  # BAGEL's image CFG on the text-guided velocity
            v_free = self.forward(x, t, cond, cond.no_image, guidance).float()
            v = v_free + guidance.image_scale * (v - v_free)
        if guidance.renorm in ("global", "channel"):  # BAGEL's rescale of the fully guided velocity
            v = renormalize(v, v_pos, guidance.renorm, renorm_min=guidance.renorm_min, channel_dim=self.channel_dim)
        if not bool(on.all()):  # per-sample sigmas straddling the guidance interval: the conditional velocity there
            v = torch.where(on.reshape(-1, *([1] * (v.ndim - 1))), v, v_pos)
        return v

    def _text_guided(self, x, t, cond, guidance):
        """(the conditional velocity, the text-guided one after the text stage's rescale)."""
        if self.cfg_batched:
            both = self._merge_branches(cond.neg, cond.pos)
            double = cond.select(torch.cat([torch.arange(x.shape[0])] * 2))
            v_neg, v_pos = self.forward(torch.cat([x, x]), torch.cat([t, t]), double, both, guidance).float().chunk(2)
        else:
            v_pos = self.forward(x, t, cond, cond.pos, guidance).float()
            v_neg = self.forward(x, t, cond, cond.neg, guidance).float()
        v = v_neg + guidance.scale * (v_pos - v_neg)
        renorm = self.cfg_renorm if guidance.renorm is None else guidance.renorm
        if renorm is True or renorm == "text_channel":  # the pipeline's per-token rescale, or BAGEL's clamped one
            v = renormalize(v, v_pos, "pipeline" if renorm is True else renorm, renorm_min=guidance.renorm_min,
                            channel_dim=self.channel_dim)
        return v_pos, v

    def _merge_branches(self, neg, pos):
        return {k: torch.cat([neg[k], v]) if torch.is_tensor(v) else v for k, v in pos.items()}

    # ---- schedule helpers ----------------------------------------------------------------------------------

    def _scheduler(self, shift):
        # A fixed shift (R3: 3, t' = 3t / (1 + 2t)) replaces the pipeline's mu and what diffusers does after a
        # shift (Qwen-Image's shift_terminal 0.02 stretches the sigmas; karras / exponential / beta respace them).
        off = dict(shift_terminal=None, use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False)
        return self.scheduler if shift is None else type(self.scheduler).from_config(
            self.scheduler.config, use_dynamic_shifting=False, shift=shift, invert_sigmas=False, **off)

    # ---- training ---------------------------------------------------------------------------------------------

    def add_lora(self, r=16, alpha=None, dropout=0.0, target_modules=None, init_lora_weights="gaussian"):
        """LoRA on the transformer through peft; freezes everything else. Returns the trainable parameters
        (kept in fp32 under bf16 weights, as diffusers' LoRA scripts do). LoRA B starts at 0: same outputs."""
        from peft import LoraConfig

        self.transformer.requires_grad_(False)
        targets = target_modules or self.lora_targets  # names, or a str: one regex over module names (peft)
        self.transformer.add_adapter(LoraConfig(r=r, lora_alpha=alpha or r, lora_dropout=dropout,
                                                init_lora_weights=init_lora_weights,
                                                target_modules=targets if isinstance(targets, str) else list(targets)))
        params = [p for p in self.transformer.parameters() if p.requires_grad]
        for p in params:
            p.data = p.data.float()
        return params

    def full_finetune(self, reference=True):
        """Train every transformer weight (no LoRA); returns them. The reference of `reference()` is then a frozen
        copy of the transformer as it is now (a second copy in memory); reference=False: none (no image KL)."""
        self.transformer.requires_grad_(True)
        self.reference_transformer = copy.deepcopy(self.transformer).requires_grad_(False).eval() if reference else None
        return list(self.transformer.parameters())

    def trainable_parameters(self):
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def enable_gradient_checkpointing(self, enabled=True):
        if enabled:
            self.transformer.enable_gradient_checkpointing()
        else:
            self.transformer.disable_gradient_checkpointing()

    @contextmanager
    def reference(self):
        """The base transformer (LoRA off), for the image KL's reference mean; after full_finetune() its frozen copy.
        Without either it changes nothing."""
        frozen = getattr(self, "reference_transformer", None)
        if frozen is None:
            with adapters_disabled(self.transformer):
                yield
            return
        denoiser, self.denoiser = self.denoiser, frozen
        try:
            yield
        finally:
            self.denoiser = denoiser

    # ---- adapter hooks ----------------------------------------------------------------------------------------

    def encode_condition(self, prompts, images=None, *, height, width, negative_prompt=None, **kw):
        raise NotImplementedError

    def prepare_latents(self, batch_size, height, width, generator=None):
        raise NotImplementedError

    def schedule(self, num_steps, latents, shift=None):
        raise NotImplementedError

    def forward(self, x, timestep, cond, branch, guidance):
        raise NotImplementedError

    def decode(self, latents, height, width, output_type="pt"):
        raise NotImplementedError

    def encode_image(self, images, height, width):
        raise NotImplementedError

    def _prompts(self, prompts, negative_prompt):
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if negative_prompt is None:
            return prompts, None
        negs = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        return prompts, negs


def edit_start(num_steps, strength):
    """First step of an SDEdit refine run, as diffusers' img2img get_timesteps computes it."""
    return int(max(num_steps - min(num_steps * strength, num_steps), 0))


def _sde_rows(sde_steps, batch):
    """Each sample's sorted SDE steps: `sde_steps` is one list for the batch, or one per sample (all of one length)."""
    listed = any(isinstance(s, (list, tuple)) or (torch.is_tensor(s) and s.ndim > 0) for s in sde_steps)
    rows = [sorted({int(i) for i in s}) for s in sde_steps] if listed else [sorted({int(i) for i in sde_steps})] * batch
    if len(rows) != batch or len({len(r) for r in rows}) > 1:
        raise ValueError(f"sde_steps: {len(rows)} lists of SDE steps for a batch of {batch}, each needs as many SDE "
                         f"steps (got {sorted({len(r) for r in rows})})")
    return rows


@torch.no_grad()
def sample(gen, cond, *, num_steps, sde_steps=(), guidance=None, noise_level=0.7, noise_cap="flow_grpo",
           shift=None, generator=None, latents=None, edit_strength=0.6, output_type="pt"):
    """Draw cond.batch_size images: ODE steps except at the step indices in `sde_steps`, SDE steps whose transitions
    are recorded for training. `sde_steps`: one list for the batch (MixGRPO: a sliding window), or one per sample,
    all of one length (R3: one index per prompt group, so groups with different SDE steps share a batch).

    guidance: a Guidance (None = no CFG). noise_cap: "flow_grpo" | "r3" (std_t rule, see utils.t2i.sde). shift: a
    fixed timestep shift instead of the pipeline's own. generator: a torch.Generator or one per sample (a sample's
    noise then does not depend on the batch), for the initial noise (unless `latents` is given) and the SDE noise.
    A condition with init_latents (SDEdit refine) starts at edit_start(num_steps, edit_strength) from the previous
    image re-noised to that sigma. output_type: "pt" | "pil" | "np" | None (no decode). The result's `steps`: one
    SDEStep per SDE step of a sample (its first, second, ...), each over the whole batch."""
    batch = cond.batch_size
    noise = latents if latents is not None else gen.prepare_latents(batch, cond.height, cond.width, generator)
    noise = noise.to(gen.device, torch.float32)
    timesteps, sigmas = gen.schedule(num_steps, noise, shift=shift)
    start, x = 0, noise
    if cond.init_latents is not None:
        start = edit_start(num_steps, edit_strength)
        sigma0 = sigmas[start]  # the scheduler's scale_noise: sigma * noise + (1 - sigma) * image
        x = sigma0 * noise + (1 - sigma0) * cond.init_latents.to(noise)
    rows = _sde_rows(sde_steps, batch)
    if any(i < start or i >= num_steps for r in rows for i in r):
        raise ValueError(f"sde_steps {sde_steps} must lie in [{start}, {num_steps})")
    recorded = [[] for _ in range(batch)]  # each sample's SDE steps in order: (record, its row in the record)
    for i in range(start, num_steps):
        t = timesteps[i].expand(batch)
        v = gen.velocity(x, t, cond, guidance)
        x_next = ode_step(v, x, sigmas[i], sigmas[i + 1])
        sde = [b for b in range(batch) if i in rows[b]]
        if sde:  # these samples take an SDE step instead, each with its own generator's noise
            n, pick = len(sde), torch.tensor(sde, device=x.device)
            gens = [generator[b] for b in sde] if isinstance(generator, (list, tuple)) else generator
            std_t = sde_std_t(sigmas[i], noise_level=noise_level, sigma_max=sigmas[1], noise_cap=noise_cap)
            x_sde, log_prob, mean, std = sde_step_from_std(v[pick], x[pick], sigmas[i], sigmas[i + 1], std_t,
                                                           generator=gens)
            record = SDEStep(
                index=torch.full_like(pick, i), timestep=t[:n].clone(), sigma=sigmas[i].expand(n), latents=x[pick],
                sigma_next=sigmas[i + 1].expand(n), std_t=std_t.to(x.device).expand(n), next_latents=x_sde, mean=mean,
                std=std.reshape(n), log_prob=log_prob, guidance=guidance or Guidance(scale=1.0))
            for j, b in enumerate(sde):
                recorded[b].append((record, j))
            x_next[pick] = x_sde.to(x_next.dtype)
        x = x_next
    steps = []
    for parts in zip(*recorded):  # every sample's k-th SDE step, in batch order
        whole = all(r is parts[0][0] and j == b for b, (r, j) in enumerate(parts))  # one record of every sample
        steps.append(parts[0][0] if whole else SDEStep.cat([r.select([j]) for r, j in parts]))
    images = None if output_type is None else gen.decode(x, cond.height, cond.width, output_type=output_type)
    return FlowSample(images=images, latents=x, steps=steps, timesteps=timesteps, sigmas=sigmas, noise=noise)


def step_logprob(gen, cond, step, *, guidance=None):
    """Recompute recorded SDE step(s) with the current weights: (log_prob [B], mean, std [B]). Gradients flow
    into the transformer (and the condition, if it was encoded with grad). guidance defaults to the rollout's."""
    v = gen.velocity(step.latents, step.timestep, cond, guidance if guidance is not None else step.guidance)
    _, log_prob, mean, std = sde_step_from_std(v, step.latents, step.sigma, step.sigma_next, step.std_t,
                                               prev_sample=step.next_latents)
    return log_prob, mean, std.reshape(-1)
