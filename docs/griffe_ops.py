"""A griffe extension for the API reference (mkdocs.yml loads it): the public methods of
the managers are flows bound by ``lookup = op(lookup_flow)`` in ``CacheEngine``'s body
(``zerda_cache/storage/driver.py``), which static analysis sees as attributes. Each such
attribute is documented as the method it is: the flow's signature and docstring under
the public name, returning what the flow yields back (``Flow[T]`` is shown as ``T``).

It also reads a ``Raises:`` entry that names several errors over more than one line
(``A, B,`` then ``C: why``) as one entry, which Google style writes on one line: the
reference shows the docstrings of zerda_cache as they are, without a warning."""

from __future__ import annotations

import re
from typing import Any

import griffe

#: In a ``Raises:`` section: a line that only lists errors and goes on on the next line.
_CONTINUED_TYPES = re.compile(r"^(\s+)((?:[A-Z]\w*, )*[A-Z]\w*,)\n\s+(?=[A-Z]\w*[,:])", re.M)


def join_listed_errors(docstring: griffe.Docstring | None) -> None:
    if docstring is None or "Raises:" not in docstring.value:
        return
    head, raises = docstring.value.split("Raises:", 1)
    docstring.value = head + "Raises:" + _CONTINUED_TYPES.sub(r"\1\2 ", raises)


class OpMethods(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        join_listed_errors(func.docstring)

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        for name, member in list(cls.members.items()):
            if member.is_alias or not isinstance(member, griffe.Attribute):
                continue
            value = member.value
            if not (isinstance(value, griffe.ExprCall) and str(value.function) == "op"):
                continue
            flow = cls.members.get(str(value.arguments[0]))
            if not isinstance(flow, griffe.Function):
                continue
            returns = flow.returns
            if isinstance(returns, griffe.ExprSubscript) and str(returns.left) == "Flow":
                returns = returns.slice
            method = griffe.Function(
                name,
                lineno=flow.lineno,
                endlineno=flow.endlineno,
                parameters=flow.parameters,
                returns=returns,
                docstring=flow.docstring,
            )
            method.labels |= {"method"}
            cls.set_member(name, method)
