"""Which draft tokens the target accepts, decided on the device, and the one pinned copy that tells the host.

Stock `_assisted_decoding` reads the device between one and a dozen times per verify round to decide what it
keeps: `selected_tokens[:, : n_matches + 1]` slices by a device count, speculative sampling branches on it
(`if n_matches < gamma`, `p[:, n_matches, :]`), 4.57-5.17 test `is_done_candidate and n_matches == candidate_length`,
5.23 looks for an EOS with `nonzero()` and `.item()`, and the streamer gets `valid_tokens.cpu()`.

Here the same expressions run on the same shapes, and where stock branches on a device value, both sides are
computed and the value is picked with `where`, `index_select`, `gather` or `scatter` (never recomputed), so every
accepted token, score and random draw is stock's, bit for bit. What the host needs to go on (how many tokens were
accepted after the max-length and EOS cuts, whether the last one is an EOS, whether a draw stock skipped must be
given back, the tokens themselves, and with scikit-learn the draft probabilities) is packed into one small int64
vector and copied to pinned memory with one non-blocking copy and one event: `RoundBox`. Waiting on that event is
the round's one blocking sync; the next round's shapes depend on it, so it cannot be lagged.
"""

from __future__ import annotations

import numpy as np
import torch

HEADER = 3  # accepted length, "the last accepted token is an EOS", "give back the speculative draw"


def select(new_logits, candidate_new_tokens, candidate_logits, candidate_length, do_sample, ensemble_weight):
    """The target's own choice at every position (greedy, or sampling without draft logits), and how many draft
    tokens match it (a 0-d device tensor).

    Copied from transformers v4.57.6-v5.24.0 `GenerationMixin._assisted_decoding`, step 3, case 2 (5.17+: the
    ensemble-weight greedy variant). Differences: none in what is computed; the count is not read.
    """
    if do_sample:
        probs = new_logits.softmax(dim=-1)
        selected_tokens = torch.multinomial(probs[0, :, :], num_samples=1).squeeze(1)[None, :]
    elif ensemble_weight is not None and candidate_logits is not None:
        p_probs = new_logits[:, :candidate_length, :].softmax(dim=-1)
        q_probs = candidate_logits.softmax(dim=-1)
        nu_probs = ensemble_weight * p_probs + (1.0 - ensemble_weight) * q_probs
        bonus_logits = new_logits[:, candidate_length:, :]
        selected_tokens = torch.cat([nu_probs.argmax(dim=-1), bonus_logits.argmax(dim=-1)], dim=-1)
    else:
        selected_tokens = new_logits.argmax(dim=-1)
    n_matches = ((~(candidate_new_tokens == selected_tokens[:, :-1])).cumsum(dim=-1) < 1).sum()
    return selected_tokens, n_matches


def speculative(candidate_new_tokens, candidate_logits, candidate_length, new_logits, ensemble_weight, is_done,
                rng):
    """Speculative sampling (algorithm 1 of arXiv 2211.17192) without a host read: (tokens, n_matches, skipped).

    Copied from transformers v4.57.6-v5.24.0 `_speculative_sampling`. Differences:
    - `torch.arange(candidate_length)` is made on the device (stock's CPU index makes an H2D copy; the values
      gathered are the same);
    - `p[:, n_matches, :]` and `q[:, n_matches, :]` are `index_select`s, and `if n_matches < gamma` (and 5.17+'s
      ensemble fallback `if p_prime_sum <= tiny`) is a `where` between stock's two branch values;
    - 4.57-5.17 (`is_done` given): where stock takes the "accepted onto an EOS or max length" branch, which draws
      nothing, the bonus draw is still made (from a uniform distribution, so it cannot fail) and `skipped` tells the
      host to give it back: `rng` was snapshotted right before it. `multinomial(p, 1)` draws by shape only.
    The returned tokens hold the accepted candidates, then the bonus token at position `n_matches`; stock's
    `valid_tokens` is their first `n_matches + 1` entries.
    """
    q = candidate_logits.softmax(dim=-1)
    positions = torch.arange(candidate_length, device=q.device)
    q_i = q[:, positions, candidate_new_tokens].squeeze(0, 1)
    p = new_logits.softmax(dim=-1)
    p_i = p[:, positions, candidate_new_tokens].squeeze(0, 1)
    if ensemble_weight is not None:
        probability_ratio = 1.0 - ensemble_weight + ensemble_weight * (p_i / q_i)
    else:
        probability_ratio = p_i / q_i
    r_i = torch.rand_like(probability_ratio)
    is_accepted = r_i <= probability_ratio
    n_matches = ((~is_accepted).cumsum(dim=-1) < 1).sum()
    skipped = None if is_done is None else is_done.reshape(()) & (n_matches == candidate_length)

    gamma = candidate_logits.shape[1]
    p_n_plus_1 = p.index_select(1, n_matches.view(1)).squeeze(1)
    q_n_plus_1 = q.index_select(1, n_matches.clamp(max=gamma - 1).view(1)).squeeze(1)
    p_prime = torch.clamp((p_n_plus_1 - q_n_plus_1), min=0)
    p_prime_sum = p_prime.sum()
    use_target = n_matches >= gamma
    if ensemble_weight is not None:
        use_target = use_target | (p_prime_sum <= torch.finfo(p_prime.dtype).tiny)
    p_prime = torch.where(use_target, p_n_plus_1, p_prime / p_prime_sum)
    if skipped is not None:
        p_prime = torch.where(skipped, torch.ones_like(p_prime), p_prime)
        rng.snapshot()
    t = torch.multinomial(p_prime, num_samples=1).squeeze(1)[None, :]

    tokens = torch.cat((candidate_new_tokens, candidate_new_tokens[:, -1:]), dim=-1)
    if skipped is None:
        return tokens.scatter(1, n_matches.view(1, 1), t), n_matches, None
    # stock: `n_matches -= 1; valid_tokens = candidates[:, : n_matches + 1]`, all candidates already in place
    n_matches = n_matches - skipped.long()
    bonus = torch.where(skipped, tokens.gather(1, n_matches.view(1, 1)), t)
    return tokens.scatter(1, n_matches.view(1, 1), bonus), n_matches, skipped


