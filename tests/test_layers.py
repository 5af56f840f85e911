"""The interposer's layers (ARCHITECTURE.md, "The interposer in layers"): each module of
`preload/src` imports only modules of its own layer or of layers below it, `unsafe` code
lives only in `sys/`, and no import circle is left (the control thread imports the
connections; nothing below calls up into it). Read from the source text: `crate::` paths, `use`
lists and `super::` paths outside comments and tests."""

import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "preload" / "src"

# From the top down. A module is a file (`relink/` and `shm_sink/` count as one each; the
# files of `sys/` count one by one).
LAYERS = [
    ("entry", {"sys/entry"}),
    ("hooks", {"hooks", "hooks_proc", "lib"}),
    ("sockets", {"fdtable", "ready", "exec", "linger", "setup"}),
    ("glue", {"vc", "relink"}),
    ("devices", {"tcp_sink", "shm_sink", "linkstate"}),
    ("base", {"accepts", "config", "log", "error", "ownfd", "sandbox", "lifetime", "stats",
              "readiness", "agent", "shm", "sockswap", "tap", "tamper", "tickets", "bells"}),
    ("sys", {"sys", "sys/fd", "sys/process", "sys/gate", "sys/shared", "sys/prog", "sys/real",
             "sys/copy", "sys/cell", "sys/packet", "sys/plugin", "sys/splice"}),
]
# No import circle is left: the sinks and the connection report to `linkstate` (below them),
# which the control thread reads, and what only the control thread can do is handed down to
# it at start. Keep it so.
GLUE_CIRCLE = set()


def module_of(path):
    rel = path.relative_to(SRC).with_suffix("").as_posix()
    if rel.endswith("/mod"):
        rel = rel[: -len("/mod")]
    top = rel.split("/")[0]
    return rel if top == "sys" else top


def sources():
    for p in sorted(SRC.rglob("*.rs")):
        text = p.read_text()
        text = text.split("#[cfg(test)]")[0]
        text = re.sub(r"//[^\n]*", "", text)
        yield p, module_of(p), text


def modules():
    return {m for _, m, _ in sources()}


def imports():
    known = modules()
    edges = {}
    for p, m, text in sources():
        out = edges.setdefault(m, set())
        for a, b in re.findall(r"crate::(\w+)(?:::(\w+))?", text):
            target = f"{a}/{b}" if a == "sys" and b and f"{a}/{b}" in known else a
            if a in ("pid", "vforked"):
                target = "sys/process"
            if target in known:
                out.add(target)
        for group in re.findall(r"use crate::\{([^}]*)\}", text):
            for name in re.split(r"[,\s]+", group):
                if name in known:
                    out.add(name)
        if m.startswith("sys/"):
            for b in re.findall(r"super::(\w+)", text):
                out.add(f"sys/{b}" if f"sys/{b}" in known else "sys")
        out.discard(m)
    return edges


def layer_of(m):
    for i, (_, mods) in enumerate(LAYERS):
        if m in mods:
            return i
    raise AssertionError(f"{m} is in no layer: add it to LAYERS (and to ARCHITECTURE.md)")


def test_every_module_has_a_layer():
    for m in modules():
        layer_of(m)


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for m, targets in imports().items():
        for t in targets:
            if layer_of(t) < layer_of(m):
                wrong.append(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(sorted(wrong))


def circles(edges):
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            c = set()
            while True:
                w = stack.pop()
                on.discard(w)
                c.add(w)
                if w == v:
                    break
            if len(c) > 1:
                out.append(c)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    found = circles(imports())
    assert all(c <= GLUE_CIRCLE for c in found), f"import circles: {found}"


def test_unsafe_code_only_in_sys():
    lib = (SRC / "lib.rs").read_text()
    assert "#![deny(unsafe_code)]" in lib
    allowed = re.findall(r"#\[allow\(unsafe_code\)\]\s*pub mod (\w+)", lib)
    assert allowed == ["sys"], allowed
    outside = [str(p.relative_to(SRC)) for p, m, text in sources()
               if not m.startswith("sys") and re.search(r"unsafe\s*(\{|fn|impl|extern)", text)]
    assert not outside, f"unsafe code outside sys/: {outside}"


def test_the_check_sees_an_import_that_runs_up(tmp_path):
    """The checks above can fail: an import of the hooks from the descriptor table is seen
    as running up, and a loop through it as a circle."""
    edges = imports()
    edges["fdtable"] = set(edges["fdtable"]) | {"hooks"}
    assert layer_of("hooks") < layer_of("fdtable")
    assert any("fdtable" in c and "hooks" in c for c in circles(edges))
