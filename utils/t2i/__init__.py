"""Text-to-image (Mix-GRPO), imported one way: `sde` (the SDE step with its log-prob, the ODE step, the image KL)
<- `generators` (the generator interface, the sampler with SDE steps, the step log-prob recompute) <- `adapters`
(diffusers pipelines behind that interface, their registry and `load_flow_generator`) <- `mixgrpo_model` (the
policy) and `mixgrpo_eval`; `data` loads the prompt sets, `r3_format` writes and reads R3's prompts."""
