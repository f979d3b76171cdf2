"""Grammar-constrained decoding (llguidance): a request's grammar, compiled once per distinct spec, and the token
masks the target's and the draft's distributions are restricted to.

Exactness under speculation: the mask of a verified position is the grammar state after every token before it,
draft tokens included; the target's logits at that position are masked (disallowed tokens -inf) BEFORE the
request's temperature and filters, so p' is the constrained target distribution. A draft model samples from its own
logits masked the same way (q'); chains are then verified with p' and q' by the ordinary rule, which makes the
output follow p' exactly. One-hot drafts (n-gram, Medusa, DFlash, predictions) need no masking on their side: a
draft token the grammar forbids has p'(x) = 0 and is always rejected, so positions after it are never reached
(their masks are left open). Nothing is cut from a proposal: cutting a *sampled* draft at the first forbidden token
would bias the output. After verification the matcher consumes what was emitted; drafted tokens are rolled back.

llguidance was picked over xgrammar: its wheel has no dependencies (3 MB), xgrammar's Linux wheel pulls `triton`
(hundreds of MB on a CPU install and in the image) and a TVM FFI runtime.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specserve.engine.errors import InvalidRequestError

log = logging.getLogger("specserve.engine")

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_CACHE_SIZE = 256


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. `value`: a JSON Schema (JSON text) for json_schema, a regex, a JSON list
    of strings for choice, a Lark grammar for grammar; ignored for json_object. `field` names the request field
    that carried it (errors name it)."""

    kind: str
    value: str = ""
    field: str = "response_format"


class GrammarCompiler:
    """One per engine: llguidance's view of the tokenizer (built once, ~1 s) and compiled matchers by spec (LRU of
    256: requests with the same schema copy one instead of compiling it again)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        import llguidance.hf

        self.vocab_size = vocab_size
        eos = sorted(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=eos[0] if eos and len(eos) == 1 else eos)
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()  # spec -> a fresh matcher to copy

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for one request: a copy of the spec's compiled one (compiling takes ~1 ms, a copy less);
        raises InvalidRequestError naming spec.field when the grammar cannot be enforced."""
        if spec in self._cache:
            self._cache.move_to_end(spec)
            return self._cache[spec].deep_copy()
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, self.compile(spec), log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"{spec.field}: cannot be enforced: {m.get_error()}", spec.field)
        self._cache[spec] = m
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return m.deep_copy()

    def compile(self, spec: GrammarSpec) -> str:
        """-> llguidance's grammar text; raises InvalidRequestError naming spec.field when it cannot compile."""
        from llguidance import LLMatcher

        try:
            grammar = _grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{spec.field}: {exc}", spec.field) from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error or messages:  # a warning means part of the schema would be ignored: refuse rather than loosen
            detail = "; ".join(messages)
            raise InvalidRequestError(f"{spec.field}: cannot be enforced: {detail}", spec.field)
        return grammar


def grammar_compiler(tokenizer, vocab_size: int, eos_token_ids: set[int]) -> GrammarCompiler | None:
    """Structured output needs llguidance and a fast tokenizer; without them requests asking for it get a 400."""
    try:
        return GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    except (ImportError, ValueError) as exc:
        log.warning("structured output unavailable: %s", exc)
        return None


def advance_grammar(matcher, token: int) -> bool:
    """The matcher consumes an emitted token. -> whether the grammar is now complete (the only token it then allows
    is the end of sequence, so the request ends there)."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused an emitted token: {matcher.get_error()}")
    return matcher.is_stopped()


def _grammar_text(spec: GrammarSpec) -> str:
    from llguidance import LLMatcher

    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, {"whitespace_flexible": False})
    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.value, {"whitespace_flexible": False})
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if spec.kind == "grammar":
        return LLMatcher.grammar_from_lark(spec.value)
    raise ValueError(f"unknown kind {spec.kind!r} (one of {', '.join(KINDS)})")


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_next_token_bitmask(matcher, bitmask: torch.Tensor, row: int) -> None:
    """Row `row` of an int32 bit set [N, words] := the tokens the matcher allows next."""
    import llguidance.torch

    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)


def node_bitmasks(matcher, parents: list[int], tokens: list[int], vocab_size: int) -> torch.Tensor:
    """Masks [n + 1, words] (int32 bit sets) of one request's verified rows: row 0 after the emitted tokens, row i
    after the path root -> node i (`parents[i - 1]`, 0 = root; a chain has parents 0, 1, 2, ...). Rows whose path
    holds a token the grammar forbids are left open (unreachable: that token is always rejected). The matcher is
    left as it was."""
    out = torch.full((len(tokens) + 1, words(vocab_size)), -1, dtype=torch.int32)
    fill_next_token_bitmask(matcher, out, 0)
    paths: list[list[int]] = [[]]
    held: list[int] = []  # tokens the matcher holds beyond the emitted ones: it moves node to node, not from the root
    for i, (parent, tok) in enumerate(zip(parents, tokens), start=1):
        path = paths[parent] + [tok]
        paths.append(path)
        common = 0
        while common < min(len(held), len(path)) and held[common] == path[common]:
            common += 1
        matcher.rollback(len(held) - common)
        done = matcher.try_consume_tokens(path[common:])
        held = path[:common + done]
        if len(held) == len(path):
            fill_next_token_bitmask(matcher, out, i)
    matcher.rollback(len(held))
    return out


def verify_bitmasks(requests, proposals, layout, vocab_size: int) -> torch.Tensor:
    """Masks [N, words] of one step's verified rows (the layout's rows of each request, in order): a grammar
    request's row j is masked by the state after its emitted tokens and the proposed tokens on node j's path; other
    rows are open."""
    masks = []
    for b, (req, prop) in enumerate(zip(requests, proposals)):
        if req.grammar is None:
            masks.append(torch.full((layout.rows_of(b), words(vocab_size)), -1, dtype=torch.int32))
            continue
        parents = list(range(layout.ks[b])) if prop is None or prop.parents is None else prop.parents
        masks.append(node_bitmasks(req.grammar, parents, [] if prop is None else prop.tokens, vocab_size))
    return torch.cat(masks)


def biased(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """fp32 logits [N, V] + each row's logit_bias (OpenAI's: added to the raw logits; None: nothing)."""
    rows = [(r, t, b) for r, bias in enumerate(biases) if bias for t, b in bias.items()]
    if not rows:
        return logits
    out = logits.float().clone()
    r, t, b = zip(*rows)
    idx = (torch.tensor(r, device=out.device), torch.tensor(t, device=out.device))
    return out.index_put_(idx, torch.tensor(b, dtype=out.dtype, device=out.device), accumulate=True)


FORBIDDEN = -1e30  # finite: the verifier's non-finite check (NaN/inf logits fail a request) must still work


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, V], FORBIDDEN where the int32 bit set [N, words] has a 0 bit (exp() of it is exactly 0 after
    any temperature a request may set). A row with no allowed token (a grammar already complete: never sampled
    from) is left open rather than made all-forbidden."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    allowed |= ~allowed.any(dim=-1, keepdim=True)
    return logits.float().masked_fill(~allowed.to(logits.device), FORBIDDEN)
