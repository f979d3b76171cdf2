"""Byte-level BPE tokenizer trained on a corpus, saved as a transformers fast tokenizer with ChatML.

Byte-level pre-tokenisation and decoder make decode(encode(text)) == text for any UTF-8 input.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# ChatML, as Qwen/OpenAI use it; the generation prompt opens an assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192,
                    min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train BPE on `texts` and wrap it; special tokens take the first ids (0, 1, 2)."""
    bpe = Tokenizer(models.BPE())
    # add_prefix_space=False: code starts lines without a space, and it keeps round-trips exact.
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(bpe)


def wrap_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja (transformers 5)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))


def load_or_train_tokenizer(path: str | Path, texts: Iterable[str],
                            vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Reuse a tokenizer saved at `path` (resumed runs must keep ids stable), else train and save."""
    path = Path(path)
    if (path / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    tok = train_tokenizer(texts, vocab_size=vocab_size)
    save_tokenizer(tok, path)
    return tok
