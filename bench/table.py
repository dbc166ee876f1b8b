"""text_table: the benchmarks' plain-text tables (throughput, perplexity, compare), in one
place: a header, a rule of dashes, then the rows, columns two spaces apart, each as wide as
its widest cell, left-aligned where named, right-aligned (numbers) elsewhere."""

from __future__ import annotations


def text_table(head: list[str], rows: list[list[str]], left: set[int]) -> str:
    """head and rows of cells (strings); left: the indexes of left-aligned columns."""
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])
