"""McNemar's test on two models' per-example outcomes, as in the authors' rebuttal.

"For each configuration, we aggregated the outputs from all tasks into a sequence of 1s (correct)
and 0s (incorrect), paired with the outputs of traditional MoE, and performed a McNemar test."

Examples are paired by (task, doc_id) over the tasks both runs have. With A's and B's outcomes,
b = #(A correct, B wrong) and c = #(A wrong, B correct); only these discordant pairs matter.
Three p-values are reported (all two-sided):

  exact     binomial test of b ~ Binomial(b + c, 1/2)             (the default)
  chi2-cc   (|b - c| - 1)^2 / (b + c) ~ chi-square(1), Edwards' continuity correction
  chi2      (b - c)^2 / (b + c) ~ chi-square(1)

The exact test is valid at every sample size and is statsmodels' default (``mcnemar(exact=True)``),
so it is the default here; ``auto`` applies the textbook rule (exact when b + c < 25, else chi2-cc).
Pure Python: math.comb-style integer arithmetic and math.erfc.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TESTS = ("exact", "chi2-cc", "chi2", "auto")
AUTO_EXACT_BELOW = 25

Outcomes = dict[str, dict[int, int]]  # task -> doc_id -> 1 (correct) / 0


class PairingError(ValueError):
    """The two runs' outcomes cannot be paired (different examples, no common task, bad files)."""


def exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: 2 * P(X <= min(b, c)), X ~ Binomial(b + c, 1/2), capped at 1."""
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    term, tail = 1, 1  # C(n, 0); the binomial coefficients are summed exactly, as integers
    for i in range(k):
        term = term * (n - i) // (i + 1)
        tail += term
    return min(1.0, (2 * tail) / (1 << n))  # int / int: correctly rounded, 0.0 on underflow


def chi2_p(b: int, c: int, continuity: bool = True) -> tuple[float, float]:
    """(statistic, p) of McNemar's chi-square test, 1 degree of freedom."""
    n = b + c
    if n == 0:
        return 0.0, 1.0
    diff = abs(b - c)
    if continuity:
        diff = max(diff - 1, 0)  # the correction never flips the sign of |b - c|
    stat = diff * diff / n
    return stat, math.erfc(math.sqrt(stat / 2))  # chi-square(1) survival function


@dataclass(frozen=True)
class McNemarResult:
    b: int  # A correct, B wrong
    c: int  # A wrong, B correct
    both_correct: int
    both_wrong: int
    p_exact: float
    chi2: float
    p_chi2: float
    chi2_cc: float
    p_chi2_cc: float
    test: str  # the test behind p_value

    @property
    def n(self) -> int:
        return self.b + self.c + self.both_correct + self.both_wrong

    @property
    def p_value(self) -> float:
        return {"exact": self.p_exact, "chi2": self.p_chi2, "chi2-cc": self.p_chi2_cc}[self.test]

    @property
    def acc_a(self) -> float:
        return (self.both_correct + self.b) / self.n if self.n else float("nan")

    @property
    def acc_b(self) -> float:
        return (self.both_correct + self.c) / self.n if self.n else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "n": self.n, "p_value": self.p_value, "acc_a": self.acc_a,
                "acc_b": self.acc_b}


def mcnemar(b: int, c: int, both_correct: int = 0, both_wrong: int = 0,
            test: str = "exact") -> McNemarResult:
    """McNemar's test on the 2x2 table [[both_correct, b], [c, both_wrong]] (rows: A, cols: B)."""
    if test not in TESTS:
        raise ValueError(f"test must be one of {TESTS}, not {test!r}")
    if min(b, c, both_correct, both_wrong) < 0:
        raise ValueError("table counts must be non-negative")
    if test == "auto":
        test = "exact" if b + c < AUTO_EXACT_BELOW else "chi2-cc"
    chi2, p_chi2 = chi2_p(b, c, continuity=False)
    chi2_cc, p_chi2_cc = chi2_p(b, c, continuity=True)
    return McNemarResult(b=b, c=c, both_correct=both_correct, both_wrong=both_wrong,
                         p_exact=exact_p(b, c), chi2=chi2, p_chi2=p_chi2, chi2_cc=chi2_cc,
                         p_chi2_cc=p_chi2_cc, test=test)


def _sample_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / "samples").is_dir():  # an output directory of aoe-evaluate
        path = path / "samples"
    if not path.is_dir():
        raise PairingError(f"{path} does not exist")
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise PairingError(f"no per-example files (*.jsonl) in {path}")
    return files


