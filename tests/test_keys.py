"""Cache keys: stable for the same inputs, different when any input changes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from asyncclcache.keys import (
    FORMAT_VERSION,
    UncertainIncludes,
    code_settings,
    device_identity,
    find_include_deps,
    make_key,
    scan_includes,
)
from conftest import child_json, run_child, small_source
from kernels import VALUE_CHILD

SOURCE = small_source(salt="test_keys").encode()
OPTIONS = b"-DFOO=1"


def _key(ctx: Any, source: bytes = SOURCE, options: bytes = OPTIONS, inc: Any = ()) -> str:
    return make_key(source, options, ctx.devices, [str(p) for p in inc]).key


def test_key_is_stable_and_well_formed(cl_ctx: Any) -> None:
    a = make_key(SOURCE, OPTIONS, cl_ctx.devices, [])
    b = make_key(SOURCE, OPTIONS, cl_ctx.devices, [])
    assert a == b
    assert len(a.key) == 64
    assert all(c in "0123456789abcdef" for c in a.key)
    assert a.devices == (device_identity(cl_ctx.devices[0]),)
    assert a.options == OPTIONS
    assert a.deps == ()


def test_device_identity_fields(cl_ctx: Any) -> None:
    dev = cl_ctx.devices[0]
    ident = device_identity(dev)
    assert ident["device_name"] == dev.name
    assert ident["driver_version"] == dev.driver_version
    assert ident["platform_name"] == dev.platform.name == "Portable Computing Language"
    assert ident["platform_version"] == dev.platform.version
    assert all(isinstance(v, str) and v for v in ident.values())


CHILD_KEY = """
    import json, sys, pyopencl as cl
    from asyncclcache.keys import make_key
    from _pocl import pocl_devices
    devs = pocl_devices()
    src, opts, incs = sys.argv[1].encode(), sys.argv[2].encode(), json.loads(sys.argv[3])
    print(json.dumps({"key": make_key(src, opts, devs[:1], incs).key,
                      "names": [d.name for d in devs]}))
"""


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_key_is_the_same_in_another_process(cl_ctx: Any, tmp_path: Path, seed: str) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "k.h").write_text("#define K 3\n")
    source = SOURCE + b'#include "k.h"\n'
    here = make_key(source, OPTIONS, cl_ctx.devices, [str(inc)]).key
    out = child_json(
        run_child(
            CHILD_KEY,
            source.decode(),
            OPTIONS.decode(),
            json.dumps([str(inc)]),
            env={"PYTHONHASHSEED": seed},
        )
    )
    assert out["key"] == here


def test_another_device_changes_the_key(cl_ctx: Any) -> None:
    """A real second device: pocl's `basic` driver instead of `pthread`."""
    here = _key(cl_ctx)
    out = child_json(
        run_child(
            CHILD_KEY, SOURCE.decode(), OPTIONS.decode(), "[]", env={"POCL_DEVICES": "basic"}
        )
    )
    assert out["names"]
    assert all(n != cl_ctx.devices[0].name for n in out["names"])
    assert out["key"] != here


def test_device_list_changes_the_key(cl_ctx: Any) -> None:
    one = make_key(SOURCE, OPTIONS, cl_ctx.devices, []).key
    two = make_key(SOURCE, OPTIONS, [cl_ctx.devices[0]] * 2, []).key
    none = make_key(SOURCE, OPTIONS, [], []).key
    assert len({one, two, none}) == 3


def test_source_changes_the_key(cl_ctx: Any) -> None:
    assert _key(cl_ctx, source=SOURCE + b" ") != _key(cl_ctx)
    assert _key(cl_ctx, source=small_source(salt="other").encode()) != _key(cl_ctx)


@pytest.mark.parametrize("options", [b"", b"-DFOO=2", b"-DFOO=1 ", b"-cl-fast-relaxed-math"])
def test_options_change_the_key(cl_ctx: Any, options: bytes) -> None:
    assert _key(cl_ctx, options=options) != _key(cl_ctx)


