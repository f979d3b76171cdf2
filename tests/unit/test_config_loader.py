"""specserve.config.loader: CLI > env > YAML > defaults, type conversion, size parsing, errors that name the field."""

from __future__ import annotations

import argparse
import dataclasses
import os
from unittest import mock

import pytest
import torch

from specserve.config.loader import _convert, add_config_flags, build_config, parse_size
from specserve.config.schema import AppConfig, EngineConfig, GiB, ServerConfig
from specserve.engine.spec_decode.registry import method_choices

ALL_FIELDS = [f.name for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)]


def parse(*argv: str) -> argparse.Namespace:
    """The flags as `specserve serve` builds them (the method names come from the engine's registry)."""
    parser = argparse.ArgumentParser(prog="t")
    add_config_flags(parser, {"speculative_method": method_choices()})
    return parser.parse_args(list(argv))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_defaults():
    assert build_config(None, {}) == AppConfig(engine=EngineConfig(), server=ServerConfig())
    assert build_config(parse(), {}) == AppConfig(engine=EngineConfig(), server=ServerConfig())


def test_absent_flags_leave_the_namespace_empty():
    assert vars(parse()) == {}


def test_cli_alone():
    cfg = build_config(parse("--max-num-seqs", "8", "--kv-cache-memory", "512MiB", "--api-key", "k",
                             "--shutdown-timeout", "2.5", "--speculative-method", "none", "--log-level", "DEBUG",
                             "--max-model-len", "none", "--seed", "3"), {})
    assert cfg.engine.max_num_seqs == 8 and cfg.engine.kv_cache_memory == 512 << 20
    assert cfg.engine.speculative_method == "none" and cfg.engine.max_model_len is None and cfg.engine.seed == 3
    assert cfg.server.api_key == "k" and cfg.server.shutdown_timeout == 2.5 and cfg.server.log_level == "debug"


def test_env_alone():
    env = {"SPECSERVE_MAX_NUM_SEQS": "8", "SPECSERVE_API_KEY": "secret", "SPECSERVE_KV_CACHE_MEMORY": "2GB",
           "SPECSERVE_PORT": "9000", "SPECSERVE_SEED": "", "SPECSERVE_SHUTDOWN_TIMEOUT": "1",
           "SPECSERVE_MODELS_DIR": "/models", "PATH": "/bin", "OTHER_PORT": "x"}
    cfg = build_config(None, env)
    assert cfg.engine.max_num_seqs == 8 and cfg.engine.kv_cache_memory == 2 * 10**9 and cfg.engine.seed is None
    assert cfg.server.api_key == "secret" and cfg.server.port == 9000 and cfg.server.shutdown_timeout == 1.0


def test_yaml_alone_with_dashed_and_snake_keys(tmp_path):
    path = write(tmp_path, "max-num-seqs: 8\nmax_num_batched_tokens: 512\nkv-cache-memory: 1.5G\n"
                           "api_key: 12345\nseed: null\nspeculative_method: none\nhost: 0.0.0.0\n")
    cfg = build_config(parse("--config", path), {})
    assert cfg.engine.max_num_seqs == 8 and cfg.engine.max_num_batched_tokens == 512
    assert cfg.engine.kv_cache_memory == int(1.5 * GiB) and cfg.engine.seed is None
    assert cfg.engine.speculative_method == "none"
    assert cfg.server.api_key == "12345" and cfg.server.host == "0.0.0.0"


def test_yaml_path_from_env_and_empty_file(tmp_path):
    path = write(tmp_path, "port: 1234\n")
    assert build_config(None, {"SPECSERVE_CONFIG": path}).server.port == 1234
    assert build_config(parse("--config", write(tmp_path, "")), {}) == build_config(None, {})


def test_precedence_cli_over_env_over_yaml_over_defaults(tmp_path):
    path = write(tmp_path, "max_num_seqs: 2\nmax_queue_len: 3\nblock_size: 4\n")
    env = {"SPECSERVE_MAX_NUM_SEQS": "20", "SPECSERVE_MAX_QUEUE_LEN": "30"}
    cfg = build_config(parse("--config", path, "--max-num-seqs", "200"), env)
    assert cfg.engine.max_num_seqs == 200  # CLI beats env and YAML
    assert cfg.engine.max_queue_len == 30  # env beats YAML
    assert cfg.engine.block_size == 4  # YAML beats the default
    assert cfg.engine.num_speculative_tokens == EngineConfig().num_speculative_tokens  # default


