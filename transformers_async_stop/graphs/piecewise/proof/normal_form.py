"""A function's source up to its model family's name: the form in which transformers' modular copies are one.

transformers writes most model families as copies of another's code (`modular_*.py` -> `modeling_*.py`): Olmo's
decoder layer is Llama's with `Llama` renamed `Olmo`. `normal_digest` hashes a function's syntax tree with its
docstring and annotations dropped and the family's class prefix (`Olmo`, `Llama`) replaced by one placeholder, so
that such a copy has the digest of the function it was copied from. `read_digests` gives the normal digests of every
source read by hand (`targets/piecewise_rows.py`) whose installed digest is one that was read: a function with one of
those is that read code, under another family's names. What the names refer to (`self.mlp`'s class, the module's
`apply_rotary_pos_emb`) is proven on its own: every function a recording runs is (`verdict.py`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import linecache
import re

from ....release_checks.verified import matches, resolve_source, sources_of

PLACEHOLDER = "\N{SECTION SIGN}"


@functools.lru_cache(maxsize=256)
def module_tree(filename: str, size: int):
    """The parsed file (`size`: its length in lines, so an edited file is parsed again)."""
    return ast.parse("".join(linecache.getlines(filename)), filename)


def _strip(node: ast.AST) -> ast.AST:
    """Docstrings and annotations dropped (neither changes what runs); a copy, the cached tree untouched."""
    node = _copy(node)
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            item.returns = None
            arguments = item.args
            for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                        *(a for a in (arguments.vararg, arguments.kwarg) if a is not None)):
                arg.annotation = None
            body = item.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
                    body[0].value.value, str):
                item.body = body[1:] or [ast.Pass()]
    return node


def _copy(node):
    import copy

    return copy.deepcopy(node)


_DIGESTS: dict = {}  # (node, prefix) -> digest (nodes of the cached trees: a file edited is parsed anew)


def normal_digest(node: ast.AST, prefix: str | None) -> str:
    key = (id(node), prefix)
    found = _DIGESTS.get(key)
    if found is not None and found[0] is node:
        return found[1]
    digest = _normal_digest(node, prefix)
    _DIGESTS[key] = (node, digest)
    return digest


def _normal_digest(node: ast.AST, prefix: str | None) -> str:
    text = ast.dump(_strip(node), annotate_fields=False, include_attributes=False)
    if prefix:
        text = re.sub(r"\b" + re.escape(prefix) + r"(?=[A-Z_]|\b)", PLACEHOLDER, text)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def function_node(function):
    """The `FunctionDef` of a function's code, from its file's tree."""
    function = getattr(function, "__func__", function)
    while getattr(function, "__wrapped__", None) is not None:
        function = function.__wrapped__
    if isinstance(function, property):
        function = function.fget
    code = getattr(function, "__code__", None)
    return None if code is None else def_at(code.co_filename, code.co_firstlineno)


def def_at(filename: str, line: int):
    """The innermost function definition of `filename` that contains `line` (its decorators included), or None."""
    lines = linecache.getlines(filename)
    if not lines:
        return None
    return _def_at(filename, len(lines), line)


@functools.lru_cache(maxsize=8192)
def _def_at(filename: str, size: int, line: int):
    best = None
    for node in _definitions(filename, size):
        if _start(node) <= line <= node.end_lineno and (best is None or _start(node) >= _start(best)):
            best = node
    return best


@functools.lru_cache(maxsize=256)
def _definitions(filename: str, size: int) -> tuple:
    return tuple(node for node in ast.walk(module_tree(filename, size))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def outer_name(filename: str, line: int) -> str | None:
    """The qualified name of the module-level function or class method of `filename` that contains `line` (a nested
    wrapper's outermost definition: `capture_outputs` for its `wrapper`), or None."""
    lines = linecache.getlines(filename)
    if not lines:
        return None
    for node in module_tree(filename, len(lines)).body:
        members = [(f"{node.name}.", item) for item in node.body] if isinstance(node, ast.ClassDef) else [("", node)]
        for prefix, item in members:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _start(item) <= line <= item.end_lineno:
                return prefix + item.name
    return None


def _start(node) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def family_prefix(causal_lm: str) -> str:
    """`OlmoForCausalLM` -> `Olmo`; GPT-2's `GPT2LMHeadModel` -> `GPT2`."""
    for suffix in ("ForCausalLM", "LMHeadModel"):
        if causal_lm.endswith(suffix):
            return causal_lm[: -len(suffix)]
    return causal_lm


_READ: dict = {}


def read_digests(families) -> frozenset:
    """The normal digests of the hand-read sources of `families` (`family.FAMILIES` values) whose installed
    sources are the ones read (`verified.matches`), remembered per set of such families."""
    names = tuple(sorted(f.name for f in families if matches(f"piecewise forward ({f.name})")))
    found = _READ.get(names)
    if found is None:
        digests = set()
        by_name = {f.name: f for f in families}
        for name in names:
            family = by_name[name]
            for source in sources_of(f"piecewise forward ({name})"):
                try:
                    function = resolve_source(source)[0]
                except (ImportError, AttributeError):
                    continue
                node = _own_node(function)
                if node is not None:
                    module = source.partition(":")[0]
                    digests.add(normal_digest(node, family_prefix(family.causal_lm)
                                              if module == family.module else None))
        found = _READ[names] = frozenset(digests)
    return found


def _own_node(function):
    """The `FunctionDef` of a read source, parsed from its own source (the same normal digest as from its file's
    tree, which `def_at` walks: positions are not part of it), without parsing the whole file."""
    import inspect
    import textwrap

    function = getattr(function, "__func__", function)
    while getattr(function, "__wrapped__", None) is not None:
        function = function.__wrapped__
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
