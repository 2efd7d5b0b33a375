"""What vLLM 0.32 learns from a chat template before rendering it.

Ported from ``vllm/renderers/hf.py`` (Apache-2.0) so the router renders prompts exactly as
the worker does without importing vLLM:

- the *content format*: ``"openai"`` when the template loops over a message's content parts
  (parts stay a list of dicts), else ``"string"`` (text parts are joined with ``"\\n"``);
- whether the template knows the ``developer`` role (if not, developer messages become one
  merged system message);
- the template's undeclared variables, which decide which request kwargs reach it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == varname


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var_access(node.node, varname) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None
                            ) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _assigned_aliases(root: jinja2.nodes.Node, varname: str) -> Iterator[str]:
    yield varname
    pending = deque([varname])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(assign.node, current) and isinstance(
                    assign.target, jinja2.nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_loop_vars(root: jinja2.nodes.Node) -> list[str]:
    messages_names = list(_assigned_aliases(root, "messages"))
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, name) for name in messages_names):
            if isinstance(loop.target, jinja2.nodes.Name):
                out.append(loop.target.name)
    return out


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    message_names = _message_loop_vars(root)
    content_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(
                        _is_var_or_elems_access(arg, name, "content") for name in message_names):
                    content_params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if (isinstance(kwarg, jinja2.nodes.Keyword) and kwarg.key in param_names
                        and any(_is_var_or_elems_access(kwarg.value, name, "content")
                                for name in message_names)):
                    content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                content_params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, name, "content") for name in message_names):
            return True
        params = content_params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name):
            if params is not None and loop.iter.name in params:
                return True
            if id(loop) not in loops_in_macros and loop.iter.name == "content":
                return True
    return False


class _GenerationTag(jinja2.ext.Extension):
    """Parses HF's ``{% generation %}`` tag (only to find the template's variables)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    content_format: str  # "string" | "openai"
    supports_developer_role: bool
    variables: frozenset[str]


def template_traits(chat_template: str) -> TemplateTraits:
    """Analyse a template (parses it: callers cache the result per template)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        ast = env.parse(chat_template)
    except jinja2.TemplateError:
        # vLLM falls back to "string" when the AST cannot be built; so do we.
        return TemplateTraits("string", _developer(chat_template), frozenset())
    content_format = "openai" if _loops_over_content(ast) else "string"
    return TemplateTraits(content_format, _developer(chat_template),
                          frozenset(jinja2.meta.find_undeclared_variables(ast)))


def _developer(chat_template: str) -> bool:
    return '"developer"' in chat_template or "'developer'" in chat_template
