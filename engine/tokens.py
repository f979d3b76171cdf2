"""The one tokenisation policy for prompts, wherever they are encoded (server routes, AsyncEngine, EngineCore).

Raw text (a completions prompt, an offline prompt) gets the tokenizer's own special tokens (a BOS where the model
wants one), as vLLM does; text that is already rendered (a chat template's output, which holds its own special
tokens, and a Predicted Outputs text, which is completion content) gets none.
"""

from __future__ import annotations


def encode_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def encode_rendered(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