def load_outcomes(path: str | Path) -> Outcomes:
    """Per-example outcomes from an evaluate.py output directory, its samples/ or one .jsonl file."""
    out: Outcomes = {}
    for f in _sample_files(Path(path)):
        with open(f, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    task, doc_id, correct = str(rec["task"]), int(rec["doc_id"]), int(rec["correct"])
                except (ValueError, KeyError, TypeError) as err:
                    raise PairingError(f"{f}:{lineno}: not a per-example record ({err})") from None
                if correct not in (0, 1):
                    raise PairingError(f"{f}:{lineno}: correct must be 0 or 1, not {correct}")
                docs = out.setdefault(task, {})
                if doc_id in docs:
                    raise PairingError(f"{f}:{lineno}: duplicate example ({task}, {doc_id})")
                docs[doc_id] = correct
    return out


def paired_counts(a: dict[int, int], b: dict[int, int]) -> tuple[int, int, int, int]:
    """(both_correct, b, c, both_wrong) over the same examples."""
    counts = [0, 0, 0, 0]
    for doc_id, x in a.items():
        y = b[doc_id]
        counts[(1 - x) * 2 + (1 - y)] += 1  # (1,1) (1,0) (0,1) (0,0)
    return counts[0], counts[1], counts[2], counts[3]


def compare(a: Outcomes, b: Outcomes, tasks: list[str] | None = None,
            test: str = "exact") -> dict[str, Any]:
    """McNemar's test of A against B over all tasks both have (or ``tasks``), pooled."""
    common = sorted(set(a) & set(b))
    if tasks:
        absent = [t for t in tasks if t not in common]
        if absent:
            raise PairingError(f"task(s) not in both runs: {', '.join(absent)}")
        common = [t for t in common if t in tasks]
    if not common:
        raise PairingError(f"no task in common (A: {sorted(a)}, B: {sorted(b)})")
    per_task = {}
    total = [0, 0, 0, 0]
    for t in common:
        if a[t].keys() != b[t].keys():
            only_a, only_b = sorted(a[t].keys() - b[t].keys()), sorted(b[t].keys() - a[t].keys())
            raise PairingError(
                f"{t}: the runs scored different examples ({len(a[t])} vs {len(b[t])}; "
                f"only in A: {only_a[:5]}{'...' if len(only_a) > 5 else ''}, "
                f"only in B: {only_b[:5]}{'...' if len(only_b) > 5 else ''}); "
                "were they run with the same data and --limit?")
        counts = paired_counts(a[t], b[t])
        total = [x + y for x, y in zip(total, counts)]
        r = mcnemar(counts[1], counts[2], counts[0], counts[3], test=test)
        per_task[t] = {k: r.to_dict()[k] for k in ("n", "b", "c", "acc_a", "acc_b", "p_value")}
    pooled = mcnemar(total[1], total[2], total[0], total[3], test=test)
    return {
        "tasks": common,
        "skipped": {"only_a": sorted(set(a) - set(b)), "only_b": sorted(set(b) - set(a))},
        "pooled": pooled.to_dict(),
        "per_task": per_task,
    }


def compare_runs(a_path: str | Path, b_path: str | Path, tasks: list[str] | None = None,
                 test: str = "exact") -> dict[str, Any]:
    report = compare(load_outcomes(a_path), load_outcomes(b_path), tasks=tasks, test=test)
    return {"a": str(a_path), "b": str(b_path), **report}


def format_report(report: dict[str, Any]) -> str:
    p = report["pooled"]
    lines = [
        f"A: {report['a']}",
        f"B: {report['b']}",
        f"tasks ({len(report['tasks'])}): {', '.join(report['tasks'])}",
    ]
    for side, key in (("A", "only_a"), ("B", "only_b")):
        if report["skipped"][key]:
            lines.append(f"  skipped, only in {side}: {', '.join(report['skipped'][key])}")
    lines += [
        f"paired examples: n = {p['n']}",
        f"{'':12}{'B correct':>12}{'B wrong':>12}",
        f"{'A correct':12}{p['both_correct']:>12}{p['b']:>12}",
        f"{'A wrong':12}{p['c']:>12}{p['both_wrong']:>12}",
        f"accuracy: A {100 * p['acc_a']:.2f}%, B {100 * p['acc_b']:.2f}%",
        f"b (A right, B wrong) = {p['b']}, c (A wrong, B right) = {p['c']}",
        f"exact binomial, two-sided:         p = {p['p_exact']:.4g}",
        f"chi-square with continuity corr.:  X2 = {p['chi2_cc']:.4f}, p = {p['p_chi2_cc']:.4g}",
        f"chi-square without correction:     X2 = {p['chi2']:.4f}, p = {p['p_chi2']:.4g}",
        f"McNemar p-value ({p['test']}): {p['p_value']:.4g}",
    ]
    return "\n".join(lines)