def accepted_length(n_matches, tokens, is_done, budget, eos_cut):
    """How many of `tokens` stock keeps (a 0-d device tensor): `n_matches + 1`, after stock's cuts.

    Copied from transformers v4.57.6-v5.24.0 `_assisted_decoding`. Differences: no host read.
    - 4.57-5.17 greedy (`is_done` given): `if is_done_candidate and n_matches == candidate_length: n_matches -= 1`;
    - 5.17+ (`budget` given): `valid_tokens[:, :tokens_budget]` when longer;
    - 5.23 (`eos_cut` given, the EOS ids): cut after the first EOS among the kept tokens, found with a broadcast
      compare and a masked `min` instead of `isin(...).nonzero()` and `.item()`.
    """
    if is_done is not None:
        candidate_length = tokens.shape[1] - 1
        n_matches = n_matches - (is_done.reshape(()) & (n_matches == candidate_length)).long()
    length = n_matches + 1
    if isinstance(budget, torch.Tensor):  # the graphed acceptance's device scalar: the same integer minimum
        length = torch.minimum(length, budget)
    elif budget is not None:
        length = length.clamp(max=budget)
    if eos_cut is not None:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hit = (tokens[0, :, None] == eos_cut.to(tokens.device).reshape(1, -1)).any(-1) & (positions < length)
        first = torch.where(hit, positions, tokens.shape[1]).min()
        length = torch.minimum(length, first + 1)
    return length


def last_is_eos(input_ids, tokens, length, eos_ids):
    """`EosTokenCriteria` on the sequence after this round: is its last token an EOS? (0-d bool, on the device)

    The last token is `tokens[length - 1]`, or the previous last one when nothing was kept (4.57-5.17 can keep
    nothing in a round without candidates that starts on an EOS). A call from `inputs_embeds` alone starts with no
    token at all: there the previous last is a -1, no EOS id (fuzzer seed 15: the gather ran past the end)."""
    previous = input_ids[0, -1:] if input_ids.shape[1] else tokens.new_full((1,), -1)
    return last_eos_after(previous, tokens, length, eos_ids)


def last_eos_after(previous, tokens, length, eos_ids):
    """`last_is_eos` given the sequence's last token before the round (a 1-element tensor)."""
    last = torch.cat((previous, tokens[0])).gather(0, length.view(1))
    hit = None
    for ids in eos_ids:
        found = (last[:, None] == ids.to(last.device).reshape(1, -1)).any()
        hit = found if hit is None else hit | found
    return hit


class RoundBox:
    """One pinned int64 buffer and one event per call: each round's verdict reaches the host in one copy.

    Safe to reuse every round: round r+1 writes into it only after the host has read round r's copy.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._host = None
        self._view = None  # a numpy view of the pinned buffer: reading it is no tensor op
        self._event = torch.cuda.Event() if self.cuda else None
        self._size = 0

    def send(self, header, tokens, extra=None) -> None:
        """Queue the copy of `header` (0-d tensors), `tokens` (1-D int64) and `extra` (1-D int64)."""
        parts = [torch.stack([h.long() for h in header]), tokens]
        if extra is not None:
            parts.append(extra)
        self.send_packed(torch.cat(parts))

    def send_packed(self, packed) -> None:
        """Queue the copy of a verdict already packed on the device (`acceptance_graph`: header, then tokens)."""
        size = packed.numel()
        if self._host is None or self._host.numel() < size:
            self._host = torch.empty(max(size, 64), dtype=torch.long, device="cpu", pin_memory=self.cuda)
            self._view = self._host.numpy()
        self._host[:size].copy_(packed, non_blocking=self.cuda)
        if self.cuda:
            self._event.record()
        self._size = size

    def receive(self) -> np.ndarray:
        """The round's one blocking wait; then the values, as numpy int64."""
        if self.cuda:
            self._event.synchronize()
        return self._view[: self._size]


def probabilities_as_int64(probs: torch.Tensor) -> torch.Tensor:
    """float32 probabilities, exactly as float64 bits in int64 (`RoundBox` carries int64 only)."""
    return probs.double().view(torch.long)


def int64_as_probabilities(bits: np.ndarray) -> list[float]:
    """The inverse on the host: Python floats, as stock's `p.tolist()` gives them."""
    return bits.view(np.float64).tolist()
