"""Tiny diffusers flow pipelines built from configs, saved as folders: Qwen-Image (+ Edit, Edit Plus) on a tiny
Qwen2.5-VL, Qwen-Image 2.1 on a tiny Qwen3-VL, SD3 and FLUX.1 with offline CLIP/T5 tokenizers, FLUX.2 Klein. Random
weights; the tests compare our sampler with these pipelines' own `__call__`, and bench/bench_flow.py times them."""

import os

import torch

from tiny.models import make_tiny_vlm
from tiny.tokenizer import make_tiny_tokenizer

SIZE = 32  # the image size the tiny VAEs are built for

# The scheduler configs of the real checkpoints (their scheduler/scheduler_config.json), so that the tiny pipelines
# schedule as the real ones do: dynamic shifting, its image lengths, shift_terminal and the time-shift type all
# change the sigmas. Keys left out are diffusers' defaults (off).
QWEN_IMAGE_SCHEDULER = dict(  # Qwen/Qwen-Image; Qwen/Qwen-Image-Edit ships the same
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
QWEN_IMAGE_EDIT_SCHEDULER = dict(QWEN_IMAGE_SCHEDULER)
QWEN_IMAGE_EDIT_PLUS_SCHEDULER = dict(QWEN_IMAGE_SCHEDULER)  # Qwen/Qwen-Image-Edit-2509 and -2511 ship Qwen-Image's
# Qwen/Qwen-Image-2.1: its scheduler_config.json could not be read offline (QwenImage21Pipeline reads shift, base/max
# shift and image lengths from it, and `sample_sigmas` from the pipeline's own config), so Qwen-Image's stands in.
QWEN_IMAGE_21_SCHEDULER = dict(QWEN_IMAGE_SCHEDULER)
SD35_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)  # stabilityai/stable-diffusion-3.5-large (and medium)
FLUX1_DEV_SCHEDULER = dict(  # black-forest-labs/FLUX.1-dev
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096)
FLUX2_KLEIN_SCHEDULER = dict(  # black-forest-labs/FLUX.2-klein-4B (the pipeline passes its own empirical mu)
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")


def _qwenimage_parts(out_dir, vlm_hidden, layers, heads, head_dim, base_dim, seed):
    """The modules of a Qwen-Image edit pipeline on a tiny Qwen2.5-VL (saved under out_dir/_vlm)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    vlm_dir = make_tiny_vlm(os.path.join(out_dir, "_vlm"), hidden_size=vlm_hidden, num_attention_heads=2,
                            vision_hidden_size=32, seed=seed)
    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    processor = AutoProcessor.from_pretrained(vlm_dir)
    rope = (head_dim // 2, head_dim // 4, head_dim // 4)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=layers,
                                              attention_head_dim=head_dim, num_attention_heads=heads,
                                              joint_attention_dim=vlm_hidden, axes_dims_rope=rope)
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(base_dim=base_dim, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                                 latents_std=[1.5, 0.8, 1.0, 1.2])
    return dict(vae=vae, text_encoder=vlm, tokenizer=processor.tokenizer, processor=processor,
                transformer=transformer)


def make_tiny_qwenimage(out_dir, *, vlm_hidden=32, layers=2, heads=3, head_dim=16, base_dim=24, seed=0):
    """A QwenImageEditPipeline folder (its T2I sibling loads from it too) on a tiny Qwen2.5-VL. Returns out_dir."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline

    parts = _qwenimage_parts(out_dir, vlm_hidden, layers, heads, head_dim, base_dim, seed)
    QwenImageEditPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_EDIT_SCHEDULER),
                          **parts).save_pretrained(out_dir)
    return str(out_dir)


def make_tiny_qwenimage_edit_plus(out_dir, *, vlm_hidden=32, layers=2, heads=3, head_dim=16, base_dim=24, seed=0):
    """A QwenImageEditPlusPipeline folder (Qwen-Image-Edit 2509 / 2511: several input images) on a tiny
    Qwen2.5-VL: the same modules as `make_tiny_qwenimage`. Returns out_dir."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline

    parts = _qwenimage_parts(out_dir, vlm_hidden, layers, heads, head_dim, base_dim, seed)
    QwenImageEditPlusPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_EDIT_PLUS_SCHEDULER),
                              **parts).save_pretrained(out_dir)
    return str(out_dir)


def make_tiny_qwenimage21(out_dir, *, vlm_hidden=32, layers=2, heads=2, head_dim=16, z_dim=8, seed=0):
    """A QwenImage21Pipeline folder (Qwen-Image 2.1): a tiny Qwen3-VL text encoder (16 px patches merged 2x2, so
    one image token per 32 px tile, which the transformer fills with 2x2 latent tokens of the 16x VAE), the
    single-stream block-causal transformer, the RGBA video VAE with 16x spatial compression. Returns out_dir."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    vlm_dir = make_tiny_vlm(os.path.join(out_dir, "_vlm"), family="qwen3_vl", hidden_size=vlm_hidden,
                            num_attention_heads=2, vision_hidden_size=32, seed=seed)
    vlm = Qwen3VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    processor = AutoProcessor.from_pretrained(vlm_dir)
    torch.manual_seed(seed)
    transformer = QwenImage21Transformer2DModel(patch_size=1, in_channels=z_dim, out_channels=z_dim, num_layers=layers,
                                                attention_head_dim=head_dim, num_attention_heads=heads,
                                                context_in_dim=vlm_hidden, mlp_ratio=2,
                                                axes_dims_rope=(4, head_dim // 2 - 2, head_dim // 2 - 2))
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False, True, True, True],
                                   latents_mean=(torch.rand(z_dim, generator=g) - 0.5).tolist(),
                                   latents_std=(torch.rand(z_dim, generator=g) + 0.5).tolist())
    QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_21_SCHEDULER), vae=vae,
                        text_encoder=vlm, processor=processor, transformer=transformer).save_pretrained(out_dir)
    return str(out_dir)


