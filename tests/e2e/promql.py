"""What a PromQL expression asks of the series: the selectors it reads and the labels it groups
or matches by, so that a test can check each against what Prometheus really scraped.

Prometheus 2.24 (the dev stack's) has no endpoint that returns a query's syntax tree, and its
promtool prints none, so this is a small reader of PromQL's tokens. It knows the language's
shape rather than its meaning: a selector is a metric name not followed by `(`, or `{...}`; an
aggregation's `by`/`without` labels are checked against the selectors inside its parentheses;
`on`/`ignoring`/`group_left`/`group_right` labels against every selector of the parenthesised
expression they sit in (their operands are in there, and a check that some series carries the
label stays true for a wider set). Labels that `label_replace`, `label_join` or `count_values`
create are counted as present. Anything it cannot read is an error naming the place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = frozenset(
    {"sum", "avg", "count", "min", "max", "group", "stddev", "stdvar"}
    | {"topk", "bottomk", "count_values", "quantile"}  # these take a parameter first
)
BINARY_KEYWORDS = frozenset({"and", "or", "unless", "atan2", "bool"})
GROUPING = frozenset({"by", "without"})
MATCHING = frozenset({"on", "ignoring", "group_left", "group_right"})
# Functions that add a label, named by their first string argument.
LABEL_MAKERS = frozenset({"label_replace", "label_join", "count_values"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>(?:\d+(?:ms|y|w|d|h|m|s))+(?![\w:.]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],:@])
    """,
    re.VERBOSE,
)


class PromQLError(ValueError):
    """An expression this reader cannot follow; the message names the place."""


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    at: int


@dataclass(frozen=True)
class Selector:
    """One instant or range selector, as `/api/v1/series` takes it."""

    text: str  # `name{matchers}` as written, without range or offset
    name: str  # "" when the name is not fixed
    # Labels a matcher asks about; `label=""` (asking for its absence) is not among them.
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Grouping:
    clause: str  # e.g. `by (model, code)`
    labels: tuple[str, ...]
    selectors: tuple[Selector, ...]  # the series whose labels these are
    made: frozenset[str] = frozenset()  # labels functions in the same scope create


@dataclass
class Reading:
    selectors: list[Selector] = field(default_factory=list)
    groupings: list[Grouping] = field(default_factory=list)


def tokens(expr: str) -> list[Token]:
    found: list[Token] = []
    at = 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise PromQLError(f"unexpected {expr[at]!r} at {at} in: {expr}")
        kind = match.lastgroup or ""
        if kind != "space":
            found.append(Token(kind, match.group(), at))
        at = match.end()
    return found


def _unquote(text: str) -> str:
    return text[1:-1]


