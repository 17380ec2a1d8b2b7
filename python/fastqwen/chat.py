"""`fastqwen chat`: an interactive terminal chat, on a model loaded in this process or against a running server.

Replies stream as they are generated; the conversation is kept until /reset. A Qwen3 <think> block is shown dimmed
on a terminal (and kept as its tags when the output is not a terminal, so a script reads exactly the model's text).
Commands: /reset (forget the conversation), /system TEXT (set the system prompt; /system alone clears it), /exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

from . import env
from .cli import add_model_positional, take_model
from .config import EngineConfig

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /exit (or Ctrl-D)"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def parse_args(argv: list[str] | None = None, prog: str = "fastqwen chat") -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Chat with a Qwen3 model in the terminal: a model loaded here (MODEL or --model, "
        "with the engine flags of `fastqwen serve`) or a running server (--url).",
    )
    chat = p.add_argument_group("chat")
    chat.add_argument(
        "--url",
        default=None,
        help="a running fastqwen (or any OpenAI-compatible) server, e.g. http://127.0.0.1:8000; no model is loaded here",
    )
    chat.add_argument(
        "--api-key", default=None, help="with --url: the server's API key (or set FASTQWEN_API_KEY / OPENAI_API_KEY)"
    )
    chat.add_argument(
        "--served-model-name", default=None, help="with --url: the model name to ask for (default: the server's first)"
    )
    chat.add_argument("--system", default=None, help="a system prompt to start with")
    chat.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature, 0 = greedy (default: the model's generation_config.json)",
    )
    chat.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: the model's)")
    chat.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most tokens of one reply, bounded by the room left in the context (default: all the room left)",
    )
    chat.add_argument(
        "--no-think", action="store_true", help="ask Qwen3 to answer without a <think> block (enable_thinking=False)"
    )
    add_model_positional(p)
    EngineConfig.add_cli_arguments(p, model=None)
    args = take_model(p, p.parse_args(argv))
    if (args.url is None) == (args.model is None):
        p.error("give a model to load (MODEL or --model) or the --url of a running server, not both")
    return args


# ---- the two backends: each streams one reply to a conversation as pieces of text ------------------------------


class ReplyRefused(Exception):
    """The model or server refused this turn (a 400: too long for the context, ...); the conversation goes on."""


class LocalChat:
    """A model loaded in this process (the offline LLM), stepped one request at a time."""

    def __init__(self, args: argparse.Namespace):
        from .llm import LLM
        from .sampling_params import SamplingParams

        self.llm = LLM(EngineConfig.from_cli(args))
        if self.llm.tokenizer is None or self.llm.tokenizer.chat_template is None:
            raise SystemExit(
                f"{args.model}: this model has no tokenizer or chat template to chat with (--tokenizer, --chat-template)"
            )
        knobs = {"temperature": args.temperature, "top_p": args.top_p}
        # max_tokens None: the engine gives the reply all the room left in the context.
        self.params = SamplingParams(max_tokens=None, **{k: v for k, v in knobs.items() if v is not None})
        self.max_tokens = args.max_tokens
        self.template_kwargs = {"enable_thinking": False} if args.no_think else {}

    def reply(self, messages: list[dict]) -> Iterator[str]:
        from dataclasses import replace

        from .errors import InvalidRequestError

        prompt = self.llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **self.template_kwargs)
        params = self.params
        try:
            if self.max_tokens is not None:  # --max-tokens, but never past the context
                room = self.llm.frontend.info.max_model_len - len(self.llm.frontend.encode(prompt))
                params = replace(params, max_tokens=max(1, min(self.max_tokens, room)))
            rid = self.llm.add_request(prompt, params)
        except InvalidRequestError as e:
            raise ReplyRefused(str(e)) from None
        try:
            while self.llm.has_unfinished():
                for update in self.llm.step():
                    if update.request_id == rid and update.new_text:
                        yield update.new_text
        finally:  # Ctrl-C in the middle of a reply
            self.llm.abort(rid)


class RemoteChat:
    """A running server's /v1/chat/completions, streamed (server-sent events, read with the standard library)."""

    def __init__(self, args: argparse.Namespace):
        self.url = args.url.rstrip("/")
        key = args.api_key or env.client_api_key()
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.model = args.served_model_name or self._get("/v1/models")["data"][0]["id"]
        # No max_tokens unless given: the server bounds the reply by the room left in the context.
        self.fields = {"stream": True, **({"max_tokens": args.max_tokens} if args.max_tokens is not None else {})}
        self.fields.update(
            {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None}
        )
        if args.no_think:
            self.fields["chat_template_kwargs"] = {"enable_thinking": False}

    def _open(self, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            if body is not None and 400 <= e.code < 500 and e.code not in (401, 403, 404):
                raise ReplyRefused(f"HTTP {e.code}: {text[:500]}") from None  # this turn; the conversation goes on
            raise SystemExit(f"{self.url}{path}: HTTP {e.code}: {text[:500]}") from None
        except urllib.error.URLError as e:
            raise SystemExit(f"{self.url}: cannot connect ({e.reason}); is the server running?") from None

    def _get(self, path: str) -> dict:
        with self._open(path) as response:
            return json.load(response)

    def reply(self, messages: list[dict]) -> Iterator[str]:
        thinking = False
        with self._open("/v1/chat/completions", {"model": self.model, "messages": messages, **self.fields}) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise ReplyRefused(event["error"].get("message", "the server failed"))
                if not event.get("choices"):
                    continue
                delta = event["choices"][0].get("delta", {})
                # A server that splits the <think> block off (reasoning_content) gets its tags back for display.
                if delta.get("reasoning_content"):
                    if not thinking:
                        thinking = True
                        yield THINK_OPEN
                    yield delta["reasoning_content"]
                if delta.get("content"):
                    if thinking:
                        thinking = False
                        yield THINK_CLOSE
                    yield delta["content"]
        if thinking:
            yield THINK_CLOSE


# ---- the terminal side ------------------------------------------------------------------------------------------


class ThinkRenderer:
    """Writes streamed text, showing what lies between <think> and </think> dimmed when `styled` (the tags may
    arrive split across pieces, so a possible tag start is held back until it is known)."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, out, styled: bool):
        self.out, self.styled = out, styled
        self.pending = ""
        self.thinking = False

    def write(self, piece: str) -> None:
        if not self.styled:
            self.out.write(piece)
            self.out.flush()
            return
        self.pending += piece
        while self.pending:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            at = self.pending.find(tag)
            if at >= 0:
                self._emit(self.pending[:at])
                self.pending = self.pending[at + len(tag) :]
                self.thinking = not self.thinking
                self.out.write(self.DIM + "thinking: " if self.thinking else self.RESET + "\n")
                continue
            keep = next((n for n in range(len(tag) - 1, 0, -1) if self.pending.endswith(tag[:n])), 0)
            self._emit(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            break
        self.out.flush()

    def _emit(self, text: str) -> None:
        self.out.write(text)

    def finish(self) -> None:
        if self.pending:
            self._emit(self.pending)
            self.pending = ""
        if self.styled and self.thinking:
            self.out.write(self.RESET)
        self.out.write("\n")
        self.out.flush()


def _read_line(interactive: bool) -> str | None:
    """The next line the user typed; None at end of input."""
    if interactive:
        try:
            return input(">>> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run(backend, system: str | None, interactive: bool, styled: bool) -> int:
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731  (status lines stay off stdout)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        say(HELP)
    history: list[dict] = []
    while True:
        line = _read_line(interactive)
        if line is None:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            say("(conversation reset)")
            continue
        if text == "/system" or text.startswith("/system "):
            system = text[len("/system") :].strip() or None
            say(f"(system prompt {'set' if system else 'cleared'})")
            continue
        if text.startswith("/"):
            say(f"unknown command {text.split()[0]}; {HELP}")
            continue
        history.append({"role": "user", "content": text})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        renderer = ThinkRenderer(sys.stdout, styled)
        pieces = []
        try:
            for piece in backend.reply(messages):
                pieces.append(piece)
                renderer.write(piece)
        except KeyboardInterrupt:
            say("\n(reply interrupted)")
        except ReplyRefused as e:
            if pieces:  # refused mid-reply (an error event): end the line the reply was on
                renderer.finish()
            history.pop()  # the refused message; what came before stays
            say(f"(refused: {' '.join(str(e).split())}; the conversation is kept, /reset to start over)")
            continue
        renderer.finish()
        history.append({"role": "assistant", "content": "".join(pieces)})


def main(argv: list[str] | None = None, prog: str = "fastqwen chat") -> int:
    args = parse_args(argv, prog)
    interactive = sys.stdin.isatty()
    styled = sys.stdout.isatty() and not env.no_color()
    if args.model is not None:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        from .config import ConfigError

        try:
            backend = LocalChat(args)
        except ConfigError as e:
            print(f"{prog}: error: {EngineConfig.flag(e.field)}: {e}", file=sys.stderr)
            return 2
    else:
        backend = RemoteChat(args)
    try:
        return run(backend, args.system, interactive, styled)
    except KeyboardInterrupt:
        return 130
