"""Settings from the environment: sizes, booleans, and errors that name the variable."""

from __future__ import annotations

from typing import Any

import pytest

from asyncclcache.config import STRATEGIES, Config, get_config, parse_bool, parse_size
from conftest import child_json, run_child


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("0", None),
        ("500M", 500 << 20),
        ("500m", 500 << 20),
        ("2G", 2 << 30),
        ("2GB", 2 << 30),
        ("2GiB", 2 << 30),
        ("10k", 10 << 10),
        ("1T", 1 << 40),
        ("1.5K", 1536),
        (" 3 M ", 3 << 20),
        ("7b", 7),
        (None, None),
        (0, None),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int | None, expected: int | None) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "-1", "-5M", "1.2.3", "10X", "1e3", "ten", "5 M B x"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_parse_size_rejects_negative_int() -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(-1)


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "on", " On "])
def test_parse_bool_true(text: str) -> None:
    assert parse_bool(text) is True


@pytest.mark.parametrize("text", ["0", "false", "False", "no", "off", "", "  "])
def test_parse_bool_false(text: str) -> None:
    assert parse_bool(text) is False


def test_parse_bool_unset() -> None:
    assert parse_bool(None) is None


@pytest.mark.parametrize("text", ["2", "maybe", "y", "tru", "-1"])
def test_parse_bool_rejects_naming_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match="MY_VAR") as info:
        parse_bool(text, name="MY_VAR")
    assert repr(text) in str(info.value)


def test_from_env_defaults() -> None:
    cfg = Config.from_env({})
    assert cfg == Config()
    assert cfg.directory is None
    assert cfg.disable is False
    assert cfg.rank_local is None
    assert cfg.strategy == "auto"
    assert cfg.workers == 1
    assert cfg.exit_timeout == 5.0
    assert cfg.max_size is None


def test_from_env_values() -> None:
    cfg = Config.from_env(
        {
            "ASYNCCLCACHE_DIR": "/some/where",
            "ASYNCCLCACHE_DISABLE": "yes",
            "ASYNCCLCACHE_RANK_LOCAL": "0",
            "ASYNCCLCACHE_STRATEGY": " Thread ",
            "ASYNCCLCACHE_WORKERS": "3",
            "ASYNCCLCACHE_FAILURE_FATAL": "1",
            "ASYNCCLCACHE_EXIT_TIMEOUT": "0.5",
            "ASYNCCLCACHE_MAX_SIZE": "1G",
        }
    )
    assert cfg == Config(
        directory="/some/where",
        disable=True,
        rank_local=False,
        strategy="thread",
        workers=3,
        failure_fatal=True,
        exit_timeout=0.5,
        max_size=1 << 30,
    )


def test_from_env_empty_values_mean_default() -> None:
    names = [
        "ASYNCCLCACHE_DIR",
        "ASYNCCLCACHE_STRATEGY",
        "ASYNCCLCACHE_WORKERS",
        "ASYNCCLCACHE_EXIT_TIMEOUT",
        "ASYNCCLCACHE_MAX_SIZE",
    ]
    assert Config.from_env(dict.fromkeys(names, "")) == Config()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_is_accepted(strategy: str) -> None:
    assert Config.from_env({"ASYNCCLCACHE_STRATEGY": strategy.upper()}).strategy == strategy


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("ASYNCCLCACHE_STRATEGY", "fast"),
        ("ASYNCCLCACHE_WORKERS", "0"),
        ("ASYNCCLCACHE_WORKERS", "-2"),
        ("ASYNCCLCACHE_WORKERS", "many"),
        ("ASYNCCLCACHE_WORKERS", "1.5"),
        ("ASYNCCLCACHE_EXIT_TIMEOUT", "soon"),
        ("ASYNCCLCACHE_EXIT_TIMEOUT", "nan"),
        ("ASYNCCLCACHE_EXIT_TIMEOUT", "inf"),
        ("ASYNCCLCACHE_EXIT_TIMEOUT", "-1"),
        ("ASYNCCLCACHE_WORKERS", "100000"),
        ("ASYNCCLCACHE_MAX_SIZE", "nan"),
        ("ASYNCCLCACHE_MAX_SIZE", "lots"),
        ("ASYNCCLCACHE_MAX_SIZE", "-1G"),
        ("ASYNCCLCACHE_DISABLE", "maybe"),
        ("ASYNCCLCACHE_RANK_LOCAL", "2"),
        ("ASYNCCLCACHE_FAILURE_FATAL", "sometimes"),
    ],
)
def test_from_env_errors_name_the_variable(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=var):
        Config.from_env({var: value})


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCLCACHE_WORKERS", "4")
    assert Config.from_env().workers == 4


def test_get_config_is_read_once_per_process() -> None:
    assert get_config() is get_config()
    out = child_json(
        run_child(
            """
            import json, os
            from asyncclcache.config import get_config
            first = get_config()
            os.environ["ASYNCCLCACHE_WORKERS"] = "7"
            print(json.dumps([first.workers, get_config().workers, first.max_size]))
            """,
            env={"ASYNCCLCACHE_WORKERS": "2", "ASYNCCLCACHE_MAX_SIZE": "1K"},
        )
    )
    assert out == [2, 2, 1024]


@pytest.mark.parametrize("value", ["nan", "inf", -1])
def test_cache_rejects_a_bad_exit_timeout(value: object, tmp_path: Any) -> None:
    import asyncclcache as acc

    with pytest.raises(ValueError, match="exit_timeout"):
        acc.Cache(tmp_path / "acc", exit_timeout=float(value))  # type: ignore[arg-type]


def test_bad_setting_is_a_usage_error_in_the_cli(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    for var, value in (("ASYNCCLCACHE_EXIT_TIMEOUT", "nan"), ("ASYNCCLCACHE_WORKERS", "x")):
        env = dict(os.environ, **{var: value})
        r = subprocess.run([sys.executable, "-m", "asyncclcache", "info", "--dir", str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=60, check=False)
        assert r.returncode == 2 and var in r.stderr and "Traceback" not in r.stderr


def test_explicit_arguments_win_over_the_environment(tmp_path: Any) -> None:
    code = r"""
import json, sys
import asyncclcache as acc
given = acc.Cache(sys.argv[1], strategy="auto", workers=1)
env = acc.Cache(sys.argv[1])
print(json.dumps([given.strategy, given._nworkers, env.strategy, env._nworkers]))
given.close(); env.close()
"""
    env = {"ASYNCCLCACHE_STRATEGY": "thread", "ASYNCCLCACHE_WORKERS": "3"}
    assert child_json(run_child(code, str(tmp_path), env=env)) == ["auto", 1, "thread", 3]
    assert child_json(run_child(code, str(tmp_path))) == ["auto", 1, "auto", 1]
