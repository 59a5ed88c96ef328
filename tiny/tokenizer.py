"""The tiny world's tokenizer: one byte-level BPE trained on the synthetic questions and answer formats, with
the special tokens and chat template of each VLM family (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, Qwen3.5, Gemma 3, Gemma 4,
InternVL, GLM-4.1V, SmolVLM, LLaVA-OneVision): each family's turn markers, role names and image placeholder, as its
released template renders them (system prompts defaults and thinking blocks left out).

Each answer word of the synthetic tasks is a single token, so an answer is one sampling decision.
"""

from __future__ import annotations

import json

# Words the synthetic tasks answer with: each must be one token so an answer is one sampling decision.
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "gray", "pink", "brown", "cyan")
SHAPES = ("circle", "square", "triangle")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# JSON punctuation is split off before BPE so `"]` or `":` never merge and the digits are split one by one.
JSON_PUNCTUATION = ("{", "}", "[", "]", '"', ":", ",")
FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
SINGLE_TOKEN_WORDS = COLOURS + SHAPES + ("yes", "no", "left", "right")

DEFAULT_BPE_VOCAB = 384  # 256 byte symbols + 128 merges; the family's special tokens come on top

FAMILIES = ("qwen2_5_vl", "internvl", "glm4v")  # the first three, which the loader and SFT tests run through
# Every family make_tiny_vlm builds (tests/test_families.py runs each through the log-prob, SFT and vLLM checks).
ALL_FAMILIES = FAMILIES + ("qwen2_vl", "qwen3_vl", "qwen3_5", "gemma3", "gemma4", "internvl3_5", "smolvlm",
                           "llava_onevision")




def tokenizer_corpus() -> list[str]:
    """The text the tiny tokenizer is trained on: the synthetic shapes questions and the answer formats."""
    lines = []
    plural = {s: s + "s" for s in SHAPES}
    for i, colour in enumerate(COLOURS):
        shape = SHAPES[i % len(SHAPES)]
        other = COLOURS[(i + 3) % len(COLOURS)]
        n = i % 4 + 1
        lines += [
            f"How many {plural[shape]} are in the image?",
            f"How many {colour} {plural[shape]} are there?",
            f"How many {colour} shapes are there?",
            f"Are there more {colour} shapes than {other} shapes?",
            f"There is one {shape} in the image. The {shape} is in the top left.",
            f"There are {n} {plural[shape]} in the middle center and the bottom right.",
            f"I see a {colour} {shape} in the top right. The other shapes are {other}.",
            f"{n} is more than {n - 1}, so yes. {n - 1} is fewer than {n}, so no.",
            f"So the {colour} {shape} is {'left' if i % 2 else 'right'} of the {other} {shape}.",
            f"What colour is the {shape}?",
            f"What color is the {shape} on the {'left' if i % 2 else 'right'}?",
            f"Is there a {colour} {shape} in the image?",
            f"Is the {colour} {shape} left or right of the {other} {SHAPES[(i + 1) % 3]}?",
            f"Which shape is {colour}?",
            f"Count the {colour} objects. Answer with a number.",
            f"Answer yes or no. Are there {NUMBER_WORDS[n]} {plural[shape]}?",
            f"{colour} {shape} at row {i % 3}, column {(i + 1) % 3}.",
            f"A) {colour}\nB) {other}\nC) {COLOURS[(i + 5) % len(COLOURS)]}\nD) {COLOURS[(i + 7) % len(COLOURS)]}",
            "Answer with the option's letter from the given choices directly.",
            f"a photo of {NUMBER_WORDS[n]} {colour} {plural[shape]}",
            f"a photo of a {colour} {shape} and a {other} {SHAPES[(i + 2) % 3]}",
            f"Make the {shape} {other}. No further edit needed.",
            # CRYSTAL JSON-steps output
            json.dumps(
                {
                    "reasoning_steps": [
                        f"I see {n} {colour} {plural[shape]} in the image.",
                        f"The {shape} on the left is {colour}.",
                        f"So the answer is {n}.",
                    ],
                    "answer": str(n),
                }
            ),
            json.dumps({"reasoning_steps": [f"The {shape} is {colour}."], "answer": colour}),
            # R1-style output
            f"<think>I see {n} {plural[shape]}. The first one is {colour}. Wait, let me count again.</think>"
            f"<answer>{n}</answer>",
            f"<think>The {shape} is {colour}.</think><answer>{colour}</answer>",
            f"<think>It is on the {'left' if i % 2 else 'right'}.</think><answer>{'yes' if i % 2 else 'no'}</answer>",
        ]
    lines += [
        "system", "user", "assistant", "You are a helpful assistant.",
        "Think step by step inside <think> </think> tags, then give the final answer inside <answer> </answer>.",
        "Output a JSON object with keys reasoning_steps and answer.",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 100",
        "yes no left right top bottom middle above below next to",
    ]
    return lines


