"""Hugging Face transformers greedy decoding: the reference our model runner must match.

`greedy_reference` runs a plain greedy loop over the KV cache (float32 unless asked for
another dtype, eval, no_grad, eager attention, no EOS stop) and also returns each step's
top-1 minus top-2 logit margin, so a test can tell a real mismatch from a near-tie that
float rounding may legitimately flip.
`assert_greedy_match` compares our ids with the reference up to its first near-tie;
`assert_served_greedy` does that for a test server's unary, batch and streamed outputs,
`assert_output_greedy` for one served /generate output, and `shared_prefix_prompts` makes
prompts that exercise the prefix cache.

`split` (greedy_reference): prefill the prompt in two forwards, prompt[:split] and then the
rest. transformers picks LongRoPE's short or long factors per forward, by the longest
position it sees (models/rope.py); prefilled in two at original_max_position_embeddings, a
prompt longer than that gets exactly the factors zserve's table gives each position.
"""

from __future__ import annotations

import pathlib
import random

import torch

_MODELS: dict[tuple[str, torch.dtype], object] = {}
_CONTINUATIONS: dict[tuple, tuple[list[int], list[float]]] = {}   # (model, prompt, dtype, split)


def _load(model_dir, dtype: torch.dtype = torch.float32):
    """The transformers model for model_dir in dtype, loaded once per process."""
    key = (str(pathlib.Path(model_dir).resolve()), dtype)
    if key not in _MODELS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            key[0], dtype=dtype, attn_implementation="eager")
        model.eval()
        _MODELS[key] = model
    return _MODELS[key]


@torch.no_grad()
def greedy_reference(model_dir, prompt_ids: list[int], max_new_tokens: int,
                     dtype: torch.dtype = torch.float32,
                     split: int | None = None) -> tuple[list[int], list[float]]:
    """Greedy continuation of prompt_ids by transformers, and the margin of each choice.

    Returns (ids, margins), both max_new_tokens long; margins[i] is top1 - top2 of the
    logits that chose ids[i]. Does not stop at EOS. split: a prompt longer than that is
    prefilled in two forwards (module docstring)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    # Greedy decoding is deterministic and prefix-closed: a longer continuation of the same
    # prompt answers every shorter request (test modules ask the same prompts of several
    # servers).
    if split is not None and len(prompt_ids) <= split:
        split = None                                        # one forward either way
    key = (str(pathlib.Path(model_dir).resolve()), tuple(prompt_ids), dtype, split)
    known = _CONTINUATIONS.get(key)
    if known is None or len(known[0]) < max_new_tokens:
        model = _load(model_dir, dtype)
        # One intra-op thread: tiny matmuls gain nothing from more, and on a loaded machine
        # (a test server running next to us) spinning OpenMP workers make each step ~30x
        # slower.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            known = _CONTINUATIONS[key] = _greedy(model, prompt_ids, max_new_tokens, split)
        finally:
            torch.set_num_threads(threads)
    return known[0][:max_new_tokens], known[1][:max_new_tokens]


def _greedy(model, prompt_ids: list[int], max_new_tokens: int, split: int | None = None):
    ids: list[int] = []
    margins: list[float] = []
    if split is None:
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    else:
        out = model(input_ids=torch.tensor([prompt_ids[:split]]), use_cache=True)
        out = model(input_ids=torch.tensor([prompt_ids[split:]]), cache=out.cache,
                    use_cache=True)
    for step in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        next_id = int(torch.argmax(logits))  # first index among exact ties, like a sampler
        ids.append(next_id)
        margins.append(float(top2[0] - top2[1]))
        if step + 1 < max_new_tokens:
            # transformers 5.x calls past_key_values "cache" (argument and output field).
            out = model(input_ids=torch.tensor([[next_id]]), cache=out.cache, use_cache=True)
    return ids, margins


def first_near_tie(margins: list[float], tie_tol: float = 1e-3) -> int | None:
    """Index of the first step whose top-1 / top-2 margin is below tie_tol, or None."""
    return next((i for i, m in enumerate(margins) if m < tie_tol), None)


def assert_greedy_match(ours: list[int], ref_ids: list[int], ref_margins: list[float],
                        tie_tol: float = 1e-3) -> None:
    """Assert our greedy ids equal the reference's, where the reference is decisive.

    If the reference has a near-tie (margin < tie_tol) at step k, its choice there could
    flip under harmless float differences and everything after may diverge, so only
    ours[:k] is compared (ours must be at least k long). Otherwise ours must equal ref_ids
    exactly, same length."""
    ours, ref_ids = list(ours), list(ref_ids)
    tie = first_near_tie(ref_margins, tie_tol)
    if tie is None:
        expected, got = ref_ids, ours
        if len(ours) != len(ref_ids):
            raise AssertionError(
                f"greedy length mismatch: ours has {len(ours)} tokens, reference "
                f"{len(ref_ids)} (no near-tie in the reference)\n"
                f"  ours: {ours}\n  ref:  {ref_ids}")
    else:
        expected, got = ref_ids[:tie], ours[:tie]
        if len(ours) < tie:
            raise AssertionError(
                f"ours stopped after {len(ours)} tokens; the reference is decisive for "
                f"{tie} (near-tie at step {tie}, margin {ref_margins[tie]:.2e})\n"
                f"  ours: {ours}\n  ref:  {ref_ids}")
    if got != expected:
        i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        lo = max(0, i - 4)
        raise AssertionError(
            f"greedy mismatch at step {i}: ours {got[i]}, reference {expected[i]} "
            f"(reference margin there {ref_margins[i]:.3g}; compared {len(expected)} steps"
            + (f", first near-tie at step {tie}" if tie is not None else "") + ")\n"
            f"  ours[{lo}:{i + 4}]: {got[lo:i + 4]}\n  ref[{lo}:{i + 4}]:  {expected[lo:i + 4]}")


def assert_output_greedy(model_dir, prompt: list[int], out: dict, max_new_tokens: int) -> None:
    """A served greedy /generate output (EOS ignored) for `prompt`: its ids equal
    transformers' up to the first near tie (assert_greedy_match), its prompt counted."""
    ref_ids, margins = greedy_reference(model_dir, prompt, max_new_tokens)
    assert_greedy_match(out["output_ids"], ref_ids, margins)
    assert out["meta_info"]["prompt_tokens"] == len(prompt)


