"""One step's row layout, built once and read by everything after the forward: which sequences emit tokens, how
many logit rows each owns (k + 1: its last token and every proposed node) and where they start. The analogue of
vLLM's SpecDecodeMetadata; the rule "k + 1 rows per emitting sequence" lives here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowLayout:
    emitting: tuple[int, ...]  # indices (into the step's sequences) of those whose last token is reached this step
    ks: tuple[int, ...]  # [E] proposed tokens (nodes) of each emitting sequence; 0: plain decode
    roots: tuple[int, ...]  # [S] position of each sequence's first new token (num_computed_tokens before the step)
    num_new_tokens: tuple[int, ...]  # [S] tokens each sequence feeds the target this step

    @classmethod
    def build(cls, seqs) -> RowLayout:
        """From the scheduled sequences (after proposals trimmed them), before their computed lengths advance."""
        emitting = tuple(i for i, s in enumerate(seqs) if s.emits)
        return cls(emitting, tuple(seqs[i].num_draft_tokens for i in emitting),
                   tuple(s.request.num_computed_tokens for s in seqs), tuple(s.num_new_tokens for s in seqs))

    def rows_of(self, b: int) -> int:
        """Logit rows of the b-th emitting sequence: its last token, then one per proposed node."""
        return self.ks[b] + 1

    @property
    def token_offsets(self) -> list[int]:
        """[S] first row of each sequence among the forward's input tokens."""
        out, n = [], 0
        for m in self.num_new_tokens:
            out.append(n)
            n += m
        return out

    @property
    def logit_offsets(self) -> list[int]:
        """[E] first logit row of each emitting sequence."""
        out, n = [], 0
        for b in range(len(self.emitting)):
            out.append(n)
            n += self.rows_of(b)
        return out

    @property
    def logit_rows(self) -> list[int]:
        """Rows of the forward's input tokens whose logits are computed: each emitting sequence's last k + 1."""
        starts = self.token_offsets
        return [starts[i] + self.num_new_tokens[i] - self.rows_of(b) + j
                for b, i in enumerate(self.emitting) for j in range(self.rows_of(b))]

    def per_row(self, values: list) -> list:
        """One value per emitting sequence -> one per logit row (e.g. each row's logit_bias)."""
        return [v for b, v in enumerate(values) for _ in range(self.rows_of(b))]
