"""Secrets never reach a file: what counts as one, how it is redacted, and the recipe check.

A secret is the string value of a field or option whose name says key, token, secret, password or authorization
(`api_key`, `hub_token`, `Authorization`, `x-api-key` ...; at any depth of a dict, e.g. a reward's option inside
`--reward_kwargs`), and the credentials inside a URL (`https://user:pass@host/...`, `?token=...`). `redact` replaces
each with a placeholder in HF's style (`<API_KEY>`, `<CREDENTIALS>`); every writer of a run's config (config.yaml,
tracker hparams, model cards, evaluate.py's metrics.json) goes through `utils.core.config.config_to_dict`, which
calls it. Error messages and logs that name a server pass its URL through `redact_url`.

A recipe is a file that gets shared and saved: `literal_secrets` finds what one holds, and `--config` refuses it,
naming the key (secrets come from the environment: OPENAI_API_KEY for judges and endpoints, HF_TOKEN for the Hub).
A placeholder read back from a run's own config.yaml means "not set": `drop_placeholders` removes it, so the value
comes from the environment again.
"""

from __future__ import annotations

import re

SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "secrets", "password", "passwd", "authorization",
                          "credential", "credentials"})
NOT_SECRET_WORDS = frozenset({"id", "ids", "pad", "eos", "bos", "unk", "sep", "cls", "mask", "image", "video",
                              "special", "max", "min", "num", "n", "count", "length", "budget", "sort", "cache"})
NOT_SECRET = frozenset({"", "EMPTY", "none", "None"})  # vLLM's and OpenAI clients' "no key" values
PLACEHOLDER = re.compile(r"^<[A-Z0-9_]+>$")
CREDENTIALS = "<CREDENTIALS>"
# scheme://user[:password]@host; the userinfo stops at the first '/', whitespace or quote
_URL_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)([^/@\s'\"<>]+)@")
_URL_QUERY = re.compile(r"([?&])([^=&#\s'\"]+)=([^&#\s'\"]*)")


def _words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", str(name))
    return [w.lower() for w in re.split(r"[^A-Za-z0-9]+", spaced) if w]


def is_secret_name(name) -> bool:
    """True for names that say key, token, secret, password or authorization (`api_key`, `HF_TOKEN`,
    `Authorization`, `x-api-key`). Not: plural words, which name counts and lists (`max_new_tokens`,
    `metadata_keys`); a tokenizer's tokens and counts (`pad_token`, `max_output_token_n_gen`, `image_token_id`); a
    bare `key`, a selector in some rewards (shapes_t2i's `key="score"`)."""
    words = _words(name)
    return any(w in SECRET_WORDS for w in words) and words != ["key"] and not NOT_SECRET_WORDS & set(words)


def placeholder(name) -> str:
    return "<" + "_".join(w.upper() for w in _words(name)) + ">"


def redact_url(text: str) -> str:
    """`text` with the credentials of every URL in it replaced: user:password@ and secret query parameters."""
    if not isinstance(text, str) or "://" not in text:
        return text
    text = _URL_USERINFO.sub(lambda m: m.group(1) + CREDENTIALS + "@", text)
    return _URL_QUERY.sub(lambda m: m.group(1) + m.group(2) + "=" + (placeholder(m.group(2))
                                                                      if is_secret_name(m.group(2)) else m.group(3)),
                          text)


def _is_literal(value) -> bool:
    return isinstance(value, str) and value.strip() not in NOT_SECRET and not PLACEHOLDER.match(value.strip())


def redact(value, name: str | None = None):
    """A copy of `value` (dicts, lists, strings, numbers) with every secret replaced by its placeholder."""
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, name) for v in value)
    if name is not None and is_secret_name(name) and _is_literal(value):
        return placeholder(name)
    return redact_url(value) if isinstance(value, str) else value


def literal_secrets(value, where: str = "") -> list[str]:
    """Where `value` holds a secret in clear: dotted key paths (`reward_kwargs.judge_tiif.api_key`)."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{where}.{k}" if where else str(k)
            if is_secret_name(k) and _is_literal(v):
                found.append(path)
            else:
                found += literal_secrets(v, path)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found += literal_secrets(v, f"{where}[{i}]")
    elif isinstance(value, str) and redact_url(value) != value:
        found.append(where)
    return found


def recipe_without_secrets(data: dict, path, error=ValueError) -> dict:
    """A recipe's values: refused (`error`, the caller's exception class, naming the file and the key) when it holds
    a secret in clear; the placeholders of a run's own config.yaml dropped."""
    found = literal_secrets(data)
    if found:
        raise error(f"{path}: key {found[0]!r} holds a secret in clear; a recipe is shared and saved with the run: "
                    "put it in the environment (judges and endpoints read OPENAI_API_KEY, the Hub HF_TOKEN; your own "
                    "reward reads os.environ)")
    return drop_placeholders(data)


def drop_placeholders(value):
    """`value` without the placeholders `redact` wrote: such keys are removed (a top-level one becomes None)."""
    if isinstance(value, dict):
        return {k: drop_placeholders(v) for k, v in value.items()
                if not (isinstance(v, str) and PLACEHOLDER.match(v) and is_secret_name(k))}
    if isinstance(value, list):
        return [drop_placeholders(v) for v in value]
    return value
