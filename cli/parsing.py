"""The argument parser every `glmrt` command is built on, and the help of flags that set a
config field.

`GlmrtParser` turns off argparse's prefix abbreviations (`--disable-cuda` must not silently mean
`--disable-cuda-graph`) and reports a bad command line in one line, `glmrt up: error: ...`, with
exit status 2 (argparse prints its usage first, burying the line that says what is wrong).
`field_help` reads a config dataclass's field docstrings, so a flag's help is the documentation
of the field it sets, with the field's default.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from typing import NoReturn


class GlmrtParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls`, whitespace folded ({} without source)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_help(cls: type, name: str, text: str | None = None) -> str:
    """`text` (else the field's docstring) with the field's default: "... (default: 64)"."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    doc = text or field_docs(cls).get(name, "")
    return with_default(doc, default)


def with_default(doc: str, default) -> str:
    """A help text ending with its default: "... (default: 64)"."""
    shown = "unset" if default is None else ("off" if default is False else default)
    # argparse expands %-formats in help texts
    return f"{doc} (default: {shown})".replace("%", "%%").strip()


def print_error(prog: str, message: str) -> int:
    """The one-line refusal of command `prog` (exit status 2), argparse's way."""
    print(f"{prog}: error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2
