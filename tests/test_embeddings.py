"""Qwen3-Embedding and Qwen3-Reranker (pooling.py, retrieval.py, server/retrieval_api.py) on tiny random checkpoints,
against Hugging Face transformers computed here: embeddings (last-token pooling, normalized) within 1e-3 cosine,
reranker scores (softmax of the "yes"/"no" logits at the last position of Qwen's prompt) within 1e-3."""

from __future__ import annotations

import base64
import os
import struct

import httpx
import pytest
import torch
from checkpoints import write_byte_level_tokenizer
from fastqwen import LLM
from fastqwen.pooling import detect_task
from fastqwen.retrieval import rerank_prompt
from server_process import ServerProcess

SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
KNOBS = dict(device="cpu", dtype="float32", num_pages=96, page_size=4)


def _tokenizer(folder: str, *, eos_suffix: bool = False, yes_no: bool = False) -> None:
    """The byte-level test tokenizer; eos_suffix: appends <|endoftext|> as Qwen3-Embedding's post-processor does;
    yes_no: "yes" and "no" as tokens of their own (Qwen's vocabulary has both)."""
    from tokenizers import Tokenizer, processors

    write_byte_level_tokenizer(folder)
    path = os.path.join(folder, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    if yes_no:
        tok.add_tokens(["yes", "no"])
    if eos_suffix:
        eos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A $B <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
        )
    tok.save(path)


def write_embedding_checkpoint(folder: str) -> str:
    """A tiny Qwen3-Embedding: a bare Qwen3Model (no LM head, tensors without "model.")."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    Qwen3Model(Qwen3Config(**SHAPE)).save_pretrained(folder)
    _tokenizer(folder, eos_suffix=True)
    return folder


def write_reranker_checkpoint(parent: str) -> str:
    """A tiny Qwen3-Reranker (a causal LM, detected by its folder's name) in parent; its folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = os.path.join(parent, "tiny-Qwen3-Reranker")
    torch.manual_seed(1)
    Qwen3ForCausalLM(Qwen3Config(**{**SHAPE, "vocab_size": 322})).save_pretrained(folder)
    _tokenizer(folder, yes_no=True)
    return folder


@pytest.fixture(scope="module")
def embedding_folder(tmp_path_factory) -> str:
    return write_embedding_checkpoint(str(tmp_path_factory.mktemp("tiny-Qwen3-Embedding")))


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory) -> str:
    return write_reranker_checkpoint(str(tmp_path_factory.mktemp("x")))


def _hf_embedding(folder: str, ids: list[int]) -> torch.Tensor:
    from transformers import Qwen3Model

    model = Qwen3Model.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        last = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(last, dim=-1)


