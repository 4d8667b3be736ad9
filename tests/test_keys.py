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


# A C++-only branch (OpenCL C leaves __cplusplus undefined): its includes are none, unless
# the options may make it C++ or the code defines __cplusplus.
@pytest.mark.parametrize("text", [
    b'#ifdef __cplusplus\n#include <stdexcept>\n#endif\n',
    b'#  if defined( __cplusplus )\n#include <stdexcept>\n#endif\n',
    b'#if defined __cplusplus\n#include <stdexcept>\n#endif\n',
    b'#if __cplusplus\n#include <stdexcept>\n#endif\n',
    b'#ifndef __cplusplus\n#define M 1\n#else\n#if X\n#include <stdexcept>\n#endif\n#include <algorithm>\n#endif\n',
    b'#if !defined(__cplusplus)\n#define M 1\n#else /* C++ */\n#include <stdexcept>\n#endif\n',
])
def test_an_include_only_cplusplus_compiles_is_none(text: bytes, inc: Path) -> None:
    (inc / "hdr.h").write_text("#define SCALE 2.0f\n")
    source = text + b'#include "hdr.h"\n' + SOURCE
    deps = find_include_deps(source, [str(inc)], cxx=False)
    assert [os.path.basename(d.path) for d in deps] == ["hdr.h"]
    with pytest.raises(UncertainIncludes):  # compiled as C++ it would be looked for
        find_include_deps(source, [str(inc)], cxx=True)


@pytest.mark.parametrize("text", [
    b'#ifdef __cplusplus\n#define M 1\n#else\n#include <stdexcept>\n#endif\n',  # the C branch
    b'#ifndef __cplusplus\n#include <stdexcept>\n#endif\n',
    b'#ifdef __cplusplus\n#elif 1\n#include <stdexcept>\n#endif\n',  # the #elif is compiled
    b'#if defined(__cplusplus) || 1\n#include <stdexcept>\n#endif\n',  # a condition not told
    b'#if __cplusplus >= 201103L\n#include <stdexcept>\n#endif\n',
    b'#ifdef __cplusplusX\n#include <stdexcept>\n#endif\n',
    b'#define __cplusplus 1\n#ifdef __cplusplus\n#include <stdexcept>\n#endif\n',  # defined by the code
    b'#ifdef __cplusplus\n#include <stdexcept>\n',  # unbalanced: clang refuses it, we skip nothing
    b'#ifdef __cplusplus\n#endif\n#endif\n#include <stdexcept>\n',
    b'#ifdef __cplusplus\n#ifdef X\n#endif\n#endif\n#include <stdexcept>\n',  # after the branch
])
def test_an_include_c_may_compile_counts(text: bytes, inc: Path) -> None:
    with pytest.raises(UncertainIncludes, match="stdexcept"):
        find_include_deps(text + SOURCE, [str(inc)], cxx=False)


def test_a_header_that_defines_cplusplus_makes_every_branch_count(inc: Path) -> None:
    (inc / "defines.h").write_text("#define __cplusplus 201703L\n")
    source = b'#include "defines.h"\n#ifdef __cplusplus\n#include <stdexcept>\n#endif\n' + SOURCE
    with pytest.raises(UncertainIncludes, match="stdexcept"):
        find_include_deps(source, [str(inc)], cxx=False)


def test_a_cplusplus_branch_is_skipped_only_where_the_options_cannot_make_it_cplusplus(
        cl_ctx: Any, inc: Path) -> None:
    source = b'#ifdef __cplusplus\n#include <stdexcept>\n#endif\n' + SOURCE
    assert make_key(source, OPTIONS, cl_ctx.devices, [str(inc)]).uncertain is None
    for options in (b"-cl-std=CLC++", b"-cl-std=clc++2021", b"-D__cplusplus=201703L", b"-D __cplusplus"):
        info = make_key(source, options, cl_ctx.devices, [str(inc)])
        assert info.uncertain is not None and "stdexcept" in info.uncertain, options