class _Reader:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.toks = tokens(expr)
        self.i = 0
        self.reading = Reading()

    def peek(self, ahead: int = 0) -> Token | None:
        at = self.i + ahead
        return self.toks[at] if at < len(self.toks) else None

    def take(self, text: str | None = None) -> Token:
        tok = self.peek()
        if tok is None:
            raise PromQLError(f"expression ends where {text or 'more'!r} was expected: {self.expr}")
        if text is not None and tok.text != text:
            raise PromQLError(f"expected {text!r} at {tok.at}, found {tok.text!r}: {self.expr}")
        self.i += 1
        return tok

    def fail(self, tok: Token, what: str) -> PromQLError:
        return PromQLError(f"{what} at {tok.at} ({tok.text!r}): {self.expr}")

    # ----- pieces ------------------------------------------------------------------------------

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        labels: list[str] = []
        while True:
            tok = self.take()
            if tok.text == ")":
                return tuple(labels)
            if tok.kind != "ident":
                raise self.fail(tok, "a label name was expected")
            labels.append(tok.text)
            after = self.take()
            if after.text == ")":
                return tuple(labels)
            if after.text != ",":
                raise self.fail(after, "',' or ')' was expected in a label list")

    def matchers(self) -> tuple[str, list[tuple[str, str, str]]]:
        """The `{...}` at the cursor: its text and its (label, op, value) triples."""
        start = self.take("{")
        found: list[tuple[str, str, str]] = []
        while True:
            tok = self.take()
            if tok.text == "}":
                return self.expr[start.at : tok.at + 1], found
            if tok.kind != "ident":
                raise self.fail(tok, "a label name was expected in a selector")
            op = self.take()
            if op.text not in ("=", "!=", "=~", "!~"):
                raise self.fail(op, "a label matcher (=, !=, =~, !~) was expected")
            value = self.take()
            if value.kind != "string":
                raise self.fail(value, "a quoted label value was expected")
            found.append((tok.text, op.text, _unquote(value.text)))
            after = self.take()
            if after.text == "}":
                return self.expr[start.at : after.at + 1], found
            if after.text != ",":
                raise self.fail(after, "',' or '}' was expected in a selector")

    def selector(self, name: Token | None) -> Selector:
        text, name_text = (name.text, name.text) if name else ("", "")
        matched: list[tuple[str, str, str]] = []
        nxt = self.peek()
        if nxt is not None and nxt.text == "{":
            braces, matched = self.matchers()
            text += braces
        for label, op, value in matched:
            if label == "__name__" and op == "=":
                name_text = value
        labels = tuple(
            label for label, op, value in matched if label != "__name__" and (op, value) != ("=", "")
        )
        selector = Selector(text, name_text, labels)
        self.reading.selectors.append(selector)
        return selector

    def suffixes(self) -> None:
        """A range or subquery, `offset` and `@`, after a selector or a parenthesised expression."""
        while (tok := self.peek()) is not None:
            if tok.text == "[":
                self.take("[")
                while self.take().text != "]":
                    pass
            elif tok.text == "offset":
                self.take()
                if (sign := self.peek()) is not None and sign.text == "-":
                    self.take()
                if self.take().kind != "duration":
                    raise self.fail(tok, "a duration was expected after offset")
            elif tok.text == "@":
                self.take()
                nxt = self.take()
                if nxt.kind == "ident":  # start() or end()
                    self.take("(")
                    self.take(")")
            else:
                return

    # ----- expressions -------------------------------------------------------------------------

    def expression(self, stops: frozenset[str]) -> tuple[list[Selector], set[str]]:
        """Read up to a token in `stops` at this depth (or the end): the selectors within, and
        the labels functions within create."""
        before = len(self.reading.selectors)
        made: set[str] = set()
        matching: list[tuple[str, tuple[str, ...]]] = []
        while (tok := self.peek()) is not None and tok.text not in stops:
            self.take()
            nxt = self.peek()
            calls = nxt is not None and nxt.text == "("
            if tok.text == "(":
                made |= self.expression(CLOSE)[1]
                self.take(")")
                self.suffixes()
            elif tok.text == "{":
                self.i -= 1
                self.selector(None)
                self.suffixes()
            elif tok.text in (")", "]", "}", ","):
                raise self.fail(tok, "unbalanced")
            elif tok.kind == "duration":
                raise self.fail(tok, "a duration outside a range or offset")
            elif tok.kind != "ident" or tok.text in BINARY_KEYWORDS or tok.text.lower() in ("inf", "nan"):
                pass  # numbers, strings, operators
            elif tok.text in MATCHING:
                matching.append((tok.text, self.label_list() if calls else ()))
            elif tok.text in AGGREGATIONS and (calls or (nxt is not None and nxt.text in GROUPING)):
                made |= self.aggregation(tok)
            elif tok.text in GROUPING or tok.text == "offset":
                raise self.fail(tok, f"{tok.text!r} out of place")
            elif calls:
                made |= self.arguments(tok.text)[1]
                self.suffixes()
            else:
                self.selector(tok)
                self.suffixes()
        selectors = self.reading.selectors[before:]
        for keyword, labels in matching:
            if labels:
                self.group_by(keyword, labels, selectors, made)
        return selectors, made

    def group_by(
        self, keyword: str, labels: tuple[str, ...], selectors: list[Selector], made: set[str]
    ) -> None:
        clause = f"{keyword} ({', '.join(labels)})"
        self.reading.groupings.append(Grouping(clause, labels, tuple(selectors), frozenset(made)))

    def aggregation(self, op: Token) -> set[str]:
        grouping: tuple[str, tuple[str, ...]] | None = None
        if (nxt := self.peek()) is not None and nxt.text in GROUPING:
            self.take()
            grouping = (nxt.text, self.label_list())
        selectors, made = self.arguments(op.text)
        if (nxt := self.peek()) is not None and nxt.text in GROUPING:
            if grouping is not None:
                raise self.fail(nxt, "a second grouping clause")
            self.take()
            grouping = (nxt.text, self.label_list())
        if grouping is not None:
            self.group_by(*grouping, selectors, made)
        # Only count_values's label outlives the aggregation; the others group labels away.
        return made if op.text == "count_values" else set()

    def arguments(self, fn: str) -> tuple[list[Selector], set[str]]:
        """The parenthesised arguments of `fn`: the selectors in them, and the labels made."""
        self.take("(")
        before = len(self.reading.selectors)
        made: set[str] = set()
        strings: list[str] = []
        while (tok := self.peek()) is not None and tok.text != ")":
            start = self.i
            made |= self.expression(ARGUMENT_END)[1]
            if self.i == start + 1 and self.toks[start].kind == "string":
                strings.append(_unquote(self.toks[start].text))
            if (sep := self.peek()) is not None and sep.text == ",":
                self.take(",")
        self.take(")")
        if fn in LABEL_MAKERS and strings:
            made.add(strings[0])
        return self.reading.selectors[before:], made


CLOSE = frozenset({")"})
ARGUMENT_END = frozenset({",", ")"})


def read(expr: str) -> Reading:
    """The selectors and grouping labels of `expr`; PromQLError when it cannot be read."""
    reader = _Reader(expr)
    if not reader.toks:
        raise PromQLError("an empty expression")
    reader.expression(frozenset())
    if (left := reader.peek()) is not None:
        raise reader.fail(left, "unbalanced")
    return reader.reading
