"""The speculation methods this engine can load: name -> module:class (imported only when a server loads it).

Adding a method: write `engine/spec_decode/<name>.py` with a class implementing `base.Proposer` and a classmethod
`load(method_config, context)`, and add one line here.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import MappingProxyType

PROPOSERS = MappingProxyType({
    "draft": "specserve.engine.spec_decode.draft_model:DraftModelProposer",
    "ngram": "specserve.engine.spec_decode.ngram:NgramProposer",
    "medusa": "specserve.engine.spec_decode.medusa.proposer:MedusaProposer",
    "dflash": "specserve.engine.spec_decode.dflash.proposer:DFlashProposer",
    "eagle3": "specserve.engine.spec_decode.eagle3.proposer:Eagle3Proposer",
})
ALIASES = MappingProxyType({"draft_model": "draft", "prompt_lookup": "ngram"})  # vLLM's and HF's names
NONE = "none"


def canonical(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def proposer_names() -> list[str]:
    return sorted(PROPOSERS)


def method_choices() -> tuple[str, ...]:
    """Every name a user may give: methods, their aliases, and "none" (the CLI's choices)."""
    return (*proposer_names(), *ALIASES, NONE)


def check_methods(config) -> None:
    """ValueError naming the field for an unknown method or one listed twice (an EngineConfig; no import of the
    methods themselves, so the config and the CLI can say it before loading anything)."""
    field = "speculative_config.method" if config.speculative_config else "speculative_method"
    seen = set()
    for m in config.speculative_methods:
        name = canonical(m.method)
        if name not in PROPOSERS:
            raise ValueError(f"{field}: unknown speculative method {m.method!r}; available: "
                             f"{', '.join(proposer_names() + [NONE])}")
        if name in seen:
            raise ValueError(f"{field}: method {name!r} is listed twice")
        seen.add(name)


def proposer_class(name: str, field: str = "speculative_method"):
    """The class of method `name`; ValueError naming `field` for an unknown one."""
    name = canonical(name)
    if name not in PROPOSERS:
        raise ValueError(f"{field}: unknown speculative method {name!r}; available: "
                         f"{', '.join(proposer_names() + [NONE])}")
    module, cls = PROPOSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_proposers(config, ctx, demo_draft) -> tuple[dict, frozenset]:
    """Every method of `config` loaded with `ctx` (base.ProposerContext); a draft method without a model gets
    `demo_draft` (the demo target's bundled draft; None: an error). -> (name -> loaded method, the default first;
    names of the methods whose k adapts)."""
    check_methods(config)
    proposers, adaptive = {}, set()
    for m in config.speculative_methods:
        cls = proposer_class(m.method)
        if cls.uses_draft_model and m.model is None:
            if demo_draft is None:
                raise ValueError(f"draft_model: speculative method {cls.name!r} needs a draft model")
            m = dataclasses.replace(m, model=str(demo_draft))
        proposers[cls.name] = cls.load(m, ctx)
        if m.adaptive:
            adaptive.add(cls.name)
    return proposers, frozenset(adaptive)