def test_pyopencl_random123_programs_are_cached(cl_ctx: Any, cache_dir: Path) -> None:
    """pyopencl's philox generator includes C++'s <stdexcept> under #ifdef __cplusplus:
    cached, and a hit in a new process gives the same numbers."""
    code = r"""
import json, sys
import numpy as np, pyopencl as cl, pyopencl.array as cla, pyopencl.clrandom as clr
import asyncclcache as acc
from _pocl import pocl_context
cache = acc.Cache(sys.argv[1]); acc.install(cache)
ctx = pocl_context(); q = cl.CommandQueue(ctx)
gen = clr.PhiloxGenerator(ctx, seed=12)
x = gen.uniform(q, 64, np.float32).get()
cache.flush(120)
s = cache.stats()
print(json.dumps({"x": x.tolist(), "hits": s.hits, "misses": s.misses, "uncacheable": s.uncacheable}))
"""
    first = child_json(run_child(code, str(cache_dir)))
    second = child_json(run_child(code, str(cache_dir)))
    assert first["uncacheable"] == 0 and first["misses"] >= 1, first
    assert second["hits"] >= 1 and second["misses"] == 0 and second["uncacheable"] == 0, second
    assert second["x"] == first["x"]


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


# {{{ lookup order and spellings (issue 18)


def test_quote_include_in_a_header_looks_in_its_own_folder_first(
    cl_ctx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "a.h").write_text('#include "b.h"\n#include <c.h>\n')
    (tmp_path / "inc" / "b.h").write_text("#define B 2\n")
    (tmp_path / "inc" / "c.h").write_text("#define C 2\n")
    (tmp_path / "b.h").write_text("#define B 1\n")  # earlier on the path, but not for a.h's "b.h"
    (tmp_path / "c.h").write_text("#define C 1\n")  # <c.h>: the path only, so this one
    source = b'#include "a.h"\n'
    deps = find_include_deps(source, [".", "inc"])
    assert [d.path for d in deps] == [str((tmp_path / p).resolve()) for p in ("c.h", "inc/a.h", "inc/b.h")]
    before = make_key(source, OPTIONS, cl_ctx.devices, [".", "inc"]).key
    (tmp_path / "inc" / "b.h").write_text("#define B 3\n")
    assert make_key(source, OPTIONS, cl_ctx.devices, [".", "inc"]).key != before


def test_source_dir_comes_first_for_quote_includes_of_the_source(cl_ctx: Any, tmp_path: Path) -> None:
    here, pocl = tmp_path / "here", tmp_path / "pocl"
    here.mkdir()
    pocl.mkdir()
    (here / "h.h").write_text("#define H 1\n")
    quoted, angled = b'#include "h.h"\n', b"#include <h.h>\n"

    def key(source: bytes, source_dir: Path | None) -> Any:
        return make_key(source, OPTIONS, cl_ctx.devices, [str(here)],
                        source_dir=None if source_dir is None else str(source_dir))

    plain = key(quoted, None)
    # Nothing of that name there: the same key as without it (another node's own
    # POCL_CACHE_DIR still shares the entry).
    assert key(quoted, pocl).key == plain.key
    (pocl / "h.h").write_text("#define H 2\n")
    shadowed = key(quoted, pocl)
    assert [d.path for d in shadowed.deps] == [str((pocl / "h.h").resolve())]
    assert shadowed.uncertain is None and shadowed.key != plain.key
    assert key(angled, pocl).deps == key(angled, None).deps  # <h.h>: the include path only
    assert [d.path for d in key(quoted, None).deps] == [str((here / "h.h").resolve())]
    # Only the source's own includes: a header's "h.h" looks next to that header.
    (here / "outer.h").write_text('#include "h.h"\n')
    deps = find_include_deps(b'#include <outer.h>\n', [str(here)], source_dir=str(pocl))
    assert str((here / "h.h").resolve()) in [d.path for d in deps]


