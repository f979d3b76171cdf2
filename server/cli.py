"""`specserve` command line: serve (the OpenAI-compatible server), generate (offline, one prompt) and train
(imported lazily, so serving never loads it)."""

from __future__ import annotations

import argparse
import sys


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model: local HF directory, .gguf file or hub id (default: the demo "
                                   "target SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model", help="draft model sharing the target's tokenizer (default: bundled demo draft)")
    from specserve.engine.spec_decode.registry import method_choices
    p.add_argument("--speculative-method", choices=method_choices(), type=str.lower,
                   help="default: eagle3 on the demo target, draft when --draft-model is given")
    from specserve.config.schema import parse_k
    p.add_argument("--num-speculative-tokens", type=parse_k, default="auto",
                   help="k: auto (adapts per step, the default), an integer (fixed) or 0 (off)")
    p.add_argument("--max-speculative-tokens", type=int, default=4, help="the largest k auto may choose")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix looked up")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix looked up")
    p.add_argument("--prompt-lookup-branches", type=int, default=1,
                   help="ngram: a tree of up to this many continuations (1: a chain)")
    p.add_argument("--speculative-config", help="vLLM's JSON (an object or a list of methods)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 where native, else fp32 on CPU) | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto (cuda when present) | cpu | cuda[:N]")
    p.add_argument("--quantization", default="auto",
                   help="auto (a Q4_1 GGUF keeps its 4-bit weights on CPU) | int8 | int4 | none (default: auto)")
    p.add_argument("--quantization-dense-rows", type=int, default=0,
                   help="with --quantization: forwards of at least this many rows use a dense copy (0: never)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="the target's forward through torch.compile (each new shape compiles on first use)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the target over this many ranks (processes; rank r on cuda:r, gloo on CPU)")
    p.add_argument("--kv-cache-memory", type=int, help="bytes for the KV caches (default min(4 GiB, RAM/4) on CPU)")
    p.add_argument("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    p.add_argument("--seed", type=int)
    p.add_argument("--chat-template", help="Jinja file or inline template replacing the model's")


def _generate(args: argparse.Namespace) -> int:
    from specserve.engine import LLM, SamplingParams

    llm = LLM(model=args.model, draft_model=args.draft_model, speculative_method=args.speculative_method,
              num_speculative_tokens=args.num_speculative_tokens, max_speculative_tokens=args.max_speculative_tokens,
              dtype=args.dtype, device=args.device, quantization=args.quantization,
              quantization_dense_rows=args.quantization_dense_rows, enable_torch_compile=args.enable_torch_compile,
              tensor_parallel_size=args.tensor_parallel_size,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, seed=args.seed,
              chat_template=args.chat_template, prompt_lookup_min=args.prompt_lookup_min,
              prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_branches=args.prompt_lookup_branches,
              speculative_config=args.speculative_config)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or [])
    out = llm.generate([args.prompt], params)[0]
    print(args.prompt + out.text)
    s = out.speculation
    rate = f"{s.num_accepted_tokens / s.num_draft_tokens:.2f}" if s.num_draft_tokens else "n/a"
    print(f"[{len(out.output_token_ids)} tokens, finish_reason={out.finish_reason}, method={s.method}, "
          f"drafted={s.num_draft_tokens}, accepted={s.num_accepted_tokens}, acceptance_rate={rate}, "
          f"steps={s.num_steps}]", file=sys.stderr)
    return 0


def _check_before_listening(engine) -> None:
    """Mistakes a user can fix, said before the server listens (models load after it does): an unknown or repeated
    speculation method, a missing demo package, an unreadable chat template."""
    from specserve.engine.model.loader import demo_model_paths, resolve_chat_template
    from specserve.engine.spec_decode.registry import check_methods

    check_methods(engine)

    if engine.model is None:
        demo_model_paths()
    if engine.chat_template:
        resolve_chat_template(engine.chat_template)


def _serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from specserve.config.loader import build_config
    from specserve.server.app import begin_drain, create_app
    from specserve.server.request_log import configure_logging
    from specserve.server.transport import (
        BoundedListener,
        ConnectionBook,
        TransportLimits,
        protocol_factory,
        raise_descriptor_limit,
    )

    config = build_config(args, os.environ)
    _check_before_listening(config.engine)
    configure_logging(config.server.log_level, config.server.log_format)
    app = create_app(config)
    limits = TransportLimits.from_config(config.server, raise_descriptor_limit())
    book = ConnectionBook(limits, on_close=app.state.metrics.record_connection_closed)
    app.state.metrics.watch_connections(lambda: book.open)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: stop admitting, let in-flight requests finish
            begin_drain(app)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the captured signal after shutting down (exit status 128+n); a graceful stop
            # is a successful run for us and for orchestrators, so exit 0 instead
            self._captured_signals.clear()

    # the h11 protocol always (whether or not httptools is installed): the transport's limits watch its states
    uv = uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
                        log_config=None, timeout_graceful_shutdown=config.server.shutdown_timeout + 5,
                        http=protocol_factory(book), ws="none", timeout_keep_alive=limits.keep_alive_timeout,
                        h11_max_incomplete_event_size=limits.max_header_bytes)
    Server(uv).run(sockets=[BoundedListener.take(uv.bind_socket())])
    return 0


def build_parser() -> argparse.ArgumentParser:
    from specserve.config.loader import add_config_flags

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API (default: the bundled demo pair)",
                           description="Every flag can also be set as env SPECSERVE_<FLAG> or in the YAML file "
                                       "given by --config; precedence: flags > env > file > defaults.")
    from specserve.engine.spec_decode.registry import method_choices

    add_config_flags(serve, {"speculative_method": method_choices()})
    serve.set_defaults(func=_serve)
    gen = sub.add_parser("generate", help="generate a completion for one prompt (offline)")
    _add_engine_flags(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=_generate)
    train = sub.add_parser("train", help="train a demo target or distil a draft (see `specserve train -h`)",
                           add_help=False)
    train.add_argument("rest", nargs=argparse.REMAINDER)
    train.set_defaults(func=_train)
    return parser


def _train(args: argparse.Namespace) -> int:
    from specserve.train import cli as train_cli  # lazy: serving never imports training code

    parser = argparse.ArgumentParser(prog="specserve")
    train_cli.add_train_parser(parser.add_subparsers(dest="command", required=True))
    return train_cli.run_train(parser.parse_args(["train", *args.rest])) or 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
