"""The flow-matching stack Mix-GRPO trains through, imported one way: `sde` (the SDE step with its log-prob, the
ODE step, the image KL) <- `generators` (the generator interface, the sampler with SDE steps, the step log-prob
recompute) <- `adapters` (diffusers pipelines behind that interface, their registry and `load_flow_generator`)."""