def test_key_covers_the_include_rule(cl_ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Entries keyed under the old lookup (which could hash a file clang did not take) never match.
    import asyncclcache.keys as keys

    before = _key(cl_ctx)
    monkeypatch.setattr(keys, "INCLUDE_RULE", keys.INCLUDE_RULE + 1)
    assert _key(cl_ctx) != before


def test_dotdot_through_a_missing_folder_is_not_a_match(tmp_path: Path) -> None:
    # The OS (and clang) cannot open missing/../h.h; a realpath of it would be ./h.h.
    (tmp_path / "h.h").write_text("#define H 1\n")
    (tmp_path / "x" / "inc").mkdir(parents=True)
    (tmp_path / "x" / "h.h").write_text("#define H 2\n")
    deps = find_include_deps(b'#include "../h.h"\n', [str(tmp_path / "missing"), str(tmp_path / "x" / "inc")])
    assert [d.path for d in deps] == [str((tmp_path / "x" / "h.h").resolve())]


def test_cycle_through_dotdot_terminates(inc: Path) -> None:
    (inc / "x").mkdir()
    (inc / "x" / "a.h").write_text('#pragma once\n#include "../x/a.h"\n')
    deps = find_include_deps(b'#include "x/a.h"\n', [str(inc)])
    assert [os.path.basename(d.path) for d in deps] == ["a.h"]


def test_header_reached_through_a_link_whose_includes_differ_is_uncertain(tmp_path: Path) -> None:
    # clang may take a linked header's folder from either name: if that changes what its
    # "b.h" is, no key can be sure.
    (tmp_path / "inc").mkdir()
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "inc" / "a.h").symlink_to(tmp_path / "real" / "a.h")
    (tmp_path / "real" / "b.h").write_text("#define B 1\n")
    (tmp_path / "inc" / "b.h").write_text("#define B 2\n")
    with pytest.raises(UncertainIncludes, match="links"):
        find_include_deps(b'#include "a.h"\n', [str(tmp_path / "inc")])
    (tmp_path / "inc" / "b.h").unlink()
    (tmp_path / "inc" / "b.h").symlink_to(tmp_path / "real" / "b.h")  # the same file both ways
    deps = find_include_deps(b'#include "a.h"\n', [str(tmp_path / "inc")])
    assert sorted(d.path for d in deps) == [str((tmp_path / "real" / n).resolve()) for n in ("a.h", "b.h")]


@pytest.mark.parametrize("text", [
    b'%:include "hdr.h"\n',
    b'??=include "hdr.h"\n',
    b'  %:  include <hdr.h>\n',
    b'#inc\\\r\nlude "hdr.h"\r\n',
    b'#inc\\\n\rlude "hdr.h"\n',
    b'#inc\\ \t \nlude "hdr.h"\n',
    b'#inc\\\rlude "hdr.h"\r',
    b'#inc??/\nlude "hdr.h"\n',
    b'// CR line ends\r#include "hdr.h"\r',
    b'int x;\r\n/* CRLF */\r\n#include "hdr.h"\r\n',
    b'\xef\xbb\xbf#include "hdr.h"\n',
    b'\f#\vinclude "hdr.h"\n',
    b'/* one */ /* two */ # /* three */ include /* four */ "hdr.h" /* five\n */\n',
    b'#include /* a comment\n across lines */ "hdr.h"\n',
    b'/* a comment\n */ #include "hdr.h"\n',
    b"#define X don't /* the quote runs to the line end: no comment\n#include \"hdr.h\"\n",
    b'#error one /* closed */ on its line\n#include "hdr.h"\n',
    b'// ??/\n#include "hdr.h"\n',  # a comment going on if ??/ is a splice: both ways counted
], ids=lambda t: repr(t)[2:40])
def test_include_spellings_the_preprocessor_sees(text: bytes, inc: Path) -> None:
    (inc / "hdr.h").write_text("#define SCALE 2.0f\n")
    deps = find_include_deps(text + SOURCE, [str(inc)])
    assert [os.path.basename(d.path) for d in deps] == ["hdr.h"]


@pytest.mark.parametrize("text", [
    b'char *s = "#include <hdr.h>";\n',
    b'/* #include "hdr.h" */\n',
    b'// #include "hdr.h" \\\n#include "hdr.h"\n',  # the splice makes it one comment
    b'int x; /* comment\n */ #include "hdr.h"\n',  # the # is not first on its line
    b'// __has_include("hdr.h")\n',
], ids=lambda t: repr(t)[2:40])
def test_what_the_preprocessor_does_not_see(text: bytes) -> None:
    assert scan_includes(text) == ((), False)


