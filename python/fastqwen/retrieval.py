"""The frontend's half of Qwen3-Embedding and Qwen3-Reranker (the engine's half: pooling.py): embedding inputs and
their truncation to fewer dimensions, and the reranker's prompt and the token ids it is judged by.

Qwen3-Reranker is a causal LM asked whether a document meets a query; its relevance score is the probability of
"yes" against "no" as the next token, after Qwen's documented prompt: a system message that asks for a yes/no
judgement, the user turn with <Instruct>, <Query> and <Document> lines, and the assistant turn opened with an empty
think block.
"""

from __future__ import annotations

import math

from .errors import InvalidRequestError

RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
# The instruction Qwen's model card uses when none is given.
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The text whose next token Qwen3-Reranker judges "yes" or "no" for (query, document)."""
    return (
        f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
        f"<Instruct>: {instruction or DEFAULT_RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def truncate_embedding(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, normalized again (Qwen3-Embedding is trained with Matryoshka representation
    learning: a prefix of the vector is an embedding of its own). None: the whole vector as it is."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def check_dimensions(dimensions: int | None, hidden_size: int, param: str = "dimensions") -> None:
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden_size:
        raise InvalidRequestError(
            f"dimensions must be an integer from 1 to the model's embedding size {hidden_size}, got {dimensions!r}",
            param,
        )
