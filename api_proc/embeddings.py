"""Embeddings, scores and reranking read off the served model: POST /v1/embeddings
(OpenAI's shape), POST /v1/score (SGLang's), POST /v1/rerank and /rerank (Jina's and
Cohere's, as llama.cpp answers it). This module owns those bodies and answers; the work is
prefill-only requests through the one pipeline (api_proc/pipeline.py), each asking for a
vector instead of tokens (wire/messages.py VectorRequest: the scheduler batches them with
generation, and their KV is the prefix cache's once they end).

- `embed(request, inputs, route)`: one embedding per input (a text or token ids), the
  prompt's final hidden states after the model's final norm, pooled by --pooling (resolved
  at startup: the flag, else the model's sentence-transformers config, else the last
  token), L2-normalized as SGLang does. Other dialects (Ollama's /api/embed) call it.
- `score(request, prompts, label_ids, route)`: per prompt, the log-probabilities of the
  label tokens as the next token (the full vocabulary's log-softmax at the prompt's last
  position). /v1/score builds each prompt as query + item (item + query with item_first),
  by text concatenation or id concatenation, as SGLang does; scores are exp(logprob), or
  with apply_softmax the softmax over the labels.
- Rerank is a score: each document's prompt is `rerank_prompt(query, document)` (a fixed
  yes/no judging prompt, Qwen3-Reranker's wording), scored with the tokenizer's first
  token of " yes" and of " no" as the labels, softmaxed: relevance = P(yes | yes or no).

Choices (docs/api.md "Embeddings, score and rerank"): `dimensions` is refused (no
Matryoshka truncation); `encoding_format` base64 is little-endian float32, as the openai
SDK decodes it; a zserve extension field `pooling` picks last / mean / cls per request.
Under --is-embedding, score and rerank are refused (400) like generation. Client-sent
sizes are bounded (MAX_INPUTS, MAX_ITEMS, MAX_LABEL_IDS); errors are OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import base64
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc.boundary import BadRequest, JSONResponse, read_json
from api_proc.chat import OpenAIError, bool_field, check_model, is_ids
from api_proc.openai_api import error_response
from api_proc.pipeline import Pipeline, settle
from api_proc.state import Dispatcher, SubmitError
from wire.messages import POOLING_MODES, GenerateRequest, TextOutput, VectorRequest
from wire.sampling import SamplingParams
from wire.server_args import ServerConfig

MAX_INPUTS = 2048           # inputs of one /v1/embeddings body (OpenAI's limit)
MAX_ITEMS = 1024            # items of one /v1/score body, documents of one /v1/rerank body
ENCODINGS = ("float", "base64")
RERANK_INSTRUCT = ("Given a web search query, retrieve relevant passages that answer the "
                   "query")
RERANK_LABELS = (" yes", " no")     # the judging prompt's answers; the first token of each


def rerank_prompt(query: str, document: str, instruct: str = RERANK_INSTRUCT
                  ) -> tuple[str, str]:
    """A rerank document's prompt as /v1/score's (query, item) texts: the score of label
    RERANK_LABELS[0] after query + item is the document's relevance."""
    head = ('Judge whether the Document meets the requirements based on the Query and the '
            'Instruct provided. Note that the answer can only be "yes" or "no".\n')
    return (f"{head}<Instruct>: {instruct}\n<Query>: {query}\n<Document>: ",
            f"{document}\nAnswer:")


# ---- bodies (pure: every check a client's JSON needs) ----------------------------------

def _object(body: Any, model_id: str) -> dict:
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.")
    check_model(body, model_id)
    return body


@dataclass(frozen=True, slots=True)
class EmbeddingsBody:
    inputs: list[str | list[int]]
    encoding: str                   # "float" | "base64"
    pooling: str | None             # the body's `pooling`; None: the server's


def parse_embeddings(body: Any, model_id: str) -> EmbeddingsBody:
    body = _object(body, model_id)
    if body.get("dimensions") is not None:
        raise OpenAIError("dimensions is not supported: the embeddings have the model's "
                          "hidden size.", param="dimensions")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODINGS:
        raise OpenAIError(f"encoding_format must be float or base64, got "
                          f"{encoding!r}.", param="encoding_format")
    pooling = body.get("pooling")
    if pooling is not None and pooling not in POOLING_MODES:
        raise OpenAIError(f"pooling must be one of {', '.join(POOLING_MODES)}, got "
                          f"{pooling!r}.", param="pooling")
    return EmbeddingsBody(embedding_inputs(body.get("input")), encoding, pooling)


