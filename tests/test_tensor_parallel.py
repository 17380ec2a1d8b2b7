"""Tensor parallelism on the CPU (gloo), against Hugging Face transformers, float32, greedy, token-exact.

The shard math and the loader first (in this process): every rank's slice, put back together, is the checkpoint's
tensor; KV heads are replicated when there are more ranks than KV heads; matrices are read by slices, never whole.
Then whole engines of 2 and 4 ranks (one process each): through the offline LLM and through the server, HF's greedy
tokens exactly, logits within float32 tolerance of one rank's, sampled tokens the same on every rank (rank 0
checksums each step against the others), and a rank that dies ends the engine instead of hanging it.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
import torch
from checkpoints import engine_logits, hf_greedy, make_checkpoint, teacher_forced_match, write_byte_level_tokenizer
from fastqwen import LLM, SamplingParams
from fastqwen.config import load_model_config
from fastqwen.sampling_params import StructuredOutput
from fastqwen.sharding import Shard
from fastqwen.weights import _TensorSource, dummy_weights, load_weights, shard_weights
from server_process import ServerProcess
from test_embeddings import KNOBS, write_embedding_checkpoint, write_reranker_checkpoint

VOCAB = 390  # not a multiple of 4: the last rank's vocabulary slice is padded
NEW_TOKENS = 24
PROMPTS = [[5, 17, 200, 3], list(range(1, 30)), [300, 2, 2, 9, 41, 7, 100]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """4 query heads, 2 KV heads: TP=2 splits the KV heads, TP=4 replicates each on two ranks."""
    folder = str(tmp_path_factory.mktemp("tp"))
    hf = make_checkpoint(folder, tied=False, num_heads=4, num_kv_heads=2, vocab=VOCAB, seed=3, max_shard_size="40KB")
    write_byte_level_tokenizer(folder, VOCAB)  # for the structured-output case (grammars need the tokenizer)
    return folder, hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


# ---- the shard math and the loader (no processes) -----------------------------------------------------------


def test_kv_heads_follow_the_query_heads_they_serve(model):
    cfg, _ = load_model_config(model[0])
    group = cfg.num_heads // cfg.num_kv_heads
    for size in (1, 2, 4):
        for rank in range(size):
            shard = Shard(rank, size)
            q0, q1 = shard.heads(cfg)
            k0, k1 = shard.kv_heads(cfg)
            # Every query head this rank holds reads a KV head this rank holds, at the same local GQA offset.
            assert {q // group for q in range(q0, q1)} == set(range(k0, k1))
            local = shard.rank_config(cfg)
            assert local.num_heads == q1 - q0 and local.num_kv_heads == k1 - k0
    assert [Shard(r, 4).kv_heads(cfg) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated
    with pytest.raises(ValueError, match="attention heads"):
        Shard(0, 3).check(cfg)


@pytest.mark.parametrize("size", [2, 4])
def test_shards_put_back_together_are_the_checkpoint(model, size):
    folder, hf, _ = model
    cfg, _ = load_model_config(folder)
    hf_state = {k: v.float() for k, v in hf.state_dict().items()}
    shards = [load_weights(folder, cfg, torch.float32, torch.device("cpu"), shard=Shard(r, size)) for r in range(size)]
    rows = Shard(0, size).vocab_rows(VOCAB)
    embed = torch.cat([w.embed for w in shards])
    assert all(w.embed.shape[0] == rows for w in shards)
    torch.testing.assert_close(embed[:VOCAB], hf_state["model.embed_tokens.weight"], rtol=0, atol=0)
    assert not embed[VOCAB:].any(), "the vocabulary padding must be zeros"
    torch.testing.assert_close(
        torch.cat([w.lm_head.weight for w in shards])[:VOCAB], hf_state["lm_head.weight"], rtol=0, atol=0
    )
    d, q_per = cfg.head_dim, cfg.num_heads // size
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        q_rows = torch.cat([w.layers[n].qkv.weight[: q_per * d] for w in shards])
        torch.testing.assert_close(q_rows, hf_state[p + "self_attn.q_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(
            torch.cat([w.layers[n].o_proj.weight for w in shards], 1),
            hf_state[p + "self_attn.o_proj.weight"],
            rtol=0,
            atol=0,
        )
        torch.testing.assert_close(
            torch.cat([w.layers[n].down.weight for w in shards], 1),
            hf_state[p + "mlp.down_proj.weight"],
            rtol=0,
            atol=0,
        )
        gate = torch.cat([w.layers[n].gate_up.weight[: w.layers[n].gate_up.weight.shape[0] // 2] for w in shards])
        torch.testing.assert_close(gate, hf_state[p + "mlp.gate_proj.weight"], rtol=0, atol=0)
        for r, w in enumerate(shards):
            k0, k1 = Shard(r, size).kv_heads(cfg)
            k = w.layers[n].qkv.weight[q_per * d : q_per * d + (k1 - k0) * d]
            torch.testing.assert_close(k, hf_state[p + "self_attn.k_proj.weight"][k0 * d : k1 * d], rtol=0, atol=0)


def test_sharded_load_reads_matrices_by_slices_only(model, monkeypatch):
    folder = model[0]
    cfg, _ = load_model_config(folder)
    whole = []
    get = _TensorSource.get
    monkeypatch.setattr(_TensorSource, "get", lambda self, name: whole.append(name) or get(self, name))
    load_weights(folder, cfg, torch.float32, torch.device("cpu"), shard=Shard(1, 2))
    assert whole and all(name.endswith("norm.weight") for name in whole), whole


def test_dummy_weights_are_the_same_numbers_at_any_size(model):
    cfg, _ = load_model_config(model[0])
    full = dummy_weights(cfg, torch.float32, torch.device("cpu"), seed=5)
    for rank in range(2):
        mine = dummy_weights(cfg, torch.float32, torch.device("cpu"), seed=5, shard=Shard(rank, 2))
        expected = shard_weights(full, cfg, Shard(rank, 2))
        for a, b in zip(mine.layers, expected.layers):
            for name, t in vars(a).items():
                t, other = (
                    (t.weight, getattr(b, name).weight)
                    if name in ("qkv", "o_proj", "gate_up", "down")
                    else (t, getattr(b, name))
                )
                torch.testing.assert_close(t, other, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(mine.embed, expected.embed, rtol=0, atol=0)


# ---- whole engines: one process per rank ---------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """Child processes of pid, whichever of its threads started them (Linux /proc)."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except FileNotFoundError:
        pass
    return found