def _clip_tokenizer(out_dir):
    """A CLIP BPE with no merges over the byte alphabet (each character a token), written offline."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        for piece in (ch, ch + "</w>"):
            vocab.setdefault(piece, len(vocab))
    tok = CLIPTokenizer(vocab=vocab, merges=[])
    tok.model_max_length = 77
    tok.save_pretrained(out_dir)
    return CLIPTokenizer.from_pretrained(out_dir)


def _t5_tokenizer(out_dir):
    """A T5 unigram over characters and a few words, written offline."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"]
    pieces += [("\u2581" + w, -1.0) for w in ("a", "photo", "of", "red", "blue", "circle", "square", "two", "the")]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0)
    tok.save_pretrained(out_dir)
    return T5Tokenizer.from_pretrained(out_dir)


def _clip_encoder(tok, cls, seed, hidden=32):
    from transformers import CLIPTextConfig

    torch.manual_seed(seed)
    return cls(CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=37, num_hidden_layers=2,
                              num_attention_heads=4, projection_dim=hidden, max_position_embeddings=77,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, hidden_act="gelu")).eval()


def _t5_encoder(tok, d_model, seed):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(vocab_size=len(tok), d_model=d_model, d_ff=64, d_kv=16, num_layers=1,
                                   num_heads=2, decoder_start_token_id=0)).eval()


def _vae_kl(latent_channels, seed, **kw):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, norm_num_groups=4, sample_size=SIZE, **kw)


def make_tiny_sd3(out_dir, *, layers=1, heads=4, head_dim=8, seed=0):
    """A StableDiffusion3Pipeline folder: two tiny CLIPs, a tiny T5, offline tokenizers. Returns out_dir."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    clip_tok = _clip_tokenizer(os.path.join(out_dir, "_clip_tok"))
    t5_tok = _t5_tokenizer(os.path.join(out_dir, "_t5_tok"))
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(sample_size=SIZE // 2, patch_size=2, in_channels=4, out_channels=4,
                                        num_layers=layers, attention_head_dim=head_dim, num_attention_heads=heads,
                                        caption_projection_dim=32, joint_attention_dim=64, pooled_projection_dim=64)
    StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD35_SCHEDULER),
        vae=_vae_kl(4, seed, shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=_clip_encoder(clip_tok, CLIPTextModelWithProjection, seed), tokenizer=clip_tok,
        text_encoder_2=_clip_encoder(clip_tok, CLIPTextModelWithProjection, seed + 1), tokenizer_2=clip_tok,
        text_encoder_3=_t5_encoder(t5_tok, 64, seed), tokenizer_3=t5_tok,
    ).save_pretrained(out_dir)
    return str(out_dir)


def make_tiny_flux(out_dir, *, seed=0):
    """A FluxPipeline folder (FLUX.1-dev style: guidance-distilled). Returns out_dir."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    clip_tok = _clip_tokenizer(os.path.join(out_dir, "_clip_tok"))
    t5_tok = _t5_tokenizer(os.path.join(out_dir, "_t5_tok"))
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 4, 8], guidance_embeds=True)
    FluxPipeline(
        transformer=transformer, vae=_vae_kl(4, seed, shift_factor=0.1159, scaling_factor=0.3611),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX1_DEV_SCHEDULER),
        text_encoder=_clip_encoder(clip_tok, CLIPTextModel, seed), tokenizer=clip_tok,
        text_encoder_2=_t5_encoder(t5_tok, 32, seed), tokenizer_2=t5_tok,
    ).save_pretrained(out_dir)
    return str(out_dir)


def make_tiny_klein(out_dir, *, seed=0):
    """A Flux2KleinPipeline folder: tiny Qwen3 text encoder (the project's tiny tokenizer), tiny FLUX.2 VAE."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = make_tiny_tokenizer("qwen2")
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                          timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
                                          guidance_embeds=False)
    torch.manual_seed(seed)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=16,
                                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                                head_dim=8, max_position_embeddings=512)).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(sample_size=SIZE, in_channels=3, out_channels=3, latent_channels=4,
                             block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=4,
                             use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():  # non-trivial latent batch-norm statistics
        vae.bn.running_mean.uniform_(-0.2, 0.2)
        vae.bn.running_var.uniform_(0.5, 1.5)
    Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_KLEIN_SCHEDULER), vae=vae,
                       text_encoder=text_encoder, tokenizer=tok, transformer=transformer).save_pretrained(out_dir)
    return str(out_dir)
