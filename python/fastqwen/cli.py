"""The `fastqwen` command: `fastqwen serve MODEL [flags]` (the flags of `python -m fastqwen.serve`) and
`fastqwen chat [MODEL | --url URL] [flags]`."""

from __future__ import annotations

import sys

USAGE = """usage: fastqwen {serve,chat} [MODEL] [flags]

  fastqwen serve MODEL [flags]      serve MODEL (a checkpoint folder or a hub id such as Qwen/Qwen3-8B) over an
                                    OpenAI-compatible HTTP API; `fastqwen serve --help` lists the flags
  fastqwen chat MODEL [flags]       chat in the terminal with MODEL loaded in this process
  fastqwen chat --url URL           chat with a running server
"""


def _model_first(argv: list[str]) -> list[str]:
    """`MODEL --flag ...` as `--model MODEL --flag ...` (a leading positional is the model)."""
    if argv and not argv[0].startswith("-"):
        return ["--model", argv[0], *argv[1:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], _model_first(argv[1:])
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