def is_rank(pid: int) -> bool:
    """A spawned engine process, not multiprocessing's resource tracker."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"resource_tracker" not in f.read()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


# TP=2 changes only how the float32 sums are grouped (each rank's partial o_proj and down sums, added by the
# all-reduce). Measured on this checkpoint, teacher-forced: at most 5.9e-7 of the largest |logit| (every one of the
# 72 steps decisive). Stated: 1e-5; a shard left out or a residual added twice moves logits by far more.
TOLERANCE = 1e-5


def norms_after_row_parallel_sums(layers) -> list:
    """The norm weights a forward pass hands all_reduce_add_rms_norm, in order: each layer's post-attention norm
    (after o_proj), and the next layer's input norm (after down) but after the last layer's (the final norm takes
    only the sampled rows)."""
    weights = []
    for index, layer in enumerate(layers):
        weights.append(layer.post_norm)
        if index + 1 < len(layers):
            weights.append(layers[index + 1].input_norm)
    return weights


def test_tp2_matches_hf_and_one_rank(model):
    folder, _, expected = model
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    single = LLM(folder, dtype="float32", device="cpu", num_pages=128, page_size=4)
    references = [engine_logits(single, p, NEW_TOKENS) for p in PROMPTS]
    tokens_1, logits_1 = references[1]
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=128, page_size=4, tensor_parallel_size=2)
    try:
        outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected
        tokens_2, logits_2 = engine_logits(llm, PROMPTS[1], NEW_TOKENS)
        assert tokens_2 == tokens_1 and tokens_1[: len(expected[1])] == expected[1]  # (ignore_eos runs on past EOS)
        torch.testing.assert_close(logits_2, logits_1, rtol=1e-4, atol=1e-4)
        # The row-parallel sums pass through all_reduce_add_rms_norm (on the CPU the gloo all-reduce, then
        # fused_add_rms_norm), with the norm that follows each; teacher-forced against TP=1, every logit within the
        # tolerance and TP=1's token wherever its margin allows.
        parallel = llm.engine.model.parallel
        seen = []
        fused = parallel.all_reduce_add_rms_norm
        parallel.all_reduce_add_rms_norm = lambda p, r, weight, eps, **kw: (
            seen.append(weight) or fused(p, r, weight, eps, **kw)
        )
        try:
            teacher_forced_match(
                llm, PROMPTS, references, TOLERANCE, min_decisive=len(PROMPTS) * NEW_TOKENS * 3 // 4, bound_forced=True
            )
        finally:
            del parallel.all_reduce_add_rms_norm
        per_forward = norms_after_row_parallel_sums(llm.engine.model.weights.layers)
        forwards = len(seen) // len(per_forward)
        assert forwards > 0 and len(seen) == forwards * len(per_forward)
        assert all(a is b for a, b in zip(seen, per_forward * forwards)), "a sum went to the wrong norm"
        # Sampled tokens: every rank must draw the same ones (a rank that drew another would fail the step checksum
        # and end the engine), and with seeds the draws repeat.
        sampled = [
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=s, ignore_eos=True) for s in (1, 2, 3)
        ]
        first = [o.token_ids for o in llm.generate(PROMPTS, sampled, use_tqdm=False)]
        second = [o.token_ids for o in llm.generate(PROMPTS, sampled, use_tqdm=False)]
        assert first == second and len(set(map(tuple, first))) > 1
        # Prompt logprobs: the LM head over prompt positions is vocabulary-parallel too (gathered, then log-softmax).
        lp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
        got, want = (
            llm.generate([PROMPTS[1]], lp, use_tqdm=False)[0],
            single.generate([PROMPTS[1]], lp, use_tqdm=False)[0],
        )
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(PROMPTS[1])
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert (
                a.token == b.token
                and abs(a.logprob - b.logprob) < 1e-4
                and [t for t, _ in a.top] == [t for t, _ in b.top]
            )
        # Structured output: each rank compiles its own grammars, and must still admit them at the same step.
        regex = "[0-9]{3}-[a-z]{2,4}"
        constrained = [
            SamplingParams(temperature=1.0, max_tokens=16, seed=s, structured=StructuredOutput("regex", regex))
            for s in (4, 5)
        ]
        outs = llm.generate(["a", "b", PROMPTS[0]], constrained + [sampled[0]], use_tqdm=False)
        for out in outs[:2]:
            assert re.fullmatch(regex, out.text), out.text
        assert outs[2].token_ids == first[0]
        llm.engine.check_invariants()
        assert llm.engine.kv.num_pages == 128
        # At close rank 0's CUDA graphs go before its NCCL communicator: NCCL's teardown waits until every graph that
        # captured one of its collectives is destroyed, so the other order hangs on GPUs. (On the CPU both steps do
        # nothing: their order is what this checks.)
        order = []
        runner, parallel = llm.engine.engine.runner, llm.engine.parallel
        release, abort = runner.release_graphs, parallel.abort_device_group
        runner.release_graphs = lambda: order.append("graphs") or release()
        parallel.abort_device_group = lambda: order.append("communicator") or abort()
    finally:
        llm.close()
    assert not any(p.is_alive() for p in llm.engine.processes)
    assert order == ["graphs", "communicator"]


def test_tp2_speculation_matches_one_rank(model):
    """Speculative decoding under TP=2: every rank drafts from the same tokens and accepts the same run (a rank that
    drifted fails the step checksum and ends the engine: rank 1 drafting one token fewer did); greedy outputs equal
    one rank's without speculation, and drafts were accepted."""
    folder = model[0]
    knobs = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance_rate": 0.0}
    prompts = [p * 3 for p in PROMPTS]  # (repeated prompts: the n-gram lookup finds runs to draft)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    reference = LLM(folder, **knobs).generate(prompts, greedy, use_tqdm=False)
    llm = LLM(folder, **knobs, tensor_parallel_size=2, speculative_config=spec)
    try:
        out = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.token_ids for o in out] == [r.token_ids for r in reference]
        stats = llm.engine.stats()
        assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats
        llm.engine.check_invariants()
    finally:
        llm.close()


