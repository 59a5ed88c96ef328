"""Multi-turn rollouts with tools (`--tools`): generate, read the tool calls in the family's own format, run them,
append the tool messages as the chat template renders them, generate again, until the model answers or the budget
ends (docs/tools.md).

A trajectory is the prompt followed by one token row: the model's segments and the template's tool suffixes in turn.
`model_mask` is 1 on the model's own tokens and 0 on the tool suffixes (the end of the model's turn that the template
writes, the tool results, their image tokens, the opening of the model's next turn), so the loss and the KL see only
what the model sampled while every token stays in the context. The model's tokens are kept as sampled (never
decoded and re-tokenized) and a suffix's tokens are what the processor gives its text with the tool images, so a
plain forward over prompt + row scores each segment in the context it was sampled in.

Budgets, as TRL's loop has them: `max_completion_length` counts model and tool tokens; a tool suffix that would leave
no room for one more model token, or push prompt + row to the context limit, is not appended and the trajectory ends
truncated (TRL's `mask_truncated_completions` then leaves it out of the loss), as does a segment cut by the budget;
`max_iterations` bounds the rounds of tool calls (a call made after the last round is not run). Each segment's
sampling noise is seeded from the completion's seed and the segment number (`segment_seeds`), so a trajectory does
not depend on which other rows were still running: resume and any process count give the same trajectories.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from utils.core.encoding import encode_prompts
from utils.core.errors import InputError
from utils.core.seeds import _GOLDEN, _splitmix64
from utils.core.tool_formats import strip_stop_texts, template_messages

# Families whose tool images go through the image processor as flattened patches split by image_grid_thw, so a
# trajectory's images can be merged with its prompt's and packed (utils/core/trajectories.py).
TOOL_IMAGE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def segment_seeds(seeds, segment):
    """The sampling seeds of segment `segment` of each trajectory (segment 0: the completion's own seeds)."""
    seeds = torch.as_tensor(seeds, dtype=torch.long)
    if segment == 0:
        return seeds
    return _splitmix64(seeds + torch.full_like(seeds, int(segment)) * _GOLDEN)


@dataclass
class _Row:
    prompt: dict  # the prompt's own encoding (batch of one): input_ids [1, n] and the processor's other outputs
    prompt_images: list  # the prompt's images
    tool_images: list = field(default_factory=list)  # the images tools returned, in order
    ids: list = field(default_factory=list)  # the trajectory's tokens after the prompt
    model: list = field(default_factory=list)  # 1: sampled by the model, 0: written by the template / a tool
    logps: list = field(default_factory=list)  # the sampler's log-probs (vLLM), 0 on tool tokens
    side: dict = field(default_factory=dict)  # per-token side inputs of the tool suffixes (position -> {key: value})
    media: list = field(default_factory=list)  # the tool suffixes' pixel inputs, in order
    messages: list = field(default_factory=list)  # TRL's completion: assistant and tool messages
    segment: list = field(default_factory=list)  # the last segment's tokens
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    turns: int = 0
    tool_tokens: int = 0
    truncated: bool = False
    done: bool = False


@dataclass
class Trajectories:
    """One rollout's trajectories, right-padded [B, T] (see the module doc)."""

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor  # 1 on every token of the trajectory (model's and tools')
    model_mask: torch.Tensor  # 1 on the model's own tokens
    sampler_logps: torch.Tensor | None
    completion_inputs: dict | None  # the tool tokens' side inputs and images (None: no tool image anywhere)
    completions: list  # TRL's conversational completions: assistant messages (with tool_calls) and tool messages
    tool_images: list  # per trajectory, the images tools returned
    tool_calls: list  # per trajectory: calls made, calls that failed, calls that timed out, turns, tool tokens
    tool_errors: list
    tool_timeouts: list
    turns: list
    tool_tokens: list
    truncated: torch.Tensor  # [B] bool: cut by the budget or the context limit


def _per_token_keys(encoding):
    ids = encoding["input_ids"]
    return [k for k, v in encoding.items() if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)
            and v.shape == ids.shape]


def _media(encoding):
    return {k: v for k, v in encoding.items() if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)
            and v.shape != encoding["input_ids"].shape}


