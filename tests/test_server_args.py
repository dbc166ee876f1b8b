"""Arguments are resolved once: ServerArgs parses each flag to its field's type, both records
are frozen, launch.resolve_args fills every model-dependent setting, and the tokenizer and
detokenizer build from the record alone (they do not read config.json again)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import shutil

import httpx
import pytest

from detokenizer_proc.process import make_detokenizer
from launch import resolve_args
from tokenizer_proc.process import make_worker
from wire.addresses import Addresses
from wire.server_args import ServerArgs, ServerConfig, concrete_dtype, flag_type


def parse(*argv: str) -> ServerArgs:
    return ServerArgs.from_cli(list(argv))


# ---- parsing ---------------------------------------------------------------------------------

def test_every_flag_kind_parses_to_its_type():
    args = parse("--port", "8000", "--read-timeout", "3", "--context-length", "128",
                 "--max-queued-requests", "5", "--request-timeout", "1.5",
                 "--disable-radix-cache", "--dtype", "bfloat16", "--api-key", "k")
    assert type(args.port) is int and args.port == 8000                      # int
    assert type(args.read_timeout) is float and args.read_timeout == 3.0     # float
    assert type(args.context_length) is int and args.context_length == 128  # int | None
    assert type(args.max_queued_requests) is int and args.max_queued_requests == 5
    assert type(args.request_timeout) is float and args.request_timeout == 1.5  # float | None
    assert args.disable_radix_cache is True                                  # store_true
    assert args.dtype == "bfloat16"                                          # choices
    assert args.api_key == "k"                                               # str | None


def test_defaults_are_the_fields_defaults():
    assert parse() == ServerArgs()
    args = parse()
    assert args.context_length is None and args.max_queued_requests is None
    assert args.disable_radix_cache is False and args.incremental_streaming_output is False
    assert args.dtype == "auto" and args.port == 30000


def test_flag_types_come_from_type_objects():
    for f in dataclasses.fields(ServerArgs):
        assert not isinstance(f.type, str), f"{f.name}: a string annotation"
        assert flag_type(f.type) in (int, float, str, bool), f.name
    assert flag_type(int | None) is int and flag_type(float) is float
    with pytest.raises(TypeError):
        flag_type("int")
    with pytest.raises(TypeError):
        flag_type(int | str)


@pytest.mark.parametrize("argv", [["--port", "http"], ["--dtype", "float8"],
                                  ["--device", "tpu"], ["--request-timeout", "soon"],
                                  ["--max-running-requests", "0"], ["--context-length", "0"],
                                  ["--mem-fraction-static", "1.5"],
                                  ["--tokenizer-worker-num", "0"],
                                  ["--tokenizer-worker-num", "-2"],
                                  ["--tokenizer-worker-num", "1.5"],
                                  ["--dp-size", "0"], ["--tp-size", "0"],
                                  ["--api-server-count", "0"],
                                  ["--keep-alive-timeout", "0"],
                                  ["--load-balance-method", "random"],
                                  ["--node-rank", "2", "--nnodes", "2"],
                                  ["--nnodes", "2", "--tp-size", "2"],
                                  ["--nnodes", "2", "--tp-size", "2",
                                   "--dist-init-addr", "nohost"],
                                  ["--nnodes", "2", "--tp-size", "2", "--dp-size", "2",
                                   "--dist-init-addr", "h:1"]])
def test_bad_values_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zserve: ") and len(err.strip().splitlines()) == 1, err


def test_idle_connections_outlast_the_clients_own_idle_limit():
    """A client reuses an idle connection until its own expiry; a server that closes first
    can close it under a request just sent (a reset, no answer: CI saw this from httpx)."""
    assert ServerArgs().keep_alive_timeout > httpx.Limits().keepalive_expiry + 10
    assert ServerArgs().keep_alive_timeout > 15 + 10           # aiohttp's keepalive_timeout


def test_tokenizer_worker_num_defaults_to_one_and_must_be_at_least_one(capsys):
    assert ServerArgs().tokenizer_worker_num == 1
    assert parse("--tokenizer-worker-num", "3").tokenizer_worker_num == 3
    with pytest.raises(SystemExit) as e:
        parse("--tokenizer-worker-num", "0")
    assert e.value.code == 2
    assert capsys.readouterr().err == "zserve: --tokenizer-worker-num must be positive\n"


def test_one_tokenizer_address_per_worker_the_first_keeps_its_name():
    for n in (1, 3):
        addrs = Addresses.create(tokenizer_workers=n)
        try:
            names = [a.rsplit("/", 1)[1] for a in addrs.tokenizer]
            assert names == ["tokenizer", "tokenizer-1", "tokenizer-2"][:n]
            assert all(a == f"ipc://{addrs.ipc_dir}/{name}"
                       for a, name in zip(addrs.tokenizer, names))
        finally:
            addrs.cleanup()


# ---- the records are frozen ------------------------------------------------------------------

def test_server_args_are_frozen():
    args = ServerArgs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.port = 1       # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.context_length = 64    # type: ignore[misc]


@pytest.fixture
def resolved(tiny_model) -> ServerConfig:
    return resolve_args(ServerArgs(model_path=str(tiny_model("llama"))))


def test_resolved_record_is_frozen(resolved):
    for name in ("context_length", "dtype", "model_path", "args"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(resolved, name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.model.num_params = 0       # type: ignore[misc]


# ---- resolving -------------------------------------------------------------------------------

def test_resolve_fills_every_field(tiny_model, resolved):
    path = str(tiny_model("llama"))
    config = json.loads((tiny_model("llama") / "config.json").read_text())
    for f in dataclasses.fields(resolved):
        assert getattr(resolved, f.name) not in (None, "", "auto"), f.name
    assert resolved.model_path == resolved.tokenizer_path == resolved.served_model_name == path
    assert resolved.context_length == config["max_position_embeddings"] == 512
    assert resolved.dtype == "float32"
    assert resolved.vocab_size == config["vocab_size"]
    assert resolved.model.architecture == "LlamaForCausalLM"
    assert resolved.model.num_params > 0 and resolved.model.random_weights
    assert resolved.model_source.startswith("model directory, random weights")
    # The flags stay as given.
    assert resolved.args.context_length is None and resolved.args.dtype == "auto"
    assert resolved.args.tokenizer_path is None and resolved.args.served_model_name is None


def test_resolve_keeps_what_the_flags_say(tiny_model):
    path = str(tiny_model("llama"))
    r = resolve_args(ServerArgs(model_path=path, context_length=100, dtype="bfloat16",
                                tokenizer_path="/tok", served_model_name="tiny"))
    assert (r.context_length, r.dtype, r.tokenizer_path, r.served_model_name) == (
        100, "bfloat16", "/tok", "tiny")
    assert r.model_path == path


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_on_cuda(resolved):
    assert resolved.args.device == "cpu" and resolved.dtype == "float32"
    assert concrete_dtype("auto", "cpu") == "float32"
    assert concrete_dtype("auto", "cuda") == "bfloat16"
    assert concrete_dtype("float16", "cuda") == "float16"


def _report_info(config: ServerConfig, conn) -> None:
    conn.send_bytes(json.dumps(config.info()).encode())


def test_record_reaches_a_spawned_child_whole(resolved):
    """Children get the record as the launcher hands it over: a "spawn" process argument."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_report_info, args=(resolved, send))
    child.start()
    send.close()
    assert json.loads(recv.recv_bytes()) == json.loads(json.dumps(resolved.info()))
    child.join(30)
    assert child.exitcode == 0


def test_info_has_every_flag_and_the_model_facts(resolved):
    """/server_info's settings: every flag's name (resolved values), plus the model's."""
    info = resolved.info()
    assert {f.name for f in dataclasses.fields(ServerArgs)} <= info.keys()
    assert {"model_source", "num_params", "vocab_size", "architecture"} <= info.keys()
    assert info["context_length"] == 512 and info["dtype"] == "float32"
    assert info["tokenizer_path"] == resolved.model_path


# ---- the children use the record -------------------------------------------------------------

def test_tokenizer_and_detokenizer_do_not_read_config_json(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model("llama"), tmp_path / "llama")
    config = resolve_args(ServerArgs(model_path=str(model)))
    (model / "config.json").unlink()
    # A vocabulary size only the record knows: what the processes use must be this one.
    vocab = config.vocab_size + 7
    config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                   vocab_size=vocab))
    worker = make_worker(config)
    assert worker.tokenizer.vocab_size == vocab
    assert worker.tokenizer.context_len == config.context_length
    detok = make_detokenizer(config)
    assert detok.vocab_size == max(len(detok.tokenizer), vocab)