@pytest.mark.parametrize("text", [
    b'#include_next "hdr.h"\n',
    b'#import "hdr.h"\n',
    b'%:import <hdr.h>\n',
    b'#inc\\\nlude_next <hdr.h>\n',
    b'#if __has_include("opt.h")\n#endif\n',
    b'#if defined(__has_include_next) && __has_include_next(<opt.h>)\n#endif\n',
    b'#define HAS __has_inc\\\nlude("opt.h")\n',
    b'#include <a/*b.h>\n',  # lexed as tokens where #if skips it: a comment
    b'#include <a//b.h>\n',
    b'#include <it\'s.h>\n',
    b'#include "a\\b.h"\n',
    b'#include ""\n',
    b'#warning an unclosed /* comment\n#include "hdr.h"\n*/\n',
    b'const char t[] = __TIME__;\n',
    b'#include HDR\n',
    b'#include ??/\n"hdr.h"\n',  # no name at all where ??/ is no trigraph
], ids=lambda t: repr(t)[2:40])
def test_what_cannot_be_known_is_uncertain(text: bytes, inc: Path) -> None:
    (inc / "hdr.h").write_text("#define SCALE 2.0f\n")
    assert scan_includes(text)[1] is True
    with pytest.raises(UncertainIncludes):
        find_include_deps(text, [str(inc)])
    nested = inc / "nested.h"
    nested.write_bytes(text)  # the same in a header
    with pytest.raises(UncertainIncludes, match=r"nested\.h"):
        find_include_deps(b'#include "nested.h"\n', [str(inc)])


def test_has_include_makes_make_key_uncertain(cl_ctx: Any, inc: Path) -> None:
    source = b'#if __has_include("opt.h")\n#define V 2\n#endif\n' + SOURCE
    info = make_key(source, OPTIONS, cl_ctx.devices, [str(inc)])
    assert info.uncertain is not None and "__has_include" in info.uncertain


def test_edit_of_a_header_included_by_any_spelling_changes_the_key(cl_ctx: Any, inc: Path) -> None:
    hdr = inc / "hdr.h"
    for text in (b'%:include "hdr.h"\r\n', b'??=inc\\\r\nlude "hdr.h"\r'):
        hdr.write_text("#define SCALE 2.0f\n")
        before = _key(cl_ctx, text + SOURCE, inc=[inc])
        hdr.write_text("#define SCALE 3.0f\n")
        assert _key(cl_ctx, text + SOURCE, inc=[inc]) != before


# }}}


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


@pytest.mark.parametrize("opts", [b"-include x.h", b"-I. -isystem /usr/include", b"-iquote q", b"-imacros m.h"])
def test_options_that_add_files_or_move_the_search_make_it_uncacheable(cl_ctx: Any, opts: bytes,
                                                                       monkeypatch: Any) -> None:
    assert make_key(SOURCE, opts, cl_ctx.devices, []).uncertain is not None
    assert make_key(SOURCE, b"-DINCLUDE=1 -I inc", cl_ctx.devices, []).uncertain is None
    monkeypatch.setenv("POCL_EXTRA_BUILD_FLAGS", opts.decode())
    assert make_key(SOURCE, b"", cl_ctx.devices, []).uncertain is not None


# {{{ each driver's settings in the key (issue 26): our selection, on a plain environment


def _selected(platform: str, env: dict[str, str]) -> dict[str, str]:
    from asyncclcache import platforms

    record = platforms.find(platform)
    assert record is not None and record.settings is not None, platform
    return record.settings.select(env)


# Set on every machine, or by other drivers and tools: never in another driver's key.
_UNRELATED = {"HOME": "/h", "PATH": "/usr/bin", "XDG_CACHE_HOME": "/x", "POCL_WORK_GROUP_METHOD": "cbs",
              "CL_CONFIG_CPU_TARGET_ARCH": "corei7", "OMPI_COMM_WORLD_RANK": "3", "PYOPENCL_CTX": "0"}


