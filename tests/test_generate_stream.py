"""SGLang's /generate streaming: each event carries the whole output so far (SGLang's clients read it that way), or
only the new part with --incremental-streaming-output; both against the same request answered in one piece. Updates
that pile up while a stream is behind go out as one event (as in SGLang), so there are at most as many events as
tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from checkpoints import make_checkpoint
from server_process import ServerProcess

COMMON = ["--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--page-size", "4"]
REQUEST = {
    "input_ids": [5, 9, 14, 3],
    "return_logprob": True,
    "top_logprobs_num": 2,
    "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("generate"))
    make_checkpoint(path, tied=True, seed=44)
    return path


def stream_events(url: str) -> list[dict]:
    with httpx.stream("POST", url + "/generate", json={**REQUEST, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


@pytest.mark.parametrize("incremental", [False, True])
def test_generate_stream_matches_the_whole_answer(folder, incremental):
    srv = ServerProcess(folder, *COMMON, *(["--incremental-streaming-output"] if incremental else []))
    try:
        whole = httpx.post(srv.url + "/generate", json=REQUEST, timeout=60).json()
        events = stream_events(srv.url)
    finally:
        srv.stop()
    ids, meta = whole["output_ids"], whole["meta_info"]
    assert len(ids) == 24 and 1 <= len(events) <= 24
    if incremental:
        assert sum((e["output_ids"] for e in events), []) == ids
        assert "".join(e["text"] for e in events) == whole["text"]
        streamed_lp = sum((e["meta_info"]["output_token_logprobs"] for e in events), [])
        streamed_top = sum((e["meta_info"]["output_top_logprobs"] for e in events), [])
    else:
        previous = 0
        for event in events:  # cumulative: each event holds a longer prefix of the answer
            n = len(event["output_ids"])
            assert n > previous and event["output_ids"] == ids[:n]
            assert whole["text"].startswith(event["text"])
            assert len(event["meta_info"]["output_token_logprobs"]) == n == event["meta_info"]["completion_tokens"]
            previous = n
        assert events[-1]["text"] == whole["text"]
        streamed_lp = events[-1]["meta_info"]["output_token_logprobs"]
        streamed_top = events[-1]["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in streamed_lp] == ids
    assert len(set(ids)) > 3, "a seeded draw of 24 tokens should vary: weak test otherwise"
    assert all(abs(a[0] - b[0]) < 1e-5 for a, b in zip(streamed_lp, meta["output_token_logprobs"]))
    assert [[t for _, t, _ in top] for top in streamed_top] == [
        [t for _, t, _ in top] for top in meta["output_top_logprobs"]
    ]
    assert events[-1]["meta_info"]["finish_reason"] == meta["finish_reason"] == {"type": "length", "length": 24}
    assert events[-1]["meta_info"]["completion_tokens"] == 24