def test_key_covers_the_format_version(cl_ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncclcache.keys as keys

    before = _key(cl_ctx)
    monkeypatch.setattr(keys, "FORMAT_VERSION", FORMAT_VERSION + 1)
    assert _key(cl_ctx) != before


# {{{ includes


@pytest.fixture
def inc(tmp_path: Path) -> Path:
    d = tmp_path / "include"
    d.mkdir()
    return d


INCLUDING = SOURCE + b'#include "hdr.h"\n'


def test_included_header_via_dash_i(cl_ctx: Any, inc: Path) -> None:
    hdr = inc / "hdr.h"
    hdr.write_text("#define SCALE 2.0f\n")
    k1 = _key(cl_ctx, INCLUDING, inc=[inc])
    info = make_key(INCLUDING, OPTIONS, cl_ctx.devices, [str(inc)])
    assert [d.path for d in info.deps] == [os.path.realpath(hdr)]
    hdr.write_text("#define SCALE 3.0f\n")  # same size, new content
    k2 = _key(cl_ctx, INCLUDING, inc=[inc])
    assert k2 != k1
    hdr.write_text("#define SCALE 2.0f\n")  # back again
    assert _key(cl_ctx, INCLUDING, inc=[inc]) == k1


def test_include_path_as_pyopencl_processes_it(cl_ctx: Any, inc: Path) -> None:
    """`-I dir` in the build options reaches the include path the key is made with."""
    import pyopencl as cl

    (inc / "hdr.h").write_text("#define SCALE 2.0f\n")
    prg = cl.Program(cl_ctx, INCLUDING.decode())
    options, include_path = prg._process_build_options(cl_ctx, ["-I", str(inc)])
    k1 = make_key(INCLUDING, options, cl_ctx.devices, include_path)
    assert os.path.realpath(inc / "hdr.h") in [d.path for d in k1.deps]
    (inc / "hdr.h").write_text("#define SCALE 4.0f\n")
    k2 = make_key(INCLUDING, options, cl_ctx.devices, include_path)
    assert k2.key != k1.key


def test_included_header_relative_to_cwd(
    cl_ctx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    hdr = tmp_path / "hdr.h"
    hdr.write_text("#define SCALE 2.0f\n")
    k1 = _key(cl_ctx, INCLUDING, inc=["."])
    hdr.write_text("#define SCALE 5.0f\n")
    assert _key(cl_ctx, INCLUDING, inc=["."]) != k1


def test_touched_but_unchanged_header_keeps_the_key(cl_ctx: Any, inc: Path) -> None:
    hdr = inc / "hdr.h"
    hdr.write_text("#define SCALE 2.0f\n")
    k1 = _key(cl_ctx, INCLUDING, inc=[inc])
    st = hdr.stat()
    os.utime(hdr, ns=(st.st_atime_ns + 10**10, st.st_mtime_ns + 10**10))
    assert _key(cl_ctx, INCLUDING, inc=[inc]) == k1
    # Rewritten with the same content (new mtime and ctime): same key.
    hdr.write_text("#define SCALE 2.0f\n")
    assert _key(cl_ctx, INCLUDING, inc=[inc]) == k1


@pytest.mark.parametrize("old_mtime", [False, True], ids=["recent", "year-2001"])
def test_changed_header_with_its_old_mtime_changes_the_key(
    cl_ctx: Any, inc: Path, old_mtime: bool
) -> None:
    """Same size, same inode, same mtime (``cp -p``, or a coarse file system clock)."""
    hdr = inc / "hdr.h"
    hdr.write_text("#define SCALE 2.0f\n")
    if old_mtime:
        os.utime(hdr, ns=(10**18, 10**18))
    st = hdr.stat()
    k1 = _key(cl_ctx, INCLUDING, inc=[inc])
    assert _key(cl_ctx, INCLUDING, inc=[inc]) == k1
    with open(hdr, "r+") as f:
        f.write("#define SCALE 7.0f\n")
    os.utime(hdr, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = hdr.stat()
    assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert _key(cl_ctx, INCLUDING, inc=[inc]) != k1


def test_first_directory_on_the_path_wins(cl_ctx: Any, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "hdr.h").write_text("#define SCALE 1.0f\n")
    (b / "hdr.h").write_text("#define SCALE 2.0f\n")
    deps = find_include_deps(INCLUDING, [str(a), str(b)])
    assert [d.path for d in deps] == [os.path.realpath(a / "hdr.h")]
    k1 = _key(cl_ctx, INCLUDING, inc=[a, b])
    (b / "hdr.h").write_text("#define SCALE 3.0f\n")  # shadowed: no effect
    assert _key(cl_ctx, INCLUDING, inc=[a, b]) == k1
    assert _key(cl_ctx, INCLUDING, inc=[b, a]) != k1


def test_recursive_includes_are_tracked(cl_ctx: Any, inc: Path) -> None:
    (inc / "hdr.h").write_text('#include "sub/inner.h"\n#define OUTER 1\n')
    (inc / "sub").mkdir()
    inner = inc / "sub" / "inner.h"
    inner.write_text("  #  include <leaf.h>\n#define INNER 1\n")
    leaf = inc / "leaf.h"
    leaf.write_text("#define LEAF 1\n")
    info = make_key(INCLUDING, OPTIONS, cl_ctx.devices, [str(inc)])
    assert sorted(os.path.basename(d.path) for d in info.deps) == ["hdr.h", "inner.h", "leaf.h"]
    leaf.write_text("#define LEAF 2\n")
    k2 = _key(cl_ctx, INCLUDING, inc=[inc])
    assert k2 != info.key
    inner.write_text("  #  include <leaf.h>\n#define INNER 2\n")
    assert _key(cl_ctx, INCLUDING, inc=[inc]) not in (info.key, k2)


def test_include_cycle_terminates(inc: Path) -> None:
    (inc / "hdr.h").write_text('#include "b.h"\n')
    (inc / "b.h").write_text('#include "hdr.h"\n#include "b.h"\n')
    deps = find_include_deps(INCLUDING, [str(inc)])
    assert sorted(os.path.basename(d.path) for d in deps) == ["b.h", "hdr.h"]


def test_missing_header_makes_the_key_uncertain(cl_ctx: Any, inc: Path) -> None:
    # Not on our path: the compiler may find it elsewhere, and we could not see it change.
    source = SOURCE + b'#include "missing.h"\n#include "hdr.h"\n'
    (inc / "hdr.h").write_text("#define SCALE 2.0f\n")
    info = make_key(source, OPTIONS, cl_ctx.devices, [str(inc)])
    assert info.uncertain is not None and "missing.h" in info.uncertain
    (inc / "missing.h").write_text("#define M 1\n")
    info = make_key(source, OPTIONS, cl_ctx.devices, [str(inc)])
    assert info.uncertain is None
    assert sorted(os.path.basename(d.path) for d in info.deps) == ["hdr.h", "missing.h"]


def test_directory_named_like_a_header_is_uncertain(inc: Path) -> None:
    (inc / "hdr.h").mkdir()
    with pytest.raises(UncertainIncludes):
        find_include_deps(INCLUDING, [str(inc)])


def test_no_include_path_is_uncertain(inc: Path) -> None:
    (inc / "hdr.h").write_text("x")
    with pytest.raises(UncertainIncludes):
        find_include_deps(INCLUDING, [])


def test_macro_include_is_uncertain(cl_ctx: Any, inc: Path) -> None:
    (inc / "hdr.h").write_text("#define H 1\n")
    source = b'#define HDR "hdr.h"\n#include HDR\n' + SOURCE
    assert make_key(source, OPTIONS, cl_ctx.devices, [str(inc)]).uncertain is not None
    (inc / "nested.h").write_text("#include HDR\n")
    with pytest.raises(UncertainIncludes):
        find_include_deps(b'#include "nested.h"\n', [str(inc)])


@pytest.mark.parametrize("line", [
    b'#include "hdr.h" // why\n',
    b'#include "hdr.h" /* why */\n',
    b'#  include "hdr.h"\n',
    b'  #\tinclude   <hdr.h>  \n',
    b'#include"hdr.h"\n',
    b'/* a comment */ #include "hdr.h"\n',
])
def test_include_spellings_are_recognised(line: bytes, inc: Path) -> None:
    (inc / "hdr.h").write_text("#define SCALE 2.0f\n")
    deps = find_include_deps(line + SOURCE, [str(inc)])
    assert [os.path.basename(d.path) for d in deps] == ["hdr.h"]


def test_commented_out_include_is_not_one() -> None:
    assert scan_includes(b'// #include "a.h"\n/*\n#include "b.h"\n*/\nint x;') == ((), False)
    assert scan_includes(b'char *s = "//"; \n#include "c.h"\n') == ((b"c.h",), False)


def test_edit_of_a_nested_header_with_a_comment_changes_the_key(cl_ctx: Any, inc: Path) -> None:
    # The stale-result report: `#include "h.h" // comment` in an included header.
    (inc / "hdr.h").write_text('#include "inner.h" // the scale\n')
    (inc / "inner.h").write_text("#define SCALE 2.0f\n")
    before = _key(cl_ctx, INCLUDING, inc=[inc])
    (inc / "inner.h").write_text("#define SCALE 3.0f\n")
    assert _key(cl_ctx, INCLUDING, inc=[inc]) != before


def test_pocl_settings_and_host_cpu_are_in_the_key(cl_ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _key(cl_ctx)
    for var, value in (("POCL_EXTRA_BUILD_FLAGS", "-DV=2"), ("POCL_LLVM_CPU_NAME", "x86-64"),
                       ("POCL_WORK_GROUP_METHOD", "cbs"), ("POCL_WORK_GROUP_SPECIALIZATION", "0"),
                       ("POCL_MAX_WORK_GROUP_SIZE", "64"), ("POCL_VECTORIZER_REMARKS", "1")):
        monkeypatch.setenv(var, value)
        assert _key(cl_ctx) != base, var
        monkeypatch.delenv(var)
    assert _key(cl_ctx) == base
    for var in ("POCL_DEBUG", "POCL_MAX_PTHREAD_COUNT"):  # cannot change the code
        monkeypatch.setenv(var, "1")
        assert _key(cl_ctx) == base, var
        monkeypatch.delenv(var)
    assert "host_cpu" in code_settings(cl_ctx.devices)
    import asyncclcache.keys as keys

    monkeypatch.setattr(keys, "host_cpu_features", lambda: "a host with fewer features")
    assert _key(cl_ctx) != base


def test_extra_build_flags_never_share_an_entry(cache_dir: Path) -> None:
    # Issue 12: a run with POCL_EXTRA_BUILD_FLAGS=-DV=2 and a plain run got each other's result.
    src = "#ifndef V\n#define V 1\n#endif\n__kernel void f(__global float *c) { c[get_global_id(0)] = V; }"
    plain = child_json(run_child(VALUE_CHILD, str(cache_dir), src))
    flagged = child_json(run_child(VALUE_CHILD, str(cache_dir), src, env={"POCL_EXTRA_BUILD_FLAGS": "-DV=2"}))
    again = child_json(run_child(VALUE_CHILD, str(cache_dir), src))
    assert (plain["value"], plain["hits"]) == (1.0, 0)
    assert flagged["value"] == 2.0 and flagged["hits"] == 0 and flagged["key"] != plain["key"]
    assert again == {"value": 1.0, "key": plain["key"], "hits": 1}


# }}}