def test_mesa_settings_that_change_code_are_in_the_key_and_its_cache_places_are_not() -> None:
    from asyncclcache.platforms.mesa import NAME as RUSTICL_PLATFORM_NAME

    code = {
        "LP_NATIVE_VECTOR_WIDTH": "128", "LP_PERF": "no_mipmap", "LP_DEBUG": "accurate_a0",
        "GALLIVM_PERF": "nopt", "GALLIVM_DEBUG": "nopt", "GALLIUM_NOSSE": "1",
        "GALLIUM_OVERRIDE_CPU_CAPS": "nosse", "GALLIUM_DRIVER": "softpipe",
        "MESA_SPIRV_FORCE_UNSTRUCTURED": "1", "MESA_LOADER_DRIVER_OVERRIDE": "zink",
        "RUSTICL_FEATURES": "fp64", "RUSTICL_DEBUG": "no_variants", "RUSTICL_CL_VERSION": "3.0",
        "RUSTICL_DEVICE_TYPE": "gpu", "AMD_DEBUG": "w64cs", "INTEL_DEBUG": "no16", "ZINK_DEBUG": "nir",
        "NV50_PROG_OPTIMIZE": "0",
    }
    not_code = {
        # Where Mesa's cache lives and which backend: a new node with another folder must hit.
        "MESA_SHADER_CACHE_DIR": "/node2/m", "MESA_GLSL_CACHE_DIR": "/g", "MESA_SHADER_CACHE_MAX_SIZE": "1G",
        "MESA_SHADER_CACHE_DISABLE": "false", "MESA_DISK_CACHE_MULTI_FILE": "1",
        "MESA_DISK_CACHE_SINGLE_FILE": "0", "MESA_DISK_CACHE_DATABASE": "0",
        # Logging, threads, and which devices (their identity is in the key).
        "MESA_DEBUG": "silent", "MESA_LOG_FILE": "/tmp/log", "GALLIUM_HUD": "fps", "GALLIUM_PRINT_OPTIONS": "1",
        "LP_NUM_THREADS": "4", "GALLIUM_THREAD": "0", "RUSTICL_ENABLE": "llvmpipe",
    }
    assert _selected(RUSTICL_PLATFORM_NAME, {**code, **not_code, **_UNRELATED}) == code
    assert _selected("Clover", code) == code
    # Two nodes that differ only in where their caches are have the same settings.
    assert _selected(RUSTICL_PLATFORM_NAME, {"MESA_SHADER_CACHE_DIR": "/a", "LP_PERF": "x"}) == \
        _selected(RUSTICL_PLATFORM_NAME, {"MESA_SHADER_CACHE_DIR": "/b", "LP_PERF": "x"})


def test_nvidia_jit_settings_are_in_the_key_and_cache_and_device_choice_are_not() -> None:
    from asyncclcache.platforms.nvidia import NAME as NVIDIA_PLATFORM_NAME

    code = {"CUDA_FORCE_PTX_JIT": "1", "CUDA_DISABLE_PTX_JIT": "1", "CUDA_FORCE_JIT": "1",
            "CUDA_MODULE_LOADING": "EAGER"}
    not_code = {
        "CUDA_CACHE_PATH": "/node2/nv", "CUDA_CACHE_MAXSIZE": "4294967296", "CUDA_CACHE_DISABLE": "0",
        "CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # differ per rank
        "CUDA_LAUNCH_BLOCKING": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "8",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/job1/mps", "CUDA_MPS_LOG_DIRECTORY": "/tmp/job1/log",
    }
    assert _selected(NVIDIA_PLATFORM_NAME, {**code, **not_code, **_UNRELATED}) == code
    # Rank 0 and rank 3 of one job share their entries.
    assert _selected(NVIDIA_PLATFORM_NAME, {"CUDA_VISIBLE_DEVICES": "0"}) == \
        _selected(NVIDIA_PLATFORM_NAME, {"CUDA_VISIBLE_DEVICES": "3"}) == {}


def test_intel_and_pocl_settings_each_stay_in_their_own_key() -> None:
    from asyncclcache.platforms.intel import NAMES as INTEL_CPU_PLATFORM_NAMES
    from asyncclcache.platforms.pocl import NAME as POCL_PLATFORM_NAME

    env = {"CL_CONFIG_CPU_TARGET_ARCH": "corei7", "CL_CONFIG_USE_VECTORIZER": "False",
           "CL_CONFIG_USE_FAST_RELAXED_MATH": "True", "CL_CONFIG_CPU_TBB_NUM_WORKERS": "1",
           "CL_CONFIG_LOG_FILE": "/tmp/log", "POCL_WORK_GROUP_METHOD": "cbs", "POCL_DEBUG": "1",
           "LP_PERF": "x", "CUDA_FORCE_PTX_JIT": "1"}
    for name in INTEL_CPU_PLATFORM_NAMES:
        assert _selected(name, env) == {"CL_CONFIG_CPU_TARGET_ARCH": "corei7", "CL_CONFIG_USE_VECTORIZER": "False",
                                        "CL_CONFIG_USE_FAST_RELAXED_MATH": "True"}
    assert _selected(POCL_PLATFORM_NAME, env) == {"POCL_WORK_GROUP_METHOD": "cbs"}