def context_batch(rows, pad_token_id, device):
    """The generation inputs of each row's prompt + trajectory so far: left-padded ids and per-token side inputs
    (the prompt's, the tool suffixes', 0 on the model's tokens), and every image's pixel inputs in sequence order."""
    keys = sorted({k for r in rows for k in _per_token_keys(r.prompt)})
    seqs, sides = [], {k: [] for k in keys}
    for r in rows:
        prompt = r.prompt["input_ids"][0].tolist()
        seqs.append(prompt + r.ids)
        for k in keys:
            values = r.prompt[k][0].tolist() if k in r.prompt else [0] * len(prompt)
            values += [r.side.get(t, {}).get(k, 0) for t in range(len(r.ids))]
            sides[k].append(values)
    width = max(map(len, seqs))
    batch = {"input_ids": torch.full((len(rows), width), pad_token_id, dtype=torch.long),
             "attention_mask": torch.zeros(len(rows), width, dtype=torch.long)}
    for k in keys:
        batch[k] = torch.zeros(len(rows), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        batch["input_ids"][i, width - len(seq):] = torch.tensor(seq)
        batch["attention_mask"][i, width - len(seq):] = 1
        for k in keys:
            batch[k][i, width - len(seq):] = torch.tensor(sides[k][i])
    media = [m for r in rows for m in [_media(r.prompt)] + r.media]
    for k in sorted({k for m in media for k in m}):
        batch[k] = torch.cat([m[k] for m in media if k in m])
    return {k: v.to(device) for k, v in batch.items()}


class ToolRollout:
    """The tool loop of one run: the tools, the family's format and the budgets. `generate(batch, seeds,
    max_new_tokens, images)` samples one segment per row of a `context_batch` (`images`: each row's images so far,
    for an engine that takes them apart from the ids) and returns (ids [B, L], mask [B, L], sampler log-probs
    [B, L] or None)."""

    def __init__(self, processor, toolbox, fmt, *, stop_ids, max_completion_length, max_iterations=None,
                 context_limit=None, model_type=None):
        self.processor, self.toolbox, self.fmt = processor, toolbox, fmt
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.stop_ids = set(int(i) for i in stop_ids)
        self.max_completion_length, self.max_iterations = max_completion_length, max_iterations
        self.context_limit, self.model_type = context_limit, model_type

    # ---- one round of tool calls ----

    def _decode(self, ids):
        return strip_stop_texts(self.tokenizer.decode(ids, skip_special_tokens=False), self.fmt.stop_texts)

    def _run_calls(self, row, message, bad_calls):
        """The tool messages answering `message`'s calls (and its unreadable ones), with their images."""
        tool_messages = []
        for error in bad_calls:
            row.errors += 1
            tool_messages.append(({"role": "tool", "name": "error", "content": [
                {"type": "text", "text": json.dumps({"error": error})}]}, []))
        for call in message.get("tool_calls", []):
            function = call["function"]
            result = self.toolbox.call(function["name"], function.get("arguments"),
                                       images=row.prompt_images + row.tool_images)
            row.errors += result.error is not None
            row.timeouts += result.timed_out
            if result.images and self.model_type not in TOOL_IMAGE_FAMILIES:
                raise InputError(f"tool {function['name']} returned an image, which --tools passes back to "
                                 f"{', '.join(TOOL_IMAGE_FAMILIES)} models only (this one is {self.model_type})")
            tool_messages.append(({"role": "tool", "name": function["name"], "content": result.content},
                                  result.images))
        row.calls += len(message.get("tool_calls", [])) + len(bad_calls)
        return tool_messages

    def _suffix(self, message, tool_messages, images):
        """The template's tokens after the model's stop token (tool results included) and their inputs."""
        text = self.fmt.tool_suffix(self.processor, message, template_messages(self.processor, [
            m for m, _ in tool_messages]))
        if images:
            encoding = self.processor(text=[text], images=[images], add_special_tokens=False, return_tensors="pt")
        else:
            encoding = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        return dict(encoding)

    def _extend(self, row, ids, model, logps=None, side=None):
        start = len(row.ids)
        row.ids += ids
        row.model += [model] * len(ids)
        row.logps += logps if logps is not None else [0.0] * len(ids)
        for k, values in (side or {}).items():
            for t, v in enumerate(values):
                if v:
                    row.side.setdefault(start + t, {})[k] = v

    def _take_segment(self, row, ids, logps):
        """Append a sampled segment (cut to the budget) and decide what follows it."""
        room = self.max_completion_length - len(row.ids)
        ids, logps = ids[:room], (logps[:room] if logps is not None else None)
        self._extend(row, ids, 1, logps)
        row.segment, row.turns = ids, row.turns + 1

    def _step(self, row, iteration):
        """After a segment: finish the row, or run its tool calls and append the tool suffix."""
        ended = bool(row.segment) and row.segment[-1] in self.stop_ids
        message, bad = self.fmt.parse(self._decode(row.segment))
        calls = message.get("tool_calls") or bad
        if not ended:  # cut by the budget (a half-written call is not run)
            row.truncated, row.done = True, True
            row.messages.append({"role": "assistant", "content": message["content"]})
            return
        row.messages.append(message)
        if not calls or (self.max_iterations is not None and iteration >= self.max_iterations):
            row.done = True
            return
        tool_messages = self._run_calls(row, message, bad)
        images = [img for _, imgs in tool_messages for img in imgs]
        suffix = self._suffix(message, tool_messages, images)
        ids = suffix["input_ids"][0].tolist()
        prompt_length = row.prompt["input_ids"].shape[1]
        over_budget = len(row.ids) + len(ids) >= self.max_completion_length
        over_context = self.context_limit is not None and prompt_length + len(row.ids) + len(ids) >= self.context_limit
        if over_budget or over_context:  # the results do not fit with a model token after them (TRL rolls back)
            row.truncated, row.done = True, True
            return
        for tool_message, imgs in tool_messages:
            it = iter(imgs)
            content = [dict(part, image=next(it)) if part["type"] == "image" else part
                       for part in tool_message["content"]]
            row.messages.append({**tool_message, "content": content})
        side = {k: suffix[k][0].tolist() for k in _per_token_keys(suffix)}
        self._extend(row, ids, 0, side=side)
        row.tool_tokens += len(ids)
        row.tool_images += images
        if images:
            row.media.append(_media(suffix))

    # ---- the loop ----

    def run(self, prompts, images, sample_ids, seeds, first, generate, *, pad_token_id, device, tools=None,
            keys=None):
        """Trajectories from the first segments `first` = (completion_ids, completion_mask, sampler log-probs or
        None), sampled from `prompts` (chat messages) with `images`, then as many tool rounds as the budget allows.
        Rows with equal `keys` share one prompt (encoded once)."""
        encodings = {}
        rows = []
        for k, (messages, imgs, sid) in enumerate(zip(prompts, images, sample_ids)):
            key = keys[k] if keys is not None else k
            if key not in encodings:
                encodings[key] = dict(encode_prompts(self.processor, [messages], [list(imgs)], sample_ids=[sid],
                                                     tools=tools))
            rows.append(_Row(prompt=encodings[key], prompt_images=list(imgs)))
        ids, mask, logps = first
        for k, row in enumerate(rows):
            n = int(mask[k].sum())
            self._take_segment(row, ids[k, :n].tolist(), logps[k, :n].tolist() if logps is not None else None)
        iteration = 0
        while True:
            for row in rows:
                if not row.done:
                    self._step(row, iteration)
            active = [k for k, row in enumerate(rows) if not row.done]
            if not active:
                break
            iteration += 1
            room = max(self.max_completion_length - len(rows[k].ids) for k in active)
            batch = context_batch([rows[k] for k in active], pad_token_id, device)
            seg_ids, seg_mask, seg_logps = generate(batch, segment_seeds(torch.as_tensor(seeds)[active], iteration),
                                                    room, [rows[k].prompt_images + rows[k].tool_images for k in active])
            for j, k in enumerate(active):
                n = int(seg_mask[j].sum())
                self._take_segment(rows[k], seg_ids[j, :n].tolist(),
                                   seg_logps[j, :n].tolist() if seg_logps is not None else None)
        return self._pack(rows, pad_token_id, device, with_logps=logps is not None)

    def _pack(self, rows, pad_token_id, device, with_logps):
        width = max(1, max(len(r.ids) for r in rows))
        B = len(rows)
        ids = torch.full((B, width), pad_token_id, dtype=torch.long)
        mask, model = torch.zeros(B, width, dtype=torch.long), torch.zeros(B, width, dtype=torch.long)
        logps = torch.zeros(B, width) if with_logps else None
        keys = sorted({k for r in rows for s in r.side.values() for k in s})
        side = {k: torch.zeros(B, width, dtype=torch.long) for k in keys}
        for i, r in enumerate(rows):
            n = len(r.ids)
            ids[i, :n], mask[i, :n], model[i, :n] = torch.tensor(r.ids), 1, torch.tensor(r.model)
            if logps is not None:
                logps[i, :n] = torch.tensor(r.logps)
            for t, values in r.side.items():
                for k, v in values.items():
                    side[k][i, t] = v
        media = [m for r in rows for m in r.media]
        completion_inputs = None
        if media:
            completion_inputs = dict(side)
            for k in sorted({k for m in media for k in m}):
                completion_inputs[k] = torch.cat([m[k] for m in media if k in m]).to(device)
            completion_inputs = {k: v.to(device) for k, v in completion_inputs.items()}
        return Trajectories(
            completion_ids=ids.to(device), completion_mask=mask.to(device), model_mask=model.to(device),
            sampler_logps=logps.to(device) if logps is not None else None, completion_inputs=completion_inputs,
            completions=[r.messages for r in rows], tool_images=[r.tool_images for r in rows],
            tool_calls=[r.calls for r in rows], tool_errors=[r.errors for r in rows],
            tool_timeouts=[r.timeouts for r in rows], turns=[r.turns for r in rows],
            tool_tokens=[r.tool_tokens for r in rows],
            truncated=torch.tensor([r.truncated for r in rows], device=device))



def context_limit(model, cfg=None):
    """The longest prompt + trajectory the run may build: vLLM's context window when it generates, else the model's
    position limit (None: none known)."""
    if cfg is not None and getattr(cfg, "use_vllm", False) and getattr(cfg, "vllm_max_model_len", None):
        return cfg.vllm_max_model_len
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


STATS = ("tool_calls", "tool_errors", "tool_timeouts", "turns", "tool_tokens")


def tool_metrics(stats, gather=None):
    """A step's tool metrics over its micro-batches' per-trajectory counts (every process's with `gather`, which
    takes a list and returns every process's lists concatenated): TRL's tools/call_frequency (calls per trajectory)
    and tools/failure_frequency (failed calls per call), and tools/timeouts, tools/turns, tools/tool_tokens (per
    trajectory)."""
    values = {k: [v for s in stats for v in s[k]] for k in STATS}
    if gather is not None:
        values = {k: list(gather(v)) for k, v in values.items()}
    n, calls = max(len(values["turns"]), 1), sum(values["tool_calls"])
    return {"tools/call_frequency": calls / n,
            "tools/failure_frequency": sum(values["tool_errors"]) / calls if calls else 0.0,
            "tools/timeouts": sum(values["tool_timeouts"]) / n, "tools/turns": sum(values["turns"]) / n,
            "tools/tool_tokens": sum(values["tool_tokens"]) / n}


def log_turns(messages, output_dir, step, name):
    """A trajectory's messages for completions.jsonl: each tool image saved as
    <output_dir>/completions/step-<step>/<name>-<k>.png and written as its relative path."""
    import os

    out, k = [], 0
    for message in messages:
        message = dict(message)
        if isinstance(message.get("content"), list):
            parts = []
            for part in message["content"]:
                if part.get("type") == "image" and part.get("image") is not None:
                    rel = os.path.join("completions", f"step-{step}", f"{name}-{k}.png")
                    os.makedirs(os.path.join(output_dir, os.path.dirname(rel)), exist_ok=True)
                    part["image"].save(os.path.join(output_dir, rel))
                    part, k = {"type": "image", "image": rel}, k + 1
                parts.append(part)
            message["content"] = parts
        out.append(message)
    return out