def test_reranker_prompt_is_qwens():
    """The format of Qwen3-Reranker's model card, written out here independently of retrieval.py."""
    expected = (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
        'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
        "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n<Query>: q\n"
        "<Document>: d<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert rerank_prompt("q", "d") == expected
    assert "<Instruct>: find code\n" in rerank_prompt("q", "d", "find code")


def test_task_detection():
    assert detect_task("/m/Qwen3-8B", ["Qwen3ForCausalLM"], True) == "generate"
    assert detect_task("/m/anything", ["Qwen3Model"], True) == "embed"
    assert detect_task("/m/anything", ["Qwen3ForCausalLM"], False) == "embed"
    assert detect_task("/hub/models--Qwen--Qwen3-Embedding-0.6B/snapshots/abc", ["Qwen3ForCausalLM"], True) == "embed"
    assert detect_task("/m/Qwen3-Reranker-0.6B", ["Qwen3ForCausalLM"], True) == "score"


def test_embed_matches_transformers(embedding_folder):
    from tokenizers import Tokenizer

    llm = LLM(embedding_folder, **KNOBS)
    assert llm.engine.task == "embed"  # detected: Qwen3Model, no LM head
    texts = ["the quick brown fox", "漢字 and emoji 🙂, a longer input than the first one"]
    tok = Tokenizer.from_file(os.path.join(embedding_folder, "tokenizer.json"))
    token_ids = [tok.encode(t).ids for t in texts]  # the post-processor's <|endoftext|> last
    assert all(ids[-1] == tok.token_to_id("<|endoftext|>") for ids in token_ids)
    from_text = llm.embed(texts)
    from_ids = llm.embed(token_ids + [[5, 6, 7]])
    for ids, a, b in zip(token_ids + [[5, 6, 7]], from_text + [None], from_ids):
        reference = _hf_embedding(embedding_folder, ids)
        for vector in (a, b) if a is not None else (b,):
            v = torch.tensor(vector)
            assert abs(v.norm().item() - 1) < 1e-5
            assert torch.dot(v, reference).item() > 1 - 1e-3
    # dimensions: the first values, normalized again (the model card's MRL)
    short = torch.tensor(llm.embed(token_ids[0], dimensions=16)[0])
    reference = torch.nn.functional.normalize(_hf_embedding(embedding_folder, token_ids[0])[:16], dim=-1)
    assert short.shape == (16,) and torch.dot(short, reference).item() > 1 - 1e-3
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("x", dimensions=65)
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate("hello")


def _hf_scores(folder: str, llm: LLM, query: str, documents: list[str]) -> list[float]:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = llm.tokenizer
    yes, no = tok.token_id("yes"), tok.token_id("no")
    scores = []
    for d in documents:
        with torch.no_grad():
            logits = model(torch.tensor([tok.encode(rerank_prompt(query, d))])).logits[0, -1]
        scores.append(torch.softmax(logits[[yes, no]], dim=-1)[0].item())
    return scores


def test_score_matches_transformers_and_batches_with_generation(reranker_folder):
    llm = LLM(reranker_folder, **KNOBS)
    assert llm.engine.task == "score"  # detected by name
    query = "what is the capital of China?"
    documents = ["Beijing is the capital of China.", "Gravity attracts bodies.", "no idea", "yes, Beijing"]
    scores = llm.score(query, documents)
    reference = _hf_scores(reranker_folder, llm, query, documents)
    assert max(abs(a - b) for a, b in zip(scores, reference)) < 1e-3
    # A reranker is a causal LM: its generation and its scores share steps.
    generating = llm.add_request([5, 6, 7, 8])
    scoring = llm.frontend.new_score_request(query, documents[0])
    llm._add(scoring)
    first = {u.request_id: u for u in llm.step()}
    assert generating in first and first[scoring.rid].finished
    assert abs(first[scoring.rid].output.pooled[0] - reference[0]) < 1e-3


def _embed_vector(item) -> list[float]:
    return list(item.embedding)


def test_embeddings_server(embedding_folder):
    import openai

    srv = ServerProcess(embedding_folder, *[f"--{k.replace('_', '-')}={v}" for k, v in KNOBS.items()])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        offline = LLM(embedding_folder, **KNOBS)
        texts = ["the quick brown fox", "jumps over"]
        expected = offline.embed(texts)
        response = client.embeddings.create(model=embedding_folder, input=texts, encoding_format="float")
        assert [d.index for d in response.data] == [0, 1]
        for item, vector in zip(response.data, expected):
            assert torch.dot(torch.tensor(_embed_vector(item)), torch.tensor(vector)).item() > 1 - 1e-4
        assert response.usage.prompt_tokens == response.usage.total_tokens > 0
        # base64: little-endian float32, the openai client decodes it
        raw = httpx.post(
            srv.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64", "dimensions": 8}
        ).json()
        decoded = struct.unpack("<8f", base64.b64decode(raw["data"][0]["embedding"]))
        expected_short = offline.embed(texts[0], dimensions=8)[0]
        assert max(abs(a - b) for a, b in zip(decoded, expected_short)) < 1e-5
        by_client = client.embeddings.create(model=embedding_folder, input=[[5, 6, 7], [8, 9]], dimensions=8)
        assert len(by_client.data[0].embedding) == 8
        assert (
            torch.dot(torch.tensor(by_client.data[1].embedding), torch.tensor(offline.embed([8, 9], 8)[0])) > 1 - 1e-4
        )
        bad = [
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            ({"input": "x", "dimensions": 0}, "dimensions"),
            ({"input": "x", "dimensions": 65}, "dimensions"),
            ({"input": []}, "input"),
            ({"input": [[1, 2], "x", 3]}, "input"),
            ({"input": [[100000]]}, "input"),
            ({"input": ["x"] * 257}, "input"),
            ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ]
        for body, param in bad:
            r = httpx.post(srv.url + "/v1/embeddings", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        r = httpx.post(srv.url + "/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    finally:
        srv.stop()


def test_rerank_server(reranker_folder):
    srv = ServerProcess(reranker_folder, *[f"--{k.replace('_', '-')}={v}" for k, v in KNOBS.items()])
    try:
        offline = LLM(reranker_folder, **KNOBS)
        query, documents = "capital of China", ["Beijing", "gravity", "a cat", "yes"]
        expected = offline.score(query, documents)
        order = sorted(range(4), key=lambda i: -expected[i])
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            r = httpx.post(srv.url + path, json={"query": query, "documents": documents, "top_n": 2})
            results = r.json()["results"]
            assert [x["index"] for x in results] == order[:2], r.text
            assert all(abs(x["relevance_score"] - expected[x["index"]]) < 1e-4 for x in results)
            assert results[0]["document"] == {"text": documents[order[0]]}
        r = httpx.post(srv.url + "/v1/rerank", json={"query": query, "documents": documents, "return_documents": False})
        assert len(r.json()["results"]) == 4 and "document" not in r.json()["results"][0]
        r = httpx.post(srv.url + "/score", json={"text_1": query, "text_2": documents}).json()
        assert [abs(d["score"] - e) < 1e-4 for d, e in zip(r["data"], expected)] == [True] * 4
        bad = [
            ("/v1/rerank", {"query": query, "documents": [3]}, "documents"),
            ("/v1/rerank", {"query": query, "documents": ["d"], "top_n": -1}, "top_n"),
            ("/v1/rerank", {"query": query, "documents": ["d"] * 257}, "documents"),
            ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
            ("/v1/embeddings", {"input": "x"}, "model"),
        ]
        for path, body, param in bad:
            r = httpx.post(srv.url + path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    finally:
        srv.stop()
