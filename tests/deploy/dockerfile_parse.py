"""Reads the root Dockerfile the way the builder does, for what the tests need: stages, ENV, ENTRYPOINT/CMD,
HEALTHCHECK and COPY, with ENV/ENTRYPOINT/CMD inherited from parent stages."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comments dropped, backslash continuations joined."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment lines inside a continuation are skipped by Docker too
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    return out


def stages(text: str) -> list[Stage]:
    result: list[Stage] = []
    for keyword, args in instructions(text):
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            result.append(Stage(base=words[0], name=name))
        elif result:
            result[-1].instructions.append((keyword, args))
    return result


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), value)


def parse_env(args: str, env: dict[str, str]) -> dict[str, str]:
    """`ENV K=V K2="v 2"` or the legacy `ENV K V`; $VAR expanded against the env so far (unknown ones kept)."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: _expand(" ".join(words[1:]), env)}
    out: dict[str, str] = {}
    for w in words:
        k, _, v = w.partition("=")
        out[k] = _expand(v, env | out)
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {args}"
    return value


@dataclass
class Image:
    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: str | None
    user: str | None
    workdir: str | None
    exposed: list[str]
    final: Stage
    stages: list[Stage]
    args: dict[str, str]  # ARG defaults of the final stage's chain

    @property
    def uid(self) -> str:
        """USER's uid part with ${ARG} defaults substituted."""
        return _expand(self.user or "0", self.args).split(":")[0]


def image(text: str | None = None) -> Image:
    """What `docker build` of the last stage gives, as far as ENV/ENTRYPOINT/CMD/USER/... go. ENV values that
    reference variables of the base image (e.g. $PATH) keep the reference."""
    text = DOCKERFILE.read_text() if text is None else text
    all_stages = stages(text)
    by_name = {s.name: s for s in all_stages if s.name}

    def chain(stage: Stage) -> list[Stage]:
        return (chain(by_name[stage.base]) if stage.base in by_name else []) + [stage]

    env: dict[str, str] = {}
    entrypoint: list[str] = []
    cmd: list[str] = []
    healthcheck = user = workdir = None
    exposed: list[str] = []
    build_args: dict[str, str] = {}
    for stage in chain(all_stages[-1]):
        for keyword, args in stage.instructions:
            if keyword == "ARG" and "=" in args:
                k, _, v = args.partition("=")
                build_args[k] = v.strip('"')
            elif keyword == "ENV":
                env.update(parse_env(args, env))
            elif keyword == "ENTRYPOINT":
                entrypoint, cmd = exec_form(args), []  # a new ENTRYPOINT resets an inherited CMD
            elif keyword == "CMD":
                cmd = exec_form(args)
            elif keyword == "HEALTHCHECK":
                healthcheck = args
            elif keyword == "USER":
                user = args
            elif keyword == "WORKDIR":
                workdir = args
            elif keyword == "EXPOSE":
                exposed += args.split()
    return Image(env, entrypoint, cmd, healthcheck, user, workdir, exposed, all_stages[-1], all_stages, build_args)