def shared_prefix_prompts(seed: int, n: int, prefix_len: int = 48) -> list[list[int]]:
    """n prompts sharing a long common prefix, with distinct suffixes of mixed lengths (ids
    in [5, 700): the tiny checkpoints' vocabulary, past the special tokens)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 700) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(5, 700) for _ in range(rng.randrange(1, 12))]
            for _ in range(n)]


def assert_greedy_through_ties(ours: list[int], ref_ids: list[int], margins: list[float],
                               tie: float, what: str) -> int:
    """tests/reference.py's near-tie rule, followed further: where ours chose the same token
    as the reference at a near tie, both continue from the same context, so the comparison
    goes on. Ours may first differ from the reference only at a near tie (margin < tie);
    returns how many steps agreed (all of them, the whole length, if none differed)."""
    for i, (a, b) in enumerate(zip(ours, ref_ids)):
        if a != b:
            assert margins[i] < tie, (
                f"{what}: greedy mismatch at step {i}: ours {a}, reference {b}, whose "
                f"top-1 / top-2 margin there is {margins[i]:.4g} (a near tie is < {tie})\n"
                f"  ours: {ours[:i + 1]}\n  ref:  {ref_ids[:i + 1]}")
            return i
    assert len(ours) == len(ref_ids), f"{what}: {len(ours)} tokens, not {len(ref_ids)}"
    return len(ref_ids)


def assert_served_batch_greedy(server, prompts: list[list[int]], max_new_tokens: int,
                               dtype: torch.dtype, tie_tol: float) -> None:
    """Send `prompts` to a test server at once (decoded together, as one batch), greedy,
    EOS ignored, and assert each output equals transformers' in `dtype` up to its first
    near tie (assert_greedy_match), and that at least 8 decisive steps were compared."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: server.generate_ok(input_ids=p, sampling_params=body),
                             prompts))
    _assert_outputs_greedy(server.model_dir, prompts, [outs], max_new_tokens, dtype, tie_tol)


def assert_served_greedy(server, model_dir, prompts: list[list[int]], max_new_tokens: int,
                         split: int | None = None, dtype: torch.dtype = torch.float32,
                         tie_tol: float = 1e-3) -> list[dict]:
    """Serve `prompts` (to a test server of the checkpoint model_dir) greedy, EOS ignored,
    in three forms: each alone (unary), all in one batch request, and each streamed; assert
    every output equals transformers' (in `dtype`, prefilled at `split`: greedy_reference)
    up to its first near tie, and that at least 8 decisive steps were compared. Returns the
    unary outputs, then the batch's, then the streams' last frames (their meta_info says
    what the prefix cache served)."""
    body = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    unary = [server.generate_ok(input_ids=p, sampling_params=body) for p in prompts]
    batch = server.generate_ok(input_ids=prompts, sampling_params=body)
    streamed = [server.stream(input_ids=p, sampling_params=body)[-1] for p in prompts]
    _assert_outputs_greedy(model_dir, prompts, [unary, batch, streamed], max_new_tokens,
                           dtype, tie_tol, split)
    return unary + batch + streamed


def _assert_outputs_greedy(model_dir, prompts: list[list[int]], forms: list[list[dict]],
                           max_new_tokens: int, dtype: torch.dtype, tie_tol: float,
                           split: int | None = None) -> None:
    """Each form's output for each prompt (forms[k][i]: prompt i's) equals transformers'
    greedy ids up to the first near tie; at least 8 decisive steps compared in all."""
    compared = 0
    for i, prompt in enumerate(prompts):
        ref_ids, margins = greedy_reference(model_dir, prompt, max_new_tokens, dtype, split)
        for outs in forms:
            assert_greedy_match(outs[i]["output_ids"], ref_ids, margins, tie_tol=tie_tol)
        tie = first_near_tie(margins, tie_tol)
        compared += max_new_tokens if tie is None else tie
    assert compared >= 8, f"only {compared} decisive steps: the check says little"