def test_the_host_cpu_is_unknown_where_the_system_does_not_say(monkeypatch: Any) -> None:
    # macOS has no /proc/cpuinfo: the probe says nothing, the key says "unknown".
    import asyncclcache.keys as keys
    from asyncclcache import system

    here = keys.host_cpu_features.__wrapped__()
    assert here != "unknown" and len(here) == 32  # this machine has /proc
    monkeypatch.setattr(system, "cpu_description", lambda: None)
    assert keys.host_cpu_features.__wrapped__() == "unknown"
    monkeypatch.setattr(system, "cpu_description", lambda: b"flags : sse2\nflags : avx2\n")
    assert keys.host_cpu_features.__wrapped__() not in ("unknown", here)


def test_pocls_jit_is_in_the_key_with_the_layout_it_writes() -> None:
    # pocl main's JIT writes <kernel>.so.o into a variant (another layout, another code path):
    # POCL_CPU_JIT is not among the settings that cannot change code, so it is in the key.
    from asyncclcache.platforms import pocl

    assert "POCL_CPU_JIT" not in pocl.NOT_CODE
    assert _selected(pocl.NAME, {"POCL_CPU_JIT": "1", "POCL_DEBUG": "all"}) == {"POCL_CPU_JIT": "1"}
    for name in ("k.so", "k.so.o"):
        assert pocl.LAYOUT.valid(f"AB/{'C' * 38}/k/64-1-1-goffs0-smallgrid/{name}")
    assert not pocl.LAYOUT.valid(f"AB/{'C' * 38}/../x") and not pocl.LAYOUT.valid(f"AB/{'C' * 38}")


# }}}


# {{{ issue 35: a repeated build's key is made once, and made again when any input changes