def _training_iterator():
    # Repeat the answer words, bare and after a space, so BPE merges them into whole tokens first.
    yield from tokenizer_corpus()
    for _ in range(40):
        yield from SINGLE_TOKEN_WORDS
        yield " " + " ".join(SINGLE_TOKEN_WORDS)


def _train_bpe(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r'[{}\[\]":,]'), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(_training_iterator(), trainer=trainer)
    for word in SINGLE_TOKEN_WORDS:
        for form in (word, " " + word):
            if len(tok.encode(form).ids) != 1:
                raise RuntimeError(f"tiny tokenizer: {form!r} is not a single token; raise vocab_size ({vocab_size})")
    return tok


# Chat templates, one per family, in each family's own style. `{% generation %}` marks assistant text so
# `apply_chat_template(..., return_assistant_tokens_mask=True)` can mask prompts in SFT.
_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or item['type'] == 'image_url' -%}{{- IMAGE -}}"
    "{%- elif item['type'] == 'video' -%}{{- VIDEO -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
)


# Qwen's tool format (Qwen2.5, Qwen3, Qwen3-VL): the tools' JSON schemas in the system turn inside <tools></tools>,
# each call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` in the assistant turn, tool results in
# a user turn as `<tool_response>\n...\n</tool_response>` (consecutive results share the turn). As the other tiny
# templates leave out their default system prompts, this one leaves out Qwen's English instructions around the
# schemas (hundreds of byte-level tokens the tiny model cannot read); calls and results are rendered as Qwen3-VL's
# template renders them.
_QWEN_TOOLS_SYSTEM = (
    "{{- '<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
)
_QWEN_TOOL_CALLS = (
    "{%- if message.tool_calls -%}{%- for tool_call in message.tool_calls -%}"
    "{%- if (loop.first and message['content']) or (not loop.first) -%}{{- '\\n' -}}{%- endif -%}"
    "{%- if tool_call.function -%}{%- set tool_call = tool_call.function -%}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' -}}"
    "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}"
    "{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
)


