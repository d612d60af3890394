"""A run's log (log.jsonl) read back, and the line plots train.py and bench.py draw: loss against tokens or
seconds, one line per run, with a target loss and where each line first reaches it."""

import json
from pathlib import Path

def read_log(log_path: Path) -> list[dict]:
    """log.jsonl's rows; a row for a step that was logged again later (a run resumed from an
    earlier checkpoint) keeps only its latest version."""
    rows = {}
    for number, line in enumerate(log_path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{log_path}: line {number} is not a JSON row ({e}): the file was cut off; delete "
                             f"that line (or the run's folder) and run again") from None
        rows[(row["step"], "val_loss" in row)] = row
    return sorted(rows.values(), key=lambda r: (r["step"], "val_loss" in r))


def line_figure(series: dict, xlabel: str, ylabel: str, title: str, target: float | None = None):
    """The figure plot_lines saves: one line per entry of series, {label: (xs, ys, matplotlib format)},
    each in a colour of its own unless its format names one, the legend beside the axes (never over
    the curves). target: a dotted horizontal line at that loss, and a dot where each line first
    reaches it (its crossing, linearly interpolated between the points either side)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(series)
    colours = plt.get_cmap("tab10" if n <= 10 else "tab20")(range(n)) if n <= 20 else \
        plt.get_cmap("turbo")([i / max(1, n - 1) for i in range(n)])
    fig, ax = plt.subplots(figsize=(9 + (2 if n > 6 else 0), 4.5))
    for (label, (xs, ys, style)), colour in zip(series.items(), colours):
        named = any(c in style for c in "bgrcmykw") or "C" in style  # the caller chose this line's colour
        line, = ax.plot(xs, ys, style, label=label, lw=1, **({} if named else {"color": colour}))
        crossing = first_crossing(list(xs), list(ys), target) if target is not None else None
        if crossing is not None:
            ax.plot(*crossing, "o", ms=4, color=line.get_color())
    if target is not None:
        ax.axhline(target, color="0.3", ls=":", lw=1, label=f"target {target:.4f}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=9, x=0.01, ha="left")  # over the whole figure: a long title stays whole beside the legend
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def first_crossing(xs: list, ys: list, target: float) -> tuple[float, float] | None:
    """(x, target) where ys first falls to target, interpolated; None when it never does."""
    for i, y in enumerate(ys):
        if y <= target:
            if i == 0:
                return xs[0], target
            f = (ys[i - 1] - target) / (ys[i - 1] - y)
            return xs[i - 1] + f * (xs[i] - xs[i - 1]), target
    return None


def plot_lines(series: dict, xlabel: str, ylabel: str, title: str, out: Path, target: float | None = None):
    """line_figure, written to out as PNG."""
    import matplotlib.pyplot as plt
    fig = line_figure(series, xlabel, ylabel, title, target)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_losses(log_path: Path, out: Path, title: str):
    rows = read_log(log_path)
    series = {}
    for label, key, style in (("train", "loss", "-"), ("val", "val_loss", "o-")):
        points = [(r["tokens"], r[key]) for r in rows if key in r]
        if points:
            series[label] = (*zip(*points), style)
    plot_lines(series, "tokens", "loss (nats)", title, out)
