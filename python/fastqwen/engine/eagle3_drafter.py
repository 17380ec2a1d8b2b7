"""The `eagle3` drafter: an EAGLE-3 head (model/eagle3.py) drafting from the target's hidden states. It lives in the
engine, beside the model it reads; the speculator (speculative/) asks it for drafts as it asks the token-id drafters.

Per request it keeps the head's KV over the positions the target has computed and kept, each built from the target's
aux hidden states at p and the token at p + 1, and the head's prediction after the last of them. After every step
(`advance`, called by the engine with that step's aux hidden states) it drops what lies at or past the step's first
position (the KV of last step's drafts, or of positions being recomputed after a preemption) and runs the head over
the positions the step kept. `propose` then drafts autoregressively: the first token is that prediction, each next
one feeds the head its own output before the final norm, at the next position; the KV of those draft positions is
dropped again (the target's hidden states replace them once it has verified).

Positions the request got from the prefix cache were never computed here: the head attends to what it has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.eagle3 import Eagle3Head, HeadKV


@dataclass
class _State:
    kv: HeadKV
    end: int = 0  # one past the last position seen
    next_token: int = -1  # the head's prediction for the token at `end + 1`
    feature: torch.Tensor | None = None  # the head's output at end - 1, before its final norm [1, hidden]


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, num_tokens: int):
        self.head = head
        self.num_tokens = num_tokens
        self._states: dict[int, _State] = {}

    def advance(self, request, start: int, aux_hidden: torch.Tensor) -> None:
        """The target computed and kept positions start .. start + R - 1 of the request (aux_hidden [R, ...], their
        hidden states at the head's aux layers); the token after each is in request.token_ids."""
        state = self._states.get(request.rid)
        if state is None:
            state = self._states[request.rid] = _State(self.head.empty_kv())
        state.kv.truncate(start)
        rows = aux_hidden.shape[0]
        device = self.head.device
        next_tokens = torch.tensor(request.token_ids[start + 1 : start + rows + 1], dtype=torch.int64, device=device)
        positions = torch.arange(start, start + rows, dtype=torch.int64, device=device)
        drafts, outputs = self.head.forward(next_tokens, aux_hidden, positions, state.kv)
        state.end, state.next_token, state.feature = start + rows, int(drafts[-1]), outputs[-1:]

    def propose(self, rid: int, tokens: list[int], num_prompt_tokens: int, limit: int) -> tuple[list[int], float]:
        state = self._states.get(rid)
        if state is None or state.end != len(tokens) - 1:
            return [], 0.0  # the head has not seen the request's last position (nothing computed here yet)
        k = min(self.num_tokens, limit)
        draft = [state.next_token]
        feature = state.feature
        device = self.head.device
        for i in range(1, k):
            position = torch.tensor([state.end + i - 1], dtype=torch.int64, device=device)
            token = torch.tensor([draft[-1]], dtype=torch.int64, device=device)
            ids, feature = self.head.forward(token, feature, position, state.kv)
            draft.append(int(ids[0]))
        state.kv.truncate(state.end)
        return draft[:k], float(k)

    def finish(self, rid: int, tokens: list[int], num_prompt_tokens: int) -> None:
        self._states.pop(rid, None)