def _im_start_template(image: str, video: str) -> str:
    """ChatML (<|im_start|>role ... <|im_end|>), the format of Qwen2.5-VL and of InternVL3, with Qwen's tool format
    (`tools=`, assistant `tool_calls`, `tool` messages); conversations without tools render as plain ChatML."""
    content = _CONTENT.replace("IMAGE", repr(image)).replace("VIDEO", repr(video))
    return (
        "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
        "{%- if messages[0]['role'] == 'system' -%}{%- set message = messages[0] -%}" + content +
        "{{- '\\n\\n' -}}{%- endif -%}" + _QWEN_TOOLS_SYSTEM + "{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if tools and loop.first and message['role'] == 'system' -%}"
        "{%- elif message['role'] == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' -}}" + content + "{{- '\\n</tool_response>' -}}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- else -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['role'] == 'assistant' -%}{%- generation -%}" + content + _QWEN_TOOL_CALLS +
        "{{- '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
        "{%- else -%}" + content + "{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def _glm4v_template() -> str:
    """GLM-4V: `[gMASK]<sop><|user|>\n...<|assistant|>\n...`. GLM stops at the next role tag or at
    <|endoftext|>; assistant turns end with <|endoftext|> so SFT teaches the tiny model to stop."""
    content = _CONTENT.replace("IMAGE", repr("<|begin_of_image|><|image|><|end_of_image|>")).replace(
        "VIDEO", repr("<|begin_of_video|><|video|><|end_of_video|>")
    )
    return (
        "{{- '[gMASK]<sop>' -}}"
        "{%- for message in messages -%}"
        "{{- '<|' + message['role'] + '|>\n' -}}"
        "{%- if message['role'] == 'assistant' -%}{%- generation -%}" + content + "{{- '<|endoftext|>' -}}"
        "{%- endgeneration -%}"
        "{%- else -%}" + content + "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
    )


def _gemma3_template() -> str:
    """Gemma 3: `<bos><start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n`; the assistant role is
    `model`, a system turn is prepended to the first user turn, an image is `<start_of_image>` (the processor
    expands it to `\n\n<start_of_image>` + soft tokens + `<end_of_image>\n\n`)."""
    content = _CONTENT.replace("IMAGE", repr("<start_of_image>")).replace("VIDEO", repr("<start_of_image>"))
    return (
        "{{- bos_token -}}"
        "{%- set ns = namespace(system='') -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}{%- set ns.system = (message['content'] if message['content'] is "
        "string else message['content'][0]['text']) + '\n\n' -%}"
        "{%- else -%}"
        "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}"
        "{%- if message['role'] == 'user' -%}{{- ns.system -}}{%- set ns.system = '' -%}{%- endif -%}"
        "{%- if message['role'] == 'assistant' -%}{%- generation -%}" + content + "{{- '<end_of_turn>' -}}"
        "{%- endgeneration -%}{{- '\n' -}}"
        "{%- else -%}" + content + "{{- '<end_of_turn>\n' -}}{%- endif -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
    )


def _gemma4_template() -> str:
    """Gemma 4 (its documented prompt format; the template itself ships only with the hub checkpoints):
    `<bos><|turn>system\n...<turn|>\n<|turn>user\n...<turn|>\n<|turn>model\n`, the assistant role `model`, turns
    closed by `<turn|>`; an image is the `<|image|>` placeholder, which the processor expands to `<|image>`, the
    image's soft tokens and `<image|>`. Thinking (`<|think|>`, `<|channel>`) is left out, as for the other families."""
    content = _CONTENT.replace("IMAGE", repr("<|image|>")).replace("VIDEO", repr("<|video|>"))
    return (
        "{{- bos_token -}}"
        "{%- for message in messages -%}"
        "{{- '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}"
        "{%- if message['role'] == 'assistant' -%}{%- generation -%}" + content + "{{- '<turn|>' -}}"
        "{%- endgeneration -%}{{- '\n' -}}"
        "{%- else -%}" + content + "{{- '<turn|>\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}"
    )


def _smolvlm_template() -> str:
    """SmolVLM / Idefics3: `<|im_start|>User:<image>text<end_of_utterance>\nAssistant: text<end_of_utterance>\n`
    (role capitalised, `:` then a space unless the turn opens with an image); generation prompt `Assistant:`."""
    content = _CONTENT.replace("IMAGE", repr("<image>")).replace("VIDEO", repr("<image>"))
    opens_with_image = ("(message['content'] is not string and message['content'][0]['type'] in "
                        "('image', 'image_url'))")
    return (
        "{{- '<|im_start|>' -}}"
        "{%- for message in messages -%}"
        "{{- message['role'] | capitalize -}}{{- ':' if " + opens_with_image + " else ': ' -}}"
        "{%- if message['role'] == 'assistant' -%}{%- generation -%}" + content + "{{- '<end_of_utterance>' -}}"
        "{%- endgeneration -%}{{- '\n' -}}"
        "{%- else -%}" + content + "{{- '<end_of_utterance>\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
    )


def _llava_onevision_template() -> str:
    """LLaVA-OneVision (Qwen2 LM): `<|im_start|>user <image>\ntext<|im_end|><|im_start|>assistant\n...`: a
    role, a space, the turn's images first, then each text after a newline; turns are not separated by newlines.
    The generation prompt `<|im_start|>assistant\n` is the start of every assistant turn."""
    images = ("{%- if message['content'] is not string -%}{%- for item in message['content'] -%}"
              "{%- if item['type'] in ('image', 'image_url') -%}{{- '<image>' -}}{%- endif -%}"
              "{%- endfor -%}{%- endif -%}")
    texts = ("{%- if message['content'] is string -%}{{- '\n' + message['content'] -}}{%- else -%}"
             "{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{- '\n' + item['text'] -}}"
             "{%- endif -%}{%- endfor -%}{%- endif -%}")
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'assistant' -%}{{- '<|im_start|>assistant' -}}{%- generation -%}" + texts +
        "{{- '<|im_end|>' -}}{%- endgeneration -%}"
        "{%- else -%}{{- '<|im_start|>' + message['role'] + ' ' -}}" + images + texts + "{{- '<|im_end|>' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    )


