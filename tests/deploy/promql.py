"""What a PromQL expression refers to, for the deploy tests: its metric names and label names.

Not a PromQL parser: a tokenizer and a walk over the tokens that knows PromQL's lexical rules well
enough to tell metric names from functions, aggregations, keywords, label names (inside `{...}`
and in `by`/`without`/`on`/`ignoring`/`group_left`/`group_right` lists), durations, numbers,
strings and Grafana's `$variables`. Whatever it does not know (a character, an unknown function)
raises ValueError, so that a test fails rather than silently checking less.

`family()` maps a referenced series name to the metric family an exposition declares
(`# TYPE` lines): histograms' `_bucket`, `_sum` and `_count` series belong to their family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Prometheus 2.x and 3.x functions (https://prometheus.io/docs/prometheus/latest/querying/functions/),
# and `start()`/`end()` of the `@` modifier.
FUNCTIONS = frozenset(
    """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp
    clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv double_exponential_smoothing exp floor histogram_avg
    histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar
    histogram_sum holt_winters hour idelta increase info irate label_join label_replace
    last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
    predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh
    sort sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time
    sum_over_time tan tanh time timestamp vector year start end
    """.split()
)
AGGREGATIONS = frozenset(
    "sum avg min max count stddev stdvar topk bottomk quantile count_values group limitk "
    "limit_ratio".split()
)
# Keywords followed by a parenthesised list of label names.
GROUPING = frozenset("by without on ignoring group_left group_right".split())
KEYWORDS = GROUPING | frozenset("bool offset and or unless atan2".split())
NUMBER_WORDS = frozenset(("inf", "nan"))
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}\s]+\}|\$\$?[A-Za-z_][A-Za-z0-9_]*)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)(?![A-Za-z0-9_])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?![A-Za-z0-9_])
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=])
  | (?P<punct>[{}()\[\],@])
    """,
    re.VERBOSE,
)


@dataclass
class Refs:
    """What one expression names."""

    metrics: set[str] = field(default_factory=set)
    # (metric, label) for each matcher in a `{...}` (metric None: a selector with no name).
    selector_labels: set[tuple[str | None, str]] = field(default_factory=set)
    # Labels in by/without/on/ignoring/group_left/group_right lists.
    grouping_labels: set[str] = field(default_factory=set)


def tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) of every token, spaces and comments left out; ValueError on anything else."""
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot tokenize {expr[pos : pos + 20]!r} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind not in ("space", "comment"):
            out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def refs(expr: str) -> Refs:
    """The metric and label names `expr` refers to."""
    toks = tokens(expr)
    found = Refs()
    stack: list[str] = []  # "{", "[", "(" or "group" (a by(...)-style label list)
    selector: str | None = None  # the metric whose `{...}` is open
    for i, (kind, text) in enumerate(toks):
        prev = toks[i - 1] if i > 0 else ("", "")
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        top = stack[-1] if stack else None
        if top == "[":  # a range or subquery: durations, `:`, Grafana variables
            if text == "]":
                stack.pop()
            elif text in "[{(":
                raise ValueError(f"unexpected {text!r} inside [...] in {expr!r}")
            continue
        if top == "{":
            if text == "}":
                stack.pop()
                selector = None
            elif kind == "ident":
                if nxt[1] not in ("=", "!=", "=~", "!~"):
                    raise ValueError(f"label {text!r} without a matcher in {expr!r}")
                after = toks[i + 2] if i + 2 < len(toks) else ("", "")
                if text == "__name__":
                    if nxt[1] != "=" or after[0] != "string":
                        raise ValueError(f'only __name__="..." is supported: {expr!r}')
                    found.metrics.add(after[1][1:-1])
                else:
                    found.selector_labels.add((selector, text))
            elif kind not in ("op", "string") and text != ",":
                raise ValueError(f"unexpected {text!r} inside {{...}} in {expr!r}")
            continue
        if top == "group":
            if text == ")":
                stack.pop()
            elif kind == "ident":
                found.grouping_labels.add(text)
            elif text != ",":
                raise ValueError(f"unexpected {text!r} in a label list in {expr!r}")
            continue
        if text == "{":
            selector = prev[1] if prev[0] == "ident" and prev[1] in found.metrics else None
            stack.append("{")
        elif text == "[":
            stack.append("[")
        elif text == "(":
            grouping = prev[0] == "ident" and prev[1].lower() in GROUPING
            stack.append("group" if grouping else "(")
        elif text in ")]}":
            if not stack or stack.pop() != "(" or text != ")":
                raise ValueError(f"unbalanced {text!r} in {expr!r}")
        elif kind == "ident":
            word = text.lower()
            if word in KEYWORDS or word in NUMBER_WORDS:
                continue
            if nxt[1] == "(":
                if word not in FUNCTIONS and word not in AGGREGATIONS:
                    raise ValueError(f"unknown function {text!r} in {expr!r}")
                continue
            if word in AGGREGATIONS and nxt[1].lower() in ("by", "without"):
                continue  # `sum by (x) (...)`
            found.metrics.add(text)
    if stack:
        raise ValueError(f"unclosed {stack[-1]!r} in {expr!r}")
    return found


def metric_names(expr: str) -> set[str]:
    return refs(expr).metrics


def families(exposition: str) -> dict[str, str]:
    """{family name: type} from the `# TYPE` lines of a Prometheus text exposition."""
    out = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out[name] = kind.strip()
    return out


def family(name: str, declared: dict[str, str]) -> str | None:
    """The declared family a series name belongs to, or None if it is none of them."""
    if name in declared:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and declared.get(base) in ("histogram", "summary", "gaugehistogram"):
            if suffix == "_bucket" and declared[base] == "summary":
                return None  # summaries have no buckets
            return base
    return None


# Labels that Prometheus attaches to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})


def label_scope(r: Refs, declared: dict[str, str], labels: dict[str, frozenset[str]]) -> set[str]:
    """Every label a series of the expression's metrics can carry (`le` for buckets)."""
    scope = set(TARGET_LABELS)
    for name in r.metrics:
        fam = family(name, declared)
        if fam is not None:
            scope |= labels.get(fam, frozenset())
            if name.endswith("_bucket"):
                scope.add("le")
    return scope


def problems(
    expr: str, declared: dict[str, str], labels: dict[str, frozenset[str]] | None = None
) -> list[str]:
    """What is wrong with the names in `expr`: a metric none of `declared` (a family, or a
    histogram's series), and with `labels` ({family: label names}) a label in a selector that its
    metric lacks, or in a by/on/... list that none of the expression's metrics has."""
    r = refs(expr)
    out = [f"{n}: no such metric" for n in sorted(r.metrics) if family(n, declared) is None]
    if labels is None:
        return out
    scope = label_scope(r, declared, labels)
    for metric, label in sorted(r.selector_labels, key=lambda x: (x[0] or "", x[1])):
        fam = family(metric, declared) if metric is not None else None
        if metric is None:
            known = scope
        elif fam is None:
            continue  # reported above
        else:
            known = set(labels.get(fam, frozenset())) | TARGET_LABELS
            if metric.endswith("_bucket"):
                known.add("le")
        if label not in known:
            out.append(f"{metric or '{...}'}: no label {label!r}")
    out += [f"no metric here has label {g!r}" for g in sorted(r.grouping_labels - scope)]
    return out
