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


# {{{ issue 33, cases 5 and 7: path settings are expanded and made absolute once; a bad one
# is named (exit 2 from the command, a warning and no caching from install())

PATH_SETTINGS = ("ASYNCCLCACHE_DIR", "ASYNCCLCACHE_NODE_DIR")
NO_USER = "~nosuchuser-acc33/x"


@pytest.mark.parametrize("var", PATH_SETTINGS)
def test_path_settings_are_expanded_and_made_absolute(var: str, tmp_path: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    field = {"ASYNCCLCACHE_DIR": "directory", "ASYNCCLCACHE_NODE_DIR": "node_dir"}[var]
    assert getattr(Config.from_env({var: "acc"}), field) == os.path.join(str(tmp_path), "acc")
    assert getattr(Config.from_env({var: "~/acc"}), field) == str(tmp_path / "home" / "acc")
    assert getattr(Config.from_env({var: "/abs/acc"}), field) == "/abs/acc"


@pytest.mark.parametrize("var", PATH_SETTINGS)
@pytest.mark.parametrize("value", [NO_USER, "~/x"], ids=["no-such-user", "empty-HOME"])
def test_a_path_setting_that_cannot_be_expanded_is_named(var: str, value: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "")  # "" is no home: never "/x"
    with pytest.raises(ValueError, match=f"{var}: cannot expand") as info:
        Config.from_env({var: value})
    assert repr(value) in str(info.value)


def test_a_relative_cache_directory_is_made_absolute_once(tmp_path: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import asyncclcache as acc

    monkeypatch.chdir(tmp_path)
    cache = acc.Cache("acc")
    try:
        (tmp_path / "out").mkdir()
        os.chdir(tmp_path / "out")  # what a program does after its first launch
        assert cache.directory.startswith(str(tmp_path / "acc"))
        assert cache.store.path_for("ab" * 32).is_absolute()
    finally:
        cache.close()
    with pytest.raises(ValueError, match="cannot expand"):
        acc.Cache(NO_USER)


def _cli(*args: str, env: dict[str, str]) -> Any:
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "asyncclcache", *args], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=120, check=False)


@pytest.mark.parametrize("var", PATH_SETTINGS)
@pytest.mark.parametrize("command", ["info", "list", "run", "run --"])
def test_a_bad_path_setting_is_a_one_line_usage_error(var: str, command: str, tmp_path: Any) -> None:
    import sys

    script = tmp_path / "driver.py"
    script.write_text("print('ran')\n")
    args = {"info": ["info"], "list": ["list"], "run": ["run", str(script)],
            "run --": ["run", "--", sys.executable, str(script)]}[command]
    r = _cli(*args, env={var: NO_USER})
    assert r.returncode == 2 and "ran" not in r.stdout, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and var in r.stderr and NO_USER in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 or command.startswith("run"), r.stderr


@pytest.mark.parametrize("command", ["info", "list", "run"])
def test_a_bad_dir_option_is_a_one_line_usage_error(command: str, tmp_path: Any) -> None:
    r = _cli(command, "--dir", NO_USER, *([str(tmp_path / "driver.py")] if command == "run" else []), env={})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--dir" in r.stderr, r.stderr
    assert NO_USER in r.stderr


def test_install_with_a_bad_setting_warns_and_builds_uncached(tmp_path: Any) -> None:
    code = r"""
import json, warnings
import asyncclcache as acc
from _pocl import pocl_context
from kernels import small_source, run_twice
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    installed = acc.install()
    ctx = pocl_context()
    prg = acc.Program(ctx, small_source(salt="bad setting")).build()  # no cache=: the default's
    ok = run_twice(ctx, prg)
print(json.dumps({"installed": installed, "ok": ok, "is_installed": acc.is_installed(),
                  "warnings": [(w.category.__name__, str(w.message)) for w in seen]}))
"""
    out = child_json(run_child(code, env={"ASYNCCLCACHE_DIR": NO_USER}))
    assert (out["installed"], out["is_installed"], out["ok"]) == (False, False, True), out
    assert [c for c, _ in out["warnings"]] == ["SettingWarning"], out  # once a process
    assert "ASYNCCLCACHE_DIR" in out["warnings"][0][1] and NO_USER in out["warnings"][0][1]


def test_activation_with_a_bad_setting_says_so_and_the_program_runs() -> None:
    code = "import pyopencl, asyncclcache as acc; print(acc.is_installed())"
    proc = run_child(code, env={"ASYNCCLCACHE_INSTALL": "1", "ASYNCCLCACHE_DIR": NO_USER})
    assert proc.stdout.split() == ["False"] and "ASYNCCLCACHE_DIR" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr

# }}}


def test_idle_baking_is_on_by_default_but_in_a_jobs_ranks_and_on_one_core(monkeypatch) -> None:
    # Issue 35: a test suite's cold run on 2 cores baked 39 of its 40 entries on the idle core
    # and ran in 0.90 of its time without a cache; a job's ranks keep every core busy.
    from asyncclcache import config, system

    assert config.Config.from_env({}).bake == "auto"
    monkeypatch.setattr(system, "usable_cores", lambda: 2)
    auto = config.Config.from_env({})
    assert auto.bakes_idle(None) and not auto.bakes_idle(0)
    monkeypatch.setattr(system, "usable_cores", lambda: 1)
    assert not auto.bakes_idle(None)
    assert config.Config.from_env({"ASYNCCLCACHE_BAKE": "idle"}).bakes_idle(0)
    assert not config.Config.from_env({"ASYNCCLCACHE_BAKE": "off"}).bakes_idle(None)


def test_a_bake_at_exit_is_for_ci_jobs_and_exit_not_for_ranks_nor_other_machines() -> None:
    from asyncclcache import config

    def at_exit(env: dict[str, str], rank: int | None = None) -> bool:
        return config.Config.from_env(env).bakes_at_exit(rank)

    assert at_exit({"CI": "true"}) and at_exit({"CI": "1"}) and at_exit({"ASYNCCLCACHE_BAKE": "exit"})
    assert not at_exit({}) and not at_exit({"CI": "false"}) and not at_exit({"CI": ""})
    assert not at_exit({"CI": "true"}, rank=0) and not at_exit({"ASYNCCLCACHE_BAKE": "exit"}, rank=3)
    assert not at_exit({"CI": "true", "ASYNCCLCACHE_BAKE": "idle"})
    assert not at_exit({"CI": "true", "ASYNCCLCACHE_BAKE": "off"})
    assert not at_exit({"CI": "true", "ASYNCCLCACHE_EXIT_BAKE_TIMEOUT": "0"})
    assert config.Config.from_env({"ASYNCCLCACHE_EXIT_BAKE_TIMEOUT": "30"}).exit_bake_timeout == 30.0
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(ValueError, match="ASYNCCLCACHE_EXIT_BAKE_TIMEOUT"):
            config.Config.from_env({"ASYNCCLCACHE_EXIT_BAKE_TIMEOUT": bad})