# SmolVLM's processor writes each tile's position as `<row_r_col_c>` (up to its largest grid of tiles).
_SMOLVLM_TILE_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]

# family -> (special tokens, named tokenizer attributes the processor reads, eos, pad, chat template)
_FAMILY_TOKENS = {
    "qwen2_5_vl": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"],
        named={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
               "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
        eos="<|im_end|>", pad="<|endoftext|>", stop=["<|im_end|>", "<|endoftext|>"],
        template=lambda: _im_start_template("<|vision_start|><|image_pad|><|vision_end|>",
                                            "<|vision_start|><|video_pad|><|vision_end|>"),
    ),
    "internvl": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"],
        named={"start_image_token": "<img>", "end_image_token": "</img>",
               "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        eos="<|im_end|>", pad="<|endoftext|>", stop=["<|im_end|>", "<|endoftext|>"],
        template=lambda: _im_start_template("<IMG_CONTEXT>\n", "<video>\n"),
    ),
    "glm4v": dict(
        special=["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                 "<|begin_of_image|>", "<|end_of_image|>", "<|image|>",
                 "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"],
        named={"image_token": "<|image|>", "video_token": "<|video|>"},
        eos="<|endoftext|>", pad="<|endoftext|>", stop=["<|endoftext|>", "<|user|>"],
        template=_glm4v_template,
    ),
}
_FAMILY_TOKENS.update({
    "gemma3": dict(
        special=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                 "<end_of_image>", "<image_soft_token>"],
        named={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
        eos="<eos>", pad="<pad>", bos="<bos>", stop=["<end_of_turn>", "<eos>"], template=_gemma3_template,
    ),
    "gemma4": dict(
        special=["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>",
                 "<audio|>", "<|audio|>", "<|video|>"],
        named={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
               "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"},
        eos="<turn|>", pad="<pad>", bos="<bos>", stop=["<turn|>", "<eos>"], template=_gemma4_template,
    ),
    "smolvlm": dict(
        special=["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                 "<global-img>", *_SMOLVLM_TILE_TOKENS],
        named={"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
               "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"},
        eos="<end_of_utterance>", pad="<|endoftext|>", stop=["<end_of_utterance>", "<|endoftext|>"],
        template=_smolvlm_template,
    ),
    "llava_onevision": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"],
        named={"image_token": "<image>", "video_token": "<video>"},
        eos="<|im_end|>", pad="<|endoftext|>", stop=["<|im_end|>", "<|endoftext|>"],
        template=_llava_onevision_template,
    ),
})
# Qwen2-VL, Qwen3-VL and Qwen3.5 keep Qwen2.5-VL's tokens and ChatML turns; InternVL3.5 those of InternVL3; the
# text-only LLMs (Qwen2, Qwen3) speak ChatML too.
for _alias, _source in (("qwen2_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen2_5_vl"), ("qwen3_5", "qwen2_5_vl"),
                        ("internvl3_5", "internvl"), ("qwen2", "qwen2_5_vl"), ("qwen3", "qwen2_5_vl")):
    _FAMILY_TOKENS[_alias] = _FAMILY_TOKENS[_source]


def make_tiny_tokenizer(family: str = "qwen2_5_vl", *, vocab_size: int = DEFAULT_BPE_VOCAB):
    """Byte-level BPE trained on `tokenizer_corpus()`, with `family`'s special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    spec = _FAMILY_TOKENS[family]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(vocab_size),
        eos_token=spec["eos"],
        pad_token=spec["pad"],
        bos_token=spec.get("bos"),
        extra_special_tokens=spec["special"],
        # Named attributes (tokenizer.image_token, tokenizer.image_token_id, ...) the processors read.
        model_specific_special_tokens=dict(spec["named"]),
        clean_up_tokenization_spaces=False,
    )
    # Answer-format tags as whole (ordinary, decodable) tokens: shorter sequences for the tiny recipes.
    tok.add_tokens(list(FORMAT_TAGS))
    tok.chat_template = spec["template"]()
    return tok


def _token_ids(tok, tokens) -> list[int]:
    return tok.convert_tokens_to_ids(list(tokens))