def test_cli_config_path_beats_env_config_path(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("port: 1111\n")
    b.write_text("port: 2222\n")
    assert build_config(parse("--config", str(a)), {"SPECSERVE_CONFIG": str(b)}).server.port == 1111


def test_namespace_attributes_that_are_not_fields_are_ignored():
    args = argparse.Namespace(command="serve", func=print, port=1)
    assert build_config(args, {}).server.port == 1


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = write(tmp_path, "max_num_seq: 8\n")
    with pytest.raises(ValueError, match="max_num_seq") as exc:
        build_config(parse("--config", path), {})
    assert "max_num_seqs" in str(exc.value)  # lists the valid keys


def test_yaml_must_be_a_mapping_and_keys_unique(tmp_path):
    with pytest.raises(ValueError, match="mapping"):
        build_config(parse("--config", write(tmp_path, "- 1\n- 2\n")), {})
    with pytest.raises(ValueError, match="twice"):
        build_config(parse("--config", write(tmp_path, "block-size: 8\nblock_size: 8\n")), {})


def test_missing_yaml_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match="nope.yaml"):
        build_config(parse("--config", missing), {})
    with pytest.raises(ValueError, match="nope.yaml"):
        build_config(None, {"SPECSERVE_CONFIG": missing})


def test_unknown_specserve_env_is_an_error():
    with pytest.raises(ValueError, match="SPECSERVE_MAX_NUM_SEQ"):
        build_config(None, {"SPECSERVE_MAX_NUM_SEQ": "8"})


@pytest.mark.parametrize("env, field", [({"SPECSERVE_PORT": "abc"}, "SPECSERVE_PORT"),
                                        ({"SPECSERVE_SHUTDOWN_TIMEOUT": "soon"}, "SPECSERVE_SHUTDOWN_TIMEOUT"),
                                        ({"SPECSERVE_KV_CACHE_MEMORY": "4 potatoes"}, "SPECSERVE_KV_CACHE_MEMORY"),
                                        ({"SPECSERVE_NUM_SPECULATIVE_TOKENS": ""}, "SPECSERVE_NUM_SPECULATIVE")])
def test_env_type_errors_name_the_variable(env, field):
    with pytest.raises(ValueError, match=field):
        build_config(None, env)


def test_env_type_error_message():
    with pytest.raises(ValueError) as exc:
        build_config(None, {"SPECSERVE_PORT": "abc"})
    assert str(exc.value) == "env SPECSERVE_PORT: invalid int 'abc'"


@pytest.mark.parametrize("text", ["port: abc", "port: true", "port: 1.5", "port: null", "max_model_len: [1]"])
def test_yaml_type_errors_name_the_field(tmp_path, text):
    with pytest.raises(ValueError, match=text.split(":")[0]):
        build_config(parse("--config", write(tmp_path, text + "\n")), {})


