"""`fastqwen chat` on a short context: the default reply length fits whatever room is left, and a turn the model or
server refuses (a 400) is reported while the conversation goes on with its history (issue 44)."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from checkpoints import make_checkpoint
from fastqwen.chat import main
from test_text import CHAT_TEMPLATE

LONG = " ".join(f"t{i % 50}" for i in range(400))  # far past a 64-token context


def _run(monkeypatch, capsys, argv: list[str], stdin: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


class _Stub(BaseHTTPRequestHandler):
    """An OpenAI-style server that refuses a message over 100 characters with a 400, and otherwise streams 'ok N'."""

    bodies: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if len(body["messages"][-1]["content"]) > 100:
            error = {"error": {"message": "the prompt is too long", "type": "invalid_request_error", "code": 400}}
            data = json.dumps(error).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "delta": {"content": f"ok {len(self.bodies)}"}}]}
        self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())


def test_a_refused_turn_keeps_the_conversation_with_a_server(monkeypatch, capsys):
    _Stub.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = ["--url", url, "--served-model-name", "m"]
        code, out, err = _run(monkeypatch, capsys, argv, f"hello\n{LONG}\nagain\n")
    finally:
        server.shutdown()
    assert code == 0, err
    assert "HTTP 400: the prompt is too long" in err and "the conversation is kept" in err
    assert out.split("\n") == ["ok 1", "ok 3", ""]
    assert "max_tokens" not in _Stub.bodies[0]  # the server bounds the reply by the room left
    assert _Stub.bodies[2]["messages"] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "ok 1"},
        {"role": "user", "content": "again"},
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    make_checkpoint(str(path), tied=True, seed=5)
    (path / "template.jinja").write_text(CHAT_TEMPLATE)
    return str(path)


@pytest.mark.parametrize("max_tokens", [[], ["--max-tokens", "4096"]])
def test_a_short_context_chats_and_refuses_only_what_cannot_fit(monkeypatch, capsys, folder, max_tokens):
    engine = ["--device", "cpu", "--max-model-len", "64", "--num-pages", "32", "--page-size", "8"]
    argv = [folder, *engine, "--chat-template", f"{folder}/template.jinja", "--temperature", "0", *max_tokens]
    # A reply may fill the context (a random model rarely stops): /reset makes room for the last message.
    code, out, err = _run(monkeypatch, capsys, argv, f"t5 t6\n{LONG}\n/reset\nt7\n")
    assert code == 0, err
    assert err.count("(refused: ") == 1 and "maximum context length is 64 tokens" in err, err
    assert len(out.split("\n")) == 3, out  # the first and the last message were answered (a line each)