def embedding_inputs(raw: Any) -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such
    lists -> the inputs, one prompt each."""
    if isinstance(raw, str) or is_ids(raw):
        return [raw]
    if isinstance(raw, list) and raw and (all(isinstance(x, str) for x in raw)
                                          or all(is_ids(x) for x in raw)):
        if len(raw) > MAX_INPUTS:
            raise OpenAIError(f"input holds {len(raw)} inputs, more than the limit of "
                              f"{MAX_INPUTS}.", param="input")
        return list(raw)
    raise OpenAIError("input must be a string, a non-empty list of strings, a non-empty list "
                      "of token ids, or a non-empty list of such lists.", param="input")


def encode_vector(vector: np.ndarray, encoding: str) -> list[float] | str:
    """One embedding as OpenAI sends it: a list of floats, or base64 of its float32 values,
    little-endian (what the openai SDK decodes with numpy's float32)."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


@dataclass(frozen=True, slots=True)
class ScoreBody:
    prompts: list[str | list[int]]   # one per item: query + item, or item + query
    label_ids: list[int]
    apply_softmax: bool


def parse_score(body: Any, model_id: str, vocab_size: int) -> ScoreBody:
    body = _object(body, model_id)
    query, items = body.get("query"), body.get("items")
    if isinstance(items, str):
        items = [items]
    if not isinstance(query, str) and not is_ids(query):
        raise OpenAIError("query must be a string or a non-empty list of token ids.",
                          param="query")
    if not isinstance(items, list) or not items:
        raise OpenAIError("items must be a string, a non-empty list of strings or a "
                          "non-empty list of token-id lists.", param="items")
    if len(items) > MAX_ITEMS:
        raise OpenAIError(f"items holds {len(items)} items, more than the limit of "
                          f"{MAX_ITEMS}.", param="items")
    text = isinstance(query, str)
    if not all(isinstance(x, str) if text else is_ids(x) for x in items):
        raise OpenAIError("query and items must both be text or both token ids (each item a "
                          "non-empty list of token ids).", param="items")
    labels = body.get("label_token_ids")
    if not is_ids(labels):
        raise OpenAIError("label_token_ids must be a non-empty list of token ids.",
                          param="label_token_ids")
    problem = VectorRequest("labels", labels).problem(vocab_size)
    if problem is not None:
        raise OpenAIError(problem.replace("label_ids", "label_token_ids"),
                          param="label_token_ids")
    item_first = bool_field(body, "item_first")
    prompts = [item + query if item_first else query + item for item in items]
    return ScoreBody(prompts, list(labels), bool_field(body, "apply_softmax"))


def label_scores(logprobs: np.ndarray, apply_softmax: bool) -> list[float]:
    """One item's scores in label order: each label's probability as the next token, or
    with apply_softmax the softmax of their logprobs (the probability given that the next
    token is one of the labels)."""
    lp = logprobs.astype(np.float64)
    if apply_softmax:
        top = lp.max()
        if not math.isfinite(top):          # every label impossible: no distribution
            return [0.0] * len(lp)
        e = np.exp(lp - top)
        return (e / e.sum()).tolist()
    return np.exp(lp).tolist()


@dataclass(frozen=True, slots=True)
class RerankBody:
    query: str
    documents: list[str]
    top_n: int
    return_documents: bool
    instruct: str


def parse_rerank(body: Any, model_id: str) -> RerankBody:
    body = _object(body, model_id)
    query, docs = body.get("query"), body.get("documents")
    if not isinstance(query, str):
        raise OpenAIError("query must be a string.", param="query")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise OpenAIError("documents must be a non-empty list of strings.", param="documents")
    if len(docs) > MAX_ITEMS:
        raise OpenAIError(f"documents holds {len(docs)} documents, more than the limit of "
                          f"{MAX_ITEMS}.", param="documents")
    top_n = body.get("top_n")
    if top_n is None:
        top_n = len(docs)
    if type(top_n) is not int or top_n < 1:
        raise OpenAIError(f"top_n must be a positive integer, got {top_n!r}.", param="top_n")
    instruct = body.get("instruct")
    if instruct is not None and not isinstance(instruct, str):
        raise OpenAIError("instruct must be a string.", param="instruct")
    return RerankBody(query, docs, top_n, bool_field(body, "return_documents"),
                      instruct or RERANK_INSTRUCT)


def _vector(out: TextOutput, finite: bool = True) -> np.ndarray:
    """A finished request's vector; an embedding must be finite (JSON has no NaN)."""
    if out.vector is None:
        raise BadRequest("Internal error: a finished request brought no vector.", 500)
    v = np.frombuffer(out.vector, dtype="<f4")
    if finite and not np.isfinite(v).all():
        raise BadRequest("Internal error: the model's hidden states are not finite.", 500)
    return v


# ---- the routes ---------------------------------------------------------------------------

class EmbeddingsHandler:
    def __init__(self, config: ServerConfig, dispatcher: Dispatcher):
        self.config = config
        self.model_id = config.served_model_name
        self.dispatcher = dispatcher
        self.pipeline = Pipeline(dispatcher, not config.args.disable_radix_cache)
        self._labels: tuple[int, int] | None = None
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="rerank-labels")

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/score", self.score_route, methods=["POST"]),
                Route("/v1/rerank", self.rerank, methods=["POST"]),
                Route("/rerank", self.rerank, methods=["POST"])]

    # -- what other dialects call --------------------------------------------------------------

    async def embed(self, request: Request, inputs: list[str | list[int]], route: str,
                    pooling: str | None = None) -> tuple[list[list[float]], int]:
        """One L2-normalized embedding per input (a text, or token ids), pooled by `pooling`
        (None: the server's) and the prompt tokens they took. Raises BadRequest (an
        OpenAIError where the input is at fault) with the HTTP status to answer: 4xx for the
        client's mistakes (empty or too long an input, ids outside the vocabulary), 503
        when the server cannot take it, 499 when the client went away."""
        outs = await self._run(request, inputs, [VectorRequest(pooling or self.config.pooling)]
                               * len(inputs), route)
        return [_vector(o).tolist() for o in outs], sum(o.prompt_tokens for o in outs)

    async def score(self, request: Request, prompts: list[str | list[int]],
                    label_ids: list[int], route: str) -> tuple[list[np.ndarray], int]:
        """Per prompt, the label tokens' log-probabilities as its next token (float32, in
        label order), and the prompt tokens they took; raises as `embed` does."""
        if self.config.args.is_embedding:
            raise OpenAIError("This server serves embeddings only (--is-embedding): scores "
                              "read the model's next-token distribution.")
        outs = await self._run(request, prompts,
                               [VectorRequest("labels", label_ids)] * len(prompts), route)
        return [_vector(o, finite=False) for o in outs], sum(o.prompt_tokens for o in outs)

    async def _run(self, request: Request, prompts: list[str | list[int]],
                   vectors: list[VectorRequest], route: str) -> list[TextOutput]:
        base = uuid.uuid4().hex
        reqs = [GenerateRequest(rid=f"{route}-{base}_{i}",
                                text=p if isinstance(p, str) else None,
                                input_ids=None if isinstance(p, str) else p,
                                sampling=SamplingParams(max_new_tokens=0), vector=v)
                for i, (p, v) in enumerate(zip(prompts, vectors))]
        try:
            states = await self.pipeline.start(request, reqs, [], route)
        except SubmitError as e:
            raise BadRequest(str(e), getattr(e, "status", 400)) from None

        def fail(message: str, status: int):
            raise OpenAIError(message, status)
        early = await settle(request, self.dispatcher, states,
                             [s.wait_finished() for s in states], fail)
        if early is not None:
            raise BadRequest("The client went away.", 499)
        return [s.last for s in states]

    # -- HTTP ----------------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        try:
            body = parse_embeddings(await read_json(request), self.model_id)
            vectors, tokens = await self.embed(request, body.inputs, "embeddings",
                                               body.pooling)
        except BadRequest as e:
            return _error(e)
        return JSONResponse({
            "object": "list", "model": self.model_id,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encode_vector(np.asarray(v, dtype=np.float32),
                                                 body.encoding)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def score_route(self, request: Request) -> Response:
        try:
            body = parse_score(await read_json(request), self.model_id,
                               self.config.vocab_size)
            logprobs, tokens = await self.score(request, body.prompts, body.label_ids,
                                                "score")
        except BadRequest as e:
            return _error(e)
        return JSONResponse({
            "scores": [label_scores(lp, body.apply_softmax) for lp in logprobs],
            "model": self.model_id, "object": "scoring",
            "usage": {"prompt_tokens": tokens, "completion_tokens": 0,
                      "total_tokens": tokens}})

    async def rerank(self, request: Request) -> Response:
        try:
            body = parse_rerank(await read_json(request), self.model_id)
            labels = await self.rerank_labels()
            prompts = [q + item for q, item in (rerank_prompt(body.query, d, body.instruct)
                                                for d in body.documents)]
            logprobs, tokens = await self.score(request, prompts, list(labels), "rerank")
        except BadRequest as e:
            return _error(e)
        relevance = [label_scores(lp, True)[0] for lp in logprobs]
        order = sorted(range(len(relevance)), key=lambda i: -relevance[i])[:body.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": relevance[i]}
            if body.return_documents:
                item["document"] = {"text": body.documents[i]}
            results.append(item)
        return JSONResponse({"model": self.model_id, "object": "list", "results": results,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def rerank_labels(self) -> tuple[int, int]:
        """The first token of each RERANK_LABELS answer (the tokenizer's, loaded in this
        process once, off the event loop)."""
        if self._labels is None:
            def load() -> tuple[int, int]:
                from tokenization.hf_tokenizer import HFTokenizer
                tok = HFTokenizer.from_dir(self.config.tokenizer_path)
                return tuple(tok.encode(w, add_special_tokens=False)[0]
                             for w in RERANK_LABELS)
            labels = await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool,
                                                                      load)
            if labels[0] == labels[1]:
                raise BadRequest(f"This model's tokenizer starts {RERANK_LABELS} with the "
                                 f"same token: rerank cannot tell them apart; use /v1/score.",
                                 500)
            self._labels = labels
        return self._labels


def _error(e: BadRequest) -> Response:
    return error_response(str(e), e.status, getattr(e, "param", None))
