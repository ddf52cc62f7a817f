"""README's figures are today's figures: every one it quotes is in docs/results.md, verbatim.

docs/results.md is the current answer (one screen per system, at most 400 lines); the history
behind it lives in docs/journal/, and every journal link in results.md must resolve.

A figure is a number with a unit in README's prose (code blocks and inline code skipped):
``%``, ``ms``, ``s``, ``×`` / ``x`` right after the number, ``points`` / ``-point`` / ``pts``; a
bracketed interval ``[+0.48, +2.52]``; a test statistic ``z = 2.07`` / ``p = 0.019``. A leading
``~`` is not part of the figure. The one typographic difference allowed is a space before ``%``
("98.6 %" in results.md is README's "98.6%"). Sizes (GB) and counts without a unit are not checked:
README quotes those from docs/operations.md, not from results.md.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
MAX_LINES = 400

_NUM = r"[+\-−]?\d[\d,]*(?:\.\d+)?"
_FIGURE = re.compile(
    "|".join((
        r"\[" + _NUM + r", " + _NUM + r"\]",  # an interval
        r"\b[zp] = " + _NUM,  # a test statistic
        _NUM + r"(?: ?%|×|x\b| ms\b| s\b|[- ]points?\b| pts\b)",  # a number with its unit
    ))
)


def prose(markdown: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", markdown, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def normalise(text: str) -> str:
    """One spelling per figure: no space (plain or narrow no-break) between a number and ``%``."""
    return re.sub(r"(\d)[ \u202f\u00a0]%", r"\1%", text)


def figures(markdown: str) -> list[str]:
    """Every figure in ``markdown``'s prose, in order, without repeats."""
    found = (m.group(0) for m in _FIGURE.finditer(normalise(prose(markdown))))
    return list(dict.fromkeys(f for f in found))


def contains_figure(text: str, figure: str) -> bool:
    """``figure`` occurs in ``text`` as a whole figure: "5%" is not found inside "85%" or "0.5%"."""
    pattern = r"(?<![\d.,])" + re.escape(figure) + (r"(?![\d])" if figure[-1].isdigit() else "")
    return re.search(pattern, normalise(text)) is not None


def missing_figures(readme: str, results: str) -> list[str]:
    return [f for f in figures(readme) if not contains_figure(results, f)]


def journal_links(results: str) -> list[str]:
    return re.findall(r"\]\((journal/[^)#\s]+\.md)(?:#[^)]*)?\)", results)


# -- the helpers, on small strings: the check can fail ---------------------------------------------

def test_figures_finds_units_intervals_and_statistics_outside_code():
    text = (
        "It took **158 s** (~27 s of it set-up); 80.6% held-out, +1.50 points [+0.48, +2.52],\n"
        "1.32× faster, 2x less, a ~5-point gain, z = 2.07, p = 0.019, p99 2.94 ms, 98.6 % pooled.\n"
        "`make demo --minutes 10 s` and\n```\nfleetloop demo  # 99% of 12 s\n```\n"
        "Python 3.11, torch 2.13.0, 16 robots.\n"
    )
    assert figures(text) == [
        "158 s", "27 s", "80.6%", "+1.50 points", "[+0.48, +2.52]", "1.32×", "2x", "5-point",
        "z = 2.07", "p = 0.019", "2.94 ms", "98.6%",
    ]


def test_a_figure_must_match_whole_not_inside_another_number():
    assert contains_figure("FERT 98.6 % against 97.1 %", "98.6%")
    assert not contains_figure("at 85%", "5%")
    assert not contains_figure("at 0.5%", "5%")
    assert not contains_figure("+1.50 points", "+1.5 points")
    assert not contains_figure("p = 0.0190", "p = 0.019")
    assert missing_figures("rose from 74% to 97.8%", "from 74.3% to 97.8 %") == ["74%"]


def test_journal_links_are_found():
    text = "see [journal](journal/2026-12-04-a.md) and [x](journal/b.md#part) not (journal/c.md)"
    assert journal_links(text) == ["journal/2026-12-04-a.md", "journal/b.md"]


# -- the documents ---------------------------------------------------------------------------------

def test_every_figure_readme_quotes_is_in_results_md():
    readme, results = README.read_text(), RESULTS.read_text()
    assert figures(readme), "no figure found in README.md: the extraction is broken"
    missing = missing_figures(readme, results)
    assert not missing, (
        "README.md quotes figures that docs/results.md does not hold verbatim: "
        + ", ".join(repr(f) for f in missing)
        + ". Put each into the right results.md table (verbatim from the run's text) "
        "or quote the figure results.md has."
    )


def test_results_md_is_one_screen_per_system():
    n = len(RESULTS.read_text().splitlines())
    assert n <= MAX_LINES, (
        f"docs/results.md has {n} lines (at most {MAX_LINES}): move history and superseded runs "
        "to docs/journal/ and link them"
    )


def test_every_journal_link_in_results_md_resolves():
    links = journal_links(RESULTS.read_text())
    assert links, "docs/results.md links no journal file"
    broken = [link for link in links if not (RESULTS.parent / link).is_file()]
    assert not broken, f"docs/results.md links journal files that do not exist: {broken}"
