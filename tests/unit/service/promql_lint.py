"""A small PromQL reader for checking the deploy files' queries against the metrics the
router and the plugin really export (test_service_deploy_queries.py).

It parses the subset the deploy files use (selectors with matchers and ranges, function
calls, aggregations with ``by``/``without``, binary operators with ``on``/``ignoring``/
``group_*`` and ``bool``) and walks the tree once, reporting:

- a label matched, grouped by, kept, dropped or read (label_replace, legends) that the
  series at that point cannot have;
- a matcher whose value (or regex alternative) the label never takes, where the label's
  values are a bounded set known in code;
- rate/increase over anything but a counter or a histogram's _bucket/_sum/_count, and a
  counter or histogram series used raw (its value only grows: a threshold on it is met
  once and forever, or never);
- histogram_quantile over anything but _bucket series with ``le`` kept;
- a vector-vector operation that can never match (label sets differ, or a label both
  sides keep is fixed to different values): an alert on it never fires;
- an aggregation that sums across a label whose values count different things
  (``Catalog.must_split``) without selecting one.

promtool is not a dependency: where it is installed the test runs it as well.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|==|!=|>=|<=|[-+*/%^<>=(){},])
""", re.X)
_PRECEDENCE = [{"or"}, {"and", "unless"}, {"==", "!=", ">", "<", ">=", "<="},
               {"+", "-"}, {"*", "/", "%"}, {"^"}]
_COMPARISONS = _PRECEDENCE[2]
_AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "group",
                 "topk", "bottomk", "quantile", "count_values"}
_COUNTER_FUNCTIONS = {"rate", "increase", "irate", "resets"}
_RANGE_FUNCTIONS = _COUNTER_FUNCTIONS | {"delta", "idelta", "deriv", "predict_linear",
                                         "changes"} | {
    f"{agg}_over_time" for agg in ("avg", "min", "max", "sum", "count", "last", "quantile",
                                   "stddev", "stdvar", "present", "absent")}
# Labels Prometheus itself adds to every scraped series (its target's).
TARGET_LABELS = frozenset({"instance", "job"})


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)
    range: str | None = None


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple


@dataclass(frozen=True)
class Aggregation:
    op: str
    grouping: str | None  # "by", "without" or None
    labels: tuple[str, ...]
    args: tuple


@dataclass(frozen=True)
class Binary:
    op: str
    lhs: object
    rhs: object
    matching: str | None = None  # "on", "ignoring" or None
    labels: tuple[str, ...] = ()
    group: str | None = None  # "group_left", "group_right" or None