def test_a_repeat_takes_the_key_made_before_until_an_input_changes(
    cl_ctx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_key(SOURCE, OPTIONS, cl_ctx.devices, [])
    assert make_key(SOURCE, OPTIONS, cl_ctx.devices, []) is first  # nothing hashed again
    monkeypatch.setenv("POCL_WORK_GROUP_SPECIALIZATION", "0")  # changes pocl's code
    assert make_key(SOURCE, OPTIONS, cl_ctx.devices, []).key != first.key
    monkeypatch.delenv("POCL_WORK_GROUP_SPECIALIZATION")
    assert make_key(SOURCE, OPTIONS, cl_ctx.devices, []).key == first.key
    monkeypatch.setenv("ASYNCCLCACHE_UNRELATED", "1")  # any change drops what was made
    again = make_key(SOURCE, OPTIONS, cl_ctx.devices, [])
    assert again is not first and again == first
    assert make_key(SOURCE, b"-DFOO=2", cl_ctx.devices, []).key != first.key


def test_a_repeat_looks_up_its_includes_again(
    cl_ctx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    early, late = tmp_path / "early", tmp_path / "late"
    early.mkdir()
    late.mkdir()
    (late / "hdr.h").write_text("#define SCALE 2.0f\n")
    path = [str(early), str(late)]
    first = make_key(INCLUDING, OPTIONS, cl_ctx.devices, path)
    assert make_key(INCLUDING, OPTIONS, cl_ctx.devices, path) is first
    # A header of that name appears earlier on the path: the compiler takes that one now.
    (early / "hdr.h").write_text("#define SCALE 2.0f\n")
    shadowed = make_key(INCLUDING, OPTIONS, cl_ctx.devices, path)
    assert [d.path for d in shadowed.deps] == [os.path.realpath(early / "hdr.h")]
    assert shadowed.key != first.key
    assert make_key(INCLUDING, OPTIONS, cl_ctx.devices, path) is shadowed  # kept in its place
    (early / "hdr.h").unlink()
    (late / "hdr.h").unlink()  # gone: uncacheable, not the key made before
    assert make_key(INCLUDING, OPTIONS, cl_ctx.devices, path).uncertain is not None
    # Relative folders: the same text names another folder after a chdir.
    for d in (early, late):
        (d / "hdr.h").write_text(f"#define SCALE {d.name!r}\n".replace("'", '"'))
    monkeypatch.chdir(early)
    here = make_key(INCLUDING, OPTIONS, cl_ctx.devices, ["."])
    monkeypatch.chdir(late)
    there = make_key(INCLUDING, OPTIONS, cl_ctx.devices, ["."])
    assert here.key != there.key and [d.path for d in there.deps] == [os.path.realpath(late / "hdr.h")]


def test_a_setting_changed_where_the_driver_reads_it_changes_the_key(cl_ctx: Any) -> None:
    # Issue 40: os.putenv and a C library's setenv change what pocl's getenv reads, not
    # os.environ; the key (made or taken again) follows what pocl reads.
    import ctypes

    libc = ctypes.CDLL(None)
    first = make_key(SOURCE, OPTIONS, cl_ctx.devices, [])
    assert "POCL_WORK_GROUP_SPECIALIZATION" not in os.environ
    try:
        os.putenv("POCL_WORK_GROUP_SPECIALIZATION", "0")
        putenv = make_key(SOURCE, OPTIONS, cl_ctx.devices, [])
        assert putenv.key != first.key
        assert make_key(SOURCE, OPTIONS, cl_ctx.devices, []) is putenv  # taken again while unchanged
        assert libc.setenv(b"POCL_WORK_GROUP_SPECIALIZATION", b"1", 1) == 0  # C, in place of the value
        setenv = make_key(SOURCE, OPTIONS, cl_ctx.devices, [])
        assert setenv.key not in (first.key, putenv.key)
    finally:
        os.unsetenv("POCL_WORK_GROUP_SPECIALIZATION")
    assert make_key(SOURCE, OPTIONS, cl_ctx.devices, []).key == first.key


def test_the_environment_read_where_the_c_library_keeps_it_falls_back_to_os_environ(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncclcache import system

    assert system.process_environ()["POCL_CACHE_DIR"] == os.environ["POCL_CACHE_DIR"]
    stamp = system.environ_stamp()
    assert system.environ_stamp() == stamp
    os.putenv("ACC_TEST_PUTENV", "1")
    try:
        assert system.environ_stamp() != stamp and system.process_environ()["ACC_TEST_PUTENV"] == "1"
    finally:
        os.unsetenv("ACC_TEST_PUTENV")
    assert "ACC_TEST_PUTENV" not in system.process_environ() and system.environ_stamp() == stamp

    class Unreadable:  # what a C library without a readable environ gives
        available = False

    monkeypatch.setattr(system, "_c_environ", Unreadable())
    assert system.process_environ() is os.environ
    before = system.environ_stamp()
    monkeypatch.setenv("ACC_TEST_SETENV", "1")
    assert system.environ_stamp() != before


def test_only_settings_the_environment_decides_let_a_key_be_taken_again() -> None:
    from asyncclcache.platforms import intel, mesa, nvidia, pocl, pocl_cuda

    assert pocl.SETTINGS.from_environment and mesa.SETTINGS.from_environment
    assert nvidia.SETTINGS.from_environment
    assert intel.SETTINGS.from_environment  # its cl.cfg is read once, at its start (F23)
    assert not pocl_cuda.SETTINGS.from_environment  # libdevice is a file, read at every build


# }}}


def test_a_source_that_includes_nothing_resolves_no_folder(tmp_path: Path, monkeypatch) -> None:
    # Every build asks: a realpath is an lstat a component of pocl's cache directory, often
    # on a network home directory. Only a source with an include looks in that folder.
    from asyncclcache import keys

    (tmp_path / "h.h").write_text("#define TWO 2\n")
    resolved: list[str] = []
    real = keys.os.path.realpath
    monkeypatch.setattr(keys.os.path, "realpath", lambda p, *a, **k: resolved.append(str(p)) or real(p, *a, **k))
    none = keys.include_deps(keys._scan(b"__kernel void f() {}"), b"", [], str(tmp_path), source_dir=str(tmp_path))
    assert none == ((), None) and str(tmp_path) not in resolved
    one = keys.include_deps(keys._scan(b'#include "h.h"\n__kernel void f() {}'), b"", [], str(tmp_path),
                            source_dir=str(tmp_path))
    assert one[1] is None and [d.path for d in one[0]] == [str(tmp_path / "h.h")] and str(tmp_path) in resolved
