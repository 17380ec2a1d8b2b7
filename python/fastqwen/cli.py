"""The `fastqwen` command: `fastqwen serve MODEL [flags]` (the flags of `python -m fastqwen.serve`) and
`fastqwen chat [MODEL | --url URL] [flags]`."""

from __future__ import annotations

import argparse
import sys

USAGE = """usage: fastqwen {serve,chat} [MODEL] [flags]

  fastqwen serve MODEL [flags]      serve MODEL (a checkpoint folder or a hub id such as Qwen/Qwen3-8B) over an
                                    OpenAI-compatible HTTP API; `fastqwen serve --help` lists the flags
  fastqwen chat MODEL [flags]       chat in the terminal with MODEL loaded in this process
  fastqwen chat --url URL           chat with a running server
"""


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    """MODEL as a positional that may stand before, between or after the flags (as `vllm serve` takes it); the
    engine's --model flag stays, and `take_model` makes the two one."""
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", help="the model: the same as --model")


def take_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """args.model from MODEL or --model (one of them, or both the same)."""
    given = args.__dict__.pop("model_positional")
    if given is not None:
        if args.model is not None and args.model != given:
            parser.error(f"two models given: {given!r} and --model {args.model!r}")
        args.model = given
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from .serve import main as serve

        return serve(rest, prog="fastqwen serve")
    if command == "chat":
        from .chat import main as chat

        return chat(rest, prog="fastqwen chat")
    print(f"fastqwen: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
