"""Building a Request from a prompt and SamplingParams: validation against what loading fixed (model length, the
loaded methods and their k, the KV budget), tokenisation policy, Predicted Outputs ids.

A RequestBuilder holds only immutable load-time facts, so the server's event loop may build requests while the
step loop runs; it never reads the scheduler or the running requests (those belong to the engine thread)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.errors import InvalidRequestError, RequestTooLongError
from specserve.engine.request import Request
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sched.prefix_hash import root_hash
from specserve.engine.sched.scheduler import requested_k
from specserve.engine.spec_decode.prediction import DEFAULT_K as PREDICTION_K
from specserve.engine.spec_decode.prediction import MAX_K as PREDICTION_MAX_K
from specserve.engine.spec_decode.registry import NONE, canonical
from specserve.engine.tokens import encode_prompt, encode_rendered


@dataclass(frozen=True)
class RequestBuilder:
    tokenizer: object  # used only for string prompts/predictions: callers on other threads pass token ids
    vocab_size: int
    max_model_len: int
    default_method: str
    method_ks: dict  # loaded method -> the most tokens it proposes per step
    adaptive_methods: frozenset  # methods whose k adapts (num_speculative_tokens "auto")
    num_blocks: int
    block_size: int
    eos_token_ids: frozenset
    device: torch.device
    cache_namespace: str = ""  # what a cached KV block's content depends on besides its tokens (model, dtype)
    grammars: object = None  # sample.grammar.GrammarCompiler (its cache is the one mutable part: thread-safe enough
    # under the GIL, dict operations only); None: structured output unavailable

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt)
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt: token ids must be integers in [0, {self.vocab_size})", "prompt")
        return list(prompt)

    def build(self, request_id: str, prompt: str | list[int], params: SamplingParams,
              prompt_token_ids: list[int] | None = None) -> Request:
        """Raises InvalidRequestError / RequestTooLongError naming the field. `prompt_token_ids` skips
        tokenising `prompt`; a string `params.prediction` is tokenised here (so pass ids from other threads)."""
        ids = self.tokenize(prompt if prompt_token_ids is None else prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt: must contain at least one token", "prompt")
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise RequestTooLongError(f"This model's maximum context length is {limit} tokens; the prompt has {n} "
                                      "tokens.")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise RequestTooLongError(f"This model's maximum context length is {limit} tokens; the prompt has {n} "
                                      f"tokens and max_tokens is {max_tokens}.", param="max_tokens")
        method = self.default_method if params.speculative_method is None else canonical(params.speculative_method)
        if method != NONE and method not in self.method_ks:
            raise InvalidRequestError(f"speculative_method: {params.speculative_method!r} is not loaded by this "
                                      f"server; use one of: {', '.join([*self.method_ks, NONE])}",
                                      "speculative_method")
        prediction = self._prediction_ids(params.prediction)
        if prediction:  # Predicted Outputs: longer chains by default; the request's method fills in the gaps
            k = PREDICTION_K if params.num_speculative_tokens is None else min(params.num_speculative_tokens,
                                                                               PREDICTION_MAX_K)
        else:
            k = requested_k(params.num_speculative_tokens, self.method_ks[method]) if method != NONE else 0
        adaptive = bool(k) and not prediction and params.num_speculative_tokens is None and \
            method in self.adaptive_methods
        need = min(n + max_tokens + k, limit)
        if -(-need // self.block_size) > self.num_blocks:
            raise RequestTooLongError(f"the request needs up to {need} tokens of KV cache but kv_cache_memory holds "
                                      f"{self.num_blocks * self.block_size}", param="max_tokens")
        grammar = self._grammar(params)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError(f"logit_bias: token ids must be < {self.vocab_size}", "logit_bias")
        label = "prediction" if prediction and k else method if k else NONE
        return Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, self.tokenizer,
                       set(self.eos_token_ids), max_tokens, label, self.device, num_speculative_tokens=k,
                       prediction_token_ids=prediction, method=method, adaptive=adaptive,
                       cache_root=root_hash(self.cache_namespace, params.cache_salt), grammar=grammar)

    def _grammar(self, params: SamplingParams):
        """A fresh matcher for the request's grammar (compiled once per spec); InvalidRequestError naming the field
        when it cannot be enforced."""
        if params.structured is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError(f"{params.structured.field}: structured output needs the llguidance package",
                                      params.structured.field)
        return self.grammars.matcher(params.structured)

    def _prediction_ids(self, prediction: str | list[int] | None) -> list[int] | None:
        if prediction is None or isinstance(prediction, list):
            if prediction and max(prediction) >= self.vocab_size:
                raise InvalidRequestError(f"prediction: token ids must be < {self.vocab_size}", "prediction")
            return prediction or None
        return encode_rendered(self.tokenizer, prediction) or None