def test_tp4_replicates_kv_heads_and_matches_hf(model):
    folder, _, expected = model
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=128, tensor_parallel_size=4)
    try:
        assert llm.engine.rank_config.num_kv_heads == 1 and llm.engine.rank_config.num_heads == 1
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected
    finally:
        llm.close()


def test_embeddings_and_scores_under_tp2_are_one_ranks(tmp_path):
    """Pooling under tensor parallelism: every rank computes the last position's hidden state (replicated after the
    row-parallel all-reduce) or the reranker's yes/no logits (the LM head's vocabulary slices gathered), and rank 0's
    result is returned. TP=2 against TP=1 (itself checked against Hugging Face in test_embeddings): embeddings of an
    embedding checkpoint without an LM head (each rank loads its slices), a reranker's scores and its generation."""
    embedding_folder = write_embedding_checkpoint(str(tmp_path / "embedding"))
    reranker_folder = write_reranker_checkpoint(str(tmp_path))
    texts = ["the quick brown fox", "漢字 and emoji 🙂, a longer input than the first one", [5, 6, 7]]
    query, documents = "what is the capital of China?", ["Beijing is the capital of China.", "Gravity.", "no idea"]
    one_embed, one_score = LLM(embedding_folder, **KNOBS), LLM(reranker_folder, **KNOBS)
    expected_vectors, expected_scores = one_embed.embed(texts), one_score.score(query, documents)
    for folder in (embedding_folder, reranker_folder):
        llm = LLM(folder, **KNOBS, tensor_parallel_size=2)
        try:
            if folder == embedding_folder:
                for got, want in zip(llm.embed(texts), expected_vectors):
                    assert torch.dot(torch.tensor(got), torch.tensor(want)).item() > 1 - 1e-5
            else:
                scores = llm.score(query, documents)
                assert max(abs(a - b) for a, b in zip(scores, expected_scores)) < 1e-5, (scores, expected_scores)
                greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)  # (a reranker also generates)
                assert (
                    llm.generate([[5, 6, 7, 8]], greedy)[0].token_ids
                    == one_score.generate([[5, 6, 7, 8]], greedy)[0].token_ids
                )
        finally:
            llm.close()


def test_a_rank_that_dies_ends_the_engine(model):
    folder = model[0]
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=128, tensor_parallel_size=2)
    rank1 = llm.engine.processes[0]
    llm.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    llm.step()
    os.kill(rank1.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1|tensor parallel|Connection|peer"):
        while llm.has_unfinished():
            llm.step()
    assert time.monotonic() - started < 30


def test_server_tp2_matches_hf_and_exits_when_a_rank_dies(model):
    folder, _, expected = model
    server = ServerProcess(folder, "--dtype", "float32", "--device", "cpu", "--num-pages", "256", "--tp", "2")
    try:
        body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
        response = httpx.post(server.url + "/generate", json=body, timeout=60)
        assert [r["output_ids"] for r in response.json()] == expected
        core = [c for c in children(server.proc.pid) if is_rank(c)]
        ranks = [pid for c in core for pid in children(c) if is_rank(pid)]
        assert len(core) == 1 and len(ranks) == 1, "expected the core process and its rank 1"
        os.kill(ranks[0], signal.SIGKILL)
        assert server.proc.wait(30) != 0, "the server must exit non-zero when a rank dies"
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in core)
    finally:
        server.stop()
