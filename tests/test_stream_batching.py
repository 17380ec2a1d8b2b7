"""Streams under load: updates that piled up while the event loop was busy come out as one batch (one write), in
order, with every token and the finish, for one request and for several merged ones."""

from __future__ import annotations

import asyncio

import pytest
from checkpoints import make_checkpoint
from fastqwen import SamplingParams
from fastqwen.engine.client import InProcessEngineClient
from fastqwen.engine.llm_engine import LLMEngine
from fastqwen.frontend import Frontend
from fastqwen.server.async_engine import AsyncEngine, Mailbox
from fastqwen.server.serving import stream_requests


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stream"))
    make_checkpoint(path, tied=False, num_heads=4, num_kv_heads=2, seed=5, max_positions=512)
    return LLMEngine(path, dtype="float32", device="cpu", page_size=4, num_pages=256)


@pytest.mark.parametrize("num_requests", [1, 3])
def test_piled_up_updates_come_as_one_batch(engine, num_requests):
    async def scenario():
        # The client's thread is not started: the test runs the engine's steps itself.
        front = AsyncEngine(InProcessEngineClient(engine), Frontend.for_engine(engine.info))
        front._loop = asyncio.get_running_loop()
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        requests = [front.new_request([3 + i, 4, 5, 6], params) for i in range(num_requests)]
        for request in requests:  # what enqueue does, without the engine thread it checks for
            front._queues[request.rid] = Mailbox()
            front._trackers[request.rid] = request
            engine.add(request.request)
        stream = stream_requests(front, requests, None)
        produced = 0
        while engine.has_unfinished():  # every step's updates land in the queues before the stream reads any
            output = engine.step()
            produced += len(output.deltas)
            front._on_output(output)
            await asyncio.sleep(0)  # the loop runs the dispatch the engine thread would have scheduled
        batches = [batch async for batch in stream]
        return requests, produced, batches

    requests, produced, batches = asyncio.run(scenario())
    assert len(batches) == 1, [len(b) for b in batches]  # all of it was waiting: one batch, one write
    items = batches[0]
    assert len(items) == produced == 6 * len(requests)
    for index, request in enumerate(requests):
        mine = [item.timed.update for item in items if item.index == index]
        assert [t for u in mine for t in u.new_token_ids] == request.output_ids  # every token, in order
        assert [u.finished for u in mine] == [False] * 5 + [True]
        assert mine[-1].output.token_ids == request.output_ids


def test_sse_events_stay_one_line_for_clients_that_split_on_unicode_line_breaks():
    """JSON leaves U+2028, U+2029 and U+0085 raw in strings; httpx's iter_lines (str.splitlines) ends a line at each.
    Every event the server writes (OpenAI's via sse, /generate's via sse_event) escapes them: one data line per
    event, decoding to the original text."""
    import json

    import httpx
    from fastqwen.server.serving import sse, sse_event

    text = 'a\u2028b\x85c\u2029d\ne"f\\'
    for event in (sse({"choices": [{"text": text}]}), sse_event(json.dumps({"text": text}, ensure_ascii=False))):
        lines = [line for line in httpx.Response(200, text=event).iter_lines() if line]
        assert len(lines) == 1 and lines[0].startswith("data: ")
        decoded = json.loads(lines[0][6:])
        assert (decoded["choices"][0]["text"] if "choices" in decoded else decoded["text"]) == text


def test_templated_token_events_are_the_bytes_sse_writes():
    """TextEvents fills a chunk encoded once with placeholders: for any index and text (quotes, backslashes, control
    characters, the line breaks escaped above, non-ASCII) the event must equal sse() of the whole chunk."""
    from fastqwen.server.serving import TextEvents, sse

    header = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": 'm"\u2028é'}

    def chunk(i, text):
        return {
            **header,
            "choices": [{"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
        }

    events = TextEvents(chunk)
    for index, text in enumerate(
        ["", " abcd", 'q"\\', "\x00\x1f\t\n", "a\u2028b\x85c\u2029", "日本\ufffd", "\U0001f600"]
    ):
        assert events(index * 11, text) == sse(chunk(index * 11, text))
