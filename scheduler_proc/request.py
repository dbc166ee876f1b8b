"""Req: the scheduler's view of one request, from arrival to its terminal output."""

from __future__ import annotations

import time

import torch

from scheduler_proc.images import image_key
from scheduler_proc.sampler import seeded_generator
from wire.messages import (DecodeParams, FinishReason, LogprobRequest, Logprobs,
                           TokenizedRequest, VectorRequest)
from wire.sampling import SamplingParams


def adapter_key(uid: int, key: int) -> int:
    """What the radix cache holds at position 0 of a prompt run under the adapter loaded as
    `uid`, in place of `key` (a token id, or an image's key: images.image_key): below
    -2^62, never a token id nor an image's key (>= -2^60)."""
    return -(1 << 62) - (uid << 62) - (key if key >= 0 else (1 << 60) - key)


class Req:
    """State derived from lists rather than kept in counters: the KV of positions
    0..num_computed-1 lives in `slots`, so num_computed is len(slots)."""

    __slots__ = ("rid", "api", "input_ids", "sampling", "stream", "output_ids", "slots", "row",
                 "prefix_node", "prefix_len", "cached_tokens", "arrived_at", "queue_time",
                 "finish", "announced", "decode_sent", "first_token_at", "generator", "logprob", "input_logprobs",
                 "pending_logprobs", "held_ids", "grammar", "grammar_future", "images",
                 "image_positions", "key_prompt", "rope_pos", "rope_delta", "image_rope",
                 "vector", "pooled", "spec", "priority", "adapter")

    def __init__(self, msg: TokenizedRequest, device: torch.device | str = "cpu",
                 image_token_id: int | None = None):
        """image_token_id: the model's image token, where msg carries images (checked
        against the prompt already: ImageEmbedder.check)."""
        self.rid = msg.rid
        self.input_ids: list[int] = msg.input_ids
        # Images (scheduler_proc/images.py): each one's positions that take its encoder
        # rows, in order; and the prompt as the radix cache keys it (an image's span by
        # the image's hash, so only the same image matches).
        self.images = msg.images or None
        self.image_positions: list[list[int]] = []
        self.key_prompt = self.input_ids
        # Multimodal RoPE (ImageEmbedder.place): each prompt token's text position, the
        # shift of the outputs' (position = index + rope_delta), and each image's tokens'
        # [t, h, w] positions. None: positions are the indices.
        self.rope_pos: list[int] | None = None
        self.rope_delta = 0
        self.image_rope: list[list[list[int]]] = []
        if self.images:
            self.key_prompt = list(self.input_ids)
            for im in self.images:
                span = range(im.offset, im.offset + im.length)
                self.image_positions.append([p for p in span
                                             if self.input_ids[p] == image_token_id])
                self.key_prompt[im.offset:im.offset + im.length] = [image_key(im)] * im.length
        self.sampling: SamplingParams = msg.sampling
        self.stream = msg.stream
        self.api = msg.api                   # the API process its outputs go to
        self.output_ids: list[int] = []
        self.slots: list[int] = []          # KV slot of each computed position
        self.row: int | None = None          # row in the request-to-token table while admitted
        self.prefix_node = None              # radix node locked for the cached prefix
        self.prefix_len = 0                  # slots[:prefix_len] are the radix tree's
        self.cached_tokens: int | None = None  # prompt tokens served from the cache (1st admit)
        self.arrived_at = time.monotonic()
        self.queue_time: float | None = None
        self.first_token_at: float | None = None     # when its first token was sampled
        self.finish: FinishReason | None = None
        self.announced = False               # has a token output (or the end) been sent
        self.decode_sent = False             # has the detokenizer seen DecodeParams yet
        self.held_ids: list[int] = []        # sampled, not sent yet (see Scheduler.emit)
        # Constrained decoding (scheduler_proc/grammar.py, grammars/): the compile in progress, then
        # this request's matcher, which has consumed exactly output_ids.
        self.grammar_future = None
        self.grammar = None
        seed = msg.sampling.sampling_seed
        # On the model's device: sampler.draw takes its uniform draw where the probs are.
        self.generator = None if seed is None else seeded_generator(seed % 2**64, device)
        self.logprob: LogprobRequest | None = msg.logprob
        self.pending_logprobs: Logprobs | None = None   # of the token sampled this step
        self.input_logprobs = Logprobs()
        self.reset_input_logprobs()
        # A VectorRequest (an embedding or a score): what the runner has read off the
        # prompt so far (`pool`; for "labels", the label logprobs: runner._scorer).
        self.vector: VectorRequest | None = msg.vector
        self.pooled: torch.Tensor | None = None
        # Speculative decoding (speculative.py): its proposer's index and measured acceptance.
        self.spec = None
        self.priority = msg.priority          # --enable-priority-scheduling (scheduler.py)
        self.adapter = None                   # its LoRA adapter (adapters.py): use_adapter

    def use_adapter(self, adapter) -> None:
        """Run under `adapter` (adapters.Adapter): the prefix cache keys the prompt's first
        position by the adapter's load (adapter_key), so the same text under two adapters,
        or under none, is two entries."""
        self.adapter = adapter
        self.key_prompt = list(self.key_prompt)
        self.key_prompt[0] = adapter_key(adapter.uid, self.key_prompt[0])

    # ---- logprobs -------------------------------------------------------------------------

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob is not None and self.logprob.start_len >= 0

    def reset_input_logprobs(self) -> None:
        """Start (or restart, after a retraction before the first output) the prompt's
        logprobs; the first prompt token has none (SGLang's convention)."""
        self.input_logprobs = Logprobs()
        if self.wants_input_logprobs and self.logprob.start_len == 0:
            self.input_logprobs = Logprobs(token_ids=self.input_ids[:1], logprobs=[None],
                                           top_ids=[[]], top_logprobs=[[]])

    def input_logprob_positions(self, start: int, end: int) -> tuple[int, int]:
        """Of positions start..end-1 computed this step, those whose logits score a prompt
        token at or after logprob start_len: position p scores token p + 1."""
        if not self.wants_input_logprobs or self.announced:
            return 0, 0
        return max(start, max(self.logprob.start_len, 1) - 1), min(end, len(self.input_ids) - 1)

    @property
    def max_prefix_match(self) -> int:
        """Cached positions must not cover positions whose logits or hidden states are
        still needed: mean and cls pooling read position 0 onwards, so they take no cached
        prefix (last pooling and labels read the last position, always computed)."""
        limit = self.seq_len - 1              # at least one position is always computed
        if self.wants_input_logprobs and not self.announced:
            limit = min(limit, max(self.logprob.start_len - 1, 0))
        if self.vector is not None and self.vector.pooling in ("mean", "cls"):
            limit = 0
        return limit

    # ---- vector requests (embeddings, scores) ---------------------------------------------

    def vector_positions(self, start: int, end: int) -> tuple[int, int]:
        """Of positions start..end-1 computed this step, those this request's vector reads
        (lo, hi): every prompt position for mean pooling, else position 0 (cls) or the
        last prompt position (last, labels) where it is among them."""
        if self.vector is None:
            return 0, 0
        n = len(self.input_ids)
        if self.vector.pooling == "mean":
            return start, min(end, n)
        p = 0 if self.vector.pooling == "cls" else n - 1
        return (p, p + 1) if start <= p < end else (0, 0)

    def pool(self, rows: torch.Tensor, start: int) -> None:
        """Take the final-normed hidden states [k, hidden] of positions start..start+k-1 (as
        vector_positions gave them). Mean pooling sums them: a request that pools by mean
        computes every position from 0 (max_prefix_match), in order, so a sum restarts at
        position 0, also after a retraction."""
        if self.vector.pooling == "mean":
            total = rows.float().sum(dim=0)
            self.pooled = total if start == 0 or self.pooled is None else self.pooled + total
        else:
            self.pooled = rows[0].float()

    def vector_bytes(self) -> bytes | None:
        """The answer of a vector request whose prompt is computed, as TokenOutput.vector
        carries it (float32, little-endian): the pooled state L2-normalized (the mean
        divided by the prompt's length first), or the label logprobs as they are."""
        if self.vector is None or self.pooled is None:
            return None
        v = self.pooled.detach().float().cpu()
        if self.vector.pooling == "mean":
            v = v / len(self.input_ids)
        if self.vector.pooling != "labels":
            v = torch.nn.functional.normalize(v, p=2.0, dim=0)
        return v.numpy().astype("<f4").tobytes()

    @property
    def output_can_wait(self) -> bool:
        """Nobody watches this request's tokens before it ends: not streamed, no logprobs,
        no stop strings (the detokenizer matches those and must see each token)."""
        return not self.stream and self.logprob is None and not self.sampling.stop

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def num_computed(self) -> int:
        return len(self.slots)

    @property
    def max_total_tokens(self) -> int:
        """KV slots this request needs if it runs to max_new_tokens (the last sampled token's
        KV is never computed)."""
        return len(self.input_ids) + max(self.sampling.max_new_tokens - 1, 0)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self._ids(self.input_ids, start, end)

    def positions(self, start: int, end: int) -> list[int] | range:
        """The RoPE positions of tokens start..end-1 (their indices, but under multimodal
        RoPE, where an image takes fewer positions than tokens)."""
        if self.rope_pos is None:
            return range(start, end)
        n = len(self.rope_pos)
        return self.rope_pos[start:min(end, n)] + \
            [p + self.rope_delta for p in range(max(start, n), end)]

    def key_ids(self, start: int, end: int) -> list[int]:
        """token_ids as the radix cache keys them: an image's positions by its hash."""
        return self._ids(self.key_prompt, start, end)

    def _ids(self, prompt: list[int], start: int, end: int) -> list[int]:
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        return (prompt[start:] if start < n else []) + \
            self.output_ids[max(start - n, 0):end - n]

    def phase_times(self) -> tuple[float | None, float | None]:
        """(prefill, decode) seconds on this process's clock, as the request ends now:
        from its first forward to its first token, and from there to now. None for a
        phase it never reached."""
        if self.queue_time is None:
            return None, None
        if self.first_token_at is None:
            return time.monotonic() - self.arrived_at - self.queue_time, None
        return (self.first_token_at - self.arrived_at - self.queue_time,
                time.monotonic() - self.first_token_at)

    def decode_params(self) -> DecodeParams:
        s = self.sampling
        return DecodeParams(skip_special_tokens=s.skip_special_tokens,
                            spaces_between_special_tokens=s.spaces_between_special_tokens,
                            stop=list(s.stop), no_stop_trim=s.no_stop_trim, api=self.api)
