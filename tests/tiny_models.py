"""Tiny random-init HF models and tokenizers, built on disk by the tests: no network, loaded by the real code path."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TEXT = (
    "The quick brown fox jumps over the lazy dog. def main(): return 0\n"
    "Speculative decoding proposes tokens with a draft and verifies them with the target model.\n"
    "Ünïcödé text: café, naïve, 東京, 😀 emoji and ∑ symbols keep byte-level BPE honest.\n"
) * 20
EOS = "<|endoftext|>"


def build_tokenizer(path: Path, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(path)
    return fast


def build_word_tokenizer(path: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose ids are the words w0..w{V-2} plus EOS: for tiny-vocabulary distribution tests."""
    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {EOS: vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(path)
    return fast


def save_llama(path: Path, tokenizer_src: Path, vocab_size: int, layers: int = 2, hidden: int = 64,
               heads: int = 4, kv_heads: int = 2, seed: int = 0, max_len: int = 256) -> Path:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_len, eos_token_id=vocab_size - 1 if vocab_size < 100 else 0,
                      bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(cfg), path, tokenizer_src)


def save_gpt2(path: Path, tokenizer_src: Path, vocab_size: int, layers: int = 2, hidden: int = 64,
              heads: int = 4, seed: int = 0, max_len: int = 256) -> Path:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_len,
                     bos_token_id=0, eos_token_id=0)
    return _save(GPT2LMHeadModel(cfg), path, tokenizer_src)


def _save(model, path: Path, tokenizer_src: Path) -> Path:
    with torch.no_grad():  # random init is nearly uniform; widen logits so sampling tests see real structure
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_src).save_pretrained(path)
    return path


def build_letter_tokenizer(path: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Like build_word_tokenizer, but the words are the letters a, b, c, ... and the decoder is one llguidance
    understands (ByteFallback): for tiny-vocabulary tests under a grammar."""
    vocab = {chr(ord("a") + i): i for i in range(vocab_size - 1)} | {EOS: vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteFallback()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(path)
    return fast