def test_cli_type_error_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse("--port", "abc")
    assert "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--speculative-method", "lookahead")
    assert "--speculative-method" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [
    ("123", 123), ("123B", 123), ("1KiB", 1024), ("512MiB", 512 << 20), ("4GiB", 4 * GiB), ("4gib", 4 * GiB),
    ("2GB", 2 * 10**9), ("500MB", 500 * 10**6), ("3KB", 3000), ("1.5G", int(1.5 * GiB)), ("2M", 2 << 20),
    ("1K", 1024), (" 1 GiB ", GiB), ("1TiB", 1 << 40)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1G", "4 potatoes", "4Gi", "4iB", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_optional_and_bool_conversion():
    assert _convert("seed", int | None, "null") is None and _convert("model", str | None, "None") is None
    assert _convert("speculative_method", str | None, "none") == "none"  # a valid choice, not None
    assert _convert("flag", bool, "yes") is True and _convert("flag", bool, "0") is False
    assert _convert("flag", bool, True) is True
    with pytest.raises(ValueError, match="invalid bool"):
        _convert("flag", bool, "maybe")
    with pytest.raises(ValueError, match="invalid int"):
        _convert("port", int, True)


def test_help_mentions_every_flag_and_env_var():
    parser = argparse.ArgumentParser(prog="t")
    add_config_flags(parser)
    text = " ".join(parser.format_help().split())  # undo line wrapping
    assert "--config" in text and "SPECSERVE_CONFIG" in text
    for name in ALL_FIELDS:
        assert "--" + name.replace("_", "-") in text
        assert f"(env SPECSERVE_{name.upper()})" in text
    assert "[default: 64]" in text and "[default: 8000]" in text  # max_num_seqs, port


@pytest.mark.parametrize("field, value", [("port", "70000"), ("max_num_seqs", "0"), ("kv_cache_memory", "0"),
                                          ("max_model_len", "1"), ("shutdown_timeout", "-1")])
def test_invalid_values_are_rejected_by_the_schema(tmp_path, field, value):
    for args, env in [(parse(f"--{field.replace('_', '-')}", value), {}),
                      (None, {f"SPECSERVE_{field.upper()}": value}),
                      (parse("--config", write(tmp_path, f"{field}: {value}\n")), {})]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            build_config(args, env)


@pytest.mark.parametrize("field, value", [("log_level", "loud"), ("speculative_method", "lookahead")])
def test_invalid_choices_from_env_and_yaml_are_rejected(tmp_path, field, value):
    """log_level by the schema; method names by the engine's registry (the config does not import the engine),
    which the CLI runs before the server listens."""
    from specserve.engine.spec_decode.registry import check_methods

    def build_and_check(args, env):
        check_methods(build_config(args, env).engine)

    with pytest.raises(ValueError, match=f"^{field}:"):
        build_and_check(None, {f"SPECSERVE_{field.upper()}": value})
    with pytest.raises(ValueError, match=f"^{field}:"):
        build_and_check(parse("--config", write(tmp_path, f"{field}: {value}\n")), {})


def test_kubernetes_service_link_variables_are_ignored_or_explained():
    from specserve.config.loader import build_config

    env = {"SPECSERVE_SERVICE_HOST": "10.0.0.1", "SPECSERVE_SERVICE_PORT": "8000",
           "SPECSERVE_PORT_8000_TCP": "tcp://10.0.0.1:8000", "SPECSERVE_PORT_8000_TCP_ADDR": "10.0.0.1"}
    assert build_config(None, env).server.port == 8000
    import pytest

    with pytest.raises(ValueError, match="enableServiceLinks"):
        build_config(None, env | {"SPECSERVE_PORT": "tcp://10.0.0.1:8000"})


def test_unknown_or_repeated_methods_are_refused_before_anything_loads(tmp_path, capsys):
    """Checked against the engine's registry (names only) by the CLI before the server listens, from every source."""
    from specserve.engine.spec_decode.registry import check_methods
    from specserve.server.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tmp_path), "--speculative-method", "lookahead"])
    with pytest.raises(ValueError, match="^speculative_method: unknown speculative method 'lookahead'"):
        check_methods(build_config(None, {"SPECSERVE_SPECULATIVE_METHOD": "lookahead"}).engine)
    with mock.patch.dict(os.environ, {"SPECSERVE_SPECULATIVE_METHOD": "lookahead"}):
        assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "speculative_method: unknown speculative method 'lookahead'" in capsys.readouterr().err
    cfg = '[{"method": "ngram"}, {"method": "prompt_lookup"}]'
    assert main(["serve", "--model", str(tmp_path), "--speculative-config", cfg]) == 2
    assert "speculative_config.method: method 'ngram' is listed twice" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--speculative-config", '{"method": "ngram", "k": 2}']) == 2
    assert "speculative_config.k: unknown key" in capsys.readouterr().err


def test_the_demo_default_method_follows_the_device():
    # on CPU the drafts that cost nothing win (docs/benchmarks.md, "The CPU default method"); on a GPU EAGLE-3
    assert EngineConfig(device="cpu").method == "ngram" and EngineConfig(device="cuda").method == "eagle3"
    assert EngineConfig(device="cuda:1").method == "eagle3"
    assert EngineConfig().method == ("eagle3" if torch.cuda.is_available() else "ngram")  # auto: as the engine
    # a model of the user's, a draft model, or an explicit method: the device does not choose
    assert EngineConfig(model="m", device="cpu").method == "none"
    assert EngineConfig(draft_model="d", device="cpu").method == "draft"
    assert EngineConfig(device="cpu", speculative_method="eagle3").method == "eagle3"
    assert EngineConfig(device="cpu", num_speculative_tokens=0).method == "none"


def test_the_cpu_kernels_switches_are_accepted_beside_the_settings():
    """SPECSERVE_CPU_LEVEL and the kernels' other switches are read by build.py, not config fields: a server started
    with one must not refuse it as an unknown setting (bench.peers at a forced level did)."""
    import ast
    from pathlib import Path

    from specserve.engine.model.cpu_kernels import build

    source = ast.parse(Path(build.__file__).read_text())
    switches = {node.value.value for node in ast.walk(source) if isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                and node.value.value.startswith("SPECSERVE_")}
    assert {"SPECSERVE_CPU_LEVEL", "SPECSERVE_CPU_AMX", "SPECSERVE_CPU_KERNELS"} <= switches
    build_config(None, {name: "1" for name in switches} | {"SPECSERVE_CPU_LEVEL": "x86-64-v3"})
