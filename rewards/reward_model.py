"""Text reward models by name, as TRL's `reward_funcs` takes a model id.

`--reward_funcs OpenAssistant/reward-model-deberta-v3-large-v2` (a hub id or a local folder holding a
`AutoModelForSequenceClassification` checkpoint with one label) scores each prompt + completion with that model:

- conversational prompts (ours always are) are rendered with the reward model's own chat template, prompt turns then
  the completion's assistant turn, no generation prompt; the text of multimodal content parts is kept and images
  are dropped (a text reward model cannot see them); plain-text prompts are concatenated with the completion;
- the texts are tokenized without special tokens (the template has them), padded on the right, and the model's
  score is the first logit at the last non-pad token (`pad_token_id` set from the tokenizer, its EOS if it has no
  pad token), exactly TRL's call;
- batched (`batch_size` texts per forward pass), under `torch.no_grad`, on `device` ("auto": this process's GPU,
  cuda:$LOCAL_RANK, else the CPU).

Options go through `--reward_kwargs '{"<name>": {"device": "cuda:1", "batch_size": 16, "dtype": "bfloat16",
"max_length": 2048}}'`.
"""

from __future__ import annotations

import os

from rewards.common import completion_text, content_text

DTYPES = ("auto", "float32", "bfloat16", "float16")


def is_reward_model_name(name: str) -> bool:
    """A local folder with a config.json, or a hub id (`owner/name`): what `get_reward` loads as a reward model."""
    if os.path.isdir(name):
        return os.path.isfile(os.path.join(name, "config.json"))
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_device(device: str):
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device {device!r} is not a torch device: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this machine has no CUDA GPU (use 'cpu' or 'auto')")
    return device


class TextRewardModel:
    """A sequence-classification checkpoint as a TRL-style reward function `f(prompts, completions, **columns)`."""

    def __init__(self, name_or_path: str, *, device: str = "auto", batch_size: int = 32, dtype: str = "auto",
                 max_length: int | None = None):
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} must be >= 1")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length {max_length} must be >= 1 or None")
        self.__name__ = name_or_path
        self.batch_size, self.max_length = int(batch_size), max_length
        self.device = resolve_device(device)
        try:
            config = AutoConfig.from_pretrained(name_or_path)
        except (OSError, ValueError) as err:
            raise ValueError(f"reward model {name_or_path!r} cannot be loaded: {str(err).splitlines()[0]}") from None
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(f"{name_or_path} is a classifier with {config.num_labels} labels; a reward model has "
                             "one (its single logit is the score)")
        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        if self.tokenizer.pad_token_id is None:  # TRL's rule: pad with EOS
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            name_or_path, num_labels=1, dtype=getattr(torch, dtype) if dtype != "auto" else "auto")
        # the score is read at the last token that is not padding: the model must know the pad id
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(self.device).eval().requires_grad_(False)

    def texts(self, prompts, completions) -> list[str]:
        """What the model reads: the chat-templated conversation (prompt turns + the completion), or prompt +
        completion for plain-text prompts."""
        if len(prompts) != len(completions):
            raise ValueError(f"reward {self.__name__!r}: {len(prompts)} prompts for {len(completions)} completions")
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str):
                out.append(prompt + completion_text(completion))
                continue
            if self.tokenizer.chat_template is None:
                raise ValueError(f"reward {self.__name__!r}: the prompts are chat messages and this reward model's "
                                 "tokenizer has no chat template to render them")
            turns = [dict(m, content=content_text(m.get("content"))) for m in prompt]
            turns.append({"role": "assistant", "content": completion_text(completion)})
            out.append(self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False))
        return out

    def __call__(self, prompts, completions, **columns) -> list[float]:
        import torch

        texts = self.texts(prompts, completions)
        scores = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                       padding_side="right", add_special_tokens=False,
                                       truncation=self.max_length is not None, max_length=self.max_length)
                logits = self.model(**batch.to(self.device)).logits
                scores += logits[:, 0].float().cpu().tolist()
        return scores

    def __repr__(self) -> str:
        return f"<reward model {self.__name__} on {self.device}>"
