"""Includes resolved as pocl's clang resolves them (issue 18): never a stale header.

Every scenario builds through the cache in a child (a new node, its own POCL_CACHE_DIR),
edits a header, and builds again in another child: the cached program must give what
pyopencl gives (the new value), or the program must be uncacheable. ``thread`` entries
are binaries, so a wrong hit there is a wrong result; ``kcache`` entries are pocl's own
folders, so a wrong key shows as a hit that pocl cannot use.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from conftest import child_json, run_child

# Builds the source in argv[2] (a file, read byte-exact) with the options in argv[4]
# through acc.Cache(argv[1], strategy=argv[3]), then with plain pyopencl; prints both values.
CHILD = r"""
import json, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
cache_dir, src_file, strategy, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
with open(src_file, newline="") as f:
    src = f.read()
ctx = pocl_context(); q = cl.CommandQueue(ctx)
def value(prg):
    c = np.zeros(1, np.int32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
    prg.f(q, (1,), None, cd); cl.enqueue_copy(q, c, cd); q.finish()
    return int(c[0])
cache = acc.Cache(cache_dir, strategy=strategy)
prg = acc.Program(ctx, src, cache=cache).build(options=options)
if strategy == "thread":
    assert cache.flush(60)  # the binary query before the launch: never beside one on pocl (F13)
got = value(prg)
assert cache.flush(60)
truth = value(cl.Program(ctx, src).build(options=options))
print(json.dumps({"value": got, "truth": truth, "key": prg.cache_key, "stats": cache.stats().as_dict()}))
"""

KERNEL = b"__kernel void f(__global int *c) { c[0] = V; }\n"


def build(
    tmp: Path, source: bytes, strategy: str, options: tuple[str, ...] = (),
    pocl_cache: Path | None = None,
) -> Any:
    """Build ``source`` in a child (cwd: the test's) through the cache in ``tmp/acc``."""
    src_file = tmp / f"src-{uuid.uuid4().hex}.cl"
    src_file.write_bytes(source)
    out = child_json(run_child(CHILD, str(tmp / "acc"), str(src_file), strategy,
                               json.dumps(list(options)), pocl_cache=pocl_cache))
    assert out["value"] == out["truth"], out  # never other than what pocl computes
    return out


@pytest.mark.parametrize("strategy", ["kcache", "thread"])
def test_nested_quote_include_is_looked_up_in_the_includers_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "inc" / "b.h").write_text("#define V 20\n")
    (tmp_path / "b.h").write_text("#define V 10\n")  # on the path too ("."), but clang takes inc/b.h
    source = b'#include "a.h"\n' + KERNEL
    first = build(tmp_path, source, strategy, ("-I", "inc"))
    assert first["value"] == 20
    (tmp_path / "inc" / "b.h").write_text("#define V 30\n")
    second = build(tmp_path, source, strategy, ("-I", "inc"))
    assert second["value"] == 30
    assert second["key"] != first["key"] and second["stats"]["hits"] == 0
    third = build(tmp_path, source, strategy, ("-I", "inc"))  # still cached
    assert (third["value"], third["key"], third["stats"]["hits"]) == (30, second["key"], 1)


@pytest.mark.parametrize("strategy", ["kcache", "thread"])
def test_header_in_pocls_cache_dir_shadows_the_working_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    # pocl compiles its copy of the source in POCL_CACHE_DIR: clang looks there first.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.h").write_text("#define V 10\n")
    source = b'#include "h.h"\n' + KERNEL
    first = build(tmp_path, source, strategy, pocl_cache=tmp_path / "pocl-1")
    assert first["value"] == 10
    shadowing = tmp_path / "pocl-2"
    shadowing.mkdir()
    (shadowing / "h.h").write_text("#define V 30\n")
    second = build(tmp_path, source, strategy, pocl_cache=shadowing)
    assert second["value"] == 30
    assert second["stats"]["hits"] == 0
    assert second["stats"]["uncacheable"] == 1 or second["key"] != first["key"]


SPELLINGS = {
    "digraph": b'%:include "h.h"\n',
    "trigraph": b'??=include "h.h"\n',
    "continuation-crlf": b'#inc\\\r\nlude "h.h"\r\n',
    "continuation-spaces": b'#inc\\ \t \nlude "h.h"\n',
    "continuation-trigraph": b'#inc??/\nlude "h.h"\n',
    "lone-cr": b'// line ends: CR only\r#include "h.h"\r',
    "include_next": b'#include_next "h.h"\n',
    "import": b'#import "h.h"\n',
}
UNCACHEABLE = {"include_next", "import"}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_include_spelling_never_serves_a_stale_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.h").write_text("#define V 10\n")
    source = SPELLINGS[spelling] + KERNEL
    first = build(tmp_path, source, "thread")
    assert first["value"] == 10
    (tmp_path / "h.h").write_text("#define V 30\n")
    second = build(tmp_path, source, "thread")
    assert second["value"] == 30 and second["stats"]["hits"] == 0
    if spelling in UNCACHEABLE:
        assert first["stats"]["uncacheable"] == second["stats"]["uncacheable"] == 1
    else:  # understood: cached, and the edit changed the key
        assert second["stats"]["uncacheable"] == 0 and second["key"] != first["key"]


@pytest.mark.parametrize("operator", ["__has_include", "__has_include_next"])
def test_has_include_is_uncacheable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operator: str
) -> None:
    # The file appearing changes the code: no key can know it was absent.
    monkeypatch.chdir(tmp_path)
    source = (f'#if {operator}("opt.h")\n#define V 2\n#else\n#define V 1\n#endif\n').encode() + KERNEL
    first = build(tmp_path, source, "thread")
    assert (first["value"], first["stats"]["uncacheable"]) == (1, 1)
    (tmp_path / "opt.h").write_text("\n")
    second = build(tmp_path, source, "thread")
    assert (second["value"], second["stats"]["uncacheable"], second["stats"]["hits"]) == (2, 1, 0)