class ParseError(ValueError):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ParseError(f"cannot read {text[pos:pos + 20]!r}")
        pos = match.end()
        if match.lastgroup != "ws":
            out.append((match.lastgroup, match.group()))
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.i >= len(self.toks):
            raise ParseError(f"ran out, expected {expected}")
        tok = self.toks[self.i]
        if expected is not None and tok[1] != expected:
            raise ParseError(f"expected {expected!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def labels(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take()[1])
            if self.peek() == ",":
                self.take(",")
        self.take(")")
        return tuple(names)

    def expr(self, level: int = 0):
        if level == len(_PRECEDENCE):
            return self.unary()
        lhs = self.expr(level + 1)
        while self.peek() in _PRECEDENCE[level]:
            op = self.take()[1]
            if self.peek() == "bool":
                self.take()
                op += " bool"
            matching, labels, group = None, (), None
            if self.peek() in ("on", "ignoring"):
                matching, labels = self.take()[1], self.labels()
            if self.peek() in ("group_left", "group_right"):
                group = self.take()[1]
                if self.peek() == "(":
                    self.labels()
            rhs = self.expr(level + 1) if op != "^" else self.expr(level)
            lhs = Binary(op, lhs, rhs, matching, labels, group)
        return lhs

    def unary(self):
        if self.peek() in ("-", "+"):
            sign = self.take()[1]
            return Binary("*", -1.0 if sign == "-" else 1.0, self.unary())
        return self.primary()

    def primary(self):
        kind, value = self.take()
        if kind == "number":
            return float(value)
        if kind == "string":
            return value[1:-1].encode().decode("unicode_escape")
        if value == "(":
            inner = self.expr()
            self.take(")")
            return inner
        if kind != "ident":
            raise ParseError(f"unexpected {value!r}")
        if value in _AGGREGATIONS:
            grouping, labels = None, ()
            if self.peek() in ("by", "without"):
                grouping, labels = self.take()[1], self.labels()
            args = self.args()
            if self.peek() in ("by", "without"):
                grouping, labels = self.take()[1], self.labels()
            return Aggregation(value, grouping, labels, args)
        if self.peek() == "(":
            return Call(value, self.args())
        return self.selector(value)

    def args(self) -> tuple:
        self.take("(")
        out = []
        while self.peek() != ")":
            out.append(self.expr())
            if self.peek() == ",":
                self.take(",")
        self.take(")")
        return tuple(out)

    def selector(self, name: str) -> Selector:
        matchers = []
        if self.peek() == "{":
            self.take("{")
            while self.peek() != "}":
                label = self.take()[1]
                op = self.take()[1]
                if op not in ("=", "!=", "=~", "!~"):
                    raise ParseError(f"bad matcher op {op!r}")
                kind, raw = self.take()
                if kind != "string":
                    raise ParseError(f"matcher value {raw!r} is not a string")
                matchers.append((label, op, raw[1:-1].encode().decode("unicode_escape")))
                if self.peek() == ",":
                    self.take(",")
            self.take("}")
        rng = None
        if self.i < len(self.toks) and self.toks[self.i][0] == "range":
            rng = self.take()[1][1:-1]
        return Selector(name, tuple(matchers), rng)


def parse(text: str):
    parser = _Parser(text)
    tree = parser.expr()
    if parser.i != len(parser.toks):
        raise ParseError(f"trailing {parser.toks[parser.i][1]!r}")
    return tree


@dataclass(frozen=True)
class Metric:
    """One series name as a query sees it: its type (counter, gauge, histogram: the
    _bucket/_sum/_count of a histogram; counter: a _total or a histogram's _sum/_count
    for rate), its labels (the target's not included) and, for labels with a bounded
    set of values known in code, a predicate saying whether a value can occur."""

    kind: str  # "counter", "gauge" or "bucket"
    labels: frozenset[str]
    values: dict[str, Callable[[str], bool]] = field(default_factory=dict)


@dataclass
class Catalog:
    metrics: dict[str, Metric]
    # Labels whose values count different things: summing across them means nothing,
    # so an aggregation must keep them or the selector must pick one value.
    must_split: dict[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Info:
    """What the walk knows of a subexpression's result: None labels for a scalar."""

    labels: frozenset[str] | None
    fixed: dict[str, str] = field(default_factory=dict)  # label -> its only value
    split: frozenset[str] = frozenset()  # must-split labels still unselected
    buckets: bool = False  # holds only histogram _bucket series
    counter_raw: bool = False  # a counter's raw value


_SCALAR = Info(None)


class Linter:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.errors: list[str] = []

    def check(self, text: str) -> Info:
        """Walk ``text``; problems go to ``self.errors``. A counter left raw at the top
        (a stat of the total) is an error too: every counter here restarts at 0 with
        its process, so its raw value says nothing an operator can act on."""
        info = self.walk(parse(text))
        if info.counter_raw:
            self.errors.append("a counter's raw value is the result (use rate/increase)")
        return info

    def walk(self, node) -> Info:
        if isinstance(node, (float, str)):
            return _SCALAR
        if isinstance(node, Selector):
            return self.selector(node, in_range_function=False)
        if isinstance(node, Aggregation):
            return self.aggregation(node)
        if isinstance(node, Call):
            return self.call(node)
        return self.binary(node)

    def selector(self, node: Selector, in_range_function: bool) -> Info:
        metric = self.catalog.metrics.get(node.name)
        if metric is None:
            self.errors.append(f"{node.name}: no such metric")
            return Info(frozenset(TARGET_LABELS))
        if node.range is not None and not in_range_function:
            self.errors.append(f"{node.name}[{node.range}]: a range outside a function")
        labels = metric.labels | TARGET_LABELS
        fixed = {}
        for label, op, value in node.matchers:
            self.matcher(node.name, metric, labels, label, op, value)
            if op == "=":
                fixed[label] = value
        split = self.catalog.must_split.get(node.name, frozenset()) - set(fixed)
        return Info(labels | {"le"} if metric.kind == "bucket" else labels, fixed, split,
                    buckets=metric.kind == "bucket",
                    counter_raw=metric.kind in ("counter", "bucket") and not in_range_function)

    def matcher(self, name: str, metric: Metric, labels: frozenset[str], label: str,
                op: str, value: str) -> None:
        if label not in labels | {"le", "__name__"}:
            self.errors.append(f"{name}{{{label}{op}...}}: {name} has no label {label!r} "
                               f"(it has {sorted(labels)})")
            return
        known = metric.values.get(label)
        if known is None:
            return
        if op in ("=", "!="):
            if not known(value):
                self.errors.append(f"{name}{{{label}{op}{value!r}}}: {label} never takes "
                                   f"{value!r}")
            return
        for alternative in _alternatives(value):
            if not known_regex(known, alternative):
                self.errors.append(f"{name}{{{label}{op}{value!r}}}: {alternative!r} "
                                   f"matches no value {label} takes")

    def aggregation(self, node: Aggregation) -> Info:
        *params, arg = node.args
        for param in params:
            self.walk(param)
        info = self.walk(arg)
        if info.labels is None:
            self.errors.append(f"{node.op}() over a scalar")
            return _SCALAR
        if info.counter_raw:
            self.errors.append(f"{node.op}() over a counter's raw value (use rate/increase)")
        for label in node.labels:
            if label not in info.labels:
                self.errors.append(f"{node.op} {node.grouping} ({label}): the series have "
                                   f"no label {label!r} (they have {sorted(info.labels)})")
        if node.grouping == "by":
            kept = frozenset(node.labels)
        elif node.grouping == "without":
            kept = info.labels - set(node.labels)
        else:
            kept = frozenset()
        if node.op == "count_values":
            kept |= {params[0]} if params and isinstance(params[0], str) else set()
        lost = info.split - kept
        if lost:
            self.errors.append(f"{node.op}() adds up {sorted(lost)} (values that count "
                               "different things): keep it in by (...) or select one")
        return Info(kept, {k: v for k, v in info.fixed.items() if k in kept},
                    info.split & kept, buckets=info.buckets and "le" in kept)

    def call(self, node: Call) -> Info:
        func, args = node.func, node.args
        if func in _RANGE_FUNCTIONS:
            (arg,) = [a for a in args if isinstance(a, Selector)] or [None]
            if arg is None or arg.range is None:
                self.errors.append(f"{func}() needs a range selector")
                return Info(frozenset())
            info = self.selector(arg, in_range_function=True)
            metric = self.catalog.metrics.get(arg.name)
            if func in _COUNTER_FUNCTIONS and metric is not None and metric.kind == "gauge":
                self.errors.append(f"{func}({arg.name}): {arg.name} is a gauge, not a counter")
            return Info(info.labels, info.fixed, info.split, info.buckets)
        infos = [self.walk(a) for a in args]
        if func == "histogram_quantile":
            inner = infos[1]
            if not inner.buckets:
                self.errors.append("histogram_quantile over series that are not all "
                                   "_bucket with le kept")
            labels = inner.labels - {"le"} if inner.labels is not None else None
            return Info(labels, inner.fixed, inner.split)
        if func == "label_replace":
            inner, dst, replacement, src = infos[0], args[1], args[2], args[3]
            if src and inner.labels is not None and src not in inner.labels:
                self.errors.append(f"label_replace reads {src!r}, which the series lack")
            fixed = dict(inner.fixed)
            if "$" in replacement:
                fixed.pop(dst, None)
            else:
                fixed[dst] = replacement
            return Info((inner.labels or frozenset()) | {dst}, fixed, inner.split,
                        inner.buckets, inner.counter_raw)
        if func == "vector":
            return Info(frozenset())
        if func in ("scalar", "time"):
            return _SCALAR
        vectors = [i for i in infos if i.labels is not None]
        return vectors[0] if vectors else _SCALAR

    def binary(self, node: Binary) -> Info:
        lhs = self.walk(node.lhs) if not isinstance(node.lhs, float) else _SCALAR
        rhs = self.walk(node.rhs)
        if lhs.labels is None or rhs.labels is None:
            vector = rhs if lhs.labels is None else lhs
            if vector.counter_raw and node.op in _COMPARISONS:
                self.errors.append(f"a counter's raw value compared ({node.op}): it only "
                                   "grows (use rate/increase)")
            return Info(vector.labels, vector.fixed, vector.split, vector.buckets,
                        vector.counter_raw)
        if lhs.counter_raw or rhs.counter_raw:
            self.errors.append(f"a counter's raw value in {node.op!r} (use rate/increase)")
        for label in node.labels:
            if label not in lhs.labels or label not in rhs.labels:
                self.errors.append(f"{node.op} {node.matching} ({label}): not on both sides")
        if node.op == "or":
            common = {k: v for k, v in lhs.fixed.items() if rhs.fixed.get(k) == v}
            return Info(lhs.labels | rhs.labels, common, lhs.split | rhs.split)
        self.matchable(node, lhs, rhs)
        if node.op in ("and", "unless") or node.op in _COMPARISONS or node.group:
            return lhs
        if node.matching == "on":
            kept = frozenset(node.labels)
        else:
            kept = lhs.labels - set(node.labels)
        return Info(kept, {k: v for k, v in lhs.fixed.items() if k in kept},
                    lhs.split & kept)

    def matchable(self, node: Binary, lhs: Info, rhs: Info) -> None:
        """Vector-vector operands pair series by their labels (all, ``on``'s, or all but
        ``ignoring``'s): with different label sets, or a label both fix to different
        values, no pair ever forms and the result is always empty."""
        if node.matching == "on":
            keys = frozenset(node.labels)
        else:
            keys_l = lhs.labels - set(node.labels)
            keys_r = rhs.labels - set(node.labels)
            if keys_l != keys_r and node.group is None:
                self.errors.append(f"{node.op!r} never matches: label sets differ "
                                   f"({sorted(keys_l ^ keys_r)}); use on/ignoring")
            keys = keys_l & keys_r
        for label in sorted(keys):
            if label in lhs.fixed and label in rhs.fixed and lhs.fixed[label] != rhs.fixed[label]:
                self.errors.append(f"{node.op!r} never matches: {label} is "
                                   f"{lhs.fixed[label]!r} on one side and "
                                   f"{rhs.fixed[label]!r} on the other; use ignoring ({label})")


def _alternatives(regex: str) -> list[str]:
    """The top-level ``|`` alternatives of ``regex`` (each must match some value)."""
    out, depth, start = [], 0, 0
    for i, char in enumerate(regex):
        if char == "\\":
            continue
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "|" and depth == 0 and (i == 0 or regex[i - 1] != "\\"):
            out.append(regex[start:i])
            start = i + 1
    out.append(regex[start:])
    return out


def known_regex(known: Callable[[str], bool], regex: str) -> bool:
    """Whether ``regex`` (anchored, as Prometheus anchors it) matches a value ``known``
    accepts; ``known`` lists them as ``known.values`` when it can."""
    values = getattr(known, "values", None)
    if values is None:
        return True  # an open set: any regex may match
    return any(re.fullmatch(regex, v) for v in values)


def value_set(values) -> Callable[[str], bool]:
    """A ``Metric.values`` predicate for a finite set."""
    frozen = frozenset(values)

    def known(value: str) -> bool:
        return value in frozen
    known.values = sorted(frozen)  # type: ignore[attr-defined]
    return known


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend))


def template_labels(text: str) -> set[str]:
    """The ``$labels.x`` an alert's annotation reads."""
    return set(re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", text))


def selectors(node) -> list[Selector]:
    """Every series selector in a parsed expression (:func:`parse`)."""
    if isinstance(node, Selector):
        return [node]
    children = [getattr(node, name) for name in ("lhs", "rhs") if hasattr(node, name)]
    children += list(getattr(node, "args", ()))
    return [s for child in children if not isinstance(child, (str, float))
            for s in selectors(child)]


def selected(selector: Selector, series: dict[str, str]) -> bool:
    """Whether ``selector``'s matchers select a series with labels ``series``."""
    def one(op: str, value: str, actual: str) -> bool:
        hit = re.fullmatch(value, actual) is not None if "~" in op else value == actual
        return hit if op in ("=", "=~") else not hit
    return all(one(op, value, series.get(label, "")) for label, op, value in selector.matchers)
